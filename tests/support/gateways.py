"""Real `saltgate serve` and `saltgate` CLI processes sharing one store, for fleet tests."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from tests.support.http import async_client
from tests.support.waiting import eventually

from saltgate.admin.scopes import SCOPES, USAGE_READ
from saltgate.config import create_master_key, load_config
from saltgate.store.admin_tokens import AdminTokens
from saltgate.store.backends import open_database
from saltgate.store.settings import StoreSettings
from saltgate.store.tenants import TenantStore

SALTGATE = Path(sys.executable).parent / "saltgate"


def write_gateway_config(
    path: Path,
    *,
    state_dir: Path,
    replicas: Iterable[str],
    master_key_file: Path | None = None,
    store: StoreSettings | None = None,
    port: int = 0,
    admin_port: int | None = 0,
    gateway_extra: str = "",
    replica_extra: str = "",
    sections: str = "",
) -> Path:
    """A gateway's config file; the ``*_extra`` strings are TOML lines added to
    `[gateway]` and to each `[[replicas]]`, ``sections`` further tables."""
    head = f"[gateway]\nport = {port}\n"
    if admin_port is not None:
        head += f"admin_port = {admin_port}\n"
    head += f'state_dir = "{state_dir}"\n'
    if master_key_file is not None:
        head += f'master_key_file = "{master_key_file}"\n'
    replica_tables = "".join(f'[[replicas]]\nurl = "{u}"\n{replica_extra}' for u in replicas)
    stored = store.toml() if store is not None else ""
    path.write_text(f"{head}{gateway_extra}{stored}{replica_tables}{sections}")
    return path


def cli(*args: str) -> str:
    """Run `saltgate ARGS` to completion; its stdout (a failure shows its stderr)."""
    done = subprocess.run(
        [str(SALTGATE), *args], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, f"saltgate {' '.join(args)}: {done.stderr.strip()}"
    return done.stdout.strip()


def spawn(args: list[str], banner: str) -> tuple[subprocess.Popen[str], str]:
    """Start `python -m saltgate.cli ARGS` and return it with the URL it announces."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "saltgate.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    seen = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        seen.append(line)
        if banner in line:
            url = next(word for word in line.split() if word.startswith("http://"))
            return proc, url
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"{args[0]} did not start: {''.join(seen)[-2000:]}")


def metrics_token(store: StoreSettings) -> dict[str, str]:
    """Headers for /metrics on the admin listener: a usage:read admin token minted in
    `store` (what a Prometheus scrape config carries)."""
    with TenantStore(open_database(store)) as tenants:
        token = AdminTokens(tenants.db).create([USAGE_READ])[1]
    return {"authorization": f"Bearer {token}"}


@dataclass
class GatewayProcess:
    proc: asyncio.subprocess.Process
    url: str
    metrics_url: str
    log: Path
    metrics_headers: dict[str, str]  # a usage:read token: what /metrics takes

    @classmethod
    async def start(cls, config: Path, log: Path, *, workers: int = 1) -> GatewayProcess:
        """`saltgate serve --config FILE [--workers N]` (with an admin port), ready when it
        prints where it serves; its stderr (warnings: store outages, replays, worker
        restarts; the access log) goes to `log`."""
        assert SALTGATE.exists(), f"missing {SALTGATE}: run `make install`"
        headers = metrics_token(load_config(config).store_settings)
        with log.open("wb") as err:
            proc = await asyncio.create_subprocess_exec(
                str(SALTGATE),
                "serve",
                "--config",
                str(config),
                "--workers",
                str(workers),
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        assert proc.stdout is not None
        url = ""
        while True:
            line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
            if not line:
                await proc.wait()
                raise AssertionError(f"saltgate serve exited: {log.read_text()[-2000:]}")
            if "serving on" in line:
                url = line.split()[3]
            if "metrics on" in line:
                return cls(proc, url, line.split()[3], log, headers)

    async def served_per_worker(self) -> dict[int, float]:
        """The requests each worker has answered so far (saltgate_worker_requests_total)."""
        async with async_client(timeout=10) as http:
            text = (await http.get(self.metrics_url, headers=self.metrics_headers)).text
        return per_worker(series(text), "saltgate_worker_requests_total")

    async def event(self, words: str, *, since: int = 0, timeout_s: float = 30) -> str:
        """The first event line the gateway wrote after byte `since` of its stderr (`log`)
        that holds `words`."""
        found: list[str] = []

        def seen() -> bool:
            text = self.log.read_bytes()[since:].decode(errors="replace")
            found[:] = [line for line in text.splitlines() if words in line]
            return bool(found) or self.proc.returncode is not None

        await eventually(seen, timeout_s=timeout_s, what=f"a line with {words!r}")
        assert found, f"the gateway exited: {self.log.read_text()[-2000:]}"
        return found[0]

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.terminate()
            await asyncio.wait_for(self.proc.wait(), 30)


def series(text: str) -> dict[str, float]:
    """`name{labels}` -> value, from the Prometheus text."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def per_worker(values: dict[str, float], name: str) -> dict[int, float]:
    pattern = re.compile(re.escape(name) + r'\{worker="(\d+)"\}')
    return {int(m[1]): v for k, v in values.items() if (m := pattern.fullmatch(k))}


class AdminGateway(NamedTuple):
    gateway: GatewayProcess
    admin_url: str  # the admin listener: /admin/v1/, /console/, /metrics
    token: str  # an admin token with every scope
    api_key: str  # an API key of the tenant "acme"


@asynccontextmanager
async def admin_supervisor(
    tmp_path: Path,
    store: StoreSettings,
    *,
    replica: str = "http://127.0.0.1:9",
    sections: str = "",
    gateway_extra: str = "",
    workers: int = 2,
) -> AsyncIterator[AdminGateway]:
    """`saltgate serve --workers 2` (or `workers`) on `store` holding the tenant "acme" with
    a key, and an admin token. Its one replica (by default nothing listens there),
    ``sections`` (more TOML tables) and ``gateway_extra`` ([gateway] lines) are the
    caller's."""
    master = tmp_path / "master.key"
    create_master_key(master)
    with TenantStore(open_database(store)) as tenants:
        tenants.create_tenant("acme")
        api_key = tenants.create_key("acme")[1]
        token = AdminTokens(tenants.db).create(SCOPES)[1]
    config = write_gateway_config(
        tmp_path / "gw.toml",
        state_dir=tmp_path / "state",
        master_key_file=master,
        replicas=[replica],
        store=store,
        sections=sections,
        gateway_extra=gateway_extra,
    )
    gateway = await GatewayProcess.start(config, tmp_path / "gw.log", workers=workers)
    try:
        yield AdminGateway(gateway, gateway.metrics_url.removesuffix("/metrics"), token, api_key)
    finally:
        await gateway.stop()
