"""onebit_optax.status (why a run is or is not compressing) and the replica-identity checks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import onebit_optax
import _fields

N = 8
status = onebit_optax.status


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((N,), ("data",))


def _params():
  return {"w": jnp.linspace(-1.0, 1.0, 37).reshape(37, 1), "b": jnp.zeros(5)}


def _state(freeze=None, **fields):
  """A single-device state with hand-set scalar fields (no optimizer arithmetic involved)."""
  state = onebit_optax.scale_by_onebit_adam(axis_name=None, freeze=freeze).init(_params())
  return state._replace(**{k: jnp.asarray(v, getattr(state, k).dtype) for k, v in fields.items()})


def _allreduce(d, n):  # ring all-reduce of d float32, bytes sent per device
  return 2 * (n - 1) / n * 4 * d


# --- the warmup reasons -----------------------------------------------------------------------

def test_default_policy_on_a_short_run_says_when_the_first_check_is():
  s = status(_state(count=400))
  assert (s.phase, s.step, s.freeze_step, s.next_check) == ("warmup", 400, None, 2000)
  assert s.steps_to_next_check == 1600
  assert "step 2000" in s.reason and "step 400" in s.reason and "never compresses" in s.reason
  assert "no max_steps" in s.reason
  assert any("assumed" in n for n in s.notes)  # no freeze= given: it says what it assumed
  text = str(s)
  assert "never froze" in text and "step 2000" in text


def test_b2_sets_the_default_interval():
  # b2 = 0.99: interval 1/(1-b2) = 100, first check at 2 x 100.
  s = status(_state(count=30), onebit_optax.variance_ratio_freeze(), b2=0.99)
  assert s.next_check == 200 and "step 200" in s.reason
  assert not any("assumed" in n for n in s.notes)


def test_ratio_outside_the_band_is_the_reason():
  policy = onebit_optax.variance_ratio_freeze(interval=10)
  s = status(_state(count=25, variance_ratio=0.81, reference_l1=1.0), policy)
  assert s.next_check == 30 and s.variance_ratio == pytest.approx(0.81)
  assert "0.810" in s.reason and "[0.960, 1.042]" in s.reason and "19%" in s.reason


def test_ratio_inside_the_band_before_min_steps():
  policy = onebit_optax.variance_ratio_freeze(min_steps=95, interval=10, max_steps=300)
  s = status(_state(count=40, variance_ratio=0.99, reference_l1=1.0), policy)
  assert s.next_check == 100  # first multiple of 10 at or after min_steps
  assert "min_steps=95" in s.reason and "max_steps=300" in s.reason


def test_max_steps_is_the_next_chance_when_it_comes_first():
  policy = onebit_optax.variance_ratio_freeze(interval=100, max_steps=150)
  assert status(_state(count=120, variance_ratio=0.5, reference_l1=1.0), policy).next_check == 150


def test_fixed_step_policy():
  s = status(_state(count=120), onebit_optax.fixed_step_freeze(400))
  assert s.next_check == 400 and "fixed_step_freeze(400)" in s.reason
  assert "280 steps from now" in s.reason and s.policy == "fixed_step_freeze(400)"


def test_a_state_that_contradicts_the_given_policy_is_flagged():
  # Frozen after step 7 cannot come from a check every 10 steps.
  s = status(_state(count=9, frozen=True, freeze_step=7), onebit_optax.variance_ratio_freeze(
      interval=10))
  assert s.phase == "compression" and s.freeze_step == 7 and s.reason == ""
  assert any("does not follow this freeze policy" in n for n in s.notes)
  assert not any("does not follow" in n for n in status(
      _state(count=9, frozen=True, freeze_step=7), 7).notes)


# --- a real run: chains, inject_hyperparams, skipped steps ------------------------------------

def _run(tx, grads_fn, steps, params=None):
  params = _params() if params is None else params
  state = tx.init(params)
  update = jax.jit(tx.update)
  for t in range(steps):
    _, state = update(grads_fn(t), state, params)
  return state


def test_chain_and_inject_hyperparams_read_b2_and_freeze_from_the_state():
  tx = optax.chain(optax.clip(1.0), optax.inject_hyperparams(onebit_optax.onebit_adam)(
      0.1, b2=0.95, axis_name=None, freeze=6))
  state = _run(tx, lambda t: jax.tree.map(jnp.ones_like, _params()), 4)
  s = status(state)
  assert s.policy == "fixed_step_freeze(6)" and s.next_check == 6 and s.step == 4
  assert not any("assumed" in n for n in s.notes)
  tx = optax.inject_hyperparams(onebit_optax.onebit_adam)(0.1, b2=0.95, axis_name=None)
  s = status(_run(tx, lambda t: jax.tree.map(jnp.ones_like, _params()), 4),
             onebit_optax.variance_ratio_freeze())
  assert s.next_check == 40  # 2 / (1 - 0.95), read from the injected b2


def test_skipped_steps_and_a_diverged_run():
  tx = onebit_optax.onebit_adam(0.1, axis_name=None, freeze=2)
  ones = jax.tree.map(jnp.ones_like, _params())
  nans = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), ones)
  params, state = _params(), tx.init(_params())
  for _ in range(3):
    _, state = tx.update(ones, state, params)
  earlier = status(state, 2)
  assert earlier.skipped_steps == 0 and not earlier.notes
  for _ in range(5):
    _, state = tx.update(nans, state, params)
  later = status(state, 2, previous=earlier)
  assert (later.step, later.skipped_steps) == (3, 5)
  assert any("5 of 8 steps were skipped" in n for n in later.notes)
  assert any("every one of the last 5 steps was skipped" in n and "diverged" in n
             for n in later.notes)


def test_flax_nnx_optimizer_state():
  nnx = pytest.importorskip("flax.nnx")
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  tx = optax.inject_hyperparams(onebit_optax.onebit_adam)(0.1, b2=0.99, axis_name=None)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  x = jnp.ones((4, 3))
  for _ in range(3):
    grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)
    optimizer.update(model, grads)
  s = status(optimizer.opt_state, onebit_optax.variance_ratio_freeze())
  assert (s.phase, s.step, s.next_check) == ("warmup", 3, 200)  # b2 = 0.99 from the state


# --- bytes on the wire, under shard_map and pmap ----------------------------------------------

def _shard_map_run(mesh, freeze, steps, axis="data", params=None, nan_steps=()):
  """Trains on 8 devices; returns the state and the bytes each step reported.

  ``nan_steps``: the (0-based) steps whose gradients are NaN on device 0 (skipped).
  """
  params = _params() if params is None else params
  tx = onebit_optax.onebit_adam(0.01, axis_name=axis, freeze=freeze)
  state = onebit_optax.init_sharded(tx, params, mesh, axis)
  specs = onebit_optax.state_partition_specs(state, axis)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P(axis), P()),
                     out_specs=(P(), specs))
  def step(params, state, x, poison):
    def loss(p):
      out = sum(jnp.sum(x[:, :v.shape[0]] @ v.reshape(v.shape[0], -1)) for v in p.values())
      return out ** 2
    grads = jax.grad(loss)(onebit_optax.local_params(params, axis))
    first = jnp.all(jnp.stack([jax.lax.axis_index(a) == 0 for a in
                               ((axis,) if isinstance(axis, str) else axis)]))
    grads = jax.tree.map(lambda g: jnp.where(first & poison, jnp.nan, g), grads)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  width = max(np.shape(v)[0] for v in params.values())
  x = jax.device_put(0.01 * jax.random.normal(jax.random.key(0), (N * 2, width)),
                     jax.sharding.NamedSharding(mesh, P(axis)))
  params = jax.device_put(params, jax.sharding.NamedSharding(mesh, P()))
  per_step = []
  for t in range(steps):
    params, state = step(params, state, x, jnp.bool_(t in nan_steps))
    per_step.append(float(_fields.field(state, "wire_bytes")))
  return state, per_step


def test_bytes_in_warmup_under_shard_map(mesh):
  state, per_step = _shard_map_run(mesh, 10, 4)
  s = status(state, 10, params=_params())
  assert s.phase == "warmup" and s.replicas_agree and s.bytes_exact
  assert s.bytes_sent == pytest.approx(sum(per_step))
  assert s.adam_bytes == pytest.approx(4 * _allreduce(37 + 5, N))
  assert "(estimate)" not in str(s)


def test_bytes_after_the_freeze_under_shard_map(mesh):
  state, per_step = _shard_map_run(mesh, 3, 7)
  s = status(state, 3, params=_params())
  assert (s.phase, s.freeze_step, s.step) == ("compression", 3, 7)
  assert s.bytes_exact and s.replicas_agree
  assert s.bytes_sent == pytest.approx(sum(per_step))
  assert s.adam_bytes == pytest.approx(7 * _allreduce(37 + 5, N))
  # A compression step sends 2 (n - 1) messages of row_bytes = momentum_message.shape[-1].
  row_bytes = state[0].momentum_message.shape[-1]
  assert per_step[3:] == [2 * (N - 1) * row_bytes] * 4
  assert per_step[:3] == [_allreduce(37 + 5, N)] * 3
  # The state holds the parameters' shapes (nu): params= is not needed for exact bytes.
  alone = status(state, 3)
  assert alone.bytes_exact and "(estimate)" not in str(alone)
  assert (alone.bytes_sent, alone.adam_bytes) == (s.bytes_sent, s.adam_bytes)
  # params= that do not belong to the state are pointed out.
  other = status(state, 3, params={"w": jnp.zeros(10)})
  assert any("params= has 10 elements but the state was made for 42" in n for n in other.notes)


def test_bytes_with_compressed_leaves_and_skipped_steps(mesh):
  params = {"w": jnp.linspace(-1.0, 1.0, 300).reshape(100, 3), "b": jnp.zeros(5)}
  state, per_step = _shard_map_run(mesh, 2, 5, params=params)
  s = status(state, 2)
  assert s.bytes_exact and s.bytes_sent == pytest.approx(sum(per_step))
  assert s.adam_bytes == pytest.approx(5 * _allreduce(305, N))
  assert s.bytes_sent < s.adam_bytes  # 300 compressed elements: fewer bytes than Adam
  # Steps skipped after the freeze: their phase is not recorded, so the total is an estimate.
  state, per_step = _shard_map_run(mesh, 2, 6, params=params, nan_steps=(3, 5))
  s = status(state, 2)
  assert (s.step, s.skipped_steps, s.phase) == (4, 2, "compression")
  assert s.bytes_sent == pytest.approx(sum(per_step))  # here they were compression steps
  assert not s.bytes_exact and "(estimate)" in str(s)
  assert any("charged at the 1-bit rate" in n for n in s.notes)


def test_bytes_of_hierarchical_averaging():
  mesh = jax.make_mesh((2, N // 2), ("node", "local"))
  params = {"w": jnp.linspace(-1.0, 1.0, 300).reshape(100, 3), "b": jnp.zeros(5)}
  state, per_step = _shard_map_run(mesh, 2, 4, axis=("node", "local"), params=params)
  s = status(state, 2)
  assert s.phase == "compression" and s.bytes_exact and s.replicas_agree
  assert s.bytes_sent == pytest.approx(sum(per_step))
  # Adam, as the warmup: the slow axis (2 nodes) carries 1/4 of the gradients.
  assert s.adam_bytes == pytest.approx(4 * _allreduce(305 / 4, 2))


def test_pmap_state_and_replicas_that_diverged():
  params = jax.tree.map(lambda x: jnp.stack([x] * N), _params())
  tx = onebit_optax.onebit_adam(0.1, axis_name="data", freeze=2)
  state = jax.pmap(tx.init, axis_name="data")(params)
  s = status(state, 2)
  assert s.step == 0 and s.replicas_agree and s.next_check == 2
  # Bytes of a pmap run: the leading device axis is not a hierarchical fast axis.
  grads = jax.tree.map(lambda x: x + jnp.arange(N, dtype=x.dtype).reshape(
      (N,) + (1,) * (x.ndim - 1)), params)
  update = jax.pmap(tx.update, axis_name="data")
  per_step = []
  for _ in range(4):
    _, state = update(grads, state, params)
    per_step.append(float(_fields.field(state, "wire_bytes")[0]))
  s = status(state, 2)
  assert (s.phase, s.step) == ("compression", 4) and s.replicas_agree and s.bytes_exact
  assert s.bytes_sent == pytest.approx(sum(per_step))
  assert s.adam_bytes == pytest.approx(4 * _allreduce(37 + 5, N))
  # A pmap-shaped state whose devices measured different variance ratios (what
  # devices that each run their own optimizer produce): the summary says so.
  per_device = [_state(count=4, variance_ratio=0.5 + 0.01 * i) for i in range(N)]
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *per_device)
  s = status(stacked, onebit_optax.variance_ratio_freeze(interval=2))
  assert s.step == 4 and s.variance_ratio == pytest.approx(0.5) and not s.replicas_agree
  assert any("axis_name=<the mapped axis>" in n for n in s.notes)


def test_status_wants_exactly_one_onebit_state():
  with pytest.raises(ValueError, match="found 0"):
    status(optax.adam(1e-3).init(_params()))


# --- replica identity ---------------------------------------------------------------------------

def _diverge(mesh, device, check_vma=False):
  """A P()-typed output whose buffer on ``device`` differs (check_vma=False lets it through)."""
  return jax.jit(jax.shard_map(
      lambda x: x + (jax.lax.axis_index("data") == device), mesh=mesh, in_specs=P(),
      out_specs=P(), check_vma=check_vma))


def test_host_check_catches_a_diverged_replica(mesh):
  good = jax.device_put(_params(), jax.sharding.NamedSharding(mesh, P()))
  assert onebit_optax_assert(good) == 2
  bad = dict(good, b=_diverge(mesh, 5)(good["b"]))
  assert float(bad["b"][0]) == 0.0  # reading it shows device 0's copy: looks fine
  with pytest.raises(AssertionError) as excinfo:
    onebit_optax_assert(bad)
  message = str(excinfo.value)
  assert "['b']: devices 5 differ from device 0" in message and "['w']" not in message
  assert "axis_name=<the mapped axis>" in message


def test_host_check_is_bit_exact(mesh):
  # A difference in one low bit of one element, and -0.0 against 0.0, both show.
  x = jax.device_put(jnp.ones(1000), jax.sharding.NamedSharding(mesh, P()))
  tiny = jax.jit(jax.shard_map(
      lambda x: x.at[999].add(jnp.where(jax.lax.axis_index("data") == 2, 1e-7, 0.0)),
      mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))(x)
  assert np.asarray(tiny.addressable_shards[2].data)[999] != 1.0
  with pytest.raises(AssertionError, match="devices 2 differ"):
    onebit_optax_assert({"x": tiny})
  zero = jax.jit(jax.shard_map(
      lambda x: jnp.where(jax.lax.axis_index("data") == 4, -x, x), mesh=mesh,
      in_specs=P(), out_specs=P(), check_vma=False))(jnp.zeros(3))
  with pytest.raises(AssertionError, match="devices 4 differ"):
    onebit_optax_assert(zero)


def test_host_check_of_pmap_outputs_with_stacked_rows():
  rows = jax.pmap(lambda x: x * 2.0)(jnp.ones((N, 3)))
  assert onebit_optax_assert(rows, stacked=True) == 1
  rows = jax.pmap(lambda x: x * 2.0)(jnp.ones((N, 3)).at[6].set(0.5))
  with pytest.raises(AssertionError, match="devices 6 differ"):
    onebit_optax_assert({"p": rows}, stacked=True)
  # Without stacked=True nothing is replicated, so nothing could be compared: an
  # error, not a silent 0 (8 different rows used to pass).
  with pytest.raises(ValueError, match="pass stacked=True"):
    onebit_optax_assert({"p": rows})


def onebit_optax_assert(tree, **kwargs):
  return onebit_optax.assert_replicas_identical(tree, **kwargs)


@pytest.mark.parametrize("check_vma", [False, True])
def test_in_graph_check_under_shard_map(mesh, check_vma):
  def body(x, noise):
    same = onebit_optax.replicas_identical({"x": x}, "data")
    # A value that differs on device 3 only (varying-typed under check_vma).
    differs = onebit_optax.replicas_identical({"x": x, "y": x + noise[0]}, "data")
    return same, differs

  noise = jax.device_put(jnp.zeros((N, 3)).at[3].set(1.0),
                         jax.sharding.NamedSharding(mesh, P("data")))
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")),
                            out_specs=(P(), P()), check_vma=check_vma))
  same, differs = f(jnp.ones(3), noise)
  assert bool(same) and not bool(differs)


def test_in_graph_check_is_one_small_all_reduce(mesh):
  f = jax.jit(jax.shard_map(lambda p: onebit_optax.replicas_identical(p, "data"), mesh=mesh,
                            in_specs=P(), out_specs=P()))
  hlo = f.lower(_params()).compile().as_text()
  reduces = [line for line in hlo.splitlines() if " all-reduce(" in line
             or " all-reduce-start(" in line]
  assert len(reduces) == 1, reduces
  assert "s32[4,2]" in reduces[0]  # 2 leaves x 2 sums, and their complements


def test_in_graph_check_under_pmap():
  f = jax.pmap(lambda x: onebit_optax.replicas_identical(x, "i"), axis_name="i")
  assert bool(jnp.all(f(jnp.ones((N, 4)))))
  assert not bool(jnp.any(f(jnp.ones((N, 4)).at[1, 2].set(3.0))))
