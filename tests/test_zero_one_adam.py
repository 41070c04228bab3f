"""0/1 Adam on 8 devices against an independent numpy simulation of 8 workers, optax.adam and its HLO.

The simulation is written from the algorithm (Lu et al. 2023, DeepSpeed's
``zoadam.py`` for the schedules and the sync) and the package's documented wire
format (one RMS scale per leaf on the workers' side, one per segment on the
servers', leaves under 64 elements exact); it imports nothing from
``onebit_optax`` (the layout model is tests/_flat.py, numpy).

The problem: each device ``i`` has its own quadratic, loss
``0.5 sum c_i (p - t_i)^2`` over four leaves ``a`` (100, compressed), ``b``
(20, exact), ``g`` (a scalar, exact) and ``w`` (60 x 20, compressed). Its
gradient ``c_i (p - t_i)`` is one subtraction and one multiplication, rounded
the same way by numpy and XLA, so both runs see the same gradients as long as
their parameters agree; what remains are the orders of the sums (the RMS
scales, the per-leaf variance norms) and float32 ``pow`` in the bias
corrections. A compressed value within rounding of 0 could flip its sign in one
run only; the simulation records the smallest ``|value| / scale`` it compressed
(``margin``), printed on failure.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import onebit_optax
import _fields
import _flat
import _hlo

F32 = np.float32
N = 8
SHAPES = {"a": (100,), "b": (20,), "g": (), "w": (60, 20)}
NAMES = sorted(SHAPES)
SIZES = [int(np.prod(SHAPES[k], dtype=int)) for k in NAMES]
B1, B2, EPS, LR, WD, FLOOR = 0.9, 0.99, 1e-8, 0.05, 0.01, 0.01
BOUND = F32(max(1.0, (1 - B1) / np.sqrt(1 - B2)))  # Adam's step bound (Kingma & Ba, Sec. 2.1)
KAPPA = 3  # variance steps 1-3, then 4, 6, 8, then 12, 16, 20, ... (interval 1, 2, 4, ...)
FREEZE = 14  # last step that may update the variance
TOL = 2e-5  # of the largest |value| of the compared tree
DECAYED = ("a", "w")  # weight decay on these leaves only (the mask)
SIM_SEED = 1  # the problem of the comparison with the simulation (see there)


def _problem(seed=0):
  rng = np.random.default_rng(seed)
  c = {k: rng.uniform(0.2, 2.0, size=(N,) + SHAPES[k]).astype(F32) for k in NAMES}
  t = {k: (rng.normal(size=(N,) + SHAPES[k]) + 0.5).astype(F32) for k in NAMES}
  c["a"][:, :3] = 0.0  # three coordinates never see a gradient: v = 0, they must stay put
  params = {k: (rng.normal(size=SHAPES[k]) * 0.1).astype(F32) for k in NAMES}
  return params, c, t


def _loss(p, c, t):
  return sum(0.5 * jnp.sum(c[k] * jnp.square(p[k] - t[k])) for k in NAMES)


# ----------------------------------------------------------------------------
# The simulation (numpy only).


def _rms(v):
  return F32(np.sqrt(np.sum(np.square(v, dtype=F32), dtype=F32) / F32(max(v.size, 1))))


def _signed(v, scale):
  return np.where(v >= 0, scale, -scale).astype(F32)


class _Wire:
  """The 1-bit mean with error feedback, as the messages carry it (tests/_flat.py layout)."""

  def __init__(self):
    compressed, exact = _flat.split(SIZES)
    self.compressed, self.exact = [NAMES[i] for i in compressed], [NAMES[i] for i in exact]
    self.bits = _flat.Bits([SIZES[i] for i in compressed], N)
    self.exact_size = sum(SIZES[i] for i in exact)
    self.exact_chunk = -(-self.exact_size // N)
    self.row_bytes = self.bits.chunk // 8 + 4 * (self.bits.S + self.exact_chunk)
    self.server_error = np.zeros((N, self.bits.chunk), F32)
    self.margin = np.inf

  def _note(self, v, scale):
    v, scale = np.broadcast_arrays(np.asarray(v, F32), np.asarray(scale, F32))
    keep = (v != 0) & (scale > 0)
    if np.any(keep):
      self.margin = min(self.margin, float(np.min(np.abs(v[keep]) / scale[keep])))

  def _stream(self, tree):
    out = np.zeros(self.bits.padded, F32)
    for k, off, size in zip(self.compressed, self.bits.offsets, self.bits.sizes):
      out[off:off + size] = np.ravel(tree[k])
    return out

  def _segment_scale(self, r, leaf_scale):
    """Per element of chunk r: its segment's scale (a worker sends its leaf's scale)."""
    out = np.zeros(self.bits.chunk, F32)
    for leaf, idx in self.bits.segments[r]:
      out[idx] = leaf_scale(leaf, idx)
    return out

  def mean(self, sent, exact):
    """sent[i][k], exact[i][k]: what worker i sends; returns the mean every worker decodes."""
    bits, real = self.bits, self.bits.real
    chunk = bits.chunk
    decoded = []
    for i in range(N):
      scales = {k: _rms(sent[i][k]) for k in self.compressed}
      for k in self.compressed:
        self._note(sent[i][k], scales[k])
      stream = self._stream(sent[i])
      per = np.concatenate([self._segment_scale(
          r, lambda leaf, idx: scales[self.compressed[leaf]] if leaf >= 0 else 0)
          for r in range(N)])
      decoded.append(np.where(real, _signed(stream, per), F32(0)))
    out = np.zeros(bits.padded, F32)
    for r in range(N):
      part = slice(r * chunk, (r + 1) * chunk)
      total = decoded[0][part]
      for i in range(1, N):
        total = total + decoded[i][part]
      w = np.where(real[part], total / F32(N) + self.server_error[r], F32(0)).astype(F32)
      seg = self._segment_scale(
          r, lambda leaf, idx: _rms(w[idx][real[part][idx]]) if real[part][idx].any() else 0)
      self._note(w[real[part]], seg[real[part]])
      out[part] = np.where(real[part], _signed(w, seg), F32(0))
      self.server_error[r] = np.where(real[part], w - _signed(w, seg), F32(0))
    mean = {k: out[off:off + size].reshape(SHAPES[k])
            for k, off, size in zip(self.compressed, bits.offsets, bits.sizes)}
    for k in self.exact:  # float32, averaged exactly (summed over the workers in order)
      total = np.asarray(exact[0][k], F32)
      for i in range(1, N):
        total = total + exact[i][k]
      mean[k] = (total / F32(N)).astype(F32)
    return mean


class _Simulation:
  """8 workers running 0/1 Adam (``H``: local steps after ``FREEZE``, None: compressed steps)."""

  def __init__(self, params, c, t, *, H=None, scaler=None, per_step=False, decayed=DECAYED):
    self.decayed = decayed  # the leaves with weight decay (the mask)
    self.p = {k: np.array(v, F32) for k, v in params.items()}
    self.c, self.t, self.H, self.scaler = c, t, H, scaler
    self.per_step, self.last_var = per_step, 0  # variance_ema='per_step'; the last variance step
    zeros = lambda: {k: np.zeros(SHAPES[k], F32) for k in NAMES}
    self.mu, self.nu, self.nu_l1 = zeros(), zeros(), {k: F32(0) for k in NAMES}
    self.step_count, self.var_updates, self.interval, self.counter = 0, 0, 1, 0
    self.wire = _Wire()
    self.sent = [{k: np.zeros(SHAPES[k], F32) for k in self.wire.compressed} for _ in range(N)]
    self.scale = [{k: F32(0) for k in self.wire.compressed} for _ in range(N)]
    self.local_mu = [zeros() for _ in range(N)]
    self.acc = [zeros() for _ in range(N)]
    self.lr_sum, self.l_interval, self.l_counter, self.since = F32(0), 1, 0, 0
    self.phase, self.wire_bytes = "none", 0.0

  def grads(self, local):
    return [{k: (self.c[k][i] * ((self.p[k] + self.acc[i][k] if local else self.p[k])
                                 - self.t[k][i])).astype(F32) for k in NAMES} for i in range(N)]

  def _direction(self, m, k, bc1, bc2, bounded, clip=True):
    nu = self.nu[k]
    v_hat = nu / bc2
    if bounded:
      v_hat = np.maximum(v_hat, F32(FLOOR) * self.nu_l1[k] / (F32(max(nu.size, 1)) * bc2))
    step = (m / bc1) / (np.sqrt(v_hat) + F32(EPS))
    if bounded and clip:
      step = np.clip(step, -BOUND, BOUND)
    return np.where(nu > 0, step, F32(0)).astype(F32)

  def _apply(self, directions):
    for k in NAMES:  # optax.adamw's order: (direction + wd p) * -lr, masked decay
      decay = F32(WD) * self.p[k] if k in self.decayed else F32(0)
      self.p[k] = (self.p[k] + (-F32(LR)) * (directions[k] + decay)).astype(F32)

  def _bc2(self):
    """v's bias correction: 1 - b2^(variance steps), or 1 - b2^(last variance step) per step."""
    return F32(1) - F32(B2) ** (self.last_var if self.per_step else self.var_updates)

  def _variance(self, t):
    grads = self.grads(False)
    bounded = self.var_updates < t - 1  # a compressed step came before: floor and clip
    # per_step: the steps since the last variance step decay v as Adam's would have.
    decay = F32(B2) ** F32(t - self.last_var) if self.per_step else F32(B2)
    self.var_updates, self.last_var = self.var_updates + 1, t
    bc1, bc2 = F32(1) - F32(B1) ** t, self._bc2()
    d = {}
    for k in NAMES:
      total = grads[0][k]
      for i in range(1, N):
        total = total + grads[i][k]
      g = (total * F32(1 / N)).astype(F32)
      self.mu[k] = (F32(B1) * self.mu[k] + F32(1 - B1) * g).astype(F32)
      self.nu[k] = (decay * self.nu[k] + (F32(1) - decay) * np.square(g)).astype(F32)
      self.nu_l1[k] = np.sum(self.nu[k], dtype=F32)
      d[k] = self._direction(self.mu[k], k, bc1, bc2, bounded)
    self.counter += 1
    if self.counter == KAPPA:
      self.counter, self.interval = 0, 2 * self.interval
    self._apply(d)
    self.wire_bytes = _flat.onebit_warmup_bytes(SIZES, N)

  def _restart_feedback(self):
    self.sent = [{k: np.zeros(SHAPES[k], F32) for k in self.wire.compressed} for _ in range(N)]
    self.scale = [{k: F32(0) for k in self.wire.compressed} for _ in range(N)]
    self.wire.server_error[:] = 0

  def _feedback(self, i, k):
    prev = self.sent[i][k]
    return prev - _signed(prev, self.scale[i][k])

  def _exchange(self, sent, exact):
    mean = self.wire.mean(sent, exact)
    for i in range(N):
      self.sent[i] = {k: sent[i][k] for k in self.wire.compressed}
      self.scale[i] = {k: _rms(sent[i][k]) for k in self.wire.compressed}
    self.wire_bytes = 2.0 * (N - 1) * self.wire.row_bytes
    return mean

  def _compressed(self, t):
    """Each device's momentum (not its gradient) through the 1-bit mean; v unchanged."""
    grads = self.grads(False)
    local = [{k: (F32(B1) * self.mu[k] + F32(1 - B1) * grads[i][k]).astype(F32) for k in NAMES}
             for i in range(N)]
    sent = [{k: (local[i][k] + self._feedback(i, k)).astype(F32) for k in self.wire.compressed}
            for i in range(N)]
    mean = self._exchange(sent, [{k: local[i][k] for k in self.wire.exact} for i in range(N)])
    bc1, bc2 = F32(1) - F32(B1) ** t, self._bc2()
    d = {}
    for k in NAMES:
      self.mu[k] = mean[k]
      d[k] = self._direction(self.mu[k], k, bc1, bc2, True)
    self._apply(d)

  def _local(self, t):
    """DeepSpeed's local step and sync, in the parameters' units (module docstring of the package)."""
    fresh = self.phase in ("none", "variance", "compressed")
    grads = self.grads(True)
    bc1, bc2 = F32(1) - F32(B1) ** t, self._bc2()
    lr = F32(LR)
    for i in range(N):
      for k in NAMES:
        base = self.mu[k] if fresh else self.local_mu[i][k]
        m = (F32(B1) * base + F32(1 - B1) * grads[i][k]).astype(F32)
        # Floored, not clipped: the bound applies to the sync's move (below).
        d = self._direction(m, k, bc1, bc2, True, clip=False)
        theta = self.p[k] + self.acc[i][k]
        self.local_mu[i][k] = m
        if k in self.decayed:
          d = d + F32(WD) * theta
        self.acc[i][k] = (self.acc[i][k] - lr * d).astype(F32)
    self.lr_sum = F32(self.lr_sum + lr)
    sync = self.since + 1 >= self.l_interval
    self.wire_bytes = 0.0
    if sync:
      if fresh:  # the error buffers held the compressed steps' errors: they restart
        self._restart_feedback()
      denominator = {k: np.sqrt(np.maximum(self.nu[k] / bc2, F32(FLOOR) * self.nu_l1[k] / (
          F32(max(self.nu[k].size, 1)) * bc2))) + F32(EPS) for k in NAMES}
      scaled = [{k: (self.acc[i][k] * denominator[k]).astype(F32) for k in NAMES} for i in range(N)]
      sent = [{k: (scaled[i][k] + self._feedback(i, k)).astype(F32) for k in self.wire.compressed}
              for i in range(N)]
      mean = self._exchange(sent, [{k: scaled[i][k] for k in self.wire.exact} for i in range(N)])
      for k in NAMES:
        # The restarted momentum: the average step, less its weight decay share.
        self.mu[k] = (-mean[k] * bc1 / self.lr_sum).astype(F32)
        if k in self.decayed:
          self.mu[k] = (self.mu[k] - F32(WD) * self.p[k] * denominator[k] * bc1).astype(F32)
        # The move, its step part (weight decay taken out) within +-BOUND * lr_sum.
        decay = F32(WD) * self.lr_sum * self.p[k] if k in self.decayed else F32(0)
        limit = F32(BOUND) * self.lr_sum
        move = np.clip(mean[k] / denominator[k] + decay, -limit, limit) - decay
        move = np.where(self.nu[k] > 0, move, F32(0)).astype(F32)
        self.p[k] = (self.p[k] + move).astype(F32)
        for i in range(N):
          self.local_mu[i][k] = self.mu[k].copy()
          self.acc[i][k] = np.zeros(SHAPES[k], F32)
      self.lr_sum, self.since = F32(0), 0
    else:
      self.since += 1
    self.l_counter += 1
    if self.l_counter == self.scaler:
      self.l_counter, self.l_interval = 0, min(self.H, 2 * self.l_interval)
    return sync

  def step(self):
    self.step_count += 1
    t = self.step_count
    frozen = t > FREEZE
    if not frozen and t % self.interval == 0:
      self._variance(t)
      self.phase = "variance"
    elif frozen and self.H is None:  # a sync of one step: each device's momentum, 1-bit mean
      if self.phase in ("variance", "compressed"):  # the first: the error feedback restarts
        self._restart_feedback()
      self._compressed(t)
      self.phase = "sync"
    elif frozen:
      self.phase = "sync" if self._local(t) else "local"
    else:
      self._compressed(t)
      self.phase = "compressed"


