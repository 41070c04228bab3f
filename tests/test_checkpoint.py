"""Checkpointing: exact resume (per-device buffers included), mesh changes, mismatches.

The reference for a resumed run is the same run never interrupted: every leaf of
the final params and optimizer state must match it to the bit. The per-device
buffers only matter once compression has started, so the test first checks
that they are non-zero at the compression checkpoint and that zeroing them (what
DeepSpeed does on every load) visibly changes the result, i.e. that the
comparison can fail.

A restore onto another mesh keeps the moments and the phase, re-lays out the
compressed mean momentum and hands the error feedback on: checked against
independent numpy models of the message (ckpt_mp_script.decode_message) and of
the hand-on (ckpt_mp_script.expected_carry).

Subprocesses (another device count, two real processes) run under timeouts.
"""

import json
import shutil
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ckpt_mp_script as run
import onebit_optax
import _fields
import _flat

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(HERE, "ckpt_mp_script.py")
TIMEOUT = 150  # seconds for one subprocess, generous for 2 shared cores
# The parameters in flattening order (b1, w1, w2).
SIZES = [run.HIDDEN, run.FEATURES * run.HIDDEN, run.HIDDEN]
FLAT = [1]  # compressed leaves on a flat mesh: w1 (b1 and w2 are exact)
HIER = [0, 1, 2]  # hierarchical: every leaf is compressed
PER_DEVICE = ("local_momentum", "worker_scale", "worker_error", "server_error")
AXES = ("node", "local")
B1 = 0.9  # make_tx's first-moment decay (the default)


def _leaves(prefix, tree):
  return {prefix + k: v for k, v in run.local_leaves(tree).items()}


def _is(key, *names):
  """Whether ``key`` (``opt_state[0].name...``) is one of the 1-bit Adam fields ``names``."""
  return any(f"[0].{name}" in key for name in names)


def _assert_bitwise(actual, expected):
  assert sorted(actual) == sorted(expected)
  for key, want in expected.items():
    got = actual[key]
    assert (got.dtype, got.shape) == (want.dtype, want.shape), key
    assert got.tobytes() == want.tobytes(), (
        f"{key} differs: max |diff| {np.nanmax(np.abs(got.astype(np.float64) - want))}")


def _assert_relaid(new_message, new_compressed, new_n, old_message, old_compressed, old_n):
  """``new_message`` is the old one's momentum compressed again as at the freeze."""
  old = run.decode_message(old_message, SIZES, old_compressed, old_n)
  new = run.decode_message(new_message, SIZES, new_compressed, new_n)
  for i, (m, c) in enumerate(zip(old, new)):
    if i in new_compressed:  # its signs, one scale per leaf: the RMS
      np.testing.assert_array_equal(c >= 0, m >= 0)
      np.testing.assert_allclose(np.abs(c), np.sqrt(np.mean(m.astype(np.float64) ** 2)),
                                 rtol=1e-6)
    else:  # exact: the decoded values themselves
      assert c.tobytes() == m.tobytes(), i


def _assert_carried(got, saved, old, new):
  """The per-device buffers ``got`` (leaves by key) are the numpy model's hand-on of ``saved``.

  ``old`` / ``new``: (compressed leaves, slow, fast) of the saved and the new layout.
  """
  message = got["opt_state[0].momentum_message"]
  want = run.expected_carry(saved, SIZES, old, new, B1, message)
  n = new[1] * new[2]
  assert bool(got["opt_state[0].feedback_valid"])
  assert not np.any(got["opt_state[0].worker_scale"])
  assert any(np.any(e) for e in want["local"].values())  # the reset would fail here
  close = lambda a, b, what: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=what)
  if new[2] == 1:
    for k, i in enumerate(new[0]):
      rows = got[f"opt_state[0].local_momentum[{k}]"].reshape(n, -1)
      for row in rows:  # every device: the mean error (and the message's correction)
        close(row, want["local"][i], f"local_momentum[{k}]")
  else:
    close(got["opt_state[0].worker_error"], want["worker_error"], "worker_error")
  if "server_error" in want:
    assert np.any(want["server_error"])
    close(got["opt_state[0].server_error"], want["server_error"], "server_error")
  else:
    assert "opt_state[0].server_error" not in got


def _fresh_restart(directory, step):
  """Everything rebuilt as after a restart: mesh, optimizer, template, step function."""
  mesh = jax.make_mesh((8,), ("data",))
  tx = run.make_tx()
  template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), run.init_params())
  params, opt_state, restored_step = onebit_optax.restore_checkpoint(
      directory, tx, template, mesh, step=step)
  return mesh, tx, params, opt_state, restored_step


