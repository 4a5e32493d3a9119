"""The isolation canary's shell: runs routing/canary.py against each replica, periodically.

Each run sends its three requests straight to the replica's pool (not through the
request path: no tenant, no admission, no ledger row, nobody billed), one after the
other, and hands the verdict to the router: FAILED takes the replica out of rotation
at once and only a later PASSED brings it back (routing/health.py, `Isolation`). The first
round runs at start, before the gateway serves, then one every ``interval_s``. Each
worker process of `serve --workers N` runs its own: each has its own router to take the
replica out of (three small requests per replica per interval each). docs/canary.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

import orjson

from saltgate.config import CanaryConfig
from saltgate.gateway.metrics import Labels, Metrics
from saltgate.gateway.replicas import Replica, ReplicaSet
from saltgate.gateway.usage import usage_from_body
from saltgate.http.client import UpstreamError
from saltgate.routing import Outcome, ReplicaId, Verdict, judge, new_run
from saltgate.routing.canary import ENTROPY_BYTES

log = logging.getLogger(__name__)

FAILURES = "saltgate_isolation_canary_failures_total"
RESULT = "saltgate_isolation_canary_result"
REQUEST_ID_PREFIX = "saltgate-canary-"  # its requests' x-request-id, in replica logs
ROUTE = b"/v1/completions"


class IsolationCanary:
    def __init__(
        self,
        config: CanaryConfig,
        replicas: ReplicaSet,
        metrics: Metrics,
    ) -> None:
        self.config = config
        self.replicas = replicas
        self.metrics = metrics
        self.last: dict[ReplicaId, Outcome] = {}  # each replica's latest verdict
        self._task: asyncio.Task[None] | None = None
        metrics.describe(
            FAILURES,
            "counter",
            "Isolation canary runs whose prompt hit the cache under a second namespace: "
            "the replica was taken out of rotation (docs/canary.md).",
        )
        metrics.gauge(
            RESULT,
            "1 for each replica's latest isolation canary result (pass, failure: out of "
            "rotation, inconclusive: nothing shown, still in rotation).",
            self._results,
        )

    def _results(self) -> list[tuple[Labels, float]]:
        out: list[tuple[Labels, float]] = []
        for replica in self.replicas.replicas:
            outcome = self.last.get(replica.id)
            if outcome is not None:
                for verdict in Verdict:
                    labels = (("replica", replica.label), ("result", verdict.value))
                    out.append((labels, float(verdict is outcome.verdict)))
        return out

    async def run_all(self) -> None:
        """One round: every replica whose probes pass, at once (a replica's own three
        requests one after the other)."""
        members = self.replicas.replicas
        for gone in self.last.keys() - {r.id for r in members}:
            del self.last[gone]
        up = [r for r in members if self._probed_up(r)]
        await asyncio.gather(*(self.run(r) for r in up))

    def _probed_up(self, replica: Replica) -> bool:
        state = self.replicas.router.state(replica.id)
        return state is not None and state.health.probe.up

    async def run(self, replica: Replica) -> Outcome:
        """One run on ``replica``: its verdict, told to the router, counted and logged."""
        try:
            outcome = await self._ask(replica)
        except (UpstreamError, TimeoutError) as exc:
            reason = str(exc) or f"no answer within {self.config.timeout_s:g} s"
            outcome = Outcome(Verdict.INCONCLUSIVE, f"a canary request failed: {reason}")
        state = self.replicas.router.state(replica.id)
        if state is None or replica not in self.replicas.replicas:
            return outcome  # removed by a reload while it ran
        before = self.last.get(replica.id)
        self.last[replica.id] = outcome
        self.replicas.router.canary(replica.id, outcome.verdict)
        index = self.replicas.replicas.index(replica)
        failed = outcome.verdict is Verdict.FAILED
        # Counted from 0 (an alert's increase() misses a series born at 1).
        self.metrics.inc(FAILURES, (("replica", replica.label),), float(failed))
        if failed:
            log.error(
                "replica %d (%s) is out of rotation: its isolation canary failed (%s)",
                index,
                replica.label,
                outcome.reason,
            )
        elif outcome.verdict is Verdict.PASSED:
            if before is not None and before.verdict is Verdict.FAILED:
                log.warning(
                    "replica %d (%s) is back: its isolation canary passed", index, replica.label
                )
        elif before != outcome:  # inconclusive: said when its reason changes
            log.warning(
                "replica %d (%s): isolation canary inconclusive (%s); it stays %s",
                index,
                replica.label,
                outcome.reason,
                "out of rotation" if state.health.isolation.failed else "in rotation",
            )
        return outcome

    async def _ask(self, replica: Replica) -> Outcome:
        models = sorted(replica.served or ())
        if not models:
            return Outcome(Verdict.INCONCLUSIVE, "the models it serves are not known yet")
        run = new_run(os.urandom(ENTROPY_BYTES))
        cached: list[int | None] = []
        for salt in (run.salt_a, run.salt_b, run.salt_a):
            body = orjson.dumps(run.body(models[0], salt))
            status, answer = await asyncio.wait_for(
                self._post(replica, body), self.config.timeout_s
            )
            if status != 200:
                return Outcome(Verdict.INCONCLUSIVE, f"a canary request was answered {status}")
            usage = usage_from_body(answer)
            cached.append(None if usage is None else usage.cached_tokens)
        return judge(*cached)

    async def _post(self, replica: Replica, body: bytes) -> tuple[int, bytes]:
        headers = [
            (b"content-type", b"application/json"),
            (b"x-request-id", (REQUEST_ID_PREFIX + os.urandom(8).hex()).encode()),
            *replica.auth,
        ]
        resp = await replica.pool.request(b"POST", replica.prefix + ROUTE, headers, body)
        return resp.status, await resp.read()

    def start(self) -> None:
        """Run a round every ``interval_s`` until `close`."""
        interval = self.config.interval_s

        async def loop() -> None:
            # Never ends on an exception: the next round must still run.
            while True:
                await asyncio.sleep(interval)
                failed = None
                try:
                    await self.run_all()
                except Exception as exc:
                    failed = exc  # logged outside the handler (buildinfo.py)
                if failed is not None:
                    log.error(
                        "an isolation canary round failed (%r); the next runs as planned", failed
                    )

        self._task = asyncio.get_running_loop().create_task(loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
