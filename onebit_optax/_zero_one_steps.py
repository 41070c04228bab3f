"""0/1 Adam's three kinds of step (variance, compressed, local/sync): full-size math and collectives."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from onebit_optax import _bounded
from onebit_optax import _collective
from onebit_optax import _groups
from onebit_optax import _layout

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


Plan = _groups.Plan


class Schedule(NamedTuple):
  """Which step this is, from replicated counters only (every device agrees: no deadlock)."""

  kind: jax.Array  # () int32: VARIANCE, COMPRESSED or LOCAL (the branch taken).
  sync: jax.Array  # () bool: a sync (with local steps: a LOCAL step that ends with the 1-bit sync;
  #   without them every step after the freeze, taken as a COMPRESSED step).
  fresh: jax.Array  # () bool: the first step after the freeze (the error feedback restarts).
  count: jax.Array  # () int32: this step's number (1 for the first).
  lr: jax.Array  # () float32: this step's learning rate (local steps; else 0).
  at: Any = None  # _groups.Offsets: where this step reads each leaf's pieces (set by step()).


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
  message: jax.Array  # the momentum message after this step (a compressed step's 1-bit mean of m)
  mu_in_message: jax.Array  # () bool: m lives in ``message``, not in ``mu``


def exchange(plan: Plan, sent: list, exact, server_error, hp: Hyper):
  """The 1-bit mean of ``sent`` (per group, ``(leaves, *shape)``) and ``exact`` (the float32 leaves, concatenated).

  One uint8 ``all_to_all`` and one uint8 ``all_gather`` however many leaves
  (:func:`_collective.onebit_exchange`); each leaf is compressed with its own
  RMS scale. Returns ``(gathered, scales, server_error, finite)``; ``finite``
  is read off the replicated gathered scales, so every device agrees on it.
  """
  rows, scales = _groups.rows(plan.layout, sent, exact)
  gathered, server_error, finite = _collective.onebit_exchange(
      rows, server_error, plan.layout, plan.axes, keep_if_nonfinite=hp.skip_nonfinite)
  if not hp.skip_nonfinite:
    finite = jnp.bool_(True)
  return gathered, _collective.vary(scales[None], plan.axes.device_axes), server_error, finite


def floors(hp: Hyper, plan: Plan, nu_l1, bc2, at: _groups.Offsets, bounded=True) -> list:
  """Per leaf: the floor on the bias-corrected variance, ``variance_floor`` x the leaf's mean (0 where not ``bounded``)."""
  floor = _bounded.floors(hp.variance_floor, nu_l1, plan.layout.sizes, bc2, bounded)
  return [_groups.at_index(floor, at.leaves[i]) for i in range(len(plan.layout.sizes))]


def _zeros_like(g):
  return jnp.zeros(jnp.shape(g), F32)


def _bytes_allreduce(plan: Plan) -> float:
  return _collective.allreduce_wire_bytes(sum(plan.layout.sizes), plan.axes.n_slow)


def _bytes_onebit(plan: Plan) -> float:
  return 2.0 * (plan.axes.n_slow - 1) * plan.layout.row_bytes


def leaves_or_none(tree):
  return None if tree is None else jax.tree.leaves(tree)


def _preconditioners(hp: Hyper, plan: Plan, nus, nu_l1, bc2, at: _groups.Offsets) -> list:
  r"""Per leaf, the frozen preconditioner's denominator :math:`\sqrt{\max(\hat v, f\bar{\hat v})} + \epsilon`."""
  floor = floors(hp, plan, nu_l1, bc2, at)
  scalars = _layout.PerShape((jnp.asarray(bc2, F32), jnp.asarray(hp.eps, F32)))
  out = []
  for i, v in enumerate(nus):
    bc2_here, eps = scalars(jnp.shape(v))
    out.append(jnp.sqrt(jnp.maximum(v / bc2_here, floor[i])) + eps)
  return out


