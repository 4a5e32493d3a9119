"""The replay benchmark's pure parts, without sockets: trace, sessions, tenants, tokens,
request shapes, SSE reading, metrics and the cross-tenant-hit detector."""

from __future__ import annotations

import json
import tomllib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from saltgate.sim.tokenizer import VOCAB_SIZE, tokenize
from saltgate_bench.gateway_setup import GatewayState, check_gateway_config, gateway_config
from saltgate_bench.procs import BenchError
from saltgate_bench.replay import DEFAULT_TRACE
from saltgate_bench.replay_client import RequestShape, StreamReader, cached_tokens_of
from saltgate_bench.replay_metrics import (
    Outcome,
    check_targets,
    cross_tenant_hits,
    legitimate_cached_tokens,
    markdown_table,
    max_mean_load,
    percentile_ms,
    summarize,
)
from saltgate_bench.replay_procs import metric_total
from saltgate_bench.trace_schedule import (
    ReplayRequest,
    TraceError,
    TraceRequest,
    assign_tenants,
    block_text,
    block_tokens,
    build_schedule,
    load_trace,
    parse_trace,
    prompt_text,
    prompt_tokens,
    reconstruct_sessions,
    scaled_output_tokens,
    zipf_weights,
)

pytestmark = pytest.mark.unit

B = 64


def line(ts: int, ids: list[int], out: int = 100) -> str:
    return json.dumps(
        {"timestamp": ts, "input_length": 512 * len(ids), "output_length": out, "hash_ids": ids}
    )


def trace(*rows: tuple[int, list[int]]) -> list[TraceRequest]:
    return parse_trace([line(ts, ids) for ts, ids in rows])


# -- trace ------------------------------------------------------------------------------------


def test_parse_trace_reads_fields() -> None:
    reqs = parse_trace([line(0, [0, 1, 2], out=7), "", line(1500, [0, 3])])
    assert reqs == [
        TraceRequest(0, 1536, 7, (0, 1, 2)),
        TraceRequest(1500, 1024, 100, (0, 3)),
    ]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (["{not json"], "t.jsonl:1: not JSON"),
        (["[1, 2]"], "expected a JSON object"),
        ([line(0, [0]), '{"timestamp": -1}'], "t.jsonl:2: 'timestamp' must be a non-negative"),
        ([line(5, [0]), line(4, [0])], "goes back in time"),
        (['{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": []}'], "non-empty"),
        (
            ['{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0, "x"]}'],
            "hash_ids[1]",
        ),
        ([line(0, [0, 1]), line(1, [0, 2, 1])], "hash id 1 follows 2, but earlier it followed 0"),
        ([], "no requests"),
    ],
)
def test_parse_trace_refuses_what_it_cannot_replay(lines: list[str], message: str) -> None:
    with pytest.raises(TraceError) as info:
        parse_trace(lines, "t.jsonl")
    assert message in str(info.value)


def test_load_trace_names_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path / "nope.jsonl")


def test_the_default_trace_parses_with_intact_chains() -> None:
    assert DEFAULT_TRACE.is_file(), f"the default trace is missing: {DEFAULT_TRACE}"
    reqs = load_trace(DEFAULT_TRACE)
    assert len(reqs) == 12031
    assert all(r.hash_ids[0] == 0 for r in reqs)
    sessions = reconstruct_sessions(reqs)
    # Most requests open a conversation; a few thousand continue one.
    assert 6000 < len(set(sessions)) < 9000


# -- sessions and tenants ------------------------------------------------------------------------


def test_sessions_follow_the_deepest_shared_block_beyond_the_system_prompt() -> None:
    reqs = trace(
        (0, [0, 1, 2]),  # 0: new
        (1, [0, 3, 4]),  # 1: new (only block 0 shared)
        (2, [0, 1, 2, 5]),  # 2: extends 0
        (3, [0, 3, 6]),  # 3: forks from 1 after block 3
        (4, [0]),  # 4: the system prompt alone: new
        (5, [0, 1, 2, 5, 7]),  # 5: extends 2, i.e. session 0
    )
    assert reconstruct_sessions(reqs) == [0, 1, 0, 1, 4, 0]


