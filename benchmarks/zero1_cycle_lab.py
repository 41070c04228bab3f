"""Lab for issue 25, item 4: 1-bit Adam whose warmup moments live in the per-device buffer (ZeRO-1 warmup), whole cycle.

    .venv/bin/python benchmarks/zero1_cycle_lab.py                     # 10M, the 6-leaf tree, 2 devices
    .venv/bin/python benchmarks/zero1_cycle_lab.py --leaves 300 --size 4e6 --out /tmp/z.md

Not the package: a prototype of the state layout that the memory goal needs,
built from the package's own pieces, to measure what the route costs before
anyone rebuilds the package on it. ``benchmarks/zero1_warmup_lab.py`` measured
the warmup alone; this one runs the whole cycle in one compiled program, as
the package does (warmup, the freeze, compression), because the question it
could not answer is what the freeze costs: there the sharded moments must
become the replicated preconditioner and every device's momentum.

The prototype's state per device: ``nu`` (a tree like the parameters,
replicated: :math:`D`), ``local_momentum`` (per group of leaves of one shape,
per device: :math:`D`; during the warmup it holds this device's shards of
:math:`m` and :math:`v`, :math:`2 \\lceil kS/n \\rceil` of its :math:`kS` elements;
after the freeze the momentum it compressed last, as in the package), the
server error (:math:`D/n`), the message (:math:`D/32`), and the exact leaves'
:math:`m` (a few floats). No ``mu``: :math:`2D + D/n + D/32` against the
package's :math:`3D + D/n + D/32`.

- **Warmup**: per group, the stacked local gradients reduce-scattered
  (``psum_scatter``), Adam on this device's shard, written into the buffer as
  one elementwise expression in its own shape (``m`` on the first ``c``
  elements of its flat index, ``v`` on the next ``c``; a
  ``dynamic_update_slice`` through a reshape of the buffer was copied); the
  update's shard gathered replicated (``all_gather(..., to='invarying')``):
  the bytes of one all-reduce. The exact leaves: one ``psum``; their ``m`` and
  ``v`` in small replicated vectors, ``v`` moved into ``nu`` at the freeze.
- **Freeze** (a ``lax.cond`` at the fixed freeze step): ``v``'s shards
  gathered into ``nu``; the message zero, the scales zero.
- **The hand-over of m**: :math:`\beta_1 m`, gathered from its shards,
  becomes every device's error feedback (the package's own hand-over: the
  first compressed step sends :math:`(1-\beta_1) g + \beta_1 m`). Two
  places, two contestants: a conditional of its own at the freeze step
  (after the gather of ``v``), or inside the first compressed step's
  conditional, which reads the buffer there before it writes it. A third
  contestant (:func:`lab_update_in_nu`) does the latter and keeps the
  warmup's update in ``nu``, gathering ``v`` there at the first compressed step.
- **Compression**: the package's (stage 1 as ``_write_sent``, ``_compression``,
  the bounded update from the message).

``local_momentum`` is written by two conditionals (compression: ``u``;
warmup: the shards), each passing it through in its *false* branch, before
anything else reads it: a conditional that writes the buffer in both
branches, or a write after another conditional has read it, was compiled
with full copies of the buffer (measured here; the package's ``_switch``
follows the same rule).

Checked: the prototypes' parameters against ``onebit_adam`` with the same fixed
freeze, after the warmup and after compression steps (the same algorithm: they
agree to the warmup's rounding, which the compression's signs then amplify).
Printed per device in a ``--devices`` mesh: state and the compiled train
step's temporaries (``memory_analysis``) in D, their sum, and the step time in
each phase against ``optax.adam`` + ``pmean`` and the package (interleaved
repeats, median). Writes ``benchmarks/results/zero1_cycle_lab.md``.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple


def _devices(argv) -> int:
  for i, a in enumerate(argv):
    if a == "--devices":
      return int(argv[i + 1])
    if a.startswith("--devices="):
      return int(a.split("=", 1)[1])
  return 2


DEVICES = _devices(sys.argv[1:])
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={DEVICES}").strip()

import jax  # noqa: E402  (XLA_FLAGS must be set first)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import _provenance  # noqa: E402
import onebit_optax  # noqa: E402
from onebit_optax import _bounded, _collective, _groups, _onebit_adam as _ob, _wire  # noqa: E402
import zero_one_compute as zc  # noqa: E402  (its trees; one XLA intra-op thread)

AXIS = "data"
B1, B2, EPS, LR = 0.9, 0.999, 1e-8, 1e-3
F32 = jnp.float32
# Where beta1 m, gathered from its shards, becomes every device's local_momentum: at the freeze step
# (a conditional of its own), or at the first compressed step (inside its conditional); the third
# also keeps the warmup's update in nu (lab_update_in_nu).
HAND_OVERS = ("first compressed step", "freeze step", "first compressed step, update in nu")


class LabState(NamedTuple):
  count: jax.Array  # (), int32.
  nu: Any  # tree like params, float32, replicated: v of the exact leaves (warmup); frozen v after.
  exact_mu: jax.Array  # (exact_size,), float32, replicated: m of the exact leaves.
  exact_nu: jax.Array  # (exact_size,), float32, replicated: v of the exact leaves (warmup).
  nu_l1: jax.Array  # (leaves,), float32: per-leaf sums of nu (set at the freeze).
  local_momentum: tuple  # per group (1, k, *shape), per device: m, v shards (warmup); u' after.
  worker_scale: jax.Array
  feedback_valid: jax.Array
  worker_error: Any  # None (flat mesh).
  server_error: jax.Array
  momentum_message: jax.Array
  frozen: jax.Array
  freeze_step: jax.Array


def _shard(layout, g: int) -> int:
  """This group's shard length per device; both shards must fit in its k*S elements."""
  k, size = len(layout.groups[g]), layout.bits.sizes[layout.groups[g].start]
  c = -(-k * size // DEVICES)
  if 2 * c > k * size:
    raise ValueError(f"group {g}: 2 x {c} shard elements do not fit in {k} x {size}")
  return c


def _gather(x):
  return jax.lax.all_gather(x, AXIS, axis=0, tiled=True, to="invarying")


def _hyper():
  return _ob._Hyper(B1, B2, EPS, 0.01, None, None, False, 64)


def _sent(plan, grads, st, first, hand_over: str):
  """The package's compression stage 1 (``_write_sent``): u = b1 m + (1 - b1) g + e per group.

  ``first`` (the first compressed step, with ``hand_over`` 'first compressed step'): the
  buffer still holds the warmup's shards; e is beta1 m, gathered from them.
  """
  local = st.local_momentum
  if hand_over == "first compressed step":
    local = jax.lax.cond(first, lambda u: _freeze_local(plan, u), lambda u: u, local)
  return _groups.write_sent(jnp.bool_(True), B1, plan.layout, st.momentum_message, grads, local,
                            st.worker_scale[0], st.feedback_valid)


def _warm_moments(plan, grads, local, exact_mu, exact_nu):
  """Adam's moments on this device's shards of every group (written into local_momentum), the exact leaves in full."""
  layout, n = plan.layout, DEVICES
  out = []
  stacked = _groups.stacks(layout, [grads[i] for i in layout.compressed])
  for g, (buf, gs) in enumerate(zip(local, stacked)):
    c, flat = _shard(layout, g), gs.reshape(-1)
    if n * c > flat.size:
      flat = jnp.concatenate([flat, jnp.zeros((n * c - flat.size,), F32)])
    mean = jax.lax.psum_scatter(flat.reshape(n, c), AXIS, scatter_dimension=0) / n
    out.append(_in_place(buf, c, mean))
  if layout.exact:
    e = _collective.psum_leaves([_groups.exact(layout, grads)], AXIS, n)[0] / n
    exact_mu = B1 * exact_mu + (1 - B1) * e
    exact_nu = B2 * exact_nu + (1 - B2) * jnp.square(e)
  return tuple(out), exact_mu, exact_nu


def _flat_index(shape) -> jax.Array:
  """The row-major flat index of every element of an array of ``shape`` (int32, in that shape)."""
  strides = np.cumprod((1,) + tuple(shape[::-1]))[:-1][::-1]
  return sum(jax.lax.broadcasted_iota(jnp.int32, shape, d) * int(s) for d, s in enumerate(strides))


def _in_place(buf, c: int, mean):
  """The buffer with Adam's moments of its shards updated: m on [0, c), v on [c, 2c) of its flat index.

  One elementwise expression in the buffer's own shape (XLA writes it in place):
  the mean's shard is laid out twice along the flat index.
  """
  pad = buf.size - 2 * c
  spread = jnp.concatenate([mean, mean] + ([jnp.zeros((pad,), F32)] if pad else [])).reshape(buf.shape)
  idx, old = _flat_index(buf.shape), buf.astype(F32)
  m = B1 * old + (1 - B1) * spread
  v = B2 * old + (1 - B2) * jnp.square(spread)
  return jnp.where(idx < c, m, jnp.where(idx < 2 * c, v, old)).astype(buf.dtype)


def _warm_updates(plan, grads, local, exact_mu, exact_nu, count):
  """Adam's update of every leaf, from the stored shards (gathered replicated) and the exact leaves."""
  layout = plan.layout
  bc1, bc2 = _bounded.bias_correction(B1, count), _bounded.bias_correction(B2, count)
  adam = lambda m, v: (m / bc1) / (jnp.sqrt(v / bc2) + EPS)
  updates = [jnp.zeros(g.shape, F32) for g in grads]
  for g, (span, buf) in enumerate(zip(layout.groups, local)):
    c, held = _shard(layout, g), buf.reshape(-1).astype(F32)
    full = _gather(adam(held[:c], held[c:2 * c]))[:buf.size].reshape(buf.shape[1:])
    for j, k in enumerate(span):
      updates[layout.compressed[k]] = full[j]
  off, exact = 0, adam(exact_mu, exact_nu)
  for i in layout.exact:
    updates[i] = exact[off:off + layout.sizes[i]].reshape(grads[i].shape)
    off += layout.sizes[i]
  return updates


def _freeze_nu(plan, local, nu, exact_nu):
  """At the freeze: v's shards gathered into nu (the exact leaves' v from their own buffer)."""
  layout = plan.layout
  nus = jax.tree.leaves(nu)
  for g, (span, buf) in enumerate(zip(layout.groups, local)):
    c, held = _shard(layout, g), buf.reshape(-1)
    v = _gather(held[c:2 * c])[:buf.size].reshape(buf.shape[1:])
    for j, k in enumerate(span):
      nus[layout.compressed[k]] = v[j].astype(nus[layout.compressed[k]].dtype)
  off = 0
  for i in layout.exact:
    nus[i] = exact_nu[off:off + layout.sizes[i]].reshape(nus[i].shape)
    off += layout.sizes[i]
  return jax.tree.unflatten(plan.treedef, nus)


def _freeze_local(plan, local):
  """At the freeze: beta1 m, gathered from its shards, becomes every device's local_momentum."""
  out = []
  for g, buf in enumerate(local):
    c = _shard(plan.layout, g)
    m = _gather(buf.reshape(-1)[:c])[:buf.size].reshape(buf.shape)
    out.append(_collective.vary(B1 * m, AXIS).astype(buf.dtype))
  return tuple(out)


def _freeze_message(plan, exact_mu):
  layout = plan.layout
  zeros = jnp.zeros((len(layout.compressed),), F32)
  rows = _wire.rows(layout, [jnp.zeros((layout.bits.used // 8,), jnp.uint8)], zeros, exact_mu)
  return rows, _collective.vary(zeros[None], AXIS)


def _prelude(grads_tree, st: LabState):
  """What both prototypes' steps start from; ``pkg``: the state as the package's stages read it."""
  plan = _groups.plan(grads_tree, _collective.resolve_axes(AXIS, None, caller="lab"), 64)
  count = st.count + 1
  pkg = _ob.ScaleByOnebitAdamState(
      count=count, mu=None, nu=st.nu, nu_l1=st.nu_l1, local_momentum=st.local_momentum,
      worker_scale=st.worker_scale, feedback_valid=st.feedback_valid, worker_error=None,
      server_error=st.server_error, momentum_message=st.momentum_message, frozen=st.frozen,
      freeze_step=st.freeze_step, variance_ratio=None, reference_l1=None, wire_bytes=None,
      skipped_steps=None)
  return (plan, plan.layout, jax.tree.leaves(grads_tree), _hyper(), count,
          _groups.offsets(plan.layout, st.frozen, st.frozen), pkg)


def lab_update(grads_tree, st: LabState, freeze_at: int, hand_over: str):
  plan, layout, grads, hp, count, at, pkg = _prelude(grads_tree, st)
  warming = jnp.logical_not(st.frozen)
  # local_momentum is written by two conditionals that each pass it through in their false branch
  # (one that writes in both branches had its result copied), before anything reads it.
  first = st.frozen & (count == st.freeze_step + 1)
  local = jax.lax.cond(st.frozen, lambda g, u: _sent(plan, g, st._replace(local_momentum=u), first, hand_over),
                       lambda g, u: u, grads, st.local_momentum)
  local, exact_mu, exact_nu = jax.lax.cond(
      warming, lambda g, u, m, v: _warm_moments(plan, g, u, m, v),
      lambda g, u, m, v: (u, m, v), grads, local, st.exact_mu, st.exact_nu)
  ex = jax.lax.cond(st.frozen, lambda g, u: _ob._compression(hp, plan, g, u, pkg, at),
                    lambda g, u: _ob._no_exchange(pkg), grads, local)
  warm = jax.lax.cond(warming, lambda u: _warm_updates(plan, grads, u, exact_mu, exact_nu, count),
                      lambda u: [jnp.zeros(g.shape, F32) for g in grads], local)
  freeze_now = warming & (count == freeze_at)
  # The freeze: v's shards into nu, then beta1 m into every device's local_momentum.
  nu = jax.lax.cond(freeze_now, lambda u, v: _freeze_nu(plan, u, v, exact_nu), lambda u, v: v,
                    local, st.nu)
  if hand_over == "freeze step":
    local = jax.lax.cond(freeze_now, lambda u: _freeze_local(plan, u), lambda u: u, local)
  message, scale = jax.lax.cond(freeze_now, lambda: _freeze_message(plan, exact_mu),
                                lambda: (ex.gathered, ex.worker_scale))
  nu_l1 = jax.lax.cond(freeze_now, lambda v: _groups.sums(jax.tree.leaves(v)), lambda v: st.nu_l1, nu)
  bc2 = _bounded.bias_correction(B2, st.freeze_step)
  scalars = _ob._step_scalars(hp, st.frozen, _bounded.bias_correction(B1, count), bc2, True)
  floors = _bounded.floors(0.01, st.nu_l1, layout.sizes, bc2, st.frozen)
  means = _groups.mean_leaves(layout, ex.gathered, at)
  nus = jax.tree.leaves(nu)  # (the new nu: at the freeze step the update is the warmup's)
  updates = []
  for i, g in enumerate(grads):
    step = _bounded.bounded_step(means[i], nus[i].astype(F32), _groups.at_index(floors, at.leaves[i]),
                                 scalars)
    updates.append(jnp.where(st.frozen, step, warm[i]).astype(g.dtype))
  new = LabState(count, nu, exact_mu, exact_nu, nu_l1, local, scale,
                 jnp.where(st.frozen, True, freeze_now | st.feedback_valid), None,
                 ex.server_error, message, st.frozen | freeze_now,
                 jnp.where(freeze_now, count, st.freeze_step))
  return jax.tree.unflatten(plan.treedef, [-LR * u for u in updates]), new


def _warm_updates_into(plan, grads, local, exact_mu, exact_nu, count, nu):
  """:func:`_warm_updates` written into nu, which holds no variance during the warmup."""
  updates = _warm_updates(plan, grads, local, exact_mu, exact_nu, count)
  return jax.tree.unflatten(plan.treedef, [u.astype(v.dtype) for u, v in zip(updates, jax.tree.leaves(nu))])


def _sent_first(plan, grads, st, first, nu, exact_nu):
  """Stage 1 of a compressed step; the first one also gathers v's shards into nu before it writes."""
  handed, nu = jax.lax.cond(
      first, lambda u, v: (_freeze_local(plan, u), _freeze_nu(plan, u, v, exact_nu)),
      lambda u, v: (u, v), st.local_momentum, nu)
  return _sent(plan, grads, st._replace(local_momentum=handed), first, "none"), nu


def lab_update_in_nu(grads_tree, st: LabState, freeze_at: int):
  """The variant that keeps the warmup's update in nu (whose variance is in the shards until the freeze).

  No zero update in the compressed steps: the update of either phase is read
  off nu (the warmup's update, or the frozen variance the compressed step
  divides by). So nu takes v's shards only at the first compressed step, in the
  conditional that writes local_momentum there (it reads the shards first).
  """
  plan, layout, grads, hp, count, at, pkg = _prelude(grads_tree, st)
  warming = jnp.logical_not(st.frozen)
  first = st.frozen & (count == st.freeze_step + 1)
  local, nu = jax.lax.cond(
      st.frozen,
      lambda g, u, v: _sent_first(plan, g, st._replace(local_momentum=u), first, v, st.exact_nu),
      lambda g, u, v: (u, v), grads, st.local_momentum, st.nu)
  local, exact_mu, exact_nu = jax.lax.cond(
      warming, lambda g, u, m, v: _warm_moments(plan, g, u, m, v),
      lambda g, u, m, v: (u, m, v), grads, local, st.exact_mu, st.exact_nu)
  ex = jax.lax.cond(st.frozen, lambda g, u: _ob._compression(hp, plan, g, u, pkg, at),
                    lambda g, u: _ob._no_exchange(pkg), grads, local)
  nu = jax.lax.cond(warming,
                    lambda u, v: _warm_updates_into(plan, grads, u, exact_mu, exact_nu, count, v),
                    lambda u, v: v, local, nu)
  freeze_now = warming & (count == freeze_at)
  message, scale = jax.lax.cond(freeze_now, lambda: _freeze_message(plan, exact_mu),
                                lambda: (ex.gathered, ex.worker_scale))
  nu_l1 = jax.lax.cond(first, lambda v: _groups.sums(jax.tree.leaves(v)), lambda v: st.nu_l1, nu)
  bc2 = _bounded.bias_correction(B2, st.freeze_step)
  scalars = _ob._step_scalars(hp, st.frozen, _bounded.bias_correction(B1, count), bc2, True)
  floors = _bounded.floors(0.01, nu_l1, layout.sizes, bc2, st.frozen)
  means = _groups.mean_leaves(layout, ex.gathered, at)
  updates = []
  for i, (g, v) in enumerate(zip(grads, jax.tree.leaves(nu))):
    step = _bounded.bounded_step(means[i], v.astype(F32), _groups.at_index(floors, at.leaves[i]),
                                 scalars)
    updates.append(jnp.where(st.frozen, step, v).astype(g.dtype))
  new = LabState(count, nu, exact_mu, exact_nu, nu_l1, local, scale,
                 jnp.where(st.frozen, True, freeze_now | st.feedback_valid), None,
                 ex.server_error, message, st.frozen | freeze_now,
                 jnp.where(freeze_now, count, st.freeze_step))
  return jax.tree.unflatten(plan.treedef, [-LR * u for u in updates]), new


def lab_init(params):
  axes = _collective.resolve_axes(AXIS, None, caller="lab")
  plan = _groups.plan(params, axes, 64)
  shapes = _ob._buffer_shapes(plan)
  vary = lambda x: _collective.vary(x, AXIS)
  for g in range(len(plan.layout.groups)):
    _shard(plan.layout, g)
  return LabState(
      jnp.zeros([], jnp.int32), jax.tree.map(lambda p: jnp.zeros(p.shape, F32), params),
      jnp.zeros((plan.layout.exact_size,), F32), jnp.zeros((plan.layout.exact_size,), F32),
      jnp.zeros((len(jax.tree.leaves(params)),), F32),
      tuple(vary(jnp.zeros(s, F32)) for s in shapes["local_momentum"]),
      vary(jnp.zeros((1, len(plan.layout.compressed)), F32)), jnp.zeros([], jnp.bool_), None,
      vary(jnp.zeros(shapes["server_error"], F32)), jnp.zeros(shapes["momentum_message"], jnp.uint8),
      jnp.zeros([], jnp.bool_), jnp.zeros([], jnp.int32))


def _specs(state: LabState) -> LabState:
  per_device = lambda x: jax.tree.map(lambda _: P(AXIS), x)
  rep = lambda x: jax.tree.map(lambda _: P(), x)
  return LabState(*(per_device(v) if k in ("local_momentum", "worker_scale", "server_error")
                    else rep(v) for k, v in state._asdict().items()))


def build(name, mesh, params, freeze_at):
  """(jitted donated train step, state) of contestant ``name``."""
  if name.startswith("adam"):
    import zero1_warmup_lab  # (its Adam + pmean; imported once jax has our devices)
    fn, state = zero1_warmup_lab.adam_pmean(mesh, params)
    return jax.jit(fn, donate_argnums=(0, 1)), state
  if name.startswith("package"):
    tx = onebit_optax.onebit_adam(LR, axis_name=AXIS, freeze=onebit_optax.fixed_step_freeze(freeze_at))
    state = onebit_optax.init_sharded(tx, params, mesh, axis_name=AXIS)
    specs = onebit_optax.state_partition_specs(state, AXIS)

    def body(p, s, g):
      u, s = tx.update(jax.lax.pcast(g, AXIS, to="varying"), s, p)
      return optax.apply_updates(p, u), s
  else:
    abstract = jax.eval_shape(lambda: jax.shard_map(lab_init, mesh=mesh, in_specs=P(),
                                                    out_specs=P(), check_vma=False)(params))
    specs = _specs(abstract)
    state = jax.jit(jax.shard_map(lab_init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

    def body(p, s, g):
      how, g = name.split("at the ")[1], jax.lax.pcast(g, AXIS, to="varying")
      u, s = (lab_update_in_nu(g, s, freeze_at) if how.endswith("update in nu")
              else lab_update(g, s, freeze_at, how))
      return optax.apply_updates(p, u), s
  fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), specs, P()), out_specs=(P(), specs))
  return jax.jit(fn, donate_argnums=(0, 1)), state


def _per_device(tree) -> int:
  return sum(x.nbytes // (DEVICES if x.sharding.spec and x.sharding.spec[0] == AXIS else 1)
             for x in jax.tree.leaves(tree))


def _diff(a, b) -> float:
  return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _checks(live) -> tuple:
  """(|prototype - package|, |package - adam|): the largest differences in the parameters now."""
  p = {name: live[name][1] for name in live}
  return (max(_diff(p[n], p["package"]) for n in p if n.startswith("prototype")),
          _diff(p["package"], p["adam + pmean"]))


def main(args) -> int:
  mesh = jax.make_mesh((DEVICES,), (AXIS,))
  put = lambda t: jax.device_put(t, NamedSharding(mesh, P()))
  size = int(float(args.size))
  grads = [put(zc.make_tree(size, s, args.leaves)) for s in (1, 2, 3)]
  d = 4 * sum(x.size for x in jax.tree.leaves(grads[0]))
  names = ("adam + pmean", "adam + pmean (again)", "package") + tuple(
      f"prototype, hand-over at the {h}" for h in HAND_OVERS)
  rows, live = {}, {}
  for name in names:
    params = put(zc.make_tree(size, 0, args.leaves))
    step, state = build(name, mesh, params, args.freeze)
    compiled = step.lower(params, state, grads[0]).compile()
    temps = compiled.memory_analysis().temp_size_in_bytes
    rows[name] = {"state": _per_device(state) / d, "temps": temps / d, "warmup": [], "compression": []}
    live[name] = [step, params, state]
  t = 0
  load = os.getloadavg()

  def run(phase: str, steps: int, timed: bool):
    nonlocal t
    for _ in range(steps):
      order = list(names)
      random.shuffle(order)
      for name in order:
        step, params, state = live[name]
        jax.block_until_ready((params, state))
        start = time.perf_counter()
        params, state = step(params, state, grads[t % 3])
        jax.block_until_ready((params, state))
        if timed:
          rows[name][phase].append(time.perf_counter() - start)
        live[name][1:] = [params, state]
      t += 1

  run("warmup", args.freeze - 1 - args.repeats, False)
  run("warmup", args.repeats, True)  # (the last is the freeze step)
  checks = {"freeze": _checks(live)}
  run("compression", 2, False)
  run("compression", args.repeats, True)
  checks["end"] = _checks(live)
  assert all(bool(live[n][2].frozen) for n in names if n.startswith("prototype")), "no freeze"
  assert onebit_optax.status(live["package"][2]).phase == "compression", onebit_optax.status(live["package"][2])
  adam = {ph: np.median(rows["adam + pmean"][ph]) for ph in ("warmup", "compression")}
  tree = f"{args.leaves} leaves in 20 shapes" if args.leaves else "the 6-leaf model-shaped tree"
  lines = [
      "#### ZeRO-1 cycle lab: 1-bit Adam with its warmup moments in the per-device buffer", "",
      f"`python benchmarks/zero1_cycle_lab.py {' '.join(shlex.quote(a) for a in sys.argv[1:])}`"
      f": commit {_provenance.git_commit()}, jax {jax.__version__}, {size:,} parameters, {tree}, "
      f"per device in a {DEVICES}-device mesh, one XLA intra-op thread, freeze after step "
      f"{args.freeze}, {args.repeats} interleaved repeats per phase; load average at start "
      f"{[round(x, 2) for x in load]}, at end {[round(x, 2) for x in os.getloadavg()]}.", "",
      "Largest |prototype - package| in the parameters (either prototype): "
      f"{checks['freeze'][0]:.2g} after the warmup, {checks['end'][0]:.2g} after "
      f"{args.repeats + 2} compression steps (package - adam: {checks['freeze'][1]:.2g}, "
      f"{checks['end'][1]:.2g}).", "",
      "| train step | state (D per device) | temporaries (D) | state + temporaries (D) | "
      "warmup / adam | compression / adam |", "|---|---:|---:|---:|---:|---:|"]
  for name, r in rows.items():
    ratio = lambda ph: np.median(r[ph]) / adam[ph]
    lines.append(f"| {name} | {r['state']:.2f} | {r['temps']:.2f} | {r['state'] + r['temps']:.2f} | "
                 f"{ratio('warmup'):.2f} | {ratio('compression'):.2f} |")
  lines += ["", f"Adam's step: {1e3 * adam['warmup']:.1f} ms (timed beside the warmup steps), "
            f"{1e3 * adam['compression']:.1f} ms (beside the compression steps). 'adam' in the "
            "compression column: Adam's steps timed beside them (Adam has no phases)."]
  Path(args.out).write_text("\n".join(lines) + "\n")
  print("\n".join(lines))
  return 0


def _parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--size", default="1e7", help="parameters (default 1e7)")
  p.add_argument("--leaves", type=int, default=0, help="leaves in 20 shapes (0: the 6-leaf tree)")
  p.add_argument("--devices", type=int, default=2)
  p.add_argument("--repeats", type=int, default=9)
  p.add_argument("--freeze", type=int, default=12, help="the fixed freeze step (> --repeats)")
  p.add_argument("--out", default=str(zc.RESULTS / "zero1_cycle_lab.md"))
  return p.parse_args(argv)


if __name__ == "__main__":
  sys.exit(main(_parse_args(sys.argv[1:])))
