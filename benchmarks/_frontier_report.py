"""The report of benchmarks/frontier.py: tables, the bytes-loss figure, the time model, README's excerpt."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

import _conv_report
import _frontier_time

LEVEL = 1.0  # percent: "level with AdamW" when the paired mean + 2 s.e. stays below it.
TITLES = {"gpt": "char GPT, 136,960 parameters, 2000 steps",
          "mlm": "BERT-style MLM, 137,024 parameters, 600 steps"}


def _by(doc, task, phase):
  return [r for r in doc["runs"] if r["task"] == task and r["phase"] == phase]


def _mean_std(x) -> str:
  x = np.asarray(x, float)
  return f"{x.mean():.4f} ± {x.std(ddof=1):.4f}" if len(x) > 1 else f"{x.mean():.4f}"


ORDER = ("AdamW", "1-bit Adam", "0/1 Adam", "0/1 Adam, local steps")  # then DiLoCo by H


def _rank(label: str):
  if label in ORDER:
    return (ORDER.index(label), 0)
  return (len(ORDER), int(label.split("H=")[-1]) if "H=" in label else 0)


def contestants(doc, task) -> dict:
  """label -> its evaluation runs: AdamW, the package's optimizers, DiLoCo by H (a rerun keeps its row)."""
  out = {}
  for r in _by(doc, task, "eval"):
    out.setdefault(r["label"], []).append(r)
  return dict(sorted(out.items(), key=lambda item: _rank(item[0])))


def rows(doc, task) -> list[dict]:
  """One row per contestant: loss, paired difference to AdamW, bytes, rounds."""
  runs = contestants(doc, task)
  base = runs.get("AdamW")
  out = []
  for label, recs in runs.items():
    paired = _conv_report.paired_stats(recs, base) if base and label != "AdamW" else None
    val = np.asarray([r["final_val"] for r in recs])
    out.append(dict(label=label, recs=recs, n=len(recs), val=val, paired=paired,
                    mb=float(np.mean([r["total_bytes"] for r in recs])) / 1e6,
                    rounds=float(np.mean([r["rounds"] for r in recs])),
                    setting=_setting(recs[0])))
  return out


def _setting(rec) -> str:
  options = rec.get("options") or {}
  text = ", ".join(f"{k} {v}" for k, v in options.items() if k != "inner_steps")
  return f"lr {rec['lr']:g}" + (f"; {text}" if text else "")


def level(row) -> bool:
  """Level with AdamW: the paired mean + 2 s.e. is below +LEVEL%."""
  p = row["paired"]
  return p is not None and p["n"] > 1 and p["mean"] + 2 * p["se"] < LEVEL


def worse(row) -> bool:
  """Worse than AdamW: the paired mean - 2 s.e. is above +LEVEL%."""
  p = row["paired"]
  return p is not None and p["n"] > 1 and p["mean"] - 2 * p["se"] > LEVEL


def _listed(items, adamw) -> str:
  return ", ".join(f"{r['label']} ({r['paired']['mean']:+.1f}%, s.e. {r['paired']['se']:.1f}%; "
                   f"{adamw['mb'] / r['mb']:.0f}x fewer bytes)" for r in items)


def _selection_md(doc, task) -> list[str]:
  """The selection runs, the chosen setting marked, and said when it is the edge of what was tried."""
  chosen = {r["label"]: _setting(r) for r in _by(doc, task, "eval")}
  out = ["| contestant | setting | selection seeds | mean final val. loss | chosen |",
         "|---|---|---|---|---|"]
  groups = {}
  for r in _by(doc, task, "select"):
    groups.setdefault((r["label"], _setting(r)), []).append(r)
  for (label, setting), recs in groups.items():
    mark = ""
    if chosen.get(label) == setting:
      tried = [r for (lab, _), rs in groups.items() if lab == label for r in rs]
      knob = (lambda r: r["options"]["outer_lr"]) if recs[0]["options"] else (lambda r: r["lr"])
      edge = knob(recs[0]) in (min(map(knob, tried)), max(map(knob, tried)))
      mark = "**chosen**" + (" (an edge of what was tried)" if edge else "")
    out.append(f"| {label} | {setting} | {len(recs)} | "
               f"{np.mean([r['final_val'] for r in recs]):.4f} | {mark} |")
  return out


