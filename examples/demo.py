#!/usr/bin/env python3
"""Adam vs 1-bit Adam, data-parallel on simulated CPU devices, on a real text corpus.

    python3 dev.py demo                       # both optimizers, 8 devices, defaults
    python3 dev.py demo --optimizer onebit --steps 600 --freeze-step 100
    python3 dev.py demo --nodes 2             # 2 nodes x 4 devices: bytes between nodes only

Each kind of run saves its own figure (``onebit_optax_demo_8dev.png``,
``onebit_optax_demo_2x4dev.png``... in the temp directory; ``--figure`` to choose).

The model is a small character-level language model (a Bengio-style MLP over
the previous ``--context`` characters) trained on CPython's own documentation
(``pydoc_data.topics``, ~465 kB of English prose that ships with Python, so
nothing is downloaded). The first 90% of the text is the training split, the
last 10% the validation split.

Both optimizers see exactly the same batches, initial parameters and
learning-rate schedule, and run the same ``jax.shard_map`` step over a 1-D
``'data'`` mesh: every device computes the gradient of its shard of the batch.

* Adam averages the local gradients with a float32 all-reduce (``pmean``) on
  every step, then applies ``optax.adam``.
* 1-bit Adam gets the *local* gradients and does the communication itself:
  a full-precision all-reduce while it warms up, then, once the variance is
  frozen, only the 1-bit signs of the momentum (plus one scale per leaf and chunk).

The devices are simulated (``--xla_force_host_platform_device_count``), so the
wall time says nothing about a network; the bytes are what each device would
put on the wire (ring model for the all-reduce), read from the optimizer state
every step.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import sys
import tempfile
import time


def _parse_args(argv):
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n", 1)[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--devices", type=int, default=8,
                      help="size of the data-parallel mesh (simulated CPU devices)")
  parser.add_argument("--nodes", type=int, default=1,
                      help="split the devices into this many simulated nodes: 1-bit Adam then "
                      "averages in float32 inside a node and in 1 bit between nodes "
                      "(axis_name=('node', 'local')); 1 (default) is flat")
  parser.add_argument("--optimizer", choices=("both", "adam", "onebit"), default="both")
  parser.add_argument("--steps", type=int, default=1000, help="training steps per optimizer")
  parser.add_argument("--batch", type=int, default=256,
                      help="global batch (windows per step), split over the devices")
  parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
  parser.add_argument("--lr-warmup", type=int, default=None,
                      help="linear LR warmup steps (default: 5%% of --steps)")
  parser.add_argument("--freeze-step", type=int, default=None,
                      help="freeze the variance after exactly this step instead of using "
                      "the variance-ratio policy")
  parser.add_argument("--freeze-interval", type=int, default=None,
                      help="variance-ratio check interval (default: --steps // 20)")
  parser.add_argument("--context", type=int, default=16, help="characters of context")
  parser.add_argument("--hidden", type=int, default=256, help="width of the hidden layers")
  parser.add_argument("--log-every", type=int, default=10,
                      help="steps between progress-bar refreshes (each one waits for the device)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--figure", default=None,
                      help="where to save the figure (loss curves, freeze step, bytes sent); "
                      "default: onebit_optax_demo_<run>.png in the temp directory, <run> "
                      "naming the mesh (8dev, 2x4dev) and the optimizers")
  parser.add_argument("--check-replicas-every", type=int, default=100,
                      help="steps between checks that every device holds the same "
                      "parameters (0: only at the end)")
  args = parser.parse_args(argv)
  if args.devices < 1 or args.steps < 1:
    parser.error("--devices and --steps must be positive")
  if args.batch % args.devices:
    parser.error(f"--batch {args.batch} must be a multiple of --devices {args.devices}")
  if args.freeze_step is not None and args.freeze_step < 1:
    parser.error("--freeze-step must be >= 1")
  if args.figure is None:  # one file per kind of run: a flat and a --nodes run do not overwrite
    args.figure = os.path.join(tempfile.gettempdir(), f"onebit_optax_demo_{run_tag(args)}.png")
  return args


def run_tag(args) -> str:
  """Names the run in file names: ``8dev``, ``2x4dev``, plus the optimizer if only one runs."""
  mesh = (f"{args.nodes}x{args.devices // args.nodes}dev" if args.nodes > 1
          else f"{args.devices}dev")
  return mesh if args.optimizer == "both" else f"{mesh}_{args.optimizer}"


def mesh_description(args, platform=None) -> str:
  """``8 CPU devices``, or ``2 nodes x 4 CPU devices`` for a hierarchical run."""
  platform = platform or jax.devices()[0].platform.upper()
  if args.nodes > 1:
    return f"{args.nodes} nodes x {args.devices // args.nodes} {platform} devices"
  return f"{args.devices} {platform} devices"


def bytes_note(args) -> str:
  """What the byte rows count: every device's traffic, or only the slow axis's (--nodes)."""
  if args.nodes > 1:
    return ("bytes: what each device sends over the slow 'node' axis (between nodes) only; "
            "the float32 traffic inside a node ('local' axis) is not counted (Adam: its "
            "1/L slice after a reduce-scatter inside the node, L = devices per node)")
  return "bytes: what each device sends per step (ring all-reduce model for float32)"


def _simulate_cpu_devices(count: int) -> None:
  """Asks XLA for ``count`` host devices; must run before jax is imported.

  An XLA_FLAGS that already sets the device count wins (the caller knows
  better, e.g. the test suite's conftest); ``main`` then checks that there are
  enough devices for ``--devices``.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (
        f"{flags} --xla_force_host_platform_device_count={count}".strip())
  os.environ.setdefault("JAX_PLATFORMS", "cpu")


# The device count is fixed when jax initialises its backend, so the flag must be
# set before the first `import jax`, hence the imports below the argument parsing.
if __name__ == "__main__":
  _simulate_cpu_devices(_parse_args(sys.argv[1:]).devices)

import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
from tqdm import tqdm  # noqa: E402

import onebit_optax  # noqa: E402

AXIS = "data"


def data_axes(mesh):
  """The optimizer's ``axis_name``: ``'data'``, or ``('node', 'local')`` (hierarchical)."""
  return tuple(mesh.axis_names) if len(mesh.axis_names) == 2 else AXIS
# How many steps the host may queue ahead of the devices. Some lookahead hides
# the Python loop behind the computation, but not much: XLA's CPU runtime
# launches every device's program from one shared pool of (here) one thread per
# device, and with dozens of queued steps a launch blocked on the per-device
# in-flight limit can hold a pool thread while the other devices wait for it in
# a collective. On these machines that aborted the process after 40 s
# ("Termination timeout for all reduce") with 50 queued 1-bit steps.
MAX_IN_FLIGHT = 4
EVAL_WINDOWS = 8192  # per split, for the final losses and accuracies
LAST_STEPS = 50  # the table also shows the mean training-batch loss over these


# --------------------------------------------------------------------------- data


def load_corpus(context: int):
  """Character ids of CPython's pydoc topics, split 90/10 into train and validation.

  The split is contiguous (not random windows) so that no validation window
  overlaps a training window. The vocabulary is every character of the text
  (103); a few occur once or twice, so their embedding rows see a gradient on
  almost no step, which 1-bit Adam's compression must not turn into noise.
  """
  import pydoc_data.topics  # pylint: disable=g-import-not-at-top

  text = "".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
  vocab = sorted(set(text))
  lookup = {c: i for i, c in enumerate(vocab)}
  ids = np.fromiter((lookup[c] for c in text), dtype=np.int32, count=len(text))
  cut = int(0.9 * len(ids))
  train, val = ids[:cut], ids[cut:]
  assert len(val) > context + 1
  return train, val, len(vocab)


def windows(ids: np.ndarray, starts: np.ndarray, context: int):
  """Inputs ``ids[s : s + context]`` and targets ``ids[s + context]`` for each start."""
  x = ids[starts[:, None] + np.arange(context)]
  y = ids[starts + context]
  return x, y


def eval_set(ids: np.ndarray, size: int, context: int, seed: int):
  """A fixed sample of ``size`` windows, the same for every optimizer."""
  starts = np.random.default_rng(seed).integers(0, len(ids) - context, size=size)
  return windows(ids, starts, context)


# -------------------------------------------------------------------------- model


def init_params(key, vocab: int, context: int, hidden: int, embed: int = 16):
  """An MLP language model: embed each context char, concatenate, 2 hidden layers."""
  keys = jax.random.split(key, 4)

  def dense(k, fan_in, fan_out):
    return {"w": jax.random.normal(k, (fan_in, fan_out)) / math.sqrt(fan_in),
            "b": jnp.zeros((fan_out,))}

  return {
      "embed": jax.random.normal(keys[0], (vocab, embed)),
      "h1": dense(keys[1], context * embed, hidden),
      "h2": dense(keys[2], hidden, hidden),
      "out": dense(keys[3], hidden, vocab),
  }


def logits_fn(params, x):
  h = params["embed"][x].reshape(x.shape[0], -1)
  h = jax.nn.gelu(h @ params["h1"]["w"] + params["h1"]["b"])
  h = jax.nn.gelu(h @ params["h2"]["w"] + params["h2"]["b"])
  return h @ params["out"]["w"] + params["out"]["b"]


def loss_fn(params, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits_fn(params, x), y).mean()


# ----------------------------------------------------------------------- training


def make_optimizer(name: str, schedule, args, lr_warmup: int, axes=AXIS):
  """Returns ``(tx, freeze_policy, freeze_description)``."""
  if name == "adam":
    return optax.adam(schedule), None, "-"
  if args.freeze_step is not None:
    freeze = onebit_optax.fixed_step_freeze(args.freeze_step)
    return (onebit_optax.onebit_adam(schedule, axis_name=axes, freeze=freeze), freeze,
            f"fixed: after step {args.freeze_step}")
  # The policy's default interval is 1/(1-b2) = 1000 steps, the averaging window
  # of v for b2 = 0.999: right for a long pretraining run, but longer than this
  # whole demo, so the check would never run. A run of S steps checks every
  # S/20 steps instead. With bias correction, v_hat_t is close to the plain
  # average of g^2 over all steps so far (t << 1000), so after k intervals the
  # ratio is about (k-1)/k + r/k, r being the recent g^2 over the earlier one:
  # the band check accepts a slowly shrinking gradient once enough history
  # has built up. The first possible freeze is at t = 2 interval (10% of the
  # run), and never before the LR warmup is over (min_steps): the variance
  # seen while the LR ramps up is not the one of the rest of the run.
  interval = args.freeze_interval or max(1, args.steps // 20)
  freeze = onebit_optax.variance_ratio_freeze(min_steps=lr_warmup, interval=interval)
  return (onebit_optax.onebit_adam(schedule, axis_name=axes, freeze=freeze), freeze,
          f"variance ratio: every {interval} steps from step "
          f"{max(lr_warmup, 2 * interval)}, freeze when in [0.96, 1/0.96]")


def make_step(tx, mesh, state_specs, onebit: bool, num_params: int):
  """The jitted data-parallel step: ``(params, state, x, y) -> (params, state, loss, bytes)``."""
  axes = data_axes(mesh)
  # Bytes over the slow (or only) axis: with nodes, plain Adam would all-reduce
  # its 1/L slice across the nodes after a reduce-scatter inside each node.
  local = mesh.shape["local"] if isinstance(axes, tuple) else 1
  n = mesh.size // local  # a ring all-reduce sends 2 (n-1)/n of the float32 buffer
  adam_bytes = 2.0 * (n - 1) / n * 4 * num_params / local

  @jax.jit
  @functools.partial(
      jax.shard_map, mesh=mesh,
      in_specs=(P(), state_specs, P(axes), P(axes)),
      out_specs=(P(), state_specs, P(), P()))
  def step(params, opt_state, x, y):
    # local_params: without it, grad w.r.t. replicated params would all-reduce
    # the gradients in the backward pass, before the optimizer sees them.
    loss, grads = jax.value_and_grad(loss_fn)(onebit_optax.local_params(params, axes), x, y)
    if onebit:
      updates, opt_state = tx.update(grads, opt_state, params)
      # The state's own count of this step's bytes; inside jit, read a field of the
      # state with optax.tree_utils.tree_get (onebit_optax.status reads them on the host).
      sent = optax.tree_utils.tree_get(opt_state, "wire_bytes")
    else:
      # Plain data-parallel Adam: one float32 all-reduce of the gradients.
      grads = jax.lax.pmean(grads, axes)
      updates, opt_state = tx.update(grads, opt_state, params)
      sent = jnp.float32(adam_bytes)
    params = optax.apply_updates(params, updates)
    return params, opt_state, jax.lax.pmean(loss, axes), sent

  return step


def make_eval(mesh):
  axes = data_axes(mesh)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(axes), P(axes)),
                     out_specs=(P(), P()))
  def evaluate(params, x, y):
    logits = logits_fn(params, x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    accuracy = jnp.mean(jnp.argmax(logits, -1) == y)
    return jax.lax.pmean(loss, axes), jax.lax.pmean(accuracy, axes)

  return evaluate


def train(name: str, args, mesh, data, lr_warmup: int):
  """Trains one optimizer from the shared seed; returns a dict of results."""
  train_ids, val_ids, vocab = data
  onebit = name == "onebit"
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, args.lr, warmup_steps=lr_warmup, decay_steps=args.steps,
      end_value=0.05 * args.lr)
  axes = data_axes(mesh)
  tx, freeze, freeze_desc = make_optimizer(name, schedule, args, lr_warmup, axes)

  replicated = NamedSharding(mesh, P())
  sharded = NamedSharding(mesh, P(axes))
  params = init_params(jax.random.key(args.seed), vocab, args.context, args.hidden)
  params = jax.device_put(params, replicated)
  num_params = sum(p.size for p in jax.tree.leaves(params))
  # init_sharded runs tx.init inside shard_map: 1-bit Adam needs the mesh size
  # and one error buffer per device; for optax.adam it simply replicates.
  opt_state = onebit_optax.init_sharded(tx, params, mesh, axes)
  state_specs = onebit_optax.state_partition_specs(opt_state, axes)
  step = make_step(tx, mesh, state_specs, onebit, num_params)

  batches = np.random.default_rng(args.seed + 1)  # same batches for both optimizers
  label = "1-bit Adam" if onebit else "Adam"
  losses, sent = [], []
  in_flight = collections.deque()
  start = time.perf_counter()
  with tqdm(range(1, args.steps + 1), desc=f"{label:>10}", unit="step",
            dynamic_ncols=True, file=sys.stderr, mininterval=0.5) as bar:
    for t in bar:
      starts = batches.integers(0, len(train_ids) - args.context, size=args.batch)
      x, y = windows(train_ids, starts, args.context)
      x, y = jax.device_put((x, y), sharded)
      params, opt_state, loss, wire = step(params, opt_state, x, y)
      losses.append(loss)
      sent.append(wire)
      in_flight.append(loss)
      if len(in_flight) > MAX_IN_FLIGHT:
        in_flight.popleft().block_until_ready()
      if args.check_replicas_every and t % args.check_replicas_every == 0:
        # A fingerprint per device, compared on the host: catches replicas that
        # drifted apart (e.g. an optimizer that does not average across devices).
        onebit_optax.assert_replicas_identical(params)
      if t % args.log_every == 0 or t == args.steps:
        # Reading a value waits for the device; doing it every step would
        # serialise the host loop with the computation.
        postfix = {"loss": f"{float(loss):.3f}"}
        if onebit:
          status = onebit_optax.status(opt_state, freeze)
          postfix["phase"] = status.phase
          # After the freeze the ratio is no longer measured: this is its value
          # at the freeze.
          postfix["var_ratio"] = f"{status.variance_ratio:.3f}"
          if status.frozen:
            postfix["froze_after"] = status.freeze_step
        bar.set_postfix(postfix, refresh=False)
  jax.block_until_ready(params)
  seconds = time.perf_counter() - start
  onebit_optax.assert_replicas_identical(params)

  evaluate = make_eval(mesh)
  metrics = {}
  for split, ids in (("train", train_ids), ("val", val_ids)):
    x, y = eval_set(ids, EVAL_WINDOWS, args.context, seed=args.seed + 2)
    loss, acc = evaluate(params, *jax.device_put((x, y), sharded))
    metrics[split] = (float(loss), float(acc))

  sent = np.asarray(jax.device_get(sent), dtype=np.float64)
  losses = np.asarray(jax.device_get(losses))
  result = {
      "label": label, "seconds": seconds, "num_params": num_params, "metrics": metrics,
      "last_train_loss": float(losses[-LAST_STEPS:].mean()), "total_bytes": float(sent.sum()),
      "freeze": freeze_desc, "froze_at": None, "warmup_bytes": float(sent[0]),
      "compress_bytes": None, "losses": losses, "cumulative_bytes": np.cumsum(sent),
      "status": None,
  }
  if onebit:
    status = onebit_optax.status(opt_state, freeze, params=params)
    if status.frozen:
      froze_at = status.freeze_step
      result["froze_at"] = froze_at
      result["compress_bytes"] = float(sent[froze_at]) if froze_at < args.steps else None
    result["status"] = status
  return result


