"""0/1 Adam's two variance EMAs at the default recipe: does ``variance_ema`` matter there?

``variance_ema='per_update'`` (DeepSpeed's: a variance step decays v by b2) and
``'per_step'`` (by b2 per step since the previous variance step) differ where the
variance steps are far apart: after a late shift of the data
(``benchmarks/data_shift.py``) the per-step EMA ended closer to AdamW. This runs
the default recipe of ``benchmarks/convergence.py`` (``var_freeze_step`` = twice
the LR warmup W, ``var_update_scaler=4``, no local steps, AdamW's selected lr 0.003)
with each EMA on the selection seeds of the char GPT and the BERT-style MLM, and
prints the paired difference (same seed, per_step over per_update) with its
standard error. The variance steps then fall within the first 2W steps, one to
four steps apart.

    .venv/bin/python benchmarks/zero_one_ema.py            # ~8 min on 2 cores
    .venv/bin/python benchmarks/zero_one_ema.py --tasks gpt --seeds 2

Writes ``benchmarks/results/zero_one_ema.md``.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _conv_runner  # noqa: E402
import _conv_tasks  # noqa: E402
import _provenance  # noqa: E402

EMAS = ("per_update", "per_step")
LR = 0.003  # AdamW's selected lr on both tasks (benchmarks/results/convergence.md)


def uptime() -> str:
  return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def run_task(name: str, seeds: int, mesh) -> dict:
  task = _conv_tasks.make_tasks([name])[0]
  runner = _conv_runner.Runner(task, mesh)
  out = {}
  for ema in EMAS:
    opts = dict(var_freeze_step=2 * task.warmup, var_update_scaler=4, variance_ema=ema)
    out[ema] = []
    for seed in range(seeds):
      out[ema].append(float(runner.run("zero_one", LR, seed, zero_one=opts)["final_val"]))
      print(f"{name} {ema} seed {seed}: {out[ema][-1]:.4f}", flush=True)
  return dict(task=task, vals=out)


def table(results: list) -> list[str]:
  rows = ["| task | steps | W | per_update val | per_step val | per_step vs per_update (paired) | s.e. | seeds |",
          "|---|---|---|---|---|---|---|---|"]
  for r in results:
    a, b = np.asarray(r["vals"]["per_update"]), np.asarray(r["vals"]["per_step"])
    d = 100.0 * (b - a) / a
    se = d.std(ddof=1) / np.sqrt(len(d)) if len(d) > 1 else float("nan")
    rows.append(f"| {r['task'].name} | {r['task'].steps} | {r['task'].warmup} | "
                f"{a.mean():.4f} ± {a.std(ddof=1) if len(a) > 1 else 0:.4f} | "
                f"{b.mean():.4f} ± {b.std(ddof=1) if len(b) > 1 else 0:.4f} | "
                f"{d.mean():+.2f}% ({', '.join(f'{x:+.2f}' for x in d)}) | {se:.2f}% | {len(d)} |")
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--tasks", default="gpt,mlm")
  p.add_argument("--seeds", type=int, default=3, help="selection seeds 0..N-1 (default 3)")
  p.add_argument("--out", default=os.path.join(HERE, "results", "zero_one_ema.md"))
  args = p.parse_args(argv)
  command = "python benchmarks/zero_one_ema.py" + " ".join([""] + (argv or sys.argv[1:]))
  mesh = jax.make_mesh((8,), (_conv_runner.AXIS,))
  start, wall = uptime(), time.time()
  results = [run_task(name, args.seeds, mesh) for name in args.tasks.split(",")]
  lines = [
      "# 0/1 Adam: `variance_ema` at the default recipe\n",
      f"Command: `{command}`; onebit_optax at {_provenance.git_commit()}, jax {jax.__version__}; "
      f"{os.cpu_count()} CPUs; {(time.time() - wall) / 60:.1f} min.  ",
      f"Load (`uptime`) at start: `{start}`; at end: `{uptime()}`.\n",
      "`zero_one_adam(var_freeze_step=2W, var_update_scaler=4)`, no local steps, peak lr "
      f"{LR:g}, the tasks of `benchmarks/convergence.py` (8 simulated devices), final "
      "validation loss (mean ± std over the seeds); paired: 100 x (per_step / per_update - 1), "
      "same seed.\n",
      *table(results), ""]
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
