"""The recipes of docs/guides/frozen_layers.md and docs/guides/nnx.md, run as written.

Every ```python block of a guide is executed in order in one namespace (what a
reader pasting them into one session gets), on the 8 simulated CPU devices of
conftest. The tests then check what the blocks computed against references
that do not use the recipe's code path: the frozen leaves bitwise equal to
their initial values, the 1-bit part equal to ``onebit_adam`` trained alone on
that subtree, the Adam part equal to a numpy Adam on the mean gradient, the
NNX and linen warmups equal to ``optax.adam`` on the full batch on one device.
"""

import contextlib
import functools
import io
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import onebit_optax
import _fields

GUIDES = Path(__file__).resolve().parents[1] / "docs" / "guides"
STEPS, FREEZE, LR = 30, 10, 1e-2  # what both guides use


def python_blocks(path: Path) -> list:
  """The bodies of the ```python fenced blocks of a markdown file, in order."""
  return re.findall(r"^```python\n(.*?)^```\s*$", path.read_text(), re.S | re.M)


def run_blocks(path: Path, after_first=None):
  """Executes the blocks in one namespace; returns (namespace, captured stdout).

  ``after_first(namespace)`` runs after the first block (to take snapshots).
  """
  namespace, out = {"__name__": f"guide_{path.stem}"}, io.StringIO()
  with contextlib.redirect_stdout(out):
    for i, block in enumerate(python_blocks(path)):
      exec(compile(block, f"{path}:python block {i + 1}", "exec"), namespace)  # noqa: S102
      if i == 0 and after_first is not None:
        after_first(namespace)
  return namespace, out.getvalue()


def _np(tree):
  return jax.tree.map(np.asarray, tree)


def _bits(a):
  a = np.asarray(a)
  return a.view(np.uint32 if a.dtype == np.float32 else np.uint8)


def _losses(output):
  return {int(s): float(v) for s, v in re.findall(r"step (\d+): loss ([\d.]+)", output)}


def test_the_guides_have_the_blocks_the_tests_read():
  assert len(python_blocks(GUIDES / "frozen_layers.md")) == 6
  assert len(python_blocks(GUIDES / "nnx.md")) == 5


# --- frozen_layers.md -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def frozen_guide():
  snapshot = {}

  def take(ns):
    snapshot["params0"] = _np(ns["init_params"](jax.random.key(0)))
    snapshot["x"], snapshot["y"] = np.asarray(ns["x"]), np.asarray(ns["y"])

  ns, output = run_blocks(GUIDES / "frozen_layers.md", after_first=take)
  return ns, output, snapshot


def _onebit_on_head_alone(ns, snapshot):
  """Reference: onebit_adam on the head subtree only, the body a constant (README recipe)."""
  mesh, body = ns["mesh"], jax.tree.map(jnp.asarray, snapshot["params0"]["body"])
  tx = onebit_optax.onebit_adam(LR, axis_name="data",
                                freeze=onebit_optax.fixed_step_freeze(FREEZE))
  head = jax.device_put(snapshot["params0"]["head"], NamedSharding(mesh, P()))
  state = onebit_optax.init_sharded(tx, head, mesh)
  specs = onebit_optax.state_partition_specs(state, "data")
  loss = lambda head, x, y: ns["loss_fn"]({"body": body, "head": head}, x, y)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                     out_specs=(P(), specs))
  def step(head, state, x, y):
    grads = jax.grad(loss)(onebit_optax.local_params(head, "data"), x, y)
    updates, state = tx.update(grads, state, head)
    return optax.apply_updates(head, updates), state

  for _ in range(STEPS):
    head, state = step(head, state, ns["x"], ns["y"])
    jax.block_until_ready(head)
  assert bool(_fields.field(state, "frozen"))
  return _np(head)


@pytest.fixture(scope="module")
def head_reference(frozen_guide):
  ns, _, snapshot = frozen_guide
  return _onebit_on_head_alone(ns, snapshot)


