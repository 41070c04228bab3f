"""When to freeze the variance: the policies and the one function that decides."""

from __future__ import annotations

import sys
import warnings
from typing import NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "VarianceRatioFreeze",
    "FixedStepFreeze",
    "DefaultFreezeWarning",
    "warn_default_policy",
    "FreezePolicy",
    "variance_ratio_freeze",
    "fixed_step_freeze",
    "default_interval",
    "policy_interval",
]


class VarianceRatioFreeze(NamedTuple):
  """Freeze once the bias-corrected variance stops moving (see :func:`variance_ratio_freeze`).

  Not callable on purpose: :func:`optax.inject_hyperparams` treats callables as
  schedules, and passes this through unchanged.

  Example:
    >>> import onebit_optax
    >>> onebit_optax.VarianceRatioFreeze(threshold=0.96, interval=None, min_steps=0)
    VarianceRatioFreeze(threshold=0.96, interval=None, min_steps=0, max_steps=None)
  """

  threshold: float
  interval: Optional[int]
  min_steps: int
  max_steps: Optional[int] = None


class FixedStepFreeze(NamedTuple):
  """Freeze after a fixed number of warmup steps (see :func:`fixed_step_freeze`).

  Example:
    >>> import onebit_optax
    >>> onebit_optax.FixedStepFreeze(step=400, interval=None)
    FixedStepFreeze(step=400, interval=None)
  """

  step: int
  interval: Optional[int]


FreezePolicy = Union[VarianceRatioFreeze, FixedStepFreeze]


def _steps(name: str, value, caller: str) -> int:
  """``value`` as a Python int, refusing anything that is not a whole number.

  Accepts Python and numpy integers, integral floats (``400.0``) and concrete
  0-d integral arrays; refuses bools, strings, ``2.7`` and traced values (a step
  count decides the state's schedule, it must be known when the policy is built).
  """
  if isinstance(value, (bool, np.bool_, str, bytes, jax.core.Tracer)):
    raise TypeError(
        f"{caller}: {name}={value!r} must be a whole number of steps (a Python int).")
  try:
    number = float(value)
  except (TypeError, ValueError):
    raise TypeError(
        f"{caller}: {name}={value!r} must be a whole number of steps (a Python int), "
        f"got a {type(value).__name__}.") from None
  if not number.is_integer():
    raise ValueError(
        f"{caller}: {name}={value!r} is not a whole number of steps; pass an int "
        f"(e.g. {name}={round(number)}).")
  return int(number)


def _check_interval(interval, caller: str) -> Optional[int]:
  if interval is None:
    return None
  interval = _steps("interval", interval, caller)
  if interval < 1:
    raise ValueError(f"interval must be a positive number of steps, got {interval}.")
  return interval