def _train_and_save(directory, mesh, tx, axis):
  params = jax.device_put(run.init_params(), NamedSharding(mesh, P()))
  opt_state = onebit_optax.init_sharded(tx, params, mesh, axis)
  snapshots = {}

  def on_step(t, params, opt_state):
    if t in (run.WARMUP_SAVE, run.COMPRESSION_SAVE):
      assert onebit_optax.save_checkpoint(directory, t, params, opt_state)
      snapshots[t] = {**_leaves("params", params), **_leaves("opt_state", opt_state)}
      np.savez(os.path.join(directory, f"saved_{t}.npz"), **snapshots[t])

  step_fn = run.make_step(tx, mesh, opt_state, axis)
  params, opt_state, losses = run.train(step_fn, mesh, params, opt_state, 0, run.STEPS, on_step)
  final = {**_leaves("params", params), **_leaves("opt_state", opt_state)}
  return directory, snapshots, final, losses


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """The 8-device run, saving at a warmup step and at a compression step on the way."""
  assert jax.device_count() == 8
  return _train_and_save(str(tmp_path_factory.mktemp("ckpt")), jax.make_mesh((8,), ("data",)),
                         run.make_tx(), "data")


def _hier_tx():
  return onebit_optax.onebit_adam(
      3e-2, axis_name=AXES, freeze=onebit_optax.variance_ratio_freeze(**run.FREEZE))


@pytest.fixture(scope="module")
def hierarchical(tmp_path_factory):
  """The same run on a (2, 4) mesh averaging hierarchically."""
  return _train_and_save(str(tmp_path_factory.mktemp("ckpt_hier")), jax.make_mesh((2, 4), AXES),
                         _hier_tx(), AXES)


def test_the_run_crosses_the_phases_where_the_checkpoints_are(uninterrupted):
  _, snapshots, final, _ = uninterrupted
  warm, comp = snapshots[run.WARMUP_SAVE], snapshots[run.COMPRESSION_SAVE]
  # Warmup checkpoint: not frozen, a variance-ratio check already made (so the
  # freeze decision after the restore depends on the restored reference_l1).
  assert not warm["opt_state[0].frozen"]
  assert warm["opt_state[0].reference_l1"] > 0
  assert np.isfinite(warm["opt_state[0].variance_ratio"])
  # Frozen at step 6 (the first possible step), before the compression checkpoint.
  assert comp["opt_state[0].frozen"] and comp["opt_state[0].freeze_step"] == 6
  assert comp["opt_state[0].feedback_valid"]
  for key, value in warm.items():
    if _is(key, *PER_DEVICE, "momentum_message"):
      assert not np.any(value), key
  # None fields: no worker_error on a flat mesh.
  assert not any(_is(key, "worker_error") for key in comp)
  # Different on every device, so a mix-up of rows would show. The server rows
  # are the chunks (one block each): w1 fills chunks 0-1, chunks 2-7 are
  # tail padding, held at exactly zero.
  assert _flat.padded([SIZES[1]], 8) == 8 * 128
  local = comp["opt_state[0].local_momentum[0]"]
  scale = comp["opt_state[0].worker_scale"]
  server = comp["opt_state[0].server_error"]
  assert local.shape == (8, 1, run.FEATURES, run.HIDDEN) and scale.shape == (8, 1)
  assert len({row.tobytes() for row in local}) == 8
  assert len({row.tobytes() for row in scale}) == 8
  assert server.shape == (8, 128)
  assert len({row.tobytes() for row in server[:2]}) == 2 and np.all(np.any(server[:2], axis=1))
  assert not np.any(server[2:])
  # The message: w1 in two segments with their own scales (so a re-layout with
  # one scale per leaf really compresses again), b1 and w2 exact.
  b1, w1, w2 = run.decode_message(comp["opt_state[0].momentum_message"], SIZES, FLAT, 8)
  assert len(np.unique(np.abs(w1))) == 2
  assert np.all(np.isfinite(b1)) and np.any(b1) and np.any(w2)
  assert final["opt_state[0].count"] == run.STEPS


