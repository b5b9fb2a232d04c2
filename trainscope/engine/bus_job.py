"""The stream job fed by a bus consumer group: polls, commits, checkpoints, restarts.

:class:`BusStreamJob` is what ``trainscope pipeline`` and the demo run. It is built on
:class:`~trainscope.engine.core.StreamCore`, beside the in-process
:class:`~trainscope.engine.embedded_job.EmbeddedStreamJob`.

Delivery (see :mod:`trainscope.engine.delivery` and :mod:`trainscope.engine.checkpoint`):
with each commit the pipeline stores a checkpoint in the store — its open windows as received,
which windows are written, its detectors' state — and then commits the positions it covers, so
a restart re-reads only what arrived since the last commit and carries on with the same windows
and detectors. Where no open-window snapshot can be stored, the committed position per partition
is the earliest message still feeding a window that is open or not yet written, and a restart
rebuilds those windows in full. Either way a window is written once, from all of its input:
windows are deterministic functions of their input, so a window rebuilt after a crash gives
byte-identical rows, which the store's insert deduplication drops. A failed sink write is
retried with backoff and never committed past. Batches a producer re-sent are dropped and
counted.

On :meth:`BusStreamJob.request_stop` (SIGTERM) the open windows are checkpointed, not closed,
and a restarted job finishes them; :meth:`BusStreamJob.finish` with ``drain=True`` closes and
writes them instead (the end of the stream).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from trainscope.engine.checkpoint import (
    DEFAULT_MAX_OPEN_BYTES,
    Checkpoint,
    ExtraState,
    ResumeFilter,
    decode,
    encode,
)
from trainscope.engine.core import PipelineStats, StreamCore
from trainscope.engine.delivery import Backoff, Source
from trainscope.schemas.topics import SUMMARIES_TOPIC
from trainscope.schemas.untrusted import bounded_payload
from trainscope.transport.bus import (
    DEAD_LETTER_TOPIC,
    EVENTS_TOPIC,
    METRICS_TOPIC,
    Bus,
    BusError,
    GroupHeldElsewhere,
    Message,
)

log = logging.getLogger(__name__)

# The Kafka client retries some commit failures internally until the call times out; polling
# waits meanwhile, so a commit may not hold the loop for long. It is retried at the next interval.
COMMIT_TIMEOUT_S = 3.0


# What the pipeline reads, by deployment: the producers' events (it windows them itself), or the
# window summaries and step records a windowing tier (the PyFlink job,
# trainscope.engines.flink) computed from them; metrics come from the producers either way.
INPUT_TOPICS: dict[str, tuple[str, ...]] = {
    "events": (EVENTS_TOPIC, METRICS_TOPIC),
    "summaries": (SUMMARIES_TOPIC, METRICS_TOPIC),
}


def summaries_lateness_s(window_s: float, lateness_s: float) -> float:
    """Lateness for the ``summaries`` input: the windowing tier may emit a window's rows in two
    parts one of its windows apart (see trainscope.engines.flink.sql), so a window waits until
    rows of the window after next arrive."""
    return max(lateness_s, window_s)


class SinkUnavailable(RuntimeError):
    """The sink kept failing until the pipeline had to stop; nothing past it was committed."""


class BusStreamJob(StreamCore):
    """A :class:`StreamCore` fed by a bus consumer group, committing what it has checkpointed.

    Sink writes are retried until they succeed (or the stop deadline passes); bus failures are
    logged once and retried, never raised: a stream job outlives a broker outage.
    ``max_open_bytes``: the largest open-window snapshot stored with a checkpoint (compressed);
    0 never stores one (restarts then re-read the open windows).
    ``extra_state``: state of hooks outside the engine (the Alertmanager notifier's), by name,
    stored with each checkpoint and restored from it (:class:`ExtraState`).
    """

    def __init__(
        self,
        bus: Bus,
        *,
        group: str = "trainscope-pipeline",
        topics: tuple[str, ...] = (EVENTS_TOPIC, METRICS_TOPIC),
        commit_interval_s: float = 5.0,
        job_idle_s: float | None = 30.0,
        sink_retry_s: float | None = None,
        stats_every_s: float | None = None,
        on_stats: Callable[[PipelineStats], None] | None = None,
        max_open_bytes: int = DEFAULT_MAX_OPEN_BYTES,
        extra_state: Mapping[str, ExtraState] | None = None,
        **kwargs: Any,
    ) -> None:
        # Idleness (of a partition, of a job) is measured in time spent waiting for the bus,
        # not wall time: while this process is busy (a large poll, a slow sink) nothing it has
        # not read yet can look idle.
        self._listening_s = 0.0
        super().__init__(job_idle_s=job_idle_s, sink_retry_s=sink_retry_s,
                         clock=self.listening_s, **kwargs)
        self.bus = bus
        self.group = group
        self.commit_interval_s = commit_interval_s
        self.stats_every_s = stats_every_s
        self.on_stats = on_stats
        self.max_open_bytes = max_open_bytes
        self._last_stats_s = time.monotonic()
        self.messages = 0
        self._committed: dict[Source, int] = {}
        self._assigned: frozenset[Source] = frozenset()
        self._last_commit_s = time.monotonic()
        self._poll_backoff = Backoff("poll from the bus", initial_s=0.5, max_s=5.0)
        self._commit_backoff = Backoff("offset commit", initial_s=0.5, max_s=10.0)
        self._resume: ResumeFilter | None = None
        # Per job, the window index below which the windows restored from a snapshot lie: until
        # they are closed, positions must not fall back to the re-read rule, which knows
        # nothing of the messages read before the restart.
        self._restored_open: dict[str, int] = {}
        self._open_in_checkpoint = False  # the last checkpoint holds the open windows
        self._snapshot_too_large = False  # warned once
        self._checkpointed_windows = 0  # windows handled when the last checkpoint was stored
        self._from_start = False  # no checkpoint in the store: read from the oldest offset
        self._first_read: set[Source] = set()  # partitions read from so far (with _from_start)
        self.extra_state = dict(extra_state or {})
        self._extra_failed: set[str] = set()  # hooks whose save raised (logged once)
        # Restored before joining the group: a member that joins must poll, not unpickle.
        if self.sink is not None:
            self._restore()
        # What the last checkpoint holds (or, with none yet, an equivalent state): a commit
        # stores a checkpoint when the hooks' state changed, even with nothing new read.
        self._checkpointed_extra = self._save_extra()
        # Every partition to one member: windows span a job's partitions and the checkpoint
        # is the group's, so a second member is refused (GroupHeldElsewhere), never split.
        self.consumer = bus.consumer(list(topics), group, sole_member=True)

    def logs_replaced(self, sources: list[Source]) -> None:
        # Batches re-read from a log that was not replaced after all are dropped as
        # duplicates (their producer stamps were seen) or skipped as already written.
        rewind = getattr(self.consumer, "rewind", None)
        if rewind is None:
            return
        try:
            rewind(sources)
        except BusError as exc:
            log.warning("could not re-read %s from the beginning: %s", sources, exc)

    def listening_s(self) -> float:
        """Seconds spent waiting for the bus so far: the clock of idleness."""
        return self._listening_s

    def dead_letter(self, message: Message, error: str) -> None:
        # At most DEAD_LETTER_PREFIX_BYTES of the payload, its size and digest in the key: a
        # bad message of any size fits under the broker's message limit.
        kept = bounded_payload(message.value)
        key = error.encode()[:200] + f" | {kept.describe()}".encode()
        try:
            self.bus.publish(DEAD_LETTER_TOPIC, kept.prefix, key=key)
        except Exception as exc:  # the dead-letter topic is best effort; the count is not
            log.warning("could not publish dead letter: %s", exc)

    # -- checkpoints ------------------------------------------------------------------------

    def _restore(self) -> None:
        if self.sink is None:
            return
        try:
            blob = self.sink.read_checkpoint(self.group)
        except Exception as exc:
            log.warning("could not read the last checkpoint of %s: %s", self.group, exc)
            return
        if blob is None:
            self._from_start = True
            return
        try:
            checkpoint = decode(blob)
        except ValueError as exc:
            log.warning("ignoring the last checkpoint of %s: %s", self.group, exc)
            return
        open_windows = 0
        if checkpoint.engine is not None:
            open_windows = self.engine.restore(checkpoint.engine)
            for job_id, windows in checkpoint.engine["windows"].items():
                if windows:
                    self._restored_open[job_id] = max(windows) + 1
            self._resume = ResumeFilter(checkpoint.positions, checkpoint.committed)
            # The bus holds this checkpoint's positions or, after a crash before they were
            # committed, the ones before: the earlier is what a later checkpoint may count on.
            self._committed = dict(checkpoint.committed)
        for job_id, before_ns in checkpoint.closed_before_ns.items():
            self.engine.restore_closed(job_id, before_ns)
        for topology in checkpoint.topologies.values():
            self.engine.add_topology(topology)
        self.validator.remember_world_sizes(checkpoint.world_sizes)
        if checkpoint.seen is not None:
            self.seen = checkpoint.seen
            self.seen.file_unfiled({job: index - 1 for job, index in self._restored_open.items()})
        runner = checkpoint.runner
        if runner is not None and [d.name for d in runner.detectors] == [
            d.name for d in self.runner.detectors
        ]:
            self.runner = runner
        self._restore_extra(checkpoint.extra or {})
        self._touch(self.engine.job_ids())
        log.info(
            "restored checkpoint of %s: %d job(s), %d open window(s)%s", self.group,
            len(self.engine.job_ids()), open_windows,
            "; resuming after " + ", ".join(
                f"{t}[{p}]@{o}" for (t, p), o in sorted(checkpoint.positions.items())
            ) if checkpoint.engine is not None else "",
        )

    def _restore_extra(self, saved: dict[str, Any]) -> None:
        for name, hook in self.extra_state.items():
            if name not in saved:
                continue
            try:
                hook.restore(saved[name])
            except Exception as exc:  # the job goes on; only that hook's state is lost
                log.warning("ignoring the %s state in the last checkpoint of %s: %s", name,
                            self.group, exc)

    def _save_extra(self) -> dict[str, Any]:
        saved: dict[str, Any] = {}
        for name, hook in self.extra_state.items():
            try:
                saved[name] = hook.save()
            except Exception:  # a bug in a hook must not stop checkpoints of the windows
                if name not in self._extra_failed:
                    self._extra_failed.add(name)
                    log.exception("%s state not checkpointed", name)
        return saved

    def _checkpoint(self, read: dict[Source, int]) -> bool:
        """Store a checkpoint; True if it holds the open windows (so ``read`` may be
        committed). Raises SinkUnavailable if it could not be stored, StoreLost if the
        store was lost (see :meth:`StreamCore._check_store`)."""
        sink = self.sink
        if sink is None:
            return False
        checkpoint = Checkpoint(
            closed_before_ns=self.engine.closed_before_ns(),
            topologies=self.engine.topologies(),
            world_sizes=self.validator.world_sizes(),
            runner=self.runner,
            seen=self.seen,
            positions=read,
            committed=dict(self._committed),
            # Taken here, on the job's thread: the hooks' state after exactly the windows
            # closed so far, which the positions stored with it cover.
            extra=self._save_extra() or None,
        )
        with_open = self.max_open_bytes > 0
        blob = b""
        if with_open:
            checkpoint.engine = self.engine.snapshot()
            blob = encode(checkpoint)
            if len(blob) > self.max_open_bytes:
                with_open = False
                if not self._snapshot_too_large:
                    self._snapshot_too_large = True
                    log.warning(
                        "open windows not checkpointed: %d bytes compressed, over the %d limit "
                        "(--max-open-bytes); a restart re-reads them", len(blob),
                        self.max_open_bytes,
                    )
        if not with_open:
            # The restart re-reads the open windows' messages, and their stamps with them:
            # stamps restored from here would take those messages for re-sends.
            checkpoint.engine, checkpoint.positions, checkpoint.seen = None, {}, None
            blob = encode(checkpoint)
        if not self._write(lambda: sink.write_checkpoint(self.group, blob)):
            raise SinkUnavailable("could not write the checkpoint")
        # Inserts into a store deleted under an embedded engine succeed and vanish: the
        # positions are committed only if the store still is the one every write went to.
        self._check_store()  # raises StoreLost
        self._stats.checkpoint_bytes = len(blob)
        self._open_in_checkpoint = with_open
        self._checkpointed_windows = self.windows
        self._checkpointed_extra = checkpoint.extra or {}
        return with_open

    def _restored_windows_open(self) -> bool:
        if self._restored_open and all(
            self.engine.closed_before(job) >= index for job, index in self._restored_open.items()
        ):
            self._restored_open.clear()
        return bool(self._restored_open)

    # -- the loop -----------------------------------------------------------------------------

    def process_messages(self, messages: list[Message]) -> None:
        if self._resume is not None:
            kept = []
            for message in messages:
                source = (message.topic, message.partition)
                if self._resume.skip(source, message.offset):
                    self.offsets.add(source, message.offset, {})
                else:
                    kept.append(message)
            self._stats.checkpoint_skipped = self._resume.skipped
            if not self._resume.active:
                self._resume = None
            messages = kept
        super().process_messages(messages)

    @property
    def watched_messages(self) -> int:
        """Messages read of the jobs this run watches (all of them without ``only_jobs``)."""
        return self.messages - self._stats.other_jobs_skipped

    def poll_once(self, timeout_s: float = 0.2, max_records: int = 20_000) -> int:
        messages: list[Message] = []
        group_changes = getattr(self.consumer, "group_changes", None)
        changes = group_changes() if group_changes is not None else 0
        waited = time.monotonic()
        if self._poll_backoff.ready():
            try:
                messages = self.consumer.poll(max_records=max_records, timeout_s=timeout_s)
            except GroupHeldElsewhere:
                raise  # not an outage: this member must leave without committing
            except BusError as exc:
                self._stats.poll_failures += 1
                self._poll_backoff.failed(exc)
            else:
                self._poll_backoff.succeeded()
        else:
            time.sleep(min(timeout_s, 0.05))
        waited_s = time.monotonic() - waited
        assignment = getattr(self.consumer, "assignment", None)
        if assignment is not None:
            assigned = frozenset(assignment())
            if assigned != self._assigned:
                log.info("assigned partitions: %s", ", ".join(
                    f"{topic}[{partition}]" for topic, partition in sorted(assigned))
                    or "none (the group is rebalancing)")
                self.engine.expect_sources(sorted(assigned - self._assigned))
                self._assigned = assigned
        # While the group rebalances (a member joins or leaves) nothing can arrive: that wait
        # is not the stream's silence, and must not close a job's windows as idle.
        rebalanced = group_changes is not None and group_changes() != changes
        if not rebalanced and (assignment is None or self._assigned):
            self._listening_s += waited_s
        if messages and self._from_start:
            messages = self._read_from_start(messages)
        if messages:
            self.messages += len(messages)
            self.process_messages(messages)
        self.close_idle()
        now = time.monotonic()
        if now - self._last_commit_s >= self.commit_interval_s:
            self.commit()
        due = self.stats_every_s is not None and now - self._last_stats_s >= self.stats_every_s
        if due and self.on_stats is not None:
            self._last_stats_s = now
            self.on_stats(self.stats())
        return len(messages)

    def _read_from_start(self, messages: list[Message]) -> list[Message]:
        """The store holds no checkpoint of this group, so whatever the group committed before
        went into a store since lost or replaced: a partition whose first message read is not
        its first is read again from its oldest retained message, as a new group's would be
        (once per partition). Returns the messages of this poll that are kept (none of a
        rewound partition: they come again)."""
        rewind = getattr(self.consumer, "rewind", None)
        behind: set[Source] = set()
        for message in messages:
            source = (message.topic, message.partition)
            if source not in self._first_read:
                self._first_read.add(source)
                if message.offset > 0:
                    behind.add(source)
        if not behind or rewind is None:
            return messages
        try:
            rewind(sorted(behind))
        except BusError as exc:
            log.warning("could not read %s from the oldest message: %s", self.group, exc)
            return messages
        log.info("no checkpoint of %s in the store: reading %s from the oldest retained "
                 "message", self.group, ", ".join(f"{t}[{p}]" for t, p in sorted(behind)))
        return [m for m in messages if (m.topic, m.partition) not in behind]

    def commit(self) -> bool:
        """Checkpoint, then commit the positions the checkpoint covers; False if the bus
        refused (it is retried at the next interval, with backoff)."""
        self._last_commit_s = time.monotonic()
        self.write_op_traces()  # before the positions that cover them are committed
        if self.write_failed:
            return False  # a window was dropped: never move past it
        read = self.offsets.read_positions()
        positions = self.offsets.positions(self.engine.closed_before)
        if self.sink is not None and self.max_open_bytes > 0:
            positions = read  # if the checkpoint takes the open windows (below)
        # Windows closed since (idle jobs) change the state even when nothing new was read.
        closed_since = self.windows != self._checkpointed_windows
        # So does a hook (an alert Alertmanager accepted meanwhile is no longer pending).
        closed_since = closed_since or (
            bool(self.extra_state) and self._save_extra() != self._checkpointed_extra)
        if not closed_since and not {
            s: o for s, o in positions.items() if self._committed.get(s) != o
        }:
            return True
        if not self._commit_backoff.ready():
            return False
        if self.sink is not None:
            try:
                with_open = self._checkpoint(read)
            except SinkUnavailable as exc:
                log.error("%s; positions not committed", exc)
                return False
            if not with_open:
                if self._restored_windows_open():
                    return False  # the re-read rule cannot rebuild the restored windows
                positions = self.offsets.positions(self.engine.closed_before)
        changed = {s: o for s, o in positions.items() if self._committed.get(s) != o}
        if not changed:
            return True
        try:
            self.consumer.commit(changed, timeout_s=COMMIT_TIMEOUT_S)
        except BusError as exc:
            self._stats.commit_failures += 1
            self._commit_backoff.failed(exc)
            return False
        self._commit_backoff.succeeded()
        self._committed.update(changed)
        self._stats.commits += 1
        return True

    def run(
        self,
        idle_timeout_s: float = 5.0,
        until: Callable[[], bool] | None = None,
        max_seconds: float | None = None,
    ) -> None:
        """Consume until ``until()`` holds and the bus is idle, or ``idle_timeout_s`` passes
        with nothing new, or ``max_seconds`` elapse, or :meth:`request_stop` is called.

        Idleness is counted in :meth:`listening_s`: time spent joining the group or
        rebalancing is not the bus being quiet (a slow join must not end the run before a
        message was read)."""
        started = time.monotonic()
        idle_since = self.listening_s()
        while not self.stopping:
            now = time.monotonic()
            if self.poll_once():
                idle_since = self.listening_s()
            elif until() if until is not None else (
                    self.listening_s() - idle_since >= idle_timeout_s):
                return
            if max_seconds is not None and now - started >= max_seconds:
                return

    def finish(self, drain: bool = True) -> bool:
        """Commit what was read, then stop; True if everything was committed.

        ``drain``: close and write every open window first (the end of the stream). Without
        it the open windows go into the checkpoint and a restarted pipeline finishes them, as
        if it had never stopped; where they cannot (no store, or over ``max_open_bytes``)
        they are drained anyway. Bounded by the deadline of :meth:`request_stop` (30 s if it
        was not called)."""
        self.request_stop()
        if drain or self.sink is None or self.max_open_bytes <= 0:
            self.drain()
        self._commit_backoff.reset()
        while not self.commit():
            deadline = self._stop_deadline or 0.0
            if self.write_failed or time.monotonic() >= deadline:
                return False
            time.sleep(0.2)
            self._commit_backoff.reset()  # the stop deadline bounds the tries
        if not drain and not self._open_in_checkpoint and self.engine.open_windows():
            self.drain()  # the snapshot did not fit: write them now rather than lose them
            return self.commit() and not self.write_failed
        return not self.write_failed

    def close(self) -> None:
        self.consumer.close()
