"""Checkpointing: exact resume (error buffers included), device-count changes, mismatches.

The reference for a resumed run is the same run never interrupted: every leaf of
the final params and optimizer state must match it to the bit. The per-device
error buffers only matter once compression has started, so the test first checks
that they are non-zero at the compression checkpoint and that zeroing them (what
DeepSpeed does on every load) visibly changes the result, i.e. that the
comparison can fail.

Subprocesses (another device count, two real processes) run under timeouts.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ckpt_mp_script as run
import onebit_optax
import _flat

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(HERE, "ckpt_mp_script.py")
TIMEOUT = 150  # seconds for one subprocess, generous for 2 shared cores
ERRORS = ("[0].worker_error", "[0].server_error")
MOMENTS = ("[0].mu", "[0].nu")  # flat, padded for the device count
# The parameters in flattening order (b1, w1, w2): one block of 128 each.
SIZES = [run.HIDDEN, run.FEATURES * run.HIDDEN, run.HIDDEN]


def _leaves(prefix, tree):
  return {prefix + k: v for k, v in run.local_leaves(tree).items()}


def _assert_bitwise(actual, expected):
  assert sorted(actual) == sorted(expected)
  for key, want in expected.items():
    got = actual[key]
    assert (got.dtype, got.shape) == (want.dtype, want.shape), key
    assert got.tobytes() == want.tobytes(), (
        f"{key} differs: max |diff| {np.nanmax(np.abs(got.astype(np.float64) - want))}")


def _fresh_restart(directory, step):
  """Everything rebuilt as after a restart: mesh, optimizer, template, step function."""
  mesh = jax.make_mesh((8,), ("data",))
  tx = run.make_tx()
  template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), run.init_params())
  params, opt_state, restored_step = onebit_optax.restore_checkpoint(
      directory, tx, template, mesh, step=step)
  return mesh, tx, params, opt_state, restored_step


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """The 8-device run, saving at a warmup step and at a compression step on the way."""
  assert jax.device_count() == 8
  directory = str(tmp_path_factory.mktemp("ckpt"))
  mesh = jax.make_mesh((8,), ("data",))
  tx = run.make_tx()
  params = jax.device_put(run.init_params(), NamedSharding(mesh, P()))
  opt_state = onebit_optax.init_sharded(tx, params, mesh)
  snapshots = {}

  def on_step(t, params, opt_state):
    if t in (run.WARMUP_SAVE, run.COMPRESSION_SAVE):
      assert onebit_optax.save_checkpoint(directory, t, params, opt_state)
      snapshots[t] = {**_leaves("params", params), **_leaves("opt_state", opt_state)}
      np.savez(os.path.join(directory, f"saved_{t}.npz"), **snapshots[t])

  step_fn = run.make_step(tx, mesh, opt_state)
  params, opt_state, losses = run.train(step_fn, mesh, params, opt_state, 0, run.STEPS, on_step)
  final = {**_leaves("params", params), **_leaves("opt_state", opt_state)}
  return directory, snapshots, final, losses


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
  for key in ERRORS:
    assert np.all(warm["opt_state" + key] == 0)
    assert comp["opt_state" + key].shape[0] == 8
  # Different on every device, so a mix-up of rows would show. The server rows
  # are the chunks (one block each): the 3 leaves fill chunks 0-2, chunks 3-7 are
  # tail padding, held at exactly zero.
  assert _flat.padded(SIZES, 8) == 8 * 128
  worker, server = (comp["opt_state" + key] for key in ERRORS)
  assert len({row.tobytes() for row in worker}) == 8
  assert len({row.tobytes() for row in server[:3]}) == 3 and np.all(np.any(server[:3], axis=1))
  assert not np.any(server[3:])
  assert final["opt_state[0].count"] == run.STEPS


@pytest.mark.parametrize("save_step", [run.WARMUP_SAVE, run.COMPRESSION_SAVE])
def test_resume_is_bitwise_exact(uninterrupted, save_step):
  directory, snapshots, final, losses = uninterrupted
  mesh, tx, params, opt_state, step = _fresh_restart(directory, save_step)
  assert step == save_step
  _assert_bitwise({**_leaves("params", params), **_leaves("opt_state", opt_state)},
                  snapshots[save_step])
  assert opt_state[0].worker_error.sharding.spec == P("data")

  step_fn = run.make_step(tx, mesh, opt_state)
  out_params, out_state, out_losses = run.train(
      step_fn, mesh, params, opt_state, step, run.STEPS)
  _assert_bitwise({**_leaves("params", out_params), **_leaves("opt_state", out_state)}, final)
  assert out_losses == losses[step:]

  if save_step == run.COMPRESSION_SAVE:
    # The comparison can fail: DeepSpeed-style zeroed error buffers change the result.
    reset = (opt_state[0]._replace(
        worker_error=jnp.zeros_like(opt_state[0].worker_error),
        server_error=jnp.zeros_like(opt_state[0].server_error)),) + tuple(opt_state[1:])
    reset_params, _, _ = run.train(step_fn, mesh, params, reset, step, run.STEPS)
    assert any(not np.array_equal(a, final[k])
               for k, a in _leaves("params", reset_params).items())


def test_latest_step_is_the_default(uninterrupted):
  directory = uninterrupted[0]
  *_, step = _fresh_restart(directory, None)
  assert step == run.COMPRESSION_SAVE


def _restore(directory, tx=None, params=None, **kwargs):
  mesh = jax.make_mesh((8,), ("data",))
  params = run.init_params() if params is None else params
  return onebit_optax.restore_checkpoint(
      directory, run.make_tx() if tx is None else tx, params, mesh, **kwargs)


def test_other_parameters_are_refused(uninterrupted):
  directory = uninterrupted[0]
  wider = {**run.init_params(), "w2": np.zeros((run.HIDDEN, 2), np.float32)}
  with pytest.raises(ValueError, match=r"other parameters(.|\n)*\['w2'\]: checkpoint \(7, 1\)"):
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


def test_hyperparameters_that_do_not_shape_the_state_are_not_checked(uninterrupted):
  # Like a new learning rate, a weight decay (the alias always holds its chain
  # element, so the state's structure does not depend on it) restores as is.
  tx = onebit_optax.onebit_adam(1e-3, axis_name="data", weight_decay=1e-4,
                                freeze=onebit_optax.variance_ratio_freeze(**run.FREEZE))
  _, opt_state, step = _restore(uninterrupted[0], tx=tx)
  assert step == run.COMPRESSION_SAVE and bool(np.asarray(opt_state[0].frozen))


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


def test_a_state_without_the_sharded_layout_is_refused(tmp_path):
  tx = run.make_tx()
  params = run.init_params()
  mesh = jax.make_mesh((8,), ("data",))
  state = onebit_optax.init_sharded(tx, params, mesh)
  # What shard_map returns for out_specs=P() under check_vma=False: device 0's rows only.
  device0 = (state[0]._replace(worker_error=np.asarray(state[0].worker_error)[:1],
                               server_error=np.asarray(state[0].server_error)[:1]),
             ) + tuple(state[1:])
  with pytest.raises(ValueError, match="layout of onebit_optax.init_sharded"):
    onebit_optax.save_checkpoint(str(tmp_path), 1, params, device0)
  pmapped = jax.tree.map(lambda a: np.stack([np.asarray(a)] * 2), state)
  with pytest.raises(ValueError, match="pmap state"):
    onebit_optax.save_checkpoint(str(tmp_path), 1, params, pmapped)
  with pytest.raises(ValueError, match="exactly one 1-bit Adam state"):
    onebit_optax.save_checkpoint(str(tmp_path), 1, params, optax.adam(1e-3).init(params))


def test_single_device_round_trip_and_restore_from_8_devices(uninterrupted, tmp_path):
  tx = onebit_optax.onebit_adam(1e-2, axis_name=None, freeze=2)
  params = jnp.arange(5.0)
  state = tx.init(params)
  update = jax.jit(tx.update)
  for _ in range(4):
    updates, state = update(jnp.sin(params) + 0.1, state, params)
    params = optax.apply_updates(params, updates)
  assert bool(onebit_optax.is_frozen(state)) and np.any(state[0].worker_error != 0)
  onebit_optax.save_checkpoint(str(tmp_path), 4, params, state)
  new_params, new_state, _ = onebit_optax.restore_checkpoint(
      str(tmp_path), tx, jnp.zeros(5), mesh=None)
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

  # The 8-device compression checkpoint on one device: errors reset, with a warning.
  tx1 = onebit_optax.onebit_adam(
      3e-2, axis_name=None, freeze=onebit_optax.variance_ratio_freeze(**run.FREEZE))
  with pytest.warns(UserWarning, match="saved on 8 devices and is restored onto 1"):
    _, state1, _ = onebit_optax.restore_checkpoint(
        uninterrupted[0], tx1, run.init_params(), mesh=None)
  assert state1[0].worker_error.shape == (1, _flat.padded(SIZES, 1))
  assert not np.any(state1[0].worker_error) and bool(state1[0].frozen)
  saved = uninterrupted[1][run.COMPRESSION_SAVE]
  for name in ("mu", "nu"):  # the moments move to the 1-device layout, leaf by leaf
    np.testing.assert_array_equal(getattr(state1[0], name),
                                  _flat.relayout(saved[f"opt_state[0].{name}"], SIZES, 1))


def _env(**extra):
  env = {k: v for k, v in os.environ.items() if not k.startswith("ONEBIT_")}
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
  env.update(extra)
  return env


def test_restore_onto_4_devices_keeps_all_but_the_errors(uninterrupted):
  directory, snapshots, _, _ = uninterrupted
  proc = subprocess.run(
      [sys.executable, SCRIPT, "resize", "--ckpt", directory, "--out", directory,
       "--step", str(run.COMPRESSION_SAVE), str(run.WARMUP_SAVE)],
      cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT,
      env=_env(XLA_FLAGS="--xla_force_host_platform_device_count=4"))
  assert proc.returncode == 0, proc.stdout + proc.stderr
  padded4 = _flat.padded(SIZES, 4)
  for step in (run.COMPRESSION_SAVE, run.WARMUP_SAVE):
    with open(os.path.join(directory, f"resize_{step}.json")) as f:
      info = json.load(f)
    with np.load(os.path.join(directory, f"resize_{step}.npz")) as f:
      out = {k: f[k] for k in f.files}
    saved = snapshots[step]
    assert info["device_count"] == 4 and info["step"] == step
    # mu, nu, phase, counters, variance-ratio fields and params: exactly the saved ones.
    for key, value in saved.items():
      if key.endswith(ERRORS):
        continue
      restored = out["restored_" + key]
      if key.endswith(MOMENTS):  # flat: the same leaves, laid out for 4 devices
        assert restored.shape == (padded4,), key
        assert restored.tobytes() == _flat.relayout(value, SIZES, 4).tobytes(), key
        # and nothing was dropped: back on 8 devices it is the saved buffer.
        assert _flat.relayout(restored, SIZES, 8).tobytes() == value.tobytes(), key
        continue
      assert restored.tobytes() == value.tobytes(), key
    # The error buffers: reset, in the 4-device shapes.
    assert out["restored_opt_state[0].worker_error"].shape == (4, padded4)
    assert out["restored_opt_state[0].server_error"].shape == (4, padded4 // 4)
    for key in ERRORS:
      assert not np.any(out["restored_opt_state" + key])
    # Training goes on exactly like the hand-built reference state.
    finals = {k[len("final_"):]: v for k, v in out.items() if k.startswith("final_")}
    refs = {k[len("ref_"):]: v for k, v in out.items() if k.startswith("ref_")}
    _assert_bitwise(finals, refs)
    assert finals["opt_state[0].count"] == step + 3
    assert finals["opt_state[0].frozen"]  # both runs are past the freeze (step 6)
    assert np.all(np.isfinite(info["losses"]))
    if step == run.COMPRESSION_SAVE:
      assert finals["opt_state[0].freeze_step"] == 6
      assert np.any(finals["opt_state[0].worker_error"])  # compression resumed
      assert len(info["warnings"]) == 1, info["warnings"]
      message = info["warnings"][0]
      for part in ("saved on 8 devices and is restored onto 4", "reset to zero",
                   "mu, nu", "freeze_step=6", "count=9", f"(4, {padded4})"):
        assert part in message, (part, message)
    else:  # still warmup: the buffers were zero anyway, nothing lost, no warning.
      assert info["warnings"] == []


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
    assert want["opt_state[0].worker_error"].shape == (1, _flat.padded(SIZES, 2))
    assert np.any(want["opt_state[0].worker_error"])
