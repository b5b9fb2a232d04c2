"""Throughput of the embedded path: window engine, then detectors + ClickHouse sink.

Two workloads, each produced first (not timed as pipeline work), then processed on one thread:

- spans: the simulated cluster's span batches, as the demo publishes them. Columns: the window
  engine (decode + window + close) in events/s — with, as a same-run baseline, one numpy argsort
  of the same number of int64 keys (the floor of any sort-based group-by); detectors + sink in
  summaries/s; real-time factor = simulated job time ÷ processing time.
- summaries: the production record path. Every rank sends, per window, one message holding a
  SummaryBatch of its 60 functions and, every sender round (0.5 s) that ended a step, one
  holding that round's step records, as the PyTorch producer does (``--step-messages window``:
  its step records in its summaries' message, as this benchmark sent them before 2026-12-06);
  every host sends its GPUs' condensed metric samples, as the host agent does. The batches are
  made by the producers' own code (``summary_batches``) from the simulated cluster's spans (each
  of its 10 functions split into 6 parts, so 60 functions per rank), and tiled out to the job
  size. Step records and metric samples travel as StepBatch and MetricBatch columns, as the
  producers send them. Columns: decode + window engine + close in records/s (summary rows, step
  records and metric samples), over the whole run and, best of 3, over one window: its summaries
  alone, the whole message, and the whole message with step records and metric samples as rows
  (the wire format of producers before them, a same-run baseline); detectors + sink, real-time
  factor, and the process's peak resident memory after the row.

Every message is handed to the stream job as the bus delivers it (``process_messages``: topic,
partition and offset; the partition its key picks, keyed by job and rank as the producers key
them; polls of 20,000 messages, partition by partition, as a consumer behind a backlog gets
them, ``--poll-records``), so decoding, de-duplication, the caps and the positions kept per
message are measured with the windowing. Until 2026-12-07 the records were decoded here and
handed over as records (``process_records``), which skipped that per-message work and
measured 2.5-6x the rate ``trainscope pipeline`` reaches.

The process is pinned to one CPU (BLAS and Arrow pools at one thread). Times are CPU seconds,
not wall-clock, because the machines we measure on are shared: the pipeline thread's own CPU
time for the window engine and the detectors, and the whole process's for the sink, whose
embedded store works in threads of its own.

Run:  python benchmarks/bench_pipeline.py [--quick] [--only spans|summaries] [--ranks 1024,10240]
      [--baselines-up-to 10240] [--step-messages round|window] [--poll-records 20000]
"""

from __future__ import annotations

import os

# One core: pin BLAS/Arrow thread pools before numpy or pyarrow are imported.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import itertools  # noqa: E402
import resource  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import msgspec  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

from trainscope.cli.demo_job import publish_step  # noqa: E402
from trainscope.detectors.base import WindowView  # noqa: E402
from trainscope.detectors.registry import DetectorRunner, load  # noqa: E402
from trainscope.engine.allocator import keep_freed_memory  # noqa: E402
from trainscope.engine.embedded_job import EmbeddedStreamJob  # noqa: E402
from trainscope.producers.agent.aggregate import WindowAggregator  # noqa: E402
from trainscope.producers.simulate import (  # noqa: E402
    ClusterSpec,
    SimulatedCluster,
    parse_faults,
)
from trainscope.producers.simulate.layout import Layout  # noqa: E402
from trainscope.schemas.codec import decode_batch, encode_batch  # noqa: E402
from trainscope.schemas.records import (  # noqa: E402
    MetricBatch,
    MetricSample,
    Record,
    StepBatch,
    StepRecord,
    SummaryBatch,
)
from trainscope.schemas.summaries import summary_batches  # noqa: E402
from trainscope.sinks.clickhouse import ClickHouseSink  # noqa: E402
from trainscope.transport.bus import EVENTS_TOPIC, METRICS_TOPIC, rank_key  # noqa: E402
from trainscope.transport.memory import MemoryBus  # noqa: E402
from trainscope.transport.protocol import (  # noqa: E402
    DEFAULT_PARTITIONS,
    Message,
    partition_for,
)

SIZES = {64: (8, 4, 2), 1024: (64, 8, 2)}
# The summaries workload's job sizes (--ranks): dp × 8 stages × 2-way tensor parallelism.
SUMMARY_SIZES = (1024, 10240)


