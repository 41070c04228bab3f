"""The quickstart notebook runs end to end, and what it prints agrees with the byte formulas.

The committed notebook is executed as it is (by the same Python as the tests,
through a Jupyter kernel) and its printed results are checked against the
textbook formulas for the bytes of a float32 ring all-reduce and of the
two-phase 1-bit all-reduce, not against onebit_optax's own byte counters.
"""

import json
import math
import os
import re
import sys
import time
from pathlib import Path

import nbformat
import pytest

import _flat  # tests/_flat.py: the layout written out independently
from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "onebit_adam_quickstart.ipynb"
DEVICES, STEPS = 8, 600  # what the notebook uses without an accelerator (STEPS = 600 in the data cell)


def _kernel_manager(tmp_path):
  """A kernel spec that runs this very interpreter (the repository's .venv under dev.py).

  A "python3" spec found on the Jupyter path could point at another Python
  without onebit_optax (or with another version of it).
  """
  spec_dir = tmp_path / "kernels" / "onebit-test"
  spec_dir.mkdir(parents=True)
  (spec_dir / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "onebit-optax test", "language": "python"}))
  return KernelManager(kernel_name="onebit-test", kernel_spec_manager=KernelSpecManager(
      kernel_dirs=[str(tmp_path / "kernels")]))


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
  nb = nbformat.read(NOTEBOOK, as_version=4)
  # The kernel must set up its own devices (the notebook's cell, not conftest.py's flag), and
  # must not look like Colab: the setup cell then installs nothing and touches no network.
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  env.pop("MPLBACKEND", None)  # ipykernel's default: inline PNGs
  cpu = {}

  def kernel_cpu_seconds(**_):
    # The kernel still runs when this hook fires: read its CPU time (all threads) from /proc.
    try:
      fields = Path(f"/proc/{client.km.provisioner.pid}/stat").read_text().rsplit(")", 1)[1].split()
      cpu["s"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    except (OSError, AttributeError, IndexError, ValueError):
      cpu["s"] = math.nan  # not Linux, or another provisioner: the timing is only informative

  client = NotebookClient(
      nb, km=_kernel_manager(tmp_path_factory.mktemp("kernelspec")), timeout=300,
      allow_errors=False, resources={"metadata": {"path": str(NOTEBOOK.parent)}},
      on_notebook_complete=kernel_cpu_seconds)
  start = time.perf_counter()
  client.execute(env=env)  # raises CellExecutionError if any cell fails
  print(f"\nnotebook: {time.perf_counter() - start:.1f} s wall, {cpu.get('s', math.nan):.1f} s "
        "kernel CPU")
  return nb


def _text(nb):
  return "".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                 for out in cell.get("outputs", []) if out.output_type == "stream")


def _number(pattern, text):
  match = re.search(pattern, text)
  assert match, f"{pattern!r} not in the notebook output:\n{text}"
  return float(match[1].replace(",", ""))


def test_committed_notebook_is_stripped_and_up_to_date():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nbformat.validate(nb)
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert cell.outputs == [] and cell.execution_count is None, cell.id
  sys.path.insert(0, str(NOTEBOOK.parent))
  try:
    import _build_notebook
  finally:
    sys.path.remove(str(NOTEBOOK.parent))
  assert NOTEBOOK.read_text() == _build_notebook.render(), (
      "notebooks/onebit_adam_quickstart.ipynb is stale: run python notebooks/_build_notebook.py")


@pytest.mark.slow  # runs the notebook (600 steps); .ci/run runs it, `-m ''` too
def test_no_cell_errored_and_the_kernel_is_this_python(executed):
  for cell in executed.cells:
    for out in cell.get("outputs", []):
      assert out.output_type != "error", (cell.id, out.get("ename"), out.get("evalue"))
      assert out.get("name") != "stderr" or "Traceback" not in out.get("text", ""), cell.id
  text = _text(executed)
  assert f"python: {sys.executable}\n" in text
  assert f"{DEVICES} cpu devices" in text


@pytest.mark.slow
def test_the_figure_is_drawn(executed):
  images = [out for cell in executed.cells for out in cell.get("outputs", [])
            if "image/png" in out.get("data", {})]
  assert len(images) == 1


@pytest.mark.slow
def test_freeze_happens_inside_the_run_after_the_lr_warmup(executed):
  text = _text(executed)
  freeze = int(_number(r"froze the variance after step (\d+)", text))
  ratio = _number(r"froze the variance after step \d+ \(variance ratio ([\d.]+)\)", text)
  assert 50 <= freeze < STEPS and freeze % 50 == 0, freeze  # min_steps=50, checked every 50
  assert 0.96 <= ratio <= 1 / 0.96


@pytest.mark.slow
def test_bytes_match_the_ring_and_two_phase_formulas(executed):
  text = _text(executed)
  d = int(_number(r"([\d,]+) parameters", text))
  vocab = int(_number(r"vocabulary (\d+)", text))
  # The notebook's model, leaves in pytree order: b1 (128), b2, embed (vocab x 16),
  # w1 (context * 16 x 128), w2 (128 x vocab); the context follows from d.
  context = (d - 128 - vocab - 16 * vocab - 128 * vocab) // (16 * 128)
  leaf_sizes = [128, vocab, 16 * vocab, context * 16 * 128, 128 * vocab]
  assert sum(leaf_sizes) == d
  n = DEVICES
  allreduce = 2 * (n - 1) / n * d * 4  # ring all-reduce of float32: reduce-scatter + all-gather
  # all_to_all + all_gather of 2 (n - 1) messages: signs + one scale per leaf piece + the
  # float32 of the leaves under 64 elements.
  onebit = _flat.onebit_compressed_bytes(leaf_sizes, n)
  assert _number(r"per step: Adam ([\d,]+)", text) == pytest.approx(allreduce, abs=1)
  assert _number(r"after the freeze ([\d,]+)", text) == pytest.approx(onebit, abs=1)
  freeze = int(_number(r"froze the variance after step (\d+)", text))
  assert _number(r"whole run: Adam ([\d,]+)", text) == pytest.approx(STEPS * allreduce, rel=1e-6)
  # 1-bit Adam's warmup all-reduces the gradients, as Adam does (no padding on the wire).
  warmup = _flat.onebit_warmup_bytes(leaf_sizes, n)
  assert warmup == pytest.approx(allreduce)
  assert _number(r"whole run: Adam [\d,]+, 1-bit Adam ([\d,]+)", text) == pytest.approx(
      freeze * warmup + (STEPS - freeze) * onebit, rel=1e-6)


@pytest.mark.slow
def test_onebit_adam_trains_as_well_as_adam(executed):
  text = _text(executed)
  adam = _number(r"validation loss: Adam ([\d.]+)", text)
  onebit = _number(r"validation loss: Adam [\d.]+, 1-bit Adam ([\d.]+)", text)
  # Uniform over ~100 characters is ln(100) = 4.6 nats; 600 steps get well below 2.5.
  assert math.isfinite(onebit) and adam < 2.5
  assert abs(onebit - adam) < 0.05 * adam, (adam, onebit)


@pytest.mark.slow
def test_the_recipe_cell_runs_and_freezes(executed):
  text = _text(executed)
  assert "frozen=True after step 20" in text
  assert _number(r"recipe: loss ([\d.]+)", text) < 0.5  # from ~16 at w = 0
