"""A character-level BERT (masked language model) in Flax linen, trained data-parallel with 1-bit Adam.

The paper's setting, in miniature: a bidirectional transformer encoder that
predicts 15% masked characters (BERT's 80/10/10 recipe), on CPython's own
documentation (``pydoc_data.topics``, shipped with Python; the last 10% is held
out). The state is a plain ``flax.training.train_state.TrainState``; each of the
8 simulated CPU devices (by default) differentiates its slice of the batch and
1-bit Adam does the communication.

    python examples/bert_linen.py                       # 1-bit Adam, variance-ratio freeze
    python examples/bert_linen.py --optimizer adamw     # the full-precision baseline
    python examples/bert_linen.py --freeze-step 300     # fixed freeze at 20% of the run
    python examples/bert_linen.py --d-model 256 --layers 4 --block-size 128 --steps 5000

Stable at larger width and learning rate, as in ``gpt_nnx.py``: queries and
keys layer-normalised per head (``normalize_qk``, QK-LayerNorm) and global
gradient-norm clipping at 1.0 (``--clip``).

The variance-ratio policy checks every min(ceil(warmup / 4), 1/(1 - b2)) steps
(38 here): in the default 1500-step run it froze after step 228 (15% of the
run, 5.5x less traffic than Adam). DeepSpeed's BERT recipes freeze at a fixed
step (15-25% of the run): pass ``--freeze-step``.

What 1-bit Adam needs from a linen training loop (see ``main`` and ``build_steps``):

1. ``TrainState.create`` calls ``tx.init`` outside the mesh, but 1-bit Adam's
   ``init`` needs the mesh axis. Build the ``TrainState`` directly with the
   state from ``onebit_optax.init_sharded`` (what ``create`` would do inside
   ``shard_map``); ``onebit_optax.state_partition_specs(state, 'data')`` then
   gives the specs of the whole ``TrainState``.
2. Differentiate with respect to ``onebit_optax.local_params(params, 'data')``
   so the gradient stays local (otherwise the backward pass all-reduces it in
   float32). ``apply_gradients`` then hands it to 1-bit Adam, which averages it;
   Adam gets an explicit ``pmean``. Clipping is on the local gradients with
   ``onebit_optax.clip_by_global_norm`` (one factor agreed across devices).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

try:
  from examples import _data
except ImportError:  # run as a script: python examples/bert_linen.py
  import _data

if __name__ == "__main__":  # Simulated CPU devices: XLA reads the flag when JAX starts.
  _data.force_host_devices(sys.argv[1:])

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

import onebit_optax

AXIS = "data"


class EncoderBlock(nn.Module):
  """Pre-LayerNorm encoder block: bidirectional self-attention, then a 4x MLP."""

  d_model: int
  num_heads: int

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    # No mask: sees both ways. QK-LayerNorm keeps the attention logits bounded.
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.num_heads, normalize_qk=True)(h)
    h = nn.LayerNorm()(x)
    return x + nn.Dense(self.d_model)(nn.gelu(nn.Dense(4 * self.d_model)(h)))


class CharBert(nn.Module):
  """Token + position embeddings, encoder blocks, a head over the vocabulary.

  The input vocabulary has one extra id, ``vocab_size``, for the [MASK] token.
  """

  vocab_size: int
  d_model: int = 64
  num_layers: int = 2
  num_heads: int = 4
  max_len: int = 64

  @property
  def mask_id(self) -> int:
    return self.vocab_size

  @nn.compact
  def __call__(self, ids):  # (batch, time) int32 -> (batch, time, vocab) logits
    x = nn.Embed(self.vocab_size + 1, self.d_model)(ids)
    x = x + nn.Embed(self.max_len, self.d_model)(jnp.arange(ids.shape[1]))
    for _ in range(self.num_layers):
      x = EncoderBlock(self.d_model, self.num_heads)(x)
    return nn.Dense(self.vocab_size)(nn.LayerNorm()(x))


def masked_lm_loss(logits, targets, weights):
  """Cross-entropy on the masked positions only (BERT's MLM loss)."""
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  return jnp.sum(losses * weights) / jnp.maximum(jnp.sum(weights), 1.0)


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
  p.add_argument("--mask-rate", type=float, default=0.15)
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


def create_train_state(model, params, tx, mesh) -> TrainState:
  """``TrainState.create``, except that the optimizer state is initialised on the mesh."""
  params = jax.device_put(params, NamedSharding(mesh, P()))
  return TrainState(step=jax.device_put(jnp.zeros([], jnp.int32), NamedSharding(mesh, P())),
                    apply_fn=model.apply, params=params, tx=tx,
                    opt_state=onebit_optax.init_sharded(tx, params, mesh, AXIS))


def build_steps(mesh, state_specs, apply_fn, onebit: bool, clip: float = 0.0):
  """The jitted, shard_mapped train and eval steps.

  ``clip`` > 0 clips the local gradients by one factor agreed across devices
  (:func:`onebit_optax.clip_by_global_norm`) before they are averaged.
  """

  batch_specs = (P(AXIS), P(AXIS), P(AXIS))

  @functools.partial(jax.jit, donate_argnums=0)
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(state_specs, *batch_specs),
                     out_specs=(state_specs, P()))
  def train_step(state, inputs, targets, weights):
    loss_fn = lambda params: masked_lm_loss(
        state.apply_fn({"params": params}, inputs), targets, weights)
    # Local gradient: without local_params, the backward pass would all-reduce it.
    loss, grads = jax.value_and_grad(loss_fn)(onebit_optax.local_params(state.params, AXIS))
    if clip > 0:
      clipper = onebit_optax.clip_by_global_norm(clip, axis_name=AXIS)
      grads, _ = clipper.update(grads, clipper.init(None))
    if not onebit:  # Adam needs the mean gradient; 1-bit Adam averages by itself.
      grads = jax.lax.pmean(grads, AXIS)
    state = state.apply_gradients(grads=grads)
    stats = {"loss": jax.lax.pmean(loss, AXIS)}
    if onebit:
      # The state's counters, traced inside jit (onebit_optax.status reads them on the host).
      field = lambda name: optax.tree_utils.tree_get(state.opt_state, name)
      stats.update(frozen=field("frozen"), freeze_step=field("freeze_step"),
                   ratio=field("variance_ratio"), wire_bytes=field("wire_bytes"))
    return state, stats

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), *batch_specs), out_specs=P())
  def eval_step(params, inputs, targets, weights):
    logits = apply_fn({"params": params}, inputs)
    return jax.lax.pmean(masked_lm_loss(logits, targets, weights), AXIS)

  return train_step, eval_step


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
  model = CharBert(corpus.vocab_size, d_model=args.d_model, num_layers=args.layers,
                   num_heads=args.heads, max_len=args.block_size)
  params = model.init(jax.random.key(args.seed), jnp.zeros((1, args.block_size), jnp.int32))
  params = params["params"]
  num_params = sum(x.size for x in jax.tree.leaves(params))
  state = create_train_state(model, params, make_optimizer(args), mesh)
  train_step, eval_step = build_steps(
      mesh, onebit_optax.state_partition_specs(state, AXIS), model.apply, onebit, args.clip)

  rng = np.random.default_rng(args.seed)
  mask = functools.partial(_data.mask_tokens, mask_id=model.mask_id,
                           vocab_size=corpus.vocab_size, rate=args.mask_rate)
  # A fixed validation set: the same windows and the same masks at every evaluation.
  val_rng = np.random.default_rng(12345)
  val_batches = [mask(w, val_rng) for w in _data.fixed_windows(
      corpus.val, args.eval_batches, args.batch_size, args.block_size)]

  def put(batch):
    return tuple(jax.device_put(a, data_sharding) for a in batch)

  def evaluate():
    return float(np.mean(jax.device_get([eval_step(state.params, *put(b)) for b in val_batches])))

  # Adam's bytes per device per step: a float32 ring all-reduce sends 2 (n-1)/n of the buffer.
  allreduce_bytes = 2.0 * (args.devices - 1) / args.devices * 4 * num_params
  start = time.perf_counter()
  val_history = [(0, evaluate())]
  train_losses, ratio_history, sent_bytes, stats = [], [], 0.0, {}
  progress = tqdm(range(1, args.steps + 1), desc=f"bert {args.optimizer}",
                  disable=args.no_progress, mininterval=0.5, dynamic_ncols=True)
  for step in progress:
    w = _data.random_windows(corpus.train, rng, args.batch_size, args.block_size)
    state, stats = train_step(state, *put(mask(w, rng)))
    stats = jax.device_get(stats)
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
      "example": "bert_linen", "optimizer": args.optimizer, "steps": args.steps,
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
