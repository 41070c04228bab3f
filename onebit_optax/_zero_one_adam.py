"""0/1 Adam (Lu et al., 2023): the state, the schedule of its steps, the transformation and the alias."""

from __future__ import annotations

from typing import Any, Hashable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from optax._src import numerics

from onebit_optax import _collective
from onebit_optax import _groups
from onebit_optax import _guards
from onebit_optax import _layout
from onebit_optax import _zero_one_steps as _steps

__all__ = ["ScaleByZeroOneAdamState", "scale_by_zero_one_adam", "zero_one_adam"]

F32 = jnp.float32
VARIANCE_EMAS = ("per_update", "per_step")
_CALLER = "scale_by_zero_one_adam"


class ScaleByZeroOneAdamState(NamedTuple):
  """State for :func:`scale_by_zero_one_adam`.

  ``mu`` and ``nu`` are shaped like the parameters and replicated. Per device
  (leading axis 1 inside ``shard_map``/``pmap``; shard them with
  ``P(axis_name)``, see :func:`state_partition_specs`): ``local_sent``,
  ``worker_scale``, ``server_error`` and, with local steps, ``local_mu`` and
  ``accumulator``. Everything else is replicated. After a compressed step
  :math:`m` is ``momentum_message``, the 1-bit mean exactly as it went over
  the wire (as in 1-bit Adam: no full-size write of :math:`m`), and ``mu``
  holds it again from the next step of another kind (:func:`onebit_optax.moments`
  shows :math:`m` in both cases). Memory per device: :math:`3D + D/n + D/32`
  floats without local steps, :math:`5D + D/n + D/32` with them
  (:func:`optax.adam`: :math:`2D`).

  Example:
    >>> import jax.numpy as jnp, onebit_optax
    >>> tx = onebit_optax.scale_by_zero_one_adam(axis_name=None, var_freeze_step=100)
    >>> state = tx.init({'w': jnp.ones(300)})
    >>> state.mu['w'].shape, state.local_sent[0].shape, onebit_optax.status(state).phase
    ((300,), (1, 1, 300), 'none')

  References:
    Lu et al., `Maximizing Communication Efficiency for Large-scale Training via
    0/1 Adam <https://arxiv.org/abs/2202.06009>`_, ICLR 2023, Algorithm 1.
  """

  count: jax.Array  # shape=(), dtype=int32: steps taken (a skipped variance or compressed step is not counted).
  mu: Any  # tree like params, float32, replicated: first moment (with local steps: the last synced one); stale while mu_in_message.
  nu: Any  # tree like params, float32, replicated: second moment, raw; changes on variance steps only.
  nu_l1: jax.Array  # shape=(num_leaves,), dtype=float32: sum of nu over each leaf (the variance floor's reference).
  variance_updates: jax.Array  # shape=(), dtype=int32: variance steps taken (nu's bias correction).
  var_interval: jax.Array  # shape=(), dtype=int32: a variance step falls on count % var_interval == 0 (1, 2, 4, ...).
  var_counter: jax.Array  # shape=(), dtype=int32: variance steps since var_interval last doubled.
  variance_step: jax.Array  # shape=(), dtype=int32: the count of the last variance step (0: none yet).
  local_sent: tuple  # per group of compressed leaves of one shape: shape=(1, leaves, *shape), float32, per device: what it compressed last.
  worker_scale: jax.Array  # shape=(1, compressed leaves), float32, per device: the scale of each leaf of local_sent, group after group.
  server_error: Any  # shape=(1, chunk), float32, per device: its residual as server of one chunk; None on one device.
  local_mu: Any  # local steps: tree of (1, *leaf shape), float32, per device: this device's momentum; else None.
  accumulator: Any  # local steps: tree of (1, *leaf shape), float32, per device: its progress since the sync; else None.
  lr_sum: jax.Array  # shape=(), dtype=float32: sum of the learning rates since the last sync.
  local_interval: jax.Array  # shape=(), dtype=int32: steps between syncs (1, doubling, at most H).
  local_counter: jax.Array  # shape=(), dtype=int32: local-phase steps since local_interval last doubled.
  since_sync: jax.Array  # shape=(), dtype=int32: local steps since the last sync.
  phase: jax.Array  # shape=(), dtype=int32: the last step: 0 variance, 1 compressed, 2 local, 3 sync; -1 none.
  momentum_message: jax.Array  # shape=(n, row_bytes), dtype=uint8, replicated: m as the last compressed step's 1-bit mean.
  mu_in_message: jax.Array  # shape=(), dtype=bool: m lives in momentum_message (compressed steps), else in mu.
  wire_bytes: jax.Array  # shape=(), dtype=float32: bytes this device sent in the last step.
  onebit_steps: jax.Array  # shape=(), dtype=int32: steps taken that sent the 1-bit exchange (compressed, sync).
  skipped_steps: jax.Array  # shape=(), dtype=int32: steps skipped (on all devices together) as non-finite.