def test_zipf_weights_are_normalised_and_skewed() -> None:
    w = zipf_weights(8, 1.1)
    assert sum(w) == pytest.approx(1.0)
    assert w == sorted(w, reverse=True)
    assert w[0] / w[1] == pytest.approx(2**1.1)
    assert zipf_weights(3, 0.0) == pytest.approx([1 / 3] * 3)
    with pytest.raises(ValueError):
        zipf_weights(0, 1.0)


def test_tenants_are_per_session_seeded_and_zipf_distributed() -> None:
    sessions = [i // 2 for i in range(20000)]  # 10000 sessions of two requests
    tenants = assign_tenants(sessions, 8, 1.1, seed=3)
    assert tenants == assign_tenants(sessions, 8, 1.1, seed=3)
    assert tenants != assign_tenants(sessions, 8, 1.1, seed=4)
    assert all(tenants[2 * k] == tenants[2 * k + 1] for k in range(10000))
    share = Counter(tenants[::2])
    for t, w in enumerate(zipf_weights(8, 1.1)):
        assert share[t] / 10000 == pytest.approx(w, abs=0.02)


# -- tokens --------------------------------------------------------------------------------------


def test_token_blocks_are_fixed_in_vocabulary_and_distinct() -> None:
    a = block_tokens(7, B)
    assert a == block_tokens(7, B) and len(a) == B
    assert all(16 <= t < VOCAB_SIZE for t in a)
    assert a != block_tokens(8, B)
    assert prompt_tokens([0, 7], B) == list(block_tokens(0, B)) + list(a)


def test_text_blocks_tokenize_to_one_token_per_word_whatever_surrounds_them() -> None:
    ids = [0, 11, 12, 13]
    text = prompt_text(ids, B)
    whole = tokenize(text)
    assert len(whole) == len(ids) * B
    assert whole == [t for h in ids for t in tokenize(block_text(h, B))]
    # Equal ids give equal token prefixes; a different block differs at once.
    other = tokenize(prompt_text([0, 11, 99], B))
    assert other[: 2 * B] == whole[: 2 * B]
    assert other[2 * B] != whole[2 * B]


def test_output_lengths_scale_with_the_block() -> None:
    assert scaled_output_tokens(512, 64) == 64
    assert scaled_output_tokens(343, 64) == 43
    assert scaled_output_tokens(0, 64) == 1


def test_schedule_windows_scales_time_and_keeps_tenants() -> None:
    rows = [(1000 * i, [0, 100 + i]) for i in range(10)]
    reqs = trace(*rows)
    kw = {"tenants": 4, "zipf_exponent": 1.0, "seed": 0, "block_size": B}
    full = build_schedule(reqs, time_scale=2.0, **kw)  # type: ignore[arg-type]
    assert [r.at_s for r in full] == [i / 2 for i in range(10)]
    assert [r.index for r in full] == list(range(10))
    part = build_schedule(reqs, time_scale=2.0, start_s=3, duration_s=4, **kw)  # type: ignore[arg-type]
    assert [r.trace_index for r in part] == [3, 4, 5, 6]
    assert part[0].at_s == 0.0 and part[-1].at_s == 1.5
    assert [r.tenant for r in part] == [r.tenant for r in full[3:7]]
    assert len(build_schedule(reqs, time_scale=1.0, limit=3, **kw)) == 3  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        build_schedule(reqs, time_scale=0.0, **kw)  # type: ignore[arg-type]


# -- request shapes and the SSE reader -------------------------------------------------------------


def req(index: int, tenant: int, ids: list[int], session: int = 0) -> ReplayRequest:
    return ReplayRequest(index, index, 0.0, tenant, session, tuple(ids), 5)


def test_gateway_requests_carry_the_tenants_key_and_no_salt() -> None:
    shape = RequestShape("m", B, tenant_keys=("k0", "k1"))
    headers, body = shape.parts(req(0, 1, [0, 5]))
    assert (b"authorization", b"Bearer k1") in headers
    assert all(name != b"x-session-id" for name, _ in headers)
    doc = json.loads(body)
    assert "cache_salt" not in doc
    assert doc["stream"] is True and doc["stream_options"] == {"include_usage": True}
    assert len(tokenize(doc["prompt"])) == 2 * B and doc["max_tokens"] == 5


def test_peer_requests_carry_a_salt_per_tenant_and_the_session_when_asked() -> None:
    shape = RequestShape("m", B, text=False, tenant_salts=("s0", "s1"), session_header=True)
    headers, body = shape.parts(req(0, 1, [0, 5], session=42))
    assert (b"x-session-id", b"t1-s42") in headers
    assert all(name != b"authorization" for name, _ in headers)
    doc = json.loads(body)
    assert doc["cache_salt"] == "s1"
    assert doc["prompt"] == prompt_tokens([0, 5], B)


def test_stream_reader_finds_first_token_usage_and_end_across_splits() -> None:
    events = (
        b'data: {"choices":[{"text":"","index":0}]}\n\n'
        b'data: {"choices":[{"text":" Hi","index":0}]}\n\n'
        b'data: {"choices":[{"text":" there","index":0}]}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2,'
        b'"prompt_tokens_details":{"cached_tokens":4}}}\n\n'
        b"data: [DONE]\n\n"
    )
    reader = StreamReader()
    firsts = [reader.feed(events[i : i + 7]) for i in range(0, len(events), 7)]
    assert firsts.count(True) == 1
    assert reader.done and reader.error is None
    assert reader.usage is not None and cached_tokens_of(reader.usage) == 4
    chat = StreamReader()
    assert not chat.feed(b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n')
    assert chat.feed(b'data: {"choices":[{"delta":{"content":"x"}}]}\n')


def test_stream_reader_reports_error_events_and_garbage() -> None:
    reader = StreamReader()
    reader.feed(b'data: {"error": {"type": "upstream_error", "message": "replica failed"}}\n\n')
    assert reader.error == "error event (upstream_error)"
    bad = StreamReader()
    bad.feed(b"data: {oops\n")
    assert bad.error == "malformed event"


# -- cross-tenant hits -----------------------------------------------------------------------------


def ok(sent: float, first: float, cached: int, prompt: int = 3 * B) -> Outcome:
    return Outcome(sent, first, first + 0.1, True, prompt, cached, 5)


def test_a_tenant_hitting_a_block_only_another_tenant_sent_is_a_cross_tenant_hit() -> None:
    schedule = [req(0, 0, [0, 1, 2]), req(1, 1, [0, 5, 6])]
    outcomes: list[Outcome | None] = [ok(0.0, 1.0, 0), ok(2.0, 2.5, B)]
    assert legitimate_cached_tokens(schedule, outcomes, B) == [0, 0]
    assert cross_tenant_hits(schedule, outcomes, B) == (1, B)


def test_the_same_tenants_earlier_prefix_explains_a_hit() -> None:
    schedule = [req(0, 0, [0, 1, 2]), req(1, 0, [0, 1, 2, 3]), req(2, 0, [0, 9])]
    outcomes: list[Outcome | None] = [ok(0.0, 1.0, 0), ok(2.0, 2.5, 3 * B), ok(3.0, 3.2, B)]
    assert legitimate_cached_tokens(schedule, outcomes, B) == [0, 3 * B, B]
    assert cross_tenant_hits(schedule, outcomes, B) == (0, 0)
    outcomes[1] = ok(2.0, 2.5, 3 * B + 16)  # one block more than the tenant ever sent
    assert cross_tenant_hits(schedule, outcomes, B) == (1, 16)


def test_a_request_sent_after_the_first_token_cannot_explain_it() -> None:
    schedule = [req(0, 0, [0, 1, 2]), req(1, 0, [0, 1])]
    # Request 1 was sent at 5.0, after request 0 already had its first token at 1.0.
    outcomes: list[Outcome | None] = [ok(0.0, 1.0, 2 * B), ok(5.0, 5.5, 0)]
    assert legitimate_cached_tokens(schedule, outcomes, B)[0] == 0
    assert cross_tenant_hits(schedule, outcomes, B) == (1, 2 * B)


def test_failed_and_unsent_requests_are_not_judged_but_still_explain_others() -> None:
    schedule = [req(0, 0, [0, 1]), req(1, 0, [0, 1, 2]), req(2, 1, [0, 3])]
    failed = Outcome(0.0, None, 0.5, False, error="HTTP 503")
    outcomes: list[Outcome | None] = [failed, ok(1.0, 1.5, 2 * B), None]
    assert legitimate_cached_tokens(schedule, outcomes, B) == [None, 2 * B, None]
    assert cross_tenant_hits(schedule, outcomes, B) == (0, 0)


# -- summaries, targets, table ---------------------------------------------------------------------


def test_percentiles_match_numpy_and_load_ratio() -> None:
    values = [0.005, 0.1, 0.02, 0.3, 0.07, 0.011]
    for q in (0, 50, 90, 99, 100):
        assert percentile_ms(values, q) == round(float(np.percentile(values, q)) * 1000, 2)
    assert percentile_ms([], 50) is None
    assert max_mean_load([10, 10, 40]) == 2.0
    assert max_mean_load([0, 0]) is None


def test_summary_counts_tokens_failures_and_load() -> None:
    schedule = [req(0, 0, [0, 1, 2]), req(1, 0, [0, 1, 2, 3]), req(2, 1, [0, 4])]
    outcomes: list[Outcome | None] = [
        ok(0.0, 0.2, 0, prompt=3 * B),
        ok(1.0, 1.1, 3 * B, prompt=4 * B),
        Outcome(2.0, None, 2.5, False, error="HTTP 502"),
    ]
    s = summarize("p", schedule, outcomes, block_size=B, replica_requests=[2, 1])
    assert s["completed"] == 2 and s["failed"] == 1 and s["errors"] == {"HTTP 502": 1}
    assert s["cached_token_ratio"] == round(3 / 7, 4)
    assert s["ttft_p50_ms"] == 150.0
    assert s["max_mean_load"] == round(2 / 1.5, 3)
    assert s["cross_tenant_hits"] == 0
    assert s["wall_s"] == 1.2


def result(policy: str, ratio: float, p99: float, load: float, hits: int = 0) -> dict[str, object]:
    return {
        "policy": policy,
        "cached_token_ratio": ratio,
        "ttft_p50_ms": p99 / 2,
        "ttft_p99_ms": p99,
        "throughput_rps": 1.0,
        "output_tokens_per_s": 10.0,
        "max_mean_load": load,
        "failed": 0,
        "cross_tenant_hits": hits,
    }


def test_targets_compare_saltgate_with_the_isolating_policies() -> None:
    results = [
        result("saltgate", 0.30, 400, 1.2),
        result("round_robin", 0.10, 900, 1.0),
        result("leaky", 0.40, 300, 1.1, hits=5),
    ]
    lines = check_targets(results)
    assert lines[0].startswith("PASS: highest cached-token ratio")
    assert "leaky" not in lines[0].split("isolating:")[1]
    assert lines[1].startswith("MISS: lowest TTFT p99") and "leaky" in lines[1]
    assert lines[2].startswith("PASS: no replica above 1.5x")
    assert check_targets([result("saltgate", 0.3, 1, 1.6, hits=1)])[0].startswith("MISS")
    assert check_targets([result("round_robin", 0.3, 1, 1.0)]) == ["N/A: no result for saltgate"]
    table = markdown_table([*results, {"policy": "broken", "error": "no smg"}])
    assert "| saltgate | 0.300 | 200 | 400 |" in table and "error: no smg" in table


# -- process helpers' pure parts -------------------------------------------------------------------


def test_metric_total_sums_label_sets_and_ignores_lookalikes() -> None:
    text = (
        "# TYPE vllm:request_success counter\n"
        'vllm:request_success_total{engine="0"} 12.0\n'
        'vllm:request_success_total{engine="1"} 3.0\n'
        "vllm:request_success_totally_else 99\n"
    )
    assert metric_total(text, "vllm:request_success_total") == 15.0
    assert metric_total("", "vllm:request_success_total") is None


def test_gateway_config_is_what_saltgate_serve_accepts(tmp_path: Path) -> None:
    state = GatewayState(tmp_path / "state", ("k",))
    urls = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    text = gateway_config(
        state, urls, port=9000, admin_port=9003, policy="round_robin",
        router_settings=("window_bytes = 256",),
    )  # fmt: skip
    doc = tomllib.loads(text)
    assert doc["router"] == {"policy": "round_robin", "window_bytes": 256}
    assert [r["url"] for r in doc["replicas"]] == urls
    check_gateway_config(text, tmp_path)
    bad = gateway_config(
        state, urls, port=9000, admin_port=9003, policy="round_robin",
        router_settings=("no_such_knob = 1",),
    )  # fmt: skip
    with pytest.raises(BenchError, match="no_such_knob"):
        check_gateway_config(bad, tmp_path)
    with pytest.raises(BenchError, match="not valid TOML"):
        check_gateway_config(text + "\n[router\n", tmp_path)
