"""The relay's settings: its upstream replicas, where it publishes, who may read.

Pure data and validation (``[kv_relay]`` and the replicas' ``kv_events_*`` keys of the
config file, or `saltgate kv-relay`'s options): loading a configuration loads no ZMQ.
Files the settings name are read by the caller (config.py), never here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from saltgate.kvevents.sequence import DEFAULT_REPLAY_WINDOW

_Z85_KEY: Final = re.compile(r"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")
SETTINGS_KEYS: Final = frozenset(
    {"publish_endpoint", "replay_endpoint", "client_keys", "replay_window"}
)


@dataclass(frozen=True, slots=True)
class CurveKeyPair:
    """A CURVE key pair in Z85 text (40 characters each)."""

    public: str
    secret: str = field(repr=False)


def parse_client_key(text: str) -> str:
    """A consumer's public key as given in the allow-list; ValueError says what is wrong."""
    key = text.strip()
    if not _Z85_KEY.fullmatch(key):
        raise ValueError(
            "a CURVE public key is 40 Z85 characters (python -c 'import zmq; "
            "print(zmq.curve_keypair()[0].decode())' makes one)"
        )
    return key


@dataclass(frozen=True, slots=True)
class KvUpstream:
    """One replica's event stream, as the relay reaches it.

    The relay CONNECTS its SUB socket to ``endpoint`` (vLLM bound it: ``tcp://*:5557`` or
    ``ipc://...``), unless ``bind`` is set: then the relay binds there and vLLM, configured
    with the relay's address, connects. ``replay_endpoint`` is vLLM's replay ROUTER, used to
    fill gaps. ``name`` (default: the endpoint) is what the opaque replica id is made from.
    ``curve_server_key``: the Z85 public key of a CURVE server at ``endpoint`` (and at
    ``replay_endpoint``): the relay connects as a CURVE client and so talks to no other.
    """

    endpoint: str
    replay_endpoint: str | None = None
    bind: bool = False
    name: str | None = None
    curve_server_key: str | None = None


@dataclass(frozen=True, slots=True)
class KvRelaySettings:
    """Where the relay publishes, who may read, and how much it keeps for replay."""

    publish_endpoint: str
    replay_endpoint: str
    client_keys: tuple[str, ...]
    replay_window: int = DEFAULT_REPLAY_WINDOW
    hwm: int = 100_000

    @classmethod
    def from_table(
        cls, table: Mapping[str, Any], more_client_keys: Sequence[str] = ()
    ) -> KvRelaySettings:
        """The ``[kv_relay]`` keys (SETTINGS_KEYS), plus client keys the caller read from
        elsewhere (a keys file); ValueError names the bad key."""
        unknown = set(table) - SETTINGS_KEYS
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}")
        endpoints = []
        for key in ("publish_endpoint", "replay_endpoint"):
            value = table.get(key)
            if not isinstance(value, str) or "://" not in value:
                raise ValueError(f'{key}: expected a ZMQ endpoint such as "tcp://127.0.0.1:5600"')
            endpoints.append(value)
        keys = table.get("client_keys", [])
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise ValueError("client_keys: expected a list of Z85 public keys")
        parsed = []
        for i, key in enumerate([*keys, *more_client_keys]):
            try:
                parsed.append(parse_client_key(key))
            except ValueError as exc:
                raise ValueError(f"client_keys[{i}]: {exc}") from None
        if not parsed:
            raise ValueError("client_keys: list at least one consumer's public key")
        window = table.get("replay_window", DEFAULT_REPLAY_WINDOW)
        if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
            raise ValueError("replay_window: expected a positive number of messages")
        return cls(endpoints[0], endpoints[1], tuple(parsed), window)


def client_key_lines(text: str) -> list[str]:
    """The keys of a client keys file: one a line; blank lines and # comments skipped."""
    return [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
