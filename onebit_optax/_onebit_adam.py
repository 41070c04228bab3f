"""1-bit Adam: per-leaf Adam moments, the phase switch around the collectives, and the alias."""

from __future__ import annotations

from typing import Any, Hashable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from optax._src import numerics

from onebit_optax import _bounded
from onebit_optax import _collective
from onebit_optax import _config
from onebit_optax import _freeze
from onebit_optax import _groups
from onebit_optax import _guards
from onebit_optax import _layout
from onebit_optax import _wire

__all__ = [
    "ScaleByOnebitAdamState",
    "scale_by_onebit_adam",
    "onebit_adam",
]

F32 = jnp.float32


class ScaleByOnebitAdamState(NamedTuple):
  """State for :func:`scale_by_onebit_adam`.

  ``mu`` and ``nu`` are shaped like the parameters, as in
  :func:`optax.scale_by_adam`. After the freeze the mean momentum lives in
  ``momentum_message``, exactly as it went over the wire (packed signs and one
  scale per leaf piece, about 1/32 of the float32 bytes); ``mu`` keeps its
  value at the freeze (at the freeze step itself the message's compressed part
  is zero and each device's ``local_momentum`` holds :math:`\beta_1 m` with
  scale 0, all of it error feedback). :func:`onebit_optax.moments` shows the
  current moments as trees in both phases.

  Per device (under ``shard_map`` their leading axis is the device axis: shard
  them with ``P(axis_name)``, see :func:`state_partition_specs`):
  ``local_momentum`` (what this device compressed last: its momentum plus its
  compression error, from which the error feedback is formed),
  ``worker_scale``, ``server_error`` and, under hierarchical averaging,
  ``worker_error``. Every other field is replicated. Memory per device:
  :math:`3D + D/n + D/32` floats (:func:`optax.adam`: :math:`2D`).

  Example:
    >>> import jax.numpy as jnp, onebit_optax
    >>> state = onebit_optax.scale_by_onebit_adam(axis_name=None).init({'w': jnp.ones(300)})
    >>> state.mu['w'].shape, state.local_momentum[0].shape, state.momentum_message.shape
    ((300,), (1, 1, 300), (1, 52))

  References:
    Tang et al., `1-bit Adam <https://arxiv.org/abs/2102.02888>`_, ICML 2021, Algorithm 1.
  """

  count: jax.Array  # shape=(), dtype=int32: optimizer steps taken.
  mu: Any  # tree like params, dtype=moment_dtype: Adam's first moment (replicated); its freeze value afterwards.
  nu: Any  # tree like params, dtype=moment_dtype: second moment, raw (no bias correction); frozen after the switch.
  nu_l1: jax.Array  # shape=(num_leaves,), dtype=float32: sum of nu over each leaf at the last check (freeze rule, floor).
  local_momentum: Any  # tuple, per group of compressed leaves of one shape: shape=(1, leaves, *shape), dtype=error_dtype, per device; None when hierarchical.
  worker_scale: jax.Array  # shape=(1, compressed leaves), dtype=float32, per device: the scale of each leaf of local_momentum, group after group.
  feedback_valid: jax.Array  # shape=(), dtype=bool: the error feedback of local_momentum applies (False after a skipped step).
  worker_error: Any  # hierarchical: shape=(1, padded // fast), dtype=error_dtype, per device; else None.
  server_error: Any  # shape=(1, chunk), dtype=error_dtype, per device; None on one device.
  momentum_message: jax.Array  # shape=(n, row_bytes), dtype=uint8: the last compressed mean momentum (replicated).
  frozen: jax.Array  # shape=(), dtype=bool: True once in the compression phase.
  freeze_step: jax.Array  # shape=(), dtype=int32: last warmup step (0 while warming up).
  variance_ratio: jax.Array  # shape=(), dtype=float32: last ||v_hat_t||_1 / ||v_hat_{t-Δ}||_1 (NaN before the first).
  reference_l1: jax.Array  # shape=(), dtype=float32: ||v_hat||_1 at the last check (every Δ steps).
  wire_bytes: jax.Array  # shape=(), dtype=float32: bytes this device sent in the last step.
  skipped_steps: jax.Array  # shape=(), dtype=int32: steps skipped (together, on all devices) for non-finite gradients.


class _Hyper(NamedTuple):
  """The (possibly traced) hyperparameters and static options one update needs."""

  b1: Any
  b2: Any
  eps: Any
  variance_floor: Any
  max_update: Any
  policy: _freeze.FreezePolicy
  skip_nonfinite: bool
  exact_below: int


class _Exchange(NamedTuple):
  """What the compression branch returns (the warmup branch returns the state's values)."""

  gathered: jax.Array  # (n, row_bytes) uint8: the compressed mean momentum.
  worker_scale: jax.Array
  worker_error: Any  # full-size buffers: fresh in one branch, passed through in the other,
  server_error: Any  # the pattern XLA writes in place (other full-size cond results got a copy).
  finite: jax.Array
  wire_bytes: jax.Array


