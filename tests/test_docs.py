"""Every public name is documented in optax's template; the doctests themselves run via --doctest-modules."""

import inspect

import pytest

import onebit_optax

# The names that carry the algorithm: these also need the math and references.
ALGORITHMIC = {
    "onebit_adam", "scale_by_onebit_adam", "scale_by_zero_one_adam",
    "variance_ratio_freeze", "clip_by_global_norm", "accumulate_gradients",
}


def test_all_is_sorted_unique_and_importable():
  names = list(onebit_optax.__all__)
  assert len(names) == len(set(names))
  for name in names:
    assert hasattr(onebit_optax, name), name
  public = {n for n in dir(onebit_optax) if not n.startswith("_")}
  # Everything public at the top level is in __all__ (modules and the version excepted).
  extra = {n for n in public - set(names)
           if not inspect.ismodule(getattr(onebit_optax, n)) and n != "annotations"}
  assert extra == set(), f"public but not in __all__: {sorted(extra)}"


@pytest.mark.parametrize("name", sorted(onebit_optax.__all__))
def test_docstring_template(name):
  obj = getattr(onebit_optax, name)
  doc = inspect.getdoc(obj)
  assert doc, f"{name} has no docstring"
  summary = doc.splitlines()[0]
  assert summary.strip() and not summary.startswith(" "), f"{name}: no one-line summary"
  assert ">>>" in doc, f"{name}: no doctest example"
  if inspect.isfunction(obj):
    assert "Args:" in doc and "Returns:" in doc, f"{name}: Args/Returns missing"
  if name in ALGORITHMIC:
    assert ".. math::" in doc, f"{name}: the math is missing"
    assert "References:" in doc and "arxiv.org" in doc.lower(), f"{name}: references missing"


def test_launch_module_is_documented():
  from onebit_optax import launch
  assert launch.__doc__ and "jax.distributed" in launch.__doc__
  assert inspect.getdoc(launch.initialize)


# ----------------------------------------------------------------------------
# The docs site (docs/): generated sources, checked without running Sphinx (the
# build itself, warnings as errors, is `python3 dev.py docs`, a CI step).

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))
import onebit_docs  # noqa: E402  pylint: disable=wrong-import-position
import _xla  # noqa: E402  pylint: disable=wrong-import-position


def _autosummary_entries(page: str) -> list[str]:
  """The names listed under the page's ``.. autosummary::`` directives."""
  names, inside = [], False
  for line in page.splitlines():
    if line.startswith(".. autosummary::"):
      inside = True
    elif inside and line.startswith("```"):
      inside = False
    elif inside and re.match(r"^   [A-Za-z_]\w*$", line):
      names.append(line.strip())
  return names


def test_every_public_name_has_one_api_entry():
  entries = _autosummary_entries(onebit_docs.api_index())
  assert sorted(entries) == sorted(onebit_optax.__all__)
  assert len(entries) == len(set(entries)), "a name is listed twice"


def test_api_index_follows_all(monkeypatch):
  # A name added to __all__ from a new module appears, in a section of its own,
  # without editing the docs.
  def brand_new_optimizer():
    """A stand-in."""
  brand_new_optimizer.__module__ = "onebit_optax._brand_new"
  monkeypatch.setattr(onebit_optax, "brand_new_optimizer", brand_new_optimizer, raising=False)
  monkeypatch.setattr(onebit_optax, "__all__", tuple(onebit_optax.__all__) + ("brand_new_optimizer",))
  page = onebit_docs.api_index()
  assert "brand_new_optimizer" in _autosummary_entries(page)
  assert "## Brand new\n" in page


def test_generate_drops_the_stubs_of_removed_names(tmp_path):
  stubs = tmp_path / "api" / "generated"
  stubs.mkdir(parents=True)
  (stubs / "onebit_optax.onebit_adam.rst").write_text("kept")
  (stubs / "onebit_optax.a_name_removed_from_all.rst").write_text("stale")
  onebit_docs.generate(tmp_path)
  assert sorted(p.name for p in stubs.iterdir()) == ["onebit_optax.onebit_adam.rst"]


def test_renumber_headings_nests_without_gaps():
  text = "#### A\n\ntext\n\n###### B\n```\n# not a heading\n```\n#### C\n# D\n### E"
  out = onebit_docs.renumber_headings(text)
  outside_code = re.sub(r"```.*?```", "", out, flags=re.S)
  assert re.findall(r"^(#+) (\w)", outside_code, flags=re.M) == [
      ("##", "A"), ("###", "B"), ("##", "C"), ("##", "D"), ("###", "E")]
  assert "# not a heading" in out


