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
