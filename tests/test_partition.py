"""set_to_zero and mean_updates: the leaves 1-bit Adam does not own, on 8 simulated devices.

References are numpy (the mean over devices, IEEE zero arithmetic) and
``onebit_adam`` trained alone on the trained subtree. The recipes themselves,
as the guide writes them, run in tests/test_recipes.py.
"""

import functools

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import onebit_optax
import _fields
from onebit_optax import _partition

N, STEPS, FREEZE, LR = 8, 14, 5, 1e-2
TRAINED = {"body": {"w": False, "b": False}, "head": {"w": True, "b": True}}
FROZEN = jax.tree.map(lambda t: not t, TRAINED)
LABELS = jax.tree.map(lambda t: "train" if t else "frozen", TRAINED)


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((N,), ("data",))


def _bits(a):
  return np.asarray(a, np.float32).view(np.uint32)


def _problem():
  rng = np.random.default_rng(0)
  params = {"body": {"w": rng.standard_normal((6, 16)).astype(np.float32),
                     # -0.0 entries: a +0 update would turn them into +0.0.
                     "b": np.array([-0.0, 0.0, 1.5, -2.0] * 4, np.float32)},
            "head": {"w": (rng.standard_normal((16, 3)) / 4).astype(np.float32),
                     "b": np.zeros(3, np.float32)}}
  x = rng.standard_normal((4 * N, 6)).astype(np.float32)
  y = np.tanh(x @ rng.standard_normal((6, 3))).astype(np.float32)
  return params, x, y


def _loss(params, x, y):
  h = jnp.tanh(x @ params["body"]["w"] + params["body"]["b"])
  return jnp.mean((h @ params["head"]["w"] + params["head"]["b"] - y) ** 2)


def _onebit():
  return onebit_optax.onebit_adam(LR, axis_name="data",
                                  freeze=onebit_optax.fixed_step_freeze(FREEZE))


# --- set_to_zero ------------------------------------------------------------------------------

def test_set_to_zero_leaves_every_float_bitwise_unchanged():
  special = np.array([-0.0, 0.0, np.inf, -np.inf, 3.5, -7.25, 2e-38, -3e38], np.float32)
  tx = onebit_optax.set_to_zero()
  apply = jax.jit(optax.apply_updates)
  updates, _ = tx.update({"p": jnp.ones(8)}, tx.init({"p": special}))
  np.testing.assert_array_equal(_bits(apply({"p": special}, updates)["p"]), _bits(special))
  # What optax.set_to_zero's +0 does to the -0.0 entry (the reason for -0).
  plus, _ = optax.set_to_zero().update({"p": jnp.ones(8)}, optax.EmptyState())
  moved = _bits(apply({"p": special}, plus)["p"]) != _bits(special)
  assert moved.tolist() == [True] + [False] * 7
  # Subnormals: XLA:CPU flushes them to zero in any addition; with -0 the sign stays.
  tiny = np.array([1e-45, -1e-45], np.float32)
  minus, _ = tx.update({"p": tiny}, optax.EmptyState())
  got = _bits(apply({"p": tiny}, minus)["p"]).tolist()
  assert got in (_bits(tiny).tolist(), _bits(np.copysign(0.0, tiny)).tolist())


def test_set_to_zero_is_replicated_under_shard_map(mesh):
  x = jax.device_put(jnp.arange(N, dtype=jnp.float32), NamedSharding(mesh, P("data")))

  def zeros(tx):
    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("data"), out_specs=P())
    def f(local):  # a per-device "gradient" in, the update out as replicated
      return tx.update(local, tx.init(local))[0]
    return np.asarray(f(x))

  np.testing.assert_array_equal(_bits(zeros(onebit_optax.set_to_zero())), _bits([-0.0]))
  with pytest.raises(ValueError, match="could not infer replication"):
    zeros(optax.set_to_zero())


# --- mean_updates -----------------------------------------------------------------------------

def test_mean_updates_is_the_mean_over_devices_under_shard_map_and_pmap(mesh):
  local = np.random.default_rng(1).standard_normal((N, 5)).astype(np.float32)
  tx = onebit_optax.mean_updates("data")
  update = lambda g: tx.update({"g": g}, tx.init(None))[0]["g"]
  sharded = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=P("data"), out_specs=P()))
  got = np.asarray(sharded(jax.device_put(local, NamedSharding(mesh, P("data")))))
  np.testing.assert_allclose(got, local.mean(0, keepdims=True), rtol=1e-6)
  by_pmap = np.asarray(jax.pmap(update, axis_name="data")(local))
  np.testing.assert_allclose(by_pmap, np.broadcast_to(local.mean(0), (N, 5)), rtol=1e-6)