# ----------------------------------------------------------------------------
# The JAX run on 8 devices.


def _mesh():
  assert jax.device_count() == N
  return jax.make_mesh((N,), ("data",))


def _tx(H=None, scaler=4, decayed=DECAYED, **kw):
  return onebit_optax.zero_one_adam(
      LR, B1, B2, EPS, WD, axis_name="data", var_freeze_step=kw.pop("freeze", FREEZE),
      var_update_scaler=kw.pop("kappa", KAPPA), local_steps=H, local_step_scaler=scaler,
      variance_floor=FLOOR, mask=lambda p: {k: k in decayed for k in p}, **kw)


@functools.cache
def _step_fn(H=None, scaler=4, kappa=KAPPA, freeze=FREEZE, ema="per_update", decayed=DECAYED):
  """(tx, jitted shard_map train step, state specs) of one configuration (one compile)."""
  mesh, tx = _mesh(), _tx(H, scaler, decayed, kappa=kappa, freeze=freeze, variance_ema=ema)
  params, _, _ = _problem()
  specs = onebit_optax.state_partition_specs(
      jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=(P(),), out_specs=P(),
                                   check_vma=False), params), "data")

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                     out_specs=(P(), specs, P("data")))
  def step(params, opt_state, c, t):
    local = onebit_optax.local_params(params, "data", opt_state)
    grads = jax.grad(_loss)(local, jax.tree.map(lambda x: x[0], c), jax.tree.map(lambda x: x[0], t))
    updates, opt_state = tx.update(grads, opt_state, params)
    new = optax.apply_updates(params, updates)
    # Each device's copy of the parameters, to check that the replicas agree bit for bit.
    return new, opt_state, jax.tree.map(lambda x: jax.lax.pcast(x, "data", to="varying")[None], new)

  # One step in flight: queued 8-device steps can trip XLA:CPU's 40 s collective
  # rendezvous abort on a busy machine.
  return tx, lambda *args: jax.block_until_ready(step(*args)), specs


