"""1-bit Adam among other optax and flax pieces: clipping, masking, partitioning, hyperparams, flax.

The rule behind every case: under data parallelism 1-bit Adam receives each
device's *local* gradient and does the averaging itself. Whatever runs before
it sees local gradients, and whatever it does not own must be averaged by
someone else. The tests train on 8 simulated devices and compare with optax
references computed from the averaged gradients in numpy or plain optax.

Found and documented here:

* ``optax.clip_by_global_norm`` before 1-bit Adam clips each device by its own
  norm: not the clipping of the mean gradient (numbers in the test).
  ``onebit_optax.clip_by_global_norm`` scales all devices by one factor.
* ``optax.masked(onebit_adam(...), mask)`` alone passes the masked-out leaves'
  raw *local* gradients through as updates: under shard_map the step refuses to
  trace (the parameters would differ across devices). Give those leaves their
  own optimizer *and their own average* (``pmean`` transformation below), via
  ``optax.partition`` or two ``optax.masked``.
* Flax ``nnx.Optimizer``: its state holds nnx ``OptArray`` variables (``status`` unwraps them).
"""

import functools

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import NamedSharding, PartitionSpec as P

import onebit_optax
import _fields
import _flat

N = 8
FEATURES, OUTPUTS, LOCAL_BATCH = 12, 3, 8
K = 4  # warmup steps
STEPS = 12
LR, SGD_LR = 0.05, 0.1
FAST_CODEGEN = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _loss(params, x, y):
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def _problem(seed=0, spread=0.3):
  """Devices with different optima (``spread``), so local gradients disagree."""
  rng = np.random.default_rng(seed)
  params = {"w": np.zeros((FEATURES, OUTPUTS), np.float32), "b": np.zeros((OUTPUTS,), np.float32)}
  x = rng.standard_normal((N, LOCAL_BATCH, FEATURES)).astype(np.float32)
  w_true = rng.standard_normal((FEATURES, OUTPUTS)) + spread * rng.standard_normal(
      (N, FEATURES, OUTPUTS))
  y = (np.einsum("dbf,dfo->dbo", x, w_true) + 1.0).astype(np.float32)
  return params, x.reshape(N * LOCAL_BATCH, FEATURES), y.reshape(N * LOCAL_BATCH, OUTPUTS)


def _local_grads(params, x, y):
  """Each device's gradient on its shard, stacked: leaves of shape (N, ...), float64."""
  grads = jax.vmap(jax.grad(_loss), in_axes=(None, 0, 0))(
      params, x.reshape(N, LOCAL_BATCH, -1), y.reshape(N, LOCAL_BATCH, -1))
  return jax.tree.map(lambda a: np.asarray(a, np.float64), grads)


def _assert_trained(history, params0, x, y, factor=0.8):
  """A sanity check on top of the exact comparisons. The mean over the last 4 steps,
  because on 40 parameters the 1-bit phase zigzags from step to step (error
  feedback over-corrects, then corrects back)."""
  losses = [float(_loss(p, x, y)) for p in history[-4:]]
  assert np.mean(losses) < factor * float(_loss(params0, x, y)), losses


@jax.jit
def _adam_step(grads, state, params):
  """optax.adam(LR), the reference (jitted: eager op-by-op dispatch is slow here)."""
  updates, state = optax.adam(LR).update(grads, state, params)
  return optax.apply_updates(params, updates), state


def _global_norm(tree):
  return float(np.sqrt(sum(np.sum(np.square(a)) for a in jax.tree.leaves(tree))))


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((N,), ("data",))


def _place(mesh, params, x, y):
  return (jax.device_put(params, NamedSharding(mesh, P())),
          jax.device_put(x, NamedSharding(mesh, P("data"))),
          jax.device_put(y, NamedSharding(mesh, P("data"))))


