"""DiLoCo (Douillard et al., arXiv 2311.08105) as an optax transformation: a benchmark baseline.

Not part of the library: the contestant that a JAX user on a slow network can
also pick (MaxText ships it), measured beside 1-bit Adam and 0/1 Adam by the
benchmarks. Each of the ``n`` data-parallel devices takes ``H`` inner steps of
its own optimizer (``optax.adamw`` in the paper) on its own data, starting from
the replicated point :math:`\\theta`; then the devices average the
pseudo-gradient :math:`\\Delta_i = \\theta - \\theta_i` in one float32
all-reduce, and an outer optimizer (SGD with Nesterov momentum, lr 0.7,
momentum 0.9 in the paper) applies the mean to :math:`\\theta`. Each device's
inner optimizer state stays with it across rounds.

The shape is the one of 0/1 Adam's local steps: ``params`` given to
``update`` is :math:`\\theta`, the point of the last outer step, replicated;
the state holds each device's progress :math:`\\theta_i - \\theta`
(``offset``), so the gradient is taken at :func:`local_point`. ``update``
returns zeros on inner steps and the outer update on every ``H``-th step,
where the all-reduce runs (inside a ``lax.cond`` on the replicated count: only
those steps communicate). Build the state with ``jax.shard_map(tx.init,
out_specs=partition_specs(...))``, or with :func:`init_sharded`.
"""

from __future__ import annotations

from typing import Any, Hashable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from onebit_optax import _collective

F32 = jnp.float32


class DiLoCoState(NamedTuple):
  count: jax.Array  # () int32: inner steps taken.
  offset: Any  # tree like params of (1, *shape) float32, per device: theta_i - theta.
  inner: Any  # the inner optimizer's state, every array with a leading axis of 1, per device.
  outer: Any  # the outer optimizer's state, replicated.
  wire_bytes: jax.Array  # () float32: bytes this device sent in the last step.


def outer_sgd(learning_rate: float = 0.7, momentum: float = 0.9):
  """The paper's outer optimizer: SGD with Nesterov momentum on the mean pseudo-gradient."""
  return optax.sgd(learning_rate, momentum=momentum, nesterov=True)


def diloco(inner: optax.GradientTransformation, outer: optax.GradientTransformation,
           inner_steps: int, axis_name: Optional[Hashable], last_step: Optional[int] = None
           ) -> optax.GradientTransformationExtraArgs:
  """DiLoCo: ``inner_steps`` (H) steps of ``inner`` per device, then ``outer`` on the mean of theta - theta_i.

  ``last_step``: the run's last step also ends a round (a shorter one when H
  does not divide the run), so that no inner progress is left out of the
  final point.
  """
  if not isinstance(inner_steps, int) or inner_steps < 1:
    raise ValueError(f"diloco: inner_steps={inner_steps!r} must be an int >= 1.")
  per_device = lambda x: (x[None] if axis_name is None
                          else jax.lax.pcast(x[None], axis_name, to="varying"))

  def init_fn(params):
    return DiLoCoState(
        jnp.zeros([], jnp.int32),
        jax.tree.map(lambda p: per_device(jnp.zeros(jnp.shape(p), F32)), params),
        jax.tree.map(per_device, inner.init(params)), outer.init(params), jnp.zeros([], F32))

  def update_fn(grads, state, params=None, **extra_args):
    del extra_args
    if params is None:
      raise ValueError("diloco: pass params (theta, the point of the last outer step) to update.")
    theta_i = local_point(params, state)
    steps, inner_state = inner.update(grads, jax.tree.map(lambda x: x[0], state.inner), theta_i)
    offset = jax.tree.map(lambda o, s: o[0] + s.astype(F32), state.offset, steps)
    count = state.count + 1
    sync = count % inner_steps == 0
    if last_step is not None:
      sync = sync | (count == last_step)

    def outer_step(offset, outer_state):
      delta = jax.tree.map(lambda o: -o, offset)  # theta - theta_i
      mean = delta if axis_name is None else jax.lax.pmean(delta, axis_name)
      return outer.update(mean, outer_state, params)

    def no_step(offset, outer_state):
      return jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), F32), params), outer_state

    updates, outer_state = jax.lax.cond(sync, outer_step, no_step, offset, state.outer)
    size = sum(int(jnp.size(p)) for p in jax.tree.leaves(params))
    n = 1 if axis_name is None else jax.lax.axis_size(axis_name)
    sent = jnp.where(sync, _collective.allreduce_wire_bytes(size, n), 0.0).astype(F32)
    new_state = DiLoCoState(
        count, jax.tree.map(lambda o: jnp.where(sync, 0.0, o)[None], offset),
        jax.tree.map(lambda x: x[None], inner_state), outer_state, sent)
    updates = jax.tree.map(lambda u, p: u.astype(jnp.result_type(p)), updates, params)
    return updates, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def local_point(params, state: DiLoCoState):
  """This device's parameters :math:`\\theta_i = \\theta + (\\theta_i - \\theta)`: take the gradient here."""
  return jax.tree.map(lambda p, o: p + o[0].astype(jnp.result_type(p)), params, state.offset)


def init_sharded(tx, params, mesh, axis_name: Hashable):
  """``(state, specs)``: ``tx.init`` under ``jax.shard_map`` over ``mesh``, its fields laid out by :func:`partition_specs`."""
  init = lambda specs, check=True: jax.shard_map(tx.init, mesh=mesh, in_specs=(P(),),
                                                 out_specs=specs, check_vma=check)
  specs = partition_specs(jax.eval_shape(init(P(), False), params), axis_name)
  return jax.jit(init(specs))(params), specs


def partition_specs(state: DiLoCoState, axis_name: Hashable) -> DiLoCoState:
  """``P(axis_name)`` for the per-device fields (``offset``, ``inner``), ``P()`` for the rest."""
  replicated = lambda tree: jax.tree.map(lambda _: P(), tree)
  return DiLoCoState(P(), jax.tree.map(lambda _: P(axis_name), state.offset),
                     jax.tree.map(lambda _: P(axis_name), state.inner),
                     replicated(state.outer), P())
