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


def _preconditioners(hp: Hyper, plan: Plan, nus, nu_l1, bc2) -> list:
  r"""Per leaf, the frozen preconditioner's denominator :math:`\sqrt{\max(\hat v, f\bar{\hat v})} + \epsilon`."""
  floor = floors(hp, plan, nu_l1, bc2)
  return [jnp.sqrt(jnp.maximum(v / bc2, floor[i])) + hp.eps for i, v in enumerate(nus)]


def _local_progress(hp: Hyper, plan: Plan, grads, state, sched: Schedule, params, bc2):
  r"""This device's own step: :math:`m_i = \beta_1 m_i + (1-\beta_1) g_i`, :math:`a_i \mathrel{+}= -\eta(d_i + \lambda\theta_i)`.

  :math:`d_i = \hat m_i/(\sqrt{\max(\hat v, f\bar{\hat v})}+\epsilon)` is
  floored but not clipped: a device's own gradient is noisier than the mean
  that ``v`` was estimated from, and clipping each device's step before the
  mean biased the mean (the first version did: +9.6% validation loss against
  AdamW on the char GPT of ``benchmarks/convergence.py``, a sync every step;
  CHANGELOG). The bound applies to the sync's move instead
  (:func:`_sync_move`). :math:`\theta_i = \theta + a_i` is this
  device's copy of the parameters (:func:`zero_one_local_params`); the
  parameters themselves do not move.
  """
  mus, nus = jax.tree.leaves(state.mu), jax.tree.leaves(state.nu)
  local_mu, acc = leaves_or_none(state.local_mu), leaves_or_none(state.accumulator)
  denominators = _preconditioners(hp, plan, nus, state.nu_l1, bc2)
  bc1 = bias_correction(hp.b1, sched.count)
  new_mu, new_acc = [], []
  for i, g in enumerate(grads):
    # The momentum and progress since the last sync (none kept: a sync every step).
    base = mus[i] if local_mu is None else jnp.where(sched.fresh, mus[i], local_mu[i][0])
    a = 0.0 if acc is None else acc[i][0]
    m = hp.b1 * base + (1.0 - hp.b1) * g.astype(F32)
    d = jnp.where(nus[i] > 0, (m / bc1) / denominators[i], 0.0)
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


def _sync_move(hp: Hyper, plan: Plan, i, avg, denominator, lr_sum, params):
  r"""The sync's move :math:`\bar a/(\sqrt{\hat v}+\epsilon)`, its step part clipped at :math:`\pm B\sum\eta`.

  The 1-bit mean holds each coordinate at its leaf's scale: divided by a small
  :math:`\sqrt{\hat v}` the sign noise would move a coordinate far beyond
  Adam's step bound. As :func:`scale_by_onebit_adam` does after its freeze,
  the bound applies to what the compression gave (the clip of each device's
  own step, before it, does not bound the mean's noise); the weight decay's
  share (:math:`-\lambda\theta\sum\eta`, the synced point's) is kept out of it.
  """
  bound = adam_bound(hp.b1, hp.b2) if hp.max_update is None else hp.max_update
  bound = jnp.asarray(bound, F32) * lr_sum
  decay = 0.0
  if params is not None and plan.decays(i):
    decay = hp.weight_decay * lr_sum * params[i].astype(F32)
  return jnp.clip(avg / denominator + decay, -bound, bound) - decay


def _mean_of(plan: Plan, gathered, shapes) -> list:
  """Per leaf, the mean that the gathered 1-bit messages hold (an empty leaf: zeros)."""
  return [jnp.zeros(s, F32) if plan.kind(i)[0] == "z" else mean_leaf(plan, gathered, i, s)
          for i, s in enumerate(shapes)]


