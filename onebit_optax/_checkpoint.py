"""Orbax checkpoints that resume 1-bit Adam and 0/1 Adam exactly, per-device buffers included."""

from __future__ import annotations

import warnings
from typing import Hashable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, make_single_device_sharding

from onebit_optax._onebit_adam import ScaleByOnebitAdamState
from onebit_optax._zero_one_adam import ScaleByZeroOneAdamState
from onebit_optax import _accessors
from onebit_optax import _ckpt_move
from onebit_optax import _config
from onebit_optax import _groups
from onebit_optax import _layout as _layout_mod
from onebit_optax import _sharding
from onebit_optax import _zero_one_sharding
from onebit_optax import _wire

__all__ = ["save_checkpoint", "restore_checkpoint", "abstract_state"]

# Names of the items of one checkpoint step (folders under directory/<step>/).
_PARAMS = "params"
_OPT_STATE = "opt_state"
_META = "onebit_optax"
# The layout of the 1-bit Adam state the record describes. 4: tree-shaped
# moments, per-device local_momentum stacked per group of leaves of one shape,
# worker_scale and the uint8 momentum_message in the groups' order (core v4).
# 5: 0/1 Adam's state also holds its momentum_message and mu_in_message (m as
# the last compressed step's message); a 1-bit Adam record of format 4 has the
# same layout and is read. 3 (core v3: one local_momentum per leaf, the stream
# in tree order) and 1 (flat padded mu/nu) are refused.
_VERSION = 5
_ZERO_ONE_SIZED = _zero_one_sharding.PER_DEVICE + ("momentum_message",)
_FORMAT = f"onebit_optax.checkpoint/{_VERSION}"
_MAX_DIFFS = 8  # differences listed in a mismatch error
# The fields whose shapes depend on the device count and the mesh layout: the
# per-device buffers and the gathered message (its rows are the n chunks).
_PER_DEVICE = ("local_momentum", "worker_scale", "worker_error", "server_error")
_SIZED = _PER_DEVICE + ("momentum_message",)


def _orbax():
  try:
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(
        "onebit_optax checkpointing needs orbax-checkpoint: pip install "
        "orbax-checkpoint") from e
  return ocp


def _open(directory_or_manager, *, create: bool):
  """Returns ``(manager, owned)``; a path gets a manager of our own (closed by us)."""
  if all(hasattr(directory_or_manager, a) for a in ("save", "restore", "latest_step")):
    return directory_or_manager, False
  ocp = _orbax()
  # Declaring the handlers lets a restore read one item without orbax logging
  # that it cannot restore the others.
  handlers = {
      _PARAMS: ocp.PyTreeCheckpointHandler(),
      _OPT_STATE: ocp.PyTreeCheckpointHandler(),
      _META: ocp.JsonCheckpointHandler(),
  }
  path = directory_or_manager
  if not isinstance(path, str):
    path = str(path)
  options = ocp.CheckpointManagerOptions(create=create)
  return ocp.CheckpointManager(path, options=options, item_handlers=handlers), True


_KINDS = (ScaleByOnebitAdamState, ScaleByZeroOneAdamState)


def _is_state(x) -> bool:
  return isinstance(x, _KINDS)


def _is_zero_one(state) -> bool:
  return isinstance(state, ScaleByZeroOneAdamState)


def _sized(state) -> tuple:
  """The fields whose shapes depend on the device count and the mesh layout."""
  return _ZERO_ONE_SIZED if _is_zero_one(state) else _SIZED


def _find(opt_state) -> tuple[tuple, ScaleByOnebitAdamState]:
  """Key path and value of the single 1-bit Adam (or 0/1 Adam) state inside ``opt_state``."""
  found = [(path, node) for path, node in
           jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=_is_state)[0]
           if _is_state(node)]
  if len(found) != 1:
    raise ValueError(
        f"Expected exactly one 1-bit Adam or 0/1 Adam state inside the optimizer state, "
        f"found {len(found)}. Pass the state of onebit_adam / zero_one_adam (or their "
        "scale_by_ transformations), possibly inside optax.chain, inject_hyperparams, "
        "masked, ...")
  return found[0]


def _with_state(opt_state, fn):
  """``opt_state`` with its 1-bit Adam state replaced by ``fn(state)``."""
  return jax.tree.map(lambda x: fn(x) if _is_state(x) else x, opt_state, is_leaf=_is_state)


def _strip(opt_state):
  """The state without the fields whose shapes depend on the mesh (compared separately)."""
  return _with_state(opt_state, lambda s: s._replace(**{name: None for name in _sized(s)}))


def _signature(tree) -> list:
  """``[key path, shape, dtype]`` of every leaf, in flattening order (JSON-able)."""
  return [[jax.tree_util.keystr(path), [int(d) for d in np.shape(leaf)],
           str(np.dtype(leaf.dtype) if hasattr(leaf, "dtype") else np.asarray(leaf).dtype)]
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _shape_of(x):
  return None if x is None else [int(d) for d in np.shape(x)]


def _device_axes(x, rows: int) -> list:
  """Sizes of the mesh axes that number a per-device buffer's rows (``[rows]`` off a mesh)."""
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, NamedSharding) and len(sharding.spec) and sharding.spec[0] is not None:
    names = sharding.spec[0] if isinstance(sharding.spec[0], tuple) else (sharding.spec[0],)
    return [int(sharding.mesh.shape[a]) for a in names]
  return [int(rows)]


def _model_shards(message) -> int:
  """How many model shards the message's rows are split into (1 without a model axis)."""
  sharding = getattr(message, "sharding", None)
  if not isinstance(sharding, NamedSharding) or not len(sharding.spec) or sharding.spec[0] is None:
    return 1
  names = sharding.spec[0] if isinstance(sharding.spec[0], tuple) else (sharding.spec[0],)
  return int(np.prod([sharding.mesh.shape[a] for a in names]))


def _local_shape(x) -> tuple:
  """The shape of one device's shard of ``x`` (its global shape when not sharded)."""
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, NamedSharding):
    return tuple(int(d) for d in sharding.shard_shape(tuple(np.shape(x))))
  return tuple(int(d) for d in np.shape(x))


