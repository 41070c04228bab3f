"""Leaves grouped by shape: the step's full-size math runs once per group, not once per leaf.

The compiled program of a step written leaf by leaf grows with the number of
leaves (about 20 fused kernels per leaf, where ``optax.adam`` has 3: minutes
of compilation for a transformer of a few hundred leaves). Written per group,
the communication, compression and reductions grow with the number of
distinct shapes instead; only Adam's own per-leaf moments and update remain
per leaf, as in ``optax.adam``.

A group is up to 8 compressed leaves of one shape (:attr:`WireLayout.groups`),
stacked ``(leaves, *shape)`` in float32; the exact leaves (fewer than
``exact_below`` elements) travel together as one flat float32 vector. The
gradients are stacked into their groups where the compression consumes them
(a concatenate that XLA fuses into that pass); the per-device state that the
compression keeps (``local_momentum``, ``local_sent``) is stored stacked.
Per-leaf sums are one variadic reduction per shape (:func:`sums`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from onebit_optax import _collective
from onebit_optax import _layout

F32 = jnp.float32


class Grouped(NamedTuple):
  """A tree's leaves as groups: ``stacks`` (per group, ``(leaves, *shape)``) and ``exact`` (flat)."""

  stacks: tuple  # per group of compressed leaves: (leaves, *shape) float32.
  exact: jax.Array  # (exact_size,) float32: the exact leaves, raveled and concatenated.


def group(layout: _layout.WireLayout, leaves: list) -> Grouped:
  """``leaves`` (tree order) as :class:`Grouped` float32 values: one stack per group."""
  order = layout.compressed
  stacks = tuple(jnp.stack([leaves[order[k]].astype(F32) for k in span])
                 for span in layout.groups)
  exact = [jnp.ravel(leaves[i]).astype(F32) for i in layout.exact]
  return Grouped(stacks, jnp.concatenate(exact) if exact else jnp.zeros((0,), F32))


def leaf(layout: _layout.WireLayout, grouped: Grouped, i: int) -> jax.Array:
  """Leaf ``i`` (tree order) of ``grouped``: a slice of its group (zeros for an empty leaf)."""
  role, shape = layout.roles[i], layout.shapes[i]
  if role[0] == "c":
    g, j = layout.group_of[role[1]]
    return grouped.stacks[g][j]
  if role[0] == "e":
    offset = layout.exact_offsets[role[1]]
    return grouped.exact[offset:offset + layout.sizes[i]].reshape(shape)
  return jnp.zeros(shape, F32)


def leaves(layout: _layout.WireLayout, grouped: Grouped) -> list:
  """Every leaf of ``grouped``, tree order."""
  return [leaf(layout, grouped, i) for i in range(len(layout.shapes))]


def stream(layout: _layout.WireLayout, stacks) -> jax.Array:
  """The groups laid out as :attr:`WireLayout.bits` lays out their leaves: one padded flat vector.

  Each leaf on whole blocks, group after group, the tail zero (what
  :meth:`FlatLayout.flatten` makes of the compressed leaves in stream order).
  """
  bits, pieces = layout.bits, []
  for s in stacks:
    flat = s.reshape(s.shape[0], -1).astype(F32)
    pad = -flat.shape[1] % bits.block
    pieces.append(jnp.pad(flat, ((0, 0), (0, pad))).reshape(-1) if pad else flat.reshape(-1))
  if bits.padded > bits.used:
    pieces.append(jnp.zeros((bits.padded - bits.used,), F32))
  return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)


def unstream(layout: _layout.WireLayout, flat: jax.Array) -> tuple:
  """Inverse of :func:`stream`: per group, ``(leaves, *shape)`` (slices of ``flat``)."""
  bits, out = layout.bits, []
  for g, span in enumerate(layout.groups):
    size = bits.sizes[span.start]
    width = -(-size // bits.block) * bits.block
    start = bits.offsets[span.start]
    rows = flat[start:start + len(span) * width].reshape(len(span), width)[:, :size]
    out.append(rows.reshape((len(span),) + tuple(layout.group_shape(g))))
  return tuple(out)


def sums(leaves: list) -> jax.Array:
  """(leaves,) float32: the sum of each leaf, with one variadic reduction per shape.

  A reduction per leaf is a fused kernel or two per leaf in the compiled
  program; one reduction of all the leaves of a shape is one instruction, and
  like a reduction of each stored leaf it stores no copy (a reduction of their
  concatenation stored the concatenation). Leaves typed differently under
  ``shard_map`` (varying over other mesh axes) are reduced apart.
  """
  by_kind = {}
  leaves = [x.astype(F32) for x in leaves]  # (summed in float32; a no-op for float32 leaves)
  for i, x in enumerate(leaves):
    key = (jnp.shape(x), jnp.result_type(x), _collective._varying_axes(x))
    by_kind.setdefault(key, []).append(i)
  out = [None] * len(leaves)
  for (shape, dtype, _), indices in by_kind.items():
    xs = tuple(leaves[i] for i in indices)
    totals = jax.lax.reduce(xs, tuple(jnp.zeros((), dtype) for _ in xs),
                            lambda a, b: tuple(x + y for x, y in zip(a, b)),
                            tuple(range(len(shape))))
    for i, total in zip(indices, totals):
      out[i] = total.astype(F32)
  return jnp.stack(out) if out else jnp.zeros((0,), F32)