def test_every_results_file_has_a_page_with_its_tables(tmp_path):
  onebit_docs.generate(tmp_path)
  results = ROOT / "benchmarks" / "results"
  full = [p for p in results.glob("*.md") if not p.stem.endswith(onebit_docs.EXCERPTS)]
  assert full, "no results files"
  toctree = (tmp_path / "results" / "generated" / "toctree.inc").read_text()
  for md in full:
    page = (tmp_path / "results" / "generated" / md.name).read_text()
    assert f"generated/{md.stem}\n" in toctree, md.stem
    assert page.startswith("# "), md.stem
    # Every table row of the benchmark's file is on its page, as written (a wide table in
    # pieces that each repeat the first column).
    split = onebit_docs.split_wide_tables(onebit_docs.renumber_headings(md.read_text()))
    for row in (line for line in split.splitlines() if line.startswith("|")):
      assert row in page, (md.stem, row)
    if (tmp_path / "results" / "generated" / f"{md.stem}.png").exists():
      figure = page.index(":::{figure}")
      assert figure < page.index("*Generated from"), "the figure comes first"
    levels = [len(h) for h in re.findall(r"^(#+) ", page, flags=re.M)]
    assert levels[0] == 1 and all(b <= a + 1 for a, b in zip(levels, levels[1:])), md.stem
  for png in results.glob("*.png"):
    assert (tmp_path / "results" / "generated" / png.name).read_bytes() == png.read_bytes()


def test_split_wide_tables_keeps_every_cell():
  row = lambda *cells: "| " + " | ".join(cells) + " |"
  table = [row(*[f"h{i}" for i in range(12)]), row(*["---"] * 12), row(*[f"c{i}" for i in range(12)])]
  pieces = onebit_docs.split_wide_tables("\n".join(["text", *table, "after"]), max_columns=5)
  rows = [[c.strip() for c in line.strip("|").split("|")] for line in pieces.splitlines()
          if line.startswith("|")]
  assert all(len(r) <= 5 and r[0] in ("h0", "---", "c0") for r in rows)
  cells = [c for r in rows if r[0] == "c0" for c in r[1:]]
  assert cells == [f"c{i}" for i in range(1, 12)]  # every cell once, in order
  assert pieces.startswith("text\n") and pieces.endswith("\nafter")
  narrow = "\n".join(table[:2])
  assert onebit_docs.split_wide_tables(narrow, max_columns=12) == narrow


def test_getting_started_code_runs():
  # The page's code blocks, in order, as one script on 8 simulated devices.
  page = (ROOT / "docs" / "getting_started.md").read_text()
  script = "\n\n".join(re.findall(r"```python\n(.*?)```", page, flags=re.S))
  env = {**__import__("os").environ, "XLA_FLAGS": _xla.flags(8)}
  out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       timeout=300, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  first, last = map(float, re.search(r"loss (\S+) -> (\S+)", out.stdout).groups())
  assert last < 0.1 * first, out.stdout
  assert "compression (froze after step" in out.stdout, out.stdout
  assert "pmap: " in out.stdout and "frozen: True" in out.stdout, out.stdout


def test_readme_is_the_front_door():
  readme = (ROOT / "README.md").read_text()
  assert len(readme.splitlines()) <= 150  # read in five minutes; the rest lives in docs/
  for command in ("python3 dev.py demo", "python3 dev.py test"):
    assert command in readme
  # The install line that works comes first (the package is not on PyPI).
  installs = re.findall(r"^pip install (.*?)\s", readme, flags=re.M)
  assert installs and installs[0] == "-e", installs
  # Links into the docs point at pages that exist.
  for target in re.findall(r"\]\((docs/[^)#]+)", readme):
    assert (ROOT / target).exists(), target


def test_dev_py_reuses_a_venv_with_more_extras_and_refreshes_on_change(tmp_path, monkeypatch):
  sys.path.insert(0, str(ROOT))
  import dev  # pylint: disable=import-outside-toplevel
  venv = tmp_path / "venv"
  py = dev._bin(venv, "python")
  py.parent.mkdir(parents=True)
  py.write_text("")
  digest = __import__("hashlib").sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
  calls = []
  monkeypatch.setattr(dev.subprocess, "check_call", lambda args, **kw: calls.append(args))
  (venv / ".onebit-installed").write_text(f"{digest} {dev.DOCS_EXTRAS}")
  dev._ensure_env(venv, ["python3"], dev.EXTRAS)  # a superset is installed: nothing to do
  assert calls == []
  (venv / ".onebit-installed").write_text(f"{digest} {dev.EXTRAS}")
  dev._ensure_env(venv, ["python3"], dev.DOCS_EXTRAS)  # docs missing: install, keeping the rest
  installs = [a for a in calls if "-e" in a]
  assert len(installs) == 1 and set(installs[0][-1].split("[")[1].rstrip("]").split(",")) == {
      "test", "examples", "dev", "docs"}
  calls.clear()
  (venv / ".onebit-installed").write_text(f"{'0' * 64} {dev.DOCS_EXTRAS}")  # pyproject changed
  dev._ensure_env(venv, ["python3"], dev.EXTRAS)
  assert [a for a in calls if "-e" in a]


