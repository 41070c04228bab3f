"""Property tests of the compressor and the collective on edge values (hypothesis).

What is pinned down here, for any shape (0-size, scalar, odd) and any float32
value (±0.0, subnormals, 1e38, ±inf, NaN), as a numpy model:

* ``sign_compress``: bit = ``x >= 0`` with ``sign(0) = sign(-0.0) = +1``;
  NaN gives bit 0 and a NaN scale; the scale is the RMS ``||x||_2 / sqrt(d)``.
  Two platform facts the docstring does not state: XLA on CPU (like GPUs)
  flushes subnormals to zero, so a negative subnormal encodes as +1 and adds
  nothing to the scale; and the sum of squares is float32, so the scale is
  ``inf`` once it overflows (``|x|`` around 1.8e19 and up) although the RMS
  itself would be finite. The flush holds on every jax version measured (0.10.2,
  0.11.2, 0.12.0.1) with one exception that comes from XLA's simplifier, not
  from the compressor: for a single element, the XLA of jax 0.10 rewrites
  ``sqrt(x * x)`` to ``|x|`` (exact: a lone subnormal keeps its value as the
  scale, 1e-20 does not underflow, 3e19 does not overflow); from jax 0.11 on the
  one-element scale follows the same float32 model as any other size. The model
  asks XLA which of the two it does (``_xla_rewrites_one_element_rms``).
  bfloat16 / float16 inputs are cast exactly to float32.
* ``compressed_mean`` (one device, and jitted on 8 devices for a few fixed
  sizes): no crash; the mean is bitwise the same on all devices; with finite
  inputs nothing is lost (``mean = avg_i(x_i + e_i - e_i') + s - s'``, chunk by
  chunk) and every chunk decodes to ``±scale``. A bare vector is compressed
  with one scale per chunk (a segment), so one non-finite value on one device
  makes its *chunk* of the output non-finite on *every* device (the other
  chunks are untouched); the collective non-finite skip of 1-bit Adam reads
  that off the scales every device gathers.
* Error feedback: one compression step obeys
  ``||e'||^2 = 2 ||u||^2 (1 - ||u||_1 / (sqrt(d) ||u||_2))`` with ``u = x + e``,
  so ``||e'|| <= sqrt(2) ||u||``; NOT ``||e'|| <= ||u||``: the RMS scale
  over-shoots sparse vectors (a 1-sparse ``u`` of size 64 gives
  ``||e'|| = 1.32 ||u||``). Repeated calls on a fixed vector keep the errors
  bounded (they plateau; measured sup ``||e|| / ||x||`` ~ ``sqrt(d)`` for 1-sparse
  ``x``, ~2-4 for Gaussian ``x``).
"""

import functools
import math

from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import pytest

from onebit_optax import _collective
from onebit_optax import _compressor
from onebit_optax import _wire

N = 8
F32_MAX = float(np.finfo(np.float32).max)
TINY = float(np.finfo(np.float32).tiny)  # smallest normal float32

SPECIAL = [0.0, -0.0, 1e-40, -1e-40, 1e-45, -1e-45, 1e-20, 1e38, -1e38, 3e19,
           np.inf, -np.inf, np.nan]
# Everything float32 can hold (hypothesis favours the edges), or only moderate values.
_wild = st.one_of(st.floats(width=32), st.sampled_from(SPECIAL))
_moderate = st.floats(-1e3, 1e3, width=32)


def _values(shape):
  return st.one_of(hnp.arrays(np.float32, shape, elements=_wild),
                   hnp.arrays(np.float32, shape, elements=_moderate))


# ----------------------------------------------------------------------------
# The numpy model of the documented (and platform) behaviour.


def _flush(x):
  """XLA:CPU flushes subnormal inputs to (signed) zero."""
  x = np.asarray(x, np.float32)
  return np.where(np.abs(x) < TINY, np.float32(0), x)


def _model_bits(x):
  x = _flush(x).ravel()
  return ((x >= 0) & ~np.isnan(x)).astype(np.uint8)  # NaN >= 0 is False: bit 0


@functools.cache
def _xla_rewrites_one_element_rms():
  """Whether this XLA computes sqrt(sum(x * x)) of one element as |x| (jax 0.10: yes).

  A probe of the platform, not of onebit_optax: 1e-20 squared is subnormal, so
  the float32 formula gives 0 (flushed) where the rewrite gives 1e-20.
  """
  rms = jax.jit(lambda v: jnp.sqrt(jnp.sum(jnp.square(v))))(jnp.full((1,), 1e-20, jnp.float32))
  return float(rms) != 0.0


