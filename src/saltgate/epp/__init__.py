"""`saltgate epp`: the gateway's request policy and router as the Endpoint Picker of an
Envoy-based gateway (Envoy's ext_proc, the Gateway API Inference Extension's protocol).

`envoy` builds the Envoy configuration it ships and checks one (pure); `server` is the
ext_proc shell around `Gateway.admit` and `Exchange`, `run` serves it, `metrics` its
/metrics; `supervisor` and `worker` are `--workers N`, serving's supervisor around EPP
processes (docs/epp.md).
"""

from typing import Final

GRPC_OPTIONS: Final = "the EPP's listener: gateway.host, epp.grpc_port"  # in bind errors
