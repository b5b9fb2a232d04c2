"""The agent loop: run every collector this host supports, condense per window, publish.

- Windows are the epoch grid every producer and the stream job share: multiples of
  ``window_s`` since the Unix epoch, as the in-process recorder of ``attach()`` cuts them
  (:func:`~trainscope.schemas.recorder.window_start_of`), not spans counted from the agent's
  start. So one interval's GPU readings, the agent's function summaries and the training
  process's own summaries meet in one window of the stream job. The loop wakes on the grid of
  ``interval_s`` and at every window boundary; a window's summaries carry its bounds and its
  condensed readings its end (the engine files a reading by the instant before its stamp).
- Each collector is started once; one that cannot run is reported once, with its reason, and
  the agent goes on with the others. A collector that raises while collecting is counted and
  retried; after ``max_consecutive_failures`` in a row it is stopped and reported.
- Memory is bounded: the window aggregator keeps at most ``max_series`` series (readings of
  further series are dropped and counted in ``readings_dropped``), and what waits for the bus
  is held by the transport layer's :class:`~trainscope.transport.outbox.Outbox`, at most
  ``queue_size`` records, with its one drop policy (drop the newest) and its counts: "published"
  means acknowledged by the bus, as for ``attach()``.
- ``stop()`` (the CLI calls it on SIGTERM/SIGINT) ends the loop; ``run`` then stops every
  collector (the eBPF one detaches its probes), publishes what was pending and closes the
  outbox, which waits up to ``close_timeout_s`` for the bus's acknowledgements.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from trainscope.config.env import DEFAULT_WINDOW_S
from trainscope.producers.agent.aggregate import WindowAggregator
from trainscope.producers.agent.base import Collector, CollectorStats, CollectorUnavailable
from trainscope.schemas.recorder import window_ns_of, window_start_of
from trainscope.schemas.records import MetricBatch, MetricSample, Record, SummaryBatch
from trainscope.transport.bus import EVENTS_TOPIC, METRICS_TOPIC, Bus, rank_key
from trainscope.transport.outbox import Outbox

log = logging.getLogger("trainscope.agent")

MAX_RECORDS_PER_MESSAGE = 2_000
# A wake-up this long after a grid point, so that a timer firing a little early does not read
# the collectors just before a window boundary and again just after it.
WAKE_SLACK_S = 0.001


@dataclass(frozen=True)
class AgentSettings:
    interval_s: float = 1.0  # how often collectors are read
    window_s: float = DEFAULT_WINDOW_S  # the epoch-grid window condensed records describe
    job_id: str = "unknown"  # for processes and devices whose job is not in their environment
    host: str = field(default_factory=socket.gethostname)
    max_series: int = 50_000
    queue_size: int = 20_000  # condensed records held for the bus at most (outbox capacity)
    close_timeout_s: float = 10.0  # how long shutdown waits for the bus's acknowledgements
    max_consecutive_failures: int = 10

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")
        if self.window_s < self.interval_s:
            raise ValueError(
                f"window_s ({self.window_s}) must be >= interval_s ({self.interval_s})"
            )
        if self.queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {self.queue_size}")


@dataclass
class CollectorState:
    status: str = "not started"  # running | unavailable | failed | stopped
    reason: str = ""
    kind: str = ""
    consecutive_failures: int = 0
    stats: CollectorStats = field(default_factory=CollectorStats)


@dataclass
class AgentStats:
    """The agent's counts. Condensed records, as the outbox counts them for every producer:
    ``records_submitted`` = ``records_published`` (acknowledged by the bus) + ``records_dropped``
    (the queue was full) + ``records_failed`` (not acknowledged when the agent stopped) +
    ``records_queued`` (held now)."""

    intervals: int = 0
    windows: int = 0
    records_submitted: int = 0
    records_published: int = 0
    records_dropped: int = 0
    records_failed: int = 0
    records_queued: int = 0
    messages_published: int = 0  # bus messages acknowledged
    bytes_published: int = 0  # bytes of the messages acknowledged
    publish_errors: int = 0  # failures to reach the bus, publish or flush (each retried)
    readings_dropped: int = 0  # collector records refused by the window's series bound
    collectors: dict[str, CollectorState] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Agent:
    """The host agent: one per GPU host, observing training processes from outside them.

    It owns the collectors it was given (starts each once, isolates and stops a failing one),
    the :class:`WindowAggregator` that condenses their readings per epoch-grid window, the
    :class:`Outbox` that delivers the condensed records to the bus (which stays the caller's to
    close), and the counts in :attr:`stats`. :meth:`run` is its loop, :meth:`stop` ends it.
    """

    def __init__(
        self,
        settings: AgentSettings,
        bus: Bus,
        collectors: list[Collector],
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self.settings = settings
        self.bus = bus
        self.collectors = list(collectors)
        self.clock_ns = clock_ns
        self.window_ns = window_ns_of(settings.window_s)
        self.interval_ns = max(int(settings.interval_s * 1e9), 1)
        self._stats = AgentStats(collectors={c.name: CollectorState() for c in collectors})
        self._running: list[Collector] = []
        self._aggregator = WindowAggregator(settings.max_series)
        self.outbox = Outbox(
            lambda: bus,
            capacity=settings.queue_size,
            batch_records=MAX_RECORDS_PER_MESSAGE,
            flush_interval_s=min(settings.interval_s, 1.0),
            name="trainscope-agent-outbox",
        )
        self._stop = threading.Event()

    @property
    def stats(self) -> AgentStats:
        """The counts, with the outbox's read now (any thread: the /metrics server reads it)."""
        counts = self.outbox.stats()
        stats = self._stats
        stats.records_submitted = counts["submitted"]
        stats.records_published = counts["acked"]
        stats.records_dropped = counts["dropped"]
        stats.records_failed = counts["failed"]
        stats.records_queued = counts["queued"]
        stats.messages_published = counts["messages_acked"]
        stats.bytes_published = counts["bytes_acked"]
        stats.publish_errors = counts["bus_errors"]
        return stats

    # -- life cycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start every collector; report each one that cannot run, once."""
        for collector in self.collectors:
            state = self._stats.collectors[collector.name]
            state.stats = collector.stats
            try:
                collector.start()
            except CollectorUnavailable as exc:
                state.status, state.kind, state.reason = "unavailable", exc.kind, exc.reason
                log.warning(
                    "collector %s not started (%s): %s", collector.name, exc.kind, exc.reason
                )
                continue
            except Exception as exc:  # a bug in one collector must not stop the agent
                state.status, state.kind = "unavailable", "error"
                state.reason = f"{type(exc).__name__}: {exc}"
                log.warning("collector %s failed to start: %s", collector.name, state.reason)
                continue
            state.status = "running"
            self._running.append(collector)
        names = ", ".join(c.name for c in self._running) or "none"
        log.info("collectors running: %s", names)

    def stop(self) -> None:
        """Ask the loop to end (safe from a signal handler or another thread)."""
        self._stop.set()

    def run(self, max_windows: int | None = None) -> AgentStats:
        """Collect and publish until ``stop()`` (or ``max_windows`` windows), then shut down."""
        self.outbox.start()
        window_start_ns = window_start_of(self.clock_ns(), self.window_ns)
        try:
            while not self._stop.wait(self._until_next_wake()):
                now_ns = self.clock_ns()
                self._collect_all(window_start_ns, now_ns)
                current = window_start_of(now_ns, self.window_ns)
                # A boundary passed (or the wall clock was set back): the window is complete.
                if current != window_start_ns:
                    self._publish_window(window_start_ns)
                    window_start_ns = current
                    if max_windows is not None and self._stats.windows >= max_windows:
                        break
        finally:
            self._shutdown(window_start_ns)
        return self.stats

    def _until_next_wake(self) -> float:
        """Seconds to the next point of the interval grid or the window grid, whichever is
        first. Computed from the wall clock each time, so a loop that fell behind (a suspended
        host) skips ahead instead of bursting, and a clock step is followed."""
        now_ns = self.clock_ns()
        wake_ns = min(
            window_start_of(now_ns, self.interval_ns) + self.interval_ns,
            window_start_of(now_ns, self.window_ns) + self.window_ns,
        )
        return (wake_ns - now_ns) / 1e9 + WAKE_SLACK_S

    def _shutdown(self, window_start_ns: int) -> None:
        end_ns = max(self.clock_ns(), window_start_ns + 1)
        for collector in self._running:
            state = self._stats.collectors[collector.name]
            try:
                self._aggregate(collector.stop(window_start_ns, end_ns))
            except Exception as exc:
                log.warning("collector %s failed to stop cleanly: %s", collector.name, exc)
            state.status = "stopped"
        self._running = []
        if len(self._aggregator):
            self._publish_window(window_start_ns)
        # What the bus has not acknowledged by then is counted as failed, never raised.
        self.outbox.close(self.settings.close_timeout_s)

    # -- one interval -------------------------------------------------------------------------
    def _collect_all(self, window_start_ns: int, now_ns: int) -> None:
        self._stats.intervals += 1
        for collector in list(self._running):
            state = self._stats.collectors[collector.name]
            try:
                records = collector.collect(window_start_ns, now_ns)
            except Exception as exc:
                self._collector_failed(collector, state, exc, now_ns)
                continue
            state.consecutive_failures = 0
            self._aggregate(records)

    def _collector_failed(
        self, collector: Collector, state: CollectorState, exc: Exception, now_ns: int
    ) -> None:
        state.consecutive_failures += 1
        collector.stats.errors += 1
        collector.stats.last_error = f"{type(exc).__name__}: {exc}"
        if state.consecutive_failures == 1:
            log.warning("collector %s raised (will retry): %s", collector.name, exc)
        if state.consecutive_failures >= self.settings.max_consecutive_failures:
            state.status, state.reason = "failed", collector.stats.last_error
            log.error(
                "collector %s failed %d times in a row and is stopped: %s",
                collector.name,
                state.consecutive_failures,
                exc,
            )
            self._running.remove(collector)
            try:
                collector.stop(now_ns, now_ns + 1)
            except Exception as stop_exc:
                log.warning("collector %s failed to stop: %s", collector.name, stop_exc)

    def _aggregate(self, records: list[Record]) -> None:
        before = self._aggregator.dropped
        self._aggregator.add(records)
        self._stats.readings_dropped += self._aggregator.dropped - before

    # -- publishing ---------------------------------------------------------------------------
    def _publish_window(self, window_start_ns: int) -> None:
        """Hand the window's condensed records to the outbox, keyed by job and rank (one
        rank's records share a partition); its thread encodes and sends them."""
        window_end_ns = window_start_ns + self.window_ns
        records = self._aggregator.flush(window_start_ns, window_end_ns)
        self._stats.windows += 1
        groups: dict[tuple[str, bytes], list[MetricSample | SummaryBatch]] = {}
        for record in records:
            if isinstance(record, MetricSample):
                topic, rank = METRICS_TOPIC, record.rank
            else:  # the aggregator makes one summary batch per job and rank
                topic, rank = EVENTS_TOPIC, int(record.column("rank")[0])
            groups.setdefault((topic, rank_key(record.job_id, rank)), []).append(record)
        for (topic, key), group in groups.items():
            # A rank's samples as one columnar batch (one job per key): the stream job takes
            # them column by column, not one decoded object each.
            sent = [MetricBatch.from_records(group)] if topic == METRICS_TOPIC else group
            self.outbox.offer_many(sent, key, topic)
        self.outbox.flush_soon()
        log.debug(
            "window %d: [%d, %d) ns, %d records; %s",
            self._stats.windows,
            window_start_ns,
            window_end_ns,
            len(records),
            _delivery(self.outbox.stats()),
        )


def _delivery(counts: dict[str, Any]) -> str:
    return (
        f"{counts['acked']} published (acknowledged), {counts['queued']} queued, "
        f"{counts['dropped']} dropped, {counts['failed']} failed"
    )
