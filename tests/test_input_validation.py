"""Step counts of the freeze policies: whole numbers or a clear error, never a silent int()."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import onebit_optax
import _fields


def _assert_words(excinfo, *words):
  message = str(excinfo.value)
  for word in words:
    assert word in message, f"{word!r} not in: {message}"


# --- fixed_step_freeze --------------------------------------------------------------------

@pytest.mark.parametrize("step", [2.7, 100.5, np.float32(2.5), np.float64(1e3 + 0.25)])
def test_fixed_step_refuses_a_fractional_step(step):
  # Before: fixed_step_freeze(2.7) printed FixedStepFreeze(step=2, ...).
  with pytest.raises(ValueError) as excinfo:
    onebit_optax.fixed_step_freeze(step)
  _assert_words(excinfo, "fixed_step_freeze", "step=", "not a whole number", "pass an int")


@pytest.mark.parametrize("step", ["100", b"100", True, np.bool_(True), None, [10]])
def test_fixed_step_refuses_a_non_number(step):
  with pytest.raises(TypeError) as excinfo:
    onebit_optax.fixed_step_freeze(step)
  _assert_words(excinfo, "fixed_step_freeze", "whole number of steps")


@pytest.mark.parametrize("step,expected", [
    (400, 400), (np.int64(400), 400), (np.int32(7), 7), (400.0, 400), (np.float32(12.0), 12),
    (jnp.array(9), 9)])
def test_fixed_step_accepts_whole_numbers_as_python_ints(step, expected):
  policy = onebit_optax.fixed_step_freeze(step)
  assert policy.step == expected and type(policy.step) is int


@pytest.mark.parametrize("interval", [0.5, 99.9, "10"])
def test_fixed_step_refuses_a_fractional_interval(interval):
  with pytest.raises((ValueError, TypeError)) as excinfo:
    onebit_optax.fixed_step_freeze(100, interval=interval)
  _assert_words(excinfo, "interval=", "whole number")


def test_fixed_step_below_one_keeps_its_message():
  with pytest.raises(ValueError) as excinfo:
    onebit_optax.fixed_step_freeze(0.0)
  _assert_words(excinfo, "step >= 1")


# --- variance_ratio_freeze ----------------------------------------------------------------

@pytest.mark.parametrize("name,value", [
    ("interval", 2.5), ("interval", np.float32(10.1)), ("min_steps", 1.5),
    ("min_steps", 99.99), ("max_steps", 10.2)])
def test_variance_ratio_refuses_fractional_steps(name, value):
  with pytest.raises(ValueError) as excinfo:
    onebit_optax.variance_ratio_freeze(**{name: value})
  _assert_words(excinfo, "variance_ratio_freeze", f"{name}=", "not a whole number")


@pytest.mark.parametrize("name,value", [
    ("interval", "100"), ("min_steps", True), ("max_steps", "500")])
def test_variance_ratio_refuses_non_numbers(name, value):
  with pytest.raises(TypeError) as excinfo:
    onebit_optax.variance_ratio_freeze(**{name: value})
  _assert_words(excinfo, f"{name}=", "whole number of steps")


@pytest.mark.parametrize("name,value,words", [
    ("interval", 0, ("interval must be a positive number",)),
    ("min_steps", -1, ("min_steps must be >= 0",)),
    ("max_steps", 0, ("max_steps=0 must be >= 1",))])
def test_variance_ratio_refuses_steps_out_of_range(name, value, words):
  with pytest.raises(ValueError) as excinfo:
    onebit_optax.variance_ratio_freeze(**{name: value})
  _assert_words(excinfo, *words)


def test_variance_ratio_max_steps_below_min_steps():
  with pytest.raises(ValueError) as excinfo:
    onebit_optax.variance_ratio_freeze(min_steps=100, max_steps=50)
  _assert_words(excinfo, "max_steps=50", "min_steps=100")


def test_variance_ratio_accepts_whole_numbers_as_python_ints():
  policy = onebit_optax.variance_ratio_freeze(
      np.int64(10), interval=50.0, max_steps=np.int32(400))
  assert policy == onebit_optax.VarianceRatioFreeze(0.96, 50, 10, 400)
  assert all(type(x) is int for x in (policy.interval, policy.min_steps, policy.max_steps))


# --- freeze= given to the optimizer -------------------------------------------------------

def test_numpy_integer_freeze_is_a_fixed_step():
  # Before: np.int64(5) was "not a freeze policy" while 5 was accepted.
  tx = onebit_optax.onebit_adam(0.1, axis_name=None, freeze=np.int64(2))
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  for _ in range(3):
    _, state = tx.update({"w": jnp.ones(3)}, state, params)
  assert int(_fields.field(state, "freeze_step")) == 2


def test_injected_fractional_freeze_is_refused_at_init():
  # inject_hyperparams turns freeze=2.7 into a float32 array: it used to be taken as is.
  tx = optax.inject_hyperparams(onebit_optax.onebit_adam)(0.1, axis_name=None, freeze=2.7)
  with pytest.raises(TypeError) as excinfo:
    tx.init({"w": jnp.ones(3)})
  _assert_words(excinfo, "freeze", "integer")


def test_injected_freeze_below_one_is_refused_at_init():
  tx = optax.inject_hyperparams(onebit_optax.onebit_adam)(0.1, axis_name=None, freeze=0)
  with pytest.raises(ValueError) as excinfo:
    tx.init({"w": jnp.ones(3)})
  _assert_words(excinfo, "freeze", ">= 1")


def test_injected_integer_freeze_still_works_under_jit():
  tx = optax.inject_hyperparams(onebit_optax.onebit_adam)(0.1, axis_name=None, freeze=2)
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  for _ in range(3):
    _, state = update({"w": jnp.ones(3)}, state, params)
  assert bool(_fields.field(state, "frozen"))
  assert int(_fields.field(state, "freeze_step")) == 2