def summary_layout(ranks: int) -> tuple[int, int, int]:
    if ranks % 16:
        raise SystemExit(f"--ranks: {ranks} is not a multiple of 16 (dp x 8 stages x 2 tp)")
    return ranks // 16, 8, 2
SOURCE = (8, 8, 2)  # dp, pp, tp of the simulated job the summaries workload is tiled from
# Each simulated function's time split over parts (kernels of an op): 10 functions become 60.
PARTS = (0.35, 0.25, 0.15, 0.10, 0.10, 0.05)
WINDOW_S = 15.0
WINDOW_NS = int(WINDOW_S * 1e9)
# Messages per poll: `trainscope pipeline` polls up to 20,000 (BusStreamJob.poll_once), and a
# consumer behind a backlog gets them (60,000 queued one-step messages on the real broker came
# in 3 polls of 20,000); --poll-records 256 gives the small polls of a job that keeps up.
POLL_RECORDS = 20_000
PRODUCER_ROUND_NS = 500_000_000  # the PyTorch producer's sender round (Sender flush_interval_s)
# CPU seconds: other work sharing the machine does not inflate them, as it does wall-clock
# time. The pipeline thread's own for its work (the embedded store's background merges run in
# threads of this process and must not count as engine time); the whole process's for the sink.
clock = time.thread_time
process_clock = time.process_time


def produce(ranks: int, steps: int) -> tuple[list[Message], int, float]:
    """The bus payloads of a simulated job, published as the demo's producers do with raw spans."""
    dp, pp, tp = SIZES[ranks]
    # Raw spans: this pass measures the engine's span path (the demo sends summaries now).
    cluster = SimulatedCluster(ClusterSpec(dp=dp, pp=pp, tp=tp, steps=steps, seed=1,
                                           send="spans"),
                               parse_faults(["slow-gpu:rank=5,factor=1.3"]))
    bus = MemoryBus()
    consumer = bus.consumer([EVENTS_TOPIC, METRICS_TOPIC], "bench")
    payloads: list[Message] = []
    events, end_ns = 0, 0
    for output in cluster.run():
        publish_step(bus, cluster, output, output.step == 0)
        # Drained per step, as the live pipeline polls: metrics stay next to their step.
        payloads += consumer.poll(max_records=10**9, timeout_s=0)
        events += output.span_count
        end_ns = max(r.start_ns + r.duration_ns for r in output.steps)
    return payloads, events, (end_ns - cluster.spec.start_ns) / 1e9


def polls(messages: list[Message]) -> Iterator[list[Message]]:
    """``messages`` (in the order they were published) as the consumer hands them over: polls
    of ``POLL_RECORDS``, each poll's messages partition by partition, in offset order (as
    KafkaConsumer.poll flattens the fetch's per-partition lists)."""
    for i in range(0, len(messages), POLL_RECORDS):
        yield sorted(messages[i : i + POLL_RECORDS], key=lambda m: (m.topic, m.partition))


def window_pass(messages: list[Message]) -> tuple[list, float]:
    """Decode + window + close, through the pipeline's own routing, with no detectors."""
    views: list = []
    pipeline = EmbeddedStreamJob([], window_s=15.0, on_window=lambda v, f: views.append(v))
    started = clock()
    for poll in polls(messages):
        pipeline.process_messages(poll)
    pipeline.finish()
    return views, clock() - started


def detect_and_sink(views: list, sink: ClickHouseSink) -> tuple[int, float, float]:
    runner = DetectorRunner(load().detectors)  # every built-in detector, as the pipeline runs
    detect_s = sink_s = 0.0
    summaries = 0
    for view in views:
        t0 = clock()
        findings = runner.run(view)
        detect_s += clock() - t0
        t1 = process_clock()
        sink.write_window(view, findings)
        sink_s += process_clock() - t1
        summaries += len(view.summaries)
    return summaries, detect_s, sink_s


# -- the summaries workload ------------------------------------------------------------------


@dataclass
class _Sent:
    """What one simulated rank sent about one window."""

    batch: SummaryBatch
    steps: list[StepRecord]
    metrics: list[MetricSample]


