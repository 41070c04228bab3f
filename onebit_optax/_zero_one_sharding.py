"""0/1 Adam's helpers: the phase of a state, each device's parameters, state placement."""

from __future__ import annotations

from typing import Hashable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from onebit_optax import _collective
from onebit_optax import _zero_one_steps as _steps
from onebit_optax._zero_one_adam import ScaleByZeroOneAdamState

__all__ = ["zero_one_phase", "zero_one_local_params", "zero_one_partition_specs",
           "init_zero_one_sharded", "zero_one_move_state"]

_PER_DEVICE = ("local_sent", "worker_scale", "server_error", "local_mu", "accumulator")


def _is_state(x) -> bool:
  return isinstance(x, ScaleByZeroOneAdamState)


def _find(opt_state) -> ScaleByZeroOneAdamState:
  found = [s for s in jax.tree.leaves(opt_state, is_leaf=_is_state) if _is_state(s)]
  if len(found) != 1:
    raise ValueError(
        f"Expected exactly one 0/1 Adam state inside the optimizer state, found {len(found)}: "
        "pass the state of zero_one_adam / scale_by_zero_one_adam (possibly in optax.chain).")
  return found[0]


def zero_one_phase(opt_state) -> str:
  """What the last step was: 'variance', 'compressed', 'local', 'sync', or 'none' before the first.

  Args:
    opt_state: any optax state holding one :class:`ScaleByZeroOneAdamState`
      (a ``pmap`` state: the replicas agree, the first one is read).

  Returns:
    The phase's name (a Python string; reads the state's ``phase`` field).

  Example:
    >>> import jax, jax.numpy as jnp, onebit_optax
    >>> tx = onebit_optax.zero_one_adam(1e-3, axis_name=None, var_freeze_step=10)
    >>> state = tx.init({'w': jnp.ones(2)})
    >>> onebit_optax.zero_one_phase(state)
    'none'
    >>> _, state = jax.jit(tx.update)({'w': jnp.ones(2)}, state, {'w': jnp.ones(2)})
    >>> onebit_optax.zero_one_phase(state)
    'variance'
  """
  code = int(np.asarray(_find(opt_state).phase).reshape(-1)[0])
  return "none" if code == _steps.NO_STEP else _steps.PHASES[code]


def zero_one_local_params(params, opt_state, axis_name: Hashable):
  r"""This device's copy of the parameters, :math:`\theta + a_i`, typed per device: differentiate here.

  With local steps the parameters ``params`` are the replicated point of the
  last sync and the state's ``accumulator`` holds this device's progress since
  then; without local steps (or before the first local step) the accumulator
  is absent or zero and this is ``params`` itself. Either way the result is
  typed as varying over ``axis_name``, so that ``jax.grad`` gives each device's
  *local* gradient (no float32 all-reduce in the backward pass; see
  :func:`local_params`). Call it inside ``shard_map``/``pmap``.

  Args:
    params: the replicated parameters.
    opt_state: the optimizer state (holding one 0/1 Adam state).
    axis_name: the data-parallel axis.

  Returns:
    A tree like ``params``.

  Example:
    >>> import jax.numpy as jnp, onebit_optax
    >>> tx = onebit_optax.zero_one_adam(1e-3, axis_name=None, var_freeze_step=10, local_steps=4)
    >>> params = {'w': jnp.ones(2)}
    >>> onebit_optax.zero_one_local_params(params, tx.init(params), None)  # no progress yet
    {'w': Array([1., 1.], dtype=float32)}
  """
  accumulator = _find(opt_state).accumulator
  if accumulator is not None:
    params = jax.tree.map(lambda p, a: (p + a[0].astype(p.dtype)), params, accumulator)
  return jax.tree.map(lambda x: _collective.vary(x, axis_name), params)


def zero_one_partition_specs(opt_state, axis_name: Hashable):
  """PartitionSpecs of a state holding a 0/1 Adam state: per-device buffers ``P(axis_name)``, the rest ``P()``.

  The per-device buffers (``local_sent``, ``worker_scale``, ``server_error``,
  ``local_mu``, ``accumulator``) have one row per device on their leading
  axis; every other leaf, and every other transformation's state, is
  replicated. Use the result as the state's ``in_specs``/``out_specs``.

  Args:
    opt_state: the optimizer state (or its ``jax.eval_shape``).
    axis_name: the data-parallel mesh axis.

  Returns:
    A pytree of ``PartitionSpec`` with the structure of ``opt_state``.

  Example:
    >>> import jax.numpy as jnp, onebit_optax
    >>> tx = onebit_optax.zero_one_adam(1e-3, axis_name=None, var_freeze_step=10)
    >>> specs = onebit_optax.zero_one_partition_specs(tx.init({'w': jnp.ones(300)}), 'data')
    >>> specs[0].local_sent, specs[0].mu, specs[0].count
    ((P('data',),), {'w': P()}, P())
  """
  per_device = P(axis_name)

  def spec(node):
    if not _is_state(node):
      return P()
    specs = jax.tree.map(lambda _: P(), node)
    return specs._replace(**{name: jax.tree.map(lambda _: per_device, getattr(node, name))
                             for name in _PER_DEVICE})
  return jax.tree.map(spec, opt_state, is_leaf=_is_state)


