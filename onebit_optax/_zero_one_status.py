"""A one-call summary of a 0/1 Adam state for logging: the last step's kind and what comes next."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import numpy as np

from onebit_optax import _status
from onebit_optax import _zero_one_steps as _steps
from onebit_optax._zero_one_adam import ScaleByZeroOneAdamState

__all__ = ["ZeroOneStatus", "zero_one_status"]

_FIELDS = ("count", "variance_updates", "var_interval", "local_interval", "since_sync",
           "phase", "wire_bytes", "skipped_steps")


class ZeroOneStatus(NamedTuple):
  """What :func:`status` reports for a 0/1 Adam state: plain Python values, ready for a logger.

  ``str(status)`` is a one-paragraph summary; ``status._asdict()`` gives the fields.

  Example:
    >>> import jax.numpy as jnp, onebit_optax
    >>> tx = onebit_optax.zero_one_adam(1e-3, axis_name=None, var_freeze_step=10)
    >>> s = onebit_optax.status(tx.init({'w': jnp.ones(2)}), var_freeze_step=10)
    >>> print(s)
    step 0: last step none; 0 variance steps so far, one every 1 steps now, next variance step 1; 0 non-finite steps skipped; last step sent 0 B
  """

  phase: str  # the last step: 'variance', 'compressed', 'local', 'sync', or 'none' before the first.
  step: int  # optimizer steps taken (skipped steps are not counted).
  variance_steps: int  # variance steps taken (float32 all-reduce, v updated).
  var_interval: int  # steps between variance steps now (1, 2, 4, ...; doubles every var_update_scaler).
  next_variance_step: Optional[int]  # the next variance step; None once v is frozen (or past var_freeze_step).
  frozen: Optional[bool]  # v frozen (step > var_freeze_step); None when not known from the state alone.
  local_interval: int  # steps between syncs after the freeze (1 without local steps).
  steps_since_sync: int  # local steps taken since the last sync.
  last_step_bytes: float  # bytes this device sent in the last step.
  skipped_steps: int  # steps skipped for non-finite gradients (all devices together).
  replicas_agree: bool  # the counters are equal on every replica the state holds.
  notes: tuple  # warnings and caveats, as sentences.

  def __str__(self) -> str:
    if self.frozen:
      head = (f"step {self.step}: variance frozen after {self.variance_steps} variance steps; "
              f"last step {self.phase}, a sync every {self.local_interval} steps "
              f"({self.steps_since_sync} local steps since the last)")
    else:
      nxt = ("" if self.next_variance_step is None
             else f", next variance step {self.next_variance_step}")
      head = (f"step {self.step}: last step {self.phase}; {self.variance_steps} variance steps "
              f"so far, one every {self.var_interval} steps now{nxt}")
    parts = [head, f"{self.skipped_steps} non-finite steps skipped",
             f"last step sent {_status._fmt_bytes(self.last_step_bytes)}"]
    return "; ".join(parts) + "".join(f"\n  note: {n}" for n in self.notes)


def _next_variance_step(step: int, interval: int, var_freeze_step: Optional[int],
                        frozen: Optional[bool]) -> Optional[int]:
  """The first count > step with count % interval == 0, if it is before the freeze."""
  if frozen:
    return None
  nxt = (step // interval + 1) * interval
  if var_freeze_step is not None and nxt > var_freeze_step:
    return None
  return nxt


def zero_one_status(opt_state: Any, *, var_freeze_step: Optional[int] = None,
                    params: Any = None) -> ZeroOneStatus:
  r"""A one-call summary of a 0/1 Adam state; :func:`status` calls it for a 0/1 state.

  Reads the state on the host (outside ``jit``). 0/1 Adam's step kinds
  (Lu et al., 2023): a *variance* step averages the gradient in float32 and
  updates :math:`m` and :math:`v`; it falls on the counts divisible by the
  interval, which starts at 1 and doubles every ``var_update_scaler`` variance
  steps. Every other step before ``var_freeze_step`` is *compressed* (the
  1-bit gradient updates :math:`m`). After it, :math:`v` is frozen: *local*
  steps move no bytes and a *sync* step averages the accumulated update in 1
  bit (every step without local steps).

  Args:
    opt_state: an optimizer state holding exactly one
      :class:`ScaleByZeroOneAdamState` (``optax.chain``, ``inject_hyperparams``,
      a ``shard_map`` state or a ``pmap`` state).
    var_freeze_step: the ``var_freeze_step`` the optimizer was built with (the
      state does not record it): without it, whether :math:`v` is frozen is
      known only once a local or sync step has run.
    params: optional parameters: a note names the leaves that are not finite.

  Returns:
    A :class:`ZeroOneStatus`.

  Example:
    >>> import jax, jax.numpy as jnp, onebit_optax
    >>> tx = onebit_optax.zero_one_adam(1e-3, axis_name=None, var_freeze_step=10)
    >>> state = tx.init({'w': jnp.ones(2)})
    >>> for _ in range(3):
    ...   _, state = jax.jit(tx.update)({'w': jnp.ones(2)}, state, {'w': jnp.ones(2)})
    >>> s = onebit_optax.status(state, var_freeze_step=10)
    >>> s.phase, s.step, s.variance_steps, s.next_variance_step
    ('variance', 3, 3, 4)
  """
  found = _status._find(opt_state, ScaleByZeroOneAdamState)
  if len(found) != 1:
    raise ValueError(
        f"status: expected exactly one 0/1 Adam state inside the optimizer state, found "
        f"{len(found)}. Pass the state of zero_one_adam / scale_by_zero_one_adam.")
  state = found[0]
  stacked = np.ndim(_status._unwrap(state.count)) == 1  # pmap: every field has the device axis.
  per_replica = {name: _status._replica_values(getattr(state, name), stacked)
                 for name in _FIELDS}
  agree = all(_status._agree(values) for values in per_replica.values())
  f = {name: values[0].item() for name, values in per_replica.items()}
  step, code = int(f["count"]), int(f["phase"])
  phase = "none" if code == _steps.NO_STEP else _steps.PHASES[code]
  if var_freeze_step is not None:
    frozen = step > var_freeze_step
  else:
    frozen = True if phase in ("local", "sync") else None
  notes = []
  if frozen is None:
    notes.append("var_freeze_step not given: pass the one zero_one_adam was built with to "
                 "know when the variance freezes")
  if not agree:
    notes.append("the replicas' counters differ: the devices are not running one optimizer "
                 "(build zero_one_adam with axis_name=<the mapped axis>)")
  param_notes = _status._params_notes(params)
  notes.extend(param_notes)
  notes.extend(_status._skip_notes(step, int(f["skipped_steps"]), None,
                                   blame_gradients=not param_notes))
  return ZeroOneStatus(
      phase=phase, step=step, variance_steps=int(f["variance_updates"]),
      var_interval=int(f["var_interval"]),
      next_variance_step=_next_variance_step(step, int(f["var_interval"]), var_freeze_step,
                                             frozen),
      frozen=frozen, local_interval=int(f["local_interval"]),
      steps_since_sync=int(f["since_sync"]), last_step_bytes=float(f["wire_bytes"]),
      skipped_steps=int(f["skipped_steps"]), replicas_agree=agree, notes=tuple(notes))
