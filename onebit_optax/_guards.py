"""Misuse the library can see: values out of range, a mapped region without an axis, bad wrappers."""

from __future__ import annotations

import functools
import sys
from typing import Hashable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from onebit_optax import _collective

__all__ = ["check_decay_rates", "check_learning_rate", "check_nonnegative", "check_step_counts",
           "static_int", "check_mapped_region", "check_wrappers", "check_state_layout",
           "check_buffers", "check_local_gradients", "check_same_tree", "check_float_params", "is_empty", "no_work"]


def _known(value) -> Optional[float]:
  """``value`` as a float when it is known while tracing (not a tracer, not a schedule)."""
  if isinstance(value, jax.core.Tracer) or callable(value):
    return None
  try:
    array = np.asarray(value, dtype=np.float64)
  except (TypeError, ValueError):
    return None
  return float(array) if array.ndim == 0 else None


def check_decay_rates(b1, b2, eps, caller: str) -> None:
  """Refuses ``b1``, ``b2`` outside [0, 1) and ``eps < 0`` where their values are known.

  Under ``optax.inject_hyperparams`` the values are concrete arrays in ``init``
  (checked) and tracers in ``update`` (not checkable there).
  """
  why = {"b1": "the momentum would never move (b1 = 1) or not be an average",
         "b2": "with b2 = 1 the variance never moves from 0, its bias correction divides "
               "by 1 - b2^t = 0, and the variance ratio is NaN forever"}
  for name, value in (("b1", b1), ("b2", b2)):
    known = _known(value)
    if known is not None and not 0.0 <= known < 1.0:
      raise ValueError(f"{caller}: {name}={known!r} must be in [0, 1): {why[name]}.")
  known = _known(eps)
  if known is not None and not known >= 0.0:
    raise ValueError(
        f"{caller}: eps={known!r} must be >= 0: it keeps the denominator "
        "sqrt(v) + eps away from zero.")


def check_nonnegative(caller: str, **values) -> None:
  """Refuses known values that are negative or NaN (and inf; ``max_update``: 0 too, inf allowed).

  ``weight_decay < 0`` grows the weights every step, ``variance_floor < 0``
  lets the frozen variance reach 0 (steps of ``1/eps``), ``max_update <= 0``
  clips every post-freeze step to nothing (training stops) or flips its sign:
  each diverges or stalls with no error, so each is refused here.
  ``max_update=float('inf')`` disables the clip.
  """
  why = {"weight_decay": "a negative decay grows the weights every step (0 disables it)",
         "variance_floor": "the floor keeps the frozen variance away from 0 (0 disables it)",
         "max_update": "it bounds every coordinate's step after the freeze, so 0 would stop "
                       "training; None uses adam_update_bound(b1, b2), float('inf') disables "
                       "the clip"}
  for name, value in values.items():
    known = None if value is None else _known(value)
    if known is None:
      continue
    if name == "max_update":
      if not known > 0:  # NaN and -inf included
        raise ValueError(f"{caller}: {name}={known!r} must be > 0: {why[name]}.")
    elif not np.isfinite(known) or known < 0:
      raise ValueError(f"{caller}: {name}={known!r} must be finite and >= 0: {why[name]}.")


def check_step_counts(caller: str, low: int = 1, **values) -> None:
  """Refuses step counts that are not whole numbers ``>= low`` (a bool, a string, 10.5, 0).

  Traced values (``optax.inject_hyperparams``) pass: they are compared in the step.
  """
  for name, value in values.items():
    if isinstance(value, jax.core.Tracer):
      continue
    number = isinstance(value, (int, float, np.integer, np.floating, np.ndarray, jax.Array))
    known = _known(value) if number and not isinstance(value, (bool, np.bool_)) else None
    if known is None or not np.isfinite(known) or known < low or known != int(known):
      raise ValueError(
          f"{caller}: {name}={value!r} must be an integer >= {low} (a number of steps; "
          f"got a {type(value).__name__}).")


