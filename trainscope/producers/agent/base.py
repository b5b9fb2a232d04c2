"""The collector contract of the host agent.

A collector is started once, asked for records once per interval, and stopped once. A collector
that cannot run on this host raises :class:`CollectorUnavailable` from ``start`` with a one-line
reason a person can act on; the agent reports it once and carries on with the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from trainscope.schemas.errors import TrainscopeError
from trainscope.schemas.records import Record

# Reasons a collector cannot start (``CollectorUnavailable.kind``).
NO_GPU = "no-gpu"
NO_NVML_LIBRARY = "no-nvml-library"
NO_BCC = "no-bcc"
NO_BPF_PERMISSION = "no-bpf-permission"
NO_KERNEL_HEADERS = "no-kernel-headers"
NO_TRACEFS = "no-tracefs"
LOAD_FAILED = "load-failed"


class CollectorUnavailable(RuntimeError, TrainscopeError):
    """This collector cannot run here; ``kind`` is machine-readable, the text is for people."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


@dataclass
class CollectorStats:
    """What one collector did; exposed by the agent (nothing is lost silently)."""

    samples: int = 0  # records produced (metric samples or function summaries)
    events: int = 0  # raw observations behind them (NVML reads, traced calls)
    dropped: int = 0  # observations lost (full maps, bounded buffers)
    errors: int = 0  # failed collection attempts
    last_error: str = ""
    extra: dict[str, int] = field(default_factory=dict)


@runtime_checkable
class Collector(Protocol):
    name: str
    stats: CollectorStats

    def start(self) -> None:
        """Acquire resources; raise :class:`CollectorUnavailable` when this host cannot run it."""
        ...

    def collect(self, window_start_ns: int, window_end_ns: int) -> list[Record]:
        """Records for the interval that just ended."""
        ...

    def stop(self, window_start_ns: int, window_end_ns: int) -> list[Record]:
        """Release resources (detach probes) and return what was still pending."""
        ...