class _Moments(NamedTuple):
  """What the warmup branch returns (the compression branch returns the state's values)."""

  mu: list  # Adam's new first moment, leaf by leaf.
  nu: list
  nu_l1: jax.Array
  finite: jax.Array
  frozen: jax.Array
  freeze_step: jax.Array
  variance_ratio: jax.Array
  reference_l1: jax.Array
  wire_bytes: jax.Array


def _write_sent(hp: _Hyper, plan: _groups.Plan, grads: list, state, at: _groups.Offsets):
  """Stage 1, compression only: ``u`` of every compressed leaf, written over ``local_momentum``.

  ``u`` is stored before the exchange so that its scale and signs are read off
  a buffer (a reduction over a computed full-size value made XLA:CPU store
  that value in a temporary). A skipped step therefore cannot keep the old
  ``u``: it clears ``feedback_valid`` instead.
  """
  if state.local_momentum is None:
    return None
  return _groups.write_sent(state.frozen, hp.b1, plan.layout, state.momentum_message, grads,
                            state.local_momentum, state.worker_scale[0], state.feedback_valid, at)


def _compression(hp: _Hyper, plan: _groups.Plan, grads: list, local, state, at) -> _Exchange:
  """The compression phase's communication: the 1-bit exchange of the momenta."""
  axes = plan.axes
  if axes.hierarchical:
    gathered, worker_error, server_error, finite = _hierarchical_exchange(hp, plan, grads, state,
                                                                          at)
    scales = state.worker_scale
  else:
    rows, scales = _groups.rows(plan.layout, [u[0] for u in local],
                                _groups.exact_momenta(hp.b1, plan.layout, state.momentum_message, grads))
    gathered, server_error, finite = _collective.onebit_exchange(
        rows, state.server_error, plan.layout, axes, keep_if_nonfinite=hp.skip_nonfinite)
    scales, worker_error = _collective.vary(scales[None], axes.device_axes), state.worker_error
  if not hp.skip_nonfinite:
    finite = jnp.bool_(True)
  return _Exchange(gathered, scales, worker_error, server_error, finite,
                   jnp.float32(_step_bytes(plan, compressed=True)))


def _no_exchange(state) -> _Exchange:
  """A warmup step sends no 1-bit message: zeros, as the state's message is until the freeze.

  (Zeros, not the state's message passed through: that pass-through of a buffer
  which the other branch makes anew, the all-gather's, was a copy every step.)
  """
  return _Exchange(jnp.zeros_like(state.momentum_message), state.worker_scale, state.worker_error,
                   state.server_error, jnp.bool_(True), jnp.float32(0))


def _hierarchical_exchange(hp: _Hyper, plan: _groups.Plan, grads, state, at):
  """Hierarchical: float32 mean of the momenta over the fast axis, then 1 bit over the slow one."""
  layout, axes = plan.layout, plan.axes
  bits = layout.bits
  old = _groups.mean_leaves(layout, state.momentum_message, at)
  momenta = [hp.b1 * old[i] + (1.0 - hp.b1) * grads[i].astype(F32) for i in layout.compressed]
  part = _collective._fast_mean_slice(bits.flatten(momenta), axes.fast, axes.n_fast)
  error, server = (state.worker_error[0].astype(F32), state.server_error[0].astype(F32))
  error = jnp.where(state.feedback_valid, error, 0.0)
  avg = _collective.compressed_average(
      part, error, server, axes.data, layout=bits,
      keep_server_error_if_nonfinite=hp.skip_nonfinite, agree_axis=axes.model)
  residual = _collective.worker_residual(
      part, error, avg.worker_scale, bits,
      _collective._part(bits, jax.lax.axis_index(axes.fast), axes.n_slow).block_valid)
  if hp.skip_nonfinite:
    residual = jnp.where(avg.finite, residual, error)
  return (avg.gathered, residual[None].astype(state.worker_error.dtype),
          avg.server_error[None].astype(state.server_error.dtype), avg.finite)


def _gradient_sum(plan: _groups.Plan, grads):
  """The float32 sum of the gradients over the data axis, and the factor that makes it the mean.

  One tuple all-reduce of the leaves (XLA's all-reduce combiner merges them),
  as ``optax.adam`` after a ``pmean`` (a stacked sum would store a copy of the
  gradients). The ``1/n`` is left to the consumers, where it fuses (a ``pmean``
  stored the divided copy: one more parameter-sized buffer). Hierarchical: one
  flat vector, reduce-scattered over the fast axis so that the slow links carry
  1/fast of it (see :func:`_collective.full_precision_mean`).
  """
  axes, grads = plan.axes, [g.astype(F32) for g in grads]
  if axes.slow is None:
    return grads, 1.0
  if not axes.hierarchical:
    return _collective.psum_leaves(grads, axes.slow, axes.n_slow), 1.0 / axes.n_slow
  bits, order = plan.layout.bits, plan.layout.compressed  # (every leaf: none is exact)
  ordered = [grads[i] for i in order]  # in the stream's order, group after group
  flat = _collective.full_precision_mean(bits.flatten(ordered), axes.data)
  for i, mean in zip(order, bits.unflatten(flat, jax.tree.structure(ordered))):
    grads[i] = mean
  return grads, 1.0


