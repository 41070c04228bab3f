"""A NaN or Inf on ONE device: all 8 devices skip the step together, and the skip is a no-op.

The danger on a data-parallel mesh is not the NaN itself but a *disagreement*:
a predicate computed from one device's local gradient (as in
``optax.apply_if_finite``) sends that device down a ``lax.cond`` branch the
others do not take, and the collectives inside deadlock. 1-bit Adam reads the
predicate off the replicated mean (warmup: the pmean'd gradient; compression:
the compressed mean momentum), which every device's gradient reaches.

Each scenario poisons one element of device 5's gradient at step ``k`` and
compares, bitwise on every device's own copy, with a run that never saw that
batch: the skipped step must change nothing but ``skipped_steps`` (and the
``wire_bytes`` report: the collectives did run), the parameters must not move,
and every later step must be bit-for-bit the run without the bad batch.

In the compression phase a skipped step also drops the worker error feedback,
as documented: ``local_momentum`` already holds what each device compressed in
the skipped step (its ``u``, written before the exchange), so ``feedback_valid``
is cleared and the next step forms no error term. There the run without the
bad batch is compared with its feedback dropped at that step too.

A hang would not raise: it would block in the collective rendezvous. The
module therefore runs under pytest-timeout's *thread* method, which dumps the
stacks and ends the session (the signal method cannot interrupt a thread
waiting inside XLA). The limit is generous because the machine is shared.
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

pytestmark = pytest.mark.timeout(300, method="thread")

N = 8
BAD_DEVICE = 5
FEATURES, OUTPUTS, LOCAL_BATCH = 12, 3, 4
SIZE = FEATURES * OUTPUTS + OUTPUTS
LEAF_SIZES = [OUTPUTS, FEATURES * OUTPUTS]  # b, w: the flattening order
FREEZE_AT = 4  # steps 1..4 warmup (step 4 freezes), 5.. compression
NUM_BATCHES = 10
LR = 0.05
# Collectives are placed by the HLO passes; fast code generation only changes the
# arithmetic kernels, and the comparisons below are between runs of one executable.
FAST_CODEGEN = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _loss(params, x, y):
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((N,), ("data",))


@pytest.fixture(scope="module")
def problem(mesh):
  rng = np.random.default_rng(0)
  params = {"w": (0.3 * rng.standard_normal((FEATURES, OUTPUTS))).astype(np.float32),
            "b": np.zeros((OUTPUTS,), np.float32)}
  w_true = rng.standard_normal((N, FEATURES, OUTPUTS))  # a different optimum per device
  batches = []
  for _ in range(NUM_BATCHES):
    x = rng.standard_normal((N, LOCAL_BATCH, FEATURES)).astype(np.float32)
    y = np.einsum("dbf,dfo->dbo", x, w_true).astype(np.float32)
    batches.append(tuple(jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y)))
  return params, batches


class _Trainer:
  """One compiled shard_map step with a per-device additive 'poison' on g['w'][0, 0]."""

  def __init__(self, mesh, params, **tx_kwargs):
    self.mesh = mesh
    # exact_below=0: both leaves (3 and 36 elements) are compressed, so that the per-device
    # compression state (local_momentum, worker_scale, server_error) is exercised.
    tx_kwargs.setdefault("exact_below", 0)
    self.tx = onebit_optax.onebit_adam(LR, axis_name="data", freeze=FREEZE_AT, **tx_kwargs)
    self.params0 = jax.device_put(params, NamedSharding(mesh, P()))
    self.state0 = onebit_optax.init_sharded(self.tx, self.params0, mesh)
    specs = onebit_optax.state_partition_specs(self.state0, "data")
    tx = self.tx

    @functools.partial(jax.shard_map, mesh=mesh,
                       in_specs=(P(), specs, P("data"), P("data"), P("data")),
                       out_specs=(P(), specs))
    def step(params, opt_state, x, y, poison):
      grads = jax.grad(_loss)(onebit_optax.local_params(params, "data"), x[0], y[0])
      # Adding 0.0 elsewhere keeps the clean runs identical to an unpoisoned step
      # (up to the sign of an exact zero, which both runs share).
      grads = {**grads, "w": grads["w"].at[0, 0].add(poison[0])}
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    self.clean = jax.device_put(np.zeros(N, np.float32), NamedSharding(mesh, P("data")))
    self._step_fn = jax.jit(step)
    self._compiled = None

  def poison(self, value):
    p = np.zeros(N, np.float32)
    p[BAD_DEVICE] = value
    return jax.device_put(p, NamedSharding(self.mesh, P("data")))

  def step(self, params, state, batch, poison=None):
    poison = self.clean if poison is None else poison
    if self._compiled is None:
      self._compiled = self._step_fn.lower(params, state, *batch, poison).compile(FAST_CODEGEN)
    return self._compiled(params, state, *batch, poison)

  def run(self, batches, bad_at=None, bad_value=None, drop_feedback_at=None):
    """Snapshots (host copies of every device's buffers) after each step.

    ``drop_feedback_at``: before that step, clear ``feedback_valid`` (what a skipped
    compression step leaves behind).
    """
    params, state, history = self.params0, self.state0, []
    for i, batch in enumerate(batches):
      poison = self.poison(bad_value) if i == bad_at else None
      if i == drop_feedback_at:
        cleared = jax.device_put(np.False_, NamedSharding(self.mesh, P()))
        state = (state[0]._replace(feedback_valid=cleared),) + tuple(state[1:])
      params, state = self.step(params, state, batch, poison)
      history.append((_snapshot(params), _snapshot(state[0])))
    return history


def _snapshot(tree):
  """Every leaf as the list of each device's own copy (np.asarray shows only device 0's)."""
  return jax.tree.map(lambda a: [np.asarray(s.data) for s in a.addressable_shards], tree)


def _bitwise_equal(a, b):
  """Equal bit patterns (so NaN == NaN, and -0.0 != 0.0)."""
  a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
  return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _assert_same(snap_a, snap_b, what, ignore=()):
  for field in snap_a._fields if hasattr(snap_a, "_fields") else [None]:
    if field in ignore:
      continue
    a = getattr(snap_a, field) if field else snap_a
    b = getattr(snap_b, field) if field else snap_b
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b), (what, field)
    for i, (x, y) in enumerate(zip(leaves_a, leaves_b)):
      assert _bitwise_equal(x, y), f"{what}: field {field} leaf {i} differs"


def _moments(snap, params, device):
  """(mu, nu) as trees, from one device's copy of a state snapshot."""
  state = jax.tree.map(lambda copies: copies[device], snap, is_leaf=lambda x: isinstance(x, list))
  return jax.tree.map(np.asarray, onebit_optax.moments(state, params))