def _model_scale(x):
  """(expected float32 scale or None when the float32 overflow point is ambiguous)."""
  if x.size == 1 and _xla_rewrites_one_element_rms():
    # sqrt(x * x) became |x|: exact, no flush (not even of a subnormal x), no overflow.
    return float(np.abs(np.asarray(x, np.float32).ravel()[0]))
  x = _flush(x).ravel()
  if x.size == 0:
    return 0.0
  if np.any(np.isnan(x)):
    return np.nan
  if np.any(np.isinf(x)):
    return np.inf
  with np.errstate(over="ignore"):
    squares = np.square(x.astype(np.float32))  # float32, as on the device: may overflow
  squares = np.where(squares < TINY, 0, squares).astype(np.float64)  # subnormal squares flush
  total = float(np.sum(squares))
  if total > 2 * F32_MAX or np.any(np.isinf(squares)):
    return np.inf
  if total > F32_MAX / 2:
    return None  # summation order decides whether float32 overflows
  return math.sqrt(total) / math.sqrt(x.size)


def _check_scale(actual, expected, what=""):
  actual = float(actual)
  if expected is None:
    return
  if np.isnan(expected):
    assert np.isnan(actual), what
  elif np.isinf(expected):
    assert actual == np.inf, what
  else:
    np.testing.assert_allclose(actual, expected, rtol=2e-6, atol=0, err_msg=what)


@jax.jit
def _compress_and_decode(x):
  packed, scale = _compressor.sign_compress(x)
  return packed, scale, _compressor.sign_decompress(packed, scale, x.size)


# ----------------------------------------------------------------------------
# sign_compress / sign_decompress.


_shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=9)


@settings(max_examples=40, deadline=None)
@given(_shapes.flatmap(_values))
def test_sign_compress_edge_values_follow_the_model(x):
  packed, scale, decoded = _compress_and_decode(jnp.asarray(x))
  size = x.size
  assert packed.dtype == np.uint8 and packed.shape == (-(-size // 8),)
  assert scale.dtype == np.float32 and scale.shape == ()
  bits = np.unpackbits(np.asarray(packed), bitorder="little")
  np.testing.assert_array_equal(bits[:size], _model_bits(x), err_msg=str(x))
  assert not np.any(bits[size:])  # trailing bits of the last byte are 0
  _check_scale(scale, _model_scale(x), str(x))
  # Decoding is exactly scale * (2 bit - 1), whatever the scale (0, inf, NaN; a
  # subnormal scale, possible for one element, decodes to 0 under flushing).
  expected = _flush(np.where(bits[:size] == 1, np.float32(scale), -np.float32(scale)))
  np.testing.assert_array_equal(np.asarray(decoded), expected)


def test_documented_signs_of_zero_nan_and_subnormals():
  x = np.array([0.0, -0.0, np.nan, -np.nan, 1e-40, -1e-40, -1.0, np.inf, -np.inf, 2.0],
               np.float32)
  packed, scale, _ = _compress_and_decode(jnp.asarray(x))
  bits = np.unpackbits(np.asarray(packed), bitorder="little", count=x.size)
  #                            0  -0 nan -nan +sub -sub -1 inf -inf 2
  np.testing.assert_array_equal(bits, [1, 1, 0, 0, 1, 1, 0, 1, 0, 1])
  assert np.isnan(float(scale))
  assert float(_compress_and_decode(jnp.asarray(x[6:]))[1]) == np.inf
  assert float(_compress_and_decode(jnp.full(8, 1e-40, jnp.float32))[1]) == 0.0
  # The float32 sum of squares overflows although the RMS (1e20) is representable.
  assert float(_compress_and_decode(jnp.full(8, 1e20, jnp.float32))[1]) == np.inf
  np.testing.assert_allclose(float(_compress_and_decode(jnp.full(8, 1e18, jnp.float32))[1]),
                             1e18, rtol=1e-6)


def test_long_axes_pack_words_into_the_same_bytes():
  # From WORDS_FROM elements pack_signs forms uint32 words: the bytes must be packbits' own,
  # edge values included, along any axis (a group (leaves, size) packs along axis 1).
  n = _compressor.WORDS_FROM
  rng = np.random.default_rng(1)
  x = rng.standard_normal((2, n)).astype(np.float32)
  edges = np.array([0.0, -0.0, np.nan, -np.nan, 1e-40, -1e-40, np.inf, -np.inf], np.float32)
  x[:, :edges.size] = edges
  x[1, 4096:4096 + edges.size] = edges[::-1]
  # (XLA:CPU flushes subnormals to zero, the sign of -1e-40 included: documented above)
  expected = np.packbits(_flush(x) >= 0, axis=1, bitorder="little")
  np.testing.assert_array_equal(np.asarray(_compressor.pack_signs(jnp.asarray(x), axis=1)), expected)
  np.testing.assert_array_equal(  # the short-axis path (packbits) agrees on every value
      np.asarray(jnp.packbits(jnp.asarray(x) >= 0, axis=1, bitorder="little")), expected)
  np.testing.assert_array_equal(np.asarray(_compressor.pack_signs(jnp.asarray(x.T), axis=0)),
                                expected.T)
  packed, _ = _compressor.sign_compress(jnp.asarray(x[0]))
  np.testing.assert_array_equal(np.asarray(packed), expected[0])


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_signs_and_squares_match_packbits_and_numpy_sums(rows, words, seed):
  # The one-pass compression of a group and of a server's chunk: its bytes are packbits' own,
  # edge values included; its sums of squares are numpy's (float64) to float32 rounding.
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal((rows, 32 * words)) * 10.0 ** rng.integers(-3, 4)).astype(np.float32)
  edges = np.array([0.0, -0.0, np.nan, -np.inf, np.inf, 1e-40, -1e-40], np.float32)
  x.reshape(-1)[rng.choice(x.size, min(3, x.size), replace=False)] = rng.choice(edges, min(3, x.size))
  signs, squares = _compressor.signs_and_squares(jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(signs),
                                np.packbits(_flush(x) >= 0, axis=1, bitorder="little"))
  expected = np.square(_flush(x).astype(np.float64)).reshape(rows, words, 32).sum(axis=2)
  got = np.asarray(squares, np.float64)
  finite = np.isfinite(expected)
  np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-5)
  assert np.array_equal(np.isnan(got), np.isnan(expected))
  blocks_signs, block_sums = _compressor.signs_and_block_sums(jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(blocks_signs), np.asarray(signs).reshape(-1))
  np.testing.assert_allclose(np.asarray(block_sums)[finite.all(1)],
                             expected.sum(1)[finite.all(1)], rtol=1e-5)


