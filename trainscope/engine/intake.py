"""The input half of the stream job: a poll's bus messages decoded, validated, de-duplicated,
admitted against the caps and filed by source, with every message's position kept.

:class:`MessageIntake` is a part of :class:`~trainscope.engine.core.StreamCore` (which mixes it
in and owns the state it works on: the window engine, the caps, the stamps seen, the positions,
the counters); what happens to the records once filed — windowing, closing, detecting, writing
— is the core's.

A poll is taken a part at a time (at most ``POLL_CHUNK_BYTES`` and ``POLL_CHUNK_MESSAGES``),
with Python's cycle collector paused (:mod:`~trainscope.engine.gc_pause`). Messages of one step
record each (nine in ten of a large job's) are taken as columns
(:mod:`~trainscope.engine.step_rows`); the rest message by message, in order.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Hashable
from dataclasses import dataclass, field

from trainscope.engine.gc_pause import collector_paused
from trainscope.engine.step_rows import StepRows, one_step
from trainscope.engine.windows import metric_window
from trainscope.schemas.codec import BadMessage, decode_envelope
from trainscope.schemas.records import (
    FunctionSummary,
    MetricBatch,
    MetricSample,
    Record,
    SpanBatch,
    SpanEvent,
    StepBatch,
    StepRecord,
    SummaryBatch,
    Topology,
)
from trainscope.schemas.topics import OPTRACE_TOPIC
from trainscope.transport.bus import Message

log = logging.getLogger(__name__)

# The most message bytes, and messages, decoded at once (see process_messages). A consumer
# catching up delivers polls of 20,000 messages; parts of a few thousand took a tenth less
# CPU than whole polls (bench_pipeline.py at 10,240 ranks: 1,000 to 8,000 alike).
POLL_CHUNK_BYTES = 16 * 2**20
POLL_CHUNK_MESSAGES = 4096
_FED_NOTHING: dict[str, int] = {}  # the windows of a message set aside (never changed)


@dataclass
class SourcePart:
    """A poll's accepted messages of one source: those taken one by one, with their records,
    and the one-step messages by job, with their index in the poll's StepRows."""

    messages: list[tuple[Message, list[Record]]] = field(default_factory=list)
    steps: dict[str, list[tuple[Message, int]]] = field(default_factory=dict)


