"""Orbax checkpoints that resume 1-bit Adam exactly, per-device error buffers included."""

from __future__ import annotations

import warnings
from typing import Hashable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from onebit_optax._onebit_adam import ScaleByOnebitAdamState
from onebit_optax import _sharding

__all__ = ["save_checkpoint", "restore_checkpoint", "abstract_state"]

# Names of the items of one checkpoint step (folders under directory/<step>/).
_PARAMS = "params"
_OPT_STATE = "opt_state"
_META = "onebit_optax"
_FORMAT = "onebit_optax.checkpoint/1"
_MAX_DIFFS = 8  # differences listed in a mismatch error


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


def _find(opt_state) -> tuple[tuple, ScaleByOnebitAdamState]:
  """Key path and value of the single 1-bit Adam state inside ``opt_state``."""
  is_state = lambda x: isinstance(x, ScaleByOnebitAdamState)
  found = [(path, node) for path, node in
           jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=is_state)[0]
           if is_state(node)]
  if len(found) != 1:
    raise ValueError(
        f"Expected exactly one 1-bit Adam state inside the optimizer state, found "
        f"{len(found)}. Pass the state of onebit_adam / scale_by_onebit_adam (possibly "
        "inside optax.chain, inject_hyperparams, masked, ...).")
  return found[0]


def _error_paths(opt_state, names=("worker_error", "server_error")) -> tuple[str, ...]:
  path, _ = _find(opt_state)
  return tuple(jax.tree_util.keystr((*path, jax.tree_util.GetAttrKey(name)))
               for name in names)


def _flat_paths(opt_state) -> tuple[str, ...]:
  """The flat moment buffers: their padded tail depends on the device count."""
  return _error_paths(opt_state, ("mu", "nu"))


def _relayout(x, abstract):
  """A flat moment buffer cut or zero-extended at its tail (leaf offsets do not move)."""
  def move(v):
    kept = v[:min(v.shape[0], abstract.shape[0])]
    return jnp.pad(kept, (0, abstract.shape[0] - kept.shape[0]))
  return jax.jit(move, out_shardings=abstract.sharding)(x)


