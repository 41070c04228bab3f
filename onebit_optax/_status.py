"""Is the run compressing, and if not why: a summary for logs, and replica-identity checks."""

from __future__ import annotations

import math
from typing import Any, Hashable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from onebit_optax import _collective
from onebit_optax import _freeze
from onebit_optax import _zero_one_sharding
from onebit_optax._onebit_adam import ScaleByOnebitAdamState
from onebit_optax._zero_one_adam import ScaleByZeroOneAdamState

__all__ = ["Status", "status", "replicas_identical", "assert_replicas_identical"]

_DEFAULT_B2 = 0.999  # onebit_adam's default.
_INJECTED = tuple(
    t for t in (getattr(optax, "InjectHyperparamsState", None),
                getattr(optax, "InjectStatefulHyperparamsState", None)) if t is not None)


class Status(NamedTuple):
  """What :func:`status` reports for either optimizer: plain Python values, ready for a logger.

  ``str(status)`` is a one-paragraph summary; ``status._asdict()`` gives the
  fields. The first fields are common to both optimizers; the fields of the
  other optimizer's schedule are None.

  Example:
    >>> import jax.numpy as jnp, onebit_optax
    >>> tx = onebit_optax.zero_one_adam(1e-3, axis_name=None, var_freeze_step=10)
    >>> print(onebit_optax.status(tx.init({'w': jnp.ones(2)}), var_freeze_step=10))
    step 0: last step none; 0 variance steps so far, one every 1 steps now, next variance step 1; 0 non-finite steps skipped; no communication (one device)
  """

  phase: str  # 1-bit Adam: 'warmup' or 'compression', the phase the next step runs. 0/1 Adam: the kind of the last step taken, 'variance', 'compressed', 'local', 'sync' ('none' before the first; a skipped call leaves it).
  step: int  # optimizer steps taken (skipped steps are not counted).
  freeze_step: Optional[int]  # last step before v froze (0/1 Adam: var_freeze_step, when given and passed); None before.
  next_check: Optional[int]  # 1-bit Adam: first step at which the policy may freeze; None once frozen (and for 0/1 Adam).
  variance_ratio: float  # 1-bit Adam: last ratio of the bias-corrected variance norms (NaN before; NaN for 0/1 Adam).
  skipped_steps: int  # steps skipped for non-finite gradients, in total.
  bytes_sent: float  # bytes this device has sent so far.
  adam_bytes: float  # bytes a float32 all-reduce of the gradients would have sent.
  bytes_exact: bool  # False when bytes_sent is an estimate (skipped steps are charged at the 1-bit rate).
  replicas_agree: bool  # the scalar fields are equal on every replica the state holds.
  policy: str  # 1-bit Adam: the freeze policy the summary was computed for; 0/1 Adam: the freeze step.
  reason: str  # 1-bit Adam: why the run is not compressing yet ('' once frozen, and for 0/1 Adam).
  notes: tuple  # warnings and caveats, as sentences.
  optimizer: str = "1-bit Adam"  # '1-bit Adam' or '0/1 Adam'.
  frozen: Optional[bool] = None  # v frozen; 0/1 Adam: None when not known (var_freeze_step not given).
  variance_steps: Optional[int] = None  # 0/1 Adam: variance steps taken (float32 all-reduce, v updated).
  var_interval: Optional[int] = None  # 0/1 Adam: steps between variance steps now (1, 2, 4, ...).
  next_variance_step: Optional[int] = None  # 0/1 Adam: the next variance step; None once v is frozen.
  local_interval: Optional[int] = None  # 0/1 Adam: steps between syncs after the freeze (1 without local steps).
  steps_since_sync: Optional[int] = None  # 0/1 Adam: local steps taken since the last sync.
  last_step_bytes: float = 0.0  # bytes this device sent in the last step.

  @property
  def steps_to_next_check(self) -> Optional[int]:
    return None if self.next_check is None else self.next_check - self.step

  def _head(self) -> str:
    head = self._phase_head()
    if not self.skipped_steps:
      return head
    # "step 59" after 60 calls: say so where the step is named.
    calls = self.step + self.skipped_steps
    return head.replace(f"step {self.step}:", f"step {self.step} ({calls} calls, "
                        f"{self.skipped_steps} skipped, not counted):", 1)

  def _phase_head(self) -> str:
    if self.optimizer == "0/1 Adam":
      if self.frozen:
        return (f"step {self.step}: variance frozen after {self.variance_steps} variance "
                f"steps; last step {self.phase}, a sync every {self.local_interval} steps "
                f"({self.steps_since_sync} local steps since the last)")
      nxt = ("" if self.next_variance_step is None
             else f", next variance step {self.next_variance_step}")
      return (f"step {self.step}: last step {self.phase}; {self.variance_steps} variance "
              f"steps so far, one every {self.var_interval} steps now{nxt}")
    if self.phase == "compression":
      return f"step {self.step}: compression (froze after step {self.freeze_step})"
    return f"step {self.step}: warmup (never froze in {self.step} steps): {self.reason}"

  def __str__(self) -> str:
    if self.adam_bytes > 0:
      wire = (f"bytes/device so far {_fmt_bytes(self.bytes_sent)} vs "
              f"{_fmt_bytes(self.adam_bytes)} for Adam "
              f"(Adam / {self.optimizer} = {self.adam_bytes / max(self.bytes_sent, 1.0):.2f}x)"
              + ("" if self.bytes_exact else " (estimate)"))
    else:
      wire = "no communication (one device)"
    parts = [self._head()]
    if self.optimizer == "1-bit Adam":
      parts.append(f"variance ratio {self.variance_ratio:.3f}")
    parts += [f"{self.skipped_steps} non-finite steps skipped", wire]
    return "; ".join(parts) + "".join(f"\n  note: {n}" for n in self.notes)


