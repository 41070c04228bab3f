"""The flat layout: where each leaf lives in the fused buffers, and the compression segments."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["BLOCK", "EXACT_BELOW", "GROUP_LEAVES", "STACK_BELOW", "FlatLayout", "PerShape", "WireLayout", "layout_for", "cached_layout",
           "wire_layout_for"]

# Elements per block. Every leaf starts on a block boundary (it is zero-padded to a
# multiple of BLOCK), so a per-leaf reduction is a reshape to (blocks, BLOCK), a row
# sum and a segment sum over the few blocks, and a per-leaf scale reaches its
# elements by a broadcast: no per-element tables, no concatenates. A multiple of 8
# (packed sign bytes never straddle two leaves).
BLOCK = 128


class Tables(NamedTuple):
  """Static per-block tables of a :class:`FlatLayout` (numpy, become constants)."""

  leaf_of_block: np.ndarray  # (blocks,) int32: leaf index, or num_leaves for tail padding.
  block_valid: np.ndarray  # (blocks,) int32: how many of the block's elements are real.
  wire_segment: np.ndarray  # (blocks,) int32: chunk * max_segments + segment within the chunk.
  segment_count: np.ndarray  # (num_devices * max_segments,) float32: real elements per segment.


@dataclasses.dataclass(frozen=True)
class FlatLayout:
  r"""Where a pytree's leaves sit in one flat, padded float32 vector.

  Leaf :math:`\ell` (in ``jax.tree.leaves`` order) occupies
  ``[offsets[l], offsets[l] + size_l)``, its block-padded end is a multiple of
  ``block``, and the whole vector is padded to ``padded``, a multiple of
  ``num_devices * block``, so that it splits into ``num_devices`` equal chunks
  ("server" ``r`` owns chunk ``r``) made of whole blocks.

  A **segment** is a maximal run of blocks inside one chunk and one leaf (or the
  tail padding): a leaf cut by a chunk boundary has one segment per piece. Each
  segment gets its own compression scale. Segments are numbered on the wire as
  ``chunk * max_segments + j`` (``j``-th segment of the chunk), so every chunk
  carries ``max_segments`` scales (unused slots are zero).

  The leaf offsets do not depend on ``num_devices`` (only the tail padding
  does), so moments can move between device counts by cutting or extending the
  tail.
  """

  shapes: tuple  # tuple of leaf shapes (tuples of ints).
  num_devices: int
  block: int = BLOCK

  @functools.cached_property
  def sizes(self) -> tuple:
    return tuple(int(math.prod(s)) for s in self.shapes)

  @functools.cached_property
  def offsets(self) -> tuple:
    out, offset = [], 0
    for size in self.sizes:
      out.append(offset)
      offset += -(-size // self.block) * self.block
    return tuple(out)

  @property
  def size(self) -> int:
    """Number of real elements (parameters)."""
    return sum(self.sizes)

  @functools.cached_property
  def used(self) -> int:
    """End of the last leaf's padded blocks (independent of ``num_devices``)."""
    return sum(-(-s // self.block) * self.block for s in self.sizes)

  @functools.cached_property
  def padded(self) -> int:
    multiple = self.num_devices * self.block
    return max(1, -(-self.used // multiple)) * multiple

  @property
  def chunk(self) -> int:
    return self.padded // self.num_devices

  @property
  def num_blocks(self) -> int:
    return self.padded // self.block

  @functools.cached_property
  def tables(self) -> Tables:
    blocks, n, num_leaves = self.num_blocks, self.num_devices, len(self.sizes)
    leaf_of_block = np.full(blocks, num_leaves, np.int32)
    block_valid = np.zeros(blocks, np.int32)
    for leaf, (offset, size) in enumerate(zip(self.offsets, self.sizes)):
      first, count = offset // self.block, -(-size // self.block)
      leaf_of_block[first:first + count] = leaf
      block_valid[first:first + count] = self.block
      if size % self.block:
        block_valid[first + count - 1] = size % self.block
    per_chunk = blocks // n
    local = np.zeros(blocks, np.int32)
    for r in range(n):
      owners = leaf_of_block[r * per_chunk:(r + 1) * per_chunk]
      local[r * per_chunk:(r + 1) * per_chunk] = np.concatenate(
          [[0], np.cumsum(owners[1:] != owners[:-1])])
    max_segments = int(local.max()) + 1
    chunk_of_block = np.arange(blocks) // per_chunk
    wire_segment = (chunk_of_block * max_segments + local).astype(np.int32)
    segment_count = np.zeros(n * max_segments, np.float32)
    np.add.at(segment_count, wire_segment, block_valid.astype(np.float32))
    return Tables(leaf_of_block, block_valid, wire_segment, segment_count)

  @property
  def max_segments(self) -> int:
    """Scales carried by each chunk on the wire (the most segments any chunk has)."""
    return len(self.tables.segment_count) // self.num_devices

  def valid(self, block_valid=None) -> jax.Array:
    """(blocks, block) bool mask of the real elements (computed, not stored)."""
    counts = jnp.asarray(self.tables.block_valid if block_valid is None else block_valid)
    return jnp.arange(self.block, dtype=jnp.int32)[None, :] < counts[:, None]

  def flatten(self, tree) -> jax.Array:
    """The leaves of ``tree`` (shaped like this layout) as one padded float32 vector.

    One concatenate, which XLA fuses into its elementwise consumers where it
    can (a per-element choice between operands; written to a fresh buffer it
    cost ~100 ms for 10M parameters on XLA:CPU, see
    benchmarks/optimizer_compute.py). Zero-size leaves emit no operand (XLA 0.11
    crashed compiling zero-size operands of a fenced concatenate).
    """
    pieces = []
    for leaf, size in zip(jax.tree.leaves(tree), self.sizes):
      if size == 0:
        continue
      pieces.append(jnp.ravel(leaf).astype(jnp.float32))
      pad = -size % self.block
      if pad:
        pieces.append(jnp.zeros((pad,), jnp.float32))
    if self.padded > self.used:
      pieces.append(jnp.zeros((self.padded - self.used,), jnp.float32))
    return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)

  def unflatten(self, flat: jax.Array, treedef, dtypes=None) -> object:
    """Inverse of :meth:`flatten`: slices (no copy of the whole) back into a tree."""
    out = []
    for i, (shape, offset, size) in enumerate(zip(self.shapes, self.offsets, self.sizes)):
      dtype = flat.dtype if dtypes is None else dtypes[i]
      if size == 0:
        out.append(jnp.zeros(shape, dtype))
      else:
        out.append(flat[offset:offset + size].reshape(shape).astype(dtype))
    return jax.tree.unflatten(treedef, out)


@functools.lru_cache(maxsize=64)
def cached_layout(shapes: tuple, num_devices: int, block: int) -> FlatLayout:
  return FlatLayout(shapes, num_devices, block)


def layout_for(tree, num_devices: int, block: int = BLOCK) -> FlatLayout:
  """The :class:`FlatLayout` of ``tree``'s leaves on ``num_devices`` devices (cached)."""
  shapes = tuple(tuple(int(d) for d in np.shape(leaf)) for leaf in jax.tree.leaves(tree))
  return cached_layout(shapes, int(num_devices), int(block))


# Leaves with fewer elements than this travel as float32 bytes inside the two
# uint8 messages and are averaged exactly (1 bit cannot carry a two-element
# leaf or a scalar gate). Chosen from benchmarks/wire_overhead.py: see there.
EXACT_BELOW = 64
# The most leaves stacked into one group. Stacking copies the gradients into the group;
# XLA:CPU fuses a concatenate of at most 8 operands into the elementwise pass that
# consumes it, and stores a larger one as a full-size temporary (measured, jax 0.10:
# 0 and 1 D of temporaries for 8 and 9 leaves): buckets of 8 keep the copy fused, and
# the program still grows with leaves / 8 per shape, not with leaves.
GROUP_LEAVES = 8
# Leaves of at least this many elements are a group of their own. XLA:CPU runs the
# pass that forms a group's u (its gradients stacked, the mean decoded from the
# signs) 2-3x slower per element on a stack of two or more leaves than on one
# leaf (8 x 1M: 6-11 ms against 3.1-3.4 ms for 8 one-leaf groups, one thread):
# for large leaves a compressed step cost ~2x Adam's (10 equal 1M matrices)
# where one-leaf groups cost 1.2x. Below it the passes take microseconds and
# stacking keeps the program small.
STACK_BELOW = 1 << 16
_SCALE_BYTES = 4


@dataclasses.dataclass(frozen=True)
class WireLayout:
  r"""How 1-bit Adam's leaves travel: packed signs, or exact float32 bytes.

  Leaves with at least ``exact_below`` elements are **compressed**: their
  signs are packed leaf after leaf into one bit stream laid out by
  :class:`FlatLayout` (each leaf on a 128-element block, the stream cut into
  ``num_devices`` equal chunks; server ``r`` owns chunk ``r``, one scale per
  segment). Smaller leaves are **exact**: concatenated as float32 and cut into
  ``num_devices`` chunks of ``exact_chunk`` elements.

  One message (a row of phase 1, or a server's reply in phase 2) is, in bytes,

  .. math::

    \underbrace{c/8}_{\text{signs}} + \underbrace{4S}_{\text{scales}} +
    \underbrace{4e}_{\text{exact floats}}

  with :math:`c` the chunk length, :math:`S` the segments per chunk and
  :math:`e` = ``exact_chunk``. Nothing full-size is ever laid out flat: only
  the packed bytes (1/32 of the float32 bytes) are concatenated.
  """

  shapes: tuple
  num_devices: int
  exact_below: int = EXACT_BELOW

  @functools.cached_property
  def sizes(self) -> tuple:
    return tuple(int(math.prod(s)) for s in self.shapes)

  @functools.cached_property
  def compressed(self) -> tuple:
    """Indices (in ``jax.tree.leaves`` order) of the leaves sent as signs, group after group.

    The leaves of one shape come together, in the order of their first leaf,
    each run in tree order, cut into **groups** of at most
    :data:`GROUP_LEAVES` (:attr:`groups`). The state and the step treat a
    group as one stacked array, so that the compiled program grows with the
    number of distinct shapes (and leaves / 8), not with the leaves; a
    group's bits are one contiguous run of the stream. (With all shapes
    distinct this is tree order.)
    """
    by_shape = {}
    for i, s in enumerate(self.sizes):
      if s >= max(self.exact_below, 1):
        by_shape.setdefault(self.shapes[i], []).append(i)
    return tuple(i for leaves in by_shape.values() for i in leaves)

  @functools.cached_property
  def groups(self) -> tuple:
    """Per group: the ``range`` of its leaves' positions in :attr:`compressed`.

    A run of leaves of one shape is cut into groups of at most
    :data:`GROUP_LEAVES` leaves; a leaf of :data:`STACK_BELOW` elements or
    more is a group of its own.
    """
    out, start, shapes = [], 0, [self.shapes[i] for i in self.compressed]
    limit = lambda k: 1 if math.prod(shapes[k]) >= STACK_BELOW else GROUP_LEAVES
    for k in range(1, len(shapes) + 1):
      if k == len(shapes) or shapes[k] != shapes[start] or k - start == limit(start):
        out.append(range(start, k))
        start = k
    return tuple(out)

  def group_shape(self, g: int) -> tuple:
    """The shape of every leaf of group ``g``."""
    return self.shapes[self.compressed[self.groups[g].start]]

  @functools.cached_property
  def exact(self) -> tuple:
    """Indices of the non-empty leaves sent as float32."""
    return tuple(i for i, s in enumerate(self.sizes) if 0 < s < self.exact_below)

  @functools.cached_property
  def roles(self) -> tuple:
    """Per leaf: ``('c', k)`` compressed leaf ``k``, ``('e', j)`` exact leaf ``j``, ``('z',)`` empty."""
    out = [("z",)] * len(self.sizes)
    for k, i in enumerate(self.compressed):
      out[i] = ("c", k)
    for j, i in enumerate(self.exact):
      out[i] = ("e", j)
    return tuple(out)

  @functools.cached_property
  def bits(self) -> FlatLayout:
    """The bit stream of the compressed leaves (its ``padded`` is a multiple of 128 n)."""
    return cached_layout(tuple(self.shapes[i] for i in self.compressed), self.num_devices, BLOCK)

  @functools.cached_property
  def exact_offsets(self) -> tuple:
    out, offset = [], 0
    for i in self.exact:
      out.append(offset)
      offset += self.sizes[i]
    return tuple(out)

  @property
  def exact_size(self) -> int:
    return sum(self.sizes[i] for i in self.exact)

  @property
  def exact_chunk(self) -> int:
    return -(-self.exact_size // self.num_devices)

  @property
  def chunk_bytes(self) -> int:
    return self.bits.chunk // 8

  @property
  def segments(self) -> int:
    return self.bits.max_segments

  @property
  def row_bytes(self) -> int:
    """Bytes of one message: packed signs, scales, exact floats."""
    return self.chunk_bytes + _SCALE_BYTES * (self.segments + self.exact_chunk)

  @functools.cached_property
  def segment_leaf(self) -> np.ndarray:
    """(num_devices * segments,) int32: position in ``compressed`` of each wire segment's leaf.

    Unused slots and the tail padding map to ``len(compressed)`` (a zero scale).
    """
    tables = self.bits.tables
    out = np.full(self.num_devices * self.segments, len(self.compressed), np.int32)
    out[tables.wire_segment] = tables.leaf_of_block
    return out


class PerShape:
  """Replicated scalars broadcast to each leaf shape once: the leaves of a shape share the broadcasts.

  ``PerShape(scalars)(shape)`` is ``scalars`` (a pytree of arrays, e.g. a
  NamedTuple) with every array broadcast to ``shape``. A scalar applied to a leaf lowers to a
  broadcast of it to the leaf's shape (and a constant, for a Python number),
  leaf after leaf: most of a step's lowered operations, which tracing,
  lowering, Shardy's propagation and XLA's passes walk before any pass
  merges them (a lab of 300 leaves and 12 scalar operations each: 25,210
  lowered lines and 1.5 s in XLA's partitioner against 7,508 lines and
  0.6 s, the same compiled program). Make one where its leaves are
  computed, in the same ``lax.cond`` branch: a broadcast from outside would
  enter the branch as a full-size operand.
  """

  def __init__(self, scalars):
    self.scalars, self._shapes = scalars, {}

  def __call__(self, shape):
    shape = tuple(shape)
    if shape not in self._shapes:
      self._shapes[shape] = jax.tree.map(lambda x: jnp.broadcast_to(x, shape), self.scalars)
    return self._shapes[shape]


@functools.lru_cache(maxsize=64)
def cached_wire_layout(shapes: tuple, num_devices: int, exact_below: int) -> WireLayout:
  return WireLayout(shapes, num_devices, exact_below)


def wire_layout_for(tree, num_devices: int, exact_below: int = EXACT_BELOW) -> WireLayout:
  """The :class:`WireLayout` of ``tree``'s leaves on ``num_devices`` devices (cached)."""
  shapes = tuple(tuple(int(d) for d in np.shape(leaf)) for leaf in jax.tree.leaves(tree))
  return cached_wire_layout(shapes, int(num_devices), int(exact_below))