@pytest.mark.parametrize("save_step", [run.WARMUP_SAVE, run.COMPRESSION_SAVE])
def test_resume_is_bitwise_exact(uninterrupted, save_step):
  directory, snapshots, final, losses = uninterrupted
  mesh, tx, params, opt_state, step = _fresh_restart(directory, save_step)
  assert step == save_step
  _assert_bitwise({**_leaves("params", params), **_leaves("opt_state", opt_state)},
                  snapshots[save_step])
  assert opt_state[0].local_momentum[0].sharding.spec[0] == "data"
  assert opt_state[0].server_error.sharding.spec[0] == "data"
  assert opt_state[0].worker_error is None
  # Placed as init_sharded places a fresh state, spelling included (P() and P(None)
  # compare unequal: the first step after a restore compiled once more).
  fresh = onebit_optax.init_sharded(tx, params, mesh)
  assert [x.sharding for x in jax.tree.leaves(opt_state)] == [
      x.sharding for x in jax.tree.leaves(fresh)]

  step_fn = run.make_step(tx, mesh, opt_state)
  out_params, out_state, out_losses = run.train(
      step_fn, mesh, params, opt_state, step, run.STEPS)
  _assert_bitwise({**_leaves("params", out_params), **_leaves("opt_state", out_state)}, final)
  assert out_losses == losses[step:]

  if save_step == run.COMPRESSION_SAVE:
    # The comparison can fail: DeepSpeed-style zeroed buffers change the result.
    s = opt_state[0]
    reset = (s._replace(
        local_momentum=jax.tree.map(jnp.zeros_like, s.local_momentum),
        server_error=jnp.zeros_like(s.server_error),
        feedback_valid=jnp.zeros_like(s.feedback_valid)),) + tuple(opt_state[1:])
    reset_params, _, _ = run.train(step_fn, mesh, params, reset, step, run.STEPS)
    assert any(not np.array_equal(a, final[k])
               for k, a in _leaves("params", reset_params).items())


def test_latest_step_is_the_default(uninterrupted):
  directory = uninterrupted[0]
  *_, step = _fresh_restart(directory, None)
  assert step == run.COMPRESSION_SAVE


def test_the_record_carries_the_format_version(uninterrupted):
  with open(os.path.join(uninterrupted[0], str(run.COMPRESSION_SAVE), "onebit_optax",
                         "metadata")) as f:
    record = json.load(f)
  assert record["onebit_format"] == 5
  assert record["layout"]["num_devices"] == 8 and record["layout"]["compressed"] == FLAT
  assert record["layout"]["buffers"]["worker_error"] is None



def _restore(directory, tx=None, params=None, **kwargs):
  mesh = jax.make_mesh((8,), ("data",))
  params = run.init_params() if params is None else params
  return onebit_optax.restore_checkpoint(
      directory, run.make_tx() if tx is None else tx, params, mesh, **kwargs)


def test_other_parameters_are_refused(uninterrupted):
  directory = uninterrupted[0]
  wider = {**run.init_params(), "w2": np.zeros((run.HIDDEN, 2), np.float32)}
  with pytest.raises(ValueError, match=r"other parameters(.|\n)*\['w2'\]: checkpoint \(40, 1\)"):
    _restore(directory, params=wider)
  extra = {**run.init_params(), "b2": np.zeros((1,), np.float32)}
  with pytest.raises(ValueError, match=r"\['b2'\]: not in the checkpoint"):
    _restore(directory, params=extra)
  half = jax.tree.map(lambda a: a.astype(np.float16), run.init_params())
  with pytest.raises(ValueError, match="other parameters"):
    _restore(directory, params=half)


@pytest.mark.parametrize("tx", [
    onebit_optax.onebit_adam(1e-2, axis_name="data", weight_decay=1e-4,
                             mask={"b1": False, "w1": True, "w2": True}),
    optax.chain(optax.clip_by_global_norm(1.0), run.make_tx()),
    onebit_optax.onebit_adam(1e-2, axis_name="data", moment_dtype=jnp.bfloat16),
    onebit_optax.onebit_adam(1e-2, axis_name="data", error_dtype=jnp.bfloat16),
    onebit_optax.onebit_adam(optax.linear_schedule(1e-2, 0.0, 10), axis_name="data"),
], ids=["weight_decay_mask", "clipping", "moment_dtype", "error_dtype", "schedule"])
def test_another_optimizer_is_refused(uninterrupted, tx):
  with pytest.raises(ValueError, match="another optimizer than `tx`"):
    _restore(uninterrupted[0], tx=tx)


def test_a_checkpoint_saved_without_tx_has_no_hyperparameters_to_check(uninterrupted):
  # Saved without tx= (the fixture does): a new learning rate and a weight decay
  # (the alias always holds its chain element, so the state's structure does not
  # depend on it) restore as they are. With tx=: tests/test_checkpoint_config.py.
  tx = onebit_optax.onebit_adam(1e-3, axis_name="data", weight_decay=1e-4,
                                freeze=onebit_optax.variance_ratio_freeze(**run.FREEZE))
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # the same mesh layout: no reset, no warning
    _, opt_state, step = _restore(uninterrupted[0], tx=tx)
  assert step == run.COMPRESSION_SAVE and bool(np.asarray(opt_state[0].frozen))


