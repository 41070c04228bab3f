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
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",
    "sphinx_copybutton",
    "onebit_docs",  # generated pages: API index from __all__, Results, the notebook
    "onebit_mathml",  # math as MathML at build time: no script, no network
]

exclude_patterns = ["_build", "_ext", "_inventories", "**/generated/*.inc", "**.ipynb_checkpoints"]
templates_path = ["_templates"]

# MyST: $...$ math, ::: fences, {.class} on blocks, anchors for "page.md#section" links.
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist", "attrs_block", "attrs_inline"]
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

# Cross-references: every reference into onebit_optax must resolve, and so must every
# reference into jax, optax, flax, orbax and numpy, against their inventories shipped
# in _inventories/ (written by _inventories/make_inventories.py: the build is offline).
nitpicky = True
intersphinx_mapping = {
    name: (url, str(DOCS / "_inventories" / f"{name}.inv"))
    for name, url in (("jax", "https://docs.jax.dev/en/latest/"),
                      ("optax", "https://optax.readthedocs.io/en/latest/"),
                      ("flax", "https://flax.readthedocs.io/en/latest/"),
                      ("orbax", "https://orbax.readthedocs.io/en/latest/"),
                      ("numpy", "https://numpy.org/doc/stable/"))
}
# Signatures name types by the module that defines them; link them to the public name.
onebit_public_types = {
    "jax.jaxlib._jax.Array": "jax.Array",
    "jaxlib._jax.Array": "jax.Array",
    "jax._src.mesh.Mesh": "jax.sharding.Mesh",
    "optax._src.base.GradientTransformationExtraArgs": "optax.GradientTransformationExtraArgs",
    "optax._src.base.GradientTransformation": "optax.GradientTransformation",
}
# learning_rate's type as written, not its expansion (optax's docs have no entry for it).
autodoc_type_aliases = {"optax.ScalarOrSchedule": "optax.ScalarOrSchedule"}
nitpick_ignore_regex = [
    (r"py:.*", r"(jaxlib|chex|typing|collections"
     r"|types|abc|enum|dataclasses|functools|os|subprocess|argparse)(\..*)?"),
    (r"py:.*", r"(Array|ArrayTree|PyTree|Params|Updates|OptState|Hashable|Sequence|Callable"
     r"|Mapping|Any|Optional|Union|NamedTuple|PartitionSpec|NamedSharding|Mesh|Sharding"
     r"|GradientTransformation|GradientTransformationExtraArgs|ScalarOrSchedule|Schedule"
     r"|DTypeLike|ArrayLike|ShapeDtypeStruct|Path|PathLike|CheckpointManager"
     r"|optax\.ScalarOrSchedule)"),
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

# Math: converted to MathML at build time (docs/_ext/onebit_mathml.py, the pinned
# math-core package), which browsers render natively: no MathJax, no CDN, no network.
html_math_renderer = "mathml"
