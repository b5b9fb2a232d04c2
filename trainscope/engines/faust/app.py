"""The stream job on Faust: several workers share the bus, one job's records meet in one worker.

Two agents per worker:

* ``rekey`` reads the events and metrics topics (and the what-if op traces' topic), whose
  messages producers key by ``job/rank`` (so one job is spread over partitions), and forwards
  each message unchanged, keyed by its job, to the repartition topic ``<app>-by-job``. The
  source message is acknowledged only once the broker has the forward, so its offset is never
  committed before. (By job, so that a job's whole op trace lands in one worker's store.)
* ``window`` reads the repartition topic and hands the messages to an
  :class:`~trainscope.engine.embedded_job.EmbeddedStreamJob` — the same decode, validate, window,
  detect and sink code the embedded engine runs. Its sources (watermarks) are the repartition
  topic's partitions.

Delivery. Open windows are **rebuilt by re-reading from the committed position**, not kept in a
Faust table: a repartition message is acknowledged (and so committed) only once every window
it fed is closed and written (:class:`~trainscope.engine.delivery.PendingOffsets`, the rule
the embedded job uses without a snapshot). What a worker that takes a partition over cannot
rebuild by re-reading is each job's *settled* state — the end of its last written window, its
detectors' history, its topology and world size. That lives in the Faust table
``<app>-jobs`` (a changelog topic, co-partitioned with the repartition topic): it is written,
and the producer flushed, before the messages it covers are acknowledged. A new owner restores
it on the job's first message, skips re-read records of windows already written (counted as
``replayed_events``), and rebuilds the open ones from their full input, so each window is
written once, from all of it, with the detectors in the state an uninterrupted run had.

A worker whose partition is taken away (a rebalance, not a crash) forgets the jobs it held
there without writing their open windows: the new owner rebuilds them. Partitions a worker
keeps go on as they were.

After a worker dies, its partitions get a new owner within the group's session timeout plus a
rebalance. Until then the producers' partitions its rekey agent read forward nothing, so
``source_idle_s`` and ``close_idle_s`` must be longer than that, or the survivors would close
windows of their own jobs without the records still on their way (defaults: 30 s).

Rejected messages go to the dead-letter topic as in the embedded job; their reason names the
repartition topic's partition and offset.

Op traces are taken in as `trainscope pipeline` takes them
(:mod:`~trainscope.engine.op_traces`), told apart by the topic they came from, and written at
each settle, before the messages that brought them are acknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import partial
from typing import Any

import faust
from faust.types import TP

from trainscope.detectors.base import Detector
from trainscope.engine.delivery import SeenBatches
from trainscope.engine.embedded_job import EmbeddedStreamJob
from trainscope.engine.sink import Sink
from trainscope.engines.faust import faust_private
from trainscope.engines.faust.consumer import use_rebalance_safe_consumer
from trainscope.schemas.records import Topology
from trainscope.schemas.topics import OPTRACE_TOPIC
from trainscope.transport.bus import DEAD_LETTER_TOPIC, EVENTS_TOPIC, METRICS_TOPIC, Message

log = logging.getLogger(__name__)

# Faust's defaults wait ~30 s for the first group join; a stream job should start in seconds.
SESSION_TIMEOUT_S = 10.0
HEARTBEAT_INTERVAL_S = 1.0
REBALANCE_TIMEOUT_S = 10.0
BATCH_MAX = 2000
BATCH_WITHIN_S = 0.2  # a batch older than this is handed over (by the timer if need be)


@dataclass(frozen=True)
class FaustOptions:
    """What a worker needs besides its sink; ``idle_exit_s`` stops it once the stream is
    drained and quiet that long (tests, benchmarks), ``None`` runs forever."""

    broker: str  # kafka://HOST:PORT
    app_id: str = "trainscope-faust"
    partitions: int = 4  # of the repartition topic and the jobs table
    # Windowed; the what-if op traces' topic is read beside them, and stored, not windowed.
    topics: tuple[str, ...] = (EVENTS_TOPIC, METRICS_TOPIC)
    window_s: float = 15.0
    lateness_s: float = 5.0
    # Above the group's session timeout plus a rebalance: while a dead worker's partitions wait
    # for a new owner, its rekey agent forwards nothing, and the producers' partitions it read
    # must go on holding the windows of the jobs the others window.
    source_idle_s: float = 30.0
    close_idle_s: float = 30.0
    idle_exit_s: float | None = None
    detector_names: tuple[str, ...] | None = None


NOT_CLOSED_NS = -(2**63)  # JobState.closed_before_ns of a job with no window written yet


@dataclass
class JobState:
    """A job's settled state, as stored in the jobs table."""

    closed_before_ns: int
    detectors: list[Any]
    topology: Topology | None
    world_size: int | None


