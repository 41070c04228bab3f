"""The collectives: the only module that names a mesh axis."""

from __future__ import annotations

import math
from typing import Hashable, Optional

import jax
import jax.numpy as jnp

from onebit_optax import _compressor
from onebit_optax import _layout

__all__ = [
    "axis_size",
    "compressed_mean",
    "compressed_mean_and_check",
    "full_precision_mean",
    "allreduce_wire_bytes",
    "compressed_wire_bytes",
]

AxisName = Optional[Hashable]
_SCALE_BYTES = 4  # each segment's float32 scale rides along with the packed signs.


def axis_size(axis_name: AxisName, *, caller: str = "onebit_optax") -> int:
  """Size of the mapped axis ``axis_name`` (1 when ``axis_name`` is None).

  Raises a ValueError that says what to do when called outside of a
  ``jax.shard_map`` / ``jax.pmap`` that binds ``axis_name``.
  """
  if axis_name is None:
    return 1
  try:
    return int(jax.lax.axis_size(axis_name))
  except NameError as e:
    raise ValueError(
        f"{caller}: axis_name={axis_name!r} is not bound here. With an axis name, "
        "the optimizer must run inside the data-parallel region: call tx.init "
        "and tx.update inside jax.shard_map(..., mesh=mesh) or jax.pmap(..., "
        f"axis_name={axis_name!r}) (for shard_map, onebit_optax.init_sharded(tx, "
        "params, mesh) does the init for you). For a single device without a "
        "mesh, build the optimizer with axis_name=None.") from e


def _varying_axes(x) -> frozenset:
  """Mesh axes over which ``x`` is typed as varying (empty outside check_vma)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))


def vary(x, axis_name: AxisName):
  """Marks ``x`` as differing across devices (the type of per-device buffers under check_vma)."""
  if axis_name is None or axis_name in _varying_axes(x):
    return x
  try:
    return jax.lax.pcast(x, axis_name, to="varying")
  except ValueError:  # outside a check_vma shard_map, there is no type to change
    return x


def full_precision_mean(x: jax.Array, axis_name: AxisName) -> jax.Array:
  """Mean of ``x`` over ``axis_name`` in full precision (an all-reduce)."""
  if axis_name is None:
    return x
  return jax.lax.pmean(x, axis_name)


def allreduce_wire_bytes(size: int, num_devices: int, itemsize: int = 4) -> float:
  r"""Bytes one device sends for a ring all-reduce of ``size`` elements.

  A ring all-reduce is a reduce-scatter then an all-gather, each sending
  :math:`(n-1)/n` of the buffer:

  .. math::

    B_{\mathrm{allreduce}} = 2\,\frac{n-1}{n}\, d \cdot \mathrm{itemsize}.

  Args:
    size: number of elements :math:`d`.
    num_devices: :math:`n`.
    itemsize: bytes per element (4 for float32).

  Returns:
    Bytes sent per device, as a float.

  Example:
    >>> import onebit_optax
    >>> onebit_optax.allreduce_wire_bytes(1_000_000, 8)
    7000000.0

  References:
    Patarasuk & Yuan, Bandwidth optimal all-reduce algorithms for clusters of
    workstations, JPDC 2009; Tang et al., `1-bit Adam
    <https://arxiv.org/abs/2102.02888>`_, ICML 2021, Section 5.
  """
  n = num_devices
  return 2.0 * (n - 1) / n * size * itemsize


def compressed_wire_bytes(padded: int, num_devices: int, max_segments: int = 1) -> float:
  r"""Bytes one device sends in one :func:`compressed_mean` of ``padded`` elements.

  Phase 1 (all_to_all) sends :math:`n-1` packed chunks of :math:`d/(8n)` bytes
  plus the chunk's :math:`S` float32 scales (one per segment: a leaf, or the
  piece of a leaf inside the chunk); phase 2 (all_gather) sends the device's
  packed server chunk and its :math:`S` scales to :math:`n-1` peers (as a ring,
  the same count):

  .. math::

    B_{\mathrm{1bit}} = 2\,(n-1)\left(\frac{d}{8n} + 4S\right)
      \approx \frac{B_{\mathrm{allreduce}}}{32} \text{ for float32.}

  Args:
    padded: the padded length :math:`d` (see :func:`padded_size`).
    num_devices: :math:`n`.
    max_segments: :math:`S`, scales per chunk (1 for a single flat vector).

  Returns:
    Bytes sent per device, as a float.

  Example:
    >>> import onebit_optax
    >>> onebit_optax.compressed_wire_bytes(onebit_optax.padded_size(1_000_000, 8), 8)
    218806.0

  References:
    Tang et al., `1-bit Adam <https://arxiv.org/abs/2102.02888>`_, ICML 2021, Section 5.
  """
  n = num_devices
  return 2.0 * (n - 1) * (padded / (8 * n) + _SCALE_BYTES * max_segments)


def _axis_index(axis_name: AxisName):
  return 0 if axis_name is None else jax.lax.axis_index(axis_name)


def _chunk_slice(table, r, length: int):
  """Chunk ``r``'s part of a static table (a dynamic slice: ``r`` is the device index)."""
  table = jnp.asarray(table)
  if isinstance(r, int):
    return table[r * length:(r + 1) * length]
  return jax.lax.dynamic_slice_in_dim(table, r * length, length)


