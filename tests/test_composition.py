"""1-bit Adam inside the usual optax wrappers, under shard_map and pmap."""

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
import _flat

N = 8
K = 10  # warmup steps (a few more than the bare minimum: see _problem).
STEPS = 16
SIZES = [4, 16 * 4]  # the leaves b and w of _problem, in flattening order
SCHEDULE = optax.linear_schedule(5e-2, 5e-3, transition_steps=STEPS)


def _problem(seed=0):
  """Linear regression, 68 parameters, 4 samples per device.

  Every true weight and bias is at least 0.5 in magnitude. A weight near 0 has a near-0
  gradient during the short warmup, hence a tiny frozen variance; after the
  freeze its coordinate still receives its leaf's RMS momentum (one sign bit,
  one scale per leaf), which 1/sqrt(v) amplifies (up to the variance floor and
  the update clip). That is 1-bit Adam's behaviour, not what these tests are about.
  """
  rng = np.random.default_rng(seed)
  params = {"w": jnp.zeros((16, 4), jnp.float32), "b": jnp.zeros((4,), jnp.float32)}
  x = jnp.asarray(rng.standard_normal((4 * N, 16)), jnp.float32)
  true_w = rng.choice([-1.0, 1.0], (16, 4)) * rng.uniform(0.5, 1.5, (16, 4))
  true_b = rng.choice([-1.0, 1.0], 4) * rng.uniform(0.5, 1.5, 4)
  y = jnp.asarray(x @ true_w + true_b + 0.1 * rng.standard_normal((4 * N, 4)), jnp.float32)
  return params, x, y


def loss_fn(params, x, y):
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def _local_grads(params, x, y):
  """Each device's gradient on its shard of the batch: shape (N, ...)."""
  shard = lambda a: a.reshape((N, -1) + a.shape[1:])
  return jax.vmap(jax.grad(loss_fn), in_axes=(None, 0, 0))(params, shard(x), shard(y))


def _reference(params, x, y, tx, steps, preprocess=None):
  """A plain optax optimizer on the averaged (optionally preprocessed) local gradients."""
  @jax.jit
  def step(params, state):
    local = _local_grads(params, x, y)
    if preprocess is not None:
      local = jax.vmap(preprocess)(local)
    g = jax.tree.map(lambda a: jnp.mean(a, axis=0), local)
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state

  state, history = tx.init(params), []
  for _ in range(steps):
    params, state = step(params, state)
    history.append(params)
  return history


def _assert_trees_close(a, b, **kw):
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(u), np.asarray(v), **kw)


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((N,), ("data",))


class _CountCompiles:
  """Counts XLA compilations (jax.monitoring's backend-compile events) in a block."""

  EVENT = "/jax/core/compile/backend_compile_duration"

  def __enter__(self):
    self.count = 0
    jax.monitoring.register_event_duration_secs_listener(self._listener)
    return self

  def _listener(self, event, duration, **kwargs):
    del duration, kwargs
    self.count += event == self.EVENT

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self._listener)


def _shard_map_training(mesh, tx, params, x, y):
  """Runs STEPS steps of the README recipe one call at a time.

  Returns the params after each step, the states, and how many times the step
  was traced and compiled.
  """
  params = jax.device_put(params, NamedSharding(mesh, P()))
  opt_state = onebit_optax.init_sharded(tx, params, mesh)
  specs = onebit_optax.state_partition_specs(opt_state, "data")
  traces = []

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                     out_specs=(P(), specs, P()))
  def step(params, opt_state, x, y):
    traces.append(1)  # runs only while tracing
    loss, g = jax.value_and_grad(loss_fn)(onebit_optax.local_params(params, "data"), x, y)
    updates, opt_state = tx.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

  x = jax.device_put(x, NamedSharding(mesh, P("data")))
  y = jax.device_put(y, NamedSharding(mesh, P("data")))
  history, states = [], []
  with _CountCompiles() as compiles:
    for _ in range(STEPS):
      params, opt_state, _ = step(params, opt_state, x, y)
      # One step in flight: queued 8-device steps can trip XLA:CPU's 40 s
      # collective rendezvous abort on a busy machine.
      jax.block_until_ready((params, opt_state))
      history.append(params)
      states.append(opt_state)
  return history, states, len(traces), compiles.count


@pytest.mark.parametrize("freeze", [onebit_optax.fixed_step_freeze(K), K],
                         ids=["policy", "int"])
