"""The deployment audit's probes of engine state no metric shows: judgements (pure).

Each replica is asked, directly and with its own key, what a tenant could reach through it
if a request ever got past the gateway's policy: a Responses store that keeps answers under
a bearer id, media URLs the replica fetches itself, `prompt_embeds` and `*_embeds` parts
(`torch.load` in the shared API server), runtime LoRA loading, and per-request engine
timings in answers (docs/audit.md, "Engine state"; the evidence with vLLM's source lines is
in the research behind issue 40). The shell (saltgate.audit.engine_probes) sends the
probes and runs the loopback listener; these functions read what came back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from saltgate.audit.findings import REFUSED, UNREACHED, Finding, Severity

__all__ = [
    "LORA_ENV",
    "MEDIA_DOMAINS",
    "MEDIA_REDIRECTS",
    "MM_EMBEDS",
    "PER_REQUEST_METRICS",
    "PROMPT_EMBEDS",
    "RESPONSES_STORE_ENV",
    "MediaProbe",
    "ProbeAnswer",
    "judge_lora_routes",
    "judge_media_fetch",
    "judge_mm_embeds",
    "judge_per_request_metrics",
    "judge_prompt_embeds",
    "judge_responses_store",
]

RESPONSES_STORE_ENV = "VLLM_ENABLE_RESPONSES_API_STORE"
MEDIA_DOMAINS = "--allowed-media-domains"
MEDIA_REDIRECTS = "VLLM_MEDIA_URL_ALLOW_REDIRECTS"
PROMPT_EMBEDS = "--enable-prompt-embeds"
MM_EMBEDS = "--enable-mm-embeds"
LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
PER_REQUEST_METRICS = "--enable-per-request-metrics"

_QUOTE = 160  # characters of a replica's error message quoted in a finding


@dataclass(frozen=True, slots=True)
class ProbeAnswer:
    """What one probe got back from a replica: status and body, or no answer at all."""

    status: int | None  # None: no HTTP answer (connection refused, timeout)
    body: bytes = b""

    def json(self) -> Any:
        try:
            return orjson.loads(self.body)
        except orjson.JSONDecodeError:
            return None

    @property
    def message(self) -> str:
        """The error's text: OpenAI's `error.message`, FastAPI's `detail`, or the raw body."""
        data = self.json()
        if isinstance(data, dict):
            error = data.get("error")
            if isinstance(error, dict) and isinstance(error.get("message"), str):
                return str(error["message"])
            if isinstance(error, str):
                return error
            if isinstance(data.get("detail"), str):
                return str(data["detail"])
        return self.body[:_QUOTE].decode("utf-8", "replace")

    @property
    def route_missing(self) -> bool:
        """The server has no such route: FastAPI's (and the simulator's) bare 404."""
        return self.status == 404 and self.json() == {"detail": "Not Found"}

    def quoted(self) -> str:
        text = " ".join(self.message.split())
        return f"{self.status}: {text[:_QUOTE]}{'...' if len(text) > _QUOTE else ''}"


def _unprobed(check: str, url: str, answer: ProbeAnswer, what: str) -> Finding | None:
    """The INFO finding of a probe that never reached the code under test, else None."""
    if answer.status is None:
        why, fix = "the replica could not be reached", UNREACHED
    elif answer.status in (401, 403):
        why, fix = f"the replica refused the probe ({answer.status})", REFUSED
    else:
        return None
    return Finding(check, url, Severity.INFO, f"not checked ({what}): {why}", fix)


# -- the Responses store ------------------------------------------------------------------


def _store_on(check: str, url: str, *, kept: bool) -> Finding:
    """The store answered the audit's GET: a finding, unless the gateway keeps responses
    for their owners ([responses] store = true), which needs it on."""
    if kept:
        return Finding(
            check,
            url,
            Severity.INFO,
            "the Responses store is on, as [responses] store = true needs: through the "
            "gateway each response is its owner's only; straight to the replica it is "
            "anyone's",
            "let nothing but the gateways reach the replica (replica-direct-access)",
        )
    return Finding(
        check,
        url,
        Severity.HIGH,
        "the Responses store is on: a response created with store=true is served back "
        "by GET /v1/responses/{id} to anyone holding the id, with no owner check (and "
        "can be continued or cancelled by it); the store is never evicted. The audit's "
        "own one-token probe stays stored until the replica restarts",
        f"start vLLM without {RESPONSES_STORE_ENV} (unset or 0)",
    )


