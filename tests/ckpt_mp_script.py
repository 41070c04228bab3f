"""The training run of tests/test_checkpoint.py, and its subprocess entry points.

Imported by the test (one process, 8 simulated devices) and run as a script:

* ``resize``: restores a checkpoint saved on 8 devices onto this process's
  devices (4, set by the test through XLA_FLAGS) and trains on, next to a
  reference state built by hand (``init_sharded`` on 4 devices, with the saved
  values of every field but the mesh-dependent ones written in, read from
  ``--out/saved_<step>.npz``; the re-laid-out message and the handed-on
  buffers are the restored ones, which the test checks against
  :func:`decode_message` and :func:`expected_carry`). Writes
  ``resize_<step>.npz`` and ``resize_<step>.json`` to ``--out``.
* ``mp-resize``: one rank of a multi-process restore of the 8-device
  checkpoint ``--ckpt`` (``--step``) onto the processes' devices; writes what
  this process holds of the restored state to ``--out/resize_<rank>.npz``.
* ``mp``: one rank of a multi-process run (``python -m onebit_optax.launch``):
  trains from scratch or restores ``--ckpt``, may save at ``--save-at`` and then
  SIGKILL itself (a crash right after the checkpoint), and writes what this
  process holds of the final params and state to ``--out/final_<rank>.npz``.
  With ``--with-reference`` it first trains from scratch without interruption
  and writes that run's result to ``--out/reference_<rank>.npz``.

Every process sees the same global batches and takes its own rows of them
(``jax.make_array_from_process_local_data``), as a per-host data loader would.
"""

import argparse
import functools
import json
import os
import signal
import warnings

import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import onebit_optax
from onebit_optax import launch
import _flat

# w1 (240 elements, 2 blocks) is compressed: on 8 devices it spans two chunks,
# i.e. two segments with their own scales; b1 and w2 (40 each, under
# EXACT_BELOW = 64) travel as exact float32.
FEATURES, HIDDEN, ROWS_PER_DEVICE = 6, 40, 4
STEPS = 12
# Freeze by the variance ratio (checked every 2 steps, first possible at step 6):
# a restore in warmup must carry reference_l1 / variance_ratio over for the
# freeze to happen at the same step.
FREEZE = dict(min_steps=6, interval=2, threshold=0.5)
WARMUP_SAVE, COMPRESSION_SAVE = 5, 9


def make_tx():
  return onebit_optax.onebit_adam(
      3e-2, axis_name="data", freeze=onebit_optax.variance_ratio_freeze(**FREEZE))


def init_params():
  rng = np.random.default_rng(0)
  return {
      "w1": (rng.standard_normal((FEATURES, HIDDEN)) / np.sqrt(FEATURES)).astype(np.float32),
      "b1": np.zeros((HIDDEN,), np.float32),
      "w2": (rng.standard_normal((HIDDEN, 1)) / np.sqrt(HIDDEN)).astype(np.float32),
  }


def loss_fn(params, x, y):
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  return jnp.mean((h @ params["w2"] - y) ** 2)


def global_batch(step, num_devices):
  rng = np.random.default_rng(1000 + step)
  n = num_devices * ROWS_PER_DEVICE
  x = rng.standard_normal((n, FEATURES)).astype(np.float32)
  # A per-row offset makes every device's gradient (and momentum) different.
  y = np.sin(x.sum(axis=1, keepdims=True)) + np.arange(n, dtype=np.float32)[:, None] / n
  return x, y.astype(np.float32)


def make_step(tx, mesh, opt_state, axis="data"):
  """The shard_map training step; ``axis`` is a mesh axis or a (slow, fast) pair."""
  specs = onebit_optax.state_partition_specs(opt_state, axis)
  names = axis if isinstance(axis, tuple) else (axis,)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P(axis), P(axis)),
                     out_specs=(P(), specs, P()))
  def step(params, opt_state, x, y):
    local = params
    for name in names:
      local = onebit_optax.local_params(local, name)
    loss, grads = jax.value_and_grad(loss_fn)(local, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, axis)
  return step


def put_batch(mesh, t):
  """Step ``t``'s batch, each process contributing its own (contiguous) rows."""
  sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
  x, y = global_batch(t, mesh.size)
  starts = sorted({idx[0].start or 0
                   for idx in sharding.addressable_devices_indices_map(x.shape).values()})
  rows = slice(starts[0], starts[-1] + ROWS_PER_DEVICE)
  return tuple(jax.make_array_from_process_local_data(sharding, a[rows], a.shape)
               for a in (x, y))


