"""Generated pages of the docs site: the API index, the Results pages, the notebook.

Everything here is derived at build time (``conf.py`` calls :func:`generate`),
so no page can drift from its source:

- ``api/index.md``: one autosummary entry per name in ``onebit_optax.__all__``,
  grouped by the private module that defines it (a new public name shows up
  without editing the docs).
- ``results/generated/NAME.md``: one page per ``benchmarks/results/NAME.md``
  (the file as the benchmark wrote it, command, commit, machine and load
  included), headings renumbered to nest under the page title, plots copied.
- ``examples/index.md``: every script of ``examples/``, its docstring and source.
- ``notebooks/onebit_adam_quickstart.ipynb``: the committed notebook (stripped of
  outputs; the build executes it once and caches the result, see ``conf.py``);
  its link to the README points to the docs' front page instead.

It also documents the fields of the NamedTuple states from their source
comments (``count: jax.Array  # shape=(), dtype=int32: ...``) instead of
Python's "Alias for field number N".

``python docs/_ext/onebit_docs.py OUTDIR`` writes the generated sources alone
(no Sphinx needed; ``tests/test_docs.py`` uses it).
"""

from __future__ import annotations

import inspect
import re
import shutil
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
NOTEBOOK = ROOT / "notebooks" / "onebit_adam_quickstart.ipynb"

# Section titles of the API index, by the module that defines a name. A name
# from a module not listed here lands in a section named after its module.
API_SECTIONS = (
    ("_onebit_adam", "The optimizer"),
    ("_bounded", "The optimizer"),
    ("_zero_one_adam", "0/1 Adam"),
    ("_freeze", "Freeze policies"),
    ("_accessors", "Reading the state"),
    ("_status", "Logging and replica checks"),
    ("_sharding", "shard_map helpers"),
    ("_accumulate", "Accumulation and clipping"),
    ("_partition", "Frozen layers and partitions"),
    ("_checkpoint", "Checkpointing"),
)

# Results files that are excerpts of another file (written for the README's
# summary); their numbers are on the full file's page.
EXCERPTS = ("_summary", "_freeze")

# Short page titles (the file's own first heading stays, under it); a results
# file not listed here is titled by its first heading.
RESULT_TITLES = {
    "convergence": "Convergence against a tuned AdamW",
    "convergence_quick": "Convergence, quick protocol (a smoke run)",
    "frontier": "Bytes against loss: against DiLoCo",
    "comm_throughput": "Throughput on 1 Gbit/s links, 4 processes",
    "comm_throughput_rates": "Throughput at three link rates",
    "comm_throughput_hier": "Hierarchical averaging, 2 nodes x 2 processes",
    "comm_throughput_zero_one": "0/1 Adam by phase, 1 Gbit/s links, 4 processes",
    "zero_one_ema": "0/1 Adam: the variance EMA at the default recipe",
    "data_shift": "A data shift half-way: does the frozen variance go stale?",
    "zero_one_compute": "0/1 Adam's compute per kind of step",
    "scaling_model": "Scaling to cluster shapes (a model)",
    "bounded_update": "Bounding the frozen-variance update",
    "wire_overhead": "Wire overhead and the exact-leaf threshold",
    "optimizer_compute": "Optimizer compute and memory",
    "compile_time": "Compile time of the train step",
    "digits_gap": "Digits: where the gap to AdamW comes from",
    "step_profile": "Where a train step's time goes, kernel by kernel",
    "step_profile_leaves": "Where a train step's time goes: 300 leaves",
    "device_tables": "Compile, compute and memory on one GPU",
    "zero1_warmup_lab": "Lab: Adam's warmup with its moments sharded (ZeRO-1)",
    "zero1_warmup_lab_leaves": "Lab: Adam's warmup with its moments sharded, 300 leaves",
    "zero1_cycle_lab": "Lab: 1-bit Adam with its warmup moments sharded, the whole cycle",
    "zero1_cycle_lab_4": "Lab: 1-bit Adam with its warmup moments sharded, 4 devices",
}

