"""XLA_FLAGS for the subprocesses the tests start: this session's flags, another device count.

conftest.py sets the session's flags (8 simulated devices, LLVM's optimizations off:
see its docstring); a subprocess gets the same codegen flags with its own count.
"""

import os
import re

_COUNT = re.compile(r"\s*--xla_force_host_platform_device_count=\d+")


def flags(devices=None):
  """This session's XLA_FLAGS with ``devices`` simulated CPU devices (None: no count)."""
  flags = _COUNT.sub("", os.environ.get("XLA_FLAGS", "")).strip()
  if devices is not None:
    flags = f"--xla_force_host_platform_device_count={devices} {flags}".strip()
  return flags
