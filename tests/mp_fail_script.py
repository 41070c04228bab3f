"""Rank 1 fails after the processes have connected; the others block in a collective.

Used by tests/test_multiprocess.py to check that the launcher stops everything at
once. Each process writes its pid (and rank 0 the pid of a child it starts) to
``--out`` so the test can check that nothing is left running.
"""

import argparse
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from onebit_optax import launch


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  launch.initialize(initialization_timeout=60)
  rank = jax.process_index()
  pids = [os.getpid()]
  if rank == 0:  # a grandchild of the launcher: must not survive either
    pids.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid)
  with open(os.path.join(args.out, f"pids_{rank}"), "w") as f:
    f.write(" ".join(map(str, pids)))
  if rank == 1:
    with open(os.path.join(args.out, "failed_at"), "w") as f:
      f.write(repr(time.time()))
    raise RuntimeError("rank 1 fails on purpose")
  # Waits forever for rank 1's contribution unless the launcher intervenes.
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  ones = jax.make_array_from_process_local_data(
      NamedSharding(mesh, P("data")), jnp.ones((jax.local_device_count(),)))
  for _ in range(1000):
    ones = jax.jit(lambda x: x + jnp.sum(x), out_shardings=NamedSharding(mesh, P("data")))(ones)
    ones.block_until_ready()


if __name__ == "__main__":
  main()
