"""The metrics reference (docs/observability.md) against the gateway, and the shipped
dashboard and alert rules against the reference; the rules through the real promtool.

The reference table is the contract: a live gateway exposes no metric it lacks, every
metric it lists is registered by the gateway's code, and the dashboard and the alert
rules query only metrics it lists (so only metrics that exist)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from tests.gateway.stack import MODEL, run, stack
from tests.support.http import async_client

from saltgate import __version__
from saltgate.buildinfo import COMPILED, build_kind
from saltgate.store.tenants import TenantStore

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "observability.md"
RULES = ROOT / "packaging" / "prometheus" / "saltgate-rules.yml"
RULE_TESTS = ROOT / "packaging" / "prometheus" / "saltgate-rules.test.yml"
DASHBOARD = ROOT / "packaging" / "grafana" / "saltgate.json"
# Where the gateway registers metrics: its request path, the worker supervisor, the store.
SOURCES = [
    *(ROOT / "src" / "saltgate" / "gateway").glob("*.py"),
    *(ROOT / "src" / "saltgate" / "serving").glob("*.py"),
    ROOT / "src" / "saltgate" / "store" / "backends.py",
]
_NAME = re.compile(r"\bsaltgate_[a-z_]+\b")
_HISTOGRAM_PARTS = re.compile(r"_(bucket|sum|count)$")


def reference() -> dict[str, str]:
    """The metrics table of docs/observability.md: name -> type."""
    text = DOCS.read_text()
    section = text.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(saltgate_[a-z_]+)` \| (counter|gauge|histogram) \|", section, re.M)
    assert rows, "no metrics table in docs/observability.md"
    assert len(rows) == len(dict(rows)), "a metric is listed twice"
    return dict(rows)


def exposed(text: str) -> dict[str, str]:
    """The metrics of a scrape: name -> type (from its # TYPE lines)."""
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))


def queried(expr: str, table: dict[str, str]) -> set[str]:
    """The metric names a PromQL expression reads (a histogram's _bucket as itself)."""
    names = set()
    for name in _NAME.findall(expr):
        base = _HISTOGRAM_PARTS.sub("", name)
        names.add(base if table.get(base) == "histogram" else name)
    return names


def test_a_live_gateway_exposes_only_documented_metrics(tmp_path: Path) -> None:
    """A few requests of every kind (plain, streamed, refused, an invented model), then
    the scrape: every metric in it is in the table with its type; the new series are
    there with bounded labels (tenant id, a model a replica serves, replica URL)."""
    table = reference()

    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s, s.client("alice") as alice:
            body = {"model": MODEL, "prompt": "observe me", "max_tokens": 3}
            assert (await alice.post("/v1/completions", json=body)).status_code == 200
            chat = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "and stream"}],
                "max_tokens": 3,
                "stream": True,
            }
            async with alice.stream("POST", "/v1/chat/completions", json=chat) as resp:
                assert resp.status_code == 200
                await resp.aread()
            invented = {**body, "model": "invented-by-the-client-0001"}
            # No replica serves it: 404 before any replica or metric series sees it.
            assert (await alice.post("/v1/completions", json=invented)).status_code == 404
            async with async_client(base_url=s.url) as anonymous:
                assert (await anonymous.post("/v1/completions", json=body)).status_code == 401
            text = await s.scrape()
            replica = f"http://127.0.0.1:{s.taps[0].port}"
            with TenantStore.from_state_dir(s.state_dir) as store:
                tenant = store.get_tenant("alice").id

        metrics = exposed(text)
        undocumented = {n: k for n, k in metrics.items() if table.get(n) != k}
        assert not undocumented, f"exposed but not in docs/observability.md: {undocumented}"
        for name in (
            "saltgate_time_to_first_token_seconds",
            "saltgate_tenant_requests_total",
            "saltgate_request_duration_seconds",
        ):
            assert name in metrics, text
        assert tenant.startswith("tn_")
        route = 'route="/v1/chat/completions"'
        assert f'saltgate_time_to_first_token_seconds_count{{{route},model="{MODEL}"}} 1' in text
        assert (
            f'saltgate_tenant_requests_total{{tenant="{tenant}",model="{MODEL}",status="200"}} 2.0'
            in text
        )
        assert f'saltgate_tokens_total{{kind="prompt",tenant="{tenant}",model="{MODEL}"}}' in text
        assert "invented-by-the-client" not in text
        assert f'saltgate_replica_healthy{{replica="{replica}"}} 1.0' in text
        assert 'le="600.0"' in text  # the default upstream timeout ends the durations
        assert "alice" not in text  # a tenant's name is never a label
        build = "compiled" if build_kind() == COMPILED else "pure"
        assert f'saltgate_build_info{{version="{__version__}",build="{build}"}} 1.0' in text

    run(main)


def test_every_documented_metric_is_registered_by_the_gateway() -> None:
    """Each name in the table is a metric name in the gateway's code, and each metric
    name in that code is in the table (including those a single-process scrape lacks:
    cluster bus, workers)."""
    table = reference()
    in_code = set()
    for source in SOURCES:
        in_code |= set(re.findall(r'"(saltgate_[a-z_]+)"', source.read_text()))
    assert set(table) == in_code, set(table) ^ in_code