class _Own(NamedTuple):
  """The scalars of a device's own step and of a sync's restart, broadcast per shape (:func:`_own`)."""

  b1: jax.Array
  c1: jax.Array  # 1 - b1
  bc1: jax.Array  # 1 - b1^t
  weight_decay: jax.Array
  lr: jax.Array  # this step's learning rate (local steps; else 0)
  lr_sum: jax.Array  # the rates' sum since the sync, this step's included
  fresh: jax.Array  # () bool: the first step after the freeze
  zero: jax.Array


def _own(hp: Hyper, state, sched: Schedule, bc1) -> _layout.PerShape:
  """The :class:`_Own` scalars (make them in the branch that uses them, see :class:`_layout.PerShape`)."""
  f32 = lambda x: jnp.asarray(x, F32)  # (1 - b1 as Python computes it for a float b1)
  lr_sum = state.lr_sum + sched.lr
  return _layout.PerShape(_Own(f32(hp.b1), f32(1.0 - hp.b1), f32(bc1), f32(hp.weight_decay),
                               f32(sched.lr), f32(lr_sum), sched.fresh, jnp.zeros((), F32)))


def _momentum(own: _layout.PerShape, base, g):
  r"""A device's momentum after its own gradient, :math:`\beta_1 m + (1-\beta_1) g_i` (``own``: :func:`_own`)."""
  k = own(jnp.shape(base))
  return k.b1 * base + k.c1 * g.astype(F32)


def _progress(own: _layout.PerShape, plan: Plan, i, m, nu, denominator, a, param):
  r"""This device's progress after its own step: :math:`a_i - \eta(d_i + \lambda\theta_i)`.

  :math:`d_i = \hat m_i/(\sqrt{\max(\hat v, f\bar{\hat v})}+\epsilon)` is
  floored but not clipped: a device's own gradient is noisier than the mean
  that ``v`` was estimated from, and clipping each device's step before the
  mean biased the mean (the first version did: +9.6% validation loss against
  AdamW on the char GPT of ``benchmarks/convergence.py``, a sync every step;
  CHANGELOG). The bound applies to the sync's move instead
  (:func:`_updates`). :math:`\theta_i = \theta + a_i` is this
  device's copy of the parameters (:func:`local_params` with the state); the
  parameters themselves do not move.
  """
  k = own(jnp.shape(m))
  d = jnp.where(nu > k.zero, (m / k.bc1) / denominator, k.zero)
  theta = a if param is None else param.astype(F32) + a
  if plan.decays(i):
    d = d + k.weight_decay * theta
  return a - k.lr * d


def _momentum_after_sync(own: _layout.PerShape, plan: Plan, i, avg, denominator, params):
  r"""The restarted momentum :math:`m = (1-\beta_1^t)(-\bar a/\sum\eta - \lambda\theta(\sqrt{\hat v}+\epsilon))`.

  :math:`-\bar a/\sum\eta` is the average step in Adam's units, weight decay
  included; its decay share is taken out (with :math:`\theta` the synced
  point: exact for a sync every step). DeepSpeed leaves it in the momentum,
  which then applies the decay again on every later step, up to
  :math:`1/(1-\beta_1)` times over (with a sync every step: +37% held-out loss
  on the digits MLP at weight decay 0.1, ``benchmarks/zero_one_volume.py``).
  """
  k = own(jnp.shape(avg))
  m = -avg * k.bc1 / k.lr_sum
  if params is not None and plan.decays(i):
    m = m - k.weight_decay * params[i].astype(F32) * denominator * k.bc1
  return m


def _finite_mean(hp: Hyper, plan: Plan, total):
  """Whether the mean gradient (the variance step's) is finite everywhere."""
  return (jnp.all(jnp.isfinite(_groups.sums(total)))  # (a NaN or Inf anywhere: a non-finite sum)
          if hp.skip_nonfinite else jnp.bool_(True))