def _spec_str(x) -> str:
  """``x``'s PartitionSpec, trailing Nones dropped (``P('model', None)`` is ``P('model')``)."""
  sharding = getattr(x, "sharding", None)
  entries = list(sharding.spec) if isinstance(sharding, NamedSharding) else []
  while entries and entries[-1] is None:
    entries.pop()
  return str(P(*entries))


def _mesh_of(x) -> Optional[dict]:
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, NamedSharding):
    return {str(name): int(size) for name, size in sharding.mesh.shape.items()}
  return None


def _layout(opt_state) -> dict:
  """The mesh-dependent part of a state in the shard_map (or 1-device) layout, checked.

  Global shapes: each per-device buffer has one row per device, the gathered
  ``momentum_message`` one row per chunk and model shard (``n`` chunks of
  each of the ``M`` model shards' messages), and ``worker_scale`` one column
  per compressed leaf, which fixes the wire layout of one model shard's
  local leaves.
  """
  _, state = _find(opt_state)
  if _is_zero_one(state):
    return _zero_one_layout(state)
  message, scale = np.shape(state.momentum_message), np.shape(state.worker_scale)
  local = state.local_momentum
  if np.ndim(state.count) != 0:
    raise ValueError(
        "The 1-bit Adam state does not have the layout of onebit_optax.init_sharded: count "
        f"has shape {np.shape(state.count)}, i.e. every field carries a leading device "
        "axis: a pmap state is not supported. Checkpoint the state of the shard_map "
        "training step (out_specs=onebit_optax.state_partition_specs(...)).")
  shards = _model_shards(state.momentum_message)
  n = message[0] // shards if len(message) == 2 else 0
  rows = [np.shape(x)[0] if np.ndim(x) >= 1 else None
          for x in (state.worker_scale, state.worker_error, state.server_error, *(local or ()))
          if x is not None]
  nu = jax.tree.leaves(state.nu)
  local_nu = [_local_shape(v) for v in nu]
  ok = (len(message) == 2 and n >= 1 and message[0] == n * shards and len(scale) == 2
        and all(r == n * shards for r in rows))
  layout = None
  if ok:
    tree = jax.tree.unflatten(jax.tree.structure(state.nu),
                              [jax.ShapeDtypeStruct(s, jnp.float32) for s in local_nu])
    layout = _accessors._layout_of(tree, jax.ShapeDtypeStruct((n, message[1]), jnp.uint8),
                                   scale[1])
    ok = (layout.row_bytes == message[1] and len(layout.compressed) == scale[1]
          and (local is None or [tuple(np.shape(u)) for u in local]
               == [(n * shards, len(span)) + tuple(layout.group_shape(g))
                   for g, span in enumerate(layout.groups)]))
  if not ok:
    shapes = {name: (None if getattr(state, name) is None
                     else jax.tree.map(np.shape, getattr(state, name)))
              for name in _SIZED}
    raise ValueError(
        "The 1-bit Adam state does not have the layout of onebit_optax.init_sharded "
        "(per-device buffers with one row per device, the message with one row per "
        f"chunk): {shapes}. Checkpoint the state returned by the shard_map training "
        "step (out_specs=onebit_optax.state_partition_specs(...)), or by tx.init with "
        "axis_name=None. A pmap state (a leading device axis on every leaf) is not "
        "supported.")
  error = next((x for x in (*(local or ()), state.worker_error, state.server_error)
                if x is not None), None)
  specs = [_spec_str(v) for v in jax.tree.leaves(state.nu)]
  return {
      "num_devices": int(n),
      "device_axes": _device_axes(state.worker_scale, n * shards),
      "model_shards": int(shards),
      "mesh": _mesh_of(state.worker_scale),
      "param_specs": None if all(spec == "P()" for spec in specs) else specs,
      "compressed": [int(i) for i in layout.compressed],
      "error_dtype": None if error is None else str(np.dtype(error.dtype)),
      "buffers": {
          "local_momentum": None if local is None else [_shape_of(u) for u in local],
          "worker_scale": _shape_of(state.worker_scale),
          "worker_error": _shape_of(state.worker_error),
          "server_error": _shape_of(state.server_error),
          "momentum_message": _shape_of(state.momentum_message),
      },
  }


def _zero_one_layout(state) -> dict:
  """The mesh-dependent part of a 0/1 Adam state: its per-device buffers' global shapes."""
  if np.ndim(state.count) != 0:
    raise ValueError(
        "The 0/1 Adam state does not have the layout of onebit_optax.init_sharded: count "
        f"has shape {np.shape(state.count)} (a pmap state); checkpoint the state of the "
        "shard_map training step (out_specs=onebit_optax.state_partition_specs(...)).")
  n = int(np.shape(state.worker_scale)[0])
  return {
      "optimizer": "zero_one_adam",
      "num_devices": n,
      "device_axes": _device_axes(state.worker_scale, n),
      "model_shards": 1,
      "mesh": _mesh_of(state.worker_scale),
      "param_specs": None,
      "compressed": int(np.shape(state.worker_scale)[1]),
      "error_dtype": None,
      # Per field: the global shape of each of its leaves (None: the field is absent).
      "buffers": {name: None if getattr(state, name) is None
                  else [_shape_of(x) for x in jax.tree.leaves(getattr(state, name))]
                  for name in _ZERO_ONE_SIZED},
  }


def _metadata(step, params, opt_state, tx) -> dict:
  stripped = _strip(opt_state)
  return {
      "format": _FORMAT,
      "onebit_format": _VERSION,
      "step": int(step),
      "layout": _layout(opt_state),
      # The optimizer's hyperparameters (onebit_optax._config.FIELDS), when
      # save_checkpoint got tx=: compared on restore.
      "config": None if tx is None else _config.describe(tx, step),
      "process_count": jax.process_count(),
      "params": _signature(params),
      "opt_state_treedef": str(jax.tree.structure(stripped)),
      "opt_state": _signature(stripped),
  }