def test_mean_updates_over_nodes_and_devices():
  mesh = jax.make_mesh((2, N // 2), ("node", "local"))
  local = np.random.default_rng(2).standard_normal((N, 3)).astype(np.float32)
  tx = onebit_optax.mean_updates(("node", "local"))
  f = jax.jit(jax.shard_map(lambda g: tx.update(g, tx.init(None))[0], mesh=mesh,
                            in_specs=P(("node", "local")), out_specs=P()))
  got = f(jax.device_put(local, NamedSharding(mesh, P(("node", "local")))))
  np.testing.assert_allclose(np.asarray(got), local.mean(0, keepdims=True), rtol=1e-6)


def test_mean_updates_without_axis_and_outside_the_mapped_region():
  tx = onebit_optax.mean_updates(None)
  g = {"g": jnp.array([1.0, -2.0])}
  assert tx.update(g, tx.init(None))[0] is g
  with pytest.raises(ValueError, match=r"mean_updates: axis_name='data' is not bound"):
    onebit_optax.mean_updates("data").update(g, optax.EmptyState())


# --- the recipe under pmap, and the check for the forms that fail -------------------------------

def _pmap_train(tx, params, x, y, steps=STEPS):
  """The README's pmap recipe (local gradients, no local_params); the params of every device."""
  params = flax.jax_utils.replicate(params)
  state = jax.pmap(tx.init, axis_name="data")(params)
  xs, ys = x.reshape(N, -1, x.shape[-1]), y.reshape(N, -1, y.shape[-1])

  @functools.partial(jax.pmap, axis_name="data")
  def step(params, state, x, y):
    updates, state = tx.update(jax.grad(_loss)(params, x, y), state, params)
    return optax.apply_updates(params, updates), state

  for _ in range(steps):
    params, state = step(params, state, xs, ys)
    jax.block_until_ready(params)
  return jax.tree.map(np.asarray, params)


@pytest.mark.parametrize("form", ["partition", "masked"])
def test_pmap_freezes_the_body_bitwise_and_trains_the_head_as_onebit_adam_alone(form):
  params, x, y = _problem()
  tx = (optax.partition({"train": _onebit(), "frozen": onebit_optax.set_to_zero()}, LABELS)
        if form == "partition" else
        optax.chain(optax.masked(_onebit(), TRAINED),
                    optax.masked(onebit_optax.set_to_zero(), FROZEN)))
  stacked = _pmap_train(tx, params, x, y)
  head = _head_alone()
  assert not np.allclose(head["w"][0], params["head"]["w"])
  for d in range(N):
    for name in ("w", "b"):
      np.testing.assert_array_equal(_bits(stacked["body"][name][d]), _bits(params["body"][name]),
                                    err_msg=f"body/{name} on device {d}")
      np.testing.assert_allclose(stacked["head"][name][d], head[name][d], rtol=1e-5, atol=1e-6,
                                 err_msg=f"head/{name} on device {d}")
      np.testing.assert_array_equal(_bits(stacked["head"][name][d]),
                                    _bits(stacked["head"][name][0]))


@functools.cache
def _head_alone():
  """The reference, trained once for both forms: onebit_adam on the head alone, the body a
  constant of the loss; the head of every device (numpy)."""
  params, x, y = _problem()
  body = jax.tree.map(jnp.asarray, params["body"])
  head_loss = lambda head, x, y: _loss({"body": body, "head": head}, x, y)
  ref_tx = _onebit()
  head = flax.jax_utils.replicate(params["head"])
  ref_state = jax.pmap(ref_tx.init, axis_name="data")(head)

  @functools.partial(jax.pmap, axis_name="data")
  def ref_step(head, state, x, y):
    updates, state = ref_tx.update(jax.grad(head_loss)(head, x, y), state, head)
    return optax.apply_updates(head, updates), state

  xs, ys = x.reshape(N, -1, 6), y.reshape(N, -1, 3)
  for _ in range(STEPS):
    head, ref_state = ref_step(head, ref_state, xs, ys)
    jax.block_until_ready(head)
  assert bool(np.asarray(_fields.field(ref_state, "frozen")).all())
  return jax.tree.map(np.asarray, head)


def _state_and_specs(tx, params, mesh, init=onebit_optax.init_sharded):
  params = jax.device_put(params, NamedSharding(mesh, P()))
  state = init(tx, params, mesh)
  return params, state, onebit_optax.state_partition_specs(state, "data")


def _init_unchecked(tx, params, mesh):
  """``tx.init`` under shard_map, as init_sharded does, without any check of the updates."""
  abstract = jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=(P(),), out_specs=P(),
                                          check_vma=False), params)
  specs = onebit_optax.state_partition_specs(abstract, "data")
  return jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(P(),), out_specs=specs))(params)


