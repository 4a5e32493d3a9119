"""Where the client keeps the user's secret: precedence, file modes, symlinks, races."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from saltgate.client.secret import (
    ENV_VAR,
    SECRET_FILE,
    SecretStoreError,
    resolve_user_cache_secret,
)

EXPLICIT = "explicit-secret-0123456789"
FROM_ENV = "environment-secret-0123456789"


@pytest.mark.unit
def test_parameter_beats_environment_beats_file(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = {ENV_VAR: FROM_ENV}
    assert resolve_user_cache_secret(EXPLICIT, state_dir=home, environ=env) == EXPLICIT
    assert resolve_user_cache_secret(None, state_dir=home, environ=env) == FROM_ENV
    assert not home.exists()  # nothing written while a higher source decides
    minted = resolve_user_cache_secret(None, state_dir=home, environ={ENV_VAR: ""})
    assert len(minted) == 64 and int(minted, 16) >= 0
    assert resolve_user_cache_secret(None, state_dir=home, environ={}) == minted


@pytest.mark.unit
def test_the_file_is_0600_in_a_0700_directory_and_nothing_else_is_left(tmp_path: Path) -> None:
    home = tmp_path / "deep" / "home"
    secret = resolve_user_cache_secret(state_dir=home, environ={})
    assert home.stat().st_mode & 0o777 == 0o700
    path = home / SECRET_FILE
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.read_text().strip() == secret
    assert sorted(p.name for p in home.iterdir()) == [SECRET_FILE]


@pytest.mark.unit
def test_invalid_secrets_are_refused_without_echoing_them(tmp_path: Path) -> None:
    with pytest.raises(SecretStoreError, match=ENV_VAR) as info:
        resolve_user_cache_secret(state_dir=tmp_path, environ={ENV_VAR: "short-value"})
    assert "short-value" not in str(info.value)
    with pytest.raises(SecretStoreError, match="parameter"):
        resolve_user_cache_secret("x" * 300, state_dir=tmp_path, environ={})


@pytest.mark.unit
def test_symlinks_are_never_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (elsewhere / SECRET_FILE).write_text("attacker-chosen-secret-value\n")
    (elsewhere / SECRET_FILE).chmod(0o600)

    linked_file = tmp_path / "a"
    linked_file.mkdir(mode=0o700)
    (linked_file / SECRET_FILE).symlink_to(elsewhere / SECRET_FILE)
    with pytest.raises(SecretStoreError, match="symlink"):
        resolve_user_cache_secret(state_dir=linked_file, environ={})

    linked_dir = tmp_path / "b"
    linked_dir.symlink_to(elsewhere)
    with pytest.raises(SecretStoreError, match="symlink"):
        resolve_user_cache_secret(state_dir=linked_dir, environ={})

    dangling = tmp_path / "c"
    dangling.mkdir(mode=0o700)
    (dangling / SECRET_FILE).symlink_to(tmp_path / "planted")
    with pytest.raises(SecretStoreError, match="symlink"):
        resolve_user_cache_secret(state_dir=dangling, environ={})
    assert not (tmp_path / "planted").exists()  # nothing was written through the link


@pytest.mark.unit
def test_loose_permissions_are_refused(tmp_path: Path) -> None:
    home = tmp_path / "home"
    secret = resolve_user_cache_secret(state_dir=home, environ={})
    (home / SECRET_FILE).chmod(0o644)
    with pytest.raises(SecretStoreError, match="chmod 600") as info:
        resolve_user_cache_secret(state_dir=home, environ={})
    assert secret not in str(info.value)
    (home / SECRET_FILE).chmod(0o600)
    home.chmod(0o755)
    with pytest.raises(SecretStoreError, match="chmod 700"):
        resolve_user_cache_secret(state_dir=home, environ={})


def test_concurrent_processes_agree_on_one_secret(tmp_path: Path) -> None:
    home = tmp_path / "home"
    script = (
        "import sys; from pathlib import Path; "
        "from saltgate.client.secret import resolve_user_cache_secret as r; "
        "print(r(state_dir=Path(sys.argv[1]), environ={}))"
    )
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(home)], stdout=subprocess.PIPE, text=True, env=env
        )
        for _ in range(6)
    ]
    outputs = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(outputs) == 1
    assert outputs == {(home / SECRET_FILE).read_text().strip()}
    assert sorted(p.name for p in home.iterdir()) == [SECRET_FILE]