@pytest.mark.parametrize("extra", [0, 5, 37, 128])
def test_large_groups_compress_in_one_pass_as_each_leaf_alone(extra):
  # From WORDS_FROM elements a group's signs and scales come from one pass, its leaves' last
  # partial word and padding words formed apart: the bytes must be each leaf's packbits (padded
  # with positive signs to whole blocks), the scales numpy's RMS of each leaf.
  n = _compressor.WORDS_FROM + extra
  x = np.random.default_rng(extra).standard_normal((2, n)).astype(np.float32)
  x[:, -3:] = [-0.0, -1.0, 0.0]
  signs, scales = _wire.group_compress(jnp.asarray(x))
  pad = -n % 128
  bits = np.concatenate([x >= 0, np.ones((2, pad), bool)], axis=1)
  np.testing.assert_array_equal(np.asarray(signs), np.packbits(bits, axis=1, bitorder="little").reshape(-1))
  np.testing.assert_allclose(np.asarray(scales), np.sqrt(np.mean(np.square(x.astype(np.float64)), 1)),
                             rtol=1e-5)


@settings(max_examples=15, deadline=None)
@given(st.sampled_from([jnp.bfloat16, jnp.float16]),
       hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=9),
       st.data())
def test_low_precision_input_is_compressed_as_its_float32_cast(dtype, shape, data):
  with np.errstate(over="ignore"):
    x = data.draw(_values(shape)).astype(jnp.dtype(dtype))  # beyond the range: inf
  low = _compress_and_decode(jnp.asarray(x))
  cast = _compress_and_decode(jnp.asarray(x.astype(np.float32)))  # exact cast
  for a, b in zip(low, cast):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_one_million_elements_once():
  rng = np.random.default_rng(0)
  x = rng.standard_normal(1_000_003).astype(np.float32)
  x[::1000] = 0.0
  x[1::1000] = -0.0
  packed, scale, decoded = _compress_and_decode(jnp.asarray(x))
  np.testing.assert_array_equal(
      np.asarray(packed), np.packbits(x >= 0, bitorder="little"))
  np.testing.assert_allclose(float(scale), np.sqrt(np.mean(x.astype(np.float64) ** 2)),
                             rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(decoded),
                                np.where(x >= 0, np.float32(scale), -np.float32(scale)))
  # And through the one-device collective: conservation, bounded error.
  d = _compressor.padded_size(x.size, 1)
  u = np.pad(x, (0, d - x.size))
  mean, we, se = jax.jit(functools.partial(_collective.compressed_mean, axis_name=None))(
      jnp.asarray(u), jnp.zeros(d), jnp.zeros(d))
  np.testing.assert_allclose(np.asarray(mean) + np.asarray(we) + np.asarray(se), u,
                             rtol=0, atol=1e-5)
  assert np.linalg.norm(we) <= np.sqrt(2) * np.linalg.norm(u)


