"""The demo: a simulated job published over a bus, consumed by the pipeline, stored in ClickHouse.

The simulated cluster publishes exactly what real producers do: each rank's spans condensed per
window into function summaries by the same recorder ``attach()`` runs (raw span batches only with
``send="spans"``, for comparison), with the step records per host on the events topic and metric
samples on the metrics topic; the pipeline consumes them like any other producer's data. On the
in-memory bus producer and pipeline alternate in one thread; on Kafka the producer runs in its
own thread and the pipeline consumes concurrently.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from trainscope.detectors.base import Detector
from trainscope.detectors.diagnosis import Suspect, diagnose
from trainscope.engine.bus_job import BusStreamJob
from trainscope.engine.core import PipelineStats
from trainscope.producers.simulate import ClusterSpec, Fault, SimulatedCluster, StepOutput
from trainscope.schemas.codec import encode_batch
from trainscope.schemas.records import (
    Finding,
    MetricBatch,
    MetricSample,
    Record,
    StepBatch,
    StepRecord,
)
from trainscope.schemas.window import WindowView
from trainscope.transport.bus import EVENTS_TOPIC, METRICS_TOPIC, Bus, open_bus, rank_key

if TYPE_CHECKING:
    from trainscope.sinks.clickhouse import ClickHouseSink

log = logging.getLogger(__name__)


@dataclass
class DemoResult:
    job_id: str
    ranks: int
    steps: int
    events: int  # span events the ranks measured
    summaries: int  # function summaries they sent instead (0 when they sent the raw spans)
    messages: int
    windows: int
    elapsed_s: float
    findings: list[Finding]
    suspects: list[Suspect]
    stats: PipelineStats
    store: Path | None = None
    sink_rows: int = 0
    notes: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "findings": [s.as_json() for s in self.suspects],
            "ranks": self.ranks,
            "events": self.events,
            "summaries": self.summaries,
            "windows": self.windows,
            "elapsed_s": round(self.elapsed_s, 3),
        }


def publish_step(bus: Bus, cluster: SimulatedCluster, output: StepOutput, first: bool) -> int:
    """Publish one step the way per-host producers would; returns the number of messages."""
    spec = cluster.spec
    per_host = spec.gpus_per_host
    messages = 0
    if first:
        bus.publish(EVENTS_TOPIC, encode_batch(cluster.topology_records()),
                    key=rank_key(spec.job_id, 0))
        messages += 1
    # One events message per host and step: its ranks' span batch or closed window summaries,
    # then their step records.
    by_host: dict[int, list[Record]] = {}
    for batch in output.spans:
        by_host.setdefault(int(batch.column("rank")[0]) // per_host, []).append(batch)
    for summary in output.summaries:
        by_host.setdefault(int(summary.column("rank")[0]) // per_host, []).append(summary)
    # Step records and metric samples go as columnar batches, as the real producers send them.
    steps_by_host: dict[int, list[StepRecord]] = {}
    for record in output.steps:
        steps_by_host.setdefault(record.rank // per_host, []).append(record)
    for host, steps in steps_by_host.items():
        by_host.setdefault(host, []).append(StepBatch.from_records(steps))
    for host in sorted(by_host):
        bus.publish(EVENTS_TOPIC, encode_batch(by_host[host]),
                    key=rank_key(spec.job_id, host * per_host))
        messages += 1
    metrics_by_host: dict[int, list[MetricSample]] = {}
    for sample in output.metrics:
        metrics_by_host.setdefault(sample.rank // per_host, []).append(sample)
    for host, samples in metrics_by_host.items():
        bus.publish(METRICS_TOPIC, encode_batch([MetricBatch.from_records(samples)]),
                    key=rank_key(spec.job_id, host * per_host))
        messages += 1
    return messages


def run_demo(
    spec: ClusterSpec,
    faults: list[Fault],
    *,
    bus_url: str = "memory",
    sink: ClickHouseSink | None = None,
    window_s: float = 15.0,
    lateness_s: float = 5.0,
    detectors: list[Detector] | None = None,
    threshold: float = 0.5,
    on_step: Callable[[int], None] | None = None,
    on_window: Callable[[WindowView, list[Finding]], None] | None = None,
    kafka_timeout_s: float = 120.0,
    ops_sink: Callable[[Any], None] | None = None,
    send: Literal["summaries", "spans"] = "summaries",
) -> DemoResult:
    """``ops_sink``, if given, receives each step's op-trace frame (for the what-if analysis).
    ``send``: what the ranks publish about their functions, per-window ``"summaries"`` as real
    producers do, or raw ``"spans"``."""
    # The ranks condense over the pipeline's windows, as attach() is configured to.
    spec = replace(spec, send=send, window_s=window_s,
                   record_ops=spec.record_ops or ops_sink is not None)
    cluster = SimulatedCluster(spec, faults)
    bus = open_bus(bus_url)
    group = f"trainscope-demo-{spec.job_id}-{time.time_ns()}"
    # A one-shot run: a sink that keeps failing costs a window (counted), not the whole run.
    job = BusStreamJob(
        bus, group=group, detectors=detectors, window_s=window_s, lateness_s=lateness_s,
        sink=sink, on_window=on_window, on_early=on_window, sink_retry_s=10.0,
        # A shared broker may carry other jobs: the demo diagnoses its own.
        only_jobs=frozenset({spec.job_id}),
    )
    started = time.perf_counter()
    sent = _Sent(ops_sink)
    notes: list[str] = []
    try:
        if bus_url.startswith("memory"):
            _run_in_memory(bus, cluster, job, sent, on_step)
        else:
            notes = _run_on_kafka(bus, cluster, job, sent, on_step, kafka_timeout_s)
        job.finish()
    finally:
        bus.close()
    elapsed = time.perf_counter() - started
    return DemoResult(
        job_id=spec.job_id,
        ranks=cluster.layout.world_size,
        steps=spec.steps,
        events=sent.events,
        summaries=sent.summaries,
        messages=sent.messages,
        windows=job.windows,
        elapsed_s=elapsed,
        findings=job.findings,
        suspects=diagnose(job.findings, threshold),
        stats=job.stats(),
        sink_rows=sink.stats.rows_written if sink is not None else 0,
        notes=notes,
    )


class _Sent:
    """What the simulated ranks published so far (read by the consuming thread on Kafka)."""

    def __init__(self, ops_sink: Callable[[Any], None] | None) -> None:
        self.ops_sink = ops_sink
        self.events = 0  # span events the ranks measured
        self.summaries = 0
        self.messages = 0

    def publish(self, bus: Bus, cluster: SimulatedCluster, output: StepOutput) -> None:
        self.messages += publish_step(bus, cluster, output, output.step == 0)
        self.events += output.span_count
        self.summaries += sum(len(b) for b in output.summaries)
        if self.ops_sink is not None and output.ops is not None:
            self.ops_sink(output.ops)


def _run_in_memory(bus: Bus, cluster: SimulatedCluster, job: BusStreamJob, sent: _Sent,
                   on_step: Callable[[int], None] | None) -> None:
    """Producer and pipeline take turns in this thread: each step is consumed as it is sent."""
    for output in cluster.run():
        sent.publish(bus, cluster, output)
        while job.poll_once(timeout_s=0.0):
            pass
        if on_step:
            on_step(output.step)


def _run_on_kafka(bus: Bus, cluster: SimulatedCluster, job: BusStreamJob, sent: _Sent,
                  on_step: Callable[[int], None] | None, timeout_s: float) -> list[str]:
    """The producer in a thread of its own, the pipeline consuming here until it has read
    every message published or ``timeout_s`` passed; returns notes on what was not read."""
    done = threading.Event()
    failure: list[BaseException] = []

    def produce() -> None:
        try:
            for output in cluster.run():
                sent.publish(bus, cluster, output)
                if on_step:
                    on_step(output.step)
            bus.flush()
        except BaseException as exc:  # reported by the main thread
            failure.append(exc)
        finally:
            done.set()

    producer = threading.Thread(target=produce, name="demo-producer", daemon=True)
    producer.start()
    job.run(until=lambda: done.is_set() and job.watched_messages >= sent.messages,
            max_seconds=timeout_s)
    producer.join(timeout=5)
    if failure:
        raise failure[0]
    if job.watched_messages < sent.messages:
        return [f"consumed {job.watched_messages} of {sent.messages} published messages before the "
                f"{timeout_s:.0f} s limit"]
    return []
