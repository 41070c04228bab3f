"""0/1 Adam's three kinds of step (variance, compressed, local/sync): full-size math and collectives."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from onebit_optax import _bounded
from onebit_optax import _collective
from onebit_optax import _groups
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
  per_step_ema: bool = False  # variance_ema='per_step': v decays by b2 per step, not per update.


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
  """What a step returns (the fields its kind does not change hold their old values)."""

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


def exchange(plan: Plan, sent: list, exact: list, server_error, hp: Hyper):
  """The 1-bit mean of ``sent`` (the compressed leaves, stream order) and ``exact`` (float32 leaves).

  One uint8 ``all_to_all`` and one uint8 ``all_gather`` however many leaves
  (:func:`_collective.onebit_exchange`); each leaf is compressed with its own
  RMS scale. Returns ``(gathered, scales, server_error, finite)``; ``finite``
  is read off the replicated gathered scales, so every device agrees on it.
  """
  sent = _groups.stacks(plan.layout, sent)  # (stacked here, where the scales and signs read them)
  scales = (jnp.concatenate([_wire.group_rms(u) for u in sent]) if sent
            else jnp.zeros((0,), F32))
  flat = [jnp.ravel(x).astype(F32) for x in exact]
  exact = jnp.concatenate(flat) if flat else jnp.zeros((0,), F32)
  rows = _wire.rows(plan.layout, [_wire.group_signs(u) for u in sent], scales, exact)
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
  sizes = np.maximum(np.asarray(plan.layout.sizes, np.float32), 1.0)
  floor = hp.variance_floor * nu_l1 / (jnp.asarray(sizes) * bc2)  # one division for all leaves
  return [floor[i] for i in range(len(sizes))]


def direction(hp: Hyper, m, nu, bc1, bc2, floor, bounded, finite):
  r"""Adam's step :math:`\hat m/(\sqrt{\hat v}+\epsilon)`; ``bounded``: floored variance and Adam's clip.

  A coordinate with :math:`v = 0` never had a gradient on a variance step: it
  stays put (see :func:`_bounded.bounded_step`).
  """
  return _bounded.bounded_step(m, nu, hp.b1, hp.b2, hp.eps, hp.max_update, bc1, bc2, floor,
                               bounded=bounded, finite=finite, zero_without_variance=True)


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


def _preconditioners(hp: Hyper, plan: Plan, nus, nu_l1, bc2) -> list:
  r"""Per leaf, the frozen preconditioner's denominator :math:`\sqrt{\max(\hat v, f\bar{\hat v})} + \epsilon`."""
  floor = floors(hp, plan, nu_l1, bc2)
  return [jnp.sqrt(jnp.maximum(v / bc2, floor[i])) + hp.eps for i, v in enumerate(nus)]


def _momentum(hp: Hyper, base, g):
  r"""A device's momentum after its own gradient, :math:`\beta_1 m + (1-\beta_1) g_i`."""
  return hp.b1 * base + (1.0 - hp.b1) * g.astype(F32)


def _progress(hp: Hyper, plan: Plan, i, m, nu, denominator, bc1, a, param, lr):
  r"""This device's progress after its own step: :math:`a_i - \eta(d_i + \lambda\theta_i)`.

  :math:`d_i = \hat m_i/(\sqrt{\max(\hat v, f\bar{\hat v})}+\epsilon)` is
  floored but not clipped: a device's own gradient is noisier than the mean
  that ``v`` was estimated from, and clipping each device's step before the
  mean biased the mean (the first version did: +9.6% validation loss against
  AdamW on the char GPT of ``benchmarks/convergence.py``, a sync every step;
  CHANGELOG). The bound applies to the sync's move instead
  (:func:`_sync_move`). :math:`\theta_i = \theta + a_i` is this
  device's copy of the parameters (:func:`local_params` with the state); the
  parameters themselves do not move.
  """
  d = jnp.where(nu > 0, (m / bc1) / denominator, 0.0)
  theta = a if param is None else param.astype(F32) + a
  if plan.decays(i):
    d = d + hp.weight_decay * theta
  return a - lr * d


