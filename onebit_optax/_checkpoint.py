"""Orbax checkpoints that resume 1-bit Adam exactly, per-device buffers included."""

from __future__ import annotations

import warnings
from typing import Hashable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from onebit_optax._onebit_adam import ScaleByOnebitAdamState
from onebit_optax import _accessors
from onebit_optax import _layout as _layout_mod
from onebit_optax import _sharding
from onebit_optax import _wire

__all__ = ["save_checkpoint", "restore_checkpoint", "abstract_state"]

# Names of the items of one checkpoint step (folders under directory/<step>/).
_PARAMS = "params"
_OPT_STATE = "opt_state"
_META = "onebit_optax"
# The layout of the 1-bit Adam state the record describes. 3: tree-shaped
# moments, per-device local_momentum / worker_scale, the uint8 momentum_message
# (onebit-optax core v3). Checkpoints without it (format 1: flat padded mu/nu)
# are refused.
_VERSION = 3
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


def _is_state(x) -> bool:
  return isinstance(x, ScaleByOnebitAdamState)


def _find(opt_state) -> tuple[tuple, ScaleByOnebitAdamState]:
  """Key path and value of the single 1-bit Adam state inside ``opt_state``."""
  found = [(path, node) for path, node in
           jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=_is_state)[0]
           if _is_state(node)]
  if len(found) != 1:
    raise ValueError(
        f"Expected exactly one 1-bit Adam state inside the optimizer state, found "
        f"{len(found)}. Pass the state of onebit_adam / scale_by_onebit_adam (possibly "
        "inside optax.chain, inject_hyperparams, masked, ...).")
  return found[0]


def _with_state(opt_state, fn):
  """``opt_state`` with its 1-bit Adam state replaced by ``fn(state)``."""
  return jax.tree.map(lambda x: fn(x) if _is_state(x) else x, opt_state, is_leaf=_is_state)


def _strip(opt_state):
  """The state without the fields whose shapes depend on the mesh (compared separately)."""
  return _with_state(opt_state, lambda s: s._replace(**{name: None for name in _SIZED}))


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


