"""Helpers for the shard_map / pmap recipe: local gradients and state placement."""

from __future__ import annotations

from typing import Hashable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from onebit_optax import _collective
from onebit_optax import _partition
from onebit_optax._compressed_updates import CompressedMeanState
from onebit_optax._onebit_adam import ScaleByOnebitAdamState
from onebit_optax import _zero_one_sharding
from onebit_optax._zero_one_adam import ScaleByZeroOneAdamState

__all__ = ["local_params", "model_replicated", "state_partition_specs", "init_sharded",
           "PER_DEVICE_FIELDS"]

_ONEBIT_PER_DEVICE = ("local_momentum", "worker_scale", "worker_error", "server_error")
# The state fields, of either optimizer, that hold one row per device (sharded over the data
# axis; every other field is replicated): what state_partition_specs gives P(axis_name).
PER_DEVICE_FIELDS = tuple(dict.fromkeys(_ONEBIT_PER_DEVICE + _zero_one_sharding.PER_DEVICE))


def local_params(params, axis_name: Hashable, opt_state=None):
  """Marks replicated params as per-device so that ``jax.grad`` gives *local* gradients.

  Inside ``jax.shard_map`` (with the default ``check_vma=True``), the gradient
  with respect to a replicated input is itself replicated: JAX inserts a float32
  all-reduce of the gradients into the backward pass, which is exactly the
  traffic 1-bit Adam exists to avoid. Casting the params to "varying" first
  (``jax.lax.pcast(..., to='varying')``, free at run time) keeps each device's
  gradient local; the optimizer then does the (compressed) averaging. Under
  ``pmap`` or ``check_vma=False`` gradients are local anyway and this is a no-op.

  With 0/1 Adam's local steps (``zero_one_adam(..., local_steps=H)``) pass the
  optimizer state too: between two syncs each device has moved its own copy
  of the parameters, :math:`\theta + a_i`, where ``params`` is the replicated
  point of the last sync and the state's ``accumulator`` holds this device's
  progress :math:`a_i`; the gradient must be taken there. For every other
  state ``opt_state`` changes nothing (it may always be passed).

  Args:
    params: a pytree of arrays, replicated over ``axis_name``.
    axis_name: the data-parallel mesh axis.
    opt_state: the optimizer state (required with 0/1 Adam's local steps,
      optional otherwise).

  Returns:
    The same values (plus this device's progress with local steps), typed as
    varying over ``axis_name``.

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
  if opt_state is not None:
    params = _zero_one_sharding.at_local_point(params, opt_state)

  def cast(x):
    if axis_name is None or axis_name in _collective._varying_axes(x):
      return x
    try:
      return jax.lax.pcast(x, axis_name, to="varying")
    except (NameError, ValueError) as e:  # ValueError: pcast outside shard_map, eagerly
      raise ValueError(
          f"local_params: axis_name={axis_name!r} is not bound; call it inside the "
          "jax.shard_map / jax.pmap that maps the data-parallel axis.") from e
  return jax.tree.map(cast, params)


def model_replicated(new_params, params, model_axis: Hashable):
  """Types the leaves that ``params`` holds replicated over ``model_axis`` as replicated again.

  With model-parallel parameters the optimizer runs on each device's local
  shards, shaped like them, which differ across ``model_axis``. So
  under ``check_vma`` its updates, and ``optax.apply_updates(params, updates)``,
  are typed as varying over ``model_axis`` even for the leaves every model shard
  holds whole (biases after a row-parallel layer, LayerNorm scales): their values
  are equal on every shard (same gradients, same arithmetic, bit for bit), but
  ``out_specs=P()`` refuses them. This gathers such leaves over ``model_axis``
  and keeps the first copy: one exact ``all_gather(..., to='invarying')`` of
  the replicated leaves only, concatenated (small, and over the model axis, not
  the data axis). Leaves sharded over ``model_axis`` (varying in ``params``) and
  leaves already typed replicated pass through unchanged, with no collective.

  Args:
    new_params: the updated parameters (inside ``shard_map``).
    params: the parameters as the step received them (their types say which
      leaves are replicated over ``model_axis``).
    model_axis: the model-parallel mesh axis.

  Returns:
    ``new_params``, with the replicated leaves typed invariant over ``model_axis``.

  Example:
    >>> import functools, jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> import onebit_optax
    >>> mesh = jax.make_mesh((1,), ('model',))
    >>> @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P('model'), P()),
    ...                    out_specs=(P('model'), P()))
    ... def step(w, b):
    ...   new_b = b + jnp.sum(w)  # depends on the local shard w: typed varying over 'model'
    ...   return onebit_optax.model_replicated((w, new_b), (w, b), 'model')
    >>> w = jax.device_put(jnp.ones(2), jax.NamedSharding(mesh, P('model')))
    >>> step(w, jnp.zeros(1))
    (Array([1., 1.], dtype=float32), Array([2.], dtype=float32))
  """
  axes = _collective.axis_names(model_axis)
  new_leaves, treedef = jax.tree.flatten(new_params)
  old_leaves = treedef.flatten_up_to(params)
  # The leaves to retype: replicated in params, typed varying in new_params.
  todo = [i for i, (new, old) in enumerate(zip(new_leaves, old_leaves))
          if not all(a in _collective._varying_axes(old) for a in axes)
          and any(a in _collective._varying_axes(new) for a in axes)]
  by_dtype = {}
  for i in todo:
    by_dtype.setdefault(jnp.result_type(new_leaves[i]), []).append(i)
  for indices in by_dtype.values():  # one gather per dtype, of all such leaves at once
    flat = jnp.concatenate([jnp.ravel(new_leaves[i]) for i in indices])
    flat = jax.lax.all_gather(flat, axes, to="invarying")[0]
    offset = 0
    for i in indices:
      size = int(np.prod(np.shape(new_leaves[i])))
      new_leaves[i] = flat[offset:offset + size].reshape(np.shape(new_leaves[i]))
      offset += size
  return jax.tree.unflatten(treedef, new_leaves)


def _device_axes(axis_name: Hashable, model_axis: Optional[Hashable]):
  """The mesh axes that number the devices holding one error buffer each, data axes first."""
  axes = _collective.axis_names(axis_name, model_axis)
  return axes[0] if len(axes) == 1 else axes


def state_partition_specs(opt_state, axis_name: Hashable,
                          model_axis: Optional[Hashable] = None, *, param_specs=None):
  """PartitionSpecs for an optimizer state holding a 1-bit Adam (or 0/1 Adam) state.

  The per-device buffers (``local_momentum``, ``worker_scale``, the error
  buffers) are sharded over the data axis on their leading axis
  (``P(axis_name)``); all other leaves (counters, the moments, flags, the
  momentum message, other transformations' state) are replicated (``P()``).
  Use the result as ``in_specs``/``out_specs`` of the training step and for
  ``NamedSharding``.

  ``axis_name`` may be a tuple of mesh axes (hierarchical data parallelism, e.g.
  ``('node', 'local')``, as given to the optimizer): the per-device buffers are
  then sharded over all of them, ``P(('node', 'local'))``.

  With ``model_axis`` (parameters sharded over a model-parallel mesh axis, the
  optimizer built with ``model_axis=...``), each device runs the optimizer on its
  local parameter shards:

  - ``mu`` and ``nu`` are shaped like the parameters and sharded like them:
    ``param_specs`` (required then);
  - ``momentum_message`` and ``nu_l1`` differ across ``model_axis``:
    ``P(model_axis)``;
  - the per-device buffers: ``P((axis_name, model_axis))``, globally one row
    per device, row ``data_index * model_size + model_index``.

  Other transformations' state (e.g. an ``optax.partition`` branch that mirrors
  the parameters) is given ``P()``; with model-sharded parameters such a state
  needs the parameters' specs instead: build those specs yourself.

  Args:
    opt_state: the optimizer state (or its ``jax.eval_shape``).
    axis_name: the data-parallel mesh axis (or tuple of axes).
    model_axis: the model-parallel mesh axis the parameters are sharded over,
      or None (parameters replicated on every device).
    param_specs: with ``model_axis``, the parameters' PartitionSpecs (a pytree
      or prefix), which ``mu`` and ``nu`` follow.

  Returns:
    A pytree of ``PartitionSpec`` with the structure of ``opt_state``.

  Example:
    >>> import jax.numpy as jnp, onebit_optax
    >>> from jax.sharding import PartitionSpec as P
    >>> tx = onebit_optax.onebit_adam(1e-3, axis_name=None)
    >>> specs = onebit_optax.state_partition_specs(tx.init({'w': jnp.ones(300)}), 'data')
    >>> specs[0].local_momentum, specs[0].mu, specs[0].count
    ((P('data',),), {'w': P()}, P())
    >>> specs = onebit_optax.state_partition_specs(
    ...     tx.init({'w': jnp.ones(300)}), 'data', model_axis='model',
    ...     param_specs={'w': P('model')})
    >>> specs[0].mu, specs[0].worker_scale, specs[0].momentum_message
    ({'w': P('model',)}, P(('data', 'model'),), P('model',))

  References:
    `jax.shard_map <https://docs.jax.dev/en/latest/notebooks/shard_map.html>`_.
  """
  per_device = P(_device_axes(axis_name, model_axis))
  per_model_shard = P() if model_axis is None else P(model_axis)
  if model_axis is not None and param_specs is None:
    raise ValueError(
        "state_partition_specs: with model_axis, pass param_specs= (the parameters' "
        "PartitionSpecs): the moments are shaped and sharded like the parameters.")

  def moments_specs(tree):
    if param_specs is None:
      return jax.tree.map(lambda _: P(), tree)
    return jax.tree.map(lambda spec, sub: jax.tree.map(lambda _: spec, sub), param_specs,
                        tree, is_leaf=_is_spec)

  def spec(node):
    if isinstance(node, ScaleByOnebitAdamState):
      replicated = jax.tree.map(lambda _: P(), node)
      return replicated._replace(
          mu=moments_specs(node.mu), nu=moments_specs(node.nu),
          momentum_message=per_model_shard, nu_l1=per_model_shard,
          **{name: jax.tree.map(lambda _: per_device, getattr(node, name))
             for name in _ONEBIT_PER_DEVICE})
    if isinstance(node, CompressedMeanState):
      replicated = jax.tree.map(lambda _: P(), node)
      return replicated._replace(worker_error=per_device, server_error=per_device)
    if isinstance(node, ScaleByZeroOneAdamState):
      if model_axis is not None:
        raise ValueError("state_partition_specs: 0/1 Adam has no model_axis (data-parallel "
                         "meshes only); pass model_axis=None.")
      return _zero_one_sharding.partition_specs(node, axis_name)
    return P()
  return jax.tree.map(
      spec, opt_state, is_leaf=lambda x: isinstance(
          x, (ScaleByOnebitAdamState, CompressedMeanState, ScaleByZeroOneAdamState)))


def _is_spec(x) -> bool:
  return isinstance(x, P)


def _abstract_on(params, mesh: Mesh, param_specs):
  """``params`` as ShapeDtypeStructs sharded on ``mesh`` by ``param_specs`` (a pytree prefix)."""
  def leaf(x, spec):
    dtype = jax.dtypes.canonicalize_dtype(x.dtype if hasattr(x, "dtype") else np.result_type(x))
    return jax.ShapeDtypeStruct(np.shape(x), dtype, sharding=NamedSharding(mesh, spec))
  return jax.tree.map(lambda spec, sub: jax.tree.map(lambda x: leaf(x, spec), sub),
                      param_specs, params, is_leaf=_is_spec)


def _check_axes(mesh: Mesh, axis_name, model_axis, caller: str) -> None:
  """Both axes are axes of ``mesh``, and they do not overlap."""
  for name, axes in (("axis_name", axis_name), ("model_axis", model_axis)):
    if axes is None and name == "model_axis":
      continue
    missing = [a for a in _collective.axis_names(axes) or (None,) if a not in mesh.axis_names]
    if missing:
      what = ("the data-parallel axis the optimizer was built with" if name == "axis_name"
              else "the mesh axis the parameters are sharded over")
      raise ValueError(
          f"{caller}: {name}={axes!r} is not an axis of the mesh "
          f"{dict(mesh.shape)}; pass {what}.")
  if model_axis is not None and set(_collective.axis_names(model_axis)) & set(_collective.axis_names(axis_name)):
    raise ValueError(
        f"{caller}: model_axis={model_axis!r} overlaps axis_name={axis_name!r}; the "
        "parameters are sharded over the model axis and replicated over the data axis.")


def state_specs_for(tx, params, mesh: Mesh, axis_name: Hashable, *, caller: str,
                    param_specs=None, model_axis: Optional[Hashable] = None):
  """PartitionSpecs of the state ``tx.init(params)`` makes under ``shard_map`` on ``mesh``."""
  _check_axes(mesh, axis_name, model_axis, caller)
  if param_specs is None:
    param_specs = P()
  else:
    # Abstract params that carry their sharding: under a mesh with explicit axes,
    # shard_map checks its in_specs against the arguments' shardings.
    params = _abstract_on(params, mesh, param_specs)
  # One abstract trace with replicated outputs gives the state's structure; the
  # specs then say which leaves are per device.
  abstract = jax.eval_shape(
      jax.shard_map(tx.init, mesh=mesh, in_specs=(param_specs,), out_specs=P(),
                    check_vma=False), params)
  return state_partition_specs(abstract, axis_name, model_axis,
                               param_specs=None if model_axis is None else param_specs)


def _spec_axes(param_specs) -> set:
  """The mesh axes named anywhere in a pytree (prefix) of PartitionSpecs."""
  axes = set()
  for spec in jax.tree.leaves(param_specs, is_leaf=_is_spec):
    for entry in spec if isinstance(spec, P) else ():
      if entry is not None:
        axes.update(_collective.axis_names(entry))
  return axes


def _check_param_specs(param_specs, axis_name, model_axis, caller: str) -> None:
  named = _spec_axes(param_specs)
  on_data = named & set(_collective.axis_names(axis_name))
  if on_data:
    raise ValueError(
        f"{caller}: param_specs shard the parameters over {sorted(on_data)}, the "
        f"data-parallel axis ({axis_name!r}): with 1-bit Adam the parameters are "
        "replicated over the data axis (each data replica holds the whole model, or its "
        "model shard) and only the batch is split over it.")
  other = named - set(_collective.axis_names(model_axis))
  if other:
    raise ValueError(
        f"{caller}: param_specs shard the parameters over {sorted(other)}, but "
        f"model_axis={model_axis!r}. Pass the model-parallel axis as model_axis= (here "
        f"and to onebit_adam(..., model_axis=...)).")


def _check_concrete(params, caller: str) -> None:
  """Refuses abstract parameters (``jax.ShapeDtypeStruct``): ``init`` needs values to place."""
  abstract = [jax.tree_util.keystr(path) for path, leaf in
              jax.tree_util.tree_leaves_with_path(params)
              if isinstance(leaf, jax.ShapeDtypeStruct)]
  if abstract:
    raise TypeError(
        f"{caller}: the parameters are abstract (jax.ShapeDtypeStruct at {abstract[0]}"
        f"{f' and {len(abstract) - 1} more' if len(abstract) > 1 else ''}): init_sharded "
        "creates the state's arrays on the mesh and needs concrete parameters. For the "
        "state's shapes and shardings without values (e.g. as the target of a checkpoint "
        "restore), use onebit_optax.abstract_state(tx, params, mesh, axis_name), which "
        "takes ShapeDtypeStructs.")


def init_sharded(tx, params, mesh: Mesh, axis_name: Hashable = "data", *,
                 param_specs=None, model_axis: Optional[Hashable] = None):
  """Runs ``tx.init(params)`` under ``shard_map`` and returns a correctly sharded state.

  The 1-bit Adam state needs the size of the data-parallel axis (to pad and
  split its buffers) and one error buffer per device, so its ``init`` runs inside
  the mapped region. This does that: per-device buffers come out sharded over
  ``axis_name`` (global leading axis = number of devices), the rest replicated.

  For a data × model mesh, pass the parameters' ``param_specs`` (a pytree, or
  prefix, of ``PartitionSpec`` naming only ``model_axis``) and ``model_axis``:
  ``init`` then runs on each device's local shards, and the state comes out as
  :func:`state_partition_specs` with ``model_axis`` says (moments per model
  shard, error buffers per device).

  Args:
    tx: the optimizer (any optax transformation containing 1-bit Adam).
    params: the parameter pytree (global arrays; replicated values without
      ``param_specs``).
    mesh: the device mesh.
    axis_name: the data-parallel axis of ``mesh`` given to the optimizer.
    param_specs: the parameters' ``PartitionSpec`` s over ``model_axis`` (None:
      replicated).
    model_axis: the model-parallel axis of ``mesh`` given to the optimizer, or
      None.

  Returns:
    The optimizer state, placed on ``mesh``.

  Example:
    >>> import jax, jax.numpy as jnp, onebit_optax
    >>> mesh = jax.make_mesh((1,), ('data',))
    >>> tx = onebit_optax.onebit_adam(1e-3, axis_name='data')
    >>> state = onebit_optax.init_sharded(tx, {'w': jnp.ones(300)}, mesh)
    >>> state[0].local_momentum[0].shape  # (devices, leaves of this shape, *shape)
    (1, 1, 300)

    A (data, model) mesh with a column-sharded matrix (on 1 × 1 devices here):

    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((1, 1), ('data', 'model'))
    >>> state = onebit_optax.init_sharded(
    ...     tx, {'w': jnp.ones((4, 6))}, mesh, 'data',
    ...     param_specs={'w': P(None, 'model')}, model_axis='model')
    >>> state[0].mu['w'].sharding.spec, state[0].worker_scale.sharding.spec[0]
    (P(None, 'model'), ('data', 'model'))

  References:
    `jax.shard_map <https://docs.jax.dev/en/latest/notebooks/shard_map.html>`_.
  """
  caller = "init_sharded"
  _check_concrete(params, caller)
  _check_axes(mesh, axis_name, model_axis, caller)
  if param_specs is not None:
    _check_param_specs(param_specs, axis_name, model_axis, caller)
  specs = state_specs_for(tx, params, mesh, axis_name, caller=caller,
                          param_specs=param_specs, model_axis=model_axis)
  # Host arrays are cast to their JAX dtype first: on a multi-process mesh,
  # device_put checks that every process passed the same value by comparing the
  # host array with the device copies, which fails for float64 numpy with x64 off.
  params = jax.tree.map(
      lambda x: np.asarray(x, jax.dtypes.canonicalize_dtype(np.asarray(x).dtype))
      if isinstance(x, (np.ndarray, np.generic, float, int)) else x, params)
  in_specs = P() if param_specs is None else param_specs
  params = jax.device_put(params, jax.tree.map(
      lambda spec: NamedSharding(mesh, spec), in_specs, is_leaf=_is_spec))
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(in_specs,),
                                out_specs=specs))(params)
  if model_axis is None:  # optax.masked / partition beside 1-bit Adam: every update replicated?
    _partition.check_updates_replicated(tx, params, state, mesh, axis_name, specs, caller)
  return state
