"""Writes the README's summary of the headline results, from the benchmarks' own output.

    python benchmarks/update_readme.py

README.md holds blocks delimited by ``<!-- results:NAME -->`` and
``<!-- /results:NAME -->``. ``summary`` is the table of headline numbers read
from ``benchmarks/results/*.json`` (the files the benchmark scripts write); any
other NAME is replaced by ``benchmarks/results/NAME.md`` as the benchmark wrote
it. The full tables are pages of the docs site (``docs/``, Results), generated
from the same files. No number in those blocks is typed by hand.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))

import _conv_report  # noqa: E402  pylint: disable=wrong-import-position
import _shift_report  # noqa: E402  pylint: disable=wrong-import-position


def _load(name: str) -> dict | None:
  path = RESULTS / f"{name}.json"
  return json.loads(path.read_text()) if path.exists() else None


def _commit_in_md(name: str) -> str:
  """The commit a benchmark's markdown says it ran at ('?' if it says none)."""
  path = RESULTS / f"{name}.md"
  match = re.search(r"commit ([0-9a-f]{7,})", path.read_text()) if path.exists() else None
  return match.group(1) if match else "?"


# The summary's columns: what was measured, on what, one number per optimizer, the source.
HEAD = ["| measured | setting | 1-bit Adam | 0/1 Adam | results (commit) |",
        "|---|---|---|---|---|"]
NONE = "–"  # not measured by that benchmark


def _row(measured: str, setting: str, onebit: str, zero_one: str, source: str) -> str:
  return f"| {measured} | {setting} | {onebit} | {zero_one} | {source} |"


def _convergence_rows(link) -> list[str]:
  """Per task: the final validation loss against AdamW's, then the bytes against AdamW's.

  0/1 Adam's numbers come from the same convergence.json when its run evaluated 0/1
  Adam (the full protocol), else from convergence_zero_one.json.
  """
  data = _load("convergence")
  if data is None:
    return []
  zero_one_stem = "convergence"
  if not any("zero_one" in t.get("eval", {}) for t in data["tasks"]):
    zero_one_stem = "convergence_zero_one"
  zero_one_data = _load(zero_one_stem) or {"tasks": []}
  zero_one_eval = {t["title"]: t["eval"] for t in zero_one_data["tasks"] if "zero_one" in t["eval"]}
  mean_bytes = lambda recs: sum(r["total_bytes"] for r in recs) / len(recs)
  loss_rows, byte_rows = [], []
  for task in data["tasks"]:
    ev, name = task["eval"], task["title"].split(":")[0]
    paired = _conv_report.paired_stats(ev["onebit"], ev["adamw"])
    adamw_bytes = task["allreduce_bytes_per_step"] * task["steps"]
    onebit_loss = f"{paired['mean']:+.2f}% (s.e. {paired['se']:.2f}%)"
    onebit_bytes = f"{adamw_bytes / mean_bytes(ev['onebit']):.1f}x fewer"
    zero_one_loss = zero_one_bytes = NONE
    source = f"{link('convergence')} ({data['meta']['git']})"
    zev = zero_one_eval.get(task["title"])
    if zev is not None:
      zpaired = _conv_report.paired_stats(zev["zero_one"], zev["adamw"])
      zero_one_loss = f"{zpaired['mean']:+.2f}% (s.e. {zpaired['se']:.2f}%)"
      zero_one_bytes = f"{mean_bytes(zev['adamw']) / mean_bytes(zev['zero_one']):.1f}x fewer"
      if zero_one_stem != "convergence":
        source += f", {link(zero_one_stem)} ({zero_one_data['meta']['git']})"
    setting = f"{name}, {task['steps']} steps, {task['devices']} devices"
    loss_rows.append(_row(
        "final validation loss vs tuned AdamW (paired mean)",
        f"{name}, {task['params']:,} parameters, {task['steps']} steps, {task['devices']} "
        f"devices, {paired['n']} fresh seeds", onebit_loss, zero_one_loss, source))
    byte_rows.append(_row("bytes sent vs AdamW", setting, onebit_bytes, zero_one_bytes, source))
  return loss_rows + byte_rows


def _shift_rows(link) -> list[str]:
  """The gap to AdamW after the data shift (benchmarks/data_shift.py), one row per variant."""
  data = _load("data_shift")
  if data is None:
    return []
  summ = _shift_report.summary(data)
  if "onebit" not in summ:
    return []
  gap = lambda kind: (f"{summ[kind]['after_ms'][0]:+.2f}% (s.e. {summ[kind]['after_ms'][1]:.2f}%)"
                      if kind in summ else NONE)
  cfg, commits = data["config"], sorted({i["git"] for i in data["meta"].get("invocations", [])})
  setting = (f"char GPT, {cfg['steps']} steps (shift at {cfg['steps'] // 2}), "
             f"{cfg['devices']} devices, {summ['onebit']['after_ms'][2]} seeds")
  source = f"{link('data_shift')} ({', '.join(commits) or data['meta']['git']})"
  return [
      _row("gap to AdamW after a data shift (prose, then Python source)", setting,
           gap("onebit"), gap("zero_one"), source),
      _row("the same, with a new optimizer state at the shift", setting, gap("onebit_restart"),
           NONE, source),
      _row("the same, with `variance_ema='per_step'`", setting, NONE, gap("zero_one_step"),
           source)]


def _zero_one_throughput() -> dict[str, str]:
  """0/1 Adam's steps/s x Adam's, by kind of step, as comm_throughput_zero_one.md states it."""
  path = RESULTS / "comm_throughput_zero_one.md"
  line = re.search(r"^- 0/1 Adam, .*steps/s by phase \(x Adam\): (.*)$",
                   path.read_text(), flags=re.M) if path.exists() else None
  return dict(re.findall(r"(\w+) [\d.]+ \(([\d.]+x)\)", line.group(1))) if line else {}


