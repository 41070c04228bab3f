"""The data-shift report (benchmarks/_shift_report.py) on synthetic curves: gaps, verdict, files.

No training: records shaped like benchmarks/data_shift.py's json, with a known
gap to AdamW before and after the shift.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import _shift_report  # pylint: disable=g-import-not-at-top,wrong-import-position

T, E = 400, 50


def _rec(kind, seed, before, after, noise):
  """A run whose loss is AdamW's x (1 + gap/100): ``before`` up to T/2, ``after`` later."""
  steps = list(range(0, T + 1, E))
  base = lambda s: 3.0 - s / T + 0.01 * seed
  gap = lambda s: (before if s <= T // 2 else after) + noise
  scale = lambda s: 1.0 if kind == "adamw" else 1.0 + gap(s) / 100.0
  prose = [base(s) * scale(s) for s in steps]
  code = [(base(s) + 0.3) * scale(s) for s in steps]
  v = dict.fromkeys(_shift_report.GROUPS, 1.0)
  return dict(kind=kind, seed=seed, steps=steps, val_prose=prose, val_code=code,
              train_loss=[2.0] * len(steps), bytes=[s * (100.0 if kind == "adamw" else 10.0)
                                                    for s in steps],
              v_hat=[None] + [v] * (len(steps) - 1),
              info=[dict(frozen=True, freeze_step=20)] * len(steps) if "onebit" in kind else
              [dict(variance_updates=50, var_interval=8, variance_step=400)] * len(steps)
              if kind.startswith("zero_one")
              else [{}] * len(steps),
              done=True, final_prose=prose[-1], final_code=code[-1], wall_s=1.0)


def _results(onebit_after):
  runs = []
  for seed, noise in zip(range(3), (-0.1, 0.0, 0.1)):
    runs += [_rec("adamw", seed, 0, 0, 0), _rec("onebit", seed, 1.0, onebit_after, noise),
             _rec("zero_one", seed, 1.0, 1.0, noise)]
  cfg = dict(steps=T, eval_every=E, warmup=20, lr=3e-3, end_fraction=0.1, weight_decay=0.1,
             clip=1.0, d_model=64, layers=2, heads=4, seq_len=64, batch_per_device=4,
             val_seqs=64, var_update_scaler=16, devices=8, b1=0.9, b2=0.999, code_bytes=1000)
  corpus = dict(train=900, val=100, val_windows_periodic=64, val_windows_full=100)
  meta = dict(command="synthetic", git="x", jax="0", jaxlib="0", optax="0", onebit_optax="0",
              python="3", machine="test", started="now", uptime_start="u", uptime_end="u",
              wall_s=60.0, params=1000, allreduce_bytes=100.0,
              corpora=dict(prose=corpus, code=corpus), stdlib="/lib", code_only_bytes=[36])
  return dict(config=cfg, meta=meta, runs=runs)


def test_gap_change_and_verdict(tmp_path):
  results = _results(onebit_after=4.0)
  summ = _shift_report.summary(results)
  np.testing.assert_allclose(summ["onebit"]["before_ms"][0], 1.0, atol=1e-6)
  np.testing.assert_allclose(summ["onebit"]["after_ms"][0], 4.0, atol=1e-6)
  np.testing.assert_allclose(summ["onebit"]["delta_ms"][0], 3.0, atol=1e-6)
  np.testing.assert_allclose(summ["zero_one"]["after_vs_onebit_ms"][0], -3.0, atol=1e-6)
  out = str(tmp_path / "data_shift")
  _shift_report.write(results, out)
  text = open(out + ".md").read()
  assert "**Yes**" in text
  assert "It does better than the frozen variance after the shift" in text
  assert os.path.getsize(out + ".png") > 1000


def test_control_separates_shift_from_time(tmp_path):
  """Without the shift the gap grows by 1 point; with it by 3: the shift adds 2."""
  results = _results(onebit_after=4.0)
  for seed, noise in zip(range(3), (-0.1, 0.0, 0.1)):
    for kind, after in (("adamw_noshift", 0), ("onebit_noshift", 2.0)):
      rec = _rec(kind, seed, 0 if kind == "adamw_noshift" else 1.0, after,
                 noise * (kind != "adamw_noshift"))
      rec["val_code"] = rec["val_prose"]  # the control's gap is read on prose after T/2
      results["runs"].append(rec)
  summ = _shift_report.summary(results)
  np.testing.assert_allclose(summ["onebit_noshift"]["delta_ms"][0], 1.0, atol=1e-6)
  np.testing.assert_allclose(summ["onebit"]["shift_attributable_ms"][0], 2.0, atol=1e-6)
  out = str(tmp_path / "data_shift")
  _shift_report.write(results, out)
  text = open(out + ".md").read()
  assert "**Is it the shift, or time?**" in text and "more than twice its standard error" in text


def test_no_staleness(tmp_path):
  results = _results(onebit_after=1.0)
  out = str(tmp_path / "data_shift")
  _shift_report.write(results, out)
  text = open(out + ".md").read()
  assert "**No measurable staleness**" in text
  assert "No significant difference from the frozen variance" in text


def test_partial_run(tmp_path):
  """A run cut short (the json written mid-run) still renders."""
  results = _results(onebit_after=4.0)
  last = results["runs"][-1]
  for key in ("steps", "val_prose", "val_code", "train_loss", "bytes", "v_hat", "info"):
    last[key] = last[key][:3]
  last["done"] = False
  del last["final_prose"], last["final_code"]
  _shift_report.write(results, str(tmp_path / "data_shift"))
  assert "Finished runs: 8 of 9" in open(str(tmp_path / "data_shift") + ".md").read()


def test_per_step_ema_is_paired_with_deepspeeds(tmp_path):
  """zero_one_step after the shift 0.5 points below zero_one (1.0 -> 0.5), same seeds."""
  results = _results(onebit_after=4.0)
  for seed, noise in zip(range(3), (-0.1, 0.0, 0.1)):
    results["runs"].append(_rec("zero_one_step", seed, 1.0, 0.5, noise))
  summ = _shift_report.summary(results)
  np.testing.assert_allclose(summ["zero_one_step"]["after_vs_zero_one_ms"][0], -0.5, atol=1e-6)
  np.testing.assert_allclose(summ["zero_one_step"]["delta_vs_zero_one_ms"][0], -0.5, atol=1e-6)
  out = str(tmp_path / "data_shift")
  _shift_report.write(results, out)
  text = open(out + ".md").read()
  assert "Against DeepSpeed's EMA (the `zero_one` runs, same seeds): -0.50" in text
  assert "(per-step EMA)" in text  # the post-shift weight, from the variance steps' counts