def _onebit_exchange(hp: Hyper, plan: Plan, sched: Schedule, sent, exact, server):
  """A compressed step's or a sync's 1-bit exchange in a conditional: ``(gathered, scales, server_error, finite)``.

  ``sent`` are the groups of ``local_sent``, ``exact`` the exact leaves'
  floats. Other steps send nothing: zeros, the server error passed through
  (the false branch, as every full-size buffer of the step). The first sync
  after the freeze restarts the server error (it held the compressed steps').
  """
  no_scales = _collective.vary(jnp.zeros((1, len(plan.layout.compressed)), F32),
                               plan.axes.device_axes)

  def onebit(sent, exact, server):
    if server is not None:
      server = jnp.where(sched.fresh, 0.0, server).astype(server.dtype)
    return exchange(plan, sent, exact, server, hp)

  shape = jax.eval_shape(onebit, sent, exact, server)[0]
  no_message = jnp.zeros(shape.shape, shape.dtype)
  silent = lambda sent, exact, server: (no_message, no_scales, server, jnp.bool_(True))
  return jax.lax.cond(_sends_onebit(sched), onebit, silent, sent, exact, server)


def _sends_onebit(sched: Schedule) -> jax.Array:
  """A compressed step or a sync: the steps that send the 1-bit exchange."""
  return (sched.kind == COMPRESSED) | _is_sync(sched)


def variance_decay(hp: Hyper, state, count) -> jax.Array:
  """What a variance step at ``count`` multiplies ``v`` by: b2, or b2 per step since the last one."""
  if not hp.per_step_ema:
    return jnp.asarray(hp.b2, F32)
  return jnp.asarray(hp.b2, F32) ** (count - state.variance_step).astype(F32)


def v_correction(hp: Hyper, variance_updates, variance_step) -> jax.Array:
  """``v``'s bias correction after ``variance_updates`` variance steps, the last at ``variance_step``."""
  return _bounded.bias_correction(hp.b2, variance_step if hp.per_step_ema else variance_updates)


class _Old(NamedTuple):
  """The state's full-size leaves (tree order) that the step reads."""

  mu: list
  nu: list
  local_mu: Optional[list]  # (1, *shape) per leaf, or None without local steps
  accumulator: Optional[list]
  params: Optional[list]


def _outgoing_leaf(own: _layout.PerShape, plan: Plan, sched: Schedule, old: _Old, i, g, denominators):
  r"""What a sync sends of leaf ``i`` before its error feedback: :math:`a_i(\sqrt{\hat v}+\epsilon)`.

  :math:`a_i` is this device's progress after this step (:func:`_progress`),
  from its own momentum (the synced ``m`` at the first local-phase step).
  """
  base = jnp.where(own(jnp.shape(g)).fresh, old.mu[i], old.local_mu[i][0])
  param = None if old.params is None else old.params[i]
  a = _progress(own, plan, i, _momentum(own, base, g), old.nu[i], denominators[i],
                old.accumulator[i][0], param)
  return a * denominators[i]


