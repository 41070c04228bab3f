"""Embedding rows that no example uses stay bitwise still through the compression phase.

The trap (DeepSpeed makes users pass ``exp_avg_mask`` by hand): a coordinate
whose gradient is always 0 has ``v = 0`` at the freeze, but after the freeze
its momentum is not 0: the compressor encodes 0 as ``+scale`` and error
feedback carries that noise along. The Adam direction ``m / (sqrt(v) + eps)``
then divides sign noise by ``eps = 1e-8``. 1-bit Adam returns 0 wherever the
frozen ``v`` is 0, with no user mask.

Here an embedding table of 50 rows, of which the data only ever indexes rows
0..29, trains on 8 devices through 5 warmup steps and 55 compression steps.
Rows 30..49 must equal their initial values bit for bit on every device. To
show the test has teeth, the momentum that they carry is fed to the formula
without the rule (numpy): it would move them by thousands. (Core v3: a worker
compresses each leaf with the RMS of the whole leaf, so every unused row gets
sign noise, also one in a block of only unused rows; the 16-element head is an
exact leaf, float32 on the wire.)

``weight_decay`` must be 0 for "exactly unchanged": decoupled decay shrinks
every parameter by ``(1 - lr * wd)`` per step whatever its gradient (last test).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import onebit_optax
import _fields

N = 8
VOCAB, USED, DIM, OUT = 50, 30, 8, 2
SEQ, LOCAL_BATCH = 4, 16
FREEZE_AT, STEPS = 5, 60
LR, B1, B2, EPS = 0.01, 0.9, 0.999, 1e-8
FAST_CODEGEN = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _loss(params, ids, y):
  pooled = jnp.mean(params["embed"][ids], axis=1)  # (batch, DIM)
  return jnp.mean((pooled @ params["head"] - y) ** 2)


def _problem(seed=0):
  rng = np.random.default_rng(seed)
  params = {"embed": (0.1 * rng.standard_normal((VOCAB, DIM))).astype(np.float32),
            "head": (0.1 * rng.standard_normal((DIM, OUT))).astype(np.float32)}
  ids = rng.integers(0, USED, size=(N * LOCAL_BATCH, SEQ)).astype(np.int32)
  true_embed = rng.standard_normal((VOCAB, OUT))
  y = true_embed[ids].mean(axis=1).astype(np.float32)
  return params, ids, y


def _shards(a):
  return [np.asarray(s.data) for s in a.addressable_shards]


def test_unused_rows_bitwise_unchanged_on_8_devices():
  mesh = jax.make_mesh((N,), ("data",))
  params0, ids, y = _problem()
  assert not np.isin(np.arange(USED, VOCAB), ids).any()  # rows 30..49: never indexed
  tx = onebit_optax.onebit_adam(LR, B1, B2, EPS, axis_name="data", freeze=FREEZE_AT)
  params = jax.device_put(params0, NamedSharding(mesh, P()))
  state = onebit_optax.init_sharded(tx, params, mesh)
  specs = onebit_optax.state_partition_specs(state, "data")

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                     out_specs=(P(), specs, P()))
  def step(params, opt_state, ids, y):
    loss, grads = jax.value_and_grad(_loss)(onebit_optax.local_params(params, "data"), ids, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

  ids_dev, y_dev = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (ids, y))
  step = jax.jit(step).lower(params, state, ids_dev, y_dev).compile(FAST_CODEGEN)
  losses = []
  for _ in range(STEPS):
    params, state, loss = step(params, state, ids_dev, y_dev)
    losses.append(float(loss))  # also waits for the step: one step in flight at a time
  s = state[0]
  assert bool(s.frozen) and int(s.count) == STEPS and int(s.skipped_steps) == 0
  assert losses[-1] < 0.8 * losses[0], (losses[0], losses[-1])

  unused = slice(USED, VOCAB)
  # Bitwise unchanged, on every device's copy; the used rows did train.
  for copy in _shards(params["embed"]):
    assert copy[unused].tobytes() == params0["embed"][unused].tobytes()
    assert np.all(copy[:USED] != params0["embed"][:USED])
  # What the rule protects them from: v is exactly 0, the momentum is not.
  # (moments: mu decoded from the momentum message; nu is the raw v frozen at T0.)
  mu, nu = (np.asarray(m["embed"]) for m in onebit_optax.moments(state, params0))
  assert np.all(nu[unused] == 0) and np.all(nu[:USED] > 0)
  assert np.all(np.isfinite(mu))
  # The worker's scale is the RMS of its whole leaf: a zero-gradient coordinate
  # (u = 0, sign +1) is sent as +scale, so every unused row's momentum is sign
  # noise, whatever block it sits in.
  assert np.all(mu[unused] != 0), "the compressor should have put sign noise there"
  noisy = np.ones(VOCAB - USED, bool)
  # The head (16 elements) is exact: its momentum is no ±scale pattern.
  assert len(set(np.abs(np.asarray(onebit_optax.moments(state, params0)[0]["head"])).ravel()
                 .tolist())) > 2

  # Without the rule (the plain Adam formula, numpy): the last step would have
  # moved every noisy unused coordinate, by lr * |m_hat| / eps.
  mu_hat = mu[unused][noisy] / np.float32(1 - B1 ** STEPS)
  nu_hat = nu[unused][noisy] / np.float32(1 - B2 ** FREEZE_AT)
  naive_update = -np.float32(LR) * mu_hat / (np.sqrt(nu_hat) + np.float32(EPS))
  moved = params0["embed"][unused][noisy] + naive_update
  assert np.all(moved != params0["embed"][unused][noisy])
  print(f"\n[zero-grad rows] |m| in [{np.abs(mu[unused][noisy]).min():.2e}, "
        f"{np.abs(mu[unused][noisy]).max():.2e}]; naive step would move them by "
        f"{np.abs(naive_update).min():.2e}..{np.abs(naive_update).max():.2e} "
        f"(embedding entries are ~0.1)")
  assert np.abs(naive_update).min() > 1.0


def test_weight_decay_moves_unused_rows():
  # Documented exception: decoupled decay is applied to every parameter, used or
  # not, so unused rows shrink by exactly (1 - lr * wd) per step (update 0 + wd * p).
  params0, ids, y = _problem(1)
  wd, steps = 0.5, 12
  tx = onebit_optax.onebit_adam(LR, B1, B2, EPS, weight_decay=wd, axis_name=None, freeze=4)

  @jax.jit
  def train(params):
    def body(carry, _):
      params, state = carry
      updates, state = tx.update(jax.grad(_loss)(params, ids, y), state, params)
      return (optax.apply_updates(params, updates), state), None
    (params, state), _ = jax.lax.scan(body, (params, tx.init(params)), None, length=steps)
    return params, state

  params, state = train(params0)
  assert bool(_fields.field(state, "frozen"))
  unused = params0["embed"][USED:]
  expected = unused.copy()
  for _ in range(steps):
    expected = expected - np.float32(LR) * (np.float32(wd) * expected)
  np.testing.assert_allclose(np.asarray(params["embed"][USED:]), expected, rtol=1e-6)
  assert np.all(np.abs(expected) < np.abs(unused))
