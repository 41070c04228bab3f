"""The 1-bit sign compressor: pure array functions, no axis names."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = ["sign_compress", "sign_decompress", "pack_signs", "signs_and_squares",
           "signs_and_block_sums",
           "padded_size", "segment_rms", "sign_residual"]

_BITS_PER_BYTE = 8
# Bit k of byte j holds the sign of element 8*j + k ("little" bit order). The same
# order is used by `np.packbits(..., bitorder="little")`.
_BITORDER = "little"
# The axis length from which pack_signs forms 32-bit words (see there).
WORDS_FROM = 1 << 20


def pack_signs(x: jax.Array, axis: int = -1, pad: int = 0) -> jax.Array:
  r"""The signs of ``x`` packed along ``axis``, 8 a byte: ``jnp.packbits(x >= 0, axis, bitorder='little')``.

  Bit :math:`k` of byte :math:`j` is :math:`[x_{8j+k} \ge 0]` (so ``-0.0`` packs as
  positive, NaN as negative); ``pad`` positive signs follow ``x`` along the axis.
  Where the axis is long (at least :data:`WORDS_FROM` elements, in whole
  32-element words), each word is formed as a ``uint32`` sum of its weighted
  bits and its 4 bytes are read back little-endian: the same bytes.
  There XLA:CPU reduces each array's words in a kernel of its own, where
  ``packbits`` fused into the concatenate of several groups' signs became a loop
  over the output bytes: 137.6 of a 302.6 ms 1-bit compression step at 100M
  parameters, one thread, against 9.9 ms and the words' own reductions. Short
  axes keep ``packbits``: there the fused form was as fast, and a kernel of its
  own for each group of small leaves made the program compile slower.

  Example:
    >>> import jax.numpy as jnp, numpy as np
    >>> from onebit_optax import _compressor
    >>> x = jnp.array([1., -2., 0., -0., 3.] * 8)
    >>> bool(np.array_equal(_compressor.pack_signs(x), np.packbits(np.asarray(x) >= 0, bitorder='little')))
    True
  """
  x = jnp.moveaxis(jnp.asarray(x), axis, -1)
  bits = x >= 0
  if pad:
    bits = jnp.concatenate([bits, jnp.ones(x.shape[:-1] + (pad,), jnp.bool_)], axis=-1)
  size = bits.shape[-1]
  if size % 32 or size < WORDS_FROM:
    return jnp.moveaxis(jnp.packbits(bits, axis=-1, bitorder=_BITORDER), -1, axis)
  bits = bits.reshape(x.shape[:-1] + (size // 32, 32)).astype(jnp.uint32)
  weights = jnp.left_shift(jnp.uint32(1), jnp.arange(32, dtype=jnp.uint32))
  words = jnp.sum(bits * weights, axis=-1, dtype=jnp.uint32)
  packed = jax.lax.bitcast_convert_type(words, jnp.uint8)  # (..., words, 4): little-endian bytes
  return jnp.moveaxis(packed.reshape(x.shape[:-1] + (size // 8,)), -1, axis)


def signs_and_squares(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  r"""One pass over ``x`` ``(..., 32 k)`` float32: its packed signs ``(..., 4 k)`` uint8 and the sum of squares of each 32 elements ``(..., k)``.

  The signs are :func:`pack_signs`' bytes (bit :math:`j` of byte :math:`i` is
  :math:`[x_{8i+j} \ge 0]`). One variadic reduction over each 32 elements forms
  a ``uint32`` word of sign bits (its 4 bytes read back little-endian) and
  :math:`\sum x^2`, so a compression reads what it compresses once for both its
  signs and its scales (a scale is the root of a sum of these sums).

  Example:
    >>> import jax.numpy as jnp, numpy as np
    >>> from onebit_optax import _compressor
    >>> x = jnp.array([1., -2., 0., -0., 3.] * 32)
    >>> signs, squares = _compressor.signs_and_squares(x)
    >>> bool(np.array_equal(signs, np.packbits(np.asarray(x) >= 0, bitorder='little')))
    True
    >>> float(squares.sum()) == float(jnp.sum(x * x))
    True
  """
  x = jnp.asarray(x, jnp.float32)
  if x.shape[-1] % 32:
    raise ValueError(f"signs_and_squares needs a multiple of 32 elements on the last axis, got {x.shape}.")
  words = x.reshape(x.shape[:-1] + (-1, 32))
  weights = jnp.left_shift(jnp.uint32(1), jnp.arange(32, dtype=jnp.uint32))
  bits, squares = jax.lax.reduce(
      (jnp.where(words >= 0, weights, jnp.uint32(0)), jnp.square(words)),
      (jnp.uint32(0), jnp.float32(0)), lambda a, b: (a[0] | b[0], a[1] + b[1]), (words.ndim - 1,))
  signs = jax.lax.bitcast_convert_type(bits, jnp.uint8)  # (..., k, 4): little-endian bytes
  return signs.reshape(x.shape[:-1] + (-1,)), squares


def signs_and_block_sums(blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
  """A blocked vector ``(num_blocks, block)``'s packed signs (flat) and each block's sum of squares.

  One pass (:func:`signs_and_squares`) where blocks are whole 32-element words;
  else :func:`pack_signs` and a separate reduction.
  """
  if blocks.shape[-1] % 32:
    return pack_signs(blocks.reshape(-1)), jnp.sum(jnp.square(blocks), axis=1)
  signs, squares = signs_and_squares(blocks)
  return signs.reshape(-1), jnp.sum(squares, axis=1)


def padded_size(size: int, num_devices: int = 1) -> int:
  """Length of the flat buffer that the collective works on.

  The buffer is split into ``num_devices`` equal chunks (one per "server"), and
  each chunk is packed 8 signs per byte, so its length must be a multiple of
  ``8 * num_devices``. Padding elements are zeros on entry; they take part in the
  compression (their error feedback is bounded) and are dropped on exit.

  Args:
    size: number of elements to communicate (e.g. the total parameter count).
    num_devices: size of the data-parallel axis.

  Returns:
    The smallest multiple of ``8 * num_devices`` that is ``>= size``.

  Example:
    >>> from onebit_optax import _compressor
    >>> _compressor.padded_size(1000, num_devices=8)
    1024

  References:
    DeepSpeed ``compressed_allreduce`` pads to a multiple of ``n * lcm(n, 8)``;
    ``8 n`` is all that the packing and the chunking need.
  """
  if num_devices < 1:
    raise ValueError(f"num_devices must be >= 1, got {num_devices}.")
  if size < 0:
    raise ValueError(f"size must be >= 0, got {size}.")
  multiple = _BITS_PER_BYTE * num_devices
  return int(math.ceil(size / multiple) * multiple)


def sign_compress(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  r"""Compresses a vector to its signs (1 bit each) and one float32 scale.

  .. math::

    s = \frac{\lVert x \rVert_2}{\sqrt{d}}, \qquad
    b_i = [x_i \ge 0], \qquad
    C(x) = s \cdot (2 b - 1)

  The scale is the root mean square of ``x`` (DeepSpeed's definition), so that
  ``C(x)`` has the same :math:`\ell_2` norm as ``x``. The sign of ``0`` (and of
  ``-0.0``) is ``+1``. A NaN element encodes as ``-1`` and makes the scale NaN.

  Subnormal inputs count as zero: XLA flushes float32 subnormals (measured on
  CPU, jax 0.10.2-0.12), so a subnormal of either sign encodes as +1 and adds
  nothing to the scale (the error feedback uses the same comparison, so the
  result stays consistent). The squares are float32 and flush too: elements
  with :math:`|x|` below about 1.1e-19 add nothing, and a vector of only such
  values has scale 0. (On jax 0.10 only, a one-element input's scale is
  :math:`|x|` exactly.) GPU and TPU behaviour was not measured.

  Args:
    x: array of any shape; it is flattened (row-major) and cast to float32.

  Returns:
    ``(packed, scale)``: ``packed`` is a uint8 vector of ``ceil(x.size / 8)``
    bytes, bit ``k`` of byte ``j`` being the sign bit of element ``8 j + k``
    (trailing bits of the last byte are 0); ``scale`` is a float32 scalar.

  Example:
    >>> import jax.numpy as jnp
    >>> from onebit_optax import _compressor
    >>> packed, scale = _compressor.sign_compress(jnp.array([3., -4., 0., 1.]))
    >>> packed.dtype, packed.shape, float(scale)
    (dtype('uint8'), (1,), 2.5495...)
    >>> _compressor.sign_decompress(packed, scale, 4)
    Array([ 2.5495..., -2.5495...,  2.5495...,  2.5495...], dtype=float32)

  References:
    Tang et al., `1-bit Adam: Communication Efficient Large-Scale Training with
    Adam's Convergence Speed <https://arxiv.org/abs/2102.02888>`_, 2021.
  """
  x = jnp.ravel(jnp.asarray(x)).astype(jnp.float32)
  size = x.size
  if size == 0:
    return jnp.zeros((0,), jnp.uint8), jnp.zeros((), jnp.float32)
  scale = jnp.sqrt(jnp.sum(jnp.square(x))) / math.sqrt(size)
  return pack_signs(x), scale


def sign_decompress(packed: jax.Array, scale: jax.Array, size: int) -> jax.Array:
  r"""Inverse of :func:`sign_compress`: ``scale * (2 b - 1)`` for the first ``size`` bits.

  .. math::

    C(x)_i = s \cdot (2 b_i - 1), \qquad i < \mathrm{size}.

  Args:
    packed: uint8 array whose last axis holds packed sign bits; leading axes are
      batch axes (e.g. one row per device).
    scale: float32 array broadcastable to ``packed.shape[:-1]``: one scale per row.
    size: number of elements to decode per row (``<= 8 * packed.shape[-1]``).

  Returns:
    float32 array of shape ``packed.shape[:-1] + (size,)``.

  Example:
    >>> import jax.numpy as jnp
    >>> from onebit_optax import _compressor
    >>> _compressor.sign_decompress(jnp.array([0b101], jnp.uint8), 2.0, 3)
    Array([ 2., -2.,  2.], dtype=float32)

  References:
    Tang et al., `1-bit Adam <https://arxiv.org/abs/2102.02888>`_, ICML 2021.
  """
  packed = jnp.asarray(packed)
  if packed.dtype != jnp.uint8:
    raise TypeError(f"packed must be uint8 (from sign_compress), got {packed.dtype}.")
  if size > _BITS_PER_BYTE * packed.shape[-1]:
    raise ValueError(
        f"size={size} needs {math.ceil(size / 8)} bytes, but packed holds only "
        f"{packed.shape[-1]} bytes on its last axis.")
  scale = jnp.asarray(scale, jnp.float32)
  # Bit extraction, the sign and the scale are elementwise, so XLA fuses them with
  # the consumer (e.g. the server's average) instead of writing a float copy of
  # the unpacked bits first.
  shifts = jnp.arange(_BITS_PER_BYTE, dtype=jnp.uint8)
  bits = (packed[..., :, None] >> shifts) & jnp.uint8(1)
  bits = bits.reshape(packed.shape[:-1] + (-1,))[..., :size]
  signs = bits.astype(jnp.float32) * 2.0 - 1.0
  return signs * scale[..., None]


def segment_rms(block_sums: jax.Array, segment_of_block: jax.Array,
                segment_count: jax.Array) -> jax.Array:
  r"""Root mean square of each segment of a blocked vector (one scale per segment), from its blocks' sums of squares.

  .. math::

    s_k = \sqrt{\frac{1}{|k|}\sum_{i \in k} x_i^2}

  where segment :math:`k` is the union of the blocks (rows) that
  ``segment_of_block`` maps to it and :math:`|k|` its count of real elements
  (padding elements must be zero). A segment with no real element gets 0.

  Args:
    block_sums: float32 ``(num_blocks,)``: each block's :math:`\sum x_i^2`
      (:func:`signs_and_block_sums`).
    segment_of_block: int32 ``(num_blocks,)``, sorted.
    segment_count: float32 ``(num_segments,)``: real elements per segment.

  Returns:
    float32 ``(num_segments,)``.
  """
  totals = jax.ops.segment_sum(block_sums, segment_of_block, segment_count.shape[0],
                               indices_are_sorted=True)
  return jnp.sqrt(totals / jnp.maximum(segment_count, 1.0))


def sign_residual(blocks: jax.Array, block_scale: jax.Array, valid: jax.Array) -> jax.Array:
  r"""What 1-bit compression loses: :math:`x - s\,\mathrm{sign}(x)` on real elements, 0 on padding.

  Args:
    blocks: float32 ``(num_blocks, block)``.
    block_scale: float32 ``(num_blocks,)``: the scale of each block's segment.
    valid: bool ``(num_blocks, block)``: the real elements.

  Returns:
    float32 ``(num_blocks, block)``.
  """
  scale = block_scale[:, None]
  return jnp.where(valid, blocks - jnp.where(blocks >= 0, scale, -scale), 0.0)
