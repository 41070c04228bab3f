"""Steps/s of Adam vs 1-bit Adam on 4 CPU ranks over a real bandwidth-limited network.

    sudo .venv/bin/python benchmarks/comm_throughput.py            # 1 Gbit/s links
    sudo .venv/bin/python benchmarks/comm_throughput.py --rates    # + 100 Mbit/s and 10 Gbit/s
    sudo .venv/bin/python benchmarks/comm_throughput.py --hier --profile  # 2 nodes x 2 ranks (~6 min)

Not a test (CI does not run it): it needs root for network namespaces and takes
minutes. What it does:

1. Builds a LAN: one network namespace per rank, each with a veth port into a
   bridge, every port shaped by ``tc tbf`` to the link rate (benchmarks/_netns.py).
   Everything is deleted at the end, also on Ctrl-C, SIGTERM or an error;
   leftovers of killed runs are deleted at the start. Without root or iproute2
   it says so and runs on plain loopback (no bandwidth limit), labelled as such.
2. Measures the link: TCP goodput and round-trip time between two namespaces.
3. Starts 4 ranks (``ip netns exec``), each one JAX process with one CPU device
   and one XLA thread, pinned to a core (``taskset``), joined by
   ``jax.distributed`` over TCP, with gloo doing the collectives. Each trains an
   embedding-bag classifier of ~25.6M parameters (the embedding table is 99.9%
   of them; the forward/backward pass is small) with optax.adam on the pmean of
   the gradients, then onebit_adam in warmup, then (forced with
   fixed_step_freeze) in the compression phase. Steps are timed after
   compilation, in repeats; bytes on the wire come from the kernel's counters of
   each rank's interface (tx_bytes), not from a formula.
4. Measures the compute alone: the same 4 ranks, run at the same time on the same
   cores but each on its own (1-device mesh, so no collective at all).
   0/1 Adam (``--modes`` with zero_one, the default) runs on its real schedule
   (zero_one_adam with ``--zo-freeze`` 40, ``--zo-scaler`` 4, ``--zo-local-steps``
   8, ``--zo-local-scaler`` 4; ``--zo-steps`` 72): variance steps (float32
   all-reduce), compressed steps (1-bit momentum), then after the freeze local
   steps (no collective) and syncs (1-bit mean of the accumulated progress; without local
   steps a sync is a compressed step).
   Every step is timed; its phase is read from the state (as status(state).phase
   does) and checked against the schedule; the interface counters are read at
   each change of phase, after a short untimed pause (``--settle``) so that a
   window's bytes are its own. Per phase: s/step, ratio to Adam, bytes against
   allreduce_wire_bytes / compressed_wire_bytes / 0, and whole-run averages of
   stated schedules (their phase counts from the optimizer's own schedule).
5. Prints and saves a table (benchmarks/results/comm_throughput.md) and a plot
   (benchmarks/results/comm_throughput.png): throughput ratio 1-bit/Adam, bytes
   per step measured and predicted, compute time, and the alpha-beta model's
   ratio. Predicted bytes per rank per step, from the optimizer's wire layout
   (onebit_optax._layout.WireLayout, core v3): leaves with >= 64 elements are
   compressed (their packed signs laid out leaf after leaf, each leaf padded to
   a multiple of 128 elements, the stream to a multiple of 128 n, cut into n
   chunks with S scales each), smaller leaves travel as float32 "exact" values
   (exact_chunk per message) inside the same uint8 messages:

       Adam (ring all-reduce of the tree)         2 (n-1)/n * 4 * num_params
       1-bit warmup (all-reduce of the tree)      2 (n-1)/n * 4 * num_params
       1-bit compression (two uint8 phases)       2 (n-1) * row_bytes,
           row_bytes = bits.chunk / 8 + 4 * (S + exact_chunk)

   and the alpha-beta model:

       t_adam   = t_compute_adam + bytes_adam / bandwidth
       t_onebit = t_compute_onebit + bytes_onebit / bandwidth
                 (t_compute_onebit = t_compute_adam + t_compress)

   with the measured bandwidth and compute times.

``--hier`` runs the hierarchical case instead (benchmarks/results/
comm_throughput_hier.md and .json): ``--nodes`` (2) namespaces of 2 ranks each,
only the link between namespaces shaped; the ranks of a node talk over its
loopback. Adam (pmean over ('node', 'local')), flat 1-bit Adam (1-D mesh
'data' of the same ranks) and hierarchical 1-bit Adam (axis_name=('node',
'local') on jax.make_mesh((2, 2), ('node', 'local'))); bytes per device on the
link (the node's eth0 counters / 2) against compressed_wire_bytes(padded/2, 2, S)
(hierarchical: every leaf compressed, exact_below = 0).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _comm_worker  # noqa: E402  (the rank's code; its 0/1 Adam defaults and schedule)
import _netns  # noqa: E402  (benchmarks/_netns.py)
import _provenance  # noqa: E402
from onebit_optax import _collective  # noqa: E402

WORKER = HERE / "_comm_worker.py"
XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
MODES = ("adam", "onebit_warmup", "onebit_compression", "hier_compression")
LABELS = {"adam": "optax.adam + pmean", "onebit_warmup": "onebit_adam warmup",
          "onebit_compression": "onebit_adam compression",
          "hier_compression": "onebit_adam hierarchical compression"}
SHORT = {"adam": "adam", "onebit_warmup": "1-bit warmup", "onebit_compression": "1-bit compression",
         "hier_compression": "hierarchical 1-bit"}
COORD_PORT = 12355


def _parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--rate", default="1gbit", help="link rate for tc (default 1gbit)")
  p.add_argument("--rates", action="store_true", help="also run 100mbit and 10gbit")
  p.add_argument("--ranks", type=int, default=4)
  p.add_argument("--vocab", type=int, default=200_000, help="embedding rows (x dim = parameters)")
  p.add_argument("--dim", type=int, default=128)
  p.add_argument("--batch", type=int, default=32, help="sequences per rank per step")
  p.add_argument("--seq", type=int, default=32)
  p.add_argument("--steps", type=int, default=3, help="timed steps per repeat")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--no-pin", action="store_true", help="do not pin ranks to cores with taskset")
  p.add_argument("--loopback", action="store_true", help="skip namespaces: plain loopback")
  p.add_argument("--profile", action="store_true",
                 help="also time the collectives of a step on their own (adds ~1 min per rate)")
  p.add_argument("--modes", default="adam,onebit,zero_one",
                 help="what the ranks train: adam, onebit (warmup then compression), zero_one "
                      "(0/1 Adam, every phase) (default adam,onebit,zero_one)")
  zo = _comm_worker.ZERO_ONE_DEFAULTS
  p.add_argument("--zo-freeze", type=int, default=zo["var_freeze_step"],
                 help="0/1 Adam's var_freeze_step (default %(default)s)")
  p.add_argument("--zo-scaler", type=int, default=zo["var_update_scaler"],
                 help="0/1 Adam's var_update_scaler (default %(default)s)")
  p.add_argument("--zo-local-steps", type=int, default=zo["local_steps"],
                 help="0/1 Adam's local_steps H, 0 for None (default %(default)s)")
  p.add_argument("--zo-local-scaler", type=int, default=zo["local_step_scaler"],
                 help="0/1 Adam's local_step_scaler (default %(default)s)")
  p.add_argument("--zo-steps", type=int, default=_comm_worker.ZERO_ONE_STEPS,
                 help="steps of the 0/1 Adam run, step 1 untimed (default %(default)s)")
  p.add_argument("--settle", type=float, default=0.3,
                 help="untimed pause (s) before the counters are read at a change of 0/1 phase")
  p.add_argument("--zo-read-each-step", action="store_true",
                 help="read each 0/1 step's phase on the host right after the step, as before "
                      "issue 25's item 6 was measured (default: copied on the device, read after)")
  p.add_argument("--hier", action="store_true",
                 help="instead: the hierarchical case, --nodes namespaces of ranks/nodes ranks each, "
                      "only the links between nodes shaped; writes comm_throughput_hier.*")
  p.add_argument("--nodes", type=int, default=2, help="namespaces (nodes) with --hier (default 2)")
  p.add_argument("--timeout", type=float, default=1200, help="seconds per group of ranks")
  p.add_argument("--note", default=None, help="a line for the results header (e.g. the load)")
  p.add_argument("--out-dir", default=str(HERE / "results"))
  p.add_argument("--name", default=None, help="output file stem (default comm_throughput, or "
                 "comm_throughput_rates with --rates)")
  return p.parse_args(argv)


# --- process handling ----------------------------------------------------------------

_CHILDREN: list[subprocess.Popen] = []


def _kill_children():
  for proc in _CHILDREN:
    if proc.poll() is None:
      try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the rank and its threads
      except ProcessLookupError:
        pass
      proc.wait()
  _CHILDREN.clear()


def _on_signal(signum, frame):
  del frame
  raise KeyboardInterrupt(f"signal {signum}")


def _start(cmd: list[str], log: Path, env: dict) -> subprocess.Popen:
  f = open(log, "w")
  proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
  f.close()
  _CHILDREN.append(proc)
  return proc


def _run_ranks(cmds: list[list[str]], workdir: Path, timeout: float, tag: str) -> list[dict]:
  """Starts one process per command, waits for all, returns their JSON results."""
  env = dict(os.environ, XLA_FLAGS=XLA_FLAGS, PYTHONUNBUFFERED="1",
             PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")])))
  outs = [workdir / f"{tag}-rank{r}.json" for r in range(len(cmds))]
  logs = [workdir / f"{tag}-rank{r}.log" for r in range(len(cmds))]
  procs = [_start(cmd + ["--out", str(out)], log, env) for cmd, out, log in zip(cmds, outs, logs)]
  deadline = time.time() + timeout
  try:
    while any(p.poll() is None for p in procs):
      if any(p.poll() not in (None, 0) for p in procs) or time.time() > deadline:
        break
      time.sleep(0.5)
    failed = [r for r, p in enumerate(procs) if p.poll() != 0]
    if failed:
      why = "timed out" if time.time() > deadline else "failed"
      tails = "\n".join(f"--- rank {r} ({logs[r]}):\n" + "\n".join(
          logs[r].read_text().splitlines()[-15:]) for r in failed)
      raise RuntimeError(f"{tag}: ranks {failed} {why}\n{tails}")
  finally:
    _kill_children()
  return [json.loads(o.read_text()) for o in outs]


def _worker_cmd(args, rank: int, num_ranks: int, coordinator: str | None, iface: str,
                modes: str | None = None, mesh: str | None = None) -> list[str]:
  cmd = [sys.executable, str(WORKER), "rank", "--rank", str(rank), "--num-ranks", str(num_ranks),
         "--iface", iface, "--vocab", str(args.vocab), "--dim", str(args.dim),
         "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
         "--repeats", str(args.repeats), "--modes", modes or args.modes]
  if "zero_one" in (modes or args.modes).split(","):
    cmd += ["--zo-freeze", str(args.zo_freeze), "--zo-scaler", str(args.zo_scaler),
            "--zo-local-steps", str(args.zo_local_steps), "--zo-local-scaler",
            str(args.zo_local_scaler), "--zo-steps", str(args.zo_steps),
            "--settle", str(args.settle)]
    cmd += ["--zo-read-each-step"] if args.zo_read_each_step else []
  if mesh:
    cmd += ["--mesh", mesh]
  if coordinator:
    cmd += ["--coordinator", coordinator]
    if args.profile:
      cmd += ["--profile"]
  if not args.no_pin and shutil.which("taskset"):
    cmd = ["taskset", "-c", str(rank % os.cpu_count())] + cmd
  return cmd


# --- statistics --------------------------------------------------------------------

def _median(xs):
  xs = sorted(xs)
  k = len(xs)
  return 0.5 * (xs[(k - 1) // 2] + xs[k // 2])


def _summarize(results: list[dict], bytes_divisor: float = 1.0) -> dict:
  """Per mode: median step time (rank 0, all timed steps), per-repeat medians, bytes."""
  summary = {}
  for mode in MODES:
    if mode not in results[0]["modes"]:
      continue
    blocks0 = results[0]["modes"][mode]["blocks"]
    steps = [t for b in blocks0 for t in b["step_s"]]
    per_rep = [_median(b["step_s"]) for b in blocks0]
    tx = [_median([b["tx_bytes_per_step"] for b in r["modes"][mode]["blocks"]]) / bytes_divisor
          for r in results]
    summary[mode] = {
        "step_s": _median(steps), "rep_min_s": min(per_rep), "rep_max_s": max(per_rep),
        "tx_bytes": sum(tx) / len(tx), "tx_bytes_ranks": tx,
        "state_wire_bytes": results[0]["modes"][mode].get("state_wire_bytes"),
        "first_step_s": results[0]["modes"][mode].get("first_step_s")}
  return summary


def _layout(leaf_shapes: list, n: int, exact_below: int | None = None):
  """The optimizer's wire layout (core v3) of the model's leaves on ``n`` ranks.

  ``exact_below=None``: the optimizer's default (leaves under EXACT_BELOW
  elements travel as float32); 0: every leaf compressed (the hierarchical case).
  """
  from onebit_optax import _layout as layout_lib  # (private: the layout is not public API)
  shapes = tuple(tuple(int(d) for d in s) for s in leaf_shapes)
  return layout_lib.WireLayout(shapes, n, layout_lib.EXACT_BELOW if exact_below is None
                               else exact_below)


def _predicted_bytes(num_params: int, leaf_shapes: list, n: int) -> dict:
  """Bytes each rank sends per step, per mode (ring all-reduce; two uint8 phases).

  Adam and 1-bit Adam's warmup all-reduce the (unpadded) gradient tree,
  ``num_params`` float32 (the warmup as one tuple psum); the compression phase
  sends, in each of two phases (all_to_all of the (n, row_bytes) rows,
  all_gather of the server's row_bytes message), n - 1 messages of
  ``row_bytes`` = packed signs of a chunk + 4 bytes per scale (S per chunk) +
  4 bytes per exact float (``exact_chunk``).
  """
  layout = _layout(leaf_shapes, n)
  allreduce = 2 * (n - 1) / n * 4 * num_params
  return {"adam": allreduce, "onebit_warmup": allreduce,
          "onebit_compression": 2 * (n - 1) * layout.row_bytes}


def _layout_info(num_params: int, leaf_shapes: list, n: int) -> dict:
  """The wire layout's numbers, saved with each run (benchmarks/scaling_model.py reads them)."""
  layout = _layout(leaf_shapes, n)
  return {"num_params": num_params, "padded": layout.bits.padded, "segments": layout.segments,
          "exact_chunk": layout.exact_chunk, "row_bytes": layout.row_bytes,
          "compressed_leaves": len(layout.compressed), "exact_leaves": len(layout.exact)}


def _load_1min(uptime: str) -> float | None:
  try:
    return float(uptime.split("load average:")[-1].split(",")[0])
  except ValueError:
    return None


def _load_note(start: str, end: str, runs: list[dict], note: str | None) -> list[str]:
  """A warning line when the machine was busy before the ranks started (1-minute load > cores)."""
  del end, runs
  out = [f"Note: {note}"] if note else []
  cores, load = os.cpu_count() or 1, _load_1min(start)
  if load is not None and load > cores:
    out.append(f"**Loaded machine**: the 1-minute load was {load:.1f} on {cores} cores before "
               "any rank started: other processes shared the CPUs, so the step times are "
               "distorted.")
  return out


def _uptime() -> str:
  try:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
  except OSError:
    la = os.getloadavg()
    return f"load average: {la[0]:.2f}, {la[1]:.2f}, {la[2]:.2f}"


# --- 0/1 Adam by phase ----------------------------------------------------------------

PHASES = (("v", "variance"), ("c", "compressed"), ("l", "local"), ("s", "sync"))
PHASE_WHAT = {"variance": "float32 all-reduce of the gradient, Adam's m and v",
              "compressed": "1-bit mean of the momentum (v fixed)",
              "local": "own Adam step on this rank's copy, no collective",
              "sync": "1-bit mean of the accumulated progress (without local steps: of the "
                      "momentum, a compressed step)"}


def _quantile(xs, q):
  xs = sorted(xs)
  if not xs:
    return float("nan")
  k = (len(xs) - 1) * q
  lo = int(k)
  hi = min(lo + 1, len(xs) - 1)
  return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _zero_one_summary(results: list[dict], bytes_divisor: float = 1.0) -> dict | None:
  """Per phase: rank 0's step times (median, quartiles), bytes per step (mean over ranks).

  Bytes per rank per step of a phase = the interface counters' change over the
  windows of that phase (read after the untimed pause at each change of phase)
  / the steps in them.
  """
  if "zero_one" not in results[0]:
    return None
  z0 = results[0]["zero_one"]
  out = {"hyper": z0["hyper"], "nsteps": z0["nsteps"], "settle_s": z0["settle_s"],
         "schedule": z0["schedule"], "predicted_schedule": z0["predicted_schedule"],
         "schedule_matches": all(r["zero_one"]["schedule_matches"] for r in results)
         and len({r["zero_one"]["schedule"] for r in results}) == 1,
         "first_step_s": z0["first_step_s"], "phases": {}}
  for code, name in PHASES:
    wins0 = [w for w in z0["windows"] if w["phase"] == code]
    times = [t for w in wins0 for t in w["step_s"]]
    if not times:
      continue
    per_rank = {}
    for key in ("tx_bytes", "rx_bytes", "lo_tx_bytes"):
      per_rank[key] = []
      for r in results:
        wins = [w for w in r["zero_one"]["windows"] if w["phase"] == code]
        per_rank[key].append(sum(w[key] for w in wins) / sum(w["steps"] for w in wins)
                             / bytes_divisor)
    # The optimizer's own count for the steps of this phase (rank 0; step 1 included).
    wire = [b for b, ph in zip(z0["state_wire_bytes"], z0["schedule"]) if ph == code]
    out["phases"][name] = {
        "steps": len(times), "windows": len(wins0), "step_s": _median(times),
        "mean_s": sum(times) / len(times), "q25_s": _quantile(times, 0.25),
        "q75_s": _quantile(times, 0.75),
        "tx_bytes": sum(per_rank["tx_bytes"]) / len(results), "tx_bytes_ranks": per_rank["tx_bytes"],
        "rx_bytes": sum(per_rank["rx_bytes"]) / len(results),
        "lo_tx_bytes": sum(per_rank["lo_tx_bytes"]) / len(results),
        "state_wire_bytes": _median(wire) if wire else None,
        # (a window's first step follows the untimed wait; the others run back to back)
        "first_s": _median([w["step_s"][0] for w in wins0]),
        "rest_s": _median([t for w in wins0 for t in w["step_s"][1:]] or [float("nan")])}
  return out


def _zero_one_predicted(num_params: int, leaf_shapes: list, n: int) -> dict:
  """Bytes each rank sends per step of each phase (the optimizer's layout, core v3).

  variance: allreduce_wire_bytes(parameters, n) (one float32 tuple all-reduce of
  the unpadded tree); compressed and sync: compressed_wire_bytes(padded, n,
  S + exact_chunk) = 2 (n-1) row_bytes (the same uint8 messages as 1-bit
  Adam's compression phase); local: 0.
  """
  import onebit_optax
  layout = _layout(leaf_shapes, n)
  onebit = _collective.compressed_wire_bytes(layout.bits.padded, n,
                                              layout.segments + layout.exact_chunk)
  assert abs(onebit - 2 * (n - 1) * layout.row_bytes) < 1e-6, (onebit, layout.row_bytes)
  return {"variance": _collective.allreduce_wire_bytes(num_params, n), "compressed": onebit,
          "local": 0.0, "sync": onebit}


# Whole-run schedules whose averages are reported (phase counts from the optimizer's
# own schedule, _comm_worker.phase_schedule). The last one (no local steps) takes
# its sync time from the measured run's sync steps (the same 1-bit exchange).
ZERO_ONE_SCHEDULES = (
    ("DeepSpeed-style: var_freeze_step 1000, var_update_scaler 16, local_steps 16, "
     "local_step_scaler 1000", 10_000,
     dict(var_freeze_step=1000, var_update_scaler=16, local_steps=16, local_step_scaler=1000)),
    ("zero_one_adam's docstring example: var_freeze_step 500, local_steps 16 (scalers 16, 32)",
     10_000, dict(var_freeze_step=500, local_steps=16)),
    ("no local steps: var_freeze_step 1000, var_update_scaler 16 (a sync every step after "
     "the freeze)", 10_000, dict(var_freeze_step=1000, var_update_scaler=16)),
)


def _schedule_rows(run: dict, pred: dict, schedules) -> list[dict]:
  """Each schedule's phase counts and its mean s/step from this run's per-phase medians."""
  ph = run["zero_one"]["phases"]
  t_adam = run["summary"]["adam"]["step_s"]
  rows = []
  for label, nsteps, hyper, counts in schedules:
    missing = [p for p, c in counts.items() if c and p not in ph]
    if missing:
      rows.append({"label": label, "nsteps": nsteps, "counts": counts, "missing": missing})
      continue
    t = sum(c * ph[p]["step_s"] for p, c in counts.items() if c) / nsteps
    b_meas = sum(c * ph[p]["tx_bytes"] for p, c in counts.items() if c) / nsteps
    b_pred = sum(c * pred[p] for p, c in counts.items() if c) / nsteps
    rows.append({"label": label, "nsteps": nsteps, "hyper": hyper, "counts": counts,
                 "mean_step_s": t, "steps_per_s": 1 / t, "vs_adam": t_adam / t,
                 "tx_bytes_per_step": b_meas, "predicted_bytes_per_step": b_pred})
  return rows


def _phase_counts(schedule: str) -> dict:
  return {name: schedule.count(code) for code, name in PHASES}


def _zero_one_schedules(run_schedule: dict) -> list:
  """(label, steps, hyper, counts): the timed run's own schedule, then ZERO_ONE_SCHEDULES."""
  out = [("this run's schedule (steps 1-{}, as timed: {})".format(
      run_schedule["nsteps"], ", ".join(f"{k} {v}" for k, v in run_schedule["hyper"].items())),
      run_schedule["nsteps"], run_schedule["hyper"], _phase_counts(run_schedule["schedule"]))]
  for label, nsteps, hyper in ZERO_ONE_SCHEDULES:
    out.append((label, nsteps, hyper, _phase_counts(_comm_worker.phase_schedule(nsteps, **hyper))))
  return out


def _zero_one_lines(run: dict, compute_zo: dict | None, pred: dict, schedules: list) -> list[str]:
  z, s = run["zero_one"], run["summary"]
  t_adam = s["adam"]["step_s"]
  hyper = ", ".join(f"{k}={v}" for k, v in z["hyper"].items())
  sched = z["schedule"]
  lines = [
      f"### 0/1 Adam by phase ({run['short_label']})", "",
      f"`zero_one_adam(1e-3, axis_name='data', {hyper})`, {z['nsteps']} steps on its real "
      f"schedule; step 1 compiles and is not timed (first step {z['first_step_s']:.1f} s). "
      "The phase of every step, as the state reports it (v variance, c compressed, l local, "
      f"s sync): `{sched}` "
      f"({'the same on every rank and as predicted' if z['schedule_matches'] else '**NOT as predicted**: ' + z['predicted_schedule']}). "
      "Consecutive steps of one phase form a window; at each change of phase the ranks wait "
      f"{z['settle_s']} s (untimed) before the interface counters are read, so each window's "
      "bytes are its own. Bytes per rank per step: tx_bytes of eth0 over a phase's windows / "
      "its steps, mean over the ranks (they include TCP acknowledgements of what the rank "
      "received and the jax.distributed coordinator's traffic). Times: rank 0's steps, "
      "median and quartiles. Compute alone: the same schedule with each rank on its own "
      "1-device mesh, all at once (no collective; the 1-device exchange still packs and "
      "unpacks the signs), timed last, unsynchronized: a rank's core-mate may have finished "
      "(the run pins two ranks to a core), and untimed reads and waits sit between its "
      "windows, so these times can fall below Adam's back-to-back compute alone; read them "
      "as a lower bound.", "",
      "| phase | what moves | steps timed (windows) | median s/step | q25-q75 | steps/s | "
      "vs Adam | compute alone s/step | bytes sent/rank/step (measured) | predicted | "
      "optimizer's wire_bytes | measured/predicted |",
      "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for name, x in z["phases"].items():
    c = (compute_zo or {}).get("phases", {}).get(name)
    ratio = f"{x['tx_bytes'] / pred[name]:.3f}" if pred[name] else "-"
    wire = x["state_wire_bytes"]
    lines.append(
        f"| {name} | {PHASE_WHAT[name]} | {x['steps']} ({x['windows']}) | {x['step_s']:.3f} | "
        f"{x['q25_s']:.3f}-{x['q75_s']:.3f} | {1 / x['step_s']:.2f} | "
        f"{t_adam / x['step_s']:.2f}x | {c['step_s'] if c else float('nan'):.3f} | "
        f"{_fmt_bytes(x['tx_bytes'])} | {_fmt_bytes(pred[name])} | "
        f"{_fmt_bytes(wire) if wire is not None else '-'} | {ratio} |")
  lines += ["", "A window's first step (after the wait) against its later steps, median s/step: "
            + ", ".join(f"{name} {x['first_s']:.3f} / {x['rest_s']:.3f}"
                        for name, x in z["phases"].items() if "first_s" in x) + "."]
  lines += ["", f"Adam in the same run: {t_adam:.3f} s/step ({1 / t_adam:.2f} steps/s); "
            f"1-bit Adam's compression phase {s['onebit_compression']['step_s']:.3f} s/step."
            if "onebit_compression" in s else ""]
  cz = (compute_zo or {}).get("phases", {})
  c_adam = c_onebit = None
  if compute_zo and run.get("compute_summary"):
    c_adam = run["compute_summary"]["adam"]["step_s"]
    c_onebit = run["compute_summary"].get("onebit_compression", {}).get("step_s")
  if cz and c_adam:
    lines.append(
        f"Compute alone, x Adam's compute alone ({c_adam:.3f} s): " + ", ".join(
            f"{name} {x['step_s'] / c_adam:.1f}x" for name, x in cz.items())
        + (f" (1-bit Adam's compression step: {c_onebit / c_adam:.1f}x)" if c_onebit else "")
        + "; measured minus compute alone (the communication the step waits for): " + ", ".join(
            f"{name} {z['phases'][name]['step_s'] - x['step_s']:+.3f} s"
            for name, x in cz.items() if name in z["phases"]) + ".")
  lines.append("")
  rows = _schedule_rows(run, pred, schedules)
  run["zero_one"]["schedules"] = rows
  lines += [
      "Whole-run averages: the phase counts of a schedule (from the optimizer's own "
      "schedule, run on a 2-element problem) times this run's median s/step of each phase, "
      "over the run's steps (the first step's compilation and any evaluation left out).", "",
      "| schedule | steps | variance | compressed | local | sync | mean s/step | steps/s | "
      "vs Adam | bytes/rank/step (measured per phase) | predicted |",
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    counts = " | ".join(str(r["counts"].get(name, 0)) for _, name in PHASES)
    if "missing" in r:
      lines.append(f"| {r['label']} | {r['nsteps']:,} | {counts} | not measured: "
                   f"{', '.join(r['missing'])} | | | | |")
      continue
    lines.append(f"| {r['label']} | {r['nsteps']:,} | {counts} | {r['mean_step_s']:.3f} | "
                 f"{r['steps_per_s']:.2f} | {r['vs_adam']:.2f}x | "
                 f"{_fmt_bytes(r['tx_bytes_per_step'])} | "
                 f"{_fmt_bytes(r['predicted_bytes_per_step'])} |")
  lines += ["", "The last schedule's syncs are timed here with local steps (local_steps="
            f"{z['hyper'].get('local_steps')}); without local steps a sync is a compressed step "
            "(the same program since 68b5d3f): the compressed row.", ""]
  return lines


def _print_zero_one(z: dict | None):
  if not z:
    return
  for name, x in z["phases"].items():
    print(f"    0/1 Adam {name:19s} {x['step_s']:.3f} s/step ({x['steps']} steps), "
          f"{_fmt_bytes(x['tx_bytes'])} sent/rank/step", flush=True)
  if not z["schedule_matches"]:
    print(f"    0/1 Adam schedule NOT as predicted: {z['schedule']}", flush=True)


def _zero_one_goal_lines(run: dict, n: int) -> list[str]:
  """The issue's 0/1 Adam lines: local steps move no bytes; steps/s of each phase."""
  z = run.get("zero_one")
  if not z or "local" not in z["phases"]:
    return []
  ph, t_adam = z["phases"], run["summary"]["adam"]["step_s"]
  local = ph["local"]
  ref = ph.get("sync", ph.get("compressed"))
  ok = ref is not None and local["tx_bytes"] < 0.01 * ref["tx_bytes"]
  out = [f"- 0/1 Adam, 1 Gbit/s, {n} ranks, steps/s by phase (x Adam): " + ", ".join(
      f"{name} {1 / x['step_s']:.2f} ({t_adam / x['step_s']:.2f}x)" for name, x in ph.items()) + "."]
  out.append(
      f"- 0/1 Adam's local steps move no bytes: {_fmt_bytes(local['tx_bytes'])} sent per rank "
      f"per local step on the links (a sync: {_fmt_bytes(ref['tx_bytes']) if ref else '?'}; "
      f"the rest is background: acknowledgements, the coordinator): "
      f"**{'PASS' if ok else 'FAIL'}** (< 1% of a sync's).")
  rows = z.get("schedules") or []
  if len(rows) > 1 and "vs_adam" in rows[1]:
    out.append(f"- 0/1 Adam over a whole run ({rows[1]['label']}, {rows[1]['nsteps']:,} "
               f"steps): {rows[1]['vs_adam']:.2f}x Adam's throughput.")
  return out


# --- the report --------------------------------------------------------------------

def _fmt_bytes(b: float) -> str:
  for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if b >= scale:
      return f"{b / scale:.2f} {unit}"
  return f"{b:.0f} B"


def _report(args, runs: list[dict], compute: dict, num_params: int, leaf_shapes: list,
            header: list[str], zo_schedules: list | None = None) -> list[str]:
  n = args.ranks
  zo_pred = _zero_one_predicted(num_params, leaf_shapes, n)
  pred = _predicted_bytes(num_params, leaf_shapes, n)
  layout = _layout(leaf_shapes, n)
  tc = compute["summary"]
  modes = [m for m in MODES if m in tc]
  t_adam_c = tc["adam"]["step_s"]
  lines = header + [
      "",
      "## Compute alone (no communication)",
      "",
      f"The {n} ranks run at the same time on the same cores, each on its own 1-device mesh "
      "(the collectives vanish), so contention for the CPU is as in the networked runs. "
      "For 1-bit Adam this is a 1-device cluster, which in core v3 has no server phase (the "
      "message is the rank's own row): t_compress leaves out the server's work on its "
      f"1/{n} chunk (decode the {n} rows, average, re-compress), which the model below adds "
      "from the profile when --profile ran. "
      "Adam's compute skips the pmean; so does the package on one device (the sum over one "
      "device is the gradients themselves where nothing types them: before b6f3095 a "
      "1-participant all-reduce, which doubled the warmup's compute here). The ranks are not "
      "synchronized: a rank whose core-mate has finished runs alone.",
      "",
      "| step | median s/step (rank 0) | repeats min-max | x Adam |",
      "|---|---:|---:|---:|",
  ]
  for mode in modes:
    c = tc[mode]
    lines.append(f"| {LABELS[mode]} | {c['step_s']:.3f} | {c['rep_min_s']:.3f}-{c['rep_max_s']:.3f} "
                 f"| {c['step_s'] / t_adam_c:.2f} |")
  lines += ["", f"t_compute (Adam step) = {t_adam_c:.3f} s; t_compress = 1-bit compression step "
            "minus Adam step: " + ", ".join(
                f"{SHORT[m]} {tc[m]['step_s'] - t_adam_c:.3f} s" for m in modes
                if m.endswith("compression")) + ".", ""]

  for run in runs:
    s, bw, rtt = run["summary"], run["bandwidth_Bps"], run["rtt_s"]
    lines += [
        f"## {run['label']}",
        "",
        f"Measured TCP goodput between two ranks: {bw / 1e6:.1f} MB/s "
        f"({bw * 8 / 1e9:.3f} Gbit/s), round trip {rtt * 1e6:.0f} us. "
        f"Load before the run: {run['load']}.",
        "",
        f"Predicted bytes from the optimizer's wire layout (core v3): {len(leaf_shapes)} leaves, "
        f"{num_params:,} parameters; {len(layout.compressed)} compressed leaves "
        f"({layout.bits.size:,} elements, the sign stream padded to {layout.bits.padded:,}, "
        f"S = {layout.segments} scales per chunk), {len(layout.exact)} exact leaves "
        f"({layout.exact_size} float32, exact_chunk = {layout.exact_chunk}); one message "
        f"row_bytes = {layout.bits.chunk // 8:,} + 4 x ({layout.segments} + "
        f"{layout.exact_chunk}) = {layout.row_bytes:,} B. Compression 2(n-1) row_bytes; "
        "warmup and Adam 2(n-1)/n x 4 bytes x parameters (the unpadded tree).",
        "",
        "| step | median s/step | repeats min-max | steps/s | vs Adam | bytes sent/rank/step "
        "(measured) | predicted | measured/predicted |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in modes:
      m = s[mode]
      lines.append(
          f"| {LABELS[mode]} | {m['step_s']:.3f} | {m['rep_min_s']:.3f}-{m['rep_max_s']:.3f} | "
          f"{1 / m['step_s']:.2f} | {s['adam']['step_s'] / m['step_s']:.2f}x | "
          f"{_fmt_bytes(m['tx_bytes'])} | {_fmt_bytes(pred[mode])} | "
          f"{m['tx_bytes'] / pred[mode]:.3f} |")
    # alpha-beta: latency terms are 2(n-1) message rounds for both (ring all-reduce;
    # all_to_all + all_gather), negligible here but kept for completeness.
    alpha = rtt / 2 * 2 * (n - 1)
    t_adam_model = t_adam_c + alpha + pred["adam"] / bw
    run["model"] = {"t_adam": t_adam_model}
    lines += [
        "",
        f"Alpha-beta model (bw = measured goodput, alpha = {alpha * 1e3:.2f} ms): t_adam = "
        f"{t_adam_c:.3f} s + {_fmt_bytes(pred['adam'])} / bw = {t_adam_model:.3f} s.",
        "",
        "| compression step | t_compute | + bytes/bw | model s/step | measured s/step | "
        "ratio vs Adam: model | measured | **measured/model** | comm implied (measured - compute) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    server = _server_s(run)
    if server:
      lines[-2:-2] = [f"t_compute of the compression step = compute alone + the server of one "
                      f"chunk from the profile ({server:.3f} s; a 1-device cluster has no "
                      "server).", ""]
    for mode in [m for m in modes if m.endswith("compression")]:
      t_c = tc[mode]["step_s"] + (server or 0.0)
      t_model = t_c + alpha + pred[mode] / bw
      predicted = t_adam_model / t_model
      achieved = s["adam"]["step_s"] / s[mode]["step_s"]
      run["model"][mode] = {"t": t_model, "predicted": predicted, "achieved": achieved}
      lines.append(
          f"| {SHORT[mode]} | {t_c:.3f} | {pred[mode] / bw:.3f} | {t_model:.3f} | "
          f"{s[mode]['step_s']:.3f} | {predicted:.2f}x | {achieved:.2f}x | "
          f"**{achieved / predicted:.0%}** | {s[mode]['step_s'] - t_c:.3f} s |")
    lines += [
        "",
        f"Adam: communication implied {s['adam']['step_s'] - t_adam_c:.3f} s "
        f"(model {pred['adam'] / bw:.3f} s). Wire bytes reported by the optimizer state: warmup "
        f"{_fmt_bytes(s['onebit_warmup']['state_wire_bytes'])}, compression "
        f"{_fmt_bytes(s['onebit_compression']['state_wire_bytes'])}."
        if "onebit_warmup" in s else "",
        "",
    ]
    if run.get("profile"):
      lines += [
          f"Collectives on their own ({num_params:,} float32 per rank; rank 0, median of "
          "repeats):",
          "",
          "| operation | s |",
          "|---|---:|",
      ] + [f"| {k} | {v:.3f} |" for k, v in run["profile"].items()] + [""]
    if run.get("zero_one"):
      run["compute_summary"] = tc
      lines += _zero_one_lines(run, compute.get("zero_one"), zo_pred, zo_schedules or [])
      del run["compute_summary"]
  return lines


def _server_s(run: dict) -> float | None:
  """The profile's server of one chunk (core v3; absent in older profiles)."""
  return next((v for k, v in (run.get("profile") or {}).items()
               if k.startswith("server alone, one chunk")), None)


def _plot(runs: list[dict], path: Path):
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib not installed: no plot")
    return
  modes = [m for m in MODES if m in runs[0]["summary"]]
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  width = 0.8 / len(modes)
  offset = lambda i: (i - (len(modes) - 1) / 2) * width
  for i, mode in enumerate(modes):
    xs = [j + offset(i) for j in range(len(runs))]
    axes[0].bar(xs, [1 / r["summary"][mode]["step_s"] for r in runs], width, label=SHORT[mode])
    axes[1].bar(xs, [r["summary"][mode]["tx_bytes"] for r in runs], width, label=SHORT[mode])
  for j, r in enumerate(runs):
    for i, mode in enumerate(modes):
      t_model = r["model"]["t_adam"] if mode == "adam" else r["model"].get(mode, {}).get("t")
      if t_model:
        axes[0].plot([j + offset(i) - width / 2, j + offset(i) + width / 2], [1 / t_model] * 2,
                     "k--", lw=1, label="alpha-beta model" if (i, j) == (0, 0) else None)
      if mode != "adam":
        axes[0].annotate(f"{r['summary']['adam']['step_s'] / r['summary'][mode]['step_s']:.2f}x",
                         (j + offset(i), 1 / r["summary"][mode]["step_s"]),
                         ha="center", va="bottom", fontsize=8)
  for ax in axes:
    ax.set_xticks(range(len(runs)), [r["short_label"] for r in runs])
  axes[0].set_ylabel("steps / s")
  axes[0].set_title(f"{runs[0]['num_ranks']} CPU ranks, {runs[0]['num_params'] / 1e6:.1f}M "
                    "parameters (labels: x Adam)", fontsize=10)
  axes[1].set_yscale("log")
  axes[1].set_ylabel("bytes sent per rank per step (tx_bytes)")
  axes[1].set_title("measured on the interfaces", fontsize=10)
  axes[0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  print(f"wrote {path}")


# --- main --------------------------------------------------------------------------

def main(argv=None):
  args = _parse_args(argv)
  for sig in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, _on_signal)
  if args.hier:
    return _main_hier(args, argv)
  rates = [args.rate] + ([r for r in ("100mbit", "10gbit") if r != args.rate] if args.rates else [])
  start_load = _uptime()
  print(f"uptime at start: {start_load}", flush=True)
  reason = "--loopback given" if args.loopback else _netns.unavailable_reason()
  if reason:
    print(f"Network namespaces unavailable ({reason}): falling back to plain loopback, "
          "NO bandwidth limit; bytes are read on `lo`, shared by all ranks.", flush=True)
  else:
    stale = _netns.cleanup_stale()
    if stale:
      print(f"removed leftovers of earlier runs: {', '.join(stale)}", flush=True)

  workdir = Path(tempfile.mkdtemp(prefix="onebit-comm-"))
  n = args.ranks
  runs = []
  t0 = time.time()
  try:
    print(f"[{time.time() - t0:5.0f}s] compute alone: {n} ranks without communication", flush=True)
    local = _run_ranks([_worker_cmd(args, r, 1, None, "lo") for r in range(n)],
                       workdir, args.timeout, "compute")
    compute = {"summary": _summarize(local), "zero_one": _zero_one_summary(local)}
    num_params, leaf_shapes = local[0]["num_params"], local[0]["leaf_shapes"]
    for mode in compute["summary"]:
      print(f"    {LABELS[mode]:28s} {compute['summary'][mode]['step_s']:.3f} s/step", flush=True)
    _print_zero_one(compute["zero_one"])

    for rate in (rates if not reason else ["loopback"]):
      load = _uptime().split("load average:")[-1].strip()
      if reason:
        print(f"[{time.time() - t0:5.0f}s] loopback run", flush=True)
        bw = _loopback_bandwidth()
        coordinator = f"127.0.0.1:{_free_port()}"
        cmds = [_worker_cmd(args, r, n, coordinator, "lo") for r in range(n)]
        results = _run_ranks(cmds, workdir, args.timeout, "loopback")
        summary = _summarize(results, bytes_divisor=n)
        runs.append({"label": "Loopback, no namespaces (NOT bandwidth-limited)",
                     "short_label": "loopback", "summary": summary, "bandwidth_Bps": bw["goodput_Bps"],
                     "rtt_s": bw["rtt_s"], "load": load, "num_ranks": n, "num_params": num_params,
                     "profile": results[0].get("profile"),
                     "zero_one": _zero_one_summary(results, bytes_divisor=n)})
        continue
      with _netns.Cluster(n, rate) as cluster:
        print(f"[{time.time() - t0:5.0f}s] {rate}: namespaces {cluster.prefix}-*, measuring the link",
              flush=True)
        nbytes = int(min(200e6, max(20e6, _netns._rate_bits(rate) / 8 * 1.0)))
        bw = _netns.measure_bandwidth(cluster, sys.executable, nbytes=nbytes)
        print(f"    goodput {bw['goodput_Bps'] / 1e6:.1f} MB/s, rtt {bw['rtt_s'] * 1e6:.0f} us; "
              f"starting {n} ranks", flush=True)
        coordinator = f"{cluster.address(0)}:{COORD_PORT}"
        cmds = [cluster.exec_prefix(r) + _worker_cmd(args, r, n, coordinator, "eth0")
                for r in range(n)]
        results = _run_ranks(cmds, workdir, args.timeout, rate)
      summary = _summarize(results)
      for mode in summary:
        print(f"    {LABELS[mode]:28s} {summary[mode]['step_s']:.3f} s/step, "
              f"{_fmt_bytes(summary[mode]['tx_bytes'])} sent/rank/step", flush=True)
      zero_one = _zero_one_summary(results)
      _print_zero_one(zero_one)
      runs.append({"label": f"{n} ranks, {rate} links (tc tbf, network namespaces)",
                   "short_label": rate, "summary": summary, "bandwidth_Bps": bw["goodput_Bps"],
                   "rtt_s": bw["rtt_s"], "load": load, "num_ranks": n, "num_params": num_params,
                   "profile": results[0].get("profile"), "zero_one": zero_one})
  finally:
    _kill_children()
    shutil.rmtree(workdir, ignore_errors=True)

  for run in runs:
    run["wire_layout"] = _layout_info(num_params, leaf_shapes, n)
  end_load = _uptime()
  import jax
  import optax
  import onebit_optax
  header = [
      f"# Communication benchmark: Adam vs 1-bit Adam"
      f"{' vs 0/1 Adam' if any(r.get('zero_one') for r in runs) else ''}, {n} CPU ranks",
      "",
      f"Command: `python benchmarks/comm_throughput.py {shlex.join(_argv(argv))}`"
      .replace("  ", " ").rstrip() + f" (took {time.time() - t0:.0f} s).",
      f"jax {jax.__version__}, optax {optax.__version__}, onebit_optax {onebit_optax.__version__} "
      f"(commit {_git_commit()}); {os.cpu_count()} CPU cores shared by {n} ranks "
      f"({'pinned rank % cores' if not args.no_pin else 'not pinned'}), one XLA thread each.",
      f"Model: embedding bag, {args.vocab:,} x {args.dim} table + 2 small dense layers = "
      f"{num_params:,} parameters; batch {args.batch} x {args.seq} tokens per rank. "
      f"{args.repeats} repeats x {args.steps} timed steps per optimizer, after compilation.",
      f"`uptime` at start: {start_load}",
      f"`uptime` at end: {end_load}",
  ] + _load_note(start_load, end_load, runs, args.note)
  zo_runs = [r["zero_one"] for r in runs if r.get("zero_one")]
  zo_schedules = _zero_one_schedules(zo_runs[0]) if zo_runs else []
  lines = _report(args, runs, compute, num_params, leaf_shapes, header, zo_schedules)
  goal = [r for r in runs if r["short_label"] == "1gbit"]
  if goal:
    lines += ["## Against the goal", ""]
    m = goal[0]["model"].get("onebit_compression")
    if m:
      lines.append(
          f"- {LABELS['onebit_compression']}, 1 Gbit/s, {n} ranks: {m['achieved']:.2f}x Adam's "
          f"throughput (target: >= 5x; issue 9's earlier goal >= 3x): "
          f"**{'PASS' if m['achieved'] >= 5 else 'FAIL'}**; the alpha-beta model with the "
          f"measured compute predicts {m['predicted']:.2f}x (measured/model "
          f"{m['achieved'] / m['predicted']:.0%}).")
    gs = goal[0]["summary"]
    if "onebit_warmup" in gs:
      w = gs["adam"]["step_s"] / gs["onebit_warmup"]["step_s"]
      lines.append(
          f"- {LABELS['onebit_warmup']}, 1 Gbit/s, {n} ranks: {w:.2f}x Adam's throughput "
          f"(target: >= 0.95x): **{'PASS' if w >= 0.95 else 'FAIL'}**.")
    lines += _zero_one_goal_lines(goal[0], n)
    lines.append("")
  out_dir = Path(args.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  text = "\n".join(lines)
  print("\n" + text, flush=True)
  stem = args.name or ("comm_throughput_rates" if args.rates else "comm_throughput")
  (out_dir / f"{stem}.md").write_text(text + "\n")
  (out_dir / f"{stem}.json").write_text(json.dumps(
      {"runs": runs, "compute": compute, "args": vars(args), "commit": _git_commit(),
       "load_start": start_load, "load_end": end_load,
       "zero_one_predicted_bytes": _zero_one_predicted(num_params, leaf_shapes, n)
       if zo_runs else None}, indent=1, default=str))
  print(f"wrote {out_dir / (stem + '.md')}")
  _plot(runs, out_dir / f"{stem}.png")


# --- the hierarchical case (--hier) ------------------------------------------------
#
# --nodes namespaces ("nodes") of k = ranks / nodes ranks each; only the veth of
# each node into the bridge is shaped, the k ranks of a node talk over its
# loopback (_netns.Cluster with ranks_per_node=k). The worker builds the 2-D mesh
# ('node', 'local') with node k's ranks on row k. Modes: Adam (pmean over both
# axes), flat 1-bit Adam (1-D mesh 'data' of the same ranks) and hierarchical
# 1-bit Adam (axis_name=('node', 'local')), both forced into compression.

HIER_MODES = ("adam", "onebit_warmup", "onebit_compression", "hier_compression")
HIER_WORKER_MODES = "adam,onebit,hier"


def _main_hier(args, argv):
  t0, start_load = time.time(), _uptime()
  print(f"uptime at start: {start_load}", flush=True)
  reason = _netns.unavailable_reason()
  if reason:
    sys.exit(f"--hier needs network namespaces ({reason}); run as root with iproute2.")
  stale = _netns.cleanup_stale()
  if stale:
    print(f"removed leftovers of earlier runs: {', '.join(stale)}", flush=True)
  workdir = Path(tempfile.mkdtemp(prefix="onebit-hier-"))
  try:
    compute = _hier_compute(args, workdir, t0)
    run = _hier_network(args, workdir, t0)
  finally:
    _kill_children()
    shutil.rmtree(workdir, ignore_errors=True)
  _hier_model(run, compute)
  _write_hier(args, argv, run, compute, t0, start_load)


def _hier_compute(args, workdir: Path, t0: float) -> dict:
  """Every rank alone on a 1-device (1x1) mesh, all at once on the same cores."""
  print(f"[{time.time() - t0:5.0f}s] compute alone: {args.ranks} ranks without communication",
        flush=True)
  cmds = [_worker_cmd(args, r, 1, None, "lo", HIER_WORKER_MODES, "1x1") for r in range(args.ranks)]
  local = _run_ranks(cmds, workdir, args.timeout, "compute")
  compute = {"summary": _summarize(local), "num_params": local[0]["num_params"],
             "leaf_shapes": local[0]["leaf_shapes"]}
  for mode, m in compute["summary"].items():
    print(f"    {LABELS[mode]:38s} {m['step_s']:.3f} s/step", flush=True)
  return compute


def _hier_network(args, workdir: Path, t0: float) -> dict:
  """The ranks on ``args.nodes`` namespaces; link probes, the run, the link counters."""
  n, nodes = args.ranks, args.nodes
  k = n // nodes
  with _netns.Cluster(n, args.rate, ranks_per_node=k) as cluster:
    print(f"[{time.time() - t0:5.0f}s] {nodes} nodes x {k} ranks, {args.rate} between nodes: "
          "measuring the links", flush=True)
    nbytes = int(min(200e6, max(20e6, _netns._rate_bits(args.rate) / 8)))
    inter = _netns.measure_bandwidth(cluster, sys.executable, nbytes=nbytes, nodes=(0, 1))
    local = _netns.measure_bandwidth(cluster, sys.executable, nbytes=200 * 2**20, nodes=(0, 0))
    print(f"    between nodes {inter['goodput_Bps'] / 1e6:.1f} MB/s, rtt "
          f"{inter['rtt_s'] * 1e6:.0f} us; inside a node {local['goodput_Bps'] / 1e6:.0f} MB/s, "
          f"rtt {local['rtt_s'] * 1e6:.0f} us; starting {n} ranks", flush=True)
    load = _uptime().split("load average:")[-1].strip()
    coordinator = f"{cluster.node_address(0)}:{COORD_PORT}"
    cmds = [cluster.exec_prefix(r) + _worker_cmd(args, r, n, coordinator, "eth0",
                                                 HIER_WORKER_MODES, f"{nodes}x{k}")
            for r in range(n)]
    before = cluster.link_counters()
    results = _run_ranks(cmds, workdir, args.timeout, f"hier-{args.rate}")
    after = cluster.link_counters()
  summary = _hier_summary(results, k)
  for mode, m in summary.items():
    print(f"    {LABELS[mode]:38s} {m['step_s']:.3f} s/step, {_fmt_bytes(m['tx_bytes'])} per "
          f"device per step on the link, {_fmt_bytes(m['lo_tx_bytes'])} inside the node",
          flush=True)
  return {"label": f"{nodes} nodes x {k} ranks, {args.rate} between nodes (tc tbf), "
                   "unshaped inside a node",
          "short_label": args.rate, "summary": summary, "bandwidth_Bps": inter["goodput_Bps"],
          "rtt_s": inter["rtt_s"], "local_bandwidth_Bps": local["goodput_Bps"],
          "local_rtt_s": local["rtt_s"], "load": load, "num_ranks": n, "num_nodes": nodes,
          "ranks_per_node": k, "num_params": results[0]["num_params"],
          "mesh_process_ids": results[0].get("mesh_process_ids"),
          "profile": results[0].get("profile"),
          "link_counters_total": {node: {c: after[node][c] - before[node][c] for c in after[node]}
                                  for node in after}}


def _hier_summary(results: list[dict], ranks_per_node: int) -> dict:
  """_summarize per device: a node's eth0 (the link) and lo counters are shared by its ranks.

  Every rank of a node reads the same counters over (nearly) the same steps, so
  the node's bytes are the mean of its ranks' readings, and a device's share is
  that divided by ranks_per_node. ``link_Bps``: bytes per second each node's link
  carried outwards while the mode ran.
  """
  summary = _summarize(results, bytes_divisor=ranks_per_node)
  for mode, m in summary.items():
    lo = [_median([b["lo_tx_bytes_per_step"] for b in r["modes"][mode]["blocks"]])
          / ranks_per_node for r in results]
    m["lo_tx_bytes"] = sum(lo) / len(lo)
    m["link_Bps"] = m["tx_bytes"] * ranks_per_node / m["step_s"]
  return summary


def _hier_predicted(num_params: int, leaf_shapes: list, n: int, nodes: int) -> dict:
  """Bytes per device per step on the links between nodes, and what each assumes.

  Hierarchical (core v3: every leaf compressed, exact_below = 0): the
  node-level 1-bit mean of the device's 1/k slice of the sign stream (padded / k
  elements over ``nodes`` nodes): compressed_wire_bytes(padded/k, nodes, S).
  Adam and the flat warmup: a ring all-reduce of the unpadded tree over the
  ranks in order crosses between nodes on ``nodes`` of its n edges. Flat 1-bit
  (exact leaves as float32, row_bytes per message): phase 1 (all_to_all) sends
  one message to each remote peer, phase 2 (a ring all_gather, n-1 messages on
  every edge) crosses on ``nodes`` of n edges.
  """
  import onebit_optax
  hier = _layout(leaf_shapes, n, exact_below=0).bits
  msg = _layout(leaf_shapes, n).row_bytes
  k = n // nodes
  remote = n - k
  return {
      "hier_compression": _collective.compressed_wire_bytes(
          hier.padded // k, nodes, hier.max_segments),
      "adam": _collective.allreduce_wire_bytes(num_params, n) * nodes / n,
      "onebit_warmup": _collective.allreduce_wire_bytes(num_params, n) * nodes / n,
      "onebit_compression": remote * msg + (n - 1) * msg * nodes / n,
      "padded": hier.padded, "max_segments": hier.max_segments,
  }


def _hier_model(run: dict, compute: dict):
  """Alpha-beta with the *measured* bytes: compute + node's link bytes / bw + intra / intra bw."""
  s, k = run["summary"], run["ranks_per_node"]
  run["model"] = {}
  for mode, m in s.items():
    t_c = compute["summary"][mode]["step_s"]
    t_link = m["tx_bytes"] * k / run["bandwidth_Bps"]
    t_intra = m["lo_tx_bytes"] * k / run["local_bandwidth_Bps"]
    run["model"][mode] = {"t": t_c + t_link + t_intra, "t_compute": t_c, "t_link": t_link,
                          "t_intra": t_intra}
  t_adam = run["model"]["adam"]["t"]
  run["model"]["t_adam"] = t_adam  # (as in comm_throughput.json)
  for mode in s:
    run["model"][mode].update(predicted=t_adam / run["model"][mode]["t"],
                              achieved=s["adam"]["step_s"] / s[mode]["step_s"])


def _hier_header(args, argv, run: dict, t0: float, start_load: str) -> list[str]:
  import jax
  import optax
  import onebit_optax
  k = run["ranks_per_node"]
  return [
      f"# Hierarchical communication benchmark: {run['num_nodes']} nodes x {k} CPU ranks",
      "",
      f"Command: `python benchmarks/comm_throughput.py {' '.join(_argv(argv))}`"
      .replace("  ", " ").rstrip() + f" (took {time.time() - t0:.0f} s).",
      f"jax {jax.__version__}, optax {optax.__version__}, onebit_optax {onebit_optax.__version__} "
      f"(commit {_git_commit()}); {os.cpu_count()} CPU cores shared by {run['num_ranks']} ranks "
      f"({'pinned rank % cores' if not args.no_pin else 'not pinned'}), one XLA thread each.",
      f"Model: embedding bag, {args.vocab:,} x {args.dim} table + 2 small dense layers = "
      f"{run['num_params']:,} parameters; batch {args.batch} x {args.seq} tokens per rank. "
      f"{args.repeats} repeats x {args.steps} timed steps per optimizer, after compilation.",
      f"`uptime` at start: {start_load}",
      f"`uptime` at end: {_uptime()}",
      "",
      f"Topology: {run['num_nodes']} network namespaces (nodes), {k} ranks in each; one veth per "
      f"node into a bridge, shaped by `tc tbf` to {args.rate} in both directions; the ranks of a "
      "node share its namespace and address and reach each other through its loopback (a "
      "connection to a local address never leaves through eth0). 2-D mesh "
      f"`jax.make_mesh(({run['num_nodes']}, {k}), ('node', 'local'))`, process ids by row: "
      f"{run['mesh_process_ids']}. Measured TCP goodput between nodes "
      f"{run['bandwidth_Bps'] / 1e6:.1f} MB/s ({run['bandwidth_Bps'] * 8 / 1e9:.3f} Gbit/s), round "
      f"trip {run['rtt_s'] * 1e6:.0f} us; inside a node "
      f"{run['local_bandwidth_Bps'] / 1e6:.0f} MB/s, round trip {run['local_rtt_s'] * 1e6:.0f} us. Load before the run: {run['load']}.",
      "",
      "Modes: Adam = `optax.adam` on `pmean(grads, ('node', 'local'))`; flat 1-bit = "
      "`onebit_adam(axis_name='data')` on the 1-D mesh of the same ranks; hierarchical 1-bit = "
      "`onebit_adam(axis_name=('node', 'local'))` on the 2-D mesh; both 1-bit modes in the "
      "compression phase (`fixed_step_freeze(1)`), local gradients (`local_params`).",
  ]


def _argv(argv) -> list[str]:
  return list(argv if argv is not None else sys.argv[1:])


def _hier_tables(run: dict, compute: dict, pred: dict) -> list[str]:
  s, tc = run["summary"], compute["summary"]
  modes = [m for m in HIER_MODES if m in s]
  lines = ["", "## Compute alone (no communication)", "",
           "Each rank alone on a 1x1 mesh, all at once on the same cores (a 1-device cluster "
           "compresses the whole vector, so for 1-bit Adam this is an upper bound).", "",
           "| step | median s/step (rank 0) | repeats min-max | x Adam |", "|---|---:|---:|---:|"]
  lines += [f"| {LABELS[m]} | {tc[m]['step_s']:.3f} | {tc[m]['rep_min_s']:.3f}-"
            f"{tc[m]['rep_max_s']:.3f} | {tc[m]['step_s'] / tc['adam']['step_s']:.2f} |"
            for m in modes]
  lines += ["", f"## {run['label']}", "",
            "Bytes per device per step from the kernel counters: on the link = the node's eth0 "
            f"tx_bytes / {run['ranks_per_node']}; inside the node = its lo tx_bytes / "
            f"{run['ranks_per_node']}. Link rate: what each node's link carried outwards while "
            "the mode ran.", "",
            "| step | median s/step | repeats min-max | steps/s | vs Adam | vs flat 1-bit | "
            "on the link (measured) | predicted | measured/predicted | inside the node | "
            "link rate |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for m in modes:
    x = s[m]
    lines.append(
        f"| {LABELS[m]} | {x['step_s']:.3f} | {x['rep_min_s']:.3f}-{x['rep_max_s']:.3f} | "
        f"{1 / x['step_s']:.2f} | {s['adam']['step_s'] / x['step_s']:.2f}x | "
        f"{s['onebit_compression']['step_s'] / x['step_s']:.2f}x | {_fmt_bytes(x['tx_bytes'])} | "
        f"{_fmt_bytes(pred[m])} | {x['tx_bytes'] / pred[m]:.3f} | {_fmt_bytes(x['lo_tx_bytes'])} | "
        f"{x['link_Bps'] * 8 / 1e6:.0f} Mbit/s |")
  return lines + _hier_model_lines(run, s, modes, pred)


def _hier_model_lines(run: dict, s: dict, modes: list, pred: dict) -> list[str]:
  lines = ["", f"Predicted bytes on the link per device: hierarchical `compressed_wire_bytes("
           f"padded/{run['ranks_per_node']}, {run['num_nodes']}, S)` with padded = "
           f"{pred['padded']:,}, S = {pred['max_segments']}; Adam a ring all-reduce over ranks in "
           f"order ({run['num_nodes']} of its {run['num_ranks']} edges cross); flat 1-bit one "
           "all_to_all message to each remote peer plus a ring all_gather. Totals over the whole "
           "run on the switch ports (rx = what the node sent): " + ", ".join(
               f"node {node} {_fmt_bytes(c['port_rx'])}"
               for node, c in run["link_counters_total"].items()) + ".",
           "", "Alpha-beta with the measured bytes: compute alone + the node's link bytes / "
           "goodput between nodes + its loopback bytes / goodput inside a node.", "",
           "| step | t_compute | + link | + inside node | model s/step | measured | measured/model |",
           "|---|---:|---:|---:|---:|---:|---:|"]
  for m in modes:
    x = run["model"][m]
    lines.append(f"| {SHORT[m]} | {x['t_compute']:.3f} | {x['t_link']:.3f} | {x['t_intra']:.3f} | "
                 f"{x['t']:.3f} | {s[m]['step_s']:.3f} | {s[m]['step_s'] / x['t']:.0%} |")
  if run.get("profile"):
    lines += ["", f"Collectives and compressed_mean on their own ({run['num_params']:,} float32 "
              "per device; rank 0, median of repeats):", "", "| operation | s |", "|---|---:|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in run["profile"].items()]
    lines += ["", _reduce_scatter_note(run)]
  return lines


def _reduce_scatter_note(run: dict) -> str:
  """The intra-node float32 reduce-scatter, measured alone, against the loopback probe."""
  prof = run["profile"]
  t = next((v for k, v in prof.items() if k.startswith("psum_scatter")), None)
  if t is None:
    return ""
  sent = run["summary"]["hier_compression"]["lo_tx_bytes"]
  t_sum = next((v for k, v in prof.items() if k.startswith("psum f32")), None)
  also = (f"; the float32 all-reduce (psum) of the same buffer over 'local', twice the bytes, "
          f"takes {t_sum:.3f} s" if t_sum is not None else "")
  return (f"Inside a node the float32 reduce-scatter alone takes {t:.3f} s "
          f"({_fmt_bytes(sent / 2)} per device would be its share of the bytes: "
          f"{sent / 2 / t / 1e6:.0f} MB/s), against "
          f"{run['local_bandwidth_Bps'] / 1e6:.0f} MB/s for one TCP stream on the same loopback "
          f"and {run['bandwidth_Bps'] / 1e6:.0f} MB/s between nodes{also}. Over gloo the "
          "optimizer therefore takes the all-reduce and a slice "
          "(onebit_optax._collective._fast_mean_slice).")


def _hier_summary_lines(run: dict, ratios: dict) -> list[str]:
  s = run["summary"]
  h, f, a = s["hier_compression"], s["onebit_compression"], s["adam"]
  lines = [
      f"- s/step: Adam {a['step_s']:.3f}, flat 1-bit {f['step_s']:.3f}, hierarchical 1-bit "
      f"{h['step_s']:.3f}: hierarchical/Adam **{ratios['hier_vs_adam']:.2f}x**, hierarchical/flat "
      f"**{ratios['hier_vs_flat']:.2f}x** throughput (flat/Adam {ratios['flat_vs_adam']:.2f}x).",
      f"- Bytes per device per step on the link between nodes (interface counters): hierarchical "
      f"{_fmt_bytes(h['tx_bytes'])} ({ratios['hier_link_bytes_measured_over_predicted']:.3f}x "
      f"`compressed_wire_bytes(padded/{run['ranks_per_node']}, {run['num_nodes']}, S)`), flat "
      f"{_fmt_bytes(f['tx_bytes'])} ({ratios['flat_over_hier_link_bytes']:.2f}x hierarchical), "
      f"Adam {_fmt_bytes(a['tx_bytes'])}; inside a node hierarchical moves "
      f"{_fmt_bytes(h['lo_tx_bytes'])} (float32 over 'local': over gloo an all-reduce and a "
      "slice, elsewhere a reduce-scatter).",
  ]
  if run.get("profile"):
    lines.append("- " + _reduce_scatter_note(run))
  return lines


def _hier_ratios(run: dict, pred: dict) -> dict:
  s = run["summary"]
  h = s["hier_compression"]
  return {"hier_vs_adam": s["adam"]["step_s"] / h["step_s"],
          "hier_vs_flat": s["onebit_compression"]["step_s"] / h["step_s"],
          "flat_vs_adam": s["adam"]["step_s"] / s["onebit_compression"]["step_s"],
          "hier_link_bytes_measured_over_predicted": h["tx_bytes"] / pred["hier_compression"],
          "flat_over_hier_link_bytes": s["onebit_compression"]["tx_bytes"] / h["tx_bytes"]}


def _write_hier(args, argv, run: dict, compute: dict, t0: float, start_load: str):
  pred = _hier_predicted(run["num_params"], compute["leaf_shapes"], run["num_ranks"],
                         run["num_nodes"])
  for mode in HIER_MODES:
    run["summary"][mode]["predicted_link_bytes"] = pred[mode]
  ratios = _hier_ratios(run, pred)
  summary = _hier_summary_lines(run, ratios)
  lines = (_hier_header(args, argv, run, t0, start_load) + _hier_tables(run, compute, pred)
           + ["", "## Summary", ""] + summary + [""])
  text = "\n".join(lines)
  print("\n" + text, flush=True)
  out_dir = Path(args.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  stem = args.name or "comm_throughput_hier"
  (out_dir / f"{stem}.md").write_text(text + "\n")
  (out_dir / f"{stem}_summary.md").write_text("\n".join([
      f"From `python benchmarks/comm_throughput.py {' '.join(_argv(argv))}` (commit "
      f"{_git_commit()}, {time.time() - t0:.0f} s, load {run['load']}; full tables in "
      f"`{stem}.md`): {run['num_nodes']} namespaces x {run['ranks_per_node']} ranks, "
      f"{args.rate} between namespaces, loopback inside, {run['num_params']:,} parameters.",
      ""] + summary) + "\n")
  (out_dir / f"{stem}.json").write_text(json.dumps(
      {"runs": [run], "compute": compute, "args": vars(args), "predicted_link_bytes": pred,
       "ratios": ratios, "command": "python benchmarks/comm_throughput.py " + " ".join(_argv(argv)),
       "commit": _git_commit(), "wall_s": time.time() - t0, "load_start": start_load,
       "load_end": _uptime()}, indent=1, default=str))
  print(f"wrote {out_dir / (stem + '.md')} and .json")

def _free_port() -> int:
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _loopback_bandwidth() -> dict:
  """Goodput and round trip over loopback, with the same probe as the namespaces."""
  port_probe = subprocess.Popen([sys.executable, str(WORKER), "tcp-server", str(200 * 2**20)],
                                stdout=subprocess.PIPE, text=True)
  try:
    time.sleep(0.5)
    client = subprocess.run([sys.executable, str(WORKER), "tcp-client", str(200 * 2**20),
                             "127.0.0.1"], capture_output=True, text=True, check=True)
    out, _ = port_probe.communicate(timeout=120)
  finally:
    if port_probe.poll() is None:
      port_probe.kill()
  return _netns.parse_probe(client.stdout + out)


_git_commit = _provenance.git_commit


if __name__ == "__main__":
  try:
    main()
  except KeyboardInterrupt as e:
    print(f"\ninterrupted ({e}); namespaces and ranks cleaned up.", file=sys.stderr)
    sys.exit(130)
