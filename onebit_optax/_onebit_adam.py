"""1-bit Adam: Adam moments on a flat buffer, the frozen-variance phase switch, and the alias."""

from __future__ import annotations

from typing import Any, Hashable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax._src import numerics

from onebit_optax import _collective
from onebit_optax import _freeze
from onebit_optax import _guards
from onebit_optax import _layout

__all__ = [
    "ScaleByOnebitAdamState",
    "scale_by_onebit_adam",
    "onebit_adam",
    "adam_update_bound",
]


class ScaleByOnebitAdamState(NamedTuple):
  """State for :func:`scale_by_onebit_adam`.

  The large buffers are flat and padded (one vector for all leaves, laid out
  leaf after leaf, each leaf starting on a 128-element block); use
  :func:`onebit_optax.moments` to see ``mu`` and ``nu`` as trees.
  ``worker_error`` and ``server_error`` are per device: under ``shard_map`` their
  leading axis is the device axis (shard it with ``P(axis_name)``, see
  :func:`state_partition_specs`); every other field is replicated. Memory on top
  of Adam: :math:`D_{pad}(1 + 1/n)` floats per device.

  Example:
    >>> import jax.numpy as jnp, onebit_optax
    >>> state = onebit_optax.scale_by_onebit_adam(axis_name=None).init({'w': jnp.ones(3)})
    >>> state.mu.shape, state.worker_error.shape, state.server_error.shape, bool(state.frozen)
    ((128,), (1, 128), (1, 128), False)

  References:
    Tang et al., `1-bit Adam <https://arxiv.org/abs/2102.02888>`_, ICML 2021, Algorithm 1.
  """

  count: jax.Array  # shape=(), dtype=int32: optimizer steps taken.
  leaf_sizes: jax.Array  # shape=(num_leaves,), dtype=int32: elements per leaf, checked against the gradients.
  mu: jax.Array  # shape=(padded,), dtype=moment_dtype (float32): first moment, flat (replicated).
  nu: jax.Array  # shape=(padded,), dtype=moment_dtype: second moment, raw (no bias correction); frozen after the switch.
  frozen: jax.Array  # shape=(), dtype=bool: True once in the compression phase.
  freeze_step: jax.Array  # shape=(), dtype=int32: last warmup step (0 while warming up).
  variance_ratio: jax.Array  # shape=(), dtype=float32: last ||v_hat_t||_1 / ||v_hat_{t-Δ}||_1 (NaN before the first).
  reference_l1: jax.Array  # shape=(), dtype=float32: ||v_hat||_1 at the last check (every Δ steps).
  wire_bytes: jax.Array  # shape=(), dtype=float32: bytes this device sent in the last step.
  skipped_steps: jax.Array  # shape=(), dtype=int32: steps skipped (together, on all devices) for non-finite gradients.
  worker_error: jax.Array  # shape=(1, padded), dtype=error_dtype (float32): this device's compression error.
  server_error: jax.Array  # shape=(1, padded // n), dtype=error_dtype (float32): this device's error as server of its chunk.


class _Hyper(NamedTuple):
  """The (possibly traced) hyperparameters and static options one update needs."""

  b1: Any
  b2: Any
  eps: Any
  variance_floor: Any
  max_update: Any
  policy: _freeze.FreezePolicy
  axis_name: Any
  skip_nonfinite: bool
  model_axis: Any = None

  @property
  def device_axes(self):
    """The axes over which the per-device error buffers differ."""
    return _collective.axis_names(self.axis_name, self.model_axis) or None


class _Step(NamedTuple):
  """What one branch of the phase switch computed: only what differs between the phases.

  The full-size elementwise work (the moments, the worker's residual) is done
  after the switch (see :func:`_new_moments`, :func:`_new_worker_error`), where
  XLA writes it into the donated state buffers; a conditional's full-size
  results would each get a fresh temporary and a copy into the output.
  """

  finite: jax.Array
  avg: jax.Array  # (padded,) float32: the mean gradient (warmup) or the mean momentum (compression).
  frozen: jax.Array
  freeze_step: jax.Array
  variance_ratio: jax.Array
  reference_l1: jax.Array
  worker_scale: jax.Array  # (blocks,) float32: the worker compression's scale of each block (0 in warmup).
  worker_error: Any  # hierarchical: the new worker error (its input lives in the branch); flat: None.
  server_error: jax.Array
  wire_bytes: jax.Array