def judge_responses_store(
    url: str, create: ProbeAnswer, read: ProbeAnswer | None, *, kept: bool = False
) -> Finding:
    """POST /v1/responses with store true, then GET /v1/responses/{id}: 200 means stored.

    vLLM keeps stored responses in a dict per API-server process, never evicted, with no
    owner: whoever holds an id reads the conversation, continues it (the model sees the
    owner's messages) or cancels it. With the store off (the default) the GET is a 404.
    """
    check = "responses-store"
    unprobed = _unprobed(check, url, create, "POST /v1/responses")
    if unprobed is not None:
        return unprobed
    if create.route_missing:
        return Finding(check, url, Severity.OK, "no /v1/responses route: nothing to store")
    if create.status != 200 or read is None:
        return Finding(
            check,
            url,
            Severity.INFO,
            f"not checked: POST /v1/responses answered {create.quoted()}",
            "make the replica answer POST /v1/responses for its first model, then audit again",
        )
    if read.status == 200:
        return _store_on(check, url, kept=kept)
    if read.status == 404:
        return Finding(
            check,
            url,
            Severity.OK,
            "store off: GET /v1/responses/{id} of a response just created with store=true is a 404",
        )
    return Finding(
        check,
        url,
        Severity.INFO,
        f"unclear: GET /v1/responses/{{id}} answered {read.quoted()}",
        f"make sure {RESPONSES_STORE_ENV} is unset on the replica unless [responses] store = true",
    )


# -- remote media -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MediaProbe:
    """A chat request whose `image_url` is the audit's own loopback listener.

    The listener answers the first path with a redirect to a second one, and that with a
    404, so nothing is ever decoded: a replica that fetches gets an HTTP error, not media.
    """

    answer: ProbeAnswer
    fetched: bool  # the listener saw the first path
    redirected: bool  # ... and the second: the replica followed the redirect
    authority: str = ""  # the image URL's host:port, which a connection error names


_LOADED = "could not be deserialized as a torch tensor"
"""vLLM's answer to bytes that are no tensor once the flag is on: it tried to load them."""
_TEXT_ONLY = ("is not a multimodal model", "model is not multimodal")


def judge_media_fetch(url: str, probe: MediaProbe) -> Finding:
    """Does the replica fetch a media URL of any host (vLLM's default: SSRF, status oracle)?

    Read in order: a fetch the listener saw decides (a finding); then the answer's words:
    vLLM's allow-list refusal is clean, a text-only model's "not a multimodal model" is
    inconclusive (vLLM refuses image parts before any fetch on such a model, so the flags
    cannot be seen), a fetch error is a finding (the replica tried, from a host whose
    loopback is not the audit's), anything else is inconclusive.
    """
    check = "remote-media"
    fix = f"start vLLM with {MEDIA_DOMAINS} (the hosts you allow) and {MEDIA_REDIRECTS}=0"
    if probe.fetched:
        how = "and followed its redirect" if probe.redirected else "(not its redirect)"
        return Finding(
            check,
            url,
            Severity.HIGH,
            f"the replica fetched a loopback image URL {how}: any tenant request that "
            "carries a media URL makes it reach into its own network (SSRF; "
            "CVE-2025-6242 class), and its errors tell status and open ports",
            fix if probe.redirected else f"start vLLM with {MEDIA_DOMAINS} (the hosts you allow)",
        )
    answer = probe.answer
    unprobed = _unprobed(check, url, answer, "an image_url chat request")
    if unprobed is not None:
        return unprobed
    message = answer.message.lower()
    if "allowed domains" in message:
        return Finding(
            check, url, Severity.OK, f"{MEDIA_DOMAINS} refuses the URL: {answer.quoted()}"
        )
    if any(words in message for words in _TEXT_ONLY):
        return Finding(
            check,
            url,
            Severity.INFO,
            "inconclusive: a text-only model, which refuses image parts before fetching "
            f"anything ({answer.quoted()}). Nothing is fetched while it serves this model; "
            "the flags cannot be seen from here",
            fix,
        )
    tried = "fetch" in message or (probe.authority and probe.authority in message)
    if answer.status != 200 and tried:
        return Finding(
            check,
            url,
            Severity.HIGH,
            "the replica tried to fetch a loopback image URL (its own loopback, not the "
            f"audit's: it answered {answer.quoted()}): media URLs of any host are fetched",
            fix,
        )
    return Finding(
        check,
        url,
        Severity.INFO,
        f"inconclusive: no fetch reached the audit's listener, and the replica answered "
        f"{answer.quoted()}",
        fix,
    )


# -- embeddings as input ------------------------------------------------------------------


