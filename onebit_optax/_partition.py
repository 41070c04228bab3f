"""Companions for the leaves 1-bit Adam does not own: frozen ones, and ones with their own optimizer."""

from __future__ import annotations

from typing import Hashable, Optional

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from onebit_optax import _collective
from onebit_optax._compressed_updates import CompressedMeanState, CompressedTraceState
from onebit_optax._onebit_adam import ScaleByOnebitAdamState

__all__ = ["mean_updates", "set_to_zero"]

_GUIDE = "docs/guides/frozen_layers.md"


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
  :math:`-0` (``+0`` would turn a ``-0.0`` parameter into ``+0.0``); only
  subnormal values become zeros of their sign, as XLA:CPU flushes them in any
  addition. The
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
  ``2 (n-1)/n \cdot 4`` bytes per element per device on a ring. The result is
  typed replicated, so the parameters it updates can be returned with
  ``out_specs=P()``.

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


# States that say "this optimizer is fed each device's local gradient" ...
_AVERAGING_STATES = (ScaleByOnebitAdamState, CompressedMeanState, CompressedTraceState)
# ... and states of the wrappers that hand some leaves to another transformation (or none).
_SPLITTING_STATES = tuple(getattr(optax, name) for name in
                          ("MaskedState", "PartitionState", "MultiTransformState")
                          if hasattr(optax, name))


def _has_state(state, types) -> bool:
  return any(isinstance(s, types) for s in jax.tree.leaves(
      state, is_leaf=lambda s: isinstance(s, types)))


def per_device_update_paths(tx, params, state, mesh, axis_name, state_specs) -> list:
  """Paths of the leaves whose update ``tx`` leaves typed per-device, fed local gradients.

  One abstract trace of ``tx.update`` under ``shard_map`` (no compilation, no
  communication), only for a state that holds an averaging 1-bit state *and*
  an ``optax.masked`` / ``optax.partition`` state: the forms where some leaves
  can escape the averaging. An empty list when the check does not apply or
  the trace fails (the training step then reports its own error).
  """
  if not (_has_state(state, _AVERAGING_STATES) and _has_state(state, _SPLITTING_STATES)):
    return []
  found = []

  def probe(params, state):
    grads = jax.tree.map(lambda p: _collective.vary(jnp.zeros_like(p), axis_name), params)
    updates, _ = tx.update(grads, state, params)
    found.extend(jax.tree_util.keystr(path) for path, u in
                 jax.tree_util.tree_leaves_with_path(updates)
                 if set(_collective.axis_names(axis_name)) & _collective._varying_axes(u))
    return jnp.zeros(())

  try:
    jax.eval_shape(jax.shard_map(probe, mesh=mesh, in_specs=(P(), state_specs),
                                 out_specs=P()), params, state)
  except Exception:  # pylint: disable=broad-except  # advisory: the step raises its own error
    return []
  return found


def check_updates_replicated(tx, params, state, mesh, axis_name, state_specs,
                             caller: str = "init_sharded") -> None:
  """Refuses a ``tx`` that would leave some parameters different on every device.

  Under ``shard_map`` the step would fail later at ``out_specs=P()`` ("could
  not infer replication", without naming the leaf); under ``check_vma=False``
  it would silently return device 0's copy. See :func:`per_device_update_paths`.
  """
  paths = per_device_update_paths(tx, params, state, mesh, axis_name, state_specs)
  if not paths:
    return
  shown = ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
  raise ValueError(
      f"{caller}: the updates of {shown} come out of the optimizer per-device (typed "
      f"varying over {axis_name!r}): 1-bit Adam averages only its own leaves, and these "
      "get each device's local gradient, so the parameters would differ across devices "
      "(the shard_map step refuses to return them with out_specs=P()). Every leaf 1-bit "
      "Adam does not own needs replicated updates: a frozen leaf "
      "onebit_optax.set_to_zero() (optax.set_to_zero keeps the gradient's per-device "
      f"type), a leaf trained by another optimizer optax.chain(onebit_optax.mean_updates("
      f"{axis_name!r}), ...). optax.masked(onebit_adam(...), mask) alone passes the other "
      f"leaves' local gradients through unchanged: give them their own optax.masked. "
      f"Recipes: {_GUIDE}.")