def _start(H=None, scaler=4, seed=0, **kw):
  mesh = _mesh()
  tx, step, _ = _step_fn(H, scaler, **kw)
  params0, c, t = _problem(seed)
  state = onebit_optax.init_sharded(tx, params0, mesh)
  put = lambda tree: jax.device_put(tree, NamedSharding(mesh, P("data")))
  return step, jax.device_put(params0, NamedSharding(mesh, P())), state, put(c), put(t)


def _inner(opt_state):
  return opt_state[0]


def _check_against(sim, params, opt_state, at):
  s = _inner(opt_state)
  big = lambda tree: max(float(np.max(np.abs(np.asarray(tree[k])))) for k in NAMES) or 1.0
  mu, nu = onebit_optax.moments(opt_state, params)  # (m decoded from the message when it lives there)
  for name, actual, expected in (("params", params, sim.p), ("mu", mu, sim.mu), ("nu", nu, sim.nu)):
    scale = big(expected)
    for k in NAMES:
      np.testing.assert_allclose(np.asarray(actual[k]), expected[k], rtol=0, atol=TOL * scale,
                                 err_msg=f"{name}[{k}] {at}, margin {sim.wire.margin:.2e}")
  for d in range(N):
    for j, k in enumerate(sim.wire.compressed):
      expected = sim.sent[d][k]
      # (every shape distinct: group j holds the one leaf k)
      np.testing.assert_allclose(np.asarray(s.local_sent[j])[d, 0], expected, rtol=0,
                                 atol=TOL * (float(np.max(np.abs(expected))) or 1.0),
                                 err_msg=f"local_sent[{k}] device {d} {at}")
  np.testing.assert_allclose(np.asarray(s.server_error), sim.wire.server_error, rtol=0,
                             atol=TOL * (float(np.max(np.abs(sim.wire.server_error))) or 1.0),
                             err_msg=f"server_error {at}")
  if sim.H is not None:
    for name, field, expected in (("accumulator", s.accumulator, sim.acc),
                                  ("local_mu", s.local_mu, sim.local_mu)):
      scale = max(big(e) for e in expected)  # the tree's magnitude: exact leaves are cancellations
      for d in range(N):
        for k in NAMES:
          np.testing.assert_allclose(np.asarray(field[k])[d], expected[d][k], rtol=0,
                                     atol=TOL * scale, err_msg=f"{name}[{k}] device {d} {at}")
  assert onebit_optax.status(opt_state).phase == sim.phase, at
  assert float(_fields.field(opt_state, "wire_bytes")) == pytest.approx(sim.wire_bytes), at


