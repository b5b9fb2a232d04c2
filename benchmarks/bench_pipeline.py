"""Throughput of the embedded path: window engine, then detectors + ClickHouse sink.

For each job size the simulated cluster produces the bus payloads first (not timed as
pipeline work); then, on one thread:
  1. the window engine: decode + window + close, in events/s — with, as a same-run baseline,
     one numpy argsort of the same number of int64 keys (the floor of any sort-based group-by);
  2. detectors + sink: closed windows through the built-in detectors and into a chDB store,
     in summaries/s;
  3. real-time factor: simulated job time ÷ processing time of 1 + 2 (> 1: faster than real time).

Run:  python benchmarks/bench_pipeline.py [--quick]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from trainscope.demo import publish_step
from trainscope.detectors.multivariate import RankAnomalyDetector
from trainscope.detectors.peer import PeerDiffDetector
from trainscope.detectors.registry import DetectorRunner
from trainscope.detectors.steptime import StepTimeDetector
from trainscope.producers.simulate import ClusterSpec, SimulatedCluster, parse_faults
from trainscope.schemas.codec import decode_batch
from trainscope.sinks.clickhouse import ClickHouseSink
from trainscope.streams.bus import EVENTS_TOPIC, METRICS_TOPIC
from trainscope.streams.memory_bus import MemoryBus
from trainscope.streams.pipeline import EmbeddedPipeline

SIZES = {64: (8, 4, 2), 1024: (64, 8, 2)}


def produce(ranks: int, steps: int) -> tuple[list[bytes], int, float]:
    """The bus payloads of a simulated job, published exactly as the demo's producers do."""
    dp, pp, tp = SIZES[ranks]
    cluster = SimulatedCluster(ClusterSpec(dp=dp, pp=pp, tp=tp, steps=steps, seed=1),
                               parse_faults(["slow-gpu:rank=5,factor=1.3"]))
    bus = MemoryBus()
    consumer = bus.consumer([EVENTS_TOPIC, METRICS_TOPIC], "bench")
    payloads: list[bytes] = []
    events, end_ns = 0, 0
    for output in cluster.run():
        publish_step(bus, cluster, output, output.step == 0)
        # Drained per step, as the live pipeline polls: metrics stay next to their step.
        payloads += [m.value for m in consumer.poll(max_records=10**9, timeout_s=0)]
        events += output.span_count
        end_ns = max(r.start_ns + r.duration_ns for r in output.steps)
    return payloads, events, (end_ns - cluster.spec.start_ns) / 1e9


def window_pass(payloads: list[bytes]) -> tuple[list, float]:
    """Decode + window + close, through the pipeline's own routing, with no detectors."""
    views: list = []
    pipeline = EmbeddedPipeline([], window_s=15.0, on_window=lambda v, f: views.append(v))
    chunk = 256  # messages per poll, as the bus pipeline hands them over
    started = time.perf_counter()
    for i in range(0, len(payloads), chunk):
        pipeline.process_records(
            [r for payload in payloads[i : i + chunk] for r in decode_batch(payload)]
        )
    pipeline.finish()
    return views, time.perf_counter() - started


def detect_and_sink(views: list, store: Path) -> tuple[int, float, float]:
    sink = ClickHouseSink.open(store)
    runner = DetectorRunner([PeerDiffDetector(), StepTimeDetector(), RankAnomalyDetector()])
    detect_s = sink_s = 0.0
    summaries = 0
    for view in views:
        t0 = time.perf_counter()
        findings = runner.run(view)
        t1 = time.perf_counter()
        sink.write_window(view, findings)
        t2 = time.perf_counter()
        detect_s += t1 - t0
        sink_s += t2 - t1
        summaries += len(view.summaries)
    return summaries, detect_s, sink_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (smoke run)")
    args = parser.parse_args()
    steps = {64: 200, 1024: 60} if not args.quick else {64: 40, 1024: 15}
    print(f"{'ranks':>6} {'events':>10} {'engine ev/s':>12} {'argsort ev/s':>13} "
          f"{'engine/argsort':>15} {'summaries':>10} {'det+sink sum/s':>15} "
          f"{'detect s':>9} {'sink s':>7} {'job s':>7} {'proc s':>7} {'x real time':>11}")
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in (64, 1024):
            payloads, events, job_s = produce(ranks, steps[ranks])
            keys = np.random.default_rng(0).integers(0, 2**40, events)
            t0 = time.perf_counter()
            np.argsort(keys, kind="stable")
            argsort_s = time.perf_counter() - t0
            views, engine_s = window_pass(payloads)
            # chDB: one store per process, so each size gets its own table prefix via job ids
            # in one store directory.
            summaries, detect_s, sink_s = detect_and_sink(views, Path(tmp) / "store")
            processing_s = engine_s + detect_s + sink_s
            print(f"{ranks:>6} {events:>10,} {events / engine_s:>12,.0f} "
                  f"{events / argsort_s:>13,.0f} {engine_s / argsort_s:>15.1f} "
                  f"{summaries:>10,} {summaries / (detect_s + sink_s):>15,.0f} "
                  f"{detect_s:>9.2f} {sink_s:>7.2f} {job_s:>7.0f} {processing_s:>7.1f} "
                  f"{job_s / processing_s:>11.1f}")


if __name__ == "__main__":
    main()