def _assert_body_bitwise_unchanged(params, snapshot, what):
  for name in ("w", "b"):
    np.testing.assert_array_equal(_bits(params["body"][name]),
                                  _bits(snapshot["params0"]["body"][name]),
                                  err_msg=f"{what}: body/{name} moved")


def _assert_head_matches(head, reference, what):
  for name in ("w", "b"):
    np.testing.assert_allclose(np.asarray(head[name]), reference[name], rtol=1e-5, atol=1e-6,
                               err_msg=f"{what}: head/{name}")


def test_frozen_guide_prints_a_falling_loss_and_compresses(frozen_guide):
  _, output, _ = frozen_guide
  losses = _losses(output)
  assert set(losses) == {1, STEPS}
  assert losses[STEPS] < 0.5 * losses[1], output
  assert "compressing: True" in output


def test_partition_keeps_the_body_bitwise_and_trains_the_head_as_onebit_adam_alone(
    frozen_guide, head_reference):
  ns, _, snapshot = frozen_guide
  params = _np(ns["params"])
  _assert_body_bitwise_unchanged(params, snapshot, "partition")
  assert not np.allclose(head_reference["w"], snapshot["params0"]["head"]["w"])
  _assert_head_matches(params["head"], head_reference, "partition")
  # Only the head is in 1-bit Adam's state: the frozen leaves cost no optimizer memory.
  (onebit_state,) = [s for s in jax.tree.leaves(
      ns["opt_state"], is_leaf=lambda s: isinstance(s, onebit_optax.ScaleByOnebitAdamState))
                     if isinstance(s, onebit_optax.ScaleByOnebitAdamState)]
  assert sorted(np.shape(v) for v in jax.tree.leaves(onebit_state.nu)) == [(4,), (32, 4)]


def test_masked_pair_is_the_partition(frozen_guide, head_reference):
  ns, _, snapshot = frozen_guide
  params = _np(ns["params_masked"])
  _assert_body_bitwise_unchanged(params, snapshot, "masked")
  _assert_head_matches(params["head"], head_reference, "masked")


def test_pmap_recipe_keeps_the_body_and_matches_the_reference(frozen_guide, head_reference):
  ns, _, snapshot = frozen_guide
  stacked = _np(ns["pmap_params"])
  n = ns["n"]
  for d in range(n):
    copy = jax.tree.map(lambda a: a[d], stacked)
    _assert_body_bitwise_unchanged(copy, snapshot, f"pmap device {d}")
    _assert_head_matches(copy["head"], head_reference, f"pmap device {d}")
    for a, b in zip(jax.tree.leaves(copy), jax.tree.leaves(jax.tree.map(lambda a: a[0], stacked))):
      np.testing.assert_array_equal(_bits(a), _bits(b))


def _numpy_adam(grads, lr=LR, b1=0.9, b2=0.999, eps=1e-8):
  """optax.adam's rule, in float64: the updates for a sequence of gradients."""
  m = v = 0.0
  for t, g in enumerate(grads, 1):
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    yield -lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)


