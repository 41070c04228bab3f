"""Checkpoints record the optimizer's hyperparameters: a restore with other ones is refused.

``save_checkpoint(..., tx=tx)`` records them; ``restore_checkpoint`` compares
them with the new ``tx`` and refuses a difference unless ``accept_changes``
names it. Each case below is a pair of optimizers whose states have the same
structure, so that only the recorded hyperparameters can tell them apart.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import onebit_optax

FREEZE, SAVE = 2, 4


def _tx(lr=1e-2, **kwargs):
  kwargs.setdefault("freeze", FREEZE)
  return onebit_optax.onebit_adam(lr, axis_name=None, **kwargs)


def _params():
  return {"w": jnp.linspace(-1.0, 1.0, 200), "b": jnp.arange(3.0)}


def _save(directory, tx, *, record=True):
  """SAVE steps of ``tx`` on one device, saved (with ``tx=`` when ``record``)."""
  params = _params()
  state, update = tx.init(params), jax.jit(tx.update)
  for t in range(SAVE):
    grads = jax.tree.map(lambda p: jnp.sin(3.0 * p + t), params)
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
  onebit_optax.save_checkpoint(str(directory), SAVE, params, state,
                               **({"tx": tx} if record else {}))
  return params, state


def _restore(directory, tx, **kwargs):
  return onebit_optax.restore_checkpoint(str(directory), tx, _params(), None, **kwargs)


SCHEDULE = lambda: optax.linear_schedule(1e-2, 1e-4, 100)

CHANGES = [  # (field, saved optimizer, restored optimizer, both values as the error shows them)
    ("weight_decay", lambda: _tx(), lambda: _tx(weight_decay=0.1), ("0.0", "0.1")),
    ("learning_rate", lambda: _tx(1e-2), lambda: _tx(1e-3), ("0.01", "0.001")),
    ("freeze", lambda: _tx(freeze=50), lambda: _tx(freeze=20), ("'step': 50", "'step': 20")),
    ("learning_rate", lambda: _tx(SCHEDULE()),
     lambda: _tx(optax.linear_schedule(1e-2, 1e-4, 200)), ("a schedule", "a schedule")),
    ("b1", lambda: _tx(), lambda: _tx(b1=0.8), ("0.9", "0.8")),
    ("mask", lambda: _tx(weight_decay=0.1, mask={"w": True, "b": False}),
     lambda: _tx(weight_decay=0.1, mask={"w": True, "b": True}), ("False", "True")),
    ("max_update", lambda: _tx(), lambda: _tx(max_update=2.0), ("None", "2.0")),
    ("weight_decay", lambda: optax.chain(optax.clip_by_global_norm(1.0), _tx()),
     lambda: optax.chain(optax.clip_by_global_norm(1.0), _tx(weight_decay=0.1)), ("0.0", "0.1")),
]


@pytest.mark.parametrize("field, saved_tx, new_tx, values", CHANGES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CHANGES)])
def test_a_changed_hyperparameter_is_refused_unless_accepted(tmp_path, field, saved_tx, new_tx,
                                                             values):
  saved_params, saved_state = _save(tmp_path, saved_tx())
  with pytest.raises(ValueError, match="other hyperparameters") as info:
    _restore(tmp_path, new_tx())
  text = str(info.value)
  line = next(l for l in text.splitlines() if l.strip().startswith(f"{field}:"))
  assert values[0] in line.split(", now ")[0] and values[1] in line.split(", now ")[1], line
  assert f"accept_changes=('{field}',)" in text
  # Accepted on purpose: restored as saved, nothing else said.
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    params, state, _ = _restore(tmp_path, new_tx(), accept_changes=(field,))
  for got, want in zip(jax.tree.leaves((params, state)), jax.tree.leaves((saved_params,
                                                                          saved_state))):
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


def test_the_same_hyperparameters_rebuilt_restore_silently(tmp_path):
  _save(tmp_path, _tx(SCHEDULE(), weight_decay=0.1, mask={"w": True, "b": False}))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _restore(tmp_path, _tx(SCHEDULE(), weight_decay=0.1, mask={"w": True, "b": False}))


def test_several_changes_are_listed_together_and_true_accepts_all(tmp_path):
  _save(tmp_path, _tx())
  changed = _tx(1e-3, weight_decay=0.1, freeze=4)
  with pytest.raises(ValueError) as info:
    _restore(tmp_path, changed)
  for field in ("learning_rate", "weight_decay", "freeze"):
    assert f"\n  {field}: checkpoint" in str(info.value)
  with pytest.raises(ValueError, match="weight_decay"):  # accepting one is not accepting all
    _restore(tmp_path, changed, accept_changes=("learning_rate", "freeze"))
  _restore(tmp_path, changed, accept_changes=True)
  with pytest.raises(ValueError, match="not hyperparameters that are checked"):
    _restore(tmp_path, changed, accept_changes=("lr",))


def test_what_is_not_recorded_is_not_checked(tmp_path):
  # Saved without tx=: nothing to compare (documented in restore_checkpoint).
  _save(tmp_path / "plain", _tx(), record=False)
  _restore(tmp_path / "plain", _tx(weight_decay=0.1))
  # A callable mask cannot be compared; the other fields still are.
  _save(tmp_path / "callable", _tx(weight_decay=0.1, mask=lambda p: {"w": True, "b": False}))
  _restore(tmp_path / "callable", _tx(weight_decay=0.1, mask=lambda p: {"w": True, "b": True}))
  with pytest.raises(ValueError, match="weight_decay"):
    _restore(tmp_path / "callable", _tx(weight_decay=0.2, mask=lambda p: {"w": True, "b": True}))