def _write_sent(hp: Hyper, plan: Plan, g32, state, sched: Schedule, old: _Old, bc1, bc2):
  """Stage 1 of a compressed step or a sync: what each device sends, written over ``local_sent``.

  A compressed step (and a sync without local steps, which is one) sends its
  momentum :math:`\\beta_1 m + (1-\\beta_1) g_i + e_i`, a sync with local steps
  its scaled progress (:func:`_outgoing_leaf`) :math:`+ e_i` (no :math:`e_i`
  at the first step after the freeze). Returns ``(local_sent, exact)``:
  the groups (other steps pass them through) and the exact leaves' float32
  values (zeros on other steps). The false branch of each ``lax.cond`` passes
  the buffers through, the form XLA writes in place (as 1-bit Adam's switch).
  """
  layout = plan.layout
  vary = lambda x: _collective.vary(x, plan.axes.device_axes)

  def values(source: str):
    def branch(local, g32):
      own = _own(hp, state, sched, bc1)
      if source == "mu":  # m and g stacked, then one expression a group (not one a leaf)
        stack = lambda leaves, span: jnp.stack([leaves[layout.compressed[k]] for k in span])
        stacked = lambda g, span: _momentum(own, stack(old.mu, span), stack(g32, span))[None]
        exact = _groups.exact(layout, {i: _momentum(own, old.mu[i], g32[i]) for i in layout.exact})
      else:
        denominators = _preconditioners(hp, plan, old.nu, state.nu_l1, bc2, sched.at)
        value = lambda i: _outgoing_leaf(own, plan, sched, old, i, g32[i], denominators)
        stacked = lambda g, span: jnp.stack([value(layout.compressed[k]) for k in span])[None]
        exact = _groups.exact(layout, {i: value(i) for i in layout.exact})
      valid = jnp.logical_not(sched.fresh)
      groups = []
      for g, (span, u) in enumerate(zip(layout.groups, local)):
        scale = _groups.group_scale(state.worker_scale[0], span, layout.group_shape(g), sched.at)[None]
        groups.append((stacked(g, span) + _groups.feedback(u, scale, valid)).astype(u.dtype))
      return tuple(groups), vary(exact)
    return branch

  zeros = lambda *_: vary(jnp.zeros((layout.exact_size,), F32))
  keep = lambda local, g32: (local, zeros())

  is_compressed = sched.kind == COMPRESSED
  in_message = state.mu_in_message
  from_message = is_compressed & in_message  # (m decoded from it, as 1-bit Adam's compression)
  local = _groups.write_sent(from_message, hp.b1, layout, state.momentum_message, g32,
                             state.local_sent, state.worker_scale[0], jnp.logical_not(sched.fresh),
                             sched.at)
  exact = jax.lax.cond(from_message, lambda g32: vary(_groups.exact_momenta(
      hp.b1, layout, state.momentum_message, g32)), zeros, g32)
  local, first = jax.lax.cond(is_compressed & jnp.logical_not(in_message), values("mu"), keep,
                              local, g32)
  exact = jnp.where(in_message, exact, first)
  if hp.local_steps is None:  # (no other sync: every step after the freeze is a compressed one)
    return local, exact
  local, synced = jax.lax.cond(_is_sync(sched), values("sync"), keep, local, g32)
  return local, jnp.where(is_compressed, exact, synced)


def _is_sync(sched: Schedule) -> jax.Array:
  return (sched.kind == LOCAL) & sched.sync


def _variance_moments(hp: Hyper, plan: Plan, state, sched: Schedule, g32, finite, old: _Old):
  """A variance step's float32 mean gradient and Adam's ``m``, ``v`` (and ``nu_l1``) of it; else passed through.

  The all-reduce runs inside the branch, where its result is consumed (one
  tuple all-reduce of the leaves; the ``1/n`` fused into the moments). A
  non-finite mean keeps the moments. ``finite`` is the 1-bit exchange's (True
  where none ran), an operand so that this conditional, which overwrites
  ``m`` and ``v``, is ordered after :func:`_write_sent`, which reads them.
  Returns ``(mu, nu, nu_l1, finite)``, ``finite`` now both flags.
  """
  scale = 1.0 / plan.axes.n_slow

  def update(mu, nu, finite):
    total = (g32 if plan.axes.slow is None else
             _collective.psum_leaves(g32, plan.axes.slow, plan.axes.n_slow))
    finite = finite & _finite_mean(hp, plan, total)
    decay = variance_decay(hp, state, sched.count)
    mu, nu = _bounded.adam_moments(mu, nu, total, scale, finite, hp.b1, decay)
    # (summed from the new buffers, not from a second pass over the old ones)
    return mu, nu, jnp.where(finite, _groups.sums(nu), state.nu_l1), finite

  keep = lambda mu, nu, finite: (mu, nu, state.nu_l1, finite)
  return jax.lax.cond(sched.kind == VARIANCE, update, keep, old.mu, old.nu, finite)


