"""TLS at the edge (issue 43): `[gateway] tls_cert_file` and `tls_key_file` make the
inference listener serve HTTPS, in a real `saltgate serve` (one process and `--workers 2`)
in front of a simulated replica, over loopback, with a test CA (tests/support/tls.py).

- An HTTPS client trusting the CA gets answers, a stream among them; a client that does
  not trust it fails the handshake; plain HTTP on the port gets no answer.
- SIGHUP with renewed files: a new connection sees the new certificate (its fingerprint),
  a keep-alive connection opened before goes on with the old one; a renewal whose key is
  not the certificate's is refused and the current certificate stays.
- `--workers 2`: both workers serve TLS, and both take the renewed certificate.
- `serve --check` names the option at fault: a missing file, a key of another certificate
  (on the configuration just served).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import shutil
import signal
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from tests.gateway.stack import MODEL, run
from tests.gateway.test_ready import _serve_check
from tests.support.gateways import GatewayProcess, admin_supervisor, per_worker, series
from tests.support.http import async_client
from tests.support.tls import Pair, Pki, make_pki

from saltgate.config import ConfigError, GatewayConfig, load_config
from saltgate.sim.run import SimConfig, start_sim
from saltgate.store.settings import StoreSettings

BODY = {"model": MODEL, "prompt": "hello", "max_tokens": 4}


def fingerprint(cert_pem: Path) -> str:
    der = x509.load_pem_x509_certificate(cert_pem.read_bytes()).public_bytes(Encoding.DER)
    return hashlib.sha256(der).hexdigest()


def peer(resp: httpx.Response) -> tuple[str, object]:
    """The fingerprint of the certificate the response came under, and the connection's
    local address (the same on a kept-alive connection)."""
    stream = resp.extensions["network_stream"]
    der = stream.get_extra_info("ssl_object").getpeercert(binary_form=True)
    return hashlib.sha256(der).hexdigest(), stream.get_extra_info("client_addr")


@functools.cache
def trusting(ca: Path) -> ssl.SSLContext:
    """A client context that trusts `ca` alone (made once per CA)."""
    return ssl.create_default_context(cafile=str(ca))


def install(pair: Pair, cert: Path, key: Path) -> None:
    """Put a certificate and key where the configuration names them (a renewal)."""
    shutil.copyfile(pair.cert, cert)
    shutil.copyfile(pair.key, key)
    key.chmod(0o600)


@dataclass
class Edge:
    gateway: GatewayProcess
    cert: Path  # what gateway.tls_cert_file names
    key: Path
    api_key: str

    def client(self, ca: Path, connections: int | None = None) -> httpx.AsyncClient:
        return async_client(
            base_url=self.gateway.url,
            verify=trusting(ca),
            headers={"authorization": f"Bearer {self.api_key}"},
            timeout=30,
            limits=httpx.Limits(max_connections=connections),
        )

    async def reload(self) -> str:
        """SIGHUP; the line saying the reload is done (every worker's, with workers)."""
        since = self.gateway.log.stat().st_size
        os.kill(self.gateway.proc.pid, signal.SIGHUP)
        return await self.gateway.event("reloaded", since=since)


@asynccontextmanager
async def edge(tmp_path: Path, pki: Pki, *, workers: int = 1) -> AsyncIterator[Edge]:
    """`saltgate serve` with TLS at the edge (pki.server) before one simulated replica."""
    cert, key = tmp_path / "edge.pem", tmp_path / "edge.key"
    install(pki.server, cert, key)
    sim = await start_sim(SimConfig(port=0))
    try:
        async with admin_supervisor(
            tmp_path,
            StoreSettings.in_state_dir(tmp_path / "state"),
            replica=sim.url,
            gateway_extra=f'tls_cert_file = "{cert}"\ntls_key_file = "{key}"\n',
            workers=workers,
        ) as g:
            yield Edge(g.gateway, cert, key, g.api_key)
    finally:
        await sim.close()


def test_https_answers_a_trusting_client_and_streams_and_check_names_the_file_at_fault(
    tmp_path: Path,
) -> None:
    pki = make_pki(tmp_path / "pki")

    async def main() -> None:
        async with edge(tmp_path, pki) as e:
            assert e.gateway.url.startswith("https://127.0.0.1:"), e.gateway.url
            async with e.client(pki.ca) as http:
                resp = await http.post("/v1/completions", json=BODY)
                assert resp.status_code == 200, resp.text
                assert resp.json()["usage"]["completion_tokens"] == 4
                assert peer(resp)[0] == fingerprint(pki.server.cert)
                stream = {**BODY, "stream": True, "max_tokens": 16}
                async with http.stream("POST", "/v1/completions", json=stream) as resp:
                    assert resp.status_code == 200
                    events = [line async for line in resp.aiter_lines() if line]
                assert events[-1] == "data: [DONE]", events[-3:]
                assert len(events) > 16  # one event per token, then [DONE]
            # A client that does not trust the CA: the certificate is what it checks.
            async with e.client(pki.unknown_ca.cert) as stranger:
                with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                    await stranger.post("/v1/completions", json=BODY)
            plain = e.gateway.url.replace("https://", "http://")
            async with async_client(base_url=plain, timeout=10) as http:
                with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
                    await http.post("/v1/completions", json=BODY)

    run(main)
    check_names_the_file_at_fault(tmp_path / "gw.toml", pki)


def check_names_the_file_at_fault(config: Path, pki: Pki) -> None:
    """`serve --check` on the configuration just served: valid as it is, then refused with
    the option named for a key of another certificate, a missing certificate, a missing
    key."""
    cert, key = config.parent / "edge.pem", config.parent / "edge.key"
    good = _serve_check(config)
    assert good.returncode == 0, good.stderr
    assert f"TLS at the edge with {cert}" in good.stdout

    shutil.copyfile(pki.client.key, key)  # another certificate's key
    mismatched = _serve_check(config)
    assert mismatched.returncode == 2
    assert "gateway.tls_cert_file, tls_key_file: cannot use them" in mismatched.stderr
    assert "key values mismatch" in mismatched.stderr

    install(pki.server, cert, key)
    cert.unlink()
    missing_cert = _serve_check(config)
    assert missing_cert.returncode == 2
    assert f"gateway.tls_cert_file: cannot read {cert}" in missing_cert.stderr

    install(pki.server, cert, key)
    key.unlink()
    missing_key = _serve_check(config)
    assert missing_key.returncode == 2
    assert f"cannot read gateway.tls_key_file {key}" in missing_key.stderr


@pytest.mark.parametrize("workers", [1, 2])
def test_sighup_gives_new_connections_the_renewed_certificate_and_keeps_open_ones(
    tmp_path: Path, workers: int
) -> None:
    old_pki, new_pki = make_pki(tmp_path / "old"), make_pki(tmp_path / "new")
    old, new = fingerprint(old_pki.server.cert), fingerprint(new_pki.server.cert)

    async def fresh(e: Edge, ca: Path, n: int) -> set[str]:
        """The certificates `n` new connections at once see (each answered)."""

        async def one() -> str:
            async with e.client(ca) as http:
                resp = await http.post("/v1/completions", json=BODY)
                assert resp.status_code == 200, resp.text
                return peer(resp)[0]

        return set(await asyncio.gather(*(one() for _ in range(n))))

    async def main() -> None:
        async with edge(tmp_path, old_pki, workers=workers) as e:
            assert await fresh(e, old_pki.ca, 20) == {old}
            if workers > 1:  # every worker serves TLS
                async with async_client(timeout=10) as http:
                    page = await http.get(e.gateway.metrics_url, headers=e.gateway.metrics_headers)
                served = per_worker(series(page.text), "saltgate_worker_requests_total")
                assert sorted(served) == [0, 1] and min(served.values()) > 0, served

            async with e.client(old_pki.ca, connections=1) as kept:
                first = await kept.post("/v1/completions", json=BODY)
                assert peer(first)[0] == old

                # A renewal whose key belongs to another certificate: refused, old kept.
                install(new_pki.server, e.cert, e.key)
                shutil.copyfile(old_pki.server.key, e.key)
                since = e.gateway.log.stat().st_size
                os.kill(e.gateway.proc.pid, signal.SIGHUP)
                line = await e.gateway.event("reload refused", since=since)
                assert "gateway.tls_cert_file, tls_key_file" in line, line
                assert await fresh(e, old_pki.ca, 4) == {old}

                install(new_pki.server, e.cert, e.key)
                await e.reload()
                assert await fresh(e, new_pki.ca, 20) == {new}
                again = await kept.post("/v1/completions", json=BODY)
                assert again.status_code == 200, again.text
                assert peer(again) == peer(first)  # the same connection, the old certificate

    run(main)


@pytest.mark.unit
def test_the_edge_files_go_together_relative_to_the_config_file(tmp_path: Path) -> None:
    def load(extra: str) -> GatewayConfig:
        path = tmp_path / "g.toml"
        path.write_text(
            f'[gateway]\nstate_dir = "st"\n{extra}\n[[replicas]]\nurl = "http://127.0.0.1:9"\n'
        )
        return load_config(path)

    assert load("").tls_cert_file is None  # plain HTTP unless configured
    for alone in ('tls_cert_file = "e.pem"', 'tls_key_file = "e.key"'):
        with pytest.raises(ConfigError, match=r"tls_cert_file and tls_key_file: give both"):
            load(alone)
    both = load('tls_cert_file = "e.pem"\ntls_key_file = "/etc/e.key"')
    assert (both.tls_cert_file, both.tls_key_file) == (tmp_path / "e.pem", Path("/etc/e.key"))
