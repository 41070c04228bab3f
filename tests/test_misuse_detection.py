"""Misuse that used to pass silently or fail with somebody else's message now says what to do.

b1/b2/eps out of range; ``axis_name=None`` inside a mapped region (the replicas
would drift apart with no error); ``optax.MultiSteps`` and ``optax.apply_if_finite``
around a communicating 1-bit Adam; a ``pmap`` state or ``P()`` specs handed to a
``shard_map`` step.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import onebit_optax

N = 8


def _assert_words(excinfo, *words):
  message = str(excinfo.value)
  for word in words:
    assert word in message, f"{word!r} not in: {message}"


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((N,), ("data",))


def _params():
  return {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.zeros(4)}


def _loss(params, x):
  return jnp.sum((x @ params["w"] + params["b"]) ** 2)


def _batch(mesh):
  x = jax.random.normal(jax.random.key(0), (N * 2, 3))
  return jax.device_put(x, NamedSharding(mesh, P("data")))


def _stacked(tree):
  return jax.tree.map(lambda x: jnp.stack([x] * N), tree)


# --- b1, b2, eps ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,words", [
    (dict(b2=1.0), ["b2=1.0", "[0, 1)", "NaN"]),
    (dict(b2=1.5), ["b2=1.5", "[0, 1)"]),
    (dict(b2=-0.1), ["b2=-0.1", "[0, 1)"]),
    (dict(b1=1.0), ["b1=1.0", "[0, 1)"]),
    (dict(b1=-0.5), ["b1=-0.5", "[0, 1)"]),
    (dict(eps=-1e-8), ["eps=-1e-08", ">= 0"]),
    (dict(b2=np.float32(1.0)), ["b2=1.0", "[0, 1)"]),
    (dict(b2=jnp.array(1.0)), ["b2=1.0", "[0, 1)"]),
])
def test_decay_rates_and_eps_out_of_range(kwargs, words):
  for make in (functools.partial(onebit_optax.onebit_adam, 1e-3),
               onebit_optax.scale_by_onebit_adam):
    with pytest.raises(ValueError) as excinfo:
      make(axis_name=None, **kwargs)
    _assert_words(excinfo, *words)


def test_edges_of_the_ranges_are_accepted():
  tx = onebit_optax.onebit_adam(1e-3, b1=0.0, b2=0.0, eps=0.0, axis_name=None)
  params = {"w": jnp.ones(3)}
  updates, _ = tx.update({"w": jnp.ones(3)}, tx.init(params), params)
  assert np.all(np.isfinite(updates["w"]))


def test_injected_b2_of_one_is_refused_at_init():
  # inject_hyperparams builds the optimizer with concrete arrays in init: checkable there.
  tx = optax.inject_hyperparams(onebit_optax.onebit_adam)(1e-3, b2=1.0, axis_name=None)
  with pytest.raises(ValueError) as excinfo:
    tx.init({"w": jnp.ones(3)})
  _assert_words(excinfo, "b2=1.0", "[0, 1)")


def test_injected_valid_decay_rates_still_trace():
  tx = optax.inject_hyperparams(onebit_optax.onebit_adam)(1e-3, b2=0.99, axis_name=None)
  params = {"w": jnp.ones(3)}
  updates, state = jax.jit(tx.update)({"w": jnp.ones(3)}, tx.init(params), params)
  assert np.all(np.isfinite(updates["w"]))


# --- axis_name=None inside a mapped region ----------------------------------------------------

def test_axis_name_none_inside_pmap():
  tx = onebit_optax.onebit_adam(1e-3, axis_name=None)
  with pytest.raises(ValueError) as excinfo:
    jax.pmap(tx.init, axis_name="batch")(_stacked(_params()))
  _assert_words(excinfo, "axis_name=None", "'batch'", "axis_name='batch'", "drift apart")


def test_axis_name_none_inside_pmap_update():
  # The state made outside, the update inside pmap: caught at the update.
  tx = onebit_optax.onebit_adam(1e-3, axis_name=None)
  state = _stacked(tx.init(_params()))
  with pytest.raises(ValueError) as excinfo:
    jax.pmap(lambda g, s: tx.update(g, s)[1], axis_name="batch")(_stacked(_params()), state)
  _assert_words(excinfo, "axis_name=None", "'batch'")


def test_axis_name_none_inside_shard_map_without_check_vma(mesh):
  tx = onebit_optax.onebit_adam(1e-3, axis_name=None)
  f = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
  with pytest.raises(ValueError) as excinfo:
    jax.jit(f)(_params())
  _assert_words(excinfo, "axis_name=None", "'data'", "drift apart")


def test_init_sharded_with_an_optimizer_built_without_an_axis(mesh):
  tx = onebit_optax.onebit_adam(1e-3, axis_name=None)
  with pytest.raises(ValueError) as excinfo:
    onebit_optax.init_sharded(tx, _params(), mesh, "data")
  _assert_words(excinfo, "axis_name=None", "axis_name='data'")


def test_axis_name_none_inside_shard_map_with_check_vma(mesh):
  # Used to be a TypeError from a lax.cond in _collective.py suggesting pcast.
  tx = onebit_optax.onebit_adam(1e-3, axis_name=None)
  params = _params()
  state = tx.init(params)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(), P("data")),
                     out_specs=P())
  def step(params, state, x):
    grads = jax.grad(_loss)(onebit_optax.local_params(params, "data"), x)
    return tx.update(grads, state, params)[0]

  with pytest.raises(ValueError) as excinfo:
    step(params, state, _batch(mesh))
  _assert_words(excinfo, "inside jax.shard_map", "data axis must be named", "axis_name='data'")


def test_named_vmap_and_size_one_meshes_are_not_mapped_regions():
  # vmap with an axis name (an ensemble of optimizers) and a 1-device mesh cannot diverge.
  tx = onebit_optax.onebit_adam(1e-3, axis_name=None)
  jax.vmap(tx.init, axis_name="ensemble")(_stacked(_params()))
  one = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
  jax.jit(jax.shard_map(tx.init, mesh=one, in_specs=P(), out_specs=P(), check_vma=False))(
      _params())


# --- wrappers ---------------------------------------------------------------------------------

def test_multi_steps_under_pmap_names_accumulate_gradients():
  multi = optax.MultiSteps(onebit_optax.onebit_adam(1e-3, axis_name="data"), every_k_schedule=4)
  params = _stacked(_params())
  state = jax.pmap(multi.init, axis_name="data")(params)

  def step(params, state):
    return multi.update(jax.grad(_loss)(params, jnp.ones((2, 3))), state, params)

  with pytest.raises(ValueError) as excinfo:
    jax.pmap(step, axis_name="data")(params, state)
  _assert_words(excinfo, "optax.MultiSteps", "onebit_optax.accumulate_gradients",
                "every mini-step")


def test_multi_steps_under_shard_map_names_accumulate_gradients(mesh):
  # Used to raise "the gradients are replicated ... take local_params" although it was used.
  multi = optax.MultiSteps(onebit_optax.onebit_adam(1e-3, axis_name="data"), every_k_schedule=4)
  params = _params()
  state = onebit_optax.init_sharded(multi, params, mesh)
  specs = onebit_optax.state_partition_specs(state, "data")

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data")),
                     out_specs=(P(), specs))
  def step(params, state, x):
    grads = jax.grad(_loss)(onebit_optax.local_params(params, "data"), x)
    return multi.update(grads, state, params)

  with pytest.raises(ValueError) as excinfo:
    step(params, state, _batch(mesh))
  _assert_words(excinfo, "optax.MultiSteps", "onebit_optax.accumulate_gradients")


def test_apply_if_finite_under_shard_map_says_steps_are_already_skipped(mesh):
  # Used to be a TypeError from optax's lax.cond (mismatched manual axis types).
  tx = optax.apply_if_finite(onebit_optax.onebit_adam(1e-3, axis_name="data"), 5)
  params = _params()
  state = onebit_optax.init_sharded(tx, params, mesh)
  specs = onebit_optax.state_partition_specs(state, "data")

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data")),
                     out_specs=(P(), specs))
  def step(params, state, x):
    grads = jax.grad(_loss)(onebit_optax.local_params(params, "data"), x)
    return tx.update(grads, state, params)

  with pytest.raises(ValueError) as excinfo:
    step(params, state, _batch(mesh))
  _assert_words(excinfo, "optax.apply_if_finite", "already skips", "all devices together",
                "skipped_steps")


def test_apply_if_finite_under_pmap_says_steps_are_already_skipped():
  tx = optax.apply_if_finite(onebit_optax.onebit_adam(1e-3, axis_name="data"), 5)
  params = _stacked(_params())
  state = jax.pmap(tx.init, axis_name="data")(params)
  with pytest.raises(ValueError) as excinfo:
    jax.pmap(lambda p, s: tx.update(p, s, p), axis_name="data")(params, state)
  _assert_words(excinfo, "optax.apply_if_finite", "already skips")


def test_wrappers_without_an_axis_still_work():
  # One device, nothing communicated: MultiSteps and apply_if_finite are fine.
  params = _params()
  grads = jax.tree.map(jnp.ones_like, params)
  for tx in (optax.MultiSteps(onebit_optax.onebit_adam(1e-3, axis_name=None), 2),
             optax.apply_if_finite(onebit_optax.onebit_adam(1e-3, axis_name=None), 5)):
    state = tx.init(params)
    for _ in range(2):
      updates, state = jax.jit(tx.update)(grads, state, params)
    assert all(np.all(np.isfinite(u)) for u in jax.tree.leaves(updates))


# --- state layouts handed to the shard_map step -----------------------------------------------

def _shard_map_step(tx, mesh, state_specs):
  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), state_specs, P("data")),
                     out_specs=(P(), state_specs), check_vma=False)
  def step(params, state, x):
    grads = jax.grad(_loss)(params, x)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return step


# A live sharded array under the wrong spec is refused by shard_map itself, before
# the library runs ("in_specs ... does not match the specs of the input"). The
# library sees host copies (a state saved from a pmap run, or one fetched to the host).

# Both optimizers: the per-device buffer the message names first.
OPTIMIZERS = [
    pytest.param(lambda: onebit_optax.onebit_adam(1e-3, axis_name="data"), "local_momentum",
                 id="onebit"),
    pytest.param(lambda: onebit_optax.zero_one_adam(1e-3, axis_name="data", var_freeze_step=10),
                 "local_sent", id="zero_one"),
]


@pytest.mark.parametrize("make_tx, buffer", OPTIMIZERS)
def test_pmap_state_in_a_shard_map_step(mesh, make_tx, buffer):
  tx = make_tx()
  pmap_state = jax.device_get(jax.pmap(tx.init, axis_name="data")(_stacked(_params())))
  specs = jax.tree.map(lambda _: P(), pmap_state)
  with pytest.raises(ValueError) as excinfo:
    _shard_map_step(tx, mesh, specs)(_params(), pmap_state, _batch(mesh))
  _assert_words(excinfo, "jax.pmap", "leading device axis", "onebit_optax.init_sharded",
                "state_partition_specs")


@pytest.mark.parametrize("make_tx, buffer", OPTIMIZERS)
def test_whole_state_replicated_with_p_in_a_shard_map_step(mesh, make_tx, buffer):
  tx = make_tx()
  state = jax.device_get(onebit_optax.init_sharded(tx, _params(), mesh))
  specs = jax.tree.map(lambda _: P(), state)  # P() for the whole state
  with pytest.raises(ValueError) as excinfo:
    _shard_map_step(tx, mesh, specs)(_params(), state, _batch(mesh))
  _assert_words(excinfo, buffer, "worker_scale has shape (8, ", "P('data')",
                "state_partition_specs(state, 'data')")
