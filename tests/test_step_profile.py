"""benchmarks/step_profile.py's reading of the profiler's trace (the benchmark itself takes
minutes; not run here): on a small Adam step, the events it counts as kernels are the compiled
program's instructions, and its table has a row per step."""

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import step_profile  # noqa: E402


def _adam_step():
  tx = optax.adam(1e-3)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = {"w": jnp.ones((64, 32)), "b": jnp.zeros(32)}
  return jax.jit(step, donate_argnums=(0, 1)), params, tx.init(params), {"w": jnp.ones((64, 32)), "b": jnp.ones(32)}


def test_the_profile_counts_the_programs_kernels():
  step, params, state, grads = _adam_step()
  names = step_profile._op_names(step.lower(params, state, grads).compile().as_text())
  row, state = step_profile.profile(step, params, state, grads, steps=2, top=3)
  assert row["kernel_count"] >= 1 and row["kernels_ms"] > 0
  assert row["top"] and all(name in names for name, _, _ in row["top"])
  assert int(state[0].count) == 2  # the state after the profiled steps
  assert row["bytes"] > 0


def test_conditionals_are_not_counted_as_kernels():
  """A conditional's event contains its branch's kernels: counting it too would count them twice."""
  def step(x, flag):
    return jax.lax.cond(flag, lambda x: jnp.sin(x) * 2, lambda x: x, x), flag

  step = jax.jit(step)
  args = (jnp.ones(1000), jnp.bool_(True))
  text = step.lower(*args).compile().as_text()
  conditionals = set(re.findall(r"%?([\w.\-]+) = \S+ conditional\(", text))
  assert conditionals
  assert not conditionals & set(step_profile._op_names(text))


def test_the_table_has_a_row_per_step_and_their_ratios():
  row = {"median_ms": 2.0, "kernels_ms": 1.0, "kernel_count": 3, "host_ms": 0.5, "bytes": 80,
         "top": [("fusion.1", 0.7, "jit(step)/add")]}
  data = {"command": "python benchmarks/step_profile.py", "commit": "abc", "jax": jax.__version__,
          "size": 10, "leaves": 0, "steps": 2, "repeats": 3, "load": [0.0] * 6}
  lines = step_profile.render(data, {"adam": row, "1-bit warmup": dict(row, median_ms=3.0)})
  assert "| 1-bit warmup | 3.0 | 1.50 | 1.0 | 1.00 | 3 | 0.5 | 1.00 | 2.00 | 1.00 |" in lines
  assert "| fusion.1 | 0.70 | `jit(step)/add` |" in lines


def _moved(fn, *args, donate=()):
  """The bytes the kernels of ``fn``'s compiled program move, summed (each runs once: no conditionals)."""
  text = jax.jit(fn, donate_argnums=donate).lower(*args).compile().as_text()
  return sum(step_profile.kernel_bytes(text).values())


def test_memory_traffic_counts_reads_and_writes():
  """Against hand counts: an elementwise pass reads its operands and writes its result; a pass
  that reads a slice reads the slice (a slice of it, that); an update of a donated buffer in
  place writes the update."""
  x, y = jnp.ones(1000), jnp.ones(1000)
  assert _moved(lambda x, y: x * 2 + y, x, y) == 3 * 4000
  assert _moved(lambda x: x[:100] * 2, x) == 2 * 400
  update = lambda x, y, i: jax.lax.dynamic_update_slice(x, y[:10] * 2, (i,))
  assert _moved(update, x, y, jnp.int32(5), donate=(0,)) == 40 + 4 + 40  # (the index too)
  # a slice of a slice (through a bitcast) reads the inner slice: a leaf's blocks of the message
  rows = lambda x, i: jax.lax.dynamic_slice_in_dim(x[:512].reshape(32, 16), i, 2) * 2
  assert _moved(rows, x, jnp.int32(3)) == 2 * 16 * 4 + 4 + 2 * 16 * 4
