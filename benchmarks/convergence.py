"""Convergence of 1-bit Adam against a tuned AdamW, over tasks, learning rates and seeds.

    .venv/bin/python benchmarks/convergence.py            # the full protocol (~35 min on 2 cores)
    .venv/bin/python benchmarks/convergence.py --quick    # a smoke run (a few minutes)

A progress bar counts the training steps of every run of the protocol and
shows the time left (``--no-progress`` turns it off; each finished run is still
printed on its own line).

The protocol, for every task of ``_conv_tasks.py`` (a char GPT and a BERT-style
masked LM on CPython's ``pydoc_data.topics`` prose, an MLP on scikit-learn's
digits), data-parallel on 8 simulated CPU devices (``_conv_runner.py``). The
learning rates are *chosen* on selection seeds (0, 1, ...) and the final
comparison runs on fresh evaluation seeds (1000, 1001, ...): a learning rate
picked as the best on some seeds looks better on those seeds than it is (a
selection effect, benchmarks/results/digits_gap.md), so it is judged on others.

1. **AdamW sweep**, selection seeds: optax.adamw at the task's learning rates
   (factor 3 apart; one more is added at an edge while the best is there). The
   best mean final validation loss picks AdamW's learning rate.
2. **1-bit Adam sweep**, selection seeds: ``onebit_optax.onebit_adam`` (the
   *default* freeze rule, ``min_steps`` = the LR warmup) at every learning rate
   of the same sweep; its best picks 1-bit Adam's own learning rate.
3. **Evaluation**, fresh seeds: AdamW at its learning rate, 1-bit Adam at
   AdamW's learning rate and at its own, same seeds (paired).
4. **Freeze-step study**, selection seeds: 1-bit Adam with
   ``fixed_step_freeze(t)`` for t at 5%, 10%, 15% and 25% of the run, at AdamW's
   learning rate. The variance-ratio rule is also replayed offline on AdamW's
   ``||v_hat_t||_1`` trajectory (1-bit Adam's warmup is Adam on the mean
   gradient: the same trajectory) for a grid of intervals and thresholds.
5. **Failing references**, the first selection seed: naive 1-bit Adam (the
   compressed *gradient* fed to AdamW) and 1-bit Adam without error feedback,
   with the same freeze step as the default rule.

Every run has the same schedule (linear LR warmup over 5% of the run, cosine
decay to 10%), b1 = 0.9, b2 = 0.999 (optax's defaults), decoupled weight decay
0.1 on matrices. Communication is what one device sends over the run:
``onebit_optax.wire_bytes`` summed over the steps, against AdamW's float32 ring
all-reduce (``allreduce_wire_bytes``).

Outputs (``--out``, default benchmarks/results): convergence.md (tables),
convergence_freeze.md (the freeze study alone), convergence.json (every run's
curves), convergence.png; ``--quick`` writes ``convergence_quick*``.
``--from-json benchmarks/results/convergence.json`` re-renders the tables and
the plot without training. The docs build turns convergence.md into its
Results page and convergence_freeze.md into the freeze guide's table;
``python benchmarks/update_readme.py`` writes the README's summary rows.
Only the public API of onebit_optax is used.
"""

from __future__ import annotations

import os

# Eight simulated CPU devices; must happen before jax is imported.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # pylint: disable=g-import-not-at-top,g-bad-import-order
import sys
import time

import jax
import numpy as np
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _conv_report  # pylint: disable=g-import-not-at-top
import _conv_runner
import _conv_tasks

FREEZE_FRACTIONS = (0.05, 0.10, 0.15, 0.25)
MAX_EXTENSIONS = 2  # learning rates added to the AdamW sweep when its best is at an edge.
EVAL_SEED_OFFSET = 1000  # evaluation seeds: disjoint from the selection seeds 0, 1, ...


def _mean_final(recs) -> float:
  return float(np.mean([r["final_val"] for r in recs]))