# What each benchmark measures, shown above its generated page (prose only: the
# numbers are in the generated tables below it).
RESULT_INTROS = {
    "convergence": (
        "Convergence on real data that ships offline: a char GPT and a BERT-style masked "
        "LM on CPython's `pydoc_data.topics` prose, and an MLP on scikit-learn's digits, "
        "each data-parallel on 8 simulated CPU devices. AdamW's learning rate is swept on "
        "*selection* seeds; 1-bit Adam with the default freeze rule is compared with it "
        "on fresh *evaluation* seeds, same seed for same seed. The freeze-step study, the "
        "replay of the freeze rule and the failing references (naive 1-bit Adam, 1-bit "
        "Adam without error feedback) run on the selection seeds. See "
        "{doc}`/guides/freeze` for what the study means for your run."),
    "frontier": (
        "Which low-communication optimizer, when: AdamW, 1-bit Adam, 0/1 Adam (with and "
        "without local steps) and DiLoCo (H inner AdamW steps per device, then an outer "
        "Nesterov step on the mean pseudo-gradient; a benchmark baseline, not part of the "
        "package) on the convergence benchmark's tasks, 8 simulated devices, learning rates "
        "chosen on selection seeds and compared on fresh ones. Each run's final loss against "
        "the bytes a device sent; then the time to AdamW's loss on slow links in an "
        "alpha-beta model with the compute measured here."),
    "convergence_quick": (
        "The smoke run of the convergence protocol (`--quick`: one selection seed, two "
        "evaluation seeds, 60–100 steps). Not a result: it shows the pipeline runs."),
    "comm_throughput": (
        "4 `jax.distributed` ranks, one per network namespace, veth pairs into a bridge, "
        "`tc tbf` rate-limited links, gloo over TCP; a 25.6M-parameter embedding model. "
        "Bytes are read from the interfaces' counters and compared with the optimizer's "
        "wire layout ({doc}`/how_it_works/wire_format`). Needs root (network "
        "namespaces)."),
    "comm_throughput_zero_one": (
        "The communication benchmark on the current code with 0/1 Adam: every step's phase "
        "(variance, compressed, local, sync) read from the state, each phase timed on its own "
        "next to Adam and 1-bit Adam, and its bytes read from the interfaces."),
    "comm_throughput_rates": (
        "The communication benchmark at three link rates (100 Mbit/s, 1 Gbit/s, "
        "10 Gbit/s): where 1-bit Adam pays and where it does not."),
    "comm_throughput_hier": (
        "Hierarchical averaging ({doc}`/guides/hierarchical`) on 2 namespaces (\"nodes\") "
        "of 2 ranks: only the link between namespaces is shaped; the ranks of a node "
        "talk over loopback. On this testbed a node's \"fast\" path is TCP on 2 shared "
        "cores, so read it for the bytes on the slow link, not for the speed of the "
        "fast one."),
    "scaling_model": (
        "Not a measurement: an alpha-beta model (compute + bytes / NIC goodput + "
        "messages x alpha, no overlap) with the optimizer's byte counts, calibrated by "
        "the measured runs, extrapolated to GPU cluster shapes. The GPU compute is an "
        "assumption (options of the script)."),
    "bounded_update": (
        "How far the farthest coordinate of each leaf moves after the freeze, relative "
        "to `optax.adam`, with and without the variance floor and the clip "
        "({doc}`/how_it_works/bounded_update`)."),
    "wire_overhead": (
        "What the scales, the padding and the exact (float32) leaves add to the packed "
        "sign bits, and how the `exact_below` threshold was chosen "
        "({doc}`/how_it_works/wire_format`). Shapes only: nothing is timed."),
    "optimizer_compute": (
        "The optimizer's compute and memory against `optax.adam` on one device and a "
        "2-device mesh, timed on the whole donated train step."),
    "compile_time": (
        "Seconds to trace, lower and compile the 8-device train step, against "
        "`optax.adam` + `pmean`."),
    "digits_gap": (
        "Where 1-bit Adam's gap to AdamW on the digits MLP came from (the learning-rate "
        "selection on few seeds)."),
}