def _fmt_bytes(x: float) -> str:
  for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if x >= size:
      return f"{x / size:.2f} {unit}"
  return f"{x:.0f} B"


# ------------------------------------------------------------------ reading the state


def _unwrap(x):
  """The array inside a Flax NNX variable (``get_value``; ``.value`` is deprecated), else ``x``.

  Containers (the tree-shaped ``mu``/``nu``, the ``local_momentum`` tuple) and
  ``None`` (a buffer the layout does not have) are returned as they are.
  """
  if x is None or isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, bool,
                                 jax.ShapeDtypeStruct, dict, list, tuple)):
    return x
  if hasattr(x, "get_value"):
    return x.get_value()
  return x


def _local_shape(x, stacked: bool) -> Optional[tuple]:
  """The shape one device holds: a ``pmap`` row, or one shard of a sharded array; None if absent."""
  x = _unwrap(x)
  if x is None:
    return None
  shape = tuple(np.shape(x))
  if stacked:
    return shape[1:]
  sharding = getattr(x, "sharding", None)
  if sharding is not None and hasattr(sharding, "shard_shape"):
    return tuple(sharding.shard_shape(shape))
  return shape


def _leaves(tree) -> list:
  """The arrays of a tree whose leaves may be NNX variables."""
  return [_unwrap(x) for x in jax.tree.leaves(
      tree, is_leaf=lambda x: not isinstance(x, (jax.Array, np.ndarray)) and hasattr(
          x, "get_value"))]


def _find(opt_state, kind) -> list:
  return [s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, kind))
          if isinstance(s, kind)]


def _replica_values(x, stacked: bool) -> list:
  """The value each replica holds: rows of a ``pmap`` state, or the shards of a replicated array."""
  x = _unwrap(x)
  if stacked:
    return list(np.asarray(x))
  if isinstance(x, jax.Array) and len(x.addressable_shards) > 1 and x.is_fully_replicated:
    return [np.asarray(shard.data) for shard in x.addressable_shards]
  return [np.asarray(x)]


def _agree(values) -> bool:
  return all(np.array_equal(values[0], v, equal_nan=values[0].dtype.kind == "f")
             for v in values[1:])


def _policy_and_b2(opt_state, freeze, b2, stacked):
  """The freeze policy and b2 to assume: given, else injected hyperparameters, else defaults."""
  injected = {}
  for inject_state in _find(opt_state, _INJECTED) if _INJECTED else ():
    for name in ("freeze", "b2"):
      if name in inject_state.hyperparams:
        injected[name] = _replica_values(inject_state.hyperparams[name], stacked)[0].item()
  assumed = freeze is None and "freeze" not in injected
  if freeze is None:
    freeze = injected.get("freeze")
  policy = _freeze.check_policy(_freeze.variance_ratio_freeze() if freeze is None else freeze)
  b2 = float(injected.get("b2", _DEFAULT_B2) if b2 is None else b2)
  return policy, b2, assumed


def _interval(policy, b2) -> int:
  return int(_freeze.policy_interval(policy, b2))


def _describe(policy, interval, b2) -> str:
  if isinstance(policy, _freeze.FixedStepFreeze):
    return f"fixed_step_freeze({int(policy.step)})"
  delta = f"{interval}" + (f" (the default for min_steps and b2 = {b2:g})"
                           if policy.interval is None else "")
  bound = f", max_steps={policy.max_steps}" if policy.max_steps is not None else ""
  return (f"variance_ratio_freeze(threshold={policy.threshold:g}, interval Δ = {delta}, "
          f"min_steps={policy.min_steps}{bound})")