def static_int(value, name: str, caller: str, *, low: int, why: str) -> int:
  """``value`` as a Python int ``>= low``: it decides the state's layout, so it must be static.

  ``optax.inject_hyperparams`` hands numeric arguments to the factory as arrays
  (tracers in ``update``): the message says which ``static_args`` to pass.
  """
  if isinstance(value, (jax.core.Tracer, jax.Array)):
    raise ValueError(
        f"{caller}: {name} is traced (optax.inject_hyperparams injects numeric arguments "
        f"as arrays); it decides the state's layout, so it must be static: pass "
        f"static_args=({name!r},) to optax.inject_hyperparams.")
  array = np.asarray(value) if isinstance(value, (int, np.integer)) else None
  if (isinstance(value, (bool, np.bool_)) or array is None or array.ndim
      or not np.issubdtype(array.dtype, np.integer) or value < low):
    raise ValueError(f"{caller}: {name}={value!r} must be an int >= {low} ({why}).")
  return int(value)


def check_learning_rate(learning_rate, caller: str) -> None:
  """Refuses a known learning rate (or a schedule's value at step 0) that is NaN, inf or < 0.

  The learning rate is applied after 1-bit Adam (``optax.scale_by_learning_rate``),
  so a NaN there turns every parameter into NaN in one step and the optimizer
  only sees the NaN gradients that follow.
  """
  where = ""
  if callable(learning_rate):
    try:
      learning_rate, where = learning_rate(0), " (the schedule's value at step 0)"
    except Exception:  # pylint: disable=broad-except  # a schedule we cannot call here
      return
  known = _known(learning_rate)
  if known is not None and not (np.isfinite(known) and known >= 0):
    raise ValueError(
        f"{caller}: learning_rate={known!r}{where} must be finite and >= 0: a NaN or "
        "infinite learning rate turns every parameter into NaN in one step, and a negative "
        "one climbs the loss (to maximise, negate the loss).")


def _mapped_axes() -> dict:
  """The manual axes of size > 1 of the enclosing ``shard_map``/``pmap`` (``vmap`` has none)."""
  mesh = jax.sharding.get_abstract_mesh()
  manual = getattr(mesh, "manual_axes", ())
  return {name: mesh.shape[name] for name in manual if mesh.shape[name] > 1}


def check_mapped_region(axis_name: Optional[Hashable], caller: str) -> None:
  """With ``axis_name=None``, refuses to run inside a ``shard_map``/``pmap`` of several devices.

  There every device would run its own optimizer on its local gradient, and
  the replicas would drift apart with no error (under ``pmap`` and
  ``shard_map(check_vma=False)``), or fail in a ``lax.cond`` with a message
  about ``pcast`` (under ``check_vma``).
  """
  if axis_name is not None:
    return
  axes = _mapped_axes()
  if not axes:
    return
  names = ", ".join(f"{name!r} ({size} devices)" for name, size in axes.items())
  suggestion = " or ".join(f"axis_name={name!r}" for name in axes)
  raise ValueError(
      f"{caller}: axis_name=None, but this runs inside jax.shard_map / jax.pmap over "
      f"{names}: inside a mapped region the data axis must be named. Build the optimizer "
      f"with {suggestion} (the data-parallel axis). With axis_name=None each device would "
      "run its own optimizer on its local gradient, and the replicas drift apart with no "
      "error. (To run separate optimizers on purpose, call init and update outside the "
      "mapped region.)")


@functools.lru_cache(maxsize=1)
def _wrapper_codes() -> dict:
  """Code objects of optax wrappers that break a communicating inner update."""
  codes = {optax.MultiSteps.update.__code__: "optax.MultiSteps"}
  for const in optax.apply_if_finite.__code__.co_consts:
    if getattr(const, "co_name", None) == "update":
      codes[const] = "optax.apply_if_finite"
  return codes


