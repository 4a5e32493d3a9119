"""The timing audit's probe design (pure): who sends what, in which order, and how a
streamed response is read. No sockets here; `timing.py` drives it.

One trial (after Gu et al.): the victim sends a fresh random prompt V = prefix + tail;
then the prober sends, in the hit arm, the same prefix with a tail whose first unit
differs from V's (so the shared part is exactly the prefix), or in the miss arm a fresh
random prompt of the same length. The prober is the attacker (the measured isolation) or
the victim itself (the positive control: its own namespace must show the hit). Every
(configuration, role, arm) cell gets the same number of trials, shuffled in time.
"""

from __future__ import annotations

import hmac
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

__all__ = [
    "ARMS",
    "DEFAULT_PREFIX_TOKENS",
    "PRESETS",
    "ROLES",
    "ROUTE_PATHS",
    "Identity",
    "ProbeError",
    "Prompt",
    "StreamReader",
    "TimingAuditConfig",
    "Trial",
    "TrialPrompts",
    "apply_preset",
    "error_message",
    "render_prompt",
    "request_body",
    "schedule",
    "trial_prompts",
]

Arm = Literal["hit", "miss"]
Role = Literal["attack", "control"]
Route = Literal["completions", "chat"]
PromptFormat = Literal["tokens", "text"]
ARMS: tuple[Arm, Arm] = ("hit", "miss")
ROLES: tuple[Role, Role] = ("attack", "control")
LETTERS = "abcdefghijklmnopqrstuvwxyz"
ROUTE_PATHS: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}

Prompt = list[int] | str


@dataclass(frozen=True, slots=True)
class Identity:
    """Whose request it is: an API key, a client-keyed secret, or a raw vLLM cache_salt.

    Every field is a secret, so none appears in repr (and so in logs or tracebacks).
    """

    api_key: str | None = field(default=None, repr=False)
    user_cache_secret: str | None = field(default=None, repr=False)
    cache_salt: str | None = field(default=None, repr=False)

    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def describe(self) -> dict[str, bool]:
        """What the identity carries, never the values (for reports)."""
        return {
            "api_key": self.api_key is not None,
            "user_cache_secret": self.user_cache_secret is not None,
            "cache_salt": self.cache_salt is not None,
        }


@dataclass(frozen=True, slots=True)
class Trial:
    configuration: int
    role: Role
    arm: Arm


@dataclass(frozen=True, slots=True)
class TrialPrompts:
    victim: list[int]
    probe: list[int]


