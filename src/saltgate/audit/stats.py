"""The timing audit's statistics and verdict rule (pure: numbers in, decisions out).

Method (docs/audit.md, after Gu et al. 2025): a probe that hits a cache answers sooner, so
the hit arm's time to first token (TTFT) is stochastically smaller than the miss arm's.

- One-sided two-sample Kolmogorov-Smirnov (hit CDF above miss CDF somewhere) and one-sided
  Mann-Whitney U (miss times tend to be larger), both from scipy.
- AUC = P(hit TTFT < miss TTFT) + P(tie) / 2: 0.5 means indistinguishable, 1.0 means every
  hit is faster than every miss. Its 95% interval comes from a stratified percentile
  bootstrap (each arm resampled on its own).
- Bonferroni over the family: configurations x 2 tests x planned looks (sampling in rounds
  and looking after each round is a multiple test too).
- Verdict per configuration: LEAK if the attack is significant at alpha; PASS if it is not
  AND the AUC interval's upper bound <= auc_bound AND the positive control was detected;
  INVALID if the control is still not detected at the sample cap; INCONCLUSIVE otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
from numpy.typing import NDArray
from scipy import stats

__all__ = [
    "ArmComparison",
    "Criteria",
    "Verdict",
    "auc",
    "auc_bootstrap_ci",
    "bonferroni",
    "compare_arms",
    "configuration_verdict",
    "control_detected",
    "looks_needed",
    "overall_verdict",
    "roc_curve",
]

Samples = Sequence[float] | NDArray[np.float64]

BOOTSTRAP_RESAMPLES = 2000
_BOOTSTRAP_CHUNK = 250  # resamples ranked at once: bounds memory at ~2000 samples per arm


class Verdict(StrEnum):
    PASS = "PASS"  # noqa: S105 (a verdict, not a password)
    LEAK = "LEAK"
    INVALID = "INVALID"
    INCONCLUSIVE = "INCONCLUSIVE"


@dataclass(frozen=True, slots=True)
class ArmComparison:
    """Hit arm against miss arm: sizes, medians, both tests' p-values, AUC and its CI."""

    n_hit: int
    n_miss: int
    hit_median_ms: float
    miss_median_ms: float
    ks_p: float
    mwu_p: float
    auc: float
    auc_low: float
    auc_high: float

    @property
    def p_min(self) -> float:
        return min(self.ks_p, self.mwu_p)


@dataclass(frozen=True, slots=True)
class Criteria:
    """The thresholds of the verdict rule; `family_size` is the Bonferroni factor."""

    alpha: float = 1e-3
    auc_bound: float = 0.55
    control_alpha: float = 1e-8
    family_size: int = 1

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 1 or not 0 < self.control_alpha < 1:
            raise ValueError("alpha and control_alpha must lie strictly between 0 and 1")
        if not 0.5 <= self.auc_bound <= 1:
            raise ValueError("auc_bound must lie between 0.5 and 1")
        if self.family_size < 1:
            raise ValueError("family_size must be at least 1")

    @staticmethod
    def family(configurations: int, looks: int) -> int:
        """Bonferroni family size: every configuration, both tests, every planned look."""
        return configurations * 2 * looks

    def adjusted_p(self, comparison: ArmComparison) -> float:
        return bonferroni(comparison.p_min, self.family_size)

    def significant(self, comparison: ArmComparison) -> bool:
        return self.adjusted_p(comparison) < self.alpha


def _array(values: Samples) -> NDArray[np.float64]:
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError("each arm needs at least one sample")
    if not np.all(np.isfinite(arr)):
        raise ValueError("samples must be finite numbers")
    return arr


def _auc_from_ranks(ranks: NDArray[np.float64], n_hit: int, n_miss: int) -> NDArray[np.float64]:
    """AUC from mid-ranks of [hits..., misses...] along the last axis (Mann-Whitney's U)."""
    miss_rank_sum = ranks[..., n_hit:].sum(axis=-1)
    u_miss = miss_rank_sum - n_miss * (n_miss + 1) / 2.0
    result: NDArray[np.float64] = u_miss / (n_hit * n_miss)
    return result


def auc(hit: Samples, miss: Samples) -> float:
    """P(a hit is faster than a miss) + half the ties."""
    h, m = _array(hit), _array(miss)
    ranks = stats.rankdata(np.concatenate([h, m]))
    return float(_auc_from_ranks(ranks, h.size, m.size))


