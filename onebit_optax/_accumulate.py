"""Data-parallel companions: gradient accumulation and global-norm clipping that compose."""

from __future__ import annotations

from typing import Any, Callable, Hashable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from onebit_optax import _collective

__all__ = ["accumulate_gradients", "clip_by_global_norm"]


def accumulate_gradients(
    loss_fn: Callable[..., Any],
    params,
    batch,
    num_microbatches: int,
    *,
    has_aux: bool = False,
):
  r"""Mean loss and *local* gradient over ``num_microbatches`` slices of ``batch``.

  .. math::

    g = \frac{1}{k} \sum_{j=1}^{k} \nabla_\theta\, \ell(\theta; b_j)

  computed with a ``lax.scan`` over micro-batches, without any communication;
  then call ``tx.update`` once. This is the way to accumulate with 1-bit Adam:
  :class:`optax.MultiSteps` calls the inner ``update`` on every mini-step (and
  selects the result with ``where``), so a communicating optimizer inside it
  would communicate on every micro-batch.

  Inside ``shard_map`` pass ``onebit_optax.local_params(params, axis)`` so the
  gradients stay local (see :func:`local_params`).

  Args:
    loss_fn: ``loss_fn(params, microbatch) -> loss`` (or ``(loss, aux)`` with
      ``has_aux``).
    params: parameters to differentiate.
    batch: pytree whose leaves share a leading axis divisible by
      ``num_microbatches``.
    num_microbatches: number of slices ``k``.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``; aux is averaged.

  Returns:
    ``((loss, aux), grads)`` if ``has_aux`` else ``(loss, grads)``: means over
    the micro-batches.

  Example:
    >>> import jax.numpy as jnp, onebit_optax
    >>> loss_fn = lambda w, x: jnp.mean((x * w) ** 2)
    >>> loss, g = onebit_optax.accumulate_gradients(loss_fn, 1.0, jnp.arange(8.0), 4)
    >>> float(loss), float(g)
    (17.5, 35.0)

  References:
    Tang et al., `1-bit Adam <https://arxiv.org/abs/2102.02888>`_, ICML 2021
    (one compressed communication per optimizer step).
  """
  k = int(num_microbatches)
  if k < 1:
    raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}.")
  leaves = jax.tree.leaves(batch)
  if not leaves:
    raise ValueError("accumulate_gradients: the batch has no array leaves.")
  for leaf in leaves:
    if jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] % k:
      raise ValueError(
          f"accumulate_gradients: every batch leaf needs a leading axis divisible by "
          f"num_microbatches={k}; got a leaf of shape {jnp.shape(leaf)}. Change the "
          "per-device batch size or the number of micro-batches.")
  micro = jax.tree.map(lambda x: x.reshape((k, x.shape[0] // k) + x.shape[1:]), batch)
  grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)

  def body(carry, microbatch):
    value, grads = grad_fn(params, microbatch)
    return jax.tree.map(jnp.add, carry, (value, grads)), None

  # The first micro-batch seeds the carry: zeros would be typed replicated under
  # shard_map while local gradients are per-device, and the scan carry must match.
  first = grad_fn(params, jax.tree.map(lambda x: x[0], micro))
  total, _ = jax.lax.scan(body, first, jax.tree.map(lambda x: x[1:], micro))
  return jax.tree.map(lambda t: t / k, total)


class ClipByGlobalNormState(NamedTuple):
  """State of :func:`clip_by_global_norm` (none needed)."""


def clip_by_global_norm(max_norm: float, *, axis_name: Optional[Hashable]
                        ) -> optax.GradientTransformationExtraArgs:
  r"""Clips local gradients by one factor agreed across devices (put it before 1-bit Adam).

  :func:`optax.clip_by_global_norm` on a device's *local* gradient clips each
  device by its own norm, which is not the clipping of the mean gradient that a
  single-device run does (and differs across devices). The mean's norm cannot be
  known without sending the full gradient, which is what 1-bit Adam avoids. This
  transformation uses one scalar all-reduce to agree on a bound instead:

  .. math::

    \rho = \sqrt{\tfrac1n \textstyle\sum_i \lVert g_i \rVert_2^2}
      \;\ge\; \lVert \bar g \rVert_2, \qquad
    g_i \leftarrow g_i \cdot \min\!\big(1, c/\rho\big).

  Every device scales by the same factor, so the averaged gradient is scaled by
  it too and its norm is at most ``max_norm``. With identical gradients on all
  devices this is exactly optax's clipping of the mean; otherwise it clips
  somewhat earlier (:math:`\rho` bounds the mean's norm from above).

  Args:
    max_norm: the clipping threshold :math:`c`.
    axis_name: the data-parallel axis (None: plain global-norm clipping).

  Returns:
    A :class:`optax.GradientTransformationExtraArgs`.

  Example:
    >>> import jax.numpy as jnp, onebit_optax
    >>> clip = onebit_optax.clip_by_global_norm(1.0, axis_name=None)
    >>> updates, _ = clip.update({'w': jnp.array([3.0, 4.0])}, clip.init(None))
    >>> updates['w']
    Array([0.6, 0.8], dtype=float32)

  References:
    Pascanu et al., `On the difficulty of training recurrent neural networks
    <https://arxiv.org/abs/1211.5063>`_, 2013.
  """

  def init_fn(params):
    del params
    return ClipByGlobalNormState()

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    local_sq = sum(jnp.sum(jnp.square(jnp.asarray(g, jnp.float32)))
                   for g in jax.tree.leaves(updates))
    rho = jnp.sqrt(_collective.full_precision_mean(local_sq, axis_name))
    factor = jnp.where(rho > max_norm, max_norm / jnp.where(rho > 0, rho, 1.0), 1.0)
    return jax.tree.map(lambda g: (g * factor).astype(jnp.result_type(g)), updates), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
