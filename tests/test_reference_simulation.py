"""1-bit Adam on 8 devices against an independent numpy simulation of 8 workers.

The simulation below is written from the algorithm's description (the 1-bit
Adam paper and DeepSpeed's ``compressed_allreduce``), not from this package: it
imports nothing from ``onebit_optax``. It keeps 8 workers' state in numpy
float32 arrays and spells out every message: the sign bits are packed with
``np.packbits``, phase 1 hands chunk ``r`` of every worker's packed signs to
worker ``r``, phase 2 hands every worker the packed server chunks.

Both runs train the same linear regression (a different data shard per device,
two parameter leaves, 1220 parameters) through warmup, the freeze and 30
compression steps. The flat layout puts each leaf on a 128-element block
boundary (b: elements 0-19, w: 128-1327) and pads the whole to a multiple of
8 * 128 = 1024, i.e. 2048 elements in 8 chunks of 256: chunk 0 holds all of b
and the start of w, w is cut by five chunk boundaries, chunk 5 ends with
padding and chunks 6-7 are only padding. Each piece of a leaf inside a chunk
(a segment) is compressed with its own RMS scale; padding is held at zero.
After the freeze, the preconditioner is 1/(sqrt(max(v_hat, 0.01 * mean of
v_hat over the leaf)) + eps) (0 where v_hat = 0) and the step is clipped at
Adam's bound max(1, (1 - b1) / sqrt(1 - b2)). Every step compares the
parameters, the momentum and each device's worker and server error buffers.

Tolerance: every compared array must agree to ``tolerance * max|numpy
array|`` at every step. The simulation is float32 too, but numpy and XLA sum in
different orders (the gradient's matmul, the RMS scales, the means): a few ulps
per operation, accumulated over the steps. The bias corrections add more with
optax's defaults: ``1 - b2**t`` is computed in float32 (as optax does), and
for b2 = 0.999 that subtraction cancels 3 digits, so XLA's ``pow`` and the
exact value differ by up to 2e-5 relative. Hence two configurations:

* ``b1=0.9, b2=0.999``: tolerance 5e-5.
* ``b1=0.5, b2=0.75``: every ``b**t`` up to the freeze is exact in float32, so
  only the summation order is left; still 1e-4, because with 60 features a
  coordinate whose mean gradient nearly cancels gets a direction m/sqrt(v)
  that amplifies the summation-order difference (measured up to 5.5e-5 in
  warmup steps, depending on how XLA fuses the update).

With 1220 parameters on 8 workers about 20,000 values are compressed per
step, and after a few dozen steps one of them comes within 1e-6 of zero
(relative to its scale), where float32 rounding can flip its sign. So the
free-running comparison covers 12 compression steps and the seeds are ones whose
smallest margin over the run is above 1e-5 (1.3e-5 and 2.0e-5); the replica
test below runs 100+ compression steps.

Both tolerances are orders of magnitude below what one wrong bit does: a flipped sign
moves a worker error by 2 * scale (relative change ~1) and the server's chunk
mean by 2 * scale / 8. The sign decisions themselves must agree exactly, so the
test also checks that no compressed value came within rounding of 0 (smallest
|u| / scale over the run: 1.2e-4 and 6e-5, against float32 differences of a
few 1e-7).
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import optax
import pytest

import onebit_optax

N = 8  # workers (devices)
FEATURES, OUTPUTS, LOCAL_BATCH = 60, 20, 12
SIZE = FEATURES * OUTPUTS + OUTPUTS  # 1220
BLOCK = 128
PADDED = 2048  # b in [0, 128), w in [128, 1408), zeros to a multiple of N * BLOCK
CHUNK = PADDED // N
LR, EPS, FLOOR = 0.02, 1e-8, 0.01
FREEZE_AT, NUM_STEPS = 15, 27  # 12 compression steps: see the margin note above

# Where the real elements sit in the padded layout, and which leaf owns each
# element (-1: padding). Pytree order of the dict is (b, w).
POSITION = np.concatenate([np.arange(OUTPUTS), BLOCK + np.arange(FEATURES * OUTPUTS)])
LEAF = np.full(PADDED, -1)
LEAF[POSITION[:OUTPUTS]] = 0
LEAF[POSITION[OUTPUTS:]] = 1


def _problem(seed=1):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(N, LOCAL_BATCH, FEATURES)).astype(np.float32)
  # Feature 0 is never seen: the gradients of w[0, :] are exactly 0 on every
  # device, so their variance is 0 at the freeze and 1-bit Adam must keep them
  # still although the compressor gives their momentum sign noise.
  x[:, :, 0] = 0.0
  w_true = rng.normal(size=(N, FEATURES, OUTPUTS)) + 1.0  # a different optimum per device
  y = (np.einsum("dbf,dfo->dbo", x, w_true) + 0.5).astype(np.float32)
  w0 = (rng.normal(size=(FEATURES, OUTPUTS)) * 0.1).astype(np.float32)
  b0 = np.zeros((OUTPUTS,), np.float32)
  return {"w": w0, "b": b0}, x, y


# ----------------------------------------------------------------------------
# The simulation (numpy only).


def _flatten(w, b):
  # The real elements in pytree order (dict keys sorted: b, w).
  return np.concatenate([b.ravel(), w.ravel()]).astype(np.float32)


def _unflatten(flat):
  return flat[OUTPUTS:].reshape(FEATURES, OUTPUTS), flat[:OUTPUTS]


def _pad(real):
  out = np.zeros(real.shape[:-1] + (PADDED,), np.float32)
  out[..., POSITION] = real
  return out


def _local_gradient(theta, x, y):
  """d/dtheta of 0.5 * mean_batch ||x w + b - y||^2, by hand."""
  b, w = theta[:OUTPUTS], theta[OUTPUTS:].reshape(FEATURES, OUTPUTS)
  residual = x @ w + b - y
  grad_w = x.T @ residual / np.float32(x.shape[0])
  grad_b = residual.sum(axis=0) / np.float32(x.shape[0])
  return _flatten(grad_w, grad_b)


def _segments(chunk):
  """Element indices (within the chunk) of each segment: one per leaf piece, padding apart."""
  owners = LEAF[chunk * CHUNK:(chunk + 1) * CHUNK]
  return [np.flatnonzero(owners == leaf) for leaf in sorted(set(owners.tolist()))]


def _compress(v, chunk):
  """Sign bits packed 8 per byte (bit k of byte j = element 8j + k), one RMS per segment."""
  real = LEAF[chunk * CHUNK:(chunk + 1) * CHUNK] >= 0
  scales = []
  for seg in _segments(chunk):
    count = np.count_nonzero(real[seg])
    sq = np.sum(v[seg] * v[seg], dtype=np.float32)
    scales.append(np.float32(np.sqrt(sq / np.float32(max(count, 1)))))
  return np.packbits(v >= 0, bitorder="little"), scales  # sign(0) = sign(-0.0) = +1


def _decompress(packed, scales, chunk):
  bits = np.unpackbits(packed, count=CHUNK, bitorder="little")
  out = np.zeros(CHUNK, np.float32)
  for seg, scale in zip(_segments(chunk), scales):
    out[seg] = np.where(bits[seg] == 1, scale, -scale)
  real = LEAF[chunk * CHUNK:(chunk + 1) * CHUNK] >= 0
  return np.where(real, out, np.float32(0)).astype(np.float32)


class _Simulation:
  """8 workers running 1-bit Adam with DeepSpeed's two-phase compressed allreduce."""

  def __init__(self, theta, x, y, b1, b2):
    self.b1, self.b2 = b1, b2
    self.theta = theta.copy()
    self.x, self.y = x, y
    self.mu = np.zeros(SIZE, np.float32)
    self.nu = np.zeros(SIZE, np.float32)
    self.worker_error = np.zeros((N, PADDED), np.float32)
    self.server_error = np.zeros((N, CHUNK), np.float32)
    self.step = 0
    self.min_sign_margin = np.inf  # smallest |value| / scale of any compressed value

  def _note_margin(self, u, scale):
    # Exact zeros (never-seen coordinates, fresh padding) are computed exactly
    # on both sides and encode as +1; only nonzero values can be rounded across 0.
    nonzero = np.abs(u[u != 0])
    if nonzero.size:
      self.min_sign_margin = min(self.min_sign_margin, float(np.min(nonzero) / scale))

  def _compressed_allreduce(self, local):
    """local: (N, PADDED) float32, one row per worker; returns the mean every worker decodes."""
    # Phase 1: each worker compresses (its vector + its error) chunk by chunk,
    # one scale per segment, and sends chunk r of its packed signs with the
    # chunk's scales to worker r.
    outbox = []
    for i in range(N):
      u = local[i] + self.worker_error[i]
      messages = []
      for r in range(N):
        piece = u[r * CHUNK:(r + 1) * CHUNK]
        packed, scales = _compress(piece, r)
        self._note_margin(piece, max(scales))
        self.worker_error[i, r * CHUNK:(r + 1) * CHUNK] = piece - _decompress(packed, scales, r)
        messages.append((packed, scales))
      outbox.append(messages)
    # Phase 2: worker r, server of chunk r, averages what it received, adds its
    # server error and re-compresses; everyone receives every server's message.
    gathered = []
    for r in range(N):
      received = [_decompress(*outbox[i][r], r) for i in range(N)]
      total = received[0]
      for row in received[1:]:
        total = total + row
      w = total / np.float32(N) + self.server_error[r]
      packed, scales = _compress(w, r)
      self.server_error[r] = w - _decompress(packed, scales, r)
      gathered.append((packed, scales))
    return np.concatenate([_decompress(p, s, r) for r, (p, s) in enumerate(gathered)])

  def _preconditioner(self):
    nu_hat = self.nu / np.float32(1 - self.b2 ** FREEZE_AT)
    floor = np.zeros(SIZE, np.float32)
    for leaf, (start, stop) in enumerate([(0, OUTPUTS), (OUTPUTS, SIZE)]):
      floor[start:stop] = np.float32(FLOOR) * np.mean(nu_hat[start:stop], dtype=np.float32)
    with np.errstate(divide="ignore"):
      p = np.float32(1) / (np.sqrt(np.maximum(nu_hat, floor)) + np.float32(EPS))
    return np.where(nu_hat > 0, p, np.float32(0)).astype(np.float32)

  def update(self):
    self.step += 1
    t, b1, b2 = self.step, self.b1, self.b2
    grads = np.stack([_local_gradient(self.theta, self.x[i], self.y[i]) for i in range(N)])
    if t <= FREEZE_AT:  # warmup: Adam with bias correction on the mean gradient
      g = grads.mean(axis=0, dtype=np.float32)
      self.mu = np.float32(1 - b1) * g + np.float32(b1) * self.mu
      self.nu = np.float32(1 - b2) * g * g + np.float32(b2) * self.nu
      nu_hat = self.nu / np.float32(1 - b2 ** t)
      direction = (self.mu / np.float32(1 - b1 ** t)) / (np.sqrt(nu_hat) + np.float32(EPS))
    else:  # compression: local momenta, averaged by the 1-bit allreduce; nu frozen
      local_mu = np.float32(1 - b1) * grads + np.float32(b1) * self.mu
      self.mu = self._compressed_allreduce(_pad(local_mu))[POSITION]
      bound = max(1.0, (1 - b1) / np.sqrt(1 - b2))
      direction = (self.mu / np.float32(1 - b1 ** t)) * self._preconditioner()
      direction = np.clip(direction, -bound, bound).astype(np.float32)
    self.theta = (self.theta - np.float32(LR) * direction).astype(np.float32)