def _layout(opt_state) -> dict:
  """The mesh-dependent part of a state in the shard_map (or 1-device) layout, checked.

  Global shapes: each per-device buffer has one row per device, the gathered
  ``momentum_message`` one row per chunk (as many as devices), and
  ``worker_scale`` one column per compressed leaf, which fixes the wire layout.
  """
  _, state = _find(opt_state)
  message, scale = np.shape(state.momentum_message), np.shape(state.worker_scale)
  local = state.local_momentum
  if np.ndim(state.count) != 0:
    raise ValueError(
        "The 1-bit Adam state does not have the layout of onebit_optax.init_sharded: count "
        f"has shape {np.shape(state.count)}, i.e. every field carries a leading device "
        "axis: a pmap state is not supported. Checkpoint the state of the shard_map "
        "training step (out_specs=onebit_optax.state_partition_specs(...)).")
  sharding = getattr(state.momentum_message, "sharding", None)
  if isinstance(sharding, NamedSharding) and any(a is not None for a in sharding.spec):
    raise ValueError(
        "save_checkpoint: the 1-bit Adam state is sharded over a model-parallel axis "
        f"(momentum_message has spec {sharding.spec}); checkpoints of data x model "
        "meshes are not supported yet (abstract_state and restore_checkpoint know only "
        "data-parallel meshes).")
  n = message[0] if len(message) == 2 else 0
  rows = [np.shape(x)[0] if np.ndim(x) >= 1 else None
          for x in (state.worker_scale, state.worker_error, state.server_error, *(local or ()))
          if x is not None]
  nu = jax.tree.leaves(state.nu)
  ok = len(message) == 2 and n >= 1 and len(scale) == 2 and all(r == n for r in rows)
  layout = None
  if ok:
    layout = _accessors._layout_of(state.nu, state.momentum_message, scale[1])
    ok = (layout.row_bytes == message[1] and len(layout.compressed) == scale[1]
          and (local is None or [tuple(np.shape(u)) for u in local]
               == [(n,) + tuple(np.shape(nu[i])) for i in layout.compressed]))
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
  return {
      "num_devices": int(n),
      "device_axes": _device_axes(state.worker_scale, n),
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


def _metadata(step, params, opt_state) -> dict:
  stripped = _strip(opt_state)
  return {
      "format": _FORMAT,
      "onebit_format": _VERSION,
      "step": int(step),
      "layout": _layout(opt_state),
      "process_count": jax.process_count(),
      "params": _signature(params),
      "opt_state_treedef": str(jax.tree.structure(stripped)),
      "opt_state": _signature(stripped),
  }


def abstract_state(tx, params, mesh: Optional[Mesh] = None, axis_name: Hashable = "data"):
  """Shapes, dtypes and shardings of the state :func:`init_sharded` would return.

  An Orbax restore needs such a target: without one it cannot rebuild the
  NamedTuple state, and it places the per-device buffers (``local_momentum``,
  ``worker_scale``, the error buffers: global leading axis = devices, sharded
  over ``axis_name``) only where it is told. Fields that do not exist in this
  layout (``server_error`` on one device, ``worker_error`` unless hierarchical)
  are None. Nothing is computed or allocated.

  Args:
    tx: the optimizer (any optax transformation containing 1-bit Adam).
    params: the parameter pytree (arrays or ``jax.ShapeDtypeStruct``).
    mesh: the device mesh; None for a single device (``axis_name=None`` optimizer).
    axis_name: the data-parallel axis of ``mesh`` given to the optimizer.

  Returns:
    A pytree of ``jax.ShapeDtypeStruct`` with shardings, structured like the state.

  Example:
    >>> import jax, jax.numpy as jnp, onebit_optax
    >>> mesh = jax.make_mesh((2,), ('data',))
    >>> tx = onebit_optax.onebit_adam(1e-3, axis_name='data')
    >>> target = onebit_optax.abstract_state(tx, {'w': jnp.ones(300)}, mesh)
    >>> target[0].local_momentum[0].shape, target[0].local_momentum[0].sharding.spec
    ((2, 300), P('data',))
    >>> target[0].momentum_message.shape, target[0].worker_error
    ((2, 40), None)

  References:
    `Orbax checkpointing <https://orbax.readthedocs.io/en/latest/>`_;
    DeepSpeed's 1-bit Adam tutorial (which resets the error buffers on load).
  """
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
  if mesh is None:
    sharding = SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
        jax.eval_shape(tx.init, params))
  specs = _sharding.state_specs_for(tx, params, mesh, axis_name, caller="abstract_state")
  shapes = jax.eval_shape(
      jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs, check_vma=False), params)
  return jax.tree.map(
      lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec)),
      shapes, specs)