def _train(mesh, tx, params, x, y, steps=STEPS):
  """The README recipe, one compiled step; returns the params after each step and the state."""
  params, x, y = _place(mesh, params, x, y)
  state = onebit_optax.init_sharded(tx, params, mesh)
  specs = onebit_optax.state_partition_specs(state, "data")

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                     out_specs=(P(), specs))
  def step(params, opt_state, x, y):
    grads = jax.grad(_loss)(onebit_optax.local_params(params, "data"), x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  compiled = jax.jit(step).lower(params, state, x, y).compile(FAST_CODEGEN)
  history = []
  for _ in range(steps):
    params, state = compiled(params, state, x, y)
    history.append(jax.tree.map(np.asarray, params))  # waits: one step in flight at a time
  return history, state, specs


# --- Clipping ------------------------------------------------------------------------------

MAX_NORM = 2.0


def test_optax_clip_on_local_gradients_is_not_clipping_the_mean():
  params, x, y = _problem(spread=3.0)
  local = _local_grads(params, x, y)
  local_norms = np.array([_global_norm(jax.tree.map(lambda a: a[i], local)) for i in range(N)])
  mean = jax.tree.map(lambda a: a.mean(axis=0), local)
  mean_norm = _global_norm(mean)
  # What a single-device run does: clip the mean gradient.
  clip_mean = jax.tree.map(lambda a: a * min(1.0, MAX_NORM / mean_norm), mean)
  # What chain(optax.clip_by_global_norm, onebit_adam) does: clip each device, then average.
  clip = optax.clip_by_global_norm(MAX_NORM)
  per_device = [clip.update(jax.tree.map(lambda a: jnp.asarray(a[i], jnp.float32), local),
                            clip.init(params))[0] for i in range(N)]
  mean_of_clipped = jax.tree.map(lambda *a: np.mean(np.stack(a), axis=0), *per_device)
  diff = _global_norm(jax.tree.map(lambda a, b: a - b, mean_of_clipped, clip_mean))
  print(f"\n[clip] local norms {np.round(local_norms, 2)}, mean-gradient norm {mean_norm:.2f}; "
        f"|mean(clip(g_i))| = {_global_norm(mean_of_clipped):.3f}, "
        f"|clip(mean g)| = {_global_norm(clip_mean):.3f}, |difference| = {diff:.3f}")
  assert np.all(local_norms > MAX_NORM)
  assert diff > 0.1 * _global_norm(clip_mean)


def test_agreed_clip_scales_every_device_by_one_factor(mesh):
  params, x, y = _problem(spread=3.0)
  clip = onebit_optax.clip_by_global_norm(MAX_NORM, axis_name="data")
  placed = _place(mesh, params, x, y)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                     out_specs=(P("data"), P("data")))
  def clipped(params, x, y):
    grads = jax.grad(_loss)(onebit_optax.local_params(params, "data"), x, y)
    out, _ = clip.update(grads, clip.init(params))
    expand = lambda t: jax.tree.map(lambda a: a[None], t)
    return expand(grads), expand(out)

  raw, out = jax.tree.map(lambda a: np.asarray(a, np.float64), clipped(*placed))
  factors = np.concatenate([(out[k] / raw[k]).reshape(N, -1) for k in ("w", "b")], axis=1)
  factors = factors[:, np.isfinite(factors).all(axis=0)]
  # One factor on every device and coordinate: min(1, c / rho), rho = RMS of local norms.
  local_norms = np.array([_global_norm(jax.tree.map(lambda a: a[i], raw)) for i in range(N)])
  rho = np.sqrt(np.mean(local_norms ** 2))
  np.testing.assert_allclose(factors, min(1.0, MAX_NORM / rho), rtol=1e-5)
  assert rho > MAX_NORM  # it clipped
  mean_clipped = jax.tree.map(lambda a: a.mean(axis=0), out)
  assert _global_norm(mean_clipped) <= MAX_NORM * (1 + 1e-6)
  print(f"\n[agreed clip] rho {rho:.3f}, factor {MAX_NORM / rho:.4f}, "
        f"|mean of clipped| {_global_norm(mean_clipped):.3f} <= {MAX_NORM}")


def test_chain_agreed_clip_then_onebit_adam_is_adam_on_clipped_mean(mesh):
  params, x, y = _problem(spread=3.0)
  tx = optax.chain(onebit_optax.clip_by_global_norm(MAX_NORM, axis_name="data"),
                   onebit_optax.onebit_adam(LR, axis_name="data", freeze=K))
  history, state, _ = _train(mesh, tx, params, x, y)
  # Reference: optax.adam on factor * mean gradient, factor from the local norms (numpy).
  ref_tx, p = optax.adam(LR), jax.tree.map(jnp.asarray, params)
  ref_state, clipped_any = ref_tx.init(p), False
  for t in range(K):
    local = _local_grads(p, x, y)
    rho = np.sqrt(np.mean([_global_norm(jax.tree.map(lambda a: a[i], local)) ** 2
                           for i in range(N)]))
    clipped_any |= rho > MAX_NORM
    g = jax.tree.map(lambda a: jnp.asarray(a.mean(0) * min(1.0, MAX_NORM / rho), jnp.float32),
                     local)
    p, ref_state = _adam_step(g, ref_state, p)
    for name in ("w", "b"):
      np.testing.assert_allclose(history[t][name], p[name], rtol=1e-5, atol=1e-6,
                                 err_msg=f"{name} step {t + 1}")
  assert clipped_any
  assert bool(_fields.field(state, "frozen"))
  _assert_trained(history, params, x, y, factor=1.0)  # devices disagree a lot: a high floor


