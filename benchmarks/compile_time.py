"""Trace, lower and compile time of the shard_map'd train step: 1-bit Adam and 0/1 Adam vs Adam + pmean.

    .venv/bin/python benchmarks/compile_time.py                       # 300 and 1000 leaves
    .venv/bin/python benchmarks/compile_time.py --leaves 300 --repeats 3
    .venv/bin/python benchmarks/compile_time.py --leaves 300 --kernels  # + what XLA compiled
    .venv/bin/python benchmarks/compile_time.py --leaves 300 --restart  # persistent cache

On 8 simulated host devices (``--xla_force_host_platform_device_count=8``), for
trees of 300 and 1000 leaves of about 1000 float32 elements in 20 distinct shapes
(vectors and matrices, leaf ``i`` of shape ``SHAPES[i % 20]``), the train step

    @jax.jit(donate_argnums=(0, 1)) over jax.shard_map(mesh of 8, axis 'data'):
      grads = onebit_optax.local_params(grads, 'data')   # [adam: then jax.lax.pmean]
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)

is traced (``jitted.trace``), lowered (``.lower()``) and compiled
(``.compile()``) from abstract arguments, for ``onebit_optax.onebit_adam``
(warmup and compression are one program: the phase switch is a ``cond``) and
``optax.adam`` on the ``pmean`` of the gradients. Each repeat builds a fresh
function (no tracing or compilation cache hit); contestants alternate;
medians reported. Goal: 1-bit / adam <= 1.5 (total).

``--kernels`` also counts what XLA:CPU compiled (one kernel per distinct fused
computation, and their optimized LLVM IR: what the compile time follows).
``--restart`` instead times a restarted job with JAX's persistent compilation
cache: each contestant's first compile, then a fresh function's.

Writes benchmarks/results/compile_time.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

DEVICES = 8
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={DEVICES}").strip()

import jax  # noqa: E402  (XLA_FLAGS must be set first)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import onebit_optax  # noqa: E402

import _provenance  # noqa: E402  (benchmarks/, the script's directory)

AXIS = "data"
# 20 distinct shapes of about 1000 elements: a program built per shape has 20 groups.
SHAPES = [(1000 + 37 * k,) if k % 2 else (20 + k, 50) for k in range(20)]
GOAL = 1.5
RESULTS = Path(__file__).parent / "results"


def _parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--leaves", default="300,1000", help="comma-separated leaf counts (default 300,1000)")
  p.add_argument("--repeats", type=int, default=2, help="fresh trace+lower+compile per contestant")
  p.add_argument("--append", action="store_true",
                 help="keep the rows of earlier runs (from the .json) and add this run's")
  p.add_argument("--kernels", action="store_true",
                 help="also compile each step once more, untimed, with XLA's dump on, and "
                      "count the kernels XLA:CPU compiles and their optimized LLVM IR")
  p.add_argument("--restart", action="store_true",
                 help="instead of the timing table: with JAX's persistent compilation cache in a "
                      "fresh directory, each contestant's first compile (cold) and a fresh "
                      "function's (warm: what a restarted job pays)")
  p.add_argument("--out", default=str(RESULTS / "compile_time.md"))
  return p.parse_args(argv)


def _tree(leaves: int):
  return {f"w{i:04d}": jax.ShapeDtypeStruct(SHAPES[i % len(SHAPES)], jnp.float32)
          for i in range(leaves)}


def _step(tx, mesh, state_specs, onebit: bool):
  def body(params, state, grads):
    grads = onebit_optax.local_params(grads, AXIS)
    if not onebit:
      grads = jax.lax.pmean(grads, AXIS)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), state_specs, P()),
                               out_specs=(P(), state_specs)), donate_argnums=(0, 1))


def _abstract_args(name, tx, tree, mesh):
  """(step, abstract params, state, grads) carrying their shardings."""
  onebit = name != "adam"
  if onebit:
    local = jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=(P(),), out_specs=P(),
                                         check_vma=False), tree)
    specs = onebit_optax.state_partition_specs(local, AXIS)
    state = jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=(P(),), out_specs=specs),
                           tree)
  else:
    state = jax.eval_shape(tx.init, tree)
    specs = jax.tree.map(lambda _: P(), state)
  put = lambda t, sp: jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)), t, sp)
  replicated = jax.tree.map(lambda _: P(), tree)
  return _step(tx, mesh, specs, onebit), put(tree, replicated), put(state, specs), put(tree, replicated)


CONTESTANTS = {
    "adam": lambda: optax.adam(1e-3),
    "onebit": lambda: onebit_optax.onebit_adam(1e-3, axis_name=AXIS, freeze=100),
    "zero_one": lambda: onebit_optax.zero_one_adam(1e-3, axis_name=AXIS, var_freeze_step=100),
}


def measure(name: str, leaves: int, mesh) -> dict:
  tx = CONTESTANTS[name]()
  tree = _tree(leaves)
  t0 = time.perf_counter()
  step, params, state, grads = _abstract_args(name, tx, tree, mesh)
  traced = step.trace(params, state, grads)
  t1 = time.perf_counter()
  lowered = traced.lower()
  t2 = time.perf_counter()
  lowered.compile()
  t3 = time.perf_counter()
  return {"trace_s": t1 - t0, "lower_s": t2 - t1, "compile_s": t3 - t2, "total_s": t3 - t0}


def kernels(name: str, leaves: int, mesh) -> dict:
  """What XLA:CPU compiles for the step: fusions, kernels (LLVM modules), lines of optimized IR.

  XLA:CPU compiles one kernel per distinct fused computation: fusions that
  differ only in their names share one. The compile time follows the kernels
  and their IR, not the fusions.
  """
  tx = CONTESTANTS[name]()
  step, params, state, grads = _abstract_args(name, tx, _tree(leaves), mesh)
  with tempfile.TemporaryDirectory() as dump:
    compiled = step.trace(params, state, grads).lower().compile(
        compiler_options={"xla_dump_to": dump})
    modules = {f.name: len(f.read_text().splitlines()) for f in Path(dump).glob("*.ir-with-opt.ll")}
  # (after the result's shape, a tuple's included: multi-output fusions count too)
  fusions = len(re.findall(r"[\]})] fusion\(", compiled.as_text()))
  return {"fusions": fusions, "kernels": len(modules), "ir_lines": sum(modules.values()),
          "ir_by_kind": _ir_by_kind(modules)}


def _ir_by_kind(modules: dict, top: int = 6) -> list:
  """[kind, kernels, IR lines] of the kinds of kernel with the most IR (kind: the fusion's name
  without its number, e.g. ``multiply_bitcast_fusion``), most first."""
  kinds = {}
  for name, lines in modules.items():
    kind = name.removesuffix(".ir-with-opt.ll").removesuffix("_kernel_module")
    kind = re.sub(r"\.\d+$", "", re.split(r"jit_body\.|__compute_module_", kind)[-1])
    count, total = kinds.get(kind, (0, 0))
    kinds[kind] = (count + 1, total + lines)
  return [[k, c, n] for k, (c, n) in sorted(kinds.items(), key=lambda kv: -kv[1][1])[:top]]


def restart(leaves: int, mesh) -> dict:
  """Cold and warm (persistent cache hit) trace + lower + compile of each contestant."""
  out = {}
  for name in CONTESTANTS:
    cold, warm = measure(name, leaves, mesh), measure(name, leaves, mesh)
    out[name] = {"cold_s": cold["total_s"], "warm_s": warm["total_s"],
                 "warm_compile_s": warm["compile_s"]}
    print(f"{leaves} leaves, {name}: {out[name]}", flush=True)
  return out


def _use_persistent_cache(directory: str):
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


_git_commit = _provenance.git_commit


def main():
  args = _parse_args(sys.argv[1:])
  cache = tempfile.TemporaryDirectory() if args.restart else None
  if cache is None:
    jax.config.update("jax_enable_compilation_cache", False)
  else:
    _use_persistent_cache(cache.name)
  load = os.getloadavg()
  mesh = jax.make_mesh((DEVICES,), (AXIS,))
  json_path = Path(args.out).with_suffix(".json")
  old = json.loads(json_path.read_text()) if args.append and json_path.exists() else {"runs": [], "rows": []}
  old.setdefault("runs", [{k: old[k] for k in ("command", "commit", "load_start", "load_end") if k in old}])
  run = {"command": shlex.join(["python", "benchmarks/compile_time.py", *sys.argv[1:]]),
         "commit": _git_commit(), "load_start": list(load)}
  runs_meta = old["runs"] + [run]
  rows = list(old["rows"])
  for r in rows:
    r.setdefault("run", 1)
  for leaves in [int(x) for x in args.leaves.split(",") if x]:
    if args.restart:
      rows.append({"leaves": leaves, "shapes": len(SHAPES), "restart": restart(leaves, mesh),
                   "run": len(runs_meta)})
      run["load_end"] = list(os.getloadavg())
      _write(args, runs_meta, rows)
      continue
    runs = {name: [] for name in CONTESTANTS}
    for _ in range(args.repeats):
      for name in runs:
        r = measure(name, leaves, mesh)
        runs[name].append(r)
        print(f"{leaves} leaves, {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items())
              + f"  load {os.getloadavg()[0]:.2f}", flush=True)
    med = {name: {k: float(np.median([r[k] for r in rs])) for k in rs[0]} for name, rs in runs.items()}
    rows.append({"leaves": leaves, "shapes": len(SHAPES), "repeats": args.repeats,
                 "median": med, "all": runs, "run": len(runs_meta)})
    if args.kernels:
      rows[-1]["kernels"] = {name: kernels(name, leaves, mesh) for name in CONTESTANTS}
      print(f"{leaves} leaves: {rows[-1]['kernels']}", flush=True)
    run["load_end"] = list(os.getloadavg())
    _write(args, runs_meta, rows)  # after each tree: a partial table survives an interrupted run


def _restart_lines(rows) -> list:
  """The table of the runs with ``--restart``: a restarted job's compile from the persistent cache."""
  counted = [r for r in rows if "restart" in r]
  if not counted:
    return []
  lines = ["", "A restarted job (runs with `--restart`): with JAX's persistent compilation cache "
           "(`jax_compilation_cache_dir`) in a fresh directory, the first trace + lower + compile "
           "(cold: compiles and writes the cache) and a fresh function's (warm: reads XLA's "
           "executable from the cache; tracing and lowering are paid again).", "",
           "| leaves | run | contestant | cold (s) | warm (s) | of which compile (s) | "
           "warm / cold | warm / adam cold |", "|---:|---:|---|---:|---:|---:|---:|---:|"]
  for r in counted:
    adam = r["restart"]["adam"]["cold_s"]
    for name, t in r["restart"].items():
      lines.append(f"| {r['leaves']} | {r['run']} | {name} | {t['cold_s']:.2f} | {t['warm_s']:.2f} "
                   f"| {t['warm_compile_s']:.2f} | {t['warm_s'] / t['cold_s']:.2f} | "
                   f"{t['warm_s'] / adam:.2f}x |")
  return lines


