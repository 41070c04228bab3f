"""1-bit Adam (core v3) on 8 devices against an independent numpy simulation of 8 workers.

The simulation below is written from the algorithm's description (the 1-bit
Adam paper, DeepSpeed's ``compressed_allreduce`` and the core v3 wire format),
not from this package: it imports nothing from ``onebit_optax`` (the layout
model is tests/_flat.py, numpy). It keeps 8 workers' state in numpy float32
arrays and spells out every message: the sign bits, one scale per leaf piece
of a chunk, and the exact leaves' float32 values.

The model: ``pred = x @ w + b + g * (x[:, :5] @ a)``, a linear regression with
a different data shard per device and four leaves in pytree order
``a`` (5x20 = 100), ``b`` (20), ``g`` (a scalar), ``w`` (60x20 = 1200), 1321
parameters. With ``exact_below = 64`` ``b`` and ``g`` are *exact* leaves
(float32 on the wire, averaged exactly; 21 floats cut into 8 chunks of 3) and
``a``, ``w`` are *compressed*: their sign bits are laid out leaf after leaf on
128-element blocks (``a``: block 0, ``w``: blocks 1-10), padded to a multiple
of 8 * 128 = 1024, i.e. 2048 bits in 8 chunks of 2 blocks. Chunk 0 holds ``a``
and the start of ``w`` (two segments), ``w`` spans chunks 0-5 (cut by five
chunk boundaries), chunk 5 ends with the tail padding and chunks 6-7 are only
padding. A message is 32 bytes of signs, 2 scales and 3 exact floats: 52 bytes.

What each worker does in the compression phase (the spec, core v3): it holds
``u'`` (what it compressed last) and the scale ``s'`` (the RMS of each whole
leaf of ``u'``); the error feedback is ``e = u' - s' sign(u')``; it forms
``u = b1 m + (1 - b1) g_i + e`` per compressed leaf, with ``m`` the mean
momentum decoded from the last message, and sends to server ``r`` the signs of
chunk ``r``, the scale of each segment's *leaf*, and chunk ``r`` of the exact
leaves' ``b1 m + (1 - b1) g_i``. Server ``r`` decodes its 8 rows, averages,
adds its server error, re-compresses with one RMS scale per *segment* and
keeps ``w - C(w)``; the exact floats are averaged. At the freeze (the last
warmup step) the message becomes ``C(m)`` with one scale per leaf, and every
worker's ``u'`` becomes ``b1 m`` (scale ``b1 rms(m)``), so that the first
compression step forms exactly ``b1 m + (1 - b1) g_i``.

Every step compares the parameters, ``mu``/``nu``, the decoded momentum
(``onebit_optax.moments``), the message's sign bits (exactly), scales and exact
floats, each device's ``u`` (``local_momentum``) and worker error, and each
device's server error. Three deliberately wrong variants of the simulation
(the worker scale per segment instead of per leaf; no error feedback from the
freeze; every leaf compressed) must fail the same comparison.

Tolerance: every compared array must agree to ``tolerance * max|numpy
array|``. The simulation is float32 too, but numpy and XLA sum in different
orders (the gradient's matmul, the RMS scales, the means): a few ulps per
operation, accumulated over the steps. ``1 - b2**t`` is computed in float32
(as optax does) and for b2 = 0.999 cancels 3 digits, so XLA's ``pow`` and the
exact value differ by up to 2e-5 relative. Hence two configurations,
``b1=0.9, b2=0.999`` and ``b1=0.5, b2=0.75`` (every ``b**t`` up to the freeze
exact in float32), with the tolerances of ``CONFIGS``.

The sign decisions must agree exactly: a flipped sign moves a worker error by
2 * scale (relative change ~1). With ~10,000 values compressed per step, after
a few dozen steps one of them comes within 1e-6 of zero (relative to its
scale), where float32 rounding can flip it; so the free-running comparison
covers 12 compression steps and the test checks that no compressed value came
within rounding of 0 (``min_sign_margin``). The replica test below runs 100+
compression steps.
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
import _flat

F32 = np.float32
N = 8  # workers (devices)
FEATURES, OUTPUTS, LOCAL_BATCH, GATED = 60, 20, 12, 5
SHAPES = {"a": (GATED, OUTPUTS), "b": (OUTPUTS,), "g": (), "w": (FEATURES, OUTPUTS)}
NAMES = sorted(SHAPES)  # pytree order of the dict: a, b, g, w
SIZES = [int(np.prod(SHAPES[k], dtype=int)) for k in NAMES]  # 100, 20, 1, 1200
SIZE = sum(SIZES)  # 1321
EXACT_BELOW = 64
BLOCK = _flat.BLOCK
LR, EPS, FLOOR = 0.02, 1e-8, 0.01
FREEZE_AT, NUM_STEPS = 15, 27  # 12 compression steps: see the margin note above

# The old flat layout of all four leaves (compressed_mean_updates, compressed_trace):
# a [0, 100), b [128, 148), g [256, 257), w [384, 1584), padded to 2048.
PADDED = _flat.padded(SIZES, N)
CHUNK = PADDED // N
ALL_BITS = _flat.Bits(SIZES, N)


def _problem(seed=1):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(N, LOCAL_BATCH, FEATURES)).astype(F32)
  # Feature 0 is never seen: the gradients of w[0, :] and a[0, :] are exactly 0
  # on every device, so their variance is 0 at the freeze and 1-bit Adam must
  # keep them still although the compressor gives their momentum sign noise.
  x[:, :, 0] = 0.0
  w_true = rng.normal(size=(N, FEATURES, OUTPUTS)) + 1.0  # a different optimum per device
  y = (np.einsum("dbf,dfo->dbo", x, w_true) + 0.5).astype(F32)
  params = {"a": (rng.normal(size=SHAPES["a"]) * 0.1).astype(F32),
            "b": np.zeros(SHAPES["b"], F32),
            "g": np.asarray(0.5, F32),
            "w": (rng.normal(size=SHAPES["w"]) * 0.1).astype(F32)}
  return params, x, y


def _local_gradient(p, x, y):
  """d/dp of 0.5 * mean_batch ||x w + b + g (x[:, :5] a) - y||^2, by hand (float32)."""
  xa = x[:, :GATED]
  z = xa @ p["a"]
  r = x @ p["w"] + p["b"] + p["g"] * z - y
  count = F32(x.shape[0])
  return {"a": (p["g"] * (xa.T @ r) / count).astype(F32),
          "b": (r.sum(axis=0) / count).astype(F32),
          "g": np.asarray(np.sum(r * z, dtype=F32) / count, F32),
          "w": (x.T @ r / count).astype(F32)}


def _loss(params, x, y):
  pred = x @ params["w"] + params["b"] + params["g"] * (x[:, :GATED] @ params["a"])
  return 0.5 * jnp.mean(jnp.sum((pred - y) ** 2, axis=-1))


# ----------------------------------------------------------------------------
# The compressor (numpy only).


def _rms(v, count):
  """sqrt(sum v^2 / count), float32 (count: real elements; 0 gives 0)."""
  return F32(np.sqrt(np.sum(np.square(v, dtype=F32), dtype=F32) / F32(max(count, 1))))


def _signed(v, scale):
  """scale * sign(v), sign(0) = sign(-0.0) = +1."""
  return np.where(v >= 0, scale, -scale).astype(F32)


def _segment_scales(values, bits, r):
  """One RMS per segment of chunk r (over its real elements); unused slots 0."""
  real = bits.chunk_real(r)
  scales = np.zeros(bits.S, F32)
  for q, (_, idx) in enumerate(bits.segments[r]):
    scales[q] = _rms(values[idx][real[idx]], np.count_nonzero(real[idx]))
  return scales


def _per_element(scales, bits, r):
  out = np.zeros(bits.chunk, F32)
  for q, (_, idx) in enumerate(bits.segments[r]):
    out[idx] = scales[q]
  return out


def _decode_chunk(signs, scales, bits, r):
  """±(segment scale) on the chunk's real elements, 0 on padding."""
  return np.where(bits.chunk_real(r), _signed(np.where(signs, 1, -1), _per_element(scales, bits, r)),
                  F32(0)).astype(F32)