# ----------------------------------------------------------------------------
# The API index.


def public_names() -> list[str]:
  """``onebit_optax.__all__``, as the package declares it."""
  import onebit_optax  # pylint: disable=import-outside-toplevel
  return list(onebit_optax.__all__)


def _section_of(name: str) -> str:
  import onebit_optax  # pylint: disable=import-outside-toplevel
  module = getattr(getattr(onebit_optax, name), "__module__", "") or ""
  short = module.rsplit(".", 1)[-1]
  for key, title in API_SECTIONS:
    if short == key:
      return title
  return short.strip("_").replace("_", " ").capitalize() or "Other"


def api_index() -> str:
  """The API index page: an autosummary table per section, every public name once."""
  order = [title for _, title in API_SECTIONS]
  sections: dict[str, list[str]] = {}
  for name in public_names():
    sections.setdefault(_section_of(name), []).append(name)
  titles = sorted(sections, key=lambda t: (order.index(t) if t in order else len(order), t))
  lines = [
      "# API reference", "",
      "Every public name of `onebit_optax` (its `__all__`), from the docstrings. "
      "This page is generated by `docs/_ext/onebit_docs.py` at build time.", "",
      "```{eval-rst}", ".. currentmodule:: onebit_optax", "```", ""]
  for title in titles:
    lines += [f"## {title}", "", "```{eval-rst}", ".. autosummary::", "   :toctree: generated",
              ""]
    lines += [f"   {name}" for name in sorted(sections[title], key=str.lower)]
    lines += ["```", ""]
  lines += [
      "## The launcher", "",
      "`onebit_optax.launch` starts N local processes for `jax.distributed` "
      "(see {doc}`/guides/multihost`).", "",
      "```{eval-rst}", ".. automodule:: onebit_optax.launch", "   :members: initialize",
      "```", ""]
  return "\n".join(lines)


# ----------------------------------------------------------------------------
# The Results pages.


def result_names() -> list[str]:
  """The results files that get a page (excerpts excluded)."""
  return sorted(p.stem for p in RESULTS.glob("*.md")
                if not any(p.stem.endswith(suffix) for suffix in EXCERPTS))


def renumber_headings(text: str, top: int = 2) -> str:
  """Renumbers markdown headings so they nest from level ``top`` with no level skipped."""
  stack: list[int] = []
  out = []
  in_code = False
  for line in text.splitlines():
    if line.startswith("```"):
      in_code = not in_code
    match = None if in_code else re.match(r"^(#{1,6}) (.*)$", line)
    if match:
      level = len(match.group(1))
      while stack and stack[-1] >= level:
        stack.pop()
      stack.append(level)
      line = "#" * min(top + len(stack) - 1, 6) + " " + match.group(2)
    out.append(line)
  return "\n".join(out)


def _mark_tables(text: str) -> str:
  """Gives every table the class ``onebit-results`` (one line per cell, scrolled: custom.css)."""
  out, previous = [], ""
  for line in text.splitlines():
    if line.startswith("|") and not previous.startswith("|"):
      if previous.strip():
        out.append("")
      out.append("{.onebit-results}")
    out.append(line)
    previous = line
  return "\n".join(out)


