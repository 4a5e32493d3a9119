"""Free ports (saltgate_devkit.procs.free_port): within a pytest-xdist worker, from that
worker's block below the kernel's ephemeral range, never the same twice before a bind, and
never one already bound; a run of two for `saltgate up`."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from saltgate_devkit import procs


def ephemeral_range() -> range:
    text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
    low, high = map(int, text.split())
    return range(low, high + 1)


def test_a_worker_takes_ports_from_its_own_block(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw2")
    block = range(22_000, 23_000)
    ports = [procs.free_port() for _ in range(50)]
    assert all(p in block for p in ports), ports
    assert len(set(ports)) == len(ports)  # asked twice before a bind, two ports
    assert not set(block) & set(ephemeral_range())
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    assert procs.free_port() in range(23_000, 24_000)


def test_a_bound_port_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw5")  # ports 25000-25999
    with socket.socket() as held:
        held.bind(("127.0.0.1", 25_001))
        monkeypatch.setattr(procs, "_cursor", 1)
        assert procs.free_port() == 25_002
        monkeypatch.setattr(procs, "_cursor", 0)
        assert procs.free_port(run=2) == 25_002  # 25_000 is free, its neighbour is not


def test_a_run_of_two_is_free_in_a_row(monkeypatch: pytest.MonkeyPatch) -> None:
    for worker in ("gw1", None):
        if worker is None:
            monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
        else:
            monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        port = procs.free_port(run=2)
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", port))
            b.bind(("127.0.0.1", port + 1))


def test_outside_a_worker_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert procs.free_port() in ephemeral_range()
