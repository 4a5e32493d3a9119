"""`saltgate audit timing` and `saltgate audit deployment`: arguments, runs, exit codes.

Exit codes: timing 0 PASS, 1 LEAK, 3 INVALID, 4 INCONCLUSIVE; deployment 0, or 1 when a
finding is high. Both: 2 for a usage, configuration or connection problem. Keys and
secrets may come from the environment instead of the command line (where `ps` shows them).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from saltgate.audit.plan import (
    DEFAULT_PREFIX_TOKENS,
    PRESETS,
    Identity,
    ProbeError,
    TimingAuditConfig,
    apply_preset,
)
from saltgate.audit.tables import render_table, write_json

__all__ = ["add_audit_parser"]

TIMING_EXIT = {"PASS": 0, "LEAK": 1, "INVALID": 3, "INCONCLUSIVE": 4}
USAGE_ERROR = 2


def _lengths(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token counts such as 128,1024, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("token counts must be positive")
    return values


def _from_env(value: str | None, name: str) -> str | None:
    return value if value is not None else (os.environ.get(name) or None)


def add_audit_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    audit = sub.add_parser("audit", help="prove isolation from outside; check a deployment")
    asub = audit.add_subparsers(dest="action", required=True, metavar="ACTION")

    d = TimingAuditConfig("", Identity(), Identity())
    p = asub.add_parser(
        "timing",
        help="measure the prompt-cache timing side channel between two identities",
        description="Victim primes random prompts; the attacker probes a shared prefix (hit) "
        "or a fresh prompt (miss), arms shuffled; the victim probing itself is the positive "
        "control. Keys and secrets also come from SALTGATE_AUDIT_VICTIM_KEY, "
        "SALTGATE_AUDIT_ATTACKER_KEY, SALTGATE_AUDIT_VICTIM_SECRET, "
        "SALTGATE_AUDIT_ATTACKER_SECRET. Exit: 0 PASS, 1 LEAK, 3 INVALID, 4 INCONCLUSIVE.",
    )
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--victim-key", help="the victim's API key")
    p.add_argument("--attacker-key", help="the attacker's API key")
    p.add_argument("--victim-secret", help="the victim's user_cache_secret (client-keyed mode)")
    p.add_argument("--attacker-secret", help="a user_cache_secret the attacker sends")
    p.add_argument("--victim-salt", help="raw cache_salt the victim sends (bare vLLM)")
    p.add_argument("--attacker-salt", help="raw cache_salt the attacker sends (bare vLLM)")
    p.add_argument(
        "--preset",
        choices=PRESETS,
        help="attacker model: another tenant; the operator (victim's key, not its secret); "
        "the same tenant (a control: expect LEAK)",
    )
    p.add_argument("--samples", type=int, default=d.samples, help="samples per arm per round")
    p.add_argument(
        "--max-samples",
        type=int,
        default=d.max_samples,
        help="cap per arm; rounds continue until PASS or LEAK (= --samples: one round)",
    )
    p.add_argument(
        "--prefix-tokens",
        type=_lengths,
        default=DEFAULT_PREFIX_TOKENS,
        help="shared prefix lengths, comma-separated (default %(default)s)",
    )
    p.add_argument("--tail-tokens", type=int, default=d.tail_tokens, help="tokens after it")
    p.add_argument(
        "--victim-requests",
        type=int,
        default=d.victim_requests,
        help="times the victim sends its prompt before each probe",
    )
    p.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    p.add_argument(
        "--route",
        choices=("completions", "chat"),
        default=d.route,
        help="/v1/completions or /v1/chat/completions (chat needs --prompt-format text)",
    )
    p.add_argument(
        "--prompt-format",
        choices=("tokens", "text"),
        default=d.prompt_format,
        help="prompts as token-id lists or as text, one letter per token",
    )
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="output tokens per request")
    p.add_argument("--batch", type=int, default=d.prime_batch, help="victim primes in flight")
    p.add_argument(
        "--alpha",
        type=float,
        default=d.alpha,
        help="LEAK when the attack's adjusted p-value is below this",
    )
    p.add_argument(
        "--auc-bound",
        type=float,
        default=d.auc_bound,
        help="PASS needs the AUC interval's upper bound at or below this",
    )
    p.add_argument(
        "--control-alpha",
        type=float,
        default=d.control_alpha,
        help="the positive control must reach a p-value below this, else INVALID",
    )
    p.add_argument("--seed", type=int, help="seed of the random prompts (default: fresh)")
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds per request")
    p.add_argument("--json", metavar="OUT", help="write the report as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="TTFT distributions and ROC curves")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_run_timing)

    p = asub.add_parser(
        "deployment",
        help="check a gateway deployment: replica exposure, KV events, hashing, salts",
        description="Exit: 0, or 1 when a finding is high. The key may also come from "
        "SALTGATE_AUDIT_API_KEY.",
    )
    p.add_argument("--config", required=True, help="the gateway's TOML file")
    p.add_argument("--api-key", help="a tenant's API key, for the canary requests")
    p.add_argument("--gateway-url", help="default: from the config's host and port")
    p.add_argument(
        "--kv-events",
        action="append",
        default=[],
        metavar="tcp://HOST:PORT",
        help="a KV-event endpoint to probe (repeatable); vLLM's default port 5557 on "
        "every replica host is always probed",
    )
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per probe")
    p.add_argument("--json", metavar="OUT", help="write the findings as JSON")
    p.add_argument(
        "--envoy-config",
        action="append",
        default=[],
        metavar="FILE",
        help="an Envoy configuration (JSON; YAML with pyyaml, in saltgate[audit]) in front "
        "of `saltgate epp`: a finding when it lets requests past the EPP (repeatable)",
    )
    # Neither numpy nor the plots: the runtime install runs it (docs/deployment.md).
    p.set_defaults(func=_run_deployment, runtime_only=True)


def _run_timing(args: argparse.Namespace) -> int:
    from saltgate.audit.report import format_table, write_plot  # noqa: PLC0415 (heavy: only when run)
    from saltgate.audit.timing import audit_criteria, run_timing_audit  # noqa: PLC0415 (heavy: only when run)

    victim = Identity(
        _from_env(args.victim_key, "SALTGATE_AUDIT_VICTIM_KEY"),
        _from_env(args.victim_secret, "SALTGATE_AUDIT_VICTIM_SECRET"),
        args.victim_salt,
    )
    attacker = Identity(
        _from_env(args.attacker_key, "SALTGATE_AUDIT_ATTACKER_KEY"),
        _from_env(args.attacker_secret, "SALTGATE_AUDIT_ATTACKER_SECRET"),
        args.attacker_salt,
    )
    try:
        config = TimingAuditConfig(
            base_url=args.base_url,
            victim=victim,
            attacker=apply_preset(args.preset, victim, attacker),
            prefix_tokens=args.prefix_tokens,
            tail_tokens=args.tail_tokens,
            samples=args.samples,
            max_samples=args.max_samples,
            victim_requests=args.victim_requests,
            model=args.model,
            route=args.route,
            prompt_format=args.prompt_format,
            max_tokens=args.max_tokens,
            prime_batch=args.batch,
            alpha=args.alpha,
            auc_bound=args.auc_bound,
            control_alpha=args.control_alpha,
            seed=args.seed,
            timeout_s=args.timeout,
            preset=args.preset,
            progress=not args.quiet,
        )
        audit_criteria(config)
    except ValueError as exc:
        print(f"saltgate audit timing: {exc}", file=sys.stderr)
        return USAGE_ERROR
    try:
        report = asyncio.run(run_timing_audit(config))
    except ProbeError as exc:
        print(f"saltgate audit timing: {exc}", file=sys.stderr)
        return USAGE_ERROR
    print(format_table(report))
    if args.json:
        write_json(report.to_json(), args.json)
    if args.plot:
        write_plot(report, args.plot)
    return TIMING_EXIT[report.verdict.value]


def _run_deployment(args: argparse.Namespace) -> int:
    from saltgate.audit.deployment import Severity, run_deployment_audit  # noqa: PLC0415 (heavy: only when run)
    from saltgate.config import ConfigError, load_config  # noqa: PLC0415 (heavy: only when run)

    try:
        config = load_config(args.config)
        envoy_configs = [(name, _envoy_document(name)) for name in args.envoy_config]
    except ConfigError as exc:
        print(f"saltgate audit deployment: {exc}", file=sys.stderr)
        return USAGE_ERROR
    report = asyncio.run(
        run_deployment_audit(
            config,
            gateway=args.gateway_url,
            api_key=_from_env(args.api_key, "SALTGATE_AUDIT_API_KEY"),
            kv_endpoints=args.kv_events,
            timeout=args.timeout,
            envoy_configs=envoy_configs,
        )
    )
    rows = [[f.severity.value, f.check, f.target, f.summary, f.fix] for f in report.findings]
    print(render_table(("severity", "check", "target", "finding", "fix"), rows))
    if args.json:
        write_json(report.to_json(), args.json)
    return 1 if report.worst is Severity.HIGH else 0


def _envoy_document(name: str) -> Any:
    """An Envoy configuration file parsed: JSON (what `saltgate epp --envoy-config`
    prints) with the runtime install, YAML too with pyyaml (saltgate[audit]); ConfigError
    if it cannot be read."""
    import json  # noqa: PLC0415 (only when run)

    from saltgate.config import ConfigError  # noqa: PLC0415 (heavy: only when run)

    try:
        with open(name, encoding="utf-8") as file:
            text = file.read()
    except OSError as exc:
        raise ConfigError(f"--envoy-config {name}: {exc.strerror}") from None
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        import yaml  # noqa: PLC0415 (only for a YAML file)
    except ModuleNotFoundError:
        raise ConfigError(
            f"--envoy-config {name}: not JSON, and reading YAML needs pyyaml: "
            "pip install 'saltgate[audit]'"
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"--envoy-config {name}: {exc}") from None
