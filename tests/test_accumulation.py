"""Gradient accumulation: micro-batches inside the step, one set of collectives per step.

``accumulate_gradients`` scans over micro-batches and returns the mean local
gradient without communicating; ``tx.update`` then communicates once. Checked:

* the accumulated gradient is the full-batch gradient (numpy, by hand);
* the compiled shard_map step has exactly the collectives of the step without
  accumulation, for 1, 4 and 8 micro-batches (counted in the HLO);
* training with 4 micro-batches follows the run without accumulation;
* ``optax.MultiSteps(onebit_adam)`` would call the inner update, and so its
  collectives, on every mini-step: it is refused with an error that names
  ``accumulate_gradients``, under pmap and under shard_map.
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
import _fields
import _hlo

N = 8
FEATURES, OUTPUTS, LOCAL_BATCH = 10, 3, 16
FREEZE_AT, STEPS, LR = 5, 25, 0.02
FAST_CODEGEN = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _loss(params, batch):
  x, y = batch
  return 0.5 * jnp.mean(jnp.sum((x @ params["w"] + params["b"] - y) ** 2, axis=-1))


def _numpy_grad(params, x, y):
  """d/dparams of 0.5 * mean_batch ||x w + b - y||^2, by hand (float64)."""
  w, b = np.asarray(params["w"], np.float64), np.asarray(params["b"], np.float64)
  residual = x @ w + b - y
  return {"w": x.T @ residual / len(x), "b": residual.mean(axis=0)}


def _problem(seed=0):
  rng = np.random.default_rng(seed)
  params = {"w": (0.1 * rng.standard_normal((FEATURES, OUTPUTS))).astype(np.float32),
            "b": np.zeros((OUTPUTS,), np.float32)}
  x = rng.standard_normal((N * LOCAL_BATCH, FEATURES)).astype(np.float32)
  w_true = rng.standard_normal((FEATURES, OUTPUTS))
  y = (x @ w_true + 0.3 * rng.standard_normal((N * LOCAL_BATCH, OUTPUTS))).astype(np.float32)
  return params, x, y


@pytest.mark.parametrize("k", [1, 4, 8, 16])
def test_accumulated_gradient_is_the_full_batch_gradient(k):
  params, x, y = _problem()
  x, y = x[:LOCAL_BATCH], y[:LOCAL_BATCH]
  expected = _numpy_grad(params, x, y)

  def loss_with_aux(p, batch):
    return _loss(p, batch), {"rows": jnp.float32(batch[0].shape[0])}

  (loss, aux), grads = jax.jit(functools.partial(
      onebit_optax.accumulate_gradients, loss_with_aux, num_microbatches=k, has_aux=True))(
          params, (x, y))
  for name in ("w", "b"):
    np.testing.assert_allclose(np.asarray(grads[name]), expected[name], rtol=1e-5, atol=1e-6)
  residual = x @ params["w"] + params["b"] - y
  np.testing.assert_allclose(float(loss), 0.5 * np.mean(np.sum(residual ** 2, -1)), rtol=1e-5)
  assert float(aux["rows"]) == LOCAL_BATCH / k  # aux is the mean over micro-batches


def _collective_counts(compiled):
  module = _hlo.HloModule(compiled.as_text())
  return collections.Counter(
      (c.collective, tuple(sorted(c.dtypes)))
      for c in module.collectives(module.reachable([module.entry])))


class _ShardMapRun:
  """The README step, with the gradient from accumulate_gradients (k) or jax.grad (None)."""

  def __init__(self, mesh, k):
    params, x, y = _problem()
    self.tx = tx = onebit_optax.onebit_adam(LR, axis_name="data", freeze=FREEZE_AT)
    self.params0 = jax.device_put(params, NamedSharding(mesh, P()))
    self.state0 = onebit_optax.init_sharded(tx, self.params0, mesh)
    specs = onebit_optax.state_partition_specs(self.state0, "data")

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                       out_specs=(P(), specs, P()))
    def step(params, opt_state, x, y):
      local = onebit_optax.local_params(params, "data")
      if k is None:
        loss, grads = jax.value_and_grad(_loss)(local, (x, y))
      else:
        loss, grads = onebit_optax.accumulate_gradients(_loss, local, (x, y), k)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

    self.x, self.y = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
    self.compiled = jax.jit(step).lower(
        self.params0, self.state0, self.x, self.y).compile(FAST_CODEGEN)

  def train(self, steps):
    params, state, history = self.params0, self.state0, []
    for _ in range(steps):
      params, state, _ = self.compiled(params, state, self.x, self.y)
      history.append(jax.tree.map(np.asarray, params))  # waits: one step in flight
    return history, state


@pytest.fixture(scope="module")
def runs():
  mesh = jax.make_mesh((N,), ("data",))
  return {k: _ShardMapRun(mesh, k) for k in (None, 1, 4, 8)}


def test_one_set_of_collectives_whatever_the_number_of_microbatches(runs):
  counts = {k: _collective_counts(run.compiled) for k, run in runs.items()}
  print("\n[collectives per step] " + "; ".join(f"k={k}: {dict(c)}" for k, c in counts.items()))
  # Warmup all-reduce, the loss pmean, and the compression branch's two packed collectives.
  assert counts[None] == {("all-reduce", ("f32",)): 2, ("all-to-all", ("u8",)): 1,
                          ("all-gather", ("u8",)): 1}, counts[None]
  for k in (1, 4, 8):
    assert counts[k] == counts[None], (k, counts[k])


def test_training_with_microbatches_follows_the_full_batch_run(runs):
  """Tolerance 1e-4 * max|w| over 25 steps (20 in the compression phase).

  The accumulated gradient differs from the full-batch one only by float32
  summation order (~1e-7 relative); the compression phase feeds it through
  sign decisions, so a value within rounding of 0 could flip one sign bit and
  move the step by ~2 * scale / 8 for one chunk. Measured worst: 5e-7 relative.
  """
  full, state_full = runs[None].train(STEPS)
  micro, state_micro = runs[4].train(STEPS)
  assert bool(_fields.field(state_full, "frozen")) and bool(_fields.field(state_micro, "frozen"))
  worst = 0.0
  for t, (a, b) in enumerate(zip(full, micro), 1):
    for name in ("w", "b"):
      scale = np.max(np.abs(full[-1]["w"]))
      worst = max(worst, float(np.max(np.abs(a[name] - b[name])) / scale))
      np.testing.assert_allclose(b[name], a[name], rtol=0, atol=1e-4 * scale,
                                 err_msg=f"{name} at step {t}")
  print(f"\n[accumulation k=4 vs full batch] worst |diff| / max|w|: {worst:.2e}")
  # The run moved far from the start, so the closeness is not trivial.
  params0 = _problem()[0]
  assert np.max(np.abs(full[-1]["w"] - params0["w"])) > 0.1


MICRO = 4


def test_optax_multisteps_is_refused_and_accumulate_gradients_communicates_once():
  # One optimizer step over MICRO micro-batches, written both ways under pmap;
  # the HLO of each holds the collectives it will execute.
  params, x, y = _problem()
  xs = x.reshape(N, MICRO, LOCAL_BATCH // MICRO, FEATURES)
  ys = y.reshape(N, MICRO, LOCAL_BATCH // MICRO, OUTPUTS)
  replicated = jax.tree.map(lambda a: np.stack([a] * N), params)

  onebit = onebit_optax.onebit_adam(LR, axis_name="data", freeze=FREEZE_AT)
  multi = optax.MultiSteps(onebit, every_k_schedule=MICRO)

  def multisteps_step(params, state, xs, ys):
    for j in range(MICRO):  # MICRO calls, as a training loop would make
      grads = jax.grad(_loss)(params, (xs[j], ys[j]))
      updates, state = multi.update(grads, state, params)
      params = optax.apply_updates(params, updates)
    return params, state

  def accumulate_step(params, state, xs, ys):
    batch = (xs.reshape((-1,) + xs.shape[2:]), ys.reshape((-1,) + ys.shape[2:]))
    _, grads = onebit_optax.accumulate_gradients(_loss, params, batch, MICRO)
    updates, state = onebit.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = jax.pmap(onebit.init, axis_name="data")(replicated)
  compiled = jax.pmap(accumulate_step, axis_name="data").lower(
      replicated, state, xs, ys).compile()
  counts = _collective_counts(compiled)
  print(f"\n[one optimizer step, {MICRO} micro-batches] {counts}")
  assert counts == {("all-reduce", ("f32",)): 1, ("all-to-all", ("u8",)): 1,
                    ("all-gather", ("u8",)): 1}

  # MultiSteps would run the inner update, and its collectives, on every one
  # of the MICRO mini-steps (it keeps the result every MICRO-th): refused.
  state = jax.pmap(multi.init, axis_name="data")(replicated)
  with pytest.raises(ValueError, match="onebit_optax.accumulate_gradients"):
    jax.pmap(multisteps_step, axis_name="data").lower(replicated, state, xs, ys)

  # Under shard_map (where its replicated accumulator used to be taken for
  # all-reduced gradients): the same error.
  mesh = jax.make_mesh((N,), ("data",))
  state = onebit_optax.init_sharded(multi, params, mesh)
  specs = onebit_optax.state_partition_specs(state, "data")
  assert specs.acc_grads == {"w": P(), "b": P()}

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                     out_specs=(P(), specs))
  def step(params, state, x, y):
    grads = jax.grad(_loss)(onebit_optax.local_params(params, "data"), (x, y))
    updates, state = multi.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = jax.device_put(params, NamedSharding(mesh, P()))
  x, y = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
  with pytest.raises(ValueError, match="onebit_optax.accumulate_gradients"):
    jax.jit(step).lower(params, state, x, y)
