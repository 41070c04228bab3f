"""Tiny leaves travel as float32 inside the 1-bit messages and are averaged exactly.

A numpy reference runs Adam on the mean gradient until the freeze and then the
frozen-variance momentum of the mean gradient for the exact leaves (a scalar
gate and a 2-element bias): what 8 devices hold after compression steps must be
that mean, not a 1-bit approximation of it.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import onebit_optax
import _fields

N, FREEZE, STEPS, LR, B1, B2 = 8, 3, 8, 1e-2, 0.9, 0.999


def _params():
  return {"w": jnp.ones((64, 32), jnp.float32) * 0.1, "b": jnp.zeros((2,), jnp.float32),
          "gate": jnp.ones((), jnp.float32)}


def _grads(step):
  """Per-device gradients: (N, *shape) float32, different on every device and step."""
  rng = np.random.default_rng(step)
  return {k: rng.normal(size=(N,) + np.shape(v)).astype(np.float32) * (1 + 3 * (k == "b"))
          for k, v in _params().items()}


def _reference_exact():
  """Numpy float32: the exact leaves' first moment and parameters over the whole run."""
  p = {k: np.asarray(_params()[k]) for k in ("b", "gate")}
  m = {k: np.zeros_like(v) for k, v in p.items()}
  v = {k: np.zeros_like(x) for k, x in p.items()}
  for t in range(1, STEPS + 1):
    g = {k: _grads(t - 1)[k].astype(np.float32) for k in p}
    for k in p:
      mean = np.float32(sum(g[k][i] for i in range(N)) / np.float32(N))
      m[k] = np.float32(B1) * m[k] + np.float32(1 - B1) * mean
      if t <= FREEZE:
        v[k] = np.float32(B2) * v[k] + np.float32(1 - B2) * mean ** 2
        step = (m[k] / (1 - B1 ** t)) / (np.sqrt(v[k] / (1 - B2 ** t)) + 1e-8)
      else:
        v_hat = v[k] / (1 - B2 ** FREEZE)
        v_hat = np.maximum(v_hat, 0.01 * v_hat.mean())
        step = np.clip((m[k] / (1 - B1 ** t)) / (np.sqrt(v_hat) + 1e-8), -3.1623, 3.1623)
      p[k] = p[k] - np.float32(LR) * step
  return m, p


def test_tiny_leaves_are_averaged_exactly_on_8_devices():
  mesh = jax.make_mesh((N,), ("data",))
  tx = onebit_optax.onebit_adam(LR, B1, B2, axis_name="data", freeze=FREEZE)
  params = jax.device_put(_params(), NamedSharding(mesh, P()))
  state = onebit_optax.init_sharded(tx, params, mesh)
  # Only w (2048 elements) is compressed: one per-device buffer, one scale column.
  assert len(state[0].local_momentum) == 1 and state[0].worker_scale.shape == (N, 1)
  specs = onebit_optax.state_partition_specs(state, "data")

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data")),
                     out_specs=(P(), specs))
  def step(params, state, grads):
    grads = jax.tree.map(lambda g: g[0], grads)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for t in range(STEPS):
    grads = jax.device_put(_grads(t), NamedSharding(mesh, P("data")))
    params, state = step(params, state, grads)
  assert bool(_fields.field(state, "frozen")) and int(_fields.field(state, "freeze_step")) == FREEZE
  mu, _ = onebit_optax.moments(state, params)
  m_ref, p_ref = _reference_exact()
  for k in ("b", "gate"):
    # Float32 sums in the same order as the server (rows 0..7, then / 8): a
    # 1-bit mean would be off by tens of percent here.
    np.testing.assert_allclose(np.asarray(mu[k]), m_ref[k], rtol=2e-6, atol=1e-9, err_msg=k)
    np.testing.assert_allclose(np.asarray(params[k]), p_ref[k], rtol=1e-5, atol=1e-7, err_msg=k)
  # The compressed leaf's momentum is 1 bit: one magnitude per leaf piece.
  assert len(np.unique(np.abs(np.asarray(mu["w"])))) <= N


def test_exact_below_zero_compresses_every_leaf():
  tx = onebit_optax.scale_by_onebit_adam(axis_name=None, exact_below=0)
  state = tx.init(_params())
  assert len(state.local_momentum) == 3 and state.worker_scale.shape == (1, 3)
  tx = onebit_optax.scale_by_onebit_adam(axis_name=None, exact_below=4096)
  assert tx.init(_params()).local_momentum == ()