def _outgoing(hp: Hyper, plan: Plan, g32, state, sched: Schedule, params, bc1, bc2) -> list:
  r"""Per leaf, the one full-size value computed before the conditional, from the old state alone.

  A compressed step: the momentum :math:`\beta_1 m + (1-\beta_1) g_i + e_i`
  (as 1-bit Adam sends it, not the gradient); a sync: :math:`a_i(\sqrt{\hat v}+\epsilon)
  + e_i` (:math:`a_i` the progress after this step; exact leaves: no
  :math:`e_i`); a local step without sync: :math:`a_i` itself, the new
  accumulator. It is the one buffer that the 1-bit message, ``local_sent`` and
  ``accumulator`` all read: each of those is then one pass over it, and the
  writers after the conditional read no old ``accumulator``, ``local_mu`` or
  ``local_sent`` but their own (XLA copies a donated buffer that a fusion not
  ordered before its writer still reads: 3 D of copies per local step before,
  ``benchmarks/results/zero_one_compute.md``).
  """
  mus, nus = jax.tree.leaves(state.mu), jax.tree.leaves(state.nu)
  local_mu, acc = leaves_or_none(state.local_mu), leaves_or_none(state.accumulator)
  denominators = _preconditioners(hp, plan, nus, state.nu_l1, bc2)
  is_comp, out = sched.kind == COMPRESSED, []
  for i, g in enumerate(g32):
    kind = plan.kind(i)
    # The momentum and progress since the last sync (none kept: a sync every step).
    base = mus[i] if local_mu is None else jnp.where(sched.fresh, mus[i], local_mu[i][0])
    a = _progress(hp, plan, i, _momentum(hp, base, g), nus[i], denominators[i], bc1,
                  0.0 if acc is None else acc[i][0], None if params is None else params[i], sched.lr)
    moved, scaled = _momentum(hp, mus[i], g), a * denominators[i]
    if kind[0] == "c":
      group, j = plan.layout.group_of[kind[1]]
      sent, scale = state.local_sent[group][0, j], state.worker_scale[0, kind[1]]
      moved = moved + feedback(sent, scale)
      scaled = scaled + feedback(sent, scale, jnp.logical_not(sched.fresh))
    out.append(jnp.where(is_comp, moved, jnp.where(sched.sync, scaled, a)))
  return out


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


def _sync_move(hp: Hyper, plan: Plan, i, avg, denominator, lr_sum, params):
  r"""The sync's move :math:`\bar a/(\sqrt{\hat v}+\epsilon)`, its step part clipped at :math:`\pm B\sum\eta`.

  The 1-bit mean holds each coordinate at its leaf's scale: divided by a small
  :math:`\sqrt{\hat v}` the sign noise would move a coordinate far beyond
  Adam's step bound. As :func:`scale_by_onebit_adam` does after its freeze,
  the bound applies to what the compression gave (the clip of each device's
  own step, before it, does not bound the mean's noise); the weight decay's
  share (:math:`-\lambda\theta\sum\eta`, the synced point's) is kept out of it.
  """
  bound = _bounded.adam_update_bound(hp.b1, hp.b2) if hp.max_update is None else hp.max_update
  bound = jnp.asarray(bound, F32) * lr_sum
  decay = 0.0
  if params is not None and plan.decays(i):
    decay = hp.weight_decay * lr_sum * params[i].astype(F32)
  return jnp.clip(avg / denominator + decay, -bound, bound) - decay


def _finite_mean(hp: Hyper, plan: Plan, total):
  """Whether the mean gradient (the variance step's) is finite everywhere."""
  return (jnp.all(jnp.isfinite(_groups.sums(total)))  # (a NaN or Inf anywhere: a non-finite sum)
          if hp.skip_nonfinite else jnp.bool_(True))