# ----------------------------------------------------------------------------
# The JAX run.


def _loss(params, x, y):
  return 0.5 * jnp.mean(jnp.sum((x @ params["w"] + params["b"] - y) ** 2, axis=-1))


def _close(actual, expected, tolerance, what, magnitude=None):
  """|actual - expected| <= tolerance * magnitude (default: max|expected|)."""
  actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
  assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
  if magnitude is None:
    magnitude = float(np.max(np.abs(expected)))
  np.testing.assert_allclose(actual, expected, rtol=0, atol=tolerance * magnitude,
                             err_msg=what)


@pytest.mark.parametrize(
    "b1, b2, tolerance, seed", [(0.9, 0.999, 5e-5, 1), (0.5, 0.75, 1e-4, 7)],
    ids=["optax_defaults", "exact_bias_correction"])
def test_matches_numpy_simulation_of_8_workers(b1, b2, tolerance, seed):
  assert jax.device_count() == N
  params0, x, y = _problem(seed)
  mesh = jax.make_mesh((N,), ("data",))
  tx = onebit_optax.onebit_adam(LR, b1, b2, EPS, axis_name="data",
                                freeze=onebit_optax.fixed_step_freeze(FREEZE_AT))
  params = jax.device_put(params0, NamedSharding(mesh, P()))
  opt_state = onebit_optax.init_sharded(tx, params, mesh)
  specs = onebit_optax.state_partition_specs(opt_state, "data")
  assert opt_state[0].worker_error.shape == (N, PADDED)
  assert opt_state[0].server_error.shape == (N, CHUNK)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                     out_specs=(P(), specs))
  def step(params, opt_state, x, y):
    grads = jax.grad(_loss)(onebit_optax.local_params(params, "data"), x[0], y[0])
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  x_dev = jax.device_put(x, NamedSharding(mesh, P("data")))
  y_dev = jax.device_put(y, NamedSharding(mesh, P("data")))
  sim = _Simulation(_flatten(params0["w"], params0["b"]), x, y, b1, b2)

  for t in range(1, NUM_STEPS + 1):
    params, opt_state = step(params, opt_state, x_dev, y_dev)
    sim.update()
    state = opt_state[0]
    at = f" after step {t}"
    sim_w, sim_b = _unflatten(sim.theta)
    _close(params["w"], sim_w, tolerance, "params['w']" + at)
    _close(params["b"], sim_b, tolerance, "params['b']" + at)
    _close(state.mu, _pad(sim.mu), tolerance, "mu" + at)
    assert bool(state.frozen) == (t >= FREEZE_AT), at
    if t > FREEZE_AT:
      # Global arrays: row i is device i's buffer. Some server chunks hold only
      # padding (all zeros, or near 0 after cancellation), so the errors are
      # measured against the size of all the compressed values of the step.
      worker_error, server_error = np.asarray(state.worker_error), np.asarray(state.server_error)
      magnitude = float(np.max(np.abs(sim.worker_error)))
      for i in range(N):
        _close(worker_error[i], sim.worker_error[i], tolerance, f"worker_error[{i}]" + at,
               magnitude)
        _close(server_error[i], sim.server_error[i], tolerance, f"server_error[{i}]" + at,
               magnitude)
    else:
      assert not np.any(np.asarray(state.worker_error)), at

  assert int(onebit_optax.freeze_step(opt_state)) == FREEZE_AT
  # The never-seen coordinates have momentum (sign noise) but did not move.
  mu, nu = onebit_optax.moments(opt_state, params)
  assert np.all(np.asarray(nu["w"])[0] == 0)
  assert np.any(np.asarray(mu["w"])[0] != 0)
  np.testing.assert_array_equal(np.asarray(params["w"])[0], params0["w"][0])
  # Padding is held at zero; the real elements carry residuals.
  padding = LEAF < 0
  assert not np.any(np.asarray(opt_state[0].worker_error)[:, padding])
  assert np.all(np.any(np.asarray(opt_state[0].worker_error)[:, ~padding] != 0, axis=1))
  # No compressed value was within rounding of a sign flip, so the sign
  # decisions were robust and the comparison above is meaningful.
  assert sim.min_sign_margin > 1e-5, sim.min_sign_margin


