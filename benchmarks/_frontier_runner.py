"""The convergence runner with DiLoCo as one more kind (benchmarks/frontier.py's contestants).

``diloco`` runs :func:`_diloco.diloco` with ``optax.adamw`` inside (the task's
schedule times the traced peak learning rate, its weight decay and mask, the
gradient clipped per device: each replica trains on its own) and the paper's
outer Nesterov SGD at ``outer_lr``. Its options (``inner_steps`` H,
``outer_lr``) travel in the runner's options slot; one compilation per
(H, outer lr). The gradient is taken at this device's point
(:func:`_diloco.local_point`); the validation loss at ``params``, the point of
the last outer step. The run's last step ends a round, so a run whose length H
does not divide keeps its last inner steps.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import _conv_runner
import _diloco

AXIS = _conv_runner.AXIS
DILOCO_OPTIONS = ("inner_steps", "outer_lr")


class FrontierRunner(_conv_runner.Runner):
  """:class:`_conv_runner.Runner` plus the kind ``diloco``."""

  kinds = _conv_runner.KINDS + ("diloco",)
  option_kinds = ("zero_one", "diloco")

  def make_tx(self, kind, freeze_at=1, zero_one=None, lr=1.0):
    if kind != "diloco":
      return super().make_tx(kind, freeze_at, zero_one=zero_one, lr=lr)
    inner = optax.adamw(lambda count: lr * self.schedule(count), b2=self.b2,
                        weight_decay=self.task.weight_decay, mask=self.task.decay_mask)
    if self.task.clip:  # per device: a replica clips its own gradient, as it trains alone
      inner = optax.chain(optax.clip_by_global_norm(self.task.clip), inner)
    return _diloco.diloco(inner, _diloco.outer_sgd(zero_one["outer_lr"]),
                          zero_one["inner_steps"], AXIS, last_step=self.task.steps)

  def _init(self, kind, params, zero_one=None):
    if kind != "diloco":
      return super()._init(kind, params, zero_one)
    opt, specs = _diloco.init_sharded(self.make_tx(kind, zero_one=zero_one), params, self.mesh,
                                      AXIS)
    carry = {"opt": opt,
             "step": jax.device_put(jnp.zeros([], jnp.int32), NamedSharding(self.mesh, P()))}
    return carry, {"opt": specs, "step": P()}

  def _train_step(self, kind, params, carry, batch, lr, freeze_at, zero_one=None):
    if kind != "diloco":
      return super()._train_step(kind, params, carry, batch, lr, freeze_at, zero_one)
    tx = self.make_tx(kind, zero_one=zero_one, lr=lr)
    task = self.task

    def loss_fn(p):
      total, count = task.loss_sums(p, batch)
      return total / count

    # This device's point: a per-device value, so jax.grad keeps the gradient local.
    loss, grads = jax.value_and_grad(loss_fn)(_diloco.local_point(params, carry["opt"]))
    updates, opt = tx.update(grads, carry["opt"], params)  # (the inner lr is applied inside)
    nan = jnp.float32(jnp.nan)
    metrics = dict(nu_l1=nan, ratio=nan, frozen=jnp.bool_(False), wire=opt.wire_bytes)
    new = dict(carry, opt=opt, step=carry["step"] + 1)
    return optax.apply_updates(params, updates), new, (loss[None], metrics)

  def run(self, kind, lr, seed, freeze_at=1, *, zero_one=None):
    if kind != "diloco":
      return super().run(kind, lr, seed, freeze_at, zero_one=zero_one)
    options = {k: zero_one[k] for k in DILOCO_OPTIONS}
    rec = super().run(kind, lr, seed, freeze_at, zero_one=options)
    rec["diloco"] = rec.pop("zero_one")
    return rec

  def chunk_seconds(self, kind, lr, seed, options=None) -> list[float]:
    """Seconds of each compiled chunk of one whole run, after compilation, without evaluations."""
    task = self.task
    params = jax.device_put(task.init_params(jax.random.key(seed)), NamedSharding(self.mesh, P()))
    carry, specs = self._init(kind, params, options)
    chunk = self._chunk_fn(kind, specs, options)
    sharding = NamedSharding(self.mesh, P(None, AXIS))
    args = (jnp.float32(lr), jnp.int32(1))
    out, first = [], True
    for s0 in range(0, task.steps, task.chunk):
      steps = range(s0 + 1, min(s0 + task.chunk, task.steps) + 1)
      per_step = [task.train_batch(seed, s, self.n * task.batch_per_device) for s in steps]
      batches = tuple(jax.device_put(np.stack(leaf), sharding) for leaf in zip(*per_step))
      if first:  # compile (and run once, discarded) on copies: the timed chunks start fresh
        jax.block_until_ready(chunk(*jax.tree.map(jnp.copy, (params, carry)), batches, *args))
        first = False
      t0 = time.perf_counter()
      params, carry, _ = jax.block_until_ready(chunk(params, carry, batches, *args))
      out.append(time.perf_counter() - t0)
    return out
