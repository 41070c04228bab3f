"""Companions for the leaves 1-bit Adam does not own: frozen ones, and ones with their own optimizer."""

from __future__ import annotations

from typing import Hashable, Optional

import jax
import jax.numpy as jnp
import optax

from onebit_optax import _collective

__all__ = ["mean_updates", "set_to_zero"]


def set_to_zero() -> optax.GradientTransformationExtraArgs:
  r"""Zero updates typed *replicated*: freezes leaves inside ``jax.shard_map``.

  :func:`optax.set_to_zero` returns ``zeros_like(updates)``. Under
  ``shard_map`` the updates 1-bit Adam's neighbours receive are the *local*
  gradients, typed per-device (varying over the data axis), and
  ``zeros_like`` keeps that type: the frozen parameters come out typed
  per-device and ``out_specs=P()`` refuses them ("could not infer
  replication"). This transformation creates fresh zeros instead, typed
  replicated, without any communication:

  .. math::

    u_t = -0 \quad \text{for every element, whatever the gradient } g_t,

  and ``optax.apply_updates`` then returns the frozen parameters bitwise
  unchanged: :math:`p + (-0) = p` for every float :math:`p`, including
  :math:`-0` (``+0`` would turn a ``-0.0`` parameter into ``+0.0``). The
  gradients of the frozen leaves are not read, so inside one ``jax.jit`` XLA
  drops what only they needed.

  Use it for the frozen part of ``optax.partition`` (or in an
  ``optax.masked`` over the frozen leaves), beside :func:`onebit_adam` on the
  trained part (guide: ``docs/guides/frozen_layers.md``). It also works under
  ``jax.pmap`` and on one device.

  Args:
    none: like :func:`optax.set_to_zero`.

  Returns:
    A stateless :class:`optax.GradientTransformationExtraArgs`.

  Example:
    >>> import jax.numpy as jnp, onebit_optax, optax
    >>> tx = onebit_optax.set_to_zero()
    >>> params = {'w': jnp.array([1.0, -0.0])}
    >>> updates, _ = tx.update({'w': jnp.array([0.5, 2.0])}, tx.init(params))
    >>> updates['w']
    Array([-0., -0.], dtype=float32)
    >>> optax.apply_updates(params, updates)['w']
    Array([ 1., -0.], dtype=float32)
  """

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    return jax.tree.map(_negative_zeros_like, updates), state

  return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)


def _negative_zeros_like(x) -> jax.Array:
  # jnp.full builds a constant: typed replicated whatever x's per-device type.
  return jnp.full(jnp.shape(x), -0.0, jnp.result_type(x))


def mean_updates(axis_name: Optional[Hashable]) -> optax.GradientTransformationExtraArgs:
  r"""The float32 mean of the updates over the data axis: put it before a plain optax optimizer.

  Inside ``jax.shard_map`` (with :func:`local_params`) and ``jax.pmap`` every
  device holds its *local* gradient; 1-bit Adam averages its own leaves, and
  every other optimizer needs the average first. ``optax.chain(mean_updates(
  'data'), optax.adam(lr))`` is data-parallel Adam on the leaves it is given
  (a head, LayerNorm scales), beside :func:`onebit_adam` in one
  ``optax.partition``:

  .. math::

    \bar g_t = \frac1n \sum_{i=1}^{n} g_{i,t},

  one ``jax.lax.pmean`` per leaf (XLA's all-reduce combiner merges them),
  ``2 (n-1)/n \cdot 4`` bytes per element per device on a ring
  (:func:`allreduce_wire_bytes`). The result is typed replicated, so the
  parameters it updates can be returned with ``out_specs=P()``. It is the
  full-precision counterpart of :func:`compressed_mean_updates`.

  Args:
    axis_name: the data-parallel axis of ``shard_map``/``pmap`` (or a tuple of
      axes, e.g. ``('node', 'local')``, all averaged in full precision); None
      on one device: the updates pass through unchanged.

  Returns:
    A stateless :class:`optax.GradientTransformationExtraArgs`.

  Example:
    >>> import jax, jax.numpy as jnp, onebit_optax
    >>> tx = onebit_optax.mean_updates('data')
    >>> local = {'w': jnp.arange(4.0).reshape(4, 1)}     # one row per device
    >>> update = lambda g: tx.update(g, tx.init(None))[0]
    >>> jax.pmap(update, axis_name='data', devices=jax.devices()[:4])(local)['w']
    Array([[1.5],
           [1.5],
           [1.5],
           [1.5]], dtype=float32)

  References:
    Goyal et al., `Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour
    <https://arxiv.org/abs/1706.02677>`_, 2017 (data-parallel SGD: the mean of
    the workers' gradients).
  """

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    if axis_name is None:
      return updates, state
    _collective.axis_size(axis_name, caller="mean_updates")  # unbound axis: what to do
    return jax.tree.map(lambda u: jax.lax.pmean(u, axis_name), updates), state

  return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)