def _warmup(hp: _Hyper, plan: _groups.Plan, grads: list, state, count) -> _Moments:
  """The warmup: Adam on the mean gradient, the freeze decision, the finite flag.

  The finite flag is a plain sum of each mean-gradient leaf (a NaN or Inf
  anywhere makes it non-finite) and the freeze rule's norm a sum of the new
  ``nu``: reductions of stored buffers, one per shape (:func:`_groups.sums`),
  which XLA:CPU runs without storing a computed copy (a reduction of a computed
  value, e.g. the squares, stored it; so did one of the leaves concatenated
  into their groups, and a dot product).
  """
  total, scale = _gradient_sum(plan, grads)
  sums = _groups.sums(total)
  finite = (_collective._all_true(jnp.all(jnp.isfinite(sums)), plan.axes.model)
            if hp.skip_nonfinite else jnp.bool_(True))
  mu, nu = _bounded.adam_moments(jax.tree.leaves(state.mu), jax.tree.leaves(state.nu), total,
                                 scale, finite, hp.b1, hp.b2)
  # Only where the freeze rule reads it (a check, or where it may fire and the
  # floor needs it): elsewhere this pass over nu would be wasted.
  nu_l1 = jax.lax.cond(_freeze.reads_norm(hp.policy, count, hp.b2),
                       lambda: _groups.sums(nu),
                       lambda: state.nu_l1)
  l1 = jnp.sum(nu_l1)
  if plan.axes.model is not None:  # the whole model's norm, so every shard freezes together
    l1 = jax.lax.psum(l1, plan.axes.model)
  freeze_now, reference, ratio = _freeze.freeze_decision(
      hp.policy, count, l1 / _bounded.bias_correction(hp.b2, count), state.reference_l1,
      state.variance_ratio, hp.b2)
  return _Moments(mu, nu, nu_l1, finite, freeze_now & finite,
                  jnp.where(freeze_now & finite, count, 0).astype(jnp.int32), ratio, reference,
                  jnp.float32(_step_bytes(plan, compressed=False)))


def _no_moments(state) -> _Moments:
  return _Moments(jax.tree.leaves(state.mu), jax.tree.leaves(state.nu), state.nu_l1,
                  jnp.bool_(True), state.frozen, state.freeze_step, state.variance_ratio,
                  state.reference_l1, jnp.float32(0))


def _step_bytes(plan: _groups.Plan, *, compressed: bool) -> float:
  """Bytes one device sends over the slow (or only) axis in one step."""
  axes, layout = plan.axes, plan.layout
  if compressed:
    return 2.0 * (axes.n_slow - 1) * layout.row_bytes
  size = layout.bits.padded // axes.n_fast if axes.hierarchical else sum(layout.sizes)
  return _collective.allreduce_wire_bytes(size, axes.n_slow)


def _freeze_stage(hp: _Hyper, plan: _groups.Plan, mu: list, local, ex: _Exchange, freeze_now):
  r"""Stage 3: at the freeze, the momentum moves into the error feedback; the message holds none of it.

  ``local_momentum`` becomes :math:`\beta_1 m` with scale 0, so its error
  feedback is all of it, and the message's compressed part is zero (zero
  bytes, zero scales; exact leaves carry :math:`m` as float32): the first
  compression step forms :math:`0 + (1-\beta_1) g + \beta_1 m`, the momentum
  exactly, with no per-leaf compression of :math:`m` here (it cost a quarter
  of the step's compiled program). Every device computes it alike from the
  replicated ``mu``: no communication. That message is selected where
  ``freeze_now``, outside the conditional (zeros but the exact columns: one
  elementwise pass with the message's other selects), so that no branch
  passes the exchange's message through (a copy of it every step; 0.094 ->
  0.063 D of one-device temporaries, ``tests/test_memory.py``). Hierarchical
  averaging keeps its worker error in a flat buffer: there the message is
  :math:`C(m)` and the scales :math:`\beta_1 s_m`, made at the freeze only.
  Returns ``(message, worker_scale, local_momentum)``.
  """
  layout, vary = plan.layout, lambda x: _collective.vary(x, plan.axes.device_axes)
  groups = lambda: _groups.stacks(layout, [mu[i] for i in layout.compressed])
  if local is None:
    def compress():
      rows, scales = _groups.rows(layout, groups(), _groups.exact(layout, mu))
      return rows, vary((hp.b1 * scales)[None])
    return (*jax.lax.cond(freeze_now, compress, lambda: (ex.gathered, ex.worker_scale)), None)
  zeros = jnp.zeros((len(layout.compressed),), F32)
  scale, local = jax.lax.cond(
      freeze_now,
      lambda u: (vary(zeros[None]), tuple(vary(hp.b1 * m[None]).astype(x.dtype)
                                           for m, x in zip(groups(), u))),
      lambda u: (ex.worker_scale, u), local)
  if not layout.exact_chunk:
    return ex.gathered, scale, local
  exact = _wire.exact_columns(layout, _groups.exact(layout, mu))
  rows = jnp.pad(exact, ((0, 0), (layout.row_bytes - exact.shape[1], 0)))  # (zeros before them)
  return jnp.where(freeze_now, rows, ex.gathered), scale, local