def adam_update_bound(b1, b2) -> jax.Array:
  r"""How large Adam's per-coordinate step :math:`|\hat m_t / (\sqrt{\hat v_t} + \epsilon)|` can get.

  Kingma & Ba (2015, Section 2.1): :math:`(1-\beta_1)/\sqrt{1-\beta_2}` when
  :math:`1-\beta_1 > \sqrt{1-\beta_2}`, else 1. It is the default ``max_update``
  of :func:`scale_by_onebit_adam`: after the freeze no coordinate steps further
  than Adam could.

  Args:
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.

  Returns:
    A float32 scalar (3.16 for the defaults 0.9, 0.999).

  Example:
    >>> import onebit_optax
    >>> round(float(onebit_optax.adam_update_bound(0.9, 0.999)), 3)
    3.162

  References:
    Kingma & Ba, `Adam: A Method for Stochastic Optimization
    <https://arxiv.org/abs/1412.6980>`_, ICLR 2015, Section 2.1.
  """
  b1, b2 = jnp.asarray(b1, jnp.float32), jnp.asarray(b2, jnp.float32)
  return jnp.maximum(1.0, (1.0 - b1) / jnp.sqrt(1.0 - b2))


def _check_params(params) -> int:
  leaves_with_path = jax.tree_util.tree_leaves_with_path(params)
  if not leaves_with_path:
    raise ValueError(
        "onebit_adam got empty params (no array leaves): there is nothing to optimize. "
        "Pass the model's parameter pytree.")
  for path, leaf in leaves_with_path:
    dtype = jnp.asarray(leaf).dtype if not hasattr(leaf, "dtype") else leaf.dtype
    if not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(
          f"onebit_adam: leaf {jax.tree_util.keystr(path)} has dtype {dtype}; only "
          "real floating-point parameters can be optimized (complex ones are not "
          "supported: split them into real and imaginary parts). Keep integer/bool "
          "leaves out of the optimizer, e.g. with optax.masked or optax.partition.")
  size = sum(int(np.prod(np.shape(leaf))) for _, leaf in leaves_with_path)
  if size == 0:
    raise ValueError(
        "onebit_adam got params whose leaves all have size 0: there is nothing to "
        "optimize.")
  return size


def _check_float_dtype(name, dtype):
  dtype = jnp.dtype(jnp.float32 if dtype is None else dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"{name} must be a floating-point dtype, got {dtype}.")
  return dtype


def _bias_correction(decay, count):
  return 1.0 - jnp.asarray(decay, jnp.float32) ** count


def _leaf_update(mu, nu, frozen, bc1, bc2, finite, hp: _Hyper):
  r"""One leaf's update: Adam's during warmup, the floored and clipped frozen-variance step after.

  ``mu`` and ``nu`` are the leaf's slices of the new moments; the floor is
  ``variance_floor`` times the mean :math:`\hat v` of the leaf. Elementwise on the
  leaf (one reduction for the floor), so XLA writes each update leaf straight
  from the moments, with no full-size temporary.
  """
  mu_hat, v_hat = mu / bc1, nu / bc2
  # m / (sqrt(v) + eps) exactly as optax.scale_by_adam.
  adam = mu_hat / (jnp.sqrt(v_hat) + hp.eps)
  floor = jnp.asarray(hp.variance_floor, jnp.float32) * jnp.mean(v_hat)
  # A coordinate whose frozen variance is 0 never had a gradient: its momentum
  # is only the compressor's sign noise, which 1/(0 + eps) would amplify.
  p = jnp.where(v_hat > 0, 1.0 / (jnp.sqrt(jnp.maximum(v_hat, floor)) + hp.eps), 0.0)
  bound = adam_update_bound(hp.b1, hp.b2) if hp.max_update is None else hp.max_update
  step = jnp.where(frozen, jnp.clip(mu_hat * p, -bound, bound), adam)
  return jnp.where(finite, step, 0.0)