# ----------------------------------------------------------------------------
# Error feedback.


@jax.jit
def _one_call(x, worker_error, server_error):
  return _collective.compressed_mean(x, worker_error, server_error, axis_name=None)


def _error_identity(u, new_error):
  """||e'||^2 against 2 ||u||^2 (1 - ||u||_1 / (sqrt(d) ||u||_2)), float64."""
  u = np.asarray(u, np.float64)
  n2, n1 = np.linalg.norm(u), np.sum(np.abs(u))
  expected = 2 * n2 ** 2 * (1 - n1 / (np.sqrt(u.size) * n2)) if n2 > 0 else 0.0
  return float(np.sum(np.asarray(new_error, np.float64) ** 2)), expected, n2


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([8, 24, 64]).flatmap(
    lambda d: st.tuples(hnp.arrays(np.float32, d, elements=_moderate),
                        hnp.arrays(np.float32, d, elements=_moderate))))
def test_one_step_worker_error_identity_and_sqrt2_bound(x_and_error):
  x, error = x_and_error
  u = _flush(x.astype(np.float32) + error)  # what the device compresses
  _, new_error, _ = _one_call(jnp.asarray(x), jnp.asarray(error), jnp.zeros(x.size))
  got, expected, norm_u = _error_identity(u, new_error)
  assert abs(got - expected) <= 1e-4 * norm_u ** 2 + 1e-30, (got, expected)
  assert np.sqrt(got) <= np.sqrt(2) * norm_u * (1 + 1e-5) + 1e-30


def test_error_can_exceed_the_compressed_vector_for_sparse_input():
  # Documented: the RMS scale is not a contraction. For a 1-sparse u of size d,
  # C(u) puts ||u|| / sqrt(d) on every coordinate: ||e'||^2 = 2 ||u||^2 (1 - 1/sqrt(d)).
  d = 64
  u = np.zeros(d, np.float32)
  u[5] = 1.0
  _, new_error, _ = _one_call(jnp.asarray(u), jnp.zeros(d), jnp.zeros(d))
  ratio = float(np.linalg.norm(new_error) / np.linalg.norm(u))
  np.testing.assert_allclose(ratio, np.sqrt(2 * (1 - 1 / np.sqrt(d))), rtol=1e-5)
  assert ratio > 1.3


@functools.partial(jax.jit, static_argnums=1)
def _repeat(x, steps):
  d = x.shape[0]

  def body(carry, _):
    _, worker_error, server_error = _collective.compressed_mean(x, *carry, axis_name=None)
    return (worker_error, server_error), jnp.sqrt(jnp.sum(worker_error ** 2) +
                                                  jnp.sum(server_error ** 2))
  _, norms = jax.lax.scan(body, (jnp.zeros(d), jnp.zeros(d)), None, length=steps)
  return norms


def _sparse(d, k, rng):
  x = np.zeros(d, np.float32)
  x[rng.choice(d, k, replace=False)] = rng.standard_normal(k)
  return x


@settings(max_examples=15, deadline=None)
@given(st.sampled_from([8, 64, 1024]), st.sampled_from(["dense", "sparse", "heavy"]),
       st.integers(0, 2**32 - 1))