def _step_scalars(hp: _Hyper, frozen, bc1, bc2, finite) -> _bounded.Scalars:
  r"""The scalars of every leaf's update: Adam's during warmup, the floored and clipped frozen-variance step after.

  One expression for both phases (the phase only changes scalars: the floor,
  the clip), so that XLA writes each update in one pass from the moments. In
  warmup the floor is 0 and the clip infinite, which leaves
  :math:`\hat m / (\sqrt{\hat v} + \epsilon)` exactly; a coordinate with
  :math:`v = 0` stays put only once frozen (before, it is Adam's).
  """
  return _bounded.scalars(hp.b1, hp.b2, hp.eps, hp.max_update, bc1, bc2, bounded=frozen,
                          finite=finite, zero_without_variance=frozen)


def _updates(hp: _Hyper, plan: _groups.Plan, grads, state, ex: _Exchange, mo: _Moments,
             count, at: _groups.Offsets) -> list:
  """The update of every leaf, from the new moments (warmup) or the new message (compression)."""
  bc1 = _bounded.bias_correction(hp.b1, count)
  bc2 = _bounded.bias_correction(hp.b2, jnp.where(state.frozen, state.freeze_step, count))
  scalars = _layout.PerShape(_Frozen(state.frozen, _step_scalars(
      hp, state.frozen, bc1, bc2, ex.finite & mo.finite)))
  layout, out = plan.layout, []
  means = _groups.mean_leaves(layout, ex.gathered, at)
  floors = _bounded.floors(hp.variance_floor, mo.nu_l1, layout.sizes, bc2, state.frozen)
  for i, g in enumerate(grads):
    if plan.kind(i)[0] == "z":
      out.append(jnp.zeros(jnp.shape(g), g.dtype))  # replicated, as every other update
      continue
    here = scalars(jnp.shape(g))
    mean = jnp.where(here.frozen, means[i], mo.mu[i].astype(F32))
    floor = _groups.at_index(floors, at.leaves[i])
    out.append(_bounded.bounded_step(mean, mo.nu[i].astype(F32), floor, here.step).astype(g.dtype))
  return out


class _Frozen(NamedTuple):
  """The scalars of every leaf's update (:func:`_updates`), broadcast per shape."""

  frozen: jax.Array  # () bool
  step: _bounded.Scalars


def _check_float_dtype(name, dtype):
  dtype = jnp.dtype(F32 if dtype is None else dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"{name} must be a floating-point dtype, got {dtype}.")
  return dtype


def _plan(tree, axis_name, model_axis, exact_below: int, caller: str) -> _groups.Plan:
  return _groups.plan(tree, _collective.resolve_axes(axis_name, model_axis, caller=caller),
                      exact_below)


