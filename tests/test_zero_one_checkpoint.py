"""A 0/1 Adam state checkpointed with Orbax onto abstract_state's target; save_checkpoint refuses it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import onebit_optax

N = 8


def _run(steps):
  mesh = jax.make_mesh((N,), ("data",))
  tx = onebit_optax.zero_one_adam(0.05, axis_name="data", var_freeze_step=3, local_steps=2,
                                  local_step_scaler=2)
  params = {"w": jnp.linspace(-1.0, 1.0, 400), "b": jnp.zeros(5)}
  state = onebit_optax.init_sharded(tx, params, mesh, "data")
  specs = onebit_optax.state_partition_specs(state, "data")

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data")),
                     out_specs=(P(), specs))
  def step(params, opt_state, shift):
    local = onebit_optax.zero_one_local_params(params, opt_state, "data")
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


def test_save_checkpoint_refuses_a_zero_one_state_and_says_what_to_do(tmp_path):
  _, _, params, state = _run(1)
  with pytest.raises(ValueError, match="0/1 Adam state. Checkpoint it with Orbax directly"):
    onebit_optax.save_checkpoint(tmp_path, 1, params, state)
  assert not any(tmp_path.iterdir())  # nothing half-written
