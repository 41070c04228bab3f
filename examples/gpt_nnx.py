"""A character-level GPT in Flax NNX, trained data-parallel with 1-bit Adam.

The corpus is CPython's own documentation (``pydoc_data.topics``, shipped with
Python: nothing is downloaded); the last 10% is held out for validation. The
model is replicated on every device of a 1-D ``data`` mesh (8 simulated CPU
devices by default) and each device takes the gradient of its own slice of the
batch; the optimizer does the communication.

    python examples/gpt_nnx.py                          # 1-bit Adam, variance-ratio freeze
    python examples/gpt_nnx.py --optimizer adamw        # the full-precision baseline
    python examples/gpt_nnx.py --freeze-step 300        # DeepSpeed's fixed freeze step
    python examples/gpt_nnx.py --d-model 256 --layers 6 --block-size 256 --steps 5000

Stable at larger width and learning rate: the queries and keys are
layer-normalised per head before the attention logits (QK-LayerNorm, Dehghani
et al. 2023; Wortsman et al. 2023), so the logits cannot grow with the weights
and the attention cannot collapse onto one position, the instability that
stalls AdamW at high learning rates; and the gradient is clipped at global norm
1.0 (``--clip``), against the spikes that otherwise inflate Adam's second
moment.

Three things make 1-bit Adam work with NNX (see ``build_steps``):

1. ``nnx.Optimizer`` calls ``tx.init`` in its constructor, and 1-bit Adam's
   ``init`` needs the mesh axis (its error buffers depend on the device count).
   So the optimizer is *constructed inside* ``nnx.shard_map``, whose
   ``out_specs`` shard the per-device buffers (``local_momentum``,
   ``worker_scale``, the error buffers) over ``data`` and replicate the rest (what ``onebit_optax.state_partition_specs`` says for a
   plain optax state).
2. The gradient must be *local*. ``nnx.grad`` of the replicated model inside
   ``shard_map`` would all-reduce the gradient in float32 in the backward pass.
   The step splits the model, marks the parameters as per-device with
   ``onebit_optax.local_params``, differentiates, and hands the local gradient to
   ``optimizer.update`` (1-bit Adam averages it; for Adam we ``pmean`` it).
   Clipping happens on the local gradient with ``onebit_optax.clip_by_global_norm``,
   whose factor is agreed across devices (one scalar all-reduce), so Adam and
   1-bit Adam's warmup see the same clipped mean gradient.
3. The step reads the state's counters inside ``jit`` with
   ``optax.tree_utils.tree_get`` on ``nnx.as_pure(optimizer.opt_state)`` (NNX
   wraps every optimizer-state leaf in a ``Variable``); on the host,
   ``onebit_optax.status(optimizer.opt_state)`` summarises the same fields.
"""

from __future__ import annotations

import argparse
import sys
import time

try:
  from examples import _data
except ImportError:  # run as a script: python examples/gpt_nnx.py
  import _data

if __name__ == "__main__":  # Simulated CPU devices: XLA reads the flag when JAX starts.
  _data.force_host_devices(sys.argv[1:])

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

import onebit_optax

AXIS = "data"


