"""The Envoy configuration the EPP ships, the audit's check of one, and the ext_proc
messages the EPP answers with: pure, no Envoy (tests/epp/test_through_envoy.py runs one)."""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path
from typing import Any

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
    parse_config,
)
from saltgate.epp.envoy import (
    DESTINATION,
    EXT_PROC,
    LB_NAMESPACE,
    REPLICAS_CLUSTER,
    bootstrap,
    fail_open_findings,
)
from saltgate.epp.server import destination, immediate
from saltgate.http import Response

pytestmark = pytest.mark.unit


def shipped() -> dict[str, Any]:
    return bootstrap(
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
    assert replicas["type"] == "ORIGINAL_DST"
    assert replicas["original_dst_lb_config"] == {
        "use_http_header": True,
        "http_header_name": DESTINATION,
    }
    # the ext_proc filter runs before the router, so no request reaches a replica unseen
    names = [f["name"] for f in manager(config)["http_filters"]]
    assert names == [EXT_PROC, "envoy.filters.http.router"]
    assert fail_open_findings(config) == []
    assert judge_envoy_config("envoy.yaml", config)[0].severity is Severity.OK


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
    assert [f.severity for f in findings] == [Severity.HIGH]
    assert said in findings[0].summary


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


def test_the_epp_section_is_parsed_and_checked(tmp_path: Path) -> None:
    doc: dict[str, Any] = {"replicas": [{"url": "http://127.0.0.1:1"}]}
    assert parse_config(doc, tmp_path).epp == EppConfig(grpc_port=9002, envoy_port=8081)
    doc["epp"] = {"grpc_port": 7000, "envoy_port": 7001}
    assert parse_config(doc, tmp_path).epp == EppConfig(grpc_port=7000, envoy_port=7001)
    for bad, said in (
        ({"grpc_port": 70000}, "epp.grpc_port: expected a port"),
        ({"envoy_port": "80"}, "epp.envoy_port: expected"),
        ({"port": 1}, "epp: unknown keys ['port']"),
    ):
        doc["epp"] = bad
        with pytest.raises(ConfigError, match=re.escape(said)):
            parse_config(doc, tmp_path)


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
