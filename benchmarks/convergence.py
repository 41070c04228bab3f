"""Convergence of 1-bit Adam against AdamW and two broken variants, on 8 simulated CPU devices.

    .venv/bin/python benchmarks/convergence.py            # the full benchmark (~15-20 min on 2 cores)
    .venv/bin/python benchmarks/convergence.py --quick    # a short smoke run (a few minutes)

A byte-level transformer (benchmarks/_convergence_model.py) learns CPython's
``pydoc_data.topics`` text, data-parallel over 8 devices with ``jax.shard_map``.
Every run uses the same initial parameters, the same batches (a pure function of
the step) and the same schedule (linear LR warmup, cosine decay):

  (a) ``adamw``:        optax.adamw on the float32 pmean of the local gradients;
  (b) ``onebit_ratio``: onebit_adam, variance frozen by ``variance_ratio_freeze``
                        (``min_steps`` = the LR warmup);
  (c) ``onebit_fixed``: onebit_adam, variance frozen at 15% of the run;
  (d) ``naive``:        "naive 1-bit Adam": the *gradient* goes through the
                        error-compensated 1-bit ``compressed_mean`` (persistent
                        worker/server error buffers) and feeds a plain optax.adamw;
                        same full-precision warmup as (c), so that (c) and (d)
                        send the same bytes and differ only in *what* is compressed;
  (e) ``no_feedback``:  (c) with the error buffers zeroed after every update.

Then two runs branch off (a) and (c) at half time and continue on Python source
code (the ``.py`` files of the standard library) instead of prose: the
distribution shift the paper leaves open. They report validation loss on the
code, and a staleness signal that costs no communication: every device keeps an
EMA of its own squared local gradient and compares it with the (frozen) second
moment of the optimizer.

Finally the variance-ratio freeze criterion is replayed offline on the
bias-corrected ``||v_hat_t||_1`` trajectory of run (a) (identical to 1-bit
Adam's warmup, which *is* Adam on the mean gradient) for a grid of intervals and
thresholds.

Outputs (``--out``, default benchmarks/results): convergence.md (tables),
convergence.json (raw curves), convergence.png (plots); ``--quick`` writes
``convergence_quick.*``.

Only the public API of onebit_optax is used.
"""

from __future__ import annotations

import os

# Eight simulated CPU devices; must happen before jax is imported.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # pylint: disable=g-import-not-at-top,g-bad-import-order
import dataclasses
import functools
import json
import math
import platform
import subprocess
import sys
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree
from jax.sharding import NamedSharding, PartitionSpec as P

import onebit_optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _convergence_model as model  # pylint: disable=g-import-not-at-top

