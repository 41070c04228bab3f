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

import ckpt_mp_script as run
import onebit_optax

DATA, MODEL = 4, 2
FEATURES, HIDDEN, BATCH = 12, 32, 32
FREEZE, SAVE, MORE = 4, 8, 3
# w1 and w2 (local shards of 12 x 16 and 16 x 12, 192 elements: two 128-blocks each, cut by
# the 4-device chunks into pieces with their own scales) are compressed, b1 and b2 exact.
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
  # Every server holds a piece of w1 or w2 (4 chunks of 128 per model shard).
  for buffer in (*s.local_momentum, s.worker_scale, s.server_error):
    rows = np.asarray(buffer).reshape(DATA * MODEL, -1)
    assert len({row.tobytes() for row in rows}) == DATA * MODEL
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


def test_other_model_splits_are_refused_with_what_to_do(saved):
  devices = jax.devices()
  other_specs = {**PARAM_SPECS, "b1": P()}
  flat = jax.make_mesh((8,), ("data",))
  four_shards = jax.make_mesh((2, 4), ("data", "model"), devices=devices)
  attempts = [
      (four_shards, _tx(), dict(param_specs=PARAM_SPECS, model_axis="model")),  # 4 shards
      (saved["mesh"], _tx(), dict(param_specs=other_specs, model_axis="model")),  # other split
      (flat, onebit_optax.onebit_adam(1e-2, axis_name="data", freeze=FREEZE), {}),  # data only
  ]
  for mesh, tx, kwargs in attempts:
    with pytest.raises(ValueError, match=r"(?s)restored onto the mesh shape and "
                       r"parameter specs it was saved with.*another model split cannot be "
                       r"moved.*start the optimizer afresh"):
      onebit_optax.restore_checkpoint(saved["directory"], tx, _params(), mesh, **kwargs)


def test_a_data_parallel_checkpoint_is_not_moved_onto_a_model_split(tmp_path):
  mesh = jax.make_mesh((8,), ("data",))
  tx = onebit_optax.onebit_adam(1e-2, axis_name="data", freeze=FREEZE)
  params = _params()
  state = onebit_optax.init_sharded(tx, params, mesh)
  onebit_optax.save_checkpoint(str(tmp_path), 1, params, state, tx=tx)
  with pytest.raises(ValueError, match="restored onto the mesh shape"):
    onebit_optax.restore_checkpoint(str(tmp_path), _tx(), params,
                                    jax.make_mesh((DATA, MODEL), ("data", "model")),
                                    param_specs=PARAM_SPECS, model_axis="model")


# One model shard's leaves in flattening order (b1, b2, w1, w2): w1 and w2 compressed.
LOCAL_SIZES = [HIDDEN // MODEL, FEATURES, FEATURES * HIDDEN // MODEL, HIDDEN // MODEL * FEATURES]
COMPRESSED = [2, 3]


def _shard_snapshot(state, m, n):
  """Model shard ``m`` of a state as ckpt_mp_script.expected_carry reads it (numpy, by key)."""
  rows = lambda x: np.asarray(x).reshape((-1, MODEL) + np.shape(x)[1:])[:, m]
  out = {f"opt_state[0].local_momentum[{k}]": rows(u) for k, u in enumerate(state.local_momentum)}
  out.update({"opt_state[0].worker_scale": rows(state.worker_scale),
              "opt_state[0].server_error": rows(state.server_error),
              "opt_state[0].feedback_valid": np.asarray(state.feedback_valid),
              "opt_state[0].momentum_message": np.asarray(state.momentum_message)[m * n:(m + 1) * n]})
  return out


def test_a_move_to_fewer_data_replicas_hands_the_feedback_on_per_model_shard(saved):
  """(4, 2) -> (2, 2): the model split kept, each model shard's feedback handed on."""
  smaller = jax.make_mesh((2, MODEL), ("data", "model"), devices=jax.devices()[:2 * MODEL])
  tx = _tx()
  params, opt_state, _ = onebit_optax.restore_checkpoint(
      saved["directory"], tx, _params(), smaller, param_specs=PARAM_SPECS, model_axis="model")
  old, new = saved["opt_state"][0], opt_state[0]
  for name in ("mu", "nu", "nu_l1", "count", "frozen", "freeze_step", "skipped_steps"):
    for got, want in zip(jax.tree.leaves(getattr(new, name)), jax.tree.leaves(getattr(old, name))):
      assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), name
  assert new.local_momentum[0].shape == (2 * MODEL, 1, FEATURES, HIDDEN // MODEL)
  for m in range(MODEL):  # each model shard: the numpy model of the hand-on
    before, after = _shard_snapshot(old, m, DATA), _shard_snapshot(new, m, 2)
    want = run.expected_carry(before, LOCAL_SIZES, (COMPRESSED, DATA, 1), (COMPRESSED, 2, 1),
                              0.9, after["opt_state[0].momentum_message"])
    assert not np.any(after["opt_state[0].worker_scale"]) and bool(new.feedback_valid)
    for k, i in enumerate(COMPRESSED):
      for row in after[f"opt_state[0].local_momentum[{k}]"].reshape(2, -1):
        np.testing.assert_allclose(row, want["local"][i], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(after["opt_state[0].server_error"], want["server_error"],
                               rtol=1e-5, atol=1e-6)
    assert np.any(want["server_error"]) and np.any(want["local"][2])

  # One step later, per model shard, the mean of what the data replicas compressed is
  # the uninterrupted run's (same global batch).
  def sent(mesh, params, opt_state):
    _, state = _step(mesh, tx, opt_state)(params, opt_state, *_batch(mesh, SAVE))
    return [np.asarray(u, np.float64).reshape((-1, MODEL) + u.shape[1:]).mean(axis=0)
            for u in state[0].local_momentum]
  for got, want in zip(sent(smaller, params, opt_state),
                       sent(saved["mesh"], saved["params"], saved["opt_state"])):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