def _check_static(var_freeze_step, var_update_scaler, local_steps, local_step_scaler,
                  learning_rate, variance_ema, **nonnegative) -> Optional[int]:
  """Refuses values that cannot work, where they are known (the checks 1-bit Adam uses); returns H."""
  if variance_ema not in VARIANCE_EMAS:
    raise ValueError(f"{_CALLER}: variance_ema={variance_ema!r} must be one of {VARIANCE_EMAS}.")
  _guards.check_step_counts(_CALLER, var_freeze_step=var_freeze_step,
                            var_update_scaler=var_update_scaler,
                            local_step_scaler=local_step_scaler)
  _guards.check_nonnegative(_CALLER, **nonnegative)
  if local_steps is None:
    if learning_rate is not None:
      raise ValueError(
          f"{_CALLER}: learning_rate is an argument of the transformation only with local "
          "steps (the sync divides by the sum of the learning rates); without them chain "
          "optax.scale_by_learning_rate, as zero_one_adam does.")
    return None
  local_steps = _guards.static_int(
      local_steps, "local_steps", _CALLER, low=1,
      why="or None: the largest number of steps between two syncs")
  if learning_rate is None:
    raise ValueError(
        f"{_CALLER}: with local_steps, pass learning_rate= (a scalar or a schedule): each "
        "device applies its own steps and the sync rebuilds the momentum from their sum.")
  _guards.check_learning_rate(learning_rate, _CALLER)
  return local_steps


def _plan(tree, axis_name, exact_below: int, caller: str) -> _steps.Plan:
  if isinstance(axis_name, tuple) and len(axis_name) > 1:
    raise ValueError(
        f"{caller}: axis_name={axis_name!r}: hierarchical averaging is not implemented for "
        "0/1 Adam yet; give the one data-parallel axis.")
  return _groups.plan(tree, _collective.resolve_axes(axis_name, None, caller=caller), exact_below)


def _buffer_shapes(plan: _steps.Plan) -> dict:
  """The shapes of the buffers that follow the mesh (None: the buffer does not exist)."""
  layout, axes = plan.layout, plan.axes
  return dict(
      local_sent=tuple((1, len(span)) + tuple(layout.group_shape(g))
                       for g, span in enumerate(layout.groups)),
      worker_scale=(1, len(layout.compressed)),
      server_error=(1, layout.bits.chunk) if axes.n_slow > 1 else None,
      momentum_message=(axes.num_devices, layout.row_bytes))


def _init(params, plan: _steps.Plan, local: bool) -> ScaleByZeroOneAdamState:
  vary = lambda x: _collective.vary(x, plan.axes.device_axes)
  leaves = jax.tree.leaves(params)
  tree = lambda make: jax.tree.unflatten(plan.treedef, [make(jnp.shape(p)) for p in leaves])
  per_device = lambda: tree(lambda s: vary(jnp.zeros((1,) + s, F32))) if local else None
  scalar = lambda value, dtype=jnp.int32: jnp.full([], value, dtype)
  shapes = _buffer_shapes(plan)
  return ScaleByZeroOneAdamState(
      count=scalar(0), mu=tree(lambda s: jnp.zeros(s, F32)), nu=tree(lambda s: jnp.zeros(s, F32)),
      nu_l1=jnp.zeros((len(leaves),), F32), variance_updates=scalar(0), var_interval=scalar(1),
      var_counter=scalar(0), variance_step=scalar(0),
      local_sent=tuple(vary(jnp.zeros(shape, F32)) for shape in shapes["local_sent"]),
      worker_scale=vary(jnp.zeros(shapes["worker_scale"], F32)),
      server_error=(None if shapes["server_error"] is None
                    else vary(jnp.zeros(shapes["server_error"], F32))),
      local_mu=per_device(), accumulator=per_device(), lr_sum=scalar(0.0, F32),
      local_interval=scalar(1), local_counter=scalar(0), since_sync=scalar(0),
      phase=scalar(_steps.NO_STEP),
      momentum_message=jnp.zeros(shapes["momentum_message"], jnp.uint8),
      mu_in_message=scalar(False, jnp.bool_), wire_bytes=scalar(0.0, F32),
      onebit_steps=scalar(0), skipped_steps=scalar(0))