AXIS = "data"


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything that defines the benchmark (saved with the results)."""

  steps: int = 3000
  chunk: int = 100  # steps per compiled call (lax.scan); also the eval / probe interval.
  batch_per_device: int = 4
  d_model: int = 64
  num_layers: int = 2
  num_heads: int = 4
  seq_len: int = 64
  peak_lr: float = 3e-3
  warmup_frac: float = 0.05  # linear LR warmup, then cosine decay to end_lr_frac * peak.
  end_lr_frac: float = 0.1
  b1: float = 0.9
  # 0.99, not 0.999: the EMA window of v (1/(1-b2) = 100 steps) has to be short
  # against a run of a few thousand steps, or v is still an average over the
  # first, non-stationary steps when it gets frozen.
  b2: float = 0.99
  eps: float = 1e-8
  weight_decay: float = 0.1
  fixed_freeze_frac: float = 0.15
  ratio_threshold: float = 0.96
  ratio_interval: int | None = None  # None: the core's default, round(1/(1-b2)).
  shift_frac: float = 0.5
  # The 1-bit runs that (besides AdamW) get a corpus-shift branch: (b) froze v on
  # its plateau, (c) froze it earlier, while it was still growing.
  shift_from: tuple[str, ...] = ("onebit_ratio", "onebit_fixed")
  val_seqs_periodic: int = 256  # periodic evals use this many windows; the final eval uses all.
  seed: int = 0
  shadow_b2: float = 0.999  # second, unused EMA of the mean g^2 in run (a), for the offline study.

  @property
  def lr_warmup(self) -> int:
    return int(round(self.warmup_frac * self.steps))

  @property
  def fixed_freeze(self) -> int:
    return int(round(self.fixed_freeze_frac * self.steps))

  @property
  def shift_step(self) -> int:
    return int(round(self.shift_frac * self.steps / self.chunk)) * self.chunk

  @property
  def model(self) -> model.ModelConfig:
    return model.ModelConfig(self.d_model, self.num_layers, self.num_heads, self.seq_len)


QUICK = dict(steps=400, chunk=25, val_seqs_periodic=128)


class Method(NamedTuple):
  name: str
  label: str
  kind: str  # 'adamw' | 'onebit' | 'naive'
  tx: Any
  zero_error_feedback: bool = False
  warmup: int = 0  # naive: full-precision steps before the gradient is compressed.


def make_methods(cfg: Config) -> list[Method]:
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, cfg.peak_lr, cfg.lr_warmup, cfg.steps, cfg.end_lr_frac * cfg.peak_lr)
  adam_kw = dict(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                 mask=model.decay_mask)
  adamw = lambda: optax.adamw(schedule, **adam_kw)
  onebit = lambda freeze: onebit_optax.onebit_adam(
      schedule, axis_name=AXIS, freeze=freeze, **adam_kw)
  ratio = onebit_optax.variance_ratio_freeze(
      min_steps=cfg.lr_warmup, threshold=cfg.ratio_threshold, interval=cfg.ratio_interval)
  fixed = onebit_optax.fixed_step_freeze(cfg.fixed_freeze)
  return [
      Method("adamw", "(a) AdamW, fp32 all-reduce", "adamw", adamw()),
      Method("onebit_ratio", "(b) 1-bit Adam, variance-ratio freeze", "onebit", onebit(ratio)),
      Method("onebit_fixed", f"(c) 1-bit Adam, freeze at {cfg.fixed_freeze_frac:.0%}",
             "onebit", onebit(fixed)),
      Method("naive", "(d) naive: 1-bit EF gradient -> AdamW", "naive", adamw(),
             warmup=cfg.fixed_freeze),
      Method("no_feedback", "(e) 1-bit Adam without error feedback", "onebit", onebit(fixed),
             zero_error_feedback=True),
  ]


# ----------------------------------------------------------------------------
# Reading the optimizer states (public state classes only).


def _find(opt_state, cls):
  found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, cls))
           if isinstance(s, cls)]
  assert len(found) == 1, (cls, opt_state)
  return found[0]


def _nu_hat(method: Method, opt_state, b2: float):
  """The second moment the optimizer divides by, bias-corrected (frozen for 1-bit Adam)."""
  if method.kind == "onebit":
    s = _find(opt_state, onebit_optax.ScaleByOnebitAdamState)
    t = jnp.where(s.frozen, s.freeze_step, s.count)
  else:
    s = _find(opt_state, optax.ScaleByAdamState)
    t = s.count
  correction = 1.0 - jnp.asarray(b2, jnp.float32) ** t.astype(jnp.float32)
  return jax.tree.map(lambda v: v / correction, s.nu)


def _zero_error_feedback(opt_state):
  """Run (e): forget the compression error after every step, i.e. no error feedback.

  compressed_mean adds ``worker_error`` (resp. ``server_error``) to its input
  before compressing and returns the new residual. Zeroing both buffers in the
  state after each update means every call starts from zero error: the 1-bit
  compression stays, the feedback of what it dropped is gone.
  """
  def zero(s):
    if isinstance(s, onebit_optax.ScaleByOnebitAdamState):
      return s._replace(worker_error=jnp.zeros_like(s.worker_error),
                        server_error=jnp.zeros_like(s.server_error))
    return s
  return jax.tree.map(zero, opt_state,
                      is_leaf=lambda s: isinstance(s, onebit_optax.ScaleByOnebitAdamState))


# ----------------------------------------------------------------------------
# The compiled pieces.


class Trainer:
  """Compiled training chunk, eval and staleness probe for one method."""

  def __init__(self, method: Method, cfg: Config, mesh, params):
    self.method, self.cfg, self.mesh = method, cfg, mesh
    self.n = mesh.shape[AXIS]
    self.size = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    self.padded = onebit_optax.padded_size(self.size, self.n)
    params = jax.device_put(params, NamedSharding(mesh, P()))
    tx = method.tx
    if method.kind == "onebit":
      opt_state = onebit_optax.init_sharded(tx, params, mesh, AXIS)
      opt_specs = onebit_optax.state_partition_specs(opt_state, AXIS)
    else:
      opt_state = jax.device_put(tx.init(params), NamedSharding(mesh, P()))
      opt_specs = jax.tree.map(lambda _: P(), opt_state)
    carry = {"opt": opt_state, "step": jnp.zeros([], jnp.int32),
             "v_local": jnp.zeros((self.n, self.size), jnp.float32)}
    specs = {"opt": opt_specs, "step": P(), "v_local": P(AXIS)}
    if method.kind == "naive":
      carry["worker_error"] = jnp.zeros((self.n, self.padded), jnp.float32)
      carry["server_error"] = jnp.zeros((self.n, self.padded // self.n), jnp.float32)
      specs["worker_error"] = specs["server_error"] = P(AXIS)
    if method.kind == "adamw":
      carry["shadow_nu"] = jnp.zeros((self.size,), jnp.float32)
      specs["shadow_nu"] = P()
    self.specs = specs
    self.init_params = params
    self.init_carry = jax.tree.map(
        lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), carry, specs)
    self._chunk = self._build_chunk()
    self._eval = self._build_eval()
    self._probe = self._build_probe()

  def _build_chunk(self) -> Callable:
    method, cfg, n, size, padded = self.method, self.cfg, self.n, self.size, self.padded
    tx, mcfg, b2 = method.tx, cfg.model, cfg.b2
    allreduce_bytes = onebit_optax.allreduce_wire_bytes(size, n)
    compressed_bytes = onebit_optax.compressed_wire_bytes(padded, n)

    def train_step(params, carry, batch):
      x, y = batch
      step = carry["step"] + 1
      # Local gradients: local_params keeps jax.grad from all-reducing them.
      loss, grads = jax.value_and_grad(model.loss_fn)(
          onebit_optax.local_params(params, AXIS), x, y, mcfg)
      flat_grads, unravel = ravel_pytree(grads)
      new = dict(carry, step=step)
      # Staleness signal: this device's own EMA of g_local^2. Elementwise, local,
      # never communicated.
      new["v_local"] = b2 * carry["v_local"] + (1 - b2) * jnp.square(flat_grads)[None]
      if method.kind == "adamw":
        mean_grads = jax.lax.pmean(grads, AXIS)
        updates, new["opt"] = tx.update(mean_grads, carry["opt"], params)
        flat_mean, _ = ravel_pytree(mean_grads)
        new["shadow_nu"] = (cfg.shadow_b2 * carry["shadow_nu"]
                            + (1 - cfg.shadow_b2) * jnp.square(flat_mean))
        wire = jnp.float32(allreduce_bytes)
      elif method.kind == "naive":
        def full_precision(ops):
          g, we, se = ops
          return jax.lax.pmean(g, AXIS), we, se

        def compressed(ops):
          g, we, se = ops
          mean, we, se = onebit_optax.compressed_mean(
              jnp.pad(g, (0, padded - size)), we[0], se[0], AXIS)
          return mean[:size], we[None], se[None]

        compress = step > method.warmup  # replicated: all devices take the same branch.
        flat_mean, new["worker_error"], new["server_error"] = jax.lax.cond(
            compress, compressed, full_precision,
            (flat_grads, carry["worker_error"], carry["server_error"]))
        updates, new["opt"] = tx.update(unravel(flat_mean), carry["opt"], params)
        wire = jnp.where(compress, compressed_bytes, allreduce_bytes).astype(jnp.float32)
      else:
        updates, opt_state = tx.update(grads, carry["opt"], params)
        if method.zero_error_feedback:
          opt_state = _zero_error_feedback(opt_state)
        new["opt"] = opt_state
        wire = onebit_optax.wire_bytes(opt_state)
      params = optax.apply_updates(params, updates)
      nu_hat_l1 = sum(jnp.sum(v) for v in jax.tree.leaves(_nu_hat(method, new["opt"], b2)))
      if method.kind == "onebit":
        s = _find(new["opt"], onebit_optax.ScaleByOnebitAdamState)
        frozen, ratio = s.frozen, s.variance_ratio
      elif method.kind == "naive":
        # Same convention as 1-bit Adam's state: 'frozen' after the last full-precision step.
        frozen, ratio = step >= method.warmup, jnp.float32(jnp.nan)
      else:
        frozen, ratio = jnp.bool_(False), jnp.float32(jnp.nan)
      if method.kind == "adamw":
        shadow_l1 = jnp.sum(new["shadow_nu"]) / (1 - cfg.shadow_b2 ** step.astype(jnp.float32))
      else:
        shadow_l1 = jnp.float32(jnp.nan)
      replicated = dict(nu_hat_l1=nu_hat_l1, shadow_l1=shadow_l1, wire=wire,
                        frozen=frozen, ratio=ratio)
      # The loss leaves per device (P(None, AXIS)) and is averaged on the host:
      # logging adds no collective to the step.
      return params, new, (loss[None], replicated)

    replicated_specs = dict(nu_hat_l1=P(), shadow_l1=P(), wire=P(), frozen=P(), ratio=P())

    @jax.jit
    @functools.partial(
        jax.shard_map, mesh=self.mesh,
        in_specs=(P(), self.specs, P(None, AXIS), P(None, AXIS)),
        out_specs=(P(), self.specs, (P(None, AXIS), replicated_specs)))
    def chunk(params, carry, xs, ys):
      def body(state, batch):
        params, carry = state
        params, carry, metrics = train_step(params, carry, batch)
        return (params, carry), metrics
      (params, carry), metrics = jax.lax.scan(body, (params, carry), (xs, ys))
      return params, carry, metrics

    return chunk

  def _build_eval(self) -> Callable:
    mcfg = self.cfg.model

    @jax.jit
    @functools.partial(jax.shard_map, mesh=self.mesh, in_specs=(P(), P(AXIS), P(AXIS)),
                       out_specs=P(AXIS))
    def evaluate(params, x, y):
      return model.loss_fn(params, x, y, mcfg)[None]  # per device; equal counts, host mean.

    return evaluate

  def _build_probe(self) -> Callable:
    method, b2 = self.method, self.cfg.b2

    @jax.jit
    @functools.partial(jax.shard_map, mesh=self.mesh, in_specs=(self.specs,),
                       out_specs=P(AXIS))
    def probe(carry):
      """Per device: how the local second moment compares with the optimizer's nu_hat."""
      nu_hat, _ = ravel_pytree(_nu_hat(method, carry["opt"], b2))
      t = carry["step"].astype(jnp.float32)
      v_local = carry["v_local"][0] / (1.0 - b2 ** t)
      alive = nu_hat > 0
      l1_ratio = jnp.sum(v_local) / jnp.sum(nu_hat)
      median_ratio = jnp.nanmedian(jnp.where(alive, v_local / jnp.where(alive, nu_hat, 1.0),
                                             jnp.nan))
      # Coordinates the optimizer treats as dead (nu_hat == 0: 1-bit Adam masks
      # their update to 0 for good once frozen) that now get gradient here.
      dead_active = jnp.sum((~alive) & (v_local > 0)).astype(jnp.float32)
      # Shape, not scale: the spread of log(v_local / nu_hat) over coordinates. A
      # global factor (local gradients are noisier than the mean gradient, by an
      # amount that drifts as training goes on) moves every log ratio alike and
      # leaves the spread unchanged; a preconditioner that has the wrong *shape*
      # for the current gradients widens it. Interquartile range (/1.349, the
      # standard deviation of a normal), so that a few hundred coordinates of rare
      # bytes with a nearly-zero nu_hat cannot dominate it.
      valid = alive & (v_local > 0)
      log_ratio = jnp.where(valid, jnp.log(jnp.where(valid, v_local, 1.0)
                                           / jnp.where(valid, nu_hat, 1.0)), jnp.nan)
      q75, q25 = jnp.nanpercentile(log_ratio, jnp.array([75.0, 25.0]))
      spread = (q75 - q25) / 1.349
      return jnp.stack([l1_ratio, median_ratio, dead_active, spread])[None]

    return probe

  # --------------------------------------------------------------------------

  def run(self, train_data, val_sets, start=None, first=0, last=None,
          snapshot_at=None, log_prefix=""):
    """Trains steps ``first+1 .. last`` on ``train_data``; returns the record and snapshots."""
    cfg, mesh = self.cfg, self.mesh
    last = cfg.steps if last is None else last
    params, carry = start if start is not None else (self.init_params, self.init_carry)
    batch_sharding = NamedSharding(mesh, P(None, AXIS))
    val_sharding = NamedSharding(mesh, P(AXIS))
    val_dev = {k: (jax.device_put(x, val_sharding), jax.device_put(y, val_sharding))
               for k, (x, y) in val_sets.items()}
    rec = {k: [] for k in ("loss", "nu_hat_l1", "shadow_l1", "wire", "frozen", "ratio")}
    rec.update(eval_steps=[], val={k: [] for k in val_sets}, probe_steps=[], probe=[])
    snapshot = None
    wall0, cpu0 = time.time(), time.process_time()

    def evaluate(step, params, carry):
      rec["eval_steps"].append(step)
      for k, (x, y) in val_dev.items():
        rec["val"][k].append(float(np.mean(np.asarray(self._eval(params, x, y)))))
      rec["probe_steps"].append(step)
      rec["probe"].append(np.asarray(self._probe(carry)).tolist())

    if first == 0:
      evaluate(0, params, carry)
    for s0 in range(first, last, cfg.chunk):
      steps = range(s0 + 1, s0 + cfg.chunk + 1)
      xs, ys = zip(*(model.train_batch(train_data, s, cfg.seed, self.n * cfg.batch_per_device,
                                       cfg.seq_len) for s in steps))
      xs = jax.device_put(np.stack(xs), batch_sharding)
      ys = jax.device_put(np.stack(ys), batch_sharding)
      params, carry, (loss, metrics) = self._chunk(params, carry, xs, ys)
      rec["loss"].extend(np.asarray(loss).mean(axis=1).tolist())
      for k, v in metrics.items():
        rec[k].extend(np.asarray(v).astype(np.float64).tolist())
      step = s0 + cfg.chunk
      evaluate(step, params, carry)
      if step == snapshot_at:
        snapshot = (params, carry)
      if (step - first) % max(cfg.chunk, (last - first) // 5 // cfg.chunk * cfg.chunk) == 0:
        vals = " ".join(f"{k}={v[-1]:.4f}" for k, v in rec["val"].items())
        print(f"  {log_prefix}{self.method.name:13s} step {step:5d}/{last}  "
              f"train {np.mean(rec['loss'][-cfg.chunk:]):.4f}  val {vals}  "
              f"frozen={bool(rec['frozen'][-1])}  {time.time() - wall0:6.1f}s", flush=True)
    rec["wall_s"] = time.time() - wall0
    rec["cpu_s"] = time.process_time() - cpu0
    rec["final"] = (params, carry)
    return rec, snapshot

  def final_val(self, params, x, y) -> float:
    sharding = NamedSharding(self.mesh, P(AXIS))
    return float(np.mean(np.asarray(
        self._eval(params, jax.device_put(x, sharding), jax.device_put(y, sharding)))))


# ----------------------------------------------------------------------------
# The freeze criterion, replayed offline.


def first_freeze(l1: np.ndarray, interval: int, threshold: float, min_steps: int,
                 patience: int = 1) -> int | None:
  """The step at which ``variance_ratio_freeze`` would fire, given ``||v_hat_t||_1`` for t=1..T.

  With ``patience=1``, exactly the rule of onebit_optax/_freeze.py
  (freeze_decision): checks at t = k*interval only; the reference is ||v_hat||_1
  at the previous check (the first check, t = interval, only records it); fire
  at the first check with t >= min_steps and threshold <= ratio <= 1/threshold.
  ``patience=k`` (not in the core) asks for k consecutive checks in the band.
  """
  in_band = 0
  for t in range(2 * interval, len(l1) + 1, interval):
    ratio = l1[t - 1] / l1[t - interval - 1]
    in_band = in_band + 1 if threshold <= ratio <= 1.0 / threshold else 0
    if t >= min_steps and in_band >= patience:
      return t
  return None


def ratio_study(l1, steps, lr_warmup, intervals, thresholds, allreduce, compressed):
  rows = []
  for interval in intervals:
    for threshold in thresholds:
      for min_steps in (0, lr_warmup):
        for patience in (1, 2):
          t0 = first_freeze(l1, interval, threshold, min_steps, patience)
          reduction = None
          if t0 is not None:
            reduction = steps * allreduce / (t0 * allreduce + (steps - t0) * compressed)
          rows.append(dict(interval=interval, threshold=threshold, min_steps=min_steps,
                           patience=patience, freeze_step=t0,
                           fraction=None if t0 is None else t0 / steps,
                           comm_reduction=reduction))
  return rows


def describe_trajectory(l1: np.ndarray) -> dict:
  """Where ||v_hat_t||_1 has its trough and when it reaches its late plateau."""
  trough = int(np.argmin(l1)) + 1
  plateau = float(np.median(l1[-len(l1) // 3:]))
  after = np.nonzero(np.abs(l1[trough - 1:] / plateau - 1) <= 0.1)[0]
  return dict(start=float(l1[0]), trough_step=trough, trough=float(l1[trough - 1]),
              plateau=plateau,
              plateau_step=None if not len(after) else int(after[0]) + trough)


# ----------------------------------------------------------------------------
# Reporting.


def _git_describe() -> str:
  try:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                          capture_output=True, text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "onebit_optax"], cwd=root,
                           capture_output=True, text=True, check=True).stdout.strip()
    if dirty:  # other work in progress: identify the exact sources that were imported.
      import hashlib  # pylint: disable=g-import-not-at-top
      pkg = os.path.dirname(onebit_optax.__file__)
      digest = hashlib.sha256()
      for name in sorted(os.listdir(pkg)):
        if name.endswith(".py"):
          with open(os.path.join(pkg, name), "rb") as f:
            digest.update(f.read())
      return f"{head} + uncommitted onebit_optax/ changes (sources sha256 {digest.hexdigest()[:12]})"
    return head
  except Exception:  # pylint: disable=broad-except
    return "unknown"


def _fmt_bytes(b: float) -> str:
  return f"{b / 1e6:,.1f} MB"


def _freeze_of(rec) -> int | None:
  frozen = np.asarray(rec["frozen"], bool)
  if not frozen.any():
    return None
  first = int(np.argmax(frozen)) + 1  # step whose state first says frozen = the last warmup step.
  return first


def build_report(cfg, results, study, shift, meta) -> tuple[str, dict]:
  base = results["adamw"]
  lines = []
  add = lines.append
  add(f"# Convergence: 1-bit Adam vs AdamW ({'quick' if meta['quick'] else 'full'} run)\n")
  add(f"Command: `{meta['command']}`  ")
  add(f"Model: byte-level transformer, {meta['params']:,} parameters "
      f"(d={cfg.d_model}, {cfg.num_layers} layers, {cfg.num_heads} heads, context "
      f"{cfg.seq_len}); data: `pydoc_data.topics` ({meta['prose_bytes']:,} bytes, last 10% "
      f"held out); 8 simulated CPU devices x {cfg.batch_per_device} sequences; "
      f"{cfg.steps} steps; LR {cfg.peak_lr:g} with {cfg.lr_warmup} warmup steps, cosine to "
      f"{cfg.end_lr_frac:g}x; b1={cfg.b1}, b2={cfg.b2}, weight decay {cfg.weight_decay} "
      f"(matrices); seed {cfg.seed}.  ")
  add(f"jax {jax.__version__}, optax {optax.__version__}, onebit_optax "
      f"{onebit_optax.__version__} at {meta['git']}; {platform.machine()}, "
      f"{os.cpu_count()} CPUs; total wall time {meta['wall_s'] / 60:.1f} min.\n")
  add("Final validation loss is measured on all of the held-out prose "
      f"({meta['val_seqs']} windows); bytes are what one device sends over the whole "
      "run (`wire_bytes` summed per step; AdamW: `allreduce_wire_bytes` of a ring "
      "all-reduce).\n")
  add("| run | final val loss | vs AdamW | variance frozen after step | bytes sent per device "
      "| vs AdamW | wall (CPU) |")
  add("|---|---|---|---|---|---|---|")
  for name, r in results.items():
    fz = r["freeze_step"]
    fz_s = "—" if fz is None else f"{fz} ({fz / cfg.steps:.1%})"
    rel = (r["final_val"] / base["final_val"] - 1) * 100
    red = base["total_bytes"] / r["total_bytes"]
    if r["final_val"] > 10 or not math.isfinite(r["final_val"]):
      val_s, rel_s = f"diverged ({r['final_val']:.3g})", "—"
    else:
      val_s, rel_s = f"{r['final_val']:.4f}", f"{rel:+.2f}%"
    add(f"| {r['label']} | {val_s} | {rel_s} | {fz_s} | "
        f"{_fmt_bytes(r['total_bytes'])} | {red:.2f}x less | {r['wall_s']:.0f}s "
        f"({r['cpu_s']:.0f}s) |")
  add("")
  add("## Goals\n")
  for goal in meta["goals"]:
    add(f"- {'PASS' if goal[1] else 'FAIL'}: {goal[0]}")
  add("")

  add("## When does the variance-ratio policy fire?\n")
  add("Replayed offline on the bias-corrected `||v_hat_t||_1` of run (a) (AdamW on the mean "
      "gradient: the same trajectory as 1-bit Adam's warmup, which is Adam on the mean "
      "gradient), with the rule of `onebit_optax/_freeze.py`: a check every Δ steps "
      "(t = kΔ), ρ_t = ||v_hat_t||_1 / ||v_hat_{t-Δ}||_1 against the value at the previous "
      "check, first possible at t = 2Δ, fires when t >= min_steps and τ <= ρ_t <= 1/τ. "
      f"Run length {cfg.steps} steps, LR warmup {cfg.lr_warmup}. Cells: freeze step "
      "(fraction of the run; communication reduction over the run vs AdamW); '—' = never.\n")
  add(f"Consistency check: the replay predicts {study['predicted_b']} for run (b)'s "
      f"settings; run (b) froze after step {results['onebit_ratio']['freeze_step']}.\n")
  for b2_key, title in (("b2", f"b2 = {cfg.b2} (the runs)"),
                        ("shadow", f"b2 = {cfg.shadow_b2} (shadow EMA of the mean g^2 "
                                   "in run (a); approximate: the run itself used "
                                   f"b2 = {cfg.b2})")):
    rows = study[b2_key]
    shape = study["trajectory_" + b2_key]
    add(f"**{title}.** ||v_hat_t||_1 starts at {shape['start']:.3g}, falls to a trough of "
        f"{shape['trough']:.3g} at step {shape['trough_step']}, and comes within 10% of its "
        f"late plateau ({shape['plateau']:.3g}, median of the last third) at step "
        f"{shape['plateau_step']}.\n")
    intervals = sorted({r["interval"] for r in rows})
    thresholds = sorted({r["threshold"] for r in rows})
    pick = lambda interval, t, m, k: next(
        r for r in rows if r["interval"] == interval and r["threshold"] == t
        and r["min_steps"] == m and r["patience"] == k)
    same = all(pick(i, t, 0, k)["freeze_step"] == pick(i, t, cfg.lr_warmup, k)["freeze_step"]
               for i in intervals for t in thresholds for k in (1, 2))
    for patience in (1, 2):
      for min_steps in ((cfg.lr_warmup,) if same else (0, cfg.lr_warmup)):
        what = ("the core's rule" if patience == 1 else
                "variant NOT in the core: two consecutive checks in the band")
        ms = (f"min_steps = {min_steps}" + (" (min_steps = 0 gives the same table)"
                                            if same else ""))
        add(f"{title}, {what}, {ms}:\n")
        add("| Δ \\ τ | " + " | ".join(f"{t}" for t in thresholds) + " |")
        add("|---|" + "---|" * len(thresholds))
        for interval in intervals:
          cells = []
          for t in thresholds:
            r = pick(interval, t, min_steps, patience)
            cells.append("—" if r["freeze_step"] is None else
                         f"{r['freeze_step']} ({r['fraction']:.0%}; {r['comm_reduction']:.1f}x)")
          add(f"| {interval} | " + " | ".join(cells) + " |")
        add("")

  if shift:
    add("## Corpus shift at half time: prose -> Python source\n")
    add(f"Branches of runs {', '.join(s['label'].split(' ')[0] for s in shift['runs'].values())} "
        f"continue from step {cfg.shift_step} on the `.py` files of the "
        "standard library (same schedule). Validation loss on held-out code "
        f"({shift['val_seqs']} windows):\n")
    add("| run | val (code) at shift | +10% of run | +25% | end | end vs AdamW |")
    add("|---|---|---|---|---|---|")
    a_end = shift["runs"]["adamw"]["final_val"]
    for name, s in shift["runs"].items():
      add(f"| {s['label']} | {s['at_shift']:.4f} | {s['plus10']:.4f} | {s['plus25']:.4f} "
          f"| {s['final_val']:.4f} | {(s['final_val'] / a_end - 1) * 100:+.2f}% |")
    add("")
    add("Staleness signal, no communication: each device's EMA of its *local* g^2 "
        f"(b2 = {cfg.b2}, bias-corrected) against the second moment the optimizer "
        "divides by (1-bit Adam: the frozen one). `l1` = ||v_local||_1 / ||nu_hat||_1, "
        "`median` = median over coordinates of v_local / nu_hat; both averaged over the 8 "
        "devices and normalised by their value at the freeze step (AdamW: at the shift "
        "step, it has no freeze); local gradients are noisier than the mean gradient, so "
        "the raw values sit above 1 (raw value at the reference step in brackets). "
        "`spread` = interquartile range / 1.349 over coordinates of log(v_local / nu_hat), not "
        "normalised (a global scale change leaves it alone; a preconditioner of the wrong "
        "shape widens it), at the reference step / before the shift / +10% / end. "
        "`dead` = coordinates with nu_hat == 0 (1-bit Adam leaves them at 0 update for "
        "good) that get a nonzero local gradient, at the end (mean over devices).\n")
    add("| run | ref step | l1 before shift | l1 +10% | l1 end | median before | median +10% "
        "| median end | spread ref / before / +10% / end | dead end |")
    add("|---|---|---|---|---|---|---|---|---|---|")
    for name, row in shift["staleness"].items():
      add(f"| {row['label']} | {row['ref_step']} | {row['l1_before']:.2f} "
          f"[{row['l1_ref_raw']:.2f}] | {row['l1_plus10']:.2f} | {row['l1_end']:.2f} | "
          f"{row['med_before']:.2f} [{row['med_ref_raw']:.2f}] | {row['med_plus10']:.2f} | "
          f"{row['med_end']:.2f} | {row['spread_ref']:.2f} / {row['spread_before']:.2f} / "
          f"{row['spread_plus10']:.2f} / {row['spread_end']:.2f} | {row['dead_end']:.0f} |")
    add("")
  return "\n".join(lines)


def plot(path, cfg, results, shift, study):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, ax = plt.subplots(2, 4, figsize=(24, 10))
  colors = dict(adamw="k", onebit_ratio="tab:blue", onebit_fixed="tab:green",
                naive="tab:red", no_feedback="tab:orange")
  for name, r in results.items():
    ax[0, 0].plot(r["eval_steps"], r["val"]["prose"], color=colors[name], label=r["label"])
    loss = np.asarray(r["loss"])
    k = max(1, cfg.steps // 60)
    smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
    ax[0, 1].plot(np.arange(k, len(loss) + 1), smooth, color=colors[name], label=r["label"])
    ax[0, 2].plot(np.arange(1, len(loss) + 1), np.cumsum(r["wire"]) / 1e6, color=colors[name],
                  label=r["label"])
    if r["freeze_step"]:
      for a in (ax[0, 0], ax[0, 1]):
        a.axvline(r["freeze_step"], color=colors[name], ls=":", lw=1)
  finals = [r["val"]["prose"][-1] for r in results.values() if r["val"]["prose"][-1] < 5]
  ax[0, 0].set_ylim(min(finals) - 0.05, max(finals) + 0.6)
  ax[0, 0].set(title="validation loss (prose); dotted: variance frozen", xlabel="step",
               ylabel="nats / byte")
  ax[0, 1].set_ylim(min(finals) - 0.2, max(finals) + 0.8)
  ax[0, 1].set(title="training loss (moving average)", xlabel="step")
  ax[0, 2].set(title="bytes sent per device, cumulative", xlabel="step", ylabel="MB")
  ax[0, 2].set_yscale("log")
  ax[0, 0].legend(fontsize=8)

  a = ax[1, 0]
  l1 = np.asarray(results["adamw"]["nu_hat_l1"])
  interval = study["interval_b"]
  for d, c in ((interval // 2, "tab:gray"), (interval, "tab:blue"), (2 * interval, "tab:purple")):
    if d < 1 or d >= len(l1):
      continue
    t = np.arange(d + 1, len(l1) + 1)
    a.plot(t, l1[d:] / l1[:-d], color=c, lw=1, label=f"||v̂_t||₁/||v̂_(t-{d})||₁ (run a)")
  rb = results["onebit_ratio"]
  ratio = np.asarray(rb["ratio"])
  a.plot(np.arange(1, len(ratio) + 1), ratio, "k.", ms=2, label="variance_ratio(state), run b")
  a.axhspan(cfg.ratio_threshold, 1 / cfg.ratio_threshold, color="tab:green", alpha=0.15,
            label=f"band [τ, 1/τ], τ={cfg.ratio_threshold}")
  if rb["freeze_step"]:
    a.axvline(rb["freeze_step"], color="tab:blue", ls=":", label="run b froze")
  a.axvline(cfg.lr_warmup, color="gray", ls="--", lw=1, label="min_steps = LR warmup")
  a.set_ylim(0.5, 1.6)
  a.set(title="variance-norm ratio", xlabel="step")
  a.legend(fontsize=7)

  if shift:
    a = ax[1, 1]
    for name, s in shift["runs"].items():
      a.plot(s["eval_steps"], s["val"], color=colors[name], label=s["label"])
    for name in shift["runs"]:
      r = results[name]
      a.plot(r["eval_steps"], r["val"]["code"], color=colors[name], ls=":", lw=1,
             label=f"{name}, no shift")
    a.axvline(cfg.shift_step, color="gray", ls="--", lw=1)
    a.set(title="validation loss on Python source (shift at dashed line)", xlabel="step")
    a.set_ylim(None, 3.5)
    a.legend(fontsize=7)
    a = ax[1, 2]
    for name, row in shift["staleness"].items():
      c = colors[row["method"]]
      ls = "-" if row["shift"] else ":"
      a.plot(row["steps"], row["median"], color=c, ls=ls, marker=".", ms=3, label=row["label"])
    a.axvline(cfg.shift_step, color="gray", ls="--", lw=1)
    a.set_yscale("log")
    a.set(title="staleness: median of v_local / nu_hat (normalised at the ref step)",
          xlabel="step")
    a.legend(fontsize=6)
    a = ax[1, 3]
    for name, row in shift["staleness"].items():
      a.plot(row["steps"], row["spread"], color=colors[row["method"]],
             ls="-" if row["shift"] else ":", label=row["label"])
    a.axvline(cfg.shift_step, color="gray", ls="--", lw=1)
    a.set(title="staleness: spread (IQR/1.349) of log(v_local / nu_hat)", xlabel="step")
    a.legend(fontsize=7)
  a = ax[0, 3]
  steps = np.arange(1, cfg.steps + 1)
  a.plot(steps, results["adamw"]["nu_hat_l1"], "k", label=f"||v̂_t||₁, b2={cfg.b2} (run a)")
  a.plot(steps, results["adamw"]["shadow_l1"], "k--", lw=1,
         label=f"||v̂_t||₁, b2={cfg.shadow_b2} (shadow EMA, run a)")
  for name in ("onebit_ratio", "onebit_fixed"):
    a.plot(steps, results[name]["nu_hat_l1"], color=colors[name], lw=1,
           label=f"{name}: nu_hat the optimizer uses")
  a.set_yscale("log")
  a.set(title="second-moment norm (bias-corrected)", xlabel="step")
  a.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


# ----------------------------------------------------------------------------


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="a short run (400 steps).")
  parser.add_argument("--steps", type=int, default=None, help="override the run length.")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                    "results"))
  parser.add_argument("--no-shift", action="store_true", help="skip the corpus-shift runs.")
  args = parser.parse_args(argv)
  cfg = Config(**(QUICK if args.quick else {}))
  if args.steps:
    cfg = dataclasses.replace(cfg, steps=args.steps)
  assert cfg.steps % cfg.chunk == 0, "steps must be a multiple of chunk"
  command = "python benchmarks/convergence.py" + " ".join([""] + (argv or sys.argv[1:]))
  wall0 = time.time()
  git = _git_describe()
  n = len(jax.devices())
  assert n == 8, f"expected 8 simulated devices, got {n}: import jax only after XLA_FLAGS is set"
  mesh = jax.make_mesh((n,), (AXIS,))

  prose_train, prose_val = model.split(model.load_corpus("prose"))
  code_train, code_val = model.split(model.load_corpus("code"))
  val_periodic = {"prose": model.val_batches(prose_val, cfg.seq_len, cfg.val_seqs_periodic, n),
                  "code": model.val_batches(code_val, cfg.seq_len, cfg.val_seqs_periodic, n)}
  val_full = model.val_batches(prose_val, cfg.seq_len, None, n)
  code_val_final = model.val_batches(code_val, cfg.seq_len, 4 * cfg.val_seqs_periodic, n)
  params = model.init_params(jax.random.key(cfg.seed), cfg.model)

  methods = make_methods(cfg)
  results, shift_runs, trainers = {}, {}, {}
  do_shift = not args.no_shift
  for method in methods:
    print(f"{method.label}", flush=True)
    trainer = Trainer(method, cfg, mesh, params)
    trainers[method.name] = trainer
    branch = do_shift and (method.name == "adamw" or method.name in cfg.shift_from)
    val_sets = val_periodic if branch else {"prose": val_periodic["prose"]}
    rec, snapshot = trainer.run(prose_train, val_sets,
                                snapshot_at=cfg.shift_step if branch else None)
    fparams, _ = rec.pop("final")
    rec.update(label=method.label, final_val=trainer.final_val(fparams, *val_full),
               final_val_code=trainer.final_val(fparams, *code_val_final) if branch else None,
               total_bytes=float(np.sum(rec["wire"])), freeze_step=_freeze_of(rec))
    if method.kind == "adamw":
      rec["freeze_step"] = None
    results[method.name] = rec
    if branch:
      print(f"{method.label}: corpus shift at step {cfg.shift_step}", flush=True)
      srec, _ = trainer.run(code_train, {"code": val_periodic["code"]}, start=snapshot,
                            first=cfg.shift_step, log_prefix="shift ")
      sparams, _ = srec.pop("final")
      srec["final_val"] = trainer.final_val(sparams, *code_val_final)
      shift_runs[method.name] = srec

  # The freeze criterion, offline.
  size = trainers["adamw"].size
  allreduce = onebit_optax.allreduce_wire_bytes(size, n)
  compressed = onebit_optax.compressed_wire_bytes(onebit_optax.padded_size(size, n), n)
  base_interval = int(round(1 / (1 - cfg.b2)))
  interval_b = cfg.ratio_interval or base_interval
  intervals = sorted({i for i in (25, 50, 100, 200, 400, 800, base_interval)
                      if 2 * i <= cfg.steps})
  thresholds = (0.9, 0.94, 0.96, 0.98)
  l1 = np.asarray(results["adamw"]["nu_hat_l1"])
  shadow = np.asarray(results["adamw"]["shadow_l1"])
  study = dict(
      b2=ratio_study(l1, cfg.steps, cfg.lr_warmup, intervals, thresholds, allreduce, compressed),
      shadow=ratio_study(shadow, cfg.steps, cfg.lr_warmup,
                         sorted(set(intervals) | ({1000} if cfg.steps >= 2000 else set())),
                         thresholds, allreduce, compressed),
      predicted_b=first_freeze(l1, interval_b, cfg.ratio_threshold, cfg.lr_warmup),
      trajectory_b2=describe_trajectory(l1), trajectory_shadow=describe_trajectory(shadow),
      interval_b=interval_b)

  # The corpus shift.
  shift = None
  if do_shift:
    shift = {"val_seqs": len(code_val_final[0]), "runs": {}, "staleness": {}}
    for name, srec in shift_runs.items():
      steps = np.asarray(srec["eval_steps"])
      val = np.asarray(srec["val"]["code"])
      at = lambda frac: float(val[min(len(val) - 1, np.searchsorted(
          steps, cfg.shift_step + frac * cfg.steps))])
      pre = results[name]
      shift["runs"][name] = dict(
          label=pre["label"].split(",")[0] + " + shift",
          eval_steps=[cfg.shift_step] + srec["eval_steps"],
          val=[pre["val"]["code"][pre["eval_steps"].index(cfg.shift_step)]] + srec["val"]["code"],
          at_shift=pre["val"]["code"][pre["eval_steps"].index(cfg.shift_step)],
          plus10=at(0.1), plus25=at(0.25), final_val=srec["final_val"],
          wall_s=srec["wall_s"], cpu_s=srec["cpu_s"],
          total_bytes_after_shift=float(np.sum(srec["wire"])))
    for name, with_shift in [(k, True) for k in shift_runs] + [(k, False) for k in shift_runs]:
      pre = results[name]
      steps = list(pre["probe_steps"])
      probe = np.asarray(pre["probe"])  # (evals, devices, 4)
      if with_shift:
        cut = steps.index(cfg.shift_step) + 1
        srec = shift_runs[name]
        steps = steps[:cut] + srec["probe_steps"]
        probe = np.concatenate([probe[:cut], np.asarray(srec["probe"])])
      mean = probe.mean(axis=1)
      ref_step = pre["freeze_step"] or cfg.shift_step
      ref = int(np.searchsorted(steps, ref_step))  # first probe at or after the freeze.
      l1_norm = mean[:, 0] / mean[ref, 0]
      med_norm = mean[:, 1] / mean[ref, 1]
      i_shift = steps.index(cfg.shift_step)
      i_10 = int(np.searchsorted(steps, cfg.shift_step + 0.1 * cfg.steps))
      label = pre["label"].split(",")[0] + (" + shift" if with_shift else ", no shift")
      shift["staleness"][f"{name}{'_shift' if with_shift else ''}"] = dict(
          label=label, method=name, shift=with_shift, steps=steps,
          l1=l1_norm.tolist(), median=med_norm.tolist(), dead=mean[:, 2].tolist(),
          raw=mean.tolist(), ref_step=steps[ref],
          l1_ref_raw=float(mean[ref, 0]), med_ref_raw=float(mean[ref, 1]),
          l1_before=float(l1_norm[i_shift]), l1_plus10=float(l1_norm[i_10]),
          l1_end=float(l1_norm[-1]), med_before=float(med_norm[i_shift]),
          med_plus10=float(med_norm[i_10]), med_end=float(med_norm[-1]),
          dead_end=float(mean[-1, 2]), spread=mean[:, 3].tolist(),
          spread_ref=float(mean[ref, 3]), spread_before=float(mean[i_shift, 3]),
          spread_plus10=float(mean[i_10, 3]), spread_end=float(mean[-1, 3]))

  base = results["adamw"]
  goals = []
  for name in ("onebit_ratio", "onebit_fixed"):
    r = results[name]
    rel = r["final_val"] / base["final_val"] - 1
    goals.append((f"{r['label']}: final val loss within 1.5% of AdamW's ({rel:+.2%})",
                  rel <= 0.015))
    red = base["total_bytes"] / r["total_bytes"]
    goals.append((f"{r['label']}: >= 5x less communication than AdamW ({red:.2f}x)", red >= 5))
  best = min(results["onebit_ratio"]["final_val"], results["onebit_fixed"]["final_val"])
  for name in ("naive", "no_feedback"):
    r = results[name]
    rel = r["final_val"] / best - 1
    how = "diverged" if r["final_val"] > 10 else f"{rel:+.2%} final val loss"
    goals.append((f"{r['label']}: visibly worse than 1-bit Adam "
                  f"({how} vs the better 1-bit run; bar: > +1.5%)", rel > 0.015))

  wall = time.time() - wall0
  meta = dict(quick=args.quick, command=command, params=size, prose_bytes=
              len(prose_train) + len(prose_val), git=git, wall_s=wall,
              val_seqs=len(val_full[0]), goals=goals)
  md = build_report(cfg, results, study, shift, meta)
  os.makedirs(args.out, exist_ok=True)
  stem = os.path.join(args.out, "convergence_quick" if args.quick else "convergence")
  with open(stem + ".md", "w") as f:
    f.write(md + "\n\n![curves](" + os.path.basename(stem) + ".png)\n")
  plot(stem + ".png", cfg, results, shift, study)

  def clean(x):
    if isinstance(x, float):
      return float(f"{x:.6g}") if math.isfinite(x) else None
    if isinstance(x, dict):
      return {k: clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
      return [clean(v) for v in x]
    return x

  with open(stem + ".json", "w") as f:
    json.dump(clean(dict(config=dataclasses.asdict(cfg), meta=meta, results=results,
                         shift=shift, ratio_study=study)), f)
  print()
  print(md)
  print(f"\nwrote {stem}.md, .json, .png  (total {wall / 60:.1f} min)")


if __name__ == "__main__":
  main()
