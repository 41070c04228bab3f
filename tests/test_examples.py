"""The examples run end to end: a few steps of a tiny model on the 8 simulated devices."""

import math

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import onebit_optax
import _flat
from examples import _data
from examples import bert_linen
from examples import gpt_nnx

# XLA_FLAGS (8 simulated CPU devices) is set by the root conftest.py before JAX starts.

DEVICES = 8
STEPS, FREEZE = 12, 5
TINY = ["--steps", str(STEPS), "--d-model", "32", "--layers", "1", "--heads", "2",
        "--block-size", "16", "--batch-size", "16", "--devices", str(DEVICES),
        "--lr", "1e-2", "--eval-every", "100", "--eval-batches", "1", "--no-progress"]
KEYS = {"example", "optimizer", "steps", "devices", "num_params", "initial_val_loss", "val_loss",
        "val_history", "train_losses", "freeze_step", "frozen", "ratio_history",
        "bytes_per_device", "bytes_total", "allreduce_bytes_per_device", "wall_time_s"}


def ring_allreduce_bytes(d, n):
  return 2 * (n - 1) / n * d * 4  # reduce-scatter + all-gather of float32.


def leaf_sizes(example):
  """Sizes of the example model's parameter leaves at TINY's shapes, in flattening order."""
  return [int(np.prod(s)) for s in leaf_shapes(example)]


def leaf_shapes(example):
  """Shapes of the example model's parameter leaves at TINY's shapes, in flattening order.

  1-bit Adam lays the compressed ones out in its bit stream group after group of
  one shape (each on blocks of 128), which sets the padding and the scales per
  chunk (tests/_flat.py).
  """
  vocab = _data.load_corpus().vocab_size
  if example == "gpt_onebit":
    model = gpt_nnx.CharTransformer(vocab, d_model=32, num_layers=1, num_heads=2, block_size=16,
                                    rngs=nnx.Rngs(0))
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
  else:
    model = bert_linen.CharBert(vocab, d_model=32, num_layers=1, num_heads=2, max_len=16)
    leaves = jax.tree.leaves(jax.eval_shape(
        model.init, jax.random.key(0), jax.ShapeDtypeStruct((1, 16), np.int32))["params"])
  return [tuple(x.shape) for x in leaves]


@pytest.fixture(scope="module")
def gpt_adamw():
  return gpt_nnx.main(TINY + ["--optimizer", "adamw"])


@pytest.fixture(scope="module")
def gpt_onebit():
  return gpt_nnx.main(TINY + ["--optimizer", "onebit", "--freeze-step", str(FREEZE)])


@pytest.fixture(scope="module")
def bert_onebit():
  return bert_linen.main(TINY + ["--optimizer", "onebit", "--freeze-step", str(FREEZE)])


@pytest.mark.parametrize("run", ["gpt_onebit", "bert_onebit"])
def test_onebit_example_trains_and_switches_phase(run, request):
  r = request.getfixturevalue(run)
  assert set(r) == KEYS
  assert all(math.isfinite(x) for x in r["train_losses"]) and len(r["train_losses"]) == STEPS
  assert math.isfinite(r["val_loss"])
  # ln(vocab) ~ 4.6 at random init; a working run is well below after 12 steps.
  assert r["val_loss"] < 0.85 * r["initial_val_loss"]
  assert np.mean(r["train_losses"][-3:]) < np.mean(r["train_losses"][:3])
  assert r["frozen"] and r["freeze_step"] == FREEZE
  # Steps 1..5 all-reduce the float32 gradients (as AdamW), steps 6..12 send 1-bit
  # momenta: 2 (n - 1) messages of signs, one scale per leaf piece, and the float32 of
  # the leaves under 64 elements.
  sizes, n = leaf_sizes(run), DEVICES
  assert sum(sizes) == r["num_params"]
  assert _flat.onebit_warmup_bytes(sizes, n) == pytest.approx(
      ring_allreduce_bytes(r["num_params"], n))
  expected = (FREEZE * _flat.onebit_warmup_bytes(sizes, n)
              + (STEPS - FREEZE) * _flat.onebit_compressed_bytes(sizes, n,
                                                                shapes=leaf_shapes(run)))
  np.testing.assert_allclose(r["bytes_per_device"], expected, rtol=1e-6)
  assert r["bytes_total"] == pytest.approx(n * expected)


