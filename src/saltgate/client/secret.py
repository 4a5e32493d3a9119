"""The user's cache secret, kept on the client: the operator never sees it.

Where it comes from, first match wins: the explicit parameter, the environment variable
SALTGATE_USER_CACHE_SECRET, or a file `user_cache_secret` (mode 0600) in a private
directory (mode 0700, default ~/.saltgate), minted there on first use. The file is written
race-safely (temp file, then a hard link that fails if another process won; everyone reads
back what is on disk), and no path component we create or read is followed if a symlink.
The same helper keeps the gateway keys trusted on first use (client/transport.py).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Final

from saltgate.derivations.derive import SECRET_FIELD, SECRET_MAX_CHARS, SECRET_MIN_CHARS

ENV_VAR: Final = "SALTGATE_USER_CACHE_SECRET"
SECRET_FILE: Final = SECRET_FIELD
_MAX_FILE_BYTES: Final = 4096


class SecretStoreError(RuntimeError):
    """The secret or its store is unusable; the message says what to fix (never the value)."""


def default_state_dir() -> Path:
    return Path.home() / ".saltgate"


def mint_secret() -> str:
    """32 random bytes as 64 hex digits (what Tinfoil's SDKs mint too)."""
    return secrets.token_hex(32)


def check_secret(value: str, source: str) -> str:
    if not SECRET_MIN_CHARS <= len(value) <= SECRET_MAX_CHARS:
        raise SecretStoreError(
            f"the user cache secret from {source} must be {SECRET_MIN_CHARS} to "
            f"{SECRET_MAX_CHARS} characters"
        )
    return value


def resolve_user_cache_secret(
    explicit: str | None = None,
    *,
    state_dir: Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> str:
    """The secret to send: parameter > environment > the private file (minted if absent)."""
    if explicit:
        return check_secret(explicit, "the user_cache_secret parameter")
    env = os.environ if environ is None else environ
    if env.get(ENV_VAR):
        return check_secret(env[ENV_VAR], f"${ENV_VAR}")
    directory = state_dir or default_state_dir()
    value, _ = read_or_create(directory, SECRET_FILE, mint_secret)
    return check_secret(value, str(directory / SECRET_FILE))


def read_or_create(directory: Path, name: str, make: Callable[[], str]) -> tuple[str, bool]:
    """The text of `directory/name`, creating it with `make()` if absent; True if we made it.

    Concurrent callers (threads or processes) all return the same text: the first link
    wins and everyone reads the file back.
    """
    dir_fd = _open_private_dir(directory)
    try:
        found = _read_private_file(dir_fd, directory / name)
        if found is not None:
            return found, False
        temp = f".{name}.{secrets.token_hex(8)}.tmp"
        fd = os.open(
            temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd
        )
        try:
            with os.fdopen(fd, "w") as f:
                f.write(make() + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.link(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
            created = True
        except FileExistsError:
            created = False  # another process linked first; its value is the one on disk
        finally:
            os.unlink(temp, dir_fd=dir_fd)
        value = _read_private_file(dir_fd, directory / name)
        if value is None:
            raise SecretStoreError(f"{directory / name} vanished while it was being created")
        return value, created
    finally:
        os.close(dir_fd)


def _open_private_dir(directory: Path) -> int:
    directory.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise SecretStoreError(f"{directory} must be a real directory, not a symlink") from None
        raise SecretStoreError(f"cannot open {directory}: {exc.strerror}") from None
    info = os.fstat(fd)
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        os.close(fd)
        raise SecretStoreError(
            f"{directory} must be owned by you and private to you (chmod 700 {directory})"
        )
    return fd


def _read_private_file(dir_fd: int, path: Path) -> str | None:
    try:
        fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SecretStoreError(f"{path} is a symlink; refusing to follow it") from None
        raise SecretStoreError(f"cannot read {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise SecretStoreError(f"{path} must be a regular file")
        if info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise SecretStoreError(f"{path} must be owned by you with mode 0600 (chmod 600 {path})")
        data = f.read(_MAX_FILE_BYTES + 1)
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        text = ""
    if not text or len(data) > _MAX_FILE_BYTES:
        raise SecretStoreError(f"{path} holds no usable value; delete it to mint a new one")
    return text
