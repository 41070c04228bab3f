"""benchmarks/comm_throughput.py's 0/1 Adam bookkeeping (the benchmark itself needs root and
minutes; not run here): the schedule it times, the per-phase summary of the ranks' windows,
and the predicted bytes per phase."""

import sys
from pathlib import Path

import numpy as np
import pytest

from onebit_optax import _collective

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _comm_worker as worker  # noqa: E402
import comm_throughput as ct  # noqa: E402


def test_the_timed_schedule_has_every_phase_in_windows():
  """The default hyperparameters give each phase, with windows of several steps."""
  sched = worker.phase_schedule(worker.ZERO_ONE_STEPS, **worker.ZERO_ONE_DEFAULTS)
  assert len(sched) == worker.ZERO_ONE_STEPS
  freeze = worker.ZERO_ONE_DEFAULTS["var_freeze_step"]
  assert set(sched[:freeze]) == {"v", "c"} and set(sched[freeze:]) == {"l", "s"}
  assert sched[:worker.ZERO_ONE_DEFAULTS["var_update_scaler"]] == "v" * 4
  assert "c" * 7 in sched and "l" * 7 in sched and "ssss" in sched


def test_without_local_steps_every_step_after_the_freeze_is_a_sync():
  sched = worker.phase_schedule(30, var_freeze_step=20, var_update_scaler=4)
  assert sched[20:] == "s" * 10 and set(sched[:20]) == {"v", "c"}


def _window(phase, step_s, tx, first=2):
  return {"phase": phase, "first_step": first, "step_s": step_s, "steps": len(step_s),
          "tx_bytes": tx, "rx_bytes": tx, "lo_tx_bytes": 0}


def test_summary_per_phase_pools_windows_and_ranks():
  windows = [_window("v", [1.0, 3.0], 200), _window("c", [0.5], 10), _window("v", [2.0], 100),
             _window("l", [0.2, 0.2, 0.4], 3)]
  rank = lambda scale: {"zero_one": {
      "hyper": {}, "nsteps": 8, "settle_s": 0.3, "schedule": "vvvcvlll",
      "predicted_schedule": "vvvcvlll", "schedule_matches": True, "first_step_s": 9.0,
      "state_wire_bytes": [100.0] * 3 + [5.0, 100.0, 0.0, 0.0, 0.0],
      "windows": [dict(w, tx_bytes=w["tx_bytes"] * scale) for w in windows]}}
  z = ct._zero_one_summary([rank(1), rank(3)])
  v = z["phases"]["variance"]
  assert (v["steps"], v["windows"], v["step_s"]) == (3, 2, 2.0)
  assert v["tx_bytes_ranks"] == [100.0, 300.0] and v["tx_bytes"] == 200.0
  assert v["state_wire_bytes"] == 100.0
  assert z["phases"]["local"]["tx_bytes"] == pytest.approx(2.0)
  assert "sync" not in z["phases"] and z["schedule_matches"]


def test_predicted_bytes_per_phase_are_the_package_functions():
  shapes = [[20_000, 128], [128, 64], [64], [64, 16], [16]]
  params = sum(int(np.prod(s)) for s in shapes)
  pred = ct._zero_one_predicted(params, shapes, 4)
  layout = ct._layout(shapes, 4)
  assert pred["variance"] == _collective.allreduce_wire_bytes(params, 4)
  assert pred["compressed"] == pred["sync"] == 2 * 3 * layout.row_bytes
  assert pred["local"] == 0.0
