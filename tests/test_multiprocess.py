"""Real multi-process runs: ``python -m onebit_optax.launch``, ``jax.distributed``, gloo over TCP.

Every subprocess runs under a timeout (the launcher's own ``--timeout`` and the
``subprocess`` one), so a deadlock fails the test instead of blocking CI.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _xla  # pylint: disable=g-import-not-at-top,wrong-import-position
import mp_train_script  # pylint: disable=g-import-not-at-top,wrong-import-position  (its data)
ROOT = os.path.dirname(HERE)
TRAIN_SCRIPT = os.path.join(HERE, "mp_train_script.py")
FAIL_SCRIPT = os.path.join(HERE, "mp_fail_script.py")
LAUNCH = [sys.executable, "-m", "onebit_optax.launch"]
TIMEOUT = 150  # seconds for one launch, generous for 2 shared cores


def _env(**extra):
  env = {k: v for k, v in os.environ.items() if not k.startswith("ONEBIT_")}
  env["JAX_PLATFORMS"] = "cpu"
  env.update(extra)
  return env


def _run(args, **extra_env):
  return subprocess.run(args, cwd=ROOT, env=_env(**extra_env), capture_output=True,
                        text=True, timeout=TIMEOUT)


def _start(args, **extra_env):
  return subprocess.Popen(args, cwd=ROOT, env=_env(**extra_env), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def _finish(popen):
  try:
    return popen.communicate(timeout=TIMEOUT)
  except subprocess.TimeoutExpired:
    popen.kill()
    popen.communicate()
    raise


def _running(pid):
  """True while ``pid`` exists and is not a zombie (PID 1 may never reap orphans here)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except FileNotFoundError:
    return False


def _wait_gone(pids, seconds=5.0):
  deadline = time.monotonic() + seconds
  while time.monotonic() < deadline and any(_running(p) for p in pids):
    time.sleep(0.05)
  return [p for p in pids if _running(p)]


def _load(out_dir, name, pid):
  with np.load(os.path.join(out_dir, f"{name}_{pid}.npz")) as f:
    return {k: f[k] for k in f.files}