_WRAPPER_ADVICE = {
    "optax.MultiSteps": (
        "it calls the inner update, and so its collectives, on every mini-step (keeping "
        "the result only every k-th), and under shard_map its replicated gradient "
        "accumulator is taken for all-reduced gradients. Accumulate the micro-batches "
        "before the optimizer instead: onebit_optax.accumulate_gradients(loss_fn, params, "
        "batch, num_microbatches) gives the local mean gradient, and one update (one "
        "communication) per optimizer step follows."),
    "optax.apply_if_finite": (
        "it decides on each device's local gradient, so devices can take different "
        "branches around the collectives (a deadlock), and under shard_map it does not "
        "trace. 1-bit Adam already skips non-finite steps, on all devices together "
        "(skip_nonfinite=True; onebit_optax.status(state).skipped_steps counts them): drop the "
        "wrapper."),
}


class LocalClippingWarning(UserWarning):
  """``optax.clip_by_global_norm`` before a communicating optimizer clips each device alone.

  Before :func:`onebit_adam` / :func:`zero_one_adam` with an ``axis_name`` the
  gradients are each device's *local* ones: optax's clip scales each by its own
  norm (not the mean gradient's, and by another factor on every device).
  :func:`clip_by_global_norm` with the same ``axis_name`` clips by the norm of
  the mean gradient, one factor on every device. Warned once, when the update
  is traced.

  Example:
    >>> import warnings, onebit_optax
    >>> with warnings.catch_warnings():
    ...   warnings.simplefilter('error', onebit_optax.LocalClippingWarning)
    ...   tx = onebit_optax.clip_by_global_norm(1.0, axis_name='data')
  """


@functools.lru_cache(maxsize=1)
def _chain_codes() -> tuple:
  """Code objects of ``optax.chain``'s update and ``optax.clip_by_global_norm``'s update."""
  return (optax.chain(optax.identity()).update.__code__,
          optax.clip_by_global_norm(1.0).update.__code__)


def _is_optax_clip(update, clip_code) -> bool:
  """Whether a chain element's update is ``optax.clip_by_global_norm``'s (maybe wrapped for extra args)."""
  if getattr(update, "__code__", None) is clip_code:
    return True
  cells = getattr(update, "__closure__", None) or ()
  inner = [c.cell_contents for c in cells if isinstance(
      getattr(c, "cell_contents", None), optax.GradientTransformation)]
  return any(getattr(t.update, "__code__", None) is clip_code for t in inner)


def _warn_local_clipping(frame, axis_name, caller: str) -> None:
  """Warns if ``frame`` is an ``optax.chain`` update whose elements before this one hold optax's clip.

  The chain's locals name the element running now (``fn``) and all of them
  (``update_fns``), so the order is known: a clip *after* the optimizer sees
  replicated updates and is fine.
  """
  names = frame.f_locals
  update_fns, current = names.get("update_fns"), names.get("fn")
  if not isinstance(update_fns, tuple) or current not in update_fns:
    return
  clip_code = _chain_codes()[1]
  if any(_is_optax_clip(f, clip_code) for f in update_fns[:update_fns.index(current)]):
    import warnings  # pylint: disable=import-outside-toplevel
    warnings.warn(
        f"{caller}: optax.clip_by_global_norm before this optimizer (axis_name="
        f"{axis_name!r}) clips each device's local gradient by its own norm: not the "
        "mean gradient's norm, and a different factor on every device. Use "
        f"onebit_optax.clip_by_global_norm(max_norm, axis_name={axis_name!r}), which "
        "agrees on one factor with one scalar all-reduce.", LocalClippingWarning,
        stacklevel=2)


