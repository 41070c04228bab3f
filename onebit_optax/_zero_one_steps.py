"""0/1 Adam's three kinds of step (variance, compressed, local/sync): full-size math and collectives."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from onebit_optax import _collective
from onebit_optax import _layout
from onebit_optax import _wire

F32 = jnp.float32

# What the last step was (``ScaleByZeroOneAdamState.phase``); NO_STEP before the first.
VARIANCE, COMPRESSED, LOCAL, SYNC = 0, 1, 2, 3
NO_STEP = -1
PHASES = ("variance", "compressed", "local", "sync")


class Hyper(NamedTuple):
  """The (possibly traced) hyperparameters and the static options of one update."""

  b1: Any
  b2: Any
  eps: Any
  variance_floor: Any
  max_update: Any
  var_freeze_step: Any
  var_update_scaler: Any
  local_steps: Optional[int]  # H, the largest interval between syncs; None: no local steps.
  local_step_scaler: Any
  learning_rate: Any  # only with local steps (the sync divides by the sum of the rates).
  weight_decay: Any
  mask: Any  # which leaves get weight decay: None (all), a tree of bools or a callable of params.
  skip_nonfinite: bool
  exact_below: int


class Plan(NamedTuple):
  """What one update knows statically: the mesh, the wire layout, the tree."""

  axes: _collective.Axes
  layout: _layout.WireLayout
  treedef: Any
  decay: tuple = ()  # per leaf: gets weight decay (empty: every leaf).

  def decays(self, i: int) -> bool:
    return not self.decay or self.decay[i]

  def kind(self, i: int):
    """('c', k): leaf ``i`` is compressed leaf ``k``; ('e', j): exact leaf ``j``; ('z',): empty."""
    return self.layout.roles[i]


class Schedule(NamedTuple):
  """Which step this is, from replicated counters only (every device agrees: no deadlock)."""

  kind: jax.Array  # () int32: VARIANCE, COMPRESSED or LOCAL (the branch taken).
  sync: jax.Array  # () bool: a local-phase step that ends with the 1-bit sync.
  fresh: jax.Array  # () bool: the first local-phase step (the error feedback restarts).
  count: jax.Array  # () int32: this step's number (1 for the first).
  lr: jax.Array  # () float32: this step's learning rate (local steps; else 0).


class Result(NamedTuple):
  """What every branch returns (the fields a branch does not change are passed through)."""

  updates: list
  mu: list
  nu: list
  nu_l1: jax.Array
  local_sent: tuple
  worker_scale: jax.Array
  server_error: Any
  local_mu: Any
  accumulator: Any
  finite: jax.Array
  wire_bytes: jax.Array


def adam_bound(b1, b2) -> jax.Array:
  """Adam's per-coordinate step bound (Kingma & Ba 2015, Section 2.1)."""
  b1, b2 = jnp.asarray(b1, F32), jnp.asarray(b2, F32)
  return jnp.maximum(1.0, (1.0 - b1) / jnp.sqrt(1.0 - b2))


def bias_correction(decay, count) -> jax.Array:
  return 1.0 - jnp.asarray(decay, F32) ** count


def mean_leaf(plan: Plan, gathered, i: int, shape):
  """Leaf ``i`` of the mean that the gathered messages hold (float32)."""
  kind = plan.kind(i)
  if kind[0] == "c":
    return _wire.message_leaf(plan.layout, gathered, kind[1], shape)
  offset, size = plan.layout.exact_offsets[kind[1]], plan.layout.sizes[i]
  return _wire.message_exact(plan.layout, gathered)[offset:offset + size].reshape(shape)


def exchange(plan: Plan, sent: list, exact: list, server_error, hp: Hyper):
  """The 1-bit mean of ``sent`` (compressed leaves, ``(1, *shape)``) and ``exact`` (float32 leaves).

  One uint8 ``all_to_all`` and one uint8 ``all_gather`` however many leaves
  (:func:`_collective.onebit_exchange`); each leaf is compressed with its own
  RMS scale. Returns ``(gathered, scales, server_error, finite)``; ``finite``
  is read off the replicated gathered scales, so every device agrees on it.
  """
  scales = (jnp.stack([_wire.leaf_rms(u) for u in sent]) if sent else jnp.zeros((0,), F32))
  flat = [jnp.ravel(x).astype(F32) for x in exact]
  exact = jnp.concatenate(flat) if flat else jnp.zeros((0,), F32)
  rows = _wire.rows(plan.layout, [_wire.leaf_signs(u) for u in sent], scales, exact)
  gathered, server_error, finite = _collective.onebit_exchange(
      rows, server_error, plan.layout, plan.axes, keep_if_nonfinite=hp.skip_nonfinite)
  if not hp.skip_nonfinite:
    finite = jnp.bool_(True)
  return gathered, _collective.vary(scales[None], plan.axes.device_axes), server_error, finite


