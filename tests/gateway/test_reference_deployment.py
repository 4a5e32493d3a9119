"""The reference deployment of docs/deployment.md, run as written on loopback.

The doc quotes packaging/reference/ (gateway.toml, haproxy.cfg, first-run.sh) and this
test checks the quotes equal the files, then runs those files with only the loopback
substitutions the doc lists under "What the test changes": HAProxy terminating TLS in
front of two `saltgate serve --workers 2` gateways, one PostgreSQL, Redis as the cluster
bus (with the doc's ACL user), four simulated replicas behind TLS. Each substitution
asserts the text it replaces is there, so a doc edit that the test would no longer run
fails here instead of drifting.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import httpx
import pytest
from tests.gateway.stack import run
from tests.support.gateways import SALTGATE, GatewayProcess
from tests.support.http import async_client
from tests.support.tls import make_pki
from tests.support.waiting import eventually

from saltgate.config import create_secret_file
from saltgate.sim.run import RunningSim, SimConfig, start_sim
from saltgate_devkit.procs import free_port
from saltgate_devkit.services import (
    HaproxyServer,
    PostgresServer,
    RedisServer,
)

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "packaging" / "reference"
DOC = ROOT / "docs" / "deployment.md"
FILES = ("gateway.toml", "haproxy.cfg", "first-run.sh")
CHAT = "/v1/chat/completions"
MODEL = "qwen3"  # the model [prices.qwen3] prices
STREAM_TOKENS = 300  # long enough to be in flight when a gateway is stopped


def quoted(doc: str, name: str) -> str:
    """The fenced block the doc shows right after its link to packaging/reference/NAME."""
    link = re.escape(f"[packaging/reference/{name}](../packaging/reference/{name})")
    found = re.search(link + r"[^\n]*\n\n```[a-z]*\n(.*?)```\n", doc, re.S)
    assert found, f"docs/deployment.md does not quote packaging/reference/{name}"
    return found.group(1)


@pytest.mark.parametrize("name", FILES)
def test_the_doc_quotes_the_reference_files_exactly(name: str) -> None:
    assert quoted(DOC.read_text(), name) == (REFERENCE / name).read_text()


def substitute(text: str, changes: list[tuple[str, str]]) -> str:
    """Each (old, new) of the doc's "What the test changes", every occurrence; an `old`
    the text no longer holds fails (the doc changed under the test)."""
    for old, new in changes:
        assert old in text, f"{old!r} is no longer in the reference file"
        text = text.replace(old, new)
    return text


@asynccontextmanager
async def _replicas(pki_dir: Path, api_key: str) -> AsyncIterator[list[RunningSim]]:
    """Four simulated vLLM replicas serving https with a certificate for 127.0.0.1 (the
    TLS sidecar of the doc), each requiring the replicas' API key."""
    pki = make_pki(pki_dir)
    sims = []
    try:
        for _ in range(4):
            sims.append(
                await start_sim(
                    SimConfig(
                        port=0,
                        model=MODEL,
                        api_key=api_key,
                        decode_ms_per_token=5.0,  # streams that are still running at a SIGTERM
                        tls_cert=str(pki.server.cert),
                        tls_key=str(pki.server.key),
                    )
                )
            )
        yield sims
    finally:
        for s in sims:
            await s.close()


class Haproxy(HaproxyServer):
    """HAProxy run from the reference haproxy.cfg (substituted) instead of its own."""

    def __init__(self, text: str, port: int) -> None:
        super().__init__([])
        self._text = text
        self._fixed_port = port

    def start(self) -> None:
        cfg = self.root / "haproxy.cfg"
        cfg.write_text(self._text)
        self._child.spawn([self.binary, "-db", "-f", str(cfg)])
        self._child.wait_port(self._fixed_port)


@pytest.fixture
def haproxy_cleanup() -> Iterator[list[Haproxy]]:
    started: list[Haproxy] = []
    yield started
    for h in started:
        h.destroy()