def test_adam_part_is_adam_on_the_mean_gradient(frozen_guide):
  # Drives the guide's own step on tx3 and checks head/b, step by step, against
  # numpy Adam on the full-batch gradient at the parameters the step started from.
  ns, _, snapshot = frozen_guide
  mesh, tx3 = ns["mesh"], ns["tx3"]
  params = jax.device_put(snapshot["params0"], NamedSharding(mesh, P()))
  state = onebit_optax.init_sharded(tx3, params, mesh)
  step = ns["make_train_step"](tx3, onebit_optax.state_partition_specs(state, "data"))
  full_grad = jax.jit(jax.grad(ns["loss_fn"]))
  m = v = np.zeros(4)
  for t in range(1, 13):  # across the freeze at 10: Adam's part does not freeze
    before = _np(params)
    g = np.asarray(full_grad(before, snapshot["x"], snapshot["y"])["head"]["b"], np.float64)
    m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
    expected = before["head"]["b"] - LR * (m / (1 - 0.9 ** t)) / (
        np.sqrt(v / (1 - 0.999 ** t)) + 1e-8)
    params, state, _ = step(params, state, ns["x"], ns["y"])
    after = _np(params)
    np.testing.assert_allclose(after["head"]["b"], expected, rtol=1e-5, atol=1e-6,
                               err_msg=f"head/b at step {t}")
    _assert_body_bitwise_unchanged(after, snapshot, f"tx3 step {t}")
  assert bool(_fields.field(state, "frozen"))
  # The guide's own 30-step run of tx3 kept the body too.
  _assert_body_bitwise_unchanged(_np(ns["params3"]), snapshot, "tx3 in the guide")


@pytest.mark.parametrize("form", ["optax.set_to_zero", "masked alone", "adam without mean"])
def test_the_forms_the_guide_warns_about_fail_under_shard_map(frozen_guide, form):
  ns, _, _ = frozen_guide
  onebit = onebit_optax.onebit_adam(LR, axis_name="data",
                                    freeze=onebit_optax.fixed_step_freeze(FREEZE))
  labels, trained = ns["labels"], ns["trained"]
  tx = {"optax.set_to_zero": lambda: optax.partition(
            {"train": onebit, "frozen": optax.set_to_zero()}, labels),
        "masked alone": lambda: optax.masked(onebit, trained),
        "adam without mean": lambda: optax.partition(
            {"train": onebit, "frozen": optax.adam(LR)}, labels)}[form]()
  # init_sharded refuses it, naming the leaves (the guide's first quote) ...
  with pytest.raises(ValueError, match=r"^init_sharded: the updates of \['body'\]\['b'\], "
                                       r"\['body'\]\['w'\] come out of the optimizer per-device "
                                       r"\(typed varying over 'data'\)"):
    ns["train"](tx, steps=1)
  # ... and a state made without init_sharded fails at the step (the second quote).
  params = jax.device_put(ns["init_params"](jax.random.key(0)), NamedSharding(ns["mesh"], P()))
  abstract = jax.eval_shape(jax.shard_map(tx.init, mesh=ns["mesh"], in_specs=(P(),),
                                          out_specs=P(), check_vma=False), params)
  specs = onebit_optax.state_partition_specs(abstract, "data")
  state = jax.jit(jax.shard_map(tx.init, mesh=ns["mesh"], in_specs=(P(),), out_specs=specs))(
      params)
  with pytest.raises(ValueError, match=r"out_specs\[0\] is P\(\) .*could not infer replication"):
    ns["make_train_step"](tx, specs)(params, state, ns["x"], ns["y"])


def _pmap_one_step(ns, frozen_tx):
  onebit = onebit_optax.onebit_adam(LR, axis_name="data",
                                    freeze=onebit_optax.fixed_step_freeze(FREEZE))
  tx = optax.partition({"train": onebit, "frozen": frozen_tx}, ns["labels"])
  params = ns["flax"].jax_utils.replicate(ns["init_params"](jax.random.key(0)))
  state = jax.pmap(tx.init, axis_name="data")(params)

  @functools.partial(jax.pmap, axis_name="data")
  def step(params, state, x, y):
    updates, state = tx.update(jax.grad(ns["loss_fn"])(params, x, y), state, params)
    return optax.apply_updates(params, updates), state

  return np.asarray(step(params, state, ns["xs"], ns["ys"])[0]["body"]["w"])


def test_under_pmap_a_plain_adam_part_drifts_silently(frozen_guide):
  # What the guide says pmap does with the mistake: no error, different copies.
  ns, _, snapshot = frozen_guide
  body_w = _pmap_one_step(ns, optax.adam(LR))
  assert not np.array_equal(body_w[0], body_w[1])
  # ... while optax.set_to_zero() does freeze under pmap (no types to check there).
  body_w = _pmap_one_step(ns, optax.set_to_zero())
  for d in range(ns["n"]):
    np.testing.assert_array_equal(_bits(body_w[d]), _bits(snapshot["params0"]["body"]["w"]))