def check_wrappers(axis_name: Optional[Hashable], caller: str) -> None:
  """Refuses ``optax.MultiSteps`` / ``optax.apply_if_finite`` around a communicating update.

  Read off the Python stack while tracing (free at run time). Without an axis
  there is no communication and both wrappers work. Also warns
  (:class:`LocalClippingWarning`) when an enclosing ``optax.chain`` runs
  ``optax.clip_by_global_norm`` before this update: it would clip each
  device's local gradient alone.
  """
  if axis_name is None:
    return
  codes = _wrapper_codes()
  chain_code = _chain_codes()[0]
  frame = sys._getframe(1)  # pylint: disable=protected-access
  while frame is not None:
    wrapper = codes.get(frame.f_code)
    if wrapper is not None:
      raise ValueError(
          f"{caller}: {wrapper} around onebit_adam(axis_name={axis_name!r}) does not "
          f"work: {_WRAPPER_ADVICE[wrapper]}")
    if frame.f_code is chain_code:
      _warn_local_clipping(frame, axis_name, caller)
    frame = frame.f_back


def check_state_layout(state, axis_name: Optional[Hashable], num_devices: int,
                       caller: str, buffers: str) -> None:
  """Recognises a ``pmap`` state, or per-device buffers passed whole, inside ``shard_map``.

  Both optimizers' states have ``count`` and a per-device ``worker_scale``
  of one row per device; ``buffers`` names the state's per-device buffers.
  """
  specs = f"onebit_optax.state_partition_specs(state, {axis_name!r})"
  if np.ndim(state.count) != 0:
    raise ValueError(
        f"{caller}: every field of the state has a leading device axis (count has shape "
        f"{np.shape(state.count)}): it is a jax.pmap state. Under jax.shard_map, make the "
        f"state with onebit_optax.init_sharded(tx, params, mesh, {axis_name!r}) and pass "
        f"{specs} as the state's in_specs and out_specs (per-device buffers on "
        f"P({axis_name!r}), everything else P()).")
  rows = state.worker_scale.shape[0] if np.ndim(state.worker_scale) == 2 else 1
  if num_devices > 1 and rows == num_devices:
    raise ValueError(
        f"{caller}: the per-device buffers ({buffers}) arrive whole on every device "
        f"(worker_scale has shape "
        f"{state.worker_scale.shape}, one row per device), so the state's "
        f"in_specs gave them P(). Shard them with P({axis_name!r}) and everything else "
        f"with P(), which is what {specs} returns; use it as the state's in_specs and "
        "out_specs.")


def check_buffers(state, expected: dict, num_devices: int, caller: str) -> None:
  """The state's mesh-sized buffers have the shapes ``expected`` (name -> shape, a tuple of them, or None)."""
  def shape(x):
    if x is None:
      return None
    return tuple(shape(u) for u in x) if isinstance(x, tuple) else tuple(np.shape(x))

  found = {name: shape(getattr(state, name)) for name in expected}
  if found != expected:
    raise ValueError(
        f"{caller}: the state's per-device buffers have shapes {found}, but these "
        f"parameters on {num_devices} devices need {expected}: the state was made for another "
        "device count or mesh: re-init it on this mesh, or restore it with "
        "onebit_optax.restore_checkpoint (which moves it to another device count). Under "
        "shard_map, shard it with onebit_optax.state_partition_specs(state, axis_name).")


def check_local_gradients(updates, per_device, axis_name: Hashable, caller: str,
                          local_params_call: str) -> None:
  """Under ``shard_map``: the gradients vary over every axis the per-device buffers vary over.

  Gradients replicated over a data axis were all-reduced in float32 by
  ``jax.grad`` in the backward pass (the gradient with respect to replicated
  parameters): the compression would then save nothing. ``per_device`` is one
  of the state's per-device buffers; ``local_params_call`` the call that
  gives the parameters to differentiate at.
  """
  per_device = _collective._varying_axes(per_device)
  for name in _collective.axis_names(axis_name):
    if name in per_device and any(name not in _collective._varying_axes(g)
                                  for g in jax.tree.leaves(updates)):
      raise ValueError(
          f"{caller}: the gradients are replicated over {name!r}, i.e. already all-reduced. "
          "Inside shard_map, jax.grad with respect to replicated params sums the gradients "
          "across devices in the backward pass, which sends them in full precision and "
          f"defeats the compression. Take the gradient at {local_params_call} instead.")