def feedback(sent, scale, valid=True):
  """The error feedback :math:`e = u' - s'\\,\\mathrm{sign}(u')` from what was sent last (``u'``, ``s'``)."""
  sent = sent.astype(F32)
  return jnp.where(valid, sent - jnp.where(sent >= 0, scale, -scale), 0.0)


def floors(hp: Hyper, plan: Plan, nu_l1, bc2) -> list:
  """Per leaf: the floor on the bias-corrected variance, ``variance_floor`` x the leaf's mean."""
  return [hp.variance_floor * nu_l1[i] / (max(size, 1) * bc2)
          for i, size in enumerate(plan.layout.sizes)]


def direction(hp: Hyper, m, nu, bc1, bc2, floor, bounded, finite):
  r"""Adam's step :math:`\hat m/(\sqrt{\hat v}+\epsilon)`; ``bounded``: floored variance and Adam's clip.

  A coordinate with :math:`v = 0` never had a gradient on a variance step: its
  momentum is the compressor's sign noise, which :math:`1/\epsilon` would
  amplify, so it stays put.
  """
  bound = adam_bound(hp.b1, hp.b2) if hp.max_update is None else hp.max_update
  bound = jnp.where(bounded, jnp.asarray(bound, F32), jnp.inf)
  v_hat = jnp.maximum(nu / bc2, jnp.where(bounded, floor, 0.0))
  step = jnp.clip((m / bc1) / (jnp.sqrt(v_hat) + hp.eps), -bound, bound)
  return jnp.where(finite & (nu > 0), step, 0.0)


def _zeros_like(g):
  return jnp.zeros(jnp.shape(g), F32)


def _bytes_allreduce(plan: Plan) -> float:
  return _collective.allreduce_wire_bytes(sum(plan.layout.sizes), plan.axes.n_slow)


def _bytes_onebit(plan: Plan) -> float:
  return 2.0 * (plan.axes.n_slow - 1) * plan.layout.row_bytes


def _scaled(hp: Hyper, plan: Plan, directions, params, sched: Schedule, finite):
  """Adds the decoupled weight decay (none on a skipped step) and, with local steps, ``-lr``."""
  if params is not None:
    directions = [d + jnp.where(finite, hp.weight_decay * p.astype(F32), 0.0)
                  if plan.decays(i) else d for i, (d, p) in enumerate(zip(directions, params))]
  if hp.local_steps is None:
    return directions
  return [-sched.lr * d for d in directions]


def leaves_or_none(tree):
  return None if tree is None else jax.tree.leaves(tree)


def _passthrough(state, updates, mu, nu, nu_l1, finite, wire) -> Result:
  return Result(updates, mu, nu, nu_l1, state.local_sent, state.worker_scale, state.server_error,
                leaves_or_none(state.local_mu), leaves_or_none(state.accumulator), finite,
                jnp.float32(wire))


def variance_step(hp: Hyper, plan: Plan, grads, state, sched: Schedule, params) -> Result:
  """A variance step: the float32 mean gradient (one all-reduce), Adam's ``m`` and ``v``, Adam's step."""
  total = [g.astype(F32) for g in grads]
  if plan.axes.slow is not None:
    total = jax.lax.psum(total, plan.axes.slow)  # one tuple all-reduce (XLA's combiner)
  mean = [t * (1.0 / plan.axes.n_slow) for t in total]
  finite = (jnp.all(jnp.isfinite(jnp.stack([jnp.sum(m) for m in mean])))
            if hp.skip_nonfinite else jnp.bool_(True))
  mus, nus = jax.tree.leaves(state.mu), jax.tree.leaves(state.nu)
  mu = [jnp.where(finite, hp.b1 * m + (1.0 - hp.b1) * g, m) for m, g in zip(mus, mean)]
  nu = [jnp.where(finite, hp.b2 * v + (1.0 - hp.b2) * jnp.square(g), v) for v, g in zip(nus, mean)]
  nu_l1 = jnp.where(finite, jnp.stack([jnp.sum(v) for v in nu]), state.nu_l1)
  bc1 = bias_correction(hp.b1, sched.count)
  bc2 = bias_correction(hp.b2, state.variance_updates + 1)
  # Adam's own step while every step so far was a variance step; once compressed
  # steps have fed m (signs at their leaf's scale), m no longer matches v
  # coordinate by coordinate, and the variance step is floored and clipped too
  # (unbounded, it blew the digits MLP up at the first variance step after them).
  bounded = state.variance_updates < state.count
  floor = floors(hp, plan, nu_l1, bc2)
  dirs = [direction(hp, m, v, bc1, bc2, floor[i], bounded, finite)
          for i, (m, v) in enumerate(zip(mu, nu))]
  return _passthrough(state, _scaled(hp, plan, dirs, params, sched, finite), mu, nu, nu_l1, finite,
                      _bytes_allreduce(plan))