def test_another_exact_threshold_re_lays_out_the_message(uninterrupted):
  # exact_below=0 compresses b1 and w2 too: the wire layout (not the device
  # count) changes, which moves the message like a new mesh does.
  tx = onebit_optax.onebit_adam(3e-2, axis_name="data", exact_below=0,
                                freeze=onebit_optax.variance_ratio_freeze(**run.FREEZE))
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # nothing dropped: b1 and w2 become compressed
    _, opt_state, _ = _restore(uninterrupted[0], tx=tx)
  s = opt_state[0]
  assert len(s.local_momentum) == 3
  saved = uninterrupted[1][run.COMPRESSION_SAVE]
  _assert_relaid(np.asarray(s.momentum_message), HIER, 8,
                 saved["opt_state[0].momentum_message"], FLAT, 8)
  # w1's error feedback handed on, its server residual at its new place in the stream.
  _assert_carried(_leaves("opt_state", opt_state), saved, (FLAT, 8, 1), (HIER, 8, 1))


def test_missing_steps_and_foreign_checkpoints_are_refused(uninterrupted, tmp_path):
  with pytest.raises(FileNotFoundError, match=r"no step 4 .*holds steps \[5, 9\]"):
    _restore(uninterrupted[0], step=4)
  with pytest.raises(FileNotFoundError, match="no checkpoint"):
    _restore(str(tmp_path / "empty"))
  assert not (tmp_path / "empty").exists()  # a restore creates nothing
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  with ocp.CheckpointManager(str(tmp_path / "plain")) as manager:
    manager.save(1, args=ocp.args.Composite(params=ocp.args.PyTreeSave(run.init_params())))
    manager.wait_until_finished()
  with pytest.raises(ValueError, match="not written by onebit_optax.save_checkpoint"):
    _restore(str(tmp_path / "plain"))


def _fake_record(directory, record, opt_state):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  with ocp.CheckpointManager(directory) as manager:
    manager.save(3, args=ocp.args.Composite(
        params=ocp.args.PyTreeSave(run.init_params()),
        opt_state=ocp.args.PyTreeSave(opt_state),
        onebit_optax=ocp.args.JsonSave(record)))
    manager.wait_until_finished()


def test_a_checkpoint_of_the_old_flat_layout_is_refused(tmp_path):
  # What onebit-optax wrote before format 3: flat padded moments, leaf_sizes,
  # flat error buffers, and a record without "onebit_format".
  padded = _flat.padded(SIZES, 8)
  old_state = {"mu": np.zeros(padded, np.float32), "nu": np.zeros(padded, np.float32),
               "leaf_sizes": np.asarray(SIZES, np.int32),
               "worker_error": np.zeros((8, padded), np.float32)}
  _fake_record(str(tmp_path / "old"), {
      "format": "onebit_optax.checkpoint/1", "step": 3, "num_devices": 8,
      "padded_size": padded, "error_paths": ["[0].worker_error", "[0].server_error"],
      "params": [], "opt_state_treedef": "", "opt_state": []}, old_state)
  with pytest.raises(ValueError, match=r"older onebit-optax(.|\n)*mu and nu as one padded "
                     r"vector(.|\n)*no conversion is offered(.|\n)*init_sharded") as info:
    _restore(str(tmp_path / "old"))
  assert "'onebit_optax.checkpoint/1'" in str(info.value)
  _fake_record(str(tmp_path / "v3"), {"format": "onebit_optax.checkpoint/3",
                                      "onebit_format": 3}, old_state)
  with pytest.raises(ValueError, match=r"core v3(.|\n)*one array per leaf(.|\n)*init_sharded"):
    _restore(str(tmp_path / "v3"))
  _fake_record(str(tmp_path / "zo4"), {"format": "onebit_optax.checkpoint/4", "onebit_format": 4,
                                       "layout": {"optimizer": "zero_one_adam"}}, old_state)
  with pytest.raises(ValueError, match=r"0/1 Adam state of checkpoint format 4(.|\n)*"
                     r"momentum_message(.|\n)*init_sharded"):
    _restore(str(tmp_path / "zo4"))
  _fake_record(str(tmp_path / "newer"), {"format": "onebit_optax.checkpoint/6",
                                         "onebit_format": 6}, old_state)
  with pytest.raises(ValueError, match="newer onebit-optax"):
    _restore(str(tmp_path / "newer"))