def abstract_state(tx, params, mesh: Optional[Mesh] = None, axis_name: Hashable = "data", *,
                   param_specs=None, model_axis: Optional[Hashable] = None):
  """Shapes, dtypes and shardings of the state :func:`init_sharded` would return.

  An Orbax restore needs such a target: without one it cannot rebuild the
  NamedTuple state, and it places the per-device buffers (``local_momentum``,
  ``worker_scale``, the error buffers: global leading axis = devices, sharded
  over ``axis_name``) only where it is told. Fields that do not exist in this
  layout (``server_error`` on one device, ``worker_error`` unless hierarchical)
  are None. Nothing is computed or allocated. For a data × model mesh pass the
  parameters' ``param_specs`` and ``model_axis``, as to :func:`init_sharded`.

  Args:
    tx: the optimizer (any optax transformation containing 1-bit Adam).
    params: the parameter pytree (arrays or ``jax.ShapeDtypeStruct``).
    mesh: the device mesh; None for a single device (``axis_name=None`` optimizer).
    axis_name: the data-parallel axis of ``mesh`` given to the optimizer.
    param_specs: the parameters' ``PartitionSpec`` s over ``model_axis`` (None:
      replicated).
    model_axis: the model-parallel axis of ``mesh`` given to the optimizer, or None.

  Returns:
    A pytree of ``jax.ShapeDtypeStruct`` with shardings, structured like the state.

  Example:
    >>> import jax, jax.numpy as jnp, onebit_optax
    >>> mesh = jax.make_mesh((2,), ('data',))
    >>> tx = onebit_optax.onebit_adam(1e-3, axis_name='data')
    >>> target = onebit_optax.abstract_state(tx, {'w': jnp.ones(300)}, mesh)
    >>> target[0].local_momentum[0].shape, target[0].local_momentum[0].sharding.spec
    ((2, 1, 300), P('data', None, None))
    >>> target[0].momentum_message.shape, target[0].worker_error
    ((2, 40), None)

  References:
    `Orbax checkpointing <https://orbax.readthedocs.io/en/latest/>`_;
    DeepSpeed's 1-bit Adam tutorial (which resets the error buffers on load).
  """
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
  if mesh is None:
    sharding = make_single_device_sharding(jax.local_devices()[0])
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
        jax.eval_shape(tx.init, params))
  caller = "abstract_state"
  if param_specs is not None:
    _sharding._check_axes(mesh, axis_name, model_axis, caller)
    _sharding._check_param_specs(param_specs, axis_name, model_axis, caller)
  specs = _sharding.state_specs_for(tx, params, mesh, axis_name, caller=caller,
                                    param_specs=param_specs, model_axis=model_axis)
  in_specs = P() if param_specs is None else param_specs
  if param_specs is not None:
    params = _sharding._abstract_on(params, mesh, param_specs)
  shapes = jax.eval_shape(
      jax.shard_map(tx.init, mesh=mesh, in_specs=(in_specs,), out_specs=specs,
                    check_vma=False), params)
  return jax.tree.map(
      lambda x, spec: jax.ShapeDtypeStruct(
          x.shape, x.dtype, sharding=NamedSharding(mesh, _full_spec(spec, len(x.shape)))),
      shapes, specs)


def _full_spec(spec, ndim: int):
  """``spec`` with one entry per dimension, as ``shard_map``'s outputs (init_sharded's state) spell it.

  ``NamedSharding(mesh, P())`` and ``NamedSharding(mesh, P(None, None))`` place
  an array alike but compare unequal, so a state restored with the short
  spelling compiled the training step a second time.
  """
  return P(*(tuple(spec) + (None,) * (ndim - len(spec))))


def save_checkpoint(directory_or_manager, step: int, params, opt_state, *, tx=None) -> bool:
  """Saves ``params`` and a 1-bit Adam ``opt_state`` as step ``step``, all of it.

  Unlike DeepSpeed, which keeps only rank 0's error-feedback buffers and zeroes
  them on every load (its tutorial warns that frequent reloads hurt
  convergence), every device's buffers (``local_momentum``, from which the
  worker error feedback is formed, ``worker_scale``, ``server_error``, and
  under hierarchical averaging ``worker_error``) are saved (each process
  writes its own rows), so :func:`restore_checkpoint` resumes bit for bit.
  Beside them goes a small JSON record: the format version (``onebit_format``,
  3), the device count and mesh layout, the wire layout (which leaves are
  compressed) and the shapes and structure of both trees, which lets the
  restore refuse a mismatched model or optimizer, and detect a new device
  count, instead of silently reinterpreting the arrays. With ``tx=`` the
  record also holds the optimizer's hyperparameters (learning rate or the
  schedule's values at a few steps, ``b1``, ``b2``, ``eps``, ``weight_decay``,
  ``mask``, ``freeze``, ``variance_floor``, ``max_update``,
  ``skip_nonfinite``), which :func:`restore_checkpoint` compares with the new
  ``tx``. States of data × model meshes (parameters sharded over a
  ``model_axis``) are saved as they are, every model shard's buffers included.

  It is an Orbax ``CheckpointManager`` step with three items: ``params``,
  ``opt_state`` and ``onebit_optax`` (the record). Call it on every process.

  Args:
    directory_or_manager: a directory (the checkpoint goes to
      ``directory/<step>``; the call returns once it is on disk) or an
      ``orbax.checkpoint.CheckpointManager`` (its options apply: the save may
      finish in the background, call its ``wait_until_finished()`` before exiting).
    step: the training step, the checkpoint's name.
    params: the parameters (replicated over the mesh in the shard_map recipe).
    opt_state: the optimizer state as the training step returns it (the layout
      of :func:`init_sharded`, or of ``tx.init`` with ``axis_name=None``).
    tx: the optimizer (recommended): its hyperparameters go into the record,
      so that a restore with other ones is refused. Found in ``tx`` when it is,
      or holds (``optax.chain``, ``masked``...), a :func:`onebit_adam` or
      :func:`scale_by_onebit_adam`; not under ``optax.inject_hyperparams``
      (whose hyperparameters are saved in the state itself).

  Returns:
    Whether a checkpoint was written (a manager may skip steps by its options).

  Example:
    >>> import tempfile, jax, jax.numpy as jnp, onebit_optax
    >>> mesh = jax.make_mesh((2,), ('data',))
    >>> tx = onebit_optax.onebit_adam(1e-3, axis_name='data')
    >>> params = {'w': jnp.ones(300)}
    >>> state = onebit_optax.init_sharded(tx, params, mesh)
    >>> with tempfile.TemporaryDirectory() as directory:
    ...   onebit_optax.save_checkpoint(directory, 7, params, state, tx=tx)
    ...   params, state, step = onebit_optax.restore_checkpoint(directory, tx, params, mesh)
    True
    >>> step, state[0].local_momentum[0].shape, state[0].server_error.shape
    (7, (2, 1, 300), (2, 256))

  References:
    `Orbax checkpointing <https://orbax.readthedocs.io/en/latest/>`_;
    DeepSpeed's 1-bit Adam tutorial (which resets the error buffers on load).
  """
  ocp = _orbax()
  metadata = _metadata(step, params, opt_state, tx)
  manager, owned = _open(directory_or_manager, create=True)
  try:
    saved = manager.save(int(step), args=ocp.args.Composite(**{
        _PARAMS: ocp.args.PyTreeSave(params),
        _OPT_STATE: ocp.args.PyTreeSave(opt_state),
        _META: ocp.args.JsonSave(metadata),
    }))
    if owned:
      manager.wait_until_finished()
  finally:
    if owned:
      manager.close()
  return bool(saved)


