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

With ``--profile`` (default on) it also breaks the 1-bit update down into its
parts at one size (the moment update, ravel + pad, compressed_mean, unravel, the
frozen-variance direction, the non-finite-step guard), lists the full-size
passes in the compiled program, and times a prototype that does the same math
on flat buffers with fewer passes (benchmarks/_prototype.py), to show what a
restructured core update could reach.

Writes benchmarks/results/optimizer_compute.md.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import re
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
  p.add_argument("--profile-size", type=float, default=1e7,
                 help="size for the breakdown and prototype (0 disables them)")
  p.add_argument("--out", default=str(Path(__file__).parent / "results" / "optimizer_compute.md"))
  return p.parse_args(argv)


ARGS = _parse_args(sys.argv[1:]) if __name__ == "__main__" else None
if ARGS is not None and ARGS.threads == "1":
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _THREAD_FLAGS).strip()

import jax  # noqa: E402  (XLA_FLAGS must be set first)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.flatten_util import ravel_pytree  # noqa: E402

import onebit_optax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _prototype  # noqa: E402  (benchmarks/_prototype.py)

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


def _written_arrays(compiled_text: str, size: int) -> dict[str, tuple[float, int]]:
  """Bytes written by top-level HLO instructions, in parameter-sized float32 arrays.

  Each top-level instruction (a fusion, a copy, a concatenate, ...) writes its
  result to memory; instructions inside fused computations do not (they are part
  of their fusion's loop). Returns, per computation that writes anything sizeable
  (the entry and each lax.cond branch): (bytes written / (4 * size), copies).
  """
  computations, current = {}, None
  for line in compiled_text.split("\n"):
    head = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
    if head:
      current = head.group(1)
      computations[current] = []
    elif current is not None and line.strip() and line.strip() != "}":
      computations[current].append(line)
  fused = set()
  for lines in computations.values():
    for line in lines:
      if " fusion(" in line:
        fused.update(re.findall(r"calls=%([\w.\-]+)", line))
  out = {}
  for name, lines in computations.items():
    if name in fused:
      continue
    written, copies = 0, 0
    for line in lines:
      m = re.match(r"\s*(?:ROOT )?%\S+ = (.*?) ([a-z][\w-]*)\(", line)
      if not m or m.group(2) in _SKIP_OPS:
        continue
      nbytes = 0
      for dtype, dims in re.findall(r"(f32|s32|u32|u8|s8|pred)\[([\d,]*)\]", m.group(1)):
        nbytes += _DTYPE_BYTES[dtype] * int(np.prod([int(x) for x in dims.split(",") if x]))
      written += nbytes
      if m.group(2) == "copy" and nbytes >= size:
        copies += 1
    if written >= 2 * size:  # at least half a parameter-sized float32 array
      out[name] = (written / (4 * size), copies)
  return out


def _hlo_sources(compiled_text: str) -> dict[str, str]:
  """Maps each HLO instruction name to the source line (in onebit_optax if any) it came from."""
  section, files, funcs, locs, frames = None, {}, {}, {}, {}
  for line in compiled_text.split("\n"):
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      section = line
      continue
    if not line.strip():
      section = None
      continue
    if section == "FileNames":
      k, v = line.split(" ", 1)
      files[k] = v.strip('"')
    elif section == "FunctionNames":
      k, v = line.split(" ", 1)
      funcs[k] = v.strip('"')
    elif section == "FileLocations":
      k = line.split(" ", 1)[0]
      f = re.search(r"file_name_id=(\d+)", line).group(1)
      ln = re.search(r"line=(\d+)", line).group(1)
      locs[k] = (files.get(f, "?"), int(ln))
    elif section == "StackFrames":
      k = line.split(" ", 1)[0]
      frames[k] = (re.search(r"file_location_id=(\d+)", line).group(1),
                   re.search(r"parent_frame_id=(\d+)", line).group(1))
  out = {}
  for m in re.finditer(r"^\s*(?:ROOT )?%(\S+) = .*?metadata=\{op_name=\"([^\"]*)\""
                       r"(?: stack_frame_id=(\d+))?", compiled_text, re.M):
    name, op_name, frame = m.group(1), m.group(2), m.group(3)
    where, seen = None, set()
    while frame and frame in frames and frame not in seen:
      seen.add(frame)
      path, line = locs.get(frames[frame][0], ("?", 0))
      if "onebit_optax/" in path:
        where = f"{path.split('onebit_optax/')[-1]}:{line}"
        break
      if where is None and "site-packages/jax/" not in path:
        where = f"{Path(path).name}:{line}"
      frame = frames[frame][1]
    prim = op_name.split("/")[-1]
    out[name] = f"{prim} @ {where or '?'}"
  return out


