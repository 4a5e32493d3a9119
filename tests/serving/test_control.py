"""The parent-to-worker channel (serving/control.py): an order arrives as it was sent, in
both builds. A worker's whole configuration travels in its `Start`, compiled frozen
dataclasses included (the router's, the cluster's), which pickle's default restore
cannot rebuild in the compiled build."""

from __future__ import annotations

import asyncio
import pickle
from pathlib import Path

import pytest

from saltgate.buildinfo import COMPILED, build_kind
from saltgate.config import load_config
from saltgate.routing import Policy, RouterConfig
from saltgate.serving.control import Order, Reload, SendMetrics, Start, order_frame, read_order

pytestmark = pytest.mark.unit

EVERY_TABLE = """
[gateway]
port = 9000
state_dir = "st"

[[replicas]]
url = "http://127.0.0.1:8100"
weight = 2

[store]
url = "postgresql://saltgate@127.0.0.1:5432/saltgate?sslmode=disable"
password_env = "SG_TEST_DB_PASSWORD"

[cluster]
url = "redis://bus@127.0.0.1:6379/0"
gateway_id = "node-a"
password_env = "SG_TEST_BUS_PASSWORD"

[router]
policy = "least_loaded"

[ehbp]
enabled = true
retired_key_files = ["old.key"]

[prices.m]
input = 1.0
cached_input = 0.1
output = 2
"""


async def through_channel(orders: list[Order]) -> list[Order | None]:
    reader = asyncio.StreamReader()
    for order in orders:
        reader.feed_data(order_frame(order))
    reader.feed_eof()
    return [await read_order(reader) for _ in orders] + [await read_order(reader)]


def test_every_order_arrives_as_sent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SG_TEST_DB_PASSWORD", "db-secret")
    monkeypatch.setenv("SG_TEST_BUS_PASSWORD", "bus-secret")
    (tmp_path / "g.toml").write_text(EVERY_TABLE)
    config = load_config(tmp_path / "g.toml")
    assert config.cluster is not None and config.store is not None
    orders: list[Order] = [
        Start(config, (b"k" * 32, b"r" * 32)),
        SendMetrics(),
        Reload(config.replicas),
    ]
    received = asyncio.run(through_channel(orders))
    assert received == [*orders, None]  # then the parent is gone


def test_the_default_pickle_cannot_restore_a_compiled_config() -> None:
    """Why the channel pickles dataclasses itself: in the compiled build the default
    restore assigns the router's frozen fields one by one, and fails."""
    router = RouterConfig(policy=Policy.LEAST_LOADED)
    if build_kind() == COMPILED:
        with pytest.raises(AttributeError):  # dataclasses.FrozenInstanceError
            pickle.loads(pickle.dumps(router))
    else:
        assert pickle.loads(pickle.dumps(router)) == router
