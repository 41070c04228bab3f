"""What a new user trips on (issue 27): both optimizers refuse the same inputs, with messages that say what to do."""

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import onebit_optax

N = 8


def _zero_one(**kwargs):
  kwargs = {"learning_rate": 0.1, "var_freeze_step": 10, **kwargs}
  return onebit_optax.zero_one_adam(axis_name=None, **kwargs)


def _onebit(**kwargs):
  kwargs = {"learning_rate": 0.1, "freeze": 10, **kwargs}
  return onebit_optax.onebit_adam(axis_name=None, **kwargs)


# --- 1. 0/1 Adam refuses what 1-bit Adam refuses, at construction -------------------------

_REFUSED_BY_BOTH = [
    (dict(learning_rate=float("nan")), "learning_rate=nan must be finite and >= 0"),
    (dict(learning_rate=float("inf")), "learning_rate=inf must be finite and >= 0"),
    (dict(learning_rate=-0.01), r"learning_rate=-0.01 must be finite and >= 0.*negate the loss"),
    (dict(learning_rate=optax.constant_schedule(float("nan"))), r"schedule's value at step 0"),
    (dict(max_update=0.0), r"max_update=0.0 must be > 0.*0 would stop training"),
    (dict(max_update=-1.0), r"max_update=-1.0 must be > 0"),
    (dict(max_update=float("nan")), r"max_update=nan must be > 0"),
    (dict(variance_floor=-1.0), r"variance_floor=-1.0 must be finite and >= 0"),
    (dict(weight_decay=-1.0), r"weight_decay=-1.0 must be finite and >= 0.*grows the weights"),
    (dict(exact_below=-1), r"exact_below=-1 must be an int >= 0"),
    (dict(exact_below=1.5), r"exact_below=1.5 must be an int >= 0"),
    (dict(exact_below="3"), r"exact_below='3' must be an int >= 0"),
]


@pytest.mark.parametrize("make", [_zero_one, _onebit], ids=["zero_one", "onebit"])
@pytest.mark.parametrize("kwargs, match", _REFUSED_BY_BOTH,
                         ids=[f"{next(iter(k))}=" + (
                             "schedule" if callable(next(iter(k.values())))  # (no address in an id)
                             else repr(next(iter(k.values())))) for k, _ in _REFUSED_BY_BOTH])
def test_both_optimizers_refuse_at_construction(make, kwargs, match):
  with pytest.raises(ValueError, match=match):
    make(**kwargs)


@pytest.mark.parametrize("value, kind", [(True, "bool"), ("10", "str"), (10.5, "float"),
                                         (0, "int"), (np.array([10]), "ndarray")])
def test_zero_one_step_counts_must_be_whole_numbers(value, kind):
  with pytest.raises(ValueError, match=rf"var_freeze_step=.* must be an integer >= 1 "
                                       rf"\(a number of steps; got a {kind}\)"):
    _zero_one(var_freeze_step=value)
  with pytest.raises(ValueError, match="var_update_scaler=.* must be an integer >= 1"):
    _zero_one(var_update_scaler=value)


@pytest.mark.parametrize("value", [True, 0, 2.0, "4"])
def test_zero_one_local_steps_must_be_an_int(value):
  with pytest.raises(ValueError, match=r"local_steps=.* must be an int >= 1 \(or None"):
    _zero_one(local_steps=value)


def test_with_local_steps_the_transformation_checks_its_learning_rate():
  with pytest.raises(ValueError, match="scale_by_zero_one_adam: learning_rate=nan"):
    onebit_optax.scale_by_zero_one_adam(axis_name=None, var_freeze_step=10, local_steps=4,
                                        learning_rate=float("nan"))


@pytest.mark.parametrize("make", [_zero_one, _onebit], ids=["zero_one", "onebit"])
def test_an_infinite_max_update_disables_the_clip(make):
  # As scale_by_onebit_adam's docstring says (benchmarks/bounded_update.py's 'none' row uses it).
  tx = make(max_update=float("inf"))
  params = {"w": jnp.ones(3)}
  tx.update(params, tx.init(params), params)


# --- 2. Static arguments under optax.inject_hyperparams -----------------------------------