def train(step_fn, mesh, params, opt_state, start, stop, on_step=None):
  """Steps ``start + 1 .. stop`` (1-based: the state after step t has count t)."""
  losses = []
  for t in range(start + 1, stop + 1):
    params, opt_state, loss = step_fn(params, opt_state, *put_batch(mesh, t))
    losses.append(float(np.asarray(loss.addressable_shards[0].data)))
    if on_step is not None:
      on_step(t, params, opt_state)
  return params, opt_state, losses


def local_leaves(tree):
  """Every leaf by key path: all of it, or this process's first shard if not addressable."""
  def value(leaf):
    if leaf.is_fully_addressable:
      return np.asarray(leaf)
    return np.asarray(leaf.addressable_shards[0].data)
  return {jax.tree_util.keystr(path): value(leaf)
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


# The fields whose shapes depend on the mesh: reset (per-device) or re-laid out
# (the message) by a restore onto another mesh.
SIZED = ("local_momentum", "worker_scale", "worker_error", "server_error", "momentum_message")


def message_layout(sizes, compressed, n):
  """Byte offsets of one message: (chunk_bytes, segments, exact_chunk), an independent model."""
  comp = [sizes[i] for i in compressed]
  exact = sum(s for i, s in enumerate(sizes) if i not in compressed and s > 0)
  return (_flat.padded(comp, n) // n // 8, _flat.max_segments(comp, n), -(-exact // n))


def decode_message(message, sizes, compressed, n):
  """The leaves (flat float32 numpy, in tree order) that a gathered message holds.

  Compressed leaves: their packed sign bits (bit 1: +scale, little bit order)
  laid out leaf after leaf on 128-element blocks, the stream cut into n
  chunks, one scale per segment (a run of one leaf's blocks in a chunk).
  Exact leaves: float32, concatenated, cut into n chunks.
  """
  message = np.asarray(message)
  chunk_bytes, segments, exact_chunk = message_layout(sizes, compressed, n)
  assert message.shape == (n, chunk_bytes + 4 * (segments + exact_chunk)), message.shape
  bits = np.unpackbits(message[:, :chunk_bytes].reshape(-1), bitorder="little")
  scales = np.ascontiguousarray(message[:, chunk_bytes:chunk_bytes + 4 * segments]).view("<f4")
  floats = np.ascontiguousarray(message[:, chunk_bytes + 4 * segments:]).view("<f4").reshape(-1)
  comp = [sizes[i] for i in compressed]
  owners = _flat._blocks(comp)
  blocks_per_chunk = chunk_bytes * 8 // _flat.BLOCK
  owners += [-1] * (n * blocks_per_chunk - len(owners))
  block_scale = []
  for b, owner in enumerate(owners):
    r, j = divmod(b, blocks_per_chunk)
    start = r * blocks_per_chunk
    seg = sum(owners[k] != owners[k - 1] for k in range(start + 1, b + 1))
    block_scale.append(scales[r, seg])
  values = np.where(bits == 1, 1.0, -1.0).astype(np.float32) * np.repeat(
      np.asarray(block_scale, np.float32), _flat.BLOCK)
  out, exact_offset = [], 0
  offsets = dict(zip(compressed, _flat.offsets(comp)))
  for i, size in enumerate(sizes):
    if i in compressed:
      out.append(values[offsets[i]:offsets[i] + size])
    elif size:
      out.append(floats[exact_offset:exact_offset + size])
      exact_offset += size
    else:
      out.append(np.zeros((0,), np.float32))
  return out


def _stream_leaves(stream, sizes, compressed):
  """The compressed leaves' pieces of a padded stream (leaf after leaf on 128-blocks), by leaf index."""
  comp = [sizes[i] for i in compressed]
  return {i: stream[o:o + sizes[i]] for i, o in zip(compressed, _flat.offsets(comp))}


def _stream(pieces, sizes, compressed, n):
  """The padded stream of ``n`` chunks holding ``pieces`` (leaf index -> flat values)."""
  comp = [sizes[i] for i in compressed]
  out = np.zeros(_flat.padded(comp, n), np.float32)
  for i, o in zip(compressed, _flat.offsets(comp)):
    out[o:o + sizes[i]] = pieces.get(i, 0.0)
  return out


def expected_carry(saved, sizes, old, new, b1, new_message):
  """An independent numpy model of what a restore onto another mesh hands on.

  ``old`` / ``new``: ``(compressed, slow, fast)`` of each layout (fast = 1:
  flat). The mean worker error over the devices (flat: ``u - s sign(u)``
  from ``local_momentum`` / ``worker_scale``; hierarchical: ``worker_error``,
  row ``node * fast + f`` holding slice f, averaged over the nodes) plus
  ``b1 (m - C'(m))`` goes to every new device; the server residual (row
  ``node * fast + f`` serves chunk ``f * slow + node``) is cut into the new
  chunks, or added to the worker error on one device. Returns
  ``{"local": {leaf: flat}, "worker_error": rows, "server_error": rows}``.
  """
  (old_c, old_slow, old_fast), (new_c, new_slow, new_fast) = old, new
  old_n, new_n = old_slow * old_fast, new_slow * new_fast
  valid = bool(saved["opt_state[0].feedback_valid"])
  if old_fast == 1:
    scale = saved["opt_state[0].worker_scale"].astype(np.float64)
    error = {}
    for k, i in enumerate(old_c):
      u = saved[f"opt_state[0].local_momentum[{k}]"].reshape(old_n, -1).astype(np.float64)
      s = scale[:, k:k + 1]
      error[i] = np.mean(u - np.where(u >= 0, s, -s), axis=0) if valid else 0 * u[0]
  else:
    rows = saved["opt_state[0].worker_error"].astype(np.float64).reshape(old_slow, old_fast, -1)
    error = _stream_leaves(rows.mean(axis=0).reshape(-1) * valid, sizes, old_c)
  server = {}
  if "opt_state[0].server_error" in saved:
    rows = saved["opt_state[0].server_error"].astype(np.float64)
    chunks = rows.reshape(old_slow, old_fast, -1).transpose(1, 0, 2).reshape(-1)
    server = _stream_leaves(chunks, sizes, old_c)
  m_old = decode_message(saved["opt_state[0].momentum_message"], sizes, old_c, old_n)
  m_new = decode_message(new_message, sizes, new_c, new_n)
  local = {}
  for i in new_c:
    e = error.get(i, np.zeros(sizes[i])) + b1 * (m_old[i].astype(np.float64) - m_new[i])
    local[i] = e + (server.get(i, 0.0) if new_slow == 1 else 0.0)
  out = {"local": local}
  if new_slow > 1:
    stream = _stream(server, sizes, new_c, new_n)
    out["server_error"] = stream.reshape(new_fast, new_slow, -1).transpose(1, 0, 2).reshape(
        new_n, -1)
  if new_fast > 1:
    slices = _stream(local, sizes, new_c, new_n).reshape(new_fast, -1)
    out["worker_error"] = np.broadcast_to(slices[None], (new_slow,) + slices.shape).reshape(
        new_n, -1)
  return out


def _resize(args, step, mesh, tx, step_fns):
  template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), init_params())
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    params, opt_state, step = onebit_optax.restore_checkpoint(
        args.ckpt, tx, template, mesh, step=step)
  messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]

  # The reference: a fresh 4-device state with every saved field but the
  # mesh-dependent ones written in by hand, from the values the 8-device run
  # held; feedback_valid False; the message: the restored one (checked by the test).
  with np.load(os.path.join(args.out, f"saved_{step}.npz")) as f:
    saved = {k: f[k] for k in f.files}
  ref_params = jax.device_put(
      {name: saved[f"params['{name}']"] for name in init_params()}, NamedSharding(mesh, P()))
  ref_state = onebit_optax.init_sharded(tx, ref_params, mesh)

  restored_sized = {jax.tree_util.keystr(path): leaf for path, leaf in
                    jax.tree_util.tree_flatten_with_path(opt_state)[0]}

  def fill(path, leaf):
    key = jax.tree_util.keystr(path)
    if any(key.startswith(f"[0].{name}") for name in SIZED + ("feedback_valid",)):
      return restored_sized[key]
    return jax.device_put(saved["opt_state" + key], leaf.sharding)
  ref_state = jax.tree_util.tree_map_with_path(fill, ref_state)

  restored = {f"restored_opt_state{k}": v for k, v in local_leaves(opt_state).items()}
  restored.update({f"restored_params{k}": v for k, v in local_leaves(params).items()})
  if not step_fns:  # one compilation for both restores
    step_fns.append(make_step(tx, mesh, opt_state))
  step_fn = step_fns[0]
  stop = step + args.more_steps
  params, opt_state, losses = train(step_fn, mesh, params, opt_state, step, stop)
  ref_params, ref_state, ref_losses = train(step_fn, mesh, ref_params, ref_state, step, stop)

  out = dict(restored)
  out.update({f"final_params{k}": v for k, v in local_leaves(params).items()})
  out.update({f"final_opt_state{k}": v for k, v in local_leaves(opt_state).items()})
  out.update({f"ref_params{k}": v for k, v in local_leaves(ref_params).items()})
  out.update({f"ref_opt_state{k}": v for k, v in local_leaves(ref_state).items()})
  np.savez(os.path.join(args.out, f"resize_{step}.npz"), **out)
  with open(os.path.join(args.out, f"resize_{step}.json"), "w") as f:
    json.dump({"step": step, "warnings": messages, "device_count": jax.device_count(),
               "losses": losses, "ref_losses": ref_losses}, f)


