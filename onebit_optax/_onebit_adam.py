"""1-bit Adam: Adam moments with a frozen-variance phase switch, and the alias."""

from __future__ import annotations

from typing import Any, Hashable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax._src import numerics

from onebit_optax import _collective
from onebit_optax import _compressor
from onebit_optax import _freeze

__all__ = [
    "ScaleByOnebitAdamState",
    "scale_by_onebit_adam",
    "onebit_adam",
    "is_frozen",
    "freeze_step",
    "variance_ratio",
    "wire_bytes",
    "skipped_steps",
]


class ScaleByOnebitAdamState(NamedTuple):
  """State for :func:`scale_by_onebit_adam`.

  ``worker_error`` and ``server_error`` are per device: under ``shard_map`` their
  leading axis is the device axis (shard it with ``P(axis_name)``, see
  :func:`state_partition_specs`); every other field is replicated. Memory on top
  of Adam: :math:`D_{pad}(1 + 1/n)` floats per device.

  Example:
    >>> import jax.numpy as jnp, onebit_optax
    >>> state = onebit_optax.scale_by_onebit_adam(axis_name=None).init({'w': jnp.ones(3)})
    >>> state.worker_error.shape, state.server_error.shape, bool(state.frozen)
    ((1, 8), (1, 8), False)

  References:
    Tang et al., `1-bit Adam <https://arxiv.org/abs/2102.02888>`_, ICML 2021, Algorithm 1.
  """

  count: jax.Array  # shape=(), dtype=int32: optimizer steps taken.
  mu: optax.Updates  # like params, moment_dtype (float32): first moment (replicated).
  nu: optax.Updates  # like params, moment_dtype (float32): second moment, raw (no bias correction); frozen after the switch.
  frozen: jax.Array  # shape=(), dtype=bool: True once in the compression phase.
  freeze_step: jax.Array  # shape=(), dtype=int32: last warmup step (0 while warming up).
  variance_ratio: jax.Array  # shape=(), dtype=float32: last ||v_hat_t||_1 / ||v_hat_{t-Δ}||_1 (NaN before the first).
  reference_l1: jax.Array  # shape=(), dtype=float32: ||v_hat||_1 at the last check (every Δ steps).
  wire_bytes: jax.Array  # shape=(), dtype=float32: bytes this device sent in the last step.
  skipped_steps: jax.Array  # shape=(), dtype=int32: steps skipped (together, on all devices) for non-finite gradients.
  worker_error: jax.Array  # shape=(1, padded), dtype=error_dtype (float32): this device's compression error.
  server_error: jax.Array  # shape=(1, padded // n), dtype=error_dtype (float32): this device's error as server of its chunk.


class _Step(NamedTuple):
  """What one branch of the phase switch computed (before the non-finite check)."""

  finite: jax.Array
  mu: optax.Updates
  nu: optax.Updates
  frozen: jax.Array
  freeze_step: jax.Array
  variance_ratio: jax.Array
  reference_l1: jax.Array
  worker_error: jax.Array
  server_error: jax.Array
  wire_bytes: jax.Array


def _check_params(params) -> tuple[int, Any]:
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
          "floating-point parameters can be optimized. Keep integer/bool leaves out "
          "of the optimizer, e.g. with optax.masked or optax.partition.")
  size = sum(int(np.prod(np.shape(leaf))) for _, leaf in leaves_with_path)
  if size == 0:
    raise ValueError(
        "onebit_adam got params whose leaves all have size 0: there is nothing to "
        "optimize.")
  return size, jax.tree.structure(params)