class CausalSelfAttention(nnx.Module):
  """Multi-head self-attention where position t only sees positions <= t.

  Queries and keys are layer-normalised per head (QK-LayerNorm): the attention
  logits stay O(sqrt(head_dim)) however large the projections grow.
  """

  def __init__(self, d_model: int, num_heads: int, *, rngs: nnx.Rngs):
    self.num_heads = num_heads
    self.qkv = nnx.Linear(d_model, 3 * d_model, rngs=rngs)
    self.q_norm = nnx.LayerNorm(d_model // num_heads, rngs=rngs)
    self.k_norm = nnx.LayerNorm(d_model // num_heads, rngs=rngs)
    self.out = nnx.Linear(d_model, d_model, rngs=rngs)

  def __call__(self, x):
    b, t, d = x.shape
    q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
    heads = lambda z: z.reshape(b, t, self.num_heads, d // self.num_heads)
    y = jax.nn.dot_product_attention(self.q_norm(heads(q)), self.k_norm(heads(k)), heads(v),
                                     is_causal=True)
    return self.out(y.reshape(b, t, d))


class Block(nnx.Module):
  """Pre-LayerNorm transformer block: attention then a 4x MLP, both residual."""

  def __init__(self, d_model: int, num_heads: int, *, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
    self.attn = CausalSelfAttention(d_model, num_heads, rngs=rngs)
    self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
    self.fc = nnx.Linear(d_model, 4 * d_model, rngs=rngs)
    self.proj = nnx.Linear(4 * d_model, d_model, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.ln1(x))
    return x + self.proj(jax.nn.gelu(self.fc(self.ln2(x))))


class CharTransformer(nnx.Module):
  """A GPT: token + learned position embeddings, causal blocks, a linear head to logits."""

  def __init__(self, vocab_size: int, *, d_model: int = 64, num_layers: int = 2,
               num_heads: int = 4, block_size: int = 64, rngs: nnx.Rngs):
    self.tokens = nnx.Embed(vocab_size, d_model, rngs=rngs)
    self.positions = nnx.Embed(block_size, d_model, rngs=rngs)
    self.blocks = nnx.List([Block(d_model, num_heads, rngs=rngs) for _ in range(num_layers)])
    self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)
    self.head = nnx.Linear(d_model, vocab_size, rngs=rngs)

  def __call__(self, ids):  # (batch, time) int32 -> (batch, time, vocab) logits
    x = self.tokens(ids) + self.positions(jnp.arange(ids.shape[1]))
    for block in self.blocks:
      x = block(x)
    return self.head(self.ln_f(x))


def next_char_loss(model, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--optimizer", choices=("adam", "adamw", "onebit"), default="onebit")
  p.add_argument("--steps", type=int, default=1500)
  p.add_argument("--batch-size", type=int, default=64, help="global batch (split over devices)")
  p.add_argument("--devices", type=int, default=8, help="data-parallel devices (simulated on CPU)")
  p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
  p.add_argument("--warmup-steps", type=int, default=None, help="LR warmup (default: 10%% of steps)")
  p.add_argument("--b2", type=float, default=0.99)
  p.add_argument("--weight-decay", type=float, default=0.01, help="adamw and onebit only")
  p.add_argument("--clip", type=float, default=1.0,
                 help="global gradient-norm clipping (0: none)")
  p.add_argument("--freeze-step", type=int, default=None,
                 help="fixed freeze step; default: the variance-ratio policy")
  p.add_argument("--freeze-threshold", type=float, default=0.96)
  p.add_argument("--freeze-interval", type=int, default=None,
                 help="ratio interval in steps (default min(ceil(warmup/4), 1/(1-b2)))")
  p.add_argument("--d-model", type=int, default=64)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--block-size", type=int, default=64)
  p.add_argument("--eval-every", type=int, default=100)
  p.add_argument("--eval-batches", type=int, default=4)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  args = p.parse_args(argv)
  if args.warmup_steps is None:
    args.warmup_steps = max(1, args.steps // 10)
  return args


def make_optimizer(args):
  """Adam, AdamW or 1-bit Adam with linear LR warmup then cosine decay to 10% of the peak."""
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, args.lr, args.warmup_steps, max(args.steps, args.warmup_steps + 1), args.lr * 0.1)
  # Decay matrices only, not biases and LayerNorm scales.
  decay_mask = lambda params: jax.tree.map(lambda x: jnp.ndim(x) > 1, params)
  if args.optimizer == "adam":
    return optax.adam(schedule, b2=args.b2)
  if args.optimizer == "adamw":
    return optax.adamw(schedule, b2=args.b2, weight_decay=args.weight_decay, mask=decay_mask)
  if args.freeze_step is not None:
    freeze = onebit_optax.fixed_step_freeze(args.freeze_step)
  else:  # Never before the LR warmup is over: the variance is still moving with the LR.
    freeze = onebit_optax.variance_ratio_freeze(
        args.warmup_steps, threshold=args.freeze_threshold, interval=args.freeze_interval)
  return onebit_optax.onebit_adam(schedule, b2=args.b2, weight_decay=args.weight_decay,
                                  mask=decay_mask, axis_name=AXIS, freeze=freeze)


# The per-device leaves of a 1-bit Adam state (local_momentum, one entry per
# compressed leaf, its worker_scale, and the error buffers) are sharded over
# the data axis; everything else (the moments mu and nu, the momentum message,
# the counters) is replicated. For a plain optax state,
# onebit_optax.state_partition_specs(opt_state, AXIS) gives this; an
# nnx.Optimizer's state is an nnx.State, which NNX shards with filters.
OPTIMIZER_SPECS = nnx.StateSharding({
    nnx.PathContains("local_momentum"): P(AXIS),
    nnx.PathContains("worker_scale"): P(AXIS),
    nnx.PathContains("worker_error"): P(AXIS),
    nnx.PathContains("server_error"): P(AXIS),
    ...: P(),
})


def build_steps(mesh, tx, onebit: bool, clip: float = 0.0):
  """The jitted, shard_mapped functions: optimizer construction, train step, eval step.

  ``clip`` > 0 clips the local gradients by one factor agreed across devices
  (:func:`onebit_optax.clip_by_global_norm`) before they are averaged.
  """

  @nnx.jit
  @nnx.shard_map(mesh=mesh, in_specs=P(), out_specs=OPTIMIZER_SPECS)
  def create_optimizer(model):
    return nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  @nnx.shard_map(mesh=mesh, in_specs=(P(), OPTIMIZER_SPECS, P(AXIS), P(AXIS)), out_specs=P())
  def train_step(model, optimizer, x, y):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss_fn = lambda params: next_char_loss(nnx.merge(graphdef, params, rest), x, y)
    # Local gradient: without local_params, the backward pass would all-reduce it.
    loss, grads = jax.value_and_grad(loss_fn)(onebit_optax.local_params(params, AXIS))
    if clip > 0:
      clipper = onebit_optax.clip_by_global_norm(clip, axis_name=AXIS)
      grads, _ = clipper.update(grads, clipper.init(None))
    if not onebit:  # Adam needs the mean gradient; 1-bit Adam averages by itself.
      grads = jax.lax.pmean(grads, AXIS)
    optimizer.update(model, grads)
    stats = {"loss": jax.lax.pmean(loss, AXIS)}
    if onebit:
      state = nnx.as_pure(optimizer.opt_state)
      field = lambda name: optax.tree_utils.tree_get(state, name)  # traced, inside jit
      stats.update(frozen=field("frozen"), freeze_step=field("freeze_step"),
                   ratio=field("variance_ratio"), wire_bytes=field("wire_bytes"))
    return stats

  @nnx.jit
  @nnx.shard_map(mesh=mesh, in_specs=(P(), P(AXIS), P(AXIS)), out_specs=P())
  def eval_step(model, x, y):
    return jax.lax.pmean(next_char_loss(model, x, y), AXIS)

  return create_optimizer, train_step, eval_step


def main(argv=None) -> dict:
  """Trains, prints a summary line and returns the numbers (for tests and benchmarks)."""
  args = parse_args(sys.argv[1:] if argv is None else argv)
  if args.devices > jax.device_count():
    raise SystemExit(
        f"--devices {args.devices} but JAX sees {jax.device_count()} device(s). Simulated CPU "
        "devices are set by XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts "
        "(running this file as a script does it).")
  if args.batch_size % args.devices:
    raise SystemExit(f"--batch-size {args.batch_size} must be a multiple of --devices {args.devices}")
  mesh = jax.make_mesh((args.devices,), (AXIS,), devices=jax.devices()[:args.devices])
  data_sharding = NamedSharding(mesh, P(AXIS))
  onebit = args.optimizer == "onebit"

  corpus = _data.load_corpus()
  model = CharTransformer(corpus.vocab_size, d_model=args.d_model, num_layers=args.layers,
                          num_heads=args.heads, block_size=args.block_size,
                          rngs=nnx.Rngs(args.seed))
  num_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  tx = make_optimizer(args)
  create_optimizer, train_step, eval_step = build_steps(mesh, tx, onebit, args.clip)
  optimizer = create_optimizer(model)

  rng = np.random.default_rng(args.seed)
  val_windows = _data.fixed_windows(corpus.val, args.eval_batches, args.batch_size,
                                    args.block_size + 1)

  def evaluate():
    losses = [eval_step(model, *(jax.device_put(a, data_sharding) for a in (w[:, :-1], w[:, 1:])))
              for w in val_windows]
    return float(np.mean(jax.device_get(losses)))

  # Adam's bytes per device per step: a float32 ring all-reduce sends 2 (n-1)/n of the buffer.
  allreduce_bytes = 2.0 * (args.devices - 1) / args.devices * 4 * num_params
  start = time.perf_counter()
  val_history = [(0, evaluate())]
  train_losses, ratio_history, sent_bytes, stats = [], [], 0.0, {}
  progress = tqdm(range(1, args.steps + 1), desc=f"gpt {args.optimizer}", disable=args.no_progress,
                  mininterval=0.5, dynamic_ncols=True)
  for step in progress:
    w = _data.random_windows(corpus.train, rng, args.batch_size, args.block_size + 1)
    x, y = (jax.device_put(a, data_sharding) for a in (w[:, :-1], w[:, 1:]))
    stats = jax.device_get(train_step(model, optimizer, x, y))
    train_losses.append(float(stats["loss"]))
    sent_bytes += float(stats["wire_bytes"]) if onebit else allreduce_bytes
    if step % args.eval_every == 0 or step == args.steps:
      val_history.append((step, evaluate()))
    postfix = {"loss": f"{train_losses[-1]:.3f}", "val": f"{val_history[-1][1]:.3f}"}
    if onebit and not np.isnan(stats["ratio"]) and (
        not ratio_history or ratio_history[-1][1] != float(stats["ratio"])):
      ratio_history.append((step, float(stats["ratio"])))
    if onebit:
      postfix["phase"] = "compression" if stats["frozen"] else "warmup"
      postfix["ratio"] = "-" if np.isnan(stats["ratio"]) else f"{float(stats['ratio']):.3f}"
    progress.set_postfix(postfix, refresh=False)
  progress.close()
  wall = time.perf_counter() - start

  freeze = int(stats["freeze_step"]) if onebit and stats["frozen"] else None
  result = {
      "example": "gpt_nnx", "optimizer": args.optimizer, "steps": args.steps,
      "devices": args.devices, "num_params": num_params,
      "initial_val_loss": val_history[0][1], "val_loss": val_history[-1][1],
      "val_history": val_history, "train_losses": train_losses,
      "freeze_step": freeze, "frozen": bool(onebit and stats["frozen"]),
      "ratio_history": ratio_history,
      "bytes_per_device": sent_bytes, "bytes_total": sent_bytes * args.devices,
      "allreduce_bytes_per_device": allreduce_bytes * args.steps, "wall_time_s": wall,
  }
  print(summary_line(result), flush=True)
  return result


def summary_line(r: dict) -> str:
  saving = r["allreduce_bytes_per_device"] / max(r["bytes_per_device"], 1.0)
  wire = "fp32 all-reduce" if r["optimizer"] != "onebit" else f"{saving:.1f}x less than Adam"
  return (f"[{r['example']}] {r['optimizer']}: val loss {r['initial_val_loss']:.4f} -> "
          f"{r['val_loss']:.4f} after {r['steps']} steps | freeze step {r['freeze_step']} | "
          f"sent {r['bytes_total'] / 1e6:.2f} MB over {r['devices']} devices "
          f"({r['bytes_per_device'] / 1e6:.2f} MB each, {wire}) "
          f"| {r['num_params']} params | {r['wall_time_s']:.1f} s")


if __name__ == "__main__":
  main()
