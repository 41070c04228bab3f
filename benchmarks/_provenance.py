"""Where a benchmark's numbers come from: the commit of the checkout that ran it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def git_commit() -> str:
  """Short commit of the checkout, with '+ uncommitted onebit_optax changes' if any."""
  try:
    run = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True,
                                    cwd=HERE, check=True).stdout.strip()
    dirty = run("status", "--porcelain", "--", "../onebit_optax")
    commit = run("rev-parse", "--short", "HEAD") + (" + uncommitted onebit_optax changes"
                                                    if dirty else "")
  except (OSError, subprocess.CalledProcessError):
    commit = "unknown"
  return commit + _imported_elsewhere()


def _imported_elsewhere() -> str:
  """Says so when the onebit_optax that runs is not this checkout's (e.g. an old copy on PYTHONPATH)."""
  module = sys.modules.get("onebit_optax")
  if module is None or module.__file__ is None:
    return ""
  package = Path(module.__file__).resolve().parent
  if package == HERE.parent / "onebit_optax":
    return ""
  return f" (but onebit_optax imported from {package}, not from this checkout)"
