"""Hierarchical averaging, ``axis_name=('node', 'local')``, on a (2, 4) mesh of 8 devices.

Float32 over the fast axis ('local', inside a node), 1 bit over the slow one
('node'). Checked three ways:

- a numpy simulation of the hierarchical algorithm (written from its
  description, core v3, reusing the flat simulation's numpy compressor of
  tests/test_reference_simulation.py) against the JAX run, across the freeze;
- the compiled compression step: over 'node' only uint8 (packed signs and
  scales), over 'local' the float32 reduce-scatter and uint8 all-gathers, and
  the bytes over 'node' at most 1/30 of a float32 all-reduce over 'node';
- every device's copy of the parameters and the momentum bitwise identical.

The simulation (every leaf compressed: ``exact_below`` does not apply here; the
bit stream of the flat simulation's four leaves on 8 chunks of 256). Device
(k, l) is node k's l-th device (device id 4k + l). At each compression step:
0. Every device forms ``x = b1 m + (1 - b1) g`` per leaf, ``m`` decoded from the
   last message, laid out on the bit stream (zeros on padding).
1. Inside each node, the x are averaged in float32; device (k, l) keeps slice l
   of its node's mean: chunks 2l and 2l + 1 of the 8 chunks.
2. Over the slow axis, the flat two-phase algorithm on that slice, one scale per
   segment on the worker too: (k, l) compresses its slice (plus its worker
   error, 2 chunks long) chunk by chunk and sends chunk 2l + j to device (j, l);
   device (k, l) serves chunk 2l + k: averages the 2 nodes' pieces, adds its
   server error, re-compresses.
3. Every device decodes all 8 server messages (the new ``momentum_message``).
At the freeze the message is ``C(m)`` with one scale per leaf and the worker
errors stay 0 (the first compression step uses ``b1 C(m)``).
"""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import onebit_optax
from onebit_optax import _collective
import _fields
import _flat
import _hlo
import test_reference_simulation as flat_sim

F32 = np.float32
NODES, LOCAL = 2, 4
N = NODES * LOCAL
AXES = ("node", "local")
SIZES, NAMES, SHAPES = flat_sim.SIZES, flat_sim.NAMES, flat_sim.SHAPES
PADDED = _flat.padded(SIZES, N)  # 2048: a [0, 100), b [128, 148), g [256, 257), w [384, 1584)
CHUNK = PADDED // N
SCALAR_ELEMENTS = 8


