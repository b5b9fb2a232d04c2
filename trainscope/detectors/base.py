"""The Detector contract: one closed window of one job in, findings out.

A detector sees every rank's summaries of a window at once, so it can compare peers; it may keep
state across windows (history, a learned model) and must stay picklable so a pipeline can
checkpoint it. The runner gives every job its own deep copy of the detector, so that state only
ever holds one job's windows.

Convention shared by every detector: ``Finding.score`` is in [0, 1] and higher means more
certain and more important; ``ALERT_THRESHOLD`` is where findings become alerts.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from trainscope.schemas.records import Finding
from trainscope.schemas.window import WindowView

ALERT_THRESHOLD = 0.5


@runtime_checkable
class Detector(Protocol):
    """``name`` identifies the detector in findings; ``detect`` is called once per window."""

    name: str

    def detect(self, window: WindowView) -> list[Finding]: ...
