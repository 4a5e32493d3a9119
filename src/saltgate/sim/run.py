"""Start and stop a simulated replica: in-process for tests, or as `saltgate sim`."""

from __future__ import annotations

import sys

from saltgate.kvevents.publisher import KvEventPublisher
from saltgate.runtime import run_service, until_stopped
from saltgate.sim.server import SimConfig, SimServer

__all__ = ["RunningSim", "SimConfig", "serve_forever", "sim_command", "start_sim"]


def sim_command(port: int, host: str = "127.0.0.1", **options: float | str) -> list[str]:
    """The argv that runs `saltgate sim` in a child process with this interpreter.

    Options are the command's long flags with underscores: ``max_concurrency=256`` gives
    ``--max-concurrency 256``.
    """
    argv = [sys.executable, "-m", "saltgate.cli", "sim", "--host", host, "--port", str(port)]
    for name, value in options.items():
        argv += ["--" + name.replace("_", "-"), str(value)]
    return argv


class RunningSim:
    """A started replica and what it owns; `close()` releases the port and the socket."""

    def __init__(self, server: SimServer, port: int, publisher: KvEventPublisher | None) -> None:
        self.server = server
        self.port = port
        self.publisher = publisher

    @property
    def url(self) -> str:
        scheme = "https" if self.server.config.tls_cert else "http"
        return f"{scheme}://{self.server.config.host}:{self.port}"

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


async def _serve(config: SimConfig) -> None:
    sim = await start_sim(config)
    print(f"saltgate sim: model {config.model} at {sim.url}", flush=True)
    await until_stopped()
    await sim.close()


def serve_forever(config: SimConfig) -> int:
    return run_service(
        lambda: _serve(config),
        "saltgate sim",
        cannot_run=f"cannot serve on {config.host}:{config.port}",
    )