def _replicas(copies):
  """The 8 devices' copies are bitwise identical."""
  for k, x in copies.items():
    x = np.asarray(x)
    assert all(np.array_equal(x[0].view(np.uint32), x[d].view(np.uint32)) for d in range(N)), k


@pytest.mark.parametrize("H,decayed", [(None, DECAYED), (4, DECAYED), (None, ()), (4, ())])
def test_matches_numpy_simulation(H, decayed):
  """Variance steps (interval 1, 2, 4), compressed steps, the freeze (then syncs); with H: local steps.

  Also with no leaf decayed (the step then reads no parameters for a decay term).
  """
  steps = 26 if H is None else 34
  # Seed 1: no value sent comes within 2e-6 of its scale of 0, where the last
  # bit of rounding (numpy vs XLA's fused multiply-adds) could flip its sign
  # (seed 0 comes within 1.3e-7 at step 22 without H; asserted below).
  step, params, state, c, t = _start(H, seed=SIM_SEED, decayed=decayed)
  params0, c_np, t_np = _problem(SIM_SEED)
  sim = _Simulation(params0, c_np, t_np, H=H, scaler=4, decayed=decayed)
  phases = []
  for n in range(steps):
    params, state, copies = step(params, state, c, t)
    sim.step()
    phases.append(sim.phase[0])
    _check_against(sim, params, state, f"after step {n + 1} ({sim.phase})")
    _replicas(copies)
  assert sim.wire.margin > 1e-6, sim.wire.margin  # the comparison was not a coin toss
  # Variance steps 1-3 (interval 1), 4, 6, 8 (2), 12 (4); frozen after 14. Local steps:
  # the sync interval doubles every 4 local-phase steps, up to H = 4.
  expected = "vvvvcvcvcccvcc" + ("s" * 12 if H is None else "ssss" + "ls" * 2 + "llls" * 3)
  assert "".join(phases) == expected[:steps]


def test_per_step_variance_ema_matches_numpy_simulation():
  """variance_ema='per_step': v decays by b2 per step since the last variance step (intervals 1, 2, 4)."""
  step, params, state, c, t = _start(seed=SIM_SEED, ema="per_step")
  params0, c_np, t_np = _problem(SIM_SEED)
  sim = _Simulation(params0, c_np, t_np, per_step=True)
  per_update = _Simulation(params0, c_np, t_np)  # DeepSpeed's EMA: must not match
  for n in range(16):
    params, state, copies = step(params, state, c, t)
    sim.step()
    per_update.step()
    _check_against(sim, params, state, f"after step {n + 1} ({sim.phase})")
    _replicas(copies)
  assert sim.wire.margin > 1e-6, sim.wire.margin
  nu = np.asarray(_inner(state).nu["w"])
  assert np.max(np.abs(nu - per_update.nu["w"])) > 100 * TOL * np.max(np.abs(nu))
  assert int(_inner(state).variance_step) == 12 == sim.last_var


def test_wrong_simulation_fails():
  """The comparison can fail: a simulation without error feedback diverges from the JAX run."""
  step, params, state, c, t = _start(None)
  params0, c_np, t_np = _problem()
  sim = _Simulation(params0, c_np, t_np)
  sim._feedback = lambda i, k: np.zeros(SHAPES[k], F32)
  with pytest.raises(AssertionError):
    for n in range(16):
      params, state, _ = step(params, state, c, t)
      sim.step()
      _check_against(sim, params, state, f"after step {n + 1}")


# ----------------------------------------------------------------------------
# The compiled program: which collectives each kind of step runs.

FAST_CODEGEN = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _deep_params(layers):
  return {f"l{i:02d}": {"w": jnp.full((16, 16), 0.1), "b": jnp.zeros((16,))} for i in range(layers)}


def _deep_loss(p, x):
  h = x
  for name in sorted(p):
    h = jnp.tanh(h @ p[name]["w"] + p[name]["b"])
  return jnp.mean(h ** 2)


def _placed(mesh, tree, spec):
  """Abstract values placed on ``mesh`` by ``spec`` (a spec or a tree of specs)."""
  specs = spec if not isinstance(spec, P) else jax.tree.map(lambda _: spec, tree)
  return jax.tree.map(lambda x, sp: jax.ShapeDtypeStruct(
      np.shape(x), jnp.result_type(x), sharding=NamedSharding(mesh, sp)), tree, specs)


