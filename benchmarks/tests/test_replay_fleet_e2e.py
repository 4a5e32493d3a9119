"""The fleet benchmark end to end: `saltgate-bench replay --gateways N` as a subprocess,
with real `saltgate serve` gateways behind a real HAProxy, one real PostgreSQL store and
a real Redis bus (saltgate_devkit.services starts them), in front of real simulated
replicas. Short settings: the figures are docs/benchmarks.md's, not these tests'."""

from __future__ import annotations

from pathlib import Path

from benchmarks.tests.test_replay_e2e import REQUIRED, bench_replay


def test_one_and_two_gateways_with_and_without_shared_state(tmp_path: Path) -> None:
    """About 30 s: three fleets (1 gateway; 2 with the bus, 2 without) each start
    behind HAProxy on a PostgreSQL store and a Redis bus, for a replay of the trace's
    first 30 s at 10x (3 s each): the start-ups are most of it."""
    report = bench_replay(
        tmp_path,
        "--policy", "saltgate", "--duration", "30",
        "--gateways", "1,2", "--shared-state", "on,off",
    )  # fmt: skip
    results = report["results"]
    variants = [(r["gateways"], r["shared_state"]) for r in results]
    assert variants == [(1, False), (2, True), (2, False)]
    n = report["schedule"]["requests"]
    for r in results:
        assert set(r) >= REQUIRED | {"gateways", "shared_state", "ledger"}, r
        assert r["failed"] == 0 and r["completed"] == n, r.get("errors")
        assert r["cross_tenant_hits"] == 0
        assert 0.0 < r["cached_token_ratio"] < 1.0
        ledger = r["ledger"]
        assert ledger["delivered_200"] == ledger["with_one_record"] == n, ledger
        assert ledger["without_record"] == ledger["with_several_records"] == 0
    # Round robin per request: each gateway of the pair served half (the readiness probes
    # aside); its access log has one line per request.
    work = tmp_path / "work"
    for tag in ("saltgate-x2-shared", "saltgate-x2-alone"):
        counts = [
            (work / f"{tag}-gw{i}.log").read_text().count("POST /v1/completions") for i in range(2)
        ]
        assert abs(counts[0] - counts[1]) <= 2 and sum(counts) >= n, counts
    shared_log = (work / "saltgate-x2-shared-gw0.log").read_text()
    assert "cluster bus redis://127.0.0.1:" in shared_log
    assert "cluster bus" not in (work / "saltgate-x2-alone-gw0.log").read_text()
    assert any("x2 shared cached-token ratio" in line for line in report["targets"])
    assert report["config"]["fleet"]["gateways"] == [1, 2]


def test_a_gateway_killed_mid_replay_fails_only_what_was_in_flight(tmp_path: Path) -> None:
    report = bench_replay(
        tmp_path,
        "--policy", "saltgate", "--duration", "60",
        "--gateways", "2", "--shared-state", "on", "--kill-gateway-at", "2",
    )  # fmt: skip
    (r,) = report["results"]
    fault = r["gateway_fault"]
    n = report["schedule"]["requests"]
    assert fault["gateway"] == 0 and fault["killed_at_s"] >= 2
    assert fault["in_flight_at_kill"] > 0
    assert r["completed"] + r["failed"] == n
    # Only requests in flight at the kill failed; the rest went to the other gateway.
    assert fault["failed_otherwise"] == 0, r["errors"]
    assert r["failed"] == fault["failed_in_flight_at_kill"]
    assert r["completed"] >= n - fault["in_flight_at_kill"]
    ledger = r["ledger"]
    assert ledger["delivered_200"] == ledger["with_one_record"] == r["completed"], ledger