def _signature(tree) -> list:
  """``[key path, shape, dtype]`` of every leaf, in flattening order (JSON-able)."""
  return [[jax.tree_util.keystr(path), [int(d) for d in np.shape(leaf)],
           str(np.dtype(leaf.dtype) if hasattr(leaf, "dtype") else np.asarray(leaf).dtype)]
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _layout(opt_state) -> dict:
  """Device count and buffer sizes of a state in the shard_map (or 1-device) layout."""
  _, state = _find(opt_state)
  size = int(np.prod(np.shape(state.mu)))
  worker, server = np.shape(state.worker_error), np.shape(state.server_error)
  n = worker[0] if len(worker) == 2 else 0
  # worker_error covers the whole buffer, or a 1/L slice under hierarchical averaging.
  if (np.ndim(state.count) != 0 or len(worker) != 2 or n < 1 or np.ndim(state.mu) != 1
      or worker[1] < 1 or size % worker[1] or server != (n, size // n)):
    raise ValueError(
        "The 1-bit Adam state does not have the layout of onebit_optax.init_sharded "
        f"(global error buffers (devices, padded)): count has shape {np.shape(state.count)}, "
        f"worker_error {worker}, server_error {server}, mu {np.shape(state.mu)}. Checkpoint "
        "the state returned by the shard_map training step (out_specs="
        "onebit_optax.state_partition_specs(...)), or by tx.init with axis_name=None. "
        "A pmap state (a leading device axis on every leaf) is not supported.")
  return {"num_devices": int(n), "padded_size": int(size)}


def _metadata(step, params, opt_state) -> dict:
  return {
      "format": _FORMAT,
      "step": int(step),
      **_layout(opt_state),
      "process_count": jax.process_count(),
      "error_paths": list(_error_paths(opt_state)),
      "params": _signature(params),
      "opt_state_treedef": str(jax.tree.structure(opt_state)),
      "opt_state": _signature(opt_state),
  }


def abstract_state(tx, params, mesh: Optional[Mesh] = None, axis_name: Hashable = "data"):
  """Shapes, dtypes and shardings of the state :func:`init_sharded` would return.

  An Orbax restore needs such a target: without one it cannot rebuild the
  NamedTuple state, and it places the per-device error buffers (global shape
  ``(devices, padded)``, sharded over ``axis_name``) only where it is told.
  Nothing is computed or allocated.

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
    >>> target = onebit_optax.abstract_state(tx, {'w': jnp.ones(3)}, mesh)
    >>> target[0].worker_error.shape, target[0].worker_error.sharding.spec
    ((2, 256), P('data',))

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
  convergence), every device's ``worker_error`` and ``server_error`` are saved
  (each process writes its own rows), so :func:`restore_checkpoint` resumes bit
  for bit. Beside them goes a small JSON record of the device count, the buffer
  sizes and the shapes and structure of both trees, which lets the restore
  refuse a mismatched model or optimizer, and detect a new device count, instead
  of silently reinterpreting the arrays.

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
    >>> params = {'w': jnp.ones(3)}
    >>> state = onebit_optax.init_sharded(tx, params, mesh)
    >>> with tempfile.TemporaryDirectory() as directory:
    ...   onebit_optax.save_checkpoint(directory, 7, params, state)
    ...   params, state, step = onebit_optax.restore_checkpoint(directory, tx, params, mesh)
    True
    >>> step, state[0].worker_error.shape
    (7, (2, 256))

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


def _check_compatible(where: str, metadata: dict, params, target) -> None:
  """Raises a ValueError naming what differs between the checkpoint and the new run."""
  if metadata.get("format") != _FORMAT:
    raise ValueError(
        f"restore_checkpoint: {where} has checkpoint format {metadata.get('format')!r}; "
        f"this version of onebit_optax reads {_FORMAT!r}.")
  lines = _diff(metadata["params"], _signature(params))
  if lines:
    raise ValueError(
        f"restore_checkpoint: {where} was saved for other parameters than `params` "
        "(a different model?):\n  " + "\n  ".join(lines) + "\nPass the parameter tree "
        "(shapes and dtypes) of the run that saved it; a different model needs a fresh "
        "optimizer state (tx.init / init_sharded).")
  error_paths = set(metadata["error_paths"])
  # The error buffers' and the flat moments' shapes depend on the device count
  # (the params, checked above, fix the rest): compared separately.
  sized_paths = error_paths | set(_flat_paths(target))
  strip = lambda sig: [[p, s if p not in sized_paths else ["devices", "..."], d]
                       for p, s, d in sig]
  lines = _diff(strip(metadata["opt_state"]), strip(_signature(target)))
  treedef = str(jax.tree.structure(target))
  if lines or metadata["opt_state_treedef"] != treedef or set(_error_paths(target)) != error_paths:
    detail = ("\n  ".join(lines) if lines
              else _first_difference(metadata["opt_state_treedef"], treedef))
    raise ValueError(
        f"restore_checkpoint: {where} holds the state of another optimizer than `tx` "
        f"(a different optax.chain, transformation or dtype):\n  {detail}\nBuild tx as "
        "in the run that saved it; a different optimizer needs a fresh state.")


def _first_value(x):
  return np.asarray(x.addressable_shards[0].data if hasattr(x, "addressable_shards") else x)


def restore_checkpoint(directory_or_manager, tx, params, mesh: Optional[Mesh] = None,
                       axis_name: Hashable = "data", *, step: Optional[int] = None):
  """Restores what :func:`save_checkpoint` saved, placed for ``mesh``, checking that it fits.

  On the same number of devices the state comes back exactly, error buffers
  included, so training continues bit for bit as if never interrupted.

  On a different number of devices (or on one device, ``mesh=None``), the
  per-device error buffers cannot be carried over: each holds one device's
  compression residual (and its share of the server chunks), and their shapes
  depend on the device count. They are reset to zero in the new shapes, with a
  warning if the run was already in the compression phase (during warmup they
  are still zero, so nothing is lost). Everything else is kept: ``mu``, ``nu``,
  the phase (``frozen``, ``freeze_step``), ``count``, ``skipped_steps`` and the
  variance-ratio fields, so training goes on in the phase it was in.

  A checkpoint of other parameters (names, shapes, dtypes) or of another
  optimizer (the state's tree structure, e.g. a different ``optax.chain``)
  raises a ValueError saying what differs.

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
    >>> params = {'w': jnp.ones(3)}
    >>> state = onebit_optax.init_sharded(tx, params, jax.make_mesh((2,), ('data',)))
    >>> new_mesh = jax.make_mesh((4,), ('data',))  # a restart on 4 devices
    >>> with tempfile.TemporaryDirectory() as directory:
    ...   _ = onebit_optax.save_checkpoint(directory, 3, params, state)
    ...   params, state, step = onebit_optax.restore_checkpoint(directory, tx, params, new_mesh)
    >>> state[0].worker_error.shape  # reset for 4 devices (no warning: still warmup)
    (4, 512)

  References:
    `Orbax checkpointing <https://orbax.readthedocs.io/en/latest/>`_;
    DeepSpeed's 1-bit Adam tutorial (which resets the error buffers on load).
  """
  ocp = _orbax()
  manager, owned = _open(directory_or_manager, create=False)  # reading creates nothing
  try:
    where = f"the checkpoint in {manager.directory}"
    if step is None:
      step = manager.latest_step()
      if step is None:
        raise FileNotFoundError(f"restore_checkpoint: no checkpoint in {manager.directory}.")
    elif step not in manager.all_steps():
      raise FileNotFoundError(
          f"restore_checkpoint: no step {step} in {manager.directory}; it holds steps "
          f"{sorted(manager.all_steps())}.")
    where = f"the checkpoint of step {step} in {manager.directory}"
    try:
      metadata = manager.restore(
          step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))[_META]
    except Exception as e:  # pylint: disable=broad-except
      raise ValueError(
          f"restore_checkpoint: {where} has no onebit_optax record (item {_META!r}); it "
          "was not written by onebit_optax.save_checkpoint.") from e
    if not isinstance(metadata, dict):
      raise ValueError(
          f"restore_checkpoint: {where} has no onebit_optax record (item {_META!r}); it "
          "was not written by onebit_optax.save_checkpoint.")

    target = abstract_state(tx, params, mesh, axis_name)
    param_sharding = (SingleDeviceSharding(jax.local_devices()[0]) if mesh is None
                      else NamedSharding(mesh, P()))
    params_target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=param_sharding), params)
    _check_compatible(where, metadata, params_target, target)

    error_paths = set(metadata["error_paths"])
    saved_errors = {p: (tuple(s), d) for p, s, d in metadata["opt_state"] if p in error_paths}
    new_errors = {p: (tuple(s), d) for p, s, d in _signature(target) if p in error_paths}
    new_layout = _layout(target)
    # The same device count with other error shapes is another mesh layout (e.g.
    # flat vs hierarchical averaging): the residuals do not carry over either.
    same_devices = (metadata["num_devices"] == new_layout["num_devices"]
                    and saved_errors == new_errors)

    # The error buffers are per device: on another device count they are not read
    # at all (an Orbax placeholder), since Orbax would happily reshard them.
    flat_paths = set(_flat_paths(target))
    saved_shapes = {p: tuple(s) for p, s, _ in metadata["opt_state"]}
    def skip(path, x):
      key = jax.tree_util.keystr(path)
      if same_devices or key not in error_paths | flat_paths:
        return x
      if key in flat_paths:  # read as saved, cut or extended below
        return jax.ShapeDtypeStruct(saved_shapes[key], x.dtype, sharding=x.sharding)
      return ocp.PLACEHOLDER
    item = jax.tree_util.tree_map_with_path(skip, target)
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
  if not same_devices:
    def zeros(path, x, abstract):
      if jax.tree_util.keystr(path) in flat_paths:
        return _relayout(x, abstract)
      if jax.tree_util.keystr(path) not in error_paths:
        return x
      return jax.jit(lambda: jnp.zeros(abstract.shape, abstract.dtype),
                     out_shardings=abstract.sharding)()
    opt_state = jax.tree_util.tree_map_with_path(zeros, opt_state, target)
    _, state = _find(opt_state)
    if bool(_first_value(state.frozen)):
      warnings.warn(
          f"onebit_optax.restore_checkpoint: {where} was saved on "
          f"{metadata['num_devices']} devices and is restored onto "
          f"{new_layout['num_devices']} (or another mesh layout). 1-bit Adam's error-feedback buffers "
          "(worker_error, server_error) hold one compression residual per device and "
          "per chunk of the flat buffer, which has no meaning on another device count, "
          "so they were reset to zero (new shapes "
          f"{state.worker_error.shape} and {state.server_error.shape}). Everything "
          "else was restored exactly: mu, nu, the phase (frozen, freeze_step="
          f"{int(_first_value(state.freeze_step))}), count="
          f"{int(_first_value(state.count))}, skipped_steps and the variance-ratio "
          "fields; training continues in the compression phase, without the "
          "correction of the residual accumulated before the checkpoint. Restore on "
          f"{metadata['num_devices']} devices to resume bit for bit.",
          UserWarning, stacklevel=2)
  return new_params, opt_state, int(step)
