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
from onebit_optax import _collective
import _flat
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
  """50 leaves (25 dense layers): the collectives must stay one each (biases travel exact)."""
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
  return _hlo.HloModule.from_compiled(step.lower(params, opt_state, x, y).compile(FAST_CODEGEN))


def _num_params(params):
  return sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))


def _sizes(params):
  return [int(np.prod(p.shape)) for p in jax.tree.leaves(params)]


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
  allreduce = _collective.allreduce_wire_bytes(d, N)
  assert allreduce == 2 * (N - 1) / N * d * 4  # the ring model, written out.
  compressed = _hlo.total_wire_bytes(linear_phases.compression, N)
  ratio = allreduce / compressed
  print(f"\n[wire bytes] {d} float32 params on {N} devices, per device per step: "
        f"fp32 ring all-reduce {allreduce:.0f} B, compression branch (HLO) {compressed:.0f} B, "
        f"ratio {ratio:.2f}x")
  assert compressed <= allreduce / 30, ratio
  # The packed collectives move exactly the signs of the block-padded flat buffer
  # and one float32 scale per leaf piece of a chunk (tests/_flat.py; here 520
  # blocks of 128, 2 scales per chunk), which is what the optimizer reports.
  sizes = _sizes(params)
  packed = _hlo.total_wire_bytes([c for c in linear_phases.compression if c.dtypes == {"u8"}], N)
  assert packed == _flat.compressed_bytes(sizes, N)
  assert packed == _collective.compressed_wire_bytes(
      _flat.padded(sizes, N), N, _flat.max_segments(sizes, N))


def test_warmup_branch_allreduces_the_fp32_gradient(linear_phases):
  params, *_ = _linear_model()
  d = _num_params(params)
  big = _large(linear_phases.warmup)
  assert len(big) == 1, [str(c) for c in linear_phases.warmup]
  (allreduce,) = big
  assert allreduce.collective == "all-reduce"
  # The gradient tree as it is (no flat buffer, no padding): XLA's all-reduce
  # combiner makes the per-leaf pmean one tuple all-reduce of all the leaves.
  assert allreduce.dtypes == {"f32"} and allreduce.size == d, str(allreduce)
  assert allreduce.wire_bytes(N) == _collective.allreduce_wire_bytes(d, N)
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
  # One (tuple) all-reduce of the 50 gradient leaves of 256 or 16 elements, on CPU
  # (on GPU XLA combines all-reduces into buckets of
  # --xla_gpu_all_reduce_combine_threshold_bytes; not measured here).
  assert [c.size for c in _large(deep_phases.warmup)] == [_num_params(_deep_model()[0])]


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
  module = _hlo.HloModule.from_compiled(
      step.lower(params, tx.init(params), x, y).compile(FAST_CODEGEN))
  big = _large(module.collectives(module.reachable([module.entry])))
  assert big and all(c.dtypes == {"f32"} for c in big)
  assert sum(c.size for c in big) == _num_params(params)
  assert sum(c.wire_bytes() for c in big) == _collective.allreduce_wire_bytes(
      _num_params(params), N)


def _one_device_step(tx, params, loss_fn, how):
  """A train step over a one-device data axis where nothing types the gradients (no check_vma), and its state."""
  def body(params, opt_state, x, y):
    g = jax.grad(loss_fn)(params, x, y)
    updates, opt_state = tx.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  if how == "pmap":
    one = functools.partial(jax.pmap, axis_name="data", devices=jax.devices()[:1])
    return one(body), one(tx.init)(jax.tree.map(lambda a: a[None], params))
  mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
  state = onebit_optax.init_sharded(tx, params, mesh)
  specs = onebit_optax.state_partition_specs(state, "data")
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), specs, P(), P()),
                               out_specs=(P(), specs), check_vma=False)), state


