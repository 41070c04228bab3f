"""compressed_mean_updates and compressed_trace as building blocks: error-feedback 1-bit momentum SGD.

``optax.chain(compressed_mean_updates('data'), optax.trace(0.9), optax.scale(-lr))``
against the same chain with a float32 ``pmean`` instead, on scikit-learn's
digits (a 64-128-10 MLP), 8 simulated devices with the shard_map recipe. The
step-by-step arithmetic is checked against the numpy workers in
tests/test_reference_simulation.py; here: does it train like the uncompressed
average, and does error feedback matter.
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import optax
import pytest

import onebit_optax
from onebit_optax import _compressed_updates

N, STEPS, BATCH, LR = 8, 300, 256, 0.1


def _digits():
  from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
  data = load_digits()
  return (data.data / 16.0).astype(np.float32), data.target.astype(np.int32)


def _init(key):
  k1, k2 = jax.random.split(key)
  return {"w1": jax.random.normal(k1, (64, 128)) / 8.0, "b1": jnp.zeros(128),
          "w2": jax.random.normal(k2, (128, 10)) / np.sqrt(128.0), "b2": jnp.zeros(10)}


def _loss(params, x, y):
  h = jax.nn.relu(x @ params["w1"] + params["b1"])
  return optax.softmax_cross_entropy_with_integer_labels(h @ params["w2"] + params["b2"], y).mean()


class _PmeanUpdates:
  """The float32 reference: pmean of the updates, as a transformation."""

  @staticmethod
  def make():
    return optax.GradientTransformation(
        lambda params: optax.EmptyState(),
        lambda updates, state, params=None: (jax.lax.pmean(updates, "data"), state))


def _train(average, reset_errors=False, lr=LR, momentum=None):
  x, y = _digits()
  mesh = jax.make_mesh((N,), ("data",))
  # The momentum after the average (optax.trace), or given: one that averages itself.
  tx = optax.chain(average, optax.trace(0.9) if momentum is None else momentum,
                   optax.scale(-lr))
  params = jax.device_put(_init(jax.random.key(0)), NamedSharding(mesh, P()))
  state = onebit_optax.init_sharded(tx, params, mesh)
  specs = onebit_optax.state_partition_specs(state, "data")

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                     out_specs=(P(), specs, P()))
  def step(params, state, xb, yb):
    loss, grads = jax.value_and_grad(_loss)(onebit_optax.local_params(params, "data"), xb, yb)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, jax.lax.pmean(loss, "data")

  rng = np.random.default_rng(0)
  data = NamedSharding(mesh, P("data"))
  for _ in range(STEPS):
    idx = rng.integers(0, len(x), BATCH)
    params, state, loss = step(params, state, jax.device_put(x[idx], data),
                               jax.device_put(y[idx], data))
    if reset_errors:
      state = (state[0]._replace(worker_error=jnp.zeros_like(state[0].worker_error),
                                 server_error=jnp.zeros_like(state[0].server_error)),
               *state[1:])
    float(loss)  # wait for the step (XLA:CPU rendezvous)
  return float(_loss(jax.device_get(params), x, y)), state


@functools.cache
def _float32_loss(lr):
  """The final loss of the float32 reference (pmean, then momentum) at ``lr``, trained once."""
  return _train(_PmeanUpdates.make(), lr=lr)[0]


@pytest.fixture(scope="module")
def full_precision():
  return _float32_loss(LR)


def test_error_feedback_1bit_momentum_sgd_trains():
  # At lr 0.03 (a third of the full-precision optimum's 0.1) EF 1-bit momentum
  # SGD is stable: measured 0.129 against 0.101 for full precision on jax 0.10.2.
  loss, state = _train(_compressed_updates.compressed_mean_updates("data"), lr=0.03)
  reference = _float32_loss(0.03)
  initial = float(_loss(_init(jax.random.key(0)), *_digits()))
  print(f"\n[EF 1-bit momentum SGD, lr 0.03] loss {initial:.3f} -> {loss:.4f}; full "
        f"precision {reference:.4f}; {float(np.asarray(state[0].wire_bytes)):,.0f} bytes per "
        "device per step")
  assert loss < 1.6 * reference, (loss, reference)  # 0.140 on jax 0.12.0.1
  assert float(np.asarray(state[0].wire_bytes)) > 0


@pytest.mark.xfail(strict=True, reason=(
    "measured on jax 0.10.2: compressing the gradient, then momentum, ends at 0.144 (0.329 on "
    "jax 0.12) against 0.038 for full precision at lr 0.1 (0.68 vs 0.015 after 600 steps, "
    "1.95 vs 0.007 at lr 0.3). The server's error feedback is what hurts: resetting only "
    "the server error every step gives 0.041 (only the worker error: 0.067; both: 0.055); "
    "an L1 server scale diverges (1.92). Compress the momentum instead: compressed_trace."))
def test_error_feedback_1bit_momentum_sgd_within_a_few_percent(full_precision):
  loss, _ = _train(_compressed_updates.compressed_mean_updates("data"))
  assert loss < 1.05 * full_precision + 0.01, (loss, full_precision)


@pytest.mark.parametrize("lr", [0.1, 0.3])
def test_compressed_momentum_sgd_within_a_few_percent_of_float32(lr):
  # Measured on jax 0.10.2: 0.0369 vs 0.0380 at lr 0.1, 0.0041 vs 0.0071 at lr 0.3
  # (the float32 optimum of {0.03, 0.1, 0.3}), 0.0989 vs 0.1009 at lr 0.03.
  loss, state = _train(optax.identity(), lr=lr,
                       momentum=_compressed_updates.compressed_trace(0.9, "data"))
  reference = _float32_loss(lr)
  print(f"\n[compressed_trace, lr {lr}] loss {loss:.4f}; float32 momentum SGD {reference:.4f}")
  assert loss < 1.05 * reference + 0.003, (loss, reference)
  # The momentum left shard_map as one replicated tree, the errors per device.
  assert state[1].mean.worker_error.shape[0] == N
