"""Where a train step's time goes, kernel by kernel: every kind of step against Adam's (XLA:CPU profiler).

    .venv/bin/python benchmarks/step_profile.py                              # 10M, the 6-leaf tree
    .venv/bin/python benchmarks/step_profile.py --size 3.9e6 --leaves 300 --out /tmp/p.md

The contestants are ``benchmarks/zero_one_compute.py``'s (``optax.adam``; 1-bit
Adam in warmup and in compression; 0/1 Adam in a run of each kind of step), one
device, one XLA intra-op thread, each training on from its own state. Per
contestant: the median step time untraced (interleaved repeats), then
``--steps`` steps under ``jax.profiler.trace``, whose events are summed per
step: every compiled kernel (an event named as an instruction of the compiled
program: fusions, copies, the kernels inside conditionals, reductions; the
conditionals themselves are containers, left out), and PJRT's host-side work
around the executable (``ExecuteHelperOnSingleDevice``: arguments, outputs,
the launch).
The top kernels are named with the jax operation they came from (the HLO
``op_name``), which says which stage of the step each one is.

Memory traffic, counted, not timed: each kernel's bytes read and written, from
the compiled program (a fusion's operands and results; an operand that the
fused computation reads only through slices counts the slices; a
``dynamic-update-slice`` writes its update in place), summed over the kernels
one step runs, in units of D (4 bytes x parameters). It says what a data-flow
change does without the noise of timing (on XLA:CPU ``optax.adam`` moves 10 D a
step: three kernels a leaf, ``m``, ``v``, then the update with the parameters).
An upper bound where a kernel selects between two operands on a scalar
(``jnp.where(flag, a, b)``): both count, but XLA:CPU reads only the chosen one
(20M elements, one thread: 10.2 ms against 9.9 ms reading one operand and
13.7 ms adding both).

Numbers under the profiler are larger than untraced ones; read them as shares.
Writes benchmarks/results/step_profile.md.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import shlex
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

import _provenance

RESULTS = Path(__file__).parent / "results"
HOST = "CommonPjRtLoadedExecutable::ExecuteHelperOnSingleDevice"


def _parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--size", default="1e7", help="parameters (default 1e7)")
  p.add_argument("--leaves", type=int, default=0, help="leaves in 20 shapes (0: the 6-leaf tree)")
  p.add_argument("--steps", type=int, default=10, help="traced steps per contestant")
  p.add_argument("--repeats", type=int, default=15, help="untraced timed steps per contestant")
  p.add_argument("--top", type=int, default=8, help="kernels listed per contestant")
  p.add_argument("--out", default=str(RESULTS / "step_profile.md"))
  return p.parse_args(argv)


def _op_names(text: str) -> dict:
  """Kernel name -> the jax op_name it came from, over the whole compiled program (its text).

  Conditionals are left out: their events contain their branches' kernels.
  """
  out = {}
  for line in text.splitlines():
    m = re.match(r"\s+(?:ROOT )?%?([\w.\-]+) = ", line)
    if m and " conditional(" not in line:
      op = re.search(r'op_name="([^"]*)"', line)
      out[m.group(1)] = op.group(1) if op else ""
  return out


_BYTES = {"f32": 4, "s32": 4, "u32": 4, "u8": 1, "s8": 1, "pred": 1, "f16": 2, "bf16": 2,
          "f64": 8, "s64": 8, "u64": 8}
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = ")
_SLICES = ("slice", "dynamic-slice")


def _array_bytes(shape: str) -> int:
  return sum(_BYTES.get(t, 0) * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
             for t, dims in re.findall(r"(\w+)\[([0-9,]*)\]", shape))


def _instruction(line: str, root: bool) -> dict:
  """One instruction line after ``%name = ``: its result bytes, opcode, operands, called computation."""
  shape, rest = (line.split(") ", 1) if line.startswith("(") else line.split(" ", 1))
  opcode, rest = rest.split("(", 1)
  depth, end = 1, 0
  while depth:
    depth += {"(": 1, ")": -1}.get(rest[end], 0)
    end += 1
  calls = re.search(r"calls=%([\w.\-]+)", rest[end:])
  return {"bytes": _array_bytes(shape), "opcode": opcode, "root": root,
          "operands": re.findall(r"%([\w.\-]+)", rest[:end - 1]),
          "number": int(rest[:end - 1]) if opcode == "parameter" else None,
          "calls": calls.group(1) if calls else None}


def _parsed(text: str) -> tuple[dict, dict]:
  """The compiled program's computations (name -> instruction names) and instructions (name -> fields)."""
  computations, instructions, current = {}, {}, None
  for line in text.splitlines():
    head = _COMPUTATION.match(line)
    if head:
      current = computations.setdefault(head.group(1), [])
    elif (m := _INSTRUCTION.match(line)) and current is not None:
      instructions[m.group(2)] = _instruction(line[m.end():], bool(m.group(1)))
      current.append(m.group(2))
  return computations, instructions


