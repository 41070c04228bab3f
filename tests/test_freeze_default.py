"""The default freeze rule fires early in a short run with a stationary variance, not while it moves.

The default is ``variance_ratio_freeze(min_steps=W)`` with b2 = 0.999 (optax's):
threshold 0.96 and, documented in ``default_interval``, a check every
Δ = min(ceil(W / 4), round(1 / (1 - b2))) steps. The reference below recomputes
the bias-corrected second moment in numpy and applies the documented rule; it
shares no code with the library.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import onebit_optax
import _fields

B2 = 0.999  # optax's default, and onebit_adam's.
WARMUP = 30  # min_steps: the LR warmup of a 600-step run at 5%.
STEPS = 200
DIM = 512


def documented_default_interval(min_steps, b2):
  window = round(1 / (1 - b2))
  return window if min_steps == 0 else min(math.ceil(min_steps / 4), window)


def reference_freeze_step(grads, b2, interval, threshold, min_steps):
  """The documented rule on numpy's bias-corrected ||v_hat_t||_1; None if it never fires."""
  nu = np.zeros(grads.shape[1], np.float64)
  reference = None
  for t, g in enumerate(grads.astype(np.float64), start=1):
    nu = b2 * nu + (1 - b2) * g * g
    l1 = np.sum(nu) / (1 - b2 ** t)
    if t % interval:
      continue
    if reference is not None and t >= min_steps and threshold <= l1 / reference <= 1 / threshold:
      return t
    reference = l1
  return None


def synthetic_grads(growth_per_step: float, seed: int = 0):
  """Gaussian gradients with fixed per-coordinate scales, times growth**t."""
  rng = np.random.default_rng(seed)
  scale = rng.uniform(0.5, 2.0, DIM)
  growth = growth_per_step ** np.arange(STEPS)
  return (rng.standard_normal((STEPS, DIM)) * scale * growth[:, None]).astype(np.float32)


def library_freeze_step(grads, policy):
  tx = onebit_optax.scale_by_onebit_adam(b2=B2, axis_name=None, freeze=policy)

  @jax.jit
  def run(grads):
    def body(state, g):
      _, state = tx.update(g, state)
      return state, None
    state, _ = jax.lax.scan(body, tx.init(jnp.zeros(DIM)), grads)
    return _fields.field(state, "frozen"), _fields.field(state, "freeze_step")

  frozen, step = run(jnp.asarray(grads))
  return int(step) if bool(frozen) else None


def test_default_fires_soon_after_the_warmup_when_the_variance_is_stationary():
  grads = synthetic_grads(1.0)
  interval = documented_default_interval(WARMUP, B2)
  expected = reference_freeze_step(grads, B2, interval, 0.96, WARMUP)
  assert expected is not None and WARMUP <= expected <= WARMUP + interval
  assert library_freeze_step(grads, onebit_optax.variance_ratio_freeze(WARMUP)) == expected


@pytest.mark.parametrize("growth", [1.02, 1 / 1.02])
def test_default_does_not_fire_while_the_variance_moves(growth):
  # The gradient's scale changes 2% per step (its square ~4%): over one interval
  # of 8 steps the mean square moves by far more than the 4% band allows.
  grads = synthetic_grads(growth)
  interval = documented_default_interval(WARMUP, B2)
  assert reference_freeze_step(grads, B2, interval, 0.96, WARMUP) is None
  assert library_freeze_step(grads, onebit_optax.variance_ratio_freeze(WARMUP)) is None


def test_the_seed_criterion_is_one_configuration():
  """Δ = 1/(1-b2) = 1000, the seed's rule: its first check that may fire is at 2000."""
  grads = synthetic_grads(1.0)
  seed_rule = onebit_optax.variance_ratio_freeze(WARMUP, threshold=0.96, interval=1000)
  assert library_freeze_step(grads, seed_rule) is None
  assert reference_freeze_step(grads, B2, 1000, 0.96, WARMUP) is None
  # Without min_steps the default is the seed's interval.
  assert documented_default_interval(0, B2) == 1000
  assert library_freeze_step(grads, onebit_optax.variance_ratio_freeze()) is None
