"""The runner of benchmarks/convergence.py: one task, one optimizer, one learning rate, one seed.

Training is data-parallel under ``jax.shard_map`` on a 1-D ``data`` mesh (8
simulated CPU devices): each device differentiates its slice of the batch
(``onebit_optax.local_params`` keeps the gradient local) and the optimizer does
the communication. The optimizers (``kind``):

* ``adamw``: optax.adamw on the float32 ``pmean`` of the local gradients;
* ``onebit``: onebit_adam with the *default* freeze rule,
  ``variance_ratio_freeze(min_steps=<LR warmup>)``;
* ``fixed``: onebit_adam with ``fixed_step_freeze(freeze_at)``;
* ``naive``: "naive 1-bit Adam": the *gradient* goes through the
  error-compensated 1-bit ``compressed_mean`` after ``freeze_at`` full-precision
  steps and feeds a plain optax.adamw (the failure the paper explains);
* ``no_feedback``: ``fixed`` with the error buffers zeroed after every update;
* ``zero_one``: ``onebit_optax.zero_one_adam`` with the options of ``run``'s
  ``zero_one`` (``var_freeze_step``, ``var_update_scaler``, ``local_steps``,
  ``local_step_scaler``). With local steps the gradient is taken at
  ``local_params`` (with the state) (this device's copy) and the validation loss at
  ``params``, the replicated point of the last sync.

The learning rate and the fixed freeze step are *traced* inputs: every
optimizer is built with a unit-peak schedule and its update is multiplied by
the peak learning rate (exact, since both alias chains end in
``scale_by_learning_rate``, after the decoupled weight decay), so one
compilation per (task, kind) serves the whole sweep. 0/1 Adam with local steps
applies the learning rate inside the transformation (the sync divides by the
sum of the learning rates): its schedule is the unit-peak one times the traced
peak, and its update is not scaled again; one compilation per (task, kind,
0/1 options). Only the public API of onebit_optax is used.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree
from jax.sharding import NamedSharding, PartitionSpec as P

import onebit_optax
from onebit_optax import _collective
from onebit_optax import _compressor
from optax.tree_utils import tree_get

AXIS = "data"
KINDS = ("adamw", "onebit", "fixed", "naive", "no_feedback", "zero_one")
# The options of a ``zero_one`` run that ``run`` accepts (zero_one_adam's names).
ZERO_ONE_OPTIONS = ("var_freeze_step", "var_update_scaler", "local_steps", "local_step_scaler",
                    "variance_ema")
PERIODIC_VAL = 128  # periodic evaluations use at most this many validation examples.


def _find_onebit_states(tree):
  is_state = lambda s: isinstance(s, onebit_optax.ScaleByOnebitAdamState)
  return [s for s in jax.tree.leaves(tree, is_leaf=is_state) if is_state(s)]


def _zero_error_feedback(opt_state):
  """``no_feedback``: forget the compression error after every step.

  ``compressed_mean`` adds the worker (resp. server) error to its input before
  compressing and returns the new residual. Zeroing every error buffer of the
  state after each update means every call starts from zero error: the 1-bit
  compression stays, the feedback of what it dropped is gone.
  """
  def zero(s):
    if isinstance(s, onebit_optax.ScaleByOnebitAdamState):
      # core v3: the worker's error is formed from local_momentum only while
      # feedback_valid holds; the server's (and the hierarchical worker's) are buffers.
      fields = {k: jnp.zeros_like(v) for k, v in s._asdict().items()
                if "error" in k and v is not None}
      return s._replace(feedback_valid=jnp.zeros_like(s.feedback_valid), **fields)
    return s
  return jax.tree.map(zero, opt_state,
                      is_leaf=lambda s: isinstance(s, onebit_optax.ScaleByOnebitAdamState))


def _find_zero_one_states(tree):
  is_state = lambda s: isinstance(s, onebit_optax.ScaleByZeroOneAdamState)
  return [s for s in jax.tree.leaves(tree, is_leaf=is_state) if is_state(s)]


def _adam_nu_hat_l1(opt_state, b2: float):
  """``||v_hat_t||_1`` of optax's Adam state: the quantity the variance-ratio rule watches."""
  is_state = lambda s: isinstance(s, optax.ScaleByAdamState)
  (s,) = [s for s in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(s)]
  correction = 1.0 - jnp.float32(b2) ** s.count.astype(jnp.float32)
  return sum(jnp.sum(v) for v in jax.tree.leaves(s.nu)) / correction


