"""The report of benchmarks/data_shift.py: markdown tables, a verdict and a plot, from the json alone."""

from __future__ import annotations

import math

import numpy as np

LABELS = dict(
    adamw="AdamW (float32 pmean)",
    onebit="1-bit Adam, default freeze (frozen once)",
    zero_one="0/1 Adam, v refreshed (var_freeze_step = T)",
    zero_one_step="0/1 Adam, v refreshed, per-step EMA (variance_ema='per_step')",
    onebit_restart="1-bit Adam, new state at the shift (remedy)",
    diloco="DiLoCo (H inner AdamW steps per device, outer Nesterov SGD)",
    adamw_noshift="control: AdamW, no shift (prose throughout)",
    onebit_noshift="control: 1-bit Adam (default freeze), no shift",
)
MAIN = ("adamw", "onebit", "zero_one", "zero_one_step", "onebit_restart", "diloco")


def _base(kind):
  """The AdamW run a kind is paired with."""
  return "adamw_noshift" if kind.endswith("_noshift") else "adamw"


def _post_shift_weight(b2, n_before, n_after):
  """Share of the bias-corrected EMA's weight on the last ``n_after`` of ``n_before + n_after`` updates."""
  n = n_before + n_after
  return (1.0 - b2 ** n_after) / (1.0 - b2 ** n) if n else float("nan")
GROUPS = ("embed", "pos", "head", "attn", "mlp", "vectors")
STALE_MIN = 0.5  # percentage points: a change in the gap smaller than this is not called stale.


def _runs(results, kind, done_only=False):
  return [r for r in results["runs"] if r["kind"] == kind and (r["done"] or not done_only)]


def _at(rec, key, step):
  try:
    return rec[key][rec["steps"].index(step)]
  except (ValueError, IndexError):
    return None


def _mean_se(values):
  v = np.asarray([x for x in values if x is not None and np.isfinite(x)], float)
  if not len(v):
    return float("nan"), float("nan"), 0
  se = float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else float("nan")
  return float(v.mean()), se, len(v)


def _fmt(m, se, digits=4, pct=False):
  if not np.isfinite(m):
    return "—"
  unit = "%" if pct else ""
  sign = "+" if pct else ""
  if np.isfinite(se):
    return f"{m:{sign}.{digits}f} ± {se:.{digits}f}{unit}"
  return f"{m:{sign}.{digits}f}{unit}"


def _pp(m, se):
  """A difference of percentages, in points."""
  return _fmt(m, se, 2, True).replace("%", "")


def _paired(results, kind, key, step, base="adamw"):
  """Per seed, 100 * (kind / AdamW - 1) of ``key`` at ``step`` (``step=None``: the final full-set value)."""
  ref = {r["seed"]: r for r in _runs(results, base)}
  out = {}
  for r in _runs(results, kind):
    b = ref.get(r["seed"])
    if b is None:
      continue
    if step is None:
      x, y = r.get(key), b.get(key)
    else:
      x, y = _at(r, key, step), _at(b, key, step)
    if x is not None and y is not None:
      out[r["seed"]] = 100.0 * (x / y - 1.0)
  return out


def _window_gap(results, kind, key, lo, hi):
  """Per seed, the mean over the evaluations in (lo, hi] of the paired relative gap on ``key``."""
  ref = {r["seed"]: r for r in _runs(results, _base(kind))}
  out = {}
  for r in _runs(results, kind):
    b = ref.get(r["seed"])
    if b is None:
      continue
    gaps = [100.0 * (_at(r, key, s) / _at(b, key, s) - 1.0) for s in r["steps"]
            if lo < s <= hi and s in b["steps"]]
    if gaps and max(r["steps"]) >= hi and max(b["steps"]) >= hi:
      out[r["seed"]] = float(np.mean(gaps))
  return out


def _kinds(results):
  seen = []
  for r in results["runs"]:
    if r["kind"] not in seen:
      seen.append(r["kind"])
  return seen


