"""From per-window findings to a diagnosis: one entry per suspect and cause, most suspect first.

Several detectors may report the same rank and cause in the same window (peer-diff names the
function, the mixture and multivariate detectors only the metrics that moved). They are one
piece of evidence about that window, not several: a suspect counts each window once, with the
strongest score any detector gave it there, and its description (function, message, evidence)
comes from the most specific finding — one that names a function beats one that does not.
"""

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
    # Window start (ns) → the strongest score any detector gave this suspect in that window.
    window_scores: dict[int, float] = field(default_factory=dict)
    victims: set[int] = field(default_factory=set)
    message: str = ""
    evidence: dict[str, float] = field(default_factory=dict)
    first_window_ns: int = 0

    @property
    def windows(self) -> int:
        """Distinct windows in which any detector reported the suspect."""
        return len(self.window_scores)

    @property
    def score(self) -> float:
        """Mean over those windows of the window's strongest score."""
        return sum(self.window_scores.values()) / len(self.window_scores)

    @property
    def weight(self) -> float:
        """Accumulated evidence: a persistent strong suspect outranks a one-window blip."""
        return sum(self.window_scores.values())

    def as_json(self) -> dict[str, object]:
        return {
            "rank": self.rank,
            "ranks": self.ranks,
            "function": self.function,
            "layer": self.layer,
            "category": self.category,
            "score": round(self.score, 4),
            "windows": self.windows,
            "detectors": sorted(self.detectors),
            "message": self.message,
            "evidence": self.evidence,
        }


def key_of(finding: Finding) -> tuple[int, int, str]:
    return (finding.rank, finding.pp_stage, finding.category)


def _specificity(finding: Finding) -> tuple[bool, float]:
    """Which finding describes a suspect: one naming a function first, then the strongest."""
    return (bool(finding.function), finding.score)


def _fold_early_flags(alerts: list[Suspect]) -> list[Suspect]:
    """An early ``straggler`` flag (detectors/early.py) says who made the peers wait, before
    the window said why: once a suspect with a cause covers one of its ranks, it is that
    suspect's first sign, not a suspect of its own."""
    explained = {r for s in alerts if s.category != "straggler"
                 for r in (s.ranks or ([s.rank] if s.rank >= 0 else []))}
    return [s for s in alerts
            if s.category != "straggler" or not explained.intersection(s.ranks or [s.rank])]


def diagnose(
    findings: Iterable[Finding], threshold: float = ALERT_THRESHOLD
) -> list[Suspect]:
    """Suspects whose mean score reaches ``threshold``, most suspect first.

    Localised suspects (a rank or a stage) come before job-level symptoms of equal weight.
    """
    suspects: dict[tuple[int, int, str], Suspect] = {}
    described_by: dict[tuple[int, int, str], Finding] = {}
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
        window = f.window_start_ns
        s.window_scores[window] = max(s.window_scores.get(window, 0.0), f.score)
        s.first_window_ns = min(s.first_window_ns, window)
        s.victims.update(f.victims)
        # ">=": of equally specific findings the latest describes the suspect.
        if key not in described_by or _specificity(f) >= _specificity(described_by[key]):
            described_by[key] = f
            s.message, s.layer, s.function = f.message, f.layer, f.function
            s.ranks, s.evidence = list(f.ranks), dict(f.evidence)
    alerts = _fold_early_flags([s for s in suspects.values() if s.score >= threshold])
    alerts.sort(key=lambda s: (s.weight, s.rank >= 0 or s.pp_stage >= 0), reverse=True)
    return alerts
