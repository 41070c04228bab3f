"""Adam's bounded step, shared by 1-bit Adam and 0/1 Adam: bias correction, the variance floor, the clip."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from onebit_optax import _layout

__all__ = ["adam_moments", "adam_update_bound", "bias_correction", "bounded_step", "floors",
           "scalars", "still_threshold", "Scalars"]

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


class _Decays(NamedTuple):
  """The scalars of Adam's moments (:func:`adam_moments`), broadcast per shape."""

  finite: jax.Array  # () bool
  scale: jax.Array  # () float32: what makes the gradients' sum their mean
  b1: jax.Array
  c1: jax.Array  # 1 - b1
  b2: jax.Array
  c2: jax.Array  # 1 - b2


def adam_moments(mus: list, nus: list, total: list, scale, finite, b1, b2) -> tuple:
  r"""Adam's moments of the mean gradient :math:`\bar g` = ``total * scale``, leaf by leaf; kept where not ``finite``.

  :math:`m \leftarrow \beta_1 m + (1-\beta_1)\bar g`, :math:`v \leftarrow \beta_2 v +
  (1-\beta_2)\bar g^2`, in float32, stored in each moment's dtype. ``b2`` is
  the step's decay of :math:`v` (0/1 Adam's may be traced). :math:`1-\beta` is
  computed as Python computes it for a float :math:`\beta`, as ``optax`` does;
  the scalars are broadcast once per shape (:class:`_layout.PerShape`), so call
  this in the branch that uses them. Returns ``(mus, nus)``.
  """
  f32 = lambda x: jnp.asarray(x, F32)
  decays = _layout.PerShape(_Decays(finite, f32(scale), f32(b1), f32(1.0 - b1), f32(b2),
                                    f32(1.0 - b2)))
  new_mu, new_nu = [], []
  for m, v, g in zip(mus, nus, total):
    k = decays(jnp.shape(g))
    mean = g * k.scale
    new_mu.append(jnp.where(k.finite, k.b1 * m.astype(F32) + k.c1 * mean, m).astype(m.dtype))
    new_nu.append(jnp.where(k.finite, k.b2 * v.astype(F32) + k.c2 * jnp.square(mean), v)
                  .astype(v.dtype))
  return new_mu, new_nu


def bias_correction(decay, count) -> jax.Array:
  """Adam's bias correction :math:`1 - \\beta^t` (float32)."""
  return 1.0 - jnp.asarray(decay, F32) ** count


class Scalars(NamedTuple):
  """The scalars of one step's :func:`bounded_step`, formed once for every leaf (:func:`scalars`)."""

  bc1: jax.Array  # shape=(), float32: 1 - b1^t.
  bc2: jax.Array  # shape=(), float32: 1 - b2^t (t: the variance's own step count).
  eps: jax.Array  # shape=(), float32.
  low: jax.Array  # shape=(), float32: the clip, -B where bounded, -inf where not.
  high: jax.Array  # shape=(), float32: +B where bounded, +inf where not.
  still_to: jax.Array  # shape=(), float32: a coordinate with v <= still_to stays put (still_threshold).
  zero: jax.Array  # shape=(), float32: 0 (what such a coordinate steps).


def still_threshold(finite, only_where_variance) -> jax.Array:
  r"""The :math:`v` at or below which a coordinate stays put: :math:`-\infty`, 0 or :math:`+\infty`.

  ``finite`` False (a skipped step): :math:`+\infty`, nothing moves.
  ``only_where_variance``: 0, a coordinate whose :math:`v` is 0 stays put.
  Else :math:`-\infty`, every coordinate moves. One scalar, so that the
  per-leaf test is one comparison, ``v <= threshold``.
  """
  moving = jnp.where(only_where_variance, 0.0, -jnp.inf).astype(F32)
  return jnp.where(finite, moving, jnp.inf)


def scalars(b1, b2, eps, max_update, bc1, bc2, *, bounded, finite,
            zero_without_variance) -> Scalars:
  """The :class:`Scalars` of a step (``bounded``, ``finite``: replicated bool scalars)."""
  bound = adam_update_bound(b1, b2) if max_update is None else jnp.asarray(max_update, F32)
  bound = jnp.where(bounded, bound, jnp.inf)
  return Scalars(jnp.asarray(bc1, F32), jnp.asarray(bc2, F32), jnp.asarray(eps, F32), -bound,
                 bound, still_threshold(finite, zero_without_variance), jnp.zeros((), F32))


def floors(variance_floor, nu_l1, sizes, bc2, bounded) -> jax.Array:
  r"""Per leaf, the floor on :math:`\hat v`: ``variance_floor`` x the leaf's mean :math:`\hat v` (0 where not ``bounded``).

  ``nu_l1``: (leaves,) the sum of each leaf's raw :math:`v`; ``sizes`` its
  element counts (static). One vector for all leaves.
  """
  sizes = jnp.asarray(np.maximum(np.asarray(sizes, np.float32), 1.0))
  return jnp.where(bounded, variance_floor * nu_l1 / (sizes * bc2), 0.0)


def bounded_step(m, nu, floor, s: Scalars) -> jax.Array:
  r"""Adam's step :math:`\hat m/(\sqrt{\hat v}+\epsilon)`, floored and clipped where bounded.

  .. math::

    \mathrm{clip}\Big(\frac{m/(1-\beta_1^t)}{\sqrt{\max(v/(1-\beta_2^t),\, f)}+\epsilon},
    \pm B\Big), \quad 0 \text{ where } v \le \tau.

  Bounded (a replicated scalar of :func:`scalars`): :math:`\hat v` is floored
  at ``floor`` (:func:`floors`) and the step clipped at :math:`\pm B`
  (``max_update``, None: :func:`adam_update_bound`); else the floor is 0 and
  the clip infinite, which leaves Adam's step exactly. :math:`\tau`
  (:func:`still_threshold`): with ``zero_without_variance`` a coordinate with
  :math:`v = 0` stays put (it never had a gradient where :math:`v` was
  estimated: its momentum is the compressor's sign noise, which
  :math:`1/\epsilon` would amplify); ``finite`` False: 0 everywhere (a
  skipped step). The scalars are formed once per step, so that each leaf's
  step is one pass from its moments; ``s`` may hold them broadcast to the
  leaf's shape (:class:`_layout.PerShape`).
  """
  v_hat = jnp.maximum(nu / s.bc2, floor)
  step = jnp.minimum(jnp.maximum((m / s.bc1) / (jnp.sqrt(v_hat) + s.eps), s.low), s.high)
  return jnp.where(nu <= s.still_to, s.zero, step)