# --- nnx.md -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nnx_guide():
  snapshot = {}

  def take(ns):
    snapshot["x"], snapshot["y"] = np.asarray(ns["x"]), np.asarray(ns["y"])

  ns, output = run_blocks(GUIDES / "nnx.md", after_first=take)
  return ns, output, snapshot


def _adam_full_batch(loss, params, x, y, steps):
  """optax.adam(LR) on one device on the whole batch: the mean of the devices' gradients."""
  tx = optax.adam(LR)
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    updates, state = tx.update(jax.grad(loss)(params, x, y), state, params)
    return optax.apply_updates(params, updates), state

  for _ in range(steps):
    params, state = step(params, state)
  return _np(params)


def test_nnx_guide_prints_falling_loss_and_the_ring_bytes(nnx_guide):
  ns, output, _ = nnx_guide
  lines = re.findall(r"step (\d+): loss ([\d.]+), compressing: (\w+), (\d+) bytes", output)
  assert [(int(s), c) for s, _, c, _ in lines] == [(1, "False"), (STEPS, "True")], output
  (_, first, _, warm_bytes), (_, last, _, onebit_bytes) = lines
  assert float(last) < 0.5 * float(first)
  num_params = 8 * 32 + 32 + 32 * 4 + 4
  n = ns["mesh"].size
  assert int(warm_bytes) == round(2 * (n - 1) / n * 4 * num_params)  # a ring float32 all-reduce
  assert int(onebit_bytes) < int(warm_bytes) / 4


def test_nnx_warmup_is_adam_on_the_full_batch(nnx_guide):
  from flax import nnx
  ns, _, snapshot = nnx_guide
  graphdef, params0, rest = nnx.split(ns["MLP"](nnx.Rngs(0)), nnx.Param, ...)
  loss = lambda p, x, y: ns["loss_fn"](nnx.merge(graphdef, p, rest), x, y)
  reference = _adam_full_batch(loss, params0, snapshot["x"], snapshot["y"], FREEZE)
  model = ns["MLP"](nnx.Rngs(0))
  optimizer = ns["create_optimizer"](model)
  for _ in range(FREEZE):
    stats = jax.device_get(ns["train_step"](model, optimizer, ns["x"], ns["y"]))
  # Steps 1..FREEZE are warmup steps (the state says frozen after the last of them).
  trained = _np(nnx.state(model, nnx.Param))
  paths = [p for p, _ in jax.tree_util.tree_leaves_with_path(trained)]
  for path, got, want, start in zip(paths, jax.tree.leaves(trained), jax.tree.leaves(reference),
                                    jax.tree.leaves(_np(params0))):
    assert not np.allclose(got, start), path
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=str(path))


def test_nnx_replicas_identical_after_the_guide(nnx_guide):
  from flax import nnx
  ns, _, _ = nnx_guide
  assert onebit_optax.assert_replicas_identical(nnx.state(ns["model"], nnx.Param)) > 0


def test_nnx_optimizer_outside_shard_map_fails_as_the_guide_says(nnx_guide):
  from flax import nnx
  ns, _, _ = nnx_guide
  with pytest.raises(ValueError, match=r"scale_by_onebit_adam.init: axis_name='data' is not "
                                       r"bound here"):
    nnx.Optimizer(ns["MLP"](nnx.Rngs(0)), ns["tx"], wrt=nnx.Param)