def _serve(decoded_rows, server_error, bits, r, margin):
  """Server r: average the decoded rows, add its error, re-compress per segment."""
  total = decoded_rows[0]
  for row in decoded_rows[1:]:
    total = total + row
  w = np.where(bits.chunk_real(r), total / F32(len(decoded_rows)) + server_error, F32(0)).astype(F32)
  scales = _segment_scales(w, bits, r)
  margin.note(w, _per_element(scales, bits, r), bits.chunk_real(r))
  residual = np.where(bits.chunk_real(r), w - _signed(w, _per_element(scales, bits, r)), F32(0))
  return w >= 0, scales, residual.astype(F32)


class _Margin:
  """The smallest |value| / scale of any compressed value: how close a sign came to flipping."""

  def __init__(self):
    self.value = np.inf

  def note(self, v, scale, real=None):
    # Exact zeros (never-seen coordinates, padding) are computed exactly on both
    # sides and encode as +1; only nonzero values can be rounded across 0.
    v, scale = np.broadcast_arrays(np.asarray(v, F32), np.asarray(scale, F32))
    keep = (v != 0) & (scale > 0) if real is None else (v != 0) & (scale > 0) & real
    if np.any(keep):
      self.value = min(self.value, float(np.min(np.abs(v[keep]) / scale[keep])))