def test_adamw_example_sends_full_gradients(gpt_adamw):
  assert set(gpt_adamw) == KEYS
  assert gpt_adamw["val_loss"] < 0.85 * gpt_adamw["initial_val_loss"]
  assert gpt_adamw["freeze_step"] is None and not gpt_adamw["frozen"]
  expected = STEPS * ring_allreduce_bytes(gpt_adamw["num_params"], DEVICES)
  np.testing.assert_allclose(gpt_adamw["bytes_per_device"], expected, rtol=1e-6)


def test_onebit_warmup_matches_optax_adamw(gpt_adamw, gpt_onebit):
  """Before the freeze, 1-bit Adam on local gradients is AdamW on the mean gradient.

  Same seed, same batches: the losses at steps 1..FREEZE+1 (the last one is
  measured after FREEZE warmup updates) match optax.adamw's, which checks the
  example's wiring (local gradients, averaging, weight-decay mask, schedule).
  """
  np.testing.assert_allclose(gpt_onebit["train_losses"][:FREEZE + 1],
                             gpt_adamw["train_losses"][:FREEZE + 1], rtol=2e-4)
  assert gpt_onebit["train_losses"][FREEZE + 1:] != gpt_adamw["train_losses"][FREEZE + 1:]


def test_nnx_optimizer_state_is_sharded_like_state_partition_specs():
  """The filter-based nnx.StateSharding agrees with onebit_optax.state_partition_specs."""
  mesh = jax.make_mesh((DEVICES,), ("data",))
  args = gpt_nnx.parse_args(TINY + ["--optimizer", "onebit"])
  vocab_size = _data.load_corpus().vocab_size
  model = gpt_nnx.CharTransformer(vocab_size, d_model=32, num_layers=1, num_heads=2, block_size=16,
                                  rngs=nnx.Rngs(0))  # TINY's shapes: the init ops are compiled.
  create_optimizer, _, _ = gpt_nnx.build_steps(mesh, gpt_nnx.make_optimizer(args), onebit=True)
  state = nnx.as_pure(create_optimizer(model).opt_state)
  specs = onebit_optax.state_partition_specs(state, "data")
  sizes, shapes = leaf_sizes("gpt_onebit"), leaf_shapes("gpt_onebit")
  compressed, _ = _flat.split(sizes, shapes=shapes)
  groups = _flat.groups(compressed, shapes)
  chunk = _flat.Bits([sizes[i] for i in compressed], DEVICES).chunk
  sharded = []
  for leaf, spec in zip(jax.tree.leaves(state), jax.tree.leaves(specs)):
    if spec == P("data"):
      assert leaf.sharding.spec[0] == "data" and leaf.shape[0] == DEVICES
      sharded.append(int(np.prod(leaf.shape[1:])))
    else:
      assert leaf.sharding.is_fully_replicated
  # local_momentum (one per group of compressed leaves of one shape), worker_scale (one
  # scale per compressed leaf), server_error; no worker_error.
  assert sorted(sharded) == sorted([len(g) * sizes[g[0]] for g in groups]
                                   + [len(compressed), chunk])
  opt = next(s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(
      x, onebit_optax.ScaleByOnebitAdamState)) if isinstance(s, onebit_optax.ScaleByOnebitAdamState))
  assert opt.worker_error is None and len(opt.local_momentum) == len(groups) > 0


def test_too_many_devices_is_a_clear_error():
  with pytest.raises(SystemExit, match="--devices 64"):
    gpt_nnx.main(TINY + ["--devices", "64"])
