"""Leaves stacked into one group train as they do apart (issue 25, item 3).

Leaves of one shape are stacked into groups (``_layout.WireLayout.groups``); a
large enough group's compressed step is written in two passes
(``_groups.write_sent``: ``b1 m + e``, then the gradients added), where a group
of one leaf takes one. The compression is per leaf either way (its own scale,
its own signs), so two leaves of one shape, stacked, must move as the same two
leaves given different shapes (each a group of its own, the path the numpy
simulations check) with the same gradients, to float32 rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import onebit_optax
from onebit_optax import _groups

N, STEPS = 2, 8
SHAPE = (128, 256)  # two of them: one stacked group of 65,536 elements


def _run(tx, shapes: dict, local_field: str):
  mesh = jax.make_mesh((N,), ("data",), devices=jax.devices()[:N])
  params = {k: jnp.full(s, 0.1, jnp.float32) for k, s in shapes.items()}
  params = jax.device_put(params, NamedSharding(mesh, P()))
  state = onebit_optax.init_sharded(tx, params, mesh)
  specs = onebit_optax.state_partition_specs(state, "data")

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data")),
                     out_specs=(P(), specs))
  def step(params, state, grads):
    updates, state = tx.update(jax.tree.map(lambda g: g[0], grads), state, params)
    return optax.apply_updates(params, updates), state

  for t in range(STEPS):
    rng = np.random.default_rng(t)
    grads = {k: rng.normal(size=(N,) + SHAPE).astype(np.float32).reshape((N,) + s)
             for k, s in zip(("x", "y"), shapes.values())}
    params, state = step(params, state, jax.device_put(grads, NamedSharding(mesh, P("data"))))
  groups = len(getattr(state[0], local_field))
  return {k: np.asarray(v).reshape(-1) for k, v in params.items()}, groups


@pytest.mark.parametrize("make_tx,local_field", [
    (lambda: onebit_optax.onebit_adam(1e-2, axis_name="data", freeze=3), "local_momentum"),
    (lambda: onebit_optax.zero_one_adam(1e-2, axis_name="data", var_freeze_step=3), "local_sent"),
], ids=["onebit", "zero_one"])
def test_a_stacked_group_moves_as_its_leaves_apart(make_tx, local_field):
  assert 2 * np.prod(SHAPE) >= _groups.TWO_PASSES_FROM  # (the two-pass form runs)
  stacked, groups = _run(make_tx(), {"x": SHAPE, "y": SHAPE}, local_field)
  assert groups == 1
  apart, groups = _run(make_tx(), {"x": SHAPE, "y": SHAPE[::-1]}, local_field)
  assert groups == 2
  for k in ("x", "y"):
    assert np.any(stacked[k] != 0.1), k  # it trained
    np.testing.assert_allclose(stacked[k], apart[k], rtol=1e-5, atol=1e-6, err_msg=k)