def test_a_state_without_the_sharded_layout_is_refused(tmp_path):
  tx = run.make_tx()
  params = run.init_params()
  mesh = jax.make_mesh((8,), ("data",))
  state = onebit_optax.init_sharded(tx, params, mesh)
  # What shard_map returns for out_specs=P() under check_vma=False: device 0's rows only.
  s = state[0]
  device0 = (s._replace(local_momentum=tuple(np.asarray(u)[:1] for u in s.local_momentum),
                        worker_scale=np.asarray(s.worker_scale)[:1],
                        server_error=np.asarray(s.server_error)[:1]),) + tuple(state[1:])
  with pytest.raises(ValueError, match="layout of onebit_optax.init_sharded"):
    onebit_optax.save_checkpoint(str(tmp_path), 1, params, device0)
  pmapped = jax.tree.map(lambda a: np.stack([np.asarray(a)] * 2), state)
  with pytest.raises(ValueError, match="pmap state"):
    onebit_optax.save_checkpoint(str(tmp_path), 1, params, pmapped)
  with pytest.raises(ValueError, match="exactly one 1-bit Adam or 0/1 Adam state"):
    onebit_optax.save_checkpoint(str(tmp_path), 1, params, optax.adam(1e-3).init(params))
  assert not (tmp_path / "1").exists()


