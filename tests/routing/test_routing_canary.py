"""The isolation canary's core: its verdicts, its runs, and the fail-closed state it feeds."""

from __future__ import annotations

import os

import pytest

from saltgate.routing import Member, ReplicaId, Router, RouterConfig, Verdict, judge, new_run
from saltgate.routing.canary import ENTROPY_BYTES, PROMPT_WORDS
from saltgate.routing.health import Isolation
from saltgate.sim.tokenizer import tokenize

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("first", "other", "repeat"),
    [(0, 0, 240), (0, 0, 16)],
)
def test_a_miss_across_namespaces_with_a_hit_within_one_passes(
    first: int, other: int, repeat: int
) -> None:
    outcome = judge(first, other, repeat)
    assert outcome.verdict is Verdict.PASSED
    assert str(repeat) in outcome.reason


@pytest.mark.parametrize(
    ("first", "other", "repeat"),
    [
        (0, 240, 240),  # the salt dropped: B reads A's blocks
        (0, 16, 240),  # one block is a leak
        (0, 240, 0),  # a leak without the repeat hitting is still a leak
        (0, 240, None),  # ... and without a repeat reported
        (240, 240, 240),  # a fresh prompt under a fresh salt hit: the salt is ignored
        (240, 0, 240),
        (16, None, None),
    ],
)
def test_any_hit_where_the_prompt_was_new_to_the_namespace_fails(
    first: int | None, other: int | None, repeat: int | None
) -> None:
    outcome = judge(first, other, repeat)
    assert outcome.verdict is Verdict.FAILED
    assert "cached tokens" in outcome.reason


@pytest.mark.parametrize(
    ("first", "other", "repeat", "why"),
    [
        (None, None, None, "no cached-token count"),  # vLLM without the flag
        (0, None, 240, "--enable-prompt-tokens-details"),
        (0, 0, None, "--enable-prompt-tokens-details"),
        (None, 0, 240, "--enable-prompt-tokens-details"),
        (0, 0, 0, "positive control"),  # no prefix caching, or evicted between requests
    ],
)
def test_a_run_that_shows_nothing_is_inconclusive_and_says_why(
    first: int | None, other: int | None, repeat: int | None, why: str
) -> None:
    outcome = judge(first, other, repeat)
    assert outcome.verdict is Verdict.INCONCLUSIVE
    assert why in outcome.reason


def test_runs_are_fresh_and_fill_several_blocks() -> None:
    a, b = new_run(os.urandom(ENTROPY_BYTES)), new_run(os.urandom(ENTROPY_BYTES))
    assert a.prompt != b.prompt and len({a.salt_a, a.salt_b, b.salt_a, b.salt_b}) == 4
    # The simulator's tokenizer: one token per six-letter word, 16 blocks of 16.
    assert len(tokenize(a.prompt)) == PROMPT_WORDS
    assert len(a.prompt.split()) == PROMPT_WORDS
    # A salt vLLM takes: at most 128 characters, none of '/', '@', '\\', NUL.
    for salt in (a.salt_a, a.salt_b):
        assert 0 < len(salt) <= 128 and not set(salt) & set("/@\\\x00")
    body = a.body("m", a.salt_b)
    assert body["max_tokens"] == 1 and body["cache_salt"] == a.salt_b
    assert body["prompt"] == a.prompt and body["model"] == "m"


def test_a_run_is_made_of_exactly_its_entropy() -> None:
    entropy = bytes(range(256)) * (ENTROPY_BYTES // 256 + 1)
    assert new_run(entropy[:ENTROPY_BYTES]) == new_run(entropy[:ENTROPY_BYTES])
    with pytest.raises(ValueError, match="random bytes"):
        new_run(entropy[: ENTROPY_BYTES - 1])


def test_isolation_fails_closed_until_a_pass() -> None:
    iso = Isolation()
    assert not iso.failed
    iso.observed(Verdict.INCONCLUSIVE)
    assert not iso.failed  # nothing shown: stays in
    iso.observed(Verdict.FAILED)
    assert iso.failed
    iso.observed(Verdict.INCONCLUSIVE)
    assert iso.failed  # an inconclusive run does not bring it back
    iso.observed(Verdict.PASSED)
    assert not iso.failed


def test_the_router_skips_a_replica_whose_canary_failed_until_it_passes() -> None:
    router = Router(RouterConfig(), b"k" * 32)
    a, b = ReplicaId("http://a"), ReplicaId("http://b")
    router.set_members([Member(a, 1.0), Member(b, 1.0)])
    router.canary(a, Verdict.FAILED)
    assert [s.id for s in router.usable(None, 0.0)] == [b]
    router.canary(a, Verdict.INCONCLUSIVE)
    assert [s.id for s in router.usable(None, 0.0)] == [b]
    router.canary(a, Verdict.PASSED)
    assert {s.id for s in router.usable(None, 0.0)} == {a, b}
    router.canary(ReplicaId("http://gone"), Verdict.FAILED)  # removed meanwhile: ignored
