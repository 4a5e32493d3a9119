"""The Envoy configuration the EPP ships, the audit's check of one, and the ext_proc
messages the EPP answers with: pure, no Envoy (tests/epp/test_through_envoy.py runs one)."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any, cast

import pytest
import yaml
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from google.protobuf import json_format

from saltgate.audit.command import _envoy_document
from saltgate.audit.deployment import Severity, judge_envoy_config
from saltgate.cli import main
from saltgate.config import (
    ConfigError,
    EppConfig,
    GatewayConfig,
    ReplicaConfig,
    parse_config,
)
from saltgate.epp.envoy import (
    ANSWER_DETAILS,
    DESTINATION,
    EXT_PROC,
    LB_NAMESPACE,
    OVERRIDE_HOST,
    REPLICAS_CLUSTER,
    RETRY_ON,
    UPSTREAM_ADDRESS,
    bootstrap,
    fail_open_findings,
    replica_choice_findings,
    replica_endpoints,
)
from saltgate.epp.metrics import metrics_tls
from saltgate.epp.server import _Conversation, destination, immediate
from saltgate.gateway.server import Gateway
from saltgate.http import Response

pytestmark = pytest.mark.unit


def shipped() -> dict[str, Any]:
    return bootstrap(
        replicas=[("127.0.0.1", 8001), ("127.0.0.1", 8002)],
        listen_host="127.0.0.1",
        envoy_port=8081,
        epp_host="127.0.0.1",
        grpc_port=9002,
        timeout_s=60,
        max_body_bytes=8 << 20,
    )


def manager(config: dict[str, Any]) -> dict[str, Any]:
    listener = config["static_resources"]["listeners"][0]
    typed: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return typed


def ext_proc(config: dict[str, Any]) -> dict[str, Any]:
    [found] = [f for f in manager(config)["http_filters"] if f["name"] == EXT_PROC]
    typed: dict[str, Any] = found["typed_config"]
    return typed


def test_the_shipped_configuration_fails_closed_and_goes_where_the_epp_says() -> None:
    config = shipped()
    typed = ext_proc(config)
    assert typed["failure_mode_allow"] is False
    assert typed["processing_mode"]["request_body_mode"] == "BUFFERED"
    assert typed["processing_mode"]["response_body_mode"] == "STREAMED"
    assert typed["metadata_options"]["receiving_namespaces"]["untyped"] == [LB_NAMESPACE]
    [replicas] = [
        c for c in config["static_resources"]["clusters"] if c["name"] == REPLICAS_CLUSTER
    ]
    # the [[replicas]] list, balanced by the override-host policy on the EPP's list alone
    assert replicas["type"] == "STATIC"
    [endpoints] = replicas["load_assignment"]["endpoints"]
    addresses = [e["endpoint"]["address"]["socket_address"] for e in endpoints["lb_endpoints"]]
    assert addresses == [
        {"address": "127.0.0.1", "port_value": 8001},
        {"address": "127.0.0.1", "port_value": 8002},
    ]
    [policy] = replicas["load_balancing_policy"]["policies"]
    override = policy["typed_extension_config"]
    assert override["name"] == OVERRIDE_HOST
    sources = override["typed_config"]["override_host_sources"]
    # the metadata only the EPP sets, never a header a client could send
    assert sources == [{"metadata": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION}]}}]
    [fallback] = override["typed_config"]["fallback_policy"]["policies"]
    subset = fallback["typed_extension_config"]["typed_config"]
    assert subset["fallback_policy"] == "NO_FALLBACK"  # past the list: no endpoint at all
    [route] = manager(config)["route_config"]["virtual_hosts"][0]["routes"]
    retry = route["route"]["retry_policy"]
    assert retry == {"retry_on": RETRY_ON, "num_retries": 1}  # down the list of two
    assert set(RETRY_ON.split(",")) == {"connect-failure", "refused-stream", "reset-before-request"}
    assert typed["response_attributes"] == [UPSTREAM_ADDRESS, ANSWER_DETAILS]
    # the ext_proc filter runs before the router, so no request reaches a replica unseen
    names = [f["name"] for f in manager(config)["http_filters"]]
    assert names == [EXT_PROC, "envoy.filters.http.router"]
    assert fail_open_findings(config) == []
    assert replica_choice_findings(config) == []
    judged = judge_envoy_config("envoy.yaml", config)
    assert [(f.check, f.severity) for f in judged] == [
        ("envoy-fail-closed", Severity.OK),
        ("envoy-replica-choice", Severity.OK),
    ]


def fail_open() -> dict[str, Any]:
    config = copy.deepcopy(shipped())
    ext_proc(config)["failure_mode_allow"] = True
    return config


def without_filter() -> dict[str, Any]:
    config = copy.deepcopy(shipped())
    m = manager(config)
    m["http_filters"] = [f for f in m["http_filters"] if f["name"] != EXT_PROC]
    return config


def route_skipping() -> dict[str, Any]:
    config = copy.deepcopy(shipped())
    host = manager(config)["route_config"]["virtual_hosts"][0]
    host["routes"].insert(
        0,
        {
            "match": {"prefix": "/v1/"},
            "route": {"cluster": REPLICAS_CLUSTER},
            "typed_per_filter_config": {
                EXT_PROC: {
                    "@type": "type.googleapis.com/"
                    "envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
                    "disabled": True,
                }
            },
        },
    )
    return config


def host_skipping() -> dict[str, Any]:
    config = copy.deepcopy(shipped())
    host = manager(config)["route_config"]["virtual_hosts"][0]
    host["typed_per_filter_config"] = {
        EXT_PROC: {
            "@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig",
            "disabled": True,
        }
    }
    return config


@pytest.mark.parametrize(
    ("broken", "said"),
    [
        (fail_open, "failure_mode_allow is true"),
        (without_filter, "no ext_proc filter"),
        (route_skipping, "routes[0]: disables the ext_proc filter"),
        (host_skipping, "virtual_hosts[inference]: disables the ext_proc filter"),
    ],
)
def test_each_way_past_the_epp_is_a_high_finding(broken: Any, said: str) -> None:
    config = broken()
    # through YAML, as `audit deployment --envoy-config` reads a file
    findings = judge_envoy_config("envoy.yaml", yaml.safe_load(yaml.safe_dump(config)))
    failing = [f for f in findings if f.check == "envoy-fail-closed"]
    assert [f.severity for f in failing] == [Severity.HIGH]
    assert said in failing[0].summary


def replicas_cluster(config: dict[str, Any]) -> dict[str, Any]:
    clusters: list[dict[str, Any]] = config["static_resources"]["clusters"]
    [found] = [c for c in clusters if c["name"] == REPLICAS_CLUSTER]
    return found


def fallback_round_robin() -> dict[str, Any]:
    config = copy.deepcopy(shipped())
    round_robin_fallback(config)
    return config


def round_robin_fallback(config: dict[str, Any]) -> None:
    """Envoy's round robin as the override-host policy's fallback: Envoy may then pick a
    replica the EPP left out (a positive control's config)."""
    override = replicas_cluster(config)["load_balancing_policy"]["policies"][0]
    override["typed_extension_config"]["typed_config"]["fallback_policy"] = {
        "policies": [
            {
                "typed_extension_config": {
                    "name": "envoy.load_balancing_policies.round_robin",
                    "typed_config": {
                        "@type": "type.googleapis.com/"
                        "envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"
                    },
                }
            }
        ]
    }


def subset_with_fallback() -> dict[str, Any]:
    config = copy.deepcopy(shipped())
    override = replicas_cluster(config)["load_balancing_policy"]["policies"][0]
    typed = override["typed_extension_config"]["typed_config"]
    typed["fallback_policy"]["policies"][0]["typed_extension_config"]["typed_config"][
        "fallback_policy"
    ] = "ANY_ENDPOINT"
    return config


def envoys_own_balancing() -> dict[str, Any]:
    config = copy.deepcopy(shipped())
    del replicas_cluster(config)["load_balancing_policy"]
    return config


def original_dst_on_the_connection() -> dict[str, Any]:
    config = copy.deepcopy(shipped())
    cluster = replicas_cluster(config)
    cluster.clear()
    cluster.update(
        {"name": REPLICAS_CLUSTER, "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED"}
    )
    return config


@pytest.mark.parametrize(
    ("broken", "said"),
    [
        (fallback_round_robin, "fallback picks a replica itself"),
        (subset_with_fallback, "fallback picks a replica itself"),
        (envoys_own_balancing, "balanced by Envoy itself"),
        (original_dst_on_the_connection, "ORIGINAL_DST without the EPP's header"),
    ],
)
def test_envoy_choosing_a_replica_the_epp_did_not_name_is_a_medium_finding(
    broken: Any, said: str
) -> None:
    findings = judge_envoy_config("envoy.yaml", yaml.safe_load(yaml.safe_dump(broken())))
    assert [(f.check, f.severity) for f in findings] == [
        ("envoy-fail-closed", Severity.OK),
        ("envoy-replica-choice", Severity.MEDIUM),
    ]
    assert findings[1].summary.startswith(f"clusters[{REPLICAS_CLUSTER}]: ")
    assert said in findings[1].summary


def test_the_older_original_dst_shape_on_the_epps_header_is_accepted() -> None:
    """Before the override-host policy the printed cluster was ORIGINAL_DST on the EPP's
    header: it fails closed (the EPP overwrites the header), only it fails over on the
    next request rather than within one (docs/epp.md)."""
    config = copy.deepcopy(shipped())
    cluster = replicas_cluster(config)
    cluster.clear()
    cluster.update(
        {
            "name": REPLICAS_CLUSTER,
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION},
        }
    )
    assert replica_choice_findings(config) == []
    assert {f.severity for f in judge_envoy_config("envoy.yaml", config)} == {Severity.OK}


