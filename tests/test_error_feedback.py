"""The 1-bit compressor against numpy, and error feedback through compressed_mean (private: onebit_optax._collective).

Error feedback is what makes 1-bit compression unbiased over time. For a fixed
input ``v`` compressed ``K`` times, the sum of the outputs telescopes (one
device: ``out_k = v + e_{k-1} - e_k + s_{k-1} - s_k``), so

    K * (mean of the K outputs - v) = -(e_K + s_K)

with ``e``/``s`` the worker/server errors, which stay bounded: the running mean
converges like 1/K. Without feedback every call returns the same biased
``C(v)`` and the mean never improves. Under ``shard_map`` the same holds for
the mean of the 8 devices' vectors, with the average of the worker errors.
"""

import functools

from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import pytest

from onebit_optax import _collective
from onebit_optax import _compressor

N = 8
SIZE = 200  # a multiple of 8 (one device), not of 64: padded on 8 devices
PADDED = _compressor.padded_size(SIZE, N)  # 256 on 8 devices
MAX_STEPS = 400
CHECKPOINTS = (50, 100, 200, 400)


# ----------------------------------------------------------------------------
# sign_compress / sign_decompress against numpy.


def _numpy_compress(x):
  flat = np.asarray(x, np.float32).ravel()
  packed = np.packbits(flat >= 0, bitorder="little")  # -0.0 >= 0 is True: sign(0) = +1
  # The squares are float32 and flush to zero below float32's smallest normal
  # (XLA on CPU, every jax version tested): |x| < ~1.1e-19 adds nothing.
  squares = np.square(flat)
  squares = np.where(squares < np.finfo(np.float32).tiny, 0, squares)
  scale = np.sqrt(np.mean(squares.astype(np.float64)))
  return packed, scale


# Subnormals are left out: XLA on CPU flushes them to zero, so a negative
# subnormal encodes as +1 there (like -0.0) while numpy says -1.
_finite_float32 = st.floats(-1e3, 1e3, width=32, allow_subnormal=False)


@jax.jit
def _compress_and_decode(x):
  # One compiled program per shape: much faster than op-by-op for many shapes.
  packed, scale = _compressor.sign_compress(x)
  return packed, scale, _compressor.sign_decompress(packed, scale, x.size)


@settings(max_examples=20, deadline=None)
@given(hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=3, max_side=11),
                  elements=_finite_float32))
