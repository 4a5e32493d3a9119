"""`saltgate serve`, `up` and `sim`: the gateway and the simulated replica."""

from __future__ import annotations

import argparse
import sys


def _add_sim(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from saltgate.sim.server import SimConfig

    d = SimConfig()
    p = sub.add_parser("sim", help="run a simulated vLLM replica (OpenAI API, prefix cache)")
    p.add_argument("--host", default=d.host, help="address to listen on")
    p.add_argument("--port", type=int, default=d.port, help="port to listen on")
    p.add_argument("--model", default=d.model, help="served model name")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    p.add_argument("--num-blocks", type=int, default=d.num_blocks, help="KV-cache capacity")
    p.add_argument(
        "--hash-algo",
        choices=("sha256", "sha256_cbor"),
        default=d.hash_algo,
        help="block hash, as vLLM's --prefix-caching-hash-algo",
    )
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on /v1")
    on_off = argparse.BooleanOptionalAction
    p.add_argument(
        "--enable-prompt-tokens-details",
        action=on_off,
        default=d.enable_prompt_tokens_details,
        help="report cached tokens in usage (vLLM's flag; on by default here, off in vLLM)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=on_off,
        default=d.enable_prefix_caching,
        help="cache prompt blocks (vLLM's flag; on by default in both)",
    )
    p.add_argument("--kv-events-endpoint", default=None, help="ZMQ endpoint, e.g. tcp://*:5557")
    p.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        help="ZMQ endpoint answering replay requests for missed KV events",
    )
    p.add_argument("--kv-events-topic", default=d.kv_events_topic, help="KV-event topic")
    p.add_argument(
        "--prefill-ms-per-1k-tokens",
        type=float,
        default=d.prefill_ms_per_1k_tokens,
        help="simulated prefill time of uncached prompt tokens (one step at a time)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="prompt tokens one prefill step computes, running prefills first (vLLM's "
        "chunked prefill; 0: one whole prompt per step)",
    )
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=d.long_prefill_token_threshold,
        help="most tokens of a step one running prefill takes (vLLM's; 0: no cap)",
    )
    p.add_argument(
        "--decode-ms-per-token",
        type=float,
        default=d.decode_ms_per_token,
        help="simulated time per output token",
    )
    p.add_argument(
        "--max-concurrency", type=int, default=d.max_concurrency, help="requests run at once"
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=d.max_model_len,
        help="longest prompt plus output, in tokens",
    )
    p.add_argument("--tls-cert", default=None, help="serve https with this PEM certificate")
    p.add_argument("--tls-key", default=None, help="its PEM private key (else in --tls-cert)")
    p.add_argument(
        "--tls-client-ca", default=None, help="require client certificates from this CA (mTLS)"
    )
    p.set_defaults(func=_run_sim)


def _run_sim(args: argparse.Namespace) -> int:
    from saltgate.sim.run import serve_forever
    from saltgate.sim.server import SimConfig

    config = SimConfig(
        host=args.host,
        port=args.port,
        model=args.model,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        hash_algo=args.hash_algo,
        api_key=args.api_key,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        kv_events_topic=args.kv_events_topic,
        prefill_ms_per_1k_tokens=args.prefill_ms_per_1k_tokens,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        decode_ms_per_token=args.decode_ms_per_token,
        max_concurrency=args.max_concurrency,
        max_model_len=args.max_model_len,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
    )
    return serve_forever(config)


def _add_gateway(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the gateway from a configuration file")
    p.add_argument("--config", required=True, help="TOML file (see docs/config.md)")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="worker processes serving the one port (1: a single process; docs/workers.md)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="validate the configuration and the files it names, then exit without serving "
        "(exit status 0 if valid, 2 if not; no network)",
    )
    p.set_defaults(func=_run_serve)

    p = sub.add_parser("up", help="run the gateway on its embedded default: simulated replicas")
    p.add_argument("--port", type=int, default=8000, help="gateway port (metrics on port+1)")
    p.add_argument("--replicas", type=int, default=2, help="how many simulated replicas")
    p.add_argument("--state-dir", default=".state", help="tenants, keys, usage, master key")
    p.set_defaults(func=_run_up)


def _run_serve(args: argparse.Namespace) -> int:
    from saltgate.config import ConfigError, load_config
    from saltgate.runtime import StartError
    from saltgate.store.errors import StoreError

    if args.workers < 1:
        print("saltgate serve: --workers must be at least 1", file=sys.stderr)
        return 2
    try:
        config = load_config(args.config)
        if args.check:  # like `nginx -t`: the files only, never the network
            from saltgate.governance.limits import enforcement
            from saltgate.serving.check import check_config

            print(f"saltgate: config {args.config} is valid ({check_config(config)})")
            cluster = config.cluster is not None
            held = enforcement(workers=args.workers, gateways=config.limits_share, cluster=cluster)
            print(f"saltgate: {held} (docs/limits.md)")
            return 0
    except (ConfigError, StoreError) as exc:
        print(f"saltgate serve: {exc}", file=sys.stderr)
        return 2
    except StartError as exc:  # --check: a port taken now
        print(f"saltgate serve: {exc.strerror}", file=sys.stderr)
        return 1
    if args.workers > 1:
        from saltgate.serving.supervisor import serve_workers

        return serve_workers(config, args.workers)
    from saltgate.serving.run import serve

    return serve(config)


def _run_up(args: argparse.Namespace) -> int:
    from pathlib import Path

    from saltgate.demo import up

    if args.replicas < 1:
        print("saltgate up: --replicas must be at least 1", file=sys.stderr)
        return 2
    return up(args.port, args.replicas, Path(args.state_dir))