def _old_compressed_allreduce(local, worker_error, server_error, bits, margin):
  """The two-phase compressed mean with one scale per segment (``compressed_mean``).

  local, worker_error: (N, padded); server_error: (N, chunk). Returns the mean
  every worker decodes and the new errors.
  """
  chunk = bits.chunk
  worker_error, server_error = worker_error.copy(), server_error.copy()
  outbox = []
  for i in range(N):
    u = np.where(bits.real, local[i] + worker_error[i], F32(0)).astype(F32)
    rows = []
    for r in range(N):
      piece = u[r * chunk:(r + 1) * chunk]
      scales = _segment_scales(piece, bits, r)
      margin.note(piece, _per_element(scales, bits, r), bits.chunk_real(r))
      worker_error[i, r * chunk:(r + 1) * chunk] = np.where(
          bits.chunk_real(r), piece - _signed(piece, _per_element(scales, bits, r)), F32(0))
      rows.append((piece >= 0, scales))
    outbox.append(rows)
  mean = []
  for r in range(N):
    signs, scales, server_error[r] = _serve(
        [_decode_chunk(*outbox[i][r], bits, r) for i in range(N)], server_error[r], bits, r, margin)
    mean.append(_decode_chunk(signs, scales, bits, r))
  return np.concatenate(mean), worker_error, server_error


def _flatten(tree, bits, names):
  out = np.zeros(bits.padded, F32)
  for name, offset, size in zip(names, bits.offsets, bits.sizes):
    out[offset:offset + size] = np.ravel(tree[name])
  return out


def _unflatten(flat, bits, names):
  return {name: flat[offset:offset + size].reshape(SHAPES[name])
          for name, offset, size in zip(names, bits.offsets, bits.sizes)}


# ----------------------------------------------------------------------------
# The simulation of 1-bit Adam (numpy only).


