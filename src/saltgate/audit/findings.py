"""What `saltgate audit deployment` reports: findings, their severity, the report (pure).

Shared by the audit's judgements (saltgate.audit.deployment, .engine_state, .kv_tiers)
and the shell that gathers their observations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

__all__ = ["DeploymentReport", "Finding", "Severity"]


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
    fix: str = ""  # what to change, e.g. the vLLM flag to add; empty when nothing to do

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
