"""Benchmarks and load tools (e.g. `python -m saltgate.bench.overhead`: per-request overhead)."""