class _Simulation:
  """8 workers running 1-bit Adam, core v3 (module docstring).

  ``variant`` (for the negative checks): ``"scale_per_segment"`` gives the
  workers one scale per segment instead of per leaf; ``"no_freeze_feedback"``
  starts the compression without the freeze's error feedback (the first step
  then uses ``b1 C(m)``); ``"every_leaf_compressed"`` sends the small leaves as
  signs too.
  """

  def __init__(self, params, x, y, b1, b2, *, variant=None, exact_below=EXACT_BELOW):
    assert variant in (None, "scale_per_segment", "no_freeze_feedback", "every_leaf_compressed")
    self.b1, self.b2, self.x, self.y, self.variant = b1, b2, x, y, variant
    self.params = {k: np.array(v, F32) for k, v in params.items()}
    self.mu = {k: np.zeros(SHAPES[k], F32) for k in NAMES}
    self.nu = {k: np.zeros(SHAPES[k], F32) for k in NAMES}
    self.nu_l1 = {k: F32(0) for k in NAMES}
    compressed, exact = _flat.split(SIZES, 0 if variant == "every_leaf_compressed" else exact_below)
    self.compressed, self.exact = [NAMES[i] for i in compressed], [NAMES[i] for i in exact]
    self.bits = _flat.Bits([SIZES[i] for i in compressed], N)
    self.exact_offsets = list(np.cumsum([0] + [SIZES[i] for i in exact])[:-1])
    self.exact_chunk = -(-sum(SIZES[i] for i in exact) // N)
    self.row_bytes = self.bits.chunk // 8 + 4 * (self.bits.S + self.exact_chunk)
    # Per worker: u' (what it compressed last) and the scale of each element of u'.
    self.u = [{k: np.zeros(SHAPES[k], F32) for k in self.compressed} for _ in range(N)]
    self.scale = [{k: np.zeros(SHAPES[k], F32) for k in self.compressed} for _ in range(N)]
    self.feedback = False
    self.server_error = np.zeros((N, self.bits.chunk), F32)
    self.message = None  # (signs (N, chunk) bool, scales (N, S), exact floats (N, exact_chunk))
    self.frozen, self.freeze_step, self.t = False, 0, 0
    self.just_froze = False
    self.wire_bytes = 0.0
    self.margin = _Margin()

  # The wire format.

  def _exact_rows(self, tree):
    flat = np.zeros(N * self.exact_chunk, F32)
    for name, offset in zip(self.exact, self.exact_offsets):
      flat[offset:offset + tree[name].size] = np.ravel(tree[name])
    return flat.reshape(N, self.exact_chunk)

  def _rows(self, leaves, leaf_scales, exact_tree):
    """Signs of the compressed leaves, each segment carrying its leaf's scale, and the exact floats."""
    bits = self.bits
    signs = (_flatten(leaves, bits, self.compressed) >= 0).reshape(N, bits.chunk)
    scales = np.zeros((N, bits.S), F32)
    for r in range(N):
      for q, (leaf, _) in enumerate(bits.segments[r]):
        if leaf >= 0:
          scales[r, q] = leaf_scales[self.compressed[leaf]]
    return signs, scales, self._exact_rows(exact_tree)

  def decode(self, message):
    """The mean momentum a message holds, as a tree."""
    signs, scales, floats = message
    stream = np.concatenate([_decode_chunk(signs[r], scales[r], self.bits, r) for r in range(N)])
    out = _unflatten(stream, self.bits, self.compressed)
    floats = floats.reshape(-1)
    for name, offset in zip(self.exact, self.exact_offsets):
      out[name] = floats[offset:offset + self.params[name].size].reshape(SHAPES[name])
    return out

  def momentum(self):
    """Adam's m in warmup and at the freeze step (the message holds none of it yet), then the message."""
    return self.decode(self.message) if self.frozen and not self.just_froze else self.mu

  def _step_bytes(self, *, compressed):
    """Bytes a device sends: 2 (n-1) messages, or a ring all-reduce of the real elements."""
    return 2.0 * (N - 1) * self.row_bytes if compressed else _flat.onebit_warmup_bytes(SIZES, N)

  # The phases.

  def _freeze(self):
    """The momentum moves into every device's error feedback: u = b1 m with scale 0.

    The message's compressed part is zero (all-zero bytes: bit 0, and zero
    scales); exact leaves carry m. The first compression step then sends
    0 + (1 - b1) g + b1 m.
    """
    b1 = F32(self.b1)
    negative = {k: np.full(SHAPES[k], -1.0, F32) for k in self.compressed}  # bit 0
    self.message = self._rows(negative, {k: F32(0) for k in self.compressed}, self.mu)
    for i in range(N):
      self.u[i] = {k: (b1 * self.mu[k]).astype(F32) for k in self.compressed}
      self.scale[i] = {k: np.zeros(SHAPES[k], F32) for k in self.compressed}
    self.feedback = self.variant != "no_freeze_feedback"
    self.just_froze = True

  def _compress_and_average(self, grads):
    self.just_froze = False
    b1, c1, bits = F32(self.b1), F32(1 - self.b1), self.bits
    mean = self.decode(self.message)
    rows = []
    for i in range(N):
      u = {}
      for k in self.compressed:
        prev = self.u[i][k]
        error = prev - _signed(prev, self.scale[i][k]) if self.feedback else np.zeros_like(prev)
        u[k] = (b1 * mean[k] + c1 * grads[i][k] + error).astype(F32)
      exact = {k: (b1 * mean[k] + c1 * grads[i][k]).astype(F32) for k in self.exact}
      leaf_scales = {k: _rms(u[k], u[k].size) for k in self.compressed}
      signs, scales, floats = self._rows(u, leaf_scales, exact)
      if self.variant == "scale_per_segment":
        stream = _flatten(u, bits, self.compressed).reshape(N, bits.chunk)
        scales = np.stack([_segment_scales(stream[r], bits, r) for r in range(N)])
        self.scale[i] = _unflatten(
            np.concatenate([_per_element(scales[r], bits, r) for r in range(N)]), bits,
            self.compressed)
      else:
        self.scale[i] = {k: np.full(SHAPES[k], leaf_scales[k], F32) for k in self.compressed}
      for k in self.compressed:
        self.margin.note(u[k], self.scale[i][k])
      self.u[i] = u
      rows.append((signs, scales, floats))
    # Server r: chunk r of every worker's row.
    signs, scales, floats = [], [], []
    for r in range(N):
      decoded = [_decode_chunk(rows[i][0][r], rows[i][1][r], bits, r) for i in range(N)]
      s, c, self.server_error[r] = _serve(decoded, self.server_error[r], bits, r, self.margin)
      total = rows[0][2][r]
      for i in range(1, N):
        total = total + rows[i][2][r]
      signs.append(s), scales.append(c), floats.append(total / F32(N))
    self.message = (np.stack(signs), np.stack(scales), np.stack(floats).astype(F32))
    self.feedback = True

  def update(self):
    self.t += 1
    t, b1, b2 = self.t, self.b1, self.b2
    grads = [_local_gradient(self.params, self.x[i], self.y[i]) for i in range(N)]
    direction = {}
    if not self.frozen:  # warmup: Adam with bias correction on the mean gradient
      bc1, bc2 = F32(1 - b1 ** t), F32(1 - b2 ** t)
      for k in NAMES:
        g = np.mean(np.stack([gr[k] for gr in grads]), axis=0, dtype=F32)
        self.mu[k] = np.asarray(F32(b1) * self.mu[k] + F32(1 - b1) * g, F32)
        self.nu[k] = np.asarray(F32(b2) * self.nu[k] + F32(1 - b2) * g * g, F32)
        self.nu_l1[k] = np.sum(self.nu[k], dtype=F32)
        direction[k] = (self.mu[k] / bc1) / (np.sqrt(self.nu[k] / bc2) + F32(EPS))
      self.wire_bytes = self._step_bytes(compressed=False)
      if t == FREEZE_AT:
        self._freeze()
        self.frozen, self.freeze_step = True, t
    else:  # compression: local momenta, averaged in 1 bit; nu frozen
      self._compress_and_average(grads)
      mean = self.decode(self.message)
      bc1, bc2 = F32(1 - b1 ** t), F32(1 - b2 ** self.freeze_step)
      bound = F32(max(1.0, (1 - b1) / np.sqrt(1 - b2)))
      for k in NAMES:
        nu = self.nu[k]
        floor = F32(FLOOR) * self.nu_l1[k] / (F32(nu.size) * bc2)
        v_hat = np.maximum(nu / bc2, floor)
        step = np.clip((mean[k] / bc1) / (np.sqrt(v_hat) + F32(EPS)), -bound, bound)
        direction[k] = np.where(nu > 0, step, F32(0))
      self.wire_bytes = self._step_bytes(compressed=True)
    for k in NAMES:
      self.params[k] = np.asarray(self.params[k] - F32(LR) * direction[k], F32)


# ----------------------------------------------------------------------------
# The JAX run, recorded step by step.


def _close(actual, expected, tolerance, what, magnitude=None):
  """|actual - expected| <= tolerance * magnitude (default: max|expected|); returns the max diff / magnitude."""
  actual, expected = np.asarray(actual, F32), np.asarray(expected, F32)
  assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
  if magnitude is None:
    magnitude = float(np.max(np.abs(expected))) if expected.size else 0.0
  np.testing.assert_allclose(actual, expected, rtol=0, atol=tolerance * magnitude,
                             err_msg=what)
  diff = float(np.max(np.abs(actual - expected))) if actual.size else 0.0
  return diff / magnitude if magnitude else diff


def _mesh():
  assert jax.device_count() == N
  return jax.make_mesh((N,), ("data",))


def _numpy_tree(tree):
  return jax.tree.map(lambda a: np.array(a), tree)


@functools.cache
def _recorded_run(b1, b2, seed, num_steps=NUM_STEPS):
  """(params0, x, y, records): the JAX run on 8 devices, one record per step."""
  params0, x, y = _problem(seed)
  mesh = _mesh()
  tx = onebit_optax.onebit_adam(LR, b1, b2, EPS, axis_name="data",
                                freeze=onebit_optax.fixed_step_freeze(FREEZE_AT))
  params = jax.device_put(params0, NamedSharding(mesh, P()))
  opt_state = onebit_optax.init_sharded(tx, params, mesh)
  specs = onebit_optax.state_partition_specs(opt_state, "data")
  state = opt_state[0]
  # Per device: u of each compressed leaf (a, w; two shapes: two groups of one leaf), the two
  # leaf scales, one chunk of server error.
  assert [u.shape for u in state.local_momentum] == [(N, 1) + SHAPES["a"], (N, 1) + SHAPES["w"]]
  assert state.worker_scale.shape == (N, 2)
  assert state.worker_error is None
  assert state.server_error.shape == (N, CHUNK)
  assert state.momentum_message.shape == (N, _flat.onebit_row_bytes(SIZES, N)) == (N, 52)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                     out_specs=(P(), specs))
  def step(params, opt_state, x, y):
    grads = jax.grad(_loss)(onebit_optax.local_params(params, "data"), x[0], y[0])
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  x_dev = jax.device_put(x, NamedSharding(mesh, P("data")))
  y_dev = jax.device_put(y, NamedSharding(mesh, P("data")))
  records = []
  for _ in range(num_steps):
    params, opt_state = jax.block_until_ready(step(params, opt_state, x_dev, y_dev))
    s = opt_state[0]
    moments_mu, moments_nu = onebit_optax.moments(opt_state, params)
    records.append(dict(
        params=_numpy_tree(params), mu=_numpy_tree(s.mu), nu=_numpy_tree(s.nu),
        nu_l1=np.array(s.nu_l1), moments_mu=_numpy_tree(moments_mu),
        moments_nu=_numpy_tree(moments_nu), frozen=bool(s.frozen),
        freeze_step=int(s.freeze_step), feedback=bool(s.feedback_valid),
        local=[np.array(u)[:, 0] for u in s.local_momentum], worker_scale=np.array(s.worker_scale),
        server_error=np.array(s.server_error), message=np.array(s.momentum_message),
        wire_bytes=float(s.wire_bytes)))
  return params0, x, y, records


