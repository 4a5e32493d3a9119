"""What `saltgate audit deployment` reports: findings, their severity, the report (pure).

Shared by the audit's judgements (saltgate.audit.deployment, .engine_state, .kv_tiers)
and the shell that gathers their observations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

__all__ = ["NOTHING_TO_CHANGE", "REFUSED", "UNREACHED", "DeploymentReport", "Finding", "Severity"]

NOTHING_TO_CHANGE = "nothing to change"  # the fix of an `ok` finding, and of it alone
# The fixes of a probe that did not reach what it checks.
UNREACHED = "run the audit where the gateway runs (a host that reaches the replica)"
REFUSED = "give the audit the replica's key ([[replicas]] api_key_file in --config)"


class Severity(StrEnum):
    HIGH = "high"
    MEDIUM = "medium"
    LOW = "low"
    INFO = "info"
    OK = "ok"

    @property
    def rank(self) -> int:
        return list(Severity).index(self)


@dataclass(frozen=True, slots=True)
class Finding:
    check: str
    target: str
    severity: Severity
    summary: str
    fix: str = NOTHING_TO_CHANGE  # what to change, e.g. the vLLM flag to add

    def __post_init__(self) -> None:
        """Every finding but an `ok` one says what to do (operators read the fix column
        alone), and none says it with an empty cell."""
        if not self.fix.strip() or (
            self.fix == NOTHING_TO_CHANGE and self.severity is not Severity.OK
        ):
            raise ValueError(f"a {self.severity} {self.check} finding needs its fix")

    def to_json(self) -> dict[str, str]:
        return {
            "check": self.check,
            "target": self.target,
            "severity": self.severity.value,
            "summary": self.summary,
            "fix": self.fix,
        }


@dataclass(slots=True)
class DeploymentReport:
    findings: list[Finding] = field(default_factory=list)

    @property
    def worst(self) -> Severity:
        return min((f.severity for f in self.findings), key=lambda s: s.rank, default=Severity.OK)

    def to_json(self) -> dict[str, Any]:
        counts = {s.value: sum(f.severity is s for f in self.findings) for s in Severity}
        return {
            "worst": self.worst.value,
            "counts": counts,
            "findings": [f.to_json() for f in self.findings],
        }
