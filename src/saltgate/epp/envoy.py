"""The Envoy bootstrap `saltgate epp --envoy-config` prints, and the check of one.

Pure: a configuration is a plain dict (YAML or JSON parsed by the caller). The shipped
one fails closed: the ext_proc filter refuses requests while the EPP is unreachable
(`failure_mode_allow: false`), every route passes through it, and the replicas' cluster
(the `[[replicas]]` list) is balanced by the override-host policy on the EPP's `envoy.lb`
list: Envoy sends a request to the EPP's pick, retries a connection that failed before
the request was sent on the next endpoint of the list, and goes nowhere else (its
fallback picks no endpoint).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator, Sequence
from typing import Any, Final

from saltgate.config import ConfigError, ReplicaConfig

DESTINATION: Final = "x-gateway-destination-endpoint"  # the GIE protocol's header and key
LB_NAMESPACE: Final = "envoy.lb"  # the dynamic metadata namespace of the fallback list
EXT_PROC: Final = "envoy.filters.http.ext_proc"
_EXT_PROC_TYPE: Final = (
    "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
)
_PER_ROUTE_TYPE: Final = (
    "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
)
_HCM_TYPE: Final = (
    "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
    "HttpConnectionManager"
)
_ROUTER_TYPE: Final = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_HTTP2: Final = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_OVERRIDE_HOST_TYPE: Final = (
    "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost"
)
_SUBSET_TYPE: Final = (
    "type.googleapis.com/envoy.extensions.load_balancing_policies.subset.v3.Subset"
)
_ROUND_ROBIN_TYPE: Final = (
    "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"
)
OVERRIDE_HOST: Final = "envoy.load_balancing_policies.override_host"
EPP_CLUSTER: Final = "saltgate_epp"
REPLICAS_CLUSTER: Final = "saltgate_replicas"
# The attributes Envoy sends with the response headers: the endpoint its last attempt
# went to, and how the response came (VIA_UPSTREAM: the replica's; else Envoy's own).
UPSTREAM_ADDRESS: Final = "upstream.address"
ANSWER_DETAILS: Final = "response.code_details"
VIA_UPSTREAM: Final = "via_upstream"
# Retried: the connection failed, or was reset or refused before the request was sent.
# Never a reset after it (the replica may be generating) nor an answer (Envoy never
# retries once response headers went to the client): no replica sees a request twice.
RETRY_ON: Final = "connect-failure,refused-stream,reset-before-request"


def replica_endpoints(replicas: Sequence[ReplicaConfig]) -> list[tuple[str, int]]:
    """The (IP, port) of each replica, the endpoints of the printed cluster (Envoy's
    override-host policy matches the EPP's `ip:port` names against them); ConfigError for
    a replica it cannot name so: a host name, or https (the printed cluster has no TLS:
    put the mesh's mTLS between Envoy and the replicas)."""
    endpoints = []
    for i, replica in enumerate(replicas):
        host, port, _ = replica.authority
        if replica.tls:
            raise ConfigError(
                f"replicas[{i}].url: https is not in the printed Envoy configuration: "
                "give http://IP:port and secure the link with the mesh's mTLS"
            )
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ConfigError(
                f"replicas[{i}].url: {host!r} is not an IP address: the printed Envoy "
                "configuration names replicas by IP:port, as the EPP does"
            ) from None
        endpoints.append((host, port))
    return endpoints


def message_timeout_s(max_queue_s: float) -> float:
    """How long Envoy waits for each EPP answer: a request may wait its turn in the fair
    queue (`[queue] max_queue_s`) before it."""
    return max(30.0, max_queue_s + 10)


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _picks_nothing() -> dict[str, Any]:
    """A load balancing policy that never picks an endpoint: a subset balancer whose one
    subset no endpoint is in, with no fallback. The override-host policy's fallback, so
    that past the end of the EPP's list Envoy answers 503 rather than choosing a replica
    itself (one the EPP left out: its isolation canary failed, it refuses the key)."""
    return {
        "policies": [
            {
                "typed_extension_config": {
                    "name": "envoy.load_balancing_policies.subset",
                    "typed_config": {
                        "@type": _SUBSET_TYPE,
                        "fallback_policy": "NO_FALLBACK",
                        "subset_selectors": [{"keys": ["saltgate.never"]}],
                        "subset_lb_policy": {
                            "policies": [
                                {
                                    "typed_extension_config": {
                                        "name": "envoy.load_balancing_policies.round_robin",
                                        "typed_config": {"@type": _ROUND_ROBIN_TYPE},
                                    }
                                }
                            ]
                        },
                    },
                }
            }
        ]
    }


def _override_host() -> dict[str, Any]:
    """The GIE picker's load balancing: the endpoints of the `envoy.lb` list the EPP set,
    in order, one per attempt; none of Envoy's choosing."""
    return {
        "policies": [
            {
                "typed_extension_config": {
                    "name": OVERRIDE_HOST,
                    "typed_config": {
                        "@type": _OVERRIDE_HOST_TYPE,
                        "override_host_sources": [
                            {"metadata": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION}]}}
                        ],
                        "fallback_policy": _picks_nothing(),
                    },
                }
            }
        ]
    }


