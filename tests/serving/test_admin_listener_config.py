"""The admin listener's settings: the Host names it answers to, its TLS files, and the
refusal of plain HTTP off loopback (issue 41), in `serve`, `serve --check` and `up`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from saltgate.config import (
    ConfigError,
    GatewayConfig,
    ReplicaConfig,
    admin_plaintext_warning,
    create_master_key,
    load_config,
)
from saltgate.serving import check
from saltgate.serving.admin_listener import admin_tls, allowed_hosts, host_allowed, host_name
from saltgate.serving.check import check_config
from saltgate.serving.run import start_gateway

pytestmark = pytest.mark.unit

CONFIG = """
[gateway]
state_dir = "st"
{extra}

[[replicas]]
url = "http://127.0.0.1:8100"
"""


def write(tmp_path: Path, extra: str) -> Path:
    path = tmp_path / "g.toml"
    path.write_text(CONFIG.format(extra=extra))
    return path


def test_host_names_without_their_port() -> None:
    assert host_name(b"127.0.0.1:8001") == "127.0.0.1"
    assert host_name(b"LocalHost") == "localhost"
    assert host_name(b"[::1]:8001") == "[::1]"
    assert host_name(b"[::1]") == "[::1]"
    assert host_name(b"admin.internal:443") == "admin.internal"
    for bad in (None, b"", b":8001", b"a:b", b"[::1]x", b"[::1", b"\xff"):
        assert host_name(bad) is None, bad


def test_names_of_the_listener_and_addresses_are_allowed() -> None:
    hosts = frozenset({"127.0.0.1", "localhost", "admin.internal"})
    for name in ("localhost", "admin.internal", "10.0.0.7", "[fd00::4]", "[::1]"):
        assert host_allowed(name, hosts), name
    for bad in (None, "attacker.example", "localhost.attacker.example", "10.0.0.7.nip.io"):
        assert not host_allowed(bad, hosts), bad


def test_allowed_hosts_are_the_admin_host_the_loopback_names_and_the_list(
    tmp_path: Path,
) -> None:
    path = write(tmp_path, 'admin_allowed_hosts = ["Admin.Internal", "[fd00::4]"]')
    hosts = allowed_hosts(load_config(path))
    assert hosts == {"127.0.0.1", "localhost", "[::1]", "admin.internal", "[fd00::4]"}
    assert "attacker.example" not in hosts
    config = GatewayConfig((), tmp_path, tmp_path / "k", admin_host="::1")
    assert "[::1]" in allowed_hosts(config)
    for bad in ('["admin:8001"]', '["a b"]', "[1]", '"admin"'):
        with pytest.raises(ConfigError, match="admin_allowed_hosts"):
            load_config(write(tmp_path, f"admin_allowed_hosts = {bad}"))


def test_plain_http_off_loopback_is_refused_unless_opted_in(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "")).admin_host == "127.0.0.1"  # the control
    for host in ("0.0.0.0", "10.0.0.4", "admin.internal", "::"):
        with pytest.raises(ConfigError, match="allow_plaintext_admin"):
            load_config(write(tmp_path, f'admin_host = "{host}"'))
    opted = load_config(write(tmp_path, 'admin_host = "0.0.0.0"\nallow_plaintext_admin = true'))
    warning = admin_plaintext_warning(opted)
    assert warning is not None and "WARNING" in warning and "clear" in warning
    assert admin_plaintext_warning(load_config(write(tmp_path, ""))) is None
    no_listener = GatewayConfig((), tmp_path, tmp_path / "k", admin_host="::", admin_port=None)
    assert not no_listener.admin_plaintext_remote  # no admin port: nothing served


def test_tls_files_come_in_pairs_and_lift_the_refusal(tmp_path: Path) -> None:
    (tmp_path / "a.pem").write_text("PEM")
    with pytest.raises(ConfigError, match="give both"):
        load_config(write(tmp_path, 'admin_tls_cert_file = "a.pem"'))
    both = 'admin_tls_cert_file = "a.pem"\nadmin_tls_key_file = "a.key"\nadmin_host = "0.0.0.0"'
    config = load_config(write(tmp_path, both))
    assert config.admin_tls_cert_file == tmp_path / "a.pem"
    assert not config.admin_plaintext_remote
    with pytest.raises(ConfigError, match="admin_tls_key_file"):
        admin_tls(config)  # no such key file: named, at start and in --check


def test_serve_check_refuses_and_warns_as_serve_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # No socket in a unit test: --check's port probe is tests/gateway/test_ready.py's.
    monkeypatch.setattr(check, "check_ports", lambda config: None)
    (tmp_path / "st").mkdir()
    create_master_key(tmp_path / "st" / "master.key")
    path = write(tmp_path, 'admin_host = "0.0.0.0"\nallow_plaintext_admin = true')
    assert "admin listener" in check_config(load_config(path))
    assert "WARNING" in capsys.readouterr().err


def test_up_and_programmatic_configs_are_refused_too(tmp_path: Path) -> None:
    """`saltgate up` (and tests) build a GatewayConfig without load_config: the listener
    refuses it at start, before anything binds."""
    create_master_key(tmp_path / "master.key")
    config = GatewayConfig(
        (ReplicaConfig("http://127.0.0.1:9"),),
        tmp_path,
        tmp_path / "master.key",
        port=0,
        admin_host="0.0.0.0",
        admin_port=0,
    )
    with pytest.raises(ConfigError, match="allow_plaintext_admin"):
        asyncio.run(start_gateway(config))
