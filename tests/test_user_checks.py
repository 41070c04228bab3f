"""What a user trips on (issue 18, items 4, 7, 8, 9): values that silently diverge, weak messages.

Each check fails on the commit before it: the values were accepted, the messages
named neither the bound axes nor ``abstract_state``, and the default freeze said
nothing at construction.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import onebit_optax

N = 8


def _words(excinfo, *words):
  message = str(excinfo.value)
  for word in words:
    assert word in message, (word, message)


# --- item 4: values that diverge with no error -------------------------------------------

@pytest.mark.parametrize("kwargs, words", [
    ({"max_update": -1.0}, ("max_update=-1.0", "> 0", "adam_update_bound")),
    ({"max_update": 0.0}, ("max_update=0.0", "> 0")),
    ({"variance_floor": -1.0}, ("variance_floor=-1.0", ">= 0")),
    ({"weight_decay": -1.0}, ("weight_decay=-1.0", ">= 0", "grows the weights")),
    ({"weight_decay": float("inf")}, ("weight_decay=inf", "finite")),
])
def test_out_of_range_hyperparameters_are_refused(kwargs, words):
  with pytest.raises(ValueError) as excinfo:
    onebit_optax.onebit_adam(1e-3, axis_name=None, **kwargs)
  _words(excinfo, *words)


@pytest.mark.parametrize("lr", [float("nan"), float("inf"), -1e-3,
                                optax.constant_schedule(float("nan"))])
def test_learning_rates_that_cannot_train_are_refused(lr):
  with pytest.raises(ValueError) as excinfo:
    onebit_optax.onebit_adam(lr, axis_name=None)
  _words(excinfo, "learning_rate=", "must be finite and >= 0")


def test_the_values_that_are_allowed_still_build():
  for kwargs in ({"max_update": 1e-6}, {"variance_floor": 0.0}, {"weight_decay": 0.0},
                 {"weight_decay": 1e-4, "max_update": None}):
    onebit_optax.onebit_adam(optax.linear_schedule(0.0, 1e-3, 10), axis_name=None, **kwargs)


def test_a_schedule_that_turns_nan_is_named_as_the_cause_by_status():
  # NaN from step 3 on: the parameters go NaN, their gradients are NaN, and every step
  # after is skipped. status(params=...) must blame the parameters, not the gradients.
  schedule = lambda count: jnp.where(count >= 3, jnp.nan, 1e-2)
  tx = onebit_optax.onebit_adam(schedule, axis_name=None, freeze=2)
  params = {"w": jnp.ones(4), "b": jnp.zeros(2)}
  loss = lambda p: jnp.sum(p["w"] ** 2) + jnp.sum(p["b"] ** 2)
  state = tx.init(params)
  first = None
  for i in range(8):
    updates, state = tx.update(jax.grad(loss)(params), state, params)
    params = optax.apply_updates(params, updates)
    if i == 4:
      first = onebit_optax.status(state, 2)
  assert not np.isfinite(np.asarray(params["w"])).any()
  s = onebit_optax.status(state, 2, params=params, previous=first)
  notes = " ".join(s.notes)
  assert "the parameters are not finite" in notes and "['w']" in notes, notes
  assert "the learning rate" in notes and "the gradients are not finite" not in notes, notes
  assert s.skipped_steps >= 3  # the steps after the NaN parameters were skipped
  # With finite parameters there is no such note.
  ok = onebit_optax.status(state, 2, params={"w": jnp.ones(4), "b": jnp.zeros(2)})
  assert not any("parameters are not finite" in n for n in ok.notes)


# --- item 7: a wrong axis name says which axes are bound ---------------------------------

def test_wrong_axis_inside_shard_map_names_the_bound_axes():
  mesh = jax.make_mesh((N,), ("data",))
  tx = onebit_optax.onebit_adam(1e-3, axis_name="batch", freeze=5)
  init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P())
  with pytest.raises(ValueError) as excinfo:
    jax.jit(init)({"w": jnp.ones(16)})
  _words(excinfo, "axis_name='batch' is not bound here", "binds 'data' (8 devices)",
         "axis_name='data'")


def test_init_sharded_with_a_mesh_named_differently_from_the_optimizer():
  mesh = jax.make_mesh((N,), ("batch",))
  tx = onebit_optax.onebit_adam(1e-3, axis_name="data", freeze=5)
  with pytest.raises(ValueError) as excinfo:
    onebit_optax.init_sharded(tx, {"w": jnp.ones(16)}, mesh, "batch")
  _words(excinfo, "axis_name='data' is not bound", "binds 'batch'", "built for 'data'",
         "init_sharded's axis_name must be the one the optimizer was built with")


# --- item 8: abstract parameters ------------------------------------------------------------

def test_init_sharded_on_abstract_params_points_to_abstract_state():
  mesh = jax.make_mesh((N,), ("data",))
  tx = onebit_optax.onebit_adam(1e-3, axis_name="data", freeze=5)
  abstract = {"w": jax.ShapeDtypeStruct((16,), jnp.float32)}
  with pytest.raises(TypeError) as excinfo:
    onebit_optax.init_sharded(tx, abstract, mesh, "data")
  _words(excinfo, "abstract", "['w']", "onebit_optax.abstract_state(tx, params, mesh")
  # ... and abstract_state does take them.
  state = onebit_optax.abstract_state(tx, abstract, mesh, "data")
  assert state[0].nu["w"].shape == (16,)


# --- item 9: the default freeze announces itself ------------------------------------------

def test_default_freeze_says_when_it_can_first_compress():
  with pytest.warns(onebit_optax.DefaultFreezeWarning) as record:
    onebit_optax.onebit_adam(1e-3, axis_name="data")
  message = str(record[0].message)
  assert "before step 2000" in message and "min_steps" in message, message
  with pytest.warns(onebit_optax.DefaultFreezeWarning) as record:
    onebit_optax.scale_by_onebit_adam(b2=0.99, axis_name="data")
  assert "before step 200" in str(record[0].message)


@pytest.mark.parametrize("kwargs", [
    {"axis_name": "data", "freeze": onebit_optax.variance_ratio_freeze()},
    {"axis_name": "data", "freeze": 100},
    {"axis_name": None},
])
def test_no_default_freeze_warning_when_the_choice_is_explicit(kwargs):
  import warnings
  with warnings.catch_warnings():
    warnings.simplefilter("error", onebit_optax.DefaultFreezeWarning)
    onebit_optax.onebit_adam(1e-3, **kwargs)


# --- 0/1 Adam through the same recipe helpers ----------------------------------------------

def test_init_sharded_and_state_partition_specs_take_a_zero_one_state():
  mesh = jax.make_mesh((N,), ("data",))
  tx = onebit_optax.zero_one_adam(1e-3, axis_name="data", var_freeze_step=10)
  params = {"w": jnp.ones(300), "b": jnp.zeros(3)}
  state = onebit_optax.init_sharded(tx, params, mesh, "data")
  specs = onebit_optax.state_partition_specs(state, "data")
  zo = state[0]
  # Per-device buffers: one row per device, sharded over 'data'; the moments replicated.
  assert zo.worker_scale.shape[0] == N and specs[0].worker_scale == P("data")
  assert tuple(zo.worker_scale.sharding.spec)[0] == "data"
  assert [u.shape for u in zo.local_sent] == [(N, 1, 300)]
  assert specs[0].mu == {"w": P(), "b": P()} and zo.mu["w"].sharding.is_fully_replicated
  s = onebit_optax.status(state, var_freeze_step=10)  # the counters of 8 replicas, read
  assert (s.phase, s.step, s.next_variance_step, s.replicas_agree) == ("none", 0, 1, True)


# --- a skipped step leaves the parameters alone, weight decay included ----------------------

def test_a_skipped_step_does_not_decay_the_weights():
  tx = onebit_optax.onebit_adam(0.1, axis_name=None, weight_decay=0.1, freeze=3)
  params = {"w": jnp.arange(1.0, 5.0), "b": jnp.ones(2)}
  state = tx.init(params)
  good = {"w": jnp.ones(4), "b": jnp.ones(2)}
  bad = {"w": jnp.ones(4).at[2].set(jnp.nan), "b": jnp.ones(2)}
  update = jax.jit(tx.update)
  for grads in (good, bad, good, good, bad):  # a skip in warmup and one after the freeze
    updates, new_state = update(grads, state, params)
    if grads is bad:
      assert int(new_state[0].skipped_steps) == int(state[0].skipped_steps) + 1
      for leaf in jax.tree.leaves(updates):
        np.testing.assert_array_equal(np.asarray(leaf), 0.0)  # was -lr * wd * params
    params, state = optax.apply_updates(params, updates), new_state
  # A step that is not skipped still decays as optax.adamw does (warmup, first step).
  p0 = {"w": jnp.arange(1.0, 5.0), "b": jnp.ones(2)}
  ours, _ = tx.update(good, tx.init(p0), p0)
  ref = optax.adamw(0.1, weight_decay=0.1, eps=1e-8)
  theirs, _ = ref.update(good, ref.init(p0), p0)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