# ------------------------------------------------------------------------ report


def _bytes(x):
  if x is None:
    return "-"
  for unit, size in (("GB", 1e9), ("MB", 1e6)):
    if x >= size:
      return f"{x / size:.3f} {unit}"
  return f"{x / 1e3:.3f} kB"


def report(results, args):
  """Prints the side-by-side table."""
  n = args.devices
  cols = [r["label"] for r in results]
  rows = []

  def row(name, *values):
    rows.append((name, *values))

  row("final train loss", *(f"{r['metrics']['train'][0]:.4f}" for r in results))
  row("final val loss", *(f"{r['metrics']['val'][0]:.4f}" for r in results))
  row("final train accuracy", *(f"{r['metrics']['train'][1]:.2%}" for r in results))
  row("final val accuracy", *(f"{r['metrics']['val'][1]:.2%}" for r in results))
  row(f"mean batch loss, last {min(LAST_STEPS, args.steps)} steps",
      *(f"{r['last_train_loss']:.4f}" for r in results))

  def froze(r):
    if r["label"] == "Adam":
      return "-"
    if r["froze_at"] is None:
      return "never (no compression)"
    return f"after step {r['froze_at']} ({r['froze_at'] / args.steps:.0%})"

  row("variance froze", *(froze(r) for r in results))
  row("bytes/device/step, full precision", *(_bytes(r["warmup_bytes"]) for r in results))
  row("bytes/device/step, 1-bit phase",
      *("-" if r["label"] == "Adam" else _bytes(r["compress_bytes"]) for r in results))
  row("bytes/device, whole run", *(_bytes(r["total_bytes"]) for r in results))
  row("train time (simulated devices)", *(f"{r['seconds']:.1f} s" for r in results))

  width = max(len(r[0]) for r in rows)
  col_w = [max(len(c), *(len(r[i + 1]) for r in rows)) for i, c in enumerate(cols)]
  line = lambda cells: "  ".join(  # noqa: E731
      [cells[0].ljust(width)] + [c.rjust(w) for c, w in zip(cells[1:], col_w)])
  print()
  print(f"{results[0]['num_params']:,} parameters, {mesh_description(args)}, {args.steps} "
        f"steps, global batch {args.batch} ({args.batch // n} per device); final metrics on "
        f"{EVAL_WINDOWS} fixed windows per split")
  print(bytes_note(args))
  for r in results:
    if r["label"] != "Adam":
      print(f"{r['label']} freeze policy: {r['freeze']}")
  print(line(["", *cols]))
  print(line(["-" * width, *("-" * w for w in col_w)]))
  for r in rows:
    print(line(list(r)))

  by_label = {r["label"]: r for r in results}
  if len(by_label) == 2:
    adam, onebit = by_label["Adam"], by_label["1-bit Adam"]
    print()
    print("bytes sent over the run, Adam / 1-bit Adam: "
          f"{adam['total_bytes'] / onebit['total_bytes']:.2f}x")
    if onebit["compress_bytes"]:
      print(f"bytes per step in the 1-bit phase, Adam / 1-bit Adam: "
            f"{adam['warmup_bytes'] / onebit['compress_bytes']:.1f}x")
    diff = onebit["metrics"]["val"][0] - adam["metrics"]["val"][0]
    print(f"val loss, 1-bit Adam - Adam: {diff:+.4f} nats "
          f"({diff / adam['metrics']['val'][0]:+.2%})")
  for r in results:
    if r["status"] is not None:
      # The one-call summary a training loop can log: the phase, and if the run
      # never compressed, why (no check before the end, or a ratio outside the band).
      print(f"\n{r['label']} status (onebit_optax.status): {r['status']}")


