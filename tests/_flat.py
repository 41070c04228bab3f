"""The optimizer's flat-buffer sizes and wire bytes, written out for the tests.

An independent model of what ``onebit_optax._layout`` documents (it is not
imported here): every leaf starts on a block of 128 elements (it is zero-padded
to a multiple of 128), and the whole buffer is padded to a multiple of
``n * 128``, so it splits into ``n`` chunks of whole blocks. A *segment* is a run
of blocks inside one chunk that belong to one leaf (or to the tail padding);
each chunk carries one 4-byte scale per segment, as many as the chunk with the
most segments has.
"""

import numpy as np

BLOCK = 128


def _blocks(leaf_sizes):
  """Owner of every used block: the leaf's index, leaf after leaf."""
  owners = []
  for leaf, size in enumerate(leaf_sizes):
    owners += [leaf] * (-(-int(size) // BLOCK))
  return owners


def padded(leaf_sizes, n):
  """Length of the flat buffers (mu, nu, worker_error) for leaves of these sizes on n devices."""
  used = len(_blocks(leaf_sizes))
  return max(1, -(-used // n)) * n * BLOCK


def max_segments(leaf_sizes, n):
  """Scales per chunk on the wire: the most segments any chunk has."""
  total = padded(leaf_sizes, n) // BLOCK
  owners = _blocks(leaf_sizes)
  owners += [-1] * (total - len(owners))  # the tail padding: one owner of its own
  per_chunk = total // n
  chunks = [owners[r * per_chunk:(r + 1) * per_chunk] for r in range(n)]
  return max(1 + sum(a != b for a, b in zip(c, c[1:])) for c in chunks)


def compressed_bytes(leaf_sizes, n):
  """Bytes one device sends in a compression step: 2 (n - 1) (padded / (8 n) + 4 S)."""
  return 2.0 * (n - 1) * (padded(leaf_sizes, n) / (8 * n) + 4 * max_segments(leaf_sizes, n))


def allreduce_bytes(leaf_sizes, n):
  """Bytes one device sends in a warmup step: a float32 ring all-reduce of the padded buffer."""
  return 2.0 * (n - 1) / n * padded(leaf_sizes, n) * 4


def offsets(leaf_sizes):
  """Where each leaf starts in the flat buffers (the same for every device count)."""
  out, offset = [], 0
  for size in leaf_sizes:
    out.append(offset)
    offset += -(-int(size) // BLOCK) * BLOCK
  return out


def relayout(flat, leaf_sizes, n):
  """A flat buffer rebuilt leaf by leaf for n devices (numpy; the padding is zero)."""
  flat = np.asarray(flat)
  out = np.zeros(flat.shape[:-1] + (padded(leaf_sizes, n),), flat.dtype)
  for offset, size in zip(offsets(leaf_sizes), leaf_sizes):
    out[..., offset:offset + size] = flat[..., offset:offset + size]
  return out


def leaves(flat, shapes):
  """The leaves (numpy, these shapes, in tree order) that a flat buffer holds."""
  flat = np.asarray(flat)
  sizes = [int(np.prod(s)) for s in shapes]
  return [flat[offset:offset + size].reshape(shape)
          for offset, size, shape in zip(offsets(sizes), sizes, shapes)]


# ----------------------------------------------------------------------------
# Core v3: the wire layout of 1-bit Adam (compressed and exact leaves).

EXACT_BELOW = 64  # leaves with 0 < size < 64 travel as float32, averaged exactly


class Bits:
  """The bit stream of the compressed leaves (these sizes, in order) on n chunks, in numpy.

  ``owner[j]``: index of the leaf whose real element sits at stream position
  ``j`` (-1: padding, inside a leaf's last block or in the tail).
  ``segments[r]``: chunk ``r``'s segments in order, each ``(leaf or -1, positions
  within the chunk)``: a maximal run of blocks of one leaf (or of the tail
  padding). ``S``: scale slots per chunk (the most segments any chunk has).
  """

  def __init__(self, sizes, n):
    self.sizes, self.n = [int(s) for s in sizes], int(n)
    self.offsets = offsets(self.sizes)
    self.padded = padded(self.sizes, self.n)
    self.chunk = self.padded // self.n
    self.owner = np.full(self.padded, -1)
    for leaf, (offset, size) in enumerate(zip(self.offsets, self.sizes)):
      self.owner[offset:offset + size] = leaf
    self.real = self.owner >= 0
    block_owner = np.full(self.padded // BLOCK, -1)
    block_owner[:len(_blocks(self.sizes))] = _blocks(self.sizes)
    per_chunk = self.chunk // BLOCK
    self.segments = []
    for r in range(self.n):
      owners = block_owner[r * per_chunk:(r + 1) * per_chunk]
      runs, start = [], 0
      for b in range(1, per_chunk + 1):
        if b == per_chunk or owners[b] != owners[start]:
          runs.append((int(owners[start]), np.arange(start * BLOCK, b * BLOCK)))
          start = b
      self.segments.append(runs)
    self.S = max(len(s) for s in self.segments)

  def chunk_real(self, r):
    return self.real[r * self.chunk:(r + 1) * self.chunk]


def split(leaf_sizes, exact_below=EXACT_BELOW, shapes=None):
  """(compressed, exact): indices of the leaves sent as sign bits and as float32.

  The compressed leaves are grouped by shape (``shapes``, or the sizes when
  not given): groups in the order of their first leaf, leaves in tree order
  within a group; the stream lays them out in that order.
  """
  sizes = [int(s) for s in leaf_sizes]
  keys = sizes if shapes is None else [tuple(s) for s in shapes]
  compressed = [i for i, s in enumerate(sizes) if s >= max(exact_below, 1)]
  first = {}
  for i in compressed:
    first.setdefault(keys[i], i)
  compressed.sort(key=lambda i: (first[keys[i]], i))
  return compressed, [i for i, s in enumerate(sizes) if 0 < s < exact_below]


def groups(compressed, shapes, most=8, stack_below=1 << 16):
  """The compressed leaves (in ``split``'s order) cut into groups: one shape, at most ``most``
  leaves; a leaf of ``stack_below`` elements or more alone."""
  out = []
  for i in compressed:
    size = int(np.prod(shapes[i], dtype=np.int64))
    if (out and tuple(shapes[out[-1][0]]) == tuple(shapes[i]) and len(out[-1]) < most
        and size < stack_below):
      out[-1].append(i)
    else:
      out.append([i])
  return out


def onebit_row_bytes(leaf_sizes, n, exact_below=EXACT_BELOW, shapes=None):
  """Bytes of one message: chunk/8 packed signs + 4 S scales + 4 * ceil(exact elements / n)."""
  compressed, exact = split(leaf_sizes, exact_below, shapes)
  bits = Bits([leaf_sizes[i] for i in compressed], n)
  exact_chunk = -(-sum(int(leaf_sizes[i]) for i in exact) // n)
  return bits.chunk // 8 + 4 * (bits.S + exact_chunk)


def onebit_compressed_bytes(leaf_sizes, n, exact_below=EXACT_BELOW, shapes=None):
  """Bytes one device sends in a compression step of 1-bit Adam (flat mesh): 2 (n-1) row_bytes."""
  return 2.0 * (n - 1) * onebit_row_bytes(leaf_sizes, n, exact_below, shapes)


def onebit_warmup_bytes(leaf_sizes, n):
  """Bytes one device sends in a warmup step (flat mesh): ring all-reduce of the real elements."""
  return 2.0 * (n - 1) / n * sum(int(s) for s in leaf_sizes) * 4