def default_interval(b2, min_steps: int = 0) -> jax.Array:
  r"""The default :math:`\Delta`: a quarter of ``min_steps``, at most :math:`1/(1-\beta_2)`.

  .. math::

    \Delta = \begin{cases}
      \min\big(\lceil \text{min\_steps}/4 \rceil,\ \mathrm{round}(1/(1-\beta_2))\big)
        & \text{min\_steps} > 0, \\
      \mathrm{round}(1/(1-\beta_2)) & \text{min\_steps} = 0.
    \end{cases}

  :math:`1/(1-\beta_2)` is the averaging window of :math:`v` (the seed's
  choice, 1000 steps for :math:`\beta_2 = 0.999`); with it, a run shorter than
  :math:`2/(1-\beta_2)` steps never checks, so never compresses. ``min_steps``
  (the LR warmup) is the one length the policy is told that scales with the
  run; a quarter of it puts the first check that may fire right after the
  warmup and the next ones close behind. (A third froze the masked LM of the
  study at 17% of its run, just short of 5x less communication; a fifth froze
  every task within 10% of its run, where the digits MLP paid most.) Works on a traced ``b2`` (under
  ``optax.inject_hyperparams``).

  Args:
    b2: decay rate of the second moment.
    min_steps: the policy's ``min_steps`` (a Python int).

  Returns:
    :math:`\Delta` as a 0-d int32 array.
  """
  window = jnp.maximum(jnp.round(1.0 / (1.0 - jnp.asarray(b2, jnp.float32))), 1).astype(jnp.int32)
  if int(min_steps) <= 0:
    return window
  return jnp.minimum(jnp.int32(-(-int(min_steps) // 4)), window)


def variance_ratio_freeze(
    min_steps: int = 0,
    *,
    threshold: float = 0.96,
    interval: Optional[int] = None,
    max_steps: Optional[int] = None,
) -> VarianceRatioFreeze:
  r"""Freezes the variance when its norm changes by less than ``1 - threshold`` per interval.

  Every :math:`\Delta` steps (:math:`t = k\Delta`) the policy compares the
  :math:`\ell_1` norm of the *bias-corrected* second moment with its value
  :math:`\Delta` steps earlier,

  .. math::

    \rho_t = \frac{\lVert \hat v_t \rVert_1}{\lVert \hat v_{t-\Delta} \rVert_1},
    \qquad \hat v_t = \frac{v_t}{1 - \beta_2^t},

  and freezes at the first check with :math:`t \ge` ``min_steps``,
  :math:`t \ge 2\Delta` and :math:`\tau \le \rho_t \le 1/\tau`, with
  :math:`\tau` = ``threshold``.

  Why it cannot fire while :math:`v` fills up from zero: the raw :math:`v_t`
  grows like :math:`1-\beta_2^t` for about :math:`1/(1-\beta_2)` steps even
  for stationary gradients, so a ratio on the raw :math:`v` is :math:`\ge 1`
  from the first step and a one-sided test :math:`\rho \ge 0.96` would fire at
  once. The bias correction divides exactly that factor out, so
  :math:`\rho_t` only moves when the gradient statistics move. The test is
  two-sided (a variance that grows by more than :math:`1/\tau` is not stable
  either). Set ``min_steps`` to at least the learning-rate warmup.

  What each parameter does to the freeze step :math:`T_0`:

  * ``min_steps``: :math:`T_0 \ge` ``min_steps``; with ``interval=None`` it
    also sets :math:`\Delta` (see :func:`default_interval`):
    :math:`\lceil` ``min_steps`` :math:`/4\rceil`, at most
    :math:`1/(1-\beta_2)`; ``min_steps=0`` gives :math:`1/(1-\beta_2)`.
  * ``interval`` :math:`\Delta`: checks at multiples of :math:`\Delta`, the
    first that may fire at :math:`2\Delta`. While :math:`t < 1/(1-\beta_2)`
    the bias-corrected :math:`\hat v_t` is close to the *mean* of
    :math:`g^2` over steps :math:`1..t`, so :math:`\rho_t - 1 \approx
    (r - 1)\,\Delta/t`, with :math:`r` the mean of :math:`g^2` over the last
    :math:`\Delta` steps relative to :math:`\hat v_{t-\Delta}`: the rule
    fires once :math:`|r - 1| \lesssim (1-\tau)\,t/\Delta`, a tolerance that
    widens as :math:`t` grows. A larger :math:`\Delta` freezes later (and
    only at multiples of it); a smaller one earlier.
  * ``threshold`` :math:`\tau`: a band :math:`[\tau, 1/\tau]`; a lower
    :math:`\tau` freezes earlier.
  * ``max_steps``: :math:`T_0 \le` ``max_steps`` whatever the ratio.

  The seed's criterion (the paper's threshold 0.96 over the averaging window
  of :math:`v`) is ``variance_ratio_freeze(warmup, interval=round(1/(1-b2)))``.
  The default :math:`\Delta` was chosen with the freeze study of
  ``benchmarks/convergence.py`` (3 tasks, several seeds, fixed freeze steps
  against a tuned AdamW; table in docs/guides/freeze.md).

  Args:
    min_steps: never freeze before this step (use at least the LR warmup
      length); with ``interval=None`` it also sets :math:`\Delta`.
    threshold: :math:`\tau` in (0, 1]; the paper uses 0.96.
    interval: :math:`\Delta` in steps; ``None``: :func:`default_interval`,
      :math:`\min(\lceil` ``min_steps`` :math:`/4\rceil, \mathrm{round}(1/(1-\beta_2)))`
      (:math:`\mathrm{round}(1/(1-\beta_2))` when ``min_steps`` is 0).
    max_steps: freeze at this step at the latest, stable or not (``None``: no
      limit). A variance that keeps drifting (seen in the BERT-style example)
      otherwise means the run never compresses.

  Returns:
    A policy to pass as ``freeze=`` to :func:`onebit_adam`.

  Example:
    >>> import onebit_optax
    >>> onebit_optax.variance_ratio_freeze(min_steps=500, interval=100)
    VarianceRatioFreeze(threshold=0.96, interval=100, min_steps=500, max_steps=None)

  References:
    Tang et al., `1-bit Adam <https://arxiv.org/abs/2102.02888>`_, 2021, Section 6.
  """
  caller = "variance_ratio_freeze"
  if not 0.0 < float(threshold) <= 1.0:
    raise ValueError(f"threshold must be in (0, 1], got {threshold}.")
  interval = _check_interval(interval, caller)
  min_steps = _steps("min_steps", min_steps, caller)
  if min_steps < 0:
    raise ValueError(f"min_steps must be >= 0, got {min_steps}.")
  if max_steps is not None:
    max_steps = _steps("max_steps", max_steps, caller)
    if max_steps < max(1, min_steps):
      raise ValueError(
          f"max_steps={max_steps} must be >= 1 and >= min_steps={min_steps}: it is the "
          "latest step at which the variance freezes.")
  return VarianceRatioFreeze(float(threshold), interval, min_steps, max_steps)


def fixed_step_freeze(step: int, *, interval: Optional[int] = None) -> FixedStepFreeze:
  r"""Freezes the variance after exactly ``step`` warmup steps (DeepSpeed's ``freeze_step``).

  Steps ``1..step`` are plain Adam; from step ``step + 1`` on the momentum is
  compressed and the variance is :math:`\hat v_{T_0}`, :math:`T_0` = ``step``. The variance ratio is still measured every ``interval`` steps (same
  definition as :func:`variance_ratio_freeze`) for logging only.

  Args:
    step: number of warmup steps, ``>= 1``.
    interval: :math:`\Delta` for the logged ratio; ``None`` means :math:`1/(1-\beta_2)`.

  Returns:
    A policy to pass as ``freeze=`` to :func:`onebit_adam`.

  Example:
    >>> import onebit_optax
    >>> onebit_optax.fixed_step_freeze(400)
    FixedStepFreeze(step=400, interval=None)

  References:
    DeepSpeed ``OnebitAdam`` (``freeze_step``) and its 1-bit Adam tutorial;
    Tang et al., `1-bit Adam <https://arxiv.org/abs/2102.02888>`_, ICML 2021.
  """
  caller = "fixed_step_freeze"
  step = _steps("step", step, caller)
  if step < 1:
    raise ValueError(
        f"fixed_step_freeze(step={step}): at least one warmup step of plain Adam is "
        "needed to estimate the variance; use step >= 1.")
  return FixedStepFreeze(step, _check_interval(interval, caller))


class DefaultFreezeWarning(UserWarning):
  """``onebit_adam(axis_name=...)`` was built without ``freeze=``: when the default freezes.

  Pass any ``freeze=`` (``variance_ratio_freeze()`` keeps the default) to say
  what you want; ``warnings.simplefilter('ignore', DefaultFreezeWarning)``
  silences it.

  Example:
    >>> import warnings, onebit_optax
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter('always')
    ...   tx = onebit_optax.onebit_adam(1e-3, axis_name='data')
    >>> caught[0].category.__name__, 'before step 2000' in str(caught[0].message)
    ('DefaultFreezeWarning', True)
    >>> with warnings.catch_warnings():
    ...   warnings.simplefilter('error', onebit_optax.DefaultFreezeWarning)
    ...   tx = onebit_optax.onebit_adam(
    ...       1e-3, axis_name='data', freeze=onebit_optax.variance_ratio_freeze())
  """


def _user_stacklevel() -> int:
  """The ``stacklevel`` of the first caller outside onebit_optax, seen from the caller's frame."""
  frame, level = sys._getframe(2), 2  # pylint: disable=protected-access
  while frame is not None and frame.f_globals.get("__name__", "").startswith("onebit_optax"):
    frame, level = frame.f_back, level + 1
  return level


def warn_default_policy(b2, caller: str) -> None:
  """Warns at construction what the default policy will do: when it can first freeze."""
  window = None if isinstance(b2, jax.core.Tracer) else round(1.0 / (1.0 - float(b2)))
  when = (f"with b2={b2} it checks the variance every {window} steps (1/(1-b2)) and cannot "
          f"freeze, i.e. start 1-bit compression, before step {2 * window}; a shorter run "
          "is plain Adam with full-precision all-reduces" if window else
          "it checks the variance every 1/(1-b2) steps and cannot freeze before 2/(1-b2)")
  warnings.warn(
      f"{caller}: freeze not given, so the default variance_ratio_freeze() applies: {when}. "
      "For a shorter run pass freeze=onebit_optax.variance_ratio_freeze(min_steps=<the "
      "learning-rate warmup>) (it then checks every min_steps/4 steps and may freeze from "
      "min_steps on) or freeze=<a fixed step>; pass freeze=onebit_optax."
      "variance_ratio_freeze() to keep the default without this warning.",
      DefaultFreezeWarning, stacklevel=_user_stacklevel())


def check_policy(policy) -> FreezePolicy:
  if isinstance(policy, (VarianceRatioFreeze, FixedStepFreeze)):
    return policy
  if isinstance(policy, (int, np.integer)) and not isinstance(policy, (bool, np.bool_)):
    return fixed_step_freeze(policy)
  if (isinstance(policy, (jax.Array, np.ndarray)) and policy.shape == ()
      and jnp.issubdtype(policy.dtype, jnp.number)):
    # optax.inject_hyperparams turns an int `freeze=k` into a (traced) array.
    return _injected_step(policy)
  raise TypeError(
      f"freeze={policy!r} is not a freeze policy: pass "
      "onebit_optax.variance_ratio_freeze(min_steps=...) or "
      "onebit_optax.fixed_step_freeze(step) (an int is read as a fixed step).")


def _injected_step(step) -> FixedStepFreeze:
  """A fixed step given as a 0-d array (``inject_hyperparams``): checked where it can be."""
  if not jnp.issubdtype(step.dtype, jnp.integer):
    raise TypeError(
        f"onebit_adam: freeze is a {step.dtype} array; a fixed freeze step must be an "
        "integer (pass freeze=<int> to optax.inject_hyperparams).")
  if not isinstance(step, jax.core.Tracer):
    if _steps("freeze", np.asarray(step).item(), "onebit_adam") < 1:
      raise ValueError(f"onebit_adam: freeze={step} must be a step >= 1.")
  return FixedStepFreeze(step, None)


def policy_interval(policy: FreezePolicy, b2) -> jax.Array:
  """:math:`\\Delta` of ``policy`` for this ``b2`` (:func:`default_interval` when not given)."""
  if policy.interval is not None:
    return jnp.int32(policy.interval)
  min_steps = policy.min_steps if isinstance(policy, VarianceRatioFreeze) else 0
  return default_interval(b2, min_steps)


def freeze_decision(policy: FreezePolicy, count, nu_hat_l1, reference_l1, ratio, b2):
  """Returns ``(freeze_now, new_reference_l1, new_ratio)`` after warmup step ``count``.

  All inputs are replicated values (the mean-gradient moments), so every device
  takes the same decision: no extra collective, no divergent ``lax.cond``.
  """
  interval = policy_interval(policy, b2)
  is_check = (count % interval) == 0
  has_reference = reference_l1 > 0
  measured = jnp.where(has_reference, nu_hat_l1 / jnp.where(has_reference, reference_l1, 1.0),
                       jnp.nan)
  new_ratio = jnp.where(is_check & has_reference, measured, ratio).astype(jnp.float32)
  new_reference = jnp.where(is_check, nu_hat_l1, reference_l1).astype(jnp.float32)
  if isinstance(policy, FixedStepFreeze):
    freeze_now = count >= policy.step
  else:
    stable = (measured >= policy.threshold) & (measured <= 1.0 / policy.threshold)
    freeze_now = is_check & has_reference & (count >= policy.min_steps) & stable
    if policy.max_steps is not None:
      freeze_now = freeze_now | (count >= policy.max_steps)
  return freeze_now, new_reference, new_ratio


def reads_norm(policy: FreezePolicy, count, b2) -> jax.Array:
  r"""Whether warmup step ``count`` needs :math:`\lVert v \rVert_1`: a check, or a step where the policy may fire.

  Elsewhere the norm is not read (the ratio is measured only at checks), so
  the optimizer skips its pass over ``nu``.
  """
  need = (count % policy_interval(policy, b2)) == 0
  if isinstance(policy, FixedStepFreeze):
    return need | (count >= policy.step)
  if policy.max_steps is not None:
    return need | (count >= policy.max_steps)
  return need