def test_single_device_round_trip_and_restore_from_8_devices(uninterrupted, tmp_path):
  tx = onebit_optax.onebit_adam(1e-2, axis_name=None, freeze=2)
  params = {"w": jnp.linspace(-1.0, 1.0, 300), "b": jnp.arange(3.0)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  for _ in range(4):
    updates, state = update(jax.tree.map(lambda p: jnp.sin(p) + 0.1, params), state, params)
    params = optax.apply_updates(params, updates)
  s = state[0]
  assert bool(_fields.field(state, "frozen")) and np.any(s.local_momentum[0] != 0)
  assert s.server_error is None and s.worker_error is None  # 1 device: None fields
  onebit_optax.save_checkpoint(str(tmp_path), 4, params, state)
  new_params, new_state, _ = onebit_optax.restore_checkpoint(
      str(tmp_path), tx, jax.tree.map(jnp.zeros_like, params), mesh=None)
  assert new_state[0].server_error is None and new_state[0].worker_error is None
  _assert_bitwise(_leaves("", (new_params, new_state)), _leaves("", (params, state)))

  # Through the user's own CheckpointManager (its options apply: keep the last one).
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  options = ocp.CheckpointManagerOptions(max_to_keep=1)
  with ocp.CheckpointManager(str(tmp_path / "managed"), options=options) as manager:
    for step in (1, 2):
      assert onebit_optax.save_checkpoint(manager, step, params, state)
    manager.wait_until_finished()
    assert manager.all_steps() == [2]
    new_params, new_state, step = onebit_optax.restore_checkpoint(manager, tx, params)
  assert step == 2
  _assert_bitwise(_leaves("", (new_params, new_state)), _leaves("", (params, state)))

  # The 8-device compression checkpoint on one device: the message re-laid out,
  # the mean worker error and the servers' residual (no servers on one device)
  # handed on to the one device's error feedback.
  tx1 = onebit_optax.onebit_adam(
      3e-2, axis_name=None, freeze=onebit_optax.variance_ratio_freeze(**run.FREEZE))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _, state1, _ = onebit_optax.restore_checkpoint(
        uninterrupted[0], tx1, run.init_params(), mesh=None)
  s1 = state1[0]
  assert s1.local_momentum[0].shape == (1, 1, run.FEATURES, run.HIDDEN)
  assert s1.server_error is None and s1.worker_error is None
  assert bool(s1.frozen)
  saved = uninterrupted[1][run.COMPRESSION_SAVE]
  for key, value in _leaves("opt_state", state1).items():  # moments and phase: exact
    if not _is(key, *PER_DEVICE, "momentum_message", "feedback_valid"):
      assert value.tobytes() == saved[key].tobytes(), key
  _assert_relaid(np.asarray(s1.momentum_message), FLAT, 1,
                 saved["opt_state[0].momentum_message"], FLAT, 8)
  _assert_carried(_leaves("opt_state", state1), saved, (FLAT, 8, 1), (FLAT, 1, 1))
  # and it trains on: one compression step on one device.
  updates, state1 = jax.jit(tx1.update)(run.init_params(), state1, run.init_params())
  assert all(np.all(np.isfinite(u)) for u in jax.tree.leaves(updates))
  assert bool(state1[0].feedback_valid) and np.any(state1[0].local_momentum[0])


def _env(**extra):
  env = {k: v for k, v in os.environ.items() if not k.startswith("ONEBIT_")}
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
  env.update(extra)
  return env


def test_restore_onto_4_devices_keeps_everything_and_hands_on_the_feedback(uninterrupted):
  directory, snapshots, _, _ = uninterrupted
  proc = subprocess.run(
      [sys.executable, SCRIPT, "resize", "--ckpt", directory, "--out", directory,
       "--step", str(run.COMPRESSION_SAVE), str(run.WARMUP_SAVE)],
      cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT,
      env=_env(XLA_FLAGS="--xla_force_host_platform_device_count=4"))
  assert proc.returncode == 0, proc.stdout + proc.stderr
  for step in (run.COMPRESSION_SAVE, run.WARMUP_SAVE):
    with open(os.path.join(directory, f"resize_{step}.json")) as f:
      info = json.load(f)
    with np.load(os.path.join(directory, f"resize_{step}.npz")) as f:
      out = {k: f[k] for k in f.files}
    saved = snapshots[step]
    assert info["device_count"] == 4 and info["step"] == step
    # mu, nu, nu_l1, phase, counters, variance-ratio fields and params: exactly the saved ones.
    for key, value in saved.items():
      if _is(key, *PER_DEVICE, "momentum_message", "feedback_valid"):
        continue
      assert out["restored_" + key].tobytes() == value.tobytes(), key
    # The per-device buffers, in the 4-device shapes.
    assert out["restored_opt_state[0].local_momentum[0]"].shape == (4, 1, run.FEATURES, run.HIDDEN)
    assert out["restored_opt_state[0].worker_scale"].shape == (4, 1)
    assert out["restored_opt_state[0].server_error"].shape == (4, 128)
    assert not any(_is(key, "worker_error") for key in out)
    restored = {k[len("restored_"):]: v for k, v in out.items() if k.startswith("restored_")}
    if saved["opt_state[0].frozen"]:  # handed on: the mean worker error, the re-cut residual
      _assert_carried(restored, saved, (FLAT, 8, 1), (FLAT, 4, 1))
    else:  # warmup: nothing sent yet, all zero
      for key, value in restored.items():
        if _is(key, *PER_DEVICE):
          assert not np.any(value), key
      assert not restored["opt_state[0].feedback_valid"]
    message = out["restored_opt_state[0].momentum_message"]
    chunk_bytes, segments, exact_chunk = run.message_layout(SIZES, FLAT, 4)
    assert message.shape == (4, chunk_bytes + 4 * (segments + exact_chunk))
    if saved["opt_state[0].frozen"]:
      _assert_relaid(message, FLAT, 4, saved["opt_state[0].momentum_message"], FLAT, 8)
    else:  # never written in warmup: zeros, as on a fresh start
      assert not np.any(message)
    # Training goes on exactly like the hand-built reference state.
    finals = {k[len("final_"):]: v for k, v in out.items() if k.startswith("final_")}
    refs = {k[len("ref_"):]: v for k, v in out.items() if k.startswith("ref_")}
    _assert_bitwise(finals, refs)
    assert finals["opt_state[0].count"] == step + 3
    assert finals["opt_state[0].frozen"]  # both runs are past the freeze (step 6)
    assert np.all(np.isfinite(info["losses"]))
    if step == run.COMPRESSION_SAVE:
      assert finals["opt_state[0].freeze_step"] == 6
      assert np.any(finals["opt_state[0].local_momentum[0]"])  # compression resumed
      assert finals["opt_state[0].feedback_valid"]
    # A move, not a reset: nothing to warn about (nothing dropped: the same leaves
    # are compressed).
    assert info["warnings"] == []


def test_hierarchical_resume_and_moves_to_and_from_a_flat_mesh(hierarchical, uninterrupted):
  directory, snapshots, final, _ = hierarchical
  comp = snapshots[run.COMPRESSION_SAVE]
  assert comp["opt_state[0].frozen"]
  assert not any(_is(key, "local_momentum") for key in comp)  # None when hierarchical
  padded = _flat.padded(SIZES, 8)
  assert comp["opt_state[0].worker_error"].shape == (8, padded // 4)
  assert np.any(comp["opt_state[0].worker_error"])
  # Row node * 4 + f holds slice f (worker) and serves chunk f * 2 + node (server): the
  # stream (b1, w1, w2: 4 blocks) fills chunks 0-3, i.e. slices 0-1, rows 0, 1, 4, 5.
  for name in ("worker_error", "server_error"):
    rows = comp[f"opt_state[0].{name}"]
    assert [bool(np.any(row)) for row in rows] == [True, True, False, False] * 2, name
  template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), run.init_params())
  tx, mesh = _hier_tx(), jax.make_mesh((2, 4), AXES)
  # The same mesh: bit for bit, to the end of the run.
  params, opt_state, step = onebit_optax.restore_checkpoint(directory, tx, template, mesh, AXES)
  _assert_bitwise({**_leaves("params", params), **_leaves("opt_state", opt_state)}, comp)
  step_fn = run.make_step(tx, mesh, opt_state, AXES)
  params, opt_state, _ = run.train(step_fn, mesh, params, opt_state, step, run.STEPS)
  _assert_bitwise({**_leaves("params", params), **_leaves("opt_state", opt_state)}, final)

  # Hierarchical -> flat on the same 8 devices: b1 and w2 become exact, their
  # residual is dropped (with a warning naming them); w1's is handed on.
  flat_mesh = jax.make_mesh((8,), ("data",))
  with pytest.warns(UserWarning, match=r"\['b1'\]", ) as caught:
    _, flat_state, _ = onebit_optax.restore_checkpoint(directory, run.make_tx(), template,
                                                       flat_mesh)
  assert "['w2']" in str(caught[0].message) and "['w1']" not in str(caught[0].message)
  s = flat_state[0]
  assert s.worker_error is None and s.local_momentum[0].shape == (8, 1, run.FEATURES, run.HIDDEN)
  np.testing.assert_array_equal(np.asarray(s.mu["w1"]), comp["opt_state[0].mu['w1']"])
  _assert_relaid(np.asarray(s.momentum_message), FLAT, 8,
                 comp["opt_state[0].momentum_message"], HIER, 8)
  _assert_carried(_leaves("opt_state", flat_state), comp, (HIER, 2, 4), (FLAT, 8, 1))

  # Flat -> hierarchical: the flat run's compression checkpoint.
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _, hier_state, _ = onebit_optax.restore_checkpoint(uninterrupted[0], tx, template, mesh,
                                                       AXES)
  s = hier_state[0]
  assert s.local_momentum is None and s.worker_error.shape == (8, padded // 4)
  flat_comp = uninterrupted[1][run.COMPRESSION_SAVE]
  _assert_relaid(np.asarray(s.momentum_message), HIER, 8,
                 flat_comp["opt_state[0].momentum_message"], FLAT, 8)
  _assert_carried(_leaves("opt_state", hier_state), flat_comp, (FLAT, 8, 1), (HIER, 2, 4))
  # and it trains on.
  step_fn = run.make_step(tx, mesh, hier_state, AXES)
  params = jax.device_put(
      {name: flat_comp[f"params['{name}']"] for name in run.init_params()},
      NamedSharding(mesh, P()))
  params, hier_state, losses = run.train(step_fn, mesh, params, hier_state,
                                         run.COMPRESSION_SAVE, run.STEPS)
  assert np.all(np.isfinite(losses)) and np.any(np.asarray(hier_state[0].worker_error))


def test_two_processes_resume_bitwise_after_a_kill(tmp_path):
  launch = [sys.executable, "-m", "onebit_optax.launch", "--nproc", "2",
            "--devices-per-process", "1", "--timeout", str(TIMEOUT - 30), SCRIPT, "mp"]
  ckpt = str(tmp_path / "ckpt")

  def launch_run(name, *args):
    out = tmp_path / name
    out.mkdir()
    proc = subprocess.run(launch + ["--ckpt", ckpt, "--out", str(out), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    return proc.returncode, proc.stdout + proc.stderr, out

  code, output, _ = launch_run("crashed", "--save-at", str(run.COMPRESSION_SAVE))
  assert code == 128 + 9, output  # the launcher's code for a SIGKILLed rank
  assert "saved step 9; frozen=True" in output, output
  # New processes: first the uninterrupted reference run, then the restored one.
  code, output, out = launch_run("resumed", "--resume", "--with-reference")
  assert code == 0, output
  assert "[rank 1] done from step 0" in output and "[rank 1] done from step 9" in output, output

  for rank in range(2):
    with np.load(out / f"final_{rank}.npz") as a, np.load(out / f"reference_{rank}.npz") as b:
      got, want = {k: a[k] for k in a.files}, {k: b[k] for k in b.files}
    _assert_bitwise(got, want)
    assert want["opt_state[0].count"] == run.STEPS
    # This process's own row of the per-device buffers.
    assert want["opt_state[0].local_momentum[0]"].shape == (1, 1, run.FEATURES, run.HIDDEN)
    assert np.any(want["opt_state[0].local_momentum[0]"])
    assert want["opt_state[0].server_error"].shape == (1, _flat.padded([SIZES[1]], 2) // 2)


def test_after_a_move_the_devices_send_the_mean_the_uninterrupted_run_sends(uninterrupted):
  """One step after 8 -> 4: the mean of what the 4 devices compress is the 8 devices' mean.

  ``local_momentum`` holds what each device compressed, ``u = b1 m + (1 - b1) g + e``;
  with the same global batch the mean gradient is the same, so the mean of ``u``
  over the devices is the same only if the restore handed on the mean worker
  error and the message's correction. The zeroed buffers (DeepSpeed) miss it.
  """
  directory = uninterrupted[0]
  step = run.COMPRESSION_SAVE
  x, y = run.global_batch(step + 1, 8)  # the uninterrupted run's next global batch

  def sent(mesh, opt_state, params, tx):
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))
    _, new_state, _ = run.make_step(tx, mesh, opt_state)(params, opt_state, put(x), put(y))
    return np.asarray(new_state[0].local_momentum[0], np.float64).mean(axis=0)

  mesh8, tx8, params8, state8, _ = _fresh_restart(directory, step)
  want = sent(mesh8, state8, params8, tx8)
  mesh4 = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  tx4 = run.make_tx()
  template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), run.init_params())
  params4, state4, _ = onebit_optax.restore_checkpoint(directory, tx4, template, mesh4)
  np.testing.assert_allclose(sent(mesh4, state4, params4, tx4), want, rtol=1e-5, atol=1e-6)
  s = state4[0]  # the comparison can fail: the error feedback zeroed
  zeroed = (s._replace(local_momentum=jax.tree.map(jnp.zeros_like, s.local_momentum),
                       worker_scale=jnp.zeros_like(s.worker_scale),
                       server_error=jnp.zeros_like(s.server_error),
                       feedback_valid=jnp.zeros_like(s.feedback_valid)),) + tuple(state4[1:])
  assert not np.allclose(sent(mesh4, zeroed, params4, tx4), want, rtol=1e-5, atol=1e-6)


