"""What skipping non-finite steps costs: the warmup and variance steps with ``skip_nonfinite`` on and off.

    .venv/bin/python benchmarks/nonfinite_cost.py                  # 10M, one device and a 2-device mesh
    .venv/bin/python benchmarks/nonfinite_cost.py --sizes 1e6,1e7 --repeats 21

Issue 25 asks for 1-bit Adam's warmup steps and 0/1 Adam's variance steps at
<= 1.1x ``optax.adam``'s train step. Both skip a step whose mean gradient holds
a NaN or Inf (``skip_nonfinite=True``, the default): one reduction of each
mean-gradient leaf before the moments are written, a full read of the
gradients that Adam does not make (Adam reads and writes about 10 D a step on
XLA:CPU, so the read alone is about 0.1x). This script times the same steps
with the skip off, and optax's own way to skip, ``optax.apply_if_finite``
around ``optax.adam``, beside plain Adam in the same run.

Contestants are ``benchmarks/zero_one_compute.py``'s train steps (``tx.update`` +
``optax.apply_updates``, params and state donated; in the mesh, local gradients
and Adam on their ``pmean``), interleaved repeats, medians; one XLA intra-op
thread. Writes ``benchmarks/results/nonfinite_cost.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=2").strip()
import zero_one_compute as zc  # noqa: E402  (adds its XLA_FLAGS: one intra-op thread)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import _provenance  # noqa: E402
import onebit_optax  # noqa: E402

RESULTS = Path(__file__).parent / "results"
NAMES = ("adam", "adam + apply_if_finite", "1-bit warmup", "1-bit warmup, no skip",
         "0/1 variance", "0/1 variance, no skip")


def optimizer(name: str, axis):
  if name == "adam + apply_if_finite":
    return optax.apply_if_finite(optax.adam(zc.LR), max_consecutive_errors=1000)
  skip = not name.endswith("no skip")
  if name.startswith("1-bit"):
    return onebit_optax.onebit_adam(zc.LR, axis_name=axis, freeze=zc.NEVER, skip_nonfinite=skip)
  if name.startswith("0/1"):
    return onebit_optax.zero_one_adam(zc.LR, axis_name=axis, skip_nonfinite=skip,
                                      **zc.KINDS["variance"])
  return optax.adam(zc.LR)


def contestant(name: str, size: int, grads, mesh):
  """(step, params, state) after 3 steps (1-bit: warmup; 0/1: variance steps only)."""
  onebit = name.startswith(("1-bit", "0/1"))
  tx = optimizer(name, None if mesh is None else zc.AXIS)
  params = zc.place(zc.make_tree(size, 0), mesh)
  state = zc._init(tx, params, mesh, onebit)
  step = zc._step(tx, mesh, state, onebit)
  for _ in range(3):
    params, state = step(params, state, grads)
  if onebit:
    assert zc._phase(state) == ("warmup" if name.startswith("1-bit") else "variance"), name
  return step, params, state


def measure(setting: str, size: int, repeats: int) -> dict:
  load_start = os.getloadavg()
  mesh = jax.make_mesh((zc.MESH_DEVICES,), (zc.AXIS,)) if setting == "mesh" else None
  grads = zc.place(zc.make_tree(size, 1), mesh)
  cands = {name: contestant(name, size, grads, mesh) for name in NAMES}
  facts = {name: zc.hlo_facts(*c, grads) for name, c in cands.items()}
  times, _ = zc.time_all(cands, grads, repeats, rotate=True, check=False)
  d4 = 4 * sum(int(np.prod(x.shape)) for x in jax.tree.leaves(grads))
  return {"setting": setting, "size": size, "load_start": [round(x, 2) for x in load_start],
          "load_end": [round(x, 2) for x in os.getloadavg()],
          "median_s": {n: float(np.median(ts)) for n, ts in times.items()},
          "temp_D": {n: facts[n]["temp_bytes"] / d4 for n in cands}}


def render(runs) -> list:
  lines = ["#### What skipping non-finite steps costs (warmup and variance steps vs Adam)", "",
           "The 6-leaf model-shaped tree of `zero_one_compute.py`, XLA intra-op threads 1, 2 CPUs "
           "(a shared, noisy machine: ratios measured side by side; compare runs, not one run). "
           "Train step: `tx.update` + `optax.apply_updates`, params and state donated, "
           "interleaved repeats in a rotating order, median. 'no skip': `skip_nonfinite=False`. temp: "
           "`memory_analysis().temp_size_in_bytes` of the compiled step, in D.", ""]
  lines += _summary(runs)
  for k, run in enumerate(runs, 1):
    where = ("one device" if run["setting"] == "single"
             else f"per device in a {zc.MESH_DEVICES}-device mesh")
    lines += [f"**run {k}: {where}, {run['size']:,} parameters** (`{run['command']}`, commit "
              f"{run['commit']}, jax {run['jax']}; load average at start {run['load_start']}, "
              f"at end {run['load_end']})", "",
              "| step | median (ms) | **/ adam** | temp (D) |", "|---|---:|---:|---:|"]
    adam = run["median_s"]["adam"]
    for name, s in run["median_s"].items():
      lines.append(f"| {name} | {1e3 * s:.1f} | **{s / adam:.2f}** | {run['temp_D'][name]:.2f} |")
    lines.append("")
  return lines


def _summary(runs) -> list:
  """Step time / Adam's, lowest-highest over the runs, per setting and contestant."""
  lines = []
  for setting in dict.fromkeys(r["setting"] for r in runs):
    mine = [r for r in runs if r["setting"] == setting]
    where = "one device" if setting == "single" else f"{zc.MESH_DEVICES}-device mesh, per device"
    cells = []
    for name in NAMES[1:]:
      ratios = [r["median_s"][name] / r["median_s"]["adam"] for r in mine]
      cells.append(f"{name} {min(ratios):.2f}–{max(ratios):.2f}")
    lines.append(f"- {where}, {len(mine)} runs, x Adam: " + "; ".join(cells) + ".")
  return lines + [""]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--sizes", default="1e7")
  p.add_argument("--settings", default="single,mesh")
  p.add_argument("--repeats", type=int, default=15)
  p.add_argument("--append", action="store_true",
                 help="keep the runs of earlier invocations (from the .json beside --out)")
  p.add_argument("--render", action="store_true",
                 help="only rewrite --out from the runs in the .json beside it")
  p.add_argument("--out", default=str(RESULTS / "nonfinite_cost.md"))
  args = p.parse_args(argv)
  if args.render:
    Path(args.out).write_text("\n".join(render(json.loads(Path(args.out).with_suffix(".json").read_text()))) + "\n")
    return 0
  command = " ".join(["python", "benchmarks/nonfinite_cost.py"] + [shlex.quote(a) for a in sys.argv[1:]])
  store = Path(args.out).with_suffix(".json")
  runs = json.loads(store.read_text()) if args.append and store.exists() else []
  for setting in args.settings.split(","):
    for size in args.sizes.split(","):
      run = measure(setting, int(float(size)), args.repeats)
      run.update(command=command, commit=_provenance.git_commit(), jax=jax.__version__)
      runs.append(run)
      print("\n".join(render([run])), flush=True)
  store.write_text(json.dumps(runs, indent=1) + "\n")
  Path(args.out).write_text("\n".join(render(runs)) + "\n")
  print("wrote", args.out, "and", store)
  return 0


if __name__ == "__main__":
  sys.exit(main())
