"""The collectives: the only module that names a mesh axis."""

from __future__ import annotations

import math
from typing import Hashable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp

from onebit_optax import _compressor
from onebit_optax import _layout
from onebit_optax import _wire

__all__ = [
    "axis_size",
    "compressed_mean",
    "compressed_mean_and_check",
    "full_precision_mean",
    "allreduce_wire_bytes",
    "compressed_wire_bytes",
    "axis_names",
    "error_sizes",
    "split_axes",
    "step_wire_bytes",
]

AxisName = Optional[Union[Hashable, tuple]]
_SCALE_BYTES = 4  # each segment's float32 scale rides along with the packed signs.


def split_axes(axis_name: AxisName) -> tuple:
  """``(slow, fast)``: ``('node', 'local')`` is hierarchical, a single name (or None) is flat.

  A pair names the slow axis (between nodes: compressed to 1 bit) first and the
  fast axis (inside a node: full precision) second; a flat axis has no fast
  axis (None).
  """
  if not isinstance(axis_name, tuple):
    return axis_name, None
  if len(axis_name) == 1:
    return axis_name[0], None
  if len(axis_name) != 2 or None in axis_name or axis_name[0] == axis_name[1]:
    raise ValueError(
        f"axis_name={axis_name!r}: give one data-parallel mesh axis (e.g. 'data'), or a "
        "pair of two different axes (slow, fast), e.g. ('node', 'local'): the mean over "
        "'local' is taken in full precision, the one over 'node' in 1 bit.")
  return axis_name


def axis_names(*axes: AxisName) -> tuple:
  """The mesh axis names in ``axes`` (each a name, a tuple of names, or None), in order."""
  return tuple(name for a in axes if a is not None
               for name in (a if isinstance(a, (tuple, list)) else (a,)))


def axis_size(axis_name: AxisName, *, caller: str = "onebit_optax") -> int:
  """Size of the mapped axis ``axis_name`` (1 when ``axis_name`` is None).

  Raises a ValueError that says what to do when called outside of a
  ``jax.shard_map`` / ``jax.pmap`` that binds ``axis_name``.
  """
  if axis_name is None:
    return 1
  if isinstance(axis_name, tuple):
    split_axes(axis_name)  # refuses a malformed tuple with a message
  try:
    return int(jax.lax.axis_size(axis_name))
  except NameError as e:
    raise ValueError(_unbound_message(axis_name, caller)) from e


def _unbound_message(axis_name: AxisName, caller: str) -> str:
  """Why ``axis_name`` is not bound: another axis is (names both), or no mapped region is."""
  mesh = jax.sharding.get_abstract_mesh()
  bound = list(getattr(mesh, "manual_axes", ()))
  if bound:
    names = ", ".join(f"{name!r} ({mesh.shape[name]} devices)" for name in bound)
    return (
        f"{caller}: axis_name={axis_name!r} is not bound here: the enclosing shard_map "
        f"binds {names}, and the optimizer was built for {axis_name!r}. Build the optimizer "
        f"with the mesh's data-parallel axis (e.g. axis_name={bound[0]!r}) or name that mesh "
        f"axis {axis_names(axis_name)[0]!r}; init_sharded's axis_name must be the one the "
        "optimizer was built with.")
  return (
      f"{caller}: axis_name={axis_name!r} is not bound here (no shard_map or pmap axis is). "
      "With an axis name, the optimizer must run inside the data-parallel region: call "
      "tx.init and tx.update inside jax.shard_map(..., mesh=mesh) or jax.pmap(..., "
      f"axis_name={axis_name!r}) (for shard_map, onebit_optax.init_sharded(tx, params, "
      "mesh) does the init for you). For a single device without a mesh, build the "
      "optimizer with axis_name=None. Under plain jax.jit with sharding annotations (no "
      "shard_map) there are no per-device gradients: XLA all-reduces them in float32 in "
      "the backward pass, leaving nothing for 1-bit compression to save; put the training "
      "step inside jax.shard_map (README: 'The jax.shard_map recipe'; "
      "docs/guides/model_parallel.md for parameters sharded over a model axis). With Flax "
      "NNX, an nnx.Optimizer built outside the mapped region lands here: build it inside "
      "nnx.shard_map, as docs/guides/nnx.md shows.")


