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
on flat buffers with fewer passes (``_prototype_update`` below), to show what a
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


def _prototype_init(params):
  flat, _ = ravel_pytree(params)
  d = onebit_optax.padded_size(flat.size, 1)
  z = lambda: jnp.zeros(d, jnp.float32)
  return {"count": jnp.zeros([], jnp.int32), "mu": z(), "nu": z(),
          "freeze_step": jnp.ones([], jnp.int32), "worker_error": z(), "server_error": z()}


def _prototype_update(grads, state):
  """Compression-phase update on flat buffers (axis_name=None math), fewer passes.

  Differences from the core (same arithmetic, same results up to rounding):
  mu and nu are stored flat and padded (no ravel of the state, no unravel into
  the tree, no pad copy); the compressor's bits come from the same fused pass
  that writes the new worker error; the final decode and the frozen-variance
  direction are one pass that writes mu and the update; no lax.cond copy-out,
  and the non-finite guard is a scalar that selects only the tiny counters (on
  a non-finite step the caller would re-run with the old state instead of
  writing ``where(ok, new, old)`` over every buffer).
  """
  g, unravel = ravel_pytree(grads)
  d, size = state["mu"].size, g.size
  g = jnp.pad(g, (0, d - size))
  count = state["count"] + 1
  u = B1 * state["mu"] + (1.0 - B1) * g + state["worker_error"]
  scale = jnp.sqrt(jnp.sum(u * u) / d)
  positive = u >= 0
  worker_error = u - jnp.where(positive, scale, -scale)
  packed = jnp.packbits(positive, bitorder="little")
  # n = 1: the "server" decodes its one chunk, adds its error, re-compresses.
  bits = jnp.unpackbits(packed, bitorder="little", count=d).astype(bool)
  w = jnp.where(bits, scale, -scale) + state["server_error"]
  server_scale = jnp.sqrt(jnp.sum(w * w) / d)
  server_positive = w >= 0
  server_error = w - jnp.where(server_positive, server_scale, -server_scale)
  server_packed = jnp.packbits(server_positive, bitorder="little")
  # Everyone decodes the gathered bits (for n = 1: the server's own).
  mean_bits = jnp.unpackbits(server_packed, bitorder="little", count=d).astype(bool)
  mu = jnp.where(mean_bits, server_scale, -server_scale)
  bc1 = 1.0 - B1 ** count.astype(jnp.float32)
  bc2 = 1.0 - B2 ** state["freeze_step"].astype(jnp.float32)
  nu = state["nu"]
  direction = jnp.where(nu > 0, (mu / bc1) / (jnp.sqrt(nu / bc2) + EPS), 0.0)
  ok = jnp.isfinite(server_scale) & jnp.isfinite(scale)
  updates = unravel(-LR * direction[:size])
  new_state = dict(state, count=jnp.where(ok, count, state["count"]), mu=mu,
                   worker_error=worker_error, server_error=server_error)
  return updates, new_state


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
  proto = jax.jit(_prototype_update, donate_argnums=(1,))
  proto_state = _prototype_init(params)
  proto_state["nu"] = jnp.abs(ravel_pytree(grads)[0]) ** 2 * 1e-3
  proto_state["nu"] = jnp.pad(proto_state["nu"], (0, d - size))

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
      "prototype flat-buffer update (below)": (lambda s: proto(grads, s), proto_state),
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
      ("prototype", jax.jit(_prototype_update, donate_argnums=(1,)),
       (small_g, _prototype_init(small_p))),
  ):
    text = fn.lower(*args).compile().as_text()
    hlo[name] = _written_arrays(text, n_small)
  return {"size": size, "times": times, "hlo": hlo}


def _check_prototype(size: int = 4096):
  """The prototype computes what onebit_adam computes (else its timing means nothing)."""
  params, grads = make_tree(size, 0), make_tree(size, 1)
  onebit = onebit_optax.onebit_adam(LR, axis_name=None, freeze=onebit_optax.fixed_step_freeze(1))
  state = onebit.init(params)
  _, state = onebit.update(grads, state, params)  # warmup step 1, then frozen
  inner = state[0]
  flat = lambda t: ravel_pytree(t)[0]
  proto = {"count": inner.count, "mu": flat(inner.mu), "nu": flat(inner.nu),
           "freeze_step": inner.freeze_step,
           "worker_error": inner.worker_error[0], "server_error": inner.server_error[0]}
  for step in range(3):
    g = make_tree(size, 10 + step)
    ref_upd, state = onebit.update(g, state, params)
    upd, proto = _prototype_update(g, proto)
    np.testing.assert_allclose(flat(upd), flat(ref_upd), rtol=2e-5, atol=1e-9)
    np.testing.assert_allclose(proto["mu"], flat(state[0].mu), rtol=2e-5, atol=1e-9)


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
    _check_prototype()
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
    block.append("")
    block.append("The prototype (`_prototype_update` in this file) matches onebit_adam's updates "
                 "and momentum to rtol 2e-5 over 3 compression steps (checked before timing).")
    print("\n".join(block), flush=True)
    lines += block

  out = Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text("\n".join(lines) + "\n")
  print(f"\nwrote {out}")


def _git_commit() -> str:
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


if __name__ == "__main__":
  main()