def _shape(shape) -> str:
  return f"({shape[0]},)" if len(shape) == 1 else "(" + ", ".join(map(str, shape)) + ")"


def _diff(saved: list, now: list) -> list[str]:
  saved_map = {path: (_shape(shape), dtype) for path, shape, dtype in saved}
  now_map = {path: (_shape(shape), dtype) for path, shape, dtype in now}
  lines = [f"{p}: only in the checkpoint, {s[0]} {s[1]}"
           for p, s in saved_map.items() if p not in now_map]
  lines += [f"{p}: not in the checkpoint, {s[0]} {s[1]}"
            for p, s in now_map.items() if p not in saved_map]
  lines += [f"{p}: checkpoint {saved_map[p][0]} {saved_map[p][1]}, now {s[0]} {s[1]}"
            for p, s in now_map.items() if p in saved_map and saved_map[p] != s]
  if len(lines) > _MAX_DIFFS:
    lines = lines[:_MAX_DIFFS] + [f"... and {len(lines) - _MAX_DIFFS} more"]
  return lines


def _first_difference(saved: str, now: str, context: int = 70) -> str:
  """The two tree structures around the first place where they differ."""
  i = next((i for i, (a, b) in enumerate(zip(saved, now)) if a != b), min(len(saved), len(now)))
  start = max(0, i - context)
  cut = lambda s: ("..." if start else "") + s[start:i + context] + (
      "..." if i + context < len(s) else "")
  return f"tree structure in the checkpoint: {cut(saved)}\n  tree structure of tx.init now:   {cut(now)}"


def _check_version(where: str, metadata: dict) -> None:
  """Refuses a record of another layout of the state (no conversion is offered)."""
  version = metadata.get("onebit_format")
  zero_one = (metadata.get("layout") or {}).get("optimizer") == "zero_one_adam"
  if version == _VERSION or (version == 4 and not zero_one):  # (1-bit Adam's is unchanged)
    return
  if version == 4:
    raise ValueError(
        f"restore_checkpoint: {where} holds a 0/1 Adam state of checkpoint format 4, "
        "written before its first moment was kept as the compressed steps' momentum "
        "message (format 5 adds momentum_message and mu_in_message). No conversion is "
        "offered: finish the run with the version that wrote it, or restore its 'params' "
        "item with Orbax and start the optimizer afresh with init_sharded.")
  if version is None and not str(metadata.get("format", "")).startswith("onebit_optax."):
    raise ValueError(
        f"restore_checkpoint: {where} has no onebit_optax record (item {_META!r} holds no "
        "'onebit_format'); it was not written by onebit_optax.save_checkpoint.")
  if version == 3:
    raise ValueError(
        f"restore_checkpoint: {where} was written by onebit-optax core v3 (checkpoint format "
        "3): its per-device buffers hold one array per leaf and its momentum message lays "
        "the leaves out in tree order, where this version stacks the leaves of one shape "
        "(format 4). No conversion is offered: finish the run with the version that wrote "
        "it, or restore its 'params' item with Orbax and start the optimizer afresh with "
        "init_sharded (the run warms up again).")
  if version is None or (isinstance(version, int) and version < _VERSION):
    raise ValueError(
        f"restore_checkpoint: {where} was written by an older onebit-optax (checkpoint "
        f"format {metadata.get('format')!r}, no 'onebit_format' {_VERSION} in its record). "
        "Its 1-bit Adam state has the old flat layout (mu and nu as one padded vector of "
        "shape (padded,), leaf_sizes, flat per-device error buffers), which this version "
        "cannot read, and no conversion is offered. Either restore it with the "
        "onebit-optax version that wrote it and finish the run with that version, or "
        "start the optimizer afresh on the saved parameters: read the 'params' item with "
        "Orbax (orbax.checkpoint.CheckpointManager(directory).restore(step, args="
        "ocp.args.Composite(params=ocp.args.PyTreeRestore()))), then init_sharded; "
        "Adam's moments and the phase are lost and the run warms up again.")
  raise ValueError(
      f"restore_checkpoint: {where} was written by a newer onebit-optax (checkpoint format "
      f"{version!r}); this version reads format {_VERSION}. Upgrade onebit-optax.")


def _check_params(where: str, metadata: dict, params) -> None:
  """Raises a ValueError naming how ``params`` differ from the checkpoint's."""
  _check_version(where, metadata)
  lines = _diff(metadata["params"], _signature(params))
  if lines:
    raise ValueError(
        f"restore_checkpoint: {where} was saved for other parameters than `params` "
        "(a different model?):\n  " + "\n  ".join(lines) + "\nPass the parameter tree "
        "(shapes and dtypes) of the run that saved it; a different model needs a fresh "
        "optimizer state (tx.init / init_sharded).")