# ----------------------------------------------------------------------------
# Cross-replica identity: no simulation needed, only the devices' own buffers.


def _replica_copies(array):
  """Each device's own buffer of a replicated output (np.asarray would show device 0's)."""
  return [np.asarray(shard.data) for shard in array.addressable_shards]


def _assert_bitwise_identical(copies, what):
  assert len(copies) == N, what
  reference = copies[0].view(np.uint32)
  for i, copy in enumerate(copies[1:], 1):
    assert np.array_equal(copy.view(np.uint32), reference), f"{what}: device {i} != device 0"


def test_replica_inspection_sees_divergent_copies():
  # The check below is only worth something if a replica that diverged would
  # show: under check_vma=False, out_specs=P() accepts per-device values without
  # complaint, and the shards must then expose them.
  mesh = jax.make_mesh((N,), ("data",))
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

  # shard_map: replicated params and momentum, one copy per device.
  mesh = jax.make_mesh((N,), ("data",))
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
  # The devices really computed different things: their local momenta, hence
  # their worker errors, differ. Only the decoded mean is shared.
  worker_error = np.asarray(opt_state[0].worker_error)
  assert not np.array_equal(worker_error[0], worker_error[1])

  replicated = {"params": params, "mu": opt_state[0].mu}
  for name, tree in replicated.items():
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
      _assert_bitwise_identical(_replica_copies(leaf),
                                f"shard_map {name}{jax.tree_util.keystr(path)}")
  pmap_replicated = {"params": pmap_params, "mu": pmap_state[0].mu}
  for name, tree in pmap_replicated.items():
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
      copies = [np.asarray(shard.data) for shard in leaf.addressable_shards]
      _assert_bitwise_identical([c.reshape(c.shape[1:]) for c in copies],
                                f"pmap {name}{jax.tree_util.keystr(path)}")
  # Same algorithm under both APIs (loose: they may fuse float ops differently).
  for name in ("w", "b"):
    np.testing.assert_allclose(np.asarray(pmap_params[name])[0], np.asarray(params[name]),
                               rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------
# The standalone transform: the same two-phase compressed mean, on raw updates.


def _updates_on_8_devices(tx, mesh):
  """The state of ``tx`` for the (w, b) model, and a jitted update of 8 devices' local (w, b)."""
  template = {"w": np.zeros((FEATURES, OUTPUTS), np.float32), "b": np.zeros(OUTPUTS, np.float32)}
  state = onebit_optax.init_sharded(tx, template, mesh)
  specs = onebit_optax.state_partition_specs(state, "data")

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(specs, P("data"), P("data")),
                     out_specs=(P(), specs))
  def step(state, w, b):
    return tx.update({"w": w[0], "b": b[0]}, state)

  return state, step


