"""A benchmark-only prototype of a lean 1-bit Adam compression step (not the package).

It computes what ``onebit_optax.onebit_adam`` computes in the compression phase
(same compressor, same two-phase collective, same wire format, same update;
``check_against_package`` asserts it), restructured to measure what the
package's step could cost:

* ``compressed_mean``: the server averages the ``n`` decoded chunks with an
  explicit sum over the rows instead of ``jnp.mean(decode(rows), axis=0)``,
  which XLA:CPU emits as a slow strided reduction (~20x slower for 4 rows).
  (Adopted by the package in commit 5f6bb7e.)
* The gradient is flattened by one standalone concatenate fenced with
  ``optimization_barrier`` (``flatten_padded``), instead of a concatenate, pad or
  dynamic_update_slice that XLA:CPU fuses into producers/consumers as a slow
  per-element choice between operands (the package moved from ravel_pytree +
  pad to dynamic_update_slice in 5f6bb7e; both fuse and stay slow).
* The moments and error buffers are kept flat and padded: no ravel of the
  state, no unravel of the new momentum into the tree.
* No ``lax.cond`` (the benchmark forces the phase) and no non-finite guard.

Used by benchmarks/optimizer_compute.py (``axis_name=None``) and by the ranks of
benchmarks/comm_throughput.py (``axis_name='data'``). Public API only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

import onebit_optax

B1, B2, EPS = 0.9, 0.999, 1e-8


def _to_bytes(scale):
  return jax.lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.uint8)


def _from_bytes(raw):
  return jax.lax.bitcast_convert_type(raw, jnp.float32)


def _residual(x, scale):
  return x - jnp.where(x >= 0, scale, -scale)


def compressed_mean(x, worker_error, server_error, axis_name, n):
  """onebit_optax.compressed_mean with the server's mean as a sum over rows."""
  d = x.shape[0]
  chunk = d // n
  u = x + worker_error
  packed, scale = onebit_optax.sign_compress(u)
  new_worker_error = _residual(u, scale)
  rows = jnp.concatenate(
      [packed.reshape(n, chunk // 8), jnp.broadcast_to(_to_bytes(scale), (n, 4))], 1)
  if axis_name is not None:
    rows = jax.lax.all_to_all(rows, axis_name, 0, 0, tiled=True)
  scales = _from_bytes(rows[:, chunk // 8:])
  total = onebit_optax.sign_decompress(rows[0, :chunk // 8], scales[0], chunk)
  for i in range(1, n):
    total = total + onebit_optax.sign_decompress(rows[i, :chunk // 8], scales[i], chunk)
  w = total / n + server_error
  server_packed, server_scale = onebit_optax.sign_compress(w)
  new_server_error = _residual(w, server_scale)
  message = jnp.concatenate([server_packed, _to_bytes(server_scale)])
  if axis_name is None:
    gathered = message[None]
  else:
    gathered = jax.lax.all_gather(message, axis_name, to="invarying")
  mean = onebit_optax.sign_decompress(
      gathered[:, :chunk // 8], _from_bytes(gathered[:, chunk // 8:]), chunk)
  return mean.reshape(d), new_worker_error, new_server_error


def init(params, n: int = 1):
  """Flat, padded state of the prototype, as if frozen at step 1 with nu = 1e-6."""
  size = ravel_pytree(params)[0].size
  d = onebit_optax.padded_size(size, n)
  z = lambda k: jnp.zeros(k, jnp.float32)
  return {"count": jnp.ones([], jnp.int32), "freeze_step": jnp.ones([], jnp.int32),
          "mu": z(d), "nu": jnp.full(d, 1e-6, jnp.float32),
          "worker_error": z((1, d)), "server_error": z((1, d // n))}


def state_specs(axis_name):
  """PartitionSpecs: error buffers per device, the rest replicated."""
  from jax.sharding import PartitionSpec as P
  return {"count": P(), "freeze_step": P(), "mu": P(), "nu": P(),
          "worker_error": P(axis_name), "server_error": P(axis_name)}


def flatten_padded(tree, d):
  """ravel_pytree + zero pad to ``d``, as one standalone concatenate.

  XLA:CPU emits a concatenate (or pad, or dynamic_update_slice) that is fused
  with its producers or consumers as a per-element choice between operands,
  5-10x slower per element than a copy. With its operands materialized and its
  result fenced by ``optimization_barrier``, the concatenate stays a plain copy
  (measured 3x faster than the package's dynamic_update_slice flatten, for
  u = flatten(moment) + worker_error at 10M parameters).
  """
  leaves = jax.lax.optimization_barrier([jnp.ravel(x).astype(jnp.float32)
                                         for x in jax.tree.leaves(tree)])
  size = sum(x.size for x in leaves)
  flat = jnp.concatenate(leaves + [jnp.zeros(d - size, jnp.float32)])
  return jax.lax.optimization_barrier(flat)


def update(grads, state, learning_rate, axis_name=None, n: int = 1):
  """One compression-phase step: returns (updates tree, new state)."""
  _, unravel = ravel_pytree(grads)
  size, d = sum(x.size for x in jax.tree.leaves(grads)), state["mu"].size
  g = flatten_padded(grads, d)
  count = state["count"] + 1
  local_mu = B1 * state["mu"] + (1.0 - B1) * g
  mu, worker_error, server_error = compressed_mean(
      local_mu, state["worker_error"][0], state["server_error"][0], axis_name, n)
  bc1 = 1.0 - B1 ** count.astype(jnp.float32)
  bc2 = 1.0 - B2 ** state["freeze_step"].astype(jnp.float32)
  nu = state["nu"]
  # The package drops the padding of the momentum (it unravels mean[:size]); so
  # does this, fused into the same pass.
  mu = jnp.where(jnp.arange(d) < size, mu, 0.0)
  direction = jnp.where(nu > 0, (mu / bc1) / (jnp.sqrt(nu / bc2) + EPS), 0.0)
  updates = unravel(-learning_rate * direction[:size])
  return updates, dict(state, count=count, mu=mu, worker_error=worker_error[None],
                       server_error=server_error[None])


def check_against_package(size: int = 4099, steps: int = 3, learning_rate: float = 1e-3):
  """Asserts the prototype reproduces onebit_adam's compression steps (axis_name=None)."""
  keys = jax.random.split(jax.random.key(0), 2 + steps)
  params = {"a": jax.random.normal(keys[0], (size // 2,)),
            "b": jax.random.normal(keys[1], (size - size // 2,))}
  grads = lambda k: jax.tree.map(lambda p: jax.random.normal(k, p.shape), params)
  tx = onebit_optax.onebit_adam(learning_rate, axis_name=None,
                                freeze=onebit_optax.fixed_step_freeze(1))
  state = tx.init(params)
  _, state = tx.update(grads(keys[2]), state, params)
  inner = state[0]
  flat = lambda t: ravel_pytree(t)[0]
  d = inner.worker_error.shape[1]
  pad = lambda v: jnp.pad(v, (0, d - v.size))
  proto = {"count": inner.count, "freeze_step": inner.freeze_step, "mu": pad(flat(inner.mu)),
           "nu": pad(flat(inner.nu)), "worker_error": inner.worker_error,
           "server_error": inner.server_error}
  for k in keys[2:]:
    ref, state = tx.update(grads(k), state, params)
    got, proto = update(grads(k), proto, learning_rate)
    np.testing.assert_allclose(flat(got), flat(ref), rtol=2e-5, atol=1e-9)
    np.testing.assert_allclose(proto["mu"][:size], flat(state[0].mu), rtol=2e-5, atol=1e-9)
