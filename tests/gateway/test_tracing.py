"""OpenTelemetry traces ([tracing], docs/observability.md): spans reach an OTLP/HTTP
endpoint the test runs, continue the client's trace, carry the GenAI attributes, and
carry no secret; without [tracing] OpenTelemetry is never loaded."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import orjson
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from tests.gateway.stack import MODEL, run, stack
from tests.support.leaks import leaks
from tests.support.waiting import eventually

from saltgate.config import ConfigError, TracingConfig, load_master_key, parse_config
from saltgate.derivations.derive import derive_subkeys
from saltgate.gateway.tracing import EXTRA_MISSING, GatewayTracer, start_tracer
from saltgate.store.tenants import TenantStore

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
PROMPT = "the secret plan of the hedgehogs, word for word"
USER_SECRET = "user-secret-of-carol-4711"


class Collector:
    """An OTLP/HTTP trace endpoint on loopback: keeps every body POSTed to /v1/traces."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        bodies = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                data = self.rfile.read(int(self.headers["content-length"]))
                if self.headers.get("content-encoding") == "gzip":
                    data = gzip.decompress(data)
                if self.path == "/v1/traces":
                    bodies.append(data)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def spans(self) -> list[Span]:
        out = []
        for body in list(self.bodies):
            request = ExportTraceServiceRequest.FromString(body)
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    out.extend(scope.spans)
        return out


@contextmanager
def collector() -> Iterator[Collector]:
    c = Collector()
    thread = threading.Thread(target=c.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield c
    finally:
        c.server.shutdown()
        c.server.server_close()


def attributes(span: Span) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in span.attributes:
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value"))
    return out


def test_a_request_and_its_attempt_reach_the_collector_under_the_clients_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A streamed chat request with the client's traceparent and a user secret: the
    collector receives the request span (child of the client's span) and the attempt
    (child of the request), with the GenAI model and token counts, the tenant id and the
    replica URL; the replica received the attempt's traceparent. The exported bytes hold
    no API key, salt, user secret, prompt, master key or tenant name; the control: a
    span given the prompt as an attribute is caught by the same scan."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # export within 50 ms, not 5 s

    async def main() -> None:
        with collector() as otlp:
            tracing = TracingConfig(otlp.url, service_name="saltgate-test")
            async with (
                stack(tmp_path, replicas=1, tracing=tracing) as s,
                s.client("alice") as alice,
            ):
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": PROMPT}],
                    "max_tokens": 3,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    "user_cache_secret": USER_SECRET,
                }
                headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
                async with alice.stream(
                    "POST", "/v1/chat/completions", json=body, headers=headers
                ) as resp:
                    assert resp.status_code == 200
                    text = (await resp.aread()).decode()
                [usage] = [
                    doc["usage"]
                    for ln in text.splitlines()
                    if ln.startswith("data: {") and (doc := orjson.loads(ln[6:])).get("usage")
                ]
                await eventually(lambda: len(otlp.spans()) >= 2, what="two spans exported")
                spans = otlp.spans()
                exported = b"".join(otlp.bodies)
                [forwarded] = s.forwarded()
                upstream_parent = dict(forwarded.headers)[b"traceparent"].decode()
                master = load_master_key(s.state_dir / "master.key")
                secrets = {
                    "api_key": s.keys["alice"],
                    "salt": orjson.loads(forwarded.body)["cache_salt"],
                    "master_key": master,
                    "salt_key": derive_subkeys(master).salt,
                    "user_secret": USER_SECRET,
                    "prompt": PROMPT,
                    "tenant_name": "alice-tenant-name-is-not-exported",
                }
                with TenantStore.from_state_dir(s.state_dir) as store:
                    tenant = store.get_tenant("alice").id
                # The control: the prompt planted as an attribute of an exported span.
                tracer = s.gateway.gateway.tracer
                assert isinstance(tracer, GatewayTracer)
                tracer.tracer.start_span("planted", attributes={"planted.prompt": PROMPT}).end()
                await eventually(
                    lambda: bool(leaks(b"".join(otlp.bodies), prompt=PROMPT)),
                    what="the planted prompt exported",
                )

        secrets.pop("tenant_name")
        assert not leaks(exported, **secrets), leaks(exported, **secrets)
        assert b"alice" not in exported  # the tenant's name: only its id is exported

        [server] = [sp for sp in spans if sp.kind == Span.SPAN_KIND_SERVER]
        [client] = [sp for sp in spans if sp.kind == Span.SPAN_KIND_CLIENT]
        assert server.trace_id.hex() == TRACE_ID == client.trace_id.hex()
        assert server.parent_span_id.hex() == PARENT_ID
        assert client.parent_span_id == server.span_id
        assert upstream_parent == f"00-{TRACE_ID}-{client.span_id.hex()}-01"
        assert server.name == "POST /v1/chat/completions"
        assert client.name == f"chat {MODEL}"

        outer, inner = attributes(server), attributes(client)
        for attrs in (outer, inner):
            assert attrs["gen_ai.request.model"] == MODEL
            assert attrs["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
            assert attrs["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
            assert "gen_ai.usage.cache_read.input_tokens" in attrs
            assert attrs["http.response.status_code"] == 200
        assert outer["http.request.method"] == "POST"
        assert outer["http.route"] == "/v1/chat/completions"
        assert outer["saltgate.tenant.id"] == tenant and tenant.startswith("tn_")
        assert inner["gen_ai.operation.name"] == "chat"
        assert inner["saltgate.replica"] == f"http://127.0.0.1:{s.taps[0].port}"
        assert inner["server.port"] == s.taps[0].port

    run(main)


def test_without_tracing_opentelemetry_is_never_imported(tmp_path: Path) -> None:
    """A gateway without [tracing] serves a request in a fresh interpreter that never
    loads OpenTelemetry's tracing SDK or exporter; the control: with [tracing] the same
    script does load them. (redis-py, installed for the cluster bus, imports the
    OpenTelemetry metrics SDK by itself when it is installed: not ours to test.)"""
    script = """
import asyncio, sys
from pathlib import Path
from tests.gateway.stack import stack
from tests.support.completions import complete
from saltgate.config import TracingConfig

TRACING_MODULES = ("opentelemetry.sdk.trace", "opentelemetry.exporter")

async def main(tmp, traced):
    tracing = TracingConfig("http://127.0.0.1:9") if traced else None
    async with stack(Path(tmp), replicas=1, tracing=tracing) as s, s.client("alice") as alice:
        await complete(alice, "no tracing here")
    print(any(m.startswith(TRACING_MODULES) for m in sys.modules))

asyncio.run(main(sys.argv[1], sys.argv[2] == "on"))
"""
    root = Path(__file__).resolve().parents[2]
    loaded = {}
    for mode in ("off", "on"):
        (tmp_path / mode).mkdir()
        done = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path / mode), mode],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=root,
            env={**os.environ, "PYTHONPATH": str(root)},
            check=False,
        )
        assert done.returncode == 0, done.stderr
        loaded[mode] = done.stdout.strip().splitlines()[-1]
    assert loaded == {"off": "False", "on": "True"}