def test_repeated_calls_on_a_fixed_vector_keep_errors_bounded(d, kind, seed):
  rng = np.random.default_rng(seed)
  x = {"dense": lambda: rng.standard_normal(d),
       "sparse": lambda: _sparse(d, max(1, d // 50), rng),
       "heavy": lambda: rng.standard_cauchy(d)}[kind]().astype(np.float32)
  norms = np.asarray(_repeat(jnp.asarray(x), 300)) / np.linalg.norm(x)
  assert np.all(np.isfinite(norms))
  # Bounded by a size-dependent constant (measured sup: 0.97 sqrt(d) for 1-sparse)...
  assert norms.max() <= 2 * np.sqrt(d), norms.max()
  # ...and no drift: the error fluctuates, but its level over the last 100 calls
  # is that of the 100 before (a growing error would show here).
  assert norms[200:].mean() <= 1.1 * norms[100:200].mean() + 1e-6, (
      norms[100:200].mean(), norms[200:].mean())


# ----------------------------------------------------------------------------
# compressed_mean on 8 devices: fixed sizes, so each compiles once.


SIZES = (64, 192)


@functools.cache
def _mean_8(size):
  mesh = jax.make_mesh((N,), ("data",))
  fn = jax.jit(jax.shard_map(
      lambda x, e, s: tuple(a[None] for a in _collective.compressed_mean(x[0], e[0], s[0], "data")),
      mesh=mesh, in_specs=P("data"), out_specs=P("data")))
  place = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))

  def run(x, e, s):
    out = fn(place(x), place(e), place(s))
    return tuple(np.asarray(a) for a in out)  # (N, ...) each: one row per device
  return run


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(SIZES).flatmap(lambda d: st.tuples(
    st.one_of(hnp.arrays(np.float32, (N, d), elements=_moderate),
              hnp.arrays(np.float32, (N, d), elements=_wild)),
    hnp.arrays(np.float32, (N, d), elements=st.floats(-1, 1, width=32)),
    hnp.arrays(np.float32, (N, d // N), elements=st.floats(-1, 1, width=32)))))
def test_compressed_mean_8_devices_edge_values(args):
  x, worker_error, server_error = args
  d = x.shape[1]
  mean, new_we, new_se = _mean_8(d)(x, worker_error, server_error)
  # The decoded mean is the same bits on every device.
  assert all(row.tobytes() == mean[0].tobytes() for row in mean)
  u = _flush(x + worker_error)
  # A bare vector is one segment per chunk: device i compresses chunk r of its
  # vector with a scale of its own, scales[i][r].
  scales = [[_model_scale(chunk) for chunk in row.reshape(N, d // N)] for row in u]
  flat_scales = [s for row in scales for s in row]
  if all(s is not None and np.isfinite(s) for s in flat_scales):
    assert np.all(np.isfinite(mean))
    # Nothing lost: the mean is the average of what the workers kept out of their
    # errors, plus what the servers kept out of theirs (chunk r on device r).
    kept = (u - _flush(new_we)).astype(np.float64).mean(axis=0)
    kept += (server_error - new_se).astype(np.float64).ravel()
    magnitude = max(np.max(np.abs(u)), np.max(np.abs(server_error)), 1e-30)
    np.testing.assert_allclose(mean[0], kept, rtol=0, atol=3e-6 * magnitude)
    # Each server chunk decodes to +-(its scale).
    for chunk in mean[0].reshape(N, d // N):
      assert np.all(np.abs(chunk) == np.abs(chunk[0]))
  else:
    # One device's NaN / Inf / overflow in chunk r reaches server r, hence chunk r
    # of the mean on every device (which every device then sees: the optimizer's
    # non-finite skip reads it off the gathered scales); the other chunks are
    # compressed with scales of their own and stay finite.
    for r in range(N):
      column = [row[r] for row in scales]
      chunk = mean[:, r * (d // N):(r + 1) * (d // N)]
      if any(s is not None and not np.isfinite(s) for s in column):
        assert not np.any(np.isfinite(chunk)), (r, np.isfinite(chunk).sum())
      elif all(s is not None for s in column):
        assert np.all(np.isfinite(chunk)), r


def test_compressed_mean_8_devices_one_nan_poisons_its_chunk_everywhere():
  d = SIZES[0]
  rng = np.random.default_rng(1)
  x = rng.standard_normal((N, d)).astype(np.float32)
  zeros = np.zeros((N, d), np.float32), np.zeros((N, d // N), np.float32)
  clean, _, _ = _mean_8(d)(x, *zeros)
  assert np.all(np.isfinite(clean))
  bad_chunk = slice(2 * d // N, 3 * d // N)  # element 17 is in chunk 2 (8 elements each)
  outside = np.ones(d, bool)
  outside[bad_chunk] = False
  for bad in (np.nan, np.inf, -np.inf, 1e38):
    poisoned = x.copy()
    poisoned[3, 17] = bad
    mean, _, _ = _mean_8(d)(poisoned, *zeros)
    # Chunk 2 is non-finite on every device (NaN for a NaN)...
    assert not np.any(np.isfinite(mean[:, bad_chunk])), bad
    if np.isnan(bad):
      assert np.all(np.isnan(mean[:, bad_chunk]))
    # ...and the other chunks, with their own scales, are bitwise the clean result.
    assert mean[:, outside].tobytes() == clean[:, outside].tobytes(), bad