def _materialized_mu(plan: Plan, state, sched: Schedule, mu: list) -> list:
  """``m`` written into ``mu`` from the momentum message, before any step but a compressed one reads ``mu``.

  A compressed step keeps its 1-bit mean of ``m`` as the message itself (as
  1-bit Adam does): no full-size write of ``m``. The other kinds read and
  write ``m`` as float32, so the first of them after compressed steps decodes
  it here (the message's exact leaves are exact); other steps pass ``mu``
  through.
  """
  def decode(mu):
    means = _groups.mean_leaves(plan.layout, state.momentum_message, sched.at)
    return [m if plan.kind(i)[0] == "z" else means[i] for i, m in enumerate(mu)]

  return jax.lax.cond(state.mu_in_message & (sched.kind != COMPRESSED), decode, lambda mu: mu, mu)


def _onebit_mu(hp: Hyper, plan: Plan, state, sched: Schedule, gathered, mu, nu, finite,
               old: _Old, bc1, bc2):
  """``m`` after a sync with local steps (restarted); other steps pass it through (a compressed step's ``m`` is its message)."""
  if hp.local_steps is None:
    return mu

  def synced(mu):
    means = _groups.mean_leaves(plan.layout, gathered, sched.at)
    denominators = _preconditioners(hp, plan, nu, state.nu_l1, bc2, sched.at)
    own = _own(hp, state, sched, bc1)
    return [m if plan.kind(i)[0] == "z" else
            _momentum_after_sync(own, plan, i, means[i], denominators[i], old.params)
            for i, m in enumerate(mu)]

  # (no rates since the sync, no move: m kept)
  moved = state.lr_sum + sched.lr > 0
  return jax.lax.cond(_is_sync(sched) & finite & moved, synced, lambda mu: mu, mu)


def _updates(hp: Hyper, plan: Plan, state, sched: Schedule, gathered, mu, nu, nu_l1, finite,
             bc1, bc2, params) -> list:
  r"""Every kind's update, one expression from the new ``m`` and ``v`` with per-kind scalars.

  A variance or compressed step: Adam's (bounded) direction :math:`d` plus the
  weight decay :math:`\lambda\theta`. A sync: the same expression of the
  restarted :math:`m` (:func:`_momentum_after_sync` is built so that
  :math:`\hat m/\delta = -\bar a/(\delta\sum\eta) - \lambda\theta`: the clip of
  :math:`\hat m/\delta` is the sync's clipped move, in
  direction units), where a coordinate whose :math:`v` is 0 does not move, its
  decay included. With local steps it is scaled by :math:`-\eta` (variance and
  compressed steps), :math:`-\sum\eta` (a sync) or 0 (a local step).
  """
  is_var = sched.kind == VARIANCE
  bc2_here = jnp.where(is_var, v_correction(hp, state.variance_updates + 1, sched.count), bc2)
  bounded = _bounded_now(state, sched)
  floor = floors(hp, plan, nu_l1, bc2_here, sched.at, bounded)
  # A coordinate whose v is 0 stays put (see _bounded.bounded_step), its decay too, except on
  # a local step.
  scalars = _bounded.scalars(hp.b1, hp.b2, hp.eps, hp.max_update, bc1, bc2_here, bounded=bounded,
                             finite=finite, zero_without_variance=True)
  decay_still_to = _bounded.still_threshold(finite, sched.kind == LOCAL)
  if hp.local_steps is None:
    factor = None
  else:
    lr_sum = state.lr_sum + sched.lr
    factor = jnp.where(sched.kind == LOCAL, jnp.where(sched.sync, -lr_sum, 0.0), -sched.lr)
  is_compressed = sched.kind == COMPRESSED  # (m: the new message, decoded leaf by leaf)
  means = _groups.mean_leaves(plan.layout, gathered, sched.at)
  per_shape = _layout.PerShape(_UpdateScalars(scalars, is_compressed, decay_still_to,
                                              jnp.asarray(hp.weight_decay, F32), factor))
  out = []
  for i, (m, v) in enumerate(zip(mu, nu)):
    if plan.kind(i)[0] == "z":
      out.append(_zeros_like(m))
      continue
    k = per_shape(jnp.shape(m))
    d = _bounded.bounded_step(jnp.where(k.compressed, means[i], m), v, floor[i], k.step)
    if params is not None and plan.decays(i):
      decay = k.weight_decay * params[i].astype(F32)
      d = d + jnp.where(v <= k.decay_still_to, k.step.zero, decay)
    out.append(d if factor is None else k.factor * d)
  return out