class Runner:
  """Compiles a task's training chunk once per optimizer kind and runs it.

  A subclass adds kinds (benchmarks/digits_gap.py): it extends ``kinds``, and
  ``replicated_kinds`` for an optax optimizer on the ``pmean`` gradient whose
  state is replicated (its ``make_tx`` and ``_train_step`` handle the rest).
  """

  kinds = KINDS
  replicated_kinds = ("adamw", "naive")
  option_kinds = ("zero_one",)  # kinds whose runs take options (``run``'s ``zero_one`` slot)
  on_steps = None  # called with the number of steps after each chunk (a progress bar)

  def __init__(self, task, mesh, b2: float = 0.999):
    self.task, self.mesh, self.b2 = task, mesh, b2
    self.n = mesh.shape[AXIS]
    self.size = sum(int(np.prod(x.shape))
                    for x in jax.tree.leaves(task.init_params(jax.random.key(0))))
    self.padded = _compressor.padded_size(self.size, self.n)
    self.allreduce_bytes = float(_collective.allreduce_wire_bytes(self.size, self.n))
    self.schedule = optax.warmup_cosine_decay_schedule(0.0, 1.0, task.warmup, task.steps, 0.1)
    val = task.val_set(self.n)
    periodic = min(len(val[0]), PERIODIC_VAL) // self.n * self.n
    sharding = NamedSharding(mesh, P(AXIS))
    self.val_full = tuple(jax.device_put(a, sharding) for a in val)
    self.val_periodic = tuple(jax.device_put(a[:periodic], sharding) for a in val)
    self._chunks: dict[str, Any] = {}
    self._evaluate = self._build_eval()

  # --------------------------------------------------------------------------

  def make_tx(self, kind: str, freeze_at=1, zero_one=None, lr=1.0):
    """The optimizer of ``kind`` (peak learning rate 1; the runner scales its update).

    ``zero_one`` with ``local_steps``: the schedule's peak is ``lr`` (the
    transformation applies it; ``_train_step`` does not scale it again).
    """
    kw = dict(b2=self.b2, weight_decay=self.task.weight_decay, mask=self.task.decay_mask)
    if kind in ("adamw", "naive"):
      return optax.adamw(self.schedule, **kw)
    if kind == "zero_one":
      options = dict(zero_one)
      schedule = self.schedule
      if options.get("local_steps") is not None:
        schedule = lambda count: lr * self.schedule(count)
      return onebit_optax.zero_one_adam(schedule, axis_name=AXIS, **kw, **options)
    if kind == "onebit":  # The default rule; never before the LR warmup is over.
      freeze = onebit_optax.variance_ratio_freeze(min_steps=self.task.warmup)
    else:
      freeze = freeze_at  # an int or a traced scalar: a fixed freeze step.
    return onebit_optax.onebit_adam(self.schedule, axis_name=AXIS, freeze=freeze, **kw)

  def _init(self, kind: str, params, zero_one=None):
    # (A subclass's make_tx/_train_step may not take the 0/1 arguments: passed for zero_one only.)
    tx = self.make_tx(kind) if zero_one is None else self.make_tx(kind, zero_one=zero_one)
    if kind in self.replicated_kinds:
      opt_state = jax.device_put(tx.init(params), NamedSharding(self.mesh, P()))
      opt_specs = jax.tree.map(lambda _: P(), opt_state)
    elif kind == "zero_one":
      opt_state = onebit_optax.init_sharded(tx, params, self.mesh, AXIS)
      opt_specs = onebit_optax.state_partition_specs(opt_state, AXIS)
    else:
      opt_state = onebit_optax.init_sharded(tx, params, self.mesh, AXIS)
      opt_specs = onebit_optax.state_partition_specs(opt_state, AXIS)
    carry = {"opt": opt_state, "step": jnp.zeros([], jnp.int32)}
    specs = {"opt": opt_specs, "step": P()}
    if kind == "naive":
      carry["worker_error"] = jnp.zeros((self.n, self.padded), jnp.float32)
      carry["server_error"] = jnp.zeros((self.n, self.padded // self.n), jnp.float32)
      specs["worker_error"] = specs["server_error"] = P(AXIS)
    carry = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(self.mesh, s)),
                         carry, specs, is_leaf=lambda x: isinstance(x, P))
    return carry, specs

  def _naive_mean(self, flat_grads, carry, step, freeze_at):
    """Error-compensated 1-bit mean of the *gradient* after ``freeze_at`` fp32 steps."""
    size, padded = self.size, self.padded

    def full_precision(ops):
      g, we, se = ops
      return jax.lax.pmean(g, AXIS), we, se

    def compressed(ops):
      g, we, se = ops
      mean, we, se = _collective.compressed_mean(jnp.pad(g, (0, padded - size)), we[0], se[0],
                                                  AXIS)
      return mean[:size], we[None], se[None]

    compress = step > freeze_at  # replicated: all devices take the same branch.
    mean, we, se = jax.lax.cond(compress, compressed, full_precision,
                                (flat_grads, carry["worker_error"], carry["server_error"]))
    wire = jnp.where(compress, _collective.compressed_wire_bytes(padded, self.n),
                     self.allreduce_bytes).astype(jnp.float32)
    return mean, we, se, wire

  def _train_step(self, kind, params, carry, batch, lr, freeze_at, zero_one=None):
    task = self.task
    tx = (self.make_tx(kind, freeze_at) if zero_one is None
          else self.make_tx(kind, freeze_at, zero_one=zero_one, lr=lr))
    step = carry["step"] + 1

    def loss_fn(p):
      total, count = task.loss_sums(p, batch)
      return total / count

    # Local gradients: local_params keeps jax.grad from all-reducing them (0/1
    # Adam: this device's copy, the last sync's point plus its local steps).
    at = (onebit_optax.local_params(params, AXIS, carry["opt"]) if kind == "zero_one"
          else onebit_optax.local_params(params, AXIS))
    loss, grads = jax.value_and_grad(loss_fn)(at)
    if task.clip:
      clip = onebit_optax.clip_by_global_norm(task.clip, axis_name=AXIS)
      grads, _ = clip.update(grads, clip.init(None))
    new = dict(carry, step=step)
    nan = jnp.float32(jnp.nan)
    metrics = dict(nu_l1=nan, ratio=nan, frozen=jnp.bool_(False))
    if kind == "adamw":
      updates, new["opt"] = tx.update(jax.lax.pmean(grads, AXIS), carry["opt"], params)
      metrics["nu_l1"] = _adam_nu_hat_l1(new["opt"], self.b2)
      wire = jnp.float32(self.allreduce_bytes)
    elif kind == "naive":
      flat, unravel = ravel_pytree(grads)
      mean, new["worker_error"], new["server_error"], wire = self._naive_mean(
          flat, carry, step, freeze_at)
      updates, new["opt"] = tx.update(unravel(mean), carry["opt"], params)
      metrics["frozen"] = step >= freeze_at
    elif kind == "zero_one":
      updates, new["opt"] = tx.update(grads, carry["opt"], params)
      (state,) = _find_zero_one_states(new["opt"])
      wire = state.wire_bytes.astype(jnp.float32)
      metrics["frozen"] = state.count > zero_one["var_freeze_step"]
    else:
      updates, opt_state = tx.update(grads, carry["opt"], params)
      if kind == "no_feedback":
        opt_state = _zero_error_feedback(opt_state)
      new["opt"] = opt_state
      wire = tree_get(opt_state, "wire_bytes").astype(jnp.float32)
      metrics.update(ratio=tree_get(opt_state, "variance_ratio").astype(jnp.float32),
                     frozen=tree_get(opt_state, "frozen"))
    if not (kind == "zero_one" and zero_one.get("local_steps") is not None):
      updates = jax.tree.map(lambda u: lr * u, updates)  # (local steps: applied inside)
    params = optax.apply_updates(params, updates)
    metrics["wire"] = wire
    # The loss leaves per device (P(None, AXIS)) and is averaged on the host:
    # logging adds no collective to the step.
    return params, new, (loss[None], metrics)

  def _chunk_fn(self, kind: str, specs, zero_one=None):
    key = kind if zero_one is None else (kind, tuple(sorted(zero_one.items())))
    if key in self._chunks:
      return self._chunks[key]
    batch_specs = P(None, AXIS)
    metric_specs = dict(nu_l1=P(), ratio=P(), frozen=P(), wire=P())

    @jax.jit
    @functools.partial(
        jax.shard_map, mesh=self.mesh,
        in_specs=(P(), specs, batch_specs, P(), P()),
        out_specs=(P(), specs, (batch_specs, metric_specs)))
    def chunk(params, carry, batches, lr, freeze_at):
      def body(state, batch):
        params, carry = state
        extra = () if zero_one is None else (zero_one,)
        params, carry, out = self._train_step(kind, params, carry, batch, lr, freeze_at, *extra)
        return (params, carry), out
      (params, carry), out = jax.lax.scan(body, (params, carry), batches)
      return params, carry, out

    self._chunks[key] = chunk
    return chunk

  def _build_eval(self):
    task = self.task

    @jax.jit
    @functools.partial(jax.shard_map, mesh=self.mesh, in_specs=(P(), P(AXIS)),
                       out_specs=P(AXIS))
    def evaluate(params, batch):
      total, count = task.loss_sums(params, batch)
      return jnp.stack([total, count])[None]

    return lambda params, batch: float(np.divide(*np.asarray(evaluate(params, batch)).sum(0)))

  # --------------------------------------------------------------------------

  def run(self, kind: str, lr: float, seed: int, freeze_at: int = 1, *,
          zero_one: dict | None = None) -> dict:
    """Trains ``task.steps`` steps; returns the curves and the final validation loss.

    ``zero_one`` (kind ``zero_one`` only): zero_one_adam's options, keys of
    ``ZERO_ONE_OPTIONS`` (``var_freeze_step`` required).
    """
    assert kind in self.kinds, kind
    assert (kind in self.option_kinds) == (zero_one is not None), (kind, zero_one)
    if kind == "zero_one":
      zero_one = {k: zero_one[k] for k in ZERO_ONE_OPTIONS if k in zero_one}
      assert "var_freeze_step" in zero_one, zero_one
    task, mesh = self.task, self.mesh
    wall0 = time.time()
    params = jax.device_put(task.init_params(jax.random.key(seed)), NamedSharding(mesh, P()))
    carry, specs = self._init(kind, params, zero_one)
    chunk = self._chunk_fn(kind, specs, zero_one)
    batch_sharding = NamedSharding(mesh, P(None, AXIS))
    global_batch = self.n * task.batch_per_device
    lr_arg, freeze_arg = jnp.float32(lr), jnp.int32(freeze_at)
    rec = {k: [] for k in ("loss", "wire", "frozen", "ratio", "nu_l1")}
    rec.update(eval_steps=[0], val=[self._evaluate(params, self.val_periodic)])
    for s0 in range(0, task.steps, task.chunk):
      steps = range(s0 + 1, min(s0 + task.chunk, task.steps) + 1)
      per_step = [task.train_batch(seed, s, global_batch) for s in steps]
      batches = tuple(jax.device_put(np.stack(leaf), batch_sharding) for leaf in zip(*per_step))
      params, carry, (loss, metrics) = chunk(params, carry, batches, lr_arg, freeze_arg)
      rec["loss"].extend(np.asarray(loss).mean(axis=1).tolist())
      for k, v in metrics.items():
        rec[k].extend(np.asarray(v).astype(np.float64).tolist())
      rec["eval_steps"].append(steps[-1])
      rec["val"].append(self._evaluate(params, self.val_periodic))
      if self.on_steps is not None:
        self.on_steps(len(steps))
    final = self._evaluate(params, self.val_full)
    frozen = np.asarray(rec["frozen"], bool)
    if kind in ("adamw",):
      freeze_step = None
    elif kind == "naive":
      freeze_step = freeze_at
    elif kind == "zero_one":
      freeze_step = zero_one["var_freeze_step"] if frozen.any() else None
    else:
      freeze_step = int(tree_get(carry["opt"], "freeze_step")) if frozen.any() else None
    if kind != "adamw":
      del rec["nu_l1"]
    if kind not in ("onebit", "fixed", "no_feedback"):
      del rec["ratio"]
    out = dict(rec, kind=kind, lr=lr, seed=seed, final_val=final,
               total_bytes=float(np.sum(rec["wire"])), freeze_step=freeze_step,
               wall_s=time.time() - wall0)
    if zero_one is not None:
      out["zero_one"] = zero_one
    return out
