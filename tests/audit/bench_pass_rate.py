"""How often does a timing audit fail to PASS when nothing leaks? (Not a test; run by hand,
results in docs/testing.md, "Tests that expect a PASS".)

    .venv/bin/python tests/audit/bench_pass_rate.py [--trials 50000] [--seed 1]

Both arms are drawn from one distribution, so every failure to PASS is the audit's own
error: a chance LEAK (alpha) or an AUC interval still over the bound at the cap. The looks,
the Bonferroni family, the tests (compare_arms) and the verdict are the audit's
(saltgate.audit.stats); only the AUC interval is the normal approximation of its bootstrap
(the bootstrap would take hours for this many audits; the two agree to about 1%).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from collections.abc import Callable

import numpy as np

from saltgate.audit.stats import (
    ArmComparison,
    Criteria,
    Verdict,
    compare_arms,
    configuration_verdict,
    looks_needed,
)

ROUND = 250
PLANS = ((1e-3, 1500), (1e-3, 3000), (1e-6, 1500), (1e-6, 2250), (1e-6, 3000))
DETECTED = ArmComparison(1, 1, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0)  # the control: always seen


def comparison(hit: np.ndarray, miss: np.ndarray) -> ArmComparison:
    """The audit's comparison of two arms, its interval by the normal approximation."""
    n = hit.size
    # One resample: the bootstrap interval it gives is replaced below.
    compared = compare_arms(hit, miss, np.random.default_rng(0), resamples=1)
    half = 1.96 * math.sqrt((2 * n + 1) / (12 * n * n))
    return dataclasses.replace(compared, auc_low=compared.auc - half, auc_high=compared.auc + half)


def looker(hit: np.ndarray, miss: np.ndarray) -> Callable[[int], ArmComparison]:
    """`look(n)`: the comparison of the arms' first n probes, computed once for all plans."""

    @functools.cache
    def look(n: int) -> ArmComparison:
        return comparison(hit[:n], miss[:n])

    return look


def audit(look: Callable[[int], ArmComparison], alpha: float, cap: int) -> Verdict:
    """One audit's verdict, looking after each round of ROUND probes per arm; `look(n)`
    compares the arms' first n probes."""
    criteria = Criteria(alpha=alpha, family_size=Criteria.family(1, looks_needed(ROUND, cap)))
    verdict = Verdict.INCONCLUSIVE
    for n in range(ROUND, cap + 1, ROUND):
        attack = look(n)
        verdict = configuration_verdict(attack, DETECTED, criteria, at_cap=n == cap)
        if verdict is not Verdict.INCONCLUSIVE:
            break
    return verdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=50_000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    cap = max(c for _, c in PLANS)
    failures = {plan: {Verdict.LEAK: 0, Verdict.INCONCLUSIVE: 0} for plan in PLANS}
    for _ in range(args.trials):
        hit, miss = rng.lognormal(2.0, 0.3, cap), rng.lognormal(2.0, 0.3, cap)
        look = looker(hit, miss)
        for plan in PLANS:
            verdict = audit(look, *plan)
            if verdict is not Verdict.PASS:
                failures[plan][verdict] += 1
    for (alpha, cap_), seen in failures.items():
        print(
            f"alpha {alpha:g}, cap {cap_}: LEAK {seen[Verdict.LEAK]}, "
            f"INCONCLUSIVE {seen[Verdict.INCONCLUSIVE]} of {args.trials} audits"
        )


if __name__ == "__main__":
    main()
