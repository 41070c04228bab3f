"""Misuse the library can see: values out of range, a mapped region without an axis, bad wrappers."""

from __future__ import annotations

import functools
import sys
from typing import Hashable, Optional

import jax
import numpy as np
import optax

__all__ = ["check_decay_rates", "check_learning_rate", "check_nonnegative", "check_mapped_region",
           "check_wrappers", "check_state_layout"]


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
  """Refuses known values that are negative or not finite (``max_update``: also 0).

  ``weight_decay < 0`` grows the weights every step, ``variance_floor < 0``
  lets the frozen variance reach 0 (steps of ``1/eps``), ``max_update <= 0``
  clips every post-freeze step to nothing or flips its sign: each diverges or
  stalls with no error, so each is refused here.
  """
  why = {"weight_decay": "a negative decay grows the weights every step (0 disables it)",
         "variance_floor": "the floor keeps the frozen variance away from 0 (0 disables it)",
         "max_update": "it bounds every coordinate's step after the freeze; None uses "
                       "adam_update_bound(b1, b2)"}
  for name, value in values.items():
    known = None if value is None else _known(value)
    if known is None:
      continue
    strict = name == "max_update"
    if not np.isfinite(known) or known < 0 or (strict and known == 0):
      bound = "> 0" if strict else ">= 0"
      raise ValueError(f"{caller}: {name}={known!r} must be finite and {bound}: {why[name]}.")


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
        "(skip_nonfinite=True; onebit_optax.skipped_steps(state) counts them): drop the "
        "wrapper."),
}


def check_wrappers(axis_name: Optional[Hashable], caller: str) -> None:
  """Refuses ``optax.MultiSteps`` / ``optax.apply_if_finite`` around a communicating update.

  Read off the Python stack while tracing (free at run time). Without an axis
  there is no communication and both wrappers work.
  """
  if axis_name is None:
    return
  codes = _wrapper_codes()
  frame = sys._getframe(1)  # pylint: disable=protected-access
  while frame is not None:
    wrapper = codes.get(frame.f_code)
    if wrapper is not None:
      raise ValueError(
          f"{caller}: {wrapper} around onebit_adam(axis_name={axis_name!r}) does not "
          f"work: {_WRAPPER_ADVICE[wrapper]}")
    frame = frame.f_back


def check_state_layout(state, axis_name: Optional[Hashable], num_devices: int,
                       caller: str) -> None:
  """Recognises a ``pmap`` state, or per-device buffers passed whole, inside ``shard_map``."""
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
        f"{caller}: the per-device buffers (local_momentum, worker_scale, worker_error, "
        f"server_error) arrive whole on every device (worker_scale has shape "
        f"{state.worker_scale.shape}, one row per device), so the state's "
        f"in_specs gave them P(). Shard them with P({axis_name!r}) and everything else "
        f"with P(), which is what {specs} returns; use it as the state's in_specs and "
        "out_specs.")
