"""`saltgate epp --config FILE` as an operator runs it: the gRPC health service says
SERVING, and SIGTERM stops it cleanly."""

from __future__ import annotations

import signal
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tests.gateway.stack import new_state_dir, run
from tests.support.gateways import SALTGATE, write_gateway_config
from tests.support.waiting import eventually

from saltgate.epp.server import SERVICE
from saltgate_devkit.procs import Proc, free_port


def test_the_command_serves_health_and_stops_on_sigterm(tmp_path: Path) -> None:
    async def body() -> None:
        state = tmp_path / "state"
        new_state_dir(state, ("alice",))
        port = free_port()
        path = write_gateway_config(
            tmp_path / "gateway.toml",
            state_dir=state,
            replicas=[f"http://127.0.0.1:{free_port()}"],  # down: the EPP still serves
            admin_port=None,
            gateway_extra='host = "127.0.0.1"\n',
            sections=f"[epp]\ngrpc_port = {port}\n[canary]\nenabled = false\n",
        )
        epp = Proc("epp", [str(SALTGATE), "epp", "--config", str(path)], tmp_path / "epp.log")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)

                async def serving() -> bool:
                    assert epp.alive(), epp.tail()
                    try:
                        answer = await stub.Check(
                            health_pb2.HealthCheckRequest(service=SERVICE), timeout=2
                        )
                    except grpc.aio.AioRpcError:
                        return False
                    return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)

                await eventually(serving, timeout_s=30, what="the EPP's health says SERVING")
            epp.popen.send_signal(signal.SIGTERM)
            assert epp.popen.wait(20) == 0, epp.tail()
            assert f"EPP (ext_proc) on 127.0.0.1:{port}" in epp.tail(50)
        finally:
            epp.stop()

    run(body)