def _update_readme():
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import update_readme  # pylint: disable=import-outside-toplevel
  return update_readme


def test_readme_summary_is_the_generated_one():
  # Its numbers come from the benchmarks' files only: rerun update_readme.py after a benchmark.
  readme = (ROOT / "README.md").read_text()
  block = re.search(r"<!-- results:summary -->\n(.*?)\n<!-- /results:summary -->", readme, re.S)
  assert block, "README.md has no summary block"
  assert block.group(1) == _update_readme().summary(), "stale: run benchmarks/update_readme.py"


def _cells(row: str) -> list[str]:
  return [c.strip() for c in row.strip().strip("|").split("|")]


def test_readme_summary_agrees_with_the_benchmarks_tables():
  # Read back from the markdown the benchmarks wrote (not from the JSON update_readme reads).
  summary = _update_readme().summary()
  rows = [_cells(l) for l in summary.splitlines()[2:]]
  assert all(len(r) == 5 for r in rows), "one number per optimizer: 5 columns"
  results = ROOT / "benchmarks" / "results"
  conv = (results / "convergence.md").read_text()
  for task in re.findall(r"^\| (gpt|mlm|digits) \|.*$", conv, flags=re.M):
    cells = _cells(next(l for l in conv.splitlines() if l.startswith(f"| {task} |")))
    paired_mean, se, less = cells[7].split(" ± ")[0], cells[8], cells[11]
    loss = [r for r in rows if f"{cells[1]} parameters" in r[1]]
    assert len(loss) == 1 and loss[0][2] == f"{paired_mean}% (s.e. {se})", (task, loss)
    name = loss[0][1].split(",")[0]
    sent = [r for r in rows if r[0] == "bytes sent vs AdamW" and r[1].startswith(f"{name},")]
    assert len(sent) == 1 and sent[0][2] == f"{float(less[:-1]):.1f}x fewer", (task, sent)
  rates = (results / "comm_throughput_rates.md").read_text()
  measured = re.findall(r"^\| onebit_adam compression \|(?:[^|]*\|){3} (\d+\.\d+x) \|", rates,
                        flags=re.M)
  zero_one = (results / "comm_throughput_zero_one.md").read_text()
  measured_zero_one = re.findall(r"compression, 1 Gbit/s, 4 ranks: (\d+\.\d+x)", zero_one)
  throughput = [r for r in rows if r[0].startswith("steps/s") and r[0].endswith("compressed steps")]
  shown = [r[2] for r in throughput]
  assert measured and measured_zero_one and set(shown) <= set(measured + measured_zero_one)
  assert len(throughput) == len({r[1] for r in throughput}), "two rows measure one setting"


def test_examples_page_shows_every_script():
  page = onebit_docs.examples_page()
  scripts = [p for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_")]
  assert scripts
  for path in scripts:
    assert f"## `examples/{path.name}`" in page and f"../../examples/{path.name}" in page


# Quoted on the troubleshooting page as the user sees them, but built from f-string fields
# (the wrapper's or the hyperparameter's name, the environment variables' names) or raised
# by XLA, not by onebit_optax: not searchable in the source as written.
_RENDERED_MESSAGES = {
    "optax.MultiSteps around onebit_adam(...) does not work",
    "optax.apply_if_finite around ...",
    "b1=... must be in [0, 1)",
    "variance_floor=... must be finite and >= 0",
    "max_update=... must be > 0",
    "ONEBIT_COORDINATOR_ADDRESS is set but ONEBIT_NUM_PROCESSES/ONEBIT_PROCESS_ID are missing",
    "Expected 8 threads to join the rendezvous, but only 7 arrived",
}


def test_troubleshooting_quotes_messages_the_package_raises():
  # Every quoted message is in onebit_optax's source ('...', quoted values and [lists] stand
  # for what the message fills in), so the page cannot drift from the code.
  # The imported package's files: CI's wheel run has no onebit_optax/ beside the tests.
  files = sorted(Path(onebit_optax.__file__).parent.glob("*.py"))
  assert len(files) > 10, files
  source = "".join(p.read_text() for p in files)
  source = re.sub(r'"\s*\n\s*[rf]*"', "", source)  # adjacent string literals: one message
  page = (ROOT / "docs" / "guides" / "troubleshooting.md").read_text()
  quotes = set(re.findall(r'"([^"\n]{8,}?)"', page))
  assert len(quotes) > 20
  assert _RENDERED_MESSAGES <= quotes, "an exemption no longer quoted: drop it"
  for quote in quotes - _RENDERED_MESSAGES:
    parts = re.split(r"\.\.\.|'[^']*'|\[[^\]]*\]|\b[NMn]\b|=0\)", quote)
    pattern = "[^\n]{0,120}?".join(re.escape(part) for part in parts)
    assert re.search(pattern, source), f"not raised by onebit_optax (any more?): {quote!r}"