def test_compressed_mean_updates_matches_the_simulated_allreduce():
  """compressed_mean_updates on 8 devices = the numpy workers' compressed allreduce, step by step."""
  rng = np.random.default_rng(3)
  mesh = jax.make_mesh((N,), ("data",))
  state, step = _updates_on_8_devices(onebit_optax.compressed_mean_updates("data"), mesh)

  sim = _Simulation(np.zeros(SIZE, np.float32), None, None, 0.9, 0.999)
  for t in range(6):
    w = rng.normal(size=(N, FEATURES, OUTPUTS)).astype(np.float32) * (1 + t)
    b = rng.normal(size=(N, OUTPUTS)).astype(np.float32) * 1e-3  # a small leaf: its own scale
    data = NamedSharding(mesh, P("data"))
    mean, state = step(state, jax.device_put(w, data), jax.device_put(b, data))
    local = np.stack([_flatten(w[i], b[i]) for i in range(N)])
    expected_w, expected_b = _unflatten(sim._compressed_allreduce(_pad(local))[POSITION])
    _close(mean["w"], expected_w, 1e-5, f"w at step {t}")
    _close(mean["b"], expected_b, 1e-5, f"b at step {t}")
    _close(np.asarray(state.worker_error), sim.worker_error, 1e-5, f"worker_error at step {t}")
    _close(np.asarray(state.server_error), sim.server_error, 1e-5, f"server_error at step {t}")
    # The small leaf is not sent at the size of the large one.
    assert np.max(np.abs(np.asarray(mean["b"]))) < 0.1
  # Inputs are fed identically to both sides every step, so the two differ only
  # by a few ulps: a sign decision is safe above ~1e-7 of its scale.
  assert sim.min_sign_margin > 1e-7, sim.min_sign_margin