class Axes(NamedTuple):
  """The mesh as one update sees it, resolved once (:func:`resolve_axes`) and passed down."""

  data: AxisName  # axis_name as given: None, a name, or (slow, fast).
  slow: AxisName  # the axis the 1-bit messages cross (the only one for a flat mesh).
  fast: AxisName  # hierarchical: the axis averaged in float32 first; else None.
  model: AxisName  # the model-parallel axis (or axes), or None.
  n_slow: int
  n_fast: int

  @property
  def num_devices(self) -> int:
    """Data-parallel devices: chunks of the wire layout."""
    return self.n_slow * self.n_fast

  @property
  def hierarchical(self) -> bool:
    return self.fast is not None

  @property
  def device_axes(self):
    """The axes over which the per-device buffers differ (None without any)."""
    return axis_names(self.data, self.model) or None


def resolve_axes(axis_name: AxisName, model_axis: AxisName = None, *,
                 caller: str = "onebit_optax") -> Axes:
  """Reads the sizes of the data (and model) axes once; refuses unbound or malformed names."""
  slow, fast = split_axes(axis_name)
  return Axes(axis_name, slow, fast, model_axis, axis_size(slow, caller=caller),
              axis_size(fast, caller=caller))


def onebit_exchange(rows: jax.Array, server_error, layout: _layout.WireLayout, axes: Axes, *,
                    keep_if_nonfinite: bool):
  """Phase 1 (``all_to_all`` of ``rows``), the server's phase 2 and the ``all_gather``, flat axis.

  Returns ``(gathered, new_server_error, finite)``: the (n, row_bytes) messages
  of all servers (identical on every device: the new mean, packed), the new
  server error (the old one where the step is not finite and
  ``keep_if_nonfinite``), and whether every scale and exact float is finite,
  agreed over the model axis. With one device there is no server: the mean
  of one compressed vector is that vector, ``rows`` itself.
  """
  if axes.n_slow == 1:
    # A 1-device mesh: the gather over it only retypes the row as replicated
    # (where nothing types it, XLA:CPU would still run it: see psum_leaves).
    retype = axes.slow is not None and set(axis_names(axes.slow)) & _varying_axes(rows)
    gathered = _gather(rows[0], axes.slow, None) if retype else rows
    return gathered, server_error, _all_true(gathered_finite(gathered, layout.bits), axes.model)
  received = jax.lax.all_to_all(rows, axes.slow, split_axis=0, concat_axis=0, tiled=True)
  old = server_error[0].astype(jnp.float32)
  served = serve(received, old, layout.bits, exact_chunk=layout.exact_chunk,
                 chunk_index=jax.lax.axis_index(axes.slow), n_slow=axes.n_slow)
  gathered = _gather(served.message, axes.slow, None)
  finite = _all_true(gathered_finite(gathered, layout.bits), axes.model)
  # (in the buffer's own shape, (1, chunk): a select written through a reshape is not in place)
  new = served.residual.reshape(server_error.shape).astype(server_error.dtype)
  return gathered, jnp.where(finite, new, server_error) if keep_if_nonfinite else new, finite