@pytest.mark.parametrize("how", ["shard_map", "pmap"])
@pytest.mark.parametrize("optimizer", ["onebit_adam", "zero_one_adam"])
def test_one_device_warmup_runs_no_gradient_allreduce(how, optimizer):
  # A sum over one device is the identity; XLA:CPU still ran it as an all-reduce
  # at a tenth of an elementwise pass's speed (the warmup step took 2x Adam's).
  params, loss_fn, x, y = _linear_model()
  kwargs = {"freeze": 100} if optimizer == "onebit_adam" else {"var_freeze_step": 100}
  tx = getattr(onebit_optax, optimizer)(1e-2, axis_name="data", **kwargs)
  step, state = _one_device_step(tx, params, loss_fn, how)
  lead = (lambda t: jax.tree.map(lambda a: a[None], t)) if how == "pmap" else (lambda t: t)
  params, x, y = lead((params, x, y))
  module = _hlo.HloModule.from_compiled(step.lower(params, state, x, y).compile(FAST_CODEGEN))
  big = _large(module.collectives(module.reachable([module.entry])))
  assert not big, [str(c) for c in big]
  if optimizer == "zero_one_adam":
    return
  # ... and the warmup is still Adam.
  first = lambda t: jax.tree.map(lambda a: a[0], t) if how == "pmap" else t
  adam = optax.adam(1e-2)
  ref = first(params)
  adam_state = adam.init(ref)
  for _ in range(3):
    params, state = step(params, state, x, y)
    updates, adam_state = adam.update(jax.grad(loss_fn)(ref, first(x), first(y)), adam_state, ref)
    ref = optax.apply_updates(ref, updates)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
               first(params), ref)


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


# The HLO text reader on both text formats of the replica groups. Two literal
# modules, as jax 0.10 and jax 0.12 print the same program (a phase switch whose
# branches communicate, and a loss all-reduce outside it); only the replica
# groups differ (0.12 also prints a stack-frame table before the computations).
_HLO_JAX_0_10 = r"""
HloModule jit_step, is_scheduled=true, entry_computation_layout={(f32[64]{0}, pred[])->(f32[64]{0}, f32[])}, num_partitions=8

%region_1.0 (a.0: f32[], b.0: f32[]) -> f32[] {
  %a.0 = f32[] parameter(0)
  %b.0 = f32[] parameter(1)
  ROOT %add.0 = f32[] add(%a.0, %b.0), metadata={op_name="add"}
}

%region_0.0_spmd (param.6: (f32[64])) -> (f32[64]) {
  %param.6 = (f32[64]{0}) parameter(0)
  %get-tuple-element.15 = f32[64]{0} get-tuple-element(%param.6), index=0
  %psum.12 = f32[64]{0} all-reduce(%get-tuple-element.15), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%region_1.0, metadata={op_name="jit(step)/shard_map/cond/branch_0_fun/psum" stack_frame_id=17}
  ROOT %tuple.17 = (f32[64]{0}) tuple(%psum.12)
}

%region_2.0_spmd (param.7: (f32[64])) -> (f32[64]) {
  %param.7 = (f32[64]{0}) parameter(0)
  %get-tuple-element.16 = f32[64]{0} get-tuple-element(%param.7), index=0
  %bitcast.1 = u8[8]{0} bitcast(%get-tuple-element.16)
  %all-to-all = (u8[1]{0}, u8[1]{0}, u8[1]{0}, u8[1]{0}, u8[1]{0}, /*index=5*/u8[1]{0}, u8[1]{0}, u8[1]{0}) all-to-all(%bitcast.1, %bitcast.1, %bitcast.1, %bitcast.1, %bitcast.1, /*index=5*/%bitcast.1, %bitcast.1, %bitcast.1), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, metadata={op_name="jit(step)/shard_map/cond/branch_1_fun/all_to_all"}
  %get-tuple-element.7 = u8[1]{0} get-tuple-element(%all-to-all), index=0
  %all_gather.2 = u8[8]{0} all-gather(%get-tuple-element.7), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(step)/shard_map/cond/branch_1_fun/all_gather"}
  %slice.1 = f32[1]{0} slice(%get-tuple-element.16), slice={[0:1]}
  %all_gather.3 = f32[8]{0} all-gather(%slice.1), channel_id=4, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %pad.1 = f32[64]{0} pad(%all_gather.3, %get-tuple-element.16), padding=0_56
  ROOT %tuple.18 = (f32[64]{0}) tuple(%pad.1)
}

ENTRY %main.0_spmd (param: f32[64], param.1: pred[]) -> (f32[64], f32[]) {
  %param = f32[64]{0} parameter(0), sharding={replicated}
  %param.1 = pred[] parameter(1), sharding={replicated}
  %wrapped_convert = s32[] convert(%param.1)
  %tuple.15 = (f32[64]{0}) tuple(%param)
  %conditional.1.clone = (f32[64]{0}) conditional(%wrapped_convert, %tuple.15, %tuple.15), branch_computations={%region_0.0_spmd, %region_2.0_spmd}, metadata={op_name="jit(step)/shard_map/cond" stack_frame_id=16}
  %get-tuple-element.5 = f32[64]{0} get-tuple-element(%conditional.1.clone), index=0
  %constant.1 = f32[] constant(0)
  %wrapped_reduce.1 = f32[] reduce(%param, %constant.1), dimensions={0}, to_apply=%region_1.0
  %psum.14 = f32[] all-reduce(%wrapped_reduce.1), channel_id=5, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%region_1.0, metadata={op_name="jit(step)/shard_map/psum" stack_frame_id=27}
  ROOT %tuple.19 = (f32[64]{0}, f32[]) tuple(%get-tuple-element.5, %psum.14)
}
"""

