"""`saltgate serve --check --config FILE`: what `serve` reads before it serves, checked
without serving, as `nginx -t` checks its configuration.

The file itself (load_config: every key, the replicas' key files with their modes), the
master key, the EHBP key file when it exists (serve makes a missing one), the store's
password file or variable, and that the access log can be written. Nothing here touches
the network: whether the store and the replicas answer is for the running gateway to
say, on `/ready` (gateway/readiness.py); a check that connected would pass or fail with
the network of the moment, not with the file. The TLS files of the listeners are loaded
as `serve` loads them (readable, the key the certificate's).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from saltgate.config import ConfigError, GatewayConfig, load_master_key
from saltgate.gateway.ehbp import load_retired_keys, load_server_key
from saltgate.gateway.tracing import require_otel
from saltgate.runtime import listen_error
from saltgate.serving.admin_listener import (
    ADMIN_OPTIONS,
    admin_scheme,
    admin_tls,
    warn_plaintext_admin,
)
from saltgate.serving.listener_tls import edge_context
from saltgate.serving.run import INFERENCE_OPTIONS
from saltgate.store.backends import require_usable, schema_status


def check_config(config: GatewayConfig) -> str:
    """What the configuration runs, in a few words; ConfigError or StoreError (the same
    messages `serve` would stop with) if it could not start."""
    load_master_key(config.master_key_file)
    notes = [f"{len(config.replicas)} replicas", f"store {config.store_settings.describe()}"]
    if config.ehbp and config.ehbp_key_file is not None:
        notes.extend(_check_ehbp_keys(config.ehbp_key_file, config.ehbp_retired_key_files))
    if config.tracing is not None:
        require_otel()
    settings = config.store_settings
    if settings.backend == "postgresql":
        from saltgate.store.postgres import conninfo  # noqa: PLC0415 - psycopg only when configured

        conninfo(settings)  # reads the password from its file or variable, to be dropped
    elif settings.sqlite_path is not None and not settings.sqlite_path.exists():
        notes.append(f"{settings.sqlite_path} will be created, with no tenants")
    else:  # a file: serve refuses one at another schema version, `saltgate store migrate`
        status = schema_status(settings)
        require_usable(status)
        notes.append(f"schema version {status.version}")
    if config.access_log not in ("stderr", "off"):
        _check_writable(Path(config.access_log))
    notes.append(f"access log {config.access_log}")
    if config.admin_port is not None:
        admin_tls(config)  # refuses plain HTTP off loopback; loads the TLS files
        warn_plaintext_admin(config)
        notes.append(f"admin listener {admin_scheme(config)}://{config.admin_host}")
    if edge_context(config) is not None:  # readable, and the key is the certificate's
        notes.append(f"TLS at the edge with {config.tls_cert_file}")
    check_ports(config)
    return ", ".join(notes)


def _check_ehbp_keys(key_file: Path, retired_files: tuple[Path, ...]) -> list[str]:
    """The offered key's fingerprint (what pinned clients must hold) and the retired keys
    still opened; the key file's creatability when it does not exist yet."""
    if os.path.lexists(key_file):
        current = load_server_key(key_file)
        notes = [f"EHBP key {current.config.fingerprint}"]
    else:
        _check_creatable(key_file, "ehbp.key_file")
        current, notes = None, [f"EHBP key file {key_file} will be created"]
    retired = load_retired_keys(current, retired_files)
    if retired:
        notes.append(f"{len(retired)} retired EHBP keys still opened")
    return notes


def check_ports(config: GatewayConfig) -> None:
    """StartError when a listener's port cannot be bound now (in use, or a privileged
    port): bound and let go at once. Exit 1 in `--check`, not 2: a port held by a gateway
    still stopping is free a moment later, and the unit retries exit 1 only."""
    listeners = [(INFERENCE_OPTIONS, config.host, config.port)]
    if config.admin_port is not None:
        listeners.append((ADMIN_OPTIONS, config.admin_host, config.admin_port))
    for what, host, port in listeners:
        if port == 0:
            continue  # any free port
        try:
            family, _, _, _, address = socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
            socket.create_server(address[:2], family=family).close()
        except OSError as exc:
            raise listen_error(what, host, port, exc) from None


def _check_creatable(path: Path, option: str) -> None:
    """A file `serve` would create (with its missing directories) must be creatable: the
    nearest existing directory above it is writable (under the shipped unit and container,
    /etc/saltgate is read-only)."""
    existing = path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise ConfigError(
            f"{option}: cannot create {path}: {existing} is not a writable directory "
            "(create the file at install, or keep it in the state directory)"
        )


def _check_writable(path: Path) -> None:
    if path.is_dir():
        raise ConfigError(f"gateway.access_log: {path} is a directory; name a file in it")
    target = path if path.exists() else path.parent
    if not os.access(target, os.W_OK):
        reason = "not writable" if target.exists() else "no such directory"
        raise ConfigError(f"gateway.access_log: cannot write {path}: {reason}")
