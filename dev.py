#!/usr/bin/env python3
"""One entry point that works on a fresh machine with only Python >= 3.10.

    python3 dev.py demo [ARGS...]   # the main job: Adam vs 1-bit Adam on 8 simulated CPU devices
    python3 dev.py test [ARGS...]   # the test suite (pytest; extra ARGS are passed on)
    python3 dev.py env              # only create/refresh the virtual environment (.venv)

The first call creates `.venv` and installs the package with its test and example
extras; later calls reuse it (it is refreshed when pyproject.toml changes).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = Path(os.environ.get("ONEBIT_VENV", ROOT / ".venv"))
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / ("python.exe" if os.name == "nt" else "python")


def _ensure_env() -> None:
  if sys.version_info < (3, 10):
    sys.exit(f"onebit-optax needs Python >= 3.10, this is {sys.version.split()[0]}.")
  stamp = VENV / ".onebit-installed"
  digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
  if stamp.exists() and stamp.read_text() == digest and PY.exists():
    return
  if not PY.exists():
    print(f"[dev.py] creating virtual environment in {VENV}", flush=True)
    venv.EnvBuilder(with_pip=True).create(VENV)
  print("[dev.py] installing onebit-optax with its test and example extras", flush=True)
  subprocess.check_call([str(PY), "-m", "pip", "install", "--quiet", "--upgrade", "pip"])
  subprocess.check_call(
      [str(PY), "-m", "pip", "install", "--quiet", "-e", f"{ROOT}[test,examples]"])
  subprocess.check_call([str(PY), "-m", "ipykernel", "install", "--sys-prefix", "--name",
                         "python3"], stdout=subprocess.DEVNULL)
  stamp.write_text(digest)


def main(argv: list[str]) -> int:
  if not argv or argv[0] not in ("demo", "test", "env"):
    print(__doc__)
    return 2
  _ensure_env()
  command, rest = argv[0], argv[1:]
  if command == "env":
    return 0
  if command == "demo":
    args = [str(PY), str(ROOT / "examples" / "demo.py"), *rest]
  else:
    args = [str(PY), "-m", "pytest", *rest]
  return subprocess.call(args, cwd=ROOT)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
