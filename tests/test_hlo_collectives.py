"""What a compiled 1-bit Adam training step sends: read off the HLO, per phase."""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import onebit_optax
import _hlo

N = 8
# A collective this small (per device) is a scalar: a loss pmean, a predicate.
SCALAR_ELEMENTS = 8
# Collectives are placed by the HLO passes; LLVM's code generation for the fused
# kernels does not move them, and at full optimization it doubles the compile time.
FAST_CODEGEN = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((N,), ("data",))


def _linear_model():
  """Two leaves, 65 664 float32 parameters (large enough that the 4-byte scales are noise)."""
  params = {"w": jnp.zeros((512, 128), jnp.float32), "b": jnp.zeros((128,), jnp.float32)}

  def loss_fn(p, x, y):
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

  x = jnp.ones((2 * N, 512), jnp.float32)
  y = jnp.ones((2 * N, 128), jnp.float32)
  return params, loss_fn, x, y


def _deep_model(layers=25, width=16):
  """50 leaves (25 dense layers): the flat buffer must keep the collectives at one each."""
  params = {f"layer{i:02d}": {"w": jnp.full((width, width), 0.1), "b": jnp.zeros((width,))}
            for i in range(layers)}

  def loss_fn(p, x, y):
    h = x
    for i in range(layers):
      h = jnp.tanh(h @ p[f"layer{i:02d}"]["w"] + p[f"layer{i:02d}"]["b"])
    return jnp.mean((h - y) ** 2)

  x = jnp.ones((2 * N, width), jnp.float32)
  y = jnp.zeros((2 * N, width), jnp.float32)
  return params, loss_fn, x, y


def _readme_step(mesh, tx, loss_fn, opt_state, use_local_params=True):
  """The README recipe: shard_map over the data axis, local gradients, one jit."""
  specs = onebit_optax.state_partition_specs(opt_state, "data")

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                     out_specs=(P(), specs, P()))
  def step(params, opt_state, x, y):
    p = onebit_optax.local_params(params, "data") if use_local_params else params
    loss, g = jax.value_and_grad(loss_fn)(p, x, y)
    updates, opt_state = tx.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

  return step


def _compiled_hlo(mesh, model):
  params, loss_fn, x, y = model
  tx = onebit_optax.onebit_adam(1e-2, axis_name="data",
                                freeze=onebit_optax.fixed_step_freeze(10))
  params = jax.device_put(params, NamedSharding(mesh, P()))
  opt_state = onebit_optax.init_sharded(tx, params, mesh)
  x = jax.device_put(x, NamedSharding(mesh, P("data")))
  y = jax.device_put(y, NamedSharding(mesh, P("data")))
  step = _readme_step(mesh, tx, loss_fn, opt_state)
  text = step.lower(params, opt_state, x, y).compile(FAST_CODEGEN).as_text()
  return _hlo.HloModule(text)


def _num_params(params):
  return sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))


def _large(collectives):
  return [c for c in collectives if c.size > SCALAR_ELEMENTS]


@pytest.fixture(scope="module")
def linear_phases(mesh):
  return _hlo.split_by_phase(_compiled_hlo(mesh, _linear_model()))


@pytest.fixture(scope="module")
def deep_phases(mesh):
  return _hlo.split_by_phase(_compiled_hlo(mesh, _deep_model()))


def test_forward_backward_only_communicates_scalars(linear_phases):
  # Without local_params the backward pass would all-reduce the gradients here.
  assert not _large(linear_phases.outside), [str(c) for c in _large(linear_phases.outside)]
  # The loss pmean is there, and it is all there is besides scalars.
  assert any(c.collective == "all-reduce" for c in linear_phases.outside)


def test_compression_branch_sends_only_packed_bytes(linear_phases):
  compression = linear_phases.compression
  kinds = collections.Counter(c.collective for c in _large(compression))
  assert kinds == {"all-to-all": 1, "all-gather": 1}, [str(c) for c in compression]
  for c in _large(compression):
    assert c.dtypes == {"u8"}, str(c)
    assert c.group_size == N, c.line
  # Anything else in the branch (e.g. a finiteness predicate) is a scalar.
  for c in compression:
    assert c.dtypes == {"u8"} or c.size <= SCALAR_ELEMENTS, str(c)