def _last_commit(path: Path) -> str:
  """`` (committed in abc1234, 2026-12-01)``, or '' outside a git checkout."""
  import subprocess  # pylint: disable=import-outside-toplevel
  try:
    out = subprocess.run(["git", "log", "-1", "--format=%h, %cs", "--", str(path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=30, check=True).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return ""
  return f" (committed in {out})" if out else ""


def _first_heading(text: str) -> str | None:
  match = re.search(r"^#{1,6} (.*)$", text, flags=re.M)
  return match.group(1).strip() if match else None


def _script_of(name: str) -> str:
  """The benchmark that writes NAME.md: the longest prefix of NAME (at '_') with a script."""
  parts = name.split("_")
  for end in range(len(parts), 0, -1):
    stem = "_".join(parts[:end])
    if (ROOT / "benchmarks" / f"{stem}.py").exists():
      return stem
  raise ValueError(f"no benchmarks/*.py writes benchmarks/results/{name}.md: name the results "
                   "file after its script (NAME or NAME_suffix)")


def result_page(name: str) -> str:
  """The page of ``benchmarks/results/NAME.md``: title, intro, source line, the file."""
  text = (RESULTS / f"{name}.md").read_text(encoding="utf-8").strip()
  heading = _first_heading(text)
  title = RESULT_TITLES.get(name)
  if title is None and heading is not None and text.startswith("#"):
    title, text = heading, text.split("\n", 1)[1] if "\n" in text else ""
  title = title or heading or name.replace("_", " ")
  text = re.sub(rf"^!\[[^\]]*\]\({re.escape(name)}\.png\)[ \t]*$", "", text, flags=re.M)
  nested = renumber_headings(text)
  split = split_wide_tables(nested)
  body = _mark_tables(split)
  lines = [f"# {title}", ""]
  if name in RESULT_INTROS:
    lines += [RESULT_INTROS[name], ""]
  png = RESULTS / f"{name}.png"
  if png.exists():  # first, with a caption (the file's own image line, if any, is dropped)
    # Scaled by a width, Sphinx links the image to its full size (html_scaled_image_link).
    lines += [f":::{{figure}} {name}.png", f":alt: {title}", ":width: 100%", "",
              figure_caption(name), ":::", ""]
  script = _script_of(name)
  committed = _last_commit(RESULTS / f"{name}.md")
  lines += [
      f"*Generated from `benchmarks/results/{name}.md`, written by "
      f"`benchmarks/{script}.py`{committed}. Below, as the benchmark wrote it: its command "
      "and, for timed runs, the commit, machine and load"
      + ("; tables wider than the page split in pieces, each repeating the first column"
         if split != nested else "") + ".*", "", body, ""]
  return "\n".join(lines)


# The caption of each benchmark's figure (shown first on its page, full width; a click opens it).
FIGURE_CAPTIONS = {
    "convergence": (
        "One row per task. Left: validation loss over the run, mean over the evaluation seeds "
        "(dashed: the failing references). Middle: final validation loss against the peak "
        "learning rate on the selection seeds. Right: the L1 norm of Adam's bias-corrected "
        "variance over the run, with the learning-rate warmup (dashed) and where the default "
        "freeze rule fired (dotted)."),
    "comm_throughput": (
        "Left: steps per second of each optimizer and phase. Right: the bytes each rank sent "
        "per step, read on the network interfaces."),
    "data_shift": (
        "Validation loss of the char GPT over the run, one line per seed; the data changes "
        "from prose to Python source at the dotted line."),
    "scaling_model": (
        "The model's throughput against Adam's after the freeze, by number of ranks, one panel "
        "per model size (a model with an assumed GPU compute, not a measurement)."),
}


def figure_caption(name: str) -> str:
  """The caption of NAME.png: its own, or that of the benchmark it is a variant of."""
  for key in sorted(FIGURE_CAPTIONS, key=len, reverse=True):
    if name == key or name.startswith(key + "_"):
      return FIGURE_CAPTIONS[key]
  return f"The figure `benchmarks/{_script_of(name)}.py` drew from these results."


MAX_COLUMNS = 9  # a wider results table is split into pieces that fit the page


def split_wide_tables(text: str, max_columns: int = MAX_COLUMNS) -> str:
  """Splits each markdown table wider than ``max_columns`` into pieces of at most that many
  columns, each repeating the first column (what a row is about), one after the other."""
  out, table = [], []

  def flush():
    cells = [[c.strip() for c in row.strip().strip("|").split("|")] for row in table]
    width = len(cells[0]) if cells else 0
    if width <= max_columns or any(len(c) != width for c in cells):
      out.extend(table)
    else:
      for start in range(1, width, max_columns - 1):
        columns = [0] + list(range(start, min(start + max_columns - 1, width)))
        if start > 1:
          out.append("")
        out.extend("| " + " | ".join(row[i] for i in columns) + " |" for row in cells)
    table.clear()

  for line in text.splitlines():
    if line.startswith("|"):
      table.append(line)
      continue
    if table:
      flush()
    out.append(line)
  if table:
    flush()
  return "\n".join(out)


# The order of the Results toctree; other results pages follow alphabetically.
RESULT_ORDER = ("convergence", "frontier", "comm_throughput", "comm_throughput_rates",
                "comm_throughput_hier", "scaling_model", "bounded_update", "wire_overhead", "optimizer_compute",
                "compile_time", "digits_gap", "convergence_quick")


def results_toctree(names: list[str]) -> str:
  """The toctree of the Results pages (included by ``results/index.md``)."""
  ordered = sorted(names, key=lambda n: (RESULT_ORDER.index(n) if n in RESULT_ORDER
                                         else len(RESULT_ORDER), n))
  return "\n".join(["```{toctree}", ":maxdepth: 1", ""] + [f"generated/{n}" for n in ordered]
                   + ["```", ""])


def headline_summary() -> str:
  """The README's summary table (``benchmarks/update_readme.py``), linking to the pages here."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import update_readme  # pylint: disable=import-outside-toplevel
  return update_readme.summary(link=lambda name: f"[{name}](generated/{name}.md)")


# ----------------------------------------------------------------------------
# The examples page.


def example_names() -> list[str]:
  """The runnable scripts of ``examples/`` (private helpers excluded)."""
  return sorted(p.stem for p in (ROOT / "examples").glob("*.py") if not p.stem.startswith("_"))


def docstring_markdown(doc: str) -> str:
  """A script's reST docstring as MyST markdown: ``x`` as `x`, indented blocks as code."""
  out, block, previous = [], [], ""

  def flush():
    if block:
      body = textwrap.dedent("\n".join(block)).strip("\n")
      language = "bash" if re.match(r"(python3? |\$ )", body) else "text"
      out.extend([f"```{language}", body, "```", ""])
      block.clear()

  for line in doc.splitlines():
    indented = line.startswith("    ") and line.strip()
    in_list = bool(re.match(r"^\s*(\d+\.|[-*]) ", previous)) or (previous.startswith("   ") and not block)
    if indented and (block or (not previous.strip() and not in_list)):
      block.append(line)
      continue
    if block and not line.strip():
      block.append(line)
      continue
    flush()
    out.append(re.sub(r"``([^`]+)``", r"`\1`", line))
    previous = line
  flush()
  return "\n".join(out).strip()


def examples_page() -> str:
  """One section per script of ``examples/``: its docstring (how to run it), then its source."""
  import ast  # pylint: disable=import-outside-toplevel
  lines = ["# Examples", "",
           "The scripts in `examples/`, each a complete training run on data that ships with "
           "Python or scikit-learn (nothing is downloaded). This page is generated from the "
           "files themselves.", ""]
  for name in example_names():
    path = ROOT / "examples" / f"{name}.py"
    module = ast.parse(path.read_text(encoding="utf-8"))
    doc = ast.get_docstring(module) or ""
    summary, _, rest = doc.partition("\n")
    body = module.body[0]
    first = body.end_lineno + 1 if doc else 1  # the source after the docstring shown above
    lines += [f"## `examples/{name}.py`", "", docstring_markdown(summary), "",
              docstring_markdown(rest), "",
              "```{literalinclude} " + f"../../examples/{name}.py", ":language: python",
              f":lines: {first}-", ":lineno-match:", "```", ""]
  return "\n".join(lines)


# ----------------------------------------------------------------------------
# Writing the generated sources.


def _write(path: Path, text: str) -> None:
  """Writes only when the text changed (Sphinx rebuilds what is newer)."""
  path.parent.mkdir(parents=True, exist_ok=True)
  if not path.exists() or path.read_text(encoding="utf-8") != text:
    path.write_text(text, encoding="utf-8")


def _copy(src: Path, dst: Path) -> None:
  dst.parent.mkdir(parents=True, exist_ok=True)
  if not dst.exists() or dst.read_bytes() != src.read_bytes():
    shutil.copyfile(src, dst)


def _excerpt(name: str, command: str) -> str:
  """``benchmarks/results/NAME.md`` with its headings nested under a guide's section."""
  path = RESULTS / f"{name}.md"
  if not path.exists():
    return f"_Not generated yet: run `{command}`._"
  return renumber_headings(path.read_text(encoding="utf-8"), top=3)


def generate(docs: Path) -> None:
  """Writes the generated sources under the docs source folder ``docs``."""
  _write(docs / "api" / "index.md", api_index())
  # autosummary writes a stub per public name and never deletes one: a name gone from
  # __all__ would leave a page outside every toctree (a warning, so a failed build).
  public = set(public_names())
  for stub in (docs / "api" / "generated").glob("onebit_optax.*.rst"):
    if stub.stem.split(".", 1)[1] not in public:
      stub.unlink()
  _write(docs / "examples" / "index.md", examples_page())
  out = docs / "results" / "generated"
  names = result_names()
  for name in names:
    _write(out / f"{name}.md", result_page(name))
  for png in RESULTS.glob("*.png"):
    _copy(png, out / png.name)
  for stale in out.glob("*.md"):
    if stale.stem not in names:
      stale.unlink()
  # Included by hand-written pages: a suffix Sphinx does not read as a page.
  _write(out / "toctree.inc", results_toctree(names))
  _write(out / "summary.inc", headline_summary() + "\n")
  # Excerpts of the convergence results for the freeze and the 0/1 Adam guides.
  for name, inc in (("convergence_freeze", "freeze_study"),
                    ("convergence_zero_one_summary", "zero_one_study")):
    _write(docs / "guides" / "generated" / f"{inc}.inc",
           _excerpt(name, "python benchmarks/convergence.py") + "\n")
  # Its links into the repository's docs/ point at the pages beside it on the site.
  notebook = (NOTEBOOK.read_text(encoding="utf-8").replace("](../README.md)", "](../index.md)")
              .replace("](../docs/", "](../"))
  _write(docs / "notebooks" / NOTEBOOK.name, notebook)


# ----------------------------------------------------------------------------
# NamedTuple fields: their source comments as docstrings.


def _field_comments(cls) -> dict[str, str]:
  try:
    source = inspect.getsource(cls)
  except (OSError, TypeError):
    return {}
  return {m.group(1): m.group(2).strip()
          for m in re.finditer(r"^\s+(\w+): [^#\n]+#\s*(.+)$", source, flags=re.M)}


def _field_docstring(app, what, name, obj, options, lines):
  del app, obj, options
  if what != "attribute" or not lines or not lines[0].startswith("Alias for field number"):
    return
  owner, _, field = name.rpartition(".")
  module, _, cls_name = owner.rpartition(".")
  cls = getattr(sys.modules.get(module), cls_name, None)
  comment = _field_comments(cls).get(field) if cls is not None else None
  if comment:
    lines[:] = [comment.replace("*", r"\*")]


# ----------------------------------------------------------------------------
# Code that names an API links to it: `onebit_adam(...)` in a guide links to its
# API page, `optax.adam` to optax's (the inventories in docs/_inventories).

# The module names pages use in code, and the library each stands for.
MODULE_ALIASES = {
    "onebit_optax": "onebit_optax", "jax": "jax", "jnp": "jax.numpy", "lax": "jax.lax",
    "optax": "optax", "flax": "flax", "nnx": "flax.nnx", "orbax": "orbax",
    "ocp": "orbax.checkpoint", "numpy": "numpy", "np": "numpy",
}
# A dotted name, not an attribute (after "."), a keyword argument ("name=") or a string.
_NAME = re.compile(r"(?<![\w.'\"])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?![\w'\"]|=(?!=))")


def _external_names() -> frozenset[str]:
  """The library names the shipped inventories hold (docs/_inventories/make_inventories.py)."""
  sys.path.insert(0, str(ROOT / "docs" / "_inventories"))
  import make_inventories  # pylint: disable=import-outside-toplevel
  return frozenset(line.split()[0] for library in make_inventories.TABLE
                   for line in make_inventories.entries(library))


def link_target(name: str, public: frozenset[str], external: frozenset[str]) -> str | None:
  """What the code ``name`` refers to (``onebit_optax.X`` or a library's name), or None."""
  head, _, rest = name.partition(".")
  if not rest:
    return f"onebit_optax.{name}" if name in public else None
  if head not in MODULE_ALIASES:
    return None
  full = f"{MODULE_ALIASES[head]}.{rest}"
  if head == "onebit_optax":
    return full if rest in public else None
  return full if full in external else None


def code_links(text: str, public: frozenset[str], external: frozenset[str]):
  """``(start, end, target)`` of every name in the code ``text`` that has an API entry."""
  for match in _NAME.finditer(text):
    target = link_target(match.group(1), public, external)
    if target:
      yield match.start(1), match.end(1), target


def _link_code(app, doctree) -> None:
  """Turns the API names in each inline code of a page into links (api/ pages excepted).

  Code marked ``{.field}`` names a state or status field (`freeze_step`{.field}), not the
  function of the same name, and stays as it is.
  """
  from docutils import nodes  # pylint: disable=import-outside-toplevel
  from sphinx import addnodes  # pylint: disable=import-outside-toplevel
  docname = app.env.docname
  if docname.startswith("api/"):
    return
  public, external = frozenset(public_names()), _external_names()
  for literal in list(doctree.findall(nodes.literal)):
    if "field" in literal["classes"] or any(
        isinstance(a, (nodes.reference, addnodes.pending_xref, nodes.title))
        for a in _ancestors(literal)):
      continue
    text = literal.astext()
    links = list(code_links(text, public, external))
    if not links:
      continue
    linked, position = nodes.literal(literal.rawsource, "", classes=literal["classes"]), 0
    for start, end, target in links:
      if start > position:
        linked += nodes.Text(text[position:start])
      linked += addnodes.pending_xref(
          "", nodes.inline(text[start:end], text[start:end]), refdomain="py", reftype="obj",
          reftarget=target, refexplicit=True, refwarn=True, refdoc=docname)
      position = end
    if position < len(text):
      linked += nodes.Text(text[position:])
    literal.replace_self(linked)


def _ancestors(node):
  while node.parent is not None:
    node = node.parent
    yield node


def _public_type(app, env, node, contnode):
  """Resolves a signature's private type path (``jax._src.mesh.Mesh``) as its public name."""
  public = app.config.onebit_public_types.get(node.get("reftarget"))
  if public is None:
    return None
  from sphinx.ext import intersphinx  # pylint: disable=import-outside-toplevel
  node["reftarget"] = public
  return intersphinx.missing_reference(app, env, node, contnode)


def _alias_signature(app, what, name, obj, options, signature, return_annotation):
  """``Optional[alias]`` shows the alias, not Sphinx's ``TypeAliasForwardRef('alias')``."""
  del app, what, name, obj, options
  unwrap = lambda text: text and re.sub(r"TypeAliasForwardRef\('([\w.]+)'\)", r"\1", text)
  return unwrap(signature), unwrap(return_annotation)


def setup(app):
  app.add_config_value("onebit_public_types", {}, "env")
  app.connect("autodoc-process-signature", _alias_signature)
  app.connect("autodoc-process-docstring", _field_docstring)
  app.connect("doctree-read", _link_code)
  app.connect("missing-reference", _public_type, priority=400)
  return {"parallel_read_safe": True, "parallel_write_safe": True}


if __name__ == "__main__":
  generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs")