def _updates(mu, nu, finite, state, count, hp: _Hyper, layout, grads, treedef):
  """The update tree, leaf by leaf from the new moments (see :func:`_leaf_update`)."""
  bc1 = _bias_correction(hp.b1, count)
  bc2 = _bias_correction(hp.b2, jnp.where(state.frozen, state.freeze_step, count))
  mu = layout.unflatten(mu.astype(jnp.float32), treedef)
  nu = layout.unflatten(nu.astype(jnp.float32), treedef)
  # A zero-size leaf gets its (empty) update without any operation on it: XLA
  # 0.11 crashed compiling zero-size reductions next to collectives.
  out = [jnp.zeros(jnp.shape(g), jnp.result_type(g)) if size == 0 else
         _leaf_update(m, v, state.frozen, bc1, bc2, finite, hp).astype(jnp.result_type(g))
         for m, v, g, size in zip(jax.tree.leaves(mu), jax.tree.leaves(nu), grads, layout.sizes)]
  return jax.tree.unflatten(treedef, out)


def _hierarchical(hp: _Hyper) -> bool:
  return _collective.split_axes(hp.axis_name)[1] is not None


def _local_momentum(grads, state, hp: _Hyper, layout) -> jax.Array:
  """This device's momentum :math:`\\beta_1 m + (1-\\beta_1) g_i` on the flat buffer (fused, not stored)."""
  return (1.0 - hp.b1) * layout.flatten(grads) + hp.b1 * state.mu.astype(jnp.float32)


def _warmup(grads, state: ScaleByOnebitAdamState, count, hp: _Hyper, layout) -> _Step:
  """The full-precision mean gradient (one float32 pmean of the flat buffer) and the freeze decision."""
  g = _collective.full_precision_mean(layout.flatten(grads), hp.axis_name)
  # Read off the replicated mean, which every device's gradient reaches: all
  # devices agree on it without another collective (but a model-parallel axis).
  finite = (_collective._all_true(jnp.all(jnp.isfinite(g)), hp.model_axis)
            if hp.skip_nonfinite else jnp.bool_(True))
  # The new nu's norm only (a reduction): nu itself is written after the switch.
  # No select on `finite` inside the sum (it made XLA:CPU store the summand):
  # on a skipped step the freeze decision is discarded anyway.
  l1 = jnp.sum((1.0 - hp.b2) * jnp.square(g) + hp.b2 * state.nu.astype(jnp.float32))
  if hp.model_axis is not None:  # the whole model's norm, so every shard freezes together
    l1 = jax.lax.psum(l1, hp.model_axis)
  freeze_now, reference, ratio = _freeze.freeze_decision(
      hp.policy, count, l1 / _bias_correction(hp.b2, count), state.reference_l1,
      state.variance_ratio, hp.b2)
  freeze_now = freeze_now & finite
  return _Step(
      finite=finite, avg=g,
      frozen=freeze_now, freeze_step=jnp.where(freeze_now, count, 0).astype(jnp.int32),
      variance_ratio=ratio, reference_l1=reference,
      worker_scale=_collective.vary(jnp.zeros((layout.num_blocks,), jnp.float32),
                                    hp.device_axes),
      # Hierarchical: the buffer is all zeros in warmup; returned as it is.
      worker_error=state.worker_error if _hierarchical(hp) else None,
      server_error=state.server_error,
      wire_bytes=jnp.float32(
          _collective.step_wire_bytes(layout, hp.axis_name, compressed=False)))


def _compression(grads, state: ScaleByOnebitAdamState, count, hp: _Hyper, layout) -> _Step:
  """The momentum, from local gradients, averaged by the 1-bit compressed mean; v frozen."""
  del count
  local_mu = _local_momentum(grads, state, hp, layout)
  worker_error = state.worker_error[0].astype(jnp.float32)
  server_error = state.server_error[0].astype(jnp.float32)
  worker_scale, new_worker_error = jnp.zeros((layout.num_blocks,), jnp.float32), None
  if _hierarchical(hp):
    # The worker compresses its slice of the node's mean: the residual needs
    # that slice, which exists only here.
    mean_mu, new_worker_error, server_error, finite = _collective.compressed_mean_and_check(
        local_mu, worker_error, server_error, hp.axis_name, layout=layout,
        keep_errors_if_nonfinite=hp.skip_nonfinite, agree_axis=hp.model_axis)
    new_worker_error = new_worker_error[None].astype(state.worker_error.dtype)
    worker_scale = _collective.vary(worker_scale, hp.device_axes)
  else:
    out = _collective.compressed_average(
        local_mu, worker_error, server_error, hp.axis_name, layout=layout,
        keep_server_error_if_nonfinite=hp.skip_nonfinite, agree_axis=hp.model_axis)
    mean_mu, worker_scale, server_error, finite = out
  if not hp.skip_nonfinite:
    finite = jnp.bool_(True)
  return _Step(
      finite=finite, avg=mean_mu, frozen=state.frozen,
      freeze_step=state.freeze_step, variance_ratio=state.variance_ratio,
      reference_l1=state.reference_l1, worker_scale=worker_scale,
      worker_error=new_worker_error,
      server_error=server_error[None].astype(state.server_error.dtype),
      wire_bytes=jnp.float32(
          _collective.step_wire_bytes(layout, hp.axis_name, compressed=True)))