def test_the_request_goes_to_the_pick_with_the_ordered_fallbacks_and_no_client_key() -> None:
    incoming = [
        (b":method", b"POST"),
        (b":path", b"/v1/completions"),
        (b"host", b"gateway"),
        (b"authorization", b"Bearer sk-tenant"),
        (b"x-gateway-destination-endpoint", b"10.0.0.9:80"),  # the client's own choice
        (b"content-type", b"application/json"),
    ]
    forwarded = [(b"content-type", b"application/json"), (b"authorization", b"Bearer replica")]
    answer = destination(
        incoming, forwarded, b'{"x":1}', ["127.0.0.1:8001", "127.0.0.1:8002"], headers_phase=False
    )
    common = answer.request_body.response
    set_headers = {h.header.key: h.header.raw_value for h in common.header_mutation.set_headers}
    assert set_headers[DESTINATION] == b"127.0.0.1:8001"  # overwrites the client's
    assert set_headers["authorization"] == b"Bearer replica"
    assert set_headers["content-length"] == b"7"
    assert common.header_mutation.remove_headers == []  # all incoming ones are overwritten
    assert common.body_mutation.body == b'{"x":1}'
    metadata = json_format.MessageToDict(answer.dynamic_metadata)
    assert metadata == {LB_NAMESPACE: {DESTINATION: "127.0.0.1:8001,127.0.0.1:8002"}}
    # a header the gateway does not forward is removed, never passed on
    dropped = destination(
        [*incoming, (b"x-tenant-secret", b"s")],
        forwarded,
        b"{}",
        ["127.0.0.1:8001"],
        headers_phase=True,
    )
    headers = dropped.request_headers.response
    assert headers.header_mutation.remove_headers == ["x-tenant-secret"]
    assert headers.status == ext.CommonResponse.ResponseStatus.CONTINUE_AND_REPLACE


