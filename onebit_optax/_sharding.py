"""Helpers for the shard_map / pmap recipe: local gradients and state placement."""

from __future__ import annotations

from typing import Hashable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from onebit_optax import _collective
from onebit_optax._compressed_updates import CompressedMeanState
from onebit_optax._onebit_adam import ScaleByOnebitAdamState

__all__ = ["local_params", "state_partition_specs", "init_sharded"]


def local_params(params, axis_name: Hashable):
  """Marks replicated params as per-device so that ``jax.grad`` gives *local* gradients.

  Inside ``jax.shard_map`` (with the default ``check_vma=True``), the gradient
  with respect to a replicated input is itself replicated: JAX inserts a float32
  all-reduce of the gradients into the backward pass, which is exactly the
  traffic 1-bit Adam exists to avoid. Casting the params to "varying" first
  (``jax.lax.pcast(..., to='varying')``, free at run time) keeps each device's
  gradient local; the optimizer then does the (compressed) averaging. Under
  ``pmap`` or ``check_vma=False`` gradients are local anyway and this is a no-op.

  Args:
    params: a pytree of arrays, replicated over ``axis_name``.
    axis_name: the data-parallel mesh axis.

  Returns:
    The same values, typed as varying over ``axis_name``.

  Example:
    >>> import functools, jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> import onebit_optax
    >>> mesh = jax.make_mesh((1,), ('data',))
    >>> @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(), out_specs=P('data'))
    ... def local_grad(w):
    ...   return jax.grad(lambda w: jnp.sum(w ** 2))(onebit_optax.local_params(w, 'data'))
    >>> local_grad(jnp.ones(2))
    Array([2., 2.], dtype=float32)

  References:
    `jax.shard_map <https://docs.jax.dev/en/latest/notebooks/shard_map.html>`_:
    "varying manual axes" (``check_vma``) and ``jax.lax.pcast``.
  """
  def cast(x):
    if axis_name in _collective._varying_axes(x):
      return x
    try:
      return jax.lax.pcast(x, axis_name, to="varying")
    except (NameError, ValueError) as e:  # ValueError: pcast outside shard_map, eagerly
      raise ValueError(
          f"local_params: axis_name={axis_name!r} is not bound; call it inside the "
          "jax.shard_map / jax.pmap that maps the data-parallel axis.") from e
  return jax.tree.map(cast, params)


def state_partition_specs(opt_state, axis_name: Hashable):
  """PartitionSpecs for an optimizer state holding a 1-bit Adam state.

  The error buffers are per device (``P(axis_name)`` on their leading axis); all
  other leaves (counters, moments, flags, other transformations' state) are
  replicated (``P()``). Use the result as ``in_specs``/``out_specs`` of the
  training step and for ``NamedSharding``.

  Args:
    opt_state: the optimizer state (or its ``jax.eval_shape``).
    axis_name: the data-parallel mesh axis.

  Returns:
    A pytree of ``PartitionSpec`` with the structure of ``opt_state``.

  Example:
    >>> import jax.numpy as jnp, onebit_optax
    >>> tx = onebit_optax.onebit_adam(1e-3, axis_name=None)
    >>> specs = onebit_optax.state_partition_specs(tx.init({'w': jnp.ones(3)}), 'data')
    >>> specs[0].worker_error, specs[0].count
    (P('data',), P())

  References:
    `jax.shard_map <https://docs.jax.dev/en/latest/notebooks/shard_map.html>`_.
  """
  def spec(node):
    if isinstance(node, (ScaleByOnebitAdamState, CompressedMeanState)):
      replicated = jax.tree.map(lambda _: P(), node)
      return replicated._replace(worker_error=P(axis_name), server_error=P(axis_name))
    return P()
  return jax.tree.map(
      spec, opt_state,
      is_leaf=lambda x: isinstance(x, (ScaleByOnebitAdamState, CompressedMeanState)))


def state_specs_for(tx, params, mesh: Mesh, axis_name: Hashable, *, caller: str):
  """PartitionSpecs of the state ``tx.init(params)`` makes under ``shard_map`` on ``mesh``."""
  if axis_name not in mesh.axis_names:
    raise ValueError(
        f"{caller}: axis_name={axis_name!r} is not an axis of the mesh "
        f"{dict(mesh.shape)}; pass the data-parallel axis the optimizer was built with.")
  # One abstract trace with replicated outputs gives the state's structure; the
  # specs then say which leaves are per device.
  abstract = jax.eval_shape(
      jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False), params)
  return state_partition_specs(abstract, axis_name)


def init_sharded(tx, params, mesh: Mesh, axis_name: Hashable = "data"):
  """Runs ``tx.init(params)`` under ``shard_map`` and returns a correctly sharded state.

  The 1-bit Adam state needs the size of the data-parallel axis (to pad and
  split its buffers) and one error buffer per device, so its ``init`` runs inside
  the mapped region. This does that: per-device buffers come out sharded over
  ``axis_name`` (global leading axis = number of devices), the rest replicated.

  Args:
    tx: the optimizer (any optax transformation containing 1-bit Adam).
    params: the parameter pytree (replicated values).
    mesh: the device mesh.
    axis_name: the data-parallel axis of ``mesh`` given to the optimizer.

  Returns:
    The optimizer state, placed on ``mesh``.

  Example:
    >>> import jax, jax.numpy as jnp, onebit_optax
    >>> mesh = jax.make_mesh((1,), ('data',))
    >>> tx = onebit_optax.onebit_adam(1e-3, axis_name='data')
    >>> state = onebit_optax.init_sharded(tx, {'w': jnp.ones(3)}, mesh)
    >>> state[0].worker_error.shape  # (devices, padded size: whole blocks of 128)
    (1, 128)

  References:
    `jax.shard_map <https://docs.jax.dev/en/latest/notebooks/shard_map.html>`_.
  """
  specs = state_specs_for(tx, params, mesh, axis_name, caller="init_sharded")
  # Host arrays are cast to their JAX dtype first: on a multi-process mesh,
  # device_put checks that every process passed the same value by comparing the
  # host array with the device copies, which fails for float64 numpy with x64 off.
  params = jax.tree.map(
      lambda x: np.asarray(x, jax.dtypes.canonicalize_dtype(np.asarray(x).dtype))
      if isinstance(x, (np.ndarray, np.generic, float, int)) else x, params)
  params = jax.device_put(params, NamedSharding(mesh, P()))
  return jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
