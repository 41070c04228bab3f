"""benchmarks/frontier.py's report: the alpha-beta time model and the summary, on synthetic runs.

No training: records written by hand, and the expected seconds worked out here
from the model's formula with the numbers spelled out.
"""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import _frontier_report  # pylint: disable=g-import-not-at-top,wrong-import-position
import _frontier_time  # pylint: disable=g-import-not-at-top,wrong-import-position

SIZE = 1000  # parameters
ALLREDUCE8 = 2 * 7 / 8 * 4 * SIZE  # a float32 ring all-reduce on 8 devices: 7000 bytes


def _rec(label, seed, final, wire, val, eval_steps, phase="eval", lr=1e-3):
  return dict(label=label, task="t", phase=phase, seed=seed, final_val=final, lr=lr,
              total_bytes=float(np.sum(wire)), rounds=int(np.count_nonzero(wire)), wire=wire,
              val=val, eval_steps=eval_steps, options=None, kind="x")


def test_steps_are_classed_by_what_they_sent_on_8_devices():
  kinds = _frontier_time._kinds([ALLREDUCE8, 120.0, 0.0, ALLREDUCE8 * 0.9], ALLREDUCE8)
  np.testing.assert_array_equal(kinds, [2, 1, 0, 2])


def test_step_seconds_are_compute_plus_the_alpha_beta_messages(monkeypatch):
  monkeypatch.setattr(_frontier_time, "_bytes", lambda size, n, shapes: (1e6, 1e4))
  compute = dict(size=SIZE, chunk=2, steps=4, seconds={"c": [0.02, 0.04]})  # 10 ms, then 20 ms
  rec = _rec("c", 0, 1.0, [ALLREDUCE8, 50.0, 0.0, ALLREDUCE8], [], [])
  got = _frontier_time.step_seconds(rec, compute, "c", n=4, rate=8e6, shapes=None)  # 1 MB/s
  alpha = 2 * 3 * _frontier_time.ALPHA  # 2(n-1) messages
  want = [0.01 + alpha + 1.0, 0.01 + alpha + 0.01, 0.02, 0.02 + alpha + 1.0]
  np.testing.assert_allclose(got, want, rtol=1e-12)


def test_time_to_a_loss_is_the_sum_up_to_the_first_evaluation_below_it():
  rec = _rec("c", 0, 1.0, [], val=[3.0, 2.0, 1.5, 1.2], eval_steps=[0, 2, 4, 6])
  seconds = np.arange(1.0, 7.0)  # 1, 2, ..., 6 s per step
  assert _frontier_time.time_to(rec, 1.5, seconds) == pytest.approx(1 + 2 + 3 + 4)
  assert _frontier_time.time_to(rec, 1.0, seconds) is None


def _doc(deltas):
  """AdamW and two contestants on 3 seeds; ``deltas``: their relative loss differences (%)."""
  runs = []
  for s, base in zip((1000, 1001, 1002), (2.0, 2.1, 1.9)):
    runs.append(_rec("AdamW", s, base, [ALLREDUCE8] * 4, [3.0, base], [0, 4]))
    for label, delta, wire in (("A", deltas[0], [ALLREDUCE8 / 10] * 4),
                               ("B", deltas[1], [0.0, 0.0, 0.0, ALLREDUCE8])):
      v = base * (1 + delta[s - 1000] / 100)
      runs.append(_rec(label, s, v, wire, [3.0, v], [0, 4]))
  return {"runs": runs}


def test_the_summary_names_the_fewest_bytes_among_those_level_with_adamw():
  doc = _doc(([0.1, -0.2, 0.0], [5.0, 6.0, 5.5]))  # A level with AdamW; B 5.5% worse
  rows = {r["label"]: r for r in _frontier_report.rows(doc, "t")}
  assert rows["A"]["mb"] == pytest.approx(4 * ALLREDUCE8 / 10 / 1e6)
  assert _frontier_report.level(rows["A"]) and not _frontier_report.level(rows["B"])
  text = _frontier_report.summary(doc, ["t"])[0]
  assert "were A's: 10x fewer than AdamW" in text
  assert "worse (paired mean - 2 s.e. > +1%): B (+5.5%, s.e. 0.3%; 4x fewer bytes)" in text


def test_the_summary_says_so_when_nobody_is_level():
  text = _frontier_report.summary(_doc(([3.0, 2.0, 4.0], [5.0, 6.0, 5.5])), ["t"])[0]
  assert "no contestant was shown level with tuned AdamW" in text
