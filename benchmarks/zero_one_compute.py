"""Compute cost of a 0/1 Adam train step, per kind of step, versus Adam and 1-bit Adam.

    .venv/bin/python benchmarks/zero_one_compute.py                    # 1M and 10M, both settings
    .venv/bin/python benchmarks/zero_one_compute.py --sizes 2.56e6 --settings single --repeats 15
    .venv/bin/python benchmarks/zero_one_compute.py --before OLD.json  # adds the earlier ratios

What is timed: the jitted train step ``params, state = step(params, state, grads)``
(``tx.update`` + ``optax.apply_updates``, ``donate_argnums=(0, 1)``), in two
settings: ``single``, one device, ``axis_name=None``; ``mesh``, per device in a
2-device ``jax.shard_map`` on local gradients (the state from ``init_sharded``,
Adam on their ``pmean``: the switch holds real collectives). Contestants: ``optax.adam``; ``onebit_adam`` in warmup and
in compression; ``zero_one_adam`` in a run of variance, compressed, local or
sync steps. Its schedule is set per kind so that such runs are long, and the
real schedule is run until the next ``--repeats`` steps are all of the kind
(read off the state's counters; each timed step's kind is checked): variance,
``var_update_scaler`` never reached (every step is one); compressed,
``var_update_scaler=1`` (variance steps at 1, 2, 4, 8, ...); local,
``local_steps=64``, ``local_step_scaler=1`` (after the freeze at step 12 the
interval between syncs doubles to 64); sync, ``local_steps=None`` (every step
after the freeze is a sync); local sync, ``local_steps=1`` (every step after
the freeze is a sync of one local step: what a sync costs with local steps). Every contestant trains on, as in a training loop:
each timed call donates the state that the previous one returned. (Until
this version each 0/1 Adam call started from a copy of one state, which was
slower on its own: in the 2-device mesh at 10M, 1-bit compression 1.72x Adam
from copies against 1.37x live, 0/1 compressed 1.74x against 1.28x.)
Contestants run interleaved (adam, warmup, ..., adam, ...), median of the
repeats. XLA: one intra-op thread (``--threads all`` lifts that).

HLO facts per program (compiled, ``jax.jit(step).lower(...).compile()``): the
number of ``copy`` instructions and the elements they copy, the number of
``conditional`` instructions and the bytes of the largest conditional's result
tuple, and ``memory_analysis().temp_size_in_bytes``.

Writes benchmarks/results/zero_one_compute.md (and, with ``--json``, the raw numbers).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def _parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--sizes", default="1e6,1e7", help="comma-separated parameter counts (default 1e6,1e7)")
  p.add_argument("--repeats", type=int, default=9, help="timed steps per contestant")
  p.add_argument("--threads", choices=("1", "all"), default="1")
  p.add_argument("--settings", default="single,mesh",
                 help="single: one device (axis_name=None); mesh: per device in a 2-device shard_map")
  p.add_argument("--leaves", type=int, default=0,
                 help="a tree of this many leaves in 20 shapes (default 0: the 6-leaf model-shaped tree)")
  p.add_argument("--json", default=None, help="also write the raw numbers here")
  p.add_argument("--before", default=None, help="a --json file of an earlier run: before/after table")
  p.add_argument("--out", default=str(RESULTS / "zero_one_compute.md"))
  return p.parse_args(argv)


ARGS = _parse_args(sys.argv[1:]) if __name__ == "__main__" else None
MESH_DEVICES = 2
if ARGS is not None:  # (the single setting runs on the first device)
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={MESH_DEVICES}")
if ARGS is None or ARGS.threads == "1":
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
                             " intra_op_parallelism_threads=1").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import onebit_optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import _provenance  # noqa: E402
from step_profile import _array_bytes as _shape_bytes  # noqa: E402  (bytes of the HLO shapes in a text)

LR = 1e-3
FREEZE = 12
NEVER = 10**9
# Per kind of 0/1 Adam step, a schedule with long runs of it (see the docstring).
KINDS = {"variance": dict(var_freeze_step=NEVER, var_update_scaler=NEVER),
         "compressed": dict(var_freeze_step=NEVER, var_update_scaler=1),
         "local": dict(var_freeze_step=FREEZE, local_steps=64, local_step_scaler=1),
         "sync": dict(var_freeze_step=FREEZE),
         # a sync of local steps (local_steps=1: every step after the freeze is one)
         "local sync": dict(var_freeze_step=FREEZE, local_steps=1, local_step_scaler=1)}


def make_tree(size: int, seed: int = 0, leaves: int = 0):
  """A model-shaped tree: two matrices, an embedding, biases (1/2, 1/4, 1/8, rest; small leaves too).

  ``leaves`` > 0: that many leaves in 20 shapes instead (matrices ``(r, 128)`` of 1 to 3
  units and vectors, about ``size`` parameters in all), as a model without scan-over-layers.
  """
  if leaves:
    unit = max(size // (2 * leaves * 128), 1)
    shapes = [(unit * (1 + k % 3), 128) if k % 2 else (unit * 128 * (1 + k % 3),) for k in range(20)]
    keys = jax.random.split(jax.random.key(seed), leaves)
    return {f"w{i:04d}": jax.random.normal(keys[i], shapes[i % 20], jnp.float32) for i in range(leaves)}
  shapes, used = [], 0
  for frac in (2, 4, 8):
    rows = size // frac // 128
    shapes.append((rows, 128))
    used += rows * 128
  shapes += [(128,), (32,), (size - used - 160,)]
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return {f"w{i}": jax.random.normal(k, s, jnp.float32) for i, (k, s) in enumerate(zip(keys, shapes))}


AXIS = "data"


def _step(tx, mesh=None, state=None, onebit=False):
  """The donated train step; in a mesh, a shard_map of local gradients (Adam: their pmean)."""
  def body(params, state, grads):
    if mesh is not None:
      grads = onebit_optax.local_params(grads, AXIS)  # per-device gradients, as jax.grad gives
      if not onebit:
        grads = jax.lax.pmean(grads, AXIS)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  if mesh is not None:
    specs = (onebit_optax.state_partition_specs(state, AXIS) if onebit
             else jax.tree.map(lambda _: P(), state))
    body = jax.shard_map(body, mesh=mesh, in_specs=(P(), specs, P()), out_specs=(P(), specs))
  return jax.jit(body, donate_argnums=(0, 1))


def _init(tx, params, mesh, onebit):
  if mesh is None:
    return tx.init(params)
  if onebit:
    return onebit_optax.init_sharded(tx, params, mesh, AXIS)
  return jax.device_put(tx.init(params), NamedSharding(mesh, P()))


def place(tree, mesh):
  return tree if mesh is None else jax.device_put(tree, NamedSharding(mesh, P()))


def _phase(state) -> str:
  return onebit_optax.status(state).phase


def _zero_one(state) -> onebit_optax.ScaleByZeroOneAdamState:
  is_zo = lambda x: isinstance(x, onebit_optax.ScaleByZeroOneAdamState)
  return next(s for s in jax.tree.leaves(state, is_leaf=is_zo) if is_zo(s))


def _ahead(state, kind: str) -> int:
  """How many of the next steps are surely of ``kind`` under ``KINDS[kind]``, from the counters."""
  s = _zero_one(state)
  count, value = int(s.count), lambda x: int(np.asarray(x))
  if kind == "variance":
    return NEVER
  if kind == "compressed":  # the next variance step is the next multiple of the interval
    return (count // value(s.var_interval) + 1) * value(s.var_interval) - count - 1
  if count < FREEZE:
    return 0
  if kind in ("sync", "local sync"):
    return NEVER
  return value(s.local_interval) - value(s.since_sync) - 1  # local steps before the next sync


def _into_run(step, params, state, grads, kind: str, length: int, limit: int = 400):
  """Runs the real schedule until the next ``length`` steps are all ``kind`` steps."""
  for _ in range(limit):
    if _ahead(state, kind) >= length:
      return params, state
    params, state = step(params, state, grads)
  raise RuntimeError(f"no run of {length} {kind} steps within {limit} steps")


NAMES = ("adam", "1-bit warmup", "1-bit compression") + tuple(f"0/1 {kind}" for kind in KINDS)


def _optimizer(name: str, axis):
  if name == "adam":
    return optax.adam(LR)
  if name.startswith("1-bit"):
    return onebit_optax.onebit_adam(LR, axis_name=axis, freeze=NEVER if name.endswith("warmup") else 1)
  return onebit_optax.zero_one_adam(LR, axis_name=axis, **KINDS[name.removeprefix("0/1 ")])


def contestant(name: str, size: int, grads, mesh=None, repeats: int = 1, leaves: int = 0):
  """(step, params, state) of contestant ``name`` (:data:`NAMES`), trained on into a run of its kind."""
  tx, onebit = _optimizer(name, None if mesh is None else AXIS), name != "adam"
  params = place(make_tree(size, 0, leaves), mesh)
  state = _init(tx, params, mesh, onebit)
  step = _step(tx, mesh, state, onebit)
  if name.startswith("0/1"):
    return (step, *_into_run(step, params, state, grads, name.removeprefix("0/1 "), repeats + 1))
  for _ in range(3):
    params, state = step(params, state, grads)
  return step, params, state


def contestants(size: int, grads, mesh=None, repeats: int = 1, leaves: int = 0):
  """name -> (step, params, state): each trains on from its state, one kind of step per name."""
  return {name: contestant(name, size, grads, mesh, repeats, leaves) for name in NAMES}


def time_all(cands, grads, repeats: int, rotate: bool = False,
             check: bool = True) -> tuple[dict, dict]:
  """Interleaved timed steps: the times per contestant, and the contestants with their live state.

  ``rotate``: each repeat starts one contestant later (no contestant always
  follows the same one). ``check``: a 0/1 Adam contestant's steps are of the
  kind its name ends with.
  """
  times = {name: [] for name in cands}
  live = {name: [c[1], c[2]] for name, c in cands.items()}
  order = list(cands)
  for r in range(repeats):
    shift = r % len(order) if rotate else 0
    for name in order[shift:] + order[:shift]:
      step = cands[name][0]
      p, s = live[name]
      jax.block_until_ready((p, s))
      t = time.perf_counter()
      p, s = step(p, s, grads)
      jax.block_until_ready((p, s))
      times[name].append(time.perf_counter() - t)
      if check and name.startswith("0/1"):
        assert _phase(s) == name.split()[-1], (name, _phase(s))
      live[name] = [p, s]
  return times, {name: (c[0], *live[name]) for name, c in cands.items()}


def hlo_facts(step, params, state, grads) -> dict:
  compiled = step.lower(params, state, grads).compile()
  text = compiled.as_text()
  copies = [ln for ln in text.splitlines() if re.search(r"= \S+ copy\(", ln)]
  copy_bytes = sum(_shape_bytes(ln.split("=", 1)[1].split("copy(", 1)[0]) for ln in copies)
  conds = [ln for ln in text.splitlines() if " conditional(" in ln]
  cond_bytes = max([_shape_bytes(ln.split("=", 1)[1].split("conditional(", 1)[0]) for ln in conds],
                   default=0)
  mem = compiled.memory_analysis()
  return {"copies": len(copies), "copy_bytes": copy_bytes, "conditionals": len(conds),
          "cond_result_bytes": cond_bytes, "temp_bytes": int(mem.temp_size_in_bytes)}


def measure(setting: str, size: int, repeats: int, leaves: int = 0) -> dict:
  load_start = os.getloadavg()
  mesh = jax.make_mesh((MESH_DEVICES,), (AXIS,)) if setting == "mesh" else None
  grads = place(make_tree(size, 1, leaves), mesh)
  cands = contestants(size, grads, mesh, repeats, leaves)
  d4 = 4 * sum(int(np.prod(x.shape)) for x in jax.tree.leaves(grads))
  facts = {name: hlo_facts(*c, grads) for name, c in cands.items()}
  times, _ = time_all(cands, grads, repeats)
  return {"setting": setting, "size": size, "load_start": [round(x, 2) for x in load_start],
          "load_end": [round(x, 2) for x in os.getloadavg()],
          "median_s": {name: float(np.median(ts)) for name, ts in times.items()}, "all_s": times,
          "facts": facts, "d4": d4}


def main(args) -> int:
  data = {"command": " ".join(["python", "benchmarks/zero_one_compute.py"] + [shlex.quote(a) for a in sys.argv[1:]]),
          "commit": _provenance.git_commit(), "jax": jax.__version__, "repeats": args.repeats,
          "threads": args.threads, "cpus": os.cpu_count(), "leaves": args.leaves, "runs": []}
  for setting in args.settings.split(","):
    for size in args.sizes.split(","):
      data["runs"].append(measure(setting, int(float(size)), args.repeats, args.leaves))
      print(f"{setting} {int(float(size)):,}: done", flush=True)
  if args.json:
    Path(args.json).write_text(json.dumps(data, indent=1))
  before = _runs(json.loads(Path(args.before).read_text())) if args.before else None
  Path(args.out).write_text("\n".join(render(data, before)) + "\n")
  print("\n".join(render(data, before)))
  return 0


def _runs(data) -> dict:
  """A --json file; one of this script's earlier single-run format as one 'single' run."""
  if "runs" in data:
    return data
  run = {k: data[k] for k in ("size", "load_start", "load_end", "median_s", "facts", "d4")}
  return {**data, "runs": [dict(run, setting=data.get("setting", "single"))]}


