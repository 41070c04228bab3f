"""Leaves grouped by shape: the step's full-size math runs once per group, not once per leaf.

The compiled program of a step written leaf by leaf grows with the number of
leaves (about 20 fused kernels per leaf, where ``optax.adam`` has 3: minutes
of compilation for a transformer of a few hundred leaves). Written per group,
the communication, compression and reductions grow with the number of
distinct shapes instead; only Adam's own per-leaf moments and update remain
per leaf, as in ``optax.adam``.

A group is up to 8 compressed leaves of one shape (:attr:`WireLayout.groups`;
a leaf of ``_layout.STACK_BELOW`` elements or more is a group of its own),
stacked ``(leaves, *shape)`` in float32; the exact leaves (fewer than
``exact_below`` elements) travel together as one flat float32 vector. The
gradients are stacked into their groups where the compression consumes them
(a concatenate that XLA fuses into that pass, :func:`write_sent`); the
per-device state that the compression keeps (``local_momentum``,
``local_sent``) is stored stacked. Per-leaf sums of small leaves are one
variadic reduction per shape (:func:`sums`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from onebit_optax import _collective
from onebit_optax import _layout
from onebit_optax import _wire

F32 = jnp.float32


class Plan(NamedTuple):
  """What one update of either optimizer knows statically: the mesh, the wire layout, the tree."""

  axes: _collective.Axes
  layout: _layout.WireLayout
  treedef: Any
  decay: tuple = ()  # per leaf: gets weight decay (empty: every leaf); 0/1 Adam's own decay.

  def decays(self, i: int) -> bool:
    return not self.decay or self.decay[i]

  def kind(self, i: int):
    """('c', k): leaf ``i`` is compressed leaf ``k``; ('e', j): exact leaf ``j``; ('z',): empty."""
    return self.layout.roles[i]


def plan(tree, axes: _collective.Axes, exact_below: int) -> Plan:
  """The plan of an update of ``tree`` on ``axes`` (hierarchical: every leaf is compressed)."""
  # (exact leaves travel only over a flat axis)
  below = 0 if axes.hierarchical else exact_below
  return Plan(axes, _layout.wire_layout_for(tree, axes.num_devices, below), jax.tree.structure(tree))


def stacks(layout: _layout.WireLayout, sent: list) -> list:
  """The compressed leaves ``sent`` (in :attr:`WireLayout.compressed` order) stacked per group.

  Each group ``(leaves, *shape)``, float32. Stacked where it is read, the
  concatenate fuses into the pass that reads it (at most ``GROUP_LEAVES``
  operands).
  """
  return [jnp.stack([sent[k].astype(F32) for k in span]) for span in layout.groups]


def scalars(pred, values) -> tuple:
  """The int32 ``values`` (static) as scalars the step computes: themselves where ``pred``, 0 where not.

  How a leaf's offsets (where its signs start in the message, where its
  scalars sit in a per-leaf vector) reach the leaf's fused kernel: as
  operands, outputs of one conditional. XLA:CPU compiles one kernel per
  distinct fused computation; a kernel that read its leaf's piece of a
  shared buffer at a constant offset would be distinct for every leaf, and
  the program would grow with the leaves. At computed offsets the leaves of
  one shape share their kernels. ``pred`` says when the offsets are used (a
  message is read, the variance is floored); 0 stands in otherwise. (Only for
  the per-leaf passes: a full-size pass over a whole group reads at constant
  offsets, measured faster, one kernel a group.)
  """
  values = [int(v) for v in values]
  return jax.lax.cond(pred, lambda: tuple(jnp.int32(v) for v in values),
                      lambda: (jnp.int32(0),) * len(values))  # (one constant, not one a leaf)


def at_index(vector: jax.Array, index) -> jax.Array:
  """``vector[index]`` at a computed index (:func:`scalars`)."""
  return jax.lax.dynamic_index_in_dim(vector, index, keepdims=False, allow_negative_indices=False)


class Offsets(NamedTuple):
  """Where a step reads each leaf's pieces: int32 scalars the step computes (:func:`scalars`)."""

  blocks: tuple  # per compressed leaf: the block of the message where its signs start.
  leaves: tuple  # per leaf: its position in the tree (in per-leaf vectors: the floors).
  compressed: tuple  # per compressed leaf: its position in the stream (in per-compressed-leaf vectors: the scales).


def offsets(layout: _layout.WireLayout, reading, floored) -> Offsets:
  """The :class:`Offsets` of ``layout``: the message's (and the scales') where ``reading``, the leaves' where ``floored``."""
  return Offsets(scalars(reading, _wire.first_blocks(layout)),
                 scalars(floored, range(len(layout.shapes))),
                 scalars(reading, range(len(layout.compressed))))


