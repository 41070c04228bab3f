"""Data × model meshes: a Megatron MLP sharded over 'model', 1-bit Adam over 'data'.

The README's "Data × model meshes" recipe on a (4, 2) mesh: each device runs the
optimizer on its local parameter shards, the momentum is compressed over 'data'
only, and the two whole-model decisions (the freeze's variance norm, the
non-finite skip) are agreed over 'model' (``onebit_adam(..., model_axis=...)``).
"""

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

DATA, MODEL = 4, 2
D, H, BATCH = 16, 64, 32
FREEZE = 10  # last warmup step
LR = 1e-2
# One model shard's leaves, in flattening order: b1 (32), b2, ln.bias, ln.scale (16 each),
# w1 (16 x 32), w2 (32 x 16). The four small ones travel as float32, w1 and w2 compressed.
LOCAL_SIZES = [32, 16, 16, 16, 512, 512]
FAST_CODEGEN = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}

# Megatron-style MLP: LayerNorm (replicated), W1 split by columns, b1 split,
# W2 split by rows, b2 replicated; the row-parallel product is summed over 'model'.
PARAM_SPECS = {"ln": {"scale": P(), "bias": P()},
               "w1": P(None, "model"), "b1": P("model"),
               "w2": P("model", None), "b2": P()}


def _init_params():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"ln": {"scale": jnp.ones(D), "bias": jnp.zeros(D)},
          "w1": jax.random.normal(k1, (D, H)) / np.sqrt(D), "b1": jnp.zeros(H),
          "w2": jax.random.normal(k2, (H, D)) / np.sqrt(H), "b2": jnp.zeros(D)}


def _layer_norm(p, x):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def _mlp(params, x, model_axis=None):
  h = jax.nn.gelu(_layer_norm(params["ln"], x) @ params["w1"] + params["b1"])
  partial = h @ params["w2"]
  if model_axis is not None:
    partial = jax.lax.psum(partial, model_axis)
  return partial + params["b2"]


def _loss(params, x, y, model_axis=None):
  return jnp.mean((_mlp(params, x, model_axis) - y) ** 2)


def _batches(steps):
  key = jax.random.key(1)
  w = jax.random.normal(jax.random.key(2), (D, D))
  out = []
  for _ in range(steps):
    key, sub = jax.random.split(key)
    x = jax.random.normal(sub, (BATCH, D))
    out.append((x, jnp.tanh(x @ w)))
  return out


def _tx(model_axis):
  return onebit_optax.onebit_adam(LR, axis_name="data", model_axis=model_axis,
                                  freeze=onebit_optax.fixed_step_freeze(FREEZE))


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((DATA, MODEL), ("data", "model"))


def _model_parallel_step(mesh, tx, opt_state, raw=False):
  """The README recipe. ``raw=True``: return every device's params and updates (no retyping)."""
  state_specs = onebit_optax.state_partition_specs(opt_state, "data", model_axis="model",
                                                    param_specs=PARAM_SPECS)
  per_device = P(("data", "model"))
  out_specs = ((per_device, per_device) if raw else (PARAM_SPECS, state_specs, P()))

  @functools.partial(jax.shard_map, mesh=mesh,
                     in_specs=(PARAM_SPECS, state_specs, P("data"), P("data")),
                     out_specs=out_specs)
  def step(params, opt_state, x, y):
    # Local over 'data' (no all-reduce of the gradients); check_vma's transpose
    # sums the replicated-over-'model' leaves' gradients over 'model' itself.
    grads = jax.grad(_loss)(onebit_optax.local_params(params, "data"), x, y, "model")
    updates, opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    if raw:
      stack = lambda t: jax.tree.map(lambda a: a[None], t)
      return stack(new_params), stack(updates)
    # The replicated leaves share the optimizer's flat buffer, typed varying over 'model'.
    new_params = onebit_optax.model_replicated(new_params, params, "model")
    loss = jax.lax.pmean(_loss(params, x, y, "model"), "data")
    return new_params, opt_state, loss

  return jax.jit(step)


