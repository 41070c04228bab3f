"""The task registry of benchmarks/convergence.py: three small problems on data that ships offline.

* ``gpt``: next-byte prediction (a causal transformer) on CPython's
  ``pydoc_data.topics`` prose;
* ``mlm``: BERT's masked language model (a bidirectional transformer, 15% of
  the bytes masked 80/10/10) on the same prose;
* ``digits``: a two-hidden-layer MLP classifying scikit-learn's 8x8 digits
  (1,797 images; a fixed stratified 20% held out): the non-language task.

A task is data, a model and a budget; the runner (``_conv_runner.py``) turns it
into compiled training chunks. Every batch is a pure function of
``(seed, step)`` and every task's validation set is fixed, so runs differ only
in what the protocol varies (optimizer, learning rate, seed).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import _convergence_model as lm


@dataclasses.dataclass(frozen=True)
class Task:
  """One benchmark problem: its data, model, loss and training budget."""

  name: str
  title: str  # one line for the report.
  steps: int
  warmup: int  # linear LR warmup, then cosine decay to 10% of the peak.
  lrs: tuple[float, ...]  # the AdamW sweep (factor 3 apart).
  batch_per_device: int
  weight_decay: float
  init_params: Callable[[jax.Array], Any]
  # (params, batch) -> (sum of the per-example losses, number of examples).
  loss_sums: Callable[..., tuple[jax.Array, jax.Array]]
  # (seed, step, global_batch) -> tuple of numpy arrays with a leading batch axis.
  train_batch: Callable[[int, int, int], tuple]
  # (multiple) -> the whole validation set, its length a multiple of the device count.
  val_set: Callable[[int], tuple]
  chunk: int = 25  # steps per compiled call (lax.scan) and between evaluations.
  # Seeds that choose the learning rates (the sweeps, and the freeze study), and
  # fresh seeds, disjoint from them, that the final comparison runs on (a cheap,
  # noisy task gets more of both).
  seeds: int = 3
  eval_seeds: int = 4
  # Global-norm clipping of the gradient before the optimizer (None: none), with
  # onebit_optax.clip_by_global_norm: one factor agreed across devices.
  clip: float | None = None

  def decay_mask(self, params):
    """Weight decay on matrices only (not on biases and LayerNorm)."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


# ----------------------------------------------------------------------------
# Language: the byte-level transformer of _convergence_model.py.

LM_CONFIG = lm.ModelConfig(d_model=64, num_layers=2, num_heads=4, seq_len=64)


def _prose():
  return lm.split(lm.load_corpus("prose"))