def _schedule(hp: _steps.Hyper, state: ScaleByZeroOneAdamState) -> _steps.Schedule:
  """This step's kind, from the replicated counters (DeepSpeed's rule, see the docstring)."""
  count = numerics.safe_increment(state.count)
  frozen = count > hp.var_freeze_step
  is_var = jnp.logical_not(frozen) & (count % state.var_interval == 0)
  kind = jnp.where(is_var, _steps.VARIANCE, _steps.COMPRESSED)
  kind = jnp.where(frozen, _steps.LOCAL, kind).astype(jnp.int32)
  fresh = frozen & (state.phase < _steps.LOCAL)
  if hp.local_steps is None:  # after the freeze every step is a sync of one step: a compressed step
    kind = jnp.where(frozen, _steps.COMPRESSED, kind).astype(jnp.int32)
    return _steps.Schedule(kind, frozen, fresh, count, jnp.float32(1))
  lr = hp.learning_rate(state.count) if callable(hp.learning_rate) else hp.learning_rate
  return _steps.Schedule(kind, frozen & (state.since_sync + 1 >= state.local_interval), fresh,
                         count, jnp.asarray(lr, F32))


def _doubled(counter, interval, scaler, cap=None):
  """DeepSpeed's interval rule: after ``scaler`` counted steps the interval doubles (up to ``cap``)."""
  counter = counter + 1
  double = counter >= scaler
  interval = jnp.where(double, 2 * interval, interval)
  if cap is not None:
    interval = jnp.minimum(interval, cap)
  return jnp.where(double, 0, counter).astype(jnp.int32), interval.astype(jnp.int32)


def _next_state(hp, plan, state, sched: _steps.Schedule, res: _steps.Result):
  """The new state: a skipped step keeps everything but the counters of skips (and drops the error feedback)."""
  is_local = sched.kind == _steps.LOCAL
  # A non-finite sync drops the interval's local steps, which were taken: the count goes on.
  advance = res.finite | (is_local & (hp.local_steps is not None))
  is_var = (sched.kind == _steps.VARIANCE) & res.finite
  var_counter, var_interval = _doubled(state.var_counter, state.var_interval, hp.var_update_scaler)
  unflatten = lambda leaves: None if leaves is None else jax.tree.unflatten(plan.treedef, leaves)
  new = state._replace(
      count=jnp.where(advance, sched.count, state.count), mu=unflatten(res.mu),
      nu=unflatten(res.nu), nu_l1=res.nu_l1,
      variance_updates=state.variance_updates + is_var.astype(jnp.int32),
      var_interval=jnp.where(is_var, var_interval, state.var_interval),
      var_counter=jnp.where(is_var, var_counter, state.var_counter),
      variance_step=jnp.where(is_var, sched.count, state.variance_step),
      local_sent=res.local_sent, worker_scale=res.worker_scale, server_error=res.server_error,
      local_mu=unflatten(res.local_mu), accumulator=unflatten(res.accumulator),
      momentum_message=res.message, mu_in_message=res.mu_in_message,
      phase=jnp.where(advance, jnp.where(sched.sync, _steps.SYNC, sched.kind),
                      state.phase).astype(jnp.int32),
      wire_bytes=res.wire_bytes,
      onebit_steps=state.onebit_steps + (
          advance & ((sched.kind == _steps.COMPRESSED) | sched.sync)).astype(jnp.int32),
      skipped_steps=state.skipped_steps + jnp.logical_not(res.finite).astype(jnp.int32))
  if hp.local_steps is None:
    return new
  local_counter, local_interval = _doubled(state.local_counter, state.local_interval,
                                           hp.local_step_scaler, hp.local_steps)
  pick = lambda value, old: jnp.where(is_local, value, old)
  return new._replace(
      lr_sum=pick(jnp.where(sched.sync, 0.0, state.lr_sum + sched.lr), state.lr_sum),
      local_counter=pick(local_counter, state.local_counter),
      local_interval=pick(local_interval, state.local_interval),
      since_sync=pick(jnp.where(sched.sync, 0, state.since_sync + 1), state.since_sync))


def _decay_flags(mask, params, treedef) -> tuple:
  """Per leaf, whether it gets weight decay (``mask`` as in :func:`optax.adamw`: a tree or a prefix)."""
  if mask is None:
    return ()
  tree = mask(params) if callable(mask) else mask
  full = jax.tree.map(lambda m, sub: jax.tree.map(lambda _: bool(m), sub), tree, params)
  return tuple(treedef.flatten_up_to(full))


def _update(updates, state, params, hp: _steps.Hyper, axis_name):
  plan = _check_update(updates, state, params, hp, axis_name)
  if _guards._known(hp.weight_decay) == 0.0:  # no decay term: the step need not read params for it
    plan = plan._replace(decay=(False,) * plan.treedef.num_leaves)
  elif hp.mask is not None and params is not None:
    plan = plan._replace(decay=_decay_flags(hp.mask, params, plan.treedef))
  grads = jax.tree.leaves(updates)
  params = None if params is None else jax.tree.leaves(params)
  sched = _schedule(hp, state)
  res = _steps.step(hp, plan, grads, state, sched, params)
  out = [u.astype(g.dtype) for u, g in zip(res.updates, grads)]
  return jax.tree.unflatten(plan.treedef, out), _next_state(hp, plan, state, sched, res)


