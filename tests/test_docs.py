"""Every public name is documented in optax's template; the doctests themselves run via --doctest-modules."""

import inspect

import pytest

import onebit_optax

# The names that carry the algorithm: these also need the math and references.
ALGORITHMIC = {
    "onebit_adam", "scale_by_onebit_adam", "sign_compress", "sign_decompress",
    "compressed_mean", "compressed_wire_bytes", "allreduce_wire_bytes",
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
