"""The hyperparameters a 1-bit Adam optimizer was built with, recorded for checkpoints."""

from __future__ import annotations

import functools
import inspect
import math
import weakref
from typing import Callable, Optional

import jax
import numpy as np

from onebit_optax import _freeze

__all__ = ["records_config", "config_of", "describe", "compare", "FIELDS", "SCHEDULE_STEPS"]

# The hyperparameters compared on restore. Those that shape the state or the
# wire layout (axis_name, model_axis, exact_below, moment_dtype, error_dtype)
# are not: the checkpoint's structure and layout checks see them (and an
# exact_below or a mesh change is a supported move, not a mismatch).
FIELDS = ("learning_rate", "b1", "b2", "eps", "weight_decay", "mask", "freeze",
          "variance_floor", "max_update", "skip_nonfinite")
# Steps at which a schedule is evaluated (with the checkpoint's step and the
# next one): two schedules equal there are taken to be the same.
SCHEDULE_STEPS = (0, 1, 10, 100, 1_000, 10_000, 100_000, 1_000_000)
_RTOL = 1e-6
_MAX_DEPTH = 8  # closures followed from the transformation to a recorded one

# transformation function (init) -> (factory name, bound arguments). Weak: a
# transformation that is gone takes its record with it.
_REGISTRY: "weakref.WeakKeyDictionary[Callable, tuple]" = weakref.WeakKeyDictionary()


def records_config(factory):
  """Decorator: the transformation a factory returns remembers the arguments it was built with.

  Only a reference to the arguments is kept (no conversion: under
  :func:`optax.inject_hyperparams` they are traced); :func:`describe` turns
  them into JSON when a checkpoint is written.
  """
  signature = inspect.signature(factory)

  @functools.wraps(factory)
  def build(*args, **kwargs):
    tx = factory(*args, **kwargs)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    try:
      _REGISTRY[tx.init] = (factory.__name__, dict(bound.arguments))
    except TypeError:  # an init that cannot be weakly referenced: nothing recorded
      pass
    return tx
  return build


def _functions_in(value):
  """The functions (and transformations' functions) held by ``value``, one level down."""
  if callable(getattr(value, "init", None)):
    return [value.init]
  if isinstance(value, (tuple, list)):
    return [f for v in value for f in _functions_in(v)]
  if isinstance(value, dict):
    return [f for v in value.values() for f in _functions_in(v)]
  if inspect.isfunction(value) or isinstance(value, functools.partial):
    return [value.func if isinstance(value, functools.partial) else value]
  return []


def config_of(tx) -> Optional[tuple]:
  """``(factory, arguments)`` of the 1-bit Adam inside ``tx``, or None where none is found.

  ``tx`` itself, or a transformation it holds (``optax.chain``, ``masked``,
  ``partition``...), found by following the closures of its ``init``
  breadth first: the outermost recorded factory wins (:func:`onebit_adam` over
  the :func:`scale_by_onebit_adam` it contains). Under
  :func:`optax.inject_hyperparams` the factory is only called inside ``init``
  and ``update``: nothing is found (its hyperparameters are in the state).
  """
  frontier, seen = [getattr(tx, "init", None)], set()
  for _ in range(_MAX_DEPTH):
    found = [_REGISTRY[f] for f in frontier if f is not None and f in _REGISTRY]
    if found:
      return found[0]
    following = []
    for f in frontier:
      if f is None or id(f) in seen:
        continue
      seen.add(id(f))
      for cell in getattr(f, "__closure__", None) or ():
        try:
          following.extend(_functions_in(cell.cell_contents))
        except ValueError:  # an empty cell
          continue
    frontier = following
    if not frontier:
      return None
  return None


def _number(x):
  """A concrete scalar as a JSON number; None for anything else (traced, an array)."""
  if isinstance(x, (bool, np.bool_)):
    return bool(x)
  if isinstance(x, jax.core.Tracer):
    return None
  try:
    value = np.asarray(x)
  except Exception:  # pylint: disable=broad-except
    return None
  if value.shape != () or not np.issubdtype(value.dtype, np.number):
    return None
  return int(value) if np.issubdtype(value.dtype, np.integer) else float(value)