def _kernel_lines(rows) -> list:
  """The table of what XLA:CPU compiled, for the rows of runs with ``--kernels``."""
  counted = [r for r in rows if "kernels" in r]
  if not counted:
    return []
  lines = ["", "What XLA:CPU compiled (runs with `--kernels`: the same step compiled once more, "
           "untimed, with `xla_dump_to`): fused computations in the program, kernels (distinct "
           "fused computations, one LLVM module each) and lines of their optimized LLVM IR.", "",
           "| leaves | run | contestant | fusions | kernels | IR lines | kernels / adam | "
           "IR lines / adam |", "|---:|---:|---|---:|---:|---:|---:|---:|"]
  for r in counted:
    a = r["kernels"]["adam"]
    for name, k in r["kernels"].items():
      lines.append(f"| {r['leaves']} | {r['run']} | {name} | {k['fusions']} | {k['kernels']} | "
                   f"{k['ir_lines']:,} | {k['kernels'] / a['kernels']:.1f}x | "
                   f"{k['ir_lines'] / a['ir_lines']:.1f}x |")
  kinds = [(r, name, k["ir_by_kind"]) for r in counted for name, k in r["kernels"].items()
           if k.get("ir_by_kind")]
  if kinds:
    lines += ["", "The kinds of kernel with the most IR (runs that recorded them): kind, kernels, "
              "IR lines, share of the contestant's IR.", ""]
    for r, name, top in kinds:
      total = r["kernels"][name]["ir_lines"]
      lines.append(f"- {r['leaves']} leaves, run {r['run']}, {name}: " + "; ".join(
          f"`{kind}` {c}, {n:,} ({100 * n / total:.0f}%)" for kind, c, n in top))
  return lines