def test_linen_warmup_is_adam_on_the_full_batch_and_then_compresses(nnx_guide):
  ns, output, snapshot = nnx_guide
  assert bool(_fields.field(ns["linen_state"].opt_state, "frozen"))
  assert int(ns["linen_state"].step) == STEPS
  initial = float(jnp.mean((ns["linen_model"].apply({"params": ns["linen_params"]},
                                                    snapshot["x"]) - snapshot["y"]) ** 2))
  final = float(re.search(r"linen, step 30: loss ([\d.]+)", output)[1])
  assert final < 0.5 * initial
  # The guide's step, driven from the initial state for the warmup steps.
  mesh, tx, params0 = ns["mesh"], ns["tx"], ns["linen_params"]
  state = ns["linen_state"].replace(
      step=jax.device_put(jnp.zeros([], jnp.int32), NamedSharding(mesh, P())), params=params0,
      opt_state=onebit_optax.init_sharded(tx, params0, mesh))
  for _ in range(FREEZE):
    state, _ = ns["linen_step"](state, ns["x"], ns["y"])
    jax.block_until_ready(state)
  loss = lambda p, x, y: jnp.mean((ns["linen_model"].apply({"params": p}, x) - y) ** 2)
  reference = _adam_full_batch(loss, _np(params0), snapshot["x"], snapshot["y"], FREEZE)
  for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(_np(state.params)),
                               jax.tree.leaves(reference)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=str(path))


def _matrix_products(ns, tx):
  params = jax.device_put(ns["init_params"](jax.random.key(0)), NamedSharding(ns["mesh"], P()))
  state = onebit_optax.init_sharded(tx, params, ns["mesh"])
  step = ns["make_train_step"](tx, onebit_optax.state_partition_specs(state, "data"))
  hlo = step.lower(params, state, ns["x"], ns["y"]).compile().as_text()
  return len(re.findall(r"\bdot\(", hlo))


def test_the_frozen_body_costs_no_backward_matmuls(frozen_guide):
  # The guide: 3 matrix products instead of 5 (the body's weight gradient and the
  # backward pass into the body are dropped by XLA).
  ns, _, _ = frozen_guide
  everything = onebit_optax.onebit_adam(LR, axis_name="data",
                                        freeze=onebit_optax.fixed_step_freeze(FREEZE))
  assert (_matrix_products(ns, ns["tx"]), _matrix_products(ns, everything)) == (3, 5)


def test_nnx_grad_of_the_replicated_model_is_refused_as_the_guide_says(nnx_guide):
  from flax import nnx
  ns, _, _ = nnx_guide
  mesh, specs, loss_fn = ns["mesh"], ns["optimizer_specs"], ns["loss_fn"]

  @nnx.jit
  @nnx.shard_map(mesh=mesh, in_specs=(P(), specs, P("data"), P("data")), out_specs=P())
  def naive_step(model, optimizer, x, y):
    optimizer.update(model, nnx.grad(loss_fn)(model, x, y))  # no local_params
    return jnp.zeros(())

  model = ns["MLP"](nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"the gradients are replicated over 'data', i.e. already "
                                       r"all-reduced"):
    naive_step(model, ns["create_optimizer"](model), ns["x"], ns["y"])