def _scales_to_bytes(scales: jax.Array) -> jax.Array:
  """(..., S) float32 -> (..., 4 S) uint8 (the bytes of each scale, in order)."""
  raw = jax.lax.bitcast_convert_type(scales.astype(jnp.float32), jnp.uint8)
  return raw.reshape(scales.shape[:-1] + (-1,))


def _scales_from_bytes(raw: jax.Array) -> jax.Array:
  """Inverse of :func:`_scales_to_bytes`."""
  return jax.lax.bitcast_convert_type(
      raw.reshape(raw.shape[:-1] + (-1, _SCALE_BYTES)), jnp.float32)


def _decode(packed: jax.Array, block_scale: jax.Array, block: int) -> jax.Array:
  """(blocks * block / 8,) packed signs and (blocks,) scales -> (blocks, block) float32."""
  return _compressor.sign_decompress(packed.reshape(-1, block // 8), block_scale, block)


def compressed_mean(
    x: jax.Array,
    worker_error: jax.Array,
    server_error: jax.Array,
    axis_name: AxisName,
    *,
    layout: Optional[_layout.FlatLayout] = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  r"""Error-compensated 1-bit mean of ``x`` over ``axis_name`` (two phases, one scale per segment).

  With :math:`n` devices and :math:`C` the 1-bit compressor (one sign bit per
  element, and one RMS scale per *segment*: a leaf of the parameter tree, or the
  piece of a leaf that falls into one chunk), device :math:`i` holding
  :math:`x_i`, worker error :math:`e_i` and server error :math:`s_i`:

  .. math::

    u_i &= x_i + e_i, \qquad e_i' = u_i - C(u_i) \\
    w_r &= \tfrac{1}{n} \textstyle\sum_i C(u_i)[r] + s_r, \qquad
      s_r' = w_r - C(w_r) \\
    \bar{x} &= \big[C(w_0), \dots, C(w_{n-1})\big], \qquad
    C(u)_j = \mathrm{rms}(u_{k(j)})\,\mathrm{sign}(u_j)

  where :math:`[r]` is chunk :math:`r` of :math:`n` equal chunks, :math:`k(j)`
  the segment of element :math:`j`, and :math:`\mathrm{sign}(0) = +1`. Device
  :math:`r` is the "server" of chunk :math:`r`. One scale per segment keeps a
  leaf with small values (a LayerNorm bias, a rare embedding) from being sent at
  the size of the whole model's RMS.

  On the wire (per device): phase 1 is one ``all_to_all`` of uint8 rows, each the
  packed signs of one chunk (``d / (8 n)`` bytes) followed by the 4-byte float32
  scales of the chunk's segments; device :math:`r` receives chunk :math:`r` of
  every device. Phase 2 is one ``all_gather`` of the packed server chunks with
  their scales, also uint8. Nothing else crosses the network (see
  :func:`compressed_wire_bytes`), and the number of collectives does not depend
  on the number of leaves. Every device decodes the same gathered bits, so
  ``mean`` is bitwise identical on all devices (and typed invariant under
  ``shard_map``). Padding elements are held at zero.

  With ``axis_name=None`` the same computation runs with :math:`n = 1` and no
  communication: the result is the 1-bit compression of ``x`` with both error
  feedback stages, as a single-worker cluster would compute it.

  Args:
    x: float32 vector of ``d`` elements on each device: a flat buffer laid out by
      ``layout``; without a layout, any vector whose length is a multiple of
      ``8 n`` (pad with zeros to :func:`padded_size`), compressed as one segment
      per chunk.
    worker_error: float32 vector shaped like ``x``: this device's compression
      error from the previous call (zeros at first).
    server_error: float32 vector of ``d / n`` elements: the error this device
      made as server of its chunk in the previous call (zeros at first).
    axis_name: the data-parallel mesh axis, or None.
    layout: where the leaves (segments) are; built by the optimizer.

  Returns:
    ``(mean, new_worker_error, new_server_error)`` with the shapes of ``x``,
    ``worker_error`` and ``server_error``.

  Example:
    >>> import jax.numpy as jnp
    >>> import onebit_optax
    >>> x = jnp.linspace(-1.0, 1.0, 16)
    >>> mean, we, se = onebit_optax.compressed_mean(
    ...     x, jnp.zeros(16), jnp.zeros(16), axis_name=None)
    >>> mean.shape, we.shape, se.shape
    ((16,), (16,), (16,))

  References:
    Tang et al., `1-bit Adam: Communication Efficient Large-Scale Training with
    Adam's Convergence Speed <https://arxiv.org/abs/2102.02888>`_, 2021
    (Algorithm 1 and Section 4.2).
  """
  mean, new_worker_error, new_server_error, _ = compressed_mean_and_check(
      x, worker_error, server_error, axis_name, layout=layout,
      keep_errors_if_nonfinite=False)
  return mean, new_worker_error, new_server_error


def _vector_layout(d: int, n: int) -> _layout.FlatLayout:
  """A one-leaf layout for a bare vector of ``d`` elements (block: a divisor of the chunk)."""
  if d % (8 * n) or d == 0:
    raise ValueError(
        f"compressed_mean needs a length that is a positive multiple of 8 * {n} = {8 * n}, "
        f"got {d}: pad x with zeros to onebit_optax.padded_size({d}, {n}) = "
        f"{_compressor.padded_size(max(d, 1), n)} elements.")
  return _layout.cached_layout(((d,),), n, math.gcd(d // n, _layout.BLOCK))


def _check_inputs(x, worker_error, server_error, layout, n):
  x = jnp.asarray(x)
  if x.ndim != 1 or x.dtype != jnp.float32:
    raise ValueError(
        f"compressed_mean expects a flat float32 vector, got {x.dtype}{list(x.shape)}; "
        "ravel and cast it first (onebit_adam does this for a pytree).")
  if layout is None:
    layout = _vector_layout(x.shape[0], n)
  if layout.num_devices != n or layout.padded != x.shape[0]:
    raise ValueError(
        f"compressed_mean: the layout is for {layout.padded} elements on "
        f"{layout.num_devices} devices, got {x.shape[0]} elements on {n} devices.")
  d, chunk = layout.padded, layout.chunk
  if worker_error.shape != (d,) or server_error.shape != (chunk,):
    raise ValueError(
        f"compressed_mean: for x of shape ({d},) on {n} devices, worker_error must "
        f"have shape ({d},) and server_error ({chunk},); got {worker_error.shape} "
        f"and {server_error.shape}.")
  return x, layout


def compressed_mean_and_check(x, worker_error, server_error, axis_name, *,
                              layout=None, keep_errors_if_nonfinite: bool):
  """:func:`compressed_mean`, plus whether the result is finite on every device.

  The flag is read off the gathered server scales: a NaN or Inf in any device's
  input makes its segment's scale non-finite, hence that server's average and
  scale, and every device sees the same gathered scales. So it is free, and
  agreed across devices without another collective. With
  ``keep_errors_if_nonfinite`` the old error buffers are returned when the flag
  is False; the residuals are computed after the flag is known, so that choice
  costs no extra pass over the buffers.
  """
  n = axis_size(axis_name, caller="compressed_mean")
  x, layout = _check_inputs(x, worker_error, server_error, layout, n)
  tables, block, segments = layout.tables, layout.block, layout.max_segments
  chunk_bytes = layout.chunk // 8
  valid = layout.valid()

  # Phase 1: every device compresses its (error-compensated) vector, one scale per
  # segment, and sends chunk r of the packed signs, with the chunk's scales, to device r.
  u = jnp.where(valid, (x + worker_error).reshape(-1, block), 0.0)
  scales = _compressor.segment_rms(u, tables.wire_segment, tables.segment_count)
  packed = jnp.packbits(u.reshape(-1) >= 0, bitorder=_compressor._BITORDER)
  rows = jnp.concatenate([packed.reshape(n, chunk_bytes),
                          _scales_to_bytes(scales.reshape(n, segments))], 1)
  if axis_name is not None:
    rows = jax.lax.all_to_all(rows, axis_name, split_axis=0, concat_axis=0, tiled=True)

  # Row i is now device i's compressed version of our chunk r.
  r = _axis_index(axis_name)
  blocks_per_chunk = layout.num_blocks // n
  local_segment = _chunk_slice(tables.wire_segment, r, blocks_per_chunk) - r * segments
  chunk_valid = layout.valid(_chunk_slice(tables.block_valid, r, blocks_per_chunk))
  worker_scales = _scales_from_bytes(rows[:, chunk_bytes:])[:, local_segment]
  # An explicit sum over the n rows: XLA:CPU lowers jnp.mean(axis=0) of the
  # decoded (n, ...) block to a slow strided reduction (~20x slower, measured in
  # benchmarks/optimizer_compute.py); the row sum fuses decode and accumulate.
  chunk_sum = _decode(rows[0, :chunk_bytes], worker_scales[0], block)
  for i in range(1, n):
    chunk_sum = chunk_sum + _decode(rows[i, :chunk_bytes], worker_scales[i], block)

  # Phase 2: as server of this chunk, re-compress the average with our own error
  # feedback and share it with everyone.
  w = jnp.where(chunk_valid, chunk_sum / n + server_error.reshape(-1, block), 0.0)
  server_scales = _compressor.segment_rms(
      w, local_segment, _chunk_slice(tables.segment_count, r, segments))
  message = jnp.concatenate([
      jnp.packbits(w.reshape(-1) >= 0, bitorder=_compressor._BITORDER),
      _scales_to_bytes(server_scales)])
  if axis_name is None:
    gathered = message[None]
  else:
    # 'invarying': every device holds the same bytes, and says so to the type
    # system, so the mean (and the parameters) can leave shard_map replicated.
    gathered = jax.lax.all_gather(message, axis_name, to="invarying")
  gathered_scales = _scales_from_bytes(gathered[:, chunk_bytes:]).reshape(-1)
  mean = jnp.where(valid, _decode(gathered[:, :chunk_bytes].reshape(-1),
                                  gathered_scales[tables.wire_segment], block), 0.0)
  finite = jnp.all(jnp.isfinite(gathered_scales))
  new_worker_error = _compressor.sign_residual(u, scales[tables.wire_segment], valid)
  new_server_error = _compressor.sign_residual(w, server_scales[local_segment], chunk_valid)
  new_worker_error = new_worker_error.reshape(-1)
  new_server_error = new_server_error.reshape(-1)
  if keep_errors_if_nonfinite:
    # A cond, not a select: the predicate is agreed across devices, and the
    # usual (finite) branch then costs no extra pass over the buffers.
    new_worker_error, new_server_error = jax.lax.cond(
        finite, lambda: (new_worker_error, new_server_error),
        lambda: (worker_error, server_error))
  return mean.reshape(-1), new_worker_error, new_server_error, finite