def test_a_record_of_an_earlier_writer_still_restores(uninterrupted, tmp_path):
  """Format 4 (1-bit Adam's layout is the same in 5), without the model-parallel and hyperparameter fields."""
  directory = str(tmp_path / "ckpt")
  shutil.copytree(uninterrupted[0], directory)
  path = os.path.join(directory, str(run.COMPRESSION_SAVE), "onebit_optax", "metadata")
  with open(path) as f:
    record = json.load(f)
  for key in ("model_shards", "mesh", "param_specs"):
    del record["layout"][key]
  del record["config"]
  record.update(onebit_format=4, format="onebit_optax.checkpoint/4")
  with open(path, "w") as f:
    json.dump(record, f)
  _, _, params, opt_state, _ = _fresh_restart(directory, run.COMPRESSION_SAVE)
  _assert_bitwise({**_leaves("params", params), **_leaves("opt_state", opt_state)},
                  uninterrupted[1][run.COMPRESSION_SAVE])
  _, state1, _ = onebit_optax.restore_checkpoint(  # and moved: onto one device
      directory, onebit_optax.onebit_adam(
          3e-2, axis_name=None, freeze=onebit_optax.variance_ratio_freeze(**run.FREEZE)),
      run.init_params(), mesh=None)
  _assert_carried(_leaves("opt_state", state1), uninterrupted[1][run.COMPRESSION_SAVE],
                  (FLAT, 8, 1), (FLAT, 1, 1))