def _collectives(hp: Hyper, plan: Plan, state, sched: Schedule, g32, sent, exact, server):
  """This step's communication alone in a conditional: ``(total, gathered, scales, server_error, finite)``.

  ``total`` is the float32 sum of the gradients (a variance step; else zeros;
  on one device there is nothing to sum: empty, and ``finite`` is decided
  outside), ``gathered`` the 1-bit messages of ``sent``/``exact`` (a
  compressed step or a sync; else zeros). The branches take and return only
  what the communication needs and gives: the full-size state stays outside,
  where XLA writes each new buffer once, into the donated one (a conditional
  returning the whole state copied every buffer into its result and the
  result into the state: ``benchmarks/results/zero_one_compute.md``).
  """
  no_scales = _collective.vary(jnp.zeros((1, len(plan.layout.compressed)), F32),
                               plan.axes.device_axes)
  g32 = g32 if plan.axes.slow is not None else []
  no_total = lambda: [jnp.zeros(jnp.shape(g), F32) for g in g32]

  def onebit(g32, sent, exact, server):
    gathered, scales, server_error, finite = exchange(plan, sent, exact, server, hp)
    return no_total(), gathered, scales, server_error, finite

  shape = jax.eval_shape(onebit, g32, sent, exact, server)[1]
  no_message = jnp.zeros(shape.shape, shape.dtype)

  def variance(g32, sent, exact, server):
    if plan.axes.slow is None:
      return [], no_message, no_scales, state.server_error, jnp.bool_(True)
    total = jax.lax.psum(g32, plan.axes.slow)  # one tuple all-reduce (XLA's combiner)
    return total, no_message, no_scales, state.server_error, _finite_mean(hp, plan, total)

  def silent(g32, sent, exact, server):
    return no_total(), no_message, no_scales, state.server_error, jnp.bool_(True)

  # One branch per kind of communication, so the 1-bit exchange (a compressed step or a
  # sync) is traced once: a copy per kind of step doubled its per-leaf code in the program.
  # (Without local steps every step after the freeze is a sync: no silent branch.)
  sends_onebit = (sched.kind == COMPRESSED) | ((sched.kind == LOCAL) & sched.sync)
  branch = jnp.where(sched.kind == VARIANCE, 0, jnp.where(sends_onebit, 1, 2))
  branches = [variance, onebit] + ([] if hp.local_steps is None else [silent])
  return jax.lax.switch(branch, branches, g32, sent, exact, server)


def variance_decay(hp: Hyper, state, count) -> jax.Array:
  """What a variance step at ``count`` multiplies ``v`` by: b2, or b2 per step since the last one."""
  if not hp.per_step_ema:
    return jnp.asarray(hp.b2, F32)
  return jnp.asarray(hp.b2, F32) ** (count - state.variance_step).astype(F32)


def v_correction(hp: Hyper, variance_updates, variance_step) -> jax.Array:
  """``v``'s bias correction after ``variance_updates`` variance steps, the last at ``variance_step``."""
  return _bounded.bias_correction(hp.b2, variance_step if hp.per_step_ema else variance_updates)


def _new_nu(hp: Hyper, nus, mean, is_var, finite, decay) -> list:
  """``v`` after a variance step with the float32 mean gradient ``mean`` (else unchanged)."""
  return [jnp.where(is_var & finite, decay * v + (1.0 - decay) * jnp.square(g), v)
          for v, g in zip(nus, mean)]


def _new_mu(hp: Hyper, plan: Plan, state, sched: Schedule, avg, nu, finite, bc1, bc2, params):
  """``m`` after a variance step (Adam's), a compressed step (the mean), a sync (restarted), a local step (kept)."""
  denominators = _preconditioners(hp, plan, nu, state.nu_l1, bc2)
  lr_sum = state.lr_sum + sched.lr
  out = []
  for i, (m, a) in enumerate(zip(jax.tree.leaves(state.mu), avg)):
    if plan.kind(i)[0] == "z":
      out.append(m)
      continue
    moved = jnp.where(finite, jnp.where(sched.kind == VARIANCE, hp.b1 * m + (1.0 - hp.b1) * a, a), m)
    synced = jnp.where(finite & (lr_sum > 0), _momentum_after_sync(
        hp, plan, i, a, denominators[i], bc1, lr_sum, params), m)
    local = synced if hp.local_steps is None else jnp.where(sched.sync, synced, m)
    out.append(jnp.where(sched.kind == LOCAL, local, moved))
  return out