def auc_bootstrap_ci(
    hit: Samples,
    miss: Samples,
    rng: np.random.Generator,
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    confidence: float = 0.95,
) -> tuple[float, float]:
    """Stratified percentile bootstrap interval of the AUC."""
    h, m = _array(hit), _array(miss)
    values: list[NDArray[np.float64]] = []
    left = resamples
    while left > 0:
        k = min(left, _BOOTSTRAP_CHUNK)
        hs = h[rng.integers(0, h.size, size=(k, h.size))]
        ms = m[rng.integers(0, m.size, size=(k, m.size))]
        ranks = stats.rankdata(np.concatenate([hs, ms], axis=1), axis=1)
        values.append(_auc_from_ranks(ranks, h.size, m.size))
        left -= k
    tail = (1.0 - confidence) / 2.0 * 100.0
    low, high = np.percentile(np.concatenate(values), [tail, 100.0 - tail])
    return float(low), float(high)


def compare_arms(
    hit_ms: Samples,
    miss_ms: Samples,
    rng: np.random.Generator,
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
) -> ArmComparison:
    """Both one-sided tests, the AUC and its bootstrap interval for one hit/miss pair."""
    h, m = _array(hit_ms), _array(miss_ms)
    # H1: the hits' CDF lies above the misses' somewhere (hits faster).
    ks = stats.ks_2samp(h, m, alternative="greater")
    # H1: miss times are stochastically larger than hit times.
    mwu = stats.mannwhitneyu(m, h, alternative="greater")
    low, high = auc_bootstrap_ci(h, m, rng, resamples=resamples)
    return ArmComparison(
        n_hit=int(h.size),
        n_miss=int(m.size),
        hit_median_ms=float(np.median(h)),
        miss_median_ms=float(np.median(m)),
        ks_p=float(ks.pvalue),
        mwu_p=float(mwu.pvalue),
        auc=auc(h, m),
        auc_low=low,
        auc_high=high,
    )


def bonferroni(p: float, family_size: int) -> float:
    if family_size < 1:
        raise ValueError("family_size must be at least 1")
    return min(1.0, p * family_size)


def control_detected(control: ArmComparison, criteria: Criteria) -> bool:
    """The positive control (the victim probing its own namespace) must show the hit."""
    return control.p_min < criteria.control_alpha


def configuration_verdict(
    attack: ArmComparison, control: ArmComparison, criteria: Criteria, *, at_cap: bool
) -> Verdict:
    """The verdict rule for one configuration; INCONCLUSIVE means "sample more" below the cap.

    A significant attack is a LEAK even if the control failed: a leak seen is a leak.
    """
    if criteria.significant(attack):
        return Verdict.LEAK
    if not control_detected(control, criteria):
        return Verdict.INVALID if at_cap else Verdict.INCONCLUSIVE
    if attack.auc_high <= criteria.auc_bound:
        return Verdict.PASS
    return Verdict.INCONCLUSIVE


def overall_verdict(verdicts: Sequence[Verdict]) -> Verdict:
    """LEAK if any configuration leaks, else INVALID if any is invalid, else PASS if all pass."""
    if not verdicts:
        raise ValueError("no configurations")
    for v in (Verdict.LEAK, Verdict.INVALID, Verdict.INCONCLUSIVE):
        if v in verdicts:
            return v
    return Verdict.PASS


def roc_curve(hit: Samples, miss: Samples) -> tuple[list[float], list[float]]:
    """(false positive rates, true positive rates) of "TTFT <= t means hit", t ascending."""
    h, m = np.sort(_array(hit)), np.sort(_array(miss))
    thresholds = np.unique(np.concatenate([h, m]))
    tpr = np.searchsorted(h, thresholds, side="right") / h.size
    fpr = np.searchsorted(m, thresholds, side="right") / m.size
    return [0.0, *fpr.tolist()], [0.0, *tpr.tolist()]


def looks_needed(first: int, cap: int) -> int:
    """How many looks sampling in rounds of `first` samples up to `cap` can take."""
    if first < 1 or cap < first:
        raise ValueError("need 1 <= samples <= max_samples")
    return math.ceil(cap / first)
