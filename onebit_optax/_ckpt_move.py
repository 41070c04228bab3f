"""Moving 1-bit Adam's error feedback to another mesh: what the next compressed mean depends on."""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from onebit_optax import _groups
from onebit_optax import _layout

__all__ = ["Mesh", "carry"]

F32 = jnp.float32


class Mesh(NamedTuple):
  """One side of a move: the wire layout and how the per-device rows are numbered."""

  wire: _layout.WireLayout  # its num_devices = slow * fast.
  slow: int  # devices of the 1-bit axis (the servers of a node's slice).
  fast: int  # devices per node (hierarchical), 1 for a flat mesh.

  @property
  def hierarchical(self) -> bool:
    return self.fast > 1


def _stream_from_rows(rows, side: Mesh):
  """A per-device server buffer ``(slow * fast, chunk)`` as the chunks in stream order.

  Row ``s * fast + f`` (device (s, f) of the mesh) serves chunk
  ``f * slow + s`` (the order in which the messages are gathered).
  """
  if side.fast == 1:
    return rows.reshape(-1)
  return jnp.swapaxes(rows.reshape(side.slow, side.fast, -1), 0, 1).reshape(-1)


def _rows_from_stream(stream, side: Mesh):
  """Inverse of :func:`_stream_from_rows`."""
  if side.fast == 1:
    return stream.reshape(side.slow, -1)
  return jnp.swapaxes(stream.reshape(side.fast, side.slow, -1), 0, 1).reshape(
      side.slow * side.fast, -1)


def _leaves(stream, bits: _layout.FlatLayout, shapes: list) -> list:
  return [stream[o:o + s].reshape(shape) for o, s, shape in zip(bits.offsets, bits.sizes, shapes)]


def mean_worker_error(state, side: Mesh, shapes: list) -> list:
  r"""Per compressed leaf of ``side``: :math:`\bar e = \frac1n \sum_i e_i`, the devices' mean worker error.

  Flat: :math:`e_i = u_i - s_i\,\mathrm{sign}(u_i)` from ``local_momentum``
  and ``worker_scale``, as the next step would form it (0 where
  ``feedback_valid`` is False). Hierarchical: device (node, f) holds the
  error of slice f; the mean over the nodes, slice after slice, is the stream.
  """
  valid = jnp.asarray(state.feedback_valid)
  if side.hierarchical:
    rows = state.worker_error.astype(F32).reshape(side.slow, side.fast, -1)
    stream = jnp.where(valid, jnp.mean(rows, axis=0).reshape(-1), 0.0)
    return _leaves(stream, side.wire.bits, shapes)
  out = []
  for span, u in zip(side.wire.groups, state.local_momentum):  # u: (devices, leaves, *shape)
    u = u.astype(F32)
    scale = state.worker_scale[:, span.start:span.stop].reshape(u.shape[:2] + (1,) * (u.ndim - 2))
    error = jnp.where(valid, u - jnp.where(u >= 0, scale, -scale), 0.0)
    out.extend(jnp.mean(error, axis=0))
  return out


def server_error(state, side: Mesh, shapes: list) -> Optional[list]:
  """Per compressed leaf of ``side``: the servers' residual (None without servers)."""
  if state.server_error is None:
    return None
  stream = _stream_from_rows(state.server_error.astype(F32), side)
  return _leaves(stream, side.wire.bits, shapes)


class Carried(NamedTuple):
  """The new per-device buffers (None where the new layout has none)."""

  local_momentum: Optional[tuple]
  worker_scale: jax.Array
  worker_error: Optional[jax.Array]
  server_error: Optional[jax.Array]


def carry(state, old: Mesh, new: Mesh, shapes: list, new_message, b1, dtype) -> Carried:
  r"""The error feedback of ``state`` (laid out for ``old``) handed on to ``new``.

  What the next compressed mean depends on is, per element, the servers'
  residual :math:`r` (it tiles the stream: chunk ``c`` is server ``c``'s) and
  the devices' *mean* worker error :math:`\bar e`: the next step's mean of the
  compressed momenta is :math:`\frac1n\sum_i C(u_i)` with
  :math:`u_i = \beta_1 m + (1-\beta_1) g_i + e_i`. So every new device gets
  :math:`\bar e` (the new mean is the old one), the server residual is cut into
  the new chunks, and where the new layout has no servers (one device) it is
  added to the worker error. The new message is :math:`C'(m)`, the old mean
  :math:`m` compressed again for the new chunks; :math:`\beta_1 (m - C'(m))` is
  added to every device's error too, so that the first step forms
  :math:`\beta_1 m + (1-\beta_1) g_i + \bar e`, as it would have on the old
  mesh (up to rounding). A flat device's error is stored as
  ``local_momentum`` with ``worker_scale`` 0 (its feedback is then
  ``local_momentum`` itself). A leaf compressed before and exact now loses
  its residual (it is averaged exactly from now on).

  Args:
    state: the 1-bit Adam state as saved (global arrays, old layout).
    old: the saved layout; ``new``: the layout restored onto.
    shapes: the leaves' shapes, in tree order.
    new_message: the re-laid-out message :math:`C'(m)`.
    b1: the first moment's decay (None: no message correction).
    dtype: the new error buffers' dtype.
  """
  old_shapes = [shapes[i] for i in old.wire.compressed]
  worker = dict(zip(old.wire.compressed, mean_worker_error(state, old, old_shapes)))
  server = server_error(state, old, old_shapes)
  server = {} if server is None else dict(zip(old.wire.compressed, server))
  zero = lambda i: jnp.zeros(shapes[i], F32)
  total = {i: worker.get(i, zero(i)) for i in new.wire.compressed}
  has_server = new.slow > 1
  if not has_server:  # no server to hand the residual to: the worker sends it
    total = {i: total[i] + server.get(i, zero(i)) for i in total}
  if b1 is not None:
    m_old = _groups.mean_leaves(old.wire, state.momentum_message)
    m_new = _groups.mean_leaves(new.wire, new_message)
    total = {i: total[i] + b1 * (m_old[i] - m_new[i]) for i in total}
  n = new.wire.num_devices
  leaves = [total[i] for i in new.wire.compressed]
  new_server = None
  if has_server:
    stream = new.wire.bits.flatten([server.get(i, zero(i)) for i in new.wire.compressed])
    new_server = _rows_from_stream(stream, new).astype(dtype)
  scale = jnp.zeros((n, len(leaves)), F32)
  if new.hierarchical:
    slices = new.wire.bits.flatten(leaves).reshape(new.fast, -1)
    worker_error = jnp.broadcast_to(slices[None], (new.slow,) + slices.shape)
    return Carried(None, scale, worker_error.reshape(n, -1).astype(dtype), new_server)
  groups = [jnp.stack([leaves[k] for k in span]) for span in new.wire.groups]
  local = tuple(jnp.broadcast_to(e[None], (n,) + e.shape).astype(dtype) for e in groups)
  return Carried(local, scale, None, new_server)
