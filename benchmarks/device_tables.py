"""Compile, compute and memory tables on one accelerator: the prepared run for a lent GPU (issue 25).

    PYTHONPATH=. python3 benchmarks/device_tables.py --commit COMMIT \\
        --out $OUT/device_tables.md                                             # on the GPU machine
    .venv/bin/python benchmarks/device_tables.py --sizes 2e4 --leaves 20 \\
        --leaves-size 2e4 --repeats 3 --out /tmp/device_tables.md                # a CPU check

Everything runs on jax's default backend, one device (the GPU where there is
one), so that the same script answers "what does it cost there" in one call
(the GPU machine's image has jax, optax, flax, chex and orbax; the package
comes from the checkout, hence ``PYTHONPATH=.``; the copy there may lack git
metadata, hence ``--commit``):

1. **Compile**: trace + lower + compile of the train step at ``--leaves``
   leaves of ``compile_time.py``'s 20 shapes, built as there (a ``shard_map``
   on a 1-device mesh; Adam on the ``pmean``), for ``optax.adam``,
   ``onebit_adam`` and ``zero_one_adam``; the ratios to Adam's.
2. **Compute and memory** per kind of step, ``zero_one_compute.py``'s
   contestants (``optax.adam``; 1-bit warmup and compression; 0/1 variance,
   compressed, local, sync, each in a run of its kind), one device
   (``axis_name=None``), at each of ``--sizes`` on the 6-leaf model-shaped
   tree and at ``--leaves-size`` on the ``--leaves``-leaf tree. One contestant
   at a time (built, timed, freed), so that 500M parameters fit: Adam is
   timed first and again last, and the two say how much the device drifted.
   Median of ``--repeats`` donated steps. State and the compiled step's
   temporaries (``memory_analysis()``) in units of D (4 bytes x parameters).

Goals (issue 25): compile <= 1.5x Adam's; every 0/1 step and 1-bit compression
<= 1.3x Adam's step, 1-bit warmup and 0/1 variance <= 1.1x; temporaries <= Adam's
+ 0.1 D. On a CPU the tables are a check that the script runs, not results.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import compile_time as ct  # (sets 8 host devices for XLA:CPU; the default backend is unchanged)
import zero_one_compute as zc

import jax  # noqa: E402
import numpy as np  # noqa: E402

import _provenance  # noqa: E402


def _parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--sizes", default="1e8,5e8", help="parameters of the 6-leaf tree (default 1e8,5e8)")
  p.add_argument("--leaves", type=int, default=300, help="leaves of the many-leaf trees (default 300)")
  p.add_argument("--leaves-size", default="1e8",
                 help="parameters of the many-leaf compute tree (0: no such tree)")
  p.add_argument("--repeats", type=int, default=20, help="timed steps per contestant")
  p.add_argument("--skip", default="", help="comma-separated parts to leave out: compile, compute")
  p.add_argument("--commit", default=None, help="the commit to report (default: git's, here)")
  p.add_argument("--out", default=str(zc.RESULTS / "device_tables.md"))
  return p.parse_args(argv)


def compile_table(leaves: int) -> dict:
  """name -> trace + lower + compile seconds of the train step at ``leaves`` leaves, one device."""
  mesh = jax.make_mesh((1,), (ct.AXIS,), devices=jax.devices()[:1])
  return {name: ct.measure(name, leaves, mesh)["total_s"] for name in ct.CONTESTANTS}


def _d(tree) -> float:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _timed(step, params, state, grads, repeats: int):
  """Median step seconds over ``repeats`` donated steps; the temporaries and state in bytes."""
  temps = step.lower(params, state, grads).compile().memory_analysis().temp_size_in_bytes
  times = []
  for _ in range(repeats):
    jax.block_until_ready((params, state))
    t = time.perf_counter()
    params, state = step(params, state, grads)
    jax.block_until_ready((params, state))
    times.append(time.perf_counter() - t)
  return float(np.median(times)), temps, _d(state), (params, state)


def compute_table(size: int, leaves: int, repeats: int) -> dict:
  """name -> (step s, temporaries D, state D), one contestant alive at a time; 'adam again' last."""
  grads = zc.make_tree(size, 1, leaves)
  d = _d(grads)
  rows = {}
  for name in zc.NAMES + ("adam again",):
    kind = name.split()[0] if name == "adam again" else name
    step, params, state = zc.contestant(kind, size, grads, None, repeats, leaves)
    seconds, temps, state_bytes, live = _timed(step, params, state, grads, repeats)
    if kind.startswith("0/1"):  # (each timed step was of the kind named: zero_one_compute's check)
      assert zc._phase(live[1]) == kind.split()[-1], (kind, zc._phase(live[1]))
    rows[name] = (seconds, temps / d, state_bytes / d)
    for x in jax.tree.leaves(live):
      x.delete()
    print(f"  {name}: {1e3 * seconds:.2f} ms", flush=True)
  return rows


def render(data) -> list:
  lines = ["#### Compile, compute and memory on one device", "",
           f"`{data['command']}`: commit {data['commit']}, jax {data['jax']}, device "
           f"{data['device']}. One contestant at a time; Adam timed first and last.", ""]
  if "compile" in data:
    c = data["compile"]
    lines += [f"**Compile** (trace + lower + compile, {data['leaves']} leaves in 20 shapes, "
              "a 1-device `shard_map`):", "", "| | seconds | / adam |", "|---|---:|---:|"]
    lines += [f"| {name} | {s:.1f} | {s / c['adam']:.2f} |" for name, s in c.items()]
  for title, rows in data.get("compute", {}).items():
    adam = rows["adam"][0]
    lines += ["", f"**Step, {title}** (median of {data['repeats']}; temporaries and state in D):",
              "", "| step | ms | / adam | temporaries | state |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {name} | {1e3 * s:.2f} | {s / adam:.2f} | {t:.2f} | {st:.2f} |"
              for name, (s, t, st) in rows.items()]
  return lines


def main(args) -> int:
  device = jax.devices()[0]
  data = {"command": " ".join(["python", "benchmarks/device_tables.py"] +
                              [shlex.quote(a) for a in sys.argv[1:]]),
          "commit": args.commit or _provenance.git_commit(), "jax": jax.__version__,
          "device": f"{device.platform}: {device.device_kind}", "leaves": args.leaves,
          "repeats": args.repeats}
  skip = set(filter(None, args.skip.split(",")))
  if "compile" not in skip:
    data["compile"] = compile_table(args.leaves)
    print("\n".join(render(data)), flush=True)
  if "compute" not in skip:
    data["compute"] = {}
    trees = [(int(float(s)), 0) for s in args.sizes.split(",") if s]
    if float(args.leaves_size):
      trees.append((int(float(args.leaves_size)), args.leaves))
    for size, leaves in trees:
      title = f"{size:,} parameters, " + (f"{leaves} leaves in 20 shapes" if leaves else
                                          "the 6-leaf model-shaped tree")
      print(title, flush=True)
      data["compute"][title] = compute_table(size, leaves, args.repeats)
  lines = render(data)
  Path(args.out).write_text("\n".join(lines) + "\n")
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main(_parse_args(sys.argv[1:])))
