"""Where the gateway's HPKE key comes from: [ehbp] in the config, the operator's key file,
and `saltgate up` (a key made at start, EHBP and plaintext alike)."""

from __future__ import annotations

import asyncio
import os
import re
import secrets
from pathlib import Path

import ehbp
import pytest
from tests.gateway.stack import MODEL
from tests.support.http import async_client
from tests.support.up import saltgate_up

from saltgate.config import ConfigError, GatewayConfig, parse_config
from saltgate.ehbp.frames import KEYS_PATH, KeyConfig, ServerKey
from saltgate.gateway.ehbp import load_or_create_server_key
from saltgate.secretfiles import create_secret_file
from saltgate.serving.check import check_config
from saltgate.serving.run import ehbp_keyring

REPLICAS = {"replicas": [{"url": "http://127.0.0.1:9"}]}


def test_the_ehbp_section(tmp_path: Path) -> None:
    default = parse_config(dict(REPLICAS), tmp_path)
    assert default.ehbp and default.ehbp_key_file == tmp_path / ".state" / "hpke.key"
    assert not default.require_encrypted_secret
    config = parse_config(
        {**REPLICAS, "ehbp": {"key_file": "hpke.key", "require_encrypted_secret": True}},
        tmp_path,
    )
    assert config.ehbp_key_file == tmp_path / "hpke.key"
    assert config.require_encrypted_secret
    assert not parse_config({**REPLICAS, "ehbp": {"enabled": False}}, tmp_path).ehbp
    for table, words in (
        ({"key": "x"}, "unknown keys"),
        ({"enabled": "yes"}, "expected bool"),
        ({"enabled": False, "require_encrypted_secret": True}, "needs ehbp.enabled"),
    ):
        with pytest.raises(ConfigError, match=words):
            parse_config({**REPLICAS, "ehbp": table}, tmp_path)


def test_the_key_file_is_made_once_private_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "hpke.key"
    key = load_or_create_server_key(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_or_create_server_key(path).config == key.config  # a restart keeps the key
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="mode 0600") as info:
        load_or_create_server_key(path)
    assert key.private_bytes().hex() not in str(info.value)
    path.chmod(0o600)
    path.write_text("not hex\n")
    with pytest.raises(ConfigError, match="64 hex digits"):
        load_or_create_server_key(path)
    link = tmp_path / "link.key"
    link.symlink_to(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_or_create_server_key(link)


def test_serve_keeps_its_default_key_across_a_restart(tmp_path: Path) -> None:
    """Without `key_file` the key lives in the state directory: a restart (the key loaded
    again from the same configuration) serves the key clients pinned."""
    config = parse_config(dict(REPLICAS), tmp_path)
    first = ehbp_keyring(config).current
    assert (tmp_path / ".state" / "hpke.key").stat().st_mode & 0o777 == 0o600
    assert ehbp_keyring(parse_config(dict(REPLICAS), tmp_path)).current.config == first.config


def test_check_refuses_a_key_file_serve_could_not_create(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`serve --check` used to say "will be created" for a key file in a directory the
    running gateway cannot write (/etc/saltgate under the shipped unit), then `serve` failed."""
    (tmp_path / "master.key").write_text(secrets.token_hex(32))
    (tmp_path / "master.key").chmod(0o600)
    base = {**REPLICAS, "gateway": {"master_key_file": "master.key", "port": 0}}
    assert "EHBP key file" in check_config(parse_config(base, tmp_path))  # creatable: a note
    (tmp_path / "etc").write_text("a file, not a directory")
    beside_a_file = parse_config({**base, "ehbp": {"key_file": "etc/hpke.key"}}, tmp_path)
    with pytest.raises(ConfigError, match="not a writable directory"):
        check_config(beside_a_file)
    read_only = tmp_path / "ro"
    read_only.mkdir()
    # What a read-only mount answers, even to root (EROFS); as root a mode would not do.
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != read_only and real_access(p, mode))
    config = parse_config({**base, "ehbp": {"key_file": "ro/keys/hpke.key"}}, tmp_path)
    with pytest.raises(ConfigError, match=r"ehbp.key_file: cannot create .*ro"):
        check_config(config)


def test_saltgate_up_serves_ehbp_and_plaintext_alike(tmp_path: Path) -> None:
    async def main() -> None:
        async with saltgate_up(tmp_path / "state") as up:
            fingerprint = re.search(r"EHBP key: (sha256:[0-9a-f]{64})", up.banner)
            assert fingerprint
            async with async_client(base_url=up.url, timeout=30) as plain:
                config = (await plain.get(KEYS_PATH)).content
                assert KeyConfig.decode(config).fingerprint == fingerprint.group(1)
                body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
                auth = {"authorization": f"Bearer {up.api_key()}"}
                assert (await plain.post("/v1/completions", json=body, headers=auth)).is_success
            transport = ehbp.AsyncEHBPTransport(ehbp.ServerIdentity.unmarshal_public_config(config))
            async with async_client(base_url=up.url, transport=transport, timeout=30) as sealed:
                resp = await sealed.post("/v1/completions", json=body, headers=auth)
                assert resp.status_code == 200 and resp.json()["choices"][0]["text"]

    asyncio.run(main())


def test_retired_keys_are_loaded_never_made_and_never_the_current_key(tmp_path: Path) -> None:
    """A rotation's config: the old key under retired_key_files, opened but not offered;
    `serve --check` names the offered fingerprint (what pinned clients must hold)."""
    (tmp_path / "master.key").write_text(secrets.token_hex(32))
    (tmp_path / "master.key").chmod(0o600)
    old, new = ServerKey.generate(), ServerKey.generate()
    for name, key in (("old.key", old), ("new.key", new)):
        create_secret_file(tmp_path / name, "EHBP key file", key.private_bytes().hex() + "\n")
    gateway = {"master_key_file": "master.key", "port": 0}

    def config(retired: list[str]) -> GatewayConfig:
        ehbp = {"key_file": "new.key", "retired_key_files": retired}
        return parse_config({**REPLICAS, "gateway": gateway, "ehbp": ehbp}, tmp_path)

    keyring = ehbp_keyring(config(["old.key"]))
    assert keyring.current.config == new.config
    assert [k.config for k in keyring.retired] == [old.config]
    notes = check_config(config(["old.key"]))
    assert new.config.fingerprint in notes and "1 retired EHBP keys" in notes
    assert old.config.fingerprint not in notes
    with pytest.raises(ConfigError, match="holds the current key"):
        ehbp_keyring(config(["old.key", "new.key"]))
    with pytest.raises(ConfigError, match="holds the current key"):
        check_config(config(["new.key"]))
    with pytest.raises(ConfigError, match=r"gone\.key"):
        ehbp_keyring(config(["gone.key"]))
    assert not (tmp_path / "gone.key").exists()
    with pytest.raises(ConfigError, match="retired_key_files: expected list"):
        parse_config({**REPLICAS, "ehbp": {"retired_key_files": "old.key"}}, tmp_path)