def _alone(span: range, at: Offsets | None) -> bool:
  """Whether a group's full-size pass reads at computed offsets: a group of one leaf, given ``at``.

  A large leaf is a group of its own (:data:`_layout.STACK_BELOW`); read at
  computed offsets, the leaves of one shape share their kernels, as the
  per-leaf passes do (measured as fast as at constant offsets on one leaf:
  8 x 1M, 3.0-3.3 ms against 3.1 ms). A stacked group reads at its constant
  offset, one kernel a group (groups of small leaves are few).
  """
  return at is not None and len(span) == 1


# A stacked group of this many elements or more is written in two passes (see :func:`write_sent`).
TWO_PASSES_FROM = 1 << 15


def write_sent(pred, b1, layout: _layout.WireLayout, message: jax.Array, grads: list,
               local: tuple, scales: jax.Array, valid, at: Offsets | None = None) -> tuple:
  r"""Where ``pred``: what each device sends of every group, :math:`u = \beta_1 m + (1-\beta_1) g + e`, written over ``local``.

  The compressed step of either optimizer: :math:`m` decoded from ``message``,
  the gradients (``grads``, tree order) stacked into their groups here, where
  they are read, :math:`e` the error feedback of what was sent last
  (:func:`feedback` of ``local``, per group ``(1, leaves, *shape)``, and the
  per-leaf ``scales``; ``valid`` False: none). Where not ``pred``, ``local``
  passes through (the form XLA writes in place). A stacked group is read at
  its constant offsets, a group of one leaf at ``at`` (:func:`_alone`).

  A stacked group takes two passes, each in a conditional of its own:
  :math:`\beta_1 m + e` over the buffer, then :math:`(1-\beta_1) g`, the
  gradients concatenated, added. As one fused pass, XLA:CPU's loop over the
  concatenated gradients that also unpacks the signs ran 2-3x slower per
  element than either alone (lab, 40 groups of 8 leaves of 30k elements, one
  thread: 1.85 ns an element, against 1.1 for the two passes together; the
  1-bit compression step on 300 such leaves, 10M: 1.94x -> 1.65x Adam's). A
  group of one leaf has no concatenate and takes one pass (the two: 0.82 ->
  1.04 ns an element), and so does a group of fewer than :data:`TWO_PASSES_FROM`
  elements: the second pass's kernel is about 1,900 lines of LLVM IR a group
  (the one pass's about 940), and ``compile_time``'s 300 leaves of ~1000
  elements (groups of 8k) compiled with 35% more IR, for microseconds a step.
  """
  stacked_groups = [g for g, span in enumerate(layout.groups) if not _alone(span, at)
                    and len(span) * math.prod(layout.group_shape(g)) >= TWO_PASSES_FROM]

  def decoded(signs, g: int):  # (1, leaves, *shape) float32
    span = layout.groups[g]
    if _alone(span, at):
      k = span.start
      return _wire.message_leaf(layout, signs, k, layout.group_shape(g), at.blocks[k])[None, None]
    return _wire.message_group(layout, signs, g)[None]

  def errors(u, g: int):
    return feedback(u, group_scale(scales, layout.groups[g], layout.group_shape(g), at)[None], valid)

  def momenta_and_errors(local):  # stacked groups: b1 m + e (no gradients)
    signs, out = _wire.stream(layout, message), list(local)
    for g in stacked_groups:
      out[g] = (b1 * decoded(signs, g) + errors(local[g], g)).astype(local[g].dtype)
    return tuple(out)

  def sent(local, grads):
    signs, out = _wire.stream(layout, message), []
    gradients = stacks(layout, [grads[i] for i in layout.compressed])
    for g, (span, u, grad) in enumerate(zip(layout.groups, local, gradients)):
      if g in stacked_groups:  # (b1 m + e already in u)
        out.append((u.astype(F32) + (1.0 - b1) * grad[None]).astype(u.dtype))
      else:
        out.append((b1 * decoded(signs, g) + (1.0 - b1) * grad[None] + errors(u, g)).astype(u.dtype))
    return tuple(out)

  if stacked_groups:
    local = jax.lax.cond(pred, momenta_and_errors, lambda local: local, local)
  return jax.lax.cond(pred, sent, lambda local, grads: local, local, grads)


def exact_momenta(b1, layout: _layout.WireLayout, message: jax.Array, grads: list) -> jax.Array:
  r"""The exact leaves' momenta :math:`\beta_1 m + (1-\beta_1) g`, concatenated, :math:`m` read off ``message``."""
  return b1 * _wire.message_exact(layout, message) + (1.0 - b1) * exact(layout, grads)