def _check_state(where: str, metadata: dict, target) -> None:
  """Raises a ValueError naming how the state of ``tx`` differs from the checkpoint's."""
  # The per-device buffers' and the message's shapes depend on the mesh (the
  # params fix the rest): compared apart, in the restore.
  stripped = _strip(target)
  lines = _diff(metadata["opt_state"], _signature(stripped))
  treedef = str(jax.tree.structure(stripped))
  saved_error, error = metadata["layout"]["error_dtype"], _layout(target)["error_dtype"]
  if not lines and saved_error is not None and error is not None and saved_error != error:
    lines = [f"error_dtype (the per-device buffers): checkpoint {saved_error}, now {error}"]
  if lines or metadata["opt_state_treedef"] != treedef:
    detail = ("\n  ".join(lines) if lines
              else _first_difference(metadata["opt_state_treedef"], treedef))
    raise ValueError(
        f"restore_checkpoint: {where} holds the state of another optimizer than `tx` "
        f"(a different optax.chain, transformation or dtype):\n  {detail}\nBuild tx as "
        "in the run that saved it; a different optimizer needs a fresh state.")


def _first_value(x):
  return np.asarray(x.addressable_shards[0].data if hasattr(x, "addressable_shards") else x)


def _wire_layout(params, info: dict) -> _layout_mod.WireLayout:
  """The wire layout a state with this record's layout was made with (checked against it)."""
  rows, row_bytes = info["buffers"]["momentum_message"]
  message = jax.ShapeDtypeStruct((rows, row_bytes), jnp.uint8)
  layout = _accessors._layout_of(params, message, len(info["compressed"]))
  if list(layout.compressed) != info["compressed"] or layout.row_bytes != row_bytes:
    raise ValueError(
        f"restore_checkpoint: the momentum message of shape {(rows, row_bytes)} with "
        f"compressed leaves {info['compressed']} matches no wire layout of these "
        f"parameters on {rows} devices (the layout gives compressed leaves "
        f"{list(layout.compressed)} and rows of {layout.row_bytes} bytes); it cannot be "
        "moved to another mesh.")
  return layout


def _relaid(message, old: _layout_mod.WireLayout, new: _layout_mod.WireLayout):
  """The mean momentum of ``message`` (``old`` layout) compressed again for ``new``.

  The momentum is decoded (:func:`_groups.mean_leaves`), and each compressed
  leaf of the new layout is sent as its signs with one scale per leaf (its
  RMS); exact leaves carry their decoded values.
  """
  means = _groups.mean_leaves(old, message)
  sent = [means[i] for i in new.compressed]
  scales = (jnp.stack([_wire.leaf_rms(u) for u in sent]) if sent
            else jnp.zeros((0,), jnp.float32))
  return _wire.rows(new, [_wire.leaf_signs(u) for u in sent], scales, _groups.exact(new, means))


def _zeros(abstract):
  return jax.jit(lambda: jnp.zeros(abstract.shape, abstract.dtype),
                 out_shardings=abstract.sharding)()


def _read_record(ocp, manager, step):
  """The step to restore (the latest when None), a phrase naming it, and its onebit record."""
  if step is None:
    step = manager.latest_step()
    if step is None:
      raise FileNotFoundError(f"restore_checkpoint: no checkpoint in {manager.directory}.")
  elif step not in manager.all_steps():
    raise FileNotFoundError(
        f"restore_checkpoint: no step {step} in {manager.directory}; it holds steps "
        f"{sorted(manager.all_steps())}.")
  where = f"the checkpoint of step {step} in {manager.directory}"
  not_ours = (f"restore_checkpoint: {where} has no onebit_optax record (item {_META!r}); it "
              "was not written by onebit_optax.save_checkpoint.")
  try:
    metadata = manager.restore(
        step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))[_META]
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(not_ours) from e
  if not isinstance(metadata, dict):
    raise ValueError(not_ours)
  return step, where, metadata


def _check_config(where: str, metadata: dict, tx, accept_changes) -> None:
  """Refuses other hyperparameters than the checkpoint's, unless ``accept_changes`` names them."""
  accepted = set(_config.FIELDS) if accept_changes is True else set(accept_changes or ())
  unknown = accepted - set(_config.FIELDS)
  if unknown:
    raise ValueError(
        f"restore_checkpoint: accept_changes names {sorted(unknown)}, which are not "
        f"hyperparameters that are checked; those are {list(_config.FIELDS)} (or True "
        "for all of them).")
  differences, _ = _config.compare(metadata.get("config"), tx)
  refused = [(name, line) for name, line in differences if name not in accepted]
  if refused:
    names = tuple(name for name, _ in refused)
    raise ValueError(
        f"restore_checkpoint: {where} was saved by an optimizer with other "
        "hyperparameters than `tx`:\n  " + "\n  ".join(line for _, line in refused) +
        "\nBuild tx as in the run that saved it, or, to resume with the new values on "
        f"purpose (e.g. a new learning-rate schedule), pass accept_changes={names!r}.")


def _is_model_parallel(info: dict) -> bool:
  return info.get("model_shards", 1) > 1 or info.get("param_specs") is not None


def _same_mesh(saved: dict, new: dict) -> bool:
  """Whether the per-device buffers can be restored as they are (same rows, same layout)."""
  keys = ("num_devices", "device_axes", "compressed", "buffers")
  return (all(saved[key] == new[key] for key in keys)
          and saved.get("model_shards", 1) == new.get("model_shards", 1)
          and saved.get("param_specs") == new.get("param_specs"))


def _movable(saved: dict, new: dict) -> bool:
  """Whether the state can move: data-parallel, or only the data axis changes (flat)."""
  if not (_is_model_parallel(saved) or _is_model_parallel(new)):
    return True
  return (saved.get("model_shards", 1) == new.get("model_shards", 1)
          and saved.get("param_specs") == new.get("param_specs")
          and saved["buffers"]["worker_error"] is None and new["buffers"]["worker_error"] is None)


