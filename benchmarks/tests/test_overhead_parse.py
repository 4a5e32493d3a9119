"""The overhead benchmark's pure parts: wrk's output, the load it sends, the report maths."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from saltgate.config import load_config
from saltgate.http.tls import client_context
from saltgate.serving.listener_tls import edge_context
from saltgate_bench.cpu import CpuUse, proc_ticks, process_tree, tree_ticks
from saltgate_bench.gateway_setup import (
    gateway_config,
    prepare_gateway_state,
    write_gateway_config,
)
from saltgate_bench.overhead import (
    Backends,
    Options,
    bench_certificate,
    fixed_completion,
    nginx_conf,
)
from saltgate_bench.overhead_report import (
    Meta,
    OverheadResult,
    Pinning,
    Sample,
    aggregate,
    markdown,
    ratios,
    summarize_profile,
    tls_cost,
)
from saltgate_bench.procs import Machine, Tools, pinned
from saltgate_bench.wrk import WrkResult, chat_body, parse_time_ms, parse_wrk_output, wrk_script

WRK_OK = """\
Running 5s test @ http://127.0.0.1:40001/v1/chat/completions
  1 threads and 32 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     9.23ms    1.02ms  31.20ms   91.00%
    Req/Sec     3.47k   120.00     3.70k    70.00%
  Latency Distribution
     50%    9.23ms
     75%    9.80ms
     90%   10.50ms
     99%   15.14ms
  17350 requests in 5.00s, 12.34MB read
Requests/sec:   3470.00
Transfer/sec:      2.47MB
"""

WRK_ERRORS = """\
Running 2s test @ http://127.0.0.1:40002/v1/chat/completions
  1 threads and 1 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency    38.50us   12.00us   1.20ms   95.00%
    Req/Sec    24.70k     1.10k   26.00k    80.00%
  Latency Distribution
     50%   38.00us
     75%   41.00us
     90%   45.00us
     99%   82.00us
  49480 requests in 2.00s, 30.10MB read
  Socket errors: connect 0, read 3, write 0, timeout 2
  Non-2xx or 3xx responses: 7
