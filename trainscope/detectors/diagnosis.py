"""From per-window findings to a diagnosis: one entry per suspect and cause, most suspect first."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from trainscope.detectors.base import ALERT_THRESHOLD
from trainscope.schemas.records import Finding


@dataclass
class Suspect:
    rank: int
    ranks: list[int]
    pp_stage: int
    layer: str
    function: str
    category: str
    detectors: set[str] = field(default_factory=set)
    scores: list[float] = field(default_factory=list)
    victims: set[int] = field(default_factory=set)
    message: str = ""
    first_window_ns: int = 0

    @property
    def score(self) -> float:
        """Mean score over the windows in which the suspect was reported."""
        return sum(self.scores) / len(self.scores)

    @property
    def weight(self) -> float:
        """Accumulated evidence: a persistent strong suspect outranks a one-window blip."""
        return sum(self.scores)

    def as_json(self) -> dict[str, object]:
        return {
            "rank": self.rank,
            "ranks": self.ranks,
            "function": self.function,
            "layer": self.layer,
            "category": self.category,
            "score": round(self.score, 4),
            "message": self.message,
        }


def key_of(finding: Finding) -> tuple[int, int, str]:
    return (finding.rank, finding.pp_stage, finding.category)


def diagnose(
    findings: Iterable[Finding], threshold: float = ALERT_THRESHOLD
) -> list[Suspect]:
    """Suspects whose mean score reaches ``threshold``, most suspect first.

    Localised suspects (a rank or a stage) come before job-level symptoms of equal weight.
    """
    suspects: dict[tuple[int, int, str], Suspect] = {}
    for f in findings:
        key = key_of(f)
        s = suspects.get(key)
        if s is None:
            s = suspects[key] = Suspect(
                rank=f.rank,
                ranks=list(f.ranks),
                pp_stage=f.pp_stage,
                layer=f.layer,
                function=f.function,
                category=f.category,
                first_window_ns=f.window_start_ns,
            )
        s.detectors.add(f.detector)
        s.scores.append(f.score)
        s.victims.update(f.victims)
        if f.score >= max(s.scores):
            s.message, s.layer, s.function = f.message, f.layer, f.function
    alerts = [s for s in suspects.values() if s.score >= threshold]
    alerts.sort(key=lambda s: (s.weight, s.rank >= 0 or s.pp_stage >= 0), reverse=True)
    return alerts
