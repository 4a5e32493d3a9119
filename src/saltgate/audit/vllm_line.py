"""The vLLM command line saltgate expects of every replica, in one place.

docs/deployment.md shows it (tests/audit/test_vllm_line.py checks the page says exactly
this), the conformance suite starts real vLLM with it (tests/conformance/fleet.py), and
`saltgate audit deployment` names these flags as the fix when a replica lacks one. Values
are shell variables, so the line can be pasted as it is and filled in by a test.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = [
    "API_KEY",
    "EXPECTED_HASH_ALGOS",
    "HASH_ALGO",
    "HOST",
    "PREFIX_CACHING",
    "PROMPT_TOKENS_DETAILS",
    "VLLM_SERVE",
    "vllm_serve_argv",
]

PROMPT_TOKENS_DETAILS = "--enable-prompt-tokens-details"
"""Without it vLLM reports no cached tokens, and every cached token is billed as uncached."""
PREFIX_CACHING = "--enable-prefix-caching"
"""vLLM's default for generation models, spelled out so no model or version turns it off."""
HASH_ALGO = "--prefix-caching-hash-algo"
EXPECTED_HASH_ALGOS = ("sha256", "sha256_cbor")
"""Collision-resistant block hashes: the ones the derivations and the simulator compute."""
API_KEY = "--api-key"
HOST = "--host"

VLLM_SERVE: tuple[str, ...] = (
    "vllm", "serve", "$MODEL",
    HOST, "$HOST", "--port", "$PORT",
    f"{API_KEY}=$API_KEY",
    PREFIX_CACHING, HASH_ALGO, EXPECTED_HASH_ALGOS[0],
    PROMPT_TOKENS_DETAILS,
)  # fmt: skip
"""`vllm serve` and saltgate's flags. $HOST is the replica's private address (never
0.0.0.0: vLLM binds every interface by default), $API_KEY the secret in the gateway's
`[[replicas]] api_key_file`, joined to its flag by `=`: a random key may begin with `-`,
which `--api-key KEY` would take for another option and refuse to start."""

_VARIABLE = re.compile(r"\$([A-Z_]+)")


def vllm_serve_argv(values: Mapping[str, str], executable: str = "vllm") -> list[str]:
    """The argv with every $VARIABLE filled in from ``values`` (all must be given)."""
    missing = sorted({n for word in VLLM_SERVE for n in _VARIABLE.findall(word)} - set(values))
    if missing:
        raise KeyError(f"no value for {', '.join(missing)}")
    argv = [_VARIABLE.sub(lambda m: values[m.group(1)], word) for word in VLLM_SERVE]
    return [executable, *argv[1:]]
