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


def _zero_one_task(study_gaps, study_bytes, eval_diffs):
  """``_task`` with the 0/1 Adam pieces: a study (label -> paired gap %, bytes) and its eval."""
  task = _task([0.0] * len(eval_diffs))
  sel, ev = task["selection_seeds"], task["eval_seeds"]
  base_sel = {r["seed"]: r["final_val"] for r in task["adamw"][1e-2]}

  def runs(seeds, base, gap, sent, lr=1e-2):
    out = []
    for s in seeds:
      r = _rec(s, base[s] * (1 + gap / 100), "zero_one", lr)
      r.update(total_bytes=sent, wire=[0.0, 2.5, 0.1, 0.0] * 10, freeze_step=2)
      out.append(r)
    return out

  grid = [[label, dict(var_freeze_step=1, var_update_scaler=k)]
          for label, k in zip(study_gaps, (16, 4, 1))]
  task["zero_one_study"] = {label: runs(sel, base_sel, gap, study_bytes[label])
                            for label, gap in study_gaps.items()}
  chosen = next(iter(study_gaps))
  task.update(zero_one_grid=grid, zero_one_chosen=chosen, zero_one_own_lr=1e-2,
              zero_one_options=dict(var_freeze_step=2, var_update_scaler=16),
              zero_one={1e-2: task["zero_one_study"][chosen]})
  base_ev = {r["seed"]: r["final_val"] for r in task["eval"]["adamw"]}
  zo = [dict(r, final_val=base_ev[r["seed"]] * (1 + d / 100))
        for r, d in zip(runs(ev, base_ev, 0.0, study_bytes[chosen]), eval_diffs)]
  task["eval"].update(zero_one=zo, zero_one_own=zo)
  for r in task["adamw"][1e-2] + task["eval"]["adamw"]:
    r["wire"] = [2.5] * 40
  for r in task["onebit"][1e-2] + task["eval"]["onebit"]:
    r["wire"] = [2.5] * 8 + [0.1] * 32
  return task


def test_rounds_count_model_sized_and_float32_collectives():
  rec = dict(wire=[2.5, 2.5, 0.1, 0.0, 0.0, 0.1, 2.5], allreduce_bytes=2.5)
  assert _conv_report.rounds(rec) == (5, 3)
  assert _conv_report.rounds(dict(wire=[4.0] * 7)) == (7, 7)  # AdamW: its own size


def test_zero_one_study_row_applies_both_goals():
  # 1-bit Adam's selection runs sent 10 bytes (``_rec``): 3x less is <= 3.33 bytes.
  task = _zero_one_task({"a": 0.2, "b": 0.2, "c": 2.0}, {"a": 3.0, "b": 5.0, "c": 1.0},
                        [0.1, 0.3])
  rows = {k: _conv_report.zero_one_study_row(task, k) for k in "abc"}
  assert math.isclose(rows["a"]["gap"], 0.2, rel_tol=1e-6) and rows["a"]["ok"]
  assert not rows["b"]["ok"]  # 2x less volume only
  assert not rows["c"]["ok"]  # +2% loss
  assert math.isclose(rows["a"]["vs_onebit"], 10.0 / 3.0)
  assert (rows["a"]["rounds"], rows["a"]["fp32_rounds"]) == (20, 10)


def test_choose_zero_one_counts_tasks_then_mean_gap():
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                  "benchmarks"))
  import convergence  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  grid = (("a", {}), ("b", {}), ("c", {}))
  one = _zero_one_task({"a": 0.4, "b": 0.1, "c": 9.0}, {"a": 1.0, "b": 1.0, "c": 1.0}, [0.0])
  two = _zero_one_task({"a": 0.4, "b": 0.3, "c": 0.0}, {"a": 1.0, "b": 1.0, "c": 9.0}, [0.0])
  # a and b are ok on both tasks (c on neither: loss, then volume); b has the lower mean gap.
  assert convergence.choose_zero_one([one, two], grid) == "b"
  three = _zero_one_task({"a": 0.4, "b": 5.0, "c": 0.0}, {"a": 1.0, "b": 1.0, "c": 9.0}, [0.0])
  assert convergence.choose_zero_one([one, two, three], grid) == "a"  # ok on all three


def test_zero_one_goals_and_markdown():
  meta = dict(command="c", quick=False, git="g", jax="j", optax="o", onebit_optax="b",
              machine="m", uptime_start="u", uptime_end="u", started="s", wall_s=60.0)
  task = _zero_one_task({"a": 0.2, "b": 1.0}, {"a": 3.0, "b": 2.0}, [0.1, 0.3, 0.2])
  (parity, ok_parity), (volume, ok_volume) = _conv_report.zero_one_goals(task)
  assert ok_parity and "+0.20%" in parity and "3 evaluation seeds" in parity
  assert ok_volume and "(3.33x)" in volume
  md = _conv_report.build_markdown([task], meta)
  assert "## Three optimizers" in md and "## 0/1 Adam parameter study" in md
  assert "| t | a **(chosen)** |" in md and "Chosen: **a**" in md
  assert "kappa: a -> b" in md  # the one-parameter effects table
  assert "PASS: t: 0/1 Adam >= 3x less volume than 1-bit Adam" in md
  excerpt = _conv_report.build_zero_one_markdown([task], meta)
  assert "## 0/1 Adam parameter study" in excerpt and "Goals" in excerpt
  assert "Freeze-step study" in md  # a task with the freeze study keeps its section


def test_markdown_of_a_run_that_reused_adamw_and_skipped_the_freeze_study():
  meta = dict(command="c", quick=False, git="g", jax="j", optax="o", onebit_optax="b",
              machine="m", uptime_start="u", uptime_end="u", started="s", wall_s=60.0)
  task = _zero_one_task({"a": 0.2, "b": 1.0}, {"a": 3.0, "b": 2.0}, [0.1, 0.3])
  for key in ("fixed", "references", "reference_step"):
    del task[key]
  del task["eval"]["onebit_own"], task["eval"]["zero_one_own"]
  task.update(own_lr=None, zero_one_own_lr=None, reused="old.json (run at abc)",
              reproduction=dict(lr=1e-2, seed=0, stored=0.9, rerun=0.9, rel=0.0,
                                bytes_equal=True, ok=True))
  md = _conv_report.build_markdown([task], meta)
  assert "**Reused runs.**" in md and "old.json (run at abc)" in md
  assert "**Not run here:** the freeze-step study" in md and "Freeze-step study" not in md
  assert "not swept" in md and "its own lr" not in md.split("## Three optimizers")[1].split(
      "## 0/1 Adam parameter study")[0]
