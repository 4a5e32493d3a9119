"""The vLLM command line saltgate expects: docs/deployment.md shows exactly the one in
saltgate.audit.vllm_line (the conformance suite starts real vLLM with that one)."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from saltgate.audit.vllm_line import (
    API_KEY,
    HASH_ALGO,
    PREFIX_CACHING,
    PROMPT_TOKENS_DETAILS,
    VLLM_SERVE,
    vllm_serve_argv,
)

pytestmark = pytest.mark.unit

DEPLOYMENT_MD = Path(__file__).resolve().parents[2] / "docs" / "deployment.md"
FENCED = re.compile(r"^```sh\n(.*?)^```", re.MULTILINE | re.DOTALL)


def serve_blocks(markdown: str) -> list[list[str]]:
    """Every ```sh block of the page that runs `vllm serve`, as the shell splits it."""
    blocks = [shlex.split(b.replace("\\\n", " ")) for b in FENCED.findall(markdown)]
    return [b for b in blocks if b[:2] == ["vllm", "serve"]]


def test_deployment_md_shows_exactly_the_expected_line() -> None:
    assert serve_blocks(DEPLOYMENT_MD.read_text()) == [list(VLLM_SERVE)]
    # the comparison sees a changed flag: the same page with one flag dropped differs
    drifted = DEPLOYMENT_MD.read_text().replace(" " + PROMPT_TOKENS_DETAILS, "", 1)
    assert serve_blocks(drifted) != [list(VLLM_SERVE)]


def test_the_line_carries_every_flag_the_audit_names() -> None:
    flags = {word.split("=", 1)[0] for word in VLLM_SERVE}
    for flag in (API_KEY, PREFIX_CACHING, HASH_ALGO, PROMPT_TOKENS_DETAILS, "--host"):
        assert flag in flags


def test_filling_in_the_line() -> None:
    values = {"MODEL": "/m", "HOST": "127.0.0.1", "PORT": "8123", "API_KEY": "k"}
    argv = vllm_serve_argv(values, executable="/venv/bin/vllm")
    assert argv[:3] == ["/venv/bin/vllm", "serve", "/m"]
    assert argv[argv.index("--port") + 1] == "8123"
    assert f"{API_KEY}=k" in argv
    assert not any("$" in word for word in argv)
    with pytest.raises(KeyError, match="API_KEY"):
        vllm_serve_argv({k: v for k, v in values.items() if k != "API_KEY"})


def test_a_key_beginning_with_a_dash_is_read_as_the_key() -> None:
    """One random key in 64 (`secrets.token_urlsafe`) begins with `-`: as a word of its own
    after `--api-key`, vLLM's argparse takes it for an option and refuses to start (the
    conformance fleet failed so, 2026-12-02). Joined by `=` it is the flag's value."""
    values = {"MODEL": "/m", "HOST": "127.0.0.1", "PORT": "8123", "API_KEY": "-k_1"}
    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument(API_KEY, nargs="+")  # as vLLM declares it: one key or more
    parser.add_argument("rest", nargs="*")
    parsed, _ = parser.parse_known_args(vllm_serve_argv(values)[2:])
    assert parsed.api_key == ["-k_1"]
    # the control: the same key as a word of its own is refused
    with pytest.raises(argparse.ArgumentError, match="expected at least one argument"):
        parser.parse_known_args([API_KEY, "-k_1"])