def _abstract_state(mesh, state, specs, placed_as=None):
  """The global abstract state (per-device buffers N times longer), placed by ``placed_as``."""
  grow = lambda x, sp: jax.ShapeDtypeStruct(
      (N * x.shape[0],) + x.shape[1:] if sp != P() else x.shape, x.dtype)
  return _placed(mesh, jax.tree.map(grow, state, specs), specs if placed_as is None else placed_as)


def _branch_collectives(H, layers):
  """Per communicating conditional: per branch, the (kind, dtypes, elements) of its collectives."""
  mesh = _mesh()
  tx = _tx(H)
  params = _deep_params(layers)
  state = jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=(P(),), out_specs=P(),
                                       check_vma=False), params)
  specs = onebit_optax.state_partition_specs(state, "data")

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data")),
                     out_specs=(P(), specs))
  def step(params, opt_state, x):
    grads = jax.grad(_deep_loss)(onebit_optax.local_params(params, "data", opt_state), x)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  args = (_placed(mesh, params, P()), _abstract_state(mesh, state, specs),
          _placed(mesh, jax.ShapeDtypeStruct((2 * N, 16), jnp.float32), P("data")))
  module = _hlo.HloModule.from_compiled(step.lower(*args).compile(FAST_CODEGEN))
  sig = lambda cs: sorted((c.collective, "".join(sorted(c.dtypes)), c.size) for c in cs)
  out = {}
  for cond in module.conditionals():
    per_branch = [sig(module.collectives(module.reachable([b]))) for b in cond.called]
    if any(per_branch):
      out[cond.name] = per_branch
  outside = sig(module.collectives(module.reachable([module.entry], skip=list(out))))
  return out, outside, [int(np.prod(p.shape)) for p in jax.tree.leaves(params)]


@pytest.mark.parametrize("H", [None, 4])
def test_hlo_collectives_per_kind_of_step(H):
  """Variance step: one f32 all-reduce; compressed step and sync: uint8 only; local step: none.

  The same collectives for 4 leaves and for 16: what goes on the wire is one
  fused message, and XLA's combiner makes the per-leaf psum one all-reduce.
  """
  found = {}
  for layers in (2, 8) if H is None else (2,):  # (compile time: one leaf count with H)
    conds, outside, sizes = _branch_collectives(H, layers)
    d, row_bytes = sum(sizes), _flat.onebit_row_bytes(sizes, N)
    assert outside == [], outside  # local gradients: no all-reduce in the backward pass
    branches = [b for per_branch in conds.values() for b in per_branch]
    variance = [b for b in branches if any(k == "all-reduce" for k, _, _ in b)]
    assert variance == [[("all-reduce", "f32", d)]], conds
    onebit = [b for b in branches if any(k == "all-to-all" for k, _, _ in b)]
    # One branch for the compressed step and the sync (the exchange is traced once).
    assert len(onebit) == 1, conds
    for b in onebit:
      assert {k for k, _, _ in b} == {"all-to-all", "all-gather"} and len(b) == 2, b
      assert all(dtype == "u8" and size == N * row_bytes for _, dtype, size in b), (b, row_bytes)
    # The all-reduce and the exchange each in a conditional whose other branch sends
    # nothing: a local step without a sync takes both of those and sends nothing.
    assert len(conds) == 2 and all(len(b) == 2 and [] in b for b in conds.values()), conds
    found[layers] = sorted(str([(k, dtype) for k, dtype, _ in b]) for b in branches)
  assert len(set(map(tuple, found.values()))) == 1, found


# ----------------------------------------------------------------------------
# Adam, long runs, skipped steps, pmap.


def _adamw_reference(steps):
  """optax.adamw on the mean gradient of the 8 quadratics, step by step (float32, one device)."""
  params, c_np, t_np = _problem()
  tx = optax.adamw(LR, B1, B2, EPS, weight_decay=WD, mask=lambda p: {k: k in DECAYED for k in p})
  ref = {k: jnp.asarray(v) for k, v in params.items()}
  ref_state = tx.init(ref)

  @jax.jit
  def step(ref, ref_state):
    grads = {k: jnp.mean(jnp.asarray(c_np[k]) * (ref[k][None] - jnp.asarray(t_np[k])), axis=0)
             for k in NAMES}
    updates, ref_state = tx.update(grads, ref_state, ref)
    return optax.apply_updates(ref, updates), ref_state

  for _ in range(steps):
    ref, ref_state = step(ref, ref_state)
    yield ref


def _assert_adamw(params, ref, at):
  for k in NAMES:
    np.testing.assert_allclose(np.asarray(params[k]), np.asarray(ref[k]), rtol=2e-6, atol=1e-6,  # params are O(1)
                               err_msg=f"{k} {at}")


def test_variance_steps_are_optax_adamw_on_8_devices():
  """Steps 1-4 of the run are all variance steps (interval 1, then 2): AdamW on the mean gradient."""
  step, params, state, c, t = _start(None)
  for n, ref in enumerate(_adamw_reference(4)):
    params, state, _ = step(params, state, c, t)
    assert onebit_optax.status(state).phase == "variance"
    _assert_adamw(params, ref, f"after step {n + 1}")


def test_all_variance_steps_is_optax_adamw():
  """An interval that never doubles and no freeze (one device, the mean gradient): AdamW for 30 steps."""
  tx = onebit_optax.zero_one_adam(LR, B1, B2, EPS, WD, axis_name=None, var_freeze_step=10**6,
                                  var_update_scaler=10**6,
                                  mask=lambda p: {k: k in DECAYED for k in p})
  params, c_np, t_np = _problem()
  c_mean = jax.tree.map(lambda x: jnp.asarray(x), c_np)
  t_dev = jax.tree.map(lambda x: jnp.asarray(x), t_np)

  @jax.jit
  def step(params, state):
    grads = {k: jnp.mean(c_mean[k] * (params[k][None] - t_dev[k]), axis=0) for k in NAMES}
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = {k: jnp.asarray(v) for k, v in params.items()}
  state = tx.init(params)
  for n, ref in enumerate(_adamw_reference(30)):
    params, state = step(params, state)
    assert onebit_optax.status(state).phase == "variance"
    _assert_adamw(params, ref, f"after step {n + 1}")


