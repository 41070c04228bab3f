"""The tests' reader of a state field: the one 1-bit Adam or 0/1 Adam state inside an optax state.

``onebit_optax.status`` reads the state on the host; this returns the field itself (an array,
traced inside ``jit``, with the device axis under ``pmap``), as a user reads it in a step.
``optax.tree_utils.tree_get(opt_state, name)`` does too, but it also matches dict keys of the
same name (an ``optax.partition`` label ``'frozen'``) and returns None when nothing matches;
this finds the state by its type and fails when there is not exactly one.
"""

import jax

import onebit_optax

_KINDS = (onebit_optax.ScaleByOnebitAdamState, onebit_optax.ScaleByZeroOneAdamState)


def field(opt_state, name: str):
  found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, _KINDS))
           if isinstance(s, _KINDS)]
  assert len(found) == 1, f"expected one 1-bit Adam or 0/1 Adam state, found {len(found)}"
  value = getattr(found[0], name)
  return value.get_value() if hasattr(value, "get_value") else value  # an nnx Variable
