"""A small 1-bit Adam training run, data-parallel over every device of every process.

Run by tests/test_multiprocess.py, either as N real processes::

  python -m onebit_optax.launch --nproc 2 tests/mp_train_script.py --out DIR

or as one plain process with simulated devices (the reference)::

  XLA_FLAGS=--xla_force_host_platform_device_count=2 python tests/mp_train_script.py \
      --no-distributed --out DIR

Both see the same global batches: every process takes its own rows of them
(``jax.make_array_from_process_local_data``), as a per-host data loader would.
Writes ``params_<process>.npz`` and ``losses_<process>.npy`` to ``--out``.
"""

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import onebit_optax
from onebit_optax import launch

ROWS_PER_DEVICE = 4
FEATURES, HIDDEN = 6, 5


def loss_fn(params, x, y):
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  return jnp.mean((h @ params["w2"] - y) ** 2)


def global_batch(step, n):
  """The step's ``n`` rows for all devices: the same on every process."""
  rng = np.random.default_rng(1000 + step)
  x = rng.standard_normal((n, FEATURES)).astype(np.float32)
  # Rows differ per device, so local gradients (and momenta) differ.
  y = np.sin(x.sum(axis=1, keepdims=True)) + 0.1 * np.arange(n, dtype=np.float32)[:, None] / n
  return x, y.astype(np.float32)


def local_rows(sharding, global_shape):
  """The contiguous block of rows this process's devices hold under ``sharding``."""
  starts = sorted({idx[0].start or 0 for idx in
                   sharding.addressable_devices_indices_map(global_shape).values()})
  per_device = global_shape[0] // jax.device_count()
  first, last = starts[0], starts[-1] + per_device
  assert last - first == per_device * len(starts), "this process's rows are not contiguous"
  return slice(first, last)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", required=True)
  parser.add_argument("--steps", type=int, default=25)
  parser.add_argument("--freeze", type=int, default=5)
  parser.add_argument("--no-distributed", action="store_true")
  args = parser.parse_args()

  if not args.no_distributed:
    launch.initialize(initialization_timeout=60)

  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  data_sharding = NamedSharding(mesh, P("data"))
  tx = onebit_optax.onebit_adam(
      3e-2, axis_name="data", freeze=onebit_optax.fixed_step_freeze(args.freeze))

  rng = np.random.default_rng(0)  # same params on every process
  params = {
      "w1": rng.standard_normal((FEATURES, HIDDEN)) / np.sqrt(FEATURES),
      "b1": np.zeros((HIDDEN,)),
      "w2": rng.standard_normal((HIDDEN, 1)) / np.sqrt(HIDDEN),
  }
  # float32 on the host already: in a multi-process run, device_put checks that
  # every process passes the same value by comparing the host array with the
  # gathered device copies, and a float64 array never equals its float32 copy.
  params = jax.tree.map(lambda a: a.astype(np.float32), params)
  np.savez(os.path.join(args.out, f"initial_params_{jax.process_index()}.npz"), **params)
  params = jax.device_put(params, NamedSharding(mesh, P()))
  opt_state = onebit_optax.init_sharded(tx, params, mesh)
  specs = onebit_optax.state_partition_specs(opt_state, "data")

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                     out_specs=(P(), specs, P()))
  def step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(onebit_optax.local_params(params, "data"), x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

  losses = []
  for t in range(args.steps):
    x, y = global_batch(t, jax.device_count() * ROWS_PER_DEVICE)
    rows = local_rows(data_sharding, x.shape)
    x = jax.make_array_from_process_local_data(data_sharding, x[rows], x.shape)
    y = jax.make_array_from_process_local_data(data_sharding, y[rows], y.shape)
    params, opt_state, loss = step(params, opt_state, x, y)
    losses.append(float(loss.addressable_data(0)))
    if t + 1 == args.freeze:
      warmup_params = params

  # Replicated outputs: every process holds a full copy on its own devices.
  host = lambda tree: jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), tree)
  info = {
      "process_count": jax.process_count(),
      "device_count": jax.device_count(),
      "frozen": bool(host(optax.tree_utils.tree_get(opt_state, "frozen"))),
      "freeze_step": int(host(optax.tree_utils.tree_get(opt_state, "freeze_step"))),
      "steps": args.steps,
  }
  print(f"process {jax.process_index()}/{jax.process_count()} devices "
        f"{jax.local_device_count()}/{jax.device_count()} frozen={info['frozen']} "
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
  pid = jax.process_index()
  np.savez(os.path.join(args.out, f"params_{pid}.npz"), **host(params))
  np.savez(os.path.join(args.out, f"warmup_params_{pid}.npz"), **host(warmup_params))
  np.save(os.path.join(args.out, f"losses_{pid}.npy"), np.asarray(losses))
  with open(os.path.join(args.out, f"info_{pid}.json"), "w") as f:
    json.dump(info, f)


if __name__ == "__main__":
  main()
