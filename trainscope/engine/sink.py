"""What a stream job writes to: the :class:`Sink` protocol.

:class:`trainscope.sinks.clickhouse.ClickHouseSink` is the one in the package; the engine knows
only this protocol, so it never imports the sinks (nor their store client). A method that raises
is retried with backoff, and a window whose write keeps failing is counted and never committed
past (see :class:`trainscope.engine.core.StreamCore`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import pandas as pd

from trainscope.schemas.records import Finding, ProfileCallPaths, Topology
from trainscope.schemas.whatif import OpTraceJob
from trainscope.schemas.window import WindowView

# A message set aside: (topic, partition, offset, reason, payload); topic "" and partition and
# offset -1 for a record handed over in-process.
DeadLetterRow = tuple[str, int, int, str, bytes]


class Sink(Protocol):
    """Every method the stream jobs call on their sink."""

    def write_window(self, view: WindowView, findings: list[Finding]) -> None:
        """A closed window's summaries, steps and metrics, with the findings made of it."""

    def write_findings(self, findings: list[Finding]) -> None:
        """Findings raised between windows (the early flag), ahead of their window."""

    def write_topology(self, topology: Topology) -> None:
        """A job's layout as one rank declared it."""

    def write_dead_letters(self, rows: Sequence[DeadLetterRow]) -> None:
        """Rejected messages and records, with the reason for each."""

    def write_profile(self, parts: Sequence[ProfileCallPaths]) -> None:
        """One on-demand profile session's call-path tree, all of its parts."""

    def write_op_trace(self, job: OpTraceJob, frame: pd.DataFrame) -> None:
        """Ops of a job's what-if op trace, validated (``trainscope.schemas.optrace.validate``),
        and the job's sizes."""

    def write_checkpoint(self, group: str, state: bytes) -> None:
        """The bus-fed job's checkpoint, stored before the positions it covers are committed."""

    def read_checkpoint(self, group: str) -> bytes | None:
        """The newest checkpoint :meth:`write_checkpoint` stored for ``group``, or None."""
