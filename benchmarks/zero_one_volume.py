"""0/1 Adam's volume and rounds against 1-bit Adam and AdamW on a small task (issue 19, a first look).

    .venv/bin/python benchmarks/zero_one_volume.py           # ~5 min on 2 cores (3 seeds)
    .venv/bin/python benchmarks/zero_one_volume.py --seeds 6 # ~12 min
    .venv/bin/python benchmarks/zero_one_volume.py --quick   # 1 seed, 100 steps (a smoke run)

The digits task of ``_conv_tasks.py`` (64-256-256-10 MLP, 300 steps, global
batch 64 on 8 simulated devices, LR warmup 15 steps then cosine to 10%, peak
1e-2 = AdamW's best there, weight decay 0.1 on matrices), the same seeds
(initialisation and batches) for every optimizer. Per run: the held-out loss
after the last step (with local steps: at the parameters of the last sync),
the bytes one device sent over the run (each optimizer's own ``wire_bytes``
per step; AdamW: a float32 ring all-reduce of the gradients every step), and
the communication rounds (steps that communicate; a 1-bit step is two uint8
collectives, a float32 step one all-reduce). This is not the convergence
protocol of ``convergence.py`` (no learning-rate selection per optimizer, few
seeds): it shows what the schedules do to the volume, and whether the loss
moves at all. Writes benchmarks/results/zero_one_volume.md (``--out``).

The ``H = 1`` rows run the post-freeze syncs through the local-steps code (the
learning rate inside the transformation); the rows without local steps run the
same algorithm in direction units (the chain's learning rate after it): two
paths that should agree up to rounding, here within the seeds' spread. History:
the first version compressed the *gradient* after the freeze (no local steps)
and, with a sync every step, kept the weight decay in the restarted momentum as
DeepSpeed does; on this task they gave +28.4 ± 9.8% (T_v = 15) and +37.2 ±
10.8% (H = 1) against AdamW (commit 74511d0), which is why neither is the code now.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import functools  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _conv_report  # noqa: E402
import _conv_tasks  # noqa: E402

import onebit_optax  # noqa: E402
from onebit_optax import _collective  # noqa: E402

N, AXIS, PEAK_LR = 8, "data", 1e-2

# (label, kind, options). kind: adamw | onebit | zero_one.
CONFIGS = (
    ("AdamW (float32 pmean)", "adamw", {}),
    ("1-bit Adam, default freeze (min_steps = warmup)", "onebit", {}),
    ("1-bit Adam, fixed T0 = 15", "onebit", dict(freeze=15)),
    ("0/1 Adam, T_v = 15", "zero_one", dict(var_freeze_step=15)),
    ("0/1 Adam, T_v = 100", "zero_one", dict(var_freeze_step=100)),
    ("0/1 Adam, T_v = 100, kappa = 4", "zero_one", dict(var_freeze_step=100, var_update_scaler=4)),
    ("0/1 Adam, T_v = 300 (v never frozen)", "zero_one", dict(var_freeze_step=300)),
    ("0/1 Adam, T_v = 15, H = 1 (a 1-bit sync every step)", "zero_one",
     dict(var_freeze_step=15, local_steps=1)),
    ("0/1 Adam, T_v = 100, H = 1", "zero_one", dict(var_freeze_step=100, local_steps=1)),
    ("0/1 Adam, T_v = 15, local steps H = 16", "zero_one", dict(var_freeze_step=15, local_steps=16)),
    ("0/1 Adam, T_v = 15, H = 16, local_step_scaler = 8", "zero_one",
     dict(var_freeze_step=15, local_steps=16, local_step_scaler=8)),
    ("0/1 Adam, T_v = 100, kappa = 4, H = 16, local_step_scaler = 8", "zero_one",
     dict(var_freeze_step=100, var_update_scaler=4, local_steps=16, local_step_scaler=8)),
)


def _optimizer(kind, options, task):
  schedule = optax.warmup_cosine_decay_schedule(0.0, PEAK_LR, task.warmup, task.steps,
                                                PEAK_LR * 0.1)
  common = dict(weight_decay=task.weight_decay, mask=task.decay_mask)
  if kind == "adamw":
    return optax.adamw(schedule, **common)
  if kind == "onebit":
    freeze = options.get("freeze", onebit_optax.variance_ratio_freeze(min_steps=task.warmup))
    return onebit_optax.onebit_adam(schedule, axis_name=AXIS, freeze=freeze, **common)
  return onebit_optax.zero_one_adam(schedule, axis_name=AXIS, **common, **options)


def _state_of(opt_state, kind):
  cls = dict(onebit=onebit_optax.ScaleByOnebitAdamState,
             zero_one=onebit_optax.ScaleByZeroOneAdamState)[kind]
  return [s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, cls))
          if isinstance(s, cls)][0]


def _trainer(kind, options, task, mesh):
  """(init, step): one compiled shard_map train step that also returns this step's bytes."""
  tx = _optimizer(kind, options, task)
  loss_fn = lambda p, batch: task.loss_sums(p, batch)[0] / task.loss_sums(p, batch)[1]

  if kind == "adamw":
    init = lambda params: tx.init(params)
    specs = P()
  else:
    init = lambda params: (onebit_optax.init_sharded(tx, params, mesh) if kind == "onebit"
                           else onebit_optax.init_sharded(tx, params, mesh))

  def step_fn(params, opt_state, batch):
    if kind == "adamw":
      grads = jax.lax.pmean(jax.grad(loss_fn)(onebit_optax.local_params(params, AXIS), batch),
                            AXIS)
      sent = jnp.float32(0)  # counted on the host: the ring all-reduce of the gradients
    elif kind == "onebit":
      grads = jax.grad(loss_fn)(onebit_optax.local_params(params, AXIS), batch)
    else:
      grads = jax.grad(loss_fn)(onebit_optax.local_params(params, AXIS, opt_state),
                                batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    if kind != "adamw":
      sent = _state_of(opt_state, kind).wire_bytes
    return optax.apply_updates(params, updates), opt_state, sent

  def build(opt_state):
    state_specs = (specs if kind == "adamw" else
                   onebit_optax.state_partition_specs(opt_state, AXIS) if kind == "onebit"
                   else onebit_optax.state_partition_specs(opt_state, AXIS))
    return jax.jit(jax.shard_map(step_fn, mesh=mesh, in_specs=(P(), state_specs, P(AXIS)),
                                 out_specs=(P(), state_specs, P())), donate_argnums=(0, 1))
  return init, build


def _val_loss(task, params):
  x, y = task.val_set(N)
  total, count = task.loss_sums(params, (jnp.asarray(x), jnp.asarray(y)))
  return float(total / count)


def _run(label, kind, options, task, seeds, mesh):
  init, build = _trainer(kind, options, task, mesh)
  adam_bytes = _collective.allreduce_wire_bytes(
      sum(int(np.prod(np.shape(p))) for p in jax.tree.leaves(task.init_params(jax.random.key(0)))), N)
  step, rows = None, []
  for seed in seeds:
    params = jax.device_put(task.init_params(jax.random.key(seed)), NamedSharding(mesh, P()))
    opt_state = init(params)
    step = step or build(opt_state)
    sent = []
    for t in range(task.steps):
      batch = jax.device_put(task.train_batch(seed, t, N * task.batch_per_device),
                             NamedSharding(mesh, P(AXIS)))
      # One step in flight: queued 8-device steps can trip XLA:CPU's 40 s
      # collective rendezvous abort on a busy machine.
      params, opt_state, b = jax.block_until_ready(step(params, opt_state, batch))
      sent.append(b)
    sent = np.asarray(jax.device_get(sent), np.float64)
    if kind == "adamw":
      sent[:] = adam_bytes
    big = sent > adam_bytes / 2  # a float32 all-reduce of the gradients
    rows.append(dict(val=_val_loss(task, jax.device_get(params)), bytes=float(sent.sum()),
                     rounds=int(np.count_nonzero(sent)), fp32_rounds=int(np.count_nonzero(big))))
    print(f"{label} seed {seed}: {rows[-1]}", flush=True)
  return rows


def _report(results, task, seeds, meta):
  lines = ["# 0/1 Adam: volume and rounds on the digits MLP (a first look)\n",
           f"Command: `{meta['command']}`  ",
           f"jax {meta['jax']}, optax {meta['optax']}, onebit_optax {meta['onebit_optax']} at "
           f"{meta['git']}; {meta['machine']}; started {meta['started']}; wall time "
           f"{meta['wall_s'] / 60:.1f} min.  ",
           f"Machine load (`uptime`) at start: `{meta['uptime_start']}`; at end: "
           f"`{meta['uptime_end']}`.\n",
           f"{task.title}; {task.steps} steps, global batch {N * task.batch_per_device} on {N} "
           f"simulated devices, peak lr {PEAK_LR} (warmup {task.warmup} steps, cosine to 10%), "
           f"weight decay {task.weight_decay} on matrices, b1 0.9, b2 0.999, for every "
           f"optimizer; seeds {list(seeds)} (same initialisation and batches for every row). "
           "*val*: held-out loss after the last step (with local steps: at the last sync's "
           "parameters), mean ± std over seeds; *paired*: mean ± std of the same-seed relative "
           "difference to AdamW. *bytes/device*: what one device sent over the run. *rounds*: "
           "steps that communicate (of them, *fp32*: float32 all-reduces).\n",
           "| optimizer | val | paired vs AdamW | bytes/device | AdamW's bytes / these "
           "| 1-bit Adam's (default) / these | rounds | fp32 rounds |",
           "|---|---|---|---|---|---|---|---|"]
  base = results[CONFIGS[0][0]]
  onebit = results[CONFIGS[1][0]]
  mean_bytes = lambda rows: float(np.mean([r["bytes"] for r in rows]))
  for label, rows in results.items():
    val = np.array([r["val"] for r in rows])
    paired = np.array([(r["val"] - b["val"]) / b["val"] for r, b in zip(rows, base)]) * 100
    lines.append(
        f"| {label} | {val.mean():.4f} ± {val.std():.4f} | {paired.mean():+.1f} ± "
        f"{paired.std():.1f}% | {mean_bytes(rows) / 1e6:.2f} MB | "
        f"{mean_bytes(base) / mean_bytes(rows):.1f}x | "
        f"{mean_bytes(onebit) / mean_bytes(rows):.2f}x | "
        f"{np.mean([r['rounds'] for r in rows]):.0f} | "
        f"{np.mean([r['fp32_rounds'] for r in rows]):.0f} |")
  return "\n".join(lines) + "\n"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default 3)")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                    "zero_one_volume.md"))
  args = parser.parse_args(argv)
  wall0 = time.time()
  meta = _conv_report.machine_meta(
      "python benchmarks/zero_one_volume.py" + (" --quick" if args.quick else "")
      + (f" --seeds {args.seeds}" if args.seeds != 3 else ""), args.quick)
  (task,) = _conv_tasks.make_tasks(["digits"], steps=100 if args.quick else None)
  seeds = (0,) if args.quick else tuple(range(args.seeds))
  mesh = jax.make_mesh((N,), (AXIS,))
  results = {label: _run(label, kind, options, task, seeds, mesh)
             for label, kind, options in CONFIGS}
  text = _report(results, task, seeds, _conv_report.finish_meta(meta, wall0))
  print(text)
  with open(args.out, "w") as f:
    f.write(text)


if __name__ == "__main__":
  main()
