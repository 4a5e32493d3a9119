"""Secret files: the master key and the other keys saltgate reads from disk.

Their rules (a regular file of mode 0600, never through a symlink) in one place, apart
from the configuration, so the store can read the master key (the audit log's key,
saltgate.store.audit) without importing saltgate.config; config re-exports all of it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path

from saltgate.derivations.derive import MASTER_KEY_MIN_BYTES

SECRET_FILE_MAX_BYTES = 4096


class ConfigError(ValueError):
    """A configuration problem a person can fix; the message says where and how."""


def read_secret_file(path: Path, what: str) -> bytes:
    """The bytes of a secret file (master key, EHBP key, a replica's API key).

    Refuses a symlink (O_NOFOLLOW: a link planted in a shared directory cannot redirect
    the read), anything but a regular file, and a file others can read, checked with
    fstat on the descriptor that is read, so the file cannot be swapped in between.
    Errors name the file and the rule, never the content.
    """
    fd = open_secret_file(path, what)
    try:
        data = os.read(fd, SECRET_FILE_MAX_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > SECRET_FILE_MAX_BYTES:
        raise ConfigError(f"{what} {path} is over {SECRET_FILE_MAX_BYTES} bytes")
    return data


def open_secret_file(path: Path, what: str) -> int:
    """A descriptor on ``path`` once it passed `read_secret_file`'s rules (also those of
    a TLS private key, which OpenSSL then reads by name)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        reason = "it is a symlink (name the file itself)" if exc.errno == errno.ELOOP else None
        raise ConfigError(f"cannot read {what} {path}: {reason or exc.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ConfigError(f"{what} {path} must be a regular file of mode 0600")
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(f"{what} {path} is readable by others: it must have mode 0600")
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_secret_file(path: Path, what: str, text: str) -> bool:
    """Write ``text`` to a new file of mode 0600 (in a 0700 directory made if needed)
    unless the file exists; True if it was created. Never writes through a symlink."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return False
    except OSError as exc:
        raise ConfigError(f"cannot create {what} {path}: {exc.strerror}") from None
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return True


def load_master_key(path: Path) -> bytes:
    """Read the cluster secret (raw or hex); refuse short keys and files others can read.
    A missing file gets the recipe for one (docs/install.md, "First run")."""
    if not os.path.lexists(path):
        raise ConfigError(
            f"no master key file at {path}: make one with (umask 077; python3 -c "
            f'"import secrets; print(secrets.token_hex(32))" > {path}), the same on every '
            "gateway of a fleet (docs/install.md)"
        )
    key = read_secret_file(path, "master key file").strip()
    with contextlib.suppress(ValueError, UnicodeDecodeError):
        key = bytes.fromhex(key.decode())
    if len(key) < MASTER_KEY_MIN_BYTES:
        raise ConfigError(
            f"master key in {path} is too short: need at least {MASTER_KEY_MIN_BYTES} bytes"
        )
    return key


def create_master_key(path: Path) -> bool:
    """Write a fresh 32-byte key (hex) with mode 0600 if none exists; True if created."""
    return create_secret_file(path, "master key file", secrets.token_hex(32) + "\n")