def bootstrap(
    *,
    replicas: Sequence[tuple[str, int]],
    listen_host: str,
    envoy_port: int,
    epp_host: str,
    grpc_port: int,
    timeout_s: float,
    max_body_bytes: int,
    message_timeout_s: float = 30.0,
) -> dict[str, Any]:
    """The Envoy bootstrap: a listener on ``envoy_port`` whose every request goes through
    the EPP at ``epp_host:grpc_port`` (request body buffered, response body streamed),
    then to the replica it names, or the next of its list when that one cannot be
    reached; ``replicas``: the (IP, port) of each replica; ``timeout_s``: a request's
    upstream time limit; ``max_body_bytes``: the largest body Envoy buffers for the EPP
    (the gateway's own limit: Envoy's default, 1 MiB, would refuse bodies the gateway
    takes);
    ``message_timeout_s``: how long Envoy waits for each EPP answer (past a request's
    wait in the fair queue)."""
    ext_proc = {
        "name": EXT_PROC,
        "typed_config": {
            "@type": _EXT_PROC_TYPE,
            "grpc_service": {"envoy_grpc": {"cluster_name": EPP_CLUSTER}},
            "failure_mode_allow": False,
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "BUFFERED",
                "request_trailer_mode": "SKIP",
                "response_header_mode": "SEND",
                "response_body_mode": "STREAMED",
                "response_trailer_mode": "SKIP",
            },
            "message_timeout": f"{message_timeout_s:g}s",
            "metadata_options": {"receiving_namespaces": {"untyped": [LB_NAMESPACE]}},
            # which replica answered (a retry may have moved the request down the list)
            "response_attributes": [UPSTREAM_ADDRESS, ANSWER_DETAILS],
        },
    }
    manager = {
        "@type": _HCM_TYPE,
        "stat_prefix": "saltgate",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "inference",
                    "domains": ["*"],
                    "routes": [
                        {
                            "match": {"prefix": "/"},
                            "route": {
                                "cluster": REPLICAS_CLUSTER,
                                "timeout": f"{timeout_s:g}s",
                                "retry_policy": {
                                    "retry_on": RETRY_ON,
                                    "num_retries": max(len(replicas) - 1, 0),
                                },
                            },
                        }
                    ],
                }
            ]
        },
        "http_filters": [
            ext_proc,
            {"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER_TYPE}},
        ],
    }
    return {
        "static_resources": {
            "listeners": [
                {
                    "name": "inference",
                    "address": _address(listen_host, envoy_port),
                    "per_connection_buffer_limit_bytes": max_body_bytes,
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": manager,
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                {
                    "name": EPP_CLUSTER,
                    "type": "STATIC",
                    "connect_timeout": "5s",
                    "typed_extension_protocol_options": {
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                            "@type": _HTTP2,
                            # One stream per connection: Envoy opens a connection per
                            # request under way and the kernel spreads connections among
                            # the `saltgate epp --workers N` processes (SO_REUSEPORT); on
                            # one multiplexed connection, one worker would take them all.
                            "explicit_http_config": {
                                "http2_protocol_options": {"max_concurrent_streams": 1}
                            },
                        }
                    },
                    "load_assignment": {
                        "cluster_name": EPP_CLUSTER,
                        "endpoints": [
                            {
                                "lb_endpoints": [
                                    {"endpoint": {"address": _address(epp_host, grpc_port)}}
                                ]
                            }
                        ],
                    },
                },
                {
                    "name": REPLICAS_CLUSTER,
                    "type": "STATIC",
                    "connect_timeout": "5s",
                    "load_balancing_policy": _override_host(),
                    "load_assignment": {
                        "cluster_name": REPLICAS_CLUSTER,
                        "endpoints": [
                            {
                                "lb_endpoints": [
                                    {"endpoint": {"address": _address(host, port)}}
                                    for host, port in replicas
                                ]
                            }
                        ],
                    },
                },
            ],
        }
    }


def _ext_proc_filters(manager: dict[str, Any]) -> list[dict[str, Any]]:
    """The typed_config of every ext_proc filter of an HTTP connection manager."""
    found = []
    for item in manager.get("http_filters") or []:
        if isinstance(item, dict):
            typed = item.get("typed_config") or {}
            if item.get("name") == EXT_PROC or typed.get("@type") == _EXT_PROC_TYPE:
                found.append(typed)
    return found