def _throughput_rows(link) -> list[str]:
  """Steps/s against Adam's: 1 Gbit/s from the run that measured both optimizers, the other
  link rates from the rates run (1-bit Adam only)."""
  rows = []
  both = _load("comm_throughput_zero_one")
  zero_one = _zero_one_throughput()
  if both is not None:
    run = both["runs"][0]
    s = run["summary"]
    setting = (f"{run['num_ranks'] if 'num_ranks' in run else both['args']['ranks']} CPU "
               f"processes, 25.6M parameters, {run['short_label']} links")
    source = f"{link('comm_throughput_zero_one')} ({both['commit']})"
    rows.append(_row("steps/s vs `optax.adam` + `pmean`, compressed steps", setting,
                     f"{s['adam']['step_s'] / s['onebit_compression']['step_s']:.2f}x",
                     zero_one.get("compressed", NONE), source))
    rows.append(_row("steps/s vs `optax.adam` + `pmean`, float32 steps (warmup, variance)",
                     setting, f"{s['adam']['step_s'] / s['onebit_warmup']['step_s']:.2f}x",
                     zero_one.get("variance", NONE), source))
  data = _load("comm_throughput_rates")
  for run in (data or {"runs": []})["runs"]:
    if both is not None and run["short_label"] == both["runs"][0]["short_label"]:
      continue  # measured above, on newer code, beside 0/1 Adam
    s = run["summary"]
    rows.append(_row(
        "steps/s vs `optax.adam` + `pmean`, compressed steps",
        f"{run['num_ranks']} CPU processes, {run['num_params'] / 1e6:.1f}M parameters, "
        f"{run['short_label']} links",
        f"{s['adam']['step_s'] / s['onebit_compression']['step_s']:.2f}x", NONE,
        f"{link('comm_throughput_rates')} ({_commit_in_md('comm_throughput_rates')})"))
  return rows


def _compute_rows(link) -> list[str]:
  """Both optimizers' compressed steps at 10M, from one zero_one_compute run (side by side):
  the 6-leaf tree, then 300 leaves in 20 shapes (``--leaves 300``, zero_one_compute_leaves)."""
  rows = []
  for name, tree in (("zero_one_compute", ""), ("zero_one_compute_leaves", " in 300 leaves")):
    data = _load(name)
    for run in (data or {}).get("runs", []):
      if run["size"] != 10_000_000 or (tree and run["setting"] != "single"):
        continue  # (300 leaves: one device, where they cost most; the mesh row is in the file)
      where = "one device" if run["setting"] == "single" else "2-device mesh, per device"
      onebit = run["median_s"]["1-bit compression"] / run["median_s"]["adam"]
      rows.append(_row("optimizer step time vs `optax.adam`, compressed steps",
                       f"{where}, 10M parameters{tree}, CPU", f"{onebit:.2f}x",
                       _zero_one_compute(data, run["setting"], run["size"]),
                       f"{link(name)} ({data['commit']})"))
  return rows


def _zero_one_compute(data, setting: str, size: int) -> str:
  """0/1 Adam's compressed step (and sync) / Adam's, as zero_one_compute measured them."""
  for run in (data or {}).get("runs", []):
    if run["setting"] == setting and run["size"] == size:
      med = run["median_s"]
      ratio = lambda kind: med[f"0/1 {kind}"] / med["adam"]
      local = (f", with local steps {ratio('local sync'):.2f}x" if "0/1 local sync" in med else "")
      return f"{ratio('compressed'):.2f}x (sync {ratio('sync'):.2f}x{local})"
  return NONE


def _compile_rows(link) -> list[str]:
  data = _load("compile_time")
  if data is None:
    return []
  row = [r for r in data["rows"] if "ratio" in r][-1]  # (the last timed row; not --restart's)
  zero_one = row.get("zero_one_ratio")
  shapes = f" of {row['shapes']} shapes" if row.get("shapes") else " of one shape"
  return [_row("compile time vs `optax.adam` + `pmean`",
               f"8 devices, {row['leaves']} leaves{shapes}",
               f"{row['ratio']:.1f}x", NONE if zero_one is None else f"{zero_one:.1f}x",
               f"{link('compile_time')} ({data['runs'][row['run'] - 1]['commit']})")]


def summary(link: Callable[[str], str] | None = None) -> str:
  """The headline table; ``link(name)`` renders a reference to results file ``name``."""
  if link is None:
    link = lambda name: f"[{name}](benchmarks/results/{name}.md)"
  rows = (_convergence_rows(link) + _shift_rows(link) + _throughput_rows(link) + _compute_rows(link)
          + _compile_rows(link))
  if not rows:
    return "_No results yet: run the benchmarks (benchmarks/*.py)._"
  return "\n".join(HEAD + rows)


def _block(name: str) -> str:
  if name == "summary":
    return summary()
  md = RESULTS / f"{name}.md"
  if not md.exists():
    return f"_Not generated yet: run the benchmark that writes `benchmarks/results/{name}.md`._"
  return md.read_text().strip()


def main() -> int:
  readme = ROOT / "README.md"
  text = readme.read_text()
  names = re.findall(r"<!-- results:([\w.-]+) -->", text)
  for name in names:
    pattern = re.compile(
        rf"(<!-- results:{re.escape(name)} -->).*?(<!-- /results:{re.escape(name)} -->)", re.S)
    text = pattern.sub(lambda m: m.group(1) + "\n" + _block(name) + "\n" + m.group(2), text)
  readme.write_text(text)
  print(f"updated {len(names)} result blocks in README.md: {', '.join(names)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