def simulate_sources(steps: int) -> tuple[dict[tuple[int, int], _Sent], list[int], float]:
    """Per (source rank, window): its summary batch, step records and condensed metrics."""
    dp, pp, tp = SOURCE
    # The raw spans, condensed below per source rank and window.
    cluster = SimulatedCluster(ClusterSpec(dp=dp, pp=pp, tp=tp, steps=steps, seed=1,
                                           send="spans"),
                               parse_faults(["slow-gpu:rank=5,factor=1.3"]))
    columns: dict[str, list[np.ndarray]] = {"rank": [], "fn": [], "start_ns": [], "dur": []}
    functions: dict[tuple[str, str], int] = {}
    steps_of: dict[tuple[int, int], list[StepRecord]] = {}
    samples: dict[tuple[int, int], list[MetricSample]] = {}
    end_ns = 0
    for output in cluster.run():
        for batch in output.spans:
            ids = np.array([functions.setdefault(f, len(functions))
                            for f in zip(batch.layers, batch.names, strict=True)])
            columns["rank"].append(batch.column("rank"))
            columns["fn"].append(ids[batch.column("fn")])
            columns["start_ns"].append(batch.column("start_ns"))
            columns["dur"].append(batch.column("duration_ns"))
        for record in output.steps:
            steps_of.setdefault((record.rank, record.start_ns // WINDOW_NS), []).append(record)
            end_ns = max(end_ns, record.start_ns + record.duration_ns)
        for sample in output.metrics:
            samples.setdefault((sample.rank, sample.ts_ns // WINDOW_NS), []).append(sample)
    rank, fn, start, dur = (np.concatenate(columns[c]) for c in ("rank", "fn", "start_ns", "dur"))
    window = start // WINDOW_NS
    names = list(functions)
    order = np.lexsort((fn, window, rank))
    rank, fn, window, dur = rank[order], fn[order], window[order], dur[order]
    cut = np.flatnonzero(np.r_[True, (np.diff(rank) != 0) | (np.diff(window) != 0), True])
    sent = {}
    for lo, hi in itertools.pairwise(cut.tolist()):
        r, w = int(rank[lo]), int(window[lo])
        durations = {}
        for f in np.unique(fn[lo:hi]):
            d = dur[lo:hi][fn[lo:hi] == f]
            layer, name = names[f]
            for j, share in enumerate(PARTS):
                durations[(layer, f"{name}/{j}", 0)] = (d * share).astype(np.int64)
        (batch,) = summary_batches(durations, job_id=cluster.spec.job_id, rank=r,
                                   window_start_ns=w * WINDOW_NS,
                                   window_end_ns=(w + 1) * WINDOW_NS)
        # The host agent's condensation of the window's NVML readings (stamped inside it).
        agent = WindowAggregator()
        agent.add(samples.get((r, w), []))
        metrics = [x for x in agent.flush(w * WINDOW_NS, (w + 1) * WINDOW_NS - 1)
                   if isinstance(x, MetricSample)]
        sent[(r, w)] = _Sent(batch, steps_of.get((r, w), []), metrics)
    windows = sorted({w for _, w in sent})
    return sent, windows, (end_ns - cluster.spec.start_ns) / 1e9


@dataclass
class Window:
    """One window's bus payloads, the topic and key each was published with (as the
    producers key them: by job and rank), and the records they hold (summary rows, step
    records, metric samples)."""

    payloads: list[bytes]
    records: int
    keys: list[tuple[str, bytes]]


class BusLog:
    """Where a run's payloads land on the bus: the partition their key picks (the bus's
    default partitions) and the next offset there; offsets go on across a run's windows, as
    they do in a partition's log."""

    def __init__(self) -> None:
        self._next: dict[tuple[str, int], int] = {}

    def messages(self, window: Window) -> list[Message]:
        out = []
        for payload, (topic, key) in zip(window.payloads, window.keys, strict=True):
            partition = partition_for(key, DEFAULT_PARTITIONS, 0)
            offset = self._next.get((topic, partition), 0)
            self._next[(topic, partition)] = offset + 1
            out.append(Message(topic, partition, offset, key, payload))
        return out


def round_step_batches(steps: list[StepRecord]) -> list[tuple[int, StepBatch]]:
    """A rank's step records as its PyTorch producer sends them: each sender round (0.5 s) the
    steps that ended in it, one step batch per round that has any, with its round."""
    rounds: dict[int, list[StepRecord]] = {}
    for step in steps:
        rounds.setdefault((step.start_ns + step.duration_ns) // PRODUCER_ROUND_NS, []).append(step)
    return [(r, StepBatch.from_records(rounds[r])) for r in sorted(rounds)]


def tiled_messages(sent: dict[tuple[int, int], _Sent], windows: list[int], ranks: int,
                   job_id: str, rows: bool = False, steps_per_round: bool = True
                   ) -> Iterator[Window]:
    """Per window, the bus payloads of a ``ranks``-rank job: per rank its summary batch and its
    step records, one per host of 8 GPUs (their condensed metrics, one metric batch), the
    topology first. ``steps_per_round``: as the PyTorch producer sends them, the steps of each
    sender round in a message of their own (:func:`round_step_batches`), in the order they
    come (round after round, every rank's in each), then the summary batches; else one message
    per rank and window holding both (what this benchmark measured until 2026-12-06, kind to
    the engine: a ninth of the messages). ``rows``: step records and metric samples one record
    each, as producers sent them before they sent batches (the same-run baseline)."""
    target = Layout(*summary_layout(ranks))
    source = Layout(*SOURCE)
    origin = []
    for r in range(ranks):
        dp_rank, pp_stage, tp_rank = target.coords(r)
        origin.append(source.rank(dp_rank % source.dp, pp_stage, tp_rank))
    step_batches = {key: (round_step_batches(s.steps) if steps_per_round
                          else [(0, StepBatch.from_records(s.steps))])
                    for key, s in sent.items() if s.steps}
    first = True
    for w in windows:
        payloads = [encode_batch([target.topology(job_id)])] if first else []
        keys = [(EVENTS_TOPIC, rank_key(job_id, 0))] if first else []
        first_window, first = first, False
        records = 0
        host_metrics: list[MetricSample] = []
        # steps_per_round: each round's step messages, with their keys
        by_round: dict[int, list[tuple[bytes, tuple[str, bytes]]]] = {}
        for r in range(ranks):
            key = (EVENTS_TOPIC, rank_key(job_id, r))
            s = sent.get((origin[r], w))
            if s is None:
                continue
            batch = msgspec.structs.replace(
                s.batch, rank=np.full(len(s.batch), r, dtype="<i4").tobytes())
            message: list[Record] = [batch]
            if rows:
                message += [msgspec.structs.replace(x, rank=r) for x in s.steps]
            elif s.steps:
                for round_index, steps in step_batches[(origin[r], w)]:
                    ranked = msgspec.structs.replace(
                        steps, rank=np.full(len(steps), r, dtype="<i4").tobytes())
                    if steps_per_round:
                        by_round.setdefault(round_index, []).append(
                            (encode_batch([ranked]), key))
                    else:
                        message.append(ranked)
            payloads.append(encode_batch(message))
            keys.append(key)
            records += len(s.batch) + len(s.steps)
            host_metrics += [msgspec.structs.replace(x, rank=r, host=target.host(r))
                             for x in s.metrics]
            if r % 8 == 7 or r == ranks - 1:
                if host_metrics:
                    payloads.append(encode_batch(
                        host_metrics if rows else [MetricBatch.from_records(host_metrics)]))
                    # The host agent's key: the job and the host's first rank.
                    keys.append((METRICS_TOPIC, rank_key(job_id, r - r % 8)))
                    records += len(host_metrics)
                host_metrics = []
        steps_first = [sent for r in sorted(by_round) for sent in by_round[r]]
        step_payloads = [payload for payload, _ in steps_first]
        step_keys = [key for _, key in steps_first]
        if first_window:  # the topology first
            yield Window(payloads[:1] + step_payloads + payloads[1:], records,
                         keys[:1] + step_keys + keys[1:])
        else:
            yield Window(step_payloads + payloads, records, step_keys + keys)


def engine_rate(window: Window, repeats: int = 1) -> float:
    """Records/s of decode + window engine + close over this window's messages, no detectors;
    the best of ``repeats`` passes (the machine is shared: the best pass is the least
    disturbed)."""
    best = 0.0
    for _ in range(repeats):
        pipeline = EmbeddedStreamJob([], window_s=WINDOW_S)
        messages = BusLog().messages(window)
        started = clock()
        for poll in polls(messages):
            pipeline.process_messages(poll)
        pipeline.finish()
        elapsed = clock() - started
        best = max(best, window.records / elapsed)
    return best


def only_summaries(window: Window) -> Window:
    """The messages' summary batches alone (no step records, no metric samples)."""
    out, keys, records = [], [], 0
    for payload, key in zip(window.payloads, window.keys, strict=True):
        batches = [r for r in decode_batch(payload) if isinstance(r, SummaryBatch)]
        if batches:
            out.append(encode_batch(batches))
            keys.append(key)
            records += sum(len(b) for b in batches)
    return Window(out, records, keys)


@dataclass
class SummaryRun:
    summaries: int = 0
    records: int = 0  # summary rows, step records and metric samples
    engine_s: float = 0.0
    detect_s: float = 0.0
    sink_s: float = 0.0
    windows: int = 0


def summaries_pass(windows: Iterator[Window], sink: ClickHouseSink) -> SummaryRun:
    """The production path; detectors + sink run on each window as it closes, timed apart."""
    run = SummaryRun()
    runner = DetectorRunner(load().detectors)  # every built-in detector, as the pipeline runs
    # What two detectors import at their first window (about 1.2 s of CPU), once per process:
    # not a cost per window, so taken before timing.
    from river import anomaly, compose, preprocessing  # noqa: F401
    from sklearn.mixture import GaussianMixture  # noqa: F401

    sink_thread_s = 0.0  # the pipeline thread's share of the sink, taken out of engine time

    def on_window(view: WindowView, _: list) -> None:
        nonlocal sink_thread_s
        t0 = clock()
        findings = runner.run(view)
        t1, p1 = clock(), process_clock()
        sink.write_window(view, findings)
        run.detect_s += t1 - t0
        run.sink_s += process_clock() - p1
        sink_thread_s += clock() - t1
        run.windows += 1

    pipeline = EmbeddedStreamJob([], window_s=WINDOW_S, on_window=on_window)
    total_s = 0.0
    log = BusLog()
    for window in windows:  # producing a window's messages is not timed
        polled = log.messages(window)
        run.records += window.records
        started = clock()
        for poll in polls(polled):
            pipeline.process_messages(poll)
        total_s += clock() - started
        # Not held while the next window's are made (1.5 GB a window at 100,000 ranks).
        del window, polled
    started = clock()
    pipeline.finish()
    total_s += clock() - started
    stats = pipeline.stats()
    if stats.decode.rejected or stats.decode.dropped or stats.window.dropped:
        raise SystemExit(f"the stream job set messages or records aside: {stats.as_dict()}")
    run.summaries = pipeline.engine.stats.summaries_received
    run.engine_s = total_s - run.detect_s - sink_thread_s
    return run


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# -- the two tables --------------------------------------------------------------------------


def span_rows(quick: bool, sink: ClickHouseSink) -> None:
    steps = {64: 200, 1024: 60} if not quick else {64: 40, 1024: 15}
    print(f"{'ranks':>6} {'events':>10} {'engine ev/s':>12} {'argsort ev/s':>13} "
          f"{'engine/argsort':>15} {'summaries':>10} {'det+sink sum/s':>15} "
          f"{'detect s':>9} {'sink s':>7} {'job s':>7} {'proc s':>7} {'x real time':>11}")
    for ranks in (64, 1024):
        payloads, events, job_s = produce(ranks, steps[ranks])
        keys = np.random.default_rng(0).integers(0, 2**40, events)
        t0 = clock()
        np.argsort(keys, kind="stable")
        argsort_s = clock() - t0
        views, engine_s = window_pass(payloads)
        summaries, detect_s, sink_s = detect_and_sink(views, sink)
        processing_s = engine_s + detect_s + sink_s
        print(f"{ranks:>6} {events:>10,} {events / engine_s:>12,.0f} "
              f"{events / argsort_s:>13,.0f} {engine_s / argsort_s:>15.1f} "
              f"{summaries:>10,} {summaries / (detect_s + sink_s):>15,.0f} "
              f"{detect_s:>9.2f} {sink_s:>7.2f} {job_s:>7.0f} {processing_s:>7.1f} "
              f"{job_s / processing_s:>11.1f}")


Workload = tuple[dict[tuple[int, int], _Sent], list[int], float]


def summary_baselines(workload: Workload, sizes: list[int], steps_per_round: bool
                      ) -> dict[int, tuple[float, float, float]]:
    """Per job size, on its first full window, records/s (best of 3 passes each): its summary
    batches alone; the whole production message as producers send it (step records and metric
    samples as batches); the same with them as rows, as producers sent them before (the
    same-run baseline). Measured before the embedded store is opened, so none of its
    background work runs."""
    sent, windows, _ = workload
    rates = {}
    for ranks in sizes:
        (window,) = itertools.islice(tiled_messages(sent, windows, ranks, "baseline",
                                                    steps_per_round=steps_per_round), 1, 2)
        (as_rows,) = itertools.islice(
            tiled_messages(sent, windows, ranks, "baseline-rows", rows=True), 1, 2)
        rates[ranks] = (engine_rate(only_summaries(window), repeats=3),
                        engine_rate(window, repeats=3), engine_rate(as_rows, repeats=3))
    return rates


def summary_rows(workload: Workload, baselines: dict[int, tuple[float, float, float]],
                 sink: ClickHouseSink, sizes: list[int], steps_per_round: bool) -> None:
    sent, windows, job_s = workload
    print(f"{'ranks':>6} {'windows':>7} {'records':>10} {'engine rec/s':>13} "
          f"{'summaries alone rec/s':>21} {'window rec/s':>12} {'rows rec/s':>11} "
          f"{'batches/rows':>12} {'detect s':>9} {'sink s':>7} {'job s':>6} {'proc s':>7} "
          f"{'x real time':>11} {'peak RSS MiB':>12}")
    for ranks in sizes:
        run = summaries_pass(tiled_messages(sent, windows, ranks, f"bench-{ranks}",
                                            steps_per_round=steps_per_round), sink)
        processing_s = run.engine_s + run.detect_s + run.sink_s
        if ranks in baselines:
            alone, batches, rows = baselines[ranks]
            rates = (f"{alone:>21,.0f} {batches:>12,.0f} {rows:>11,.0f} "
                     f"{batches / rows:>12.2f}")
        else:
            rates = f"{'-':>21} {'-':>12} {'-':>11} {'-':>12}"
        print(f"{ranks:>6} {run.windows:>7} {run.records:>10,} "
              f"{run.records / run.engine_s:>13,.0f} {rates} {run.detect_s:>9.2f} "
              f"{run.sink_s:>7.2f} {job_s:>6.0f} {processing_s:>7.1f} "
              f"{job_s / processing_s:>11.1f} {peak_rss_mib():>12,.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (smoke run)")
    parser.add_argument("--only", choices=("spans", "summaries"), help="one workload only")
    parser.add_argument("--ranks", default=",".join(str(r) for r in SUMMARY_SIZES),
                        help="job sizes of the summaries workload, comma-separated "
                             "(multiples of 16: dp x 8 stages x 2 tp)")
    parser.add_argument("--baselines-up-to", type=int, default=10240, metavar="RANKS",
                        help="one-window rates (summaries alone, whole message, rows) only for "
                             "job sizes up to this: each holds two more windows' payloads, "
                             "about 3 GB at 100,000 ranks")
    parser.add_argument("--step-messages", choices=("round", "window"), default="round",
                        help="round: each rank's step records in a message per sender round, "
                             "as the PyTorch producer sends them (default); window: with the "
                             "rank's summaries, one message per rank and window (this "
                             "benchmark's workload before 2026-12-06)")
    parser.add_argument("--poll-records", type=int, default=20_000, metavar="N",
                        help="messages per poll (default: a consumer catching up; 256: the "
                             "small polls of a job keeping up, this benchmark's polls before "
                             "2026-12-07)")
    args = parser.parse_args()
    global POLL_RECORDS  # the polls of every pass of this run
    POLL_RECORDS = args.poll_records
    steps_per_round = args.step_messages == "round"
    sizes = [int(r) for r in args.ranks.split(",")]
    for ranks in sizes:
        summary_layout(ranks)
    if hasattr(os, "sched_setaffinity"):  # the whole process, embedded store included
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    # As `trainscope pipeline` does (TRAINSCOPE_KEEP_FREED_MEMORY=0 measures without it).
    print(f"allocator keeps freed memory: {keep_freed_memory()}; step records sent per "
          f"{args.step_messages}; {POLL_RECORDS} messages a poll")
    if args.only != "spans":
        workload = simulate_sources(steps=20 if args.quick else 60)
        baselines = summary_baselines(
            workload, [r for r in sizes if r <= args.baselines_up_to], steps_per_round)
    # The embedded store may still be merging parts in its own threads when the rows are done.
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        # chDB: one store per process, shared by every row (each job has its own id).
        sink = ClickHouseSink.open(Path(tmp) / "store")
        try:
            if args.only != "summaries":
                span_rows(args.quick, sink)
            if args.only != "spans":
                summary_rows(workload, baselines, sink, sizes, steps_per_round)
        finally:
            sink.close()


if __name__ == "__main__":
    main()
