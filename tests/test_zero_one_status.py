"""status() on a 0/1 Adam state: the step kinds against DeepSpeed's schedule, written out here."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import onebit_optax

N = 8


def _reference_kinds(steps, var_freeze_step, kappa, local_steps=None, local_scaler=None):
  """Each step's kind from the rules of zoadam.py, written independently of the package."""
  kinds, interval, counter = [], 1, 0
  local_interval, local_counter, since_sync = 1, 0, 0
  for count in range(1, steps + 1):
    if count > var_freeze_step:
      if local_steps is None:
        kinds.append("sync")
        continue
      since_sync += 1
      kinds.append("sync" if since_sync >= local_interval else "local")
      if since_sync >= local_interval:
        since_sync = 0
      local_counter += 1
      if local_counter == local_scaler:
        local_counter, local_interval = 0, min(2 * local_interval, local_steps)
    elif count % interval == 0:
      kinds.append("variance")
      counter += 1
      if counter == kappa:
        counter, interval = 0, 2 * interval
    else:
      kinds.append("compressed")
  return kinds


def test_reference_schedule_is_the_papers():
  # kappa 2: variance steps 1, 2, then every 2nd (4, 6), every 4th (8, 12)...
  assert _reference_kinds(12, 11, 2) == (
      ["variance"] * 2 + ["compressed", "variance"] * 2 + ["compressed"] * 1 + ["variance"]
      + ["compressed"] * 3 + ["sync"])


def test_status_follows_the_schedule_on_one_device():
  tx = onebit_optax.zero_one_adam(1e-2, axis_name=None, var_freeze_step=11,
                                  var_update_scaler=2)
  params = {"w": jnp.linspace(-1.0, 1.0, 300), "b": jnp.ones(3)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  kinds = _reference_kinds(14, 11, 2)
  s = onebit_optax.status(state, var_freeze_step=11)
  assert (s.phase, s.step, s.next_variance_step, s.frozen) == ("none", 0, 1, False)
  for t, kind in enumerate(kinds, start=1):
    grads = jax.tree.map(lambda p: jnp.sin(3.0 * p + t), params)
    _, state = update(grads, state, params)
    s = onebit_optax.status(state, var_freeze_step=11)
    assert s.phase == kind and s.step == t, (t, s)
    assert s.variance_steps == kinds[:t].count("variance")
    later = [c for c in range(t + 1, 12) if kinds[c - 1] == "variance"]
    assert s.next_variance_step == (later[0] if later else None), (t, s)
    assert s.frozen == (t > 11) and s.replicas_agree and s.skipped_steps == 0
  assert "variance frozen after 5 variance steps" in str(s)


def test_status_without_var_freeze_step_says_what_it_does_not_know():
  tx = onebit_optax.zero_one_adam(1e-2, axis_name=None, var_freeze_step=2)
  params = {"w": jnp.ones(100)}
  state = tx.init(params)
  _, state = jax.jit(tx.update)(params, state, params)
  s = onebit_optax.status(state)
  assert s.frozen is None and any("var_freeze_step not given" in n for n in s.notes)
  for _ in range(2):
    _, state = jax.jit(tx.update)(params, state, params)
  assert onebit_optax.status(state).frozen is True  # a sync step ran: frozen


def test_status_of_a_pmap_state_with_local_steps():
  kinds = _reference_kinds(12, 4, 16, local_steps=4, local_scaler=2)
  schedule = lambda count: 1e-2 * jnp.ones((), jnp.float32)
  tx = onebit_optax.zero_one_adam(schedule, axis_name="data", var_freeze_step=4,
                                  local_steps=4, local_step_scaler=2)
  devices = jax.devices()[:N]
  params = {"w": np.stack([np.linspace(-1, 1, 200, dtype=np.float32)] * N)}
  state = jax.pmap(tx.init, axis_name="data", devices=devices)(params)

  @functools.partial(jax.pmap, axis_name="data", devices=devices)
  def step(params, opt_state, shift):
    local = onebit_optax.local_params(params, "data", opt_state)
    grads = jax.grad(lambda p: jnp.sum((p["w"] - shift) ** 2))(local)
    updates, opt_state = tx.update(grads, opt_state, params)
    return jax.tree.map(lambda p, u: p + u, params, updates), opt_state

  shift = np.arange(N, dtype=np.float32) / N
  for t, kind in enumerate(kinds, start=1):
    params, state = step(params, state, shift)
    s = onebit_optax.status(state, var_freeze_step=4)
    assert (s.phase, s.step) == (kind, t) and s.replicas_agree, (t, s)
    assert (s.last_step_bytes == 0.0) == (kind == "local"), (t, s)
    if kind == "local":
      assert s.steps_since_sync > 0
  assert s.local_interval == 4


def test_status_refuses_mixed_arguments():
  tx = onebit_optax.zero_one_adam(1e-2, axis_name=None, var_freeze_step=2)
  state = tx.init({"w": jnp.ones(3)})
  with pytest.raises(ValueError, match="pass var_freeze_step"):
    onebit_optax.status(state, b2=0.999)
  onebit_state = onebit_optax.onebit_adam(1e-2, axis_name=None).init({"w": jnp.ones(3)})
  with pytest.raises(ValueError, match="var_freeze_step= is for a 0/1 Adam state"):
    onebit_optax.status(onebit_state, var_freeze_step=3)


def test_a_skipped_call_is_named_where_the_step_is():
  """After 3 calls of which one was skipped, the summary says step 2 and why it is not 3."""
  tx = onebit_optax.zero_one_adam(1e-2, axis_name=None, var_freeze_step=10)
  params = {"w": jnp.ones(300)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  for g in (1.0, jnp.nan, 1.0):
    _, state = update({"w": jnp.full(300, g)}, state, params)
  s = onebit_optax.status(state, var_freeze_step=10)
  assert (s.step, s.skipped_steps, s.phase) == (2, 1, "variance")
  assert str(s).startswith("step 2 (3 calls, 1 skipped, not counted): last step variance")


def test_moments_of_a_zero_one_state_are_its_trees():
  tx = onebit_optax.zero_one_adam(1e-2, axis_name=None, var_freeze_step=10)
  params = {"w": jnp.ones(300), "b": jnp.ones(3)}
  state = tx.init(params)
  grads = {"w": jnp.linspace(-1.0, 1.0, 300), "b": jnp.full(3, 2.0)}
  _, state = jax.jit(tx.update)(grads, state, params)
  mu, nu = onebit_optax.moments(state, params)
  # One variance step from zero: Adam's first moments, raw (no bias correction).
  np.testing.assert_allclose(mu["w"], 0.1 * np.asarray(grads["w"]), rtol=1e-6)
  np.testing.assert_allclose(nu["b"], (np.float32(1) - np.float32(0.999)) * 4.0 * np.ones(3),
                             rtol=1e-6)
  with pytest.raises(ValueError, match="pass the params the optimizer was initialised with"):
    onebit_optax.moments(state, {"w": jnp.ones(301), "b": jnp.ones(3)})