def _read_bytes(name: str, users_of: dict, instructions: dict, whole: int) -> int:
  """Bytes a fused computation reads of ``name``: ``whole``, or only what slices take of it.

  Followed through bitcasts and slices of slices (a static slice of the message
  whose one user is a dynamic slice of one leaf's blocks reads that leaf's
  blocks); a ``dynamic-update-slice`` into it is an in-place write, no read.
  """
  users = users_of.get(name, [])
  through = lambda u: instructions[u]["opcode"] in _SLICES + ("bitcast",)
  in_place = lambda u: (instructions[u]["opcode"] == "dynamic-update-slice" and
                        instructions[u]["operands"][0] == name)
  if not users or not all(through(u) or in_place(u) for u in users):
    return whole
  return sum(_read_bytes(u, users_of, instructions, instructions[u]["bytes"])
             for u in users if through(u))


def _fusion_bytes(fusion: dict, body: list, instructions: dict) -> int:
  """Bytes a fusion reads (its operands; only the slices of one read through slices) and writes."""
  size = lambda n: instructions[n]["bytes"] if n in instructions else 0
  params = sorted((n for n in body if instructions[n]["opcode"] == "parameter"),
                  key=lambda n: instructions[n]["number"])
  users_of = {}
  for n in body:
    for o in instructions[n]["operands"]:
      users_of.setdefault(o, []).append(n)
  total = sum(_read_bytes(param, users_of, instructions, size(operand))
              for param, operand in zip(params, fusion["operands"]))
  root = instructions[next(n for n in body if instructions[n]["root"])]
  results = [instructions[n] for n in root["operands"]] if root["opcode"] == "tuple" else [root]
  return total + sum(size(r["operands"][1]) if r["opcode"] == "dynamic-update-slice"
                     else r["bytes"] for r in results)


_NOT_KERNELS = ("parameter", "constant", "get-tuple-element", "tuple", "bitcast", "conditional",
                "while", "call")


def kernel_bytes(text: str) -> dict:
  """Kernel name -> the bytes it reads and writes, for every kernel of the compiled program's text.

  Kernels: the instructions that run (not parameters, tuples, bitcasts, nor the
  conditionals that contain their branches' kernels), outside fused computations.
  """
  computations, instructions = _parsed(text)
  fused = {ins["calls"] for ins in instructions.values() if ins["opcode"] == "fusion"}
  inside = {n for c in fused for n in computations.get(c, ())}
  out = {}
  for name, ins in instructions.items():
    if name in inside or ins["opcode"] in _NOT_KERNELS:
      continue
    if ins["calls"] in computations and ins["opcode"] == "fusion":
      out[name] = _fusion_bytes(ins, computations[ins["calls"]], instructions)
    else:
      out[name] = ins["bytes"] + sum(instructions[o]["bytes"] for o in ins["operands"]
                                     if o in instructions)
  return out


def _traced(step, params, state, grads, steps: int):
  """Runs ``steps`` steps under the profiler; returns (events per name summed, the new params, state)."""
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d, create_perfetto_trace=True):
      for _ in range(steps):
        params, state = step(params, state, grads)
      jax.block_until_ready((params, state))
    path = glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)[0]
    events = json.load(gzip.open(path))["traceEvents"]
  total, count = collections.Counter(), collections.Counter()
  for e in events:
    if e.get("ph") == "X":
      total[e["name"]] += e["dur"] / 1e3 / steps  # ms a step
      count[e["name"]] += 1 / steps
  return total, count, params, state


