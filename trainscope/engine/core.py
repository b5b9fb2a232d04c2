"""What every stream job does with its input: validate, window, detect, write, count.

:class:`StreamCore` is the window engine, the detector runner and the sink put together. The
stream jobs are built on it, side by side:

- :class:`~trainscope.engine.embedded_job.EmbeddedStreamJob` is handed records or messages
  in-process (tests, the detector contract check, benchmarks, a Faust worker);
- :class:`~trainscope.engine.bus_job.BusStreamJob` polls a bus consumer group and commits what
  it has checkpointed.

Every stage counts what it received, emitted, dropped and rejected (:class:`PipelineStats`).
How a poll's messages are decoded, validated, de-duplicated, admitted and filed by source is
:mod:`~trainscope.engine.intake`'s (:class:`~trainscope.engine.intake.MessageIntake`, mixed
in); what happens to the records after, here.

Bad input never stops the stream. A message that cannot be decoded, or any of whose records
fails :mod:`trainscope.schemas.validate`, is rejected whole — none of its records reaches the
window engine — and set aside in the dead-letter topic (and table, with a sink) with a one-line
reason that names where it came from (topic[partition]@offset), the record index, the field and
the value. So does a message whose decoding raises anything unexpected.

Jobs are isolated: the window engine keeps each job apart, and the detector runner gives every
job its own detector instances. At most ``max_jobs`` jobs are kept; beyond that the least
recently seen job's open windows are closed and detected, and its state is forgotten
(``PipelineStats.jobs_evicted``).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable
from dataclasses import asdict, dataclass, field
from typing import Any

import pandas as pd

from trainscope.detectors.base import ALERT_THRESHOLD, Detector
from trainscope.detectors.early import EarlyWatch
from trainscope.detectors.registry import DEFAULT_MAX_JOBS, DetectorRunner, load
from trainscope.engine.caps import CapGuard, Caps, Refusal
from trainscope.engine.clocks import DEFAULT_TOLERANCE_S as CLOCK_TOLERANCE_S
from trainscope.engine.clocks import clock_skew_findings
from trainscope.engine.delivery import Backoff, PendingOffsets, SeenBatches
from trainscope.engine.intake import MessageIntake, SourcePart
from trainscope.engine.op_traces import OpTraceIntake
from trainscope.engine.sink import DeadLetterRow, Sink
from trainscope.engine.step_rows import StepRows
from trainscope.engine.windows import WindowEngine
from trainscope.schemas.records import (
    ControlMessage,
    Finding,
    FindingCallPath,
    FunctionSummary,
    MetricBatch,
    MetricSample,
    ProfileCallPaths,
    Record,
    SpanBatch,
    SpanEvent,
    StepBatch,
    StepRecord,
    SummaryBatch,
    Topology,
)
from trainscope.schemas.step_metric import metrics_by_job, steps_by_job
from trainscope.schemas.validate import InvalidRecord, Limits, Validator
from trainscope.schemas.window import STEP_COLUMNS, WindowView
from trainscope.transport.bus import (
    Message,
)

log = logging.getLogger(__name__)

class StoreLost(RuntimeError):
    """The sink's store is no longer the one it opened (deleted, moved, a table or database
    gone): what was written since the last checkpoint may be lost, so nothing may be
    committed from here on. The text names the store and what it lost."""


@dataclass
class StageCounts:
    received: int = 0
    emitted: int = 0
    dropped: int = 0
    rejected: int = 0


@dataclass
class PipelineStats:
    """``decode`` counts bus messages (rejected: undecodable or invalid), ``validate`` records
    (rejected: every record of a rejected message, or an invalid record handed over directly),
    ``window`` events and summaries, ``detect`` windows in and findings out, ``sink`` writes."""

    decode: StageCounts = field(default_factory=StageCounts)
    validate: StageCounts = field(default_factory=StageCounts)
    window: StageCounts = field(default_factory=StageCounts)
    detect: StageCounts = field(default_factory=StageCounts)
    sink: StageCounts = field(default_factory=StageCounts)
    detector_errors: dict[str, int] = field(default_factory=dict)
    jobs_evicted: int = 0
    duplicate_batches: int = 0  # re-sent by a producer; also in decode.dropped
    replayed_events: int = 0  # re-read after a restart for windows already written
    # Step records filed in the window they ended in, the one they started in being written
    # (a step longer than a window and its lateness: a validation pass, a checkpoint save).
    steps_outlasting: int = 0
    sink_retries: int = 0
    commits: int = 0
    checkpoint_bytes: int = 0  # size of the last checkpoint stored (compressed)
    checkpoint_skipped: int = 0  # messages re-read after a restart that its checkpoint held
    commit_failures: int = 0
    poll_failures: int = 0
    # Messages of jobs a run does not watch (``only_jobs``), skipped undecoded; not in decode.
    other_jobs_skipped: int = 0
    profile_parts: int = 0  # call-path trees of on-demand profiles (parts) received
    # Ranks whose clock was found off its peers' and corrected (engine/clocks.py), and records
    # held while estimated that were let go with no estimate (their ranks taken as they are).
    clock_corrections: int = 0
    clock_unestimated: int = 0
    # Valid messages set aside because they would pass a cap of the window engine (caps.py);
    # also in decode.rejected. capped_rows: their summary rows and span events.
    capped_messages: int = 0
    capped_rows: int = 0
    # detect() calls stopped over the time budget per window (--detector-budget-s), per detector.
    detector_over_budget: dict[str, int] = field(default_factory=dict)
    # Findings raised from step records before their window closed (detectors/early.py).
    early_flags: int = 0
    # Producer stamps kept now to drop re-sent batches: those of the open windows' batches.
    stamps_kept: int = 0
    # Ops of what-if op traces (engine/op_traces.py): received in decoded messages, emitted
    # (written), rejected (in messages set aside), dropped (no store, or its write failed);
    # their messages count in decode.
    op_traces: StageCounts = field(default_factory=StageCounts)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class StreamCore(MessageIntake):
    """The work every stream job shares: records in, windows closed, detectors run, results
    written; the jobs differ only in how records reach it and when positions are committed.

    It owns the :class:`WindowEngine`, the :class:`DetectorRunner` (one detector set per job),
    the validator, the dead letters waiting for the sink, the positions of the messages that
    feed open windows (``offsets``), the producer stamps seen (``seen``) and the counters. It
    writes to ``sink`` if given; a failing write is retried with backoff for ``sink_retry_s``
    (``None``: until :meth:`request_stop`'s deadline), then the window is dropped, counted,
    and ``write_failed`` keeps positions from moving past it.

    :meth:`window_source`, :meth:`dead_letter` and :meth:`logs_replaced` are where the jobs
    built on it differ; by default a message's partition is its source, and rejected messages
    and replaced logs need nothing beyond the sink.
    """

    def __init__(
        self,
        detectors: list[Detector] | None = None,
        *,
        window_s: float = 15.0,
        lateness_s: float = 5.0,
        source_idle_s: float = 10.0,
        job_idle_s: float | None = None,
        sink: Sink | None = None,
        sink_retry_s: float | None = 0.0,
        on_window: Callable[[WindowView, list[Finding]], None] | None = None,
        on_profile: Callable[[list[ProfileCallPaths]], None] | None = None,
        on_early: Callable[[WindowView, list[Finding]], None] | None = None,
        limits: Limits | None = None,
        max_jobs: int = DEFAULT_MAX_JOBS,
        clock: Callable[[], float] = time.monotonic,
        only_jobs: frozenset[str] | None = None,
        caps: Caps | None = None,
        detector_budget_s: float | None = None,
    ) -> None:
        if detectors is None:
            loaded = load()
            detectors = loaded.detectors
            for name, error in loaded.errors.items():
                log.warning("detector %s not loaded: %s", name, error)
        self.engine = WindowEngine(
            window_s=window_s, allowed_lateness_s=lateness_s, source_idle_s=source_idle_s,
            clock=clock, clock_tolerance_s=CLOCK_TOLERANCE_S,
        )
        self.runner = DetectorRunner(detectors, max_jobs=max_jobs)
        # Stragglers flagged from step records between windows (detectors/early.py).
        self.early = EarlyWatch(self.engine.window_ns)
        self.on_early = on_early
        self.validator = Validator(limits)
        # Bounded work per job: caps on what a window may hold (caps.py), and a time budget
        # for each detector on each window (None: none; see DetectorRunner.run).
        self.caps = CapGuard(caps or Caps(), self.engine.window_ns, self.engine.closed_before)
        self.detector_budget_s = detector_budget_s
        self._capped: dict[str, dict[int, list[int]]] = {}  # per job, per rank: to report
        self.max_jobs = max_jobs
        # A run that watches some jobs of a shared bus (the demo) skips the others' messages by
        # their key (job/rank), before decoding; their positions still count as handled.
        self._only_jobs = (
            None if only_jobs is None else frozenset(job.encode() for job in only_jobs)
        )
        self._jobs: OrderedDict[str, None] = OrderedDict()  # least recently seen first
        self._dead_letters: list[DeadLetterRow] = []
        self.sink = sink
        self.sink_retry_s = sink_retry_s
        self.job_idle_s = job_idle_s
        self.on_window = on_window
        self.on_profile = on_profile
        self._profile_parts = ProfileParts()
        self.findings: list[Finding] = []
        self.windows = 0
        self.offsets = PendingOffsets()
        self.seen = SeenBatches()
        self.write_failed = False  # a window was dropped: positions must not move past it
        self._stop_deadline: float | None = None
        self._stats = PipelineStats()
        self._op_traces = OpTraceIntake(self._stats.op_traces)

    # -- input ------------------------------------------------------------------------------

    def _cap_refused(self, message: Message, refusal: Refusal) -> None:
        """A valid message over a cap: counted, dead-lettered with the reason, and reported
        with the job's next closed window (:meth:`_cap_findings`)."""
        self._stats.capped_messages += 1
        self._stats.capped_rows += refusal.rows
        counts = self._capped.setdefault(refusal.job_id, {}).setdefault(
            refusal.rank, [0, 0, 0, 0])
        counts[0] += 1
        counts[1] += refusal.rows
        counts[2] += refusal.new_functions
        counts[3] = refusal.window_start_ns  # where to report it if no window of the job closes
        self._reject(message, f"over a cap: {refusal.reason}")

    def _report_capped(self) -> None:
        """Report refusals of jobs with no window open, whose report no closed window would
        carry (every message of the job was refused): as findings of the refused window alone,
        written without rows and without running the detectors on it."""
        for job_id in [j for j in self._capped if not self.caps.has_open(j)]:
            start_ns = max(counts[3] for counts in self._capped[job_id].values())
            view = WindowView(job_id, start_ns, start_ns + self.engine.window_ns)
            findings = self._cap_findings(view)
            self._stats.detect.emitted += len(findings)
            self.findings.extend(findings)
            sink = self.sink
            if sink is not None:
                self._write(lambda v=view, f=findings, sink=sink: sink.write_window(v, f))
            if self.on_window is not None:
                self.on_window(view, findings)

    def _cap_findings(self, view: WindowView) -> list[Finding]:
        """One ``cardinality`` finding per rank whose messages were set aside over a cap since
        the job's last closed window. At the alert threshold: the job's telemetry is being
        dropped, which its owner must hear of (the auto-profiler leaves it alone)."""
        capped = self._capped.pop(view.job_id, {})
        return [
            Finding(
                job_id=view.job_id, window_start_ns=view.window_start_ns,
                window_end_ns=view.window_end_ns, detector="window-engine", rank=rank,
                category="cardinality", score=ALERT_THRESHOLD,
                evidence={"messages": messages, "rows": rows, "new_functions": functions},
                message=(f"cardinality: rank {rank} sent more than the stream job's caps allow "
                         f"(distinct functions per window, open windows): {messages} "
                         f"message(s), {rows} row(s), {functions} new function name(s) set "
                         "aside as dead letters"),
            )
            for rank, (messages, rows, functions, _) in sorted(capped.items())
        ]

    def _ingest_sources(self, by_source: dict[Hashable, SourcePart], rows: StepRows) -> None:
        """Window a poll's accepted messages, source by source, then check the early flags."""
        with self.engine.one_poll():
            for source, part in by_source.items():
                self._ingest_source(source, part, rows)
        if by_source:
            self._flag_early()

    def _ingest_source(self, source: Hashable, part: SourcePart, rows: StepRows) -> None:
        records = [r for _, message_records in part.messages for r in message_records]
        records += [rows.take(job_id, [j for _, j in entries])
                    for job_id, entries in part.steps.items()]
        failed = self._ingest(records, source, flag_early=False)
        if not failed:
            return
        # Validated records should never make the engine raise. If they do, every message
        # of this poll with records of that job is set aside, loudly; other jobs go on.
        set_aside = [(message, next((r.job_id for r in message_records if r.job_id in failed),
                                    None)) for message, message_records in part.messages]
        set_aside += [(message, job_id) for job_id, entries in part.steps.items()
                      if job_id in failed for message, _ in entries]
        for message, job_id in set_aside:
            if job_id is not None:
                exc = failed[job_id]
                self._stats.decode.emitted -= 1
                self._reject(message, f"window engine raised {type(exc).__name__}: {exc} "
                                      f"on job {job_id!r} (its records of this poll may be "
                                      "partly windowed)")

    def _validate(self, messages: list[list[Record]]) -> list[str | None]:
        """Per message, ``None`` or why it is rejected; a check that raises rejects only the
        message it was checking."""
        try:
            return [None if e is None else str(e) for e in self.validator.validate_many(messages)]
        except Exception:
            log.exception("validation raised; checking the poll's messages one by one")
        errors: list[str | None] = []
        for records in messages:
            try:
                self.validator.validate(records)
            except InvalidRecord as exc:
                errors.append(str(exc))
            except Exception as exc:
                errors.append(f"validation raised {type(exc).__name__}: {exc}")
            else:
                errors.append(None)
        return errors

    def _ingest(self, records: list[Record], source: Hashable = 0, *, flag_early: bool = True
                ) -> dict[str, Exception]:
        """Route validated records to the window engine, job by job. Returns the jobs whose
        records made the engine raise, so that only their messages are set aside.
        ``flag_early=False``: the caller checks the early flags once it has ingested the
        poll's other sources too."""
        by_job: dict[str, list[Record]] = {}
        for record in records:
            if isinstance(record, ControlMessage | Finding | FindingCallPath):
                continue  # addressed to producers / produced by another pipeline
            if isinstance(record, ProfileCallPaths):
                self._profile(record)
                continue
            by_job.setdefault(record.job_id, []).append(record)
        self._touch(by_job)
        failed: dict[str, Exception] = {}
        for job_id, job_records in by_job.items():
            try:
                self._ingest_job(job_records, source)
            except Exception as exc:  # validated records should never get here
                log.exception("window engine raised on job %s", job_id)
                failed[job_id] = exc
        if flag_early:
            self._flag_early()
        return failed

    def _flag_early(self) -> None:
        """Findings the step records already support: stored and handed to ``on_early`` now,
        not at the window's close."""
        try:
            findings = self.early.check()
        except Exception:  # an extra: the windows' detectors still run
            log.exception("the early flag failed")
            return
        if not findings:
            return
        self._stats.early_flags += len(findings)
        self.findings.extend(findings)
        sink = self.sink
        if sink is not None:
            self._write(lambda: sink.write_findings(findings))
        if self.on_early is None:
            return
        by_job: dict[str, list[Finding]] = {}
        for finding in findings:
            by_job.setdefault(finding.job_id, []).append(finding)
        for job_id, flagged in by_job.items():
            # What the flag's consumers (alerts, the profiling loop) need of a window: the
            # job's layout and its ranks, not yet its summaries.
            view = WindowView(
                job_id=job_id, window_start_ns=flagged[0].window_start_ns,
                window_end_ns=flagged[0].window_end_ns,
                steps=pd.DataFrame({c: self.early.ranks(job_id) if c == "rank" else 0
                                    for c in STEP_COLUMNS}),
                topology=self.engine.topology(job_id),
            )
            try:
                self.on_early(view, flagged)
            except Exception:
                log.exception("on_early raised on job %s", job_id)

    def _profile(self, record: ProfileCallPaths) -> None:
        """A part of a rank's on-demand profile (its call-path tree). Once every part of the
        session is here, the tree is stored (``call_paths``) and handed to ``on_profile`` (the
        automatic profiling loop). Not windowed: the session's summaries travel as ordinary
        summaries."""
        self._stats.profile_parts += 1
        parts = self._profile_parts.add(record)
        if parts is None:
            return
        sink = self.sink
        if sink is not None:
            self._write(lambda: sink.write_profile(parts))
        if self.on_profile is not None:
            try:
                self.on_profile(parts)
            except Exception:  # the loop is an extra; the stream goes on without it
                log.exception("on_profile raised on a profile of job %s rank %d",
                              record.job_id, record.rank)

    def _ingest_job(self, records: list[Record], source: Hashable) -> None:
        spans: list[SpanBatch] = []
        summaries: list[SummaryBatch | FunctionSummary] = []
        steps: list[StepRecord | StepBatch] = []
        metrics: list[MetricSample | MetricBatch] = []
        events: list[SpanEvent] = []
        for record in records:
            if isinstance(record, SpanBatch):
                spans.append(record)
            elif isinstance(record, StepRecord | StepBatch):
                steps.append(record)
            elif isinstance(record, MetricSample | MetricBatch):
                metrics.append(record)
            elif isinstance(record, SummaryBatch | FunctionSummary):
                summaries.append(record)
            elif isinstance(record, SpanEvent):
                events.append(record)
            elif isinstance(record, Topology):
                self.engine.add_topology(record)
                sink = self.sink
                if sink is not None:
                    self._write(lambda r=record, sink=sink: sink.write_topology(r))
        if events:
            spans.append(SpanBatch.from_events(events))
        # One batch of each for the poll (rows packed, batches joined): from here on, step
        # records and metric samples are windowed column by column.
        step_batches = list(steps_by_job(steps).values())
        metric_batches = list(metrics_by_job(metrics).values())
        self._stats.window.received += (
            sum(len(b) for b in spans)
            + sum(len(s) if isinstance(s, SummaryBatch) else 1 for s in summaries)
            + sum(len(b) for b in step_batches)
            + sum(len(b) for b in metric_batches)
        )
        # Steps first: they tell each rank's clock offset, which the other records need.
        if step_batches:
            self.engine.add_steps(step_batches, source)
            self.early.add(step_batches)
        if spans:
            self.engine.add_spans(spans, source)
        if summaries:
            self.engine.add_summaries(summaries, source)
        if metric_batches:
            self.engine.add_metrics(metric_batches, source)
            self.early.add_metrics(metric_batches)

    def _touch(self, jobs: Collection[str]) -> None:
        """Mark ``jobs`` as seen; evict the least recently seen others beyond ``max_jobs``."""
        for job_id in jobs:
            if job_id in self._jobs:
                self._jobs.move_to_end(job_id)
            else:
                self._jobs[job_id] = None
        excess = len(self._jobs) - self.max_jobs
        if excess <= 0:
            return
        # A job of the records at hand is never evicted before they are windowed.
        for job_id in [j for j in self._jobs if j not in jobs][:excess]:
            self._evict(job_id)

    def _evict(self, job_id: str) -> None:
        del self._jobs[job_id]
        self._handle(self.engine.evict_job(job_id))
        self.runner.forget(job_id)
        self.early.forget(job_id)
        self.validator.forget(job_id)
        self.caps.forget(job_id)
        self.seen.forget_job(job_id)
        self._capped.pop(job_id, None)
        self._stats.jobs_evicted += 1
        # A flood of job ids must not flood the log too: the first, then every 1000th.
        level = logging.WARNING if self._stats.jobs_evicted % 1000 == 1 else logging.DEBUG
        log.log(level, "job %s evicted: more than %d jobs (%d evicted so far); its open "
                "windows were closed and its detector state forgotten",
                job_id, self.max_jobs, self._stats.jobs_evicted)

    def _reject(self, message: Message, error: str) -> None:
        self._stats.decode.rejected += 1
        reason = f"{message.topic}[{message.partition}]@{message.offset}: " + " ".join(
            error.split()
        )
        log.warning("rejected message %s; set aside as a dead letter", reason)
        self.dead_letter(message, reason)
        if self.sink is not None:
            self._dead_letters.append(
                (message.topic, message.partition, message.offset, reason, message.value)
            )

    def write_op_traces(self) -> None:
        """The op traces taken so far, one write per job (:mod:`~trainscope.engine.op_traces`);
        before a commit, so that their positions are committed only once they are written."""
        if not self._op_traces:
            return
        counts = self._stats.op_traces
        for job, frame, messages in self._op_traces.validated(self._reject):
            self._stats.decode.emitted += messages
            sink = self.sink
            if sink is None:
                counts.dropped += len(frame)
                continue
            if self._write(lambda sink=sink, job=job, frame=frame: sink.write_op_trace(job, frame)):
                counts.emitted += len(frame)
            else:
                counts.dropped += len(frame)
        self._flush_dead_letters()  # the messages validation set aside

    def _flush_dead_letters(self) -> None:
        """One insert per call rather than per message: a burst of garbage stays cheap."""
        sink = self.sink
        if not self._dead_letters or sink is None:
            self._dead_letters.clear()
            return
        rows, self._dead_letters = self._dead_letters, []
        self._write(lambda: sink.write_dead_letters(rows))

    def window_source(self, message: Message) -> Hashable:
        """The source whose progress ``message`` advances in the window engine: the partition
        it was read from. A job re-keyed through a repartition topic (the Faust app) names the
        partition the producer wrote to instead, where each rank's records are in order."""
        return (message.topic, message.partition)

    def dead_letter(self, message: Message, error: str) -> None:
        """Where rejected messages go besides the sink; the bus-fed job republishes them."""

    def logs_replaced(self, sources: list[tuple[str, int]]) -> None:
        """Partitions whose log the broker probably lost; the bus-fed job re-reads them."""

    # -- output -----------------------------------------------------------------------------

    def _handle(self, views: list[WindowView]) -> None:
        for view in views:
            self.windows += 1
            self._stats.window.emitted += len(view.summaries)
            self._stats.detect.received += 1
            self.caps.closed(view.job_id, view.window_start_ns)
            findings = [*clock_skew_findings(view), *self._cap_findings(view),
                        *self.runner.run(view, budget_s=self.detector_budget_s)]
            self._stats.detect.emitted += len(findings)
            self._stats.detector_errors = dict(self.runner.errors)
            self._stats.detector_over_budget = dict(self.runner.over_budget)
            self.findings.extend(findings)
            sink = self.sink
            if sink is not None:
                self._stats.sink.received += 1
                if self._write(lambda v=view, f=findings, sink=sink: sink.write_window(v, f)):
                    self._stats.sink.emitted += 1
            if self.on_window is not None:
                self.on_window(view, findings)
        if views:  # however they closed: the stamps of batches that fed only closed windows go
            self.seen.forget_closed(self.engine.closed_before)

    def _write(self, action: Callable[[], None]) -> bool:
        """Write, retrying with backoff; False (counted, logged) if it had to give up."""
        backoff = Backoff("sink write", initial_s=0.2, max_s=10.0)
        give_up = (
            None if self.sink_retry_s is None else time.monotonic() + self.sink_retry_s
        )
        while True:
            try:
                action()
            except Exception as exc:
                self._check_store()  # a server that lost its database refuses every write
                delay = backoff.failed(exc)
                deadline = self._stop_deadline if give_up is None else give_up
                if deadline is not None and time.monotonic() + delay > deadline:
                    self._stats.sink.dropped += 1
                    self.write_failed = True
                    log.error("sink write failed, window dropped from the store: %s", exc)
                    return False
                self._stats.sink_retries += 1
                time.sleep(delay)
                continue
            backoff.succeeded()
            return True

    def _check_store(self) -> None:
        """Raise :class:`StoreLost` if the sink says its store was lost. A sink that cannot
        tell (no ``store_lost`` method) or cannot be asked now (an outage) passes."""
        store_lost = getattr(self.sink, "store_lost", None)
        if store_lost is None:
            return
        try:
            reason = store_lost()
        except Exception:
            return  # unreachable is an outage: writes are retried, nothing is committed
        if reason:
            raise StoreLost(reason)

    def close_idle(self) -> None:
        """Close the windows of jobs that stopped sending (``job_idle_s``)."""
        if self.job_idle_s is not None:
            self._handle(self.engine.close_idle(self.job_idle_s))

    def request_stop(self, timeout_s: float = 30.0) -> None:
        """Stop soon: retries give up after ``timeout_s`` (safe to call from a signal handler)."""
        if self._stop_deadline is None:
            self._stop_deadline = time.monotonic() + timeout_s

    @property
    def stopping(self) -> bool:
        return self._stop_deadline is not None

    def drain(self) -> None:
        """Close every open window, detect and write it (the end of the stream); write the op
        traces taken."""
        self._handle(self.engine.close_all())
        self.write_op_traces()

    def stats(self) -> PipelineStats:
        engine = self.engine.stats
        self._stats.clock_corrections = engine.clock_corrections
        self._stats.clock_unestimated = engine.clock_unestimated
        self._stats.window.rejected = engine.rejected
        self._stats.window.dropped = engine.late_events
        self._stats.replayed_events = engine.replayed
        self._stats.steps_outlasting = engine.steps_outlasting
        self._stats.stamps_kept = len(self.seen)
        return self._stats


class ProfileParts:
    """Parts of profile sessions until each session is whole. A producer sends a session's
    parts together, so few are ever open; beyond ``max_open`` sessions the oldest is dropped
    (counted in ``dropped``), and a session cut by a restart is not completed."""

    def __init__(self, max_open: int = 64) -> None:
        self.max_open = max_open
        self._open: OrderedDict[tuple[str, int, str, int], dict[int, ProfileCallPaths]] = (
            OrderedDict()
        )
        self.dropped = 0

    def add(self, record: ProfileCallPaths) -> list[ProfileCallPaths] | None:
        """The whole session once ``record`` completes it, else None."""
        if record.parts == 1:
            return [record]
        key = (record.job_id, record.rank, record.request_id, record.started_ns)
        got = self._open.setdefault(key, {})
        got[record.part] = record
        if len(got) == record.parts:
            del self._open[key]
            return [got[i] for i in range(record.parts)]
        while len(self._open) > self.max_open:
            self._open.popitem(last=False)
            self.dropped += 1
        return None