# --- Masking and partitioning ---------------------------------------------------------------

def _pmean(axis_name):
  """Averages the gradients it sees: what leaves outside 1-bit Adam need under shard_map."""
  return optax.stateless(lambda g, _: jax.tree.map(lambda a: jax.lax.pmean(a, axis_name), g))


MASK = {"w": True, "b": False}


def test_masked_alone_leaves_local_gradients_on_the_other_leaves(mesh):
  # optax.masked passes the masked-out leaves' updates through unchanged: here
  # the raw local gradient of 'b', different on every device. init_sharded refuses
  # the chain, naming the leaf (and check_vma would refuse the step's out_specs).
  params, x, y = _problem()
  tx = optax.masked(onebit_optax.onebit_adam(LR, axis_name="data", freeze=K), MASK)
  with pytest.raises(ValueError, match=r"init_sharded: the updates of \['b'\] come out of "
                                       r"the optimizer per-device"):
    _train(mesh, tx, params, x, y, steps=1)


def _check_sgd_leaf_and_onebit_leaf(history, params0, x, y, state, specs):
  # 'b' follows plain SGD on the mean gradient, at every step (both phases).
  previous = params0
  for t, params in enumerate(history, 1):
    mean_grad = jax.tree.map(lambda a: a.mean(axis=0), _local_grads(previous, x, y))
    np.testing.assert_allclose(params["b"], previous["b"] - SGD_LR * mean_grad["b"],
                               rtol=1e-5, atol=1e-6, err_msg=f"b at step {t}")
    previous = params
  # 'w' follows Adam on its mean gradient during warmup (gradients evaluated
  # along the actual trajectory, which 'b' also shapes).
  adam, p = optax.adam(LR), params0
  adam_state = adam.init(p["w"])
  for t in range(K):
    g = jnp.asarray(_local_grads(history[t - 1] if t else params0, x, y)["w"].mean(0), jnp.float32)
    updates, adam_state = adam.update(g, adam_state)
    p = {"w": optax.apply_updates(history[t - 1]["w"] if t else params0["w"], updates)}
    np.testing.assert_allclose(history[t]["w"], p["w"], rtol=1e-5, atol=1e-6,
                               err_msg=f"w at step {t + 1}")
  onebit_state = [s for s in jax.tree.leaves(
      state, is_leaf=lambda s: isinstance(s, onebit_optax.ScaleByOnebitAdamState))
                  if isinstance(s, onebit_optax.ScaleByOnebitAdamState)]
  assert len(onebit_state) == 1
  (onebit_state,) = onebit_state
  assert bool(onebit_state.frozen) and int(onebit_state.freeze_step) == K
  # Only 'w' (36 params) is in 1-bit Adam's state and travels compressed (exact_below=0).
  assert [np.shape(v) for v in jax.tree.leaves(onebit_state.nu)] == [(FEATURES, OUTPUTS)]
  assert [u.shape for u in onebit_state.local_momentum] == [(N, 1, FEATURES, OUTPUTS)]
  assert onebit_state.momentum_message.shape == (
      N, _flat.onebit_row_bytes([FEATURES * OUTPUTS], N, exact_below=0))
  assert onebit_state.server_error.shape == (N, _flat.Bits([FEATURES * OUTPUTS], N).chunk)
  # state_partition_specs found the nested per-device buffers: local_momentum's one
  # entry, worker_scale and server_error.
  spec_leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
  assert sum(s == P("data") for s in spec_leaves) == 3
  _assert_trained(history, params0, x, y)