def _judge_embeds(
    check: str, url: str, answer: ProbeAnswer, *, flag: str, what: str, text_only_ok: bool
) -> Finding:
    unprobed = _unprobed(check, url, answer, what)
    if unprobed is not None:
        return unprobed
    if flag in answer.message:
        return Finding(check, url, Severity.OK, f"refused with the flag off: {answer.quoted()}")
    if answer.route_missing:  # e.g. a pooling model's replica: no generation routes
        return Finding(check, url, Severity.OK, f"no route for {what} on this replica")
    risk = (
        "tensors from requests are torch.load-ed in the API server every tenant shares "
        "(CVE-2025-62164, CVE-2026-56340, CVE-2026-73557: memory corruption, a crash)"
    )
    if answer.status == 200 or _LOADED in answer.message:
        how = "accepted" if answer.status == 200 else f"handed to torch ({answer.quoted()})"
        return Finding(
            check, url, Severity.HIGH, f"{what} {how}: {risk}", f"start vLLM without {flag}"
        )
    if text_only_ok and any(words in answer.message.lower() for words in _TEXT_ONLY):
        return Finding(
            check,
            url,
            Severity.INFO,
            f"inconclusive: a text-only model refuses {what} whatever {flag} says "
            f"({answer.quoted()})",
            f"make sure vLLM starts without {flag}",
        )
    return Finding(
        check,
        url,
        Severity.MEDIUM,
        f"{what} not refused as vLLM refuses it with {flag} off (answered "
        f"{answer.quoted()}): the replica may have tried to load the tensor; {risk}",
        f"start vLLM without {flag}",
    )


def judge_prompt_embeds(url: str, answer: ProbeAnswer) -> Finding:
    """POST /v1/completions with `prompt_embeds` (bytes that are no tensor, so nothing loads):
    vLLM without the flag answers 400 "You must set `--enable-prompt-embeds`..."."""
    return _judge_embeds(
        "prompt-embeds",
        url,
        answer,
        flag=PROMPT_EMBEDS,
        what="prompt_embeds on completions",
        text_only_ok=False,
    )


def judge_mm_embeds(url: str, answer: ProbeAnswer) -> Finding:
    """A chat `image_embeds` part: vLLM without the flag answers 400 "You must set
    `--enable-mm-embeds`..."; a text-only model answers "The model is not multimodal."."""
    return _judge_embeds(
        "mm-embeds",
        url,
        answer,
        flag=MM_EMBEDS,
        what="an image_embeds chat part",
        text_only_ok=True,
    )


# -- runtime LoRA loading -----------------------------------------------------------------


def judge_lora_routes(url: str, load: ProbeAnswer, unload: ProbeAnswer) -> Finding:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (a name and a path that do
    not exist): without VLLM_ALLOW_RUNTIME_LORA_UPDATING the routes are not attached."""
    check = "runtime-lora"
    unprobed = _unprobed(check, url, load, "POST /v1/load_lora_adapter")
    if unprobed is not None:
        return unprobed
    open_routes = [
        f"/v1/{name}_lora_adapter answered {answer.quoted()}"
        for name, answer in (("load", load), ("unload", unload))
        if answer.status is not None and not answer.route_missing
    ]
    if open_routes:
        return Finding(
            check,
            url,
            Severity.HIGH,
            f"runtime LoRA updating is on ({'; '.join(open_routes)}): whoever reaches the "
            "replica loads weights from a path of their choosing, swaps an adapter in place "
            "(blocks cached with the old weights stay), and unknown model names make "
            "resolver plugins load adapters",
            f"start vLLM without {LORA_ENV} (unset or false)",
        )
    return Finding(
        check, url, Severity.OK, "no /v1/load_lora_adapter or /v1/unload_lora_adapter route"
    )


# -- per-request metrics ------------------------------------------------------------------


def judge_per_request_metrics(url: str, answer: ProbeAnswer) -> Finding:
    """A one-token completion: does its answer carry `metrics` (engine-side time to first
    token, queue time), which vLLM adds with --enable-per-request-metrics?"""
    check = "per-request-metrics"
    unprobed = _unprobed(check, url, answer, "a one-token completion")
    if unprobed is not None:
        return unprobed
    if answer.status != 200:
        return Finding(
            check,
            url,
            Severity.INFO,
            f"not checked: the completion answered {answer.quoted()}",
            "make the replica answer a completion for its first model, then audit again",
        )
    data = answer.json()
    metrics = data.get("metrics") if isinstance(data, dict) else None
    if metrics:
        names = ", ".join(sorted(metrics)) if isinstance(metrics, dict) else "metrics"
        return Finding(
            check,
            url,
            Severity.MEDIUM,
            f"answers carry the engine's own timings ({names}): every timing side channel "
            "(another tenant's cache hits and load) is read without network noise, unless "
            "the gateway drops `metrics` from every answer",
            f"start vLLM without {PER_REQUEST_METRICS}",
        )
    return Finding(check, url, Severity.OK, "answers carry no per-request metrics")
