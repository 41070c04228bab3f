"""Lab for issue 25, item 4: Adam's warmup with its moments sharded along the data axis (ZeRO-1).

    .venv/bin/python benchmarks/zero1_warmup_lab.py                      # 10M, the 6-leaf tree
    .venv/bin/python benchmarks/zero1_warmup_lab.py --leaves 300 --size 4e6 --out /tmp/z.md

Not the package: the bare data flow of the route the issue proposes for the
memory goal, measured before anyone builds it. Per device in a 2-device
``jax.shard_map`` on local gradients, against ``optax.adam`` on their ``pmean``:

- **zero1**: each leaf's local gradient reduce-scattered (``psum_scatter``,
  padded to a multiple of the device count), Adam's ``m`` and ``v`` kept and
  updated on this device's shard only (per-device state, ``P('data')``, 2 D/n),
  the update's shard gathered into a replicated (invariant) full update
  (``all_gather(..., to='invarying')``; jax 0.10 has it only as the private
  ``all_gather_invariant``) and applied. The same bytes as the all-reduce.
- **zero1, per group**: the same, with the collectives and the moments per group
  of up to 8 leaves of one shape (the package's groups): the leaves' gradients
  concatenated into one reduce-scatter, the group's update gathered at once and
  sliced back into its leaves. XLA:CPU does not combine collectives, so per leaf
  a model of 300 leaves runs 600 of them.

Printed: state and the compiled step's temporaries per device in D (4 bytes x
parameters), the largest difference from ``optax.adam`` + ``pmean`` after three
steps, the step time (interleaved repeats, median; two Adam copies as the noise
control). Writes ``benchmarks/results/zero1_warmup_lab.md``.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import sys
import time
from pathlib import Path

DEVICES = 2
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={DEVICES}").strip()

import jax  # noqa: E402  (XLA_FLAGS must be set first)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import _provenance  # noqa: E402
from onebit_optax import _layout  # noqa: E402
import zero_one_compute as zc  # noqa: E402  (its tree; one XLA intra-op thread)

AXIS = "data"
B1, B2, EPS, LR = 0.9, 0.999, 1e-8, 1e-3


def _gather_invariant(x):
  """The shards of ``x`` concatenated along axis 0, typed replicated (invariant) over AXIS."""
  try:
    return jax.lax.all_gather(x, AXIS, axis=0, tiled=True, to="invarying")  # (jax >= 0.12)
  except TypeError:
    from jax._src.lax.parallel import all_gather_invariant  # (jax 0.10: private)
    return all_gather_invariant(x, AXIS, axis=0, tiled=True)


def _shard_of(n: int) -> int:
  return -(-n // DEVICES)


def adam_pmean(mesh, params):
  tx = optax.adam(LR)

  def body(p, s, g):
    g = jax.lax.pmean(jax.lax.pcast(g, AXIS, to="varying"), AXIS)  # (local gradients, meaned)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  state = jax.device_put(tx.init(params), NamedSharding(mesh, P()))
  return jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P()), out_specs=(P(), P())), state


def _group(xs, gs, m, v, bc1, bc2) -> tuple:
  """Leaves ``xs`` of one shape: one reduce-scatter, Adam on this device's shard, one gather."""
  size = xs[0].size
  k = _shard_of(len(xs) * size)
  flat = [jax.lax.pcast(g, AXIS, to="varying").reshape(-1) for g in gs]
  if DEVICES * k > len(xs) * size:
    flat.append(jnp.zeros((DEVICES * k - len(xs) * size,), jnp.float32))
  mean = jax.lax.psum_scatter(jnp.concatenate(flat).reshape(DEVICES, k), AXIS, scatter_dimension=0,
                              tiled=True) / DEVICES
  m = B1 * m + (1 - B1) * mean
  v = B2 * v + (1 - B2) * jnp.square(mean)
  update = -LR * (m / bc1) / (jnp.sqrt(v / bc2) + EPS)
  full = _gather_invariant(update).reshape(-1)
  return [x + full[j * size:(j + 1) * size].reshape(x.shape) for j, x in enumerate(xs)], m, v


def _groups(params, per_group: bool) -> list:
  """Lists of leaf positions: one per leaf, or the package's groups (``WireLayout.groups``)."""
  if not per_group:
    return [[i] for i in range(len(jax.tree.leaves(params)))]
  layout = _layout.wire_layout_for(params, DEVICES, exact_below=0)  # (every leaf in a group)
  return [[layout.compressed[k] for k in span] for span in layout.groups]