@pytest.mark.parametrize("static, kwargs", [
    ("local_steps", dict(local_steps=4)),
    ("exact_below", dict(exact_below=8)),
    ("local_steps", dict(local_steps=4, exact_below=8)),
])
def test_inject_hyperparams_names_the_static_args_to_pass(static, kwargs):
  tx = optax.inject_hyperparams(onebit_optax.zero_one_adam)(
      learning_rate=0.1, axis_name=None, var_freeze_step=10, **kwargs)
  with pytest.raises(ValueError, match=re.escape(f"pass static_args=({static!r},) to "
                                                 "optax.inject_hyperparams")):
    tx.init({"w": jnp.ones(3)})


def test_inject_hyperparams_names_exact_below_for_onebit_adam():
  tx = optax.inject_hyperparams(onebit_optax.onebit_adam)(
      learning_rate=0.1, axis_name=None, freeze=10, exact_below=8)
  with pytest.raises(ValueError, match=re.escape("static_args=('exact_below',)")):
    tx.init({"w": jnp.ones(3)})


def test_inject_hyperparams_with_the_static_args_trains():
  static = ("local_steps", "exact_below")
  tx = optax.inject_hyperparams(onebit_optax.zero_one_adam, static_args=static)(
      learning_rate=0.1, axis_name=None, var_freeze_step=3, local_steps=2, exact_below=8)
  params = {"w": jnp.ones(300), "b": jnp.ones(3)}
  state = tx.init(params)
  for _ in range(6):
    updates, state = jax.jit(tx.update)(params, state, params)
    params = optax.apply_updates(params, updates)
  assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(params))


# --- 3. A mismatched leaf is named ----------------------------------------------------------

def _layers():
  return {f"l{i}": {"w": jnp.ones((3 + i, 4 + i)), "b": jnp.ones(4 + i)} for i in range(1, 5)}


@pytest.mark.parametrize("make", [_zero_one, _onebit], ids=["zero_one", "onebit"])
def test_a_transposed_leaf_is_named(make):
  params = _layers()
  tx = make()
  state = tx.init(params)
  grads = {**params, "l2": {**params["l2"], "w": params["l2"]["w"].T}}
  with pytest.raises(ValueError, match=re.escape(
      "other shapes: ['l2']['w']: (6, 5) in the gradients, (5, 6) in the state (transposed)")):
    tx.update(grads, state, params)


@pytest.mark.parametrize("make", [_zero_one, _onebit], ids=["zero_one", "onebit"])
def test_a_missing_or_extra_leaf_is_named(make):
  params = _layers()
  tx = make()
  state = tx.init(params)
  grads = {**params, "l4": {"w": params["l4"]["w"]}, "l5": {"b": jnp.ones(2)}}
  with pytest.raises(ValueError) as excinfo:
    jax.jit(tx.update)(grads, state, params)
  message = str(excinfo.value)
  assert "only in the gradients: ['l5']['b']: (2,)" in message, message
  assert "only in the state: ['l4']['b']: (8,)" in message, message
  assert "['l1']" not in message, message  # the leaves that match are not listed


# --- 4. Empty trees (a partition label or a mask that selects nothing) --------------------

@pytest.mark.parametrize("make", [_zero_one, _onebit], ids=["zero_one", "onebit"])
@pytest.mark.parametrize("params", [{}, {"a": {}}, {"a": jnp.zeros((0, 3))}], ids=str)
def test_empty_params_are_no_work(make, params):
  tx = make()
  state = tx.init(params)
  updates, new_state = jax.jit(tx.update)(params, state, params)
  assert jax.tree.structure(updates) == jax.tree.structure(params)
  assert jax.tree.structure(new_state) == jax.tree.structure(state)


def _train(tx, steps=1):
  """``steps`` of the shard_map recipe on a small linear model (w, b); returns params, state."""
  mesh = jax.make_mesh((N,), ("data",))
  params = jax.device_put({"w": jnp.ones((8, 16)), "b": jnp.zeros(16)},
                          jax.sharding.NamedSharding(mesh, P()))
  x = jax.device_put(jnp.arange(N * 4 * 8, dtype=jnp.float32).reshape(N * 4, 8) / 10.0,
                     jax.sharding.NamedSharding(mesh, P("data")))
  state = onebit_optax.init_sharded(tx, params, mesh)
  specs = onebit_optax.state_partition_specs(state, "data")

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data")),
                     out_specs=(P(), specs))
  def step(params, state, x):
    local = onebit_optax.local_params(params, "data")
    grads = jax.grad(lambda p: jnp.mean((x @ p["w"] + p["b"]) ** 2))(local)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for _ in range(steps):
    params, state = step(params, state, x)
  return params, state