def _check_layout(updates, state, plan: _steps.Plan, caller: str) -> None:
  """The state belongs to these parameters on this mesh, and arrived sharded per device."""
  _guards.check_state_layout(state, plan.axes.data, plan.axes.num_devices, caller,
                             "local_sent, worker_scale, server_error, local_mu, accumulator")
  _guards.check_same_tree(updates, state.nu, caller)
  _guards.check_buffers(state, _buffer_shapes(plan), plan.axes.num_devices, caller)


def _check_types(updates, params, hp: _steps.Hyper, plan: _steps.Plan, state, caller) -> None:
  """Under shard_map's type check: local gradients, and (local steps) replicated parameters."""
  _guards.check_local_gradients(updates, state.worker_scale, plan.axes.data, caller,
                                f"onebit_optax.local_params(params, {plan.axes.data!r}, opt_state)")
  names = _collective.axis_names(plan.axes.data)
  if hp.local_steps is None or params is None:
    return
  if any(n in _collective._varying_axes(p) for n in names for p in jax.tree.leaves(params)):
    raise ValueError(
        f"{caller}: with local steps pass the replicated parameters as params= (the point "
        "of the last sync), not each device's copy: the optimizer holds each device's "
        "progress itself (local_params(params, axis_name, opt_state) gives the copy to differentiate at), and "
        "per-device params would drift apart with nothing to bring them back.")


def _check_update(updates, state, params, hp, axis_name) -> _steps.Plan:
  caller = f"{_CALLER}.update"
  if not isinstance(state, ScaleByZeroOneAdamState):
    raise TypeError(f"{caller} got a {type(state).__name__}; pass the state its init returned.")
  _guards.check_float_params(updates, caller)
  _guards.check_wrappers(axis_name, caller)
  _guards.check_mapped_region(axis_name, caller)
  plan = _plan(updates, axis_name, hp.exact_below, caller)
  _check_layout(updates, state, plan, caller)
  _check_types(updates, params, hp, plan, state, caller)
  if params is None and _guards._known(hp.weight_decay) != 0.0:
    raise ValueError(f"{caller}: weight_decay needs params= in update.")
  return plan