def _buffer_shapes(plan: _groups.Plan) -> dict:
  """The per-device buffers' shapes for this plan (None: the buffer does not exist)."""
  axes, layout = plan.axes, plan.layout
  return dict(
      local_momentum=None if axes.hierarchical else tuple(
          (1, len(span)) + tuple(layout.group_shape(g)) for g, span in enumerate(layout.groups)),
      worker_error=(1, layout.bits.padded // axes.n_fast) if axes.hierarchical else None,
      # (hierarchical: the slow axis compresses even with one node, as with more)
      server_error=(1, layout.bits.chunk) if axes.n_slow > 1 or axes.hierarchical else None,
      momentum_message=(axes.num_devices, layout.row_bytes))


def _init(params, plan: _groups.Plan, moment_dtype, error_dtype) -> ScaleByOnebitAdamState:
  vary = lambda x: _collective.vary(x, plan.axes.device_axes)
  shapes = _buffer_shapes(plan)
  zeros = lambda shape, dtype: None if shape is None else vary(jnp.zeros(shape, dtype))
  leaves = jax.tree.leaves(params)
  like = lambda dtype: jax.tree.unflatten(
      plan.treedef, [jnp.zeros(jnp.shape(p), dtype) for p in leaves])
  return ScaleByOnebitAdamState(
      count=jnp.zeros([], jnp.int32), mu=like(moment_dtype), nu=like(moment_dtype),
      nu_l1=jnp.zeros((len(leaves),), F32),
      local_momentum=None if shapes["local_momentum"] is None else tuple(
          vary(jnp.zeros(shape, error_dtype)) for shape in shapes["local_momentum"]),
      worker_scale=vary(jnp.zeros((1, len(plan.layout.compressed)), F32)),
      feedback_valid=jnp.zeros([], jnp.bool_),
      worker_error=zeros(shapes["worker_error"], error_dtype),
      server_error=zeros(shapes["server_error"], error_dtype),
      momentum_message=jnp.zeros(shapes["momentum_message"], jnp.uint8),
      frozen=jnp.zeros([], jnp.bool_), freeze_step=jnp.zeros([], jnp.int32),
      variance_ratio=jnp.full([], jnp.nan, F32), reference_l1=jnp.zeros([], F32),
      wire_bytes=jnp.zeros([], F32), skipped_steps=jnp.zeros([], jnp.int32))


def _placeholder_state(params) -> ScaleByOnebitAdamState:
  """For :func:`optax.tree.map_params`: ``mu`` and ``nu`` are the parameter-shaped fields."""
  fields = {name: jnp.zeros([]) for name in ScaleByOnebitAdamState._fields}
  return ScaleByOnebitAdamState(**{**fields, "mu": params, "nu": params})


def _check_update(updates, state, axis_name, model_axis, exact_below) -> _groups.Plan:
  """Validates the update's inputs; returns the plan of this update."""
  caller = "scale_by_onebit_adam.update"
  if not isinstance(state, ScaleByOnebitAdamState):
    raise TypeError(
        f"{caller} got a {type(state).__name__} state; pass the state returned by this "
        "transformation's init.")
  _guards.check_float_params(updates, caller)
  _guards.check_wrappers(axis_name, caller)
  _guards.check_mapped_region(axis_name, caller)
  plan = _plan(updates, axis_name, model_axis, exact_below, caller)
  _guards.check_state_layout(state, axis_name, plan.axes.num_devices, caller,
                             "local_momentum, worker_scale, worker_error, server_error")
  _guards.check_same_tree(updates, state.nu, caller)
  _guards.check_buffers(state, _buffer_shapes(plan), plan.axes.num_devices, caller)
  _guards.check_local_gradients(updates, state.worker_scale, axis_name, caller,
                                f"onebit_optax.local_params(params, {axis_name!r})")
  return plan


def _switch(hp: _Hyper, plan: _groups.Plan, grads, state, count, at: _groups.Offsets):
  """The phase switch: the warmup's or the compression's communication and state changes.

  ``frozen`` is replicated, so every device takes the same branches and only
  the taken branch's collectives run. Three conds on the one predicate, each
  with one kind of full-size result (``u``; the server and worker errors; the
  moments) that one branch writes and the *false* branch passes through:
  measured on XLA:CPU (jax 0.10), that is the form XLA writes in place into the
  donated buffers; with the pass-through as the true branch, or several kinds
  of results in one cond, every full-size result got a copy.
  """
  local = _write_sent(hp, plan, grads, state, at)
  exchange = jax.lax.cond(state.frozen,
                          lambda g, u: _compression(hp, plan, g, u, state, at),
                          lambda g, u: _no_exchange(state), grads, local)
  small = state._replace(mu=None, nu=None, local_momentum=None, server_error=None,
                         worker_error=None)
  moments = jax.lax.cond(
      jnp.logical_not(state.frozen),
      lambda g, mu, nu: _warmup(hp, plan, g, small._replace(mu=mu, nu=nu), count),
      lambda g, mu, nu: _no_moments(small._replace(mu=mu, nu=nu)),
      grads, state.mu, state.nu)
  return local, exchange, moments


def _update(updates, state, hp: _Hyper, axis_name, model_axis):
  plan = _check_update(updates, state, axis_name, model_axis, hp.exact_below)
  count_inc = numerics.safe_increment(state.count)
  grads = jax.tree.leaves(updates)
  at = _groups.offsets(plan.layout, state.frozen, state.frozen)  # (the message, the floor: once frozen)
  local, ex, mo = _switch(hp, plan, grads, state, count_inc, at)
  finite = ex.finite & mo.finite
  freeze_now = mo.frozen & jnp.logical_not(state.frozen)
  message, scale, local = _freeze_stage(hp, plan, mo.mu, local, ex, freeze_now)
  updates = _updates(hp, plan, grads, state, ex, mo, count_inc, at)
  pick = lambda new, old: jnp.where(finite, new, old)
  unflatten = lambda leaves: jax.tree.unflatten(plan.treedef, leaves)
  new_state = ScaleByOnebitAdamState(
      count=pick(count_inc, state.count), mu=unflatten(mo.mu), nu=unflatten(mo.nu),
      nu_l1=pick(mo.nu_l1, state.nu_l1), local_momentum=local, worker_scale=pick(scale, state.worker_scale),
      feedback_valid=jnp.where(state.frozen, finite, freeze_now | state.feedback_valid),
      worker_error=ex.worker_error, server_error=ex.server_error,
      momentum_message=pick(message, state.momentum_message),
      frozen=pick(mo.frozen, state.frozen), freeze_step=pick(mo.freeze_step, state.freeze_step),
      variance_ratio=pick(mo.variance_ratio, state.variance_ratio),
      reference_l1=pick(mo.reference_l1, state.reference_l1),
      wire_bytes=ex.wire_bytes + mo.wire_bytes,
      skipped_steps=state.skipped_steps + jnp.where(finite, 0, 1).astype(jnp.int32))
  return unflatten(updates), new_state


@_config.records_config  # checkpoints record the hyperparameters (onebit_optax/_config.py)
def scale_by_onebit_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    axis_name: Optional[Hashable | tuple],
    freeze: _freeze.FreezePolicy | int | None = None,
    variance_floor: float = 0.01,
    max_update: Optional[float] = None,
    model_axis: Optional[Hashable | tuple] = None,
    moment_dtype: Any = None,
    error_dtype: Any = None,
    skip_nonfinite: bool = True,
    exact_below: Optional[int] = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Rescales local gradients by 1-bit Adam, averaging them across ``axis_name``.

  Feed it each device's *local* gradient :math:`g_i`; it does the communication.
  The state is shaped like the parameters and the full-size work runs leaf by
  leaf, elementwise, in place; only what goes on the wire is fused: the packed
  sign bits and the scales of all leaves (1/32 of the float32 bytes) in one
  uint8 message, so a step has the same collectives for 2 leaves or 2000.
  Leaves smaller than ``exact_below`` travel as float32 inside the same
  messages and are averaged exactly.

  **Warmup** (until the freeze policy fires at step :math:`T_0`): exactly
  :func:`optax.scale_by_adam` applied to the mean gradient
  :math:`\bar g = \frac1n \sum_i g_i` (one float32 all-reduce):

  .. math::

    m_t = \beta_1 m_{t-1} + (1-\beta_1)\bar g_t, \quad
    v_t = \beta_2 v_{t-1} + (1-\beta_2)\bar g_t^2, \quad
    u_t = \frac{m_t/(1-\beta_1^t)}{\sqrt{v_t/(1-\beta_2^t)} + \epsilon}.

  **Freeze**: from :math:`T_0` on, :math:`v` is frozen and the update divides
  by it through the preconditioner

  .. math::

    p = \frac{1}{\sqrt{\max(\hat v, f\,\overline{\hat v}_\ell)} + \epsilon}, \qquad
    \hat v = \frac{v_{T_0}}{1-\beta_2^{T_0}},

  with :math:`\overline{\hat v}_\ell` the mean of :math:`\hat v` over the
  coordinate's leaf and :math:`f` = ``variance_floor``; :math:`p = 0` where
  :math:`\hat v = 0` (a coordinate that never had a gradient stays put instead
  of following the compressor's sign noise).

  **Compression** (:math:`t > T_0`): each device updates the momentum with its
  local gradient and the momenta are averaged by the error-compensated 1-bit
  mean (one scale per leaf piece, about 1/32 of the bytes; the mean
  momentum is kept as the message itself, signs and scales):

  .. math::

    m_t = \mathrm{compressed\_mean}_i\big(\beta_1 m_{t-1} + (1-\beta_1) g_{i,t}\big), \quad
    u_t = \mathrm{clip}\Big(\frac{m_t}{1-\beta_1^t}\, p,\; \pm B\Big),

  with :math:`B` = ``max_update``, by default Adam's own bound
  :func:`adam_update_bound` (3.16 for the default betas).

  *Why the floor and the clip.* With a frozen variance nothing ties the step to
  the current gradient any more. The compressed momentum of a coordinate is
  about the RMS of its leaf, so a coordinate whose frozen :math:`\hat v` is tiny
  (a rare input's weight row, a gate that was quiet during warmup) would be
  multiplied by a huge :math:`p`: measured 1.2e4 parameter units against Adam's
  3e-4 for a 1e-10 coordinate next to O(1) ones, and 500x Adam's movement for a
  rare-pixel weight row of a digits MLP. The floor bounds :math:`p` by
  :math:`1/\sqrt{f\,\overline{\hat v}_\ell}` relative to the coordinate's own leaf, which
  cost no loss in our measurements (``benchmarks/bounded_update.py``); the clip
  guarantees that no coordinate steps further than Adam could, whatever the
  gradients do after the freeze. The switch is a few ``lax.cond`` on the
  replicated ``frozen`` flag (see ``_switch``), so only the taken branch
  communicates and all devices take the same branch.

  **Non-finite gradients**: if any device's gradient holds a NaN or Inf, the
  averaged gradient (warmup) or the averaged momentum (compression) is
  non-finite on *every* device, because each device's contribution reaches all
  of them. The step is then skipped on all devices together: zero updates, and
  the state is left as it was except ``skipped_steps`` (+1) and ``wire_bytes``;
  in the compression phase each device's ``local_momentum`` already holds the
  skipped step's momentum, so its error feedback is dropped
  (``feedback_valid`` False; the next step sends its momentum without it).
  The predicate is read off the replicated result, so it needs no extra
  collective and cannot differ across devices (no deadlock).

  All arithmetic is float32; ``moment_dtype`` and ``error_dtype`` only set how
  the moments and the error buffers are stored. Updates are returned in the
  gradients' dtype (e.g. bfloat16). The wire format does not depend on them.
  Complex parameters are refused (split them into real and imaginary parts).

  With ``axis_name=None`` (one device, no mesh) there is no communication: the
  warmup is Adam, and the compression phase applies the same 1-bit compression
  with error feedback to the momentum (a 1-device cluster), which lets one study
  its effect on convergence.

  Args:
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.
    eps: added to the denominator.
    axis_name: the data-parallel axis of ``shard_map``/``pmap``, or None; or a
      pair ``(slow, fast)`` such as ``('node', 'local')`` for hierarchical
      averaging: float32 over the fast axis (inside a node), 1 bit over the slow
      one (see ``docs/guides/hierarchical.md``).
    freeze: when to switch: :func:`variance_ratio_freeze` (default, with
      ``min_steps=0``) or :func:`fixed_step_freeze` (an int ``k`` means
      ``fixed_step_freeze(k)``). Left at None with an ``axis_name``, a
      :class:`DefaultFreezeWarning` says at construction when the default can
      first freeze (step :math:`2/(1-\beta_2)`, 2000 for ``b2=0.999``).
    variance_floor: :math:`f`, the floor on the frozen :math:`\hat v` relative to
      the mean of its leaf (0 disables it).
    max_update: :math:`B`, the largest step of a coordinate after the freeze
      (before the learning rate); None means :func:`adam_update_bound`,
      ``float('inf')`` disables the clip.
    model_axis: the mesh axis (or axes) over which the parameters are sharded
      (tensor/model parallelism), or None. The optimizer works on each device's
      local shards and communicates over ``axis_name`` only; the two decisions
      that read the whole model (the variance norm of the freeze rule, and
      whether a step is finite) are agreed over ``model_axis`` with one scalar
      collective each, so all shards freeze and skip together.
    moment_dtype: storage dtype of ``mu`` and ``nu`` (None: float32). Under
      :func:`optax.inject_hyperparams`, give dtypes as strings (``'bfloat16'``):
      it would take a dtype class for a schedule.
    error_dtype: storage dtype of the per-device error buffers (None: float32).
    skip_nonfinite: skip steps with non-finite gradients (see above). With
      False, a NaN propagates into the moments as in :func:`optax.adam`.
    exact_below: leaves with fewer elements than this (a scalar gate, a bias of
      a few elements) travel as float32 inside the same two uint8 messages and
      are averaged exactly; 1 bit cannot carry them (a two-element leaf cycles
      around its optimum). None: 64 (see ``benchmarks/wire_overhead.py``); 0
      compresses every leaf. Under hierarchical averaging every leaf is
      compressed.

  Returns:
    A :class:`optax.GradientTransformationExtraArgs`. ``init`` and ``update`` must
    run inside the mapped region when ``axis_name`` is set.

  Example:
    >>> import jax.numpy as jnp
    >>> import onebit_optax
    >>> tx = onebit_optax.scale_by_onebit_adam(
    ...     axis_name=None, freeze=onebit_optax.fixed_step_freeze(1))
    >>> params = {'w': jnp.ones(3)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({'w': jnp.array([1., -2., 3.])}, state)
    >>> state.frozen, state.freeze_step
    (Array(True, dtype=bool), Array(1, dtype=int32))

  References:
    Tang et al., `1-bit Adam: Communication Efficient Large-Scale Training with
    Adam's Convergence Speed <https://arxiv.org/abs/2102.02888>`_, ICML 2021.

    Kingma & Ba, `Adam <https://arxiv.org/abs/1412.6980>`_, ICLR 2015 (the bound).
  """
  _guards.check_decay_rates(b1, b2, eps, "scale_by_onebit_adam")
  if freeze is None and axis_name is not None:
    _freeze.warn_default_policy(b2, "scale_by_onebit_adam")
  _guards.check_nonnegative("scale_by_onebit_adam", variance_floor=variance_floor,
                            max_update=max_update)
  policy = _freeze.check_policy(_freeze.variance_ratio_freeze() if freeze is None else freeze)
  moment_dtype = _check_float_dtype("moment_dtype", moment_dtype)
  error_dtype = _check_float_dtype("error_dtype", error_dtype)
  _collective.split_axes(axis_name)  # refuses a malformed tuple now, not at the first step
  exact_below = _layout.EXACT_BELOW if exact_below is None else _guards.static_int(
      exact_below, "exact_below", "scale_by_onebit_adam", low=0,
      why="leaves with fewer elements travel as float32; 0 compresses every leaf")
  hp = _Hyper(b1, b2, eps, variance_floor, max_update, policy, skip_nonfinite, int(exact_below))

  def init_fn(params):
    if type(params).__name__ == "_ParamsPlaceholder":
      return _placeholder_state(params)
    _guards.check_float_params(params, "scale_by_onebit_adam.init")
    _guards.check_mapped_region(axis_name, "scale_by_onebit_adam.init")
    plan = _plan(params, axis_name, model_axis, hp.exact_below, "scale_by_onebit_adam.init")
    return _init(params, plan, moment_dtype, error_dtype)

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    if _guards.no_work(updates, state, ScaleByOnebitAdamState, "scale_by_onebit_adam.update"):
      return updates, state  # a partition or mask left this optimizer no parameters
    return _update(updates, state, hp, axis_name, model_axis)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@_config.records_config
def onebit_adam(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    axis_name: Optional[Hashable | tuple],
    freeze: _freeze.FreezePolicy | int | None = None,
    variance_floor: float = 0.01,
    max_update: Optional[float] = None,
    model_axis: Optional[Hashable | tuple] = None,
    mask: Any = None,
    moment_dtype: Any = None,
    error_dtype: Any = None,
    skip_nonfinite: bool = True,
    exact_below: Optional[int] = None,
) -> optax.GradientTransformationExtraArgs:
  r"""1-bit Adam (Tang et al., 2021): Adam whose communication drops to 1 bit per element.

  A chain of :func:`scale_by_onebit_adam`, decoupled weight decay (as in
  :func:`optax.adamw`; the chain always holds this element, an identity when
  ``weight_decay`` is 0, so the state's structure does not depend on its value)
  and :func:`optax.scale_by_learning_rate`:

  .. math::

    \theta_{t} = \theta_{t-1} - \eta_t \big(u_t + \lambda \theta_{t-1}\big),

  with :math:`u_t` the output of :func:`scale_by_onebit_adam`: Adam on the
  mean gradient during warmup, then frozen-variance momentum SGD whose momentum
  is averaged with error-compensated 1-bit compression.

  To clip gradients, chain :func:`onebit_optax.clip_by_global_norm` (with the
  same ``axis_name``) before it: the gradients it sees are each device's
  local ones, so :func:`optax.clip_by_global_norm` there would clip each
  device by its own norm (not the mean gradient's, and a different factor on
  every device); tracing the update under ``optax.chain`` warns of that.

  Args:
    learning_rate: a scalar or an optax schedule.
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.
    eps: added to the denominator.
    weight_decay: decoupled weight decay :math:`\lambda` (0 disables it).
    axis_name: the data-parallel axis of ``shard_map``/``pmap``, or None; a
      pair ``(slow, fast)`` averages hierarchically (see
      :func:`scale_by_onebit_adam`).
    freeze: :func:`variance_ratio_freeze` or :func:`fixed_step_freeze` (or an
      int); None: the default ``variance_ratio_freeze()``, announced by a
      :class:`DefaultFreezeWarning` when ``axis_name`` is set.
    variance_floor: floor on the frozen variance, relative to its leaf's mean
      (see :func:`scale_by_onebit_adam`).
    max_update: largest per-coordinate step after the freeze, before the
      learning rate (None: :func:`adam_update_bound`).
    model_axis: the model-parallel axis the parameters are sharded over, or None
      (see :func:`scale_by_onebit_adam`).
    mask: as in :func:`optax.adamw`: which leaves get weight decay.
    moment_dtype: storage dtype of the moments (see :func:`scale_by_onebit_adam`).
    error_dtype: storage dtype of the error buffers.
    skip_nonfinite: skip non-finite steps on all devices together.
    exact_below: leaves with fewer elements are averaged exactly, as float32
      (see :func:`scale_by_onebit_adam`).

  Returns:
    A :class:`optax.GradientTransformationExtraArgs`.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import onebit_optax
    >>> tx = onebit_optax.onebit_adam(0.1, axis_name=None, freeze=20)
    >>> params = jnp.array([1.0, -2.0])
    >>> state = tx.init(params)
    >>> @jax.jit
    ... def step(params, state):
    ...   grads = jax.grad(lambda p: jnp.sum(p ** 2))(params)
    ...   updates, state = tx.update(grads, state, params)
    ...   return optax.apply_updates(params, updates), state
    >>> for _ in range(40):
    ...   params, state = step(params, state)
    >>> onebit_optax.status(state, 20).frozen, bool(jnp.all(jnp.abs(params) < 1.0))
    (True, True)

  References:
    Tang et al., `1-bit Adam: Communication Efficient Large-Scale Training with
    Adam's Convergence Speed <https://arxiv.org/abs/2102.02888>`_, ICML 2021.

    Loshchilov & Hutter, `Decoupled Weight Decay Regularization
    <https://arxiv.org/abs/1711.05101>`_, 2019.
  """
  _guards.check_learning_rate(learning_rate, "onebit_adam")
  if freeze is None and axis_name is not None:
    _freeze.warn_default_policy(b2, "onebit_adam")
    freeze = _freeze.variance_ratio_freeze()
  _guards.check_nonnegative("onebit_adam", weight_decay=weight_decay)
  decay = (optax.identity() if isinstance(weight_decay, (int, float)) and weight_decay == 0.0
           else optax.add_decayed_weights(weight_decay))
  if mask is not None:
    decay = optax.masked(decay, mask)
  return _chain_skipping_decay(
      scale_by_onebit_adam(
          b1, b2, eps, axis_name=axis_name, freeze=freeze, variance_floor=variance_floor,
          max_update=max_update, model_axis=model_axis, moment_dtype=moment_dtype,
          error_dtype=error_dtype,
          skip_nonfinite=skip_nonfinite, exact_below=exact_below),
      decay,
      optax.scale_by_learning_rate(learning_rate))


def _chain_skipping_decay(scale, decay, lr) -> optax.GradientTransformationExtraArgs:
  r"""``optax.chain(scale, decay, lr)`` (same state), whose decay also skips a skipped step.

  A non-finite step leaves the parameters unchanged: :func:`scale_by_onebit_adam`
  returns zeros and counts it in ``skipped_steps``; the decay then sees the
  parameters times 0 (times 1 on every other step: bitwise the same), where
  ``optax.chain`` would still have shrunk them by :math:`\eta\lambda`.
  """
  chained = optax.chain(scale, decay, lr)

  def update_fn(updates, state, params=None, **extra_args):
    updates, scale_state = scale.update(updates, state[0], params, **extra_args)
    if params is not None:
      kept = (scale_state.skipped_steps == state[0].skipped_steps)
      params = jax.tree.map(lambda p: p * kept.astype(p.dtype), params)
    updates, decay_state = decay.update(updates, state[1], params)
    updates, lr_state = lr.update(updates, state[2], params)
    return updates, (scale_state, decay_state, lr_state)

  return optax.GradientTransformationExtraArgs(chained.init, update_fn)
