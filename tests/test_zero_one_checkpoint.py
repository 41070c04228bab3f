"""0/1 Adam states through the shared checkpoint helpers: bitwise on the same mesh, moved onto another."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import onebit_optax

N = 8


def _run(steps, local_steps=2):
  mesh = jax.make_mesh((N,), ("data",))
  local = {} if local_steps is None else dict(local_steps=local_steps, local_step_scaler=2)
  tx = onebit_optax.zero_one_adam(0.05, axis_name="data", var_freeze_step=3, **local)
  params = {"w": jnp.linspace(-1.0, 1.0, 400), "b": jnp.zeros(5)}
  state = onebit_optax.init_sharded(tx, params, mesh, "data")
  specs = onebit_optax.state_partition_specs(state, "data")

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data")),
                     out_specs=(P(), specs))
  def step(params, opt_state, shift):
    local = onebit_optax.local_params(params, "data", opt_state)
    grads = jax.grad(lambda p: jnp.sum((p["w"] - shift) ** 2) + jnp.sum(p["b"] ** 2))(local)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  shift = jax.device_put(jnp.arange(N, dtype=jnp.float32), NamedSharding(mesh, P("data")))
  params = jax.device_put(params, NamedSharding(mesh, P()))
  for _ in range(steps):
    params, state = step(params, state, shift)
  return mesh, tx, params, state


def test_orbax_restores_a_zero_one_state_bitwise_onto_abstract_state(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  mesh, tx, params, state = _run(6)  # variance, compressed, then local steps and syncs
  assert np.any(np.asarray(state[0].accumulator["w"]))  # per-device progress to keep
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
  target = {"params": jax.tree.map(lambda x: jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=NamedSharding(mesh, P())), params),
            "opt_state": onebit_optax.abstract_state(tx, params, mesh)}
  with ocp.StandardCheckpointer() as ckptr:
    restored = ckptr.restore(tmp_path / "ckpt", target)
  assert type(restored["opt_state"][0]) is onebit_optax.ScaleByZeroOneAdamState
  same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)),
                      restored, {"params": params, "opt_state": state})
  assert all(jax.tree.leaves(same)), same
  rows = restored["opt_state"][0].local_sent[0]
  assert rows.shape[0] == N and tuple(rows.sharding.spec)[0] == "data"


def test_save_and_restore_checkpoint_resume_a_zero_one_state_bitwise(tmp_path):
  """Mid-interval (per-device progress in the accumulator): the same mesh gets every bit back."""
  mesh, tx, params, state = _run(6)
  assert int(np.asarray(state[0].since_sync)) != 0 or np.any(np.asarray(state[0].accumulator["w"]))
  assert onebit_optax.save_checkpoint(tmp_path, 6, params, state, tx=tx)
  new_params, restored, step = onebit_optax.restore_checkpoint(tmp_path, tx, params, mesh)
  assert step == 6
  same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)),
                      (new_params, restored), (params, state))
  assert all(jax.tree.leaves(same)), same
  # Placed exactly as the training step placed it (NamedSharding(P()) and P(None, None)
  # compare unequal: the step compiled a second time for a restored state).
  assert [x.sharding for x in jax.tree.leaves(restored)] == [
      x.sharding for x in jax.tree.leaves(state)]


@pytest.mark.parametrize("devices", [4, None])
def test_restore_onto_another_device_count_keeps_moments_and_schedule(tmp_path, devices):
  """8 -> 4 devices (and -> one device): moments and counters exact, error feedback restarts."""
  _, tx, params, state = _run(5, local_steps=None)
  assert onebit_optax.save_checkpoint(tmp_path, 5, params, state, tx=tx)
  mesh = None if devices is None else jax.make_mesh((devices,), ("data",),
                                                    devices=jax.devices()[:devices])
  new_tx = tx if devices else onebit_optax.zero_one_adam(0.05, axis_name=None, var_freeze_step=3)
  new_params, moved, step = onebit_optax.restore_checkpoint(tmp_path, new_tx, params, mesh)
  old, new = state[0], moved[0]
  for name in ("count", "nu", "nu_l1", "variance_updates", "var_interval", "phase",
               "onebit_steps", "skipped_steps"):
    same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)),
                        getattr(old, name), getattr(new, name))
    assert all(jax.tree.leaves(same)), name
  # m as moments() reads it (decoded from the momentum message where it lives there)
  same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)),
                      onebit_optax.moments(state, params), onebit_optax.moments(moved, params))
  assert all(jax.tree.leaves(same))
  rows = devices or 1
  assert np.shape(new.worker_scale)[0] == rows
  assert not np.any(np.asarray(new.local_sent[0]))
  assert (new.server_error is None) == (devices is None)
  status = onebit_optax.status(moved, var_freeze_step=3)
  assert (status.phase, status.step) == (onebit_optax.status(state, var_freeze_step=3).phase, 5)


def test_a_state_between_two_syncs_is_not_moved(tmp_path):
  _, tx, params, state = _run(6)
  assert int(np.asarray(state[0].since_sync)) != 0
  assert onebit_optax.save_checkpoint(tmp_path, 6, params, state, tx=tx)
  mesh4 = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  with pytest.raises(ValueError, match="between two syncs"):
    onebit_optax.restore_checkpoint(tmp_path, tx, params, mesh4)