def compressed_step(hp: Hyper, plan: Plan, grads, state, sched: Schedule, params) -> Result:
  r"""A compressed step: each device's gradient through the 1-bit mean with error feedback; ``m`` only.

  .. math::

    u_i = g_i + e_i, \quad \hat g = \mathrm{compressed\_mean}_i(u_i), \quad
    m = \beta_1 m + (1-\beta_1)\hat g, \quad v \text{ unchanged}.
  """
  layout = plan.layout
  sent = [grads[i].astype(F32)[None] + feedback(state.local_sent[k], state.worker_scale[0, k])
          for k, i in enumerate(layout.compressed)]
  gathered, scales, server_error, finite = exchange(
      plan, sent, [grads[i] for i in layout.exact], state.server_error, hp)
  mus, nus = jax.tree.leaves(state.mu), jax.tree.leaves(state.nu)
  bc1 = bias_correction(hp.b1, sched.count)
  bc2 = bias_correction(hp.b2, state.variance_updates)
  floor = floors(hp, plan, state.nu_l1, bc2)
  mu, dirs = [], []
  for i, (m, v) in enumerate(zip(mus, nus)):
    if plan.kind(i)[0] == "z":
      mu.append(m)
      dirs.append(_zeros_like(m))
      continue
    g = mean_leaf(plan, gathered, i, jnp.shape(m))
    mu.append(jnp.where(finite, hp.b1 * m + (1.0 - hp.b1) * g, m))
    dirs.append(direction(hp, mu[-1], v, bc1, bc2, floor[i], True, finite))
  # A skipped step keeps what was sent before: its feedback stays valid.
  local_sent = tuple(jnp.where(finite, u, old).astype(old.dtype)
                     for u, old in zip(sent, state.local_sent))
  return Result(_scaled(hp, plan, dirs, params, sched, finite), mu, nus, state.nu_l1, local_sent,
                jnp.where(finite, scales, state.worker_scale), server_error,
                leaves_or_none(state.local_mu), leaves_or_none(state.accumulator), finite,
                jnp.float32(_bytes_onebit(plan)))


def _preconditioners(hp: Hyper, plan: Plan, nus, nu_l1, bc2) -> list:
  r"""Per leaf, the frozen preconditioner's denominator :math:`\sqrt{\max(\hat v, f\bar{\hat v})} + \epsilon`."""
  floor = floors(hp, plan, nu_l1, bc2)
  return [jnp.sqrt(jnp.maximum(v / bc2, floor[i])) + hp.eps for i, v in enumerate(nus)]


def _local_progress(hp: Hyper, plan: Plan, grads, state, sched: Schedule, params, bc1, bc2):
  r"""This device's own step: :math:`m_i = \beta_1 m_i + (1-\beta_1) g_i`, :math:`a_i \mathrel{+}= -\eta(d_i + \lambda\theta_i)`.

  :math:`\theta_i = \theta + a_i` is this device's copy of the parameters
  (:func:`zero_one_local_params`); the parameters themselves do not move.
  """
  mus, nus = jax.tree.leaves(state.mu), jax.tree.leaves(state.nu)
  local_mu, acc = leaves_or_none(state.local_mu), leaves_or_none(state.accumulator)
  floor = floors(hp, plan, state.nu_l1, bc2)
  new_mu, new_acc = [], []
  for i, g in enumerate(grads):
    # The momentum and progress since the last sync (none kept: a sync every step).
    base = mus[i] if local_mu is None else jnp.where(sched.fresh, mus[i], local_mu[i][0])
    a = 0.0 if acc is None else acc[i][0]
    m = hp.b1 * base + (1.0 - hp.b1) * g.astype(F32)
    d = direction(hp, m, nus[i], bc1, bc2, floor[i], True, True)
    theta = a if params is None else params[i].astype(F32) + a
    new_mu.append(m)
    if plan.decays(i):
      d = d + hp.weight_decay * theta
    new_acc.append(a - sched.lr * d)
  return new_mu, new_acc