def _message_parts(message, bits, exact_chunk):
  """(signs (n, chunk) bool, scales (n, S), exact floats (n, exact_chunk)) of uint8 messages."""
  chunk_bytes = bits.chunk // 8
  assert message.shape == (bits.n, chunk_bytes + 4 * (bits.S + exact_chunk)), message.shape
  signs = np.unpackbits(message[:, :chunk_bytes], axis=1, bitorder="little").astype(bool)
  floats = np.ascontiguousarray(message[:, chunk_bytes:]).view("<f4")
  return signs, floats[:, :bits.S], floats[:, bits.S:]


def _tree_magnitude(tree):
  return max(float(np.max(np.abs(tree[k]))) for k in NAMES)


def _compare_seen(sim, rec, tolerance, at, diffs):
  """What the user sees: the parameters and the decoded momentum.

  Each leaf against the largest value of the whole tree (as one flat buffer):
  the scalar gate's mean gradient is a cancellation of the devices' gradients,
  so its own magnitude would amplify their rounding.
  """
  momentum = sim.momentum()
  for name, actual, expected in (("params", rec["params"], sim.params),
                                 ("momentum", rec["moments_mu"], momentum)):
    magnitude = _tree_magnitude(expected)
    for k in NAMES:
      diffs[name] = max(diffs.get(name, 0), _close(
          actual[k], expected[k], tolerance, f"{name}[{k!r}]" + at, magnitude))