def test_sign_compress_matches_numpy(x):
  packed, scale, decoded = _compress_and_decode(jnp.asarray(x))
  expected_packed, expected_scale = _numpy_compress(x)
  assert packed.dtype == jnp.uint8
  np.testing.assert_array_equal(np.asarray(packed), expected_packed)
  np.testing.assert_allclose(float(scale), expected_scale, rtol=1e-5, atol=1e-30)
  # The decoder gives scale * (+1/-1), bit k of byte j being element 8j + k.
  bits = np.unpackbits(expected_packed, count=x.size, bitorder="little")
  np.testing.assert_array_equal(
      np.asarray(decoded), np.where(bits == 1, np.float32(scale), -np.float32(scale)))


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 5), st.integers(1, 70), st.integers(0, 2**32 - 1))
def test_sign_decompress_rows_match_numpy(rows, size, seed):
  # Several rows at once (as the server decodes n workers' chunks), each with its own scale.
  rng = np.random.default_rng(seed)
  packed = rng.integers(0, 256, size=(rows, -(-size // 8)), dtype=np.uint8)
  scales = rng.uniform(0.1, 10.0, size=rows).astype(np.float32)
  decoded = jax.jit(_compressor.sign_decompress, static_argnums=2)(
      jnp.asarray(packed), jnp.asarray(scales), size)
  bits = np.unpackbits(packed, axis=-1, count=size, bitorder="little")
  expected = np.where(bits == 1, scales[:, None], -scales[:, None])
  np.testing.assert_array_equal(np.asarray(decoded), expected)


@pytest.mark.parametrize("size", [1, 7, 8, 9, 13, 63])
def test_sign_of_zero_is_plus_one_and_odd_sizes_pad_with_zero_bits(size):
  x = np.zeros(size, np.float32)
  x[1::3] = -0.0
  x[2::3] = -2.5
  packed, scale = _compressor.sign_compress(jnp.asarray(x))
  expected_packed, expected_scale = _numpy_compress(x)
  assert packed.shape == (-(-size // 8),)
  np.testing.assert_array_equal(np.asarray(packed), expected_packed)
  np.testing.assert_allclose(float(scale), expected_scale, rtol=1e-6)
  bits = np.unpackbits(np.asarray(packed), bitorder="little")
  assert not np.any(bits[size:])  # bits past the end are 0, whatever the signs
  assert np.all(bits[:size][x == 0] == 1)  # +0.0 and -0.0 both encode as +1
  assert np.all(bits[:size][x < 0] == 0)
  decoded = np.asarray(_compressor.sign_decompress(packed, scale, size))
  np.testing.assert_array_equal(decoded, np.where(bits[:size] == 1, scale, -scale))


def test_scale_counts_zero_padding():
  # The RMS runs over the whole (padded) vector, zeros included.
  x = np.zeros(16, np.float32)
  x[:4] = [3.0, -4.0, 1.0, -2.0]
  _, scale = _compressor.sign_compress(jnp.asarray(x))
  np.testing.assert_allclose(float(scale), np.sqrt(30.0 / 16.0), rtol=1e-6)


# ----------------------------------------------------------------------------
# Error feedback through compressed_mean.


def _target(seed, shape):
  rng = np.random.default_rng(seed)
  # Different magnitudes per coordinate, so that a single sign per element with
  # one shared scale is a biased approximation of it.
  return (rng.normal(size=shape) * rng.uniform(0.1, 3.0, size=shape) + 0.3).astype(np.float32)


def _repeat_compressed_mean(x, worker_error, server_error, axis_name, feedback):
  """MAX_STEPS calls of compressed_mean on the same x; returns the outputs and final errors."""
  def body(carry, _):
    worker_error, server_error = carry
    if not feedback:
      worker_error, server_error = jnp.zeros_like(worker_error), jnp.zeros_like(server_error)
    mean, worker_error, server_error = _collective.compressed_mean(
        x, worker_error, server_error, axis_name)
    return (worker_error, server_error), mean
  (worker_error, server_error), outputs = jax.lax.scan(
      body, (worker_error, server_error), None, length=MAX_STEPS)
  return outputs, worker_error, server_error


def _running_mean_errors(outputs, target):
  """Relative error of the mean of the first K outputs, for each K in CHECKPOINTS."""
  running = np.cumsum(np.asarray(outputs, np.float64), axis=0)
  norm = np.linalg.norm(target)
  return {k: np.linalg.norm(running[k - 1] / k - target) / norm for k in CHECKPOINTS}


def _check_converges_like_one_over_k(errors, errors_without_feedback):
  # 1/K: from 50 to 400 calls the error drops about 8x (at least 4x), and K * error
  # stays bounded by the (bounded) error buffers instead of growing (it would
  # grow by sqrt(8) = 2.8x for a 1/sqrt(K) rate). Measured K * error: 2.7-3.0
  # on one device, 5.4-5.6 on 8 devices.
  assert errors[400] < errors[50] / 4, errors
  scaled = [k * errors[k] for k in CHECKPOINTS]
  assert max(scaled) < 1.5 * scaled[0], scaled
  assert max(scaled) < 10.0, scaled
  # Without feedback the mean is stuck at the biased C(v).
  assert errors_without_feedback[400] > 0.9 * errors_without_feedback[50], errors_without_feedback
  assert errors_without_feedback[400] > 0.1
  assert errors_without_feedback[400] > 50 * errors[400]


def test_error_feedback_one_device():
  v = _target(0, (SIZE,))
  run = jax.jit(_repeat_compressed_mean, static_argnums=(3, 4))
  zeros = (jnp.zeros(SIZE), jnp.zeros(SIZE))
  outputs, worker_error, server_error = run(jnp.asarray(v), *zeros, None, True)
  no_feedback_outputs, _, _ = run(jnp.asarray(v), *zeros, None, False)
  errors = _running_mean_errors(outputs, v)
  _check_converges_like_one_over_k(errors, _running_mean_errors(no_feedback_outputs, v))
  # The telescoping sum, exactly what error feedback promises (up to float32
  # rounding accumulated over the calls).
  total = np.sum(np.asarray(outputs, np.float64), axis=0)
  np.testing.assert_allclose(
      total - MAX_STEPS * v.astype(np.float64),
      -(np.asarray(worker_error, np.float64) + np.asarray(server_error, np.float64)),
      atol=1e-3 * np.linalg.norm(v))


def test_error_feedback_8_devices_shard_map():
  mesh = jax.make_mesh((N,), ("data",))
  vs = np.zeros((N, PADDED), np.float32)
  vs[:, :SIZE] = _target(1, (N, SIZE))  # a different vector per device; zero padding
  target = vs.mean(axis=0, dtype=np.float64)

  def per_device(feedback, x, worker_error, server_error):
    outputs, worker_error, server_error = _repeat_compressed_mean(
        x[0], worker_error[0], server_error[0], "data", feedback)
    return outputs, worker_error[None], server_error[None]

  def run(feedback):
    return jax.jit(jax.shard_map(
        functools.partial(per_device, feedback), mesh=mesh,
        in_specs=(P("data"), P("data"), P("data")),
        out_specs=(P(), P("data"), P("data"))))(
            jax.device_put(vs, NamedSharding(mesh, P("data"))),
            jax.device_put(np.zeros((N, PADDED), np.float32), NamedSharding(mesh, P("data"))),
            jax.device_put(np.zeros((N, PADDED // N), np.float32),
                           NamedSharding(mesh, P("data"))))

  # Waited for before the next 8-device program is queued (XLA:CPU rendezvous abort).
  outputs, worker_error, server_error = jax.block_until_ready(run(True))
  no_feedback_outputs, _, _ = run(False)
  errors = _running_mean_errors(outputs, target)
  _check_converges_like_one_over_k(errors, _running_mean_errors(no_feedback_outputs, target))
  # Telescoping over 8 workers: the mean of the worker errors plus, chunk by
  # chunk, the error of that chunk's server (device r serves chunk r).
  total = np.sum(np.asarray(outputs, np.float64), axis=0)
  residual = (np.asarray(worker_error, np.float64).mean(axis=0)
              + np.asarray(server_error, np.float64).reshape(-1))
  np.testing.assert_allclose(total - MAX_STEPS * target, -residual,
                             atol=1e-3 * np.linalg.norm(target))
