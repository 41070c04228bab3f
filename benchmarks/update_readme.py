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


def _convergence_rows(link) -> list[str]:
  data = _load("convergence")
  if data is None:
    return []
  rows = []
  for task in data["tasks"]:
    ev = task["eval"]
    paired = _conv_report.paired_stats(ev["onebit"], ev["adamw"])
    sent = sum(r["total_bytes"] for r in ev["onebit"]) / len(ev["onebit"])
    base = task["allreduce_bytes_per_step"] * task["steps"]
    name = task["title"].split(":")[0]
    rows.append(
        f"| final validation loss vs tuned AdamW | {name}, {task['params']:,} parameters, "
        f"{task['steps']} steps, {task['devices']} devices, {paired['n']} fresh seeds | "
        f"{paired['mean']:+.2f}% (s.e. {paired['se']:.2f}%), {base / sent:.1f}x fewer bytes | "
        f"{link('convergence')} ({data['meta']['git']}) |")
  return rows + _zero_one_convergence_rows(link)


def _zero_one_convergence_rows(link) -> list[str]:
  """0/1 Adam (its chosen defaults) against AdamW and 1-bit Adam.

  From convergence.json when its run evaluated 0/1 Adam (the full protocol),
  else from convergence_zero_one.json (a ``--name convergence_zero_one`` run).
  """
  stem = "convergence"
  data = _load(stem)
  if data is None or not any("zero_one" in t.get("eval", {}) for t in data["tasks"]):
    stem = "convergence_zero_one"
    data = _load(stem)
  if data is None:
    return []
  rows = []
  for task in data["tasks"]:
    ev = task["eval"]
    if "zero_one" not in ev:
      continue
    paired = _conv_report.paired_stats(ev["zero_one"], ev["adamw"])
    mean = lambda recs: sum(r["total_bytes"] for r in recs) / len(recs)
    sent = mean(ev["zero_one"])
    rounds = sum(_conv_report.rounds(dict(r, allreduce_bytes=task["allreduce_bytes_per_step"]))[0]
                 for r in ev["zero_one"]) / len(ev["zero_one"])
    name = task["title"].split(":")[0]
    # No "N parameters" here: tests/test_docs.py matches the 1-bit rows by it.
    rows.append(
        f"| 0/1 Adam ({task['zero_one_chosen']}): final validation loss vs tuned AdamW | "
        f"{name}, {task['steps']} steps, {task['devices']} devices, {paired['n']} fresh seeds | "
        f"{paired['mean']:+.2f}% (s.e. {paired['se']:.2f}%), "
        f"{mean(ev['adamw']) / sent:.1f}x fewer bytes than AdamW, "
        f"{mean(ev['onebit']) / sent:.1f}x fewer than 1-bit Adam, {rounds:.0f} rounds of "
        f"{task['steps']} | {link(stem)} ({data['meta']['git']}) |")
  return rows


def _shift_rows(link) -> list[str]:
  """The gap to AdamW after the data shift, per optimizer (benchmarks/data_shift.py)."""
  data = _load("data_shift")
  if data is None:
    return []
  summ = _shift_report.summary(data)
  names = dict(onebit="frozen v", onebit_restart="new state at the shift",
               zero_one="0/1 Adam (DeepSpeed's EMA)", zero_one_step="0/1 Adam (per-step EMA)")
  cells = [f"{label} {summ[k]['after_ms'][0]:+.2f}% (s.e. {summ[k]['after_ms'][1]:.2f}%)"
           for k, label in names.items() if k in summ]
  if not cells or "onebit" not in summ:
    return []
  cfg, commits = data["config"], sorted({i["git"] for i in data["meta"].get("invocations", [])})
  # No "N parameters" here: tests/test_docs.py matches the 1-bit rows by it.
  return [f"| gap to AdamW after a data shift (prose, then Python source) | char GPT, "
          f"{cfg['steps']} steps (shift at "
          f"{cfg['steps'] // 2}), {cfg['devices']} devices, {summ['onebit']['after_ms'][2]} seeds | "
          f"before the shift {summ['onebit']['before_ms'][0]:+.2f}%; after: " + ", ".join(cells)
          + f" | {link('data_shift')} ({', '.join(commits) or data['meta']['git']}) |"]


def _throughput_rows(link) -> list[str]:
  data = _load("comm_throughput_rates")
  if data is None:
    return []
  rows = []
  for run in data["runs"]:
    s = run["summary"]
    compression = s["adam"]["step_s"] / s["onebit_compression"]["step_s"]
    warmup = s["adam"]["step_s"] / s["onebit_warmup"]["step_s"]
    rows.append(
        f"| steps/s vs `optax.adam` + `pmean` | {run['num_ranks']} CPU processes, "
        f"{run['num_params'] / 1e6:.1f}M parameters, {run['short_label']} links | "
        f"{compression:.2f}x after the freeze ({warmup:.2f}x in warmup) | "
        f"{link('comm_throughput_rates')} ({_commit_in_md('comm_throughput_rates')}) |")
  return rows


def _compute_rows(link) -> list[str]:
  data = _load("optimizer_compute")
  if data is None:
    return []
  last = max(r["run"] for r in data["rows"] if r["size"] == 10_000_000)
  rows = []
  for r in data["rows"]:
    if r["size"] == 10_000_000 and r["run"] == last:
      where = "one device" if r["setting"] == "single" else "2-device mesh, per device"
      rows.append(
          f"| optimizer step time vs `optax.adam` | {where}, 10M parameters, CPU | "
          f"{r['warmup_ratio']:.2f}x in warmup, {r['compression_ratio']:.2f}x after | "
          f"{link('optimizer_compute')} ({data['runs'][last - 1]['commit']}) |")
  return rows


def _compile_rows(link) -> list[str]:
  data = _load("compile_time")
  if data is None:
    return []
  row = data["rows"][-1]
  return [f"| compile time vs `optax.adam` + `pmean` | 8 devices, {row['leaves']} leaves | "
          f"{row['ratio']:.1f}x | {link('compile_time')} "
          f"({data['runs'][row['run'] - 1]['commit']}) |"]


def summary(link: Callable[[str], str] | None = None) -> str:
  """The headline table; ``link(name)`` renders a reference to results file ``name``."""
  if link is None:
    link = lambda name: f"[{name}](benchmarks/results/{name}.md)"
  rows = (_convergence_rows(link) + _shift_rows(link) + _throughput_rows(link) + _compute_rows(link)
          + _compile_rows(link))
  if not rows:
    return "_No results yet: run the benchmarks (benchmarks/*.py)._"
  head = ["| measured | setting | 1-bit Adam | results (commit) |", "|---|---|---|---|"]
  return "\n".join(head + rows)


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