def _compare(sim, rec, tolerance, at, diffs):
  """Every buffer of the state against the simulation (``diffs``: max relative differences)."""
  _compare_seen(sim, rec, tolerance, at, diffs)

  def close(name, actual, expected, magnitude=None):
    diffs[name] = max(diffs.get(name, 0), _close(actual, expected, tolerance, name + at, magnitude))

  for k in NAMES:
    close("mu", rec["mu"][k], sim.mu[k], _tree_magnitude(sim.mu))
    close("nu", rec["nu"][k], sim.nu[k], _tree_magnitude(sim.nu))
    close("nu", rec["moments_nu"][k], sim.nu[k], _tree_magnitude(sim.nu))
  if sim.frozen:
    # Per-leaf sums of nu, for the floor: written on the steps the freeze rule
    # reads them (checks, and the freeze step itself), so compared from the freeze on.
    close("nu_l1", rec["nu_l1"], [sim.nu_l1[k] for k in NAMES])
  assert rec["frozen"] == sim.frozen, at
  assert rec["feedback"] == sim.feedback, at
  assert rec["wire_bytes"] == sim.wire_bytes, (rec["wire_bytes"], sim.wire_bytes, at)
  if not sim.frozen:
    assert rec["freeze_step"] == 0, at
    assert not any(np.any(u) for u in rec["local"]), at
    assert not np.any(rec["server_error"]) and not np.any(rec["message"]), at
    return
  assert rec["freeze_step"] == sim.freeze_step, at
  bits = sim.bits
  signs, scales, floats = _message_parts(rec["message"], bits, sim.exact_chunk)
  sim_signs, sim_scales, sim_floats = sim.message
  real = bits.real.reshape(N, bits.chunk)
  # The sign bits of the real elements, exactly, in little bit order.
  np.testing.assert_array_equal(signs[real], sim_signs[real], err_msg="message signs" + at)
  close("message scales", scales, sim_scales)
  close("message exact floats", floats, sim_floats)
  for j, k in enumerate(sim.compressed):
    sim_u = np.stack([sim.u[i][k] for i in range(N)])
    close("u", rec["local"][j], sim_u)
    sim_s = np.array([sim.scale[i][k].flat[0] for i in range(N)], F32)
    close("worker_scale", rec["worker_scale"][:, j], sim_s)
    scale = rec["worker_scale"][:, j].reshape((N,) + (1,) * len(SHAPES[k]))
    error = rec["local"][j] - np.where(rec["local"][j] >= 0, scale, -scale)
    sim_error = np.stack([sim.u[i][k] - _signed(sim.u[i][k], sim.scale[i][k]) for i in range(N)])
    close("worker error", error, sim_error)
  close("server_error", rec["server_error"], sim.server_error,
        max(float(np.max(np.abs(sim.server_error))), float(np.max(sim_scales))))


# (b1, b2, tolerance, seed). Measured max differences over the 27 steps, relative to
# max|numpy array|: 1.1e-5 (nu) with the defaults, 5.9e-6 (params) with exact bias
# corrections. The seeds are ones whose smallest sign margin is above 2e-5 (2.4e-5 both).
CONFIGS = {"optax_defaults": (0.9, 0.999, 5e-5, 67), "exact_bias_correction": (0.5, 0.75, 3e-5, 11)}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_matches_numpy_simulation_of_8_workers(config):
  b1, b2, tolerance, seed = CONFIGS[config]
  params0, x, y, records = _recorded_run(b1, b2, seed)
  sim = _Simulation(params0, x, y, b1, b2)
  diffs = {}
  for t, rec in enumerate(records, 1):
    sim.update()
    _compare(sim, rec, tolerance, f" after step {t}", diffs)
  print(f"\n[{config}] max |jax - numpy| / max|numpy| over {len(records)} steps: "
        + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items())
        + f"; smallest sign margin {sim.margin.value:.1e}")
  last = records[-1]
  assert last["freeze_step"] == FREEZE_AT and len(records) - FREEZE_AT >= 12
  # The never-seen coordinates have momentum (sign noise) but did not move.
  for k in ("a", "w"):
    assert np.all(last["moments_nu"][k][0] == 0)
    assert np.any(last["moments_mu"][k][0] != 0)
    np.testing.assert_array_equal(last["params"][k][0], params0[k][0])
  # The exact leaves moved and their momentum is no ±scale pattern.
  assert len(set(np.abs(last["moments_mu"]["b"]).tolist())) > 1
  # No compressed value was within rounding of a sign flip, so the sign
  # decisions were robust and the comparison above is meaningful.
  assert sim.margin.value > 1e-5, sim.margin.value


@pytest.mark.parametrize("variant", ["scale_per_segment", "no_freeze_feedback",
                                     "every_leaf_compressed"])