def test_an_answer_of_the_gateway_is_an_immediate_response() -> None:
    message = immediate(
        Response(401, [(b"content-type", b"application/json")], b'{"error":{}}')
    ).immediate_response
    assert message.status.code == 401
    assert message.body == b'{"error":{}}'
    assert [(h.header.key, h.header.raw_value) for h in message.headers.set_headers] == [
        ("content-type", b"application/json")
    ]


def test_a_method_a_client_invents_is_counted_as_other() -> None:
    """Envoy passes any method token through (HTTP/2 carries any): saltgate_requests_total
    labels the standard ones, every other one OTHER, so a client adds no series."""
    counted: list[tuple[bytes, int]] = []

    class Counting:
        def counted(self, method: bytes, status: int) -> None:
            counted.append((method, status))

    conversation = _Conversation(cast(Gateway, Counting()), None)
    for method in (b"POST", b"FROB", b"ZAP", b"GET"):
        conversation.headers = [(b":method", method), (b":path", b"/v1/models")]
        conversation._counted(404)
    assert counted == [(b"POST", 404), (b"OTHER", 404), (b"OTHER", 404), (b"GET", 404)]


def test_the_printed_cluster_names_replicas_by_ip_and_port_as_the_epp_does() -> None:
    def config(url: str) -> ReplicaConfig:
        return ReplicaConfig(url)

    found = replica_endpoints([config("http://10.0.0.1:8000"), config("http://[::1]:9000/v1")])
    assert found == [("10.0.0.1", 8000), ("::1", 9000)]
    with pytest.raises(ConfigError, match=re.escape("replicas[1].url: 'vllm' is not an IP")):
        replica_endpoints([config("http://10.0.0.1:8000"), config("http://vllm:8000")])
    with pytest.raises(ConfigError, match=re.escape("replicas[0].url: https is not")):
        replica_endpoints([config("https://10.0.0.1:8000")])


