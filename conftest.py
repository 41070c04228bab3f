"""Pytest setup shared by tests/ and the doctests: 8 simulated CPU devices."""

import os

# Must happen before JAX creates its CPU backend (i.e. before any jax import in a test).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