def _eval_md(task_rows) -> list[str]:
  out = ["| contestant | setting | seeds | val. loss | vs AdamW (paired) | s.e. | MB sent per "
         "device | bytes vs AdamW | communication rounds |",
         "|---|---|---|---|---|---|---|---|---|"]
  adamw = next((r for r in task_rows if r["label"] == "AdamW"), None)
  for r in task_rows:
    p = r["paired"]
    diff = "–" if p is None else f"{p['mean']:+.2f} ± {p['std']:.2f}%"
    se = "–" if p is None else f"{p['se']:.2f}%"
    fewer = "1x" if adamw is None or r is adamw else f"{adamw['mb'] / r['mb']:.1f}x fewer"
    out.append(f"| {r['label']} | {r['setting']} | {r['n']} | {_mean_std(r['val'])} | {diff} | "
               f"{se} | {r['mb']:.1f} | {fewer} | {r['rounds']:.0f} |")
  return out


def plot(doc, tasks, path: Path) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, len(tasks), figsize=(6.5 * len(tasks), 4.8), squeeze=False)
  for ax, task in zip(axes[0], tasks):
    for r in rows(doc, task):
      if r["label"] == "AdamW":
        ax.axhline(r["val"].mean(), color="gray", ls=":", lw=1)
      se = r["val"].std(ddof=1) / math.sqrt(r["n"]) if r["n"] > 1 else 0.0
      ax.errorbar(r["mb"], r["val"].mean(), yerr=se, fmt="o", capsize=3)
      ax.annotate(r["label"], (r["mb"], r["val"].mean()), textcoords="offset points",
                  xytext=(4, 4), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("MB sent per device over the run (log)")
    ax.set_ylabel("final validation loss (nats), mean ± s.e.")
    ax.set_title(TITLES.get(task, task), fontsize=10)
    ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _header(doc) -> list[str]:
  out = []
  for inv in doc.get("invocations", []):
    out.append(f"- `{inv['command']}`: commit {inv['git']}, jax {inv['jax']}, optax {inv['optax']}, "
               f"{inv['machine']}; started {inv['started']}, {inv['wall_s'] / 60:.1f} min; load "
               f"(`uptime`) at start `{inv['uptime_start'].split('load average: ')[-1]}`, at end "
               f"`{inv['uptime_end'].split('load average: ')[-1]}`.")
  return out


def summary(doc, tasks) -> list[str]:
  """README's three sentences, written from the numbers (whatever they say)."""
  out = []
  for task in tasks:
    task_rows = [r for r in rows(doc, task) if r["label"] != "AdamW"]
    adamw = next((r for r in rows(doc, task) if r["label"] == "AdamW"), None)
    if adamw is None or not task_rows:
      continue
    fine = [r for r in task_rows if level(r)]
    best = min(fine, key=lambda r: r["mb"]) if fine else None
    text = f"On the {TITLES.get(task, task)} ({adamw['n']} fresh seeds), "
    if best is None:
      text += f"no contestant was shown level with tuned AdamW (paired mean + 2 s.e. < +{LEVEL:g}%)"
    else:
      p = best["paired"]
      text += (f"the fewest bytes at AdamW's loss (paired mean + 2 s.e. < +{LEVEL:g}%) were "
               f"{best['label']}'s: {adamw['mb'] / best['mb']:.0f}x fewer than AdamW, "
               f"{p['mean']:+.2f}% (s.e. {p['se']:.2f}%)")
    bad = [r for r in task_rows if worse(r)]
    open_ = [r for r in task_rows if r["paired"] and not level(r) and not worse(r)]
    if bad:
      text += "; worse (paired mean - 2 s.e. > +" + f"{LEVEL:g}%): " + _listed(bad, adamw)
    if open_:
      text += f"; not resolved at {adamw['n']} seeds: " + _listed(open_, adamw)
    out.append(text + ".")
  return out + _time_sentence(doc, tasks) + _shift_sentence()


def _shift_sentence(path: Path = Path(__file__).resolve().parent / "results" / "data_shift.json"
                    ) -> list[str]:
  """DiLoCo's gap to AdamW before and after the data shift, beside 1-bit Adam's (data_shift.py)."""
  if not path.exists():
    return []
  import _shift_report  # pylint: disable=g-import-not-at-top
  summ = _shift_report.summary(json.loads(path.read_text()))
  if "diloco" not in summ or "onebit" not in summ or not summ["diloco"]["after"]:
    return []
  gap = lambda kind, key: "{:+.2f}% (s.e. {:.2f}%)".format(*summ[kind][key][:2])
  return [f"Through the data shift (benchmarks/data_shift.py, {summ['diloco']['after_ms'][2]} "
          f"seeds), DiLoCo's gap to AdamW went from {gap('diloco', 'before_ms')} to "
          f"{gap('diloco', 'after_ms')}, 1-bit Adam's from {gap('onebit', 'before_ms')} to "
          f"{gap('onebit', 'after_ms')}."]


def _time_sentence(doc, tasks) -> list[str]:
  """Who reaches AdamW's loss first on a slow link, in the alpha-beta model with measured compute."""
  parts = []
  for task in tasks:
    for n in _frontier_time.WORKERS:
      for slack in _frontier_time.SLACKS:  # AdamW's loss; where nobody reaches it, 2% above
        won = _frontier_time.fastest(doc, task, rows, n, 1e8, slack)
        if won is not None:
          break
      if won is None:
        continue
      label, secs, adamw = won
      versus = f"AdamW {adamw:.0f} s" if adamw else "AdamW on no seed"
      within = f", to within {slack:.0%} of it" if slack else ""
      parts.append(f"{label} on the {task} with {n} workers{within} ({secs:.0f} s; {versus})")
  if not parts:
    return []
  return ["On 100 Mbit/s links (alpha-beta model, this machine's compute per step), the first "
          "to reach AdamW's final loss on every seed was " + "; ".join(parts) + "."]


def write(doc, stem: Path) -> None:
  tasks = [t for t in ("gpt", "mlm") if _by(doc, t, "eval")]
  md = ["# Bytes against loss: AdamW, 1-bit Adam, 0/1 Adam and DiLoCo", "",
        "Generated by `benchmarks/frontier.py` (protocol in its docstring) from "
        f"`{stem.name}.json`.", "", *_header(doc), ""]
  replaced = [r for r in doc.get("superseded", []) if "reason" not in r]
  if replaced:
    gone = sorted({(r["task"], r["label"], _setting(r)) for r in replaced})
    md += [f"Superseded: {len(replaced)} evaluation runs of settings that a later, "
           "wider selection replaced (kept in the json under `superseded`): "
           + "; ".join(f"{t} {label} ({setting})" for t, label, setting in gone) + ".", ""]
  rerun = [r for r in doc.get("superseded", []) if "reason" in r]
  if rerun:
    gone = sorted({(r["task"], r["label"], r["reason"]) for r in rerun})
    md += [f"Rerun: {len(rerun)} evaluation runs of code that has since changed (kept in the json "
           "under `superseded`, `--rerun`): "
           + "; ".join(f"{t} {label} ({reason})" for t, label, reason in gone) + ".", ""]
  for task in tasks:
    md += [f"## {TITLES.get(task, task)}", "", "Selection (AdamW's peak lr; DiLoCo's outer lr "
           "per H, at AdamW's lr):", "", *_selection_md(doc, task), "",
           "Evaluation (fresh seeds; paired: same-seed relative difference to AdamW, mean ± std; "
           "s.e. = std/sqrt(n)):", "", *_eval_md(rows(doc, task)), ""]
  md += _frontier_time.section(doc, tasks, rows, TITLES)
  md += ["## In short", "", *summary(doc, tasks), "", f"![frontier]({stem.name}.png)", ""]
  stem.with_suffix(".md").write_text("\n".join(md))
  Path(str(stem) + "_summary.md").write_text(" ".join(summary(doc, tasks)) + "\n")
  if tasks:
    plot(doc, tasks, stem.with_suffix(".png"))
  print(f"wrote {stem}.md, {stem}_summary.md, {stem}.png")


if __name__ == "__main__":
  import sys  # pylint: disable=g-import-not-at-top
  path = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/frontier.json")
  write(json.loads(path.read_text()), path.with_suffix(""))
