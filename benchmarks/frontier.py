"""Bytes against loss: AdamW, 1-bit Adam, 0/1 Adam and DiLoCo on the same tasks, seeds and devices.

    .venv/bin/python benchmarks/frontier.py                    # both tasks, the whole protocol
    .venv/bin/python benchmarks/frontier.py --diloco-select gpt=1   # as run: GPT's outer lr on 1 seed
    .venv/bin/python benchmarks/frontier.py --tasks mlm        # one task (runs already in the json are kept)
    .venv/bin/python benchmarks/frontier.py --report-only      # tables, figure, README excerpt

Not a test: about 2.5 hours on 2 cores (a 2000-step GPT run takes 100 s); the runs are appended to
benchmarks/results/frontier.json as they finish (an interrupted invocation
resumes where it stopped) and a progress bar shows the steps left.

The contestants, data-parallel on 8 simulated CPU devices with the convergence
benchmark's tasks, data sharding, schedule (linear warmup over 5% of the run,
cosine decay to 10%) and runner (benchmarks/_conv_runner.py):

* AdamW on the float32 ``pmean`` of the gradients (one all-reduce per step);
* 1-bit Adam, ``onebit_adam`` with its defaults (the variance-ratio freeze, never
  before the LR warmup has ended);
* 0/1 Adam, ``zero_one_adam`` with ``var_freeze_step`` = 2 W and
  ``var_update_scaler`` 4 (the setting the convergence benchmark reports), and the
  same with local steps (``local_steps`` 8, ``local_step_scaler`` 32);
* DiLoCo (Douillard et al., arXiv 2311.08105; benchmarks/_diloco.py): H inner
  AdamW steps per device, then the paper's outer SGD (Nesterov momentum 0.9) on
  the float32 mean pseudo-gradient, for H in ``H_GRID``.

Protocol, as in benchmarks/convergence.py: AdamW's peak learning rate is chosen
on *selection* seeds over the task's grid; every other contestant uses it (the
package's optimizers at their defaults; DiLoCo as its inner rate), and DiLoCo's
outer rate is chosen per H on the same selection seeds, from ``OUTER_LRS`` (the
paper's 0.7 and below), halved while the smallest tried is the best, and 1.0
tried when 0.7 is. A grid's best at an edge is extended (AdamW's by 3x,
DiLoCo's outer rate by halving), twice at most. The comparison runs on fresh
*evaluation* seeds (1000, 1001, ...), disjoint from them; the report gives the
same-seed (paired) difference to AdamW and its
standard error. Per run: the final validation loss (the whole held-out set),
the bytes one device sent (the optimizers' ``wire_bytes``, summed) and the
communication rounds (steps that sent anything).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _conv_report  # pylint: disable=g-import-not-at-top,wrong-import-position
import _conv_tasks
import _frontier_runner

RESULTS = HERE / "results"
TASK_STEPS = {"gpt": 2000, "mlm": 600}
H_GRID = {"gpt": (4, 16, 64, 256), "mlm": (4, 16, 64)}
OUTER_LRS = (0.4, 0.7)  # then halved while the smallest is best (MAX_EXTENSIONS times at most)
OUTER_MAX = 1.0  # tried when the largest of OUTER_LRS is best (SGD with Nesterov momentum 0.9)
MAX_EXTENSIONS = 2
ZERO_ONE = dict(var_freeze_step=2, var_update_scaler=4)  # var_freeze_step in units of W
ZERO_ONE_LOCAL = dict(ZERO_ONE, local_steps=8, local_step_scaler=32)
EVAL_SEED_OFFSET = 1000
KEEP = ("kind", "lr", "seed", "final_val", "total_bytes", "wall_s", "val", "eval_steps", "wire",
        "zero_one", "diloco", "freeze_step")


def contestants(task) -> list[tuple[str, str, dict | None]]:
  """(label, runner kind, options) of every contestant but AdamW; DiLoCo's ``outer_lr`` is chosen later."""
  zero_one = lambda o: dict(o, var_freeze_step=o["var_freeze_step"] * task.warmup)
  out = [("1-bit Adam", "onebit", None), ("0/1 Adam", "zero_one", zero_one(ZERO_ONE)),
         ("0/1 Adam, local steps", "zero_one", zero_one(ZERO_ONE_LOCAL))]
  return out + [(f"DiLoCo H={h}", "diloco", dict(inner_steps=h)) for h in H_GRID[task.name]]