class Progress:
  """One tqdm bar over the training steps of every run, with the time left.

  The plan is counted up front (``planned_runs``); a sweep that extends at an
  edge, or a 1-bit learning rate other than AdamW's, adds its runs when it
  happens (``expect``), so the estimate only grows when the work does.
  """

  def __init__(self, total_steps: int, enabled: bool = True):
    self.total, self.done = total_steps, 0  # counted here too: a disabled bar counts nothing
    self.bar = tqdm(total=total_steps, unit="step", disable=not enabled, smoothing=0.1,
                    bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} steps "
                               "[{elapsed} elapsed, {remaining} left]")

  def update(self, steps: int) -> None:
    self.done += steps
    self.bar.update(steps)

  def expect(self, runs: int, steps: int) -> None:
    self.total += runs * steps
    self.bar.total = self.total
    self.bar.refresh()

  def task(self, name: str) -> None:
    self.bar.set_description(name)

  def close(self) -> None:
    self.bar.close()


def planned_runs(task, seeds, eval_seeds, fractions) -> int:
  """Runs of ``run_task`` before any sweep extension (``Progress.expect`` adds those)."""
  select, fresh = seed_sets(task, seeds, eval_seeds)
  fixed = len({max(1, int(round(f * task.steps))) for f in fractions})
  return (2 * len(task.lrs) * len(select)  # the AdamW and the 1-bit Adam sweeps
          + 2 * len(fresh)                 # the evaluation, 1-bit at AdamW's lr
          + fixed * len(select)            # the freeze-step study
          + 2)                             # the failing references


def _sweep_adamw(runner, task, seeds, log, extensions=MAX_EXTENSIONS, progress=None):
  """AdamW at every learning rate; extends the sweep by x3 at an edge that wins."""
  runs = {}
  lrs = sorted(task.lrs)
  for _ in range(extensions + 1):
    for lr in lrs:
      if lr not in runs:
        runs[lr] = [log(runner.run("adamw", lr, s)) for s in seeds]
    best = min(runs, key=lambda lr: _mean_final(runs[lr]))
    if best == min(runs):
      lrs = [best / 3]
    elif best == max(runs):
      lrs = [best * 3]
    else:
      break
    if progress is not None and len(runs) < len(task.lrs) + extensions:
      progress.expect(2 * len(seeds), task.steps)  # AdamW and 1-bit Adam at the new lr
  return dict(sorted(runs.items())), best


def seed_sets(task, seeds=None, eval_seeds=None) -> tuple[tuple, tuple]:
  """(selection seeds, evaluation seeds): disjoint."""
  n_eval = eval_seeds or task.eval_seeds
  return (tuple(range(seeds or task.seeds)),
          tuple(range(EVAL_SEED_OFFSET, EVAL_SEED_OFFSET + n_eval)))


def _evaluate(runner, best_lr, own_lr, seeds, log, progress=None) -> dict:
  """The final comparison on fresh seeds: AdamW and 1-bit Adam at AdamW's lr, 1-bit at its own."""
  out = {kind: [log(runner.run(kind, best_lr, s)) for s in seeds] for kind in ("adamw", "onebit")}
  if own_lr != best_lr and progress is not None:
    progress.expect(len(seeds), runner.task.steps)
  out["onebit_own"] = (out["onebit"] if own_lr == best_lr
                       else [log(runner.run("onebit", own_lr, s)) for s in seeds])
  return out


def _freeze_study(runner, task, best_lr, seeds, fractions, log) -> dict:
  steps = sorted({max(1, int(round(f * task.steps))) for f in fractions})
  return {t: [log(runner.run("fixed", best_lr, s, freeze_at=t)) for s in seeds] for t in steps}


