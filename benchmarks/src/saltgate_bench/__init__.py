"""Benchmarks (docs/benchmarks.md), each a `saltgate-bench NAME` command (cli.py)."""