class Store:
  """The runs in benchmarks/results/frontier.json, keyed by what they ran; saved after each."""

  def __init__(self, path: Path):
    self.path = path
    self.doc = json.loads(path.read_text()) if path.exists() else {"runs": [], "invocations": []}

  @staticmethod
  def key(task, label, lr, options, seed) -> str:
    return json.dumps([task, label, lr, options, seed], sort_keys=True)

  def get(self, key):
    return next((r for r in self.doc["runs"] if r["key"] == key), None)

  def supersede(self, task, label, lr, options) -> None:
    """Moves ``label``'s evaluation runs of another setting (an earlier choice) to ``superseded``."""
    self._move([r for r in self.doc["runs"] if r["task"] == task and r["label"] == label
                and r["phase"] == "eval" and (r["lr"], r["options"]) != (lr, options)])

  def rerun(self, labels, commit: str) -> None:
    """Moves the evaluation runs of ``labels`` to ``superseded``: their code changed at ``commit``."""
    old = [r for r in self.doc["runs"] if r["label"] in labels and r["phase"] == "eval"]
    for r in old:
      r["reason"] = f"rerun at {commit}: the code changed"
    self._move(old)

  def _move(self, old: list) -> None:
    if old:
      self.doc.setdefault("superseded", []).extend(old)
      self.doc["runs"] = [r for r in self.doc["runs"] if not any(r is o for o in old)]
      self.save()

  def add(self, rec: dict) -> None:
    self.doc["runs"].append(rec)
    self.save()

  def save(self) -> None:
    self.path.write_text(json.dumps(_conv_report._clean(self.doc)))


class Protocol:
  """Runs (or finds in the store) every run of one task, with one progress bar."""

  def __init__(self, runner, store: Store, bar, select, fresh, diloco_seeds=None):
    self.runner, self.store, self.bar = runner, store, bar
    self.select, self.fresh, self.diloco_seeds = select, fresh, diloco_seeds

  def run(self, label, kind, lr, seed, options=None, phase="eval") -> dict:
    task = self.runner.task
    key = Store.key(task.name, label, lr, options, seed)
    rec = self.store.get(key)
    if rec is None:
      out = self.runner.run(kind, lr, seed, zero_one=options)
      rec = {k: out[k] for k in KEEP if k in out}
      rec.update(key=key, task=task.name, label=label, phase=phase, options=options,
                 rounds=int(np.count_nonzero(out["wire"])))
      self.store.add(rec)
      tqdm.write(f"  {task.name} {label} lr={lr} {options or ''} seed {seed}: "
                 f"val {rec['final_val']:.4f}, {rec['total_bytes'] / 1e6:.1f} MB, "
                 f"{rec['rounds']} rounds, {rec['wall_s']:.0f} s")
    self.bar.update(task.steps)
    return rec

  def _score(self, label, kind, lr, options, seeds=None) -> float:
    """Mean final loss on the selection seeds (``seeds``: the first few of them)."""
    return float(np.mean([self.run(label, kind, lr, s, options, "select")["final_val"]
                          for s in self.select[:seeds]]))

  def best_lr(self) -> float:
    """AdamW's peak learning rate over the task's grid, extended by 3x at an edge (twice at most)."""
    lrs = list(self.runner.task.lrs)
    scores = {lr: self._score("AdamW", "adamw", lr, None) for lr in lrs}
    for _ in range(MAX_EXTENSIONS):
      best = min(scores, key=scores.get)
      if best not in (min(scores), max(scores)):
        break
      new = best / 3 if best == min(scores) else best * 3
      self._expect(1)
      scores[new] = self._score("AdamW", "adamw", new, None)
    return min(scores, key=scores.get)

  def best_outer(self, label, lr, options) -> dict:
    """DiLoCo's outer lr: ``OUTER_LRS``, halved while the best is the smallest (twice at most),
    or ``OUTER_MAX`` tried when the best is the largest."""
    seeds = self.diloco_seeds
    score = lambda o: self._score(label, "diloco", lr, dict(options, outer_lr=o), seeds)
    scores = {o: score(o) for o in OUTER_LRS}
    for _ in range(MAX_EXTENSIONS):
      best = min(scores, key=scores.get)
      if best == max(scores) and best < OUTER_MAX:
        new = OUTER_MAX
      elif best == min(scores):
        new = round(best / 2, 6)
      else:
        break
      self._expect(1, seeds)
      scores[new] = score(new)
    return dict(options, outer_lr=min(scores, key=scores.get))

  def _expect(self, settings: int, seeds=None) -> None:
    self.bar.total += settings * len(self.select[:seeds]) * self.runner.task.steps
    self.bar.refresh()

  def all(self) -> None:
    lr = self.best_lr()
    plan = [("AdamW", "adamw", None)]
    for label, kind, options in contestants(self.runner.task):
      if kind == "diloco":
        options = self.best_outer(label, lr, options)
      plan.append((label, kind, options))
    for label, kind, options in plan:
      self.store.supersede(self.runner.task.name, label, lr, options)
      for seed in self.fresh:
        self.run(label, kind, lr, seed, options)