_HLO_JAX_0_12 = r"""
HloModule jit_step, is_scheduled=true, entry_computation_layout={(f32[64]{0}, pred[])->(f32[64]{0}, f32[])}, num_partitions=8
FileNames
1 "/tmp/step.py"
FunctionNames
1 "step"
FileLocations
1 {file_name_id=1 function_name_id=1 line=21 end_line=21 column=4 end_column=4}
StackFrames
1 {file_location_id=1 parent_frame_id=1}

%region_1.0 (a.0: f32[], b.0: f32[]) -> f32[] {
  %a.0 = f32[] parameter(0)
  %b.0 = f32[] parameter(1)
  ROOT %add.0 = f32[] add(%a.0, %b.0), metadata={op_name="add"}
}

%region_0.0_spmd (param.6: (f32[64])) -> (f32[64]) {
  %param.6 = (f32[64]{0}) parameter(0)
  %get-tuple-element.15 = f32[64]{0} get-tuple-element(%param.6), index=0
  %psum.12 = f32[64]{0} all-reduce(%get-tuple-element.15), channel_id=1, replica_groups=mesh['data'=8] {'data'}, use_global_device_ids=true, to_apply=%region_1.0, metadata={op_name="jit(step)/shard_map/cond/branch_0_fun/psum" stack_frame_id=17}
  ROOT %tuple.17 = (f32[64]{0}) tuple(%psum.12)
}

%region_2.0_spmd (param.7: (f32[64])) -> (f32[64]) {
  %param.7 = (f32[64]{0}) parameter(0)
  %get-tuple-element.16 = f32[64]{0} get-tuple-element(%param.7), index=0
  %bitcast.1 = u8[8]{0} bitcast(%get-tuple-element.16)
  %all-to-all = (u8[1]{0}, u8[1]{0}, u8[1]{0}, u8[1]{0}, u8[1]{0}, /*index=5*/u8[1]{0}, u8[1]{0}, u8[1]{0}) all-to-all(%bitcast.1, %bitcast.1, %bitcast.1, %bitcast.1, %bitcast.1, /*index=5*/%bitcast.1, %bitcast.1, %bitcast.1), channel_id=2, replica_groups=mesh['data'=8] {'data'}, metadata={op_name="jit(step)/shard_map/cond/branch_1_fun/all_to_all"}
  %get-tuple-element.7 = u8[1]{0} get-tuple-element(%all-to-all), index=0
  %all_gather.2 = u8[8]{0} all-gather(%get-tuple-element.7), channel_id=3, replica_groups=mesh['data'=8] {'data'}, dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(step)/shard_map/cond/branch_1_fun/all_gather"}
  %slice.1 = f32[1]{0} slice(%get-tuple-element.16), slice={[0:1]}
  %all_gather.3 = f32[8]{0} all-gather(%slice.1), channel_id=4, replica_groups=mesh['data'=8] {'data'}, dimensions={0}, use_global_device_ids=true
  %pad.1 = f32[64]{0} pad(%all_gather.3, %get-tuple-element.16), padding=0_56
  ROOT %tuple.18 = (f32[64]{0}) tuple(%pad.1)
}

ENTRY %main.0_spmd (param: f32[64], param.1: pred[]) -> (f32[64], f32[]) {
  %param = f32[64]{0} parameter(0), sharding={replicated}
  %param.1 = pred[] parameter(1), sharding={replicated}
  %wrapped_convert = s32[] convert(%param.1)
  %tuple.15 = (f32[64]{0}) tuple(%param)
  %conditional.1.clone = (f32[64]{0}) conditional(%wrapped_convert, %tuple.15, %tuple.15), branch_computations={%region_0.0_spmd, %region_2.0_spmd}, metadata={op_name="jit(step)/shard_map/cond" stack_frame_id=16}
  %get-tuple-element.5 = f32[64]{0} get-tuple-element(%conditional.1.clone), index=0
  %constant.1 = f32[] constant(0)
  %wrapped_reduce.1 = f32[] reduce(%param, %constant.1), dimensions={0}, to_apply=%region_1.0
  %psum.14 = f32[] all-reduce(%wrapped_reduce.1), channel_id=5, replica_groups=mesh['data'=8] {'data'}, use_global_device_ids=true, to_apply=%region_1.0, metadata={op_name="jit(step)/shard_map/psum" stack_frame_id=27}
  ROOT %tuple.19 = (f32[64]{0}, f32[]) tuple(%get-tuple-element.5, %psum.14)
}
"""


