"""Adam's bounded step, shared by 1-bit Adam and 0/1 Adam: bias correction, the variance floor, the clip."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["adam_update_bound", "bias_correction", "bounded_step"]

F32 = jnp.float32


def adam_update_bound(b1, b2) -> jax.Array:
  r"""How large Adam's per-coordinate step :math:`|\hat m_t / (\sqrt{\hat v_t} + \epsilon)|` can get.

  Kingma & Ba (2015, Section 2.1): :math:`(1-\beta_1)/\sqrt{1-\beta_2}` when
  :math:`1-\beta_1 > \sqrt{1-\beta_2}`, else 1. It is the default ``max_update``
  of :func:`scale_by_onebit_adam` and :func:`scale_by_zero_one_adam`: once the
  variance is frozen no coordinate steps further than Adam could.

  Args:
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.

  Returns:
    A float32 scalar (3.16 for the defaults 0.9, 0.999).

  Example:
    >>> import onebit_optax
    >>> round(float(onebit_optax.adam_update_bound(0.9, 0.999)), 3)
    3.162

  References:
    Kingma & Ba, `Adam: A Method for Stochastic Optimization
    <https://arxiv.org/abs/1412.6980>`_, ICLR 2015, Section 2.1.
  """
  b1, b2 = jnp.asarray(b1, F32), jnp.asarray(b2, F32)
  return jnp.maximum(1.0, (1.0 - b1) / jnp.sqrt(1.0 - b2))


def bias_correction(decay, count) -> jax.Array:
  """Adam's bias correction :math:`1 - \\beta^t` (float32)."""
  return 1.0 - jnp.asarray(decay, F32) ** count


def bounded_step(m, nu, b1, b2, eps, max_update, bc1, bc2, floor, *, bounded, finite,
                 zero_without_variance):
  r"""Adam's step :math:`\hat m/(\sqrt{\hat v}+\epsilon)`, floored and clipped where ``bounded``.

  ``bounded`` (a replicated scalar): :math:`\hat v` is floored at ``floor``
  and the step clipped at :math:`\pm B` (``max_update``, None:
  :func:`adam_update_bound`); else the floor is 0 and the clip infinite, which
  leaves Adam's step exactly. ``zero_without_variance``: a coordinate with
  :math:`v = 0` stays put (it never had a gradient where :math:`v` was
  estimated: its momentum is the compressor's sign noise, which
  :math:`1/\epsilon` would amplify). ``finite`` False: 0 everywhere (a
  skipped step). Each intermediate is used once, so that XLA writes the step
  in one pass from the moments.
  """
  bound = adam_update_bound(b1, b2) if max_update is None else max_update
  bound = jnp.where(bounded, jnp.asarray(bound, F32), jnp.inf)
  v_hat = jnp.maximum(nu / bc2, jnp.where(bounded, floor, 0.0))
  step = jnp.clip((m / bc1) / (jnp.sqrt(v_hat) + eps), -bound, bound)
  return jnp.where(finite & (jnp.logical_not(zero_without_variance) | (nu > 0)), step, 0.0)
