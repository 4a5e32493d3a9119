"""`saltgate kv-relay` and `proxy`: the KV-event relay and the client-keyed local proxy."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    from saltgate.kvevents.settings import KvRelaySettings, KvUpstream


def _add_kv_relay(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "kv-relay",
        help="relay the replicas' KV events, sanitised, to authenticated consumers",
        description="Either --config FILE (the gateway's: replicas' kv_events_* and "
        "[kv_relay]) or the options below. See docs/kv-relay.md.",
    )
    p.add_argument("--config", help="gateway TOML file with a [kv_relay] section")
    p.add_argument("--master-key-file", help="the cluster's master key (without --config)")
    p.add_argument(
        "--upstream",
        action="append",
        default=[],
        metavar="ENDPOINT[,REPLAY]",
        help="a replica's KV-event endpoint (and its replay endpoint); repeat per replica",
    )
    p.add_argument("--publish", help="where consumers subscribe, e.g. tcp://127.0.0.1:5600")
    p.add_argument("--replay", help="where consumers ask for replay, e.g. tcp://127.0.0.1:5601")
    p.add_argument(
        "--client-key",
        action="append",
        default=[],
        metavar="KEY",
        help="a consumer's public key, written --client-key=KEY (a Z85 key may begin with '-')",
    )
    p.add_argument("--client-keys-file", help="consumers' public keys, one per line")
    p.add_argument("--replay-window", type=int, help="messages kept for replay")
    p.add_argument(
        "--print-server-key", action="store_true", help="print the public key consumers pin"
    )
    p.add_argument(
        "--allow-plaintext-upstream",
        action="store_true",
        help="accept --upstream endpoints off loopback (no CURVE: salts in clear)",
    )
    p.set_defaults(func=_run_kv_relay)


def _kv_relay_from_args(
    args: argparse.Namespace,
) -> tuple[Path, list[KvUpstream], KvRelaySettings | None]:
    """(master key file, upstreams, settings) from --config or the options; ValueError.

    The settings are None when only --print-server-key was asked for without --config.
    """
    from pathlib import Path

    from saltgate.config import kv_plaintext_remote, kv_relay_settings, load_config
    from saltgate.kvevents.settings import KvUpstream

    if args.config:
        config = load_config(args.config)
        if config.kv_relay is None:
            raise ValueError(f"{args.config} has no [kv_relay] section")
        upstreams = [u for r in config.replicas if (u := r.kv_upstream) is not None]
        return config.master_key_file, upstreams, config.kv_relay
    if not args.master_key_file:
        raise ValueError("give --config FILE, or --master-key-file with the other options")
    key_file = Path(args.master_key_file)
    if args.print_server_key:
        return key_file, [], None
    upstreams = []
    for item in args.upstream:
        endpoint, _, replay = item.partition(",")
        upstreams.append(KvUpstream(endpoint, replay or None))
    if not upstreams:
        raise ValueError("--upstream: give at least one replica's KV-event endpoint")
    remote = [u.endpoint for u in upstreams if kv_plaintext_remote(u)]
    if remote and not args.allow_plaintext_upstream:
        raise ValueError(
            f"--upstream {remote[0]}: off loopback without CURVE, salts and token ids cross "
            "in clear; pin a forwarder's key with --config (kv_events_curve_server_key_file) "
            "or pass --allow-plaintext-upstream"
        )
    table: dict[str, object] = {
        "publish_endpoint": args.publish,
        "replay_endpoint": args.replay,
        "client_keys": args.client_key,
    }
    if args.client_keys_file:
        table["client_keys_file"] = args.client_keys_file
    if args.replay_window is not None:
        table["replay_window"] = args.replay_window
    return key_file, upstreams, kv_relay_settings(table, Path.cwd())


def _run_kv_relay(args: argparse.Namespace) -> int:
    import signal
    import threading

    from saltgate.config import load_master_key
    from saltgate.derivations.derive import derive_subkeys
    from saltgate.kvevents.relay import KvRelay, relay_server_keys

    try:
        key_file, upstreams, settings = _kv_relay_from_args(args)
        k_kv = derive_subkeys(load_master_key(key_file)).kv_events
        if args.print_server_key or settings is None:
            print(relay_server_keys(k_kv).public)
            return 0
        relay = KvRelay(upstreams, k_kv, settings)
        relay.start()
    except (ValueError, OSError) as exc:  # ConfigError is a ValueError
        print(f"saltgate kv-relay: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"saltgate kv-relay: {relay.describe()}", flush=True)
    while not stop.wait(0.5):
        pass
    relay.close()
    return 0


PROXY_API_KEY_ENV = "SALTGATE_API_KEY"  # where `saltgate proxy` reads its key by default


def _add_proxy(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "proxy",
        help="a loopback OpenAI-compatible proxy adding client-keyed caching (EHBP + secret)",
    )
    p.add_argument("--upstream", required=True, help="the gateway's URL (without /v1)")
    p.add_argument(
        "--api-key",
        default=None,
        help=f"the tenant API key to send upstream (default: ${PROXY_API_KEY_ENV}, which "
        "unlike an argument is not visible to other local users in the process list)",
    )
    p.add_argument("--port", type=int, default=8788, help="loopback port to listen on")
    p.add_argument(
        "--pin",
        action="append",
        default=[],
        help="accept only this gateway key fingerprint (sha256:...; repeatable); "
        "without it the first key seen is trusted and recorded",
    )
    p.set_defaults(func=_run_proxy)


def _run_proxy(args: argparse.Namespace) -> int:
    from saltgate.client.proxy import ProxyConfig, serve_proxy

    api_key = args.api_key or os.environ.get(PROXY_API_KEY_ENV)
    if not api_key:
        print(
            f"saltgate proxy: no API key: set {PROXY_API_KEY_ENV} (or pass --api-key)",
            file=sys.stderr,
        )
        return 2
    config = ProxyConfig(args.upstream, api_key, args.port, pin=tuple(args.pin))
    return serve_proxy(config)