@pytest.mark.parametrize("H", [None, 4])
def test_replicas_bitwise_identical_over_120_steps(H):
  """Parameters identical on every device after every step; with H, every sync restarts the replicas alike."""
  step, params, state, c, t = _start(H)
  syncs = drifted = 0
  for _ in range(120):
    params, state, copies = step(params, state, c, t)
    _replicas(copies)
    s = _inner(state)
    if H is not None and onebit_optax.status(state).phase == "sync":
      syncs += 1
      for k in NAMES:
        assert not np.any(np.asarray(s.accumulator[k])), k  # every copy is the synced point
        mu = np.asarray(s.local_mu[k])
        assert all(np.array_equal(mu[0], mu[d]) for d in range(N)), k
    elif H is not None and onebit_optax.status(state).phase == "local":
      acc = np.asarray(s.accumulator["w"])
      drifted += not all(np.array_equal(acc[0], acc[d]) for d in range(N))
  assert all(np.all(np.isfinite(np.asarray(v))) for v in params.values())
  if H is not None:
    assert syncs >= 25 and drifted >= 50, (syncs, drifted)  # the replicas did drift in between


def test_nonfinite_steps_are_skipped_on_every_device():
  """A NaN on one device: a variance step is skipped without a trace; a compressed step or a sync
  keeps the parameters, the moments and the counters and drops the error feedback (as 1-bit Adam)."""
  step, params, state, c, t = _start(None)
  _, _, t_np = _problem()
  bad = {k: v.copy() for k, v in t_np.items()}
  bad["w"][3, 0, 0] = np.nan
  t_bad = jax.device_put(bad, NamedSharding(_mesh(), P("data")))
  clean_params, clean_state = params, state
  equal = lambda a, b: all(jax.tree.leaves(jax.tree.map(
      lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), a, b)))
  kept = lambda s: _inner(s)._replace(local_sent=None, worker_scale=None, skipped_steps=None,
                                     wire_bytes=None)  # (the skipped step did send)
  for n in range(18):
    if n == 6:  # the variance step skipped at n = 1 left no trace
      assert equal((params, _inner(state)._replace(skipped_steps=0)),
                   (clean_params, _inner(clean_state)))
    if n in (1, 6, 16):  # steps 2 (variance), 7 (compressed), 17 (sync) of the clean run
      before = (params, state)
      params, state, _ = step(params, state, c, t_bad)
      assert equal((params, kept(state)), (before[0], kept(before[1]))), n
      s = _inner(state)
      if n > 1:  # the feedback is dropped: zero sent, zero scales
        assert not any(np.any(np.asarray(u)) for u in s.local_sent), n
        assert not np.any(np.asarray(s.worker_scale)), n
    params, state, _ = step(params, state, c, t)
    clean_params, clean_state, _ = step(clean_params, clean_state, c, t)
  assert int(_fields.field(state, "skipped_steps")) == 3
  assert int(_fields.field(clean_state, "skipped_steps")) == 0
  assert onebit_optax.status(state).phase == onebit_optax.status(clean_state).phase == "sync"
  # The run goes on, finite (the feedback it dropped makes it differ from the clean one).
  assert all(np.all(np.isfinite(np.asarray(v))) for v in params.values())
  assert not equal(params, before[0])


def test_nonfinite_local_step_drops_the_interval():
  """Local steps cannot agree on a NaN; the next sync drops the interval on every device together."""
  step, params, state, c, t = _start(4)
  _, _, t_np = _problem()
  bad = {k: v.copy() for k, v in t_np.items()}
  bad["a"][5, 50] = np.nan
  t_bad = jax.device_put(bad, NamedSharding(_mesh(), P("data")))
  for _ in range(22):  # steps 19, 21: local; 20, 22: syncs
    params, state, _ = step(params, state, c, t)
  assert onebit_optax.status(state).phase == "sync"
  before = jax.tree.map(np.asarray, params)
  params, state, _ = step(params, state, c, t_bad)  # step 23: local
  params, state, copies = step(params, state, c, t)  # 24: local
  params, state, copies = step(params, state, c, t)  # 25: local
  params, state, copies = step(params, state, c, t)  # 26: the sync
  s = _inner(state)
  assert onebit_optax.status(state).phase == "sync" and int(s.skipped_steps) == 1
  assert all(np.array_equal(before[k], np.asarray(params[k])) for k in NAMES)
  assert all(not np.any(np.asarray(s.accumulator[k])) for k in NAMES)
  _replicas(copies)
  for _ in range(8):  # and the run goes on, finite
    params, state, copies = step(params, state, c, t)
  assert all(np.all(np.isfinite(np.asarray(v))) for v in params.values())
  assert not np.array_equal(before["w"], np.asarray(params["w"]))


def test_pmap_matches_shard_map():
  """The same local-steps run under jax.pmap (state and parameters per device, gradients local)."""
  tx = _tx(4)
  params0, c_np, t_np = _problem()
  devices = jax.devices()[:N]
  params = jax.tree.map(lambda x: np.stack([x] * N), params0)
  state = jax.pmap(tx.init, axis_name="data", devices=devices)(params)

  @functools.partial(jax.pmap, axis_name="data", devices=devices)
  def step(params, opt_state, c, t):
    local = onebit_optax.local_params(params, "data", opt_state)
    grads = jax.grad(_loss)(local, c, t)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  ref_step, ref_params, ref_state, c, t = _start(4)
  for _ in range(22):  # through variance, compressed, local steps and syncs (22: a sync)
    params, state = jax.block_until_ready(step(params, state, c_np, t_np))
    ref_params, ref_state, _ = ref_step(ref_params, ref_state, c, t)
  assert onebit_optax.status(state).phase == "sync"
  for k in NAMES:
    p = np.asarray(params[k])
    assert all(np.array_equal(p[0], p[d]) for d in range(N)), k
    np.testing.assert_allclose(p[0], np.asarray(ref_params[k]), rtol=0, atol=1e-6, err_msg=k)


