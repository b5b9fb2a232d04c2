"""Replaying PyTorch profiler (Kineto) traces as a live rank would send them.

Reading and condensing live in :mod:`trainscope.traces` (streaming ingestion of every event
class, call paths); this module turns a condensed trace into the records a rank publishes:
its step records and its function summaries, one or more batches per window.
"""

from __future__ import annotations

from trainscope.traces.condense import Condensed, condense
from trainscope.traces.reader import TRACE_SUFFIXES, KinetoError, Trace, read_trace, trace_files

__all__ = [
    "TRACE_SUFFIXES",
    "Condensed",
    "KinetoError",
    "Trace",
    "condense",
    "read_trace",
    "records_of",
    "trace_files",
]


def records_of(condensed: Condensed) -> list[object]:
    """What a rank publishes for its trace: step records first, then summary batches."""
    return [*condensed.steps, *condensed.summaries]