def scale_by_zero_one_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    axis_name: Optional[Hashable],
    var_freeze_step: int,
    var_update_scaler: int = 4,
    local_steps: Optional[int] = None,
    local_step_scaler: int = 32,
    learning_rate: Optional[optax.ScalarOrSchedule] = None,
    weight_decay: float = 0.0,
    mask: Any = None,
    variance_floor: float = 0.01,
    max_update: Optional[float] = None,
    skip_nonfinite: bool = True,
    exact_below: Optional[int] = None,
    variance_ema: str = "per_update",
) -> optax.GradientTransformationExtraArgs:
  r"""Rescales local gradients by 0/1 Adam, averaging them across ``axis_name``.

  Feed it each device's *local* gradient :math:`g_i`. Step :math:`t` (from 1) is
  one of three kinds, chosen from replicated counters (all devices agree; only
  the chosen branch's collectives run):

  **Variance step** (:math:`t \le T_v` = ``var_freeze_step`` and
  :math:`t \bmod I = 0`): the float32 mean gradient :math:`\bar g` (one
  all-reduce) updates both moments, and the step is Adam's:

  .. math::

    m \leftarrow \beta_1 m + (1-\beta_1)\bar g, \quad
    v \leftarrow \beta_2 v + (1-\beta_2)\bar g^2, \quad
    d_t = \frac{m/(1-\beta_1^t)}{\sqrt{v/(1-\beta_2^k)} + \epsilon},

  with :math:`k` the number of variance steps so far (:math:`v`'s own bias
  correction: while every step is a variance step this is
  :func:`optax.scale_by_adam`). Once a compressed step has come before, the
  variance step's :math:`d_t` is floored and clipped as the compressed step's
  below: :math:`m` then holds signs at their leaf's scale, which no longer
  match :math:`v` coordinate by coordinate (unbounded, the first variance step
  after compressed ones blew up the digits MLP of
  ``benchmarks/zero_one_volume.py``). The interval :math:`I` starts at 1 and doubles
  after every ``var_update_scaler`` (:math:`\kappa`) variance steps
  (DeepSpeed's rule; :math:`\kappa` = 4: steps 1-4, 6, 8, 10, 12, 16, 20, ...).
  With ``variance_ema='per_step'`` a variance step :math:`\Delta` steps after
  the previous one decays :math:`v` by :math:`\beta_2^{\Delta}` instead,
  :math:`v \leftarrow \beta_2^{\Delta} v + (1-\beta_2^{\Delta})\bar g^2`,
  bias-corrected by :math:`1-\beta_2^{t_k}` (:math:`t_k` the last variance
  step): the weights Adam would give the gradients of those steps, had they
  all been :math:`\bar g`. With DeepSpeed's EMA the variance steps after a
  change of the data carry little weight once they are sparse (the char GPT of
  ``benchmarks/data_shift.py``: 15% of :math:`v` after 1000 steps of the new
  data).

  **Compressed step** (every other step): each device's *momentum* goes
  through the error-compensated 1-bit mean (one uint8 ``all_to_all`` and one
  uint8 ``all_gather``; each device scales each leaf by its RMS, each server
  each piece of a leaf in its chunk; leaves smaller than ``exact_below``
  exact), as in 1-bit Adam's compression phase, and only
  :math:`m` moves:

  .. math::

    m \leftarrow \mathrm{compressed\_mean}_i\big(\beta_1 m + (1-\beta_1) g_i + e_i\big), \quad
    d_t = \mathrm{clip}\Big(\frac{m/(1-\beta_1^t)}{\sqrt{\max(\hat v, f\,\overline{\hat v}_\ell)}+\epsilon}, \pm B\Big),

  :math:`v` held fixed, so the update is linear in the momentum between two
  variance steps and the error feedback :math:`e_i` cancels. DeepSpeed
  compresses the gradient here (:math:`m \leftarrow \beta_1 m +
  (1-\beta_1)\,\mathrm{compressed\_mean}_i(g_i + e_i)`); sign compression of
  the raw gradients, whose signs disagree across devices, is not contractive
  and cost the char GPT of ``benchmarks/convergence.py`` with :math:`T_v` = the
  whole run (every step variance or compressed) +8.0% validation loss against
  AdamW, the momentum +1.5% (3 seeds; CHANGELOG). The floor
  :math:`f` = ``variance_floor`` (relative to the mean of the coordinate's
  leaf) and the clip :math:`B` = ``max_update`` (default: Adam's own bound,
  :func:`adam_update_bound`) keep a coordinate with a tiny :math:`v` from
  multiplying the sign noise (as in :func:`scale_by_onebit_adam`); a coordinate
  with :math:`v = 0` stays put.

  **After** :math:`T_v` (:math:`v` frozen), without local steps, every step is
  a **sync** of one step (DeepSpeed's local steps at interval 1): each
  device's momentum :math:`\beta_1 m + (1-\beta_1) g_i` goes through the 1-bit
  mean with error feedback and :math:`m` is the mean, :math:`v` held: the
  compressed step's formulas and program (1-bit Adam's compression phase),
  which ``status`` reports as ``'sync'``. This compresses the momentum, as
  1-bit Adam does after its freeze: on the digits MLP, compressing the
  gradient for the rest of the run from an early freeze (T_v = 15 of 300, the
  first version of this code) cost +28% held-out loss against AdamW (3
  seeds), syncs -1.9 ± 7.2% (6 seeds, within their spread;
  ``benchmarks/results/zero_one_volume.md``; measured with the earlier sync,
  which sent each device's progress and gave the same loss as this one within
  the seeds' standard errors on the convergence benchmark's three tasks,
  ``benchmarks/results/zero_one_ab_sync.md``). The error feedback restarts at
  the first of them: carried over from the compressed steps (whose momentum
  the variance steps overwrote in between) it cost the char GPT of
  ``benchmarks/convergence.py`` +5% validation loss (CHANGELOG).

  **Local steps** (``local_steps=H``, after :math:`T_v`): each device runs its
  own Adam step on its own copy of the parameters,
  :math:`\theta_i = \theta + a_i`, with no communication:

  .. math::

    m_i \leftarrow \beta_1 m_i + (1-\beta_1) g_i, \quad
    a_i \leftarrow a_i - \eta_t (d_{i,t} + \lambda\theta_i),

  and a **sync** when the steps since the last sync reach :math:`J` (counted
  from the last sync; DeepSpeed tests :math:`t \bmod J = 0`): :math:`\bar a` =
  the 1-bit mean of :math:`a_i\delta` (with error feedback,
  :math:`\delta = \sqrt{\max(\hat v, f\,\overline{\hat v}_\ell)}+\epsilon` the
  floored denominator), :math:`\theta \leftarrow \theta +
  \mathrm{clip}(\bar a/\delta, \pm B\textstyle\sum\eta)` (the weight decay's
  share :math:`-\lambda\theta\sum\eta` kept out of the clip; a coordinate
  whose :math:`v` is 0 does not move, weight decay included),
  :math:`m \leftarrow (1-\beta_1^t)\big(-\bar a/\sum\eta - \lambda\theta\delta\big)`,
  :math:`a_i \leftarrow 0` (DeepSpeed's sync, except that the weight decay's
  share of :math:`\bar a` is kept out of the momentum: DeepSpeed's momentum
  re-applies it on every later step, which cost 37% held-out loss on the
  digits MLP with a sync every step). :math:`J` starts at 1 and doubles every
  ``local_step_scaler`` local-phase steps up to :math:`H`. The parameters
  ``params`` stay replicated (the update is 0 on local steps and the synced
  move on a sync, identical bits on every device); differentiate at
  :func:`local_params` (with ``opt_state``), this device's :math:`\theta_i`. The learning
  rate is part of the sync, so with local steps it is an argument here and the
  output is the parameter update itself. A local step at step :math:`t`
  (from 1) uses ``learning_rate(t - 1)``, optax's ``schedule(count)``
  convention, and :math:`d_{i,t}` is floored but not clipped.

  **Non-finite gradients** skip a variance, compressed or (without local
  steps) sync step on every device together (zero update, state kept but the
  error feedback of a compressed step or sync, which restarts from zero as 1-bit
  Adam's does, ``skipped_steps`` + 1; the flag is read off the
  replicated mean, no extra collective). A local step cannot know
  (no communication): a non-finite value reaches the next sync, which then
  drops the whole interval on every device (parameters kept, accumulators and
  momenta restart from the last sync).

  What the parameters do to volume and loss (per device, :math:`D` parameters,
  :math:`n` devices): a variance step sends :math:`8D(n-1)/n` bytes (Adam's
  all-reduce), a compressed step or sync about :math:`D(n-1)/(4n)` (1/32), a
  local step nothing. With :math:`T_v` steps before the freeze about
  :math:`\kappa\log_2(T_v/\kappa)` of them are variance steps: a larger
  :math:`\kappa` or :math:`T_v` refreshes :math:`v` more often (closer to Adam,
  more float32 rounds). :math:`H` divides the rounds after :math:`T_v` by up
  to :math:`H` at the cost of replicas drifting between syncs;
  ``local_step_scaler`` sets how fast :math:`J` reaches :math:`H`.

  Defaults, from ``benchmarks/convergence.py`` (the char GPT, the BERT-style
  MLM and the digits MLP, 300-600 steps on 8 devices; grid on the selection
  seeds, the chosen setting on fresh seeds, ``benchmarks/results/convergence.md``):
  :math:`\kappa` = 4 (DeepSpeed: 16), no local steps, :math:`T_v` required:
  twice the learning-rate warmup W was chosen (DeepSpeed: 100000). Against
  tuned AdamW it ended -2.5% (s.e. 0.5%) on the char GPT, -2.2% (0.9%) on the
  MLM and -1.4% (2.5%) on the digits MLP, with 1.25x, 3.1x and 1.9x fewer bytes
  than :func:`onebit_adam` (rerun at c9fbf57; the earlier sync, 1ea734d: -2.6%,
  -1.8%, +0.4%).
  On the selection seeds :math:`T_v` = W sent 0.8-0.9x the bytes of 2W and was
  worse on all three tasks (mean over the tasks +3.6% against AdamW, 2W +0.4%); :math:`\kappa` = 1 sent 1.3x fewer bytes
  than :math:`\kappa` = 4 and was worse on two tasks of three; local steps
  (:math:`H` = 2, scaler 32) sent 0.6-0.7x the bytes at a higher loss on all
  three. The
  scaler's default 32: :math:`J` = 16 after 128 local-phase steps (DeepSpeed's
  32678 is sized for 100k-step runs).

  Args:
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.
    eps: added to the denominator.
    axis_name: the data-parallel axis of ``shard_map``/``pmap``, or None (one
      device: the same algorithm with a 1-device compression).
    var_freeze_step: :math:`T_v`, the last step that may update the variance.
    var_update_scaler: :math:`\kappa`, variance steps per interval doubling.
    local_steps: None (no local steps), or :math:`H`, the largest interval
      between syncs after :math:`T_v`.
    local_step_scaler: local-phase steps per doubling of the sync interval.
    learning_rate: with local steps only: a scalar or a schedule of the step
      count (step :math:`t` uses ``learning_rate(t - 1)``, as in optax).
    weight_decay: decoupled weight decay :math:`\lambda` (added to the direction,
      as :func:`optax.add_decayed_weights`; not on a skipped step); needs ``params``.
    mask: which leaves get weight decay, as in :func:`optax.adamw` (a tree of
      bools like the parameters, or a function of them; None: every leaf).
    variance_floor: :math:`f` (0 disables the floor).
    max_update: :math:`B`, the clip of a compressed step's direction (and of a
      variance step's once a compressed step came before) and of a sync's
      move, at :math:`\pm B\sum\eta`; local steps are not clipped (None:
      Adam's bound).
    skip_nonfinite: skip non-finite steps on all devices together.
    exact_below: leaves with fewer elements travel as float32 in the same
      messages (None: 64; 0 compresses every leaf).
    variance_ema: ``'per_update'`` (DeepSpeed's, the paper's): a variance step
      decays :math:`v` by :math:`\beta_2`, bias correction
      :math:`1-\beta_2^k`; ``'per_step'``: by :math:`\beta_2^{\Delta}`,
      :math:`\Delta` the steps since the previous variance step, with weight
      :math:`1-\beta_2^{\Delta}` for the new :math:`\bar g^2` and bias
      correction :math:`1-\beta_2^{t_k}` (:math:`t_k` the last variance step):
      :math:`v` then averages over Adam's horizon of :math:`1/(1-\beta_2)`
      *steps* however sparse the variance steps are (see above).

  Returns:
    A :class:`optax.GradientTransformationExtraArgs`; ``init`` and ``update``
    run inside the mapped region when ``axis_name`` is set.

  Example:
    >>> import jax.numpy as jnp, onebit_optax
    >>> import jax
    >>> tx = onebit_optax.scale_by_zero_one_adam(axis_name=None, var_freeze_step=100)
    >>> state, update = tx.init({'w': jnp.ones(3)}), jax.jit(tx.update)
    >>> phases = []
    >>> for _ in range(19):
    ...   _, state = update({'w': jnp.array([1., -2., 3.])}, state)
    ...   phases.append(onebit_optax.status(state).phase[0])
    >>> ''.join(phases)
    'vvvvcvcvcvcvcccvccc'

  References:
    Lu et al., `Maximizing Communication Efficiency for Large-scale Training via
    0/1 Adam <https://arxiv.org/abs/2202.06009>`_, ICLR 2023.

    DeepSpeed ``ZeroOneAdam`` (``deepspeed/runtime/fp16/onebit/zoadam.py``): the
    interval rules and the sync.
  """
  _guards.check_decay_rates(b1, b2, eps, _CALLER)
  local_steps = _check_static(var_freeze_step, var_update_scaler, local_steps,
                              local_step_scaler, learning_rate, variance_ema,
                              weight_decay=weight_decay, variance_floor=variance_floor,
                              max_update=max_update)
  _collective.split_axes(axis_name)
  exact_below = _layout.EXACT_BELOW if exact_below is None else _guards.static_int(
      exact_below, "exact_below", _CALLER, low=0,
      why="leaves with fewer elements travel as float32; 0 compresses every leaf")
  hp = _steps.Hyper(b1, b2, eps, variance_floor, max_update, var_freeze_step, var_update_scaler,
                    local_steps, local_step_scaler, learning_rate, weight_decay, mask,
                    bool(skip_nonfinite), exact_below, variance_ema == "per_step")

  def init_fn(params):
    _guards.check_float_params(params, f"{_CALLER}.init")
    _guards.check_mapped_region(axis_name, f"{_CALLER}.init")
    plan = _plan(params, axis_name, exact_below, f"{_CALLER}.init")
    return _init(params, plan, local_steps is not None)

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    if _guards.no_work(updates, state, ScaleByZeroOneAdamState, f"{_CALLER}.update"):
      return updates, state  # a partition or mask left this optimizer no parameters
    return _update(updates, state, params, hp, axis_name)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def zero_one_adam(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    axis_name: Optional[Hashable],
    var_freeze_step: int,
    var_update_scaler: int = 4,
    local_steps: Optional[int] = None,
    local_step_scaler: int = 32,
    mask: Any = None,
    variance_floor: float = 0.01,
    max_update: Optional[float] = None,
    skip_nonfinite: bool = True,
    exact_below: Optional[int] = None,
    variance_ema: str = "per_update",
) -> optax.GradientTransformationExtraArgs:
  r"""0/1 Adam (Lu et al., 2023): 1-bit momentum between exponentially spaced variance steps.

  Without local steps (the default): a chain of :func:`scale_by_zero_one_adam`
  (with the decoupled weight decay of :func:`optax.adamw` inside it, so that a
  skipped step leaves the parameters exactly as they were) and
  :func:`optax.scale_by_learning_rate`. The parameters stay replicated,
  bitwise identical on every device: variance steps, 1-bit compressed momentum
  steps between them, and after ``var_freeze_step`` a 1-bit sync of the step
  every step.

  With ``local_steps=H``: after ``var_freeze_step`` each device takes its own
  steps and the replicas meet every 1, 2, ..., :math:`H` steps (a chain of
  :func:`scale_by_zero_one_adam` alone, which then applies the learning rate
  and weight decay itself). ``params`` stays the replicated point of the last
  sync; take the gradient at ``local_params(params, axis_name, opt_state)``
  and pass ``params`` to ``update``.

  The training step under ``jax.shard_map`` (with or without local steps; under
  ``jax.pmap`` the same body, with the state made by ``jax.pmap(tx.init)``):

  .. code-block:: python

    tx = onebit_optax.zero_one_adam(1e-3, axis_name='data', var_freeze_step=500,
                                    local_steps=16)           # or local_steps=None
    opt_state = onebit_optax.init_sharded(tx, params, mesh)
    specs = onebit_optax.state_partition_specs(opt_state, 'data')

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P('data')),
                       out_specs=(P(), specs, P()))
    def train_step(params, opt_state, batch):
      # this device's copy (params + its progress since the last sync), typed per device
      local = onebit_optax.local_params(params, 'data', opt_state)
      loss, grads = jax.value_and_grad(loss_fn)(local, batch)
      updates, opt_state = tx.update(grads, opt_state, params)  # params: the replicated point
      return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, 'data')

  ``params`` leave replicated (``P()``): between syncs they stay the point of
  the last sync, and every device holds the same bits. To evaluate the model
  between syncs, use ``params`` (the synced point) or gather
  ``local_params(params, axis_name, opt_state)`` (each device's copy).

  To clip gradients, chain :func:`onebit_optax.clip_by_global_norm` (with the
  same ``axis_name``) before it: :func:`optax.clip_by_global_norm` on the
  local gradients would clip each device by its own norm (not the mean
  gradient's, and a different factor on every device); tracing the update
  under ``optax.chain`` warns of that.

  Args:
    learning_rate: a scalar or an optax schedule.
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.
    eps: added to the denominator.
    weight_decay: decoupled weight decay (0 disables it).
    axis_name: the data-parallel axis, or None.
    var_freeze_step: the last step that may update the variance (e.g. twice the
      learning-rate warmup, the choice of ``benchmarks/convergence.py``).
    var_update_scaler: variance steps per doubling of their interval.
    local_steps: None, or the largest interval between syncs.
    local_step_scaler: local-phase steps per doubling of the sync interval.
    mask: which leaves get weight decay, as in :func:`optax.adamw`.
    variance_floor: floor on the variance on compressed and local steps.
    max_update: largest per-coordinate step there (None: Adam's bound).
    skip_nonfinite: skip non-finite steps on all devices together.
    exact_below: leaves with fewer elements travel exact, as float32.
    variance_ema: ``'per_update'`` (DeepSpeed's) or ``'per_step'``: how a
      variance step weighs the past (:func:`scale_by_zero_one_adam`).

  Returns:
    A :class:`optax.GradientTransformationExtraArgs`.

  Example:
    >>> import jax, jax.numpy as jnp, optax, onebit_optax
    >>> tx = onebit_optax.zero_one_adam(0.1, axis_name=None, var_freeze_step=30)
    >>> params = jnp.array([1.0, -2.0])
    >>> state = tx.init(params)
    >>> @jax.jit
    ... def step(params, state):
    ...   grads = jax.grad(lambda p: jnp.sum(p ** 2))(params)
    ...   updates, state = tx.update(grads, state, params)
    ...   return optax.apply_updates(params, updates), state
    >>> for _ in range(60):
    ...   params, state = step(params, state)
    >>> onebit_optax.status(state).phase, bool(jnp.all(jnp.abs(params) < 1.0))
    ('sync', True)

  References:
    Lu et al., `Maximizing Communication Efficiency for Large-scale Training via
    0/1 Adam <https://arxiv.org/abs/2202.06009>`_, ICLR 2023.
  """
  _guards.check_learning_rate(learning_rate, "zero_one_adam")
  inner = dict(axis_name=axis_name, var_freeze_step=var_freeze_step, mask=mask,
               var_update_scaler=var_update_scaler, local_step_scaler=local_step_scaler,
               variance_floor=variance_floor, max_update=max_update,
               skip_nonfinite=skip_nonfinite, exact_below=exact_below,
               variance_ema=variance_ema)
  # The weight decay is applied inside, so that a skipped step does not decay the parameters.
  if local_steps is not None:
    return optax.chain(scale_by_zero_one_adam(
        b1, b2, eps, local_steps=local_steps, learning_rate=learning_rate,
        weight_decay=weight_decay, **inner))
  return optax.chain(scale_by_zero_one_adam(b1, b2, eps, weight_decay=weight_decay, **inner),
                     optax.scale_by_learning_rate(learning_rate))
