"""Metrics as plain snapshots: what a worker sends its parent, and how the parent merges
them (counters and the histogram summed, gauges per worker, dead workers' counts kept)."""

from __future__ import annotations

import pytest

from saltgate.gateway.metrics import (
    DURATION_BUCKETS,
    Metrics,
    Snapshot,
    duration_buckets,
    merge_workers,
    render,
)

pytestmark = pytest.mark.unit

OK = (("method", "POST"), ("status", "200"))
DURATION = "saltgate_request_duration_seconds"
BUCKETS = (0.005, 0.25, 10.0)


def _worker(requests: int, latencies: list[float], inflight: float) -> Metrics:
    m = Metrics()
    m.describe("saltgate_requests_total", "counter", "Requests by method and status.")
    for _ in range(requests):
        m.inc("saltgate_requests_total", OK)
    m.inc("saltgate_tokens_total", (("kind", "prompt"),), 10.0 * requests)
    m.histogram(DURATION, "Time from request to the end of the response.", BUCKETS)
    for seconds in latencies:
        m.observe(DURATION, (), seconds)
    m.gauge("saltgate_replica_inflight", "In flight.", lambda: [((("replica", "0"),), inflight)])
    return m


def _lines(text: bytes) -> list[str]:
    return [ln for ln in text.decode().splitlines() if not ln.startswith("#")]


def test_a_single_process_renders_as_before() -> None:
    text = _worker(2, [0.003, 0.2], 1.0).render().decode()
    assert text == (
        "# HELP saltgate_requests_total Requests by method and status.\n"
        "# TYPE saltgate_requests_total counter\n"
        'saltgate_requests_total{method="POST",status="200"} 2.0\n'
        "# HELP saltgate_tokens_total saltgate_tokens_total\n"
        "# TYPE saltgate_tokens_total counter\n"
        'saltgate_tokens_total{kind="prompt"} 20.0\n'
        "# HELP saltgate_replica_inflight In flight.\n"
        "# TYPE saltgate_replica_inflight gauge\n"
        'saltgate_replica_inflight{replica="0"} 1.0\n'
        "# HELP saltgate_request_duration_seconds Time from request to the end of the response.\n"
        "# TYPE saltgate_request_duration_seconds histogram\n"
        'saltgate_request_duration_seconds_bucket{le="0.005"} 1\n'
        'saltgate_request_duration_seconds_bucket{le="0.25"} 2\n'
        'saltgate_request_duration_seconds_bucket{le="10.0"} 2\n'
        'saltgate_request_duration_seconds_bucket{le="+Inf"} 2\n'
        "saltgate_request_duration_seconds_sum 0.203\n"
        "saltgate_request_duration_seconds_count 2\n"
    )


def test_a_snapshot_survives_the_wire_and_is_a_copy() -> None:
    m = _worker(3, [0.01], 2.0)
    snap = m.snapshot()
    m.inc("saltgate_requests_total", OK)
    m.observe(DURATION, (), 0.5)
    back = Snapshot.from_json(snap.to_json())
    assert back == snap
    assert back.total("saltgate_requests_total") == 3.0
    assert render(back) != m.render()  # the snapshot did not follow the later increments


def test_workers_merge_counters_summed_gauges_per_worker_histogram_merged() -> None:
    a = _worker(3, [0.003, 0.003, 0.2], 1.0).snapshot()
    b = _worker(5, [0.02], 4.0).snapshot()
    merged = merge_workers({"0": a, "1": b}, Snapshot())
    lines = _lines(render(merged))
    assert 'saltgate_requests_total{method="POST",status="200"} 8.0' in lines
    assert 'saltgate_tokens_total{kind="prompt"} 80.0' in lines
    assert 'saltgate_replica_inflight{replica="0",worker="0"} 1.0' in lines
    assert 'saltgate_replica_inflight{replica="0",worker="1"} 4.0' in lines
    assert 'saltgate_request_duration_seconds_bucket{le="0.005"} 2' in lines
    assert 'saltgate_request_duration_seconds_bucket{le="0.25"} 4' in lines
    assert "saltgate_request_duration_seconds_count 4" in lines
    assert not any(
        ln.startswith("saltgate_replica_inflight{replica") and "worker" not in ln for ln in lines
    )


def test_a_dead_workers_counts_stay_in_the_sums_but_not_its_gauges() -> None:
    dead = _worker(7, [0.1], 9.0).snapshot()
    retired = Snapshot()
    retired.add_counts(dead)
    fresh = _worker(1, [0.1], 0.0).snapshot()  # its replacement, counting from zero
    merged = merge_workers({"0": fresh}, retired)
    assert merged.total("saltgate_requests_total") == 8.0
    counts = merged.histograms[DURATION].values[()][0]
    assert counts[-1] == 0 and sum(counts) == 2
    assert merged.gauges["saltgate_replica_inflight"].values == [
        ((("replica", "0"), ("worker", "0")), 0.0)
    ]


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"[]",
        b'{"counters": {}}',
        b'{"counters": {}, "gauges": {}, "histograms": {"h": ["", [1.0], [[[], [1], 0]]]}}',
    ],
)
def test_a_malformed_snapshot_is_refused(data: bytes) -> None:
    with pytest.raises(ValueError, match="not a metrics snapshot"):
        Snapshot.from_json(data)


def test_durations_end_at_the_upstream_timeout() -> None:
    """A request cannot outlast the upstream timeout: its bound is the last bucket, and
    the default 600 s timeout keeps every standard bucket (the old histogram ended at 10 s)."""
    assert duration_buckets(600.0) == DURATION_BUCKETS
    assert DURATION_BUCKETS[-1] == 600.0
    assert duration_buckets(45.0)[-3:] == (10.0, 30.0, 45.0)
    assert duration_buckets(1.0)[-1] == 1.0 and len(set(duration_buckets(1.0))) == len(
        duration_buckets(1.0)
    )


def test_histograms_with_other_buckets_do_not_merge() -> None:
    """Workers of one gateway share a config; a mismatch is a bug, not a silent sum."""
    a = _worker(1, [0.1], 0.0).snapshot()
    other = Metrics()
    other.histogram(DURATION, "x", (1.0, 2.0))
    other.observe(DURATION, (), 0.5)
    with pytest.raises(ValueError, match="buckets do not match"):
        merge_workers({"0": a, "1": other.snapshot()}, Snapshot())


def test_label_values_are_escaped() -> None:
    """A model id is any string a replica lists: quotes, backslashes and newlines in it
    cannot break the exposition format or forge a series."""
    m = Metrics()
    m.inc("saltgate_tokens_total", (("model", 'a"b\\c\nd} 9'),))
    assert 'saltgate_tokens_total{model="a\\"b\\\\c\\nd} 9"} 1.0' in _lines(m.render())