def profile(step, params, state, grads, steps: int, top: int) -> tuple[dict, object]:
  """The profile of ``steps`` steps (see the module docstring), and the state after them."""
  text = step.lower(params, state, grads).compile().as_text()
  names, moved = _op_names(text), kernel_bytes(text)
  total, count, params, state = _traced(step, params, state, grads, steps)
  kernels = {k: v for k, v in total.items() if k in names}
  ranked = sorted(kernels.items(), key=lambda kv: -kv[1])[:top]
  return {"kernels_ms": sum(kernels.values()), "kernel_count": sum(count[k] for k in kernels),
          "bytes": sum(count[k] * moved.get(k, 0) for k in kernels),
          "host_ms": total.get(HOST, 0.0),
          "top": [(k, v, names[k]) for k, v in ranked]}, state


def main(args) -> int:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +  # (before jax's first use)
                             " --xla_force_host_platform_device_count=1").strip()
  import zero_one_compute as zc  # (which sets one XLA intra-op thread, as it runs)
  size = int(float(args.size))
  grads = zc.make_tree(size, 1, args.leaves)
  cands = zc.contestants(size, grads, None, args.repeats + args.steps + 2, args.leaves)
  load_start = os.getloadavg()
  times, cands = zc.time_all(cands, grads, args.repeats)  # (each 0/1 step's kind checked)
  rows = {}
  for name, (step, params, state) in cands.items():
    rows[name], state = profile(step, params, state, grads, args.steps, args.top)
    rows[name]["median_ms"] = 1e3 * float(np.median(times[name]))
    if name.startswith("0/1"):  # (its run was long enough: every step of the kind named)
      assert zc._phase(state) == name.split()[-1], (name, zc._phase(state))
  data = {"command": " ".join(["python", "benchmarks/step_profile.py"] + [shlex.quote(a) for a in sys.argv[1:]]),
          "commit": _provenance.git_commit(), "jax": jax.__version__, "size": size,
          "params": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(grads)),
          "leaves": args.leaves, "steps": args.steps, "repeats": args.repeats,
          "load": [round(x, 2) for x in load_start] + [round(x, 2) for x in os.getloadavg()]}
  lines = render(data, rows)
  Path(args.out).write_text("\n".join(lines) + "\n")
  print("\n".join(lines))
  return 0


def _ratio(a: float, b: float) -> str:
  return f"{a / b:.2f}" if b > 0.05 else "–"


def render(data, rows) -> list:
  adam = rows["adam"]
  tree = f"{data['leaves']} leaves in 20 shapes" if data["leaves"] else "the 6-leaf model-shaped tree"
  lines = ["#### Where a train step's time goes (XLA:CPU profiler)", "",
           f"`{data['command']}`: commit {data['commit']}, jax {data['jax']}, {data['size']:,} "
           f"parameters, {tree}, one device, one XLA intra-op thread; load average (1/5/15 min) "
           f"at start {data['load'][:3]}, at end {data['load'][3:]}. Step: untraced median of "
           f"{data['repeats']} interleaved repeats. The rest: per step, summed over "
           f"{data['steps']} traced steps (the profiler slows every step: read shares). Kernels: "
           "events named as instructions of the compiled program (two threads may run "
           "them side by side: their sum can exceed the step). Host: PJRT's "
           "`ExecuteHelperOnSingleDevice` (arguments, outputs, the launch).", "",
           "| step | step (ms) | / adam | kernels (ms) | / adam | kernels a step | host (ms) | / adam "
           "| memory traffic (D) | / adam |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  d = 4 * data.get("params", data["size"])
  for name, r in rows.items():
    lines.append(f"| {name} | {r['median_ms']:.1f} | {r['median_ms'] / adam['median_ms']:.2f} | "
                 f"{r['kernels_ms']:.1f} | {r['kernels_ms'] / adam['kernels_ms']:.2f} | "
                 f"{r['kernel_count']:.0f} | {r['host_ms']:.1f} | {_ratio(r['host_ms'], adam['host_ms'])} | "
                 f"{r['bytes'] / d:.2f} | {r['bytes'] / adam['bytes']:.2f} |")
  for name, r in rows.items():
    lines += ["", f"**{name}**: the {len(r['top'])} longest kernels (ms a step; the jax op they came from)", "",
              "| kernel | ms | op |", "|---|---:|---|"]
    lines += [f"| {k} | {v:.2f} | `{op[-90:]}` |" for k, v, op in r["top"]]
  return lines


if __name__ == "__main__":
  sys.exit(main(_parse_args(sys.argv[1:])))