class _HierarchicalSimulation(flat_sim._Simulation):
  """The flat simulation's workers, averaging hierarchically (module docstring)."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, exact_below=0, **kwargs)  # every leaf compressed
    assert self.compressed == NAMES and self.bits.padded == PADDED
    self.worker_error = np.zeros((N, PADDED // LOCAL), F32)

  def _freeze(self):
    """Hierarchical: the message is C(m) (one RMS scale per leaf); the worker errors start at 0."""
    scales = {k: flat_sim._rms(self.mu[k], self.mu[k].size) for k in self.compressed}
    for k in self.compressed:
      self.margin.note(self.mu[k], scales[k])
    self.message = self._rows(self.mu, scales, self.mu)
    self.feedback, self.just_froze = True, True

  def _step_bytes(self, *, compressed):
    if compressed:
      return 2.0 * (NODES - 1) * self.row_bytes
    return _collective.allreduce_wire_bytes(PADDED // LOCAL, NODES)

  def _compress_and_average(self, grads):
    self.just_froze = False
    b1, c1, bits = F32(self.b1), F32(1 - self.b1), self.bits
    mean = self.decode(self.message)
    x = [flat_sim._flatten({k: b1 * mean[k] + c1 * grads[i][k] for k in NAMES}, bits, NAMES)
         for i in range(N)]
    node_mean = []
    for k in range(NODES):
      total = x[k * LOCAL]
      for l in range(1, LOCAL):
        total = total + x[k * LOCAL + l]
      node_mean.append(total / F32(LOCAL))
    span = NODES * CHUNK  # one device's slice
    outbox = {}
    for k in range(NODES):
      for l in range(LOCAL):
        i = k * LOCAL + l
        error = self.worker_error[i] if self.feedback else np.zeros(span, F32)
        part = node_mean[k][l * span:(l + 1) * span] + error
        for j in range(NODES):
          chunk = l * NODES + j
          real = bits.chunk_real(chunk)
          piece = np.where(real, part[j * CHUNK:(j + 1) * CHUNK], F32(0)).astype(F32)
          scales = flat_sim._segment_scales(piece, bits, chunk)
          per_element = flat_sim._per_element(scales, bits, chunk)
          self.margin.note(piece, per_element, real)
          self.worker_error[i, j * CHUNK:(j + 1) * CHUNK] = np.where(
              real, piece - flat_sim._signed(piece, per_element), F32(0))
          outbox[k, chunk] = (piece >= 0, scales)
    signs, scales = [None] * N, [None] * N
    for k in range(NODES):
      for l in range(LOCAL):
        i, chunk = k * LOCAL + l, l * NODES + k
        decoded = [flat_sim._decode_chunk(*outbox[source, chunk], bits, chunk)
                   for source in range(NODES)]
        signs[chunk], scales[chunk], self.server_error[i] = flat_sim._serve(
            decoded, self.server_error[i], bits, chunk, self.margin)
    self.message = (np.stack(signs), np.stack(scales), np.zeros((N, 0), F32))
    self.feedback = True


def _moments(opt_state, params):
  # A host copy: onebit_optax.moments of the hierarchical state as it is (on the
  # 2x4 mesh, no exact leaves) raised "Length of device assignment 1 is not equal
  # to the size of the mesh 8 of aval u8[8,0]" (a zero-width slice of the message).
  return onebit_optax.moments(jax.device_get(opt_state), params)


def _compare(sim, rec, tolerance, at, diffs):
  flat_sim._compare_seen(sim, rec, tolerance, at, diffs)

  def close(name, actual, expected, magnitude=None):
    diffs[name] = max(diffs.get(name, 0),
                      flat_sim._close(actual, expected, tolerance, name + at, magnitude))

  for k in NAMES:
    close("mu", rec["mu"][k], sim.mu[k], flat_sim._tree_magnitude(sim.mu))
    close("nu", rec["nu"][k], sim.nu[k], flat_sim._tree_magnitude(sim.nu))
  assert rec["frozen"] == sim.frozen and rec["feedback"] == sim.feedback, at
  assert rec["wire_bytes"] == sim.wire_bytes, (rec["wire_bytes"], sim.wire_bytes, at)
  if not sim.frozen:
    assert not np.any(rec["worker_error"]) and not np.any(rec["server_error"]), at
    return
  bits = sim.bits
  signs, scales, floats = flat_sim._message_parts(rec["message"], bits, 0)
  real = bits.real.reshape(N, bits.chunk)
  np.testing.assert_array_equal(signs[real], sim.message[0][real], err_msg="message signs" + at)
  close("message scales", scales, sim.message[1])
  # Some server chunks hold only padding (all zeros), so the errors are measured
  # against the size of all the compressed values of the step.
  magnitude = max(float(np.max(np.abs(sim.worker_error))), float(np.max(sim.message[1])))
  close("worker_error", rec["worker_error"], sim.worker_error, magnitude)
  close("server_error", rec["server_error"], sim.server_error, magnitude)


@pytest.fixture(scope="module")
def mesh():
  assert jax.device_count() == N
  return jax.make_mesh((NODES, LOCAL), AXES)


def _training_step(mesh, tx, specs, loss_fn=flat_sim._loss):
  data = P(AXES)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, data, data),
                     out_specs=(P(), specs))
  def step(params, opt_state, x, y):
    grads = jax.grad(loss_fn)(onebit_optax.local_params(params, AXES), x[0], y[0])
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return step


def _setup(mesh, freeze_at, seed=1):
  params0, x, y = flat_sim._problem(seed)
  tx = onebit_optax.onebit_adam(flat_sim.LR, 0.9, 0.999, flat_sim.EPS, axis_name=AXES,
                                freeze=onebit_optax.fixed_step_freeze(freeze_at))
  params = jax.device_put(params0, NamedSharding(mesh, P()))
  opt_state = onebit_optax.init_sharded(tx, params, mesh, AXES)
  specs = onebit_optax.state_partition_specs(opt_state, AXES)
  data = NamedSharding(mesh, P(AXES))
  return (params0, x, y, tx, params, opt_state, specs,
          jax.device_put(x, data), jax.device_put(y, data))


def test_matches_numpy_simulation_of_2_nodes_of_4(mesh):
  # Measured: max |jax - numpy| / max|numpy| about 1e-5 (see the printout).
  freeze_at, num_steps, tolerance = flat_sim.FREEZE_AT, flat_sim.NUM_STEPS, 5e-5
  seed = flat_sim.CONFIGS["optax_defaults"][3]
  params0, x, y, tx, params, opt_state, specs, x_dev, y_dev = _setup(mesh, freeze_at, seed)
  state = opt_state[0]
  # The worker error covers one device's 1/4 slice; the server error one chunk;
  # no per-leaf u (hierarchical), every leaf compressed (a 2-segment message, no floats).
  assert state.local_momentum is None
  assert state.worker_error.shape == (N, PADDED // LOCAL)
  assert state.server_error.shape == (N, CHUNK)
  assert state.momentum_message.shape == (N, CHUNK // 8 + 4 * _flat.max_segments(SIZES, N))
  step = _training_step(mesh, tx, specs)
  sim = _HierarchicalSimulation(params0, x, y, 0.9, 0.999)
  diffs = {}
  for t in range(1, num_steps + 1):
    params, opt_state = jax.block_until_ready(step(params, opt_state, x_dev, y_dev))
    sim.update()
    s = opt_state[0]
    rec = dict(params=flat_sim._numpy_tree(params), mu=flat_sim._numpy_tree(s.mu),
               nu=flat_sim._numpy_tree(s.nu),
               moments_mu=flat_sim._numpy_tree(_moments(opt_state, params)[0]),
               frozen=bool(s.frozen), feedback=bool(s.feedback_valid),
               worker_error=np.array(s.worker_error), server_error=np.array(s.server_error),
               message=np.array(s.momentum_message), wire_bytes=float(s.wire_bytes))
    _compare(sim, rec, tolerance, f" after step {t}", diffs)
  print("\n[hierarchical] max |jax - numpy| / max|numpy|: "
        + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items())
        + f"; smallest sign margin {sim.margin.value:.1e}")
  assert int(_fields.field(opt_state, "freeze_step")) == freeze_at
  # The slow axis carries the compressed mean of a quarter of the buffer per device.
  assert float(_fields.field(opt_state, "wire_bytes")) == _collective.compressed_wire_bytes(
      PADDED // LOCAL, NODES, _flat.max_segments(SIZES, N))
  assert sim.margin.value > 1e-5, sim.margin.value


def test_replicas_bitwise_identical_after_compression(mesh):
  params0, x, y, tx, params, opt_state, specs, x_dev, y_dev = _setup(mesh, freeze_at=3)
  step = _training_step(mesh, tx, specs)
  for _ in range(40):
    params, opt_state = jax.block_until_ready(step(params, opt_state, x_dev, y_dev))
  assert bool(_fields.field(opt_state, "frozen"))
  worker_error = np.asarray(opt_state[0].worker_error)
  assert not np.array_equal(worker_error[0], worker_error[1])  # devices did differ
  for name, tree in {"params": params, "mu": opt_state[0].mu}.items():
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
      flat_sim._assert_bitwise_identical(flat_sim._replica_copies(leaf),
                                         f"{name}{jax.tree_util.keystr(path)}")


def test_one_node_compresses_too():
  """The hierarchical recipe on one node (node axis of 1): past the freeze, nothing crosses nodes.

  The server of the one-member slow axis still compresses its chunk with its
  error (a server error buffer exists as with more nodes; there was none, and
  the first compression step failed with a TypeError).
  """
  one_node = jax.make_mesh((1, LOCAL), AXES, devices=jax.devices()[:LOCAL])
  params0, x, y, tx, params, opt_state, specs, x_dev, y_dev = _setup(one_node, freeze_at=3)
  assert opt_state[0].server_error.shape[0] == LOCAL
  step = _training_step(one_node, tx, specs)
  loss = lambda p: float(flat_sim._loss(p, x.reshape(-1, *x.shape[2:]), y.reshape(-1, *y.shape[2:])))
  for _ in range(12):
    params, opt_state = jax.block_until_ready(step(params, opt_state, x_dev, y_dev))
  assert bool(_fields.field(opt_state, "frozen"))
  assert float(_fields.field(opt_state, "wire_bytes")) == 0.0  # no other node to send to
  assert loss(params) < loss(params0)
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    copies = [np.asarray(c).view(np.uint32) for c in flat_sim._replica_copies(leaf)]
    assert len(copies) == LOCAL and all(np.array_equal(copies[0], c) for c in copies), path


@pytest.fixture(scope="module")
def phases(mesh):
  _, _, _, tx, params, opt_state, specs, x_dev, y_dev = _setup(mesh, freeze_at=10)
  step = _training_step(mesh, tx, specs)
  compiled = step.lower(params, opt_state, x_dev, y_dev).compile(
      {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True})
  return _hlo.split_by_phase(_hlo.HloModule.from_compiled(compiled))


def _large(collectives):
  return [c for c in collectives if c.size > SCALAR_ELEMENTS]


def test_compression_step_sends_only_bytes_over_the_slow_axis(phases):
  over = collections.defaultdict(list)  # the group size tells the axis: 2 = node, 4 = local
  for c in _large(phases.compression):
    over[{NODES: "node", LOCAL: "local"}[c.group_size]].append(c)
  described = {axis: sorted(f"{c.collective} {sorted(c.dtypes)}" for c in cs)
               for axis, cs in over.items()}
  assert described == {
      "node": ["all-gather ['u8']", "all-to-all ['u8']"],
      "local": ["all-gather ['u8']", "reduce-scatter ['f32']"]}, described
  sizes = SIZES
  slow = _hlo.total_wire_bytes(over["node"], NODES)
  allreduce_over_nodes = _collective.allreduce_wire_bytes(_flat.padded(sizes, N), NODES)
  print(f"\n[hierarchical] bytes over 'node' per device: {slow:.0f}, "
        f"fp32 all-reduce over 'node': {allreduce_over_nodes:.0f} "
        f"({allreduce_over_nodes / slow:.1f}x)")
  assert slow <= allreduce_over_nodes / 30
  assert slow == _collective.compressed_wire_bytes(
      _flat.padded(sizes, N) // LOCAL, NODES, _flat.max_segments(sizes, N))
  # Anything else (a finiteness predicate) is a scalar.
  for c in phases.compression:
    assert c.size <= SCALAR_ELEMENTS or c in _large(phases.compression), str(c)


def test_warmup_sends_a_quarter_of_the_buffer_over_the_slow_axis(phases):
  sizes = SIZES
  described = sorted(f"{c.collective} {sorted(c.dtypes)} {c.group_size} {c.size}"
                     for c in _large(phases.warmup))
  quarter = _flat.padded(sizes, N) // LOCAL
  assert described == sorted([
      f"reduce-scatter ['f32'] {LOCAL} {quarter}",
      f"all-reduce ['f32'] {NODES} {quarter}",
      f"all-gather ['f32'] {LOCAL} {_flat.padded(sizes, N)}"]), described


def test_malformed_axis_pairs_are_refused():
  for bad in [("node", "node"), ("a", "b", "c"), ("node", None)]:
    with pytest.raises(ValueError, match="pair of two different axes"):
      onebit_optax.onebit_adam(1e-3, axis_name=bad)


def test_checkpoint_round_trip_and_move_to_a_flat_mesh(mesh, tmp_path):
  _, _, _, tx, params, opt_state, specs, x_dev, y_dev = _setup(mesh, freeze_at=3)
  step = _training_step(mesh, tx, specs)
  for _ in range(6):
    params, opt_state = jax.block_until_ready(step(params, opt_state, x_dev, y_dev))
  assert onebit_optax.save_checkpoint(str(tmp_path), 6, params, opt_state)
  # The same mesh: everything back exactly, error buffers included.
  params2, state2, _ = onebit_optax.restore_checkpoint(str(tmp_path), tx, params, mesh, AXES)
  for a, b in zip(jax.tree.leaves((params, opt_state)), jax.tree.leaves((params2, state2))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The same 8 devices as a flat mesh: the errors have other shapes; they are handed on
  # (elastic restore), except the residual of b and g, exact on the flat mesh (a warning).
  flat_mesh = jax.make_mesh((N,), ("data",))
  flat_tx = onebit_optax.onebit_adam(flat_sim.LR, axis_name="data",
                                     freeze=onebit_optax.fixed_step_freeze(3))
  with pytest.warns(UserWarning, match=r"no longer compressed"):
    _, flat_state, _ = onebit_optax.restore_checkpoint(str(tmp_path), flat_tx, params, flat_mesh)
  # Core v3 on a flat mesh: no worker error buffer, a per-device u per compressed
  # leaf (a and w, one group each; b and g are exact there), carrying the handed-on feedback.
  assert flat_state[0].worker_error is None
  assert [u.shape for u in flat_state[0].local_momentum] == [(N, 1) + SHAPES["a"],
                                                              (N, 1) + SHAPES["w"]]
  assert all(np.any(np.asarray(u)) for u in flat_state[0].local_momentum)
  assert flat_state[0].server_error.shape == (N, _flat.padded([SIZES[0], SIZES[3]], N) // N)
  assert np.any(np.asarray(flat_state[0].server_error))
  for name in NAMES:
    np.testing.assert_array_equal(np.asarray(flat_state[0].mu[name]),
                                  np.asarray(opt_state[0].mu[name]), err_msg=name)
    np.testing.assert_array_equal(np.asarray(flat_state[0].nu[name]),
                                  np.asarray(opt_state[0].nu[name]), err_msg=name)
  # The message was re-laid out for the flat mesh: the same signs; the exact leaves
  # (b, g) carry the decoded values, the compressed ones one RMS per new segment
  # (the segments moved), which keeps each leaf's norm.
  hier_mu = _moments(opt_state, params)[0]
  flat_mu = onebit_optax.moments(flat_state, params)[0]
  for name in NAMES:
    a, b = np.asarray(flat_mu[name]), np.asarray(hier_mu[name])
    np.testing.assert_array_equal(np.signbit(a), np.signbit(b), err_msg=name)
    if a.size < flat_sim.EXACT_BELOW:
      np.testing.assert_allclose(a, b, rtol=1e-6, atol=0, err_msg=name)
    else:
      np.testing.assert_allclose(np.linalg.norm(a), np.linalg.norm(b), rtol=1e-5, err_msg=name)
  # status counts the bytes over the slow axis: a quarter of the buffer, 2 nodes.
  summary = onebit_optax.status(flat_state, params=params, freeze=3)
  assert summary.phase == "compression"
  hier = onebit_optax.status(opt_state, params=params, freeze=3)
  assert hier.adam_bytes == 6 * _collective.allreduce_wire_bytes(flat_sim.SIZE / LOCAL, NODES)


def test_the_gloo_lowering_gives_the_same_training(mesh, monkeypatch):
  # Over gloo (multi-process CPU) the fast-axis reduce-scatter is an all-reduce
  # and a slice (faster there); forced here on simulated devices, the run must
  # match the reduce-scatter one across the freeze.
  from onebit_optax import _collective

  def train():
    _, _, _, tx, params, opt_state, specs, x_dev, y_dev = _setup(mesh, freeze_at=4)
    step = _training_step(mesh, tx, specs)
    for _ in range(10):
      params, opt_state = jax.block_until_ready(step(params, opt_state, x_dev, y_dev))
    return params, step

  params, step = train()
  monkeypatch.setattr(_collective, "_gloo_collectives", lambda: True)
  params_gloo, step_gloo = train()
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params_gloo)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)
  _, _, _, _, p, s, _, x_dev, y_dev = _setup(mesh, freeze_at=4)
  assert "reduce_scatter" in step.lower(p, s, x_dev, y_dev).as_text()
  text = step_gloo.lower(p, s, x_dev, y_dev).as_text()
  assert "reduce_scatter" not in text and "all_reduce" in text


@pytest.mark.parametrize("bad_step", [2, 6], ids=["warmup", "compression"])
def test_a_nan_on_one_device_skips_the_step_on_every_device(mesh, bad_step):
  # Device (1, 2) only: after the reduce-scatter over 'local' the NaN sits in one
  # device's slice, yet every device must see it (it reaches the gathered scales).
  _, x, y, tx, params, opt_state, specs, x_dev, y_dev = _setup(mesh, freeze_at=4)
  step = _training_step(mesh, tx, specs)
  x_bad = np.array(x)
  x_bad[1 * LOCAL + 2, 0, 3] = np.nan
  x_bad = jax.device_put(x_bad, NamedSharding(mesh, P(AXES)))
  for t in range(1, 9):
    before = (params, opt_state)
    params, opt_state = jax.block_until_ready(
        step(params, opt_state, x_bad if t == bad_step else x_dev, y_dev))
    if t == bad_step:
      for a, b in zip(jax.tree.leaves(before[0]), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
      for name in ("mu", "nu", "worker_error", "server_error", "count", "momentum_message"):
        for a, b in zip(jax.tree.leaves(getattr(before[1][0], name)),
                        jax.tree.leaves(getattr(opt_state[0], name))):
          np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
      # A skipped compression step drops the worker error feedback of the next step.
      assert not bool(opt_state[0].feedback_valid)  # warmup: not yet valid
  assert int(_fields.field(opt_state, "skipped_steps")) == 1
  assert bool(_fields.field(opt_state, "frozen"))
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    assert np.all(np.isfinite(np.asarray(leaf)))
    flat_sim._assert_bitwise_identical(flat_sim._replica_copies(leaf), jax.tree_util.keystr(path))