# ----------------------------------------------------------------------------
# Refused configurations (traced only: nothing compiles).


@pytest.mark.parametrize("kwargs, match", [
    (dict(var_freeze_step=0), "var_freeze_step"),
    (dict(var_freeze_step=10, var_update_scaler=0), "var_update_scaler"),
    (dict(var_freeze_step=10, local_steps=0, learning_rate=0.1), "local_steps"),
    (dict(var_freeze_step=10, local_steps=4), "learning_rate"),
    (dict(var_freeze_step=10, learning_rate=0.1), "only with local"),
    (dict(var_freeze_step=10, weight_decay=-1.0), "weight_decay"),
    (dict(var_freeze_step=10, variance_ema="per_time"), "variance_ema"),
])
def test_refuses_values_that_cannot_work(kwargs, match):
  with pytest.raises(ValueError, match=match):
    onebit_optax.scale_by_zero_one_adam(axis_name="data", **kwargs)


def _trace_step(tx, *, state_specs=None, use_local=True, pass_local_as_params=False):
  mesh = _mesh()
  params, c, t = _problem()
  state = jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=(P(),), out_specs=P(),
                                       check_vma=False), params)
  specs = onebit_optax.state_partition_specs(state, "data")
  in_specs = specs if state_specs is None else jax.tree.map(lambda _: state_specs, specs)

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), in_specs, P("data"), P("data")),
                     out_specs=P())
  def step(params, opt_state, c, t):
    local = (onebit_optax.local_params(params, "data", opt_state) if use_local
             else params)
    grads = jax.grad(_loss)(local, jax.tree.map(lambda x: x[0], c), jax.tree.map(lambda x: x[0], t))
    updates, _ = tx.update(grads, opt_state, local if pass_local_as_params else params)
    return jax.tree.map(jnp.sum, updates)

  return jax.eval_shape(step, _placed(mesh, params, P()),
                        _abstract_state(mesh, state, specs, in_specs),
                        _placed(mesh, c, P("data")), _placed(mesh, t, P("data")))


def test_refuses_replicated_gradients_and_whole_per_device_buffers():
  tx = _tx(None)
  with pytest.raises(ValueError, match="replicated over 'data'"):
    _trace_step(tx, use_local=False)  # jax.grad all-reduced them in the backward pass
  with pytest.raises(ValueError, match="arrive whole"):
    _trace_step(tx, state_specs=P())  # every device would get the same error buffers


def test_local_steps_refuse_per_device_params():
  """With local steps the parameters given to update must be the replicated point of the sync."""
  with pytest.raises(ValueError, match="replicated parameters"):
    _trace_step(_tx(4), pass_local_as_params=True)


def test_refuses_hierarchical_axes():
  mesh = jax.make_mesh((2, 4), ("node", "local"))
  tx = onebit_optax.zero_one_adam(LR, axis_name=("node", "local"), var_freeze_step=10)
  with pytest.raises(ValueError, match="hierarchical"):
    jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=(P(),), out_specs=P(),
                                 check_vma=False), _problem()[0])


# ----------------------------------------------------------------------------
# Checkpoints (orbax directly): every buffer is saved, so a resumed run is the same run.


def test_checkpoint_resumes_bitwise_in_every_phase(tmp_path):
  """Saved after a variance, a compressed, a sync and a local step; resumed; equal to the unbroken run.

  Unlike DeepSpeed (which drops the error buffers and the local-step state on
  load), the per-device error feedback, accumulators and momenta are saved, one
  row per device, with the schedule's counters.
  """
  ocp = pytest.importorskip("orbax.checkpoint")
  mesh = _mesh()
  step, params, state, c, t = _start(4)
  saved, end = {}, 30
  for n in range(1, end + 1):
    params, state, _ = step(params, state, c, t)
    if n in (4, 5, 22, 23):  # variance, compressed, sync, local
      assert onebit_optax.status(state).phase[0] == "vcsl"[(4, 5, 22, 23).index(n)]
      path = tmp_path / f"step{n}"
      with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, {"params": params, "opt_state": state})
      saved[n] = path
  specs = onebit_optax.state_partition_specs(state, "data")
  target = {"params": jax.tree.map(lambda x: jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=NamedSharding(mesh, P())), params),
            "opt_state": jax.tree.map(lambda x, sp: jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=NamedSharding(mesh, sp)), state, specs)}
  for n, path in saved.items():
    with ocp.StandardCheckpointer() as ckptr:
      restored = ckptr.restore(path, target)
    p, s = restored["params"], restored["opt_state"]
    assert type(_inner(s)) is onebit_optax.ScaleByZeroOneAdamState
    for _ in range(end - n):
      p, s, _ = step(p, s, c, t)
    same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)),
                        (p, s), (params, state))
    assert all(jax.tree.leaves(same)), (n, same)
  # The check can fail: DeepSpeed's load (error buffers and local-step state dropped) differs.
  with ocp.StandardCheckpointer() as ckptr:
    restored = ckptr.restore(saved[23], target)
  p, s = restored["params"], restored["opt_state"]
  inner = _inner(s)
  s = (inner._replace(local_sent=jax.tree.map(jnp.zeros_like, inner.local_sent),
                      server_error=jnp.zeros_like(inner.server_error),
                      accumulator=jax.tree.map(jnp.zeros_like, inner.accumulator)),) + tuple(s[1:])
  for _ in range(end - 23):
    p, s, _ = step(p, s, c, t)
  assert not np.array_equal(np.asarray(p["w"]), np.asarray(params["w"]))


