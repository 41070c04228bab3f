"""Where 1-bit Adam's gap to AdamW on the digits MLP comes from (issue 10).

    .venv/bin/python benchmarks/digits_gap.py          # 5-8 min on 2 cores
    .venv/bin/python benchmarks/digits_gap.py --quick  # 2 seeds, fewer rows (a smoke run)

The digits task of ``_conv_tasks.py`` (64-256-256-10 MLP, 300 steps, 8
simulated devices, 8 seeds, same schedule, weight decay and mask for every
optimizer), trained by the runner of ``_conv_runner.py`` with a few extra
optimizer *kinds*, all same-seed (same initialisation, same batches):

* ``adamw``: optax.adamw on the float32 mean gradient (the baseline);
* ``onebit``: onebit_adam with the default freeze rule (its step T0 is read
  per seed and reused by the rows below, so "default T0" rows are paired);
* ``fixed``: onebit_adam frozen after T0 (at the default T0 it is the same
  trajectory as ``onebit``: a consistency check);
* ``fixed_raw``: the same without floor and clip (``variance_floor=0``,
  ``max_update=inf``);
* ``ref``: *frozen-variance Adam without compression*: Adam on the float32
  mean gradient whose ``nu`` stops updating after T0, with the package's
  post-freeze rule (v_hat floored at 1% of its leaf's mean, step clipped at
  ``adam_update_bound``); ``ref_raw``: the same without floor and clip;
  ``ref_f0.1``, ``ref_f1``: floor 0.1 and 1;
* ``ref_leaf``: ``ref`` whose frozen v_hat is rescaled, leaf by leaf, to the
  mean of the *live* Adam v_hat of that leaf (an oracle: it keeps the frozen
  per-coordinate shape and only lets each leaf's scale follow Adam's);
* ``ref_shape``: the converse oracle, the live per-coordinate v_hat rescaled to
  the frozen leaf mean (the shape follows Adam, the scale stays frozen).

The decomposition at AdamW's lr (1e-2): adamw -> ref (cost of freezing v) ->
fixed (cost of the 1-bit compression on top). Evaluation: the whole held-out
set every 10 steps; "val" is the loss after step 300, "last-5" the mean of the
evaluations at steps 260..300 (less noisy). Also: a finer lr sweep of AdamW
and of 1-bit Adam (default rule), AdamW's ||v_hat_t||_1 drift after T0, and
adamw / onebit / ref at the default T0 on 16 more seeds (8..23), pooled to 24:
seeds 8..23 also play fresh seeds for AdamW's lr, picked on seeds 0..7.
Writes benchmarks/results/digits_gap.md and .json (``--out``).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any, NamedTuple  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _conv_report  # noqa: E402
import _conv_runner  # noqa: E402
import _conv_tasks  # noqa: E402
import onebit_optax  # noqa: E402

AXIS = _conv_runner.AXIS
LR = 1e-2  # AdamW's best on the convergence protocol's sweep.
FIXED_T0 = (15, 45, 75)  # 5%, 15%, 25% of the 300 steps.
LR_SWEEP = (3e-3, 5e-3, 1e-2, 2e-2, 3e-2)
EXTRA_SEEDS = 16  # more seeds (8..23) for the three rows the diagnosis rests on.
LAST = 5  # evaluations averaged for "last-5" (every 10 steps: steps 260..300).

# kind -> (variance_floor, max_update) of onebit_adam (fixed freeze step).
PKG_KINDS = {
    "fixed_raw": (0.0, float("inf")),
    "fixed_noclip": (0.01, float("inf")),
    "fixed_f0.1": (0.1, None),
}
# kind -> (variance_floor, max_update, how the frozen v_hat is used)
REF_KINDS = {
    "ref": (0.01, None, "frozen"),
    "ref_raw": (0.0, float("inf"), "frozen"),
    "ref_noclip": (0.01, float("inf"), "frozen"),
    "ref_f0.1": (0.1, None, "frozen"),
    "ref_leaf": (0.01, None, "leaf_scale"),
    "ref_shape": (0.01, None, "live_shape"),
}


# ----------------------------------------------------------------------------
# The uncompressed reference: Adam whose variance stops after T0.


class FrozenAdamState(NamedTuple):
  count: jax.Array
  mu: Any
  nu: Any  # the live Adam variance, updated every step.
  nu_frozen: Any  # nu after step T0 (follows nu until then).


def scale_by_frozen_adam(freeze_at, b1=0.9, b2=0.999, eps=1e-8, variance_floor=0.01,
                         max_update=None, mode="frozen"):
  """optax.scale_by_adam until step ``freeze_at``; then the package's post-freeze step.

  The post-freeze step is ``_leaf_update`` of onebit_optax/_onebit_adam.py on
  the uncompressed momentum: v_hat = nu_{T0} / (1 - b2^T0), floored at
  ``variance_floor`` x its leaf's mean (p = 0 where v_hat = 0), the step
  clipped at ``max_update`` (None: ``adam_update_bound``).
  """
  bound = onebit_optax.adam_update_bound(b1, b2) if max_update is None else max_update

  def init(params):
    zeros = lambda: jax.tree.map(jnp.zeros_like, params)
    return FrozenAdamState(jnp.zeros([], jnp.int32), zeros(), zeros(), zeros())

  def update(grads, state, params=None):
    del params
    count = state.count + 1
    warm = count <= freeze_at
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, grads)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, grads)
    nu_frozen = jax.tree.map(lambda v, f: jnp.where(warm, v, f), nu, state.nu_frozen)
    c = count.astype(jnp.float32)
    bc1, bc2 = 1 - b1 ** c, 1 - b2 ** c
    bc2_frozen = 1 - b2 ** jnp.minimum(c, jnp.asarray(freeze_at, jnp.float32))

    def leaf(m, v, vf):
      m_hat, v_hat, vf_hat = m / bc1, v / bc2, vf / bc2_frozen
      adam = m_hat / (jnp.sqrt(v_hat) + eps)
      if mode == "leaf_scale":  # frozen shape, live leaf scale.
        vf_hat = vf_hat * jnp.mean(v_hat) / jnp.maximum(jnp.mean(vf_hat), 1e-30)
      elif mode == "live_shape":  # live shape, frozen leaf scale.
        vf_hat = v_hat * jnp.mean(vf_hat) / jnp.maximum(jnp.mean(v_hat), 1e-30)
      floor = variance_floor * jnp.mean(vf_hat)
      p = jnp.where(vf_hat > 0, 1.0 / (jnp.sqrt(jnp.maximum(vf_hat, floor)) + eps), 0.0)
      return jnp.where(warm, adam, jnp.clip(m_hat * p, -bound, bound))

    updates = jax.tree.map(leaf, mu, nu, nu_frozen)
    return updates, FrozenAdamState(count, mu, nu, nu_frozen)

  return optax.GradientTransformation(init, update)


class GapRunner(_conv_runner.Runner):
  """The convergence runner with the kinds above; evaluates the whole held-out set."""

  kinds = _conv_runner.KINDS + tuple(PKG_KINDS) + tuple(REF_KINDS)
  replicated_kinds = _conv_runner.Runner.replicated_kinds + tuple(REF_KINDS)

  def __init__(self, task, mesh):
    super().__init__(task, mesh)
    self.val_periodic = self.val_full  # 360 images: cheap enough at every evaluation.

  def make_tx(self, kind, freeze_at=1):
    kw = dict(b2=self.b2, weight_decay=self.task.weight_decay, mask=self.task.decay_mask)
    if kind in PKG_KINDS:
      floor, max_update = PKG_KINDS[kind]
      return onebit_optax.onebit_adam(self.schedule, axis_name=AXIS, freeze=freeze_at,
                                      variance_floor=floor, max_update=max_update, **kw)
    if kind in REF_KINDS:
      floor, max_update, mode = REF_KINDS[kind]
      decay = optax.masked(optax.add_decayed_weights(kw["weight_decay"]), kw["mask"])
      return optax.chain(
          scale_by_frozen_adam(freeze_at, b2=self.b2, variance_floor=floor,
                               max_update=max_update, mode=mode),
          decay, optax.scale_by_learning_rate(self.schedule))
    return super().make_tx(kind, freeze_at)

  def _train_step(self, kind, params, carry, batch, lr, freeze_at):
    if kind not in REF_KINDS:
      return super()._train_step(kind, params, carry, batch, lr, freeze_at)
    tx = self.make_tx(kind, freeze_at)
    loss_fn = lambda p: (lambda t, n: t / n)(*self.task.loss_sums(p, batch))
    loss, grads = jax.value_and_grad(loss_fn)(onebit_optax.local_params(params, AXIS))
    updates, opt = tx.update(jax.lax.pmean(grads, AXIS), carry["opt"], params)
    params = optax.apply_updates(params, jax.tree.map(lambda u: lr * u, updates))
    nan = jnp.float32(jnp.nan)
    metrics = dict(nu_l1=nan, ratio=nan, frozen=jnp.bool_(False),
                   wire=jnp.float32(self.allreduce_bytes))
    return params, dict(carry, opt=opt, step=carry["step"] + 1), (loss[None], metrics)

  def run(self, kind, lr, seed, freeze_at=1):
    rec = super().run(kind, lr, seed, freeze_at)
    if kind in REF_KINDS:
      rec["freeze_step"] = freeze_at
    vals = np.asarray(rec["val"])
    rec["last"] = float(vals[-LAST:].mean())
    rec["train_last"] = float(np.mean(rec["loss"][-50:]))  # training loss, last 50 steps.
    return rec


# ----------------------------------------------------------------------------


def _paired(recs, base, key):
  a = np.array([r[key] for r in recs])
  b = np.array([base[r["seed"]][key] for r in recs])
  rel = (a / b - 1) * 100
  return rel.mean(), (rel.std(ddof=1) if len(rel) > 1 else 0.0)


def _row(label, recs, base, allreduce_total):
  vals = np.array([r["final_val"] for r in recs])
  last = np.array([r["last"] for r in recs])
  bad = int(np.sum(~(vals < 10)))
  if bad:  # diverged seeds (val loss > 10 or non-finite): no mean.
    return (f"| {label} | diverged ({bad}/{len(vals)} seeds: val > 10) | — | — | — | — | "
            f"{allreduce_total / np.mean([r['total_bytes'] for r in recs]):.2f}x |")
  out = [label, f"{vals.mean():.4f} ± {vals.std(ddof=1) if len(vals) > 1 else 0:.4f}"]
  if base is None:
    out += ["—", "—"]
  else:
    out += ["{:+.1f} ± {:.1f}%".format(*_paired(recs, base, "final_val")),
            "{:+.1f} ± {:.1f}%".format(*_paired(recs, base, "last"))]
  out.append(f"{last.mean():.4f}")
  out.append(f"{np.mean([r['train_last'] for r in recs]):.4f}")
  reduction = allreduce_total / np.mean([r["total_bytes"] for r in recs])
  out.append(f"{reduction:.2f}x")
  return "| " + " | ".join(out) + " |"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                    "results"))
  args = parser.parse_args(argv)
  command = "python benchmarks/digits_gap.py" + " ".join([""] + (argv or sys.argv[1:]))
  assert len(jax.devices()) == 8
  mesh = jax.make_mesh((8,), (AXIS,))
  (task,) = _conv_tasks.make_tasks(["digits"])
  task = dataclasses.replace(task, chunk=10)  # evaluate every 10 steps (batches do not depend on it).
  seeds = range(2 if args.quick else task.seeds)
  fixed_t0 = FIXED_T0[1:2] if args.quick else FIXED_T0
  lr_sweep = (5e-3, 2e-2) if args.quick else LR_SWEEP
  meta = _conv_report.machine_meta(command, quick=args.quick)
  wall0 = time.time()
  runner = GapRunner(task, mesh)
  allreduce_total = runner.allreduce_bytes * task.steps
  runs: dict[tuple, list] = {}

  def go(kind, lr, t0=None, seed_t0=None, seed_list=None):
    key = (kind, lr, t0)
    if key in runs:
      return runs[key]
    recs = []
    for s in (seeds if seed_list is None else seed_list):
      freeze_at = seed_t0[s] if seed_t0 is not None else (t0 if isinstance(t0, int) else 1)
      recs.append(runner.run(kind, lr, s, freeze_at=freeze_at))
    runs[key] = recs
    print(f"  {kind:12s} lr {lr:.0e} T0 {t0 or '-'}: val "
          f"{np.mean([r['final_val'] for r in recs]):.4f} last-{LAST} "
          f"{np.mean([r['last'] for r in recs]):.4f}  (t+{(time.time() - wall0) / 60:.1f} min)",
          flush=True)
    return recs

  # Sanity: the reference never frozen is AdamW.
  check = runner.run("ref", LR, 0, freeze_at=task.steps + 1)
  adamw = go("adamw", LR)
  sanity = abs(check["final_val"] / adamw[0]["final_val"] - 1)
  print(f"ref never frozen vs adamw, seed 0: {check['final_val']:.6f} vs "
        f"{adamw[0]['final_val']:.6f}", flush=True)
  base = {r["seed"]: r for r in adamw}
  onebit = go("onebit", LR)
  default_t0 = {r["seed"]: r["freeze_step"] for r in onebit}
  kinds = ("ref", "ref_raw", "ref_noclip", "ref_f0.1", "ref_leaf", "ref_shape",
           "fixed", "fixed_raw", "fixed_noclip", "fixed_f0.1")
  for kind in kinds:
    go(kind, LR, "default", default_t0)
  for t0 in fixed_t0:
    for kind in ("fixed", "ref"):
      go(kind, LR, t0)

  # The rows the diagnosis rests on, on more seeds (pooled with the first ones).
  extra = range(len(seeds), len(seeds) + (0 if args.quick else EXTRA_SEEDS))
  pooled = dict(adamw=adamw, onebit=onebit, ref=runs[("ref", LR, "default")])
  if len(extra):
    ext_adamw = go("adamw", LR, "extra seeds", seed_list=extra)
    ext_onebit = go("onebit", LR, "extra seeds", seed_list=extra)
    ext_t0 = {r["seed"]: r["freeze_step"] for r in ext_onebit}
    ext_ref = go("ref", LR, "extra seeds, default", ext_t0, seed_list=extra)
    pooled = dict(adamw=adamw + ext_adamw, onebit=onebit + ext_onebit, ref=pooled["ref"] + ext_ref)

  # ||v_hat_t||_1 of AdamW after T0: how far the frozen variance drifts from Adam's.
  def drift(rec, t0):
    l1 = np.asarray(rec["nu_l1"])
    return l1[task.steps - 1] / l1[t0 - 1]

  drift_default = [drift(base[s], default_t0[s]) for s in seeds]
  drift_fixed = {t0: [drift(base[s], t0) for s in seeds] for t0 in fixed_t0}

  # The finer lr sweep, both optimizers.
  sweep = {lr: (go("adamw", lr), go("onebit", lr)) for lr in lr_sweep}
  meta = _conv_report.finish_meta(meta, wall0)

  # --------------------------------------------------------------------------
  lines = []
  add = lines.append
  add("# Digits: where 1-bit Adam's gap to AdamW comes from\n")
  add(f"Command: `{meta['command']}`  ")
  add(f"jax {meta['jax']}, optax {meta['optax']}, onebit_optax {meta['onebit_optax']} at "
      f"{meta['git']}; {meta['machine']}; started {meta['started']}; wall time "
      f"{meta['wall_s'] / 60:.1f} min.  ")
  add(f"Machine load (`uptime`) at start: `{meta['uptime_start']}`; at end: "
      f"`{meta['uptime_end']}`.\n")
  add(f"{task.title}; {task.steps} steps, global batch {task.batch_per_device * 8} on 8 "
      f"simulated devices, LR warmup {task.warmup} steps then cosine to 10%, weight decay "
      f"{task.weight_decay} on matrices, b1 = 0.9, b2 = {runner.b2}, for every optimizer; "
      f"{len(seeds)} seeds, every row same-seed with AdamW (same initialisation and "
      "batches). Loss on the whole held-out set (360 images): *val* after step 300, "
      f"*last-{LAST}* the mean of the evaluations at steps "
      f"{task.steps - task.chunk * (LAST - 1)}..{task.steps}. *Paired*: mean ± std over "
      "seeds of the same-seed relative difference to AdamW.\n")
  add(f"Sanity: `ref` never frozen vs AdamW, seed 0: {check['final_val']:.6f} vs "
      f"{adamw[0]['final_val']:.6f} (relative {sanity:.1e}).\n")
  add(f"## Decomposition at lr {LR:g} (AdamW's best)\n")
  add("Default T0: the step the default rule fired at, per seed: "
      f"{[default_t0[s] for s in seeds]}. `fixed` at the default T0 replays `onebit` "
      "(same trajectory).\n")
  add("| optimizer | val | paired vs AdamW (val) | paired vs AdamW (last-5) | last-5 | "
      "train loss (last 50 steps) | comm. reduction |")
  add("|---|---|---|---|---|---|---|")
  add(_row("AdamW", adamw, None, allreduce_total))
  labels = {
      "onebit": "1-bit Adam, default rule",
      "fixed": "1-bit Adam, fixed T0",
      "fixed_raw": "1-bit Adam, no floor/clip",
      "fixed_f0.1": "1-bit Adam, floor 0.1",
      "fixed_noclip": "1-bit Adam, floor, no clip",
      "ref_f0.1": "frozen-v Adam, fp32 mean, floor 0.1",
      "ref_noclip": "frozen-v Adam, fp32 mean, floor, no clip",
      "ref": "frozen-v Adam, fp32 mean (floor+clip)",
      "ref_raw": "frozen-v Adam, fp32 mean, no floor/clip",
      "ref_leaf": "frozen-v Adam, leaf scale follows Adam (oracle)",
      "ref_shape": "frozen-v Adam, shape follows Adam, leaf scale frozen (oracle)",
  }
  add(_row(f"{labels['onebit']} (T0 default)", onebit, base, allreduce_total))
  for kind in kinds:
    add(_row(f"{labels[kind]} (T0 default)", runs[(kind, LR, "default")], base,
             allreduce_total))
  for t0 in fixed_t0:
    for kind in ("fixed", "ref"):
      add(_row(f"{labels[kind]} (T0 = {t0})", runs[(kind, LR, t0)], base, allreduce_total))
  add("")
  add("AdamW's ||v_hat_300||_1 / ||v_hat_T0||_1 (how much smaller Adam's variance is at "
      "the end than the frozen one; the step scales as its inverse square root): "
      f"default T0: {np.mean(drift_default):.3f} [{np.min(drift_default):.3f}–"
      f"{np.max(drift_default):.3f}]; "
      + "; ".join(f"T0 = {t0}: {np.mean(v):.3f}" for t0, v in drift_fixed.items()) + ".\n")
  n_pooled = len(pooled["adamw"])
  add(f"### The same at default T0 on {n_pooled} seeds (0..{n_pooled - 1})\n")
  add("Paired relative difference of the final val loss, mean ± std over seeds, and the "
      "standard error of the mean (std/sqrt(n)).\n")
  add("| comparison | paired difference | s.e. | seeds where the first is worse |")
  add("|---|---|---|---|")
  for name, (x, y) in {
      "1-bit Adam (default rule) vs AdamW": ("onebit", "adamw"),
      "frozen-v Adam fp32 (same T0) vs AdamW": ("ref", "adamw"),
      "1-bit Adam vs frozen-v Adam fp32 (same T0)": ("onebit", "ref")}.items():
    by = {r["seed"]: r for r in pooled[y]}
    rel = np.array([(r["final_val"] / by[r["seed"]]["final_val"] - 1) * 100 for r in pooled[x]])
    add(f"| {name} | {rel.mean():+.1f} ± {rel.std(ddof=1):.1f}% | "
        f"{rel.std(ddof=1) / np.sqrt(len(rel)):.1f}% | {int(np.sum(rel > 0))}/{len(rel)} |")
  add("")
  add("## Learning-rate sweep (finer), same seeds\n")
  add("| peak lr | AdamW val | AdamW last-5 | 1-bit Adam val | 1-bit last-5 | 1-bit vs AdamW "
      "same lr, paired (val) | default rule fired at |")
  add("|---|---|---|---|---|---|---|")
  for lr, (a, o) in sweep.items():
    b = {r["seed"]: r for r in a}
    fmt = lambda recs, k: (f"{np.mean([r[k] for r in recs]):.4f} ± "
                           f"{np.std([r[k] for r in recs], ddof=1):.4f}")
    fired = [r["freeze_step"] for r in o if r["freeze_step"]]
    add(f"| {lr:g} | {fmt(a, 'final_val')} | {fmt(a, 'last')} | {fmt(o, 'final_val')} | "
        f"{fmt(o, 'last')} | " + "{:+.1f} ± {:.1f}%".format(*_paired(o, b, "final_val"))
        + f" | {int(np.median(fired)) if fired else 'never'} |")
  md = "\n".join(lines) + "\n"
  stem = os.path.join(args.out, "digits_gap_quick" if args.quick else "digits_gap")
  keep = ("seed", "final_val", "last", "train_last", "freeze_step", "total_bytes", "eval_steps", "val")
  with open(stem + ".json", "w") as f:
    json.dump(dict(meta=meta, runs=[dict(kind=k[0], lr=k[1], t0=k[2],
                                         recs=[{x: r[x] for x in keep} for r in v])
                                    for k, v in runs.items()]), f)
  with open(stem + ".md", "w") as f:
    f.write(md)
  print()
  print(md)
  print(f"wrote {stem}.md ({meta['wall_s'] / 60:.1f} min)")


if __name__ == "__main__":
  main()
