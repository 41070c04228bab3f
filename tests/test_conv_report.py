"""The convergence report's statistics: paired differences, standard errors, the verdict line.

benchmarks/_conv_report.py on synthetic records (no training).
"""

import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import _conv_report  # pylint: disable=g-import-not-at-top,wrong-import-position


def _rec(seed, val, kind="adamw", lr=1e-2, steps=40):
  nu = np.linspace(1.0, 2.0, steps).tolist()
  return dict(kind=kind, lr=lr, seed=seed, final_val=val, total_bytes=100.0 if kind == "adamw"
              else 10.0, freeze_step=None if kind == "adamw" else 8, nu_l1=nu,
              ratio=[float("nan")] * 3 + [1.0] * (steps - 3), eval_steps=[0, steps],
              val=[2.0, val])


def _task(rel_diffs, base=1.0):
  sel, ev = (0, 1), tuple(1000 + i for i in range(len(rel_diffs)))
  run = lambda kind, seeds, vals, lr=1e-2: [_rec(s, v, kind, lr) for s, v in zip(seeds, vals)]
  evaluation = dict(adamw=run("adamw", ev, [base] * len(ev)),
                    onebit=run("onebit", ev, [base * (1 + d / 100) for d in rel_diffs]))
  evaluation["onebit_own"] = evaluation["onebit"]
  return dict(name="t", title="synthetic", steps=40, warmup=2, chunk=10, batch=8, devices=8,
              params=10, weight_decay=0.1, b2=0.999, allreduce_bytes_per_step=2.5,
              best_lr=1e-2, own_lr=1e-2, selection_seeds=list(sel), eval_seeds=list(ev),
              adamw={1e-2: run("adamw", sel, [0.9, 0.9])},
              onebit={1e-2: run("onebit", sel, [0.95, 0.95])}, eval=evaluation,
              fixed={4: run("fixed", sel, [0.97, 0.97])}, reference_step=8,
              references=dict(naive=_rec(0, 1.2, "naive"),
                              no_feedback=_rec(0, 1.5, "no_feedback")), wall_s=1.0)


def test_paired_stats_mean_std_and_standard_error():
  task = _task([1.0, 3.0, -1.0, 5.0])
  p = _conv_report.paired_stats(task["eval"]["onebit"], task["eval"]["adamw"])
  assert math.isclose(p["mean"], 2.0, rel_tol=1e-9)
  std = float(np.std([1.0, 3.0, -1.0, 5.0], ddof=1))
  assert math.isclose(p["std"], std, rel_tol=1e-9)
  assert math.isclose(p["se"], std / 2, rel_tol=1e-9)
  assert (p["n"], p["worse"]) == (4, 3)


def test_verdict_says_whether_the_half_percent_goal_is_resolved():
  met = _conv_report.verdict(_task([0.0, 0.1, -0.1, 0.05, -0.05]))
  assert "within 0.5%: yes" in met and "resolvable at 5 evaluation seeds: yes" in met
  assert "lies below +0.5%" in met
  missed = _conv_report.verdict(_task([5.0, 5.1, 4.9, 5.05]))
  assert "within 0.5%: no" in missed and "lies above +0.5%" in missed
  noisy = _conv_report.verdict(_task([10.0, -9.0, 1.0, -1.5]))
  assert "within 0.5%: yes" in noisy and "resolvable at 4 evaluation seeds: no" in noisy
  assert "contains +0.5%" in noisy


def test_markdown_reports_both_seed_sets():
  meta = dict(command="c", quick=True, git="g", jax="j", optax="o", onebit_optax="b",
              machine="m", uptime_start="u", uptime_end="u", started="s", wall_s=60.0)
  md = _conv_report.build_markdown([_task([1.0, 2.0])], meta)
  assert "2 selection seeds (0–1), 2 evaluation seeds (1000–1001)" in md
  assert "Evaluation on the 2 fresh seeds (1000–1001)" in md
  assert "## Verdict" in md
  freeze = _conv_report.build_freeze_markdown([_task([1.0, 2.0])], meta)
  assert "selection" in freeze and "2 evaluation seeds" in freeze