BAD = {
    "optax.set_to_zero": lambda: optax.partition(
        {"train": _onebit(), "frozen": optax.set_to_zero()}, LABELS),
    "masked alone": lambda: optax.masked(_onebit(), TRAINED),
    "adam without mean": lambda: optax.partition(
        {"train": _onebit(), "frozen": optax.adam(LR)}, LABELS),
}
GOOD = {
    "partition": lambda: optax.partition(
        {"train": _onebit(), "frozen": onebit_optax.set_to_zero()}, LABELS),
    "masked pair": lambda: optax.chain(optax.masked(_onebit(), TRAINED),
                                       optax.masked(onebit_optax.set_to_zero(), FROZEN)),
    "adam with mean": lambda: optax.partition(
        {"train": _onebit(),
         "frozen": optax.chain(onebit_optax.mean_updates("data"), optax.adam(LR))}, LABELS),
    "onebit alone": _onebit,
    "plain adam (fed the mean gradient by its step)": lambda: optax.masked(optax.adam(LR), FROZEN),
}


@pytest.mark.parametrize("form", sorted(BAD))
def test_the_check_names_the_leaves_that_stay_per_device(mesh, form):
  params, x, y = _problem()
  tx = BAD[form]()
  placed, state, specs = _state_and_specs(tx, params, mesh, init=_init_unchecked)
  paths = _partition.per_device_update_paths(tx, placed, state, mesh, "data", specs)
  assert paths == ["['body']['b']", "['body']['w']"]
  with pytest.raises(ValueError, match=r"init_sharded: the updates of \['body'\]\['b'\], "
                                       r"\['body'\]\['w'\] come out of the optimizer per-device"):
    _partition.check_updates_replicated(tx, placed, state, mesh, "data", specs)


@pytest.mark.parametrize("form", sorted(GOOD))
def test_the_check_passes_the_recipes(mesh, form):
  params, x, y = _problem()
  tx = GOOD[form]()
  placed, state, specs = _state_and_specs(tx, params, mesh, init=_init_unchecked)
  assert _partition.per_device_update_paths(tx, placed, state, mesh, "data", specs) == []
  _partition.check_updates_replicated(tx, placed, state, mesh, "data", specs)


def test_hierarchical_mesh_frozen_body_and_an_adam_bias():
  # (node, local) axes: the 1-bit head over 'node', the Adam bias averaged over both
  # in float32, the body frozen; head/b against numpy Adam on the full-batch gradient.
  axes = ("node", "local")
  mesh = jax.make_mesh((2, N // 2), axes)
  params, x, y = _problem()
  labels = {"body": {"w": "frozen", "b": "frozen"}, "head": {"w": "train", "b": "adam"}}
  tx = optax.partition(
      {"train": onebit_optax.onebit_adam(LR, axis_name=axes,
                                         freeze=onebit_optax.fixed_step_freeze(FREEZE)),
       "adam": optax.chain(onebit_optax.mean_updates(axes), optax.adam(LR)),
       "frozen": onebit_optax.set_to_zero()}, labels)
  placed = jax.device_put(params, NamedSharding(mesh, P()))
  state = onebit_optax.init_sharded(tx, placed, mesh, axes)
  specs = onebit_optax.state_partition_specs(state, axes)
  _partition.check_updates_replicated(tx, placed, state, mesh, axes, specs)  # passes

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P(axes), P(axes)),
                     out_specs=(P(), specs))
  def step(params, state, x, y):
    grads = jax.grad(_loss)(onebit_optax.local_params(params, axes), x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  xd, yd = jax.device_put((x, y), NamedSharding(mesh, P(axes)))
  full_grad = jax.jit(jax.grad(_loss))
  m = v = np.zeros(3)
  for t in range(1, FREEZE + 4):
    before = jax.tree.map(np.asarray, placed)
    g = np.asarray(full_grad(before, x, y)["head"]["b"], np.float64)
    m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
    expected = before["head"]["b"] - LR * (m / (1 - 0.9 ** t)) / (
        np.sqrt(v / (1 - 0.999 ** t)) + 1e-8)
    placed, state = step(placed, state, xd, yd)
    after = jax.tree.map(np.asarray, placed)
    np.testing.assert_allclose(after["head"]["b"], expected, rtol=1e-5, atol=1e-6,
                               err_msg=f"head/b at step {t}")
    for name in ("w", "b"):
      np.testing.assert_array_equal(_bits(after["body"][name]), _bits(params["body"][name]))
  assert bool(_fields.field(state, "frozen"))
  assert onebit_optax.assert_replicas_identical(placed) > 0


@pytest.mark.parametrize("form", sorted(BAD))
def test_init_sharded_names_the_leaves_that_stay_per_device(mesh, form):
  params, _, _ = _problem()
  with pytest.raises(ValueError, match=r"init_sharded: the updates of \['body'\]\['b'\], "
                                       r"\['body'\]\['w'\] come out of the optimizer per-device"):
    _state_and_specs(BAD[form](), params, mesh)
