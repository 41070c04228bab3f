"""Runnable training examples; importable so tests and benchmarks can reuse the models."""