Requests/sec:  24740.12
Transfer/sec:     15.05MB
"""


@pytest.mark.unit
def test_parse_wrk_output() -> None:
    r = parse_wrk_output(WRK_OK)
    assert r.requests == 17350
    assert r.duration_s == pytest.approx(5.0)
    assert r.rps == pytest.approx(3470.0)
    assert (r.p50_ms, r.p75_ms, r.p90_ms, r.p99_ms) == pytest.approx((9.23, 9.8, 10.5, 15.14))
    assert r.non_2xx == 0
    assert r.errors == 0


@pytest.mark.unit
def test_parse_wrk_output_errors_and_microseconds() -> None:
    r = parse_wrk_output(WRK_ERRORS)
    assert r.p50_ms == pytest.approx(0.038)
    assert r.p99_ms == pytest.approx(0.082)
    assert r.non_2xx == 7
    assert r.socket_errors == {"connect": 0, "read": 3, "write": 0, "timeout": 2}
    assert r.errors == 12


@pytest.mark.unit
def test_parse_wrk_output_needs_latency_distribution() -> None:
    without = "\n".join(line for line in WRK_OK.splitlines() if "%" not in line or "Req" in line)
    with pytest.raises(ValueError, match="latency distribution"):
        parse_wrk_output(without)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("text", "ms"),
    [("12.00us", 0.012), ("1.5ms", 1.5), ("2.00s", 2000.0), ("1.50m", 90_000.0)],
)
def test_parse_time_ms(text: str, ms: float) -> None:
    assert parse_time_ms(text) == pytest.approx(ms)


@pytest.mark.unit
def test_parse_time_ms_rejects_garbage() -> None:
    with pytest.raises(ValueError):
        parse_time_ms("fast")


@pytest.mark.unit
def test_load_is_a_chat_request_of_about_4_4_kb() -> None:
    for stream in (False, True):
        body = chat_body(stream=stream)
        assert 4300 <= len(body) <= 4500
        doc = json.loads(body)
        assert doc["model"] == "sim-model"
        assert doc.get("stream", False) is stream
    script = wrk_script(chat_body(stream=False), "sk-test")
    assert 'wrk.headers["Authorization"] = [==[Bearer sk-test]==]' in script
    assert 'wrk.method = "POST"' in script


@pytest.mark.unit
def test_nginx_answer_is_openai_shaped_and_quoted() -> None:
    doc = json.loads(fixed_completion())
    assert doc["usage"]["prompt_tokens_details"]["cached_tokens"] == 1024
    conf = nginx_conf(Path("/tmp/x"), [1111, 2222])
    assert "listen 127.0.0.1:1111;" in conf
    assert "listen 127.0.0.1:2222;" in conf
    assert "$" not in conf
    assert "ssl" not in conf


def test_upstream_tls_serves_nginx_over_tls_and_saltgate_verifies_it(tmp_path: Path) -> None:
    """--upstream-tls: nginx listens on more ports with a certificate made for the run, and
    saltgate's replicas are those https ports with the certificate as tls_ca_file (a
    config `saltgate serve` loads); direct stays on the plain ports."""
    cert = bench_certificate(tmp_path)
    assert cert.with_suffix(".key").stat().st_mode & 0o077 == 0
    conf = nginx_conf(tmp_path, [1111, 2222], [3333, 4444], cert)
    assert "listen 127.0.0.1:1111;" in conf and "listen 127.0.0.1:3333 ssl;" in conf
    assert f"ssl_certificate {cert};" in conf
    backends = Backends([1111, 2222], [], [3333, 4444], cert)
    assert backends.urls == ["https://127.0.0.1:3333", "https://127.0.0.1:4444"]
    state = prepare_gateway_state(tmp_path / "state", ["bench"], None)
    text = gateway_config(state, backends.urls, port=1, admin_port=2, tls_ca_file=cert)
    path = write_gateway_config(tmp_path / "gw.toml", text)
    replicas = load_config(path).replicas
    assert [(r.tls, r.tls_ca_file) for r in replicas] == [(True, cert), (True, cert)]
    client_context(cert)  # the certificate is one a client context can trust


def test_saltgate_tls_serves_https_with_the_runs_certificate(tmp_path: Path) -> None:
    """Target saltgate-tls: the same config with [gateway] tls_cert_file and tls_key_file
    (the run's certificate and its key), which `saltgate serve` loads."""
    cert = bench_certificate(tmp_path)
    state = prepare_gateway_state(tmp_path / "state", ["bench"], None)
    text = gateway_config(state, ["http://127.0.0.1:9"], port=1, admin_port=2, edge_cert=cert)
    config = load_config(write_gateway_config(tmp_path / "gw.toml", text))
    assert (config.tls_cert_file, config.tls_key_file) == (cert, cert.with_suffix(".key"))
    assert edge_context(config) is not None  # readable, mode 0600, the key the certificate's


@pytest.mark.unit
def test_tls_cost_sets_saltgate_tls_against_saltgate_of_the_same_run() -> None:
    samples = [
        _sample("saltgate", 1, 2000, 0.35, 1.1),
        _sample("saltgate-tls", 1, 1800, 0.40, 1.3),
        _sample("saltgate", 32, 4000, 8.0, 12.0, router_cpu=100.0),
        _sample("saltgate-tls", 32, 3000, 10.0, 15.0, router_cpu=100.0),
        _sample("smg", 32, 3200, 10.0, 14.0),
    ]
    rows = tls_cost(aggregate(samples))
    assert "| nginx | 1 | 2,000 | 1,800 | 0.90x | 50 us | 200 us | - | - |" in rows
    cpu = "| 250 us | 333 us |"  # 100% of a core over 4,000 and 3,000 req/s
    assert f"| nginx | 32 | 4,000 | 3,000 | 0.75x | 2.00 ms | 3.00 ms {cpu}" in rows
    assert tls_cost(aggregate(samples[:1] + samples[2:3])) == []  # no saltgate-tls: no table


def _sample(
    target: str, conc: int, rps: float, p50: float, p99: float, *, router_cpu: float | None = None
) -> Sample:
    wrk = WrkResult(int(rps), 1.0, rps, p50, p50, p99, p99)
    cpu = CpuUse(wrk_cpu_pct=40.0, backend_cpu_pct=30.0, router_proc_cpu_pct=router_cpu)
    return Sample("nginx", target, 0, conc, wrk, cpu)


@pytest.mark.unit
def test_added_latency_and_ratios() -> None:
    samples = [
        _sample("direct", 1, 20000, 0.05, 0.1),
        _sample("saltgate", 1, 2000, 0.35, 1.1),
        _sample("smg", 1, 1500, 0.45, 2.1),
        _sample("direct", 32, 30000, 1.0, 2.0),
        _sample("saltgate", 32, 4000, 8.0, 12.0),
        _sample("smg", 32, 3200, 10.0, 14.0),
    ]
    points = aggregate(samples)
    salt1 = next(p for p in points if p.target == "saltgate" and p.concurrency == 1)
    assert salt1.added_p50_ms == pytest.approx(0.30)
    assert salt1.added_p99_ms == pytest.approx(1.0)
    rows = ratios(points)
    r32 = next(r for r in rows if r.concurrency == 32)
    assert r32.peer == "smg"
    assert r32.rps_ratio == pytest.approx(1.25)
    assert r32.added_p50_ratio == pytest.approx(7.0 / 9.0)
    meta = Meta(
        started="now",
        elapsed_s=1.0,
        command="saltgate-bench overhead",
        machine=Machine("test", 2, "6.1", "3.11.7"),
        loadavg_before=(0.0, 0.0, 0.0),
        loadavg_after=(0.0, 0.0, 0.0),
        pinning=Pinning(0, [0, 1]),
        duration_s=1,
        warmup_s=0,
        rounds=1,
        store="postgres",
        saltgate_workers=2,
        concurrency=[1, 32],
        body_bytes={"nginx": 4400},
        versions={},
        saltgate_source="abc1234",
    )
    support = {"direct": {"nginx": "ok"}, "saltgate": {"nginx": "ok"}, "smg": {"nginx": "ok"}}
    result = OverheadResult(meta, support, points, rows, [], [], samples)
    text = markdown(result)
    assert "| saltgate | 32 | 4,000 |" in text
    assert "saltgate's store: postgres" in text
    assert "routers on CPU 0,1; saltgate's store: postgres; saltgate workers: 2;" in text
    assert "1.25x, met" in text
    assert "300 us vs 400 us, met" in text
    assert (
        "| saltgate | 1 | 2,000 | 350 us | 1.10 ms | 300 us | 1.00 ms | 0 | - | - | - (40%/30%/-) |"
        in text
    )


@pytest.mark.unit
def test_the_json_document_keeps_its_shape() -> None:
    """docs/benchmarks.md and saved results read these fields: the records write the same
    keys, in the same order, that the dictionaries did."""
    sample = Sample("nginx", "saltgate", 0, 32, parse_wrk_output(WRK_OK), CpuUse(wrk_cpu_pct=9.5))
    assert list(sample.to_json()) == [
        "scenario", "target", "round", "concurrency", "requests", "duration_s", "rps",
        "p50_ms", "p75_ms", "p90_ms", "p99_ms", "non_2xx", "socket_errors", "cpu",
    ]  # fmt: skip
    assert sample.to_json()["cpu"] == {"wrk_cpu_pct": 9.5, "backend_cpu_pct": 0.0}
    (point,) = aggregate([sample])
    doc = json.loads(json.dumps(asdict(point)))
    assert list(doc)[:9] == [
        "scenario", "target", "concurrency", "rounds", "rps", "p50_ms", "p99_ms", "errors",
        "requests",
    ]  # fmt: skip
    assert list(doc)[-3:] == ["added_p50_ms", "added_p99_ms", "backend_bound"]
    assert doc["wrk_cpu_pct"] == 9.5 and doc["router_proc_cpu_pct"] is None


@pytest.mark.unit
def test_summarize_profile_own_and_total() -> None:
    raw = (
        "<module> (saltgate/cli.py:1);run (asyncio/runners.py:10);handle (gw/server.py:5) 30\n"
        "<module> (saltgate/cli.py:1);run (asyncio/runners.py:10);loads (orjson) 10\n"
        "<module> (saltgate/cli.py:1);run (asyncio/runners.py:10) 10\n"
    )
    summary = summarize_profile(raw)
    assert summary.samples == 50
    own = {row.frame: row.pct for row in summary.top_own}
    assert own["handle (gw/server.py:5)"] == 60.0
    assert own["run (asyncio/runners.py:10)"] == 20.0
    total = {row.frame: row.pct for row in summary.top_total}
    assert total["<module> (saltgate/cli.py:1)"] == 100.0


@pytest.mark.unit
def test_summarize_profile_of_worker_processes_leaves_out_the_process_frames() -> None:
    raw = (
        'process 10:"python -m saltgate.cli serve";process 11:"python -m saltgate.gateway'
        '.worker --index 0";run (asyncio/runners.py:10);handle (gw/server.py:5) 30\n'
        'process 10:"python -m saltgate.cli serve";process 12:"python -m saltgate.gateway'
        '.worker --index 1";run (asyncio/runners.py:10);handle (gw/server.py:5) 10\n'
    )
    summary = summarize_profile(raw)
    assert summary.samples == 40
    assert [row.frame for row in summary.top_own] == ["handle (gw/server.py:5)"]
    assert {row.frame for row in summary.top_total} == {
        "run (asyncio/runners.py:10)",
        "handle (gw/server.py:5)",
    }


@pytest.mark.unit
def test_saltgate_workers_give_every_router_every_cpu() -> None:
    """One core per router, as in the one-core figures; with saltgate workers, every CPU
    for every router (the peers too: smg sizes its threads to them), wrk and the backend
    staying on the load CPU."""

    def options(router_cpu: int | None, workers: int) -> Options:
        return Options(
            ("saltgate",), ("nginx",), (1,), 1, 0, 1, 0, router_cpu, 1.0, None, None, False,
            saltgate_workers=workers,
        )  # fmt: skip

    one = options(1, 1)
    assert (one.router_cpus, one.router_core) == ((1,), 1)
    two = options(1, 2)
    everything = tuple(sorted(os.sched_getaffinity(0)))
    assert two.router_cpus == everything
    assert two.router_core == (everything[0] if len(everything) == 1 else None)
    assert options(None, 2).router_cpus is None
    tools = Tools(None, None, "/usr/bin/taskset", None, None, None, None)
    assert pinned(tools, (0, 1), ["x"]) == ["/usr/bin/taskset", "-c", "0,1", "x"]
    assert pinned(tools, 1, ["x"]) == ["/usr/bin/taskset", "-c", "1", "x"]


# SIGINT set to raise first: a runner started in the background (nohup, `cmd &` in a script)
# hands its children SIGINT ignored, and Python then leaves it ignored.
_PARENT_OF_ONE = """
import signal, subprocess, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
try:
    time.sleep(60)
finally:
    child.kill()
"""


def test_a_routers_cpu_counts_its_worker_processes() -> None:
    """`saltgate serve --workers N` is a parent and N children: the router's CPU
    accounting (CpuWindow) reads the threads of the whole process tree."""
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT_OF_ONE], stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert {parent.pid, child} <= set(process_tree(os.getpid()))
        assert process_tree(parent.pid) == [parent.pid, child]
        threads = tree_ticks(parent.pid)
        assert set(proc_ticks(parent.pid)) | set(proc_ticks(child)) == set(threads)
    finally:
        parent.send_signal(signal.SIGINT)  # its finally kills the child
        parent.wait(timeout=30)
