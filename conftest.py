"""Pytest setup shared by tests/ and the doctests: 8 simulated CPU devices, quick codegen.

The suite mostly compiles (each test builds its own small optimizer and step), and
much of XLA:CPU's compile time is LLVM optimizing the machine code of programs that
then run on a few thousand numbers. So by default the tests compile with LLVM's
optimizations off (``FAST_CODEGEN_FLAGS``, the flags of the ``FAST_CODEGEN`` compile
options that the tests inspecting HLO already used): about a third less time. XLA's
HLO passes (fusion, collectives, buffer assignment, the memory the tests measure)
run as always; the machine code differs, and with it float results in their last
bits (instruction selection, e.g. fused multiply-adds), which 1-bit Adam's sign
decisions can amplify. The assertions are tolerances against independent references
and bitwise checks between replicas of one program, which hold either way; CI's
second run (.ci/run) passes the whole suite with the default codegen too.
The subprocesses the tests start (the demo, the launcher, the getting-started page)
get the same flags (tests/_xla.py). To test the default codegen, set XLA_FLAGS
yourself, with the device count:
``XLA_FLAGS=--xla_force_host_platform_device_count=8 python3 dev.py test``.

Many tests compile the same program (the same optimizer on the same small tree and
step, built afresh in each test), and jit's cache is per function object. So the
run shares jax's persistent compilation cache (keyed on the program and the compile
options, debug locations stripped) in a fresh temporary directory of its own, made
here by the first process (pytest, or xdist's controller) and inherited by the
workers and the subprocesses the tests start; it is removed when that process
exits. (Multi-process runs on jax 0.12.1 do not use it: a program read back from
it hangs in a collective between processes; ``onebit_optax.launch.initialize``
turns it off there.) A later run starts cold again: the suite's time is a cold run's. Set
``JAX_COMPILATION_CACHE_DIR`` yourself to use another (e.g. to keep one).
"""

import atexit
import os
import shutil
import tempfile

# Off: LLVM's optimization passes on the generated code (not XLA's HLO passes).
FAST_CODEGEN_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"

# Must happen before JAX creates its CPU backend (i.e. before any jax import in a test).
os.environ.setdefault("XLA_FLAGS",
                      f"--xla_force_host_platform_device_count=8 {FAST_CODEGEN_FLAGS}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _CACHE = tempfile.mkdtemp(prefix="onebit-optax-tests-jax-cache-")
  atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
  # Every program, however quick to compile (the default keeps those over a second).
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
