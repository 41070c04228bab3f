"""0/1 Adam (the recipe's setting) on the convergence benchmark's evaluation seeds: two versions of the package, paired.

When a change alters 0/1 Adam's numbers, this says what it did to the loss
before the stored results are rerun: the chosen setting of
``benchmarks/results/convergence.json`` (per task its ``zero_one_options``, at
AdamW's selected learning rate ``best_lr``) on the task's evaluation seeds,
the same runner and data (``_conv_runner``), once with this checkout and once
with another (``PYTHONPATH`` of an old checkout: the JSON records which
``onebit_optax`` ran), then the report pairs them seed by seed and against the
stored AdamW runs of the same seeds::

    .venv/bin/python benchmarks/zero_one_ab.py --tasks gpt,digits --json /tmp/new.json
    PYTHONPATH=/tmp/old .venv/bin/python benchmarks/zero_one_ab.py --tasks gpt,digits --json /tmp/old.json
    .venv/bin/python benchmarks/zero_one_ab.py --report /tmp/new.json /tmp/old.json --out OUT.md

8 simulated CPU devices, as ``convergence.py``.
"""

from __future__ import annotations

import os

# Eight simulated CPU devices; must happen before jax is imported.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # pylint: disable=g-import-not-at-top,g-bad-import-order
import json
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _conv_report  # pylint: disable=g-import-not-at-top
import _conv_runner
import _conv_tasks
import _provenance

STORED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "convergence.json")


def stored_tasks(path: str = STORED) -> dict:
  """The stored convergence results by task name."""
  with open(path) as f:
    return {t["name"]: t for t in json.load(f)["tasks"]}


def run(task_names: list, seeds: int | None, path: str, seed_set: str = "eval") -> dict:
  """0/1 Adam at each task's stored setting and lr, on its first ``seeds`` evaluation (or selection) seeds."""
  stored = stored_tasks()
  mesh = jax.make_mesh((len(jax.devices()),), (_conv_runner.AXIS,))
  out = dict(commit=_provenance.git_commit(), load=list(os.getloadavg()), seed_set=seed_set,
             tasks={})
  for task in _conv_tasks.make_tasks(task_names):
    ref = stored[task.name]
    fresh = ref[f"{'eval' if seed_set == 'eval' else 'selection'}_seeds"][:seeds]
    runner = _conv_runner.Runner(task, mesh, ref["b2"])
    wall = time.time()
    finals = {}
    for seed in fresh:
      rec = runner.run("zero_one", ref["best_lr"], seed, zero_one=ref["zero_one_options"])
      finals[seed] = rec["final_val"]
      print(task.name, seed, rec["final_val"], flush=True)
    out["tasks"][task.name] = dict(finals=finals, lr=ref["best_lr"],
                                   options=ref["zero_one_options"], wall_s=time.time() - wall)
  out["load_end"] = list(os.getloadavg())
  with open(path, "w") as f:
    json.dump(out, f, indent=1)
  return out


def _paired(a: dict, b: dict) -> tuple:
  """Mean and standard error of the relative difference a/b - 1 over the seeds both hold (percent)."""
  recs = lambda finals: [dict(seed=s, final_val=v) for s, v in finals.items()]
  stats = _conv_report.paired_stats(recs(a), recs(b))
  return stats["mean"], stats["se"], stats["n"]


def _load(run_json: dict) -> str:
  """The 1/5/15-minute load averages at the start and the end of a run."""
  fmt = lambda xs: " ".join(f"{x:.2f}" for x in xs)
  return f"{fmt(run_json['load'])} -> {fmt(run_json['load_end'])}"


def report(new_path: str, old_path: str, note: str | None = None) -> str:
  """The paired table of two runs of :func:`run` (and both against the stored AdamW runs)."""
  new, old = (json.load(open(p)) for p in (new_path, old_path))
  stored = stored_tasks()
  lines = [
      f"#### 0/1 Adam, two versions paired on the convergence benchmark's "
      f"{new.get('seed_set', 'eval').replace('eval', 'evaluation')} seeds", "",
      *([note, ""] if note else []),
      f"New: {new['commit']} (load {_load(new)}); "
      f"old: {old['commit']} (load {_load(old)}). Each task at the "
      "setting and AdamW's learning rate stored in benchmarks/results/convergence.json; "
      "AdamW: the stored runs of the same seeds. Paired: mean ± s.e. over seeds of the "
      "relative difference of the final validation loss.", "",
      "| task | seeds | new 0/1 val. loss | old 0/1 val. loss | new vs old (paired) | "
      "new vs AdamW | old vs AdamW |",
      "|---|---:|---:|---:|---:|---:|---:|"]
  for name, t in new["tasks"].items():
    a = {int(s): v for s, v in t["finals"].items()}
    b = {int(s): v for s, v in old["tasks"][name]["finals"].items()}
    ref = stored[name]
    runs = (ref["eval"]["adamw"] if new.get("seed_set", "eval") == "eval"
            else ref["adamw"][str(ref["best_lr"])])  # (the sweep's runs at the chosen lr)
    adamw = {r["seed"]: r["final_val"] for r in runs}
    fmt = lambda m, se, n: f"{m:+.2f}% ± {se:.2f}%"
    seeds = sorted(set(a) & set(b))
    lines.append(
        f"| {name} | {len(seeds)} | {np.mean([a[s] for s in seeds]):.4f} | "
        f"{np.mean([b[s] for s in seeds]):.4f} | {fmt(*_paired(a, b))} | "
        f"{fmt(*_paired(a, adamw))} | {fmt(*_paired(b, adamw))} |")
  return "\n".join(lines) + "\n"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--tasks", default="gpt,mlm,digits")
  parser.add_argument("--seeds", type=int, default=None, help="the first N seeds of the set")
  parser.add_argument("--seed-set", choices=("eval", "selection"), default="eval",
                      help="the evaluation seeds (compare) or the selection seeds (choose)")
  parser.add_argument("--json", default=None, help="where run writes its final losses")
  parser.add_argument("--report", nargs=2, metavar=("NEW", "OLD"), default=None)
  parser.add_argument("--note", default=None, help="a line under the report's title: what differs")
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  if args.report:
    text = report(*args.report, note=args.note)
    if args.out:
      with open(args.out, "w") as f:
        f.write(text)
    print(text)
    return
  assert args.json, "--json is required for a run"
  run(args.tasks.split(","), args.seeds, args.json, args.seed_set)


if __name__ == "__main__":
  main()