def _new_moments(step: _Step, state, hp: _Hyper):
  """The new ``mu`` and ``nu``, elementwise from the switch's averaged vector.

  Warmup: Adam's moments of the mean gradient; compression: ``mu`` is the mean
  momentum and ``nu`` stays frozen. A select on the phase, outside the switch,
  so that XLA writes both in place into the donated moments.
  """
  mu32, nu32 = state.mu.astype(jnp.float32), state.nu.astype(jnp.float32)
  g = step.avg
  mu = jnp.where(state.frozen, g, (1.0 - hp.b1) * g + hp.b1 * mu32)
  nu = (1.0 - hp.b2) * jnp.square(g) + hp.b2 * nu32
  return (jnp.where(step.finite, mu, mu32),
          jnp.where(step.finite & jnp.logical_not(state.frozen), nu, nu32))


def _new_worker_error(step: _Step, state, grads, hp: _Hyper, layout):
  """The new worker error: the residual of the compression, read old and written in place.

  Recomputed from the local momentum and the old error with the scales the
  switch returned (so ``u`` is never stored); the old error is kept in warmup
  (it is zero then) and on a skipped step.
  """
  if step.worker_error is not None:
    return step.worker_error
  old = state.worker_error.astype(jnp.float32)  # (1, padded), as stored: see worker_residual
  new = _collective.worker_residual(
      _local_momentum(grads, state, hp, layout), old, step.worker_scale, layout)
  return jnp.where(state.frozen & step.finite, new, old).astype(state.worker_error.dtype)


def _short(sizes, limit: int = 8) -> str:
  sizes = [int(x) for x in sizes]
  return str(sizes[:limit])[:-1] + (", ...]" if len(sizes) > limit else "]")


