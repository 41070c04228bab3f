"""Start N JAX processes of a training script on this machine, connected by ``jax.distributed``.

Usage::

  python -m onebit_optax.launch --nproc 4 train.py --steps 100
  python -m onebit_optax.launch --nproc 2 --devices-per-process 4 train.py  # 8 CPU devices
  python -m onebit_optax.launch --nproc 4 --cpus-per-process 1 --xla-single-thread bench.py

The launcher picks a free port on 127.0.0.1 for the coordinator and starts
``--nproc`` copies of ``SCRIPT ARGS...`` (with the same Python), each with::

  ONEBIT_COORDINATOR_ADDRESS  127.0.0.1:PORT (process 0 runs the coordinator service)
  ONEBIT_NUM_PROCESSES        N
  ONEBIT_PROCESS_ID           this process's rank, 0 .. N-1
  PYTHONUNBUFFERED            1 (so that output arrives line by line)

in its environment (JAX reads no such variables for the process count and rank,
hence our own names). The script calls :func:`initialize` before any other JAX
call; it connects the processes, after which ``jax.devices()`` lists the
devices of *all* processes. On CPU the collectives between processes go over
TCP through gloo (JAX's default CPU collectives): a real multi-process run, not
a simulation. The script is the single-process recipe with two changes, the
call to :func:`initialize` and per-process data::

  from onebit_optax import launch
  launch.initialize()
  mesh = jax.make_mesh((jax.device_count(),), ('data',))   # all processes' devices
  data = NamedSharding(mesh, P('data'))
  params = jax.device_put(params, NamedSharding(mesh, P()))  # same values everywhere
  opt_state = onebit_optax.init_sharded(tx, params, mesh)
  ...
  # Each process passes only its own rows of the global batch:
  x = jax.make_array_from_process_local_data(data, local_x, global_shape)

Replicated results (params, loss) are read with ``a.addressable_data(0)``.

Each line a process prints is forwarded with a ``[rank i]`` prefix (stdout to
stdout, stderr to stderr). If one process fails, the launcher stops the others
at once (they would otherwise wait in their next collective until a timeout)
and exits with the failed process's code. Ctrl-C (or SIGTERM) stops all
processes; every process also dies with the launcher if it is killed, so no
orphan is left behind.

Multi-host: the launcher is for one machine (tests, CPU benchmarks, a
workstation). On a cluster, start the *same script* with the cluster's own
launcher: ``srun`` under SLURM (one task per GPU: JAX then gives each process
its GPU), ``mpirun`` with Open MPI, every worker of a Cloud TPU pod slice, or
an indexed Kubernetes job. There :func:`initialize` calls
``jax.distributed.initialize()`` without arguments and JAX detects the
coordinator, the process count and the rank itself. The training step does not
change: the mesh covers all devices of all hosts, and 1-bit Adam's collectives
cross hosts over NCCL (GPU) or the TPU interconnect.

Known limits on CPU (jax 0.10.2): the first collective over a set of devices
sets up a gloo context, and a process that arrives there more than 30 s after
another makes it fail (no setting changes this); do slow per-process setup
(data loading) before the first collective or on every process alike. Later
collectives wait as long as needed. ``jax.device_put`` of a host array onto a
mesh that spans processes checks that all processes pass the same value by
comparing the host array with the gathered device copies, so a float64 numpy
array (stored as float32 on the devices) fails that check with "not the same
on each process": cast host arrays to float32 first.

Known limit on CPU (jax 0.12.1; 0.10.2 and 0.11.0 to 0.12.0.1 are fine): a
program that a process reads back from jax's persistent compilation cache
(``JAX_COMPILATION_CACHE_DIR``) never completes its first ``shard_map``
collective across processes, so the second run of a script waits until its
timeout, without a message. :func:`initialize` turns the cache off for a
multi-process CPU run on jax 0.12.1 and later, with a warning.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from typing import IO, Optional, Sequence

import jax

__all__ = ["initialize", "main", "COORDINATOR_ADDRESS", "NUM_PROCESSES", "PROCESS_ID"]

COORDINATOR_ADDRESS = "ONEBIT_COORDINATOR_ADDRESS"
NUM_PROCESSES = "ONEBIT_NUM_PROCESSES"
PROCESS_ID = "ONEBIT_PROCESS_ID"

# Seconds a process gets to exit after Ctrl-C or a timeout before it is killed.
_GRACE_SECONDS = 3.0
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# The first jax version seen to hang on a persistent-cache hit between CPU processes.
_CACHE_HANG_SINCE = (0, 12, 1)
_SINGLE_THREAD_FLAGS = ("--xla_cpu_multi_thread_eigen=false", "intra_op_parallelism_threads=1")


def initialize(*, fail_fast: bool = True, **kwargs) -> None:
  """Connects this process to the others: ``jax.distributed.initialize`` for any launcher.

  Under ``python -m onebit_optax.launch`` it passes the coordinator address,
  process count and rank that the launcher put in the environment (and binds the
  coordinator service to that loopback address only). Anywhere else it calls
  ``jax.distributed.initialize()`` with no addresses, which auto-detects SLURM,
  Open MPI, Cloud TPU and Kubernetes jobs (and raises if it finds none: a
  script that should also run as one plain process can skip the call behind a
  flag, or be started with ``--nproc 1``). Call it once, before any other JAX
  call.

  Why ``fail_fast``: at exit, JAX waits in a shutdown barrier until *every*
  process has arrived (up to ``shutdown_timeout_seconds``, 300 s by default).
  A process that dies of an exception therefore does not exit: it waits for
  the others, which wait in their next collective for its data, until a timeout.
  With ``fail_fast`` an uncaught exception prints its traceback and ends the
  process at once (``os._exit(1)``, skipping atexit handlers), so a launcher
  (this one, ``srun --kill-on-bad-exit``, ``mpirun``) sees the failure and stops
  the rest. An explicit ``sys.exit(code)`` still goes through the barrier.

  Args:
    fail_fast: end the process right after an uncaught exception (see above).
    **kwargs: passed on to :func:`jax.distributed.initialize` (e.g.
      ``initialization_timeout``, ``local_device_ids``).

  Example:
    >>> import os
    >>> from onebit_optax import launch
    >>> launch.NUM_PROCESSES in os.environ  # not started by the launcher here
    False
  """
  address = os.environ.get(COORDINATOR_ADDRESS)
  if address is None:
    jax.distributed.initialize(**kwargs)
  else:
    try:
      num_processes = int(os.environ[NUM_PROCESSES])
      process_id = int(os.environ[PROCESS_ID])
    except (KeyError, ValueError) as e:
      raise RuntimeError(
          f"{COORDINATOR_ADDRESS} is set but {NUM_PROCESSES}/{PROCESS_ID} are missing or "
          "not integers; start the script with `python -m onebit_optax.launch --nproc N "
          "SCRIPT` (or unset the variable to let JAX auto-detect the cluster).") from e
    kwargs.setdefault("coordinator_bind_address", address)
    jax.distributed.initialize(
        coordinator_address=address, num_processes=num_processes, process_id=process_id,
        **kwargs)
  _turn_off_a_hanging_cache()
  if fail_fast:
    _exit_on_uncaught_exception()


def _turn_off_a_hanging_cache() -> None:
  """Turns jax's persistent compilation cache off where it hangs a multi-process CPU run.

  See the module's docstring: jax 0.12.1 (later versions untested, so included)
  hangs on a program read back from the cache. Checked only when a cache
  directory is set.
  """
  if (not jax.config.jax_compilation_cache_dir or not jax.config.jax_enable_compilation_cache
      or jax.__version_info__ < _CACHE_HANG_SINCE):
    return  # (the checks below start the backend)
  if jax.process_count() == 1 or jax.default_backend() != "cpu":
    return
  jax.config.update("jax_enable_compilation_cache", False)
  warnings.warn(
      f"onebit_optax.launch.initialize turned jax's persistent compilation cache off "
      f"(jax_compilation_cache_dir={jax.config.jax_compilation_cache_dir!r}): with jax "
      f"{jax.__version__} a program read back from it hangs in its first collective "
      "between CPU processes. Unset JAX_COMPILATION_CACHE_DIR for multi-process CPU runs "
      "to silence this.", RuntimeWarning, stacklevel=3)


def _exit_on_uncaught_exception() -> None:
  previous = sys.excepthook

  def hook(exc_type, exc, tb):
    try:
      previous(exc_type, exc, tb)
      sys.stdout.flush()
      sys.stderr.flush()
    finally:
      os._exit(130 if issubclass(exc_type, KeyboardInterrupt) else 1)
  sys.excepthook = hook


def _free_port(host: str) -> int:
  # The OS picks a free port; it is released again before process 0 binds it,
  # which is racy only against another program grabbing the same port meanwhile.
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def _xla_flags(base: str, devices_per_process: Optional[int], single_thread: bool) -> str:
  flags = base.split()
  if devices_per_process is not None:
    # Replace any inherited device count (e.g. a test runner's) rather than
    # appending a second, conflicting one.
    flags = [f for f in flags if not f.startswith(_DEVICE_COUNT_FLAG)]
    flags.append(f"{_DEVICE_COUNT_FLAG}={devices_per_process}")
  if single_thread:
    flags += [f for f in _SINGLE_THREAD_FLAGS if f not in flags]
  return " ".join(flags)


def _rank_environ(args, rank: int, address: str) -> dict[str, str]:
  env = dict(os.environ)
  for item in args.env:
    key, sep, value = item.partition("=")
    if not sep or not key:
      raise SystemExit(f"launch: --env expects KEY=VALUE, got {item!r}")
    env[key] = value.replace("{rank}", str(rank))
  env[COORDINATOR_ADDRESS] = address
  env[NUM_PROCESSES] = str(args.nproc)
  env[PROCESS_ID] = str(rank)
  env["PYTHONUNBUFFERED"] = "1"
  xla_flags = _xla_flags(env.get("XLA_FLAGS", ""), args.devices_per_process,
                         args.xla_single_thread)
  if xla_flags:
    env["XLA_FLAGS"] = xla_flags
  return env


def _child_setup(cpus: Optional[list[int]]):
  """The function run in each rank between fork and exec (resolved before the fork)."""
  prctl = None
  if sys.platform.startswith("linux"):
    try:
      prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
      pass
  launcher = os.getpid()

  def setup():
    if prctl is not None:
      prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the launcher, even on SIGKILL
      if os.getppid() != launcher:  # it died before the line above took effect
        os._exit(1)
    if cpus:
      os.sched_setaffinity(0, cpus)
  return setup


def _cpu_sets(nproc: int, per_process: Optional[int]) -> list[Optional[list[int]]]:
  if not per_process:
    return [None] * nproc
  if not hasattr(os, "sched_setaffinity"):
    raise SystemExit("launch: --cpus-per-process needs os.sched_setaffinity (Linux).")
  available = sorted(os.sched_getaffinity(0))
  # Wraps around when ranks * cpus exceeds the machine: ranks then share cores.
  return [[available[(rank * per_process + j) % len(available)] for j in range(per_process)]
          for rank in range(nproc)]


def _forward(stream: IO[bytes], out: IO[bytes], prefix: bytes, lock: threading.Lock) -> None:
  for line in iter(stream.readline, b""):
    if not line.endswith(b"\n"):
      line += b"\n"
    with lock:
      out.write(prefix + line)
      out.flush()
  stream.close()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
  try:
    os.killpg(proc.pid, sig)  # the rank and anything it started
  except (ProcessLookupError, PermissionError):
    pass


def _stop(procs: Sequence[subprocess.Popen], grace: float) -> None:
  """SIGINT to every process group still running, SIGKILL after ``grace`` seconds.

  SIGINT rather than SIGTERM: JAX's preemption notifier catches SIGTERM in a
  process that called ``jax.distributed.initialize`` (and carries on), while
  SIGINT raises KeyboardInterrupt as a Ctrl-C in a terminal would. A process
  blocked inside a collective sees neither until it returns: SIGKILL ends it.
  """
  if grace > 0:
    for p in procs:
      if p.poll() is None:
        _signal_group(p, signal.SIGINT)
    deadline = time.monotonic() + grace
    for p in procs:
      try:
        p.wait(timeout=max(0.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        pass
  for p in procs:
    # Killing the group also ends what ranks started (a data loader, a shell).
    _signal_group(p, signal.SIGKILL)
    p.wait()


def _exit_code(returncode: int) -> int:
  return 128 - returncode if returncode < 0 else returncode  # shell convention for signals


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="python -m onebit_optax.launch",
      description="Start N connected JAX processes of SCRIPT on this machine.",
      epilog="Example: python -m onebit_optax.launch --nproc 4 train.py --steps 100")
  parser.add_argument("--nproc", type=int, required=True, help="number of processes")
  parser.add_argument(
      "--devices-per-process", type=int, default=None, metavar="K",
      help="simulated CPU devices per process (sets "
      "XLA_FLAGS=--xla_force_host_platform_device_count=K)")
  parser.add_argument(
      "--cpus-per-process", type=int, default=None, metavar="C",
      help="pin rank i to C cores of its own (Linux sched_setaffinity; wraps around "
      "when there are fewer cores than ranks * C)")
  parser.add_argument(
      "--xla-single-thread", action="store_true",
      help="one compute thread per process (XLA_FLAGS --xla_cpu_multi_thread_eigen=false "
      "intra_op_parallelism_threads=1): steadier CPU timings when ranks share cores")
  parser.add_argument(
      "--env", action="append", default=[], metavar="KEY=VALUE",
      help="extra environment variable for every process (repeatable); '{rank}' in VALUE "
      "becomes the rank, e.g. --env JAX_LOCAL_DEVICE_IDS={rank} for one GPU per process")
  parser.add_argument(
      "--timeout", type=float, default=None, metavar="SECONDS",
      help="stop all processes and exit with 124 after this many seconds")
  parser.add_argument("-m", "--module", action="store_true",
                      help="SCRIPT is a module name, run as python -m SCRIPT")
  parser.add_argument("script", metavar="SCRIPT", help="the training script")
  parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                      help="arguments for the script")
  return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs the launcher on ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
  args = _parser().parse_args(argv)
  if args.nproc < 1:
    raise SystemExit("launch: --nproc must be >= 1")
  if args.devices_per_process is not None and args.devices_per_process < 1:
    raise SystemExit("launch: --devices-per-process must be >= 1")
  host = "127.0.0.1"
  address = f"{host}:{_free_port(host)}"
  command = [sys.executable] + (["-m"] if args.module else []) + [args.script, *args.script_args]
  cpu_sets = _cpu_sets(args.nproc, args.cpus_per_process)
  envs = [_rank_environ(args, rank, address) for rank in range(args.nproc)]

  def on_sigterm(signum, frame):
    del signum, frame
    raise KeyboardInterrupt
  previous = signal.signal(signal.SIGTERM, on_sigterm)

  procs: list[subprocess.Popen] = []
  threads: list[list[threading.Thread]] = []
  lock = threading.Lock()
  code, grace = 1, _GRACE_SECONDS
  try:
    # All processes are forked before any forwarding thread exists (fork with
    # threads running is unsafe around preexec_fn).
    for rank in range(args.nproc):
      procs.append(subprocess.Popen(
          command, env=envs[rank], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
          stderr=subprocess.PIPE, start_new_session=True,
          preexec_fn=_child_setup(cpu_sets[rank])))
    for rank, p in enumerate(procs):
      prefix = f"[rank {rank}] ".encode()
      threads.append([])
      for stream, out in ((p.stdout, sys.stdout.buffer), (p.stderr, sys.stderr.buffer)):
        t = threading.Thread(target=_forward, args=(stream, out, prefix, lock), daemon=True)
        t.start()
        threads[rank].append(t)

    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    code = 0
    while True:
      failed = [(rank, p.returncode) for rank, p in enumerate(procs)
                if p.poll() is not None and p.returncode != 0]
      if failed:
        rank, returncode = failed[0]
        code = _exit_code(returncode)
        for t in threads[rank]:
          t.join(timeout=1.0)  # its last words (the traceback) before ours
        how = (f"was killed by {signal.Signals(-returncode).name}" if returncode < 0
               else f"exited with code {returncode}")
        print(f"[launch] rank {rank} {how}; stopping the other ranks.", file=sys.stderr,
              flush=True)
        # The others are (or soon will be) blocked in a collective waiting for
        # the dead rank: nothing is gained by waiting for them.
        grace = 0.0
        break
      if all(p.returncode == 0 for p in procs):
        break
      if deadline is not None and time.monotonic() > deadline:
        print(f"[launch] timeout after {args.timeout:g} s; stopping all ranks.",
              file=sys.stderr, flush=True)
        code = 124
        break
      time.sleep(0.05)
  except KeyboardInterrupt:
    print("[launch] interrupted; stopping all ranks.", file=sys.stderr, flush=True)
    code = 130
  finally:
    _stop(procs, grace)
    for t in (t for rank_threads in threads for t in rank_threads):
      t.join(timeout=1.0)  # the rest of the output, if the pipes have closed
    signal.signal(signal.SIGTERM, previous)
  return code


if __name__ == "__main__":
  sys.exit(main())
