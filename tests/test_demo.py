"""Smoke test of examples/demo.py: a short run end to end, checked against the byte formulas."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import _xla
import _flat

ROOT = Path(__file__).resolve().parents[1]
DEVICES, STEPS, FREEZE = 8, 30, 10
UNITS = {"kB": 1e3, "MB": 1e6, "GB": 1e9}


def _run_demo(*args):
  # A subprocess, because the demo fixes the device count before importing jax
  # (and a fresh process is what `python3 dev.py demo` runs).
  env = dict(os.environ, XLA_FLAGS=_xla.flags(DEVICES),
             JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, str(ROOT / "examples" / "demo.py"), "--devices", str(DEVICES), *args],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  return proc.stdout


@pytest.fixture(scope="module")
def figure_path(tmp_path_factory):
  return tmp_path_factory.mktemp("demo") / "curves.png"


@pytest.fixture(scope="module")
def demo_output(figure_path):
  return _run_demo("--steps", str(STEPS), "--freeze-step", str(FREEZE),
                   "--figure", str(figure_path), "--check-replicas-every", "7")


def _row(output, label):
  """The cells of the table row starting with ``label`` (split on 2+ spaces)."""
  for line in output.splitlines():
    if line.startswith(label):
      return re.split(r"\s{2,}", line[len(label):].strip())
  raise AssertionError(f"no row {label!r} in the demo output:\n{output}")


def _bytes(cell):
  value, unit = cell.split()
  return float(value) * UNITS[unit]


def test_flat_run_says_its_mesh_and_what_the_bytes_count(demo_output):
  assert f"; {DEVICES} CPU devices" in demo_output.splitlines()[0]
  assert re.search(rf"^[\d,]+ parameters, {DEVICES} CPU devices, {STEPS} steps", demo_output, re.M)
  assert "bytes: what each device sends per step" in demo_output


def test_runs_get_their_own_figure_and_a_title_that_names_them():
  from examples import demo
  flat, nodes = demo._parse_args([]), demo._parse_args(["--nodes", "2"])
  adam_only = demo._parse_args(["--optimizer", "adam"])
  paths = {flat.figure, nodes.figure, adam_only.figure}
  assert len(paths) == 3, paths  # a --nodes run does not overwrite the flat run's figure
  assert os.path.basename(nodes.figure) == "onebit_optax_demo_2x4dev.png"
  assert os.path.basename(flat.figure) == "onebit_optax_demo_8dev.png"
  labels = [{"label": "Adam"}, {"label": "1-bit Adam"}]
  assert demo.figure_title(labels, flat) == "Adam vs 1-bit Adam, 8 CPU devices, 1000 steps"
  title = demo.figure_title(labels, nodes)
  assert title.startswith("Adam vs 1-bit Adam, 2 nodes x 4 CPU devices, 1000 steps\n")
  assert "slow 'node' axis only" in title


def test_table_has_both_optimizers_with_finite_losses(demo_output):
  header = next(line for line in demo_output.splitlines() if line.strip().startswith("Adam"))
  assert header.split() == ["Adam", "1-bit", "Adam"]
  for label in ("final train loss", "final val loss", f"mean batch loss, last {STEPS} steps"):
    adam, onebit = (float(x) for x in _row(demo_output, label))
    assert math.isfinite(adam) and math.isfinite(onebit), label
    # 30 steps must have learned something: uniform over ~100 chars is ln(100) = 4.6.
    assert adam < 4.0 and onebit < 4.0, (label, adam, onebit)
  assert _row(demo_output, "variance froze")[1].startswith(f"after step {FREEZE} ")


def _leaf_shapes(vocab, context=16, hidden=256, embed=16):
  """The demo model's leaves (its defaults), in flattening order: embed, h1, h2, out (b, w)."""
  return [(vocab, embed), (hidden,), (context * embed, hidden), (hidden,), (hidden, hidden),
          (vocab,), (hidden, vocab)]


def _leaf_sizes(vocab, **kwargs):
  return [math.prod(s) for s in _leaf_shapes(vocab, **kwargs)]