def test_two_processes_restore_an_8_device_checkpoint_onto_4_devices(uninterrupted, tmp_path):
  """The move across processes: 2 processes of 2 devices each, the feedback handed on."""
  directory, snapshots, _, _ = uninterrupted
  proc = subprocess.run(
      [sys.executable, "-m", "onebit_optax.launch", "--nproc", "2", "--devices-per-process", "2",
       "--timeout", str(TIMEOUT - 30), SCRIPT, "mp-resize", "--ckpt", directory,
       "--out", str(tmp_path), "--step", str(run.COMPRESSION_SAVE)],
      cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT, env=_env())
  assert proc.returncode == 0, proc.stdout + proc.stderr
  saved = snapshots[run.COMPRESSION_SAVE]
  rows = {}
  for rank in range(2):
    with np.load(tmp_path / f"resize_{rank}.npz") as f:
      got = {k: f[k] for k in f.files}
    assert np.all(np.isfinite(got["losses"]))
    for key, value in got.items():  # mu, nu, phase, counters: exactly the saved ones
      if key.startswith("opt_state") and not _is(key, *PER_DEVICE, "momentum_message",
                                                 "feedback_valid"):
        assert value.tobytes() == saved[key].tobytes(), key
    rows.update({k: v for k, v in got.items() if k.startswith("row")})
    message, valid = got["opt_state[0].momentum_message"], got["opt_state[0].feedback_valid"]
  # Every device's row, gathered from both processes, is the numpy model's hand-on.
  whole = {name: np.stack([rows[f"row{r}_opt_state[0].{name}"] for r in range(4)])
           for name in ("local_momentum[0]", "worker_scale", "server_error")}
  _assert_carried({**{f"opt_state[0].{k}": v for k, v in whole.items()},
                   "opt_state[0].momentum_message": message,
                   "opt_state[0].feedback_valid": valid},
                  saved, (FLAT, 8, 1), (FLAT, 4, 1))