def run_task(task, mesh, seeds, fractions, log, extensions=MAX_EXTENSIONS,
             eval_seeds=None, progress=None) -> dict:
  """The whole protocol for one task; returns every record."""
  select, fresh = seed_sets(task, seeds, eval_seeds)
  runner = _conv_runner.Runner(task, mesh)
  if progress is not None:
    progress.task(task.name)
    runner.on_steps = progress.update
  wall0 = time.time()
  adamw, best_lr = _sweep_adamw(runner, task, select, log, extensions, progress)
  onebit = {lr: [log(runner.run("onebit", lr, s)) for s in select] for lr in adamw}
  own_lr = min(onebit, key=lambda lr: _mean_final(onebit[lr]))
  final = _evaluate(runner, best_lr, own_lr, fresh, log, progress)
  fixed = _freeze_study(runner, task, best_lr, select, fractions, log)
  fired = [r["freeze_step"] for r in onebit[best_lr] if r["freeze_step"]]
  ref_step = int(np.median(fired)) if fired else int(round(0.15 * task.steps))
  references = {kind: log(runner.run(kind, best_lr, select[0], freeze_at=ref_step))
                for kind in ("naive", "no_feedback")}
  return dict(name=task.name, title=task.title, steps=task.steps, warmup=task.warmup,
              chunk=task.chunk, batch=task.batch_per_device * runner.n, devices=runner.n,
              params=runner.size, weight_decay=task.weight_decay, b2=runner.b2,
              allreduce_bytes_per_step=runner.allreduce_bytes, best_lr=best_lr, own_lr=own_lr,
              selection_seeds=list(select), eval_seeds=list(fresh),
              adamw=adamw, onebit=onebit, eval=final, fixed=fixed, reference_step=ref_step,
              references=references, wall_s=time.time() - wall0)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help="1 selection and 2 evaluation seeds, short runs, one fixed freeze "
                      "step: a smoke run.")
  parser.add_argument("--tasks", default=None, help="comma-separated subset (gpt,mlm,digits).")
  parser.add_argument("--seeds", type=int, default=None,
                      help="selection seeds (default: the task's, 3 or more).")
  parser.add_argument("--eval-seeds", type=int, default=None,
                      help="evaluation seeds (default: the task's, 4 or more).")
  parser.add_argument("--from-json", default=None,
                      help="only re-render the tables and the plot from a convergence.json.")
  parser.add_argument("--no-progress", action="store_true",
                      help="no progress bar (e.g. when the output goes to a log file).")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                    "results"))
  args = parser.parse_args(argv)
  if args.from_json:
    results, meta = _conv_report.load_json(args.from_json)
    _conv_report.write(os.path.splitext(args.from_json)[0], results, meta)
    return
  command = "python benchmarks/convergence.py" + " ".join([""] + (argv or sys.argv[1:]))
  n = len(jax.devices())
  assert n == 8, f"expected 8 simulated devices, got {n}: import jax only after XLA_FLAGS is set"
  mesh = jax.make_mesh((n,), (_conv_runner.AXIS,))
  seeds = args.seeds or (1 if args.quick else None)
  eval_seeds = args.eval_seeds or (2 if args.quick else None)
  fractions = (0.10,) if args.quick else FREEZE_FRACTIONS
  tasks = _conv_tasks.make_tasks(args.tasks.split(",") if args.tasks else None, quick=args.quick)
  meta = _conv_report.machine_meta(command, quick=args.quick)
  wall0 = time.time()

  extensions = 0 if args.quick else MAX_EXTENSIONS
  progress = Progress(sum(planned_runs(t, seeds, eval_seeds, fractions) * t.steps
                          for t in tasks), enabled=not args.no_progress)

  def log(rec):
    fz = f" freeze {rec['freeze_step']}" if rec["freeze_step"] else ""
    tqdm.write(f"  {rec['kind']:11s} lr {rec['lr']:.0e} seed {rec['seed']}: val "
               f"{rec['final_val']:.4f}{fz}  {rec['total_bytes'] / 1e6:8.1f} MB  "
               f"{rec['wall_s']:5.1f}s  (t+{(time.time() - wall0) / 60:.1f} min)")
    return rec

  results = []
  for task in tasks:
    tqdm.write(f"{task.name}: {task.title}, {task.steps} steps")
    results.append(run_task(task, mesh, seeds, fractions, log, extensions=extensions,
                            eval_seeds=eval_seeds, progress=progress))
  progress.close()
  meta = _conv_report.finish_meta(meta, wall0)
  os.makedirs(args.out, exist_ok=True)
  stem = os.path.join(args.out, "convergence_quick" if args.quick else "convergence")
  _conv_report.write_json(stem, results, meta)
  md = _conv_report.write(stem, results, meta)
  print()
  print(md)
  print(f"\nwrote {stem}.md, .json, .png  (total {meta['wall_s'] / 60:.1f} min)")


if __name__ == "__main__":
  main()