def test_the_dashboard_and_the_rules_query_only_documented_metrics() -> None:
    table = reference()
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(exprs) >= 10
    rules = RULES.read_text()
    used = set().union(*(queried(e, table) for e in exprs), queried(rules, table))
    unknown = used - set(table)
    assert not unknown, f"queried but not in docs/observability.md: {unknown}"
    assert "saltgate_time_to_first_token_seconds" in used and "saltgate_tokens_total" in used
    # the control: a name that is not a metric is caught by the same check
    assert queried("rate(saltgate_made_up_total[5m])", table) - set(table)


def test_every_documented_family_has_a_dashboard_panel() -> None:
    """Each family of the table is read by some panel (issue 43: 17 were on none, the
    workers', the fair queue's, the cluster bus's, the limits' among them). The control:
    the dashboard without its last panel misses that panel's family."""
    table = reference()
    panels = json.loads(DASHBOARD.read_text())["panels"]

    def shown(panels: list[Any]) -> set[str]:
        exprs = [t["expr"] for panel in panels for t in panel["targets"]]
        return set().union(*(queried(e, table) for e in exprs))

    assert set(table) - shown(panels) == set()
    assert set(table) - shown(panels[:-1]) == queried(panels[-1]["targets"][0]["expr"], table)
    assert len({p["id"] for p in panels}) == len(panels)  # Grafana keys panels by id


def _promtool() -> str:
    tool = shutil.which("promtool")
    assert tool, "promtool is missing: run scripts/services-setup.sh (package prometheus)"
    return tool


def scrape_configs() -> list[str]:
    """docs/observability.md's Prometheus configurations (the YAML blocks with scrape_configs)."""
    blocks = re.findall(r"```yaml\n(.*?)```", DOCS.read_text(), re.DOTALL)
    return [b for b in blocks if b.startswith("scrape_configs:")]


@pytest.mark.parametrize("broken", [False, True], ids=["as-documented", "misspelt-control"])
def test_promtool_checks_the_documented_scrape_configs(tmp_path: Path, broken: bool) -> None:
    """Each documented scrape config, its token file where it says, as Prometheus would
    load it; the control misspells a key, which promtool refuses. Not the Kubernetes one:
    Debian builds its Prometheus without Kubernetes discovery (promtool: "field
    kubernetes_sd_configs not found")."""
    found = scrape_configs()
    assert len(found) == 2  # the static target and Kubernetes' pod discovery
    runnable = [b for b in found if "kubernetes_sd_configs" not in b]
    assert len(runnable) == 1
    for number, block in enumerate(runnable):
        token = tmp_path / f"token-{number}"
        token.write_text("adm_test\n")
        text = re.sub(r"credentials_file: \S+", f"credentials_file: {token}", block)
        if broken:
            text = text.replace("job_name:", "jobname:")
        config = tmp_path / f"prometheus-{number}.yml"
        config.write_text(text)
        done = _run("check", "config", "--syntax-only", config, cwd=tmp_path)
        assert (done.returncode == 0) != broken, done.stdout + done.stderr


def _run(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_promtool(), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        check=False,
    )


def test_promtool_checks_the_rules_and_runs_their_unit_tests(tmp_path: Path) -> None:
    """The real promtool accepts the rules and passes their unit tests; the control: the
    same unit tests fail against rules whose TTFT threshold was raised out of reach."""
    checked = _run("check", "rules", RULES, cwd=RULES.parent)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS" in checked.stdout
    tested = _run("test", "rules", RULE_TESTS, cwd=RULES.parent)
    assert tested.returncode == 0, tested.stdout + tested.stderr

    broken = RULES.read_text().replace("[5m]))) > 10", "[5m]))) > 100")
    assert broken != RULES.read_text()
    (tmp_path / RULES.name).write_text(broken)
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    failed = _run("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert failed.returncode != 0 and "SaltgateTTFTHigh" in failed.stdout + failed.stderr


def fired_alerts(tests: str) -> set[str]:
    """The alerts some case of a promtool test file expects to fire (not `exp_alerts: []`)."""
    return set(re.findall(r"alertname: (\w+)\n\s+exp_alerts:\n\s+- exp_labels:", tests))


def test_every_alert_has_a_unit_test_that_fires_it() -> None:
    """Each rule of saltgate-rules.yml is fired by some case of saltgate-rules.test.yml
    (issue 43: six of ten had none), so promtool proves its expression and labels."""
    alerts = set(re.findall(r"^\s*- alert: (\w+)$", RULES.read_text(), re.MULTILINE))
    assert len(alerts) >= 12
    assert alerts <= fired_alerts(RULE_TESTS.read_text()), alerts - fired_alerts(
        RULE_TESTS.read_text()
    )
    # the control: a case that expects silence is not a test that fires
    quiet = "      - eval_time: 2m\n        alertname: SaltgateX\n        exp_alerts: []\n"
    assert fired_alerts(quiet) == set()


def test_promtool_refuses_a_malformed_rule(tmp_path: Path) -> None:
    """The control of `check rules`: it does read the file and fails on a bad query."""
    bad = tmp_path / "bad.yml"
    bad.write_text(RULES.read_text().replace("== 0\n        for: 1m", "== == 0\n        for: 1m"))
    assert _run("check", "rules", bad, cwd=tmp_path).returncode != 0