def _assert_replicas_agree(snap, what):
  """A replicated value must be bitwise the same on all 8 devices."""
  for field in ("count", "mu", "nu", "nu_l1", "feedback_valid", "momentum_message", "frozen",
                "freeze_step", "variance_ratio", "reference_l1", "wire_bytes", "skipped_steps"):
    for leaf in jax.tree.leaves(getattr(snap, field), is_leaf=lambda x: isinstance(x, list)):
      assert len(leaf) == N
      assert all(_bitwise_equal(c, leaf[0]) for c in leaf), f"{what}: {field} differs by device"


@pytest.fixture(scope="module")
def trainer(mesh, problem):
  return _Trainer(mesh, problem[0])


SCENARIOS = [
    ("warmup", 1, np.nan), ("warmup", 1, np.inf),
    ("freeze_step", FREEZE_AT - 1, np.nan),  # the step that would freeze
    ("compression", 6, np.nan), ("compression", 6, np.inf), ("compression", 6, -np.inf),
]


@pytest.mark.parametrize("phase, bad_at, value", SCENARIOS,
                         ids=[f"{p}-{v}" for p, _, v in SCENARIOS])
def test_one_bad_device_skips_everywhere_and_the_skip_is_a_no_op(
    problem, trainer, phase, bad_at, value):
  params0, batches = problem
  compression = phase == "compression"
  bad = trainer.run(batches, bad_at=bad_at, bad_value=value)
  # The run that never saw batch `bad_at` (in compression, with the feedback dropped there).
  skipped = batches[:bad_at] + batches[bad_at + 1:]
  without = trainer.run(skipped, drop_feedback_at=bad_at if compression else None)

  step = bad_at + 1  # 1-based number of the poisoned call
  params_before, state_before = bad[bad_at - 1] if bad_at else (
      _snapshot(trainer.params0), _snapshot(trainer.state0[0]))
  params_after, state_after = bad[bad_at]
  assert bool(state_before.frozen[0]) == compression, phase

  # Every device skipped (no hang, and the count agrees everywhere).
  _assert_replicas_agree(state_after, f"after the bad step {step}")
  assert all(int(c) == 1 for c in state_after.skipped_steps)
  # Nothing moved: parameters and every state field, bitwise on every device,
  # except the two counters that report the step, and (compression) the feedback.
  _assert_same(params_after, params_before, "params across the skipped step")
  feedback = ("local_momentum", "feedback_valid") if compression else ()
  _assert_same(state_after, state_before, "state across the skipped step",
               ignore=("skipped_steps", "wire_bytes") + feedback)
  expected_bytes = (_flat.onebit_compressed_bytes(LEAF_SIZES, N, exact_below=0) if compression
                    else _flat.onebit_warmup_bytes(LEAF_SIZES, N))
  assert all(float(b) == expected_bytes for b in state_after.wire_bytes)  # it did communicate
  if compression:
    _check_dropped_feedback(params0, params_before, batches[bad_at], state_before, state_after)
    # Dropping the feedback is not a no-op: the run that keeps it differs after the step.
    kept = trainer.run(skipped)
    assert not all(_bitwise_equal(a, b) for a, b in zip(
        jax.tree.leaves(kept[bad_at][1].local_momentum),
        jax.tree.leaves(without[bad_at][1].local_momentum)))

  # Before: identical to the run without the bad batch. After: shifted by one
  # call, bit for bit, in every field but skipped_steps.
  for i in range(bad_at):
    _assert_same(bad[i][0], without[i][0], f"params at step {i + 1}")
    _assert_same(bad[i][1], without[i][1], f"state at step {i + 1}")
  for i in range(bad_at + 1, len(bad)):
    _assert_same(bad[i][0], without[i - 1][0], f"params at call {i + 1}")
    _assert_same(bad[i][1], without[i - 1][1], f"state at call {i + 1}", ignore=("skipped_steps",))
    assert all(int(c) == 1 for c in bad[i][1].skipped_steps)
  final = bad[-1][1]
  assert all(bool(f) for f in final.frozen) and all(bool(f) for f in final.feedback_valid)
  assert all(int(f) == FREEZE_AT for f in final.freeze_step)  # the skip did not shift the freeze
  assert int(final.count[0]) == NUM_BATCHES - 1
  # The comparison is not vacuous: training moved the parameters and the
  # compression phase ran (what the devices compressed differs).
  assert not _bitwise_equal(bad[-1][0]["w"][0], np.asarray(problem[0]["w"]))
  assert not _bitwise_equal(final.local_momentum[1][0], final.local_momentum[1][1])