def test_a_wrong_simulation_fails_the_comparison(variant):
  # The comparison has teeth: each variant is one plausible misreading of the
  # spec, and the parameters or the decoded momentum tell it apart.
  b1, b2, tolerance, seed = CONFIGS["optax_defaults"]
  params0, x, y, records = _recorded_run(b1, b2, seed)
  sim = _Simulation(params0, x, y, b1, b2, variant=variant)
  with pytest.raises(AssertionError) as failure:
    for t, rec in enumerate(records, 1):
      sim.update()
      _compare_seen(sim, rec, tolerance, f" after step {t}", {})
  print(f"\n[{variant}] fails: " + " | ".join(str(failure.value).strip().splitlines()[:4]))
  assert t >= FREEZE_AT, "the variants differ from the freeze on"


def test_the_simulated_wire_layout():
  # The layout the module docstring describes, from tests/_flat.py.
  sim = _Simulation(*_problem()[0:3], 0.9, 0.999)
  assert sim.compressed == ["a", "w"] and sim.exact == ["b", "g"]
  bits = sim.bits
  assert bits.offsets == [0, 128] and bits.padded == 2048 and bits.chunk == 256 and bits.S == 2
  assert [[leaf for leaf, _ in segs] for segs in bits.segments] == [
      [0, 1], [1], [1], [1], [1], [1, -1], [-1], [-1]]
  assert sim.exact_chunk == 3 and sim.row_bytes == 52


# ----------------------------------------------------------------------------
# Cross-replica identity: no simulation needed, only the devices' own buffers.


def _replica_copies(array):
  """Each device's own buffer of a replicated output (np.asarray would show device 0's)."""
  return [np.asarray(shard.data) for shard in array.addressable_shards]


def _assert_bitwise_identical(copies, what):
  assert len(copies) == N, what
  reference = np.ascontiguousarray(copies[0]).reshape(-1).view(np.uint8)
  for i, copy in enumerate(copies[1:], 1):
    assert np.array_equal(np.ascontiguousarray(copy).reshape(-1).view(np.uint8), reference), (
        f"{what}: device {i} != device 0")


def test_replica_inspection_sees_divergent_copies():
  # The check below is only worth something if a replica that diverged would
  # show: under check_vma=False, out_specs=P() accepts per-device values without
  # complaint, and the shards must then expose them.
  mesh = _mesh()
  per_device = jax.jit(jax.shard_map(
      lambda: jnp.full((3,), jax.lax.axis_index("data"), jnp.float32), mesh=mesh,
      in_specs=(), out_specs=P(), check_vma=False))()
  copies = _replica_copies(per_device)
  with pytest.raises(AssertionError, match="device 1 != device 0"):
    _assert_bitwise_identical(copies, "axis_index")


def test_replicas_bitwise_identical_after_100_compression_steps():
  freeze_at, num_steps = 5, 110
  params0, x, y = _problem()
  tx = onebit_optax.onebit_adam(LR, axis_name="data",
                                freeze=onebit_optax.fixed_step_freeze(freeze_at))

  def local_step(params, opt_state, x, y, grad_params):
    grads = jax.grad(_loss)(grad_params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  # shard_map: replicated params and momentum message, one copy per device.
  mesh = _mesh()
  params = jax.device_put(params0, NamedSharding(mesh, P()))
  opt_state = onebit_optax.init_sharded(tx, params, mesh)
  specs = onebit_optax.state_partition_specs(opt_state, "data")

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                     out_specs=(P(), specs))
  def shard_map_step(params, opt_state, x, y):
    return local_step(params, opt_state, x[0], y[0], onebit_optax.local_params(params, "data"))

  # pmap: the same step, gradients are local without any cast.
  pmap_step = jax.pmap(lambda p, s, x, y: local_step(p, s, x, y, p), axis_name="data")
  pmap_params = jax.tree.map(lambda a: np.stack([a] * N), params0)  # one copy per device
  pmap_state = jax.pmap(tx.init, axis_name="data")(pmap_params)

  x_dev = jax.device_put(x, NamedSharding(mesh, P("data")))
  y_dev = jax.device_put(y, NamedSharding(mesh, P("data")))
  for _ in range(num_steps):
    # Each step waited for: queued 8-device steps can trip XLA:CPU's 40 s
    # collective rendezvous abort on a busy machine.
    params, opt_state = jax.block_until_ready(shard_map_step(params, opt_state, x_dev, y_dev))
    pmap_params, pmap_state = jax.block_until_ready(pmap_step(pmap_params, pmap_state, x, y))

  for state in (opt_state[0], pmap_state[0]):
    assert bool(np.all(np.asarray(state.frozen)))
    assert np.all(np.asarray(state.count) - np.asarray(state.freeze_step) >= 100)
    assert int(np.max(np.asarray(state.skipped_steps))) == 0
  # The devices really computed different things: their u (momentum + error),
  # hence their worker errors, differ. Only the message is shared.
  for u in opt_state[0].local_momentum:
    u = np.asarray(u)
    assert not np.array_equal(u[0], u[1])

  replicated = {"params": params, "mu": opt_state[0].mu, "nu": opt_state[0].nu,
                "message": opt_state[0].momentum_message}
  for name, tree in replicated.items():
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
      _assert_bitwise_identical(_replica_copies(leaf),
                                f"shard_map {name}{jax.tree_util.keystr(path)}")
  pmap_replicated = {"params": pmap_params, "mu": pmap_state[0].mu,
                     "message": pmap_state[0].momentum_message}
  for name, tree in pmap_replicated.items():
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
      copies = [np.asarray(shard.data) for shard in leaf.addressable_shards]
      _assert_bitwise_identical([c.reshape(c.shape[1:]) for c in copies],
                                f"pmap {name}{jax.tree_util.keystr(path)}")
  # Same algorithm under both APIs (loose: they may fuse float ops differently).
  for name in NAMES:
    np.testing.assert_allclose(np.asarray(pmap_params[name])[0], np.asarray(params[name]),
                               rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------
# The standalone transforms: the old two-phase compressed mean (one scale per
# segment on the worker too, all leaves compressed), on raw updates.


def _updates_on_8_devices(tx, mesh):
  """The state of ``tx`` for the 4-leaf model, and a jitted update of 8 devices' local leaves."""
  template = {k: np.zeros(SHAPES[k], np.float32) for k in NAMES}
  state = onebit_optax.init_sharded(tx, template, mesh)
  specs = onebit_optax.state_partition_specs(state, "data")

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(specs, P("data")),
                     out_specs=(P(), specs))
  def step(state, leaves):
    return tx.update({k: v[0] for k, v in leaves.items()}, state)

  return state, step


