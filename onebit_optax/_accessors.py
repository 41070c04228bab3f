"""Reading an optimizer state: the moments as trees.

The phase and the counters are read on the host with :func:`onebit_optax.status`;
inside ``jit`` they are the state's fields (``optax.tree_utils.tree_get(opt_state,
"frozen")``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from onebit_optax import _layout
from onebit_optax import _groups
from onebit_optax._onebit_adam import ScaleByOnebitAdamState
from onebit_optax._zero_one_adam import ScaleByZeroOneAdamState

__all__ = ["moments"]


def _find_state(opt_state, kinds):
  """The one state of ``kinds`` inside ``opt_state``."""
  found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, kinds))
           if isinstance(s, kinds)]
  if len(found) != 1:
    raise ValueError(
        f"Expected exactly one 1-bit Adam or 0/1 Adam state inside the optimizer state, "
        f"found {len(found)}. Pass the state returned by onebit_adam, zero_one_adam or their "
        "scale_by_ transformations (possibly wrapped by optax.chain, inject_hyperparams, "
        "masked, ...).")
  return found[0]


# Fields that 1-bit Adam's and 0/1 Adam's states both have.
_EITHER = (ScaleByOnebitAdamState, ScaleByZeroOneAdamState)


def _plain(x):
  """The array inside a Flax NNX variable (``nnx.Optimizer`` wraps its state), else ``x``."""
  if isinstance(x, jax.Array):
    return x
  # flax >= 0.12 deprecates `.value` (even hasattr(x, "value") warns); older
  # versions lack get_value.
  if hasattr(x, "get_value"):
    return x.get_value()
  return x.value if type(x).__name__ == "Variable" or hasattr(type(x), "value") else x


def _layout_of(params, message, num_compressed: int) -> _layout.WireLayout:
  """The wire layout a state of ``params`` was made with (its threshold read off the state)."""
  sizes = sorted((int(np.prod(np.shape(x))) for x in jax.tree.leaves(params)), reverse=True)
  threshold = sizes[num_compressed - 1] if num_compressed else sizes[0] + 1
  return _layout.wire_layout_for(params, message.shape[0], max(threshold, 1))


def moments(opt_state, params):
  r"""The first and second moments as trees shaped like ``params``.

  During warmup they are the state's ``mu`` and ``nu``. After the freeze the
  first moment is the mean momentum as it was last sent, decoded from
  ``momentum_message`` (sign bits and one scale per leaf piece; exact leaves
  as float32), and ``nu`` is Adam's raw second moment frozen at
  :math:`v_{T_0}`; the update uses
  :math:`\max(v_{T_0}/(1-\beta_2^{T_0}), \text{floor})` (see
  :func:`scale_by_onebit_adam`).

  For a 0/1 Adam state they are its ``mu`` (with local steps: the momentum of
  the last sync; each device's own is ``local_mu``) and ``nu``, raw; after a
  compressed step the first moment is decoded from its ``momentum_message``
  in the same way.

  Args:
    opt_state: the optimizer state, or any optax state that contains exactly one
      :class:`ScaleByOnebitAdamState` or :class:`ScaleByZeroOneAdamState`. A
      ``pmap`` state (leading device axis) is read on its first device.
    params: the parameter tree (or anything with the same structure and shapes).

  Returns:
    ``(mu, nu)``: two trees shaped like ``params``, float32.

  Example:
    >>> import jax.numpy as jnp, onebit_optax
    >>> tx = onebit_optax.onebit_adam(1e-3, axis_name=None)
    >>> params = {'w': jnp.ones(3)}
    >>> state = tx.init(params)
    >>> _, state = tx.update({'w': jnp.array([1.0, 2.0, 3.0])}, state)
    >>> mu, nu = onebit_optax.moments(state, params)
    >>> mu['w']
    Array([0.1, 0.2, 0.3], dtype=float32)
  """
  state = _find_state(opt_state, _EITHER)
  leaves = lambda tree: [jnp.asarray(_plain(x)) for x in jax.tree.leaves(tree)]
  mu, nu = leaves(state.mu), leaves(state.nu)
  message, scale = (jnp.asarray(_plain(x)) for x in (state.momentum_message, state.worker_scale))
  in_message = _in_message(state)
  if message.ndim == 3:  # pmap: one copy per device
    mu, nu, message, scale, in_message = ([x[0] for x in mu], [x[0] for x in nu], message[0],
                                          scale[0], in_message[0])
  _check_shapes(nu, params)
  treedef = jax.tree.structure(params)
  mu, nu = [x.astype(jnp.float32) for x in mu], [x.astype(jnp.float32) for x in nu]
  if bool(in_message):
    layout = _layout_of(params, message, scale.shape[-1])
    means = _groups.mean_leaves(layout, message)
    mu = [means[i] if size else m for i, (m, size) in enumerate(zip(mu, layout.sizes))]
  return jax.tree.unflatten(treedef, mu), jax.tree.unflatten(treedef, nu)


def _in_message(state) -> jax.Array:
  """Whether the first moment lives in ``momentum_message`` (else in ``mu``)."""
  if isinstance(state, ScaleByZeroOneAdamState):  # after a compressed step
    return jnp.asarray(_plain(state.mu_in_message))
  # 1-bit Adam: after the freeze step (at the freeze step itself the message holds no
  # momentum yet: it is in the error feedback, see _onebit_adam._freeze_stage; mu keeps it).
  sent = jnp.asarray(_plain(state.count)) > jnp.asarray(_plain(state.freeze_step))
  return jnp.asarray(_plain(state.frozen)) & sent


def _check_shapes(nu: list, params) -> list:
  shapes = [tuple(np.shape(x)) for x in jax.tree.leaves(params)]
  if [tuple(x.shape) for x in nu] != shapes:
    raise ValueError(
        f"moments: the state's moments have shapes {[tuple(x.shape) for x in nu][:4]}..., "
        f"params {shapes[:4]}...: pass the params the optimizer was initialised with.")
  return shapes


