"""Checkpoints of a data × model state: bitwise on the saved mesh, refused elsewhere.

A Megatron-style MLP on a (4, 2) mesh (data, model), trained past the freeze so
that every per-device buffer differs from device to device (a mix-up of rows,
or of the model shards' messages, would show). The reference for the resumed
run is the same run never interrupted.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import onebit_optax

DATA, MODEL = 4, 2
FEATURES, HIDDEN, BATCH = 8, 32, 32
FREEZE, SAVE, MORE = 4, 8, 3
# w1 and w2 (local shards of 8 x 16 and 16 x 8) are compressed, b1 and b2 exact.
PARAM_SPECS = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}


def _tx():
  return onebit_optax.onebit_adam(1e-2, axis_name="data", model_axis="model", freeze=FREEZE)


def _params():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"w1": jax.random.normal(k1, (FEATURES, HIDDEN)) / np.sqrt(FEATURES),
          "b1": jnp.zeros(HIDDEN),
          "w2": jax.random.normal(k2, (HIDDEN, FEATURES)) / np.sqrt(HIDDEN),
          "b2": jnp.zeros(FEATURES)}


def _loss(params, x, y):
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  return jnp.mean((jax.lax.psum(h @ params["w2"], "model") + params["b2"] - y) ** 2)


def _step(mesh, tx, opt_state):
  specs = onebit_optax.state_partition_specs(opt_state, "data", model_axis="model",
                                             param_specs=PARAM_SPECS)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh,
                     in_specs=(PARAM_SPECS, specs, P("data"), P("data")),
                     out_specs=(PARAM_SPECS, specs))
  def step(params, opt_state, x, y):
    grads = jax.grad(_loss)(onebit_optax.local_params(params, "data"), x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    return onebit_optax.model_replicated(new_params, params, "model"), opt_state
  return step


def _batch(mesh, t):
  rng = np.random.default_rng(t)
  x = rng.standard_normal((BATCH, FEATURES)).astype(np.float32)
  # A per-row offset: every data replica's gradient differs.
  y = np.sin(x) + np.arange(BATCH, dtype=np.float32)[:, None] / BATCH
  put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))
  return put(x), put(y.astype(np.float32))


def _train(step, mesh, params, opt_state, start, stop):
  for t in range(start, stop):
    params, opt_state = step(params, opt_state, *_batch(mesh, t))
  return params, opt_state


def _leaves(tree):
  return {jax.tree_util.keystr(path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _assert_same(actual, expected):
  actual, expected = _leaves(actual), _leaves(expected)
  assert sorted(actual) == sorted(expected)
  for key, want in expected.items():
    got = actual[key]
    assert got.sharding.is_equivalent_to(want.sharding, want.ndim), key
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), key


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """Trained to step SAVE (compressing since FREEZE) on the (4, 2) mesh and saved there."""
  mesh = jax.make_mesh((DATA, MODEL), ("data", "model"))
  tx = _tx()
  params = jax.device_put(_params(), jax.tree.map(lambda s: NamedSharding(mesh, s), PARAM_SPECS))
  opt_state = onebit_optax.init_sharded(tx, params, mesh, "data", param_specs=PARAM_SPECS,
                                        model_axis="model")
  step = _step(mesh, tx, opt_state)
  params, opt_state = _train(step, mesh, params, opt_state, 0, SAVE)
  directory = str(tmp_path_factory.mktemp("ckpt_model"))
  assert onebit_optax.save_checkpoint(directory, SAVE, params, opt_state, tx=tx)
  return dict(mesh=mesh, directory=directory, params=params, opt_state=opt_state, step=step)


def test_the_saved_state_differs_across_devices_and_model_shards(saved):
  s = saved["opt_state"][0]
  assert bool(s.frozen) and bool(s.feedback_valid)
  for buffer in (*s.local_momentum, s.worker_scale):
    rows = np.asarray(buffer).reshape(DATA * MODEL, -1)
    assert len({row.tobytes() for row in rows}) == DATA * MODEL
  # Servers 0 and 1 of each shard hold w1's and w2's chunks (2 and 3: tail padding).
  rows = np.asarray(s.server_error).reshape(DATA, MODEL, -1)[:2].reshape(4, -1)
  assert len({row.tobytes() for row in rows}) == 4 and np.all(np.any(rows, axis=1))
  message = np.asarray(s.momentum_message)  # (MODEL * DATA, row_bytes): one message per shard
  assert message.shape[0] == MODEL * DATA
  assert message[:DATA].tobytes() != message[DATA:].tobytes()


def test_resume_on_the_same_mesh_is_bitwise(saved):
  mesh, tx = saved["mesh"], _tx()  # rebuilt, as after a restart
  template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _params())
  params, opt_state, step = onebit_optax.restore_checkpoint(
      saved["directory"], tx, template, mesh, param_specs=PARAM_SPECS, model_axis="model")
  assert step == SAVE
  _assert_same((params, opt_state), (saved["params"], saved["opt_state"]))
  # abstract_state takes the same arguments and describes exactly this state.
  target = onebit_optax.abstract_state(tx, template, mesh, param_specs=PARAM_SPECS,
                                       model_axis="model")
  for key, want in _leaves(target).items():
    got = _leaves(opt_state)[key]
    assert (got.shape, got.dtype) == (want.shape, want.dtype), key
    assert got.sharding.is_equivalent_to(want.sharding, got.ndim), key
  # Training on from the restored state is the run that never stopped.
  step_fn = saved["step"]
  resumed = _train(step_fn, mesh, params, opt_state, SAVE, SAVE + MORE)
  never_stopped = _train(step_fn, mesh, saved["params"], saved["opt_state"], SAVE, SAVE + MORE)
  _assert_same(resumed, never_stopped)


def test_without_param_specs_the_checkpoint_is_refused(saved):
  with pytest.raises(ValueError, match=r"(?s)2 model shards.*pass param_specs= and model_axis="):
    onebit_optax.restore_checkpoint(saved["directory"], _tx(), _params(), saved["mesh"])


def test_other_meshes_and_specs_are_refused_with_what_to_do(saved):
  devices = np.asarray(jax.devices())
  smaller = jax.make_mesh((2, 2), ("data", "model"), devices=devices[:4].tolist())
  other_specs = {**PARAM_SPECS, "b1": P()}
  flat = jax.make_mesh((8,), ("data",))
  attempts = [
      (smaller, _tx(), dict(param_specs=PARAM_SPECS, model_axis="model")),  # fewer replicas
      (saved["mesh"], _tx(), dict(param_specs=other_specs, model_axis="model")),  # other split
      (flat, onebit_optax.onebit_adam(1e-2, axis_name="data", freeze=FREEZE), {}),  # data only
  ]
  for mesh, tx, kwargs in attempts:
    with pytest.raises(ValueError, match=r"(?s)restored only onto the mesh shape and "
                       r"parameter specs it was saved with.*start the optimizer afresh"):
      onebit_optax.restore_checkpoint(saved["directory"], tx, _params(), mesh, **kwargs)


def test_a_data_parallel_checkpoint_is_not_moved_onto_a_model_split(tmp_path):
  mesh = jax.make_mesh((8,), ("data",))
  tx = onebit_optax.onebit_adam(1e-2, axis_name="data", freeze=FREEZE)
  params = _params()
  state = onebit_optax.init_sharded(tx, params, mesh)
  onebit_optax.save_checkpoint(str(tmp_path), 1, params, state, tx=tx)
  with pytest.raises(ValueError, match="restored only onto the mesh shape"):
    onebit_optax.restore_checkpoint(str(tmp_path), _tx(), params,
                                    jax.make_mesh((DATA, MODEL), ("data", "model")),
                                    param_specs=PARAM_SPECS, model_axis="model")