def _sync_updates(hp: Hyper, plan: Plan, state, sched: Schedule, avg, nu, finite, bc2, params):
  """The update of a local-phase step: the sync's move (negated without local steps), else 0."""
  denominators = _preconditioners(hp, plan, nu, state.nu_l1, bc2)
  lr_sum = state.lr_sum + sched.lr
  out = []
  for i, (v, a) in enumerate(zip(nu, avg)):
    move = _zeros_like(v) if plan.kind(i)[0] == "z" else jnp.where(
        finite & (v > 0), _sync_move(hp, plan, i, a, denominators[i], lr_sum, params), 0.0)
    out.append(-move if hp.local_steps is None else jnp.where(sched.sync, move, 0.0))
  return out


def _updates(hp: Hyper, plan: Plan, state, sched: Schedule, mu, nu, avg, nu_l1, finite, bc1, bc2,
             params) -> list:
  """Adam's (bounded) step from the new ``m`` and ``v``, or a local-phase step's update."""
  is_var = sched.kind == VARIANCE
  bc2_here = jnp.where(is_var, v_correction(hp, state.variance_updates + 1, sched.count), bc2)
  bounded = jnp.where(is_var, state.variance_updates < state.count, True)
  floor = floors(hp, plan, nu_l1, bc2_here)
  dirs = [_zeros_like(m) if plan.kind(i)[0] == "z" else
          direction(hp, m, v, bc1, bc2_here, floor[i], bounded, finite)
          for i, (m, v) in enumerate(zip(mu, nu))]
  moved = _scaled(hp, plan, dirs, params, sched, finite)
  synced = _sync_updates(hp, plan, state, sched, avg, nu, finite, bc2, params)
  return [jnp.where(sched.kind == LOCAL, s, u) for s, u in zip(synced, moved)]


def _per_device(hp: Hyper, plan: Plan, state, sched: Schedule, g32, mu, outgoing):
  """``local_mu`` and ``accumulator`` after a local step (``outgoing`` is the progress) or a sync."""
  if hp.local_steps is None:
    return None, None
  vary = lambda x: _collective.vary(x[None], plan.axes.device_axes)
  is_local, local_mu, acc = sched.kind == LOCAL, [], []
  for i, (g, m, a) in enumerate(zip(g32, mu, outgoing)):
    old_mu, old_acc = jax.tree.leaves(state.local_mu)[i], jax.tree.leaves(state.accumulator)[i]
    # The first local step starts from the synced m, which a local step keeps: mu is its value.
    # (In the buffer's own shape: a fusion reading it through a reshape cannot write it in place.)
    own = _momentum(hp, jnp.where(sched.fresh, m[None], old_mu), g[None])
    local_mu.append(jnp.where(is_local, jnp.where(sched.sync, vary(m), own), old_mu))
    acc.append(jnp.where(is_local, jnp.where(sched.sync, vary(jnp.zeros_like(a)), a[None]), old_acc))
  return local_mu, acc