def _write(args, runs_meta, rows):
  lines = [
      "#### Compile time of the train step: 1-bit Adam and 0/1 Adam vs Adam + pmean, 8 devices",
      "",
      f"jax {jax.__version__}, optax {optax.__version__}, onebit_optax {onebit_optax.__version__}, "
      f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs (shared). Runs:",
      "",
  ]
  for i, m in enumerate(runs_meta):
    fmt = lambda x: " ".join(f"{v:.2f}" for v in x) if x else "?"
    lines.append(f"- run {i + 1}: `{m.get('command', '?')}` (commit {m.get('commit', '?')}); load "
                 f"average (1/5/15 min) at start {fmt(m.get('load_start'))}, at end "
                 f"{fmt(m.get('load_end'))}.")
  lines += [
      "",
      f"Seconds to trace (`jit(...).trace`, including building the abstract state), lower and "
      f"compile the `jax.jit(jax.shard_map(step), donate_argnums=(0, 1))` train step on "
      f"{DEVICES} simulated host devices, from abstract arguments; leaves of about 1000 float32 "
      f"elements in {len(SHAPES)} distinct shapes. 1-bit Adam: "
      f"`onebit_adam(axis_name='data')`, one program for both phases; "
      f"0/1 Adam: `zero_one_adam(axis_name='data', var_freeze_step=100)`, one program for every "
      f"kind of step; both on local gradients (`local_params`); Adam: `optax.adam` on "
      f"`jax.lax.pmean` of them. Median of the repeats, a fresh function each time, contestants "
      f"alternating. Goal: each / adam <= {GOAL} (total).",
      "",
      "| leaves | run | repeats | **adam total** | 1-bit trace | 1-bit lower | 1-bit compile "
      "| **1-bit total** | **1-bit / adam** | **0/1 total** | **0/1 / adam** | goal met |",
      "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
  ]
  for r in (r for r in rows if "median" in r):  # (--restart rows have their own table)
    a, o = r["median"]["adam"], r["median"]["onebit"]
    z = r["median"].get("zero_one")  # (rows of runs before 0/1 Adam was measured have none)
    r["ratio"] = o["total_s"] / a["total_s"]
    r["zero_one_ratio"] = None if z is None else z["total_s"] / a["total_s"]
    met = r["ratio"] <= GOAL and (z is None or r["zero_one_ratio"] <= GOAL)
    zero_one = ("–", "–") if z is None else (f"**{z['total_s']:.2f}**",
                                             f"**{r['zero_one_ratio']:.2f}x**")
    lines.append(
        f"| {r['leaves']} | {r['run']} | {r['repeats']} | **{a['total_s']:.2f}** | "
        f"{o['trace_s']:.2f} | {o['lower_s']:.2f} | {o['compile_s']:.2f} | "
        f"**{o['total_s']:.2f}** | **{r['ratio']:.2f}x** | {zero_one[0]} | {zero_one[1]} | "
        f"{'yes' if met else '**no**'} |")
  lines += _kernel_lines(rows) + _restart_lines(rows)
  out = Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text("\n".join(lines) + "\n")
  out.with_suffix(".json").write_text(json.dumps(
      {"jax": jax.__version__, "runs": runs_meta, "rows": rows}, indent=1) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
