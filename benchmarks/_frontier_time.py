"""Time on a slow link for benchmarks/frontier.py's contestants: measured compute + an alpha-beta network.

Per step, one worker per node on links of ``rate`` bit/s (``ALPHA`` seconds per
message): the compute this machine measured for that step of that contestant
on one device (``frontier.py --time``), plus what the step sends at ``n``
workers. A step is classed by what it sent in the 8-device run: a float32
all-reduce of the model (AdamW, 1-bit Adam's warmup, 0/1 Adam's variance steps,
DiLoCo's outer steps), a 1-bit exchange (any smaller message), or nothing:

    all-reduce   2(n-1) alpha + allreduce_wire_bytes(D, n) / B
    1-bit        2(n-1) alpha + 2(n-1) row_bytes(n) / B   (all_to_all + all_gather)

``row_bytes(n)`` from the package's wire layout of the task's parameters on n
devices. No overlap of compute and communication. The time to reach AdamW's
loss: the first periodic evaluation (every 25 steps, the same 128 held-out
examples for all) at or below AdamW's mean loss there after its last step.
"""

from __future__ import annotations

import numpy as np

ALPHA = 50e-6  # seconds per message: an assumption (a LAN's latency), stated in the report.
LINKS = ((1e9, "1 Gbit/s"), (1e8, "100 Mbit/s"))
WORKERS = (8, 64)


def _bytes(size: int, n: int, params_shapes) -> tuple[float, float]:
  """(float32 all-reduce, 1-bit exchange) bytes one worker sends at ``n`` workers."""
  from onebit_optax import _collective, _layout  # pylint: disable=g-import-not-at-top
  layout = _layout.wire_layout_for(params_shapes, n)
  return (float(_collective.allreduce_wire_bytes(size, n)), 2.0 * (n - 1) * layout.row_bytes)


def _kinds(wire, allreduce8: float) -> np.ndarray:
  """Per step: 2 a float32 all-reduce, 1 a 1-bit exchange, 0 nothing (from the 8-device run)."""
  wire = np.asarray(wire, float)
  return np.where(wire >= 0.5 * allreduce8, 2, np.where(wire > 0, 1, 0))


def step_seconds(rec, compute: dict, label: str, n: int, rate: float, shapes) -> np.ndarray:
  """Seconds of each step of run ``rec`` at ``n`` workers on ``rate`` bit/s links."""
  from onebit_optax import _collective  # pylint: disable=g-import-not-at-top
  size, chunk = compute["size"], compute["chunk"]
  per_chunk = np.asarray(compute["seconds"][label]) / chunk
  comp = np.repeat(per_chunk, chunk)[:len(rec["wire"])]
  full, onebit = _bytes(size, n, shapes)
  kinds = _kinds(rec["wire"], float(_collective.allreduce_wire_bytes(size, 8)))
  comm = np.choose(kinds, [0.0, 2 * (n - 1) * ALPHA + onebit * 8 / rate,
                           2 * (n - 1) * ALPHA + full * 8 / rate])
  return comp + comm


def time_to(rec, target: float, seconds: np.ndarray):
  """Seconds until the first periodic evaluation at or below ``target`` (None: never)."""
  for step, val in zip(rec["eval_steps"], rec["val"]):
    if step > 0 and val <= target:
      return float(np.sum(seconds[:step]))
  return None


def reach_times(doc, task, row, target, n, rate, shapes) -> list:
  """Per seed of ``row``: seconds to ``target`` at ``n`` workers on ``rate`` links (None: never)."""
  compute = doc["compute"][task]
  return [time_to(rec, target, step_seconds(rec, compute, row["label"], n, rate, shapes))
          for rec in row["recs"]]


def target_of(adamw_row) -> float:
  """AdamW's mean periodic loss after its last step."""
  return float(np.mean([r["val"][-1] for r in adamw_row["recs"]]))


