"""The table of the A/B on how comm_throughput.py reads 0/1 Adam's state between steps (issue 25, item 6).

Each run is ``comm_throughput.py --out-dir benchmarks/results/reads_ab --name NAME``, with
``--zo-read-each-step`` for the runs that read each step's phase on the host right after
it (the old way) and without it for the runs that copy it on the device and read it after
the run. This script prints, per run in the order given, the seconds per step of 1-bit
Adam's compression and of 0/1 Adam's compressed and sync steps (medians, as the reports
state them) and their ratios: same bytes and collectives, so a ratio above 1 is what the
0/1 run pays for something other than the wire.

    .venv/bin/python benchmarks/reads_ab.py old new new2 old2
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent / "results" / "reads_ab"


def row(name: str) -> str:
  data = json.loads((HERE / f"{name}.json").read_text())
  run = data["runs"][0]
  onebit = run["summary"]["onebit_compression"]["step_s"]
  adam = run["summary"]["adam"]["step_s"]
  phases = run["zero_one"]["phases"]
  comp, sync = phases["compressed"]["step_s"], phases["sync"]["step_s"]
  alone = data["compute"]["summary"]["adam"]["step_s"]
  reads = "host, each step" if data["args"].get("zo_read_each_step") else "device copy, after"
  return (f"| {name} | {reads} | {run['load']} | {alone:.3f} | {adam:.3f} | {onebit:.3f} | "
          f"{comp:.3f} | {sync:.3f} | {comp / onebit:.2f} | {sync / onebit:.2f} |")


def main(names: list[str]) -> None:
  print("| run | 0/1 reads | load before | Adam compute alone (s) | Adam (s) | 1-bit compression (s) "
        "| 0/1 compressed (s) | 0/1 sync (s) | compressed / 1-bit | sync / 1-bit |")
  print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
  for name in names:
    print(row(name))


if __name__ == "__main__":
  main(sys.argv[1:])