def _schedule(fn, steps) -> Optional[dict]:
  try:
    values = [_number(fn(np.int32(s))) for s in steps]
  except Exception:  # pylint: disable=broad-except
    return None
  return None if any(v is None for v in values) else {"schedule": [list(p) for p in zip(steps, values)]}


def _value(name: str, x, steps):
  """The JSON form of one hyperparameter (``{"unknown": kind}`` where it cannot be compared)."""
  if name == "freeze":
    try:
      policy = _freeze.check_policy(_freeze.variance_ratio_freeze() if x is None else x)
    except (TypeError, ValueError):
      return {"unknown": type(x).__name__}
    fields = {k: _number(v) if v is not None else None for k, v in policy._asdict().items()}
    return {type(policy).__name__: fields}
  if name == "mask":
    if x is None or callable(x):
      return None if x is None else {"unknown": "callable"}
    leaves, treedef = jax.tree.flatten(x)
    return {"tree": str(treedef), "leaves": [_number(v) for v in leaves]}
  if x is None or isinstance(x, (bool, np.bool_)):
    return x if x is None else bool(x)
  if callable(x):
    return _schedule(x, steps) or {"unknown": "schedule"}
  number = _number(x)
  return {"unknown": type(x).__name__} if number is None else number


def describe(tx, step: int) -> Optional[dict]:
  """The JSON record of ``tx``'s hyperparameters (:data:`FIELDS`), or None if not found."""
  found = config_of(tx)
  if found is None:
    return None
  factory, arguments = found
  steps = sorted(set(SCHEDULE_STEPS) | {int(step), int(step) + 1})
  return {"factory": factory, "step": int(step),
          "fields": {name: _value(name, arguments[name], steps)
                     for name in FIELDS if name in arguments}}


def _same(saved, now) -> bool:
  if isinstance(saved, dict) and "schedule" in saved:
    if not (isinstance(now, dict) and "schedule" in now):
      return False
    return all(s0 == s1 and math.isclose(v0, v1, rel_tol=_RTOL, abs_tol=0.0)
               for (s0, v0), (s1, v1) in zip(saved["schedule"], now["schedule"]))
  if isinstance(saved, float) and isinstance(now, (int, float)) and not isinstance(now, bool):
    return math.isclose(saved, now, rel_tol=_RTOL, abs_tol=0.0) or saved == now
  return saved == now


def _show(value) -> str:
  if isinstance(value, dict) and "schedule" in value:
    shown = ", ".join(f"{s}: {v:.6g}" for s, v in value["schedule"][:4])
    return f"a schedule ({shown}, ...)"
  if isinstance(value, dict) and "unknown" in value:
    return f"a {value['unknown']} (not comparable)"
  return repr(value)


def compare(saved: Optional[dict], tx) -> tuple[list, list]:
  """``(differences, unchecked)``: the fields of ``saved`` that ``tx`` changes, and those it cannot check.

  Each difference is ``(field, line)``. A field is unchecked where either side
  could not be recorded (a callable mask, a schedule that could not be
  evaluated) or where ``saved`` or ``tx`` has no record at all.
  """
  if saved is None:
    return [], ["all (the checkpoint holds no hyperparameters)"]
  now = describe(tx, saved["step"])
  if now is None:
    return [], ["all (no onebit_adam / scale_by_onebit_adam found in tx)"]
  differences, unchecked = [], []
  for name, old in saved["fields"].items():
    if name not in now["fields"]:
      if saved["factory"] != now["factory"]:
        unchecked.append(name)
      continue
    new = now["fields"][name]
    if any(isinstance(v, dict) and "unknown" in v for v in (old, new)):
      unchecked.append(name)
    elif not _same(old, new):
      differences.append((name, f"{name}: checkpoint {_show(old)}, now {_show(new)}"))
  return differences, unchecked