def test_two_masks_onebit_adam_and_averaged_sgd(mesh):
  params, x, y = _problem()
  not_mask = jax.tree.map(lambda m: not m, MASK)
  tx = optax.chain(
      optax.masked(onebit_optax.onebit_adam(LR, axis_name="data", freeze=K, exact_below=0),
                   MASK),
      optax.masked(optax.chain(_pmean("data"), optax.sgd(SGD_LR)), not_mask))
  history, state, specs = _train(mesh, tx, params, x, y)
  _check_sgd_leaf_and_onebit_leaf(history, params, x, y, state, specs)


def test_partition_onebit_adam_and_averaged_sgd(mesh):
  assert optax.multi_transform is optax.partition  # one test covers both names
  params, x, y = _problem(1)
  tx = optax.partition(
      {"onebit": onebit_optax.onebit_adam(LR, axis_name="data", freeze=K, exact_below=0),
       "sgd": optax.chain(_pmean("data"), optax.sgd(SGD_LR))},
      {"w": "onebit", "b": "sgd"})
  history, state, specs = _train(mesh, tx, params, x, y)
  _check_sgd_leaf_and_onebit_leaf(history, params, x, y, state, specs)


# --- inject_hyperparams -----------------------------------------------------------------------

def test_inject_hyperparams_learning_rate_edit_is_honoured(mesh):
  # Editing state.hyperparams between steps (the documented way to change a
  # hyperparameter at run time) scales the step exactly, in both phases: the
  # 1-bit Adam direction does not depend on the learning rate.
  params, x, y = _problem()
  tx = optax.inject_hyperparams(onebit_optax.onebit_adam)(
      learning_rate=LR, b1=0.9, axis_name="data", freeze=K, moment_dtype="float32")
  params, x, y = _place(mesh, params, x, y)
  state = onebit_optax.init_sharded(tx, params, mesh)
  specs = onebit_optax.state_partition_specs(state, "data")
  assert set(state.hyperparams) >= {"learning_rate", "b1", "b2", "eps"}

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                     out_specs=(P(), specs))
  def step(params, opt_state, x, y):
    grads = jax.grad(_loss)(onebit_optax.local_params(params, "data"), x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def with_lr(state, lr):
    hyper = dict(state.hyperparams, learning_rate=jax.device_put(
        jnp.asarray(lr, jnp.float32), NamedSharding(mesh, P())))
    return state._replace(hyperparams=hyper)

  for t in range(1, K + 4):
    if t in (2, K + 2):  # one warmup step, one compression step
      full, _ = jax.block_until_ready(step(params, with_lr(state, LR), x, y))
      half, _ = jax.block_until_ready(step(params, with_lr(state, LR / 2), x, y))
      for name in ("w", "b"):
        delta_full = np.asarray(full[name]) - np.asarray(params[name])
        delta_half = np.asarray(half[name]) - np.asarray(params[name])
        assert np.max(np.abs(delta_full)) > 0
        np.testing.assert_allclose(delta_half, delta_full / 2, rtol=1e-4, atol=1e-7,
                                   err_msg=f"{name} at step {t}")
    params, state = step(params, state, x, y)
    jax.block_until_ready(params)
  assert bool(_fields.field(state, "frozen"))


# --- Flax ---------------------------------------------------------------------------------

def test_flax_nnx_optimizer_single_device():
  params, x, y = _problem()
  model = nnx.Linear(FEATURES, OUTPUTS, rngs=nnx.Rngs(0))
  model.kernel[...] = jnp.asarray(params["w"])
  model.bias[...] = jnp.asarray(params["b"])
  tx = onebit_optax.onebit_adam(LR, axis_name=None, freeze=K)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def nnx_step(model, optimizer, x, y):
    grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)

  # Reference: the same transformation driven by hand on the params pytree, and
  # optax.adam for the warmup steps.
  @jax.jit
  def optax_step(p, s):
    updates, s = tx.update(jax.grad(_loss)(p, x, y), s, p)
    return optax.apply_updates(p, updates), s

  p, s = jax.tree.map(jnp.asarray, params), tx.init(params)
  adam, adam_p = optax.adam(LR), jax.tree.map(jnp.asarray, params)
  adam_s = adam.init(adam_p)
  for t in range(1, STEPS + 1):
    nnx_step(model, optimizer, x, y)
    p, s = optax_step(p, s)
    np.testing.assert_allclose(model.kernel[...], p["w"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(model.bias[...], p["b"], rtol=1e-6, atol=1e-7)
    if t <= K:
      adam_p, adam_s = _adam_step(jax.grad(_loss)(adam_p, x, y), adam_s, adam_p)
      np.testing.assert_allclose(model.kernel[...], adam_p["w"], rtol=1e-5, atol=1e-6)
  # status finds the state inside nnx's wrappers and unwraps its variables.
  status = onebit_optax.status(optimizer.opt_state, K)
  assert status.frozen is True and status.freeze_step == K and status.replicas_agree
  assert int(optimizer.step[...]) == STEPS


def _linen_model():
  return flax.linen.Dense(OUTPUTS)


def _linen_params(params):
  return {"params": {"kernel": jnp.asarray(params["w"]), "bias": jnp.asarray(params["b"])}}


def _linen_loss(apply_fn, variables, x, y):
  return jnp.mean((apply_fn(variables, x) - y) ** 2)


def test_linen_train_state_single_device():
  params, x, y = _problem()
  model = _linen_model()
  tx = onebit_optax.onebit_adam(LR, axis_name=None, freeze=K)
  state = train_state.TrainState.create(apply_fn=model.apply, params=_linen_params(params), tx=tx)

  @jax.jit
  def step(state):
    grads = jax.grad(lambda v: _linen_loss(state.apply_fn, v, x, y))(state.params)
    return state.apply_gradients(grads=grads)

  adam, adam_p = optax.adam(LR), jax.tree.map(jnp.asarray, params)
  adam_s = adam.init(adam_p)
  for t in range(1, STEPS + 1):
    state = step(state)
    if t <= K:
      adam_p, adam_s = _adam_step(jax.grad(_loss)(adam_p, x, y), adam_s, adam_p)
      np.testing.assert_allclose(state.params["params"]["kernel"], adam_p["w"],
                                 rtol=1e-5, atol=1e-6)
  assert int(state.step) == STEPS and bool(_fields.field(state.opt_state, "frozen"))
  assert _linen_loss(model.apply, state.params, x, y) < 0.8 * _loss(params, x, y)


def test_linen_train_state_inside_pmap():
  # tx.init needs the axis: TrainState.create runs inside the pmap too.
  params, x, y = _problem(2)
  model = _linen_model()
  tx = onebit_optax.onebit_adam(LR, axis_name="data", freeze=K)
  replicated = flax.jax_utils.replicate(_linen_params(params))
  state = jax.pmap(
      lambda v: train_state.TrainState.create(apply_fn=model.apply, params=v, tx=tx),
      axis_name="data")(replicated)
  # The per-device buffers under pmap: (devices, 1, ...). The bias (3) and the kernel (36)
  # are both under 64 elements: they travel as float32, nothing is compressed.
  s = state.opt_state[0]
  assert s.local_momentum == () and s.worker_scale.shape == (N, 1, 0)
  assert s.momentum_message.shape == (
      N, N, _flat.onebit_row_bytes([OUTPUTS, FEATURES * OUTPUTS], N))

  @functools.partial(jax.pmap, axis_name="data")
  def step(state, x, y):
    grads = jax.grad(lambda v: _linen_loss(state.apply_fn, v, x, y))(state.params)  # local
    return state.apply_gradients(grads=grads)

  xs, ys = x.reshape(N, LOCAL_BATCH, -1), y.reshape(N, LOCAL_BATCH, -1)
  adam, adam_p = optax.adam(LR), jax.tree.map(jnp.asarray, params)
  adam_s = adam.init(adam_p)
  for t in range(1, STEPS + 1):
    state = step(state, xs, ys)
    kernel = np.asarray(state.params["params"]["kernel"])
    assert np.all(kernel == kernel[0]), f"replicas diverged at step {t}"
    if t <= K:  # warmup: Adam on the mean of the 8 local gradients
      g = jax.tree.map(lambda a: jnp.asarray(a.mean(0), jnp.float32), _local_grads(adam_p, x, y))
      adam_p, adam_s = _adam_step(g, adam_s, adam_p)
      np.testing.assert_allclose(kernel[0], adam_p["w"], rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(_fields.field(state.opt_state, "frozen")))
  assert np.all(np.asarray(state.step) == STEPS)
  final = jax.tree.map(lambda a: a[0], state.params)
  assert _linen_loss(model.apply, final, x, y) < 0.8 * _loss(params, x, y)