def _same_secret(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return a is b
    return hmac.compare_digest(a.encode(), b.encode())


PRESETS = ("other-tenant", "operator", "same-tenant")


def apply_preset(preset: str | None, victim: Identity, attacker: Identity) -> Identity:
    """The attacker identity an attacker model implies; ValueError says what is missing.

    - other-tenant: another tenant's key (the attacker's own, which must differ);
    - operator: the victim tenant's key without the user's secret (client-keyed mode);
    - same-tenant: the victim's own credentials (a control that must report LEAK).
    """
    if preset is None:
        return attacker
    if victim.api_key is None:
        raise ValueError(f"preset {preset}: --victim-key is required")
    if preset == "other-tenant":
        if attacker.api_key is None:
            raise ValueError("preset other-tenant: --attacker-key is required")
        if _same_secret(attacker.api_key, victim.api_key):
            raise ValueError(
                "preset other-tenant: the attacker's key must differ from the victim's"
            )
        return attacker
    if preset == "operator":
        if victim.user_cache_secret is None:
            raise ValueError("preset operator: --victim-secret is required (client-keyed mode)")
        if attacker.api_key is not None and not _same_secret(attacker.api_key, victim.api_key):
            raise ValueError(
                "preset operator: the operator uses the victim's key; drop --attacker-key"
            )
        if _same_secret(attacker.user_cache_secret, victim.user_cache_secret):
            raise ValueError("preset operator: the operator does not know the victim's secret")
        return Identity(victim.api_key, attacker.user_cache_secret, attacker.cache_salt)
    if preset == "same-tenant":
        return victim
    raise ValueError(f"unknown preset {preset!r}; use one of {', '.join(PRESETS)}")


def schedule(rng: random.Random, counts: Sequence[tuple[int, Role, int]]) -> list[Trial]:
    """Shuffled trials: for each (configuration, role, n) entry, n hits and n misses."""
    trials = [
        Trial(config, role, arm) for config, role, n in counts for arm in ARMS for _ in range(n)
    ]
    rng.shuffle(trials)
    return trials


def _units(rng: random.Random, n: int, vocab: range) -> list[int]:
    return [rng.choice(vocab) for _ in range(n)]


def _other(rng: random.Random, unit: int, vocab: range) -> int:
    while True:
        pick = rng.choice(vocab)
        if pick != unit:
            return pick


def trial_prompts(
    rng: random.Random, prefix: int, tail: int, arm: Arm, vocab: range
) -> TrialPrompts:
    """The victim's prompt and the probe's, as units drawn from `vocab` (token ids or letters).

    Both prompts have `prefix + tail` units. In the hit arm they share exactly `prefix`
    units; in the miss arm nothing (the probe's first unit differs from the victim's).
    """
    if prefix < 1 or tail < 1:
        raise ValueError("prefix and tail need at least one unit each")
    if len(vocab) < 2:
        raise ValueError("the vocabulary needs at least two units")
    victim = _units(rng, prefix + tail, vocab)
    if arm == "hit":
        probe = [*victim[:prefix], _other(rng, victim[prefix], vocab)]
    else:
        probe = [_other(rng, victim[0], vocab)]
    probe += _units(rng, prefix + tail - len(probe), vocab)
    return TrialPrompts(victim, probe)


def render_prompt(units: list[int], prompt_format: PromptFormat) -> Prompt:
    """Token ids as they are, or text: one letter per unit, space-separated (one token each)."""
    if prompt_format == "tokens":
        return units
    return " ".join(LETTERS[u % len(LETTERS)] for u in units)


def request_body(
    route: Route, model: str, prompt: Prompt, identity: Identity, max_tokens: int
) -> bytes:
    """A streamed request whose first content chunk marks the first token."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    if route == "chat":
        if not isinstance(prompt, str):
            raise ValueError("chat prompts are text: use prompt_format 'text'")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if identity.user_cache_secret is not None:
        body["user_cache_secret"] = identity.user_cache_secret
    if identity.cache_salt is not None:
        body["cache_salt"] = identity.cache_salt
    return orjson.dumps(body)


# 128 tokens is one KV block on vLLM's CPU backend (and 8 of GPU's 16-token blocks).
DEFAULT_PREFIX_TOKENS = (128, 1024)


@dataclass(frozen=True, slots=True)
class TimingAuditConfig:
    base_url: str
    victim: Identity
    attacker: Identity
    prefix_tokens: tuple[int, ...] = DEFAULT_PREFIX_TOKENS
    tail_tokens: int = 32
    samples: int = 250
    max_samples: int = 1500
    victim_requests: int = 1
    model: str | None = None
    route: Route = "completions"
    prompt_format: PromptFormat = "tokens"
    max_tokens: int = 1
    prime_batch: int = 8
    alpha: float = 1e-3
    auc_bound: float = 0.55
    control_alpha: float = 1e-8
    seed: int | None = None
    timeout_s: float = 120.0
    preset: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.prefix_tokens or min(self.prefix_tokens) < 1:
            raise ValueError("prefix_tokens: give at least one positive length")
        if self.tail_tokens < 1:
            raise ValueError("tail_tokens must be at least 1")
        if self.samples < 2 or self.max_samples < self.samples:
            raise ValueError("need 2 <= samples <= max_samples")
        if self.victim_requests < 1 or self.prime_batch < 1 or self.max_tokens < 1:
            raise ValueError("victim_requests, prime_batch and max_tokens must be at least 1")
        if self.route == "chat" and self.prompt_format != "text":
            raise ValueError("the chat route takes text prompts: use prompt_format 'text'")


class ProbeError(Exception):
    """The target answered something the audit cannot use (the message says what)."""


@dataclass(slots=True)
class StreamReader:
    """Reads an OpenAI SSE stream line by line: when the first token came, cached tokens.

    The first token is the first chunk carrying a token (`_has_content`); chat streams
    open with a role-only chunk sent before any prefill, which does not count.
    """

    first_token: bool = False
    cached_tokens: int | None = None
    done: bool = False
    _partial: bytes = b""

    def feed_bytes(self, chunk: bytes) -> bool:
        """Consume a piece of the body; True when the first token arrived in it."""
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        seen = False
        for line in lines:
            seen = self.feed(line.decode("utf-8", "replace").rstrip("\r")) or seen
        return seen

    def feed(self, line: str) -> bool:
        """Consume one line; True exactly when it carried the first token."""
        if not line.startswith("data:"):
            return False
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return False
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise ProbeError("the stream carried a line that is not JSON") from None
        if not isinstance(event, dict):
            raise ProbeError("the stream carried a JSON value that is not an object")
        if "error" in event:
            raise ProbeError(f"the stream reported an error: {_error_message(event)}")
        usage = event.get("usage")
        if isinstance(usage, dict):
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                self.cached_tokens = details["cached_tokens"]
        if self.first_token:
            return False
        for choice in event.get("choices") or ():
            if isinstance(choice, dict) and _has_content(choice):
                self.first_token = True
                return True
        return False


def _has_content(choice: dict[str, Any]) -> bool:
    """Whether this chunk is a generated token (its text may be empty).

    vLLM sends one chunk per token; a token can decode to "" (a random model's often do),
    so the text's presence counts, not its length. Chat's opening chunk carries the role
    and is sent before any prefill: it is not a token.
    """
    if isinstance(choice.get("text"), str) or choice.get("finish_reason") is not None:
        return True
    delta = choice.get("delta")
    return isinstance(delta, dict) and "role" not in delta and "content" in delta


def _error_message(body: object) -> str:
    """The message of an OpenAI-shaped (or vLLM's bare) error body, cut to one line."""
    message: object = body
    if isinstance(body, dict):
        error = body.get("error", body)
        message = error.get("message", error) if isinstance(error, dict) else error
    return str(message).splitlines()[0][:300] if str(message) else "(empty)"


def error_message(raw: bytes) -> str:
    try:
        return _error_message(orjson.loads(raw))
    except orjson.JSONDecodeError:
        return raw.decode("utf-8", "replace").splitlines()[0][:300] if raw else "(empty body)"