def is_empty(tree) -> bool:
  """Whether ``tree`` holds no elements (no array leaves, or only leaves of size 0).

  What ``optax.partition`` or ``optax.masked`` hands an optimizer whose label
  or mask selects nothing (``optax.MaskedNode`` leaves are empty subtrees). As
  in ``optax.adam``, that is no work rather than an error.
  """
  return all(np.size(leaf) == 0 for leaf in jax.tree.leaves(tree))


def _listed(entries: list, limit: int = 4) -> str:
  more = f", and {len(entries) - limit} more" if len(entries) > limit else ""
  return ", ".join(entries[:limit]) + more


def check_same_tree(updates, reference, caller: str) -> None:
  """The gradients must have the keys and shapes of ``reference`` (the state's ``nu``).

  The message names the leaves that differ (a transposed ``['l2']['w']``, a key
  only one side has), not the first few of each tree.
  """
  if jax.tree.structure(updates) == jax.tree.structure(reference) and all(
      np.shape(g) == np.shape(v)
      for g, v in zip(jax.tree.leaves(updates), jax.tree.leaves(reference))):
    return
  ours = {jax.tree_util.keystr(p): tuple(np.shape(x))
          for p, x in jax.tree_util.tree_leaves_with_path(updates)}
  theirs = {jax.tree_util.keystr(p): tuple(np.shape(x))
            for p, x in jax.tree_util.tree_leaves_with_path(reference)}
  shapes = [f"{k}: {ours[k]} in the gradients, {theirs[k]} in the state"
            + (" (transposed)" if ours[k] == theirs[k][::-1] else "")
            for k in ours if k in theirs and ours[k] != theirs[k]]
  extra = [f"{k}: {ours[k]}" for k in ours if k not in theirs]
  missing = [f"{k}: {theirs[k]}" for k in theirs if k not in ours]
  found = []
  if shapes:
    found.append(f"other shapes: {_listed(shapes)}")
  if extra:
    found.append(f"only in the gradients: {_listed(extra)}")
  if missing:
    found.append(f"only in the state: {_listed(missing)}")
  if not found:  # same paths and shapes, other containers (a tuple for a list, None leaves)
    found.append(f"same leaves in other containers: the gradients are "
                 f"{jax.tree.structure(updates)}, the state {jax.tree.structure(reference)}")
  raise ValueError(
      f"{caller}: the gradient tree does not match the parameters the state was "
      f"initialised with ({len(ours)} leaves in the gradients, {len(theirs)} in the state); "
      f"{'; '.join(found)}. Pass gradients shaped like the params (same keys, same shapes, "
      "not transposed); if the model changed, re-init the optimizer state.")


def check_float_params(tree, caller: str) -> None:
  """Every leaf must be a real floating-point array (an empty tree passes: see :func:`is_empty`)."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
    if not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(
          f"{caller}: leaf {jax.tree_util.keystr(path)} has dtype {dtype}; only "
          "real floating-point parameters can be optimized (complex ones are not "
          "supported: split them into real and imaginary parts). Keep integer/bool "
          "leaves out of the optimizer, e.g. with optax.masked or optax.partition.")


def no_work(updates, state, state_type, caller: str) -> bool:
  """Whether this update has nothing to do: no gradient elements, for a state made for none.

  The optimizer then returns the (empty) updates and the state as they are: no
  collective runs, and every device agrees (the tree's structure is static).
  """
  if not is_empty(updates):
    return False
  if not isinstance(state, state_type):
    raise TypeError(f"{caller} got a {type(state).__name__} state; pass the state returned "
                    "by this transformation's init.")
  check_same_tree(updates, state.nu, caller)
  return True
