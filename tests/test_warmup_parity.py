"""Warmup parity: before the freeze, 1-bit Adam on 8 devices is optax.adam(w) on the mean gradient.

The reference never sees the per-device split: it runs ``optax.adam`` /
``optax.adamw`` on one device, fed ``jax.grad`` of the mean loss over the full
batch. The 1-bit run takes *local* gradients on 8 devices (a different data
shard each) inside ``jax.shard_map`` and has to do the averaging itself, with a
freeze policy that cannot fire. Any difference in the moments, the bias
correction, the averaging, weight decay or the learning-rate schedule shows up
in the parameters after a few steps.
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import optax
import pytest

import onebit_optax
import _fields

NUM_DEVICES = 8
NUM_STEPS = 25
FEATURES, OUTPUTS, LOCAL_BATCH = 13, 3, 16
# float32 differences between "pmean of 8 local gradients" and "gradient of the
# full-batch mean loss" are a few ulps of the gradient; Adam divides them by
# sqrt(v), so the parameters agree to a few 1e-7 relative (measured: at most 0.26 of
# the tolerance below over all tests). The moments are compared with an absolute
# tolerance relative to their leaf's largest entry, because an entry that is
# crossing zero has a large relative error from rounding alone.
RTOL, ATOL = 1e-6, 1e-7


def _loss(params, x, y):
  pred = x @ params["w"] + params["b"]
  return 0.5 * jnp.mean(jnp.sum((pred - y) ** 2, axis=-1))


def _problem(seed=0):
  """A linear regression whose data differs per device and whose gradients stay far from 0."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(NUM_DEVICES * LOCAL_BATCH, FEATURES)).astype(np.float32)
  # A different optimum per device shard, so the local gradients really differ.
  w_true = rng.normal(size=(NUM_DEVICES, FEATURES, OUTPUTS)) * 3.0 + 5.0
  y = np.einsum("dbf,dfo->dbo", x.reshape(NUM_DEVICES, LOCAL_BATCH, FEATURES), w_true)
  y = (y.reshape(-1, OUTPUTS) + 4.0).astype(np.float32)
  params = {"w": jnp.asarray(rng.normal(size=(FEATURES, OUTPUTS)), jnp.float32) * 0.1,
            "b": jnp.zeros((OUTPUTS,), jnp.float32)}
  return params, x, y


def _run_and_compare(onebit_tx, reference_tx):
  mesh = jax.make_mesh((NUM_DEVICES,), ("data",))
  params0, x, y = _problem()

  params = jax.device_put(params0, NamedSharding(mesh, P()))
  opt_state = onebit_optax.init_sharded(onebit_tx, params, mesh)
  specs = onebit_optax.state_partition_specs(opt_state, "data")

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                     out_specs=(P(), specs))
  def onebit_step(params, opt_state, x, y):
    grads = jax.grad(_loss)(onebit_optax.local_params(params, "data"), x, y)
    updates, opt_state = onebit_tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  @jax.jit
  def reference_step(params, opt_state, x, y):
    grads = jax.grad(_loss)(params, x, y)  # the full batch on one device
    updates, opt_state = reference_tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  x_sharded = jax.device_put(x, NamedSharding(mesh, P("data")))
  y_sharded = jax.device_put(y, NamedSharding(mesh, P("data")))
  device = jax.devices()[0]
  ref_params = jax.device_put(params0, device)
  ref_state = reference_tx.init(ref_params)
  x_ref, y_ref = jax.device_put(x, device), jax.device_put(y, device)

  moved = 0.0
  for step in range(1, NUM_STEPS + 1):
    params, opt_state = onebit_step(params, opt_state, x_sharded, y_sharded)
    ref_params, ref_state = reference_step(ref_params, ref_state, x_ref, y_ref)
    for name in ("w", "b"):
      np.testing.assert_allclose(
          np.asarray(params[name]), np.asarray(ref_params[name]), rtol=RTOL, atol=ATOL,
          err_msg=f"params[{name!r}] after step {step}")
    # The flat state read back as trees (during warmup nu is Adam's raw v).
    onebit_moments = dict(zip(("mu", "nu"), onebit_optax.moments(opt_state, params0)))
    adam_moments = ref_state[0]
    for field in ("mu", "nu"):
      for name in ("w", "b"):
        expected = np.asarray(getattr(adam_moments, field)[name])
        np.testing.assert_allclose(
            np.asarray(onebit_moments[field][name]), expected, rtol=RTOL,
            atol=RTOL * np.max(np.abs(expected)), err_msg=f"{field}[{name!r}] after step {step}")
    moved = max(moved, float(jnp.max(jnp.abs(params["w"] - params0["w"]))))

  assert not bool(_fields.field(opt_state, "frozen"))
  assert int(_fields.field(opt_state, "freeze_step")) == 0
  assert int(opt_state[0].count) == NUM_STEPS
  # The comparison is meaningful only if the parameters travelled well beyond the tolerance.
  assert moved > 0.05, moved


def test_warmup_matches_adam_on_mean_gradient():
  never = onebit_optax.fixed_step_freeze(10**6)
  _run_and_compare(
      onebit_optax.onebit_adam(1e-2, b1=0.9, b2=0.999, eps=1e-8, axis_name="data",
                               freeze=never),
      optax.adam(1e-2, b1=0.9, b2=0.999, eps=1e-8))


def test_warmup_matches_adam_with_other_hyperparameters():
  # Unusual b1/b2/eps catch a swapped or hard-coded hyperparameter.
  never = onebit_optax.fixed_step_freeze(10**6)
  _run_and_compare(
      onebit_optax.onebit_adam(3e-2, b1=0.5, b2=0.9, eps=1e-3, axis_name="data", freeze=never),
      optax.adam(3e-2, b1=0.5, b2=0.9, eps=1e-3))


@pytest.mark.parametrize("masked", [False, True], ids=["decay_all", "decay_w_only"])
def test_warmup_matches_adamw_with_schedule(masked):
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=5e-2, warmup_steps=5, decay_steps=NUM_STEPS, end_value=1e-3)
  mask = {"w": True, "b": False} if masked else None
  never = onebit_optax.fixed_step_freeze(10**6)
  _run_and_compare(
      onebit_optax.onebit_adam(schedule, weight_decay=0.1, axis_name="data", freeze=never,
                               mask=mask),
      optax.adamw(schedule, weight_decay=0.1, mask=mask))
