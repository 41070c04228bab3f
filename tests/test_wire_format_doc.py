"""docs/how_it_works/wire_format.md's scales, computed from its text and compared with the state.

The page says: compressed leaves are packed leaf after leaf, each padded to a
multiple of 128 elements, the stream padded to a multiple of 128 n and cut
into n chunks; a *segment* is a run of one leaf inside one chunk; a device
compresses each leaf with one scale, the RMS of u over the leaf
(``worker_scale``); a server's row carries, per segment of its chunk, the RMS
of its average over that segment alone (the server error is 0 at the first
compression step); sign(0) = +1. This test builds that layout and those
scales in numpy from the page's rules, not from the package's layout code.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import onebit_optax

N, BLOCK = 8, 128
SHAPES = {"a": (10, 10), "w": (60, 20)}  # both >= exact_below: compressed, in this order


def _layout():
  """Per element of the padded stream: (leaf name or None, index in the leaf)."""
  owners = []
  for name, shape in SHAPES.items():
    size = int(np.prod(shape))
    padded = -(-size // BLOCK) * BLOCK
    owners += [(name, j) if j < size else (None, None) for j in range(padded)]
  total = -(-len(owners) // (BLOCK * N)) * BLOCK * N
  owners += [(None, None)] * (total - len(owners))
  return owners, total // N


def _segments(owners, chunk, r):
  """The segments of chunk r: runs of one leaf, as (leaf, [positions in the chunk])."""
  runs, current = [], None
  for p in range(chunk):
    name = owners[r * chunk + p][0]
    block_leaf = owners[r * chunk + (p // BLOCK) * BLOCK][0]  # padding belongs to its leaf's block
    key = block_leaf if block_leaf is not None else name
    if not runs or key != current:
      runs.append((key, []))
      current = key
    runs[-1][1].append(p)
  return runs


def _run():
  mesh = jax.make_mesh((N,), ("data",))
  tx = onebit_optax.onebit_adam(0.01, axis_name="data", freeze=onebit_optax.fixed_step_freeze(1))
  rng = np.random.default_rng(0)
  params = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in SHAPES.items()}
  state = onebit_optax.init_sharded(tx, params, mesh)
  specs = onebit_optax.state_partition_specs(state, "data")

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data")),
                     out_specs=(P(), specs))
  def step(params, opt_state, x):
    grads = jax.grad(lambda p: sum(jnp.sum(jnp.sin(v * x[0])) for v in p.values()))(
        onebit_optax.local_params(params, "data"))
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  x = jax.device_put(jnp.arange(1.0, N + 1.0), NamedSharding(mesh, P("data")))
  params = jax.device_put(params, NamedSharding(mesh, P()))
  for _ in range(2):  # the freeze, then the first compression step
    params, state = step(params, state, x)
  return state[0]


def test_worker_and_server_scales_are_the_documented_ones():
  s = _run()
  owners, chunk = _layout()
  u = {name: np.asarray(x, np.float32)[:, 0]  # (N, *shape): one leaf per shape
       for name, x in zip(SHAPES, s.local_momentum)}
  worker = np.asarray(s.worker_scale)
  rms = lambda v: np.sqrt(np.sum(np.square(v, dtype=np.float64)) / v.size)
  for k, name in enumerate(SHAPES):  # one scale per whole leaf, per device
    for i in range(N):
      np.testing.assert_allclose(worker[i, k], rms(u[name][i]), rtol=1e-5)
  message = np.asarray(s.momentum_message)
  segments = [_segments(owners, chunk, r) for r in range(N)]
  slots = max(len(seg) for seg in segments)
  assert message.shape == (N, chunk // 8 + 4 * slots)  # no exact leaves here
  for r in range(N):
    served = message[r, chunk // 8:chunk // 8 + 4 * slots].view(np.float32)
    # The server's average of its chunk: each device's leaf scale times the sign of its u.
    average = np.zeros(chunk, np.float64)
    for p in range(chunk):
      name, j = owners[r * chunk + p]
      if name is not None:
        k = list(SHAPES).index(name)
        signs = np.where(u[name].reshape(N, -1)[:, j] >= 0, 1.0, -1.0)
        average[p] = np.mean(worker[:, k] * signs)
    for slot, (leaf, positions) in enumerate(segments[r]):
      real = [p for p in positions if owners[r * chunk + p][0] is not None]
      want = np.sqrt(np.sum(average[real] ** 2) / len(real)) if real else 0.0
      np.testing.assert_allclose(served[slot], want, rtol=1e-5, atol=1e-12,
                                 err_msg=f"chunk {r}, segment {slot} ({leaf})")
    assert not np.any(served[len(segments[r]):])  # unused slots are zero