def save_checkpoint(directory_or_manager, step: int, params, opt_state) -> bool:
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
  count, instead of silently reinterpreting the arrays.

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

  Returns:
    Whether a checkpoint was written (a manager may skip steps by its options).

  Example:
    >>> import tempfile, jax, jax.numpy as jnp, onebit_optax
    >>> mesh = jax.make_mesh((2,), ('data',))
    >>> tx = onebit_optax.onebit_adam(1e-3, axis_name='data')
    >>> params = {'w': jnp.ones(300)}
    >>> state = onebit_optax.init_sharded(tx, params, mesh)
    >>> with tempfile.TemporaryDirectory() as directory:
    ...   onebit_optax.save_checkpoint(directory, 7, params, state)
    ...   params, state, step = onebit_optax.restore_checkpoint(directory, tx, params, mesh)
    True
    >>> step, state[0].local_momentum[0].shape, state[0].server_error.shape
    (7, (2, 300), (2, 256))

  References:
    `Orbax checkpointing <https://orbax.readthedocs.io/en/latest/>`_;
    DeepSpeed's 1-bit Adam tutorial (which resets the error buffers on load).
  """
  ocp = _orbax()
  metadata = _metadata(step, params, opt_state)
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
  if version == _VERSION:
    return
  if version is None and not str(metadata.get("format", "")).startswith("onebit_optax."):
    raise ValueError(
        f"restore_checkpoint: {where} has no onebit_optax record (item {_META!r} holds no "
        "'onebit_format'); it was not written by onebit_optax.save_checkpoint.")
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


def _check_compatible(where: str, metadata: dict, params, target) -> None:
  """Raises a ValueError naming what differs between the checkpoint and the new run."""
  _check_version(where, metadata)
  lines = _diff(metadata["params"], _signature(params))
  if lines:
    raise ValueError(
        f"restore_checkpoint: {where} was saved for other parameters than `params` "
        "(a different model?):\n  " + "\n  ".join(lines) + "\nPass the parameter tree "
        "(shapes and dtypes) of the run that saved it; a different model needs a fresh "
        "optimizer state (tx.init / init_sharded).")
  # The per-device buffers' and the message's shapes depend on the mesh (the
  # params, checked above, fix the rest): compared apart, in the restore.
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


def _relayout_message(message, params, old: _layout_mod.WireLayout,
                      new: _layout_mod.WireLayout, sharding):
  """The mean momentum of ``message`` (``old`` layout) compressed again for ``new``.

  As at the freeze: the momentum is decoded leaf by leaf, and each compressed
  leaf of the new layout is sent as its signs with one scale per leaf (its
  RMS); exact leaves carry their decoded values.
  """
  shapes = [tuple(np.shape(x)) for x in jax.tree.leaves(params)]

  def move(message):
    exact_old = _wire.message_exact(old, message)
    def leaf(i):
      if i in old.compressed:
        return _wire.message_leaf(old, message, old.compressed.index(i), shapes[i])
      offset = old.exact_offsets[old.exact.index(i)]
      return exact_old[offset:offset + old.sizes[i]].reshape(shapes[i])
    sent = [leaf(i) for i in new.compressed]
    exact = [jnp.ravel(leaf(i)) for i in new.exact]
    scales = (jnp.stack([_wire.leaf_rms(u) for u in sent]) if sent
              else jnp.zeros((0,), jnp.float32))
    exact = jnp.concatenate(exact) if exact else jnp.zeros((0,), jnp.float32)
    return _wire.rows(new, [_wire.leaf_signs(u) for u in sent], scales, exact)

  return jax.jit(move, out_shardings=sharding)(message)


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


def _saved_item(ocp, target, buffers):
  """The restore target on another mesh: the message as saved (moved later), no per-device buffers.

  The per-device buffers get an Orbax placeholder: Orbax would happily reshard
  them onto the new devices.
  """
  placeholder = lambda name: None if buffers[name] is None else ocp.PLACEHOLDER

  def as_saved(state):
    return state._replace(
        local_momentum=(None if buffers["local_momentum"] is None
                        else tuple(ocp.PLACEHOLDER for _ in buffers["local_momentum"])),
        worker_scale=ocp.PLACEHOLDER, worker_error=placeholder("worker_error"),
        server_error=placeholder("server_error"),
        momentum_message=jax.ShapeDtypeStruct(
            tuple(buffers["momentum_message"]), jnp.uint8,
            sharding=state.momentum_message.sharding))
  return _with_state(target, as_saved)


def restore_checkpoint(directory_or_manager, tx, params, mesh: Optional[Mesh] = None,
                       axis_name: Hashable = "data", *, step: Optional[int] = None):
  """Restores what :func:`save_checkpoint` saved, placed for ``mesh``, checking that it fits.

  On the same mesh (device count and layout) the state comes back exactly,
  per-device buffers included, so training continues bit for bit as if never
  interrupted.

  On another device count or mesh layout (flat vs hierarchical, or on one
  device, ``mesh=None``), the per-device buffers cannot be carried over: each
  holds one device's compression residual (``local_momentum``,
  ``worker_scale``, ``worker_error``) or its share of the server chunks
  (``server_error``), and their shapes depend on the mesh. They are reset to
  zero in the new shapes and ``feedback_valid`` to False, with a warning if the
  run was already in the compression phase (during warmup they are still zero,
  so nothing is lost). The compressed mean momentum (``momentum_message``,
  one row per device) is decoded with the saved wire layout and compressed
  again for the new one as the freeze step does (its signs, one scale per
  leaf; exact leaves keep their values), so the first step after the restore
  uses :math:`\\beta_1 C(m)` instead of :math:`\\beta_1 m`. Everything else is
  kept: ``mu``, ``nu``, ``nu_l1``, the phase (``frozen``, ``freeze_step``),
  ``count``, ``skipped_steps`` and the variance-ratio fields, so training goes
  on in the phase it was in.

  A checkpoint of other parameters (names, shapes, dtypes), of another
  optimizer (the state's tree structure, e.g. a different ``optax.chain``), or
  of an older onebit-optax (record without ``onebit_format`` 3: the flat state
  layout, which is not converted) raises a ValueError saying what differs.

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

  Returns:
    ``(params, opt_state, step)``: params replicated over ``mesh`` and the state
    sharded as by :func:`init_sharded` (on ``mesh=None``: on the first local
    device), and the restored step.

  Example:
    >>> import tempfile, warnings, jax, jax.numpy as jnp, onebit_optax
    >>> tx = onebit_optax.onebit_adam(1e-3, axis_name='data', freeze=1)
    >>> params = {'w': jnp.ones(300)}
    >>> state = onebit_optax.init_sharded(tx, params, jax.make_mesh((2,), ('data',)))
    >>> new_mesh = jax.make_mesh((4,), ('data',))  # a restart on 4 devices
    >>> with tempfile.TemporaryDirectory() as directory:
    ...   _ = onebit_optax.save_checkpoint(directory, 3, params, state)
    ...   params, state, step = onebit_optax.restore_checkpoint(directory, tx, params, new_mesh)
    >>> state[0].server_error.shape  # reset for 4 devices (no warning: still warmup)
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

    target = abstract_state(tx, params, mesh, axis_name)
    param_sharding = (SingleDeviceSharding(jax.local_devices()[0]) if mesh is None
                      else NamedSharding(mesh, P()))
    params_target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=param_sharding), params)
    _check_compatible(where, metadata, params_target, target)

    saved_layout, new_layout = metadata["layout"], _layout(target)
    # The same device count with other buffer shapes is another mesh layout
    # (flat vs hierarchical, another threshold of exact leaves): the
    # per-device buffers do not carry over either.
    same_mesh = all(saved_layout[key] == new_layout[key]
                    for key in ("num_devices", "device_axes", "compressed", "buffers"))
    if same_mesh:
      item = target
    else:
      item = _saved_item(ocp, target, saved_layout["buffers"])
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
  frozen = bool(_first_value(state.frozen))
  if frozen:  # in warmup the message was never written: zeros, as on a fresh start
    old_wire = _wire_layout(params_target, saved_layout)
    new_wire = _wire_layout(params_target, new_layout)
    message = _relayout_message(state.momentum_message, params_target, old_wire, new_wire,
                                abstract.momentum_message.sharding)
  else:
    message = _zeros(abstract.momentum_message)
  reset = {name: jax.tree.map(_zeros, getattr(abstract, name)) for name in _PER_DEVICE}
  state = state._replace(**reset, momentum_message=message,
                         feedback_valid=_zeros(abstract.feedback_valid))
  opt_state = _with_state(opt_state, lambda _: state)
  if frozen:
    shapes = ", ".join(
        f"{name} {jax.tree.map(lambda x: tuple(x.shape), getattr(state, name))}"
        for name in _SIZED)
    warnings.warn(
        f"onebit_optax.restore_checkpoint: {where} was saved on "
        f"{saved_layout['num_devices']} devices and is restored onto "
        f"{new_layout['num_devices']} (or another mesh layout). 1-bit Adam's per-device "
        "buffers (local_momentum, worker_scale, worker_error, server_error) hold one "
        "compression residual per device and per chunk of the wire layout, which has no "
        "meaning on another mesh, so they were reset to zero and the error feedback "
        "restarts (feedback_valid=False). The compressed mean momentum (momentum_message) "
        "was decoded with the saved layout and compressed again for the new one as at "
        "the freeze (signs and one scale per leaf), so the next step starts from that "
        f"compressed momentum. New shapes: {shapes}. Everything else was restored exactly: "
        "mu, nu, nu_l1, the phase (frozen, freeze_step="
        f"{int(_first_value(state.freeze_step))}), count="
        f"{int(_first_value(state.count))}, skipped_steps and the variance-ratio "
        "fields; training continues in the compression phase, without the correction "
        "of the residual accumulated before the checkpoint. Restore on "
        f"{saved_layout['num_devices']} devices with the saved mesh layout to resume "
        "bit for bit.",
        UserWarning, stacklevel=2)
  return new_params, opt_state, int(step)