def _varying_axes(x) -> frozenset:
  """Mesh axes over which ``x`` is typed as varying (empty outside check_vma)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))


def psum_leaves(leaves: list, axis_name: AxisName, n: int) -> list:
  """``jax.lax.psum(leaves, axis_name)`` (``n`` devices): over one device, the leaves themselves.

  A sum over one device is the identity, but XLA:CPU runs it as an
  all-reduce, a full pass at about a tenth of an elementwise pass's speed
  (100 MB: 50 ms against 4.5 ms): under ``pmap`` or
  ``shard_map(check_vma=False)`` on one device it doubled the warmup step.
  Leaves typed varying keep the psum, which types the sum replicated.
  """
  if n == 1 and not any(set(axis_names(axis_name)) & _varying_axes(x) for x in leaves):
    return list(leaves)
  return jax.lax.psum(leaves, axis_name)


def vary(x, axis_name: AxisName):
  """Marks ``x`` as differing across devices (the type of per-device buffers under check_vma)."""
  missing = tuple(name for name in axis_names(axis_name) if name not in _varying_axes(x))
  if not missing:
    return x
  try:
    return jax.lax.pcast(x, missing, to="varying")
  except ValueError:  # outside a check_vma shard_map, there is no type to change
    return x


def _gloo_collectives() -> bool:
  """True where the collectives run over gloo (multi-process CPU)."""
  return jax.default_backend() == "cpu" and jax.process_count() > 1


def _fast_mean_slice(x: jax.Array, fast, n_fast: int) -> jax.Array:
  """This device's ``1/n_fast`` slice of the mean of ``x`` over the fast axis.

  A reduce-scatter, except over gloo (multi-process CPU), where XLA's
  reduce-scatter ran 5x slower than an all-reduce of the same buffer (102 MB,
  2 processes on loopback: 0.75 s against 0.14 s; see
  benchmarks/results/comm_throughput_hier.md): there, the all-reduce and a
  slice. The same values either way, up to the order of the float32 sums.
  """
  if not _gloo_collectives():
    return jax.lax.psum_scatter(x, fast, scatter_dimension=0, tiled=True) / n_fast
  size = x.shape[0] // n_fast
  total = jax.lax.psum(x, fast)
  return jax.lax.dynamic_slice_in_dim(total, jax.lax.axis_index(fast) * size, size) / n_fast


def full_precision_mean(x: jax.Array, axis_name: AxisName) -> jax.Array:
  """Mean of ``x`` over ``axis_name`` in full precision (an all-reduce).

  For a pair ``(slow, fast)``, a vector is reduce-scattered over the fast axis,
  each slice averaged over the slow axis and the slices all-gathered over the
  fast axis: the slow links carry ``1/fast_size`` of the vector per device.
  """
  if axis_name is None:
    return x
  slow, fast = split_axes(axis_name)
  if fast is None:
    return jax.lax.pmean(x, slow)
  n_fast = axis_size(fast)
  if jnp.ndim(x) != 1 or x.shape[0] % n_fast:
    return jax.lax.pmean(x, (slow, fast))
  part = _fast_mean_slice(x, fast, n_fast)
  return jax.lax.all_gather(jax.lax.pmean(part, slow), fast, tiled=True, to="invarying")


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
    >>> from onebit_optax import _collective
    >>> _collective.allreduce_wire_bytes(1_000_000, 8)
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
    >>> from onebit_optax import _collective, _compressor
    >>> _collective.compressed_wire_bytes(_compressor.padded_size(1_000_000, 8), 8)
    218806.0

  References:
    Tang et al., `1-bit Adam <https://arxiv.org/abs/2102.02888>`_, ICML 2021, Section 5.
  """
  n = num_devices
  return 2.0 * (n - 1) * (padded / (8 * n) + _SCALE_BYTES * max_segments)