def _momentum_after_sync(hp: Hyper, plan: Plan, i, avg, denominator, bc1, lr_sum, params):
  r"""The restarted momentum :math:`m = (1-\beta_1^t)(-\bar a/\sum\eta - \lambda\theta(\sqrt{\hat v}+\epsilon))`.

  :math:`-\bar a/\sum\eta` is the average step in Adam's units, weight decay
  included; its decay share is taken out (with :math:`\theta` the synced
  point: exact for a sync every step). DeepSpeed leaves it in the momentum,
  which then applies the decay again on every later step, up to
  :math:`1/(1-\beta_1)` times over (with a sync every step: +37% held-out loss
  on the digits MLP at weight decay 0.1, ``benchmarks/zero_one_volume.py``).
  """
  m = -avg * bc1 / lr_sum
  if params is not None and plan.decays(i):
    m = m - hp.weight_decay * params[i].astype(F32) * denominator * bc1
  return m


def _sync(hp: Hyper, plan: Plan, state, sched: Schedule, acc, denominators, bc1, lr_sum,
          params):
  r"""The sync: the 1-bit mean of :math:`a_i(\sqrt{\hat v}+\epsilon)`, applied as :math:`\bar a/(\sqrt{\hat v}+\epsilon)`.

  The momentum restarts from the mean (:func:`_momentum_after_sync`), on
  every device alike. A non-finite mean drops the interval on every device
  (the parameters stay, the accumulators and momenta restart from the last
  sync; without local steps: a skipped step).
  """
  layout, mus, nus = plan.layout, jax.tree.leaves(state.mu), jax.tree.leaves(state.nu)
  scaled = [a * q for a, q in zip(acc, denominators)]
  sent = [scaled[i][None] + feedback(state.local_sent[k], state.worker_scale[0, k],
                                     jnp.logical_not(sched.fresh))
          for k, i in enumerate(layout.compressed)]
  server = (None if state.server_error is None
            else jnp.where(sched.fresh, 0.0, state.server_error).astype(state.server_error.dtype))
  gathered, scales, server_error, finite = exchange(
      plan, sent, [scaled[i] for i in layout.exact], server, hp)
  updates, mu = [], []
  for i, (m, v) in enumerate(zip(mus, nus)):
    if plan.kind(i)[0] == "z":
      updates.append(_zeros_like(m))
      mu.append(m)
      continue
    avg = mean_leaf(plan, gathered, i, jnp.shape(m))
    updates.append(jnp.where(finite & (v > 0), avg / denominators[i], 0.0))
    mu.append(jnp.where(finite & (lr_sum > 0), _momentum_after_sync(
        hp, plan, i, avg, denominators[i], bc1, lr_sum, params), m))
  vary = lambda x: _collective.vary(x[None], plan.axes.device_axes)
  # A dropped sync keeps the last sent values (their error feedback stays valid),
  # unless they were the gradients' (the first sync after the freeze).
  keep = lambda new, old: jnp.where(finite, new, jnp.where(sched.fresh, 0.0, old)).astype(old.dtype)
  local_sent = tuple(keep(u, old) for u, old in zip(sent, state.local_sent))
  return Result(updates, mu, nus, state.nu_l1, local_sent, keep(scales, state.worker_scale),
                server_error, [vary(m) for m in mu], [vary(jnp.zeros_like(a)) for a in acc],
                finite, jnp.float32(_bytes_onebit(plan)))


def local_step(hp: Hyper, plan: Plan, grads, state, sched: Schedule, params) -> Result:
  """A local step (no communication), or a sync step: the local step, then the 1-bit sync.

  Without local steps (after the freeze) every step is a sync, in direction
  units (``sched.lr`` is 1, the chain's learning rate follows) and with no
  per-device momentum or accumulator kept between steps.
  """
  bc1 = bias_correction(hp.b1, sched.count)
  bc2 = bias_correction(hp.b2, state.variance_updates)
  new_mu, acc = _local_progress(hp, plan, grads, state, sched, params, bc1, bc2)
  nus = jax.tree.leaves(state.nu)
  lr_sum = state.lr_sum + sched.lr

  def no_sync(new_mu, acc):
    zeros = [_zeros_like(v) for v in nus]
    return Result(zeros, jax.tree.leaves(state.mu), nus, state.nu_l1, state.local_sent,
                  state.worker_scale, state.server_error, [m[None] for m in new_mu],
                  [a[None] for a in acc], jnp.bool_(True), jnp.float32(0))

  def sync(new_mu, acc):
    denominators = _preconditioners(hp, plan, nus, state.nu_l1, bc2)
    return _sync(hp, plan, state, sched, acc, denominators, bc1, lr_sum, params)

  if hp.local_steps is None:
    res = sync(new_mu, acc)
    return res._replace(updates=[-u for u in res.updates], local_mu=None, accumulator=None)
  return jax.lax.cond(sched.sync, sync, no_sync, new_mu, acc)