def init_zero_one_sharded(tx, params, mesh: Mesh, axis_name: Hashable = "data"):
  """Runs ``tx.init(params)`` under ``shard_map`` on ``mesh``: a state placed per :func:`zero_one_partition_specs`.

  Args:
    tx: the optimizer (holding one 0/1 Adam transformation).
    params: the parameters (replicated values).
    mesh: the device mesh.
    axis_name: its data-parallel axis, the one the optimizer was built with.

  Returns:
    The optimizer state on ``mesh``: per-device buffers one row per device.

  Example:
    >>> import jax, jax.numpy as jnp, onebit_optax
    >>> tx = onebit_optax.zero_one_adam(1e-3, axis_name='data', var_freeze_step=10)
    >>> mesh = jax.make_mesh((1,), ('data',))
    >>> state = onebit_optax.init_zero_one_sharded(tx, {'w': jnp.ones(300)}, mesh)
    >>> state[0].local_sent[0].shape  # (devices, *leaf shape)
    (1, 300)
  """
  abstract = jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=(P(),), out_specs=P(),
                                          check_vma=False), params)
  specs = zero_one_partition_specs(abstract, axis_name)
  params = jax.device_put(params, NamedSharding(mesh, P()))
  return jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(P(),), out_specs=specs))(params)


# What a move to another mesh keeps: everything but the per-device error feedback.
_CARRIED = ("count", "mu", "nu", "nu_l1", "variance_updates", "var_interval", "var_counter",
            "variance_step", "lr_sum", "local_interval", "local_counter", "since_sync", "phase",
            "wire_bytes", "skipped_steps")


def _moved(old: ScaleByZeroOneAdamState, new: ScaleByZeroOneAdamState, mesh: Mesh, axis_name):
  if old.accumulator is not None and int(np.asarray(old.since_sync).reshape(-1)[0]) != 0:
    raise ValueError(
        "zero_one_move_state: the state is between two syncs (since_sync = "
        f"{int(np.asarray(old.since_sync).reshape(-1)[0])}): each device holds its own "
        "progress, which another device count cannot take over. Save (or move) it right "
        "after a sync, when zero_one_phase(state) == 'sync'.")
  replicated = lambda x: jax.device_put(np.asarray(x), NamedSharding(mesh, P()))
  fields = {name: jax.tree.map(replicated, getattr(old, name)) for name in _CARRIED}
  if old.local_mu is not None:  # right after a sync every device's momentum is the synced one
    rows = jax.tree.map(lambda m, row: jax.device_put(
        np.broadcast_to(np.asarray(m), row.shape), NamedSharding(mesh, P(axis_name))),
        old.mu, new.local_mu)
    fields["local_mu"] = rows
  return new._replace(**fields)


def zero_one_move_state(tx, params, opt_state, mesh: Mesh, axis_name: Hashable = "data"):
  """A 0/1 Adam state moved onto ``mesh`` (e.g. another device count): moments and schedule kept.

  The moments, the variance schedule (count, interval, counters), the
  local-step schedule and the phase are carried over; the per-device error
  feedback (``local_sent``, ``worker_scale``, ``server_error``) is laid out
  for one chunk per device and restarts from zero, as it does after the freeze.
  With local steps the state must come from right after a sync (each device's
  progress between syncs has no owner on another device count). Other states
  of the chain (counters of ``optax.scale_by_learning_rate``,
  ``inject_hyperparams``) are taken as replicated.

  Args:
    tx: the optimizer that made ``opt_state``.
    params: the parameters (for the shapes of the new state).
    opt_state: the state to move (host or device arrays, e.g. restored by orbax
      onto the old layout).
    mesh: the new mesh.
    axis_name: its data-parallel axis.

  Returns:
    The state on ``mesh``, sharded as :func:`zero_one_partition_specs` says.

  Example:
    >>> import jax, jax.numpy as jnp, onebit_optax
    >>> tx = onebit_optax.zero_one_adam(1e-3, axis_name='data', var_freeze_step=10)
    >>> mesh = jax.make_mesh((1,), ('data',))
    >>> state = onebit_optax.init_zero_one_sharded(tx, {'w': jnp.ones(300)}, mesh)
    >>> moved = onebit_optax.zero_one_move_state(tx, {'w': jnp.ones(300)}, state, mesh)
    >>> moved[0].local_sent[0].shape, int(moved[0].count)
    ((1, 300), 0)
  """
  new_state = init_zero_one_sharded(tx, params, mesh, axis_name)
  old_state = _find(opt_state)
  moved = _moved(old_state, _find(new_state), mesh, axis_name)
  replicated = lambda x: jax.device_put(np.asarray(x), NamedSharding(mesh, P()))
  return jax.tree.map(lambda node: moved if _is_state(node) else replicated(node), opt_state,
                      is_leaf=_is_state)