def _compile(step, *args):
  return step.lower(*args).compile(FAST_CODEGEN)


def _replicated_step(mesh, tx, opt_state):
  state_specs = onebit_optax.state_partition_specs(opt_state, "data")

  @functools.partial(jax.shard_map, mesh=mesh,
                     in_specs=(P(), state_specs, P("data"), P("data")),
                     out_specs=(P(), state_specs, P()))
  def step(params, opt_state, x, y):
    grads = jax.grad(_loss)(onebit_optax.local_params(params, "data"), x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state,
            jax.lax.pmean(_loss(params, x, y), "data"))

  return jax.jit(step)


def _put(mesh, batch):
  return tuple(jax.device_put(a, NamedSharding(mesh, P("data"))) for a in batch)


@pytest.fixture(scope="module")
def setup(mesh):
  """The optimizer, params and state on the (4, 2) mesh, and the step compiled once."""
  tx = _tx("model")
  params = jax.device_put(_init_params(),
                          jax.tree.map(lambda s: NamedSharding(mesh, s), PARAM_SPECS))
  opt_state = onebit_optax.init_sharded(tx, params, mesh, "data", param_specs=PARAM_SPECS,
                                        model_axis="model")
  batch = _put(mesh, _batches(1)[0])
  step = _compile(_model_parallel_step(mesh, tx, opt_state), params, opt_state, *batch)
  raw = _compile(_model_parallel_step(mesh, tx, opt_state, raw=True),
                 params, opt_state, *batch)
  return dict(params=params, opt_state=opt_state, step=step, raw=raw)


@pytest.fixture(scope="module")
def run(mesh, setup):
  """30 steps on the (4, 2) mesh: params after each warmup step, losses, and the final state."""
  params, opt_state, step = setup["params"], setup["opt_state"], setup["step"]
  history, losses = [], []
  for t, batch in enumerate(_batches(3 * FREEZE)):
    if t == 2 * FREEZE:
      # One compression step with every device's own copy of the result.
      raw = setup["raw"](params, opt_state, *_put(mesh, batch))
    params, opt_state, loss = step(params, opt_state, *_put(mesh, batch))
    losses.append(float(loss))
    if t < FREEZE:
      history.append(jax.device_get(params))
  return dict(history=history, losses=losses, params=params, opt_state=opt_state, raw=raw)


