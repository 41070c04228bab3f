"""What per-leaf scales and block padding cost on the wire (no training, a few seconds).

    .venv/bin/python benchmarks/wire_overhead.py

For a 100-leaf transformer-shaped parameter tree (8 pre-LayerNorm blocks of
width 256, MLP 1024, vocabulary 256: 6.4M parameters), on 2 to 256 devices: the bytes one device sends per compressed step
(the layout's formula ``2 (n - 1) (padded / (8 n) + 4 S)`` with ``S`` scales
per chunk, what ``onebit_optax.wire_bytes`` reports), split into packed signs, per-segment scales and block padding, against
the fp32 ring all-reduce of the unpadded parameters. Goal (issue 9): scales
<= 3% of the packed signs for a 100-leaf model. Writes
benchmarks/results/wire_overhead.md.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import onebit_optax
from onebit_optax import _layout  # the layout the optimizer uses (shapes only)


def transformer_tree(layers: int = 8, d: int = 256, mlp: int = 1024, vocab: int = 256):
  tree = {"embed": jax.ShapeDtypeStruct((vocab, d), jnp.float32),
          "pos": jax.ShapeDtypeStruct((256, d), jnp.float32),
          "ln_f": {"scale": jax.ShapeDtypeStruct((d,), jnp.float32),
                   "bias": jax.ShapeDtypeStruct((d,), jnp.float32)}}
  for i in range(layers):
    s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    tree[f"block{i}"] = {
        "ln1": {"scale": s(d), "bias": s(d)}, "ln2": {"scale": s(d), "bias": s(d)},
        "qkv": {"kernel": s(d, 3 * d), "bias": s(3 * d)},
        "proj": {"kernel": s(d, d), "bias": s(d)},
        "fc1": {"kernel": s(d, mlp), "bias": s(mlp)},
        "fc2": {"kernel": s(mlp, d), "bias": s(d)}}
  return tree


def rows(tree):
  leaves = jax.tree.leaves(tree)
  size = sum(int(np.prod(x.shape)) for x in leaves)
  out = []
  for n in (2, 4, 8, 16, 64, 256):
    layout = _layout.layout_for(tree, n)
    signs = 2 * (n - 1) * layout.padded / (8 * n)
    scales = 2 * (n - 1) * 4 * layout.max_segments
    padding = 2 * (n - 1) * (layout.padded - size) / (8 * n)
    total = onebit_optax.compressed_wire_bytes(layout.padded, n, layout.max_segments)
    fp32 = onebit_optax.allreduce_wire_bytes(size, n)
    out.append((n, len(leaves), size, layout.max_segments, signs, scales / signs,
                padding / signs, total, fp32 / total))
  return out


def main():
  lines = ["#### Wire overhead of per-leaf scales and block padding", "",
           "Command: `python benchmarks/wire_overhead.py` (shapes only, no training).", "",
           "Per compressed step, bytes one device sends (both phases); 'scales' and "
           "'padding' are relative to the packed signs of the real parameters' chunks; "
           "'vs fp32' is the ring all-reduce of the unpadded float32 parameters divided by "
           "the 1-bit bytes.", ""]
  for name, tree in (("100-leaf transformer (8 blocks, d=256, MLP 1024)", transformer_tree()),):
    lines += [f"**{name}**", "",
              "| devices | leaves | parameters | scales per chunk S | packed signs (B) | "
              "scales / signs | padding / signs | 1-bit bytes | vs fp32 |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n, leaves, size, segments, signs, scale_share, pad_share, total, ratio in rows(tree):
      lines.append(f"| {n} | {leaves} | {size:,} | {segments} | {signs:,.0f} | "
                   f"{scale_share:.2%} | {pad_share:.2%} | {total:,.0f} | {ratio:.1f}x |")
    lines.append("")
  lines.append("The formula is checked against the compiled program's collectives in "
               "tests/test_hlo_collectives.py and against bytes read off the network interfaces "
               "in benchmarks/comm_throughput.py.")
  out = Path(__file__).parent / "results" / "wire_overhead.md"
  out.write_text("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