@pytest.mark.unit
def test_tracing_without_the_extra_is_a_clear_error_at_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in [m for m in sys.modules if m.split(".")[0] == "opentelemetry"]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    with pytest.raises(ConfigError, match=r"pip install 'saltgate\[otel\]'") as caught:
        start_tracer(TracingConfig("http://127.0.0.1:4318"))
    assert str(caught.value) == EXTRA_MISSING


@pytest.mark.unit
@pytest.mark.parametrize(
    ("table", "error"),
    [
        ({}, "tracing.otlp_endpoint: required"),
        ({"otlp_endpoint": "collector:4318"}, 'expected "http(s)://host:port"'),
        ({"otlp_endpoint": "http://u:p@c:4318"}, "credentials"),
        ({"otlp_endpoint": "http://c:4318", "sample_ratio": 1.5}, "from 0 to 1"),
        ({"otlp_endpoint": "http://c:4318", "service_name": ""}, "must not be empty"),
        ({"otlp_endpoint": "http://c:4318", "sampling": 1}, "unknown keys ['sampling']"),
    ],
)
def test_a_bad_tracing_section_is_refused(table: dict[str, Any], error: str) -> None:
    doc = {"replicas": [{"url": "http://127.0.0.1:9"}], "tracing": table}
    with pytest.raises(ConfigError) as caught:
        parse_config(doc, Path("."))
    assert error in str(caught.value)


@pytest.mark.unit
def test_a_tracing_section_is_read() -> None:
    doc = {
        "replicas": [{"url": "http://127.0.0.1:9"}],
        "tracing": {"otlp_endpoint": "http://c:4318/", "sample_ratio": 0.25},
    }
    assert parse_config(doc, Path(".")).tracing == TracingConfig("http://c:4318", "saltgate", 0.25)
    assert parse_config({"replicas": doc["replicas"]}, Path(".")).tracing is None
