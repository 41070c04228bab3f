"""Elastic restore: what handing the error feedback on is worth, against zeroing it.

    .venv/bin/python benchmarks/elastic_restore.py            # ~12 min on 2 cores at load 6
    .venv/bin/python benchmarks/elastic_restore.py --seeds 2  # a smoke run

The digits MLP of ``_conv_tasks.py`` (64-256-256-10 ReLU, scikit-learn's 8x8
digits, held-out 20%) trained by ``onebit_adam`` (constant lr 1e-2, weight
decay 0.1 on the matrices, variance frozen after step 40) with the README's
shard_map recipe, global batch 64 at every step whatever the device count.
Per seed (initialisation and batches), the run on 8 simulated devices is saved
at step 60 (compressing since step 40) with ``save_checkpoint`` and goes on:

* ``uninterrupted``: the 8-device run, never stopped, to step 100;
* ``8->8 reset``: restored on the same 8 devices with the per-device buffers
  zeroed (``local_momentum``, ``worker_scale``, ``server_error``,
  ``feedback_valid`` False: what DeepSpeed does on every load);
* ``8->4``, ``8->2``: ``restore_checkpoint`` onto 4 or 2 of the devices (the
  error feedback handed on: the mean worker error, the message's correction
  and the server residual re-cut, see docs/guides/elastic_restore.md);
* ``8->4 reset``, ``8->2 reset``: the same restores with the buffers zeroed
  afterwards (what restore_checkpoint did before: the re-laid-out message kept,
  the error feedback lost).

Reported: the held-out loss 10, 20 and 40 steps after the restore, and paired
differences per seed (the same seed's uninterrupted run, or its reset run)
as mean +- standard error over the seeds. Writes
benchmarks/results/elastic_restore.md (``--out``) with the command, the
commit and the machine's load.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import functools  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _conv_tasks  # noqa: E402
import onebit_optax  # noqa: E402
from optax.tree_utils import tree_get  # noqa: E402

LR, WEIGHT_DECAY, FREEZE, RESTORE, END, BATCH = 1e-2, 0.1, 40, 60, 100, 64
AFTER = (10, 20, 40)  # evaluations, in steps after the restore
ARMS = ("uninterrupted", "8->8 reset", "8->4", "8->4 reset", "8->2", "8->2 reset")
OUT = Path(__file__).parent / "results" / "elastic_restore.md"


SCHEDULES = {
    "constant": lambda: LR,
    # The task's schedule (_conv_tasks: 5% linear warmup, cosine decay to 10% of the peak).
    "cosine": lambda: optax.warmup_cosine_decay_schedule(0.0, LR, END // 20, END, LR / 10),
}


def make_tx(task, params, schedule):
  return onebit_optax.onebit_adam(SCHEDULES[schedule](), weight_decay=WEIGHT_DECAY,
                                  mask=task.decay_mask(params), axis_name="data", freeze=FREEZE)


def make_step(task, tx, mesh, opt_state):
  specs = onebit_optax.state_partition_specs(opt_state, "data")

  def loss_fn(params, batch):
    total, count = task.loss_sums(params, batch)
    return total / count

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data")),
                     out_specs=(P(), specs))
  def step(params, opt_state, batch):
    grads = jax.grad(loss_fn)(onebit_optax.local_params(params, "data"), batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  return step


def make_eval(task):
  """(params) -> {"val": held-out loss, "train": loss on the whole training set, "params"}."""
  x_train, x_val, y_train, y_val = _conv_tasks._digits()

  @jax.jit
  def losses(params):
    mean = lambda sums: sums[0] / sums[1]
    return (mean(task.loss_sums(params, (x_val, y_val))),
            mean(task.loss_sums(params, (x_train, y_train))))

  def evaluate(params):
    params = jax.device_get(params)
    val, train = losses(params)
    return {"val": float(val), "train": float(train), "params": params}
  return evaluate


def distance(params, reference) -> float:
  """||params - reference|| / ||reference|| over all leaves."""
  diff = sum(float(np.sum((np.asarray(a) - np.asarray(b)) ** 2))
             for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reference)))
  norm = sum(float(np.sum(np.asarray(b) ** 2)) for b in jax.tree.leaves(reference))
  return float(np.sqrt(diff / norm))


def zeroed(opt_state):
  """The per-device buffers zeroed, as DeepSpeed does on every load."""
  s = opt_state[0]
  zero = lambda x: None if x is None else jnp.zeros_like(x)
  s = s._replace(local_momentum=jax.tree.map(zero, s.local_momentum),
                 worker_scale=zero(s.worker_scale), server_error=zero(s.server_error),
                 worker_error=zero(s.worker_error), feedback_valid=jnp.zeros_like(s.feedback_valid))
  return (s,) + tuple(opt_state[1:])


def train(task, step, mesh, params, opt_state, seed, start, stop, evaluate, record):
  sharding = NamedSharding(mesh, P("data"))
  for t in range(start, stop):
    batch = jax.device_put(task.train_batch(seed, t, BATCH), sharding)
    params, opt_state = step(params, opt_state, batch)
    if t + 1 - RESTORE in AFTER:
      record[t + 1 - RESTORE] = evaluate(params)
  return params, opt_state


class Runner:
  """The meshes, optimizer and compiled steps, shared by every seed."""

  def __init__(self, task, schedule):
    self.task = task
    devices = jax.devices()
    self.meshes = {n: jax.make_mesh((n,), ("data",), devices=devices[:n]) for n in (8, 4, 2)}
    template = task.init_params(jax.random.key(0))
    self.template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), template)
    self.tx = make_tx(task, template, schedule)
    self.evaluate = make_eval(task)
    self.steps = {}

  def step(self, n, opt_state):
    if n not in self.steps:
      self.steps[n] = make_step(self.task, self.tx, self.meshes[n], opt_state)
    return self.steps[n]

  def seed(self, seed: int, directory: str) -> dict:
    task, mesh8 = self.task, self.meshes[8]
    params = jax.device_put(task.init_params(jax.random.key(seed)), NamedSharding(mesh8, P()))
    opt_state = onebit_optax.init_sharded(self.tx, params, mesh8)
    step8 = self.step(8, opt_state)
    params, opt_state = train(task, step8, mesh8, params, opt_state, seed, 0, RESTORE,
                              self.evaluate, {})
    assert bool(tree_get(opt_state, "frozen"))
    onebit_optax.save_checkpoint(directory, RESTORE, params, opt_state, tx=self.tx)
    losses = {arm: {} for arm in ARMS}
    train(task, step8, mesh8, params, opt_state, seed, RESTORE, END, self.evaluate,
          losses["uninterrupted"])
    for n, reset, arm in ((8, True, "8->8 reset"), (4, False, "8->4"), (4, True, "8->4 reset"),
                          (2, False, "8->2"), (2, True, "8->2 reset")):
      mesh = self.meshes[n]
      restored, state, _ = onebit_optax.restore_checkpoint(directory, self.tx, self.template,
                                                           mesh)
      state = zeroed(state) if reset else state
      train(task, self.step(n, state), mesh, restored, state, seed, RESTORE, END,
            self.evaluate, losses[arm])
    reference = {a: losses["uninterrupted"][a]["params"] for a in AFTER}
    for arm in ARMS:  # how far each run is from the one that never stopped
      for a in AFTER:
        losses[arm][a]["dist"] = distance(losses[arm][a].pop("params"), reference[a])
    return losses


def paired(results, arm, base, after, key="val"):
  diffs = np.array([r[arm][after][key] - r[base][after][key] for r in results])
  rel = np.array([(r[arm][after][key] - r[base][after][key]) / r[base][after][key]
                  for r in results])
  se = lambda d: d.std(ddof=1) / np.sqrt(len(d)) if len(d) > 1 else float("nan")
  worse = int(np.sum(diffs > 0))
  return (f"{diffs.mean():+.4f} ± {se(diffs):.4f} ({100 * rel.mean():+.1f}% ± "
          f"{100 * se(rel):.1f}%; {worse}/{len(diffs)} worse)")


def _commit() -> str:
  try:
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                         text=True, check=True).stdout.strip()
    # What this run depends on: the package and the two benchmark files.
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "onebit_optax",
                            "benchmarks/elastic_restore.py", "benchmarks/_conv_tasks.py"],
                           cwd=root, capture_output=True, text=True, check=True).stdout.strip()
    return out + (" (+ uncommitted changes)" if dirty else "")
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def header(command, commit, load_before, load_after, seconds) -> list:
  return [
      "# Elastic restore: the error feedback handed on vs zeroed",
      "",
      f"Generated by `{command}` (commit {commit}, jax {jax.__version__}, "
      f"{jax.device_count()} simulated CPU devices, {os.cpu_count()} cores; load average "
      f"{load_before:.1f} at the start, {load_after:.1f} at the end; {seconds:.0f} s).",
      "",
  ]


def report(results, seeds, schedule) -> str:
  what = {"constant": f"lr {LR} constant",
          "cosine": f"lr {LR} peak, 5% warmup, cosine decay to {LR / 10} at step {END}"}[schedule]
  lines = [
      f"## Learning rate: {schedule}",
      "",
      f"Digits MLP (64-256-256-10), onebit_adam {what}, weight decay "
      f"{WEIGHT_DECAY} on the matrices, frozen after step {FREEZE}, global batch {BATCH}; "
      f"saved at step {RESTORE} on 8 devices; {len(seeds)} seeds ({seeds[0]}..{seeds[-1]}). "
      "Held-out loss (359 images) after the restore; paired differences are "
      "mean ± standard error over the seeds (same seed, same batches).",
      "",
      "| run | " + " | ".join(f"loss at +{a}" for a in AFTER) + " |",
      "|---|" + "---|" * len(AFTER),
  ]
  mean = lambda arm, a, key: np.mean([r[arm][a][key] for r in results])
  for arm in ARMS:
    cells = [f"{mean(arm, a, 'val'):.4f}" for a in AFTER]
    lines.append(f"| {arm} | " + " | ".join(cells) + " |")
  lines += ["", "Training loss (all 1,437 training images) and the distance of the parameters "
            "from the uninterrupted run's, ||θ − θ_uninterrupted|| / ||θ_uninterrupted|| "
            "(means over the seeds):", "",
            "| run | " + " | ".join(f"train at +{a}" for a in AFTER) + " | "
            + " | ".join(f"distance at +{a}" for a in AFTER) + " |",
            "|---|" + "---|" * (2 * len(AFTER))]
  for arm in ARMS:
    cells = ([f"{mean(arm, a, 'train'):.4f}" for a in AFTER]
             + [f"{mean(arm, a, 'dist'):.2e}" for a in AFTER])
    lines.append(f"| {arm} | " + " | ".join(cells) + " |")
  pairs = [("8->8 reset", "uninterrupted"), ("8->4", "uninterrupted"),
           ("8->4 reset", "uninterrupted"), ("8->4", "8->4 reset"),
           ("8->2", "uninterrupted"), ("8->2 reset", "uninterrupted"), ("8->2", "8->2 reset")]
  for key, what in (("val", "held-out loss"), ("train", "training loss"),
                    ("dist", "distance from the uninterrupted run")):
    lines += ["", f"Paired differences of the {what} (per seed; mean ± standard error, "
              "relative to the second run, and how many seeds the first run is higher):", "",
              f"| comparison | at +{AFTER[0]} | at +{AFTER[-1]} |", "|---|---|---|"]
    for arm, base in pairs:
      if key == "dist" and base == "uninterrupted":
        continue
      lines.append(f"| {arm} − {base} | {paired(results, arm, base, AFTER[0], key)} | "
                   f"{paired(results, arm, base, AFTER[-1], key)} |")
  return "\n".join(lines) + "\n"


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--seeds", type=int, default=5)
  parser.add_argument("--schedules", nargs="+", choices=sorted(SCHEDULES),
                      default=["constant", "cosine"])
  parser.add_argument("--out", type=Path, default=OUT)
  args = parser.parse_args()
  command = " ".join(["python", "benchmarks/elastic_restore.py"] + sys.argv[1:])
  load_before, start, commit = os.getloadavg()[0], time.time(), _commit()  # the code that runs
  task = _conv_tasks.make_tasks(["digits"], steps=END)[0]
  seeds = list(range(args.seeds))
  sections = []
  for schedule in args.schedules:
    runner, results = Runner(task, schedule), []
    for seed in seeds:
      with tempfile.TemporaryDirectory() as directory:
        results.append(runner.seed(seed, directory))
      print(f"{schedule} seed {seed} ({time.time() - start:.0f} s): " + ", ".join(
          f"{arm} {results[-1][arm][AFTER[-1]]['val']:.4f}" for arm in ARMS), flush=True)
    sections.append(report(results, seeds, schedule))
  text = "\n".join(header(command, commit, load_before, os.getloadavg()[0], time.time() - start)
                   + sections)
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(text)
  print(text)


if __name__ == "__main__":
  main()