def _managers(config: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, typed_config) of every HTTP connection manager of the static listeners."""
    resources = config.get("static_resources") if isinstance(config, dict) else None
    listeners = (resources or {}).get("listeners") or []
    for li, listener in enumerate(listeners):
        for ci, chain in enumerate(listener.get("filter_chains") or []):
            for fi, item in enumerate(chain.get("filters") or []):
                typed = item.get("typed_config") or {}
                if typed.get("@type") == _HCM_TYPE:
                    name = listener.get("name", li)
                    yield f"listeners[{name}].filter_chains[{ci}].filters[{fi}]", typed


def _routes(manager: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    route_config = manager.get("route_config") or {}
    for vi, host in enumerate(route_config.get("virtual_hosts") or []):
        if _skips(host.get("typed_per_filter_config")):
            yield f"virtual_hosts[{host.get('name', vi)}]", host
        for ri, route in enumerate(host.get("routes") or []):
            if _skips(route.get("typed_per_filter_config")):
                yield f"virtual_hosts[{host.get('name', vi)}].routes[{ri}]", route


def _skips(per_filter: Any) -> bool:
    """Whether a route's (or host's) per-filter config turns the ext_proc filter off."""
    if not isinstance(per_filter, dict):
        return False
    for name, typed in per_filter.items():
        if not isinstance(typed, dict):
            continue
        # ExtProcPerRoute's `disabled`, or the generic FilterConfig's on the filter's name
        if (name == EXT_PROC or typed.get("@type") == _PER_ROUTE_TYPE) and typed.get(
            "disabled"
        ) is True:
            return True
    return False


def _first_policy(policy: Any) -> dict[str, Any]:
    """The typed_config of a load_balancing_policy's first policy (the one Envoy uses
    when it has it), {} when there is none."""
    policies = (policy.get("policies") or []) if isinstance(policy, dict) else []
    first = (policies[0] if policies else {}).get("typed_extension_config") or {}
    typed: dict[str, Any] = first.get("typed_config") or {}
    return typed


def _cluster_choice(cluster: dict[str, Any]) -> str | None:
    """Why a replicas' cluster may send a request somewhere the EPP did not name, or None:
    the override-host policy whose fallback picks nothing (the shipped shape), or
    ORIGINAL_DST on the EPP's header (the older one; the EPP overwrites the header)."""
    if cluster.get("type") == "ORIGINAL_DST":
        header = cluster.get("original_dst_lb_config") or {}
        if header.get("use_http_header") is True and header.get("http_header_name") == DESTINATION:
            return None
        return "ORIGINAL_DST without the EPP's header: Envoy goes where the connection was bound"
    typed = _first_policy(cluster.get("load_balancing_policy"))
    if typed.get("@type") != _OVERRIDE_HOST_TYPE:
        return "balanced by Envoy itself, not by the EPP's pick"
    fallback = _first_policy(typed.get("fallback_policy"))
    # `_picks_nothing`'s kind: a subset balancer without fallback (NO_FALLBACK, its default)
    without = fallback.get("fallback_policy", "NO_FALLBACK") == "NO_FALLBACK"
    if fallback.get("@type") != _SUBSET_TYPE or not without:
        return (
            "the override-host policy's fallback picks a replica itself when the EPP's list "
            "is used up"
        )
    return None


def replica_choice_findings(config: Any) -> list[str]:
    """Where Envoy may choose a replica the EPP did not name: a cluster the routes send to
    that is not balanced on the EPP's list, or whose override-host fallback picks
    endpoints. Such a replica may be one the EPP left out (its isolation canary failed,
    it refuses the gateway's key). Empty: Envoy goes where the EPP says or nowhere."""
    resources = config.get("static_resources") if isinstance(config, dict) else None
    clusters = {c.get("name"): c for c in (resources or {}).get("clusters") or []}
    findings = []
    targets: set[str] = set()
    for _, manager in _managers(config):
        for host in (manager.get("route_config") or {}).get("virtual_hosts") or []:
            for route in host.get("routes") or []:
                target = (route.get("route") or {}).get("cluster")
                if isinstance(target, str):
                    targets.add(target)
    for name in sorted(targets):
        cluster = clusters.get(name)
        why = None if cluster is None else _cluster_choice(cluster)
        if why is not None:
            findings.append(f"clusters[{name}]: {why}")
    return findings


def fail_open_findings(config: Any) -> list[str]:
    """What lets a request reach a replica without the EPP in an Envoy configuration:
    an ext_proc filter with `failure_mode_allow: true`, a connection manager without the
    filter, or a route (or virtual host) that disables it. Empty: it fails closed."""
    findings = []
    managers = list(_managers(config))
    if not managers:
        return ["no HTTP connection manager in static_resources.listeners: nothing to check"]
    for where, manager in managers:
        filters = _ext_proc_filters(manager)
        if not filters:
            findings.append(f"{where}: no ext_proc filter: requests reach replicas unsalted")
        for typed in filters:
            if typed.get("failure_mode_allow") is True:
                findings.append(
                    f"{where}: ext_proc failure_mode_allow is true: while the EPP is down "
                    "Envoy forwards requests unsalted"
                )
        for route_where, _ in _routes(manager):
            findings.append(
                f"{where}.{route_where}: disables the ext_proc filter: its requests skip the EPP"
            )
    return findings