class MessageIntake:
    """Decoding, validation, de-duplication, the caps and the positions of a poll's messages
    (the methods :class:`~trainscope.engine.core.StreamCore` takes its input with)."""

    def is_op_trace(self, message: Message) -> bool:
        """Whether the message is a what-if op trace (written, never windowed): read from the
        op-trace topic (a stream engine that re-keys messages says where they came from)."""
        return message.topic == OPTRACE_TOPIC

    def _is_watched(self, message: Message) -> bool:
        if message.key is None:
            return True  # unkeyed: cannot tell, so it is decoded and windowed like any other
        job = message.key.rpartition(b"/")[0]
        return job in self._only_jobs if self._only_jobs is not None else True

    def process_messages(self, messages: list[Message]) -> None:
        """Decode, validate, drop re-sent batches; the valid messages are windowed by source
        (partition), and every message's offset is recorded with the windows it feeds.

        A poll of many large messages is handled a part at a time, as if polled apart: what
        is decoded at once (Python objects, several times the bytes) stays bounded. Python's
        cycle collector is paused meanwhile (:func:`collector_paused`)."""
        with collector_paused():
            for part in _parts(messages, POLL_CHUNK_BYTES, POLL_CHUNK_MESSAGES):
                self._process_part(part)

    def _process_part(self, messages: list[Message]) -> None:
        handled, stamps, rows, lane = self._decode_part(messages)
        fed = self._admit_part(handled, stamps, rows, lane)
        self._ingest_sources(self._by_source(handled, fed, rows, lane), rows)
        if self._op_traces.full():
            self.write_op_traces()
        self._flush_dead_letters()
        self._handle(self.engine.close_ready())
        if self._capped:
            self._report_capped()

    def _decode_part(self, messages: list[Message]) -> tuple[
            list[tuple[Message, list[Record] | None]], dict[int, tuple[int, int, int]],
            StepRows, dict[int, int]]:
        """Each message with its records (None: set aside), its batch's producer id, sequence
        and payload digest (see SeenBatches), and the messages of one step record, taken as
        columns (:mod:`~trainscope.engine.step_rows`; message's place -> its index there).
        A part that declares a topology is taken message by message: the world size it
        declares must count only for the messages after it."""
        handled: list[tuple[Message, list[Record] | None]] = []
        stamps: dict[int, tuple[int, int, int]] = {}
        rows = StepRows()
        lane: dict[int, int] = {}
        declares = False
        stats = self._stats
        watched_only = self._only_jobs is not None
        is_op_trace = self.is_op_trace
        for message in messages:
            if watched_only and not self._is_watched(message):
                stats.other_jobs_skipped += 1
                handled.append((message, None))
                continue
            stats.decode.received += 1
            if is_op_trace(message):  # a what-if op trace: written, never windowed
                refused = self._op_traces.take(message)
                if refused is not None:
                    self._reject(message, refused)
                handled.append((message, None))
                continue
            try:
                batch = decode_envelope(message.value)
            except BadMessage as exc:
                self._reject(message, str(exc))
                handled.append((message, None))
                continue
            except Exception as exc:  # decode raises only BadMessage; never die on input
                self._reject(message, f"decoding raised {type(exc).__name__}: {exc}")
                handled.append((message, None))
                continue
            records = batch.records
            place = len(handled)
            stamp = (batch.producer_id, batch.seq, zlib.crc32(message.value))
            step = one_step(records)
            if step is not None:
                lane[place] = rows.add(step, place, stamp)
            else:
                stamps[place] = stamp
                if not declares:
                    declares = any(type(r) is Topology for r in records)
            handled.append((message, records))
        if declares and lane:
            return self._one_by_one(handled, stamps, rows)
        if lane:
            try:
                rows.seal(self.engine)
            except Exception:  # never on decoded batches; if it does, one by one as before
                log.exception("a poll's one-step messages could not be taken as columns; "
                              "taking them one by one")
                return self._one_by_one(handled, stamps, rows)
        return handled, stamps, rows, lane

    @staticmethod
    def _one_by_one(handled: list[tuple[Message, list[Record] | None]],
                    stamps: dict[int, tuple[int, int, int]], rows: StepRows) -> tuple[
            list[tuple[Message, list[Record] | None]], dict[int, tuple[int, int, int]],
            StepRows, dict[int, int]]:
        """:meth:`_decode_part`'s result with its one-step messages taken one by one."""
        stamps.update(zip(rows.places, rows.stamps, strict=True))
        return handled, stamps, StepRows(), {}

    def _admit_part(self, handled: list[tuple[Message, list[Record] | None]],
                    stamps: dict[int, tuple[int, int, int]], rows: StepRows,
                    lane: dict[int, int]) -> dict[int, dict[str, int]]:
        """Validate, drop re-sent batches, admit against the caps, in message order; returns,
        per message kept, the newest window it feeds per job (``handled`` is updated: None for
        a message set aside)."""
        stats = self._stats
        general = [records for i, (_, records) in enumerate(handled)
                   if records is not None and i not in lane]
        errors = iter(self._validate(general))
        fed: dict[int, dict[str, int]] = {}  # per message kept, the newest window per job
        apart: list[bool] = []
        row_errors: list[str | None] = []
        emitted = 0
        if lane:
            row_errors = rows.errors(self._validate)
            apart, emitted = self._admit_apart(handled, stamps, rows, row_errors, fed)
        resent, keep, admit, admit_row = (self.seen.resent, self.seen.keep, self.caps.admit,
                                          self.caps.admit_row)
        newest_windows = self._newest_windows
        validated = stats.validate
        for i, (message, records) in enumerate(handled):
            if records is None:
                continue
            j = lane.get(i)
            if j is None:
                error = next(errors)
                stamp = stamps[i]
            elif apart[j]:
                continue
            else:
                error, stamp = row_errors[j], rows.stamps[j]
            validated.received += len(records)
            if error is not None:
                validated.rejected += len(records)
                self._reject(message, error)
                handled[i] = (message, None)
                continue
            validated.emitted += len(records)
            if resent(*stamp):
                stats.decode.dropped += 1
                stats.duplicate_batches += 1
                handled[i] = (message, None)
                continue
            refusal = (admit(records) if j is None
                       else admit_row(rows.job_ids[j], rows.raw_window[j], rows.rank[j]))
            if refusal is not None:
                self._cap_refused(message, refusal)
                handled[i] = (message, None)
                continue
            emitted += 1
            if j is None:
                records = _events_as_batches(records)
                handled[i] = (message, records)
                windows = fed[i] = newest_windows(records)
            else:
                windows = fed[i] = {rows.job_ids[j]: rows.newest[j]}
            # Only a batch windowed counts as seen: a copy damaged on the way is dead-lettered
            # and does not shadow the intact re-send, nor does a batch refused over a cap.
            keep(*stamp, windows)
        stats.decode.emitted += emitted
        return fed

    def _admit_apart(self, handled: list[tuple[Message, list[Record] | None]],
                     stamps: dict[int, tuple[int, int, int]], rows: StepRows,
                     errors: list[str | None], fed: dict[int, dict[str, int]]
                     ) -> tuple[list[bool], int]:
        """The one-step messages whose admission does not depend on the poll's order, at once
        (:meth:`StepRows.admit_apart`); returns which were taken so, and how many kept."""
        others = {stamp[:2] for stamp in stamps.values()}
        apart, kept = rows.admit_apart(errors, self.caps, self.seen, others)
        taken = apart.count(True)
        stats = self._stats
        stats.validate.received += taken
        stats.validate.emitted += taken
        stats.decode.dropped += taken - len(kept)
        stats.duplicate_batches += taken - len(kept)
        places = rows.places
        if taken > len(kept):  # re-sends: set aside
            fresh = set(kept)
            for j in range(len(apart)):
                if apart[j] and j not in fresh:
                    handled[places[j]] = (handled[places[j]][0], None)
        job_ids, newest = rows.job_ids, rows.newest
        for j in kept:
            fed[places[j]] = {job_ids[j]: newest[j]}
        return apart, len(kept)

    def _by_source(self, handled: list[tuple[Message, list[Record] | None]],
                   fed: dict[int, dict[str, int]], rows: StepRows, lane: dict[int, int]
                   ) -> dict[Hashable, SourcePart]:
        """Every message's position kept with the windows it feeds; the messages kept, by the
        source they are windowed under (in the order sources first appear)."""
        by_source: dict[Hashable, SourcePart] = {}
        add_offset = self.offsets.add
        for i, (message, records) in enumerate(handled):
            source = (message.topic, message.partition)
            replaced = add_offset(source, message.offset, fed.get(i, _FED_NOTHING))
            if replaced:
                self.logs_replaced(replaced)
            if records is None:
                continue
            part = by_source.get(source := self.window_source(message))
            if part is None:
                part = by_source[source] = SourcePart()
            j = lane.get(i)
            if j is None:
                part.messages.append((message, records))
            else:
                part.steps.setdefault(rows.job_ids[j], []).append((message, j))
        return by_source

    def _newest_windows(self, records: list[Record]) -> dict[str, int]:
        """Per job, the newest window the records can feed (on the job's clock: a rank's
        known clock offset is taken off, see :meth:`WindowEngine.on_job_clock`)."""
        window_ns = self.engine.window_ns
        newest: dict[str, int] = {}
        for record in records:
            kind = type(record)
            if (kind is StepBatch or kind is MetricBatch) and len(record) == 1:
                # A rank's step of a sender round (nine messages in ten), read as one value.
                offset_ns = self.engine.offset_ns(record.job_id, int(record.column("rank")[0]))
                if kind is StepBatch:
                    index = (int(record.column("start_ns")[0]) - offset_ns) // window_ns
                else:
                    index = metric_window(int(record.column("ts_ns")[0]) - offset_ns, window_ns)
                if index > newest.get(record.job_id, -(2**62)):
                    newest[record.job_id] = index
                continue
            if isinstance(record, SpanBatch | StepBatch | MetricBatch | StepRecord | MetricSample
                          | SummaryBatch):
                record = self.engine.on_job_clock(record)
            if isinstance(record, SpanBatch | StepBatch | MetricBatch):
                if not len(record):
                    continue
                if isinstance(record, MetricBatch):
                    index = metric_window(int(record.column("ts_ns").max()), window_ns)
                else:
                    index = int(record.column("start_ns").max()) // window_ns
            elif isinstance(record, StepRecord):
                index = record.start_ns // window_ns
            elif isinstance(record, MetricSample):
                index = metric_window(record.ts_ns, window_ns)
            elif isinstance(record, SummaryBatch | FunctionSummary):
                index = record.window_start_ns // window_ns
            else:
                continue
            if index > newest.get(record.job_id, -(2**62)):
                newest[record.job_id] = index
        return newest


def _parts(messages: list[Message], max_bytes: int, max_messages: int
           ) -> list[list[Message]]:
    """``messages`` in order, cut into parts of at most ``max_bytes`` (or one message) and
    ``max_messages``."""
    parts: list[list[Message]] = [[]]
    size = 0
    for message in messages:
        if parts[-1] and (size + len(message.value) > max_bytes
                          or len(parts[-1]) >= max_messages):
            parts.append([])
            size = 0
        parts[-1].append(message)
        size += len(message.value)
    return parts


def _events_as_batches(records: list[Record]) -> list[Record]:
    """Loose span events of one message become one batch per job: a message is the unit the
    window engine reduces on its own (see :meth:`WindowEngine.add_spans`)."""
    if len(records) == 1 and not isinstance(records[0], SpanEvent):
        return records
    events = [r for r in records if isinstance(r, SpanEvent)]
    if not events:
        return records
    by_job: dict[str, list[SpanEvent]] = {}
    for event in events:
        by_job.setdefault(event.job_id, []).append(event)
    rest: list[Record] = [r for r in records if not isinstance(r, SpanEvent)]
    return rest + [SpanBatch.from_events(e) for e in by_job.values()]
