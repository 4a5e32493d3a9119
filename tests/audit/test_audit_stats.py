"""The audit's statistics and verdict rule, on synthetic samples (no sockets)."""

from __future__ import annotations

import numpy as np
import pytest

from saltgate.audit.stats import (
    ArmComparison,
    Criteria,
    Verdict,
    auc,
    auc_bootstrap_ci,
    bonferroni,
    compare_arms,
    configuration_verdict,
    control_detected,
    looks_needed,
    overall_verdict,
    roc_curve,
)

pytestmark = pytest.mark.unit


def comparison(p: float, auc_high: float, auc_value: float = 0.5) -> ArmComparison:
    return ArmComparison(10, 10, 1.0, 1.0, p, p, auc_value, auc_value - 0.05, auc_high)


def test_auc_counts_faster_hits_and_half_ties() -> None:
    assert auc([1, 2], [3, 4]) == 1.0
    assert auc([3, 4], [1, 2]) == 0.0
    assert auc([1, 3], [2, 2]) == 0.5
    assert auc([2], [2]) == 0.5
    # hit 1 beats both misses, hit 3 beats one (2) and ties none: (2 + 1) / 4
    assert auc([1, 3], [2, 4]) == 0.75


def test_auc_matches_the_pairwise_definition() -> None:
    rng = np.random.default_rng(7)
    hit, miss = rng.integers(0, 20, 40).astype(float), rng.integers(0, 20, 30).astype(float)
    pairs = [(1.0 if h < m else 0.5 if h == m else 0.0) for h in hit for m in miss]
    assert auc(hit, miss) == pytest.approx(sum(pairs) / len(pairs))


def test_bootstrap_interval_covers_the_estimate_and_narrows_with_samples() -> None:
    rng = np.random.default_rng(1)
    small = auc_bootstrap_ci(rng.normal(0, 1, 50), rng.normal(0.5, 1, 50), rng)
    large_hit, large_miss = rng.normal(0, 1, 800), rng.normal(0.5, 1, 800)
    low, high = auc_bootstrap_ci(large_hit, large_miss, rng)
    assert low < auc(large_hit, large_miss) < high
    assert high - low < small[1] - small[0]
    # true AUC of N(0,1) vs N(0.5,1): Phi(0.5 / sqrt 2) = 0.638
    assert low < 0.638 < high


def test_clear_separation_is_a_leak_and_equal_distributions_pass() -> None:
    rng = np.random.default_rng(3)
    criteria = Criteria(family_size=Criteria.family(configurations=2, looks=6))
    leak = compare_arms(rng.normal(10, 1, 250), rng.normal(14, 1, 250), rng)
    assert leak.auc > 0.95 and leak.ks_p < 1e-8 and leak.mwu_p < 1e-8
    assert criteria.significant(leak)
    same = compare_arms(rng.normal(10, 1, 1500), rng.normal(10, 1, 1500), rng)
    assert not criteria.significant(same)
    assert same.auc_high <= 0.55
    assert configuration_verdict(same, leak, criteria, at_cap=False) is Verdict.PASS
    # the tests are one-sided: hits SLOWER than misses is no cache leak
    slower = compare_arms(rng.normal(14, 1, 250), rng.normal(10, 1, 250), rng)
    assert slower.ks_p > 0.5 and slower.mwu_p > 0.5


def test_verdict_rule() -> None:
    criteria = Criteria(alpha=1e-3, auc_bound=0.55, control_alpha=1e-8, family_size=10)
    strong_control = comparison(1e-20, 1.0, 0.99)
    weak_control = comparison(1e-5, 0.8, 0.7)
    # significant after Bonferroni: 1e-5 * 10 < 1e-3
    assert configuration_verdict(comparison(1e-5, 0.7), weak_control, criteria, at_cap=False) is (
        Verdict.LEAK
    )
    # 2e-4 * 10 = 2e-3: not significant once corrected
    not_sig = comparison(2e-4, 0.54)
    assert configuration_verdict(not_sig, strong_control, criteria, at_cap=True) is Verdict.PASS
    wide = comparison(0.3, 0.56)
    assert configuration_verdict(wide, strong_control, criteria, at_cap=False) is (
        Verdict.INCONCLUSIVE
    )
    assert configuration_verdict(wide, strong_control, criteria, at_cap=True) is (
        Verdict.INCONCLUSIVE
    )
    # a control that does not detect its own hits makes the run invalid at the cap
    assert not control_detected(weak_control, criteria)
    assert configuration_verdict(not_sig, weak_control, criteria, at_cap=False) is (
        Verdict.INCONCLUSIVE
    )
    assert configuration_verdict(not_sig, weak_control, criteria, at_cap=True) is Verdict.INVALID


def test_overall_verdict_and_bonferroni() -> None:
    assert overall_verdict([Verdict.PASS, Verdict.PASS]) is Verdict.PASS
    assert overall_verdict([Verdict.PASS, Verdict.INVALID, Verdict.LEAK]) is Verdict.LEAK
    assert overall_verdict([Verdict.INCONCLUSIVE, Verdict.INVALID]) is Verdict.INVALID
    assert overall_verdict([Verdict.PASS, Verdict.INCONCLUSIVE]) is Verdict.INCONCLUSIVE
    with pytest.raises(ValueError, match="no configurations"):
        overall_verdict([])
    assert bonferroni(1e-4, 12) == pytest.approx(1.2e-3)
    assert bonferroni(0.5, 12) == 1.0
    assert Criteria.family(configurations=2, looks=6) == 24
    assert looks_needed(250, 1500) == 6
    assert looks_needed(250, 1600) == 7
    assert looks_needed(250, 250) == 1


def test_bad_inputs_are_refused_with_a_reason() -> None:
    with pytest.raises(ValueError, match="at least one sample"):
        auc([], [1.0])
    with pytest.raises(ValueError, match="finite"):
        auc([float("nan")], [1.0])
    with pytest.raises(ValueError, match="auc_bound"):
        Criteria(auc_bound=0.4)
    with pytest.raises(ValueError, match="samples <= max_samples"):
        looks_needed(300, 200)


def test_roc_curve_runs_from_origin_to_corner() -> None:
    fpr, tpr = roc_curve([1.0, 2.0], [3.0, 4.0])
    assert (fpr[0], tpr[0]) == (0.0, 0.0)
    assert (fpr[-1], tpr[-1]) == (1.0, 1.0)
    assert tpr[2] == 1.0 and fpr[2] == 0.0  # perfect separation reaches (0, 1)