def _flatten(tree, length: int) -> jax.Array:
  """The leaves of ``tree`` as one float32 vector, zero-padded to ``length``.

  Same order as ``ravel_pytree``. XLA:CPU fuses a concatenate (or pad, or
  dynamic_update_slice) into its producers and consumers as a per-element choice
  between operands, 5-10x slower per element than a copy; fenced by
  ``optimization_barrier`` it stays one plain copy (measured 3x faster at 10M
  parameters in benchmarks/optimizer_compute.py).
  """
  leaves = [jnp.ravel(x).astype(jnp.float32) for x in jax.tree.leaves(tree)]
  size = sum(x.size for x in leaves)
  if size < length:
    leaves.append(jnp.zeros((length - size,), jnp.float32))
  leaves = jax.lax.optimization_barrier(leaves)
  return jax.lax.optimization_barrier(jnp.concatenate(leaves))


def _unraveler(tree):
  """Inverse of :func:`_flatten` for trees shaped like ``tree`` (slices, no copy of the whole)."""
  leaves, treedef = jax.tree.flatten(tree)
  shapes = [leaf.shape for leaf in leaves]
  def unravel(flat):
    out, offset = [], 0
    for shape in shapes:
      size = int(np.prod(shape))
      out.append(flat[offset:offset + size].reshape(shape))
      offset += size
    return jax.tree.unflatten(treedef, out)
  return unravel


def _zeros(tree, dtype):
  return jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), dtype), tree)


def _as_f32(tree):
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def _check_float_dtype(name, dtype):
  dtype = jnp.dtype(jnp.float32 if dtype is None else dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"{name} must be a floating-point dtype, got {dtype}.")
  return dtype


def _vary(x, axis_name):
  """Marks ``x`` as differing across devices (needed for per-device buffers)."""
  if axis_name is None or axis_name in _collective._varying_axes(x):
    return x
  try:
    return jax.lax.pcast(x, axis_name, to="varying")
  except ValueError:  # outside a check_vma shard_map, there is no type to change
    return x