class _UpdateScalars(NamedTuple):
  """The scalars of every kind's update (:func:`_updates`), broadcast per shape."""

  step: _bounded.Scalars
  compressed: jax.Array  # () bool: a compressed step (m is the new message)
  decay_still_to: jax.Array  # () float32: where v <= it, no weight decay either
  weight_decay: jax.Array  # () float32
  factor: Any  # () float32: with local steps, what scales the update; else None


def _bounded_now(state, sched: Schedule) -> jax.Array:
  """The step is floored and clipped: every step but a variance step before any compressed one."""
  return jnp.where(sched.kind == VARIANCE, state.variance_updates < state.count, True)


def _local_step(hp: Hyper, plan: Plan, state, sched: Schedule, g32, old: _Old, bc1, bc2):
  """A local step's ``local_mu`` and ``accumulator``: this device's own momentum and progress.

  Taken first, before anything writes ``m``, ``v`` or the parameters that it
  reads (a local step changes nothing else); other steps pass the buffers through.
  """
  if hp.local_steps is None:
    return None, None

  def local(local_mu, acc):
    denominators = _preconditioners(hp, plan, old.nu, state.nu_l1, bc2, sched.at)
    own = _own(hp, state, sched, bc1)
    new_mu, new_acc = [], []
    for i, (g, lm, a) in enumerate(zip(g32, local_mu, acc)):
      # (in the buffers' own shape, (1, *shape): a fusion writing through a reshape is not in place)
      m = _momentum(own, lm, g[None])  # (never fresh: the first local-phase step is a sync)
      param = None if old.params is None else old.params[i][None]
      new_acc.append(_progress(own, plan, i, m, old.nu[i][None], denominators[i][None], a, param))
      new_mu.append(m)
    return new_mu, new_acc

  return jax.lax.cond((sched.kind == LOCAL) & jnp.logical_not(sched.sync), local,
                      lambda lm, acc: (lm, acc), old.local_mu, old.accumulator)


def _restarted(hp: Hyper, plan: Plan, sched: Schedule, mu, local_mu, acc):
  """After a sync every device restarts from the synced ``m`` with no progress; other steps pass them through."""
  if hp.local_steps is None:
    return None, None
  vary = lambda x: _collective.vary(x[None], plan.axes.device_axes)
  restart = lambda lm, acc: ([vary(m) for m in mu], [jnp.zeros_like(a) for a in acc])
  return jax.lax.cond(_is_sync(sched), restart, lambda lm, acc: (lm, acc), local_mu, acc)


def _dropped(sched: Schedule, finite, local_sent, scales, old_scales):
  """After the exchange: a skipped 1-bit step drops the error feedback (``local_sent`` and its scales zero).

  What was sent is written before the step knows it is finite (the exchange
  reads it from ``local_sent``), so a skipped step cannot keep the old value:
  zero sent with zero scale is zero feedback, as 1-bit Adam's
  ``feedback_valid`` False.
  """
  drop = _sends_onebit(sched) & jnp.logical_not(finite)
  local_sent = jax.lax.cond(drop, lambda ls: tuple(jnp.zeros_like(u) for u in ls), lambda ls: ls,
                            local_sent)
  scales = jnp.where(_sends_onebit(sched), jnp.where(finite, scales, 0.0), old_scales)
  return local_sent, scales.astype(old_scales.dtype)


