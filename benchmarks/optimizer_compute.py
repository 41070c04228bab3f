"""Compute cost of a 1-bit Adam update versus an Adam update, on one device.

    .venv/bin/python benchmarks/optimizer_compute.py            # 1M, 10M, 30M, 100M
    .venv/bin/python benchmarks/optimizer_compute.py --sizes 1e6,1e7 --repeats 5

What is timed: the jitted ``tx.update(grads, state, params)`` with the state
donated, for ``optax.adam`` and for ``onebit_optax.onebit_adam(axis_name=None)``
in the compression phase (variance frozen: compress, pack, unpack, both error
feedbacks; a 1-device cluster, so no communication). The two run interleaved
(A, B, A, B, ...) so that load from other processes hits both alike; the median
of the repeats is reported. By default XLA runs one intra-op thread, as each rank
does in benchmarks/comm_throughput.py (``--threads all`` lifts that).

It also reports, from XLA's own buffer assignment (``compiled.memory_analysis()``,
deterministic, unlike the timings on a shared machine), the full-size temporary
buffers each update writes, in units of one parameter-sized float32 array. On
XLA:CPU with glibc malloc every such buffer of more than 32 MB is a fresh mmap
and is page-faulted on every step: measured here, writing a fresh 40 MB array
costs ~50 ms against ~2-4 ms for the same pass into a donated buffer, so the
count of fresh buffers (temporaries + the update leaves) predicts the ratio.

Writes benchmarks/results/optimizer_compute.md.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

_THREAD_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def _parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--sizes", default="1e6,1e7,3e7,1e8",
                 help="comma-separated parameter counts (default: 1e6,1e7,3e7,1e8)")
  p.add_argument("--repeats", type=int, default=7, help="timed updates per optimizer and size")
  p.add_argument("--threads", choices=("1", "all"), default="1",
                 help="XLA CPU intra-op threads: 1 (as one rank of the comm benchmark) or all")
  p.add_argument("--out", default=str(Path(__file__).parent / "results" / "optimizer_compute.md"))
  return p.parse_args(argv)


ARGS = _parse_args(sys.argv[1:]) if __name__ == "__main__" else None
if ARGS is not None and ARGS.threads == "1":
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _THREAD_FLAGS).strip()

import jax  # noqa: E402  (XLA_FLAGS must be set first)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import onebit_optax  # noqa: E402


B1, B2, EPS, LR = 0.9, 0.999, 1e-8, 1e-3


def make_tree(size: int, seed: int = 0):
  """A parameter-shaped tree of ``size`` float32 values in 4 leaves (1/2, 1/4, 1/8, rest)."""
  shapes, used = [], 0
  for frac in (2, 4, 8):
    rows = size // frac // 128
    shapes.append((rows, 128))
    used += rows * 128
  shapes.append((size - used,))
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return {f"w{i}": jax.random.normal(k, s, jnp.float32) for i, (k, s) in enumerate(zip(keys, shapes))}


def _donated_update(tx):
  @functools.partial(jax.jit, donate_argnums=(1,))
  def update(grads, state, params):
    return tx.update(grads, state, params)
  return update


def _frozen_state(tx, update, params, grads):
  """A 1-bit Adam state already in the compression phase (freeze after step 1)."""
  state = tx.init(params)
  _, state = update(grads, state, params)
  assert bool(onebit_optax.is_frozen(state))
  return state


def _time_interleaved(contestants: dict, repeats: int) -> dict:
  """Median seconds per call; ``contestants`` maps name -> (step_fn, state)."""
  times = {name: [] for name in contestants}
  states = {name: st for name, (_, st) in contestants.items()}
  for name, (fn, _) in contestants.items():  # compile + one warm call each
    out, states[name] = fn(states[name])
    jax.block_until_ready((out, states[name]))
    del out
  for _ in range(repeats):
    for name, (fn, _) in contestants.items():
      t = time.perf_counter()
      out, states[name] = fn(states[name])
      jax.block_until_ready((out, states[name]))
      times[name].append(time.perf_counter() - t)
      del out
  return {name: float(np.median(ts)) for name, ts in times.items()}


def _mem_available() -> float:
  try:
    for line in Path("/proc/meminfo").read_text().split("\n"):
      if line.startswith("MemAvailable:"):
        return float(line.split()[1]) * 1024
  except OSError:
    pass
  return float("inf")


# Buffers alive at once, in units of one float32 copy of the parameters: params,
# grads, adam (mu, nu), onebit (mu, nu, worker and server error), the prototype's
# state (4), outputs and XLA temporaries (~6).
_LIVE_COPIES = 18


_DTYPE_BYTES = {"f32": 4, "s32": 4, "u32": 4, "u8": 1, "s8": 1, "pred": 1}
_SKIP_OPS = ("parameter", "get-tuple-element", "bitcast", "tuple", "constant", "conditional",
             "while", "call")


def compare(size: int, repeats: int) -> dict:
  params = make_tree(size, 0)
  grads = make_tree(size, 1)
  adam = optax.adam(LR)
  onebit = onebit_optax.onebit_adam(LR, axis_name=None, freeze=onebit_optax.fixed_step_freeze(1))
  # Warmup: a freeze step that is never reached.
  warm = onebit_optax.onebit_adam(LR, axis_name=None, freeze=onebit_optax.fixed_step_freeze(10**9))
  adam_update, onebit_update, warm_update = map(_donated_update, (adam, onebit, warm))
  contestants = {
      "adam": (lambda s: adam_update(grads, s, params), adam.init(params)),
      "warmup": (lambda s: warm_update(grads, s, params), warm.init(params)),
      "onebit": (lambda s: onebit_update(grads, s, params),
                 _frozen_state(onebit, onebit_update, params, grads)),
  }
  t = _time_interleaved(contestants, repeats)
  return {"size": size, "adam_s": t["adam"], "warmup_s": t["warmup"], "onebit_s": t["onebit"],
          "ratio": t["onebit"] / t["adam"], "warmup_ratio": t["warmup"] / t["adam"]}


def temporaries(size: int = 1_000_000) -> dict:
  """Temporary bytes of each compiled update, in parameter-sized float32 arrays (no run)."""
  params = make_tree(size, 0)
  out = {}
  for name, tx in (("adam", optax.adam(LR)),
                   ("onebit", onebit_optax.onebit_adam(LR, axis_name=None)),
                   ("onebit, skip_nonfinite=False",
                    onebit_optax.onebit_adam(LR, axis_name=None, skip_nonfinite=False))):
    state = tx.init(params)
    compiled = _donated_update(tx).lower(params, state, params).compile()
    memory = compiled.memory_analysis()
    out[name] = memory.temp_size_in_bytes / (4 * size)
  return out


def _fmt_ms(s: float) -> str:
  return f"{s * 1e3:.1f}"


def main():
  args = ARGS
  sizes = [int(float(s)) for s in args.sizes.split(",") if s]
  load = os.getloadavg()
  header = [
      "#### Optimizer compute: 1-bit Adam (warmup and compression) vs Adam, one device",
      "",
      f"Command: `python benchmarks/optimizer_compute.py {' '.join(sys.argv[1:])}`".rstrip(),
      f"jax {jax.__version__}, optax {optax.__version__}, onebit_optax {onebit_optax.__version__} "
      f"(commit {_git_commit()}), {platform.processor() or platform.machine()}, "
      f"{os.cpu_count()} CPUs, XLA intra-op threads: {args.threads}.",
      f"Load average at start (1/5/15 min): {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}.",
      "",
      "Median of interleaved repeats of the jitted update with the optimizer state donated. "
      "1-bit Adam runs with axis_name=None after the freeze: compress, pack, unpack and both "
      "error feedbacks, no communication (a 1-device cluster: the server's chunk is the whole "
      "vector, as much compression work as a rank of any cluster does and then some). Goal: "
      "compression/adam <= 1.5, warmup/adam <= 1.2.",
      "",
      "| parameters | adam update (ms) | onebit warmup (ms) | **warmup/adam** | onebit compression (ms) "
      "| **compression/adam** |",
      "|---:|---:|---:|---:|---:|---:|",
  ]
  print("\n".join(header), flush=True)
  rows, notes = [], []
  for size in sizes:
    need = _LIVE_COPIES * 4 * size
    if need > 0.8 * _mem_available():
      note = (f"{size:,} parameters skipped: needs about {need / 2**30:.1f} GiB, "
              f"{_mem_available() / 2**30:.1f} GiB available.")
      notes.append(note)
      print(note, flush=True)
      continue
    r = compare(size, args.repeats)
    row = (f"| {size:,} | {_fmt_ms(r['adam_s'])} | {_fmt_ms(r['warmup_s'])} | "
           f"{r['warmup_ratio']:.2f} | {_fmt_ms(r['onebit_s'])} | **{r['ratio']:.2f}** |")
    rows.append(row)
    print(row, flush=True)
  lines = header + rows + [""] + notes
  temps = temporaries()
  block = ["", "Temporaries of the compiled update (1,000,000 parameters; both 1-bit phases "
           "live in one program, the larger branch counts): " + ", ".join(
               f"{name} {k:.2f}" for name, k in temps.items()) +
           " parameter-sized float32 arrays, written fresh on every step: a copy of mu "
           "(the worker residual reads the old mu after the phase switch, unordered with "
           "mu's in-place write) and, with skip_nonfinite, the server residual (one "
           "device: the server's chunk is the whole vector)."]
  print("\n".join(block), flush=True)
  lines += block

  out = Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text("\n".join(lines) + "\n")
  print(f"\nwrote {out}")


def _git_commit() -> str:
  """Short commit of the checkout, with '+ uncommitted onebit_optax changes' if any."""
  try:
    run = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True,
                                    cwd=Path(__file__).parent, check=True).stdout.strip()
    dirty = run("status", "--porcelain", "--", "../onebit_optax")
    return run("rev-parse", "--short", "HEAD") + (" + uncommitted onebit_optax changes" if dirty else "")
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


if __name__ == "__main__":
  main()