def _local_leaves(rng, t):
  leaves = {k: (rng.normal(size=(N,) + SHAPES[k]) * (1 + t)).astype(F32) for k in NAMES}
  leaves["b"] *= F32(1e-3)  # a small leaf: its own scale
  return leaves


def test_compressed_mean_updates_matches_the_simulated_allreduce():
  """compressed_mean_updates on 8 devices = the numpy workers' compressed allreduce, step by step."""
  rng = np.random.default_rng(3)
  mesh = _mesh()
  state, step = _updates_on_8_devices(_compressed_updates.compressed_mean_updates("data"), mesh)
  assert state.worker_error.shape == (N, PADDED) and state.server_error.shape == (N, CHUNK)
  margin = _Margin()
  worker_error, server_error = np.zeros((N, PADDED), F32), np.zeros((N, CHUNK), F32)
  data = NamedSharding(mesh, P("data"))
  for t in range(6):
    leaves = _local_leaves(rng, t)
    mean, state = step(state, jax.device_put(leaves, data))
    local = np.stack([_flatten({k: v[i] for k, v in leaves.items()}, ALL_BITS, NAMES)
                      for i in range(N)])
    expected, worker_error, server_error = _old_compressed_allreduce(
        local, worker_error, server_error, ALL_BITS, margin)
    expected = _unflatten(expected, ALL_BITS, NAMES)
    for k in NAMES:
      _close(mean[k], expected[k], 1e-5, f"{k} at step {t}")
    _close(np.asarray(state.worker_error), worker_error, 1e-5, f"worker_error at step {t}")
    _close(np.asarray(state.server_error), server_error, 1e-5, f"server_error at step {t}")
    # The small leaf is not sent at the size of the large one.
    assert np.max(np.abs(np.asarray(mean["b"]))) < 0.1
  # Inputs are fed identically to both sides every step, so the two differ only
  # by a few ulps: a sign decision is safe above ~1e-7 of its scale.
  assert margin.value > 1e-7, margin.value


def test_compressed_trace_matches_the_simulated_momentum():
  """compressed_trace on 8 devices: m = allreduce_1bit(decay * m + g_i), as the numpy workers do it."""
  rng = np.random.default_rng(5)
  decay = 0.9
  mesh = _mesh()
  state, step = _updates_on_8_devices(_compressed_updates.compressed_trace(decay, "data"), mesh)
  margin = _Margin()
  worker_error, server_error = np.zeros((N, PADDED), F32), np.zeros((N, CHUNK), F32)
  momentum = np.zeros(PADDED, F32)
  data = NamedSharding(mesh, P("data"))
  for t in range(6):
    leaves = {k: v + F32(0.3 * t) for k, v in _local_leaves(rng, 0).items()}
    out, state = step(state, jax.device_put(leaves, data))
    local = np.stack([_flatten({k: v[i] for k, v in leaves.items()}, ALL_BITS, NAMES)
                      for i in range(N)]) + F32(decay) * momentum
    momentum, worker_error, server_error = _old_compressed_allreduce(
        local, worker_error, server_error, ALL_BITS, margin)
    expected = _unflatten(momentum, ALL_BITS, NAMES)
    for k in NAMES:
      _close(out[k], expected[k], 1e-5, f"{k} at step {t}")
      _close(state.trace[k], expected[k], 1e-5, f"trace[{k!r}] at step {t}")
  assert margin.value > 1e-7, margin.value
