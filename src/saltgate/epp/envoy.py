"""The Envoy bootstrap `saltgate epp --envoy-config` prints, and the check of one.

Pure: a configuration is a plain dict (YAML or JSON parsed by the caller). The shipped
one fails closed: the ext_proc filter refuses requests while the EPP is unreachable
(`failure_mode_allow: false`), every route passes through it, and the one upstream
cluster is ORIGINAL_DST on the EPP's `x-gateway-destination-endpoint` header, so Envoy
sends a request where the EPP said and nowhere else.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final

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
EPP_CLUSTER: Final = "saltgate_epp"
REPLICAS_CLUSTER: Final = "saltgate_replicas"


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def bootstrap(
    *,
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
    then to the replica it names; ``timeout_s``: a request's upstream time limit;
    ``max_body_bytes``: the largest body Envoy buffers for the EPP (the gateway's own
    limit: Envoy's default, 1 MiB, would refuse bodies the gateway takes);
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
                            "explicit_http_config": {"http2_protocol_options": {}},
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
                    "type": "ORIGINAL_DST",
                    "lb_policy": "CLUSTER_PROVIDED",
                    "connect_timeout": "5s",
                    "original_dst_lb_config": {
                        "use_http_header": True,
                        "http_header_name": DESTINATION,
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