@pytest.mark.parametrize("H", [None, 2])
def test_weight_decay_known_to_be_0_follows_the_traced_path(H):
  """A weight decay of 0 known while tracing drops the decay term (no leaf reads the
  parameters for it); one injected (traced) keeps it, times 0. The two agree step by step (to
  float32 rounding), through local steps and intervals whose learning rates are 0 (a sync
  after them keeps the old m)."""
  lr = lambda count: jnp.where((count >= 6) & (count < 12), 0.0, 0.05)
  kw = dict(axis_name=None, var_freeze_step=3, local_steps=H, local_step_scaler=1)
  injected = optax.inject_hyperparams(
      onebit_optax.zero_one_adam,
      static_args=("axis_name", "var_freeze_step", "local_steps", "local_step_scaler"))

  def run(tx):
    @jax.jit
    def step(params, state, k):
      updates, state = tx.update(jax.tree.map(lambda x: jnp.sin(3.0 * x + k), params), state, params)
      return optax.apply_updates(params, updates), state

    params = {"w": jnp.linspace(-1.0, 1.0, 300).reshape(30, 10), "b": jnp.ones(5)}
    state, out = tx.init(params), []
    for k in range(16):
      params, state = step(params, state, k)
      out.append((params, onebit_optax.moments(state, params)[0]))
    return out

  known = run(onebit_optax.zero_one_adam(lr if H else 0.05, **kw))
  traced = run(injected(learning_rate=lr if H else 0.05, weight_decay=0.0, **kw))
  for n, (a, b) in enumerate(zip(known, traced)):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0,
                                 atol=2e-6 * float(np.max(np.abs(np.asarray(y)))), err_msg=n + 1)


@pytest.mark.parametrize("H", [None, 2])
def test_bfloat16_params_under_inject_hyperparams(H):
  """bfloat16 parameters and gradients, an injected learning rate (float32 hyperparameters):
  updates in the gradients' dtype from the transformation, float32 moments, a run that converges."""
  tx = optax.inject_hyperparams(
      onebit_optax.zero_one_adam, hyperparam_dtype=jnp.float32,
      static_args=("local_steps", "var_freeze_step", "var_update_scaler", "local_step_scaler"))(
          learning_rate=0.05, axis_name=None, var_freeze_step=5, local_steps=H, weight_decay=0.01)
  params = {"w": jnp.ones(300, jnp.bfloat16), "b": jnp.zeros(3, jnp.bfloat16)}
  loss = lambda p: (jnp.sum((p["w"].astype(jnp.float32) - 0.3) ** 2)
                    + jnp.sum(p["b"].astype(jnp.float32) ** 2))

  @jax.jit
  def step(params, state):
    grads = jax.grad(loss)(onebit_optax.local_params(params, None, state))
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  for _ in range(40):
    params, state = step(params, state)
  inner = [s for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(
      s, onebit_optax.ScaleByZeroOneAdamState)) if isinstance(s, onebit_optax.ScaleByZeroOneAdamState)][0]
  assert onebit_optax.status(state).phase in (("sync",) if H is None else ("sync", "local"))
  assert params["w"].dtype == jnp.bfloat16 and inner.mu["w"].dtype == jnp.float32
  assert float(loss(params)) < 0.05 * float(loss({"w": jnp.ones(300), "b": jnp.zeros(3)}))


@pytest.mark.parametrize("H,steps,phase", [(None, 22, "sync"), (4, 22, "sync"),
                                            (None, 11, "compressed")])
def test_move_state_to_another_device_count(H, steps, phase, tmp_path):
  """8 -> 4 devices through a checkpoint: moments and schedule carried, error feedback re-laid out (zeros); between syncs refused."""
  step, params, state, c, t = _start(H)
  for _ in range(steps):  # step 22: a sync (with H = 4: syncs at 20, 22, 26); 11: compressed
    params, state, _ = step(params, state, c, t)
  assert onebit_optax.status(state).phase == phase
  # (m lives in the message after a compressed step, a sync without local steps being one)
  assert bool(_inner(state).mu_in_message) == (phase == "compressed" or H is None)
  tx = _tx(H)
  mesh4 = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  host_params = jax.tree.map(np.asarray, params)
  onebit_optax.save_checkpoint(tmp_path, 22, params, state, tx=tx)
  _, moved, _ = onebit_optax.restore_checkpoint(tmp_path, tx, host_params, mesh4)
  old, new = _inner(state), _inner(moved)
  old_mu, new_mu = (onebit_optax.moments(x, host_params)[0] for x in (state, moved))
  assert all(np.array_equal(np.asarray(a), np.asarray(b))  # (decoded exactly where m was the message)
             for a, b in zip(jax.tree.leaves(old_mu), jax.tree.leaves(new_mu)))
  assert not bool(new.mu_in_message)
  for name in ("count", "nu", "nu_l1", "variance_updates", "var_interval", "var_counter",
               "variance_step", "local_interval", "local_counter", "since_sync", "phase"):
    same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)),
                        getattr(old, name), getattr(new, name))
    assert all(jax.tree.leaves(same)), name
  assert [np.shape(u) for u in new.local_sent] == [(4, 1, 100), (4, 1, 60, 20)]
  assert not any(np.any(np.asarray(u)) for u in new.local_sent)
  chunk4 = _flat.Bits([100, 1200], 4).chunk
  assert np.shape(new.server_error) == (4, chunk4) and not np.any(np.asarray(new.server_error))
  if H is not None:
    np.testing.assert_array_equal(np.asarray(new.local_mu["w"])[3], np.asarray(old_mu["w"]))
  # The moved state is one the 4-device update accepts (traced, not compiled).
  specs = onebit_optax.state_partition_specs(moved, "data")

  @functools.partial(jax.shard_map, mesh=mesh4, in_specs=(P(), specs, P("data"), P("data")),
                     out_specs=P())
  def update(params, opt_state, c, t):
    local = onebit_optax.local_params(params, "data", opt_state)
    grads = jax.grad(_loss)(local, jax.tree.map(lambda x: x[0], c), jax.tree.map(lambda x: x[0], t))
    return jax.tree.map(jnp.sum, tx.update(grads, opt_state, params)[0])

  _, c_np, t_np = _problem()
  half = lambda tree: _placed(mesh4, jax.tree.map(lambda x: x[:4], tree), P("data"))
  jax.eval_shape(update, _placed(mesh4, host_params, P()), moved, half(c_np), half(t_np))
  if H is not None:
    params, state, _ = step(params, state, c, t)  # step 23: local, between syncs
    onebit_optax.save_checkpoint(tmp_path, 23, params, state, tx=tx)
    with pytest.raises(ValueError, match="between two syncs"):
      onebit_optax.restore_checkpoint(tmp_path, tx, host_params, mesh4)