def job_of(key: bytes | None) -> bytes:
    """The job of a ``job/rank`` message key (see ``rank_key``); unkeyed messages share b""."""
    if not key:
        return b""
    return key.rpartition(b"/")[0] or key


ORIGIN_HEADER = "trainscope-origin"


def _origin(headers: Any) -> tuple[str, int] | None:
    """The producer's (topic, partition) from a repartitioned message's headers."""
    items = headers.items() if isinstance(headers, dict) else (headers or ())
    for name, value in items:
        if name == ORIGIN_HEADER and value:
            topic, _, partition = bytes(value).decode().rpartition(":")
            return topic, int(partition)
    return None


class _ListeningClock:
    """Seconds not spent processing: while a worker is busy, nothing it has not read yet can
    look idle (the embedded job measures idleness the same way)."""

    def __init__(self) -> None:
        self.busy_s = 0.0

    def __call__(self) -> float:
        return time.monotonic() - self.busy_s


class FaustWorkerJob:
    """One worker's stream job: the pipeline, the held (unacknowledged) events, the jobs table."""

    def __init__(self, app: faust.App, options: FaustOptions, pipeline: _DeadLetteringPipeline,
                 clock: _ListeningClock, table: Any, by_job: Any) -> None:
        self.app = app
        self.options = options
        self.pipeline = pipeline
        self.clock = clock
        self.table = table
        self.by_job = by_job
        self._held: dict[TP, deque[Any]] = {}
        self._repeats: dict[TP, list[Any]] = {}  # delivered again, handled before
        self._job_partition: dict[str, int] = {}
        self._saved: dict[str, tuple[int, Topology | None, int | None]] = {}
        self.last_event_s = time.monotonic()
        self.started = False  # assigned partitions once
        self.done = asyncio.Event()
        self._batch: list[Any] = []
        self._owned: set[int] = set()  # partitions of the repartition topic
        self._ever_owned: set[int] = set()
        self._next_offset: dict[TP, int] = {}
        self._batch_since_s = 0.0

    # -- input ------------------------------------------------------------------------------

    def restore_job(self, job_id: str) -> None:
        """A job first seen by this worker: take over its settled state, if another had it."""
        blob = self.table.data.get(job_id.encode())
        if blob is None:
            return
        state: JobState = pickle.loads(blob)
        p = self.pipeline
        if state.closed_before_ns != NOT_CLOSED_NS:
            p.engine.restore_closed(job_id, state.closed_before_ns)
        if state.topology is not None:
            p.engine.add_topology(state.topology)
        if state.world_size is not None:
            p.validator.remember_world_sizes({job_id: state.world_size})
        p.runner.for_job(job_id)[:] = state.detectors
        self._saved[job_id] = (state.closed_before_ns, state.topology, state.world_size)
        if state.closed_before_ns == NOT_CLOSED_NS:
            log.info("job %s taken over: its topology, no window written yet", job_id)
        else:
            log.info("job %s taken over: windows before %d ns were written by another worker",
                     job_id, state.closed_before_ns)

    async def add(self, event: Any) -> None:
        if not self._batch:
            self._batch_since_s = time.monotonic()
        self._batch.append(event)
        if (len(self._batch) >= BATCH_MAX
                or time.monotonic() - self._batch_since_s >= BATCH_WITHIN_S):
            await self.flush()

    async def flush(self) -> None:
        events, self._batch = self._batch, []
        if events:
            await self.handle(events)

    async def handle(self, events: list[Any]) -> None:
        started = time.monotonic()
        messages = []
        for event in events:
            m = event.message
            if m.partition not in self._owned:
                continue  # delivered before a rebalance took the partition away
            if m.offset < self._next_offset.get(m.tp, -1):
                # A kept partition delivered again from its committed position. The rebalance
                # dropped Faust's record of what was acknowledged, so the repeat is
                # acknowledged too, once its offset is settled: the commit waits for it.
                self._repeats.setdefault(m.tp, []).append(event)
                continue
            self._next_offset[m.tp] = m.offset + 1
            job = job_of(m.key).decode(errors="replace")
            if job not in self._job_partition:
                self._job_partition[job] = m.partition
                self.restore_job(job)
            self._held.setdefault(m.tp, deque()).append(event)
            origin = _origin(m.headers)
            if origin is not None:
                self.pipeline.origins[(m.partition, m.offset)] = origin
            messages.append(Message(m.topic, m.partition, m.offset, m.key, m.value,
                                    int((m.timestamp or 0) * 1000)))
        self.pipeline.process_messages(messages)
        self.pipeline.origins.clear()
        self.pipeline.close_idle()
        self.clock.busy_s += time.monotonic() - started
        self.last_event_s = time.monotonic()
        await self.settle()

    async def tick(self) -> None:
        """Timer: close idle jobs' windows, settle, and stop once drained if asked to."""
        await self.flush()
        started = time.monotonic()
        self.pipeline.close_idle()
        self.clock.busy_s += time.monotonic() - started
        await self.settle()
        idle = self.options.idle_exit_s
        if (idle is not None and self.started and not self.done.is_set()
                and time.monotonic() - self.last_event_s >= idle
                and self.pipeline.engine.open_windows() == 0
                and not any(self._held.values())):
            self.done.set()

    async def settle(self) -> None:
        """Store the settled state of jobs whose windows closed, then acknowledge the messages
        whose windows are all written (Faust commits acknowledged offsets)."""
        p = self.pipeline
        # Op traces taken in are written before the messages that brought them are
        # acknowledged (they feed no window, so their positions are settled at once).
        p.write_op_traces()
        if p.write_failed:
            return  # a window was dropped: never move past it
        engine = p.engine
        changed = False
        closed = engine.closed_before_ns()
        topologies = engine.topologies()
        world_sizes = p.validator.world_sizes()
        for job_id, partition in self._job_partition.items():
            # Also a topology or world size not yet covered by a written window: the message
            # that declared it is acknowledged at once (it feeds no window), so a worker taking
            # the job over would not read it again.
            state = JobState(closed.get(job_id, NOT_CLOSED_NS), p.runner.for_job(job_id),
                             topologies.get(job_id), world_sizes.get(job_id))
            mark = (state.closed_before_ns, state.topology, state.world_size)
            if self._saved.get(job_id) == mark:
                continue
            blob = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
            key = job_id.encode()
            self.table.data[key] = blob
            self.table.send_changelog(partition, key, blob)
            self._saved[job_id] = mark
            log.info("job %s settled before %d ns (windows written: %d)", job_id,
                     state.closed_before_ns, p.windows)
            changed = True
        if changed:
            await self.app.producer.flush()
        positions = p.offsets.positions(engine.closed_before)
        for tp, held in self._held.items():
            position = positions.get((tp.topic, tp.partition))
            if position is None:
                continue
            while held and held[0].message.offset < position:
                held.popleft().ack()
        for tp, repeats in self._repeats.items():
            position = positions.get((tp.topic, tp.partition))
            if position is None:
                continue
            waiting = []
            for event in repeats:
                if event.message.offset < position:
                    event.ack()
                else:
                    waiting.append(event)
            repeats[:] = waiting

    def assigned(self, partitions: set[int]) -> None:
        """The repartition topic's partitions after a rebalance. Faust revokes every partition
        first; what matters is the difference. A partition lost is another worker's now: its
        jobs' open windows are dropped unwritten (the new owner rebuilds them from all of
        their input, from the committed position). A partition kept goes on as it was (Faust
        may deliver its messages again from the committed position; those already handled are
        skipped). A partition gained is read from its committed position."""
        lost = self._owned - partitions
        gained = partitions - self._owned
        topic = self.by_job.get_topic_name()
        for partition in lost:
            tp = TP(topic, partition)
            self._held.pop(tp, None)
            self._repeats.pop(tp, None)
            self._next_offset.pop(tp, None)
            self.pipeline.offsets.forget((topic, partition))
        self._batch = [e for e in self._batch if e.message.partition not in lost]
        for job_id, partition in list(self._job_partition.items()):
            if partition in lost:
                self.pipeline.forget_job(job_id)
                del self._job_partition[job_id]
                self._saved.pop(job_id, None)
        if gained & self._ever_owned:
            # Producer stamps of what was read there before would drop it as re-sent.
            self.pipeline.seen = SeenBatches()
        self._owned = set(partitions)
        self._ever_owned |= partitions
        if lost or gained:
            log.info("repartition topic: lost %s, gained %s", sorted(lost), sorted(gained))

    def stats(self) -> dict[str, Any]:
        return self.pipeline.stats().as_dict()


