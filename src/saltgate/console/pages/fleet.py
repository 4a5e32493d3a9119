"""The routing and fleet page: replicas, their isolation canary, the bus, the store."""

from __future__ import annotations

import time

from saltgate.admin import scopes
from saltgate.console import html
from saltgate.console.common import View, _int
from saltgate.console.core import ConsoleCore
from saltgate.console.html import esc, fmt, raw
from saltgate.console.security import Session


async def fleet_page(console: ConsoleCore, session: Session, query: dict[str, str]) -> View:
    refused = scopes.may_read_fleet(session.scopes, session.tenant_id)
    if refused is not None:  # replicas, the store and every tenant's traffic
        message = f"The fleet is not shown to this admin token: {refused}."
        body = html.notice(message, kind="error")
        return View("Routing and fleet", {"error": message}, body)  # as a refused call
    snap = await console.snapshot()
    gauges = {
        name: {dict(labels).get("replica", ""): v for labels, v in g.values}
        for name, g in snap.gauges.items()
    }
    healthy = gauges.get("saltgate_replica_healthy", {})
    inflight = gauges.get("saltgate_replica_inflight", {})
    results = snap.gauges.get("saltgate_isolation_canary_result")
    canary = {  # each replica's latest isolation canary result (docs/canary.md)
        dict(labels).get("replica", ""): dict(labels).get("result")
        for labels, v in (results.values if results is not None else [])
        if v == 1.0
    }
    start = (int(time.time()) - 3600) // 60 * 60
    params = {
        "start_time": str(start),
        "bucket_width": "1m",
        "limit": "60",
        "group_by": "replica",
    }
    usage, usage_error = await console.buckets(session, console.service.usage_completions, params)
    ratio: dict[str, tuple[int, int | None]] = {}
    for b in usage:
        for r in b.get("results") or []:
            name = str(r.get("replica"))
            p, c = ratio.get(name, (0, 0))
            rc = r.get("input_cached_tokens")
            ratio[name] = (
                p + _int(r.get("input_tokens")),
                None if c is None or rc is None else c + int(rc),
            )
    replicas = []
    for name in sorted(set(healthy) | set(inflight)):
        p, c = ratio.get(name, (0, 0))
        replicas.append(
            {
                "replica": name,
                "healthy": healthy.get(name) == 1.0,
                "canary": canary.get(name),  # None: not run (yet, or switched off)
                "inflight": int(inflight.get(name, 0)),
                "cached_ratio_1h": None if c is None or not p else c / p,
            }
        )
    single = {name: g.values[0][1] for name, g in snap.gauges.items() if len(g.values) == 1}
    bus = {
        "configured": console.config.cluster is not None,
        "up": single.get("saltgate_cluster_bus_up"),
        "peers": single.get("saltgate_cluster_peers"),
        "workers_alive": single.get("saltgate_workers_alive"),
    }
    store = {
        "backend": console.config.store_settings.backend,
        "where": console.config.store_settings.describe(),
        "unreachable_s": single.get("saltgate_store_unreachable_seconds"),
        "spooled_records": single.get("saltgate_ledger_spooled_records"),
    }
    data = {"replicas": replicas, "cluster": bus, "store": store, "usage_error": usage_error}
    rows = [
        (
            esc(r["replica"]),
            esc("healthy" if r["healthy"] else "unhealthy"),
            esc(r["canary"] or "not run"),
            esc(r["inflight"]),
            esc("unknown" if r["cached_ratio_1h"] is None else f"{r['cached_ratio_1h']:.1%}"),
        )
        for r in replicas
    ]
    peers = (
        "not configured"
        if not bus["configured"]
        else f"bus {'up' if bus['up'] else 'down'}, {int(bus['peers'] or 0)} other gateways"
    )
    body = (
        raw("<h2>Replicas</h2>")
        + html.table(
            ["Replica", "Health", "Isolation canary", "In flight", "Cached ratio (1 h)"],
            rows,
            empty="No replicas.",
        )
        + raw("<h2>Gateways on the bus</h2>")
        + fmt("<p>{}</p>", peers)
        + (
            fmt("<p>{} worker processes alive</p>", int(bus["workers_alive"] or 0))
            if bus["workers_alive"] is not None
            else ""
        )
        + raw("<h2>Store</h2>")
        + html.table(
            ["Backend", "Where", "Unreachable for", "Spooled records"],
            [
                (
                    esc(store["backend"]),
                    esc(store["where"]),
                    esc(f"{store['unreachable_s'] or 0:.0f} s"),
                    esc(int(store["spooled_records"] or 0)),
                )
            ],
        )
    )
    return View("Routing and fleet", data, body)
