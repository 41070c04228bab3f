"""Where a benchmark's numbers come from: the commit of the checkout that ran it."""

from __future__ import annotations

import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent


def git_commit() -> str:
  """Short commit of the checkout, with '+ uncommitted onebit_optax changes' if any."""
  try:
    run = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True,
                                    cwd=HERE, check=True).stdout.strip()
    dirty = run("status", "--porcelain", "--", "../onebit_optax")
    return run("rev-parse", "--short", "HEAD") + (" + uncommitted onebit_optax changes" if dirty else "")
  except (OSError, subprocess.CalledProcessError):
    return "unknown"
