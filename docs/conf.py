"""Sphinx configuration of the onebit-optax docs (optax's stack: book theme, MyST, autosummary).

Build: ``python3 dev.py docs`` (warnings are errors, cross-references checked).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(DOCS.parent))

import onebit_optax  # pylint: disable=wrong-import-position
import onebit_docs  # pylint: disable=wrong-import-position

# The generated sources (API index from __all__, Results pages, the notebook) are
# written before Sphinx looks for sources, so autosummary sees the API index.
onebit_docs.generate(DOCS)

project = "onebit-optax"
author = "onebit-optax authors"
copyright = "2026, onebit-optax authors"  # pylint: disable=redefined-builtin
release = version = onebit_optax.__version__

extensions = [
    "myst_nb",  # MyST markdown pages and the notebook (rendered from its stored outputs)
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "sphinx_copybutton",
    "onebit_docs",  # generated pages: API index from __all__, Results, the notebook
]

exclude_patterns = ["_build", "_ext", "**/generated/*.inc", "**.ipynb_checkpoints"]
templates_path = ["_templates"]

# MyST: $...$ math, ::: fences, {.class} on blocks, anchors for "page.md#section" links.
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist", "attrs_block"]
myst_heading_anchors = 4
# The committed notebook is stripped (tests/test_notebook.py), so the build runs it,
# once (a minute or two on 2 cores): jupyter-cache keeps the outputs until the
# notebook changes. An error in a cell fails the build. ONEBIT_DOCS_NB_EXECUTION=off
# renders it without outputs (CI does: tests/test_notebook.py runs it there already).
nb_execution_mode = os.environ.get("ONEBIT_DOCS_NB_EXECUTION", "cache")
nb_execution_timeout = 600
nb_execution_raise_on_error = True

# autodoc / autosummary: one page per public name, from its docstring.
autosummary_generate = True
autosummary_imported_members = True
autodoc_typehints = "signature"
autodoc_member_order = "bysource"
autodoc_default_options = {"exclude-members": "_asdict,_fields,_field_defaults,_make,_replace"}
add_module_names = False
toc_object_entries_show_parents = "hide"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# Cross-references: every reference into onebit_optax must resolve. Without
# network access there is no intersphinx inventory for the libraries the
# signatures and docstrings name, so references into them are not checked.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(jax|jaxlib|optax|chex|numpy|np|jnp|flax|nnx|orbax|ocp|typing|collections"
     r"|types|abc|enum|dataclasses|functools|os|subprocess|argparse)(\..*)?"),
    (r"py:.*", r"(Array|ArrayTree|PyTree|Params|Updates|OptState|Hashable|Sequence|Callable"
     r"|Mapping|Any|Optional|Union|NamedTuple|PartitionSpec|NamedSharding|Mesh|Sharding"
     r"|GradientTransformation|GradientTransformationExtraArgs|ScalarOrSchedule|Schedule"
     r"|DTypeLike|ArrayLike|ShapeDtypeStruct|Path|PathLike|CheckpointManager)"),
]
# Private names that public docstrings and signatures mention (not in __all__, so
# they have no page). Each is a candidate for export or for rewording its docstring.
nitpick_ignore = [
    ("py:class", "onebit_optax._layout.FlatLayout"),
    ("py:func", "error_sizes"),
    ("py:class", "onebit_optax._status.Status"),
    ("py:class", "Status"),
    ("py:func", "default_interval"),
]

# HTML: the theme of optax, flax and orbax.
html_theme = "sphinx_book_theme"
html_title = f"onebit-optax {version}"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_theme_options = {
    "show_toc_level": 2,
    "home_page_in_toc": True,
    "use_repository_button": False,
    "navigation_with_keys": False,
}
html_show_sourcelink = False

# MathJax 3 is loaded from its CDN (Sphinx's default). ONEBIT_DOCS_MATHJAX=<MathJax 3's
# es5/ folder> (e.g. from `npm pack mathjax@3`) serves it from _static instead, to
# read the math offline.
_local_mathjax = os.environ.get("ONEBIT_DOCS_MATHJAX")
if _local_mathjax:
  html_static_path.append(_local_mathjax)
  mathjax_path = "tex-mml-chtml.js"
