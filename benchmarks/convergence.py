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
6. **0/1 Adam parameter study**, selection seeds, every task, at AdamW's
   learning rate: ``onebit_optax.zero_one_adam`` at the settings of
   ``ZERO_ONE_GRID`` (``var_freeze_step`` T_v in units of the task's LR warmup
   W; ``var_update_scaler`` kappa; ``local_steps`` H and ``local_step_scaler``).
   One setting is chosen for all tasks by ``choose_zero_one`` (the goals of
   issue 19: the most tasks with a paired mean within +0.5% of AdamW *and* at
   least 3x fewer bytes than 1-bit Adam, ties to the lower mean paired
   difference over the tasks): "0/1 Adam (defaults)".
7. **0/1 Adam sweep and evaluation**: the chosen setting at the other learning
   rates of AdamW's sweep (selection seeds; its best is 0/1 Adam's own lr),
   then on the evaluation seeds at AdamW's lr and at its own, paired with
   AdamW on the same seeds.

Every run has the same schedule (linear LR warmup over 5% of the run, cosine
decay to 10%), b1 = 0.9, b2 = 0.999 (optax's defaults), decoupled weight decay
0.1 on matrices. Communication is what one device sends over the run:
the state's ``wire_bytes`` summed over the steps, against AdamW's float32 ring
all-reduce (``allreduce_wire_bytes``).

Communication rounds: steps whose collective carries the model's size (every
AdamW step; every 1-bit Adam step; 0/1 Adam's variance, compressed and sync
steps, not its local steps), and of them the float32 ones. Not counted, for all
three alike: the one-scalar all-reduce of the agreed gradient clipping
(``onebit_optax.clip_by_global_norm``, gpt and mlm) on every step.

``--reuse PATH`` takes the AdamW runs (sweep and evaluation) of a task from an
earlier convergence.json when the task's configuration and seeds match and a
rerun of one of them (best lr, first selection seed) gives the stored final
loss (to its 6 stored digits) and bytes; the report names the file, its commit
and the check. 1-bit Adam is always rerun. ``--no-freeze-study`` skips steps 4
and 5 (the freeze-step study and the failing references),
``--onebit-at-adamw-lr`` and ``--zero-one-at-adamw-lr`` run 1-bit Adam, resp.
0/1 Adam, at AdamW's lr only (no own lr), and
``--name`` sets the output files' stem: the 0/1 Adam run of issue 19 is

    .venv/bin/python benchmarks/convergence.py --reuse benchmarks/results/convergence.json \
        --no-freeze-study --onebit-at-adamw-lr --zero-one-at-adamw-lr --name convergence_zero_one