# ------------------------------------------------------------------ the policy's schedule


def _next_check(policy, interval: int, step: int) -> int:
  """The first step after ``step`` at which ``policy`` may freeze."""
  if isinstance(policy, _freeze.FixedStepFreeze):
    return max(int(policy.step), step + 1)
  # A check at t = kΔ compares with t - Δ, so the first ratio exists at 2Δ.
  first = max(2 * interval, -(-policy.min_steps // interval) * interval)
  candidate = max(first, (step // interval + 1) * interval)
  if policy.max_steps is not None:
    candidate = min(candidate, max(policy.max_steps, step + 1))
  return candidate


def _warmup_reason(policy, interval, step, ratio, next_check) -> str:
  """Why a state still in warmup has not frozen, in one sentence."""
  if isinstance(policy, _freeze.FixedStepFreeze):
    return (f"fixed_step_freeze({int(policy.step)}) compresses from step "
            f"{int(policy.step) + 1}, {int(policy.step) - step} steps from now")
  first = max(2 * interval, -(-policy.min_steps // interval) * interval)
  low, high = policy.threshold, 1.0 / policy.threshold
  if step < first and math.isnan(ratio):
    reason = (f"the first variance-ratio check that can freeze is at step {first} "
              f"(2Δ = {2 * interval}" + (f", min_steps = {policy.min_steps}"
                                         if policy.min_steps > 2 * interval else "")
              + f"), and the run is at step {step}; a shorter run never compresses: "
              "pass variance_ratio_freeze(interval=..., max_steps=...) or fixed_step_freeze(k)")
  elif math.isnan(ratio):
    reason = ("the variance ratio is NaN: the variance is zero (no gradient yet) or the "
              "gradients were not finite")
  elif not low <= ratio <= high:
    reason = (f"last variance ratio {ratio:.3f} is outside [{low:.3f}, {high:.3f}]: the "
              f"variance still changes by {abs(1 - ratio):.0%} per {interval} steps")
  elif step < policy.min_steps:
    reason = (f"last variance ratio {ratio:.3f} is inside [{low:.3f}, {high:.3f}] but "
              f"min_steps={policy.min_steps} is not reached")
  else:
    reason = f"last variance ratio {ratio:.3f} is inside [{low:.3f}, {high:.3f}]"
  if policy.max_steps is not None:
    reason += f"; max_steps={policy.max_steps} freezes it at the latest at step {policy.max_steps}"
  else:
    reason += "; no max_steps bounds the warmup"
  return reason + f"; next chance at step {next_check}"


def _policy_mismatch(policy, interval, step, frozen, freeze_step) -> Optional[str]:
  """A sentence if the state could not have come from ``policy`` (the wrong one was passed)."""
  if isinstance(policy, _freeze.FixedStepFreeze):
    expected = int(policy.step)
    consistent = (freeze_step == expected) if frozen else step < expected
  elif frozen:
    consistent = (freeze_step % interval == 0 and freeze_step >= 2 * interval) or (
        freeze_step == policy.max_steps)
  else:
    consistent = policy.max_steps is None or step < policy.max_steps
  if consistent:
    return None
  return ("the state does not follow this freeze policy (pass the freeze= and b2= the "
          "optimizer was built with): the schedule above may be wrong")


# ------------------------------------------------------------------ bytes on the wire


class _Wire(NamedTuple):
  """The mesh and the per-step bytes of one device, read off the state's buffer shapes."""

  n_slow: int  # devices the 1-bit messages cross (the slow axis; the only one for a flat mesh).
  n_fast: int  # hierarchical: devices of the fast axis (float32 inside a node); else 1.
  warmup: float  # bytes of one warmup step (an all-reduce of the gradients).
  compression: float  # bytes of one compression step.
  params: int  # parameters this device holds (its model shard with a model axis).


def _wire(state, stacked: bool) -> _Wire:
  """Reads the mesh off the layout (see ``scale_by_onebit_adam``'s state).

  ``momentum_message`` is ``(n, row_bytes)`` on every device, ``n`` the data
  devices; hierarchical averaging (``worker_error`` present) keeps a worker
  error of ``padded // n_fast`` and a server error of ``padded // n`` elements,
  so ``n_slow`` is their ratio (1 without a server error). The shapes are read
  per device (a ``pmap`` row, a shard), so neither the leading device axis of
  a ``pmap`` state nor a model axis is taken for part of the data mesh.
  """
  message = _local_shape(state.momentum_message, stacked)
  n, row_bytes = int(message[-2]), int(message[-1])
  worker, server = (_local_shape(e, stacked) for e in (state.worker_error, state.server_error))
  params = int(sum(math.prod(_local_shape(v, stacked)) for v in _leaves(state.nu)))
  if worker is None:  # flat: every device is a server
    n_slow, n_fast, reduced = n, 1, params
  else:
    n_slow = 1 if server is None else int(worker[-1]) // int(server[-1])
    n_fast, reduced = n // n_slow, int(worker[-1])  # the slow links carry 1/fast of the buffer
  return _Wire(n_slow, n_fast, _collective.allreduce_wire_bytes(reduced, n_slow),
               2.0 * (n_slow - 1) * row_bytes, params)


def _bytes(fields, wire: _Wire, num_params: Optional[int]):
  """``(sent, adam, exact)``: bytes this device sent so far, Adam's, and whether both are exact.

  The state keeps only the last step's bytes; the rest follows from the phase
  lengths and the per-step bytes of each phase, which the layout fixes. Adam
  all-reduces the ``num_params`` float32 gradients (hierarchical: their
  ``1/n_fast`` slice over the slow axis, as 1-bit Adam's warmup does).
  """
  step, frozen, freeze_step, skipped = (
      fields[k] for k in ("count", "frozen", "freeze_step", "skipped_steps"))
  if wire.n_slow == 1:
    return 0.0, 0.0, True
  steps = step + skipped  # a skipped step still communicated.
  adam = steps * _collective.allreduce_wire_bytes(num_params / wire.n_fast, wire.n_slow)
  sent = fields.get("total_wire_bytes")
  exact = True
  if sent is None and not frozen:
    sent = steps * wire.warmup  # every step so far was the same all-reduce
  elif sent is None:
    # The phase of a skipped step is not recorded: charged at the 1-bit rate.
    sent = freeze_step * wire.warmup + (step - freeze_step + skipped) * wire.compression
    exact = skipped == 0
  return float(sent), float(adam), exact


def _num_params(params) -> Optional[int]:
  if params is None:
    return None
  return int(sum(math.prod(np.shape(x)) for x in _leaves(params)))


def _nonfinite_leaves(params) -> list:
  """Paths of the floating-point leaves of ``params`` holding a NaN or an inf (values only)."""
  bad = []
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    if isinstance(leaf, jax.ShapeDtypeStruct) or not hasattr(leaf, "dtype"):
      continue
    if jnp.issubdtype(leaf.dtype, jnp.inexact) and not bool(jnp.all(jnp.isfinite(leaf))):
      bad.append(jax.tree_util.keystr(path))
  return bad


def _params_notes(params) -> list:
  bad = _nonfinite_leaves(params) if params is not None else []
  if not bad:
    return []
  shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
  return [f"the parameters are not finite (NaN/inf in {len(bad)} leaves: {shown}): any step "
          "skipped after that is its consequence (gradients of NaN parameters are NaN), not "
          "its cause. 1-bit Adam's own output is bounded; look at what is applied after it: "
          "the learning rate (a schedule that returns NaN or inf at some step) or a "
          "transformation chained after onebit_adam, and restore the last good checkpoint"]


# ------------------------------------------------------------------ the summary


_FIELDS = ("count", "frozen", "freeze_step", "variance_ratio", "skipped_steps", "wire_bytes",
           "total_wire_bytes")


def status(opt_state, freeze: Any = None, *, b2: Optional[float] = None, params: Any = None,
           previous: Optional[Status] = None, var_freeze_step: Optional[int] = None):
  r"""A one-call summary of a 1-bit Adam or 0/1 Adam state for logging: phase, schedule, bytes, why not.

  Reads the state on the host (call it outside ``jit``, every few hundred steps
  or at the end of a run). Answers the question a log of losses does not: is
  the run compressing, and if not, why (e.g. *the first variance-ratio check
  is at step 2000, after the 400 steps of this run*, or *the last ratio 0.81 is
  outside [0.96, 1.04]*).

  The state does not record its freeze policy: pass the ``freeze=`` (and
  ``b2=``) the optimizer was built with. Without them the summary reads them
  from ``optax.inject_hyperparams``' state if it holds them, else assumes
  :func:`onebit_adam`'s defaults (``variance_ratio_freeze()``, ``b2 = 0.999``)
  and says so in ``notes``.

  Args:
    opt_state: an optimizer state containing exactly one
      :class:`ScaleByOnebitAdamState`: from ``optax.chain``,
      ``inject_hyperparams``, ``masked``, a ``flax.nnx.Optimizer``'s
      ``opt_state``, a ``shard_map`` state or a ``pmap`` state (leading device
      axis on every field).
    freeze: the ``freeze=`` given to :func:`onebit_adam` (None: its default).
    b2: the ``b2`` given to :func:`onebit_adam` (sets the default interval).
    params: optional, the parameters 1-bit Adam optimizes (or their shapes):
      checked against the state (a note if they differ) and, given values, for
      NaN/inf (a note that names the leaves: a NaN learning rate shows up
      here, not as a gradient problem). Not needed for the
      byte counts: the state's ``nu`` has the parameters' shapes, so Adam's
      bytes are exact without it.
    previous: the status of an earlier call: the notes then say how many of the
      steps since were skipped (a run that diverged skips every step).
    var_freeze_step: for a 0/1 Adam state only, the ``var_freeze_step`` of
      :func:`zero_one_adam` (the state does not record it): without it,
      whether :math:`v` is frozen is known only once a local or sync step
      has run.

  Returns:
    A :class:`Status` (``print`` it, or log ``status._asdict()``).

  For a 0/1 Adam state (:func:`zero_one_adam`) ``phase`` is the kind of the
  last step: a *variance* step averages the gradient in float32 and updates
  :math:`m` and :math:`v`; it falls on the counts divisible by the interval,
  which starts at 1 and doubles every ``var_update_scaler`` variance steps.
  Every other step before ``var_freeze_step`` is *compressed* (1-bit mean of
  the momenta). After it :math:`v` is frozen: *local* steps move no bytes and
  a *sync* step averages the accumulated update in 1 bit (every step without
  local steps). The bytes sent so far follow from the counts of variance and
  1-bit steps, which the state keeps.

  Example:
    >>> import jax, jax.numpy as jnp, onebit_optax
    >>> tx = onebit_optax.onebit_adam(1e-3, axis_name=None)
    >>> state = tx.init({'w': jnp.ones(2)})
    >>> s = onebit_optax.status(state, b2=0.999)
    >>> s.phase, s.next_check
    ('warmup', 2000)
    >>> tx = onebit_optax.zero_one_adam(1e-3, axis_name=None, var_freeze_step=10)
    >>> state = tx.init({'w': jnp.ones(2)})
    >>> for _ in range(3):
    ...   _, state = jax.jit(tx.update)({'w': jnp.ones(2)}, state, {'w': jnp.ones(2)})
    >>> s = onebit_optax.status(state, var_freeze_step=10)
    >>> s.phase, s.step, s.variance_steps, s.next_variance_step
    ('variance', 3, 3, 4)
  """
  found = _find(opt_state, ScaleByOnebitAdamState)
  if not found and _find(opt_state, ScaleByZeroOneAdamState):
    if freeze is not None or b2 is not None:
      raise ValueError(
          "status: this is a 0/1 Adam state: freeze= and b2= are 1-bit Adam's; pass "
          "var_freeze_step= (and params=, previous=) instead")
    return _zero_one_status(opt_state, var_freeze_step, params, previous)
  if var_freeze_step is not None:
    raise ValueError("status: var_freeze_step= is for a 0/1 Adam state; this state holds "
                     "1-bit Adam (pass freeze= and b2=)")
  if len(found) != 1:
    raise ValueError(
        f"status: expected exactly one 1-bit Adam state inside the optimizer state, found "
        f"{len(found)}. Pass the state of onebit_adam / scale_by_onebit_adam (possibly "
        "inside optax.chain, inject_hyperparams, masked, or an nnx.Optimizer's opt_state).")
  state = found[0]
  stacked = np.ndim(_unwrap(state.count)) == 1  # pmap: every field has the device axis.
  per_replica = {name: _replica_values(getattr(state, name), stacked)
                 for name in _FIELDS if hasattr(state, name)}
  agree = all(_agree(values) for values in per_replica.values())
  fields = {name: values[0].item() for name, values in per_replica.items()}
  step, frozen = int(fields["count"]), bool(fields["frozen"])
  freeze_step = int(fields["freeze_step"])
  ratio, skipped = float(fields["variance_ratio"]), int(fields["skipped_steps"])

  policy, b2, assumed = _policy_and_b2(opt_state, freeze, b2, stacked)
  interval = _interval(policy, b2)
  wire = _wire(state, stacked)
  sent, adam, exact = _bytes(fields, wire, wire.params)

  notes = []
  given = _num_params(params)
  held = _num_params(state.nu) // (np.shape(_unwrap(state.count))[0] if stacked else 1)
  if given is not None and given != held:
    notes.append(f"params= has {given} elements but the state was made for {held}: pass the "
                 "parameters this optimizer state belongs to")
  if assumed:
    notes.append("freeze policy not given: assumed onebit_adam's default "
                 "variance_ratio_freeze() with b2 = 0.999; pass freeze= and b2= to status")
  mismatch = _policy_mismatch(policy, interval, step, frozen, freeze_step)
  if mismatch:
    notes.append(mismatch)
  if not agree:
    notes.append("the replicas' counters differ: the devices are not running one optimizer "
                 "(under pmap / shard_map(check_vma=False), build onebit_adam with "
                 "axis_name=<the mapped axis>)")
  param_notes = _params_notes(params)
  notes.extend(param_notes)
  notes.extend(_skip_notes(step, skipped, previous, blame_gradients=not param_notes))
  if not exact:
    notes.append("bytes sent are an estimate: the skipped steps of a run that froze are "
                 "charged at the 1-bit rate (the state does not record their phase)")

  next_check = None if frozen else _next_check(policy, interval, step)
  return Status(
      phase="compression" if frozen else "warmup", step=step,
      freeze_step=freeze_step if frozen else None, next_check=next_check,
      variance_ratio=ratio, skipped_steps=skipped, bytes_sent=float(sent),
      adam_bytes=float(adam), bytes_exact=exact, replicas_agree=agree,
      policy=_describe(policy, interval, b2),
      reason="" if frozen else _warmup_reason(policy, interval, step, ratio, next_check),
      notes=tuple(notes), frozen=frozen, last_step_bytes=float(fields["wire_bytes"]))


# ------------------------------------------------------------------ 0/1 Adam's summary


_ZERO_ONE_FIELDS = ("count", "variance_updates", "var_interval", "local_interval", "since_sync",
                    "phase", "wire_bytes", "onebit_steps", "skipped_steps")


def _next_variance_step(step: int, interval: int, var_freeze_step: Optional[int],
                        frozen: Optional[bool]) -> Optional[int]:
  """The first count > step with count % interval == 0, if it is before the freeze."""
  if frozen:
    return None
  nxt = (step // interval + 1) * interval
  if var_freeze_step is not None and nxt > var_freeze_step:
    return None
  return nxt


def _zero_one_bytes(state, f: dict, stacked: bool):
  """``(sent, adam, exact)`` of a 0/1 Adam state, from its step counts and its layout."""
  from onebit_optax import _layout  # pylint: disable=g-import-not-at-top
  n = int(np.shape(_unwrap(state.worker_scale))[0])
  if n == 1:
    return 0.0, 0.0, True
  shapes = [_local_shape(v, stacked) for v in _leaves(state.nu)]
  params = int(sum(math.prod(x) for x in shapes))
  compressed = int(_local_shape(state.worker_scale, stacked)[-1])
  sizes = sorted((math.prod(x) for x in shapes), reverse=True)
  threshold = sizes[compressed - 1] if compressed else sizes[0] + 1
  layout = _layout.wire_layout_for([np.zeros(x, np.uint8) for x in shapes], n, max(threshold, 1))
  allreduce = _collective.allreduce_wire_bytes(params, n)
  onebit = 2.0 * (n - 1) * layout.row_bytes
  skipped = int(f["skipped_steps"])
  sent = int(f["variance_updates"]) * allreduce + (int(f["onebit_steps"]) + skipped) * onebit
  adam = (int(f["count"]) + skipped) * allreduce
  return float(sent), float(adam), skipped == 0


def _zero_one_status(opt_state, var_freeze_step: Optional[int], params, previous) -> Status:
  """:func:`status` of a 0/1 Adam state (the step kinds: see :func:`scale_by_zero_one_adam`)."""
  found = _find(opt_state, ScaleByZeroOneAdamState)
  if len(found) != 1:
    raise ValueError(
        f"status: expected exactly one 0/1 Adam state inside the optimizer state, found "
        f"{len(found)}. Pass the state of zero_one_adam / scale_by_zero_one_adam.")
  state = found[0]
  stacked = np.ndim(_unwrap(state.count)) == 1  # pmap: every field has the device axis.
  per_replica = {name: _replica_values(getattr(state, name), stacked)
                 for name in _ZERO_ONE_FIELDS}
  agree = all(_agree(values) for values in per_replica.values())
  f = {name: values[0].item() for name, values in per_replica.items()}
  step, skipped = int(f["count"]), int(f["skipped_steps"])
  phase = _zero_one_sharding.phase_name(f["phase"])
  frozen = (step > var_freeze_step if var_freeze_step is not None
            else (True if phase in ("local", "sync") else None))
  notes = []
  if frozen is None:
    notes.append("var_freeze_step not given: pass the one zero_one_adam was built with to "
                 "know when the variance freezes")
  if not agree:
    notes.append("the replicas' counters differ: the devices are not running one optimizer "
                 "(build zero_one_adam with axis_name=<the mapped axis>)")
  param_notes = _params_notes(params)
  notes.extend(param_notes)
  notes.extend(_skip_notes(step, skipped, previous, blame_gradients=not param_notes))
  sent, adam, exact = _zero_one_bytes(state, f, stacked)
  return Status(
      phase=phase, step=step, freeze_step=var_freeze_step if frozen else None,
      next_check=None, variance_ratio=float("nan"), skipped_steps=skipped,
      bytes_sent=sent, adam_bytes=adam, bytes_exact=exact, replicas_agree=agree,
      policy="" if var_freeze_step is None else f"var_freeze_step={var_freeze_step}",
      reason="", notes=tuple(notes), optimizer="0/1 Adam", frozen=frozen,
      variance_steps=int(f["variance_updates"]), var_interval=int(f["var_interval"]),
      next_variance_step=_next_variance_step(step, int(f["var_interval"]), var_freeze_step,
                                             frozen),
      local_interval=int(f["local_interval"]), steps_since_sync=int(f["since_sync"]),
      last_step_bytes=float(f["wire_bytes"]))


def _skip_notes(step, skipped, previous, blame_gradients: bool = True) -> list:
  notes = []
  if skipped:
    notes.append(f"{skipped} of {step + skipped} steps were skipped for non-finite "
                 "gradients (all devices together)"
                 + ("" if blame_gradients else " because the parameters are not finite"))
  if previous is not None:
    new_steps = step + skipped - previous.step - previous.skipped_steps
    new_skips = skipped - previous.skipped_steps
    if new_steps > 0 and new_skips == new_steps and blame_gradients:
      notes.append(f"every one of the last {new_steps} steps was skipped: the gradients are "
                   "not finite any more, the run has diverged (lower the learning rate, "
                   "clip, or freeze later; pass params= to see whether the parameters "
                   "themselves went NaN)")
    elif new_skips > 0:
      notes.append(f"{new_skips} of the last {new_steps} steps were skipped")
  return notes


# ------------------------------------------------------------------ replica identity


def _words(x) -> jax.Array:
  """The bits of ``x`` as a flat uint32 vector (bit-exact: NaNs and -0.0 included)."""
  x = jnp.ravel(jnp.asarray(x))
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    x = jnp.stack([x.real, x.imag], -1).ravel()
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
  return jax.lax.bitcast_convert_type(x, unsigned).ravel().astype(jnp.uint32)


def _fingerprint(leaves) -> jax.Array:
  """Two wrapping uint32 sums per leaf, the second position-weighted: (leaves, 2) int32."""
  rows = []
  for leaf in leaves:
    words = _words(leaf)
    odd = (2 * jnp.arange(words.size, dtype=jnp.uint32) + 1)
    rows.append(jnp.stack([jnp.sum(words, dtype=jnp.uint32),
                           jnp.sum(words * odd, dtype=jnp.uint32)]))
  if not rows:
    return jnp.zeros((0, 2), jnp.int32)
  return jax.lax.bitcast_convert_type(jnp.stack(rows), jnp.int32)


def replicas_identical(tree, axis_name: Hashable) -> jax.Array:
  """Inside ``shard_map``/``pmap``: True iff every device along ``axis_name`` holds the same bits.

  For a training loop that must keep its replicas identical (the parameters,
  the optimizer's moments): one pass over ``tree`` on each device (two sums
  per leaf) and one all-reduce of ``2 x leaves`` int32 values; run it every N
  steps under ``lax.cond`` on the step count, or log it. Bit-exact: any
  difference in any element shows (up to a 2^-64 chance of a collision of both
  sums).

  Under ``shard_map`` with ``check_vma=True`` the values are cast to varying
  first, so JAX cannot assume that replicated values are equal and skip the
  comparison. Pass only values that should be replicated (not the per-device
  error buffers).

  Args:
    tree: a pytree of arrays that should be equal on every device.
    axis_name: the mapped axis (of ``shard_map`` or ``pmap``).

  Returns:
    A bool scalar, the same on every device (replicated).

  Example:
    >>> import functools, jax, jax.numpy as jnp, onebit_optax
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ('data',))
    >>> @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(), out_specs=P())
    ... def check(params):
    ...   return onebit_optax.replicas_identical(params, 'data')
    >>> bool(check({'w': jnp.ones(3)}))
    True
  """
  fingerprint = _fingerprint(jax.tree.leaves(tree))
  if axis_name not in _collective._varying_axes(fingerprint):
    try:
      fingerprint = jax.lax.pcast(fingerprint, axis_name, to="varying")
    except (ValueError, TypeError):  # pmap or check_vma=False: nothing to cast
      pass
  # max(x) == min(x) with one collective: min(x) = ~max(~x) on two's complement ints.
  both = jax.lax.pmax(jnp.concatenate([fingerprint, ~fingerprint]), axis_name)
  rows = fingerprint.shape[0]
  return jnp.all(both[:rows] == ~both[rows:])


_fingerprint_jit = jax.jit(_fingerprint)


def _check_something_replicated(leaves, stacked: bool) -> None:
  """Nothing to compare although the arrays span several devices: a pmap output without ``stacked``."""
  spread = [path for path, leaf in leaves if isinstance(_unwrap(leaf), jax.Array)
            and len(_unwrap(leaf).addressable_shards) > 1]
  if spread and not stacked:
    raise ValueError(
        f"assert_replicas_identical: none of the {len(spread)} arrays on several devices is "
        f"replicated (e.g. {jax.tree_util.keystr(spread[0]) or '<root>'}: every device holds "
        "another slice), so nothing could be compared. For the outputs of jax.pmap (a "
        "leading device axis) pass stacked=True; for sharded arrays there are no replicas.")


def assert_replicas_identical(tree, *, stacked: bool = False) -> int:
  """On the host: raises if the devices hold different copies of replicated arrays.

  Each replicated ``jax.Array`` of ``tree`` (e.g. params returned by a
  ``shard_map`` step with ``out_specs=P()``) keeps one buffer per device, and
  reading it shows device 0's. Under ``pmap`` or ``shard_map(check_vma=False)``
  nothing forces the buffers to be equal: a training loop whose devices each
  run their own optimizer (``axis_name=None``) diverges silently. This compares
  them: a fingerprint of each device's buffers is computed on that device, and
  only two int32 per leaf per device come back to the host.

  Args:
    tree: a pytree of ``jax.Array``. Shards with the same index (replicas) are
      compared; other leaves are ignored.
    stacked: the leading axis of every leaf is the replica axis (``pmap``
      outputs): all shards (rows) are compared with each other.

  Returns:
    The number of leaves that were compared on more than one device.

  Raises:
    AssertionError: naming the leaves and devices that differ.
    ValueError: arrays span several devices but none is replicated (a ``pmap``
      output passed without ``stacked=True``): nothing would be compared.

  Example:
    >>> import jax, jax.numpy as jnp, onebit_optax
    >>> onebit_optax.assert_replicas_identical({'w': jnp.ones(3)})  # one device: nothing to compare
    0
  """
  leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: not isinstance(
      x, (jax.Array, np.ndarray)) and hasattr(x, "get_value"))
  groups = []  # (leaf number, path, [shards]) with shards that must hold the same bits.
  for number, (path, leaf) in enumerate(leaves):
    leaf = _unwrap(leaf)
    if not isinstance(leaf, jax.Array):
      continue
    by_index = {}
    for shard in leaf.addressable_shards:
      key = None if stacked else str(shard.index)
      by_index.setdefault(key, []).append(shard)
    groups.extend((number, path, shards) for shards in by_index.values() if len(shards) > 1)
  if not groups:
    _check_something_replicated(leaves, stacked)
  per_device = {}  # one fingerprint call per device over all its shards.
  for g, (_, _, shards) in enumerate(groups):
    for s in shards:
      per_device.setdefault(s.device, []).append((g, s.data))
  fingerprints = {}
  for device, items in per_device.items():
    rows = np.asarray(_fingerprint_jit([data for _, data in items]))
    for (g, _), row in zip(items, rows):
      fingerprints.setdefault(g, []).append((device, row))
  differing = []
  for g, (_, path, _) in enumerate(groups):
    first_device, first = fingerprints[g][0]
    bad = [str(d.id) for d, row in fingerprints[g][1:] if not np.array_equal(row, first)]
    if bad:
      differing.append(f"{jax.tree_util.keystr(path) or '<root>'}: devices {', '.join(bad)} "
                       f"differ from device {first_device.id}")
  if differing:
    raise AssertionError(
        "the replicas differ (each device holds its own values):\n  "
        + "\n  ".join(differing) + "\nThe devices are not running one optimizer: under pmap "
        "or shard_map(check_vma=False), build onebit_adam with axis_name=<the mapped axis>, "
        "and average anything else you update with lax.pmean.")
  return len({number for number, _, _ in groups})