def step(hp: Hyper, plan: Plan, grads, state, sched: Schedule, params) -> Result:
  r"""One step of the kind ``sched.kind``: each kind's full-size work in its own conditionals.

  **Variance step**: the float32 mean gradient :math:`\bar g` (one
  all-reduce), Adam's ``m`` and ``v``, Adam's step (floored and clipped once
  compressed steps have fed ``m``).

  **Compressed step**: each device's momentum through the 1-bit mean with
  error feedback, :math:`u_i = \beta_1 m + (1-\beta_1) g_i + e_i`,
  :math:`m = \mathrm{compressed\_mean}_i(u_i)`, ``v`` unchanged.

  **Local step** (no communication), or a **sync**: the local step, then the
  1-bit mean of the progress (:func:`_momentum_after_sync`). A non-finite
  mean drops the interval on every device. Without local steps every step
  after the freeze is a sync of one step, taken as a compressed step
  (``sched.kind`` COMPRESSED, ``sched.sync`` True): the sync's own branches
  are not traced.

  The step is a chain of stages, each a ``lax.cond`` on replicated scalars
  whose false branch passes its full-size buffers through (the form XLA
  writes in place into the donated buffers; 1-bit Adam's switch): ``m`` out of
  the message into ``mu`` (:func:`_materialized_mu`), what is sent
  (:func:`_write_sent`), the 1-bit exchange (:func:`_onebit_exchange`), the
  variance step's moments, a sync's ``m``, the per-device buffers of local
  steps. So a step computes only its own kind's formulas. A compressed step's
  ``m`` is its gathered message (the new ``momentum_message``). The update is
  one expression of the new moments for every kind (:func:`_updates`).
  """
  g32 = [g.astype(F32) for g in grads]
  sched = sched._replace(at=_groups.offsets(plan.layout, (sched.kind != VARIANCE) | state.mu_in_message,
                                            _bounded_now(state, sched)))
  bc1 = _bounded.bias_correction(hp.b1, sched.count)
  bc2 = v_correction(hp, state.variance_updates, state.variance_step)  # v held: not a variance step
  old = _Old(jax.tree.leaves(state.mu), jax.tree.leaves(state.nu), leaves_or_none(state.local_mu),
             leaves_or_none(state.accumulator), params)
  old = old._replace(mu=_materialized_mu(plan, state, sched, old.mu))
  local_mu, accumulator = _local_step(hp, plan, state, sched, g32, old, bc1, bc2)
  old = old._replace(local_mu=local_mu, accumulator=accumulator)  # (the same values: read after)
  local_sent, exact = _write_sent(hp, plan, g32, state, sched, old, bc1, bc2)
  gathered, scales, server_error, finite = _onebit_exchange(
      hp, plan, sched, [u[0] for u in local_sent], exact, state.server_error)
  mu, nu, nu_l1, finite = _variance_moments(hp, plan, state, sched, g32, finite, old)
  # (every later reader takes v's successor, never the old buffer that its writer overwrites)
  mu = _onebit_mu(hp, plan, state, sched, gathered, mu, nu, finite, old, bc1, bc2)
  updates = _updates(hp, plan, state, sched, gathered, mu, nu, nu_l1, finite, bc1, bc2, params)
  local_sent, worker_scale = _dropped(sched, finite, local_sent, scales, state.worker_scale)
  is_var = sched.kind == VARIANCE
  is_compressed = sched.kind == COMPRESSED
  message = jnp.where(is_compressed & finite, gathered, state.momentum_message)
  in_message = jnp.where(is_compressed, finite | state.mu_in_message, False)
  wire = jnp.where(is_var, _bytes_allreduce(plan),
                   jnp.where(_sends_onebit(sched), _bytes_onebit(plan), 0.0)).astype(F32)
  local_mu, accumulator = _restarted(hp, plan, sched, mu, local_mu, accumulator)
  return Result(updates, mu, nu, nu_l1, local_sent, worker_scale, server_error,
                local_mu, accumulator, finite, wire, message, in_message)