def test_nnx_head_only_keeps_the_body_bitwise_and_its_warmup_is_adam(nnx_guide):
  from flax import nnx
  ns, output, snapshot = nnx_guide
  fresh = lambda: ns["MLP"](nnx.Rngs(0))
  initial = _np(nnx.state(fresh(), nnx.Param))
  after_guide = _np(nnx.state(ns["head_model"], nnx.Param))
  for name in ("kernel", "bias"):
    np.testing.assert_array_equal(_bits(after_guide["hidden"][name]),
                                  _bits(initial["hidden"][name]), err_msg=f"hidden/{name}")
  final = float(re.search(r"head only, step 30: loss ([\d.]+)", output)[1])
  assert final < 0.5 * float(ns["loss_fn"](fresh(), snapshot["x"], snapshot["y"]))
  # Only the head is in the optimizer's state.
  state = nnx.as_pure(ns["head_optimizer"].opt_state)
  (onebit_state,) = [s for s in jax.tree.leaves(
      state, is_leaf=lambda s: isinstance(s, onebit_optax.ScaleByOnebitAdamState))
                     if isinstance(s, onebit_optax.ScaleByOnebitAdamState)]
  assert sorted(np.shape(v) for v in jax.tree.leaves(onebit_state.nu)) == [(4,), (32, 4)]
  # Warmup: the guide's head step against optax.adam on the head alone, full batch.
  graphdef, head0, rest = nnx.split(fresh(), ns["trained"], ...)
  loss = lambda head, x, y: ns["loss_fn"](nnx.merge(graphdef, head, rest), x, y)
  reference = _adam_full_batch(loss, head0, snapshot["x"], snapshot["y"], FREEZE)
  model = fresh()
  optimizer = ns["create_head_optimizer"](model)
  for _ in range(FREEZE):
    float(ns["head_step"](model, optimizer, ns["x"], ns["y"]))
  got = _np(nnx.state(model, ns["trained"]))
  for a, b, start in zip(jax.tree.leaves(got), jax.tree.leaves(reference),
                         jax.tree.leaves(_np(head0))):
    assert not np.allclose(a, start)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(_bits(_np(nnx.state(model, nnx.Param))["hidden"]["kernel"]),
                                _bits(initial["hidden"]["kernel"]))


def test_nnx_optimizer_outside_shard_map_points_to_the_nnx_guide(nnx_guide):
  from flax import nnx
  ns, _, _ = nnx_guide
  with pytest.raises(ValueError, match=r"nnx\.Optimizer.*docs/guides/nnx\.md"):
    nnx.Optimizer(ns["MLP"](nnx.Rngs(0)), ns["tx"], wrt=nnx.Param)


def test_the_nnx_filter_names_every_per_device_field_of_both_optimizers():
  from onebit_optax import _sharding
  guide = (GUIDES / "nnx.md").read_text()
  block = guide[guide.index("optimizer_specs = nnx.StateSharding({"):]
  block = block[:block.index("})")]
  assert set(re.findall(r"PathContains\('(\w+)'\): P\('data'\)", block)) == set(
      _sharding.PER_DEVICE_FIELDS)


def test_nnx_guide_step_trains_zero_one_adam_with_local_steps(nnx_guide):
  """The guide's filter and step with zero_one_adam(local_steps=4), as its 0/1 paragraph says."""
  from flax import nnx
  ns, _, _ = nnx_guide
  tx = onebit_optax.zero_one_adam(LR, axis_name="data", var_freeze_step=FREEZE, local_steps=4,
                                  local_step_scaler=2)
  mesh, specs = ns["mesh"], ns["optimizer_specs"]

  @nnx.jit
  @nnx.shard_map(mesh=mesh, in_specs=P(), out_specs=specs)
  def create(model):
    return nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  @nnx.shard_map(mesh=mesh, in_specs=(P(), specs, P("data"), P("data")), out_specs=P())
  def step(model, optimizer, x, y):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    local = onebit_optax.local_params(params, "data", nnx.as_pure(optimizer.opt_state))
    loss, grads = jax.value_and_grad(
        lambda p: ns["loss_fn"](nnx.merge(graphdef, p, rest), x, y))(local)
    optimizer.update(model, grads)
    return jax.lax.pmean(loss, "data")

  model = ns["MLP"](nnx.Rngs(0))
  optimizer = create(model)
  losses, phases = [], []
  for _ in range(STEPS):
    losses.append(float(step(model, optimizer, ns["x"], ns["y"])))
    phases.append(onebit_optax.status(nnx.as_pure(optimizer.opt_state)).phase)
  assert {"variance", "local", "sync"} <= set(phases), phases
  assert losses[-1] < 0.5 * losses[0]
  onebit_optax.assert_replicas_identical(nnx.state(model, nnx.Param))
