"""The messages of 1-bit Adam: packing a tree into them and reading leaves back (no axis names)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from onebit_optax import _compressor
from onebit_optax import _layout

__all__ = ["leaf_signs", "leaf_rms", "group_compress", "rows", "message_leaf",
           "message_group", "message_exact", "first_blocks", "Stream", "stream", "scales_to_bytes", "scales_from_bytes"]

_BLOCK = _layout.BLOCK


def scales_to_bytes(scales: jax.Array) -> jax.Array:
  """(..., S) float32 -> (..., 4 S) uint8 (the bytes of each scale, in order)."""
  raw = jax.lax.bitcast_convert_type(scales.astype(jnp.float32), jnp.uint8)
  return raw.reshape(scales.shape[:-1] + (-1,))


def scales_from_bytes(raw: jax.Array) -> jax.Array:
  """Inverse of :func:`scales_to_bytes`."""
  return jax.lax.bitcast_convert_type(raw.reshape(raw.shape[:-1] + (-1, 4)), jnp.float32)


def leaf_signs(u: jax.Array) -> jax.Array:
  """The packed signs of one leaf (any shape), padded to whole 128-element blocks (16 B each)."""
  flat = jnp.ravel(u)
  return _compressor.pack_signs(flat, pad=-flat.shape[0] % _BLOCK)


def leaf_rms(u: jax.Array) -> jax.Array:
  """Root mean square of one leaf (its 1-bit scale)."""
  return jnp.sqrt(jnp.sum(jnp.square(u)) / max(u.size, 1))


def group_compress(u: jax.Array) -> tuple[jax.Array, jax.Array]:
  r"""A group ``(leaves, *shape)`` compressed in one pass over it: each leaf's packed signs and RMS scale.

  Returns ``(signs, scales)``: the leaves' signs as :func:`leaf_signs` packs
  each (``(leaves * blocks * 16,)`` uint8, every leaf padded with positive
  signs to whole 128-element blocks), and ``(leaves,)`` float32
  :math:`\sqrt{\sum_i u_i^2 / n}`, both from
  :func:`_compressor.signs_and_squares` over the leaves' whole 32-element
  words (separate passes for the signs and the squares read the group twice:
  the 10M tree's groups, one thread, 6.2 ms against 8.9 ms). A leaf's last,
  partial word and its padding words are formed apart, from its last few
  elements: a padded copy of the group would be a temporary of its size.

  Leaves under :data:`_compressor.WORDS_FROM` elements keep the two passes:
  each group's one-pass kernel is its own (its shape is in it), about 1,800
  lines of LLVM IR against about 200, and at 300 leaves of 20 shapes that made
  the train step compile 1.2-1.3x longer (``benchmarks/compile_time.md``,
  run 20), for passes that take microseconds.
  """
  leaves, size = u.shape[0], math.prod(u.shape[1:])
  flat = u.astype(jnp.float32).reshape(leaves, size)
  if size < _compressor.WORDS_FROM:  # (small leaves: two small kernels, see the docstring)
    signs = _compressor.pack_signs(flat, axis=1, pad=-size % _BLOCK).reshape(-1)
    return signs, jnp.sqrt(jnp.sum(jnp.square(flat), axis=1) / max(size, 1))
  whole = size - size % 32
  signs, squares = _compressor.signs_and_squares(flat[:, :whole])
  pieces, sums = [signs], jnp.sum(squares, axis=1)
  if whole < size:  # the last word: the leaf's last elements, then positive padding signs
    tail = jnp.concatenate([flat[:, whole:], jnp.zeros((leaves, 32 - (size - whole)), jnp.float32)], 1)
    tail_signs, tail_squares = _compressor.signs_and_squares(tail)
    pieces.append(tail_signs)
    sums = sums + tail_squares[:, 0]
  padding = 4 * ((-size % _BLOCK) // 32)  # the bytes of whole words of positive padding signs
  if padding:
    pieces.append(jnp.full((leaves, padding), 255, jnp.uint8))
  packed = jnp.concatenate(pieces, axis=1) if len(pieces) > 1 else signs
  return packed.reshape(-1), jnp.sqrt(sums / max(size, 1))


def rows(layout: _layout.WireLayout, signs: list, leaf_scales: jax.Array,
         exact: jax.Array) -> jax.Array:
  """Phase 1's rows: row ``r`` is what goes to server ``r`` (its chunk of the signs, scales, floats).

  Args:
    layout: the wire layout.
    signs: the packed signs of the compressed leaves in stream order, in
      pieces (per leaf, :func:`leaf_signs`, or per group, :func:`group_compress`).
    leaf_scales: (compressed leaves,) float32: each leaf's scale; a segment
      carries the scale of its leaf.
    exact: (exact_size,) float32: the exact leaves, concatenated.

  Returns:
    (num_devices, row_bytes) uint8.
  """
  n, bits = layout.num_devices, layout.bits
  tail = (bits.padded - bits.used) // 8
  pieces = list(signs) + ([jnp.zeros((tail,), jnp.uint8)] if tail else [])
  stream = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)
  scales = jnp.concatenate([leaf_scales.astype(jnp.float32), jnp.zeros((1,), jnp.float32)])
  table = jnp.asarray(layout.segment_leaf.reshape(n, layout.segments))
  parts = [stream.reshape(n, layout.chunk_bytes), scales_to_bytes(scales[table])]
  if layout.exact_chunk:
    parts.append(exact_columns(layout, exact))
  return jnp.concatenate(parts, axis=1)


def exact_columns(layout: _layout.WireLayout, exact: jax.Array) -> jax.Array:
  """The rows' last columns: the exact leaves' float32 bytes, ``(num_devices, 4 exact_chunk)`` uint8.

  ``exact``: (exact_size,) float32, the exact leaves concatenated (see :func:`rows`).
  """
  n = layout.num_devices
  pad = n * layout.exact_chunk - layout.exact_size
  floats = jnp.concatenate([exact, jnp.zeros((pad,), jnp.float32)]) if pad else exact
  return scales_to_bytes(floats.reshape(n, layout.exact_chunk))


class Stream(NamedTuple):
  """The gathered messages' sign stream, ready to decode at any block."""

  blocks: jax.Array  # (blocks, 16) uint8: the packed signs, 128 elements a block.
  scales: jax.Array  # (blocks,) float32: each block's scale (its wire segment's).
  unpack: Any  # _layout.PerShape of _Bits: what unpacks a leaf's bytes, per shape.


class _Bits(NamedTuple):
  """What unpacks a byte's 8 signs (:func:`_decoded`)."""

  shifts: jax.Array  # (8,) uint8: bit k of byte j holds the sign of element 8 j + k.
  one: jax.Array  # () uint8


def stream(layout: _layout.WireLayout, gathered: jax.Array) -> Stream:
  """The :class:`Stream` of the gathered messages (once per message: every leaf reads it)."""
  blocks = gathered[:, :layout.chunk_bytes].reshape(-1, _BLOCK // 8)
  scales = scales_from_bytes(
      gathered[:, layout.chunk_bytes:layout.chunk_bytes + 4 * layout.segments]).reshape(-1)
  bits = _layout.PerShape(_Bits(jnp.arange(8, dtype=jnp.uint8), jnp.uint8(1)))
  return Stream(blocks, scales[jnp.asarray(layout.bits.tables.wire_segment)], bits)


def _decoded(signs: Stream, start, nblocks: int) -> jax.Array:
  """``nblocks`` blocks of the stream from block ``start`` decoded: ``(nblocks, 128)`` float32.

  :func:`_compressor.sign_decompress`'s values, the block's scale where a bit
  is set and its negative where not, in few operations a leaf: what unpacks
  the bytes is broadcast once per shape (``signs.unpack``). Elementwise, so
  XLA fuses it into the pass that reads it.
  """
  packed = jax.lax.dynamic_slice_in_dim(signs.blocks, start, nblocks, allow_negative_indices=False)
  scale = jax.lax.dynamic_slice_in_dim(signs.scales, start, nblocks, allow_negative_indices=False)
  bits = signs.unpack((nblocks, _BLOCK // 8, 8))
  positive = ((packed[:, :, None] >> bits.shifts) & bits.one) == bits.one
  scale = jnp.broadcast_to(scale[:, None], (nblocks, _BLOCK))
  return jnp.where(positive.reshape(nblocks, _BLOCK), scale, -scale)


def first_blocks(layout: _layout.WireLayout) -> np.ndarray:
  """(compressed leaves,) int32: the stream block at which each compressed leaf's signs start."""
  return np.asarray(layout.bits.offsets, np.int64).astype(np.int32) // _BLOCK


def message_leaf(layout: _layout.WireLayout, signs: Stream, k: int, shape,
                 start=None) -> jax.Array:
  """Compressed leaf ``k`` (position in ``layout.compressed``) decoded from the messages' :func:`stream`.

  Elementwise from the packed bytes: XLA fuses the unpacking into the
  consumer. ``start``: the leaf's first block (an int32 scalar the step
  computes, see :func:`_groups.scalars`; None: :func:`first_blocks`).
  """
  size = layout.bits.sizes[k]
  start = first_blocks(layout)[k] if start is None else start
  return _decoded(signs, start, -(-size // _BLOCK)).reshape(-1)[:size].reshape(shape)


def message_group(layout: _layout.WireLayout, signs: Stream, g: int) -> jax.Array:
  """Group ``g`` (``layout.groups[g]``) decoded from the messages' :func:`stream`: ``(leaves, *shape)``.

  The group's bits are one contiguous run of the stream, each leaf on whole
  blocks: one slice, one unpack, one scale per block (its wire segment's).
  Read at the group's constant offset (see :func:`_groups.momenta`).
  """
  span = layout.groups[g]
  size = layout.bits.sizes[span.start]
  nblocks = -(-size // _BLOCK)
  decoded = _decoded(signs, first_blocks(layout)[span.start], len(span) * nblocks)
  shape = (len(span),) + tuple(layout.group_shape(g))
  return decoded.reshape(len(span), -1)[:, :size].reshape(shape)


def message_exact(layout: _layout.WireLayout, gathered: jax.Array) -> jax.Array:
  """The exact leaves' floats (exact_size,) from the gathered messages."""
  if not layout.exact_size:  # (a zero-width slice of a mesh-sharded message fails)
    return jnp.zeros((0,), jnp.float32)
  start = layout.chunk_bytes + 4 * layout.segments
  return scales_from_bytes(gathered[:, start:]).reshape(-1)[:layout.exact_size]