def summary(results) -> dict:
  """The numbers of the verdict, per optimizer (also stored in the json by the report)."""
  cfg = results["config"]
  T, E = cfg["steps"], cfg["eval_every"]
  half = T // 2
  out = {}
  for kind in _kinds(results):
    if kind in ("adamw", "adamw_noshift"):
      continue
    before = _window_gap(results, kind, "val_prose", half // 2, half)
    after = _window_gap(results, kind, "val_prose" if kind.endswith("_noshift") else "val_code",
                        half + half // 2, T)
    delta = {s: after[s] - before[s] for s in after if s in before}
    out[kind] = dict(before=before, after=after, delta=delta,
                     before_ms=_mean_se(before.values()), after_ms=_mean_se(after.values()),
                     delta_ms=_mean_se(delta.values()))
  for kind in ("zero_one", "zero_one_step", "onebit_restart", "diloco"):
    if kind in out and "onebit" in out:
      a, b = out[kind]["after"], out["onebit"]["after"]
      d = {s: a[s] - b[s] for s in a if s in b}
      out[kind]["after_vs_onebit"] = d
      out[kind]["after_vs_onebit_ms"] = _mean_se(d.values())
  if "zero_one_step" in out and "zero_one" in out:  # the two EMAs, same seeds
    for key in ("after", "delta"):
      a, b = out["zero_one_step"][key], out["zero_one"][key]
      out["zero_one_step"][f"{key}_vs_zero_one_ms"] = _mean_se([a[s] - b[s] for s in a if s in b])
  if "onebit" in out and "onebit_noshift" in out:
    a, b = out["onebit"]["delta"], out["onebit_noshift"]["delta"]
    d = {s: a[s] - b[s] for s in a if s in b}
    out["onebit"]["shift_attributable"] = d
    out["onebit"]["shift_attributable_ms"] = _mean_se(d.values())
  return out


def _verdict(results, summ) -> list[str]:
  lines = ["## Verdict\n"]
  if "onebit" not in summ or not summ["onebit"]["delta"]:
    return lines + ["Not enough finished runs for a verdict yet.\n"]
  n = summ["onebit"]["delta_ms"][2]
  m_b, se_b, _ = summ["onebit"]["before_ms"]
  m_a, se_a, _ = summ["onebit"]["after_ms"]
  m_d, se_d, _ = summ["onebit"]["delta_ms"]
  noise = (f"{n} seeds; ± is the standard error of the paired (same-seed) value" if n > 1 else
           "1 seed: no estimate of the seed noise, so no claim below is a significant one")
  lines.append(
      f"*Gap* = mean over the evaluations of a window of 100 x (optimizer's held-out loss / "
      f"AdamW's, same seed, same step - 1) on the distribution being trained on: *before* = "
      f"prose, steps ({half_q(results)}], the second quarter of the run, just before the "
      f"shift; *after* = Python source, steps ({after_q(results)}], the last quarter. {noise}.\n")
  stale = m_d > STALE_MIN and (n < 2 or not np.isfinite(se_d) or m_d > 2 * se_d)
  lines.append(
      f"**Does the frozen preconditioner go stale?** 1-bit Adam's gap to AdamW is "
      f"{_fmt(m_b, se_b, 2, True)} before the shift and {_fmt(m_a, se_a, 2, True)} after it: "
      f"a change of {_pp(m_d, se_d)} points. "
      + ("**Yes**: the gap grows after the shift by more than twice its standard error "
         f"and more than {STALE_MIN} points (how much of it is the shift and how much is "
         "time: the next paragraph)." if stale and n > 1 else
         f"It grows by more than {STALE_MIN} points (one seed: not tested against noise)."
         if stale else
         f"**No measurable staleness** at this scale: the change is below {STALE_MIN} points "
         "or within twice its standard error.") + "\n")
  if "onebit_noshift" in summ and summ["onebit_noshift"]["delta"]:
    c = summ["onebit_noshift"]
    m_c, se_c, n_c = c["delta_ms"]
    m_s, se_s, n_s = summ["onebit"].get("shift_attributable_ms", (float("nan"),) * 2 + (0,))
    lines.append(
        f"**Is it the shift, or time?** Without the shift (prose throughout, the control), "
        f"1-bit Adam's gap to AdamW on prose goes from {_fmt(*c['before_ms'][:2], 2, True)} "
        f"(steps ({half_q(results)}]) to {_fmt(*c['after_ms'][:2], 2, True)} (steps "
        f"({after_q(results)}]): a change of {_pp(m_c, se_c)} points ({n_c} seeds). The part of "
        f"the growth that the shift adds (same-seed change with the shift minus change without "
        f"it): {_pp(m_s, se_s)} points ({n_s} seeds)"
        + (", more than twice its standard error." if n_s > 1 and np.isfinite(se_s)
           and m_s > 2 * se_s else
           ", within twice its standard error: at this scale the frozen variance goes stale "
           "mostly with *time* (it was measured at the start of a long run), and the shift's own "
           "addition is not distinguishable from seed noise." if n_s > 1 else ".") + "\n")
  for kind, name in (("zero_one", "0/1 Adam's refresh"),
                     ("zero_one_step", "0/1 Adam's refresh with the per-step EMA"),
                     ("onebit_restart", "The restart remedy"), ("diloco", "DiLoCo")):
    if kind not in summ or not summ[kind]["after"]:
      continue
    s = summ[kind]
    mv, sev, nv = s.get("after_vs_onebit_ms", (float("nan"),) * 2 + (0,))
    closes = np.isfinite(mv) and mv < 0 and (nv < 2 or not np.isfinite(sev) or -mv > 2 * sev)
    worse = np.isfinite(mv) and mv > 0 and nv > 1 and np.isfinite(sev) and mv > 2 * sev
    lines.append(
        f"**{name}** ({LABELS[kind]}): gap {_fmt(*s['before_ms'][:2], 2, True)} before, "
        f"{_fmt(*s['after_ms'][:2], 2, True)} after (change {_pp(*s['delta_ms'][:2])} points); "
        f"after the shift it is {_pp(mv, sev)} points from 1-bit Adam's "
        f"(negative: closer to or better than AdamW). "
        + (("It does better than the frozen variance after the shift"
            + (" (more than twice the standard error)." if nv > 1 else " (one seed)."))
           if closes else "It does worse than the frozen variance after the shift (more than "
           "twice the standard error)." if worse else
           ("No significant difference from the frozen variance after the shift."
            if nv > 1 else "Not better than the frozen variance (one seed)."))
        + (f" It trails AdamW by {s['before_ms'][0]:.1f}% already before the shift (1-bit Adam: "
           f"{m_b:.1f}%), so its curve after the shift says little about the refresh as such; "
           "how far its v moved is in *The preconditioner* and *Freeze and refresh*."
           if kind.startswith("zero_one") and s["before_ms"][0] - m_b > 2.0 else "")
        + (f" Against DeepSpeed's EMA (the `zero_one` runs, same seeds): "
           f"{_pp(*s['after_vs_zero_one_ms'][:2])} points after the shift, "
           f"{_pp(*s['delta_vs_zero_one_ms'][:2])} points of change."
           if "after_vs_zero_one_ms" in s else "")
        + "\n")
  return lines


def _advice(results, summ) -> list[str]:
  """What a user can do today, when the measurements say so."""
  if "onebit_restart" not in summ or "onebit" not in summ:
    return []
  cfg = results["config"]
  T, half = cfg["steps"], cfg["steps"] // 2
  mv, sev, nv = summ["onebit_restart"].get("after_vs_onebit_ms", (float("nan"),) * 2 + (0,))
  stale_m, stale_se, _ = summ["onebit"]["delta_ms"]
  if not (np.isfinite(mv) and mv < 0 and stale_m > STALE_MIN):
    return []
  after = lambda kind: np.mean([_at(r, "bytes", T) - _at(r, "bytes", half)
                                for r in _runs(results, kind, done_only=True)] or [np.nan])
  ad, ob, rs = after("adamw"), after("onebit"), after("onebit_restart")
  freezes = [r["info"][-1].get("freeze_step") for r in _runs(results, "onebit_restart", True)]
  return [
      "## What a user can do today\n",
      "When the data distribution changes at a known step (a new mixture, a fine-tuning "
      "stage), or a run is long compared with the warmup the variance was frozen after, start "
      "a **new** `onebit_adam` state from the current parameters: its "
      "full-precision warmup measures the current variance and its freeze rule freezes it "
      "again. (Measured here only at the shift; a restart without a shift, i.e. against the "
      "time drift of the control alone, was not run.) "
      f"Here its gap to AdamW after the shift was {_fmt(*summ['onebit_restart']['after_ms'][:2], 2, True)}"
      f" (the frozen variance's: {_fmt(*summ['onebit']['after_ms'][:2], 2, True)}; both before the "
      f"shift: {_fmt(*summ['onebit']['before_ms'][:2], 2, True)}; paired difference "
      f"{_pp(mv, sev)} points, {nv} seeds), for "
      f"{(rs - ob) / 1e6:.0f} MB more per device over the second half ({rs / 1e6:.0f} MB "
      f"instead of {ob / 1e6:.0f} MB; AdamW: {ad / 1e6:.0f} MB); the new states froze "
      f"{', '.join(str(f) for f in freezes)} steps after the shift. With the public API "
      "(the momentum restarts from zero; the old state is dropped):\n",
      "```python",
      "# at the step `shift` where the data changes, on every process:",
      "tx = onebit_optax.onebit_adam(lambda count: schedule(count + shift), axis_name='data',",
      "                              freeze=onebit_optax.variance_ratio_freeze(min_steps=warmup),",
      "                              weight_decay=0.1, mask=decay_mask)",
      "opt_state = onebit_optax.init_sharded(tx, params, mesh, 'data')",
      "# ... and rebuild (re-jit) the train step with the new tx and its state_partition_specs",
      "```\n"] + ([
      "0/1 Adam's exponentially spaced variance steps are no substitute here: its second "
      "moment is an EMA (b2 = 0.999) over *variance steps*, of which only a few fall after a "
      "late shift (see *Freeze and refresh*), so its preconditioner at the end is still "
      "mostly the prose one (see *The preconditioner*).\n"]
      if "zero_one" in summ and summ["zero_one"].get("after_vs_onebit_ms", [np.nan])[0] >= 0
      else []) + _per_step_advice(summ)


def _per_step_advice(summ) -> list[str]:
  """What the per-step EMA did, next to DeepSpeed's EMA and the control's drift."""
  s = summ.get("zero_one_step", {})
  if "delta_vs_zero_one_ms" not in s:
    return []
  control = summ.get("onebit_noshift", {}).get("delta_ms")
  return [
      "With `zero_one_adam(..., variance_ema='per_step')` a variance step decays v by b2 per "
      "*step* since the previous one, so the sparse variance steps after the shift still weigh "
      "as Adam's steps would: its gap grew by "
      f"{_pp(*s['delta_ms'][:2])} points over the shift ({_pp(*s['delta_vs_zero_one_ms'][:2])} "
      "against DeepSpeed's EMA, same seeds)"
      + (f"; 1-bit Adam's gap grows {_pp(*control[:2])} points without any shift"
         if control else "") + ".\n"]


def half_q(results):
  T = results["config"]["steps"]
  return f"{T // 4}, {T // 2}"


def after_q(results):
  T = results["config"]["steps"]
  return f"{T // 2 + T // 4}, {T}"


def _points(cfg):
  T, E = cfg["steps"], cfg["eval_every"]
  half = T // 2
  soon = half + E
  later = half + max(E, (T // 10) // E * E)
  pts = [("just before the shift", half), (f"{soon - half} steps after", soon)]
  if later != soon:
    pts.append((f"{later - half} steps after", later))
  pts.append(("end", T))
  return pts


def _run_commits(runs) -> str:
  """Which commit each kind's runs ran at (runs of older invocations did not record it)."""
  by_kind = {}
  for r in runs:
    by_kind.setdefault(r["kind"], set()).add(r.get("git", "its invocation's commit"))
  return "Runs' code: " + "; ".join(f"{k} at {', '.join(sorted(v))}"
                                    for k, v in sorted(by_kind.items())) + "."


def write(results, out: str) -> None:
  """Writes ``out``.md and ``out``.png from ``results`` (and the summary into the json's dict)."""
  cfg, meta = results["config"], results["meta"]
  T, E = cfg["steps"], cfg["eval_every"]
  half = T // 2
  kinds = _kinds(results)
  summ = summary(results)
  results["summary"] = {k: {kk: vv for kk, vv in v.items()} for k, v in summ.items()}
  seeds = sorted({r["seed"] for r in results["runs"]})
  finished = sorted({(r["kind"], r["seed"]) for r in results["runs"] if r["done"]})
  L = ["# A data shift half-way: does 1-bit Adam's frozen variance go stale?\n",
       f"Command: `{meta['command']}`  ",
       f"Commit {meta['git']}; jax {meta['jax']} (jaxlib {meta['jaxlib']}), optax {meta['optax']}, "
       f"onebit_optax {meta['onebit_optax']}, Python {meta['python']}; {meta['machine']} "
       "(shared with other jobs); started "
       f"{meta['started']}; wall time so far {meta.get('wall_s', 0) / 60:.1f} min (all invocations).  ",
       f"Load (`uptime`) at start: `{meta['uptime_start']}`; at the last write: "
       f"`{meta.get('uptime_end', '?')}`.  ",
       *([f"Invocations (`--append` adds runs to the json): " + "; ".join(
           f"`{i['command']}` at {i['git']}, started {i['started']}, "
           f"{i.get('wall_s', 0) / 60:.1f} min, load `{i['uptime_start'].split('load average: ')[-1]}`"
           f" -> `{i.get('uptime_end', '?').split('load average: ')[-1]}`"
           for i in meta["invocations"]) + ".  "] if len(meta.get("invocations", [])) > 1 else []),
       f"Finished runs: {len(finished)} of {len(results['runs'])} started "
       f"({', '.join(f'{k}/{s}' for k, s in finished)}).  ",
       _run_commits(results["runs"]) + "\n",
       "## Setup\n",
       f"Char GPT of `benchmarks/_convergence_model.py`: d_model {cfg['d_model']}, "
       f"{cfg['layers']} layers, {cfg['heads']} heads, context {cfg['seq_len']}, "
       f"{meta['params']:,} parameters; next-byte cross-entropy (nats). {T} steps, global batch "
       f"{cfg['devices'] * cfg['batch_per_device']} sequences on {cfg['devices']} simulated CPU "
       f"devices (`jax.shard_map`, local gradients). Steps 1–{half} train on "
       f"`pydoc_data.topics` prose ({meta['corpora']['prose']['train']:,} training bytes), steps "
       f"{half + 1}–{T} on the standard library's `.py` files ({meta['stdlib']}, sorted, first "
       f"{cfg['code_bytes']:,} bytes; {meta['corpora']['code']['train']:,} training bytes): an "
       "abrupt shift. Each corpus holds out its last 10%; the curves use "
       f"{meta['corpora']['prose']['val_windows_periodic']} fixed, evenly spaced held-out "
       f"windows of each (every {E} steps), the *final* rows all of them "
       f"({meta['corpora']['prose']['val_windows_full']} prose, "
       f"{meta['corpora']['code']['val_windows_full']} code windows). Bytes that occur in the "
       f"code's training text but never in the prose's: {meta['code_only_bytes']} (their "
       "embedding rows get no gradient before the shift).\n",
       f"Every optimizer: peak lr {cfg['lr']} (the char GPT's selected lr in "
       "`convergence.md`), linear warmup over the first "
       f"{cfg['warmup']} steps (5%), then cosine decay to {cfg['end_fraction']:.0%} of the peak "
       f"at step {T} (the protocol under which that lr was selected; at the shift the lr is "
       "still 55% of the peak, so the second half is real training, not a cool-down), "
       f"b1 {cfg['b1']}, b2 {cfg['b2']}, eps 1e-8, decoupled weight decay {cfg['weight_decay']} "
       f"on matrices, `onebit_optax.clip_by_global_norm({cfg['clip']})` on the local gradients. "
       f"Seeds {seeds} (each seed: the same initialisation and batches for every optimizer).\n"]
  for kind in kinds:
    L.append(f"* **{LABELS[kind]}**: " + dict(
        adamw="`optax.adamw` on the float32 `pmean` of the gradients.",
        onebit="`onebit_adam(freeze=variance_ratio_freeze(min_steps=warmup))`: v is frozen "
        "once, early, on prose.",
        zero_one="`zero_one_adam(var_freeze_step=T, var_update_scaler="
        f"{cfg['var_update_scaler']})`, no local steps: v is updated on variance steps (float32 "
        f"all-reduce) whose interval doubles every {cfg['var_update_scaler']} of them, never "
        "frozen; 1-bit compressed momentum in between; a variance step decays v by b2 "
        "(DeepSpeed's EMA over variance steps).",
        zero_one_step="the same with `variance_ema='per_step'`: a variance step decays v by "
        "b2 per step since the previous one (b2^gap), with weight 1 - b2^gap for the new mean "
        "gradient squared: an EMA over Adam's horizon in steps, however sparse the variance "
        "steps.",
        onebit_restart=f"the `onebit` run up to step {half}; there a new `onebit_adam` state "
        f"(same freeze rule, schedule continued: `lambda c: schedule(c + {half})`) from its "
        "parameters: a second full-precision warmup measures the new variance and freezes it "
        "again. Public API only.",
        diloco=f"benchmarks/_diloco.py: {cfg.get('diloco_inner_steps')} inner `optax.adamw` "
        "steps per device on its own data (its gradient clipped on its own), then the mean "
        "pseudo-gradient through `optax.sgd(outer lr "
        f"{cfg.get('diloco_outer_lr')}, momentum=0.9, nesterov=True)`; the inner states stay with "
        "their device; a float32 all-reduce of the model every H steps. The preconditioner table "
        "shows device 0's inner v.",
        adamw_noshift="the control: `adamw` with prose for all the steps (same seeds, same "
        "first half).",
        onebit_noshift="the control: `onebit` with prose for all the steps.")[kind])
  L.append("")

  # ---- freeze / refresh facts
  facts = []
  for r in results["runs"]:
    last = r["info"][-1] if r["info"] else {}
    if r["kind"] in ("onebit", "onebit_noshift"):
      facts.append(f"{r['kind']} seed {r['seed']}: froze at step {last.get('freeze_step')}")
    elif r["kind"] == "onebit_restart":
      facts.append(f"restart seed {r['seed']}: the new state froze {last.get('freeze_step')} "
                   f"steps after the shift (step {half + (last.get('freeze_step') or 0)})")
    elif r["kind"] in ("zero_one", "zero_one_step"):
      at_half = _at(r, "info", half) or {}
      nb, na = at_half.get("variance_updates"), last.get("variance_updates")
      per_step = r["kind"] == "zero_one_step"  # weighs by steps: the last variance steps' counts
      key, how = (("variance_step", "per-step EMA") if per_step else
                  ("variance_updates", "b2 EMA over variance steps"))
      wb, wa = at_half.get(key), last.get(key)
      share = (f"; the post-shift variance steps carry {100 * _post_shift_weight(cfg['b2'], wb, wa - wb):.0f}% "
               f"of the weight of its bias-corrected v at the end ({how})"
               if wb is not None and wa is not None else "")
      name = "0/1 per-step EMA" if per_step else "0/1"
      facts.append(f"{name} seed {r['seed']}: {nb} variance steps by "
                   f"the shift, {na} by step {r['steps'][-1]} "
                   f"(interval then {last.get('var_interval')}){share}")
  if facts:
    L.append("Freeze and refresh: " + "; ".join(facts) + ".\n")

  # ---- loss table
  L += ["## Held-out loss\n",
        "Mean ± s.e. over seeds (fixed subset of the held-out windows; *final*: all of them).\n",
        "| optimizer | " + " | ".join(f"{name} (step {s}) prose / code" for name, s in _points(cfg))
        + " | final prose / code |",
        "|---|" + "---|" * (len(_points(cfg)) + 1)]
  for kind in kinds:
    runs = _runs(results, kind)
    cells = []
    for _, s in _points(cfg):
      p = _mean_se(_at(r, "val_prose", s) for r in runs)
      c = _mean_se(_at(r, "val_code", s) for r in runs)
      cells.append(f"{_fmt(*p[:2])} / {_fmt(*c[:2])}")
    p = _mean_se(r.get("final_prose") for r in runs)
    c = _mean_se(r.get("final_code") for r in runs)
    cells.append(f"{_fmt(*p[:2])} / {_fmt(*c[:2])}")
    L.append(f"| {LABELS[kind]} | " + " | ".join(cells) + " |")
  ad = _runs(results, "adamw", done_only=True)
  if len(ad) > 1:
    fp = np.array([r["final_prose"] for r in ad]); fc = np.array([r["final_code"] for r in ad])
    L.append(f"\nSeed noise of AdamW itself (std over seeds / mean): final prose "
             f"{100 * fp.std(ddof=1) / fp.mean():.2f}%, final code "
             f"{100 * fc.std(ddof=1) / fc.mean():.2f}%.")
  L.append("")

  # ---- gap table
  L += ["## Gap to AdamW (paired, relative)\n",
        "100 x (loss / AdamW's loss, same seed - 1), mean ± s.e. over seeds; negative: better "
        "than AdamW. *In-distribution*: prose up to the shift, code after it.\n",
        "| optimizer | prose, steps (" + half_q(results) + "] (before) | code, steps ("
        + after_q(results) + "] (after) | change (points) | " + " | ".join(
            f"{'prose' if s <= half else 'code'} at step {s}" for _, s in _points(cfg))
        + " | final code | final prose (forgetting) |",
        "|---|---|---|---|" + "---|" * (len(_points(cfg)) + 2)]
  for kind in kinds:
    if kind not in MAIN or kind == "adamw":
      continue
    s = summ[kind]
    cells = [_fmt(*s["before_ms"][:2], 2, True), _fmt(*s["after_ms"][:2], 2, True),
             _pp(*s["delta_ms"][:2])]
    for _, st in _points(cfg):
      key = "val_prose" if st <= half else "val_code"
      cells.append(_fmt(*_mean_se(_paired(results, kind, key, st).values())[:2], 2, True))
    cells.append(_fmt(*_mean_se(_paired(results, kind, "final_code", None).values())[:2], 2, True))
    cells.append(_fmt(*_mean_se(_paired(results, kind, "final_prose", None).values())[:2], 2,
                      True))
    L.append(f"| {LABELS[kind]} | " + " | ".join(cells) + " |")
  if "onebit_noshift" in summ:
    c = summ["onebit_noshift"]
    L += ["", "Control (no shift, prose throughout; paired with AdamW without the shift): "
          f"1-bit Adam's gap on prose {_fmt(*c['before_ms'][:2], 2, True)} in steps "
          f"({half_q(results)}], {_fmt(*c['after_ms'][:2], 2, True)} in steps ({after_q(results)}]"
          f", change {_pp(*c['delta_ms'][:2])} points; final prose "
          + _fmt(*_mean_se(_paired(results, 'onebit_noshift', 'final_prose', None,
                                   base='adamw_noshift').values())[:2], 2, True) + "."]
    if "shift_attributable" in summ.get("onebit", {}):
      L.append("Change with the shift minus change without it, per seed (points): " + ", ".join(
          f"seed {k}: {v:+.2f}" for k, v in sorted(summ["onebit"]["shift_attributable"].items()))
          + ".")
  per_seed = []
  for kind in kinds:
    if kind in summ:
      d = summ[kind]["delta"]
      per_seed.append(f"{kind}: " + ", ".join(f"seed {k}: {v:+.2f}" for k, v in sorted(d.items())))
  if per_seed:
    L.append("\nChange of the gap per seed (points): " + "; ".join(per_seed) + ".")
  L.append("")

  # ---- bytes
  L += ["## Bytes sent per device\n",
        "Cumulative bytes one device sent (each optimizer's own `wire_bytes` per step; AdamW: "
        "a float32 ring all-reduce of the gradients every step), mean over seeds.\n",
        f"| optimizer | by step {half} | by step {T} | AdamW's / these (whole run) | "
        f"after the shift only | AdamW's / these (after the shift) |",
        "|---|---|---|---|---|---|"]
  ad_half = np.mean([_at(r, "bytes", half) for r in _runs(results, "adamw")
                     if _at(r, "bytes", half) is not None] or [np.nan])
  ad_end = np.mean([_at(r, "bytes", T) for r in _runs(results, "adamw")
                    if _at(r, "bytes", T) is not None] or [np.nan])
  for kind in kinds:
    runs = _runs(results, kind)
    bh = np.mean([_at(r, "bytes", half) for r in runs if _at(r, "bytes", half) is not None]
                 or [np.nan])
    be = np.mean([_at(r, "bytes", T) for r in runs if _at(r, "bytes", T) is not None] or [np.nan])
    L.append(f"| {LABELS[kind]} | {bh / 1e6:.1f} MB | {be / 1e6:.1f} MB | {ad_end / be:.1f}x | "
             f"{(be - bh) / 1e6:.1f} MB | {(ad_end - ad_half) / (be - bh):.1f}x |")
  L.append("")

  # ---- preconditioner
  L += ["## The preconditioner\n",
        "Sum of the bias-corrected second moment that each optimizer divides by, per parameter "
        "group, relative to AdamW's at the same step and seed (1.00: the same overall scale as "
        "the fresh Adam variance; below 1: larger steps than AdamW would take, above 1: "
        f"smaller), at the shift (step {half}) and the end (step {T}); mean over seeds. Last "
        "row: how much AdamW's own variance moved from the shift to the end.\n",
        "| optimizer | " + " | ".join(f"{g} {half} / {T}" for g in GROUPS) + " |",
        "|---|" + "---|" * len(GROUPS)]
  def ratio(kind, g, step):
    ref = {r["seed"]: r for r in _runs(results, _base(kind))}
    vals = []
    for r in _runs(results, kind):
      b = ref.get(r["seed"])
      if b is None:
        continue
      x, y = _at(r, "v_hat", step), _at(b, "v_hat", step)
      if x and y and y[g] > 0:
        vals.append(x[g] / y[g])
    return f"{np.mean(vals):.2f}" if vals else "—"
  for kind in kinds:
    if kind in ("adamw", "adamw_noshift"):
      continue
    L.append(f"| {LABELS[kind]} | " + " | ".join(
        f"{ratio(kind, g, half)} / {ratio(kind, g, T)}" for g in GROUPS) + " |")
  moved = []
  for g in GROUPS:
    vals = [(_at(r, "v_hat", T) or {}).get(g, np.nan) / (_at(r, "v_hat", half) or {}).get(g, np.nan)
            for r in _runs(results, "adamw") if _at(r, "v_hat", T) and _at(r, "v_hat", half)]
    moved.append(f"{np.mean(vals):.2f}" if vals else "—")
  L.append("| AdamW: v(end) / v(shift) | " + " | ".join(moved) + " |")
  L.append("")

  L += _verdict(results, summ)
  L += _advice(results, summ)
  L.append("![val loss vs step](data_shift.png)\n" if not out.endswith("_quick") else
           "![val loss vs step](data_shift_quick.png)\n")
  with open(out + ".md", "w") as f:
    f.write("\n".join(L) + "\n")
  _plot(results, out + ".png")


def _plot(results, path):
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    return
  cfg = results["config"]
  half = cfg["steps"] // 2
  colors = dict(adamw="k", onebit="tab:red", zero_one="tab:blue", zero_one_step="tab:purple",
                diloco="tab:orange", onebit_restart="tab:green",
                adamw_noshift="gray", onebit_noshift="salmon")
  styles = dict(onebit_restart="--", adamw_noshift=":", onebit_noshift=":")
  fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
  for kind in _kinds(results):
    ref = {r["seed"]: r for r in _runs(results, _base(kind))}
    runs = _runs(results, kind)
    for ax, key in zip(axes[:2], ("val_prose", "val_code")):
      for i, r in enumerate(runs):
        ax.plot(r["steps"], r[key], color=colors.get(kind), alpha=0.8, lw=1.2,
                ls=styles.get(kind, "-"), label=LABELS[kind] if i == 0 else None)
    if kind in ("adamw", "adamw_noshift"):
      continue
    for i, r in enumerate(runs):
      b = ref.get(r["seed"])
      if b is None:
        continue
      st = [s for s in r["steps"] if s in b["steps"] and s > 0]
      key = lambda s: ("val_prose" if s <= half or kind.endswith("_noshift") else "val_code")
      gap = [100 * (_at(r, key(s), s) / _at(b, key(s), s) - 1) for s in st]
      axes[2].plot(st, gap, color=colors.get(kind), alpha=0.8, lw=1.2, ls=styles.get(kind, "-"),
                   label=LABELS[kind] if i == 0 else None)
  titles = ("held-out loss, prose", "held-out loss, Python source",
            "gap to AdamW on the training distribution (%)\n(control: to AdamW without the shift)")
  for ax, title in zip(axes, titles):
    ax.axvline(half, color="gray", ls=":", lw=1)
    ax.set_title(title)
    ax.set_xlabel("step")
  axes[2].axhline(0, color="k", lw=0.8)
  axes[0].set_ylabel("cross-entropy (nats/byte)")
  for ax in axes[:2]:
    lo = min(min(r["val_prose" if ax is axes[0] else "val_code"]) for r in results["runs"])
    ax.set_ylim(lo - 0.05, lo + 1.2)
  axes[1].legend(fontsize=8)
  fig.suptitle(f"char GPT, prose -> Python source at step {half} (dotted line); one line per seed")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
