"""The embedded stream job: records → windows → detectors → sink, in one process.

:class:`EmbeddedPipeline` takes records directly (the demo on the in-memory path, tests);
:class:`Pipeline` consumes them from a bus (in-memory or Kafka). Every stage counts what it
received, emitted, dropped and rejected; a message that cannot be decoded is set aside in the
dead-letter topic (and table, with a sink) and the stream goes on.

Delivery: consumer positions are committed once the windows their records fed have been closed
and written, so a restart re-reads what was not yet written; the sink deduplicates re-sent rows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from trainscope.detectors.base import Detector
from trainscope.detectors.registry import DetectorRunner, load
from trainscope.schemas.codec import BadMessage, decode_batch
from trainscope.schemas.records import (
    ControlMessage,
    Finding,
    FunctionSummary,
    MetricSample,
    Record,
    SpanBatch,
    SpanEvent,
    StepRecord,
    Topology,
)
from trainscope.schemas.window import WindowView
from trainscope.streams.bus import DEAD_LETTER_TOPIC, EVENTS_TOPIC, METRICS_TOPIC, Bus, Message
from trainscope.streams.windows import WindowEngine

log = logging.getLogger(__name__)


@dataclass
class StageCounts:
    received: int = 0
    emitted: int = 0
    dropped: int = 0
    rejected: int = 0


@dataclass
class PipelineStats:
    decode: StageCounts = field(default_factory=StageCounts)
    window: StageCounts = field(default_factory=StageCounts)
    detect: StageCounts = field(default_factory=StageCounts)
    sink: StageCounts = field(default_factory=StageCounts)
    detector_errors: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class EmbeddedPipeline:
    def __init__(
        self,
        detectors: list[Detector] | None = None,
        *,
        window_s: float = 15.0,
        lateness_s: float = 5.0,
        sink: Any | None = None,
        on_window: Callable[[WindowView, list[Finding]], None] | None = None,
    ) -> None:
        if detectors is None:
            loaded = load()
            detectors = loaded.detectors
            for name, error in loaded.errors.items():
                log.warning("detector %s not loaded: %s", name, error)
        self.engine = WindowEngine(window_s=window_s, allowed_lateness_s=lateness_s)
        self.runner = DetectorRunner(detectors)
        self.sink = sink
        self.on_window = on_window
        self.findings: list[Finding] = []
        self.windows = 0
        self._stats = PipelineStats()

    # -- input ------------------------------------------------------------------------------

    def process_records(self, records: Iterable[Record]) -> None:
        spans: list[SpanBatch] = []
        summaries: list[FunctionSummary] = []
        steps: list[StepRecord] = []
        metrics: list[MetricSample] = []
        events: list[SpanEvent] = []
        for record in records:
            if isinstance(record, SpanBatch):
                spans.append(record)
            elif isinstance(record, StepRecord):
                steps.append(record)
            elif isinstance(record, MetricSample):
                metrics.append(record)
            elif isinstance(record, FunctionSummary):
                summaries.append(record)
            elif isinstance(record, SpanEvent):
                events.append(record)
            elif isinstance(record, Topology):
                self.engine.add_topology(record)
                if self.sink is not None:
                    self._write(lambda r=record: self.sink.write_topology(r))
            elif isinstance(record, ControlMessage | Finding):
                pass  # addressed to producers / produced by another pipeline
        if events:
            for job_events in _by_job(events).values():
                spans.append(SpanBatch.from_events(job_events))
        self._stats.window.received += (
            sum(len(b) for b in spans) + len(summaries) + len(steps) + len(metrics)
        )
        if spans:
            self.engine.add_spans(spans)
        if summaries:
            self.engine.add_summaries(summaries)
        if steps:
            self.engine.add_steps(steps)
        if metrics:
            self.engine.add_metrics(metrics)
        self._handle(self.engine.close_ready())

    def process_messages(self, messages: list[Message]) -> None:
        records: list[Record] = []
        for message in messages:
            self._stats.decode.received += 1
            try:
                decoded = decode_batch(message.value)
            except BadMessage as exc:
                self._reject(message, str(exc))
                continue
            self._stats.decode.emitted += 1
            records.extend(decoded)
        self.process_records(records)

    def _reject(self, message: Message, error: str) -> None:
        self._stats.decode.rejected += 1
        log.warning(
            "rejected message %s[%d]@%d: %s; set aside as a dead letter",
            message.topic, message.partition, message.offset, error,
        )
        self.dead_letter(message, error)
        if self.sink is not None:
            self._write(
                lambda: self.sink.write_dead_letter(
                    message.topic, message.partition, message.offset, error, message.value
                )
            )

    def dead_letter(self, message: Message, error: str) -> None:
        """Where rejected messages go besides the sink; the bus pipeline republishes them."""

    # -- output -----------------------------------------------------------------------------

    def _handle(self, views: list[WindowView]) -> None:
        for view in views:
            self.windows += 1
            self._stats.window.emitted += len(view.summaries)
            self._stats.detect.received += 1
            findings = self.runner.run(view)
            self._stats.detect.emitted += len(findings)
            self._stats.detector_errors = dict(self.runner.errors)
            self.findings.extend(findings)
            if self.sink is not None:
                self._stats.sink.received += 1
                if self._write(lambda v=view, f=findings: self.sink.write_window(v, f)):
                    self._stats.sink.emitted += 1
            if self.on_window is not None:
                self.on_window(view, findings)

    def _write(self, action: Callable[[], None]) -> bool:
        try:
            action()
        except Exception as exc:
            self._stats.sink.dropped += 1
            log.error("sink write failed, window dropped from the store: %s", exc)
            return False
        return True

    def finish(self) -> None:
        """End of stream: close and process every open window."""
        self._handle(self.engine.close_all())

    def stats(self) -> PipelineStats:
        engine = self.engine.stats
        self._stats.window.rejected = engine.rejected
        self._stats.window.dropped = engine.late_events
        return self._stats


class Pipeline(EmbeddedPipeline):
    """An EmbeddedPipeline fed by a bus consumer group."""

    def __init__(
        self,
        bus: Bus,
        *,
        group: str = "trainscope-pipeline",
        topics: tuple[str, ...] = (EVENTS_TOPIC, METRICS_TOPIC),
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.bus = bus
        self.consumer = bus.consumer(list(topics), group)
        self.messages = 0

    def dead_letter(self, message: Message, error: str) -> None:
        try:
            self.bus.publish(DEAD_LETTER_TOPIC, message.value, key=error.encode()[:200])
        except Exception as exc:  # the dead-letter topic is best effort; the count is not
            log.warning("could not publish dead letter: %s", exc)

    def poll_once(self, timeout_s: float = 0.2, max_records: int = 20_000) -> int:
        messages = self.consumer.poll(max_records=max_records, timeout_s=timeout_s)
        if messages:
            self.messages += len(messages)
            self.process_messages(messages)
            if self.engine.open_windows() == 0:
                self.consumer.commit()
        return len(messages)

    def run(
        self,
        idle_timeout_s: float = 5.0,
        until: Callable[[], bool] | None = None,
        max_seconds: float | None = None,
    ) -> None:
        """Consume until ``until()`` holds and the bus is idle, or ``idle_timeout_s`` passes
        with nothing new, or ``max_seconds`` elapse."""
        started = idle_since = time.monotonic()
        while True:
            now = time.monotonic()
            if self.poll_once():
                idle_since = now
            elif until() if until is not None else now - idle_since >= idle_timeout_s:
                return
            if max_seconds is not None and now - started >= max_seconds:
                return

    def finish(self) -> None:
        super().finish()
        self.consumer.commit()


def _by_job(events: list[SpanEvent]) -> dict[str, list[SpanEvent]]:
    out: dict[str, list[SpanEvent]] = {}
    for event in events:
        out.setdefault(event.job_id, []).append(event)
    return out
