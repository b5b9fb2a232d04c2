"""The agent loop: run every collector this host supports, condense per window, publish.

- Each collector is started once; one that cannot run is reported once, with its reason, and
  the agent goes on with the others. A collector that raises while collecting is counted and
  retried; after ``max_consecutive_failures`` in a row it is stopped and reported.
- Memory is bounded: the window aggregator keeps at most ``max_series`` series, and at most
  ``max_backlog_messages`` messages wait for a bus that refuses them; beyond that we drop the
  oldest and count it.
- ``stop()`` (the CLI calls it on SIGTERM/SIGINT) ends the loop; ``run`` then stops every
  collector (the eBPF one detaches its probes), publishes what was pending and flushes the bus.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from trainscope.config.env import DEFAULT_WINDOW_S
from trainscope.producers.agent.aggregate import WindowAggregator
from trainscope.producers.agent.base import Collector, CollectorStats, CollectorUnavailable
from trainscope.schemas.codec import encode_batch
from trainscope.schemas.records import MetricSample, Record, SummaryBatch
from trainscope.transport.bus import EVENTS_TOPIC, METRICS_TOPIC, Bus, rank_key

log = logging.getLogger("trainscope.agent")

MAX_RECORDS_PER_MESSAGE = 2_000


@dataclass(frozen=True)
class AgentSettings:
    interval_s: float = 1.0  # how often collectors are read
    window_s: float = DEFAULT_WINDOW_S  # how often condensed records are published
    job_id: str = "unknown"  # for processes and devices whose job is not in their environment
    host: str = field(default_factory=socket.gethostname)
    max_series: int = 50_000
    max_backlog_messages: int = 1_000
    max_consecutive_failures: int = 10

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")
        if self.window_s < self.interval_s:
            raise ValueError(
                f"window_s ({self.window_s}) must be >= interval_s ({self.interval_s})"
            )


@dataclass
class CollectorState:
    status: str = "not started"  # running | unavailable | failed | stopped
    reason: str = ""
    kind: str = ""
    consecutive_failures: int = 0
    stats: CollectorStats = field(default_factory=CollectorStats)


@dataclass
class AgentStats:
    intervals: int = 0
    windows: int = 0
    records_published: int = 0
    messages_published: int = 0
    bytes_published: int = 0
    publish_errors: int = 0
    dropped_records: int = 0
    collectors: dict[str, CollectorState] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Agent:
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
        self.stats = AgentStats(collectors={c.name: CollectorState() for c in collectors})
        self._running: list[Collector] = []
        self._aggregator = WindowAggregator(settings.max_series)
        self._backlog: deque[tuple[str, bytes | None, bytes, int]] = deque()
        self._stop = threading.Event()

    # -- life cycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start every collector; report each one that cannot run, once."""
        for collector in self.collectors:
            state = self.stats.collectors[collector.name]
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
        interval_s, window_s = self.settings.interval_s, self.settings.window_s
        window_start_ns = self.clock_ns()
        next_tick = time.monotonic() + interval_s
        window_due = time.monotonic() + window_s
        try:
            while not self._stop.wait(max(0.0, next_tick - time.monotonic())):
                next_tick += interval_s
                now_ns = self.clock_ns()
                self._collect_all(window_start_ns, now_ns)
                if time.monotonic() >= window_due - 1e-3:
                    self._publish_window(window_start_ns, now_ns)
                    window_start_ns, window_due = now_ns, window_due + window_s
                    if max_windows is not None and self.stats.windows >= max_windows:
                        break
                if next_tick < time.monotonic():  # fell behind (suspended?): do not burst
                    next_tick = time.monotonic() + interval_s
        finally:
            self._shutdown(window_start_ns)
        return self.stats

    def _shutdown(self, window_start_ns: int) -> None:
        end_ns = max(self.clock_ns(), window_start_ns + 1)
        for collector in self._running:
            state = self.stats.collectors[collector.name]
            try:
                self._aggregate(collector.stop(window_start_ns, end_ns))
            except Exception as exc:
                log.warning("collector %s failed to stop cleanly: %s", collector.name, exc)
            state.status = "stopped"
        self._running = []
        if len(self._aggregator):
            self._publish_window(window_start_ns, end_ns)
        try:
            self._drain_backlog()
            self.bus.flush()
        except Exception as exc:
            self.stats.publish_errors += 1
            log.warning("bus flush at shutdown failed: %s", exc)
        # Nothing will send what is still waiting: count it as dropped.
        self.stats.dropped_records += sum(records for *_, records in self._backlog)
        self._backlog.clear()

    # -- one interval -------------------------------------------------------------------------
    def _collect_all(self, window_start_ns: int, now_ns: int) -> None:
        self.stats.intervals += 1
        for collector in list(self._running):
            state = self.stats.collectors[collector.name]
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
        self.stats.dropped_records += self._aggregator.dropped - before

    # -- publishing ---------------------------------------------------------------------------
    def _publish_window(self, window_start_ns: int, window_end_ns: int) -> None:
        records = self._aggregator.flush(window_start_ns, max(window_end_ns, window_start_ns + 1))
        self.stats.windows += 1
        groups: dict[tuple[str, bytes], list[MetricSample | SummaryBatch]] = {}
        for record in records:
            if isinstance(record, MetricSample):
                topic, rank = METRICS_TOPIC, record.rank
            else:  # the aggregator makes one summary batch per job and rank
                topic, rank = EVENTS_TOPIC, int(record.column("rank")[0])
            groups.setdefault((topic, rank_key(record.job_id, rank)), []).append(record)
        for (topic, key), group in groups.items():
            for i in range(0, len(group), MAX_RECORDS_PER_MESSAGE):
                chunk = group[i : i + MAX_RECORDS_PER_MESSAGE]
                self._enqueue(topic, key, encode_batch(chunk), len(chunk))
        self._drain_backlog()
        log.debug(
            "window %d: %d records, %d messages waiting",
            self.stats.windows,
            len(records),
            len(self._backlog),
        )

    def _enqueue(self, topic: str, key: bytes | None, payload: bytes, records: int) -> None:
        if len(self._backlog) >= self.settings.max_backlog_messages:
            _, _, _, lost = self._backlog.popleft()
            self.stats.dropped_records += lost
        self._backlog.append((topic, key, payload, records))

    def _drain_backlog(self) -> None:
        while self._backlog:
            topic, key, payload, records = self._backlog[0]
            try:
                self.bus.publish(topic, payload, key=key)
            except Exception as exc:
                self.stats.publish_errors += 1
                if self.stats.publish_errors == 1:
                    log.warning("bus refused a message (kept for the next window): %s", exc)
                return
            self._backlog.popleft()
            self.stats.messages_published += 1
            self.stats.records_published += records
            self.stats.bytes_published += len(payload)