def _gpt_task(steps: int) -> Task:
  train, val = _prose()
  cfg = LM_CONFIG

  def loss_sums(params, batch):
    x, y = batch
    return lm.loss_fn(params, x, y, cfg) * y.size, jnp.float32(y.size)

  return Task(
      name="gpt", title=(f"char GPT: causal transformer on pydoc topics prose "
                         f"(d={cfg.d_model}, {cfg.num_layers} layers, context {cfg.seq_len})"),
      steps=steps, warmup=max(1, steps // 20), lrs=(1e-3, 3e-3, 1e-2), batch_per_device=4,
      weight_decay=0.1, clip=1.0, eval_seeds=5,
      init_params=lambda key: lm.init_params(key, cfg), loss_sums=loss_sums,
      train_batch=lambda seed, step, batch: lm.train_batch(train, step, seed, batch, cfg.seq_len),
      val_set=lambda multiple: lm.val_batches(val, cfg.seq_len, None, multiple))


def _mlm_task(steps: int) -> Task:
  train, val = _prose()
  cfg = LM_CONFIG._replace(causal=False)

  def batch(seed, step, size):
    tokens, _ = lm.train_batch(train, step, seed, size, cfg.seq_len)
    return lm.mask_tokens(tokens, np.random.default_rng([seed, step, 1]))

  def val_set(multiple):
    tokens, _ = lm.val_batches(val, cfg.seq_len, None, multiple)
    return lm.mask_tokens(tokens, np.random.default_rng(12345))  # the same masks every time.

  return Task(
      name="mlm", title=(f"BERT-style MLM: bidirectional transformer, 15% of the bytes masked "
                         f"(d={cfg.d_model}, {cfg.num_layers} layers, context {cfg.seq_len})"),
      steps=steps, warmup=max(1, steps // 20), lrs=(1e-3, 3e-3, 1e-2), batch_per_device=4,
      weight_decay=0.1, clip=1.0, init_params=lambda key: lm.init_params(key, cfg),
      loss_sums=lambda params, b: lm.masked_loss_sums(params, *b, cfg),
      train_batch=batch, val_set=val_set)


# ----------------------------------------------------------------------------
# Not language: an MLP on scikit-learn's digits.

DIGITS_HIDDEN = (256, 256)


def _digits():
  from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
  from sklearn.model_selection import train_test_split  # pylint: disable=g-import-not-at-top
  x, y = load_digits(return_X_y=True)
  x = (x / 16.0 - 0.5).astype(np.float32)  # pixels are 0..16.
  return train_test_split(x, y.astype(np.int32), test_size=0.2, stratify=y, random_state=0)


def _mlp_init(key, sizes):
  keys = jax.random.split(key, len(sizes) - 1)
  return {f"layer{i}": {"w": jax.random.normal(k, (a, b)) * math.sqrt(2.0 / a),  # He init.
                        "b": jnp.zeros(b)}
          for i, (k, a, b) in enumerate(zip(keys, sizes[:-1], sizes[1:]))}


def _mlp_apply(params, x):
  n = len(params)
  for i in range(n):
    x = x @ params[f"layer{i}"]["w"] + params[f"layer{i}"]["b"]
    if i < n - 1:
      x = jax.nn.relu(x)
  return x


def _digits_task(steps: int) -> Task:
  x_train, x_val, y_train, y_val = _digits()
  sizes = (64, *DIGITS_HIDDEN, 10)

  def loss_sums(params, batch):
    x, y = batch
    logp = jax.nn.log_softmax(_mlp_apply(params, x))
    return -jnp.sum(jnp.take_along_axis(logp, y[:, None], axis=-1)), jnp.float32(y.shape[0])

  def batch(seed, step, size):
    idx = np.random.default_rng([seed, step]).integers(0, len(y_train), size=size)
    return x_train[idx], y_train[idx]

  def val_set(multiple):
    # Pad to a multiple of the device count by repeating the first images; the
    # loss sums count them twice, a fixed and tiny bias shared by all runs.
    pad = -len(y_val) % multiple
    return np.concatenate([x_val, x_val[:pad]]), np.concatenate([y_val, y_val[:pad]])

  return Task(
      name="digits", title=(f"digits MLP: 64-{'-'.join(map(str, DIGITS_HIDDEN))}-10 ReLU on "
                            f"scikit-learn's 8x8 digits ({len(y_train)} train / {len(y_val)} "
                            "held out)"),
      steps=steps, warmup=max(1, steps // 20), lrs=(3e-3, 1e-2, 3e-2), batch_per_device=8,
      weight_decay=0.1, seeds=8, eval_seeds=24, init_params=lambda key: _mlp_init(key, sizes),
      loss_sums=loss_sums,
      train_batch=batch, val_set=val_set)


# ----------------------------------------------------------------------------

FULL_STEPS = dict(gpt=300, mlm=600, digits=300)
QUICK_STEPS = dict(gpt=60, mlm=60, digits=100)
_BUILDERS = dict(gpt=_gpt_task, mlm=_mlm_task, digits=_digits_task)


def make_tasks(names=None, quick: bool = False, steps: int | None = None) -> list[Task]:
  """The registry: tasks by name (all by default), with the full or the quick budget."""
  names = list(_BUILDERS) if names is None else list(names)
  unknown = set(names) - set(_BUILDERS)
  if unknown:
    raise ValueError(f"unknown task(s) {sorted(unknown)}: choose from {sorted(_BUILDERS)}.")
  budget = QUICK_STEPS if quick else FULL_STEPS
  return [_BUILDERS[n](steps or budget[n]) for n in names]