@pytest.mark.parametrize("make", [
    lambda: onebit_optax.zero_one_adam(0.1, axis_name="data", var_freeze_step=2),
    lambda: onebit_optax.onebit_adam(0.1, axis_name="data", freeze=2),
], ids=["zero_one", "onebit"])
def test_a_partition_label_with_no_leaves_trains_under_shard_map(make):
  # optax.partition hands the unused label's optimizer only MaskedNode()s: no parameters.
  labels = {"w": "adam", "b": "adam"}
  tx = optax.partition({"adam": optax.chain(onebit_optax.mean_updates("data"),
                                            optax.adam(0.1)),
                        "onebit": make()}, labels)
  params, _ = _train(tx, steps=3)
  assert float(jnp.max(jnp.abs(params["w"] - 1.0))) > 0.0


@pytest.mark.parametrize("make", [_zero_one, _onebit], ids=["zero_one", "onebit"])
def test_gradients_for_a_state_made_for_nothing_are_refused(make):
  tx = make()
  with pytest.raises(ValueError, match=re.escape("only in the gradients: ['w']: (3,)")):
    tx.update({"w": jnp.ones(3)}, tx.init({}), None)
  with pytest.raises(ValueError, match=re.escape("only in the state: ['w']: (3,)")):
    tx.update({}, tx.init({"w": jnp.ones(3)}), {})


# --- 5. optax.clip_by_global_norm before a communicating optimizer -------------------------

_OPTIMIZERS = {
    "onebit": lambda: onebit_optax.onebit_adam(0.1, axis_name="data", freeze=3),
    "zero_one": lambda: onebit_optax.zero_one_adam(0.1, axis_name="data", var_freeze_step=3),
}


@pytest.mark.parametrize("name", sorted(_OPTIMIZERS))
@pytest.mark.parametrize("nested", [False, True], ids=["chain", "nested_chain"])
def test_optax_clipping_of_local_gradients_warns(name, nested):
  inner = _OPTIMIZERS[name]()
  if nested:
    inner = optax.chain(optax.identity(), inner)
  tx = optax.chain(optax.clip_by_global_norm(1.0), inner)
  with pytest.warns(UserWarning, match=re.escape(
      "optax.clip_by_global_norm before this optimizer (axis_name='data') clips each "
      "device's local gradient by its own norm")) as record:
    _train(tx)
  assert "onebit_optax.clip_by_global_norm(max_norm, axis_name='data')" in str(record[0].message)


@pytest.mark.parametrize("name", sorted(_OPTIMIZERS))
@pytest.mark.parametrize("tx", [
    lambda opt: optax.chain(onebit_optax.clip_by_global_norm(1.0, axis_name="data"), opt),
    lambda opt: optax.chain(opt, optax.clip_by_global_norm(1.0)),  # replicated updates: fine
], ids=["onebit_clip_before", "optax_clip_after"])
def test_clipping_that_agrees_across_devices_does_not_warn(name, tx):
  with warnings.catch_warnings():
    warnings.simplefilter("error", UserWarning)
    _train(tx(_OPTIMIZERS[name]()))


def test_without_an_axis_optax_clipping_is_plain_clipping():
  tx = optax.chain(optax.clip_by_global_norm(1.0), _onebit())
  params = {"w": jnp.ones(3)}
  with warnings.catch_warnings():
    warnings.simplefilter("error", UserWarning)
    updates, _ = tx.update({"w": jnp.array([30.0, 40.0, 0.0])}, tx.init(params), params)
  assert bool(jnp.all(jnp.isfinite(updates["w"])))


def test_init_sharded_of_zero_one_adam_names_the_mesh_axes():
  """0/1 Adam through the shared helper: an axis the mesh lacks is named with the mesh's axes."""
  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  tx = onebit_optax.zero_one_adam(1e-3, axis_name="batch", var_freeze_step=3)
  with pytest.raises(ValueError, match=r"axis_name='batch' is not an axis of the mesh \{'data': 4\}"):
    onebit_optax.init_sharded(tx, {"w": jnp.ones(300)}, mesh, axis_name="batch")