def zero1(mesh, params, per_group=False):
  groups = _groups(params, per_group)
  sizes = [len(g) * jax.tree.leaves(params)[g[0]].size for g in groups]

  def body(p, s, g):
    count, ms, vs = s
    count = count + 1
    bc1, bc2 = (1 - b ** count.astype(jnp.float32) for b in (B1, B2))
    ps, gs, new_m, new_v = jax.tree.leaves(p), jax.tree.leaves(g), [], []
    out = list(ps)
    for idx, m, v in zip(groups, ms, vs):
      xs, m, v = _group([ps[i] for i in idx], [gs[i] for i in idx], m, v, bc1, bc2)
      for i, x in zip(idx, xs):
        out[i] = x
      new_m.append(m)
      new_v.append(v)
    return jax.tree.unflatten(jax.tree.structure(p), out), (count, new_m, new_v)

  sharded = NamedSharding(mesh, P(AXIS))
  zeros = lambda: [jax.device_put(jnp.zeros((DEVICES, _shard_of(n)), jnp.float32), sharded)
                   for n in sizes]
  state = (jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(mesh, P())), zeros(), zeros())
  specs = (P(), [P(AXIS)] * len(sizes), [P(AXIS)] * len(sizes))
  return jax.shard_map(body, mesh=mesh, in_specs=(P(), specs, P()), out_specs=(P(), specs)), state


def _per_device(tree) -> int:
  return sum(x.nbytes // (DEVICES if x.sharding.spec == P(AXIS) else 1) for x in jax.tree.leaves(tree))


def main(args) -> int:
  mesh = jax.make_mesh((DEVICES,), (AXIS,))
  put = lambda t: jax.device_put(t, NamedSharding(mesh, P()))
  size = int(float(args.size))
  grads = put(zc.make_tree(size, 1, args.leaves))
  d = 4 * sum(x.size for x in jax.tree.leaves(grads))
  rows, live = {}, {}
  for name, build in (("adam + pmean", adam_pmean), ("adam + pmean (again)", adam_pmean),
                      ("zero1", zero1), ("zero1, per group", lambda m, p: zero1(m, p, True))):
    params = put(zc.make_tree(size, 0, args.leaves))
    body, state = build(mesh, params)
    step = jax.jit(body, donate_argnums=(0, 1))
    temps = step.lower(params, state, grads).compile().memory_analysis().temp_size_in_bytes
    rows[name] = {"state": _per_device(state) / d, "temps": temps / d, "times": []}
    for _ in range(3):
      params, state = step(params, state, grads)
    live[name] = [step, params, state]
  diff = max(float(jnp.max(jnp.abs(a - b))) for name in ("zero1", "zero1, per group")
             for a, b in zip(jax.tree.leaves(live["adam + pmean"][1]), jax.tree.leaves(live[name][1])))
  load = os.getloadavg()
  for _ in range(args.repeats):
    names = list(live)
    random.shuffle(names)
    for name in names:
      step, params, state = live[name]
      jax.block_until_ready((params, state))
      t = time.perf_counter()
      params, state = step(params, state, grads)
      jax.block_until_ready((params, state))
      rows[name]["times"].append(time.perf_counter() - t)
      live[name][1:] = [params, state]
  adam = np.median(rows["adam + pmean"]["times"])
  tree = f"{args.leaves} leaves in 20 shapes" if args.leaves else "the 6-leaf model-shaped tree"
  lines = ["#### ZeRO-1 warmup lab: Adam with its moments sharded along the data axis", "",
           f"`python benchmarks/zero1_warmup_lab.py {' '.join(shlex.quote(a) for a in sys.argv[1:])}`"
           f": commit {_provenance.git_commit()}, jax {jax.__version__}, {size:,} parameters, {tree}, "
           f"per device in a {DEVICES}-device mesh, one XLA intra-op thread, {args.repeats} "
           f"interleaved repeats; load average at start {[round(x, 2) for x in load]}, at end "
           f"{[round(x, 2) for x in os.getloadavg()]}. Largest |zero1 - adam| in the parameters "
           f"after 3 steps (either zero1): {diff:.2g}.", "",
           "| step | ms | / adam + pmean | state (D per device) | temporaries (D) |",
           "|---|---:|---:|---:|---:|"]
  for name, r in rows.items():
    t = np.median(r["times"])
    lines.append(f"| {name} | {1e3 * t:.1f} | {t / adam:.2f} | {r['state']:.2f} | {r['temps']:.2f} |")
  Path(args.out).write_text("\n".join(lines) + "\n")
  print("\n".join(lines))
  return 0


def _parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--size", default="1e7", help="parameters (default 1e7)")
  p.add_argument("--leaves", type=int, default=0, help="leaves in 20 shapes (0: the 6-leaf tree)")
  p.add_argument("--repeats", type=int, default=21)
  p.add_argument("--out", default=str(zc.RESULTS / "zero1_warmup_lab.md"))
  return p.parse_args(argv)


if __name__ == "__main__":
  sys.exit(main(_parse_args(sys.argv[1:])))