Outputs (``--out``, default benchmarks/results): convergence.md (tables),
convergence_freeze.md (the freeze study alone), convergence_zero_one_summary.md
(the three optimizers and the 0/1 Adam study alone), convergence.json (every
run's curves), convergence.png; ``--quick`` writes ``convergence_quick*``.
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
# The 0/1 Adam parameter study: (label, options); var_freeze_step in units of the
# LR warmup W (an int multiple), the rest as zero_one_adam takes them.
ZERO_ONE_GRID = (
    ("T_v=W, kappa=1, no H", dict(var_freeze_step=1, var_update_scaler=1)),
    ("T_v=W, kappa=4, no H", dict(var_freeze_step=1, var_update_scaler=4)),
    ("T_v=W, kappa=1, H=2/32", dict(var_freeze_step=1, var_update_scaler=1, local_steps=2,
                                    local_step_scaler=32)),
    # (H=4/32 was the worst setting at f3cc16d, +12.7% mean over the tasks; T_v=2W replaces it.)
    ("T_v=2W, kappa=4, no H", dict(var_freeze_step=2, var_update_scaler=4)),
)
QUICK_ZERO_ONE_GRID = (ZERO_ONE_GRID[0], ZERO_ONE_GRID[2])  # no H and H
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


def planned_runs(task, seeds, eval_seeds, fractions, adamw=True, freeze_study=True,
                 onebit_sweep=True) -> int:
  """Runs of ``run_task`` before any sweep extension (``Progress.expect`` adds those).

  ``adamw=False``: AdamW's runs are reused (one check run); ``freeze_study=False``:
  no freeze-step study and no failing references; ``onebit_sweep=False``: 1-bit
  Adam at AdamW's lr only.
  """
  select, fresh = seed_sets(task, seeds, eval_seeds)
  fixed = len({max(1, int(round(f * task.steps))) for f in fractions})
  return ((len(task.lrs) if adamw else 0) * len(select)  # the AdamW sweep
          + (len(task.lrs) if onebit_sweep else 1) * len(select)  # the 1-bit Adam sweep
          + (2 if adamw else 1) * len(fresh)   # the evaluation, 1-bit at AdamW's lr
          + (0 if adamw else 1)                # the reproduction check of a reused AdamW
          + (fixed * len(select) + 2 if freeze_study else 0))  # freeze study, references


def planned_zero_one_runs(task, seeds, eval_seeds, grid, sweep=True) -> int:
  """Runs of ``zero_one_study`` and ``zero_one_final`` before any own-lr evaluation."""
  select, fresh = seed_sets(task, seeds, eval_seeds)
  return len(grid) * len(select) + (len(task.lrs) - 1) * len(select) * sweep + len(fresh)


def zero_one_options(options: dict, warmup: int) -> dict:
  """A grid entry's options for a task: var_freeze_step in steps (a multiple of W)."""
  return dict(options, var_freeze_step=options["var_freeze_step"] * warmup)


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


def task_config(task, runner, select, fresh) -> dict:
  """What a stored task must match to be reused (``--reuse``)."""
  return dict(name=task.name, title=task.title, steps=task.steps, warmup=task.warmup,
              chunk=task.chunk, batch=task.batch_per_device * runner.n, devices=runner.n,
              params=runner.size, weight_decay=task.weight_decay, b2=runner.b2,
              allreduce_bytes_per_step=runner.allreduce_bytes,
              selection_seeds=list(select), eval_seeds=list(fresh))


REPRODUCE_RTOL = 2e-5  # a stored final loss has 6 significant digits (convergence.json).


def _reusable(stored, config, task) -> bool:
  if stored is None or any(stored.get(k) != v for k, v in config.items()):
    return False
  return set(task.lrs) <= set(stored["adamw"])


def _reproduces(runner, stored, log) -> dict:
  """Reruns AdamW at the stored best lr on the first selection seed; compares with the stored run."""
  old = stored["adamw"][stored["best_lr"]][0]
  new = log(runner.run("adamw", stored["best_lr"], old["seed"]))
  rel = abs(new["final_val"] / old["final_val"] - 1)
  same_bytes = float(f"{new['total_bytes']:.6g}") == float(f"{old['total_bytes']:.6g}")  # as stored
  return dict(lr=stored["best_lr"], seed=old["seed"], stored=old["final_val"],
              rerun=new["final_val"], rel=rel, bytes_equal=same_bytes,
              ok=bool(rel <= REPRODUCE_RTOL and same_bytes))


def run_task(task, mesh, seeds, fractions, log, extensions=MAX_EXTENSIONS,
             eval_seeds=None, progress=None, reuse=None, freeze_study=True,
             onebit_sweep=True) -> dict:
  """The AdamW and 1-bit Adam protocol (steps 1-5) for one task; returns every record.

  ``reuse``: ``(task record, source)`` of an earlier run. When its
  configuration and seeds match this task's and one of its AdamW runs
  reproduces (``_reproduces``: within ``REPRODUCE_RTOL``, same bytes), its
  AdamW runs (sweep and evaluation) are taken as they are and ``task["reused"]``
  says from where; else they are made. 1-bit Adam is always run.
  ``freeze_study=False`` skips steps 4 and 5; ``onebit_sweep=False`` runs 1-bit
  Adam at AdamW's lr only (no own lr: ``own_lr`` is None).
  """
  select, fresh = seed_sets(task, seeds, eval_seeds)
  runner = _conv_runner.Runner(task, mesh)
  if progress is not None:
    progress.task(task.name)
    runner.on_steps = progress.update
  config = task_config(task, runner, select, fresh)
  wall0 = time.time()
  out = dict(config)
  stored = reuse[0] if reuse is not None and _reusable(reuse[0], config, task) else None
  if reuse is not None and stored is None:
    tqdm.write(f"  {task.name}: not reusable from {reuse[1]} (configuration differs): running")
    if progress is not None:  # the AdamW runs, less the check that is not made
      progress.expect(len(task.lrs) * len(select) + len(fresh) - 1, task.steps)
  if stored is not None:
    check = _reproduces(runner, stored, log)
    out["reproduction"] = check
    tqdm.write(f"  {task.name}: AdamW lr {check['lr']:g} seed {check['seed']}: rerun "
               f"{check['rerun']:.6g}, stored {check['stored']:.6g} (rel. {check['rel']:.1e}, "
               f"bytes {'equal' if check['bytes_equal'] else 'differ'}): "
               + ("reused" if check["ok"] else "not reproduced: running"))
    if not check["ok"]:
      stored = None
      if progress is not None:  # the full AdamW runs after all
        progress.expect(len(task.lrs) * len(select) + len(fresh), task.steps)
  if stored is not None:
    adamw, best_lr = dict(sorted(stored["adamw"].items())), stored["best_lr"]
    extra = len(adamw) - len(task.lrs)
    if progress is not None and extra and onebit_sweep:
      progress.expect(extra * len(select), task.steps)  # 1-bit Adam at the added lrs
    out["reused"] = reuse[1]
  else:
    adamw, best_lr = _sweep_adamw(runner, task, select, log, extensions, progress)
  onebit = {lr: [log(runner.run("onebit", lr, s)) for s in select]
            for lr in (adamw if onebit_sweep else [best_lr])}
  own_lr = min(onebit, key=lambda lr: _mean_final(onebit[lr])) if onebit_sweep else None
  if not onebit_sweep:
    final = {"adamw": (stored["eval"]["adamw"] if stored is not None else
                       [log(runner.run("adamw", best_lr, s)) for s in fresh]),
             "onebit": [log(runner.run("onebit", best_lr, s)) for s in fresh]}
  elif stored is not None:
    final = {"adamw": stored["eval"]["adamw"],
             "onebit": [log(runner.run("onebit", best_lr, s)) for s in fresh]}
    if own_lr != best_lr and progress is not None:
      progress.expect(len(fresh), task.steps)
    final["onebit_own"] = (final["onebit"] if own_lr == best_lr
                           else [log(runner.run("onebit", own_lr, s)) for s in fresh])
  else:
    final = _evaluate(runner, best_lr, own_lr, fresh, log, progress)
  out.update(best_lr=best_lr, own_lr=own_lr, adamw=adamw, onebit=onebit, eval=final)
  if freeze_study:
    fixed = _freeze_study(runner, task, best_lr, select, fractions, log)
    fired = [r["freeze_step"] for r in onebit[best_lr] if r["freeze_step"]]
    ref_step = int(np.median(fired)) if fired else int(round(0.15 * task.steps))
    references = {kind: log(runner.run(kind, best_lr, select[0], freeze_at=ref_step))
                  for kind in ("naive", "no_feedback")}
    out.update(fixed=fixed, reference_step=ref_step, references=references)
  out["wall_s"] = time.time() - wall0
  return out


def zero_one_study(runner, result, grid, log) -> dict:
  """Step 6 for one task: every grid setting at AdamW's lr on the selection seeds."""
  out = {}
  for label, options in grid:
    opts = zero_one_options(options, result["warmup"])
    out[label] = [log(runner.run("zero_one", result["best_lr"], s, zero_one=opts))
                  for s in result["selection_seeds"]]
  return out


def choose_zero_one(results, grid) -> str:
  """One setting for every task: the goals of issue 19, counted over the tasks.

  Per task and setting (selection seeds, AdamW's lr): *ok* when the paired
  mean vs AdamW is <= +0.5% and 1-bit Adam's mean bytes (its default rule, same
  lr and seeds) are >= 3x this setting's. The setting with the most ok tasks
  wins; a tie goes to the lower mean over the tasks of the paired mean, then
  to the grid's order.
  """
  def score(item):
    index, (label, _) = item
    oks, gaps = 0, []
    for task in results:
      row = _conv_report.zero_one_study_row(task, label)
      oks += row["ok"]
      gaps.append(row["gap"])
    return (-oks, float(np.mean(gaps)), index)
  return min(enumerate(grid), key=score)[1][0]


def zero_one_final(runner, result, chosen, options, log, progress=None, sweep=True) -> None:
  """Step 7 for one task: the chosen setting's sweep and evaluation (adds to ``result``).

  ``sweep=False``: at AdamW's lr only (no own lr: ``zero_one_own_lr`` is None).
  """
  opts = zero_one_options(options, result["warmup"])
  best = result["best_lr"]
  lrs = result["adamw"] if sweep else [best]
  runs = {lr: (result["zero_one_study"][chosen] if lr == best else
               [log(runner.run("zero_one", lr, s, zero_one=opts))
                for s in result["selection_seeds"]])
          for lr in lrs}
  extra = len(result["adamw"]) - len(runner.task.lrs)  # lrs added by the AdamW sweep
  if progress is not None and extra and sweep:
    progress.expect(extra * len(result["selection_seeds"]), runner.task.steps)
  own = min(runs, key=lambda lr: _mean_final(runs[lr])) if sweep else None
  fresh = result["eval_seeds"]
  ev = {"zero_one": [log(runner.run("zero_one", best, s, zero_one=opts)) for s in fresh]}
  if own is not None and own != best and progress is not None:
    progress.expect(len(fresh), runner.task.steps)
  if own is not None:
    ev["zero_one_own"] = (ev["zero_one"] if own == best else
                          [log(runner.run("zero_one", own, s, zero_one=opts)) for s in fresh])
  sweep = runs
  result.update(zero_one=sweep, zero_one_own_lr=own, zero_one_chosen=chosen,
                zero_one_options=opts)
  result["eval"].update(ev)


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
  parser.add_argument("--reuse", default=None,
                      help="take the AdamW and 1-bit Adam runs of a task from this "
                      "convergence.json when its configuration and seeds match.")
  parser.add_argument("--no-freeze-study", action="store_true",
                      help="skip the freeze-step study and the failing references (steps 4, 5).")
  parser.add_argument("--onebit-at-adamw-lr", action="store_true",
                      help="1-bit Adam at AdamW's selected lr only (no sweep for its own lr).")
  parser.add_argument("--zero-one-at-adamw-lr", action="store_true",
                      help="0/1 Adam at AdamW's selected lr only (no sweep for its own lr).")
  parser.add_argument("--name", default=None,
                      help="the output files' stem (default convergence, or convergence_quick).")
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
  grid = QUICK_ZERO_ONE_GRID if args.quick else ZERO_ONE_GRID
  freeze_study = not args.no_freeze_study
  onebit_sweep = not args.onebit_at_adamw_lr
  progress = Progress(sum((planned_runs(t, seeds, eval_seeds, fractions, not args.reuse,
                                        freeze_study, onebit_sweep)
                           + planned_zero_one_runs(t, seeds, eval_seeds, grid,
                                                   not args.zero_one_at_adamw_lr)) * t.steps
                          for t in tasks), enabled=not args.no_progress)
  reuse = {}
  if args.reuse:
    stored, stored_meta = _conv_report.load_json(args.reuse)
    source = f"{os.path.relpath(os.path.abspath(args.reuse), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))} (run at {stored_meta['git']}, {stored_meta['started']})"
    reuse = {t["name"]: (t, source) for t in stored}

  def log(rec):
    fz = f" freeze {rec['freeze_step']}" if rec["freeze_step"] else ""
    tqdm.write(f"  {rec['kind']:11s} lr {rec['lr']:.0e} seed {rec['seed']}: val "
               f"{rec['final_val']:.4f}{fz}  {rec['total_bytes'] / 1e6:8.1f} MB  "
               f"{rec['wall_s']:5.1f}s  (t+{(time.time() - wall0) / 60:.1f} min)")
    return rec

  results, runners = [], []
  for task in tasks:
    tqdm.write(f"{task.name}: {task.title}, {task.steps} steps")
    results.append(run_task(task, mesh, seeds, fractions, log, extensions=extensions,
                            eval_seeds=eval_seeds, progress=progress,
                            reuse=reuse.get(task.name, (None, args.reuse)) if args.reuse else None,
                            freeze_study=freeze_study, onebit_sweep=onebit_sweep))
  # 0/1 Adam: the study on every task first, one setting chosen for all, then its runs.
  for task, result in zip(tasks, results):
    tqdm.write(f"{task.name}: 0/1 Adam parameter study at lr {result['best_lr']:g}")
    runner = _conv_runner.Runner(task, mesh)
    runner.on_steps = progress.update
    progress.task(task.name)
    wall = time.time()
    result["zero_one_study"] = zero_one_study(runner, result, grid, log)
    result["zero_one_wall_s"] = time.time() - wall
    runners.append(runner)
  chosen = choose_zero_one(results, grid)
  tqdm.write(f"0/1 Adam (defaults): {chosen}")
  stem = os.path.join(args.out, args.name or ("convergence_quick" if args.quick
                                              else "convergence"))
  os.makedirs(args.out, exist_ok=True)
  _conv_report.write_json(stem + "_study", results, dict(meta, chosen=chosen))  # a checkpoint
  for runner, result in zip(runners, results):
    progress.task(result["name"])
    wall = time.time()
    zero_one_final(runner, result, chosen, dict(grid)[chosen], log, progress,
                   sweep=not args.zero_one_at_adamw_lr)
    result["zero_one_wall_s"] += time.time() - wall
    result["zero_one_grid"] = [[label, opts] for label, opts in grid]
  progress.close()
  meta = _conv_report.finish_meta(meta, wall0)
  os.makedirs(args.out, exist_ok=True)
  stem = os.path.join(args.out, args.name or ("convergence_quick" if args.quick
                                              else "convergence"))
  _conv_report.write_json(stem, results, meta)
  if os.path.exists(stem + "_study.json"):
    os.remove(stem + "_study.json")  # the checkpoint, now in the full json
  md = _conv_report.write(stem, results, meta)
  print()
  print(md)
  print(f"\nwrote {stem}.md, .json, .png  (total {meta['wall_s'] / 60:.1f} min)")


if __name__ == "__main__":
  main()