def _check_update(updates, state, axis_name):
  """Validates the update's inputs; returns the layout of the gradients on this axis."""
  if not isinstance(state, ScaleByOnebitAdamState):
    raise TypeError(
        f"scale_by_onebit_adam.update got a {type(state).__name__} state; pass the "
        "state returned by this transformation's init.")
  _check_params(updates)
  caller = "scale_by_onebit_adam.update"
  _guards.check_wrappers(axis_name, caller)
  _guards.check_mapped_region(axis_name, caller)
  n = _collective.axis_size(axis_name, caller=caller)
  _guards.check_state_layout(state, axis_name, n, caller)
  layout = _layout.layout_for(updates, n)
  fast = _collective.axis_size(_collective.split_axes(axis_name)[1], caller=caller)
  worker, server = _collective.error_sizes(layout, fast)
  sizes = state.leaf_sizes
  if sizes.shape != (len(layout.sizes),) or (
      not isinstance(sizes, jax.core.Tracer) and tuple(np.asarray(sizes)) != layout.sizes):
    raise ValueError(
        "scale_by_onebit_adam.update: the gradient tree does not match the tree the "
        f"state was initialised with: the gradients have {len(layout.sizes)} leaves of "
        f"sizes {_short(layout.sizes)}, the state was made for {sizes.shape[0]} leaves"
        + ("" if isinstance(sizes, jax.core.Tracer) else f" of sizes {_short(np.asarray(sizes))}")
        + ". Did the model change after init? Re-init the optimizer state.")
  if (state.mu.shape != (layout.padded,) or state.worker_error.shape != (1, worker)
      or state.server_error.shape != (1, server)):
    raise ValueError(
        f"scale_by_onebit_adam.update: the state's buffers have shapes mu "
        f"{state.mu.shape}, worker_error {state.worker_error.shape} and server_error "
        f"{state.server_error.shape} per device, but these leaves on {n} devices need "
        f"({layout.padded},), (1, {worker}) and (1, {server}): the state was "
        "made for another device count: re-init it on this mesh, or restore it with "
        "onebit_optax.restore_checkpoint (which moves it to another device count). Under "
        "shard_map, shard it with onebit_optax.state_partition_specs(state, axis_name).")
  replicated = [name for name in _collective.axis_names(axis_name)
                if name in _collective._varying_axes(state.worker_error)
                and any(name not in _collective._varying_axes(g)
                        for g in jax.tree.leaves(updates))]
  if replicated:
    raise ValueError(
        f"scale_by_onebit_adam.update: the gradients are replicated over {replicated[0]!r}, "
        "i.e. already all-reduced. Inside shard_map, jax.grad with respect to replicated "
        "params sums the gradients across devices in the backward pass, which sends them "
        "in full precision and defeats the compression. Take the gradient with respect "
        f"to onebit_optax.local_params(params, {axis_name!r}) instead.")
  return layout


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
) -> optax.GradientTransformationExtraArgs:
  r"""Rescales local gradients by 1-bit Adam, averaging them across ``axis_name``.

  Feed it each device's *local* gradient :math:`g_i`; it does the communication.
  All leaves live in one flat buffer (one flatten of the gradients, flat math,
  one unravel of the update), so a step has the same collectives for 2 leaves
  or 2000.

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
  :func:`compressed_mean` (one scale per leaf, about 1/32 of the bytes):

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
  gradients do after the freeze. The switch is one ``lax.cond`` on the
  replicated ``frozen`` flag, so only the taken branch communicates and all
  devices take the same branch.

  **Non-finite gradients**: if any device's gradient holds a NaN or Inf, the
  averaged gradient (warmup) or the averaged momentum (compression) is
  non-finite on *every* device, because each device's contribution reaches all
  of them. The step is then skipped on all devices together: zero updates, and
  the state is left as it was except ``skipped_steps`` (+1) and ``wire_bytes``.
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
      one (see :func:`compressed_mean`).
    freeze: when to switch: :func:`variance_ratio_freeze` (default, with
      ``min_steps=0``) or :func:`fixed_step_freeze` (an int ``k`` means
      ``fixed_step_freeze(k)``).
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
    >>> bool(onebit_optax.is_frozen(state)), int(onebit_optax.freeze_step(state))
    (True, 1)

  References:
    Tang et al., `1-bit Adam: Communication Efficient Large-Scale Training with
    Adam's Convergence Speed <https://arxiv.org/abs/2102.02888>`_, ICML 2021.

    Kingma & Ba, `Adam <https://arxiv.org/abs/1412.6980>`_, ICLR 2015 (the bound).
  """
  _guards.check_decay_rates(b1, b2, eps, "scale_by_onebit_adam")
  policy = _freeze.check_policy(_freeze.variance_ratio_freeze() if freeze is None else freeze)
  moment_dtype = _check_float_dtype("moment_dtype", moment_dtype)
  error_dtype = _check_float_dtype("error_dtype", error_dtype)
  _collective.split_axes(axis_name)  # refuses a malformed tuple now, not at the first step
  hp = _Hyper(b1, b2, eps, variance_floor, max_update, policy, axis_name, skip_nonfinite,
              model_axis)
  device_axes = hp.device_axes

  def init_fn(params):
    if type(params).__name__ == "_ParamsPlaceholder":
      # optax.tree.map_params: the state holds no parameter-shaped tree (the
      # moments are flat buffers), so every field is a "non-param" field.
      return ScaleByOnebitAdamState(*[jnp.zeros([]) for _ in ScaleByOnebitAdamState._fields])
    _check_params(params)
    _guards.check_mapped_region(axis_name, "scale_by_onebit_adam.init")
    n = _collective.axis_size(axis_name, caller="scale_by_onebit_adam.init")
    layout = _layout.layout_for(params, n)
    worker, server = _collective.error_sizes(layout, _collective.axis_size(
        _collective.split_axes(axis_name)[1], caller="scale_by_onebit_adam.init"))
    return ScaleByOnebitAdamState(
        count=jnp.zeros([], jnp.int32),
        leaf_sizes=jnp.asarray(layout.sizes, jnp.int32).reshape(-1),
        mu=jnp.zeros((layout.padded,), moment_dtype),
        nu=jnp.zeros((layout.padded,), moment_dtype),
        frozen=jnp.zeros([], jnp.bool_),
        freeze_step=jnp.zeros([], jnp.int32),
        variance_ratio=jnp.full([], jnp.nan, jnp.float32),
        reference_l1=jnp.zeros([], jnp.float32),
        wire_bytes=jnp.zeros([], jnp.float32),
        skipped_steps=jnp.zeros([], jnp.int32),
        worker_error=_collective.vary(jnp.zeros((1, worker), error_dtype), device_axes),
        server_error=_collective.vary(jnp.zeros((1, server), error_dtype), device_axes),
    )

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    layout = _check_update(updates, state, axis_name)
    count_inc = numerics.safe_increment(state.count)
    grads, treedef = jax.tree.flatten(updates)
    # Zero-size leaves stay out of the cond (their slots are skipped by the
    # layout): XLA 0.11 crashed compiling zero-size operands of a conditional.
    operands = [g if size else jnp.zeros([]) for g, size in zip(grads, layout.sizes)]
    # The phase switch. `frozen` is computed from replicated values only, so all
    # devices agree on the branch; only the taken branch's collectives run.
    step = jax.lax.cond(
        state.frozen,
        lambda g: _compression(g, state, count_inc, hp, layout),
        lambda g: _warmup(g, state, count_inc, hp, layout), operands)
    pick = lambda new, old: jnp.where(step.finite, new, old)
    worker_error = _new_worker_error(step, state, grads, hp, layout)
    mu, nu = _new_moments(step, state, hp)
    new_state = ScaleByOnebitAdamState(
        count=pick(count_inc, state.count),
        leaf_sizes=state.leaf_sizes,
        mu=mu.astype(state.mu.dtype),
        nu=nu.astype(state.nu.dtype),
        frozen=pick(step.frozen, state.frozen),
        freeze_step=pick(step.freeze_step, state.freeze_step),
        variance_ratio=pick(step.variance_ratio, state.variance_ratio),
        reference_l1=pick(step.reference_l1, state.reference_l1),
        wire_bytes=step.wire_bytes,
        skipped_steps=state.skipped_steps + jnp.where(step.finite, 0, 1).astype(jnp.int32),
        worker_error=worker_error,
        server_error=step.server_error,
    )
    return _updates(mu, nu, step.finite, state, count_inc, hp, layout, grads, treedef), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


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

  Args:
    learning_rate: a scalar or an optax schedule.
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.
    eps: added to the denominator.
    weight_decay: decoupled weight decay :math:`\lambda` (0 disables it).
    axis_name: the data-parallel axis of ``shard_map``/``pmap``, or None; a
      pair ``(slow, fast)`` averages hierarchically (see
      :func:`scale_by_onebit_adam`).
    freeze: :func:`variance_ratio_freeze` or :func:`fixed_step_freeze` (or an int).
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
    >>> bool(onebit_optax.is_frozen(state)), bool(jnp.all(jnp.abs(params) < 1.0))
    (True, True)

  References:
    Tang et al., `1-bit Adam: Communication Efficient Large-Scale Training with
    Adam's Convergence Speed <https://arxiv.org/abs/2102.02888>`_, ICML 2021.

    Loshchilov & Hutter, `Decoupled Weight Decay Regularization
    <https://arxiv.org/abs/1711.05101>`_, 2019.
  """
  decay = (optax.identity() if isinstance(weight_decay, (int, float)) and weight_decay == 0.0
           else optax.add_decayed_weights(weight_decay))
  if mask is not None:
    decay = optax.masked(decay, mask)
  return optax.chain(
      scale_by_onebit_adam(
          b1, b2, eps, axis_name=axis_name, freeze=freeze, variance_floor=variance_floor,
          max_update=max_update, model_axis=model_axis, moment_dtype=moment_dtype,
          error_dtype=error_dtype,
          skip_nonfinite=skip_nonfinite),
      decay,
      optax.scale_by_learning_rate(learning_rate))