def _traced_ops(fn, state, steps: int = 5):
  """Runs ``state -> (out, state)`` ``steps`` times under jax.profiler.trace.

  Returns the trace events (one per executed HLO op, named like the
  instruction) and the final state.
  """
  import glob
  import gzip
  import json
  import tempfile
  out, state = fn(state)
  jax.block_until_ready((out, state))
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp):
      for _ in range(steps):
        out, state = fn(state)
        jax.block_until_ready((out, state))
    trace = glob.glob(f"{tmp}/**/*.trace.json.gz", recursive=True)
    events = json.load(gzip.open(trace[0]))["traceEvents"] if trace else []
  return events, state


def _breakdown(events, sources: dict, steps: int) -> tuple[list[tuple[float, str]], float]:
  """([(ms per step, 'primitive @ file:line (instructions)')], total ms): ops by source line.

  Each instruction's time is the median over the traced steps (times the number
  of executions per step), so one preempted step does not dominate.
  """
  durations = {}
  for e in events:
    name = e.get("name")
    if e.get("ph") != "X" or name not in sources or name.startswith(("cond", "conditional")):
      continue
    durations.setdefault(name, []).append(e["dur"] / 1e3)
  by_source, total = {}, 0.0
  for name, ds in durations.items():
    ms = float(np.median(ds)) * len(ds) / steps
    total += ms
    t, names = by_source.get(sources[name], (0.0, set()))
    names.add(name)
    by_source[sources[name]] = (t + ms, names)
  rows = sorted(((t, f"{k} ({', '.join(sorted(n)[:3])}{', ...' if len(n) > 3 else ''})")
                 for k, (t, n) in by_source.items()), reverse=True)
  return rows, total


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