def _finite_mean(hp: Hyper, plan: Plan, total):
  """Whether the mean gradient (the variance step's) is finite everywhere."""
  mean = [t * (1.0 / plan.axes.n_slow) for t in total]
  return (jnp.all(jnp.isfinite(jnp.stack([jnp.sum(m) for m in mean])))
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

  if hp.local_steps is None:
    local = onebit
  else:
    local = lambda *ops: jax.lax.cond(sched.sync, onebit, silent, *ops)
  return jax.lax.switch(sched.kind, [variance, onebit, local], g32, sent, exact, server)


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
  The values are those of the earlier per-kind branches up to the rounding of
  fused multiply-adds, which XLA:CPU contracts differently in other fusions.
  """
  layout = plan.layout
  is_var, is_comp = sched.kind == VARIANCE, sched.kind == COMPRESSED
  is_local = sched.kind == LOCAL
  synced = is_local & sched.sync
  mus, nus = jax.tree.leaves(state.mu), jax.tree.leaves(state.nu)
  empty = [plan.kind(i)[0] == "z" for i in range(len(mus))]
  g32 = [g.astype(F32) for g in grads]
  bc1 = bias_correction(hp.b1, sched.count)
  bc2 = bias_correction(hp.b2, state.variance_updates)  # v frozen: compressed, local, sync
  # The local step's own progress and the sync's message (used on local-phase steps).
  new_mu, acc = _local_progress(hp, plan, grads, state, sched, params, bc2)
  if hp.local_steps is not None:  # (read after the conditional: materialized before it)
    new_mu, acc = jax.lax.optimization_barrier((new_mu, acc))
  denominators = _preconditioners(hp, plan, nus, state.nu_l1, bc2)
  scaled = [a * q for a, q in zip(acc, denominators)]
  # A compressed step sends each device's momentum (as 1-bit Adam does), not its gradient.
  local_momentum = [hp.b1 * m + (1.0 - hp.b1) * g for m, g in zip(mus, g32)]
  sent = [jnp.where(is_comp, local_momentum[i][None] + feedback(state.local_sent[k], state.worker_scale[0, k]),
                    scaled[i][None] + feedback(state.local_sent[k], state.worker_scale[0, k],
                                               jnp.logical_not(sched.fresh)))
          for k, i in enumerate(layout.compressed)]
  exact = [jnp.where(is_comp, local_momentum[i], scaled[i]) for i in layout.exact]
  server = (None if state.server_error is None  # (fresh: a local-phase step)
            else jnp.where(sched.fresh, 0.0, state.server_error).astype(state.server_error.dtype))
  total, gathered, scales, server_error, finite = _collectives(
      hp, plan, state, sched, g32, sent, exact, server)
  if plan.axes.slow is None:  # one device: the sum is the gradient (no operand of the conditional)
    total = g32
    finite = jnp.where(is_var, _finite_mean(hp, plan, g32), finite)
  # The mean: float32 (variance step) or decoded from the 1-bit messages (fused into its consumers).
  onebit_mean = _mean_of(plan, gathered, [jnp.shape(v) for v in nus])
  avg = [jnp.where(is_var, t * (1.0 / plan.axes.n_slow), c) for t, c in zip(total, onebit_mean)]
  # Later readers take mu's and nu's successors (the same values where they are
  # read): a donated buffer that a fusion not ordered before its writer still
  # reads costs XLA a copy of it. (XLA:CPU expands the optimization barriers
  # before fusion; they still shape the passes before it.)
  # Variance and compressed steps: the new moments and Adam's (bounded) step.
  nu_v = [jnp.where(finite, hp.b2 * v + (1.0 - hp.b2) * jnp.square(g), v) for v, g in zip(nus, avg)]
  nu = jax.lax.optimization_barrier([jnp.where(is_var, v_new, v) for v_new, v in zip(nu_v, nus)])
  nu_l1 = jnp.where(is_var & finite, jnp.stack([jnp.sum(v) for v in nu_v]), state.nu_l1)
  bc2_here = jnp.where(is_var, bias_correction(hp.b2, state.variance_updates + 1), bc2)
  bounded = jnp.where(is_var, state.variance_updates < state.count, True)
  floor = floors(hp, plan, nu_l1, bc2_here)
  mu_vc = [m if empty[i] else jnp.where(finite, jnp.where(is_var, hp.b1 * m + (1.0 - hp.b1) * g, g), m)
           for i, (m, g) in enumerate(zip(mus, avg))]
  # Local-phase steps: nothing moves but this device's progress, or the sync (v unchanged).
  denominators = _preconditioners(hp, plan, nu, state.nu_l1, bc2)
  lr_sum = state.lr_sum + sched.lr
  mu_s = [m if empty[i] else jnp.where(finite & (lr_sum > 0), _momentum_after_sync(
      hp, plan, i, a, denominators[i], bc1, lr_sum, params), m)
          for i, (m, a) in enumerate(zip(mus, avg))]
  mu_l = mu_s if hp.local_steps is None else [jnp.where(sched.sync, ms, m)
                                               for ms, m in zip(mu_s, mus)]
  mu = jax.lax.optimization_barrier([jnp.where(is_local, ml, mvc) for ml, mvc in zip(mu_l, mu_vc)])
  # mu and nu are now this step's: mu_vc and nu on variance and compressed steps.
  dirs = [_zeros_like(m) if empty[i] else direction(hp, m, v, bc1, bc2_here, floor[i], bounded, finite)
          for i, (m, v) in enumerate(zip(mu, nu))]
  upd_vc = _scaled(hp, plan, dirs, params, sched, finite)
  upd_s = [_zeros_like(v) if empty[i] else jnp.where(finite & (v > 0), _sync_move(
      hp, plan, i, a, denominators[i], lr_sum, params), 0.0) for i, (v, a) in enumerate(zip(nu, avg))]
  if hp.local_steps is None:
    upd_l = [-u for u in upd_s]
  else:
    upd_l = [jnp.where(sched.sync, u, 0.0) for u in upd_s]
  updates = [jnp.where(is_local, ul, uvc) for ul, uvc in zip(upd_l, upd_vc)]
  # A skipped step keeps what was sent before (its feedback stays valid), unless
  # that was the gradients' (a dropped first sync after the freeze).
  active = is_comp | synced
  keep = lambda new, old: jnp.where(active, jnp.where(finite, new, jnp.where(
      sched.fresh, 0.0, old)), old).astype(old.dtype)
  local_sent = tuple(keep(u, old) for u, old in zip(sent, state.local_sent))
  wire = jnp.where(is_var, _bytes_allreduce(plan),
                   jnp.where(active, _bytes_onebit(plan), 0.0)).astype(F32)
  local_mu = accumulator = None
  if hp.local_steps is not None:
    vary = lambda x: _collective.vary(x[None], plan.axes.device_axes)
    local_mu = [jnp.where(is_local, jnp.where(sched.sync, vary(ms), m[None]), old)  # (mu: mu_s)
                for ms, m, old in zip(mu, new_mu, jax.tree.leaves(state.local_mu))]
    accumulator = [jnp.where(is_local, jnp.where(sched.sync, vary(jnp.zeros_like(a)), a[None]), old)
                   for a, old in zip(acc, jax.tree.leaves(state.accumulator))]
  return Result(updates, mu, nu, nu_l1, local_sent, keep(scales, state.worker_scale), server_error,
                local_mu, accumulator, finite, wire)
