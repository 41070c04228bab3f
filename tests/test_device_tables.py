"""benchmarks/device_tables.py, the prepared run for a lent GPU, runs on a CPU at tiny sizes: its
tables have every contestant, and the memory columns read what the states hold. Also the ZeRO-1
warmup lab. Marked slow: CI's full run (`-m ''`) runs them."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import _xla

ROOT = Path(__file__).resolve().parents[1]

# Benchmark scripts, not the package: about 40 s of compiling in subprocesses, so only in the
# full run (`python3 dev.py test -m ''`, as CI's first run).
pytestmark = pytest.mark.slow


def _rows(text: str, title: str) -> dict:
  """name -> the cells of the markdown table that follows the line starting with ``title``."""
  block = text.split(title, 1)[1].split("\n\n", 2)[1]
  rows = [line.strip("|").split("|") for line in block.splitlines()[2:]]
  return {r[0].strip(): [c.strip() for c in r[1:]] for r in rows}


def test_device_tables_on_a_cpu(tmp_path):
  out = tmp_path / "tables.md"
  env = {**os.environ, "XLA_FLAGS": _xla.flags()}  # one device, the session's codegen flags
  subprocess.run([sys.executable, str(ROOT / "benchmarks" / "device_tables.py"), "--sizes", "1e4",
                  "--leaves", "2", "--leaves-size", "0", "--repeats", "2", "--out", str(out)],
                 check=True, env=env, cwd=ROOT, capture_output=True, timeout=600)
  text = out.read_text()
  assert re.search(r"device cpu", text)
  compiled = _rows(text, "**Compile**")
  assert set(compiled) == {"adam", "onebit", "zero_one"} and compiled["adam"][1] == "1.00"
  steps = _rows(text, "**Step, 10,000 parameters, the 6-leaf")
  assert list(steps) == ["adam", "1-bit warmup", "1-bit compression", "0/1 variance",
                         "0/1 compressed", "0/1 local", "0/1 sync", "0/1 local sync", "adam again"]
  state = {name: float(cells[3]) for name, cells in steps.items()}
  # optax.adam holds mu and nu; both optimizers add one per-device buffer (one device: no
  # server error) and the message; 0/1 Adam's local steps add each device's momentum and progress
  assert state["adam"] == 2.0
  assert all(3.0 < state[n] < 3.1 for n in ("1-bit warmup", "0/1 sync"))
  assert 5.0 < state["0/1 local"] < 5.1


def test_zero1_warmup_lab_matches_adam_with_half_the_state(tmp_path):
  """benchmarks/zero1_warmup_lab.py (issue 25, item 4's route, not the package): Adam with its
  moments sharded over a 2-device mesh gives optax.adam + pmean's parameters and holds 2 D/n."""
  out = tmp_path / "lab.md"
  env = {**os.environ, "XLA_FLAGS": _xla.flags()}  # one device, the session's codegen flags
  subprocess.run([sys.executable, str(ROOT / "benchmarks" / "zero1_warmup_lab.py"), "--size", "1e4",
                  "--repeats", "2", "--out", str(out)],
                 check=True, env=env, cwd=ROOT, capture_output=True, timeout=600)
  text = out.read_text()
  assert float(re.search(r"after 3 steps[^:]*: ([0-9.e+-]+)\.", text).group(1)) < 1e-6
  rows = _rows(text, "Largest |zero1")
  assert [float(rows[n][2]) for n in ("adam + pmean", "zero1", "zero1, per group")] == [2.0, 1.0, 1.0]
