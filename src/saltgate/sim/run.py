"""Start and stop a simulated replica: in-process for tests, or as `saltgate sim`."""

from __future__ import annotations

import asyncio
import signal
import sys

import uvloop

from saltgate.kvevents.publisher import KvEventPublisher
from saltgate.sim.server import SimConfig, SimServer

__all__ = ["RunningSim", "SimConfig", "serve_forever", "start_sim"]


class RunningSim:
    """A started replica and what it owns; `close()` releases the port and the socket."""

    def __init__(self, server: SimServer, port: int, publisher: KvEventPublisher | None) -> None:
        self.server = server
        self.port = port
        self.publisher = publisher

    @property
    def url(self) -> str:
        return f"http://{self.server.config.host}:{self.port}"

    async def close(self) -> None:
        await self.server.close()
        if self.publisher is not None:
            self.publisher.close()


async def start_sim(config: SimConfig) -> RunningSim:
    publisher = None
    if config.kv_events_endpoint:
        publisher = KvEventPublisher(
            config.kv_events_endpoint,
            config.kv_events_topic,
            replay_endpoint=config.kv_events_replay_endpoint,
        )
    server = SimServer(config, publish=publisher.publish if publisher else None)
    port = await server.start()
    return RunningSim(server, port, publisher)


def install_uvloop() -> None:
    """Run on uvloop: the servers were measured on it (docs/benchmarks.md)."""
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


async def _serve(config: SimConfig) -> None:
    sim = await start_sim(config)
    print(f"saltgate sim: model {config.model} at {sim.url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await sim.close()


def serve_forever(config: SimConfig) -> int:
    install_uvloop()
    try:
        asyncio.run(_serve(config))
    except OSError as exc:
        print(f"saltgate sim: cannot serve on {config.host}:{config.port}: {exc}", file=sys.stderr)
        return 1
    return 0