def group_scale(scales: jax.Array, span: range, shape, at: Offsets | None = None) -> jax.Array:
  """The scales of a group's leaves (``span`` of the per-leaf ``scales``), ``(leaves, 1, ...)``: broadcastable against the group.

  Read in a full-size pass: at the group's constant offset, or at ``at``'s
  for a group of one leaf (see :func:`momenta`).
  """
  if _alone(span, at):
    return at_index(scales, at.compressed[span.start]).reshape((1,) * (1 + len(shape)))
  return scales[span.start:span.stop].reshape((len(span),) + (1,) * len(shape))


def feedback(sent: jax.Array, scale, valid=True) -> jax.Array:
  r"""The error feedback :math:`e = u' - s'\,\mathrm{sign}(u')` of what was sent last (``u'``, ``s'``), float32.

  Formed from the stored :math:`u'` and its scale, the same float operations
  as a stored residual would have taken: no residual buffer, no residual
  pass. ``valid`` False (a skipped step: :math:`u'` was not sent) gives 0.
  """
  sent = sent.astype(F32)
  return jnp.where(valid, sent - jnp.where(sent >= 0, scale, -scale), 0.0)


def rows(layout: _layout.WireLayout, sent: list, exact: jax.Array) -> tuple:
  """Phase 1's rows of the groups ``sent`` (``(leaves, *shape)`` each) and the exact leaves' floats.

  Each compressed leaf is sent as its packed signs and its RMS scale. Returns
  ``(rows, scales)``: ``(num_devices, row_bytes)`` uint8 and the
  ``(compressed leaves,)`` float32 scales, group after group.
  """
  compressed = [_wire.group_compress(u) for u in sent]
  scales = (jnp.concatenate([scale for _, scale in compressed]) if sent
            else jnp.zeros((0,), F32))
  return _wire.rows(layout, [signs for signs, _ in compressed], scales, exact), scales


def exact(layout: _layout.WireLayout, leaves) -> jax.Array:
  """The exact leaves of ``leaves`` (indexed by tree position), raveled and concatenated: ``(exact_size,)`` float32."""
  flat = [jnp.ravel(leaves[i]).astype(F32) for i in layout.exact]
  return jnp.concatenate(flat) if flat else jnp.zeros((0,), F32)


def mean_leaves(layout: _layout.WireLayout, gathered: jax.Array,
                at: Offsets | None = None) -> list:
  """Every leaf (tree order) of the mean the gathered 1-bit messages hold, float32.

  Each compressed leaf decoded from its blocks (at ``at.blocks``; None:
  constant offsets), which XLA fuses into the pass that reads it; the
  exact leaves are read off their floats; an empty leaf is zeros.
  """
  floats = _wire.message_exact(layout, gathered)
  signs = _wire.stream(layout, gathered)
  out = []
  for i, (role, shape) in enumerate(zip(layout.roles, layout.shapes)):
    if role[0] == "c":
      k = role[1]
      out.append(_wire.message_leaf(layout, signs, k, shape, None if at is None else at.blocks[k]))
    elif role[0] == "e":
      offset = layout.exact_offsets[role[1]]
      out.append(floats[offset:offset + layout.sizes[i]].reshape(shape))
    else:
      out.append(jnp.zeros(shape, F32))
  return out


# Leaves of this many elements or more are summed one by one (see :func:`sums`).
REDUCE_ALONE = 1 << 12


def sums(leaves: list) -> jax.Array:
  """(leaves,) float32: the sum of each leaf; small leaves with one variadic reduction per shape.

  A reduction per leaf is a fused kernel or two per leaf in the compiled
  program; one reduction of all the small leaves of a shape is one
  instruction, and like a reduction of each stored leaf it stores no copy (a
  reduction of their concatenation stored the concatenation). XLA:CPU runs a
  variadic reduction element by element, 2-3x slower than a reduction of one
  leaf (measured, 300 leaves of 16k-50k elements: 11.8 vs 4.8 ms), so a leaf
  of :data:`REDUCE_ALONE` elements or more is reduced by itself (its kernel
  shared with the leaves of its shape). Leaves typed differently under
  ``shard_map`` (varying over other mesh axes) are reduced apart.
  """
  by_kind = {}
  leaves = [x.astype(F32) for x in leaves]  # (summed in float32; a no-op for float32 leaves)
  for i, x in enumerate(leaves):
    alone = i if math.prod(jnp.shape(x)) >= REDUCE_ALONE else None
    key = (jnp.shape(x), jnp.result_type(x), _collective._varying_axes(x), alone)
    by_kind.setdefault(key, []).append(i)
  out = [None] * len(leaves)
  for (shape, dtype, _, _), indices in by_kind.items():
    xs = tuple(leaves[i] for i in indices)
    totals = jax.lax.reduce(xs, (jnp.zeros((), dtype),) * len(xs),
                            lambda a, b: tuple(x + y for x, y in zip(a, b)),
                            tuple(range(len(shape))))
    for i, total in zip(indices, totals):
      out[i] = total.astype(F32)
  return jnp.stack(out) if out else jnp.zeros((0,), F32)