def _refuse_model_move(where: str, saved: dict, new: dict, model_axis) -> None:
  """A data × model state moves onto nothing but its own mesh: raise what to do."""
  describe = lambda info: (
      f"mesh {info.get('mesh')} ({info['num_devices']} data-parallel devices x "
      f"{info.get('model_shards', 1)} model shards), parameter specs "
      f"{info.get('param_specs') or 'all P()'}")
  hint = ""
  if _is_model_parallel(saved) and model_axis is None:
    hint = ("It was saved with the parameters sharded over a model axis: pass "
            "param_specs= and model_axis= as to init_sharded. ")
  raise ValueError(
      f"restore_checkpoint: {where} was saved on {describe(saved)}; it is restored onto "
      f"{describe(new)}. {hint}A data x model state is restored onto the mesh shape and "
      "parameter specs it was saved with (bit for bit), or onto another number of "
      "data-parallel devices with the same model split and param_specs (a flat data "
      "axis); each model shard's per-device buffers and momentum message are laid out "
      "for its own local shards, so another model split cannot be moved. Restore it "
      "with the saved param_specs and model size; to change the model split, finish on "
      "the saved mesh, or read the saved 'params' with Orbax and start the optimizer "
      "afresh (init_sharded; Adam's moments and the phase are lost, the run warms up "
      "again).")


def _saved_target(x_saved_shape, dtype, abstract, mesh):
  """Where a saved per-device buffer is read to: split like the new rows where they divide it."""
  shape = tuple(x_saved_shape)
  sharding = getattr(abstract, "sharding", None)
  if mesh is None or not isinstance(sharding, NamedSharding):
    sharding = make_single_device_sharding(jax.local_devices()[0])
  elif shape[0] % abstract.shape[0]:
    sharding = NamedSharding(mesh, P())
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _saved_item(target, info: dict, mesh):
  """The restore target on another mesh: every buffer in its saved shape (moved afterwards)."""
  buffers = info["buffers"]
  error_dtype = jnp.dtype(info["error_dtype"] or "float32")

  def zero_one_as_saved(state):
    def field(name):
      saved, now = buffers[name], getattr(state, name)
      if saved is None:
        return None
      if now is None:  # the server error, absent on one device: read as saved, dropped
        return _saved_target(saved[0], jnp.float32, state.worker_scale, mesh)
      leaves = [_saved_target(shape, x.dtype, x, mesh)
                for shape, x in zip(saved, jax.tree.leaves(now))]
      return jax.tree.unflatten(jax.tree.structure(now), leaves)
    return state._replace(**{name: field(name) for name in _ZERO_ONE_SIZED})

  def as_saved(state):
    if _is_zero_one(state):
      return zero_one_as_saved(state)
    one = lambda name, dtype: (None if buffers[name] is None else _saved_target(
        buffers[name], dtype, getattr(state, name) if getattr(state, name) is not None
        else state.worker_scale, mesh))
    local = None
    if buffers["local_momentum"] is not None:
      like = state.worker_scale
      local = tuple(_saved_target(shape, error_dtype, like, mesh)
                    for shape in buffers["local_momentum"])
    return state._replace(
        local_momentum=local, worker_scale=one("worker_scale", jnp.float32),
        worker_error=one("worker_error", error_dtype),
        server_error=one("server_error", error_dtype),
        momentum_message=jax.ShapeDtypeStruct(
            tuple(buffers["momentum_message"]), jnp.uint8,
            sharding=state.momentum_message.sharding))
  return _with_state(target, as_saved)