def step_wire_bytes(layout: _layout.FlatLayout, axis_name: AxisName, *,
                    compressed: bool) -> float:
  """Bytes one device sends over the slow (or only) axis in one optimizer step.

  Flat: the all-reduce (:func:`allreduce_wire_bytes`) or the compressed mean
  (:func:`compressed_wire_bytes`) of the padded buffer. Hierarchical
  ``(slow, fast)``: the same over the slow axis for the device's
  ``1/fast_size`` slice; the fast axis's traffic is not counted (it is what the
  fast links are for).
  """
  slow, fast = split_axes(axis_name)
  n_slow, n_fast = axis_size(slow), axis_size(fast)
  if compressed:
    return compressed_wire_bytes(layout.padded // n_fast, n_slow, layout.max_segments)
  return allreduce_wire_bytes(layout.padded // n_fast, n_slow)


def _axis_index(axis_name: AxisName):
  return 0 if axis_name is None else jax.lax.axis_index(axis_name)


def _chunk_slice(table, r, length: int):
  """Chunk ``r``'s part of a static table (a dynamic slice: ``r`` is the device index)."""
  table = jnp.asarray(table)
  if isinstance(r, int):
    return table[r * length:(r + 1) * length]
  return jax.lax.dynamic_slice_in_dim(table, r * length, length)


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
  the size of the whole model's RMS. (The optimizers' flat exchange differs on
  the worker side: each device scales a whole leaf by one RMS, and a segment
  carries its leaf's scale; the servers scale each segment, as here. See
  the wire format in the docs.)

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

  **Hierarchical** (``axis_name=(slow, fast)``, e.g. ``('node', 'local')``
  with :math:`N` nodes of :math:`L` devices): ``x`` is first reduce-scattered
  over the fast axis in float32, so the device with fast index :math:`l` holds
  its node's mean of the slice made of chunks :math:`lN, \dots, lN + N - 1`
  (of :math:`NL` chunks). The two phases above then run over the slow axis only,
  on that slice (device :math:`(k, l)` serves chunk :math:`lN + k`), and the
  packed server messages are all-gathered over the slow axis and then over the
  fast one. The slow links carry :math:`2(N-1)(d/(8NL) + 4S)` bytes per device,
  all uint8; ``worker_error`` has :math:`d/L` elements (see :func:`error_sizes`).

  Args:
    x: float32 vector of ``d`` elements on each device: a flat buffer laid out by
      ``layout``; without a layout, any vector whose length is a multiple of
      ``8 n`` (pad with zeros to :func:`padded_size`), compressed as one segment
      per chunk.
    worker_error: float32 vector shaped like ``x`` (hierarchical: ``d / L``
      elements): this device's compression error from the previous call (zeros
      at first).
    server_error: float32 vector of ``d / n`` elements: the error this device
      made as server of its chunk in the previous call (zeros at first).
    axis_name: the data-parallel mesh axis, a pair ``(slow, fast)`` of axes for
      hierarchical averaging, or None.
    layout: where the leaves (segments) are; built by the optimizer.

  Returns:
    ``(mean, new_worker_error, new_server_error)`` with the shapes of ``x``,
    ``worker_error`` and ``server_error``.

  Example:
    >>> import jax.numpy as jnp
    >>> from onebit_optax import _collective
    >>> x = jnp.linspace(-1.0, 1.0, 16)
    >>> mean, we, se = _collective.compressed_mean(
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
        f"got {d}: pad x with zeros to padded_size({d}, {n}) = "
        f"{_compressor.padded_size(max(d, 1), n)} elements.")
  return _layout.cached_layout(((d,),), n, math.gcd(d // n, _layout.BLOCK))


def _check_inputs(x, worker_error, server_error, layout, n, n_fast):
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
  worker, server = error_sizes(layout, n_fast)
  if worker_error.shape != (worker,) or server_error.shape != (server,):
    raise ValueError(
        f"compressed_mean: for x of shape ({layout.padded},) on {n} devices "
        f"({n_fast} on the fast axis), worker_error must have shape ({worker},) and "
        f"server_error ({server},); got {worker_error.shape} and {server_error.shape}.")
  return x, layout


def error_sizes(layout: _layout.FlatLayout, fast_size: int = 1) -> tuple[int, int]:
  """Elements of the worker and server error vectors of one device.

  The worker error covers what the device compresses: the whole padded buffer,
  or its ``1/fast_size`` slice under hierarchical averaging; the server error
  covers the one chunk the device serves.
  """
  return layout.padded // fast_size, layout.chunk


class _Part(NamedTuple):
  """The static tables restricted to the chunks one device compresses (its part)."""

  segment: jax.Array  # (part_blocks,) int32: wire segment, numbered from the part's first chunk.
  segment_count: jax.Array  # (slow * max_segments,) float32: real elements per segment.
  block_valid: jax.Array  # (part_blocks,) int32: real elements per block.


def _part(layout: _layout.FlatLayout, index, slow: int) -> _Part:
  """Chunks ``[index * slow, (index + 1) * slow)`` of ``layout`` (``index`` may be traced)."""
  tables, segments = layout.tables, layout.max_segments
  blocks = slow * (layout.num_blocks // layout.num_devices)
  first_segment = index * slow * segments
  return _Part(
      segment=_chunk_slice(tables.wire_segment, index, blocks) - first_segment,
      segment_count=_chunk_slice(tables.segment_count, index, slow * segments),
      block_valid=_chunk_slice(tables.block_valid, index, blocks))


def _all_true(flag: jax.Array, axis_name: AxisName) -> jax.Array:
  """``flag`` and-ed over ``axis_name`` (one scalar collective; none without an axis)."""
  if axis_name is None:
    return flag
  return jax.lax.pmin(flag.astype(jnp.int32), axis_name) > 0


def _gather(message: jax.Array, slow: AxisName, fast: AxisName) -> jax.Array:
  """Every device's message, in chunk order ``fast_index * slow_size + slow_index``."""
  if slow is None:
    return message[None]
  # 'invarying': every device holds the same bytes, and says so to the type
  # system, so the mean (and the parameters) can leave shard_map replicated.
  gathered = jax.lax.all_gather(message, slow, to="invarying")
  if fast is not None:
    gathered = jax.lax.all_gather(gathered, fast, to="invarying")
  return gathered.reshape(-1, message.shape[0])


class Served(NamedTuple):
  """What the server of one chunk computes from the rows it received."""

  message: jax.Array  # (row_bytes,) uint8: its packed signs, its scales, the exact means.
  residual: jax.Array  # (chunk,) float32: the new server error, w - C(w).


def serve(received: jax.Array, server_error: jax.Array, bits: _layout.FlatLayout, *,
          exact_chunk: int, chunk_index, n_slow: int) -> Served:
  """Phase 2 on one server: average the received rows of its chunk, add its error, re-compress.

  ``received`` (n_slow, row_bytes) holds, from each worker, the packed signs of
  chunk ``chunk_index``, the scale of each of the chunk's segments and
  ``exact_chunk`` float32 values. The signs are decoded with their worker's
  scales and averaged (an explicit sum over the rows: XLA:CPU lowered a mean
  over the row axis to a slow strided reduction), the server error is added,
  and the result is compressed again with one RMS scale per segment; the
  exact floats are averaged as they are.
  """
  block, segments = bits.block, bits.max_segments
  chunk_bytes, per_chunk = bits.chunk // 8, bits.num_blocks // bits.num_devices
  tables = bits.tables
  local_segment = _chunk_slice(tables.wire_segment, chunk_index, per_chunk) - chunk_index * segments
  chunk_valid = bits.valid(_chunk_slice(tables.block_valid, chunk_index, per_chunk))
  worker_scales = _wire.scales_from_bytes(
      received[:, chunk_bytes:chunk_bytes + 4 * segments])[:, local_segment]
  chunk_sum = _decode(received[0, :chunk_bytes], worker_scales[0], block)
  for i in range(1, n_slow):
    chunk_sum = chunk_sum + _decode(received[i, :chunk_bytes], worker_scales[i], block)
  w = jnp.where(chunk_valid, chunk_sum / n_slow + server_error.reshape(-1, block), 0.0)
  signs, squares = _compressor.signs_and_block_sums(w)  # (one pass over w for both)
  server_scales = _compressor.segment_rms(
      squares, local_segment, _chunk_slice(tables.segment_count, chunk_index, segments))
  parts = [signs, _wire.scales_to_bytes(server_scales)]
  if exact_chunk:
    floats = _wire.scales_from_bytes(received[:, chunk_bytes + 4 * segments:])
    total = floats[0]
    for i in range(1, n_slow):
      total = total + floats[i]
    parts.append(_wire.scales_to_bytes(total / n_slow))
  residual = _compressor.sign_residual(w, server_scales[local_segment], chunk_valid)
  return Served(jnp.concatenate(parts), residual.reshape(-1))


def gathered_finite(gathered: jax.Array, bits: _layout.FlatLayout) -> jax.Array:
  """Whether every scale and exact float of the gathered messages is finite (the same on every device).

  A NaN or Inf in any device's input makes its segment's scale (or its exact
  float) non-finite at the server, and every device sees every server's
  message: the flag needs no collective of its own.
  """
  values = _wire.scales_from_bytes(gathered[:, bits.chunk // 8:])
  return jnp.all(jnp.isfinite(values))


def _decode_stream(gathered: jax.Array, bits: _layout.FlatLayout) -> jax.Array:
  """The whole gathered bit stream with its segment scales, as (blocks, block) float32."""
  chunk_bytes = bits.chunk // 8
  scales = _wire.scales_from_bytes(
      gathered[:, chunk_bytes:chunk_bytes + 4 * bits.max_segments]).reshape(-1)
  return _decode(gathered[:, :chunk_bytes].reshape(-1), scales[bits.tables.wire_segment],
                 bits.block)


def compressed_mean_and_check(x, worker_error, server_error, axis_name, *,
                              layout=None, keep_errors_if_nonfinite: bool,
                              agree_axis: AxisName = None):
  """:func:`compressed_mean`, plus whether the result is finite on every device.

  The flag is read off the gathered server scales: a NaN or Inf in any device's
  input makes its segment's scale non-finite, hence that server's average and
  scale, and every device sees the same gathered scales. So it is free, and
  agreed across devices without another collective (``agree_axis``, e.g. a
  model-parallel axis whose devices hold other parameters, adds one scalar
  ``pmin``). With ``keep_errors_if_nonfinite`` the old error buffers are returned
  when the flag is False; the residuals are computed after the flag is known,
  so that choice costs no extra pass over the buffers.
  """
  slow, fast = split_axes(axis_name)
  n_slow = axis_size(slow, caller="compressed_mean")
  n_fast = axis_size(fast, caller="compressed_mean")
  x, layout = _check_inputs(x, worker_error, server_error, layout, n_slow * n_fast, n_fast)
  if fast is not None:
    # Full precision over the fast axis first: a reduce-scatter leaves each
    # device with its node's mean of one 1/n_fast slice, all it compresses.
    x = _fast_mean_slice(x, fast, n_fast)
  out = compressed_average(x, worker_error, server_error, axis_name, layout=layout,
                           keep_server_error_if_nonfinite=keep_errors_if_nonfinite,
                           agree_axis=agree_axis)
  new_worker_error = worker_residual(x, worker_error, out.worker_scale, layout,
                                     _part(layout, _axis_index(fast), n_slow).block_valid)
  if keep_errors_if_nonfinite:
    # A cond, not a select: the predicate is agreed across devices, and the
    # usual (finite) branch then costs no extra pass over the buffer.
    new_worker_error = jax.lax.cond(out.finite, lambda: new_worker_error, lambda: worker_error)
  return out.mean, new_worker_error, out.server_error, out.finite


class Averaged(NamedTuple):
  """What :func:`compressed_average` returns (all but the worker's residual)."""

  mean: jax.Array  # (padded,) float32: the averaged vector, identical on all devices.
  gathered: jax.Array  # (n, row_bytes) uint8: every server's message (the mean, packed).
  worker_scale: jax.Array  # (part_blocks,) float32: each block's scale in the worker's compression.
  server_error: jax.Array  # (chunk,) float32: the new server error.
  finite: jax.Array  # () bool: the mean is finite on every device.


def _error_compensated(x, worker_error, valid, block: int) -> jax.Array:
  """``x + e`` on real elements, 0 on padding, as (blocks, block)."""
  return jnp.where(valid, (x + worker_error).reshape(-1, block), 0.0)


def worker_residual(x, worker_error, worker_scale, layout, block_valid=None) -> jax.Array:
  """The new worker error ``u - C(u)``, ``u = x + e``, from the scales :func:`compressed_average` used.

  Separate from the average so that the optimizer can compute it outside its
  phase switch, elementwise from the same inputs: XLA then writes it straight
  into the donated error buffer (reading old error, writing new) instead of
  materializing ``u`` and the conditional's result as full-size temporaries.
  Computed in ``worker_error``'s own shape: a reshape of the donated buffer (to
  blocks, or from ``(1, d)`` to ``(d,)``) makes XLA:CPU write the result to a
  fresh buffer and copy it back; only the small per-block tables are broadcast
  and reshaped (3x faster on XLA:CPU than gathering them per element).
  ``block_valid``: the blocks of the device's part (hierarchical); None: all.
  """
  shape, blocks = worker_error.shape, worker_scale.shape[0]
  per_element = lambda table: jnp.broadcast_to(table, (blocks, layout.block)).reshape(shape)
  valid = per_element(layout.valid(block_valid))
  scale = per_element(worker_scale[:, None])
  u = jnp.where(valid, x.reshape(shape) + worker_error, 0.0)
  return jnp.where(valid, u - jnp.where(u >= 0, scale, -scale), 0.0)


def compressed_average(x, worker_error, server_error, axis_name, *, layout,
                       keep_server_error_if_nonfinite: bool,
                       agree_axis: AxisName = None) -> Averaged:
  """The two phases of :func:`compressed_mean` on ``x`` (already this device's part), less the worker's residual.

  ``x`` is the vector this device compresses: the whole buffer, or under
  hierarchical averaging its slice after the fast axis's reduce-scatter. The
  worker's residual is left to :func:`worker_residual`.
  """
  slow, fast = split_axes(axis_name)
  n_slow = axis_size(slow, caller="compressed_mean")
  part = _part(layout, _axis_index(fast), n_slow)
  block, segments = layout.block, layout.max_segments
  chunk_bytes = layout.chunk // 8

  # Phase 1: every device compresses its (error-compensated) part, one scale per
  # segment, and sends chunk r of the packed signs, with the chunk's scales, to
  # device r of the slow axis.
  u = _error_compensated(x, worker_error, layout.valid(part.block_valid), block)
  packed, squares = _compressor.signs_and_block_sums(u)  # (one pass over u for both)
  scales = _compressor.segment_rms(squares, part.segment, part.segment_count)
  rows = jnp.concatenate([packed.reshape(n_slow, chunk_bytes),
                          _wire.scales_to_bytes(scales.reshape(n_slow, segments))], 1)
  if slow is not None:
    rows = jax.lax.all_to_all(rows, slow, split_axis=0, concat_axis=0, tiled=True)

  r = _axis_index(slow)
  served = serve(rows, server_error, layout, exact_chunk=0, chunk_index=r + _axis_index(fast) * n_slow,
                 n_slow=n_slow)
  gathered = _gather(served.message, slow, fast)
  mean = jnp.where(layout.valid(), _decode_stream(gathered, layout), 0.0)
  finite = _all_true(gathered_finite(gathered, layout), agree_axis)
  new_server_error = served.residual
  if keep_server_error_if_nonfinite:
    # A select, fused into the residual's pass (a cond stored the residual first).
    new_server_error = jnp.where(finite, new_server_error, server_error)
  return Averaged(mean.reshape(-1), gathered, scales[part.segment], new_server_error, finite)
