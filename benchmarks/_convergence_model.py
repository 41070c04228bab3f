"""The language data and model of benchmarks/convergence.py: a byte-level transformer on CPython's text.

Nothing is downloaded. The two corpora ship with every CPython:

* ``prose``: the documentation topics of ``pydoc_data.topics`` (about 465 kB of
  English), joined in key order;
* ``code``: the ``.py`` files directly under the standard library directory
  (``os.path.dirname(os.__file__)``), joined in file-name order and cut to a
  fixed length so that the benchmark does not depend on the size of the local
  install.

Both are read as UTF-8 bytes (vocabulary of 256), so that one model covers both
corpora. The last 10% of each corpus is held out for validation.

The model is plain JAX (a dict of arrays, no framework): a pre-LayerNorm
transformer with learned positions and an untied output head, causal (next-byte
prediction) or bidirectional with one extra input id for [MASK] (BERT's masked
language model). Plain JAX keeps the
benchmark independent of the example code and makes the parameter tree obvious.
The untied input embedding matters for the measurement: rows of bytes that never
occur in the training text get an exactly-zero gradient, which is the case
1-bit Adam has to mask (``nu == 0``).
"""

from __future__ import annotations

import glob
import math
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

VOCAB = 256
CODE_BYTES = 2_000_000  # the standard library has ~5 MB of .py files; a fixed prefix is plenty.


def load_corpus(name: str) -> np.ndarray:
  """Returns the corpus ``name`` ('prose' or 'code') as a uint8 array of UTF-8 bytes."""
  if name == "prose":
    import pydoc_data.topics  # pylint: disable=g-import-not-at-top
    topics = pydoc_data.topics.topics
    text = "".join(topics[k] for k in sorted(topics))
    data = text.encode("utf-8")
  elif name == "code":
    stdlib = os.path.dirname(os.__file__)
    parts = []
    for path in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
      with open(path, "rb") as f:
        parts.append(f.read())
    data = b"".join(parts)[:CODE_BYTES]
  else:
    raise ValueError(f"unknown corpus {name!r}: use 'prose' or 'code'.")
  return np.frombuffer(data, dtype=np.uint8)


