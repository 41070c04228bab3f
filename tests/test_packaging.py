"""Packaging and suite configuration: one version, and warnings from onebit_optax fail tests."""

import importlib.metadata
import re
import warnings
from pathlib import Path

import pytest

import onebit_optax

ROOT = Path(__file__).resolve().parents[1]


def _library_call_that_warns():
  """Stands in for a jax/optax/flax API that deprecates itself (warns at its caller)."""
  warnings.warn("this API is deprecated", DeprecationWarning, stacklevel=2)


def _call_from_module(module_name):
  # Code whose module is `module_name` calls the deprecated API: the warning is
  # attributed to that module, as it would be to onebit_optax/_onebit_adam.py.
  exec("call()", {"__name__": module_name, "call": _library_call_that_warns})


def test_a_warning_attributed_to_onebit_optax_fails_the_test():
  # pyproject.toml's filterwarnings = ["error:::onebit_optax"]: without it the
  # warning would only be recorded and this would not raise.
  with pytest.raises(DeprecationWarning, match="deprecated"):
    _call_from_module("onebit_optax._accessors")


def test_a_warning_attributed_to_other_code_only_warns():
  with warnings.catch_warnings(record=True) as caught:
    _call_from_module("some_user_script")
  assert [str(w.message) for w in caught] == ["this API is deprecated"]


def test_the_installed_version_is_the_package_version():
  # pyproject.toml reads the version from onebit_optax.__version__ (dynamic), so
  # the distribution metadata cannot disagree with it (after a version bump, an
  # editable install must be reinstalled: `pip install -e .`).
  assert importlib.metadata.version("onebit-optax") == onebit_optax.__version__


def test_the_changelog_starts_with_the_package_version():
  changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
  releases = re.findall(r"^## \[?(\d+\.\d+\.\d+[^\]\s]*)\]?", changelog, flags=re.M)
  assert releases and releases[0] == onebit_optax.__version__, releases[:3]