def _table(run) -> list:
  med, facts, d4 = run["median_s"], run["facts"], run["d4"]
  lines = ["| step | median (ms) | **/ adam** | copies (HLO) | copied (D) | conditionals | "
           "largest conditional result (D) | temp (D) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
  for name, t in med.items():
    f = facts[name]
    lines.append(f"| {name} | {1e3 * t:.1f} | {t / med['adam']:.2f} | {f['copies']} | "
                 f"{f['copy_bytes'] / d4:.2f} | {f['conditionals']} | {f['cond_result_bytes'] / d4:.2f} | "
                 f"{f['temp_bytes'] / d4:.2f} |")
  return lines


_WHERE = {"single": "one device, `axis_name=None`",
          "mesh": f"per device in a {MESH_DEVICES}-device `shard_map` mesh, Adam on the `pmean` of the local gradients"}


def _header(data) -> str:
  tree = (f"{data['leaves']} leaves in 20 shapes" if data.get("leaves") else
          "the 6-leaf model-shaped tree")
  return (f"`{data['command']}`: commit {data['commit']}, jax {data['jax']}, {tree}, {data['repeats']} "
          f"interleaved repeats, XLA intra-op threads {data['threads']}, {data['cpus']} CPUs "
          "(a shared machine: ratios measured side by side, not absolute times).")


def _run_title(run) -> str:
  return (f"{_WHERE[run['setting']]}, {run['d4'] // 4:,} parameters; load average (1/5/15 min) at "
          f"start {run['load_start']}, at end {run['load_end']}")


def _summary(data) -> list:
  lines = ["| setting | parameters | " + " | ".join(data["runs"][0]["median_s"]) + " |",
           "|---|---:|" + "---:|" * len(data["runs"][0]["median_s"])]
  for run in data["runs"]:
    med = run["median_s"]
    lines.append(f"| {run['setting']} | {run['size']:,} | " +
                 " | ".join(f"{t / med['adam']:.2f}" for t in med.values()) + " |")
  return lines


def render(data, before=None) -> list:
  lines = ["#### 0/1 Adam compute per kind of step vs Adam", "",
           "Timed: the jitted train step (`tx.update` + `optax.apply_updates`, params and state "
           "donated), median of interleaved repeats; every contestant trains on from the "
           "state its last call returned, each 0/1 Adam kind in a run of its kind (its own "
           f"schedule: variance, `var_update_scaler={NEVER}`; compressed, "
           "`var_update_scaler=1`; local, `local_steps=64, local_step_scaler=1`; sync, "
           f"`local_steps=None` after `var_freeze_step={FREEZE}`; local sync, `local_steps=1` "
           "(every step after the freeze a sync of one local step); each timed step's kind "
           "checked). D = parameter bytes (4 x count). HLO: "
           "the compiled step's `copy` instructions and their size, `conditional` count, the "
           "largest conditional's result tuple, `memory_analysis().temp_size_in_bytes` (per "
           "device). Goals (issue 25): 1-bit compression and every 0/1 step <= 1.3x Adam, "
           "1-bit warmup and 0/1 variance steps <= 1.1x.", "",
           ("After: " if before else "") + _header(data), "",
           "Step time / Adam's, every run:", ""] + _summary(data)
  for run in data["runs"]:
    lines += ["", f"**{_run_title(run)}**", ""] + _table(run)
  if before:
    lines += ["", "Before: " + _header(before), "", "Step time / Adam's:", ""] + _summary(before)
  return lines


if __name__ == "__main__":
  sys.exit(main(ARGS))