def test_inject_hyperparams_with_schedule_compiles_once(mesh, freeze):
  # An int freeze becomes a traced hyperparameter under inject_hyperparams; a
  # policy object stays static. Both must switch at step K without retracing.
  params, x, y = _problem()
  tx = optax.inject_hyperparams(onebit_optax.onebit_adam)(
      learning_rate=SCHEDULE, axis_name="data", freeze=freeze)
  history, states, traces, compiles = _shard_map_training(mesh, tx, params, x, y)
  # One trace and one compile for all steps, across the phase switch. (jit's
  # dispatch cache holds 2 entries: params placed with P() then returned as
  # P(None,), an equivalent sharding; that costs no compile.)
  assert (traces, compiles) == (1, 1)
  for t, state in enumerate(states, start=1):
    assert bool(_fields.field(state, "frozen")) == (t >= K), t
    assert int(_fields.field(state, "freeze_step")) == (K if t >= K else 0)
    # The learning rate used by step t.
    np.testing.assert_allclose(state.hyperparams["learning_rate"], SCHEDULE(t - 1), rtol=1e-6)
    if t > K:
      assert float(_fields.field(state, "wire_bytes")) == _flat.onebit_compressed_bytes(SIZES, N)
  assert np.isnan(float(_fields.field(states[0], "variance_ratio")))
  # Warmup is Adam on the mean gradient with the scheduled learning rate.
  expected = _reference(params, x, y, optax.inject_hyperparams(optax.adam)(
      learning_rate=SCHEDULE), K)
  _assert_trees_close(history[:K], expected, rtol=1e-5, atol=1e-6)
  assert all(np.all(np.isfinite(p)) for p in jax.tree.leaves(history))
  assert loss_fn(history[-1], x, y) < 0.5 * loss_fn(params, x, y)


def test_clip_then_onebit_adam(mesh):
  # clip acts on each device's local gradient before the optimizer averages.
  params, x, y = _problem(1)
  tx = optax.chain(optax.clip(1.0), onebit_optax.onebit_adam(5e-2, axis_name="data", freeze=K))
  history, states, traces, compiles = _shard_map_training(mesh, tx, params, x, y)
  assert (traces, compiles) == (1, 1)
  local = _local_grads(params, x, y)
  assert float(jnp.max(jnp.abs(local["w"]))) > 1.0  # the clip does something
  expected = _reference(params, x, y, optax.adam(5e-2), K,
                        preprocess=lambda g: jax.tree.map(lambda a: jnp.clip(a, -1.0, 1.0), g))
  _assert_trees_close(history[:K], expected, rtol=1e-5, atol=1e-6)
  assert bool(_fields.field(states[-1], "frozen"))
  assert int(_fields.field(states[-1], "freeze_step")) == K
  assert loss_fn(history[-1], x, y) < loss_fn(params, x, y)


def test_pmap_recipe_trains_and_switches_phase():
  params, x, y = _problem(2)
  tx = onebit_optax.onebit_adam(5e-2, axis_name="data", freeze=K)
  replicated = flax.jax_utils.replicate(params)
  opt_state = jax.pmap(tx.init, axis_name="data")(replicated)
  # pmap: every field gets the leading device axis; the per-device buffers are (1, ...)
  # on each device. b (4 elements) travels as float32, w (64) compressed.
  s = opt_state[0]
  assert [u.shape for u in s.local_momentum] == [(N, 1, 1, 16, 4)]
  assert s.worker_scale.shape == (N, 1, 1) and s.worker_error is None
  assert s.server_error.shape == (N, 1, _flat.Bits([SIZES[1]], N).chunk)
  assert s.momentum_message.shape == (N, N, _flat.onebit_row_bytes(SIZES, N))
  assert jax.tree.map(np.shape, s.mu) == {"b": (N, 4), "w": (N, 16, 4)}

  @functools.partial(jax.pmap, axis_name="data")
  def step(params, opt_state, x, y):
    loss, g = jax.value_and_grad(loss_fn)(params, x, y)  # local under pmap
    updates, opt_state = tx.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

  xs, ys = x.reshape(N, -1, 16), y.reshape(N, -1, 4)
  history, losses = [], []
  for t in range(1, 2 * K + 1):
    replicated, opt_state, loss = step(replicated, opt_state, xs, ys)
    history.append(jax.tree.map(lambda a: np.asarray(a[0]), replicated))
    losses.append(float(loss[0]))
    frozen = np.asarray(_fields.field(opt_state, "frozen"))
    assert frozen.shape == (N,) and np.all(frozen == (t >= K)), (t, frozen)
    for leaf in jax.tree.leaves(replicated):  # replicas stay bitwise identical
      assert np.all(np.asarray(leaf) == np.asarray(leaf)[0])
  assert np.all(np.asarray(_fields.field(opt_state, "freeze_step")) == K)
  _assert_trees_close(history[:K], _reference(params, x, y, optax.adam(5e-2), K),
                      rtol=1e-5, atol=1e-6)
  assert losses[-1] < 0.5 * float(loss_fn(params, x, y))