def _redis_cli(server: RedisServer, *command: str) -> str:
    """`redis-cli COMMAND` as the server's admin, as an operator types it; its output."""
    done = subprocess.run(
        [shutil.which("redis-cli") or "redis-cli", "-p", str(server.port), *command],
        env={**os.environ, "REDISCLI_AUTH": server.password_file.read_text().strip()},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _samples(page: str, metric: str) -> list[float]:
    """The values of ``metric`` on a Prometheus page, one per label set (per worker)."""
    found = re.findall(rf"^{metric}{{[^}}]*}} (\S+)$", page, re.M)
    return [float(v) for v in found]


def _access_lines(path: Path, route: str = CHAT) -> list[dict[str, object]]:
    """The access log's JSON lines for ``route`` (HAProxy's checks are logged too)."""
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [line for line in lines if line["route"] == route]


@pytest.mark.timeout(300)
def test_the_reference_deployment_runs_as_written(
    tmp_path: Path,
    private_postgres: PostgresServer,
    redis_server: RedisServer,
    haproxy_cleanup: list[Haproxy],
) -> None:
    """16 to 43 s on a shared 2-core machine, 49 s beside two CPU hogs: it starts PostgreSQL,
    Redis, HAProxy and two gateways of two workers each (six Python processes importing
    saltgate), and waits for a stopped gateway to drain and for HAProxy's checks to take it
    out. Its own 300 s timeout: the suite's 120 s would fail it on a machine twice as busy."""
    doc = DOC.read_text()
    etc = tmp_path / "etc"
    etc.mkdir()
    vllm_key = "vllm-" + os.urandom(8).hex()
    create_secret_file(etc / "vllm-key", "replica key", vllm_key + "\n")
    db_password = private_postgres.password_file.read_text()
    create_secret_file(etc / "db-password", "database password", db_password)
    bus_password = os.urandom(16).hex()
    create_secret_file(etc / "bus-password", "bus password", bus_password + "\n")

    # The doc's database and Redis ACL user, on the test's own servers.
    with private_postgres.connect() as conn:
        conn.execute("CREATE DATABASE saltgate OWNER saltgate")
    [acl] = re.findall(r"^ACL SETUSER saltgate .*$", doc, re.M)
    assert (
        _redis_cli(redis_server, *substitute(acl, [(">PASSWORD", f">{bus_password}")]).split())
        == "OK"
    )

    async def main() -> None:
        async with AsyncExitStack() as stack:
            sims = await stack.enter_async_context(_replicas(tmp_path / "pki", vllm_key))
            await _deployment(
                tmp_path,
                etc=etc,
                sims=sims,
                bus=redis_server,
                db=private_postgres,
                haproxies=haproxy_cleanup,
            )

    run(main)


async def _deployment(
    tmp_path: Path,
    *,
    etc: Path,
    sims: list[RunningSim],
    bus: RedisServer,
    db: PostgresServer,
    haproxies: list[Haproxy],
) -> None:
    pki = tmp_path / "pki"
    ports = {node: (free_port(), free_port()) for node in ("node-a", "node-b")}
    common = [
        ('host = "0.0.0.0"', 'host = "127.0.0.1"'),
        ("?sslmode=verify-full&sslrootcert=/etc/saltgate/db-ca.pem", ""),
        ('"/var/lib/saltgate', f'"{tmp_path}/NODE/state'),
        ('"/var/log/saltgate/', f'"{tmp_path}/NODE/log/'),
        ('"/etc/saltgate/', f'"{etc}/'),
        ('["10.0.0.10"]', '["127.0.0.1"]'),
        ("10.0.0.10:5432", f"127.0.0.1:{db.port}"),
        ("rediss://saltgate@10.0.0.11:6380/0", f"redis://saltgate@127.0.0.1:{bus.port}/0"),
        (f"{etc}/replica-ca.pem", str(pki / "ca.pem")),
        *[(f"https://10.0.1.{i + 1}:8443", sims[i].url) for i in range(4)],
    ]
    reference = (REFERENCE / "gateway.toml").read_text()
    configs = {}
    for node, (port, admin_port) in ports.items():
        text = substitute(
            reference,
            [
                *common,
                ("port = 8000", f"port = {port}"),
                ("admin_port = 8001", f"admin_port = {admin_port}"),
                *([('gateway_id = "node-a"', 'gateway_id = "node-b"')] if node == "node-b" else []),
            ],
        ).replace("NODE", node)
        (tmp_path / node / "log").mkdir(parents=True)
        configs[node] = tmp_path / node / "gateway.toml"
        configs[node].write_text(text)

    # first-run.sh on node A: master key, --check, the tenant and its key.
    script = substitute(
        (REFERENCE / "first-run.sh").read_text(),
        [
            ("/etc/saltgate/gateway.toml", str(configs["node-a"])),
            ("/etc/saltgate", str(etc)),
            ("chown saltgate master.key hpke.key\n", ""),
        ],
    )
    env = {**os.environ, "PATH": f"{SALTGATE.parent}:{os.environ['PATH']}"}
    done = await asyncio.to_thread(
        subprocess.run, ["sh", "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    api_key = done.stdout.strip().splitlines()[-1]
    assert (etc / "master.key").stat().st_mode & 0o777 == 0o600

    gateways = {}
    try:
        for node, config in configs.items():  # node A first: it makes the shared HPKE key
            gateways[node] = await GatewayProcess.start(
                config, tmp_path / node / "stderr.log", workers=2
            )
        await _through_haproxy(
            tmp_path,
            ports=ports,
            gateways=gateways,
            db=db,
            bus=bus,
            api_key=api_key,
            haproxies=haproxies,
        )
    finally:
        for g in gateways.values():
            await g.stop()


async def _through_haproxy(
    tmp_path: Path,
    *,
    ports: dict[str, tuple[int, int]],
    gateways: dict[str, GatewayProcess],
    db: PostgresServer,
    bus: RedisServer,
    api_key: str,
    haproxies: list[Haproxy],
) -> None:
    pki = make_pki(tmp_path / "front")  # the balancer's certificate, for 127.0.0.1
    crt = tmp_path / "front" / "saltgate.pem"
    pem = pki.server.cert.read_text() + pki.server.key.read_text()  # HAProxy's one file
    create_secret_file(crt, "HAProxy's certificate", pem)
    front = free_port()
    text = substitute(
        (REFERENCE / "haproxy.cfg").read_text(),
        [
            ("bind :443 ", f"bind 127.0.0.1:{front} "),
            ("/etc/haproxy/saltgate.pem", str(crt)),
            ("10.0.0.10:8000", f"127.0.0.1:{ports['node-a'][0]}"),
            ("10.0.0.11:8000", f"127.0.0.1:{ports['node-b'][0]}"),
        ],
    )
    haproxy = Haproxy(text, front)
    haproxies.append(haproxy)
    await asyncio.to_thread(haproxy.start)

    logs = {node: tmp_path / node / "log" / "access.log" for node in ports}
    served: Counter[str] = Counter()  # request id -> 200 answers the client received
    # The client connects from 127.0.0.3: the gateways' TCP peer is HAProxy (127.0.0.1),
    # so only X-Forwarded-For read from a trusted proxy can name 127.0.0.3. It also sends
    # an X-Forwarded-For of its own, which HAProxy passes on with 127.0.0.3 appended: the
    # gateway must take HAProxy's entry, not the one the client wrote.
    forged = "203.0.113.9"
    trust = ssl.create_default_context(cafile=pki.ca)
    transport = httpx.AsyncHTTPTransport(verify=trust, local_address="127.0.0.3")
    url = f"https://127.0.0.1:{front}{CHAT}"
    headers = {"authorization": f"Bearer {api_key}", "x-forwarded-for": forged}

    async with async_client(transport=transport, timeout=60) as client:

        async def chat(i: int, *, tokens: int = 8, started: asyncio.Event | None = None) -> str:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"request {i}: hello"}],
                "max_tokens": tokens,
                "stream": True,
            }
            async with client.stream("POST", url, json=body, headers=headers) as resp:
                chunks = resp.aiter_text()
                text = await anext(chunks)
                if started is not None:
                    started.set()
                text += "".join([c async for c in chunks])
                assert resp.status_code == 200, text
                assert text.rstrip().endswith("data: [DONE]"), text[-300:]
                request_id = resp.headers["x-request-id"]
                served[request_id] += 1
                return request_id

        await asyncio.gather(*(chat(i) for i in range(16)))
        await eventually(
            lambda: sum(len(_access_lines(p)) for p in logs.values()) >= 16,
            what="16 access log lines",
        )
        for node, path in logs.items():
            lines = _access_lines(path)
            assert lines, f"{node} served nothing: HAProxy did not balance"
            assert {line["client_addr"] for line in lines} == {"127.0.0.3"}
            # HAProxy's own checks: /ready, from its address, with no X-Forwarded-For.
            checks = _access_lines(path, "/ready")
            assert checks and {line["client_addr"] for line in checks} == {"127.0.0.1"}

        # The bus, as the doc's ACL user: every worker of both nodes hears the three others.
        async def bus_joined() -> bool:
            for g in gateways.values():
                page = (await client.get(g.metrics_url, headers=g.metrics_headers)).text
                if _samples(page, "saltgate_cluster_bus_up") != [1.0, 1.0]:
                    return False
                if _samples(page, "saltgate_cluster_peers") != [3.0, 3.0]:
                    return False
            return True

        await eventually(bus_joined, what="four workers on the bus, each hearing three peers")
        assert _redis_cli(bus, "ACL", "LOG") == ""  # nothing the bus user did was denied

        # SIGTERM node A while streams run through both: those on A drain and finish,
        # HAProxy's /ready check takes A out, and node B serves everything after.
        # Four in a row: round robin puts two on each gateway.
        started = [asyncio.Event() for _ in range(4)]
        streams = [
            asyncio.create_task(chat(100 + i, tokens=STREAM_TOKENS, started=started[i]))
            for i in range(4)
        ]
        for event in started:
            await asyncio.wait_for(event.wait(), 30)
        gateways["node-a"].proc.send_signal(signal.SIGTERM)
        drained = set(await asyncio.gather(*streams))
        assert await asyncio.wait_for(gateways["node-a"].proc.wait(), 60) == 0
        assert drained & {line["request_id"] for line in _access_lines(logs["node-a"])}, (
            "no stream was in flight on node-a when it was stopped"
        )
        await eventually(
            lambda: "gateways/node-a is DOWN" in (haproxy.root / "haproxy.log").read_text(),
            timeout_s=30,
            what="HAProxy marking node-a DOWN",
        )
        before_b = len(_access_lines(logs["node-b"]))
        await asyncio.gather(*(chat(200 + i) for i in range(8)))
        await eventually(
            lambda: len(_access_lines(logs["node-b"])) >= before_b + 8, what="B's lines"
        )

    # Every answer the client received has exactly one usage row, and there are no others.
    assert len(served) == 16 + 4 + 8 and set(served.values()) == {1}
    with db.connect("saltgate") as conn:

        def usage() -> dict[str, int]:
            rows = conn.execute("SELECT request_id, count(*) FROM usage GROUP BY request_id")
            return {str(request_id): int(str(n)) for request_id, n in rows.fetchall()}

        await eventually(lambda: len(usage()) >= len(served), what="a usage row per answer")
        assert usage() == dict.fromkeys(served, 1)