def _summary(collectives):
  return [(c.collective, sorted(c.dtypes), c.size, c.group_size) for c in collectives]


@pytest.mark.parametrize("text", [_HLO_JAX_0_10, _HLO_JAX_0_12], ids=["jax-0.10", "jax-0.12"])
def test_parser_reads_both_replica_group_formats(text):
  phases = _hlo.split_by_phase(_hlo.HloModule(text))
  assert phases.conditional.name == "conditional.1.clone"
  assert _summary(phases.warmup) == [("all-reduce", ["f32"], 64, 8)]
  assert _summary(phases.compression) == [
      ("all-to-all", ["u8"], 8, 8), ("all-gather", ["u8"], 8, 8), ("all-gather", ["f32"], 8, 8)]
  assert _summary(phases.outside) == [("all-reduce", ["f32"], 1, 8)]
  # Ring model by hand, 8 devices: the f32[64] all-reduce sends 2 * 7/8 * 256 B; the
  # all-to-all and the u8 all-gather 7/8 * 8 B each; the f32[8] all-gather 7/8 * 32 B.
  assert _hlo.total_wire_bytes(phases.warmup) == 448
  assert _hlo.total_wire_bytes(phases.compression) == 7 + 7 + 28


@pytest.mark.parametrize("groups, size", [
    ("{{0,1,2,3,4,5,6,7}}", 8),
    ("{{0,1,2,3},{4,5,6,7}}", 4),
    ("{{0,4},{1,5},{2,6},{3,7}}", 2),
    ("[2,4]<=[8]", 4),
    ("[4,2]<=[2,4]T(1,0)", 2),
    ("mesh['data'=8] {'data'}", 8),
    ("mesh['x'=2,'y'=4] {'y'}", 4),
    ("mesh['x'=2,'y'=4] {'x'}", 2),
    ("mesh['x'=2,'y'=4] {'x','y'}", 8),
    ("{}", None),
])
def test_parser_group_size_of_each_format(groups, size):
  line = (f"  %ar = f32[64]{{0}} all-reduce(%p), channel_id=1, replica_groups={groups}, "
          "use_global_device_ids=true, to_apply=%add")
  module = _hlo.HloModule(f"ENTRY %main (p: f32[64]) -> f32[64] {{\n{line}\n}}\n")
  (instr,) = module.collectives([module.entry])
  assert instr.group_size == size


@pytest.mark.parametrize("groups", ["mesh['x'=2] {'z'}", "devices[8] {0}"])
def test_parser_rejects_replica_groups_it_cannot_read(groups):
  text = (f"ENTRY %main (p: f32[64]) -> f32[64] {{\n  %ar = f32[64]{{0}} all-reduce(%p), "
          f"replica_groups={groups}, to_apply=%add\n}}\n")
  with pytest.raises(ValueError, match="replica_groups"):
    _hlo.HloModule(text)


def test_from_compiled_catches_a_collective_the_text_parser_missed(mesh):
  # The structured module of the compiled program is the safety net of the text
  # parser: drop one collective's line from the text and from_compiled must object.
  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
  def f(x):
    return jax.lax.all_gather(x, "data", tiled=True)[:x.shape[0]] + jax.lax.pmean(x, "data")

  compiled = f.lower(jax.device_put(jnp.ones((2 * N,)), NamedSharding(mesh, P("data")))).compile()
  if _hlo._structured_collectives(compiled) is None:
    pytest.skip(f"jaxlib {jax.__version__} does not list the compiled module's instructions")
  module = _hlo.HloModule.from_compiled(compiled)
  assert sorted(c.collective for c in module.collectives(module.reachable([module.entry]))) == [
      "all-gather", "all-reduce"]

  class WithoutTheAllGather:
    def as_text(self):
      return "\n".join(l for l in compiled.as_text().splitlines() if " all-gather(" not in l)

    def runtime_executable(self):
      return compiled.runtime_executable()

  with pytest.raises(AssertionError, match="all-gather"):
    _hlo.HloModule.from_compiled(WithoutTheAllGather())