# 4 processes: the 2-process run's checks on more ranks, outside the default suite (slow:
# .ci/run runs it, and `python3 dev.py test -m ''` does).
@pytest.mark.parametrize("nproc", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_training_is_identical_across_processes_and_to_one_process(nproc, tmp_path):
  multi, single = tmp_path / "multi", tmp_path / "single"
  multi.mkdir()
  single.mkdir()
  # Reference: one plain process (no jax.distributed) with nproc simulated
  # devices, run at the same time as the real processes to save wall time.
  ref = _start([sys.executable, TRAIN_SCRIPT, "--no-distributed", "--out", str(single)],
               XLA_FLAGS=_xla.flags(nproc))
  proc = _run(LAUNCH + ["--nproc", str(nproc), "--devices-per-process", "1",
                        "--timeout", str(TIMEOUT - 30), TRAIN_SCRIPT, "--out", str(multi)])
  ref_out, ref_err = _finish(ref)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  for rank in range(nproc):
    assert f"[rank {rank}] process {rank}/{nproc} devices 1/{nproc} frozen=True" in proc.stdout
  assert ref.returncode == 0, ref_out + ref_err

  expected = _load(single, "params", 0)
  ref_info = json.loads((single / "info_0.json").read_text())
  assert ref_info == {"process_count": 1, "device_count": nproc, "frozen": True,
                      "freeze_step": 5, "steps": 25}
  params = [_load(multi, "params", rank) for rank in range(nproc)]
  for rank in range(nproc):
    info = json.loads((multi / f"info_{rank}.json").read_text())
    assert info == {"process_count": nproc, "device_count": nproc, "frozen": True,
                    "freeze_step": 5, "steps": 25}
    for name in expected:
      # Every process decodes the same bits: bitwise identical replicas.
      np.testing.assert_array_equal(params[rank][name], params[0][name], err_msg=name)
      np.testing.assert_allclose(params[rank][name], expected[name], rtol=0, atol=1e-6,
                                 err_msg=name)
    losses = np.load(multi / f"losses_{rank}.npy")
    np.testing.assert_allclose(losses, np.load(single / "losses_0.npy"), rtol=0, atol=1e-6)
    assert np.all(np.isfinite(losses))
  # Training works, in the compression phase too (steps 6..25): held-out loss,
  # computed here in numpy, goes down from the initial to the warmup-end to the
  # final params.
  x, y = mp_train_script.global_batch(10_000, 256)
  def held_out_loss(p):
    return np.mean((np.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)
  initial, warmup, final = (held_out_loss(_load(multi, name, 0))
                            for name in ("initial_params", "warmup_params", "params"))
  assert final < warmup < initial, (initial, warmup, final)


def test_failing_rank_stops_the_launcher_promptly(tmp_path):
  """Rank 1 raises after connecting; rank 0 is blocked in a collective waiting for it."""
  start = time.time()
  proc = _run(LAUNCH + ["--nproc", "2", "--devices-per-process", "1", "--timeout",
                        str(TIMEOUT - 30), FAIL_SCRIPT,
                        "--out", str(tmp_path)])
  end = time.time()
  assert proc.returncode == 1, proc.stdout + proc.stderr
  assert "[rank 1] RuntimeError: rank 1 fails on purpose" in proc.stderr
  assert "[launch] rank 1 exited with code 1" in proc.stderr
  failed_at = float((tmp_path / "failed_at").read_text())
  # Without fail-fast, rank 1 waits in JAX's shutdown barrier and rank 0 in the
  # collective until gloo's 30 s timeout.
  assert end - failed_at < 15, (end - start, end - failed_at)
  pids = [int(p) for rank in range(2) for p in (tmp_path / f"pids_{rank}").read_text().split()]
  assert len(pids) == 3  # both ranks and rank 0's child process
  assert not _wait_gone(pids), proc.stderr


_SLEEPER = textwrap.dedent("""
    import os, subprocess, sys, time
    rank = os.environ["ONEBIT_PROCESS_ID"]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.path.join(sys.argv[1], "pids_" + rank + ".tmp"), "w") as f:
      f.write(f"{os.getpid()} {child.pid}")
    os.rename(f.name, f.name[:-4])
    print("ready", flush=True)
    time.sleep(600)
""")


def _start_sleepers(tmp_path, nproc):
  script = tmp_path / "sleeper.py"
  script.write_text(_SLEEPER)
  # Ctrl-C's default action for the launcher: a suite started in the background by a
  # non-interactive shell (`cmd &`) runs with SIGINT ignored, and Python keeps it ignored.
  launcher = subprocess.Popen(
      LAUNCH + ["--nproc", str(nproc), "--timeout", "120", str(script), str(tmp_path)],
      cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
  deadline = time.monotonic() + 60
  files = [tmp_path / f"pids_{rank}" for rank in range(nproc)]
  while not all(f.exists() for f in files):
    if time.monotonic() > deadline or launcher.poll() is not None:
      launcher.kill()
      pytest.fail("the sleeper processes did not start: " + launcher.communicate()[1])
    time.sleep(0.05)
  return launcher, [int(p) for f in files for p in f.read_text().split()]


def test_interrupt_stops_all_ranks(tmp_path):
  launcher, pids = _start_sleepers(tmp_path, 3)
  launcher.send_signal(signal.SIGINT)  # what Ctrl-C in a terminal delivers
  _, stderr = launcher.communicate(timeout=30)
  assert launcher.returncode == 130, stderr
  assert "[launch] interrupted" in stderr
  assert not _wait_gone(pids)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_killed_launcher_takes_its_ranks_along(tmp_path):
  launcher, pids = _start_sleepers(tmp_path, 2)
  launcher.kill()  # SIGKILL: no cleanup code of the launcher runs
  launcher.communicate(timeout=30)
  ranks = pids[0::2]  # the ranks die with the launcher; their own children may outlive them
  leftover = _wait_gone(ranks)
  for pid in pids:  # tidy up whatever remains
    try:
      os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
  assert not leftover


def test_environment_prefixes_and_exit_code(tmp_path):
  script = tmp_path / "show_env.py"
  script.write_text(textwrap.dedent("""
      import os, pathlib, sys, time
      e = os.environ
      rank = e["ONEBIT_PROCESS_ID"]
      print(rank, e["ONEBIT_NUM_PROCESSES"], e["ONEBIT_COORDINATOR_ADDRESS"], e["XLA_FLAGS"],
            e["MY_VAR"], sys.argv[1:])
      print("to stderr", file=sys.stderr, flush=True)
      here = pathlib.Path(__file__).parent
      (here / f"done_{rank}").touch()
      if rank == "2":  # fail only after the others are through, so none gets killed
        while not ((here / "done_0").exists() and (here / "done_1").exists()):
          time.sleep(0.02)
        time.sleep(0.2)
        sys.exit(3)
  """))
  proc = _run(LAUNCH + ["--nproc", "3", "--devices-per-process", "2", "--xla-single-thread",
                        "--env", "MY_VAR=r{rank}", "--timeout", "60", str(script), "a", "--b"],
              XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_dump_to=/dev/null")
  assert proc.returncode == 3, proc.stderr
  lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("[rank"))
  assert len(lines) == 3, proc.stdout
  addresses = set()
  for rank, line in enumerate(lines):
    fields = line.split()
    assert fields[:4] == ["[rank", f"{rank}]", str(rank), "3"], line
    addresses.add(fields[4])
    assert fields[4].startswith("127.0.0.1:")
    # The inherited device count is replaced, not duplicated; other flags stay.
    assert fields[5:9] == ["--xla_dump_to=/dev/null", "--xla_force_host_platform_device_count=2",
                           "--xla_cpu_multi_thread_eigen=false",
                           "intra_op_parallelism_threads=1"], line
    assert fields[9] == f"r{rank}"
    assert line.endswith("['a', '--b']")
    assert f"[rank {rank}] to stderr" in proc.stderr
  assert len(addresses) == 1
  assert "[launch] rank 2 exited with code 3" in proc.stderr


def test_a_rerun_with_a_persistent_compilation_cache_completes(tmp_path):
  """A second run reading the programs of the first from jax's persistent cache finishes.

  With jax 0.12.1 a program read back from the cache hangs in its first collective
  between CPU processes (a ``shard_map`` ``psum``; ``jnp.sum`` of the sharded array
  did not); :func:`onebit_optax.launch.initialize` turns the cache off
  there (with a warning) and leaves it on where it works.
  """
  script = tmp_path / "psum.py"
  script.write_text(textwrap.dedent("""
      import jax, jax.numpy as jnp
      from jax.sharding import NamedSharding, PartitionSpec as P
      from onebit_optax import launch
      launch.initialize(initialization_timeout=60)
      mesh = jax.make_mesh((jax.device_count(),), ("data",))
      x = jax.make_array_from_process_local_data(
          NamedSharding(mesh, P("data")), jnp.full((1,), jax.process_index() + 1.0))
      psum = jax.shard_map(lambda a: jax.lax.psum(a, "data"), mesh=mesh,
                           in_specs=P("data"), out_specs=P())  # as the optimizers' collectives
      total = jax.jit(psum)(x)
      print("total", float(total.addressable_data(0)[0]),
            "cache", jax.config.jax_enable_compilation_cache, flush=True)
  """))
  import jax  # pylint: disable=g-import-not-at-top
  from onebit_optax import launch  # pylint: disable=g-import-not-at-top
  hangs = jax.__version_info__ >= launch._CACHE_HANG_SINCE  # pylint: disable=protected-access
  cache = tmp_path / "cache"
  for _ in range(2):
    proc = _run(LAUNCH + ["--nproc", "2", "--devices-per-process", "1", "--timeout", "90",
                          str(script)],
                JAX_COMPILATION_CACHE_DIR=str(cache),
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in range(2):
      assert f"[rank {rank}] total 3.0 cache {not hangs}" in proc.stdout, proc.stdout
    assert ("turned jax's persistent compilation cache off" in proc.stderr) == hangs, proc.stderr
  assert hangs or os.listdir(cache)  # where it works, the first run wrote its programs there