def step(hp: Hyper, plan: Plan, grads, state, sched: Schedule, params) -> Result:
  r"""One step of the kind ``sched.kind``: its collectives in a conditional, the full-size math outside.

  **Variance step**: the float32 mean gradient :math:`\bar g` (one
  all-reduce), Adam's ``m`` and ``v``, Adam's step (floored and clipped once
  compressed steps have fed ``m``).

  **Compressed step**: each device's momentum through the 1-bit mean with
  error feedback, :math:`u_i = \beta_1 m + (1-\beta_1) g_i + e_i`,
  :math:`m = \mathrm{compressed\_mean}_i(u_i)`, ``v`` unchanged.

  **Local step** (no communication), or a **sync**: the local step, then the
  1-bit mean of the progress (:func:`_momentum_after_sync`). Without local
  steps (after the freeze) every step is a sync, in direction units
  (``sched.lr`` is 1, the chain's learning rate follows), with no per-device
  momentum or accumulator kept between steps. A non-finite mean drops the
  interval on every device.

  Only the collectives are branched (:func:`_collectives`); every step
  evaluates the elementwise formulas of all kinds and selects its kind's values
  with ``jnp.where`` on replicated scalars, which measured cheaper than a
  conditional over the full-size state (``benchmarks/zero_one_compute.py``).
  The data flow is laid out so that XLA writes every donated buffer in place,
  with no copy: one buffer computed from the old state before the conditional
  (:func:`_outgoing`), then ``v``, then ``m``, then what reads them; every
  later reader takes ``v``'s and ``m``'s successors (the same values where they
  are read), never the old buffers that their writers overwrite. The values
  are those of the earlier per-kind branches up to the rounding of fused
  multiply-adds, which XLA:CPU contracts differently in other fusions.
  """
  is_var = sched.kind == VARIANCE
  g32 = [g.astype(F32) for g in grads]
  bc1 = _bounded.bias_correction(hp.b1, sched.count)
  bc2 = v_correction(hp, state.variance_updates, state.variance_step)  # v held: not a variance step
  outgoing = _outgoing(hp, plan, g32, state, sched, params, bc1, bc2)
  # What each device sends: the compressed leaves, passed to the conditional leaf by leaf
  # (the buffers outgoing computed) and stacked into their groups where they are read.
  sent = [outgoing[i] for i in plan.layout.compressed]
  server = (None if state.server_error is None  # (fresh: a local-phase step)
            else jnp.where(sched.fresh, 0.0, state.server_error).astype(state.server_error.dtype))
  total, gathered, scales, server_error, finite = _collectives(
      hp, plan, state, sched, g32, sent, [outgoing[i] for i in plan.layout.exact], server)
  if plan.axes.slow is None:  # one device: the sum is the gradient (no operand of the conditional)
    total = g32
    finite = jnp.where(is_var, _finite_mean(hp, plan, g32), finite)
  # The mean: float32 (variance step) or decoded from the 1-bit messages (fused into its consumers).
  mean = [t * (1.0 / plan.axes.n_slow) for t in total]
  onebit_mean = _groups.mean_leaves(plan.layout, gathered)
  avg = [jnp.where(is_var, t, c) for t, c in zip(mean, onebit_mean)]
  nu = _new_nu(hp, jax.tree.leaves(state.nu), mean, is_var, finite,
               variance_decay(hp, state, sched.count))
  # (summed from the new buffer, not from a second pass over the old one)
  nu_l1 = jnp.where(is_var & finite, _groups.sums(nu), state.nu_l1)
  mu = _new_mu(hp, plan, state, sched, avg, nu, finite, bc1, bc2, params)
  updates = _updates(hp, plan, state, sched, mu, nu, avg, nu_l1, finite, bc1, bc2, params)
  # A skipped step keeps what was sent before (its feedback stays valid), unless
  # that was the gradients' (a dropped first sync after the freeze).
  active = (sched.kind == COMPRESSED) | ((sched.kind == LOCAL) & sched.sync)
  keep = lambda new, old: jnp.where(active, jnp.where(finite, new, jnp.where(
      sched.fresh, 0.0, old)), old).astype(old.dtype)
  local_sent = tuple(keep(u[None], old) for u, old in zip(_groups.stacks(plan.layout, sent), state.local_sent))
  wire = jnp.where(is_var, _bytes_allreduce(plan),
                   jnp.where(active, _bytes_onebit(plan), 0.0)).astype(F32)
  local_mu, accumulator = _per_device(hp, plan, state, sched, g32, mu, outgoing)
  return Result(updates, mu, nu, nu_l1, local_sent, keep(scales, state.worker_scale), server_error,
                local_mu, accumulator, finite, wire)
