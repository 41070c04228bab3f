#!/usr/bin/env python3
"""One entry point that works on a fresh machine with only Python >= 3.11.

    python3 dev.py demo [ARGS...]   # the main job: Adam vs 1-bit Adam on 8 simulated CPU devices
    python3 dev.py test [ARGS...]   # the test suite (pytest; extra ARGS are passed on;
                                    # -m '' adds the few tests marked slow, as CI does;
                                    # one worker per core, a test file per worker: -n 0 for one)
    python3 dev.py docs [ARGS...]   # the docs site into docs/_build/html (warnings are errors)
    python3 dev.py env              # only create/refresh the virtual environment

    python3 dev.py --python python3.12 test   # the same, in a venv of another interpreter

The first call creates a virtual environment and installs the package (editable)
with its test, example and dev (build, twine) extras, at the newest versions pip
resolves for that interpreter; `docs` adds the docs extra (Sphinx). Later calls
reuse it (it is refreshed when pyproject.toml changes).
The venv is `.venv` for the interpreter that runs dev.py, and `.venv-pyX.Y` for
an interpreter given with `--python` (or the ONEBIT_PYTHON environment
variable), so each Python version keeps its own. ONEBIT_VENV overrides the
directory.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
COMMANDS = ("demo", "test", "docs", "env")
MIN_PYTHON = (3, 11)
EXTRAS = "test,examples,dev"
DOCS_EXTRAS = EXTRAS + ",docs"
# Sphinx: warnings are errors (all of them reported), every cross-reference checked.
SPHINX_ARGS = ("-W", "--keep-going", "-n", "-q", "-b", "html")


def _bin(venv: Path, name: str) -> Path:
  return venv / ("Scripts" if os.name == "nt" else "bin") / (
      f"{name}.exe" if os.name == "nt" else name)


def _interpreter_version(python: list[str]) -> tuple[int, int]:
  """The (major, minor) version of ``python`` (a command line), or exits with a clear message."""
  try:
    out = subprocess.run([*python, "-c", "import sys; print(*sys.version_info[:2])"],
                         capture_output=True, text=True, check=True).stdout
  except (OSError, subprocess.CalledProcessError) as e:
    detail = getattr(e, "stderr", None) or e
    sys.exit(f"[dev.py] cannot run the interpreter {shlex.join(python)!r}: {detail}")
  major, minor = (int(x) for x in out.split())
  return major, minor


def _venv_for(python: list[str] | None) -> tuple[Path, list[str]]:
  """The venv directory and the interpreter command that creates it."""
  if python is None:
    version, python = sys.version_info[:2], [sys.executable]
    default = ROOT / ".venv"
  else:
    version = _interpreter_version(python)
    default = ROOT / f".venv-py{version[0]}.{version[1]}"
  if version < MIN_PYTHON:
    sys.exit(f"onebit-optax needs Python >= 3.11, {shlex.join(python)} is "
             f"{version[0]}.{version[1]}.")
  return Path(os.environ.get("ONEBIT_VENV", default)), python


def _installed(stamp: Path, digest: str) -> set[str]:
  """The extras the stamp says were installed for this pyproject.toml (empty: none)."""
  if not stamp.exists():
    return set()
  recorded, _, extras = stamp.read_text().partition(" ")
  return set(extras.split(",")) if recorded == digest else set()


def _ensure_env(venv: Path, python: list[str], extras: str = EXTRAS) -> Path:
  """Creates/refreshes ``venv`` with ``python`` and ``extras``; returns the venv's interpreter."""
  py = _bin(venv, "python")
  stamp = venv / ".onebit-installed"
  digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
  installed = _installed(stamp, digest)
  if set(extras.split(",")) <= installed and py.exists():
    return py
  if not py.exists():
    print(f"[dev.py] creating virtual environment in {venv} ({shlex.join(python)})", flush=True)
    subprocess.check_call([*python, "-m", "venv", str(venv)])
  extras = ",".join(sorted(installed | set(extras.split(","))))  # keep what was there
  print(f"[dev.py] installing onebit-optax with its extras [{extras}] into {venv}", flush=True)
  subprocess.check_call([str(py), "-m", "pip", "install", "--quiet", "--upgrade", "pip"])
  subprocess.check_call(
      [str(py), "-m", "pip", "install", "--quiet", "-e", f"{ROOT}[{extras}]"])
  subprocess.check_call([str(py), "-m", "ipykernel", "install", "--sys-prefix", "--name",
                         "python3"], stdout=subprocess.DEVNULL)
  stamp.write_text(f"{digest} {extras}")
  return py


def _parse(argv: list[str]) -> tuple[list[str] | None, list[str]]:
  """Splits off a leading ``--python CMD`` / ``--python=CMD``; returns (python, rest)."""
  python = os.environ.get("ONEBIT_PYTHON") or None
  if argv and argv[0].startswith("--python"):
    if argv[0] == "--python" and len(argv) > 1:
      python, argv = argv[1], argv[2:]
    elif argv[0].startswith("--python="):
      python, argv = argv[0].split("=", 1)[1], argv[1:]
    else:
      return None, []
  return (shlex.split(python) if python else None), argv


def main(argv: list[str]) -> int:
  python, argv = _parse(argv)
  if not argv or argv[0] not in COMMANDS:
    print(__doc__)
    return 2
  command, rest = argv[0], argv[1:]
  py = _ensure_env(*_venv_for(python), DOCS_EXTRAS if command == "docs" else EXTRAS)
  if command == "env":
    return 0
  if command == "demo":
    args = [str(py), str(ROOT / "examples" / "demo.py"), *rest]
  elif command == "docs":
    out = ROOT / "docs" / "_build" / "html"
    args = [str(py), "-m", "sphinx", *SPHINX_ARGS, *rest, str(ROOT / "docs"), str(out)]
    status = subprocess.call(args, cwd=ROOT)
    if status == 0:
      print(f"[dev.py] docs built: {out / 'index.html'}", flush=True)
    return status
  else:
    args = [str(py), "-m", "pytest", *_workers(rest), *rest]
  return subprocess.call(args, cwd=ROOT)


def _workers(rest: list[str]) -> list[str]:
  """pytest-xdist options: one worker per core (at most 4), each test file on one worker.

  The suite mostly compiles, one XLA compilation at a time per process, so a
  worker per core runs it about twice as fast on 2 cores; a file stays on one
  worker so its module-level fixtures compile once. Given ``-n`` (``-n 0``: no
  workers) or ``-p no:xdist``, pytest gets what was given.
  """
  given = any(a in ("-n", "--numprocesses", "no:xdist") or a.startswith(("-n", "--numprocesses="))
              for a in rest)
  return [] if given else ["-n", str(min(os.cpu_count() or 1, 4)), "--dist", "loadfile"]


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
