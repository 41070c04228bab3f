"""The benchmarks' DiLoCo baseline (benchmarks/_diloco.py) against a numpy replay of two rounds.

Two devices, each with its own quadratic loss 0.5 |theta_i - c_i|^2 (so its own
gradient), H = 3 inner AdamW steps, then the outer Nesterov SGD on the mean of
theta - theta_i; the replay writes AdamW, the Nesterov trace and the round out in
numpy from the paper's description and optax's documented update rules.
"""

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import _diloco  # pylint: disable=g-import-not-at-top,wrong-import-position

N, H, ROUNDS = 2, 3, 2
LR, WD, OUTER_LR, MOMENTUM = 0.05, 0.1, 0.7, 0.9
B1, B2, EPS = 0.9, 0.999, 1e-8
C = np.array([[1.0, -2.0, 0.5, 3.0], [-1.0, 0.0, 2.5, 1.0]], np.float32)  # each device's target


def _replay(theta, rounds=(H,) * ROUNDS):
  """DiLoCo rounds of the given lengths in numpy (float64): per-device AdamW, mean pseudo-gradient, Nesterov SGD."""
  theta = theta.astype(np.float64)
  m, v = np.zeros((N, theta.size)), np.zeros((N, theta.size))
  trace, t, bytes_sent = np.zeros_like(theta), 0, []
  offsets = np.zeros((N, theta.size))
  for length in rounds:
    for _ in range(length):
      t += 1
      for i in range(N):
        x = theta + offsets[i]
        g = x - C[i]
        m[i] = B1 * m[i] + (1 - B1) * g
        v[i] = B2 * v[i] + (1 - B2) * g * g
        step = (m[i] / (1 - B1 ** t)) / (np.sqrt(v[i] / (1 - B2 ** t)) + EPS) + WD * x
        offsets[i] -= LR * step
    delta = np.mean(-offsets, axis=0)  # mean of theta - theta_i
    trace = delta + MOMENTUM * trace  # optax.trace(nesterov=True): g + mu * (g + mu * trace)
    theta = theta - OUTER_LR * (delta + MOMENTUM * trace)
    offsets[:] = 0.0
    bytes_sent.append(2 * (N - 1) / N * 4 * theta.size)
  return theta


def _setup(theta, inner, last_step=None):
  """(step, params, state, targets) on a 2-device mesh; step returns (params, state, wire bytes)."""
  mesh = jax.make_mesh((N,), ("data",), devices=jax.devices()[:N])
  tx = _diloco.diloco(inner, _diloco.outer_sgd(OUTER_LR, MOMENTUM), H, "data", last_step)
  params = jax.device_put({"w": jnp.asarray(theta)}, NamedSharding(mesh, P()))
  state, specs = _diloco.init_sharded(tx, params, mesh, "data")

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data")),
                     out_specs=(P(), specs, P()))
  def step(params, state, c):
    grads = jax.grad(lambda p: 0.5 * jnp.sum((p["w"] - c[0]) ** 2))(
        _diloco.local_point(params, state))
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, state.wire_bytes

  return step, params, state, jax.device_put(jnp.asarray(C), NamedSharding(mesh, P("data")))


def _jax_run(theta, steps=ROUNDS * H, last_step=None):
  step, params, state, c = _setup(theta, optax.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD),
                                  last_step)
  sent = []
  for _ in range(steps):
    params, state, wire = step(params, state, c)
    sent.append(float(wire))
  return np.asarray(params["w"]), sent, state


def test_two_rounds_match_the_numpy_replay():
  theta0 = np.array([0.3, -0.7, 1.2, 0.0], np.float32)
  got, sent, state = _jax_run(theta0)
  want = _replay(theta0)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert not np.allclose(want, theta0)  # the rounds moved theta
  # Only the outer steps communicate: one float32 ring all-reduce of the parameters.
  assert sent == [0.0, 0.0, 16.0, 0.0, 0.0, 16.0]
  assert not np.any(np.asarray(state.offset["w"]))  # every device back at theta after a round


def test_the_last_step_ends_a_shorter_round():
  theta0 = np.array([0.3, -0.7, 1.2, 0.0], np.float32)
  got, sent, _ = _jax_run(theta0, steps=H + 2, last_step=H + 2)
  np.testing.assert_allclose(got, _replay(theta0, rounds=(H, 2)), rtol=1e-5, atol=1e-6)
  assert sent == [0.0, 0.0, 16.0, 0.0, 16.0]


def test_between_rounds_params_stay_and_each_device_moves_its_own_copy():
  theta0 = np.array([0.3, -0.7, 1.2, 0.0], np.float32)
  step, params, state, c = _setup(theta0, optax.adamw(LR))
  for _ in range(H - 1):
    params, state, _ = step(params, state, c)
  np.testing.assert_array_equal(np.asarray(params["w"]), theta0)  # no outer step yet
  offsets = np.asarray(state.offset["w"])
  assert offsets.shape == (N, 4) and not np.allclose(offsets[0], offsets[1])


def test_inner_steps_must_be_a_positive_int():
  with pytest.raises(ValueError, match="inner_steps=0 must be an int >= 1"):
    _diloco.diloco(optax.adamw(1e-3), _diloco.outer_sgd(), 0, "data")