def _side(local_params, info: dict) -> _ckpt_move.Mesh:
  """The wire layout of one model shard and the device numbering a record describes."""
  shards = info.get("model_shards", 1)
  rows, row_bytes = info["buffers"]["momentum_message"]
  wire = _wire_layout(local_params, {**info, "buffers": {
      **info["buffers"], "momentum_message": [rows // shards, row_bytes]}})
  hierarchical = info["buffers"]["worker_error"] is not None
  fast = info["device_axes"][-1] if hierarchical and len(info["device_axes"]) == 2 else 1
  return _ckpt_move.Mesh(wire, info["num_devices"] // fast, fast)


def _model_shard(state, shards: int, m: int, n: int):
  """Model shard ``m``'s per-device rows (row ``d * shards + m``) and its ``n`` message rows."""
  if shards == 1:
    return state
  rows = lambda x: None if x is None else x.reshape((-1, shards) + x.shape[1:])[:, m]
  return state._replace(
      local_momentum=None if state.local_momentum is None
      else tuple(rows(u) for u in state.local_momentum),
      worker_scale=rows(state.worker_scale), worker_error=rows(state.worker_error),
      server_error=rows(state.server_error), momentum_message=state.momentum_message[m * n:(m + 1) * n])


def _interleaved(parts: list):
  """Per-model-shard rows back into one buffer, row ``d * shards + m`` (None stays None)."""
  if parts[0] is None or len(parts) == 1:
    return parts[0]
  return jnp.stack(parts, axis=1).reshape((-1,) + parts[0].shape[1:])


def _carry_all(state, old, new, shapes, shards: int, b1, dtype):
  """Every model shard's message re-laid out and its error feedback handed on (one program)."""
  messages, carried = [], []
  for m in range(shards):
    part = _model_shard(state, shards, m, old.wire.num_devices)
    message = _relaid(part.momentum_message, old.wire, new.wire)
    messages.append(message)
    carried.append(_ckpt_move.carry(part, old, new, shapes, message, b1, dtype))
  joined = _ckpt_move.Carried(
      None if carried[0].local_momentum is None else tuple(
          _interleaved([c.local_momentum[k] for c in carried])
          for k in range(len(carried[0].local_momentum))),
      *(_interleaved([getattr(c, name) for c in carried])
        for name in ("worker_scale", "worker_error", "server_error")))
  return joined, jnp.concatenate(messages) if shards > 1 else messages[0]


def _b1(tx):
  """``tx``'s first-moment decay where it is known (a number), else None."""
  found = _config.config_of(tx)
  value = None if found is None else _config._number(found[1].get("b1"))
  return None if isinstance(value, bool) else value


def _moved(state, abstract, saved: dict, new: dict, tx):
  """The restored state moved onto the new mesh layout, its error feedback handed on.

  Returns the state and the names of the leaves whose residual was dropped
  (compressed before, exact now).
  """
  if not bool(_first_value(state.frozen)):
    # In warmup nothing was sent yet: every buffer and the message are zero.
    reset = {name: jax.tree.map(_zeros, getattr(abstract, name)) for name in _SIZED}
    return state._replace(**reset, feedback_valid=_zeros(abstract.feedback_valid)), []
  # One model shard's leaves (the whole parameters without a model axis).
  shapes = [_local_shape(x) for x in jax.tree.leaves(abstract.nu)]
  local = jax.tree.unflatten(jax.tree.structure(abstract.nu),
                             [jax.ShapeDtypeStruct(x, jnp.float32) for x in shapes])
  old_side, new_side = _side(local, saved), _side(local, new)
  shards = new.get("model_shards", 1)
  error = next((x for x in (*(abstract.local_momentum or ()), abstract.worker_error,
                            abstract.server_error) if x is not None), abstract.worker_scale)
  shardings = _ckpt_move.Carried(
      None if abstract.local_momentum is None
      else tuple(x.sharding for x in abstract.local_momentum),
      abstract.worker_scale.sharding,
      None if abstract.worker_error is None else abstract.worker_error.sharding,
      None if abstract.server_error is None else abstract.server_error.sharding)
  b1 = _b1(tx)
  # The residual buffers are cut and re-ordered whole (a reshape of an array
  # sharded over a mesh axis is refused under explicit sharding); without a
  # model axis the local_momentum rows are only averaged, where they lie.
  # (A jit, not device_put: it also reshards arrays that span several processes.)
  whole = lambda x: (x if x is None or not isinstance(getattr(x, "sharding", None), NamedSharding)
                     else jax.jit(lambda a: a, out_shardings=NamedSharding(x.sharding.mesh, P()))(x))
  state = state._replace(worker_error=whole(state.worker_error),
                         server_error=whole(state.server_error))
  if shards > 1:
    state = state._replace(
        local_momentum=tuple(whole(u) for u in state.local_momentum),
        worker_scale=whole(state.worker_scale), momentum_message=whole(state.momentum_message))
  carried, message = jax.jit(
      lambda s: _carry_all(s, old_side, new_side, shapes, shards, b1, error.dtype),
      out_shardings=(shardings, abstract.momentum_message.sharding))(state)
  valid = jax.jit(lambda: jnp.ones((), jnp.bool_),
                  out_shardings=abstract.feedback_valid.sharding)()
  names = [jax.tree_util.keystr(path) for path, _ in
           jax.tree_util.tree_flatten_with_path(abstract.nu)[0]]
  dropped = [names[i] for i in old_side.wire.compressed if i not in new_side.wire.compressed]
  return state._replace(**carried._asdict(), momentum_message=message,
                        feedback_valid=valid), dropped


def restore_checkpoint(directory_or_manager, tx, params, mesh: Optional[Mesh] = None,
                       axis_name: Hashable = "data", *, step: Optional[int] = None,
                       param_specs=None, model_axis: Optional[Hashable] = None,
                       accept_changes=()):
  r"""Restores what :func:`save_checkpoint` saved, placed for ``mesh``, checking that it fits.

  **On the same mesh** (device count, mesh layout, and for a data × model mesh
  the same ``param_specs``) the state comes back exactly, per-device buffers
  included, so training continues bit for bit as if never interrupted.

  **On another device count or mesh layout** (flat vs hierarchical, another
  ``exact_below``, or one device, ``mesh=None``; data × model meshes: below),
  everything but the per-device buffers and the message is restored exactly:
  ``mu``, ``nu``, ``nu_l1``, the phase (``frozen``, ``freeze_step``),
  ``count``, ``skipped_steps`` and the variance-ratio fields. The compressed
  mean momentum :math:`m` (``momentum_message``, one row per device) is
  decoded with the saved wire layout and compressed again for the new one,
  :math:`C'(m)`, as the freeze step does (its signs, one scale per leaf; exact
  leaves keep their values). The error feedback is handed on rather than
  reset (DeepSpeed resets it on every load): what the next compressed mean
  depends on is the servers' residual, which tiles the compressed vector
  (chunk :math:`r` is server :math:`r`'s) and is cut into the new chunks, and
  the devices' *mean* worker error :math:`\bar e = \frac1n\sum_i e_i`, which
  every new device gets, so the new mean of the errors is the old one. Every
  device's error also gets :math:`\beta_1 (m - C'(m))` (``b1`` read off
  ``tx``), so that the first step forms
  :math:`\beta_1 m + (1-\beta_1) g_i + \bar e` as the old mesh would have.
  Restored onto one device (no servers), the servers' residual is added to
  the worker error. What is not carried: the residual of a leaf that was
  compressed and is exact in the new layout (``exact_below`` raised, or
  hierarchical to flat; a warning names it), and, in warmup, nothing
  exists to carry (the buffers are zero). ``docs/guides/elastic_restore.md``
  measures the difference to the reset.

  **A data × model checkpoint** (saved with ``param_specs`` / ``model_axis``)
  is restored onto its own mesh shape (bit for bit), or onto another number of
  data-parallel devices with the same model split and ``param_specs`` (each
  model shard's message and error feedback moved as above, on its local
  shards); another model split, other ``param_specs``, a data-only mesh or a
  hierarchical data axis raise a ValueError saying what to do.

  **What is checked.** Always: the parameters' tree, shapes and dtypes; the
  optimizer state's tree structure (another ``optax.chain`` or
  transformation, ``moment_dtype``, ``error_dtype``) and the format
  (``onebit_format`` 3; older flat-layout checkpoints are refused, not
  converted). When the checkpoint was saved with ``save_checkpoint(...,
  tx=tx)`` and ``tx`` here is, or holds, a :func:`onebit_adam` /
  :func:`scale_by_onebit_adam` (not under ``optax.inject_hyperparams``): its
  hyperparameters ``learning_rate`` (a constant, or a schedule compared by its
  values at steps 0, 1, 10, ..., 10^6, the checkpoint's step and the next),
  ``b1``, ``b2``, ``eps``, ``weight_decay``, ``mask`` (a pytree of bools; a
  callable mask is not compared), ``freeze`` (the policy and its fields),
  ``variance_floor``, ``max_update`` and ``skip_nonfinite``. Any difference
  raises a ValueError naming the fields with both values; a change made on
  purpose (a new learning rate on resume is a legitimate one) is accepted by
  naming it in ``accept_changes``. Not checked: the hyperparameters of other
  transformations in the chain (their states' shapes are), a checkpoint saved
  without ``tx=``, and a ``tx`` in which no 1-bit Adam factory is found.

  Args:
    directory_or_manager: the directory given to :func:`save_checkpoint`, or an
      ``orbax.checkpoint.CheckpointManager``.
    tx: the optimizer, built as in the run that saved the checkpoint (the
      ``axis_name`` may differ only if ``mesh`` says so).
    params: a parameter pytree with the saved shapes and dtypes (arrays or
      ``jax.ShapeDtypeStruct``; only their shapes and dtypes are used).
    mesh: the device mesh to restore onto; None for a single device.
    axis_name: the data-parallel axis of ``mesh`` given to the optimizer.
    step: the step to restore; the latest by default.
    param_specs: for a data × model mesh, the parameters' ``PartitionSpec`` s
      (as given to :func:`init_sharded`); the parameters come back sharded
      by them.
    model_axis: the model-parallel axis of ``mesh``, with ``param_specs``.
    accept_changes: names of the hyperparameters (of ``learning_rate``,
      ``b1``, ``b2``, ``eps``, ``weight_decay``, ``mask``, ``freeze``,
      ``variance_floor``, ``max_update``, ``skip_nonfinite``) that may differ
      from the checkpoint's on purpose, or True for all of them.

  Returns:
    ``(params, opt_state, step)``: params replicated over ``mesh`` (sharded by
    ``param_specs`` when given) and the state sharded as by
    :func:`init_sharded` (on ``mesh=None``: on the first local device), and the
    restored step.

  Example:
    >>> import tempfile, warnings, jax, jax.numpy as jnp, onebit_optax
    >>> tx = onebit_optax.onebit_adam(1e-3, axis_name='data', freeze=1)
    >>> params = {'w': jnp.ones(300)}
    >>> state = onebit_optax.init_sharded(tx, params, jax.make_mesh((2,), ('data',)))
    >>> new_mesh = jax.make_mesh((4,), ('data',))  # a restart on 4 devices
    >>> with tempfile.TemporaryDirectory() as directory:
    ...   _ = onebit_optax.save_checkpoint(directory, 3, params, state, tx=tx)
    ...   params, state, step = onebit_optax.restore_checkpoint(directory, tx, params, new_mesh)
    >>> state[0].server_error.shape  # re-chunked for 4 devices
    (4, 128)
    >>> state[0].momentum_message.shape  # one row per device
    (4, 20)

  References:
    `Orbax checkpointing <https://orbax.readthedocs.io/en/latest/>`_;
    DeepSpeed's 1-bit Adam tutorial (which resets the error buffers on load).
  """
  ocp = _orbax()
  manager, owned = _open(directory_or_manager, create=False)  # reading creates nothing
  try:
    step, where, metadata = _read_record(ocp, manager, step)
    target = abstract_state(tx, params, mesh, axis_name, param_specs=param_specs,
                            model_axis=model_axis)
    params_target = _params_target(params, mesh, param_specs)
    _check_params(where, metadata, params_target)
    saved_layout, new_layout = metadata["layout"], _layout(target)
    # The same device count with other buffer shapes is another mesh layout
    # (flat vs hierarchical, another threshold of exact leaves): the
    # per-device buffers are moved too.
    same_mesh = _same_mesh(saved_layout, new_layout)
    if not same_mesh and not _movable(saved_layout, new_layout):
      _refuse_model_move(where, saved_layout, new_layout, model_axis)
    _check_state(where, metadata, target)
    _check_config(where, metadata, tx, accept_changes)
    item = target if same_mesh else _saved_item(target, saved_layout, mesh)
    as_args = lambda x: (ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape,
                                              dtype=x.dtype)
                         if isinstance(x, jax.ShapeDtypeStruct) else x)
    restored = manager.restore(step, args=ocp.args.Composite(**{
        _PARAMS: ocp.args.PyTreeRestore(
            item=params_target, restore_args=jax.tree.map(as_args, params_target)),
        _OPT_STATE: ocp.args.PyTreeRestore(item=item, restore_args=jax.tree.map(as_args, item)),
    }))
  finally:
    if owned:
      manager.close()

  new_params, opt_state = restored[_PARAMS], restored[_OPT_STATE]
  if same_mesh:
    return new_params, opt_state, int(step)
  _, state = _find(opt_state)
  _, abstract = _find(target)
  if _is_zero_one(state):
    fresh = jax.tree.map(_zeros, abstract)
    state = _zero_one_sharding.moved(state, fresh, mesh, axis_name, where)
    return new_params, _with_state(opt_state, lambda _: state), int(step)
  state, dropped = _moved(state, abstract, saved_layout, new_layout, tx)
  opt_state = _with_state(opt_state, lambda _: state)
  if dropped:
    warnings.warn(
        f"onebit_optax.restore_checkpoint: {where} is restored onto another wire layout "
        f"in which the leaves {dropped} are no longer compressed (exact_below, or "
        "hierarchical to flat): their error-feedback residual was dropped; they are "
        "averaged exactly from now on. Everything else was moved (see "
        "restore_checkpoint's docstring).", UserWarning, stacklevel=2)
  return new_params, opt_state, int(step)


def _params_target(params, mesh, param_specs):
  """``params`` as ShapeDtypeStructs placed for the restore (replicated, or by ``param_specs``)."""
  if mesh is not None and param_specs is not None:
    return _sharding._abstract_on(params, mesh, param_specs)
  sharding = (make_single_device_sharding(jax.local_devices()[0]) if mesh is None
              else NamedSharding(mesh, P()))
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding), params)