def planned_steps(task, select: int, fresh: int, diloco_select: int) -> int:
  """Training steps of the whole protocol of ``task`` (found runs included: the bar counts them)."""
  diloco = sum(kind == "diloco" for _, kind, _ in contestants(task))
  runs = len(task.lrs) * select + diloco * len(OUTER_LRS) * diloco_select
  runs += (1 + len(contestants(task))) * fresh
  return runs * task.steps


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--tasks", nargs="+", default=["mlm", "gpt"], choices=sorted(TASK_STEPS))
  p.add_argument("--select-seeds", type=int, default=2, help="selection seeds 0..N-1")
  p.add_argument("--eval-seeds", type=int, default=3, help="evaluation seeds 1000..")
  p.add_argument("--diloco-select", nargs="*", default=[], metavar="TASK=SEEDS",
                 help="DiLoCo's outer lr chosen on the first SEEDS selection seeds of TASK "
                 "(default: all of them), e.g. gpt=1")
  p.add_argument("--rerun", nargs="+", default=[], metavar="LABEL",
                 help="first move these contestants' evaluation runs (e.g. '0/1 Adam') to "
                 "`superseded`, marked with the commit, so that they run again on today's code")
  p.add_argument("--out", default=str(RESULTS / "frontier.json"))
  p.add_argument("--report-only", action="store_true")
  p.add_argument("--time", action="store_true",
                 help="only measure each evaluated contestant's compute per step (1 device)")
  p.add_argument("--time-repeats", type=int, default=2)
  p.add_argument("--no-progress", action="store_true")
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  store = Store(Path(args.out))
  if args.time:
    measure_compute(args, store)
  elif not args.report_only:
    if args.rerun:
      store.rerun(args.rerun, _conv_report._git_describe())
    train(args, store)
  import _frontier_report  # pylint: disable=g-import-not-at-top
  _frontier_report.write(store.doc, Path(args.out).with_suffix(""))


def train(args, store: Store) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_num_cpu_devices", 8)
  mesh = jax.make_mesh((8,), (_frontier_runner.AXIS,))
  tasks = [_conv_tasks.make_tasks([name], steps=TASK_STEPS[name])[0] for name in args.tasks]
  select = tuple(range(args.select_seeds))
  fresh = tuple(range(EVAL_SEED_OFFSET, EVAL_SEED_OFFSET + args.eval_seeds))
  diloco_seeds = {k: int(v) for k, v in (a.split("=") for a in args.diloco_select)}
  total = sum(planned_steps(t, len(select), len(fresh), diloco_seeds.get(t.name, len(select)))
              for t in tasks)
  meta = _conv_report.machine_meta(" ".join(["python benchmarks/frontier.py", *sys.argv[1:]]),
                                   quick=False)
  wall0 = time.time()
  with tqdm(total=total, unit="step", disable=args.no_progress, smoothing=0.05) as bar:
    for task in tasks:
      bar.set_description(task.name)
      runner = _frontier_runner.FrontierRunner(task, mesh)
      Protocol(runner, store, bar, select, fresh, diloco_seeds.get(task.name)).all()
  store.doc["invocations"].append(_conv_report.finish_meta(meta, wall0))
  store.save()


def measure_compute(args, store: Store) -> None:
  """Each evaluated contestant's compute per step on one device, whole runs interleaved.

  One device, the per-device batch of the 8-device runs, no communication at
  all: the alpha-beta model adds that (benchmarks/_frontier_time.py). The
  contestants take turns, ``--time-repeats`` times, and each chunk keeps its
  fastest repeat, so a change in the machine's load falls on all of them.
  """
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_num_cpu_devices", 8)
  mesh = jax.make_mesh((1,), (_frontier_runner.AXIS,), devices=jax.devices()[:1])
  for name in args.tasks:
    task = _conv_tasks.make_tasks([name], steps=TASK_STEPS[name])[0]
    runner = _frontier_runner.FrontierRunner(task, mesh)
    first = {}
    for r in store.doc["runs"]:
      if r["task"] == name and r["phase"] == "eval":
        first.setdefault(r["label"], r)
    meta = _conv_report.machine_meta("python benchmarks/frontier.py " + " ".join(sys.argv[1:]),
                                     quick=False)
    seconds, wall0 = {label: [] for label in first}, time.time()
    for _ in range(args.time_repeats):
      for label, r in first.items():
        seconds[label].append(runner.chunk_seconds(r["kind"], r["lr"], r["seed"], r["options"]))
        tqdm.write(f"  {name} {label}: {sum(seconds[label][-1]) / task.steps * 1e3:.2f} ms/step")
    store.doc.setdefault("compute", {})[name] = dict(
        _conv_report.finish_meta(meta, wall0), chunk=task.chunk, steps=task.steps,
        size=runner.size, seconds={k: np.min(v, axis=0).tolist() for k, v in seconds.items()})
    store.save()


if __name__ == "__main__":
  main()