def scale_by_onebit_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    axis_name: Optional[Hashable],
    freeze: _freeze.FreezePolicy | int | None = None,
    moment_dtype: Any = None,
    error_dtype: Any = None,
    skip_nonfinite: bool = True,
) -> optax.GradientTransformationExtraArgs:
  r"""Rescales local gradients by 1-bit Adam, averaging them across ``axis_name``.

  Feed it each device's *local* gradient :math:`g_i`; it does the communication.

  **Warmup** (until the freeze policy fires at step :math:`T_0`): exactly
  :func:`optax.scale_by_adam` applied to the mean gradient
  :math:`\bar g = \frac1n \sum_i g_i` (one float32 all-reduce):

  .. math::

    m_t = \beta_1 m_{t-1} + (1-\beta_1)\bar g_t, \quad
    v_t = \beta_2 v_{t-1} + (1-\beta_2)\bar g_t^2, \quad
    u_t = \frac{m_t/(1-\beta_1^t)}{\sqrt{v_t/(1-\beta_2^t)} + \epsilon}.

  **Compression** (:math:`t > T_0`): :math:`v` is frozen; each device updates
  the momentum with its local gradient and the momenta are averaged by the
  error-compensated 1-bit :func:`compressed_mean` (about 1/32 of the bytes):

  .. math::

    m_t = \mathrm{compressed\_mean}_i\big(\beta_1 m_{t-1} + (1-\beta_1) g_{i,t}\big), \quad
    u_t = \frac{m_t/(1-\beta_1^t)}{\sqrt{v_{T_0}/(1-\beta_2^{T_0})} + \epsilon},

  with :math:`u_t = 0` where :math:`v_{T_0} = 0` (coordinates that never had a
  gradient stay put instead of following sign noise). All leaves travel in one
  flat buffer, so a step has the same collectives for 2 leaves or 2000. The
  switch is one ``lax.cond`` on the replicated ``frozen`` flag, so only the
  taken branch communicates and all devices take the same branch.

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

  With ``axis_name=None`` (one device, no mesh) there is no communication: the
  warmup is Adam, and the compression phase applies the same 1-bit compression
  with error feedback to the momentum (a 1-device cluster), which lets one study
  its effect on convergence.

  Args:
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.
    eps: added to the denominator.
    axis_name: the data-parallel axis of ``shard_map``/``pmap``, or None.
    freeze: when to switch: :func:`variance_ratio_freeze` (default, with
      ``min_steps=0``) or :func:`fixed_step_freeze` (an int ``k`` means
      ``fixed_step_freeze(k)``).
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
  """
  policy = _freeze.check_policy(_freeze.variance_ratio_freeze() if freeze is None else freeze)
  moment_dtype = _check_float_dtype("moment_dtype", moment_dtype)
  error_dtype = _check_float_dtype("error_dtype", error_dtype)

  def init_fn(params):
    size, _ = _check_params(params)
    n = _collective.axis_size(axis_name, caller="scale_by_onebit_adam.init")
    padded = _compressor.padded_size(size, n)
    return ScaleByOnebitAdamState(
        count=jnp.zeros([], jnp.int32),
        mu=_zeros(params, moment_dtype),
        nu=_zeros(params, moment_dtype),
        frozen=jnp.zeros([], jnp.bool_),
        freeze_step=jnp.zeros([], jnp.int32),
        variance_ratio=jnp.full([], jnp.nan, jnp.float32),
        reference_l1=jnp.zeros([], jnp.float32),
        wire_bytes=jnp.zeros([], jnp.float32),
        skipped_steps=jnp.zeros([], jnp.int32),
        worker_error=_vary(jnp.zeros((1, padded), error_dtype), axis_name),
        server_error=_vary(jnp.zeros((1, padded // n), error_dtype), axis_name),
    )

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    if not isinstance(state, ScaleByOnebitAdamState):
      raise TypeError(
          f"scale_by_onebit_adam.update got a {type(state).__name__} state; pass the "
          "state returned by this transformation's init.")
    if jax.tree.structure(updates) != jax.tree.structure(state.mu):
      raise ValueError(
          "scale_by_onebit_adam.update: the gradient tree does not match the tree the "
          f"state was initialised with.\n  gradients: {jax.tree.structure(updates)}\n"
          f"  state:     {jax.tree.structure(state.mu)}")
    for g, m in zip(jax.tree.leaves(updates), jax.tree.leaves(state.mu)):
      if jnp.shape(g) != m.shape:
        raise ValueError(
            f"scale_by_onebit_adam.update: a gradient leaf has shape {jnp.shape(g)} but "
            f"the state holds {m.shape}; did the model change after init?")
    size, _ = _check_params(updates)
    n = _collective.axis_size(axis_name, caller="scale_by_onebit_adam.update")
    padded = _compressor.padded_size(size, n)
    if state.worker_error.shape != (1, padded) or state.server_error.shape != (1, padded // n):
      raise ValueError(
          f"scale_by_onebit_adam.update: the error buffers have shapes "
          f"{state.worker_error.shape} and {state.server_error.shape} per device, but "
          f"{size} parameters on {n} devices need (1, {padded}) and (1, {padded // n}). "
          "The state was made for another device count or model: re-init it, or "
          "restore it with onebit_optax's checkpoint helpers. Under shard_map, shard "
          "it with onebit_optax.state_partition_specs(state, axis_name).")
    if (axis_name is not None and axis_name in _collective._varying_axes(state.worker_error)
        and any(axis_name not in _collective._varying_axes(g) for g in jax.tree.leaves(updates))):
      raise ValueError(
          f"scale_by_onebit_adam.update: the gradients are replicated over {axis_name!r}, "
          "i.e. already all-reduced. Inside shard_map, jax.grad with respect to replicated "
          "params sums the gradients across devices in the backward pass, which sends them "
          "in full precision and defeats the compression. Take the gradient with respect "
          f"to onebit_optax.local_params(params, {axis_name!r}) instead.")

    grads = _as_f32(updates)
    mu32, nu32 = _as_f32(state.mu), _as_f32(state.nu)
    count_inc = numerics.safe_increment(state.count)
    unravel = _unraveler(mu32)

    def guard(finite, new, old):
      """``new`` where the step is finite, else ``old`` (fused into ``new``'s producer)."""
      if not skip_nonfinite:
        return new
      return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)

    def warmup(_):
      if axis_name is None:
        # Nothing to average: skip the flatten/unflatten copies. (A mapped axis of
        # size 1 still needs the pmean: it makes the moments replicated-typed.)
        mean_grads = grads
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
      else:
        flat_mean = _collective.full_precision_mean(_flatten(grads, size), axis_name)
        # Read off the replicated mean, which every device's gradient reaches: all
        # devices agree on it without another collective.
        finite = jnp.all(jnp.isfinite(flat_mean))
        mean_grads = unravel(flat_mean)
      mu = guard(finite, optax.tree.update_moment(mean_grads, mu32, b1, 1), mu32)
      nu = guard(finite, optax.tree.update_moment_per_elem_norm(mean_grads, nu32, b2, 2), nu32)
      nu_hat = optax.tree.bias_correction(nu, b2, count_inc)
      nu_hat_l1 = sum(jnp.sum(v) for v in jax.tree.leaves(nu_hat))
      freeze_now, reference, ratio = _freeze.freeze_decision(
          policy, count_inc, nu_hat_l1, state.reference_l1, state.variance_ratio, b2)
      # m / (sqrt(v) + eps) exactly as optax.scale_by_adam (no zero mask before the freeze).
      mu_hat = optax.tree.bias_correction(mu, b1, count_inc)
      direction = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu_hat, nu_hat)
      direction = guard(finite, direction, jax.tree.map(jnp.zeros_like, direction))
      return direction, _Step(
          finite=finite, mu=mu, nu=nu, frozen=freeze_now,
          freeze_step=jnp.where(freeze_now, count_inc, 0).astype(jnp.int32),
          variance_ratio=ratio, reference_l1=reference,
          worker_error=state.worker_error, server_error=state.server_error,
          wire_bytes=jnp.float32(_collective.allreduce_wire_bytes(size, n)))

    def compression(_):
      local_mu = optax.tree.update_moment(grads, mu32, b1, 1)
      worker_error = state.worker_error[0].astype(jnp.float32)
      server_error = state.server_error[0].astype(jnp.float32)
      mean_mu, new_worker_error, new_server_error, finite = (
          _collective.compressed_mean_and_check(
              _flatten(local_mu, padded), worker_error, server_error, axis_name,
              keep_errors_if_nonfinite=skip_nonfinite))
      mu = guard(finite, unravel(mean_mu[:size]), mu32)
      nu_hat = optax.tree.bias_correction(nu32, b2, state.freeze_step)
      mu_hat = optax.tree.bias_correction(mu, b1, count_inc)
      # A coordinate whose frozen variance is 0 never had a gradient: its momentum
      # is only sign noise from the compressor, which 1/(0 + eps) would amplify.
      direction = jax.tree.map(
          lambda m, v: jnp.where(v > 0, m / (jnp.sqrt(v) + eps), 0.0), mu_hat, nu_hat)
      direction = guard(finite, direction, jax.tree.map(jnp.zeros_like, direction))
      return direction, _Step(
          finite=finite, mu=mu, nu=nu32, frozen=state.frozen,
          freeze_step=state.freeze_step, variance_ratio=state.variance_ratio,
          reference_l1=state.reference_l1,
          worker_error=new_worker_error[None].astype(error_dtype),
          server_error=new_server_error[None].astype(error_dtype),
          wire_bytes=jnp.float32(_collective.compressed_wire_bytes(padded, n)))

    # The phase switch. `frozen` is computed from replicated values only, so all
    # devices agree on the branch; only the taken branch's collectives run.
    direction, step = jax.lax.cond(state.frozen, compression, warmup, None)

    # The large buffers were already guarded inside the branches; the scalars here.
    apply = step.finite if skip_nonfinite else jnp.bool_(True)
    pick = lambda new, old: jnp.where(apply, new, old)
    new_state = ScaleByOnebitAdamState(
        count=pick(count_inc, state.count),
        mu=jax.tree.map(lambda m, old: m.astype(old.dtype), step.mu, state.mu),
        nu=jax.tree.map(lambda v, old: v.astype(old.dtype), step.nu, state.nu),
        frozen=pick(step.frozen, state.frozen),
        freeze_step=pick(step.freeze_step, state.freeze_step),
        variance_ratio=pick(step.variance_ratio, state.variance_ratio),
        reference_l1=pick(step.reference_l1, state.reference_l1),
        wire_bytes=step.wire_bytes,
        skipped_steps=state.skipped_steps + jnp.where(apply, 0, 1).astype(jnp.int32),
        worker_error=step.worker_error,
        server_error=step.server_error,
    )
    # Zero on a skipped step (guarded in the branches, fused with the division).
    new_updates = jax.tree.map(lambda d, g: d.astype(jnp.result_type(g)), direction, updates)
    return new_updates, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def onebit_adam(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    axis_name: Optional[Hashable],
    freeze: _freeze.FreezePolicy | int | None = None,
    mask: Any = None,
    moment_dtype: Any = None,
    error_dtype: Any = None,
    skip_nonfinite: bool = True,
) -> optax.GradientTransformationExtraArgs:
  r"""1-bit Adam (Tang et al., 2021): Adam whose communication drops to 1 bit per element.

  A chain of :func:`scale_by_onebit_adam`, decoupled weight decay (when
  ``weight_decay > 0``, as in :func:`optax.adamw`) and
  :func:`optax.scale_by_learning_rate`:

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
    axis_name: the data-parallel axis of ``shard_map``/``pmap``, or None.
    freeze: :func:`variance_ratio_freeze` or :func:`fixed_step_freeze` (or an int).
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
  parts = [scale_by_onebit_adam(
      b1, b2, eps, axis_name=axis_name, freeze=freeze, moment_dtype=moment_dtype,
      error_dtype=error_dtype, skip_nonfinite=skip_nonfinite)]
  if not (isinstance(weight_decay, (int, float)) and weight_decay == 0.0):
    parts.append(optax.add_decayed_weights(weight_decay, mask))
  parts.append(optax.scale_by_learning_rate(learning_rate))
  return optax.chain(*parts)


def _find_state(opt_state) -> ScaleByOnebitAdamState:
  found = [s for s in jax.tree.leaves(
      opt_state, is_leaf=lambda s: isinstance(s, ScaleByOnebitAdamState))
           if isinstance(s, ScaleByOnebitAdamState)]
  if len(found) != 1:
    raise ValueError(
        f"Expected exactly one 1-bit Adam state inside the optimizer state, found "
        f"{len(found)}. Pass the state returned by onebit_adam / scale_by_onebit_adam "
        "(possibly wrapped by optax.chain, inject_hyperparams, masked, ...).")
  return found[0]


def _plain(x):
  """The array inside a Flax NNX variable (``nnx.Optimizer`` wraps its state), else ``x``."""
  return x.value if hasattr(x, "value") and not isinstance(x, jax.Array) else x


def is_frozen(opt_state) -> jax.Array:
  """True once the variance is frozen (compression phase). Accepts any state containing one.

  Args:
    opt_state: the optimizer state, or any optax state that contains exactly one
      :class:`ScaleByOnebitAdamState` (``optax.chain``, ``inject_hyperparams``,
      ``masked``, ...). Under ``pmap`` fields carry the device axis.

  Returns:
    A bool scalar array: the phase the *next* step will run.

  Example:
    >>> import jax.numpy as jnp, onebit_optax
    >>> tx = onebit_optax.onebit_adam(1e-3, axis_name=None)
    >>> bool(onebit_optax.is_frozen(tx.init({'w': jnp.ones(2)})))
    False
  """
  return _plain(_find_state(opt_state).frozen)


def freeze_step(opt_state) -> jax.Array:
  """The last warmup step (the variance is frozen after it); 0 while still warming up.

  Args:
    opt_state: the optimizer state, or any optax state that contains exactly one
      :class:`ScaleByOnebitAdamState` (``optax.chain``, ``inject_hyperparams``,
      ``masked``, ...). Under ``pmap`` fields carry the device axis.

  Returns:
    An int32 scalar array :math:`T_0` (the frozen variance is :math:`v_{T_0}`).

  Example:
    >>> import jax.numpy as jnp, onebit_optax
    >>> tx = onebit_optax.onebit_adam(1e-3, axis_name=None)
    >>> int(onebit_optax.freeze_step(tx.init({'w': jnp.ones(2)})))
    0
  """
  return _plain(_find_state(opt_state).freeze_step)


def variance_ratio(opt_state) -> jax.Array:
  r"""The last measured :math:`\lVert\hat v_t\rVert_1 / \lVert\hat v_{t-\Delta}\rVert_1` (NaN before the first).

  Args:
    opt_state: the optimizer state, or any optax state that contains exactly one
      :class:`ScaleByOnebitAdamState` (``optax.chain``, ``inject_hyperparams``,
      ``masked``, ...). Under ``pmap`` fields carry the device axis.

  Returns:
    A float32 scalar array, measured every :math:`\Delta` warmup steps (see
    :func:`variance_ratio_freeze`); it stops moving once frozen.

  Example:
    >>> import jax.numpy as jnp, onebit_optax
    >>> tx = onebit_optax.onebit_adam(1e-3, axis_name=None)
    >>> float(onebit_optax.variance_ratio(tx.init({'w': jnp.ones(2)})))
    nan
  """
  return _plain(_find_state(opt_state).variance_ratio)


def wire_bytes(opt_state) -> jax.Array:
  r"""Bytes this device sent on the wire in the last step (ring model for the all-reduce).

  Args:
    opt_state: the optimizer state, or any optax state that contains exactly one
      :class:`ScaleByOnebitAdamState` (``optax.chain``, ``inject_hyperparams``,
      ``masked``, ...). Under ``pmap`` fields carry the device axis.

  Returns:
    A float32 scalar array: :math:`2\frac{n-1}{n}\,4D` for the float32
    all-reduce of warmup, :func:`compressed_wire_bytes` in compression, 0 on
    one device.

  Example:
    >>> import jax.numpy as jnp, onebit_optax
    >>> tx = onebit_optax.onebit_adam(1e-3, axis_name=None)
    >>> float(onebit_optax.wire_bytes(tx.init({'w': jnp.ones(2)})))
    0.0
  """
  return _plain(_find_state(opt_state).wire_bytes)


def skipped_steps(opt_state) -> jax.Array:
  """How many steps were skipped on all devices because a gradient was not finite.

  Args:
    opt_state: the optimizer state, or any optax state that contains exactly one
      :class:`ScaleByOnebitAdamState` (``optax.chain``, ``inject_hyperparams``,
      ``masked``, ...). Under ``pmap`` fields carry the device axis.

  Returns:
    An int32 scalar array.

  Example:
    >>> import jax.numpy as jnp, onebit_optax
    >>> tx = onebit_optax.onebit_adam(1e-3, axis_name=None)
    >>> state = tx.init({'w': jnp.ones(2)})
    >>> _, state = tx.update({'w': jnp.array([1.0, jnp.nan])}, state)
    >>> int(onebit_optax.skipped_steps(state))
    1
  """
  return _plain(_find_state(opt_state).skipped_steps)