def test_state_layout(mesh, setup):
  state = setup["opt_state"][0]
  # mu and nu are shaped like the (global) parameters and sharded like them.
  for moments in (state.mu, state.nu):
    for path, leaf in jax.tree_util.tree_leaves_with_path(moments):
      param = _at(setup["params"], path)
      assert leaf.shape == param.shape, path
      assert leaf.sharding.is_equivalent_to(param.sharding, leaf.ndim), path
  # Per device: what it compressed last, one entry per compressed leaf (its local shard
  # of w1 and w2), and their scales; globally one row per device, row data * MODEL + model.
  per_device = ("data", "model")
  assert [u.shape for u in state.local_momentum] == [(DATA * MODEL, 1, D, H // MODEL),
                                                     (DATA * MODEL, 1, H // MODEL, D)]
  assert state.worker_scale.shape == (DATA * MODEL, 2) and state.worker_error is None
  bits = _flat.Bits([512, 512], DATA)  # the compressed leaves' stream, in 4 chunks
  assert state.server_error.shape == (DATA * MODEL, bits.chunk)
  for buffer in (*state.local_momentum, state.worker_scale, state.server_error):
    assert buffer.sharding.spec[0] == per_device
  # The message and the per-leaf norms differ across 'model' (each shard its own).
  assert state.momentum_message.shape == (MODEL * DATA, _flat.onebit_row_bytes(LOCAL_SIZES, DATA))
  by_model = NamedSharding(mesh, P("model"))
  assert state.momentum_message.sharding.is_equivalent_to(by_model, 2)
  assert state.nu_l1.shape == (MODEL * len(LOCAL_SIZES),)
  assert state.nu_l1.sharding.is_equivalent_to(by_model, 1)
  assert state.count.sharding.is_fully_replicated and state.frozen.sharding.is_fully_replicated
  # Row data * MODEL + model of a global per-device buffer is device (data, model).
  for buffer in (state.local_momentum[0], state.server_error):
    for shard in buffer.addressable_shards:
      row = shard.index[0].start
      assert mesh.devices[row // MODEL, row % MODEL] == shard.device


def test_warmup_matches_the_replicated_model(mesh, run):
  """Warmup is Adam on the mean gradient: sharding the matrices changes nothing but rounding."""
  data_mesh = jax.make_mesh((DATA,), ("data",), devices=jax.devices()[:DATA])
  tx = _tx(None)
  params = jax.device_put(_init_params(), NamedSharding(data_mesh, P()))
  opt_state = onebit_optax.init_sharded(tx, params, data_mesh)
  batch = _put(data_mesh, _batches(1)[0])
  step = _compile(_replicated_step(data_mesh, tx, opt_state), params, opt_state, *batch)
  for t, batch in enumerate(_batches(FREEZE)):
    params, opt_state, _ = step(params, opt_state, *_put(data_mesh, batch))
    got = run["history"][t]  # gathered global arrays: the shards concatenated
    for path, want in jax.tree_util.tree_leaves_with_path(jax.device_get(params)):
      np.testing.assert_allclose(
          _at(got, path), want, rtol=1e-4, atol=1e-5,
          err_msg=f"step {t + 1}, {jax.tree_util.keystr(path)}")
  assert int(_fields.field(opt_state[0], "freeze_step")) == FREEZE  # all compared steps: warmup


def _at(tree, path):
  for key in path:
    tree = tree[key.key]
  return tree


def test_freezes_together_and_compression_keeps_replicas_identical(run):
  state = run["opt_state"][0]
  assert bool(state.frozen) and int(state.freeze_step) == FREEZE
  assert int(state.skipped_steps) == 0
  new_params, updates = run["raw"]  # one row per device, row = data * MODEL + model
  for path, leaf in jax.tree_util.tree_leaves_with_path(new_params):
    leaf = np.asarray(leaf).reshape((DATA, MODEL) + leaf.shape[1:])
    for m in range(MODEL):  # bitwise identical across the 'data' replicas of each shard
      assert all(np.array_equal(leaf[d, m], leaf[0, m]) for d in range(DATA)), path
  for name in ("ln", "b2"):  # replicated over 'model' too: equal on all 8 devices
    for leaf in jax.tree.leaves(updates[name]):
      leaf = np.asarray(leaf)
      assert all(np.array_equal(row, leaf[0]) for row in leaf), name
      assert np.any(leaf != 0)


def test_training_continues_to_decrease_the_loss_after_the_freeze(run):
  losses = run["losses"]
  assert all(np.isfinite(losses))
  at_freeze, end = np.mean(losses[FREEZE - 3:FREEZE]), np.mean(losses[-3:])
  assert end < 0.9 * at_freeze, losses


def test_compression_sends_only_uint8_over_data(mesh, setup):
  module = _hlo.HloModule.from_compiled(setup["step"])
  phases = _hlo.split_by_phase(module)
  large = lambda cs: [c for c in cs if c.size > 8]
  # Compression: the all_to_all and all_gather of packed bytes, over 'data' (4 devices
  # per group: the devices with the same model index); over 'model' only scalars.
  kinds = sorted(c.collective for c in large(phases.compression))
  assert kinds == ["all-gather", "all-to-all"], [str(c) for c in phases.compression]
  for c in large(phases.compression):
    assert c.dtypes == {"u8"} and c.group_size == DATA, str(c)
    _assert_data_groups(mesh, c)
  # Warmup: the float32 mean over 'data' of the local gradient shards (the leaves'
  # all-reduces combined into one).
  assert [(c.collective, c.size, c.group_size) for c in large(phases.warmup)] == [
      ("all-reduce", sum(LOCAL_SIZES), DATA)], [str(c) for c in phases.warmup]
  # Outside the switch, nothing large goes over 'data' (the gradients are local); over
  # 'model' go the activations' psum, its transpose and the replicated leaves' gather
  # (one, of ln and b2 together).
  assert all(c.group_size == MODEL for c in large(phases.outside)), (
      [str(c) for c in phases.outside])
  gathers = [c for c in phases.outside if c.collective == "all-gather"]
  assert [c.size for c in gathers] == [MODEL * 3 * D], [str(c) for c in gathers]


def _assert_data_groups(mesh, collective):
  """The replica groups are the mesh's columns (the devices with the same model index)."""
  line = collective.line
  if "replica_groups=mesh[" in line:  # jax >= 0.12 names the axes
    assert line.split("replica_groups=mesh[", 1)[1].split("]", 1)[1].lstrip().startswith(
        "{'data'}"), line
    return
  if "replica_groups={{" not in line:
    return  # the iota format: the group size was checked
  groups = line.split("replica_groups={{", 1)[1].split("}}", 1)[0].split("},{")
  groups = sorted(sorted(int(i) for i in g.split(",")) for g in groups)
  ids = np.vectorize(lambda d: d.id)(mesh.devices)
  position = {int(d): i for i, d in enumerate(ids.reshape(-1))}
  columns = sorted(sorted(position[int(d)] for d in ids[:, m]) for m in range(MODEL))
  assert groups == columns, (groups, columns)


def test_plain_jit_with_sharding_annotations_points_to_shard_map(mesh):
  """Under jax.jit alone (GSPMD) there are no per-device gradients to compress: refused."""
  tx = _tx("model")
  params = jax.device_put(_init_params(),
                          jax.tree.map(lambda s: NamedSharding(mesh, s), PARAM_SPECS))
  with jax.set_mesh(mesh):
    with pytest.raises(ValueError) as excinfo:
      jax.jit(tx.init)(params)
    for words in ("axis_name='data' is not bound", "jax.shard_map", "init_sharded"):
      assert words in str(excinfo.value), str(excinfo.value)
    opt_state = jax.eval_shape(
        lambda: onebit_optax.init_sharded(tx, params, mesh, "data", param_specs=PARAM_SPECS,
                                          model_axis="model"))
    with pytest.raises(ValueError, match="jax.shard_map") as excinfo:
      jax.jit(tx.update)(params, opt_state, params)
    assert "scale_by_onebit_adam.update" in str(excinfo.value)


def test_init_sharded_refuses_inconsistent_param_specs(mesh):
  tx = _tx("model")
  params = _init_params()
  with pytest.raises(ValueError, match="model_axis=None.*model_axis="):
    onebit_optax.init_sharded(tx, params, mesh, "data", param_specs=PARAM_SPECS)
  with pytest.raises(ValueError, match="data-parallel axis"):
    onebit_optax.init_sharded(tx, params, mesh, "data", model_axis="model",
                              param_specs={**PARAM_SPECS, "b2": P("data")})
  with pytest.raises(ValueError, match="not an axis of the mesh"):
    onebit_optax.init_sharded(tx, params, mesh, "data", param_specs=PARAM_SPECS,
                              model_axis="tensor")


def test_status_counts_the_bytes_of_one_model_shard(run):
  # Each device sends its own model shard's messages over 'data': the counts are per
  # device, from the local shards (the model axis is not part of the data mesh).
  s = onebit_optax.status(run["opt_state"], onebit_optax.fixed_step_freeze(FREEZE))
  steps = 3 * FREEZE
  assert (s.phase, s.step, s.freeze_step) == ("compression", steps, FREEZE)
  assert s.bytes_exact and s.replicas_agree
  warmup = _collective.allreduce_wire_bytes(sum(LOCAL_SIZES), DATA)
  compression = 2 * (DATA - 1) * _flat.onebit_row_bytes(LOCAL_SIZES, DATA)
  assert s.bytes_sent == pytest.approx(FREEZE * warmup + (steps - FREEZE) * compression)
  assert s.adam_bytes == pytest.approx(steps * warmup)
  assert float(_fields.field(run["opt_state"], "wire_bytes")) == compression
