"""Compute and memory cost of a 1-bit Adam train step versus an Adam train step.

    .venv/bin/python benchmarks/optimizer_compute.py                       # 1e6, 1e7, 1e8
    .venv/bin/python benchmarks/optimizer_compute.py --sizes 1e6,1e7 --repeats 9
    .venv/bin/python benchmarks/optimizer_compute.py --sizes 1e8 --repeats 3 --append

What is timed: the jitted train step the way a user runs it,

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state, grads):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

with params and state donated, for ``optax.adam``, 1-bit Adam in warmup
(``onebit_adam(..., freeze=10**9)``) and 1-bit Adam in the compression phase
(``freeze=1``, frozen after a few steps: the state's ``frozen``). Why the
whole step and not ``jax.jit(tx.update, donate_argnums=1)``: jax pairs donated
buffers with outputs by shape, in order, so there the donated ``mu`` buffer
goes to the first parameter-shaped output, the *update*, and the new moments
are written to fresh buffers: the program measures copies (and, on XLA:CPU,
page faults of fresh > 32 MB mmaps) that a real step, whose params are donated
too, does not make.

Two settings:

(a) one device, ``axis_name=None`` (no communication; 1-bit Adam still
    compresses, packs and unpacks with error feedback);
(b) per device inside a 2-device ``jax.shard_map`` (simulated host devices):
    local gradients (``onebit_optax.local_params``), the state from
    ``onebit_optax.init_sharded`` / ``state_partition_specs``; against
    ``optax.adam`` on ``jax.lax.pmean`` of the gradients in the same mesh.

The contestants run interleaved (A, B, C, A, B, C, ...) so that load from other
processes hits them alike; the median of the repeats is reported. XLA runs one
intra-op thread per device (``--threads all`` lifts that).

Memory, in units of D (the parameter count, as float32 bytes 4 D): the state's
bytes (``jax.eval_shape(tx.init, ...)``; per device in the mesh) and the
compiled train step's temporaries (``.lower(...).compile().memory_analysis()
.temp_size_in_bytes``), for three trees: the benchmark's tree (4 leaves), 10
equal leaves, 1000 leaves of 10 elements.

Writes benchmarks/results/optimizer_compute.md and .json (``--append`` adds the
run's timing rows to the existing .json and rewrites the .md from all runs).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

_THREAD_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
_MESH_DEVICES = 2
RESULTS = Path(__file__).parent / "results"


def _parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--sizes", default="1e6,1e7,1e8",
                 help="comma-separated parameter counts (default: 1e6,1e7,1e8)")
  p.add_argument("--repeats", type=int, default=7, help="timed steps per contestant and size")
  p.add_argument("--settings", default="single,mesh",
                 help="comma-separated: single (one device), mesh (2-device shard_map)")
  p.add_argument("--threads", choices=("1", "all"), default="1",
                 help="XLA CPU intra-op threads per device: 1 (default) or all")
  p.add_argument("--no-memory", action="store_true", help="skip the memory tables")
  p.add_argument("--append", action="store_true",
                 help="add this run's rows to the existing .json instead of replacing it")
  p.add_argument("--out", default=str(RESULTS / "optimizer_compute.md"))
  return p.parse_args(argv)


ARGS = _parse_args(sys.argv[1:]) if __name__ == "__main__" else None
_flags = [f"--xla_force_host_platform_device_count={_MESH_DEVICES}"]
if ARGS is None or ARGS.threads == "1":
  _flags.append(_THREAD_FLAGS)
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", "")] + _flags).strip()

import jax  # noqa: E402  (XLA_FLAGS must be set first)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import onebit_optax  # noqa: E402

import _provenance  # noqa: E402  (benchmarks/, the script's directory)
from optax.tree_utils import tree_get  # noqa: E402


LR = 1e-3
AXIS = "data"
GOALS = {"warmup": 1.1, "compression": 1.3}
WARMUP_FREEZE = 10**9


# ----------------------------------------------------------------------------- trees

def make_tree(size: int, seed: int = 0):
  """A parameter-shaped tree of ``size`` float32 values in 4 leaves (1/2, 1/4, 1/8, rest)."""
  shapes, used = [], 0
  for frac in (2, 4, 8):
    rows = size // frac // 128
    shapes.append((rows, 128))
    used += rows * 128
  shapes.append((size - used,))
  return _random_tree(shapes, seed)


def _random_tree(shapes, seed):
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return {f"w{i:04d}": jax.random.normal(k, s, jnp.float32) for i, (k, s) in enumerate(zip(keys, shapes))}


def memory_trees(size: int):
  """The three trees of the memory table, as ShapeDtypeStructs (name, tree)."""
  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  bench = jax.eval_shape(lambda: make_tree(size))
  equal = {f"w{i:02d}": s(size // 10) for i in range(10)}
  tiny = {f"w{i:04d}": s(10) for i in range(1000)}
  return [(f"benchmark tree (4 leaves, D={size:,})", bench),
          (f"10 equal leaves (D={10 * (size // 10):,})", equal),
          ("1000 leaves of 10 (D=10,000)", tiny)]


def _num_params(tree) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


# ----------------------------------------------------------------------------- optimizers

def _optimizers(axis_name):
  return {
      "adam": optax.adam(LR),
      "warmup": onebit_optax.onebit_adam(LR, axis_name=axis_name, freeze=WARMUP_FREEZE),
      "compression": onebit_optax.onebit_adam(LR, axis_name=axis_name, freeze=1),
  }


def _single_step(tx):
  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return step


def _mesh():
  return jax.make_mesh((_MESH_DEVICES,), (AXIS,))


def _mesh_step(tx, mesh, state_specs, onebit: bool):
  """jit(shard_map(step)): local gradients; Adam gets their pmean, 1-bit Adam averages itself."""
  def body(params, state, grads):
    grads = onebit_optax.local_params(grads, AXIS)  # per-device gradients, as jax.grad would give
    if not onebit:
      grads = jax.lax.pmean(grads, AXIS)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(), state_specs, P()),
                         out_specs=(P(), state_specs))
  return jax.jit(mapped, donate_argnums=(0, 1))


def _setup(setting: str, name: str, tx, params, mesh=None):
  """(step, state, state_specs) of one contestant; the state of 'compression' already frozen."""
  onebit = name != "adam"
  if setting == "single":
    step, state, specs = _single_step(tx), tx.init(params), None
  else:
    if onebit:
      state = onebit_optax.init_sharded(tx, params, mesh, AXIS)
      specs = onebit_optax.state_partition_specs(state, AXIS)
    else:
      state = jax.device_put(tx.init(params), NamedSharding(mesh, P()))
      specs = jax.tree.map(lambda _: P(), state)
    step = _mesh_step(tx, mesh, specs, onebit)
  return step, state, specs


def _place(tree, mesh):
  return tree if mesh is None else jax.device_put(tree, NamedSharding(mesh, P()))


# ----------------------------------------------------------------------------- timing

def compare(setting: str, size: int, repeats: int) -> dict:
  mesh = _mesh() if setting == "mesh" else None
  grads = _place(make_tree(size, 1), mesh)
  contestants = {}
  for name, tx in _optimizers(AXIS if mesh is not None else None).items():
    params = _place(make_tree(size, 0), mesh)
    step, state, _ = _setup(setting, name, tx, params, mesh)
    for _ in range(3):  # compile, warm, and (compression) pass the freeze
      params, state = step(params, state, grads)
    jax.block_until_ready((params, state))
    if name != "adam":
      frozen = bool(tree_get(state, "frozen"))
      assert frozen == (name == "compression"), (name, frozen)
    contestants[name] = [step, params, state]
  times = {name: [] for name in contestants}
  for _ in range(repeats):
    for name, c in contestants.items():
      step, params, state = c
      t = time.perf_counter()
      params, state = step(params, state, grads)
      jax.block_until_ready((params, state))
      times[name].append(time.perf_counter() - t)
      c[1], c[2] = params, state
  assert bool(tree_get(contestants["compression"][2], "frozen"))
  assert not bool(tree_get(contestants["warmup"][2], "frozen"))
  med = {name: float(np.median(ts)) for name, ts in times.items()}
  del contestants
  return {"setting": setting, "size": size, "repeats": repeats,
          "adam_s": med["adam"], "warmup_s": med["warmup"], "compression_s": med["compression"],
          "warmup_ratio": med["warmup"] / med["adam"],
          "compression_ratio": med["compression"] / med["adam"],
          "all_s": {k: [float(x) for x in v] for k, v in times.items()}}


# ----------------------------------------------------------------------------- memory

def _bytes(tree) -> int:
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _per_device_state(tx, params, mesh, onebit: bool):
  """Per-device state shapes under the mesh (out_specs=P() with check_vma=False: local shapes)."""
  if not onebit:
    return jax.eval_shape(tx.init, params)
  return jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=(P(),), out_specs=P(),
                                      check_vma=False), params)


def memory(setting: str, tree) -> dict:
  """State bytes and compiled-step temporaries (per device), in units of 4 D bytes."""
  d4 = 4 * _num_params(tree)
  mesh = _mesh() if setting == "mesh" else None
  out = {}
  for name, tx in _optimizers(AXIS if mesh is not None else None).items():
    onebit = name != "adam"
    if name == "compression":  # the same program and state as warmup (both phases in one program)
      continue
    if mesh is None:
      state = jax.eval_shape(tx.init, tree)
      step = _single_step(tx)
      args = (tree, state, tree)
    else:
      state = _per_device_state(tx, tree, mesh, onebit)
      if onebit:
        specs = onebit_optax.state_partition_specs(state, AXIS)
        glob = jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=(P(),), out_specs=specs),
                              tree)
      else:
        specs = jax.tree.map(lambda _: P(), state)
        glob = state
      step = _mesh_step(tx, mesh, specs, onebit)
      shard = lambda t, sp: jax.tree.map(
          lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)), t, sp)
      args = (shard(tree, jax.tree.map(lambda _: P(), tree)), shard(glob, specs),
              shard(tree, jax.tree.map(lambda _: P(), tree)))
    compiled = step.lower(*args).compile()
    mem = compiled.memory_analysis()
    out[name] = {"state_D": _bytes(state) / d4, "temp_D": mem.temp_size_in_bytes / d4,
                 "temp_bytes": int(mem.temp_size_in_bytes)}
  return out


def update_only_temporaries(tree) -> dict:
  """Temporaries of ``jax.jit(tx.update, donate_argnums=1)`` (the misleading measurement), in D."""
  d4 = 4 * _num_params(tree)
  out = {}
  for name, tx in _optimizers(None).items():
    if name == "compression":
      continue
    update = jax.jit(lambda g, s, p, tx=tx: tx.update(g, s, p), donate_argnums=1)
    mem = update.lower(tree, jax.eval_shape(tx.init, tree), tree).compile().memory_analysis()
    out[name] = mem.temp_size_in_bytes / d4
  return out


# ----------------------------------------------------------------------------- report

_git_commit = _provenance.git_commit


def _ok(ok: bool) -> str:
  return "yes" if ok else "**no**"


def render(data: dict) -> list:
  lines = [
      "#### Optimizer compute and memory: 1-bit Adam (warmup and compression) vs Adam",
      "",
      "Commands (one per run; rows below say which run they come from):",
      "",
  ]
  for i, run in enumerate(data["runs"]):
    lines.append(f"- run {i + 1}: `{run['command']}`: jax {run['jax']}, optax {run['optax']}, "
                 f"onebit_optax {run['onebit_optax']} (commit {run['commit']}), {run['machine']}, "
                 f"{run['cpus']} CPUs, XLA intra-op threads per device: {run['threads']}; "
                 f"load average (1/5/15 min) at start {run['load_start']}, at end {run['load_end']}.")
  lines += [
      "",
      "Timed: the jitted train step `params, state = step(params, state, grads)` "
      "(`tx.update` + `optax.apply_updates`, `donate_argnums=(0, 1)`: params and state "
      "donated), median of interleaved repeats (adam, warmup, compression, adam, ...). "
      "Why the whole step: jax pairs donated buffers with outputs by shape, in order, so "
      "`jax.jit(tx.update, donate_argnums=1)` hands mu's buffer to the *update* output and "
      "writes the new moments to fresh buffers: it measures copies that a real step does not "
      "make. Warmup: `onebit_adam(..., freeze=10**9)`; compression: `freeze=1`, timed after "
      "the freeze (the state's `frozen` checked). 'one device': `axis_name=None` (no communication; "
      "compress, pack, unpack, worker error feedback). 'mesh, per device': a 2-device "
      "`jax.shard_map` on simulated host devices (one thread each, both on the shared 2 cores), "
      "local gradients (`local_params`), state from `init_sharded`/`state_partition_specs`; "
      "Adam gets `jax.lax.pmean` of the gradients in the same mesh. Goals: warmup/adam <= "
      f"{GOALS['warmup']}, compression/adam <= {GOALS['compression']}.",
      "",
      "| setting | parameters | repeats | run | adam (ms) | warmup (ms) | **warmup/adam** | "
      "compression (ms) | **compression/adam** | goals met |",
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
  ]
  label = {"single": "one device", "mesh": f"mesh, per device ({_MESH_DEVICES})"}
  for r in sorted(data["rows"], key=lambda r: (r["setting"] != "single", r["size"], r["run"])):
    ok = r["warmup_ratio"] <= GOALS["warmup"] and r["compression_ratio"] <= GOALS["compression"]
    lines.append(
        f"| {label[r['setting']]} | {r['size']:,} | {r['repeats']} | {r['run']} | "
        f"{r['adam_s'] * 1e3:.1f} | {r['warmup_s'] * 1e3:.1f} | **{r['warmup_ratio']:.2f}** | "
        f"{r['compression_s'] * 1e3:.1f} | **{r['compression_ratio']:.2f}** | {_ok(ok)} |")
  for note in data.get("notes", []):
    lines += ["", note]
  if data.get("memory"):
    lines += [
        "",
        f"Memory (from run {data.get('memory_run', len(data['runs']))}) in units of D "
        "(parameter count x 4 bytes): the state's bytes "
        "(`jax.eval_shape(tx.init, ...)`; in the mesh per device) and the compiled train "
        "step's temporaries (`memory_analysis().temp_size_in_bytes`, per device). 1-bit "
        "Adam's warmup and compression are one program and one state. Goals: state <= "
        "2D + D/n + D/16 (n devices), temporaries <= 0.1 D (one device).",
        "",
        "| setting | tree | adam state | 1-bit state | state goal | state ok | adam temps | "
        "1-bit temps | temps ok |",
        "|---|---|---:|---:|---:|---|---:|---:|---|",
    ]
    for m in data["memory"]:
      n = 1 if m["setting"] == "single" else _MESH_DEVICES
      goal = 2 + 1 / n + 1 / 16
      a, o = m["adam"], m["warmup"]
      temps_ok = _ok(o["temp_D"] <= 0.1) if m["setting"] == "single" else "(goal: one device)"
      lines.append(
          f"| {label[m['setting']]} | {m['tree']} | {a['state_D']:.3f} | {o['state_D']:.3f} | "
          f"{goal:.3f} | {_ok(o['state_D'] <= goal)} | {a['temp_D']:.3f} | {o['temp_D']:.3f} | "
          f"{temps_ok} |")
  if data.get("update_only"):
    u = data["update_only"]
    lines += ["", "For comparison, temporaries of `jax.jit(tx.update, donate_argnums=1)` (not "
              f"the train step) on one device, {u['tree']}: " +
              ", ".join(f"{k} {v:.2f} D" for k, v in u["temps"].items()) +
              " (the copies the train step does not make)."]
  return lines


def main():
  args = ARGS
  out = Path(args.out)
  json_path = out.with_suffix(".json")
  data = {"runs": [], "rows": [], "memory": [], "notes": []}
  if args.append and json_path.exists():
    data = json.loads(json_path.read_text())
  run_index = len(data["runs"]) + 1
  load = os.getloadavg()
  run = {"command": shlex.join(["python", "benchmarks/optimizer_compute.py", *sys.argv[1:]]),
         "jax": jax.__version__, "optax": optax.__version__,
         "onebit_optax": onebit_optax.__version__, "commit": _git_commit(),
         "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
         "threads": args.threads, "load_start": " ".join(f"{x:.2f}" for x in load)}
  print(f"run {run_index}: {run}", flush=True)
  sizes = [int(float(s)) for s in args.sizes.split(",") if s]
  settings = [s for s in args.settings.split(",") if s]
  for size in sizes:
    for setting in settings:
      r = compare(setting, size, args.repeats)
      r["run"] = run_index
      data["rows"].append(r)
      print(f"{setting} {size:,}: adam {r['adam_s'] * 1e3:.1f} ms, warmup {r['warmup_s'] * 1e3:.1f} "
            f"ms ({r['warmup_ratio']:.2f}x), compression {r['compression_s'] * 1e3:.1f} ms "
            f"({r['compression_ratio']:.2f}x)  load {os.getloadavg()[0]:.2f}", flush=True)
  if not args.no_memory:
    data["memory"] = []
    for setting in settings:
      for tree_name, tree in memory_trees(1_000_000):
        m = memory(setting, tree)
        data["memory"].append({"setting": setting, "tree": tree_name, **m})
        print(f"memory {setting} {tree_name}: {m}", flush=True)
    tree_name, tree = memory_trees(1_000_000)[0]
    data["update_only"] = {"tree": tree_name, "temps": update_only_temporaries(tree)}
    data["memory_run"] = run_index
  run["load_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
  data["runs"].append(run)
  lines = render(data)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text("\n".join(lines) + "\n")
  json_path.write_text(json.dumps(data, indent=1) + "\n")
  print("\n".join(lines))
  print(f"\nwrote {out} and {json_path}")


if __name__ == "__main__":
  main()
