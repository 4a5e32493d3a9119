"""`saltgate epp`: the gateway's policy and router as the Endpoint Picker of Envoy."""

from __future__ import annotations

import argparse
import json
import sys


def _add_epp(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "epp",
        help="serve the gateway's policy and router to Envoy (ext_proc endpoint picker)",
        description="The gateway's configuration file, with its [epp] section: an Envoy "
        "External Processing server on [gateway] host, [epp] grpc_port. See docs/epp.md.",
    )
    p.add_argument("--config", required=True, help="the gateway's TOML file")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="EPP processes serving the one [epp] grpc_port, as `serve --workers` "
        "(1: a single process; docs/epp.md)",
    )
    p.add_argument(
        "--envoy-config",
        action="store_true",
        help="print the Envoy bootstrap (for `envoy -c`) that sends every request through "
        "this EPP and refuses requests while it is down, then exit",
    )
    p.set_defaults(func=_run_epp)


def _run_epp(args: argparse.Namespace) -> int:
    from saltgate.config import ConfigError, load_config

    if args.workers < 1:
        print("saltgate epp: --workers must be at least 1", file=sys.stderr)
        return 2
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"saltgate epp: {exc}", file=sys.stderr)
        return 2
    if args.envoy_config:
        from saltgate.epp.envoy import bootstrap, message_timeout_s, replica_endpoints

        try:
            replicas = replica_endpoints(config.replicas)
        except ConfigError as exc:
            print(f"saltgate epp: {exc}", file=sys.stderr)
            return 2
        document = bootstrap(
            replicas=replicas,
            listen_host=config.host,
            envoy_port=config.epp.envoy_port,
            epp_host=config.host,
            grpc_port=config.epp.grpc_port,
            timeout_s=config.upstream_timeout_s,
            max_body_bytes=config.max_body_bytes,
            message_timeout_s=message_timeout_s(config.queue.max_queue_s),
        )
        print(json.dumps(document, indent=2))  # JSON is YAML: `envoy -c` reads it as such
        return 0
    if args.workers > 1:
        from saltgate.epp.supervisor import serve_epp_workers

        return serve_epp_workers(config, args.workers)
    from saltgate.epp.run import serve

    return serve(config)
