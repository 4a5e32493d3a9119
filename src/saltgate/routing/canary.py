"""The isolation canary's core: what a run sends and what its answers prove (pure).

A run sends one fresh random prompt to one replica three times, one after the other, with
``max_tokens`` 1 (docs/canary.md):

1. under namespace A (a ``cache_salt`` made for this run only): fresh, it must miss;
2. under namespace B (another): the same prompt must report 0 cached tokens, else the
   replica's prefix cache is shared across namespaces (the salt is dropped or ignored);
3. under A again: it must hit, the positive control that the replica does cache and
   report it, so that the 0 of step 2 means something.

`judge` turns the three answers' cached-token counts into a `Verdict`: PASSED, FAILED (the
replica leaks: it is taken out of rotation) or INCONCLUSIVE (nothing was shown either way:
the replica reports no cached tokens, caches nothing, or evicted the prompt; it stays in
rotation and the result is shown). The namespaces are random per run, never a tenant's
salt, so a run can neither read nor warm any tenant's cache.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Final

PROMPT_WORDS: Final = 96
"""Random six-letter words per prompt: 96 tokens on the simulator's tokenizer (6 blocks
of 16), some 250 on a large BPE vocabulary, 530 on the conformance suite's tiny one
(16 blocks of 32): several of vLLM's blocks of 16 (GPU) or 32, at least one of 128 (its CPU
default), far below any context length and a small share of any KV pool."""
WORD_LETTERS: Final = 6
SALT_BYTES: Final = 18  # 24 base64url characters: vLLM takes at most 128, no '/' or '@'
ENTROPY_BYTES: Final = PROMPT_WORDS * WORD_LETTERS + 2 * SALT_BYTES
_LETTERS: Final = "abcdefghijklmnopqrstuvwxyz"
_SALT_ALPHABET: Final = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"


class Verdict(enum.Enum):
    PASSED = "pass"
    FAILED = "failure"
    INCONCLUSIVE = "inconclusive"


@dataclass(frozen=True, slots=True)
class Outcome:
    """A run's verdict and, for the operator, why (no prompt, no salt in it)."""

    verdict: Verdict
    reason: str


@dataclass(frozen=True, slots=True)
class CanaryRun:
    """What one run sends: a fresh prompt and its two namespaces (cache salts)."""

    prompt: str
    salt_a: str
    salt_b: str

    def body(self, model: str, salt: str) -> dict[str, Any]:
        """A /v1/completions request of this run's prompt under ``salt``."""
        return {
            "model": model,
            "prompt": self.prompt,
            "max_tokens": 1,
            "temperature": 0,
            "cache_salt": salt,
        }


def new_run(entropy: bytes) -> CanaryRun:
    """A run made from ``ENTROPY_BYTES`` random bytes (the shell reads them from the OS)."""
    if len(entropy) != ENTROPY_BYTES:
        raise ValueError(f"a canary run takes {ENTROPY_BYTES} random bytes, got {len(entropy)}")
    letters = entropy[: PROMPT_WORDS * WORD_LETTERS]
    words = (
        "".join(_LETTERS[b % 26] for b in letters[i : i + WORD_LETTERS])
        for i in range(0, len(letters), WORD_LETTERS)
    )
    salts = entropy[len(letters) :]
    return CanaryRun(
        " ".join(words),
        "".join(_SALT_ALPHABET[b % 64] for b in salts[:SALT_BYTES]),
        "".join(_SALT_ALPHABET[b % 64] for b in salts[SALT_BYTES:]),
    )


def judge(first: int | None, other: int | None, repeat: int | None) -> Outcome:
    """The verdict of a run from the cached tokens each answer reported (None: the answer
    said nothing of its cache): ``first`` under A, ``other`` under B, ``repeat`` under A.

    Any hit where the prompt was new to the namespace is FAILED, whatever else was
    reported: both namespaces are fresh, so only a cache shared across them can hit."""
    if other:
        return Outcome(
            Verdict.FAILED,
            f"the prompt under a second namespace hit {other} cached tokens: the replica's "
            "prefix cache is shared across cache salts",
        )
    if first:
        return Outcome(
            Verdict.FAILED,
            f"a fresh prompt under a fresh namespace hit {first} cached tokens: the "
            "replica's prefix cache ignores the cache salt",
        )
    if first is None or other is None or repeat is None:
        return Outcome(
            Verdict.INCONCLUSIVE,
            "its answers carry no cached-token count (vLLM: --enable-prompt-tokens-details)",
        )
    if not repeat:
        return Outcome(
            Verdict.INCONCLUSIVE,
            "the repeat under the first namespace missed (the positive control): prefix "
            "caching is off, the blocks are larger than the prompt, or it was evicted",
        )
    return Outcome(
        Verdict.PASSED, f"0 cached tokens across namespaces, {repeat} on the repeat within one"
    )