def split(data: np.ndarray, val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
  """The first ``1 - val_fraction`` for training, the last ``val_fraction`` held out."""
  cut = int(len(data) * (1.0 - val_fraction))
  return data[:cut], data[cut:]


def train_batch(data: np.ndarray, step: int, seed: int, batch: int, seq_len: int):
  """Random windows for ``step``: a pure function of ``(seed, step)``.

  Drawing each step's batch from its own generator (instead of one running
  stream) makes a run that resumes from a snapshot see exactly the batches it
  would have seen, which is what lets the corpus-shift runs branch off the
  main runs.
  """
  rng = np.random.default_rng([seed, step])
  starts = rng.integers(0, len(data) - seq_len - 1, size=batch)
  idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
  windows = data[idx].astype(np.int32)
  return windows[:, :-1], windows[:, 1:]


def val_batches(data: np.ndarray, seq_len: int, num_seqs: int | None = None,
                multiple: int = 1):
  """Non-overlapping windows over the held-out text (all of it, or ``num_seqs`` evenly spaced).

  The count is rounded down to a multiple of ``multiple`` (the device count).
  """
  total = (len(data) - 1) // seq_len
  if num_seqs is None or num_seqs >= total:
    starts = np.arange(total) * seq_len
  else:
    starts = np.linspace(0, (total - 1) * seq_len, num_seqs).astype(np.int64)
  starts = starts[: len(starts) // multiple * multiple]
  idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
  windows = data[idx].astype(np.int32)
  return windows[:, :-1], windows[:, 1:]


class ModelConfig(NamedTuple):
  d_model: int = 64
  num_layers: int = 2
  num_heads: int = 4
  seq_len: int = 64
  mlp_ratio: int = 4
  causal: bool = True  # False: bidirectional encoder with a [MASK] input id (MASK_ID).


MASK_ID = VOCAB  # the extra input id of the bidirectional model.


def init_params(key: jax.Array, cfg: ModelConfig) -> dict:
  """Parameters as a nested dict of float32 arrays (GPT-2 style initialisation).

  Every matrix is N(0, 0.02^2) and the two projections that write into the
  residual stream are scaled down by ``1/sqrt(2 * num_layers)`` (GPT-2), so the
  residual stream's variance does not grow with depth at initialisation.
  """
  d, f = cfg.d_model, cfg.mlp_ratio * cfg.d_model
  keys = iter(jax.random.split(key, 3 + 4 * cfg.num_layers))
  normal = lambda shape, std: std * jax.random.normal(next(keys), shape, jnp.float32)
  resid_std = 0.02 / math.sqrt(2 * cfg.num_layers)
  params = {
      "embed": normal((VOCAB + (0 if cfg.causal else 1), d), 0.02),
      "pos": normal((cfg.seq_len, d), 0.01),
      "head": normal((d, VOCAB), 0.02),
      "ln_f": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
  }
  for i in range(cfg.num_layers):
    params[f"block{i}"] = {
        "ln1": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
        "qkv": {"w": normal((d, 3 * d), 0.02), "b": jnp.zeros(3 * d)},
        "proj": {"w": normal((d, d), resid_std), "b": jnp.zeros(d)},
        "ln2": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
        "fc": {"w": normal((d, f), 0.02), "b": jnp.zeros(f)},
        "out": {"w": normal((f, d), resid_std), "b": jnp.zeros(d)},
    }
  return params


def _layer_norm(p, x):
  mean = jnp.mean(x, -1, keepdims=True)
  var = jnp.var(x, -1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def apply(params: dict, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Logits of shape ``tokens.shape + (VOCAB,)`` (causal, or bidirectional if not ``cfg.causal``)."""
  b, t = tokens.shape
  h, d = cfg.num_heads, cfg.d_model
  x = params["embed"][tokens] + params["pos"][:t]
  mask = jnp.tril(jnp.ones((t, t), bool)) if cfg.causal else jnp.ones((t, t), bool)
  for i in range(cfg.num_layers):
    p = params[f"block{i}"]
    y = _layer_norm(p["ln1"], x)
    qkv = y @ p["qkv"]["w"] + p["qkv"]["b"]
    q, k, v = jnp.split(qkv.reshape(b, t, 3 * h, d // h), 3, axis=2)
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // h)
    att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
    y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d)
    x = x + y @ p["proj"]["w"] + p["proj"]["b"]
    y = _layer_norm(p["ln2"], x)
    y = jax.nn.gelu(y @ p["fc"]["w"] + p["fc"]["b"])
    x = x + y @ p["out"]["w"] + p["out"]["b"]
  x = _layer_norm(params["ln_f"], x)
  return x @ params["head"]


def loss_fn(params: dict, x: jax.Array, y: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Mean next-byte cross-entropy in nats."""
  logits = apply(params, x, cfg)
  logp = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(logp, y[..., None], axis=-1))


def masked_loss_sums(params: dict, inputs: jax.Array, targets: jax.Array, weights: jax.Array,
                     cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
  """Sum of the cross-entropy over the positions with weight 1, and their count (MLM loss)."""
  logp = jax.nn.log_softmax(apply(params, inputs, cfg))
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  return jnp.sum(nll * weights), jnp.sum(weights)


def mask_tokens(tokens: np.ndarray, rng: np.random.Generator, rate: float = 0.15):
  """BERT's masking: pick ``rate`` of the positions; 80% -> [MASK], 10% -> random byte, 10% kept.

  Returns ``(inputs, targets, weights)``, int32, int32, float32; the loss is
  taken where ``weights`` is 1.
  """
  picked = rng.random(tokens.shape) < rate
  action = rng.random(tokens.shape)
  inputs = np.where(picked & (action < 0.8), MASK_ID, tokens)
  random_bytes = rng.integers(0, VOCAB, size=tokens.shape)
  inputs = np.where(picked & (action >= 0.8) & (action < 0.9), random_bytes, inputs)
  return inputs.astype(np.int32), tokens.astype(np.int32), picked.astype(np.float32)


def decay_mask(params: dict) -> dict:
  """Weight decay on matrices only (not on biases and LayerNorm), as usual for transformers."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)