def _check_dropped_feedback(params0, params, batch, before, after, b1=0.9):
  """A skipped compression step: feedback_valid cleared, local_momentum = the skipped u.

  On every device u = b1 m + (1 - b1) g + e, with m the mean momentum the message
  held, g the device's gradient (poisoned on device BAD_DEVICE) and
  e = u' - s' sign(u') (sign(0) = +1) the error of what it compressed the step before.
  """
  assert all(bool(f) for f in before.feedback_valid)
  assert not any(bool(f) for f in after.feedback_valid)
  x, y = (np.asarray(a) for a in batch)
  for device in range(N):
    m = jax.tree.map(np.array, _moments(before, params0, device)[0])  # writable copies
    p = {k: jnp.asarray(v[device]) for k, v in params.items()}  # the params the step saw
    g = jax.tree.map(np.asarray, jax.grad(_loss)(p, x[device], y[device]))
    for k, name in enumerate(("b", "w")):  # the compressed leaves, in flattening order
      u_prev = np.asarray(before.local_momentum[k][device][0, 0], np.float32)
      s_prev = np.asarray(before.worker_scale[device])[0, k]
      e = u_prev - np.where(u_prev >= 0, s_prev, -s_prev)
      u = np.asarray(after.local_momentum[k][device][0, 0], np.float32)
      if name == "w" and device == BAD_DEVICE:
        assert not np.isfinite(u[0, 0])  # the poisoned element, kept as it was sent
        u, g = u.copy(), dict(g, w=np.array(g["w"]))
        u[0, 0] = g["w"][0, 0] = 0.0
        e[0, 0] = m["w"][0, 0] = 0.0
      else:
        assert np.all(np.isfinite(u)), (device, name)
      np.testing.assert_allclose(u, b1 * m[name] + (1 - b1) * g[name] + e,
                                 rtol=1e-5, atol=1e-6, err_msg=f"u of {name} on {device}")


