"""Shared by the examples: the offline corpus, batch sampling and the simulated-device flag."""

from __future__ import annotations

import os
from typing import NamedTuple, Sequence

import numpy as np


def force_host_devices(argv: Sequence[str], default: int = 8) -> None:
  """Asks XLA for ``--devices N`` simulated CPU devices (default 8).

  XLA reads the flag once, when JAX creates its CPU backend, so this must run
  before the first JAX computation (in practice: before ``import jax``). An
  explicit device count already in ``XLA_FLAGS`` wins.
  """
  n = default
  for i, arg in enumerate(argv):
    if arg == "--devices" and i + 1 < len(argv):
      n = int(argv[i + 1])
    elif arg.startswith("--devices="):
      n = int(arg.split("=", 1)[1])
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


class Corpus(NamedTuple):
  """A character-level corpus: integer-coded train/validation splits and the vocabulary."""

  train: np.ndarray  # shape=(n_train,), dtype=int32: character ids.
  val: np.ndarray  # shape=(n_val,), dtype=int32: the held-out last 10% of the text.
  chars: str  # id -> character.

  @property
  def vocab_size(self) -> int:
    return len(self.chars)


def load_corpus(val_fraction: float = 0.1) -> Corpus:
  """CPython's own documentation (``pydoc_data.topics``, ~465 kB of English): no download.

  The vocabulary is built on the whole text so that validation never meets an
  unknown character; characters that only occur in the validation split keep a
  zero gradient, which 1-bit Adam handles (it does not move coordinates whose
  variance is 0).
  """
  from pydoc_data.topics import topics  # pylint: disable=g-import-not-at-top
  text = "\n".join(topics.values())
  chars = "".join(sorted(set(text)))
  lookup = {c: i for i, c in enumerate(chars)}
  ids = np.fromiter((lookup[c] for c in text), dtype=np.int32, count=len(text))
  split = int(len(ids) * (1.0 - val_fraction))
  return Corpus(train=ids[:split], val=ids[split:], chars=chars)


def random_windows(ids: np.ndarray, rng: np.random.Generator, batch: int, length: int):
  """``batch`` random windows of ``length`` consecutive ids: an int32 array (batch, length)."""
  starts = rng.integers(0, len(ids) - length, size=batch)
  return ids[starts[:, None] + np.arange(length)[None, :]]


def fixed_windows(ids: np.ndarray, num_batches: int, batch: int, length: int):
  """The same evenly spaced windows on every call: (num_batches, batch, length) int32.

  A fixed validation set makes the validation losses of different runs and
  optimizers comparable.
  """
  count = num_batches * batch
  starts = np.linspace(0, len(ids) - length - 1, count).astype(np.int64)
  windows = ids[starts[:, None] + np.arange(length)[None, :]]
  return windows.reshape(num_batches, batch, length)


def mask_tokens(tokens: np.ndarray, rng: np.random.Generator, *, mask_id: int,
                vocab_size: int, rate: float = 0.15):
  """BERT's masking: pick ``rate`` of the positions; 80% -> [MASK], 10% -> random, 10% kept.

  Returns ``(inputs, targets, weights)``: ``weights`` is 1.0 on the picked
  positions, where the loss is taken, and 0.0 elsewhere.
  """
  picked = rng.random(tokens.shape) < rate
  action = rng.random(tokens.shape)
  inputs = np.where(picked & (action < 0.8), mask_id, tokens)
  random_ids = rng.integers(0, vocab_size, size=tokens.shape)
  inputs = np.where(picked & (action >= 0.8) & (action < 0.9), random_ids, inputs)
  return inputs.astype(np.int32), tokens.astype(np.int32), picked.astype(np.float32)
