"""0/1 Adam's side of the shared helpers: its phase, each device's parameters, its placement, a move."""

from __future__ import annotations

from typing import Hashable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, make_single_device_sharding

from onebit_optax import _accessors
from onebit_optax import _zero_one_steps as _steps
from onebit_optax._zero_one_adam import ScaleByZeroOneAdamState

__all__ = ["phase_name", "at_local_point", "partition_specs", "moved", "PER_DEVICE"]

# The fields with one row per device (leading axis sharded over the data axis).
PER_DEVICE = ("local_sent", "worker_scale", "server_error", "local_mu", "accumulator")


def _is_state(x) -> bool:
  return isinstance(x, ScaleByZeroOneAdamState)


def find(opt_state) -> list:
  """The 0/1 Adam states inside ``opt_state``."""
  return [s for s in jax.tree.leaves(opt_state, is_leaf=_is_state) if _is_state(s)]


def phase_name(code) -> str:
  """The name of a ``phase`` code: 'variance', 'compressed', 'local', 'sync', or 'none'."""
  code = int(np.asarray(code).reshape(-1)[0])
  return "none" if code == _steps.NO_STEP else _steps.PHASES[code]


def at_local_point(params, opt_state):
  r"""``params`` plus this device's progress since the sync, :math:`\theta + a_i`, when the state has local steps.

  ``opt_state`` may hold no 0/1 Adam state (then ``params`` come back as they
  are); it may be a Flax NNX optimizer's state (variables are read).
  """
  found = find(opt_state)
  if len(found) > 1:
    raise ValueError(
        f"local_params: the optimizer state holds {len(found)} 0/1 Adam states; pass the "
        "state of the one whose parameters these are.")
  accumulator = found[0].accumulator if found else None
  if accumulator is None:
    return params
  # Leaf by leaf in flattening order: the parameters may come in another container
  # than the state was made from (a Flax nnx.State against the dict of tx.init).
  leaves, treedef = jax.tree.flatten(params)
  progress = [_plain(a) for a in jax.tree.leaves(accumulator, is_leaf=_is_variable)]
  if [np.shape(p) for p in leaves] != [np.shape(a)[1:] for a in progress]:
    raise ValueError(
        "local_params: the parameters do not have the shapes of the 0/1 Adam state's "
        f"accumulator ({[np.shape(p) for p in leaves][:4]}... vs "
        f"{[np.shape(a)[1:] for a in progress][:4]}...): pass the parameters this optimizer "
        "state was made for, and the state itself (nnx.as_pure(optimizer.opt_state) with "
        "Flax NNX).")
  return treedef.unflatten([p + a[0].astype(p.dtype) for p, a in zip(leaves, progress)])


def _is_variable(x) -> bool:
  return hasattr(x, "get_value") and not isinstance(x, (jax.Array, np.ndarray))


def _plain(x):
  """The array inside a Flax NNX variable, else ``x``."""
  if hasattr(x, "get_value"):
    return x.get_value()
  return x


def partition_specs(node: ScaleByZeroOneAdamState, axis_name: Hashable):
  """The specs of one 0/1 Adam state: its per-device buffers ``P(axis_name)``, the rest ``P()``."""
  specs = jax.tree.map(lambda _: P(), node)
  return specs._replace(**{name: jax.tree.map(lambda _: P(axis_name), getattr(node, name))
                           for name in PER_DEVICE})


# What a move to another mesh keeps: everything but the per-device error feedback.
_CARRIED = ("count", "nu", "nu_l1", "variance_updates", "var_interval", "var_counter",
            "variance_step", "lr_sum", "local_interval", "local_counter", "since_sync", "phase",
            "wire_bytes", "onebit_steps", "skipped_steps")


def moved(old: ScaleByZeroOneAdamState, new: ScaleByZeroOneAdamState, mesh: Mesh,
          axis_name, where: str) -> ScaleByZeroOneAdamState:
  """``old`` (host values) placed into ``new``'s layout on ``mesh``: moments and schedule kept.

  The per-device error feedback (``local_sent``, ``worker_scale``,
  ``server_error``) is laid out for the new chunks and restarts from zero, as it
  does after the freeze. A first moment held in the momentum message (whose
  rows are the old chunks) is decoded into ``mu``, exactly. Right after a sync
  every device's momentum is the synced one, so ``local_mu`` is ``mu`` on every
  new device; between two syncs each device's progress has no owner on another
  device count: refused.
  """
  since = int(np.asarray(old.since_sync).reshape(-1)[0])
  if old.accumulator is not None and since != 0:
    raise ValueError(
        f"restore_checkpoint: {where} holds a 0/1 Adam state between two syncs "
        f"({since} local steps since the last): each device holds its own progress, which "
        "another device count cannot take over. Restore it onto the mesh it was saved on, "
        "or save right after a sync (status(opt_state).phase == 'sync').")
  place = lambda spec: (make_single_device_sharding(jax.local_devices()[0]) if mesh is None
                        else NamedSharding(mesh, spec))
  replicated = lambda x: jax.device_put(np.asarray(x), place(P()))
  fields = {name: jax.tree.map(replicated, getattr(old, name)) for name in _CARRIED}
  mu, _ = _accessors.moments(old, old.mu)  # (m decoded from the message where it lives there)
  fields.update(mu=jax.tree.map(replicated, mu), mu_in_message=replicated(False))
  if old.local_mu is not None:
    fields["local_mu"] = jax.tree.map(lambda m, row: jax.device_put(
        np.broadcast_to(np.asarray(m), row.shape), place(P(axis_name))), mu, new.local_mu)
  return new._replace(**fields)