def test_compression_wire_bytes_at_most_a_thirtieth_of_fp32_allreduce(linear_phases):
  params, *_ = _linear_model()
  d = _num_params(params)
  allreduce = onebit_optax.allreduce_wire_bytes(d, N)
  assert allreduce == 2 * (N - 1) / N * d * 4  # the ring model, written out.
  compressed = _hlo.total_wire_bytes(linear_phases.compression, N)
  ratio = allreduce / compressed
  print(f"\n[wire bytes] {d} float32 params on {N} devices, per device per step: "
        f"fp32 ring all-reduce {allreduce:.0f} B, compression branch (HLO) {compressed:.0f} B, "
        f"ratio {ratio:.2f}x")
  assert compressed <= allreduce / 30, ratio
  # The packed collectives move exactly what the optimizer reports in its state.
  packed = _hlo.total_wire_bytes([c for c in linear_phases.compression if c.dtypes == {"u8"}], N)
  assert packed == onebit_optax.compressed_wire_bytes(onebit_optax.padded_size(d, N), N)


def test_warmup_branch_allreduces_the_fp32_gradient(linear_phases):
  params, *_ = _linear_model()
  d = _num_params(params)
  big = _large(linear_phases.warmup)
  assert len(big) == 1, [str(c) for c in linear_phases.warmup]
  (allreduce,) = big
  assert allreduce.collective == "all-reduce"
  assert allreduce.dtypes == {"f32"} and allreduce.size == d, str(allreduce)
  assert allreduce.wire_bytes(N) == onebit_optax.allreduce_wire_bytes(d, N)
  assert not any(c.collective == "all-to-all" for c in linear_phases.warmup)


def _counts(phases):
  return {region: collections.Counter(c.collective for c in getattr(phases, region))
          for region in ("outside", "warmup", "compression")}


def test_collective_count_does_not_depend_on_the_number_of_leaves(linear_phases, deep_phases):
  assert len(jax.tree.leaves(_deep_model()[0])) == 50
  counts_2, counts_50 = _counts(linear_phases), _counts(deep_phases)
  print(f"\n[collectives] 2 leaves: {counts_2}\n[collectives] 50 leaves: {counts_50}")
  assert counts_2 == counts_50
  # The 50-leaf model obeys the same rules as the 2-leaf one.
  assert not _large(deep_phases.outside)
  assert all(c.dtypes == {"u8"} for c in _large(deep_phases.compression))
  d = _num_params(_deep_model()[0])
  assert [c.size for c in _large(deep_phases.warmup)] == [d]


def test_parser_detects_a_full_precision_gradient_allreduce(mesh):
  # Guard against a vacuous pass: the plain data-parallel Adam step (gradients
  # of replicated params, which JAX all-reduces in the backward pass) must show
  # up as a large float all-reduce outside of any phase switch.
  params, loss_fn, x, y = _linear_model()
  tx = optax.adam(1e-2)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                     out_specs=(P(), P()))
  def step(params, opt_state, x, y):
    g = jax.grad(loss_fn)(params, x, y)
    updates, opt_state = tx.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params = jax.device_put(params, NamedSharding(mesh, P()))
  x = jax.device_put(x, NamedSharding(mesh, P("data")))
  y = jax.device_put(y, NamedSharding(mesh, P("data")))
  module = _hlo.HloModule(
      step.lower(params, tx.init(params), x, y).compile(FAST_CODEGEN).as_text())
  big = _large(module.collectives(module.reachable([module.entry])))
  assert big and all(c.dtypes == {"f32"} for c in big)
  assert sum(c.size for c in big) == _num_params(params)
  assert sum(c.wire_bytes() for c in big) == onebit_optax.allreduce_wire_bytes(
      _num_params(params), N)


def test_gradients_of_replicated_params_are_rejected(mesh):
  # Without local_params, check_vma makes grad all-reduce the gradients in the
  # backward pass; the optimizer must refuse instead of silently losing the savings.
  params, loss_fn, x, y = _linear_model()
  tx = onebit_optax.onebit_adam(1e-2, axis_name="data", freeze=10)
  params = jax.device_put(params, NamedSharding(mesh, P()))
  opt_state = onebit_optax.init_sharded(tx, params, mesh)
  x = jax.device_put(x, NamedSharding(mesh, P("data")))
  y = jax.device_put(y, NamedSharding(mesh, P("data")))
  step = _readme_step(mesh, tx, loss_fn, opt_state, use_local_params=False)
  with pytest.raises(ValueError) as excinfo:
    step.lower(params, opt_state, x, y)
  message = str(excinfo.value)
  assert "replicated" in message and "local_params" in message, message