def _smooth(values, window):
  """Trailing moving average (the first points average what there is)."""
  sums = np.cumsum(np.insert(np.asarray(values, np.float64), 0, 0.0))
  counts = np.minimum(np.arange(1, len(values) + 1), window)
  return (sums[1:] - sums[np.maximum(np.arange(1, len(values) + 1) - window, 0)]) / counts


def figure_title(results, args) -> str:
  """Says which run the figure is: the optimizers, the mesh, the steps, what the bytes count."""
  names = " vs ".join(r["label"] for r in results)
  title = f"{names}, {mesh_description(args)}, {args.steps} steps"
  if args.nodes > 1:
    title += "\nbytes: over the slow 'node' axis only (between nodes)"
  return title


def plot(results, args, path: str) -> str:
  """Saves the loss curves, the freeze step and the bytes sent so far; returns the path."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")  # no display needed
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, loss_ax = plt.subplots(figsize=(9, 5), constrained_layout=True)
  bytes_ax = loss_ax.twinx()
  steps = np.arange(1, args.steps + 1)
  window = max(1, args.steps // 50)
  colors = {"Adam": "tab:blue", "1-bit Adam": "tab:orange"}
  for r in results:
    color = colors[r["label"]]
    loss_ax.plot(steps, _smooth(r["losses"], window), color=color,
                 label=f"{r['label']}: training loss")
    bytes_ax.plot(steps, r["cumulative_bytes"] / 1e6, color=color, linestyle=":",
                  label=f"{r['label']}: MB sent per device so far")
    if r["froze_at"] is not None:
      loss_ax.axvline(r["froze_at"], color=color, linestyle="--", linewidth=1,
                      label=f"{r['label']}: variance frozen after step {r['froze_at']}")
  loss_ax.set_xlabel("step")
  loss_ax.set_ylabel("training batch loss (nats" + (
      f", mean of the last {window} steps)" if window > 1 else ")"))
  bytes_ax.set_ylabel("MB sent per device so far" + (
      " (between nodes)" if args.nodes > 1 else ""))
  bytes_ax.set_ylim(bottom=0)
  title = figure_title(results, args)
  never = [r for r in results if r["status"] is not None and r["froze_at"] is None]
  if never:
    title += "\n1-bit Adam never froze (no compression): see the status printed by the demo"
  loss_ax.set_title(title)
  handles = [h for ax in (loss_ax, bytes_ax) for h in ax.get_legend_handles_labels()[0]]
  loss_ax.legend(handles, [h.get_label() for h in handles], loc="upper center", fontsize=8)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return os.path.abspath(path)


def main(argv=None) -> int:
  args = _parse_args(sys.argv[1:] if argv is None else argv)
  available = len(jax.devices())
  if available < args.devices:
    sys.exit(f"--devices {args.devices} but jax sees {available} devices; XLA_FLAGS="
             f"{os.environ.get('XLA_FLAGS', '')!r} already fixes the count. Unset it or "
             "pass a matching --devices.")
  if args.nodes < 1 or args.devices % args.nodes:
    sys.exit(f"--nodes {args.nodes} must divide --devices {args.devices}.")
  devices = jax.devices()[:args.devices]
  if args.nodes == 1:
    mesh = jax.make_mesh((args.devices,), (AXIS,), devices=devices)
  else:  # hierarchical: float32 inside a node, 1 bit between nodes
    mesh = jax.make_mesh((args.nodes, args.devices // args.nodes), ("node", "local"),
                         devices=devices)
  lr_warmup = args.lr_warmup if args.lr_warmup is not None else max(1, args.steps // 20)
  data = load_corpus(args.context)
  print(f"pydoc_data.topics: {len(data[0]):,} train / {len(data[1]):,} val characters, "
        f"vocabulary {data[2]}; LR warmup {lr_warmup} steps then cosine decay; "
        f"{mesh_description(args, jax.devices()[0].platform.upper())}", flush=True)

  names = {"both": ("adam", "onebit"), "adam": ("adam",), "onebit": ("onebit",)}[args.optimizer]
  results = [train(name, args, mesh, data, lr_warmup) for name in names]
  report(results, args)
  print(f"\nfigure saved to {plot(results, args, args.figure)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