def test_compressed_trace_matches_the_simulated_momentum():
  """compressed_trace on 8 devices: m = allreduce_1bit(decay * m + g_i), as the numpy workers do it."""
  rng = np.random.default_rng(5)
  decay = 0.9
  mesh = jax.make_mesh((N,), ("data",))
  state, step = _updates_on_8_devices(onebit_optax.compressed_trace(decay, "data"), mesh)

  sim = _Simulation(np.zeros(SIZE, np.float32), None, None, 0.9, 0.999)
  momentum = np.zeros(SIZE, np.float32)
  data = NamedSharding(mesh, P("data"))
  for t in range(6):
    w = rng.normal(size=(N, FEATURES, OUTPUTS)).astype(np.float32) + 0.3 * t
    b = rng.normal(size=(N, OUTPUTS)).astype(np.float32)
    out, state = step(state, jax.device_put(w, data), jax.device_put(b, data))
    local = np.stack([_flatten(w[i], b[i]) for i in range(N)]) + np.float32(decay) * momentum
    momentum = sim._compressed_allreduce(_pad(local))[POSITION]
    expected_w, expected_b = _unflatten(momentum)
    _close(out["w"], expected_w, 1e-5, f"w at step {t}")
    _close(out["b"], expected_b, 1e-5, f"b at step {t}")
    _close(state.trace["w"], expected_w, 1e-5, f"trace at step {t}")
  assert sim.min_sign_margin > 1e-7, sim.min_sign_margin