def test_the_epp_section_is_parsed_and_checked(tmp_path: Path) -> None:
    doc: dict[str, Any] = {"replicas": [{"url": "http://127.0.0.1:1"}]}
    assert parse_config(doc, tmp_path).epp == EppConfig(grpc_port=9002, envoy_port=8081)
    doc["epp"] = {"grpc_port": 7000, "envoy_port": 7001, "metrics_port": 7002}
    assert parse_config(doc, tmp_path).epp == EppConfig(
        grpc_port=7000, envoy_port=7001, metrics_port=7002
    )
    for bad, said in (
        ({"grpc_port": 70000}, "epp.grpc_port: expected a port"),
        ({"envoy_port": "80"}, "epp.envoy_port: expected"),
        ({"port": 1}, "epp: unknown keys ['port']"),
        ({"metrics_port": -1}, "epp.metrics_port: expected a port"),
    ):
        doc["epp"] = bad
        with pytest.raises(ConfigError, match=re.escape(said)):
            parse_config(doc, tmp_path)


def test_the_metrics_listener_takes_the_admin_listeners_rules(tmp_path: Path) -> None:
    """Off by default; on loopback in plain HTTP; off loopback without TLS refused at
    start, as the admin listener is (its tokens would cross the network in clear)."""
    base = GatewayConfig(
        replicas=(ReplicaConfig("http://127.0.0.1:1"),),
        state_dir=tmp_path,
        master_key_file=tmp_path / "master.key",
    )
    assert base.epp.metrics_port is None
    assert metrics_tls(base) is None
    on = dataclasses.replace(base, epp=EppConfig(metrics_port=9100))
    assert metrics_tls(on) is None  # loopback: plain HTTP
    remote = dataclasses.replace(on, admin_host="0.0.0.0")
    with pytest.raises(ConfigError, match=re.escape("gateway.admin_host: 0.0.0.0 is off")):
        metrics_tls(remote)


def test_audit_reads_the_printed_json_and_yaml_and_names_a_bad_file(tmp_path: Path) -> None:
    printed = tmp_path / "envoy.json"
    printed.write_text(json.dumps(shipped(), indent=2))  # what --envoy-config prints
    assert _envoy_document(str(printed)) == shipped()
    as_yaml = tmp_path / "envoy.yaml"
    as_yaml.write_text(yaml.safe_dump(fail_open()))
    assert _envoy_document(str(as_yaml)) == fail_open()
    for bad in (tmp_path / "absent.yaml", tmp_path / "broken.yaml"):
        if bad.name == "broken.yaml":
            bad.write_text("a: [unclosed\n")
        with pytest.raises(ConfigError, match=re.escape(f"--envoy-config {bad}")):
            _envoy_document(str(bad))


def test_the_command_without_its_extra_says_which_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """In this process, with grpc hidden (an install without saltgate[epp])."""
    monkeypatch.setitem(sys.modules, "grpc", None)
    assert main(["epp", "--config", "gateway.toml"]) == 2
    err = capsys.readouterr().err
    assert err == "saltgate epp: needs grpc, not installed: pip install 'saltgate[epp]'\n"
