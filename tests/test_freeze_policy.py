"""When the variance freezes: variance_ratio_freeze and fixed_step_freeze against numpy."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import onebit_optax
import _fields

N = 8
D = 256  # gradient elements per device.
STEPS = 600
B1, B2 = 0.9, 0.99
INTERVAL = 50
THRESHOLD = 0.96
LATE_MIN_STEPS = 520  # after the variance has settled, and not a multiple of INTERVAL.


def _gradients(seed=0):
  """Per-device gradients (STEPS, N, D): noise whose scale decays, then stationary.

  The scale is 1 + 2 exp(-t/50): the mean gradient's variance falls by ~9x over
  the first ~250 steps and then only the noise is left. Meanwhile the raw v
  grows from 0 for ~1/(1-b2) = 100 steps, which a criterion on the raw v
  mistakes for stability.
  """
  rng = np.random.default_rng(seed)
  t = np.arange(1, STEPS + 1, dtype=np.float64)
  scale = 1.0 + 2.0 * np.exp(-t / 50.0)
  return (scale[:, None, None] * rng.standard_normal((STEPS, N, D))).astype(np.float32)


def _reference(mean_grads, min_steps):
  """The policy re-derived in numpy (float64) from its definition.

  Returns (freeze_step, checks) with checks[t] = (corrected ratio, raw ratio) at
  every check t = k * INTERVAL that has a reference (t >= 2 * INTERVAL).
  """
  v = np.zeros(mean_grads.shape[1])
  checks, previous, freeze = {}, None, None
  for t in range(1, len(mean_grads) + 1):
    g = mean_grads[t - 1].astype(np.float64)
    v = B2 * v + (1 - B2) * g * g
    corrected_l1 = np.sum(v / (1 - B2**t))
    raw_l1 = np.sum(v)
    if t % INTERVAL == 0:
      if previous is not None:
        ratio = corrected_l1 / previous[0]
        checks[t] = (ratio, raw_l1 / previous[1])
        if freeze is None and t >= min_steps and THRESHOLD <= ratio <= 1 / THRESHOLD:
          freeze = t
      previous = (corrected_l1, raw_l1)
  return freeze, checks


def _policy(min_steps):
  return onebit_optax.variance_ratio_freeze(
      min_steps=min_steps, threshold=THRESHOLD, interval=INTERVAL)


def _scan_flags(tx, grads, params):
  """Runs tx over the gradient sequence; returns per-step (frozen, freeze_step, ratio)."""
  def body(state, g):
    _, state = tx.update(g, state)
    return state, (_fields.field(state, "frozen"), _fields.field(state, "freeze_step"),
                   _fields.field(state, "variance_ratio"))
  _, flags = jax.lax.scan(body, tx.init(params), grads)
  return flags


@pytest.fixture(scope="module")
def grads():
  return _gradients()


@pytest.fixture(scope="module")
def reference(grads):
  mean = grads.mean(axis=1, dtype=np.float32)
  early, checks = _reference(mean, min_steps=0)
  late, _ = _reference(mean, min_steps=LATE_MIN_STEPS)
  return early, late, checks


def test_reference_sequence_has_the_intended_shape(reference):
  # The scenario the policy tests below rely on; if this fails, retune _gradients.
  early, late, checks = reference
  assert early == 450 and late == 550
  # Every decision is clear of the band's edges by far more than float32 error.
  for ratio, _ in checks.values():
    assert min(abs(ratio - THRESHOLD), abs(ratio - 1 / THRESHOLD)) > 1e-3, checks
  # Stable checks exist before LATE_MIN_STEPS, so min_steps is what delays the freeze.
  assert any(THRESHOLD <= checks[t][0] <= 1 / THRESHOLD for t in checks if t < LATE_MIN_STEPS)


def _assert_matches_reference(frozen, freeze_step, ratio, expected_step, checks):
  frozen, freeze_step, ratio = map(np.asarray, (frozen, freeze_step, ratio))
  t = np.arange(1, STEPS + 1)
  np.testing.assert_array_equal(frozen, t >= expected_step)
  np.testing.assert_array_equal(freeze_step, np.where(t >= expected_step, expected_step, 0))
  # Before any comparison the logged ratio is NaN; afterwards it is the last check's.
  assert np.all(np.isnan(ratio[:2 * INTERVAL - 1]))
  for check, (expected_ratio, _) in checks.items():
    if check <= expected_step:
      np.testing.assert_allclose(ratio[check - 1], expected_ratio, rtol=1e-4)


def test_variance_ratio_freeze_single_device(grads, reference):
  early, late, checks = reference
  mean = jnp.asarray(grads.mean(axis=1, dtype=np.float32))
  params = jnp.zeros((D,), jnp.float32)

  @jax.jit
  def run(mean):
    return [_scan_flags(onebit_optax.scale_by_onebit_adam(
        B1, B2, axis_name=None, freeze=_policy(m)), mean, params) for m in (0, LATE_MIN_STEPS)]

  (frozen0, step0, ratio0), (frozen1, step1, ratio1) = run(mean)
  _assert_matches_reference(frozen0, step0, ratio0, early, checks)
  _assert_matches_reference(frozen1, step1, ratio1, late, checks)
  # Never before min_steps, although the variance was already stable at `early`.
  assert not np.any(np.asarray(frozen1)[:LATE_MIN_STEPS])
  assert THRESHOLD <= float(ratio1[early - 1]) <= 1 / THRESHOLD


def test_raw_variance_criterion_would_fire_during_warmup(grads, reference):
  # At the first comparison (t = 2 * INTERVAL) the gradients are still shrinking
  # fast, yet the raw v has grown, because it is still filling up from zero: a
  # criterion on the raw v reads that as stability and fires 350 steps early.
  early, _, checks = reference
  first = 2 * INTERVAL
  corrected, raw = checks[first]
  print(f"\n[freeze] t={first}: ratio of bias-corrected v {corrected:.3f}, of raw v "
        f"{raw:.3f}; variance_ratio_freeze fires at t={early}")
  assert raw >= THRESHOLD and raw <= 1 / THRESHOLD  # even a two-sided raw test fires
  assert corrected < THRESHOLD
  assert early > first
  # And the optimizer indeed did not fire there.
  mean = jnp.asarray(grads.mean(axis=1, dtype=np.float32))[:first]
  tx = onebit_optax.scale_by_onebit_adam(B1, B2, axis_name=None, freeze=_policy(0))
  frozen, _, ratio = jax.jit(lambda g: _scan_flags(tx, g, jnp.zeros((D,))))(mean)
  assert not np.any(np.asarray(frozen))
  np.testing.assert_allclose(float(ratio[-1]), corrected, rtol=1e-4)


def test_variance_ratio_freeze_on_8_devices_all_agree(grads, reference):
  early, late, checks = reference
  mesh = jax.make_mesh((N,), ("data",))
  params = jnp.zeros((D,), jnp.float32)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(None, "data"), out_specs=P("data"))
  def run(local_grads):  # (STEPS, 1, D): this device's gradients.
    out = []
    for m in (0, LATE_MIN_STEPS):
      tx = onebit_optax.scale_by_onebit_adam(B1, B2, axis_name="data", freeze=_policy(m))
      # Each device reports its own flags (one row per device).
      out.append(jax.tree.map(lambda x: x[None], _scan_flags(tx, local_grads[:, 0], params)))
    return out

  sharded = jax.device_put(grads, NamedSharding(mesh, P(None, "data")))
  results = jax.tree.map(np.asarray, run(sharded))
  for (frozen, step, ratio), expected in zip(results, (early, late)):
    assert frozen.shape == (N, STEPS)
    for device in range(N):  # every device decided the same thing at every step
      np.testing.assert_array_equal(frozen[device], frozen[0])
      np.testing.assert_array_equal(step[device], step[0])
      np.testing.assert_array_equal(ratio[device], ratio[0])
    _assert_matches_reference(frozen[0], step[0], ratio[0], expected, checks)


def test_fixed_step_freeze_switches_exactly_after_step_k():
  k, steps = 7, 12
  rng = np.random.default_rng(1)
  grads = jnp.asarray(rng.standard_normal((steps, 5)), jnp.float32)
  params = jnp.zeros((5,), jnp.float32)
  tx = onebit_optax.scale_by_onebit_adam(
      B1, B2, axis_name=None, freeze=onebit_optax.fixed_step_freeze(k))
  adam = optax.scale_by_adam(B1, B2)
  state, adam_state = tx.init(params), adam.init(params)
  update, adam_update = jax.jit(tx.update), jax.jit(adam.update)
  for t in range(1, steps + 1):
    nu_before = np.asarray(state.nu)
    updates, state = update(grads[t - 1], state)
    adam_updates, adam_state = adam_update(grads[t - 1], adam_state)
    assert bool(_fields.field(state, "frozen")) == (t >= k), t
    assert int(_fields.field(state, "freeze_step")) == (k if t >= k else 0), t
    if t <= k:  # warmup, including step k itself, is Adam
      np.testing.assert_allclose(updates, adam_updates, rtol=1e-5, atol=1e-7)
    else:  # compression: v no longer moves, and the update is no longer Adam's
      np.testing.assert_array_equal(np.asarray(state.nu), nu_before)
      assert not np.allclose(updates, adam_updates, rtol=1e-3)
  # An int k means fixed_step_freeze(k).
  tx_int = onebit_optax.scale_by_onebit_adam(B1, B2, axis_name=None, freeze=k)
  frozen, step, _ = jax.jit(lambda g: _scan_flags(tx_int, g, params))(grads)
  np.testing.assert_array_equal(frozen, np.arange(1, steps + 1) >= k)
  assert int(step[-1]) == k


@pytest.mark.parametrize("kwargs, words", [
    (dict(threshold=0.0), ["threshold", "(0, 1]"]),
    (dict(threshold=1.5), ["threshold", "(0, 1]"]),
    (dict(threshold=-0.5), ["threshold", "(0, 1]"]),
    (dict(interval=0), ["interval", "positive"]),
    (dict(interval=-3), ["interval", "positive"]),
    (dict(min_steps=-1), ["min_steps", ">= 0"]),
])
def test_variance_ratio_freeze_validation(kwargs, words):
  with pytest.raises(ValueError) as excinfo:
    onebit_optax.variance_ratio_freeze(**kwargs)
  for word in words:
    assert word in str(excinfo.value), str(excinfo.value)


def test_variance_ratio_freeze_accepts_the_edges():
  assert onebit_optax.variance_ratio_freeze(threshold=1.0, interval=1, min_steps=0) == (
      onebit_optax.VarianceRatioFreeze(threshold=1.0, interval=1, min_steps=0))
  assert onebit_optax.variance_ratio_freeze().interval is None  # default: 1 / (1 - b2)


@pytest.mark.parametrize("step", [0, -5])
def test_fixed_step_freeze_validation(step):
  with pytest.raises(ValueError, match=r"step >= 1"):
    onebit_optax.fixed_step_freeze(step)
  with pytest.raises(ValueError, match=r"interval"):
    onebit_optax.fixed_step_freeze(3, interval=0)


def test_max_steps_freezes_a_drifting_variance():
  """A variance that grows 10% per interval never looks stable; max_steps bounds the warmup."""
  tx = onebit_optax.scale_by_onebit_adam(
      b2=0.9, axis_name=None,
      freeze=onebit_optax.variance_ratio_freeze(interval=5, max_steps=37))
  params = {"w": jnp.ones(4)}
  state = tx.init(params)
  step = jax.jit(tx.update)
  frozen_at = None
  for t in range(1, 60):
    grads = {"w": jnp.full(4, 1.1 ** (t / 5.0 * 0.5))}  # E[g^2] grows 10% per 5 steps
    _, state = step(grads, state)
    if frozen_at is None and bool(_fields.field(state, "frozen")):
      frozen_at = t
  assert frozen_at == 37
  assert int(_fields.field(state, "freeze_step")) == 37
  ratio = float(_fields.field(state, "variance_ratio"))
  assert ratio > 1 / 0.96  # it was never in the band


def test_max_steps_validation():
  with pytest.raises(ValueError, match="max_steps"):
    onebit_optax.variance_ratio_freeze(min_steps=10, max_steps=5)
