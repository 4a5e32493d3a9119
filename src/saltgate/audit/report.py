"""How audit results are shown: a terminal table, a JSON file, and a PNG plot."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from saltgate.audit.plan import Role
from saltgate.audit.stats import ArmComparison, roc_curve
from saltgate.audit.tables import render_table
from saltgate.audit.timing import TimingReport

__all__ = ["format_table", "write_plot"]


def _p(value: float) -> str:
    return f"{value:.1e}"


def format_table(report: TimingReport) -> str:
    headers = (
        "prefix",
        "probe",
        "n/arm",
        "hit ms",
        "miss ms",
        "AUC [95% CI]",
        "KS p",
        "MWU p",
        "adj p",
        "verdict",
    )
    rows: list[list[str]] = []
    for c in report.configurations:
        for role, comparison in (("attack", c.attack), ("control", c.control)):
            if comparison is None:
                continue
            rows.append(
                [
                    str(c.prefix_tokens),
                    role,
                    str(comparison.n_hit),
                    f"{comparison.hit_median_ms:.2f}",
                    f"{comparison.miss_median_ms:.2f}",
                    f"{comparison.auc:.3f} [{comparison.auc_low:.3f}, {comparison.auc_high:.3f}]",
                    _p(comparison.ks_p),
                    _p(comparison.mwu_p),
                    _p(report.criteria.adjusted_p(comparison)),
                    c.verdict.value if role == "attack" else "",
                ]
            )
    crit = report.criteria
    footer = (
        f"verdict: {report.verdict.value} after {report.samples_per_arm} samples per arm "
        f"in {report.rounds} round(s), {report.elapsed_s:.1f} s "
        f"(PASS needs adjusted p >= {crit.alpha:g} and AUC upper <= {crit.auc_bound:g}; "
        f"control must reach p < {crit.control_alpha:g}; Bonferroni x{crit.family_size})"
    )
    return render_table(headers, rows) + "\n" + footer


def write_plot(report: TimingReport, path: str | Path) -> None:
    """Per prefix length: the attack's hit/miss TTFT histograms, and both ROC curves."""
    configs = [c for c in report.configurations if c.attack is not None]
    fig = Figure(figsize=(11, 4 * len(configs)))  # the Agg canvas: no display, no pyplot state
    axes = fig.subplots(len(configs), 2, squeeze=False)
    for row, c in zip(axes, configs, strict=True):
        hist, roc = row
        hits, misses = c.ttft_ms["attack"]["hit"], c.ttft_ms["attack"]["miss"]
        # Outliers (a GC pause, a busy neighbour) would squash the bulk: the last bin
        # holds everything above the 99th percentile.
        low, high = np.percentile([*hits, *misses], [0, 99])
        bins = np.linspace(low, max(high, low + 1e-3), 61)
        hist.hist(np.clip(misses, low, high), bins=bins, alpha=0.6, label=f"miss (n={len(misses)})")
        hist.hist(np.clip(hits, low, high), bins=bins, alpha=0.6, label=f"hit (n={len(hits)})")
        hist.set_xlabel("time to first token (ms; last bin: >= 99th percentile)")
        hist.set_ylabel("probes")
        hist.set_title(f"attacker, {c.prefix_tokens}-token prefix: {c.verdict.value}")
        hist.legend()
        pairs: tuple[tuple[Role, ArmComparison | None], ...] = (
            ("attack", c.attack),
            ("control", c.control),
        )
        for role, comparison in pairs:
            if comparison is None:
                continue
            fpr, tpr = roc_curve(c.ttft_ms[role]["hit"], c.ttft_ms[role]["miss"])
            roc.plot(fpr, tpr, label=f"{role} AUC {comparison.auc:.3f}")
        roc.plot([0, 1], [0, 1], linestyle=":", color="grey")
        roc.set_xlabel("false positive rate (misses called hits)")
        roc.set_ylabel("true positive rate")
        roc.set_title("ROC: 'fast means hit'")
        roc.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
