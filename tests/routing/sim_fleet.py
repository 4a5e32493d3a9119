"""The fleet's routing in virtual time, without processes (not a test; run by hand).

    .venv/bin/python tests/routing/sim_fleet.py [--gateways 4] [--duration 600] [--interval 0.02]

The live fleet benchmark (`saltgate-bench replay --gateways N`) measures real processes
on a shared machine, where a run-to-run spread of about 0.01 in the cached-token ratio
hides what routing itself does. This replays the same schedule through the real routers
(routing/router.py, routing/cluster.py with the real wire format) against a model of the
replicas with the simulator's own block pool (vLLM's hashing and LRU) and time model
(serial prefill at 60 ms per 1k uncached tokens, 2 ms per output token), in virtual
time: the same input gives the same output. Requests go round robin over N routers; with
shared state each router's batch goes out every ``--interval`` (the bus publishes on
change, at most once per publish_interval_s: this is its slowest case) and reaches the
others ``--latency`` later. Prints, for one gateway, N sharing and N alone: cached-token
ratio, TTFT p50/p99.

The trace's timestamps come in steps of about 3 s (bursts of up to 28 requests at one
instant, 0.3 s apart after --time-scale 10). One gateway decides a burst in sequence,
each choice seeing the last; N gateways decide it in parallel, and no bus is faster
than simultaneous. The live load generator sends a burst over about a millisecond, so
``--burst-spread`` spaces the requests of one timestamp that far apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from saltgate.derivations.derive import ROUTE_COMPLETIONS, cluster_keys
from saltgate.routing import Router, RouterConfig
from saltgate.routing.cluster import ClusterState
from saltgate.routing.domain import ReplicaId
from saltgate.routing.rendezvous import Member
from saltgate.sim.blockpool import BlockPool, NotEnoughBlocks
from saltgate_bench.replay import DEFAULT_TRACE
from saltgate_bench.replay_metrics import percentile_ms
from saltgate_bench.trace_schedule import (
    ReplayRequest,
    build_schedule,
    load_trace,
    prompt_text,
    prompt_tokens,
)

BLOCK_TOKENS = 64
K_ROUTE = b"r" * 32
PREFILL_S_PER_TOKEN = 60.0 / 1_000_000
DECODE_S = 0.002


@dataclass
class Replica:
    pool: BlockPool
    free_at: float = 0.0  # when its (serial) prefill is next free


@dataclass(order=True)
class Event:
    at: float
    seq: int
    run: Callable[[], None] = field(compare=False)


def simulate(
    schedule: list[ReplayRequest],
    gateways: int,
    shared: bool,
    *,
    interval: float,
    latency: float,
    replicas: int = 4,
    num_blocks: int = 8192,
) -> dict[str, float | None]:
    members = [Member(ReplicaId(f"http://r{i}"), 1.0) for i in range(replicas)]
    routers = [Router(RouterConfig(), K_ROUTE, members) for _ in range(gateways)]
    for router, member in itertools.product(routers, members):
        router.set_models(member.id, ["m"])  # every replica serves the one model
    states = (
        [ClusterState(r, cluster_keys(K_ROUTE), f"g{i}/0") for i, r in enumerate(routers)]
        if shared
        else []
    )
    pools = {m.id: Replica(BlockPool(num_blocks, 16)) for m in members}
    queue: list[Event] = []
    seq = itertools.count()
    ttfts: list[float] = []
    prompt = cached = 0

    def at(when: float, run: Callable[[], None]) -> None:
        heapq.heappush(queue, Event(when, next(seq), run))

    def arrive(req: ReplayRequest, now: float) -> None:
        router = routers[req.index % gateways]
        body = {"prompt": prompt_text(req.hash_ids, BLOCK_TOKENS)}
        salt = f"salt-{req.tenant}"
        plan = router.plan_request(ROUTE_COMPLETIONS, body, "m", salt, now, remember=True)
        replica_id = router.pick(plan, now)
        assert replica_id is not None
        estimate = float(plan.uncached_bytes(replica_id))
        router.started(replica_id, now, estimate)
        admit(req, router, replica_id, estimate, now)

    def admit(
        req: ReplayRequest, router: Router, rid: ReplicaId, estimate: float, now: float
    ) -> None:
        nonlocal prompt, cached
        replica = pools[rid]
        tokens = prompt_tokens(req.hash_ids, BLOCK_TOKENS)
        rkey = f"q{req.index}"
        try:
            hit = replica.pool.begin(rkey, tokens, f"salt-{req.tenant}")
        except NotEnoughBlocks:  # wait for blocks, as the simulator does
            at(now + 0.01, lambda: admit(req, router, rid, estimate, now + 0.01))
            return
        prompt += len(tokens)
        cached += hit
        start = max(now, replica.free_at)
        done = start + (len(tokens) - hit) * PREFILL_S_PER_TOKEN
        replica.free_at = done

        def first_token() -> None:
            replica.pool.prompt_computed(rkey)
            router.prefilled(rid, estimate)
            ttfts.append(done - req.at_s)
            at(done + req.max_tokens * DECODE_S, finish)

        def finish() -> None:
            replica.pool.finish(rkey)
            router.finished(rid, 0.0)

        at(done, first_token)

    for req in schedule:
        at(req.at_s, partial(arrive, req, req.at_s))
    if states:
        end = schedule[-1].at_s + 120.0

        def deliver(state: ClusterState, data: bytes, when: float) -> None:
            state.incoming(data, when)

        def tick(now: float) -> None:
            for state in states:
                state.expire(now)
                data = state.outgoing(now)
                if data is not None:
                    for other in states:
                        if other is not state:
                            at(now + latency, partial(deliver, other, data, now + latency))
            if now < end:
                at(now + interval, partial(tick, now + interval))

        at(0.0, partial(tick, 0.0))
    while queue:
        heapq.heappop(queue).run()
    return {
        "cached_token_ratio": round(cached / prompt, 4) if prompt else 0.0,
        "ttft_p50_ms": percentile_ms(ttfts, 50),
        "ttft_p99_ms": percentile_ms(ttfts, 99),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gateways", type=int, default=4)
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--interval", type=float, default=0.001, help="publish interval, s")
    parser.add_argument("--latency", type=float, default=0.0003, help="bus latency, s")
    parser.add_argument(
        "--burst-spread",
        type=float,
        default=0.0,
        help="s between requests the trace gives one timestamp (the live load generator "
        "sends a burst over about a millisecond)",
    )
    args = parser.parse_args()
    schedule = build_schedule(
        load_trace(DEFAULT_TRACE),
        tenants=8,
        zipf_exponent=1.1,
        seed=0,
        block_size=BLOCK_TOKENS,
        time_scale=10.0,
        duration_s=args.duration,
    )
    spread = []
    last, k = None, 0
    for req in schedule:
        k = k + 1 if req.at_s == last else 0
        last = req.at_s
        spread.append(dataclasses.replace(req, at_s=req.at_s + args.burst_spread * k))
    for gateways, shared in ((1, False), (args.gateways, True), (args.gateways, False)):
        result = simulate(spread, gateways, shared, interval=args.interval, latency=args.latency)
        print(f"{gateways} gateway(s), shared={shared}: {result}", flush=True)


if __name__ == "__main__":
    main()