def fastest(doc, task, rows, n: int, rate: float, slack: float = 0.0):
  """(label, seconds, AdamW's seconds) of the first to reach AdamW's loss on every seed, or None."""
  if task not in doc.get("compute", {}):
    return None
  shapes, task_rows = _shapes(task), rows(doc, task)
  adamw = next(r for r in task_rows if r["label"] == "AdamW")
  target, best = target_of(adamw) * (1 + slack), None
  for r in task_rows:
    times = reach_times(doc, task, r, target, n, rate, shapes)
    if r["label"] in doc["compute"][task]["seconds"] and None not in times:
      if best is None or np.mean(times) < best[1]:
        best = (r["label"], float(np.mean(times)))
  adamw_times = [t for t in reach_times(doc, task, adamw, target, n, rate, shapes) if t]
  return None if best is None else (*best, float(np.mean(adamw_times)) if adamw_times else None)


def _cell(times) -> str:
  reached = [t for t in times if t is not None]
  if not reached:
    return f"not reached (0/{len(times)})"
  return f"{np.mean(reached):.1f} s ({len(reached)}/{len(times)})"


SLACKS = (0.0, 0.02)  # targets: AdamW's loss, and 2% above it


def table(doc, task, rows, shapes, slack: float = 0.0, whole: bool = True) -> list[str]:
  """Seconds to AdamW's loss (times 1 + ``slack``) per contestant and network; the whole run's."""
  compute = doc["compute"][task]
  task_rows = [r for r in rows(doc, task) if r["label"] in compute["seconds"]]
  target = target_of(next(r for r in task_rows if r["label"] == "AdamW")) * (1 + slack)
  heads = [f"{name}, {n} workers" for _, name in LINKS for n in WORKERS]
  what = "AdamW's mean periodic loss after its last step" + (
      f" plus {slack:.0%}" if slack else "")
  out = [f"Target: {what}, {target:.4f}. Cells: mean seconds to reach it over the seeds that do "
         "(seeds reaching / seeds)" + ("; then the whole run's seconds." if whole else "."), "",
         "| contestant | compute ms/step | " + " | ".join(heads)
         + (" | whole run: " + " | ".join(heads) if whole else "") + " |",
         "|---|---|" + "---|" * (len(heads) * (2 if whole else 1))]
  for r in task_rows:
    ms = np.sum(compute["seconds"][r["label"]]) / compute["steps"] * 1e3
    reach, total = [], []
    for rate, _ in LINKS:
      for n in WORKERS:
        reach.append(_cell(reach_times(doc, task, r, target, n, rate, shapes)))
        secs = [step_seconds(rec, compute, r["label"], n, rate, shapes) for rec in r["recs"]]
        total.append(f"{np.mean([np.sum(s) for s in secs]):.1f} s")
    out.append(f"| {r['label']} | {ms:.2f} | " + " | ".join(reach)
               + (" | " + " | ".join(total) if whole else "") + " |")
  return out


def section(doc, tasks, rows, titles) -> list[str]:
  timed = [t for t in tasks if t in doc.get("compute", {})]
  if not timed:
    return ["## Time on a slow link", "", "_Not measured yet: run `python benchmarks/frontier.py "
            "--time`._", ""]
  out = ["## Time on a slow link (alpha-beta model)", "", __doc__.split("\n\n", 1)[1].strip(), "",
         f"alpha = {ALPHA * 1e6:.0f} us (an assumption); compute measured by `frontier.py --time` "
         "(one device, the per-device batch of the runs, contestants interleaved, each chunk's "
         "fastest of the repeats).", ""]
  for task in timed:
    c = doc["compute"][task]
    out += [f"### {titles.get(task, task)}", "", f"`{c['command']}` at {c['git']}; load at start "
            f"`{c['uptime_start'].split('load average: ')[-1]}`, at end "
            f"`{c['uptime_end'].split('load average: ')[-1]}`.", "",
            *table(doc, task, rows, _shapes(task)), "",
            *table(doc, task, rows, _shapes(task), SLACKS[1], whole=False), ""]
  return out


def _shapes(task: str):
  """The task's parameter tree (abstract), for the wire layout."""
  import jax  # pylint: disable=g-import-not-at-top
  import _conv_tasks  # pylint: disable=g-import-not-at-top
  t = _conv_tasks.make_tasks([task], steps=10)[0]
  return jax.eval_shape(t.init_params, jax.random.key(0))
