"""The convergence benchmark's progress bar: its planned total is the work the protocol does."""

import os
import sys
import types

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import convergence  # noqa: E402  pylint: disable=wrong-import-position


class _FakeRunner:
  """Stands in for _conv_runner.Runner: counts the steps of every run, trains nothing."""

  n, size, b2, allreduce_bytes = 8, 1000, 0.999, 1.0
  calls = []

  def __init__(self, task, mesh):
    del mesh
    self.task = task
    self.on_steps = None

  def run(self, kind, lr, seed, freeze_at=1):
    _FakeRunner.calls.append(kind)
    for s0 in range(0, self.task.steps, self.task.chunk):
      self.on_steps(min(self.task.chunk, self.task.steps - s0))
    # AdamW is best at its smallest lr (the sweep extends at that edge), 1-bit Adam at its
    # largest (its own lr differs from AdamW's, adding evaluation runs).
    final = lr if kind == "adamw" else -lr
    return dict(kind=kind, lr=lr, seed=seed, final_val=final, total_bytes=1.0,
                freeze_step=3 if kind != "adamw" else None, wall_s=0.0)


@pytest.mark.parametrize("extensions", [0, 1, 2])
def test_the_bar_ends_full(monkeypatch, extensions):
  monkeypatch.setattr(convergence._conv_runner, "Runner", _FakeRunner)
  _FakeRunner.calls = []
  task = types.SimpleNamespace(name="t", title="t", steps=10, warmup=1, chunk=4,
                               batch_per_device=1, weight_decay=0.0, lrs=(1e-3, 3e-3, 1e-2),
                               seeds=2, eval_seeds=3)
  fractions = convergence.FREEZE_FRACTIONS
  progress = convergence.Progress(
      convergence.planned_runs(task, None, None, fractions) * task.steps, enabled=False)
  out = convergence.run_task(task, None, None, fractions, lambda r: r, extensions=extensions,
                             eval_seeds=None, progress=progress)
  # Counted independently: every call of run() trained task.steps steps.
  assert progress.done == len(_FakeRunner.calls) * task.steps
  assert progress.total == progress.done
  assert len(out["adamw"]) == len(task.lrs) + extensions
  assert out["own_lr"] != out["best_lr"]
  assert np.isclose(out["best_lr"], min(task.lrs) / 3 ** extensions)


def test_the_bar_ends_full_when_adamw_is_reused(monkeypatch):
  monkeypatch.setattr(convergence._conv_runner, "Runner", _FakeRunner)
  _FakeRunner.calls = []
  task = types.SimpleNamespace(name="t", title="t", steps=10, warmup=1, chunk=4,
                               batch_per_device=1, weight_decay=0.0, lrs=(1e-3, 3e-3, 1e-2),
                               seeds=2, eval_seeds=3)
  select, fresh = convergence.seed_sets(task)
  runner = _FakeRunner(task, None)
  stored = dict(convergence.task_config(task, runner, select, fresh), best_lr=3e-3,
                adamw={lr: [dict(seed=s, final_val=lr, total_bytes=1.0) for s in select]
                       for lr in task.lrs},
                eval=dict(adamw=[dict(seed=s, final_val=3e-3, total_bytes=1.0) for s in fresh]))
  progress = convergence.Progress(
      convergence.planned_runs(task, None, None, (), adamw=False, freeze_study=False,
                               onebit_sweep=False) * task.steps, enabled=False)
  out = convergence.run_task(task, None, None, (), lambda r: r, progress=progress,
                             reuse=(stored, "old"), freeze_study=False, onebit_sweep=False)
  assert out["reused"] == "old" and out["reproduction"]["ok"]
  assert _FakeRunner.calls == ["adamw"] + ["onebit"] * (len(select) + len(fresh))
  assert progress.done == progress.total == len(_FakeRunner.calls) * task.steps
  assert out["eval"]["adamw"] is stored["eval"]["adamw"] and "fixed" not in out