def test_bytes_match_the_ring_and_two_phase_formulas(demo_output):
  # Independent of onebit_optax: the textbook formulas, from the printed sizes.
  num_params = int(re.search(r"^([\d,]+) parameters", demo_output, re.M)[1].replace(",", ""))
  vocab = int(re.search(r"vocabulary (\d+)", demo_output)[1])
  sizes = _leaf_sizes(vocab)
  assert sum(sizes) == num_params  # the model the test describes is the demo's
  n = DEVICES
  allreduce = 2 * (n - 1) / n * num_params * 4  # ring all-reduce of float32
  # 1-bit Adam's warmup all-reduces the leaves as they are (no padding); its
  # compression phase sends one fused message per chunk: the packed signs of the
  # leaves >= 64 elements, one float32 scale per leaf piece of a chunk and the small
  # leaves as float32, through an all_to_all and an all_gather (tests/_flat).
  onebit_warmup = _flat.onebit_warmup_bytes(sizes, n)
  onebit = _flat.onebit_compressed_bytes(sizes, n, shapes=_leaf_shapes(vocab))
  assert onebit_warmup == pytest.approx(allreduce)

  full_adam, full_onebit = (
      _bytes(c) for c in _row(demo_output, "bytes/device/step, full precision"))
  assert full_adam == pytest.approx(allreduce, rel=1e-3)
  assert full_onebit == pytest.approx(onebit_warmup, rel=1e-3)
  assert _bytes(_row(demo_output, "bytes/device/step, 1-bit phase")[1]) == pytest.approx(
      onebit, rel=1e-3)
  total_adam, total_onebit = (_bytes(c) for c in _row(demo_output, "bytes/device, whole run"))
  assert total_adam == pytest.approx(STEPS * allreduce, rel=1e-3)
  assert total_onebit == pytest.approx(
      FREEZE * onebit_warmup + (STEPS - FREEZE) * onebit, rel=1e-3)


def test_figure_is_saved_where_the_demo_says(demo_output, figure_path):
  assert f"figure saved to {figure_path}" in demo_output
  data = figure_path.read_bytes()
  assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_status_summary_after_the_freeze(demo_output):
  line = next(l for l in demo_output.splitlines() if "status (onebit_optax.status)" in l)
  assert f"step {STEPS}: compression (froze after step {FREEZE})" in line
  # Bytes so far in the summary agree with the table's whole-run rows.
  total_adam, total_onebit = (_bytes(c) for c in _row(demo_output, "bytes/device, whole run"))
  sent, adam = re.search(r"so far ([\d.]+ \w+) vs ([\d.]+ \w+) for Adam", line).groups()
  assert _bytes(sent) == pytest.approx(total_onebit, rel=1e-2)
  assert _bytes(adam) == pytest.approx(total_adam, rel=1e-2)


def test_a_run_that_never_froze_says_why(tmp_path):
  # The ratio policy checks every 100 steps, from step 200: a 12-step run never compresses.
  output = _run_demo("--steps", "12", "--freeze-interval", "100", "--optimizer", "onebit",
                     "--figure", str(tmp_path / "f.png"))
  assert _row(output, "variance froze")[0] == "never (no compression)"
  line = next(l for l in output.splitlines() if "status (onebit_optax.status)" in l)
  assert "never froze in 12 steps" in line
  assert "first variance-ratio check that can freeze is at step 200" in line
  assert (tmp_path / "f.png").stat().st_size > 10_000


def test_hierarchical_demo_counts_the_bytes_between_nodes(tmp_path):
  # 2 simulated nodes of 4: float32 inside a node, 1 bit between the nodes, on a
  # quarter of the flat buffer per device (see README, hierarchical averaging).
  output = _run_demo("--nodes", "2", "--steps", "16", "--freeze-step", "6",
                     "--figure", str(tmp_path / "f.png"), "--check-replicas-every", "5")
  # The mesh as it is (not "8 x CPU devices"), and a note that the bytes are the slow axis's.
  assert output.splitlines()[0].endswith("; 2 nodes x 4 CPU devices"), output.splitlines()[0]
  assert re.search(r"^[\d,]+ parameters, 2 nodes x 4 CPU devices, 16 steps", output, re.M)
  assert "8 CPU devices" not in output and "8 x CPU" not in output
  note = next(l for l in output.splitlines() if l.startswith("bytes: "))
  assert "over the slow 'node' axis (between nodes) only" in note
  assert output.index(note) < output.index("bytes/device/step, full precision")
  num_params = int(re.search(r"^([\d,]+) parameters", output, re.M)[1].replace(",", ""))
  vocab = int(re.search(r"vocabulary (\d+)", output)[1])
  sizes = _leaf_sizes(vocab)
  # Every leaf compressed (hierarchical), laid out group after group of one shape.
  sizes = [sizes[i] for i in _flat.split(sizes, 0, _leaf_shapes(vocab))[0]]
  nodes, local = 2, DEVICES // 2
  quarter = _flat.padded(sizes, DEVICES) / local
  full_adam, full_onebit = (_bytes(c) for c in _row(output, "bytes/device/step, full precision"))
  assert full_adam == pytest.approx(2 * (nodes - 1) / nodes * num_params / local * 4, rel=1e-3)
  assert full_onebit == pytest.approx(2 * (nodes - 1) / nodes * quarter * 4, rel=1e-3)
  onebit = 2 * (nodes - 1) * (quarter / (8 * nodes) + 4 * _flat.max_segments(sizes, DEVICES))
  assert _bytes(_row(output, "bytes/device/step, 1-bit phase")[1]) == pytest.approx(
      onebit, rel=1e-3)
  assert all(math.isfinite(float(c)) for c in _row(output, "final train loss")[:2])