def profile(size: int, repeats: int) -> dict:
  """Times the parts of the compression-phase update and the prototype."""
  params = make_tree(size, 0)
  grads = make_tree(size, 1)
  d = onebit_optax.padded_size(size, 1)
  adam = optax.adam(LR)
  onebit = onebit_optax.onebit_adam(LR, axis_name=None, freeze=onebit_optax.fixed_step_freeze(1))
  no_guard = onebit_optax.onebit_adam(LR, axis_name=None, freeze=onebit_optax.fixed_step_freeze(1),
                                      skip_nonfinite=False)
  adam_update, onebit_update, no_guard_update = map(_donated_update, (adam, onebit, no_guard))
  proto = jax.jit(functools.partial(_prototype.update, learning_rate=LR), donate_argnums=(1,))
  proto_state = _prototype.init(params)

  flat_g = ravel_pytree(grads)[0]
  x = jnp.pad(flat_g, (0, d - size))
  packed, scale = onebit_optax.sign_compress(x)
  _, unravel = ravel_pytree(params)

  moment = jax.jit(lambda g, m: optax.tree.update_moment(g, m, B1, 1), donate_argnums=(1,))
  ravel_pad = jax.jit(lambda t: jnp.pad(ravel_pytree(t)[0], (0, d - size)))
  cmean = jax.jit(lambda x, e: onebit_optax.compressed_mean(x, e[0], e[1], None),
                  donate_argnums=(1,))
  unravel_fn = jax.jit(lambda v: unravel(v[:size]))
  direction = jax.jit(lambda m, v: jax.tree.map(
      lambda m, v: jnp.where(v > 0, m / (1 - B1 ** 5) / (jnp.sqrt(v / (1 - B2)) + EPS), 0.0), m, v))
  add = jax.jit(lambda a, b: a + b, donate_argnums=(0,))
  compress = jax.jit(onebit_optax.sign_compress)
  decompress = jax.jit(lambda p, s: onebit_optax.sign_decompress(p, s, d))
  decompress_acc = jax.jit(lambda p, s, acc: acc + onebit_optax.sign_decompress(p, s, d),
                           donate_argnums=(2,))

  chunk4 = d // 32 * 8  # n = 4: the server's chunk
  rows4 = jnp.stack([packed[:chunk4 // 8]] * 4)
  s4 = jnp.full(4, scale)
  mean0 = jax.jit(lambda r, s: jnp.mean(onebit_optax.sign_decompress(r, s, chunk4), axis=0))
  rowsum = jax.jit(lambda r, s: sum(onebit_optax.sign_decompress(r[i], s[i], chunk4)
                                    for i in range(4)) / 4)

  def keep(fn):  # parts whose output we do not feed back: no state
    return (lambda s: (fn(s), s)), None

  parts = {
      "adam update (reference)": (lambda s: adam_update(grads, s, params), adam.init(params)),
      "onebit update, compression phase": (
          lambda s: onebit_update(grads, s, params),
          _frozen_state(onebit, onebit_update, params, grads)),
      "  same, skip_nonfinite=False": (
          lambda s: no_guard_update(grads, s, params),
          _frozen_state(no_guard, no_guard_update, params, grads)),
      "  moment update b1*mu+(1-b1)*g (tree)": (lambda s: (None, moment(grads, s)), make_tree(size, 2)),
      "  ravel_pytree + pad": keep(lambda _: ravel_pad(grads)),
      "  compressed_mean (axis_name=None)": (
          lambda e: (lambda m, we, se: (m, (we, se)))(*cmean(x, e)),
          (jnp.zeros(d), jnp.zeros(d))),
      "  unravel (slice into leaves)": keep(lambda _: unravel_fn(x)),
      "  direction m/(sqrt(v)+eps), masked": keep(lambda _: direction(grads, params)),
      "  sign_compress (norm + packbits)": keep(lambda _: compress(x)),
      "  sign_decompress (write f32)": keep(lambda _: decompress(packed, scale)),
      "  sign_decompress fused into acc +=": (
          lambda a: (None, decompress_acc(packed, scale, a)), jnp.zeros(d)),
      "  one donated f32 add (memory pass unit)": (lambda a: (None, add(a, x)), jnp.zeros(d)),
      "  server mean of 4 decoded chunks: jnp.mean(axis=0)": keep(lambda _: mean0(rows4, s4)),
      "  same as a sum over the 4 rows": keep(lambda _: rowsum(rows4, s4)),
      "prototype update (benchmarks/_prototype.py)": (lambda s: proto(grads, s), proto_state),
  }
  times = _time_interleaved(parts, repeats)

  # What the compiled programs do at full size.
  n_small = 1 << 16
  small_p, small_g = make_tree(n_small, 0), make_tree(n_small, 1)
  hlo = {}
  for name, fn, args in (
      ("adam", jax.jit(adam.update, donate_argnums=(1,)),
       (small_g, adam.init(small_p), small_p)),
      ("onebit", jax.jit(onebit.update, donate_argnums=(1,)),
       (small_g, onebit.init(small_p), small_p)),
      ("prototype", jax.jit(functools.partial(_prototype.update, learning_rate=LR),
                             donate_argnums=(1,)),
       (small_g, _prototype.init(small_p))),
  ):
    text = fn.lower(*args).compile().as_text()
    hlo[name] = _written_arrays(text, n_small)
  # Where the time goes inside the compiled updates, per source line (profiler trace).
  traced = {}
  for name, jitted, make_state in (
      ("adam", jax.jit(adam.update, donate_argnums=(1,)), lambda: adam.init(params)),
      ("onebit compression", jax.jit(onebit.update, donate_argnums=(1,)),
       lambda: _frozen_state(onebit, onebit_update, params, grads)),
  ):
    st = make_state()
    sources = _hlo_sources(jitted.lower(grads, st, params).compile().as_text())
    events, st = _traced_ops(lambda s, f=jitted: f(grads, s, params), st, steps=5)
    traced[name] = _breakdown(events, sources, 5)
    del st
  return {"size": size, "times": times, "hlo": hlo, "traced": traced}


def _fmt_ms(s: float) -> str:
  return f"{s * 1e3:.1f}"


def main():
  args = ARGS
  sizes = [int(float(s)) for s in args.sizes.split(",") if s]
  load = os.getloadavg()
  header = [
      "# Optimizer compute: 1-bit Adam (compression phase) vs Adam, one device",
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
      "ratio <= 1.5.",
      "",
      "| parameters | adam update (ms) | onebit warmup (ms) | warmup/adam | onebit compression (ms) "
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

  if args.profile_size:
    _prototype.check_against_package()
    size = int(args.profile_size)
    prof = profile(size, args.repeats)
    unit = prof["times"]["adam update (reference)"]
    add_unit = prof["times"]["  one donated f32 add (memory pass unit)"]
    block = [
        "",
        f"## Where the time goes ({size:,} parameters, 4 leaves)",
        "",
        "Each part jitted on its own (so a part may cost more alone than fused inside the update).",
        "",
        "| part | ms | x adam update | x one f32 add |",
        "|---|---:|---:|---:|",
    ]
    for name, s in prof["times"].items():
      block.append(f"| {name} | {_fmt_ms(s)} | {s / unit:.2f} | {s / add_unit:.1f} |")
    block += [
        "",
        f"Compiled programs ({1 << 16:,} parameters): memory written by the top-level HLO "
        "instructions (fusions, copies, concatenates, ...), in parameter-sized float32 arrays, "
        "per computation (the entry and each lax.cond branch), with the number of large copies:",
        "",
    ]
    for name, comps in prof["hlo"].items():
      parts = ", ".join(f"{comp}: {k:.2f} arrays ({c} copies)" for comp, (k, c) in comps.items())
      block.append(f"- {name}: {parts}")
    for name, (rows, total) in prof["traced"].items():
      block += ["", f"Profiler trace of the {name} update ({size:,} parameters), time per op "
                f"grouped by the source line it comes from ({total:.1f} ms per update in ops; "
                "top 12):", "", "| ms | share | primitive @ source (HLO instructions) |",
                "|---:|---:|---|"]
      for t, what in rows[:12]:
        block.append(f"| {t:.1f} | {t / total:.0%} | {what} |")
    block.append("")
    block.append("The prototype (benchmarks/_prototype.py) matches onebit_adam's updates and "
                 "momentum to rtol 2e-5 over 3 compression steps (checked before timing).")
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