def _mp_run(args, resume):
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  tx = make_tx()
  if resume:
    template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), init_params())
    params, opt_state, start = onebit_optax.restore_checkpoint(args.ckpt, tx, template, mesh)
  else:
    params = jax.device_put(init_params(), NamedSharding(mesh, P()))
    opt_state = onebit_optax.init_sharded(tx, params, mesh)
    start = 0
  step_fn = make_step(tx, mesh, opt_state)

  def on_step(t, params, opt_state):
    if t == args.save_at:
      onebit_optax.save_checkpoint(args.ckpt, t, params, opt_state)
      # Crash once every process has returned from its save: the checkpoint
      # must already be complete on disk.
      multihost_utils.sync_global_devices("saved")
      print(f"saved step {t}; frozen={bool(local_leaves(opt_state)['[0].frozen'])}",
            flush=True)
      os.kill(os.getpid(), signal.SIGKILL)

  params, opt_state, losses = train(step_fn, mesh, params, opt_state, start, args.steps,
                                    on_step)
  print(f"done from step {start}: losses {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
  return {**{f"params{k}": v for k, v in local_leaves(params).items()},
          **{f"opt_state{k}": v for k, v in local_leaves(opt_state).items()}}


def _mp(args):
  launch.initialize(initialization_timeout=60)
  rank = jax.process_index()
  if args.with_reference:  # the uninterrupted run, from scratch, in these processes
    np.savez(os.path.join(args.out, f"reference_{rank}.npz"), **_mp_run(args, resume=False))
  # Everything rebuilt for the run that is measured (optimizer, step function).
  np.savez(os.path.join(args.out, f"final_{rank}.npz"), **_mp_run(args, resume=args.resume))


def _mp_resize(args):
  """One rank of a multi-process restore of an 8-device checkpoint onto these processes' devices.

  Writes ``resize_<rank>.npz``: every leaf as this process holds it (its first
  shard), and each per-device buffer's addressable rows as ``row<i>_<key>``;
  then trains ``--more-steps`` steps and writes the losses.
  """
  launch.initialize(initialization_timeout=60)
  rank = jax.process_index()
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  tx = make_tx()
  template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), init_params())
  params, opt_state, step = onebit_optax.restore_checkpoint(args.ckpt, tx, template, mesh,
                                                            step=args.step[0])
  out = {f"opt_state{k}": v for k, v in local_leaves(opt_state).items()}
  for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
    key = "opt_state" + jax.tree_util.keystr(path)
    if any(key.startswith(f"opt_state[0].{name}") for name in SIZED[:-1]):
      for shard in leaf.addressable_shards:
        out[f"row{shard.index[0].start}_{key}"] = np.asarray(shard.data)[0]
  _, _, losses = train(make_step(tx, mesh, opt_state), mesh, params, opt_state, step,
                       step + args.more_steps)
  out["losses"] = np.asarray(losses)
  np.savez(os.path.join(args.out, f"resize_{rank}.npz"), **out)
  print(f"restored step {step} onto {jax.device_count()} devices: losses {losses}", flush=True)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("mode", choices=["resize", "mp", "mp-resize"])
  parser.add_argument("--ckpt", required=True)
  parser.add_argument("--out", required=True)
  parser.add_argument("--step", type=int, nargs="+", help="resize: the steps to restore")
  parser.add_argument("--more-steps", type=int, default=3)
  parser.add_argument("--steps", type=int, default=STEPS)
  parser.add_argument("--save-at", type=int, default=-1)
  parser.add_argument("--resume", action="store_true")
  parser.add_argument("--with-reference", action="store_true",
                      help="mp: first run the whole training uninterrupted, for comparison")
  args = parser.parse_args()
  if args.mode == "resize":
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    tx, step_fns = make_tx(), []
    for step in args.step:
      _resize(args, step, mesh, tx, step_fns)
  elif args.mode == "mp-resize":
    _mp_resize(args)
  else:
    _mp(args)


if __name__ == "__main__":
  main()