def test_skip_nonfinite_false_propagates_nan(mesh, problem):
  # Documented: with skip_nonfinite=False a NaN enters the moments, as in optax.adam.
  # Warmup is elementwise after the pmean, so only the poisoned coordinate turns
  # NaN; in the compression phase the poisoned device's scale of 'w' is NaN and
  # reaches the server of w's chunk, so all of w's momentum and parameters turn
  # NaN on every device, while 'b' (a leaf of its own, with its own scales) does not.
  params0, batches = problem
  trainer = _Trainer(mesh, params0, skip_nonfinite=False)
  warm = trainer.run(batches[:3], bad_at=1, bad_value=np.nan)
  params, state = warm[1]
  assert int(state.skipped_steps[0]) == 0 and int(state.count[0]) == 2
  for copy in params["w"]:
    nan = np.isnan(copy)
    assert nan[0, 0] and nan.sum() == 1, nan.sum()
  mu, nu = _moments(state, params0, 0)
  assert np.isnan(mu["w"][0, 0]) and np.isnan(nu["w"][0, 0])
  assert np.isnan(mu["w"]).sum() == 1 and np.all(np.isfinite(mu["b"]))
  assert np.all(np.isfinite(params["b"][0]))

  comp = trainer.run(batches[:8], bad_at=6, bad_value=np.nan)
  params, state = comp[6]
  assert int(state.skipped_steps[0]) == 0
  assert all(np.all(np.isnan(copy)) for copy in params["w"])
  assert all(np.all(np.isfinite(copy)) for copy in params["b"])
  for device in range(N):
    mu, _ = _moments(state, params0, device)
    assert np.all(np.isnan(mu["w"])) and np.all(np.isfinite(mu["b"])), device
  assert np.all(np.isfinite(comp[5][0]["w"][0]))  # the step before was fine


@pytest.mark.parametrize("exact_below", [None, 0], ids=["exact", "compressed"])
def test_axis_name_none_skips_too(exact_below):
  # The single-device path takes the same predicate (no collective involved).
  tx = onebit_optax.onebit_adam(LR, axis_name=None, freeze=2, exact_below=exact_below)
  params = {"w": jnp.ones(5)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  grads = {"w": jnp.arange(5.0)}
  for _ in range(3):
    _, state = update(grads, state, params)
  assert bool(_fields.field(state, "frozen"))
  before = state
  updates, state = update({"w": jnp.array([1.0, np.inf, 0.0, 0.0, 0.0])}, state, params)
  assert np.all(np.asarray(updates["w"]) == 0)
  assert int(_fields.field(state, "skipped_steps")) == 1
  # Everything is kept but the feedback: it is dropped (local_momentum holds the skipped u).
  keep = lambda s: s._replace(skipped_steps=0, wire_bytes=0, local_momentum=(),
                              feedback_valid=True)
  for a, b in zip(jax.tree.leaves(keep(before[0])), jax.tree.leaves(keep(state[0]))):
    assert _bitwise_equal(np.asarray(a), np.asarray(b))
  assert bool(before[0].feedback_valid) and not bool(state[0].feedback_valid)
  if exact_below == 0:
    (u,) = state[0].local_momentum
    u = u[:, 0]  # the group's one leaf
    assert u.shape == (1, 5) and not np.isfinite(u[0, 1]) and np.all(np.isfinite(u[0, [0, 2, 3, 4]]))
  else:
    assert state[0].local_momentum == ()  # 5 elements travel as float32: nothing compressed
  # The next finite step runs (no feedback), and the feedback is valid again after it.
  updates, state = update(grads, state, params)
  assert int(_fields.field(state, "skipped_steps")) == 1 and int(state[0].count) == 4
  assert bool(state[0].feedback_valid) and np.all(np.isfinite(np.asarray(updates["w"])))