class _DeadLetteringPipeline(EmbeddedStreamJob):
    def __init__(self, publish: Callable[[bytes, bytes], None], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._publish = publish
        # (repartition partition, offset) → the producer's (topic, partition), for this batch.
        self.origins: dict[tuple[int, int], tuple[str, int]] = {}

    def is_op_trace(self, message: Message) -> bool:
        origin = self.origins.get((message.partition, message.offset))
        return origin is not None and origin[0] == OPTRACE_TOPIC

    def window_source(self, message: Message) -> Hashable:
        # Watermarks per partition the producers wrote to: there each rank's records are in
        # order, while the repartition topic interleaves partitions as the rekey agents read.
        return self.origins.get((message.partition, message.offset),
                                (message.topic, message.partition))

    def forget_job(self, job_id: str) -> None:
        self.engine.evict_job(job_id)  # the views are discarded: not written
        self.seen.forget_job(job_id)
        self.runner.forget(job_id)
        self.validator.forget(job_id)

    def dead_letter(self, message: Message, error: str) -> None:
        try:
            self._publish(error.encode()[:200], message.value)
        except Exception as exc:  # best effort, as in the embedded job; the count is not
            log.warning("could not publish dead letter: %s", exc)


def _ack_if_delivered(event: Any, delivery: asyncio.Future) -> None:
    if delivery.cancelled() or delivery.exception() is not None:
        # Not acknowledged: the source offset stays where it is, and the message is forwarded
        # again after a restart or rebalance (the window agent drops the copy by its stamp).
        log.warning("forward of %s[%d]@%d failed: %s", event.message.topic,
                    event.message.partition, event.message.offset,
                    "cancelled" if delivery.cancelled() else delivery.exception())
        return
    event.ack()


async def _all_partitions(app: faust.App, topics: tuple[str, ...]) -> list[tuple[str, int]]:
    """Every partition of ``topics``, not only this worker's. From the producer's metadata: the
    consumer's (``topic_partitions``) is the group leader's alone, so another worker would
    expect no source at all and close windows on whichever arrived first."""
    producer = faust_private.aiokafka_producer(app.producer)  # public aiokafka API below
    sources = []
    for topic in topics:
        try:
            partitions = await asyncio.wait_for(producer.partitions_for(topic), 10.0)
        except Exception as exc:  # not created yet: its first records will make it a source
            log.warning("partitions of %s unknown (%s): it holds no window until it delivers",
                        topic, exc or type(exc).__name__)
            continue
        sources.extend((topic, partition) for partition in sorted(partitions))
    return sources


def build_app(options: FaustOptions, sink: Sink | None,
              detectors: list[Detector] | None = None) -> tuple[faust.App, FaustWorkerJob]:
    """The Faust app of one worker process, writing to ``sink``."""
    app = faust.App(
        options.app_id,
        broker=options.broker,
        key_serializer="raw",
        value_serializer="raw",
        store="memory://",
        # Faust makes its data directory at start, tables in memory or not; by default that is
        # `<app id>-data/` in the operator's working directory. Nothing of ours lives there.
        datadir=tempfile.mkdtemp(prefix=f"{options.app_id}-faust-"),
        topic_partitions=options.partitions,
        broker_session_timeout=SESSION_TIMEOUT_S,
        broker_heartbeat_interval=HEARTBEAT_INTERVAL_S,
        broker_rebalance_timeout=REBALANCE_TIMEOUT_S,
        broker_commit_interval=0.5,
        consumer_auto_offset_reset="earliest",
        web_enabled=False,
        producer_acks=-1,
        # Faust would hold a rebalance until every event handed to the agents is acknowledged;
        # ours are acknowledged only once their windows are written, so it would wait out the
        # whole rebalance timeout. assigned() settles kept and lost partitions instead.
        stream_wait_empty=False,
    )
    use_rebalance_safe_consumer(app)
    source = app.topic(*options.topics, OPTRACE_TOPIC, key_type=bytes, value_type=bytes)
    by_job = app.topic(f"{options.app_id}-by-job", partitions=options.partitions,
                       key_type=bytes, value_type=bytes, internal=True)
    dead = app.topic(DEAD_LETTER_TOPIC, key_type=bytes, value_type=bytes)
    table = app.Table("jobs", partitions=options.partitions, key_type=bytes,
                      value_type=bytes)
    clock = _ListeningClock()
    pipeline = _DeadLetteringPipeline(
        lambda key, value: dead.send_soon(key=key, value=value),
        detectors=detectors, window_s=options.window_s, lateness_s=options.lateness_s,
        source_idle_s=options.source_idle_s, job_idle_s=options.close_idle_s, sink=sink,
        sink_retry_s=None, clock=clock,
    )
    job = FaustWorkerJob(app, options, pipeline, clock, table, by_job)

    @app.agent(source, name="rekey")
    async def rekey(stream: Any) -> None:
        # A source message is acknowledged (so its offset may be committed) only once the
        # broker has its forward: acknowledged when handed over, a forward still in the
        # producer's buffer when the worker is killed would be lost with its source offset
        # committed. Forwards to different partitions complete in any order: the consumer
        # (faust_consumer) commits only a run of acknowledged offsets from the committed
        # position, so the position never passes a forward still in flight.
        async for event in stream.noack().events():
            origin = f"{event.message.topic}:{event.message.partition}".encode()
            delivery = await by_job.send(key=job_of(event.key), value=event.value,
                                         headers={ORIGIN_HEADER: origin})
            delivery.add_done_callback(partial(_ack_if_delivered, event))

    @app.agent(by_job, name="window")
    async def window(stream: Any) -> None:
        # Not take_events(): it acknowledges each batch once handed over, before its windows
        # are written. Events are batched here and acknowledged by settle(); the timer hands
        # over a batch that stopped growing.
        async for event in stream.noack().events():
            await job.add(event)

    @app.timer(BATCH_WITHIN_S)
    async def tick() -> None:
        await job.tick()

    @app.on_partitions_assigned.connect
    async def on_assigned(app: faust.App, assigned: set[TP], **_: Any) -> None:
        job.assigned({tp.partition for tp in assigned if tp.topic == by_job.get_topic_name()})
        # The window engine's sources are the producers' partitions (see window_source): any
        # of them may still carry a job's oldest records, through either worker's rekey agent.
        pipeline.engine.expect_sources(await _all_partitions(app, options.topics))
        job.started = True
        job.last_event_s = time.monotonic()

    return app, job


def run_worker(app: faust.App, job: FaustWorkerJob, loglevel: str | None = None) -> dict:
    """Run one worker until it is stopped (SIGTERM, Ctrl-C) or, with ``idle_exit_s``, drained;
    returns its final counts."""
    if loglevel is None:  # `trainscope -v` asks for info
        loglevel = "info" if logging.getLogger().isEnabledFor(logging.INFO) else "warning"
    worker = faust.Worker(app, loglevel=loglevel, quiet=True, redirect_stdouts=False)

    async def stop_when_done() -> None:
        await job.done.wait()
        await app.consumer.commit()
        # The way an operator stops a worker: stopping it from one of its own tasks cancels
        # the agents before they are told to stop, and Faust logs them as crashed.
        os.kill(os.getpid(), signal.SIGTERM)

    @app.task
    async def watch() -> None:
        await stop_when_done()

    try:
        with contextlib.suppress(SystemExit):  # mode's worker exits the way a command does
            worker.execute_from_commandline()
    finally:
        shutil.rmtree(app.conf.datadir, ignore_errors=True)
    stats = job.stats()
    print(json.dumps(stats), file=sys.stderr, flush=True)
    return stats
