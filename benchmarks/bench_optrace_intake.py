"""What storing what-if op traces costs the stream job: ops taken in, validated and written per
CPU-second, against decoding the same messages alone (the floor) in the same run.

A job of ``--ranks`` data-parallel ranks sends ``--steps`` steps of five ops per rank (forward,
backward, the gradient all-reduce, the optimizer, a second micro-batch's forward), one message
per rank, as ``attach(optrace=True)`` sends them every 50 steps. The stream job reads them from
the in-memory bus and writes them to a fresh embedded store (``trainscope pipeline``'s path,
``trainscope/engine/op_traces.py``). One pinned core, CPU seconds.

    python benchmarks/bench_optrace_intake.py [--ranks 1000] [--steps 50] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from trainscope.engine.bus_job import BusStreamJob
from trainscope.schemas.topics import EVENTS_TOPIC, OPTRACE_TOPIC
from trainscope.schemas.whatif import OpTraceJob, OpTraceRecord, decode_optrace, encode_records
from trainscope.sinks.clickhouse import ClickHouseSink
from trainscope.transport.memory import MemoryBus

OPS = ("forward-compute", "backward-compute", "separate-grads-all-reduce", "optimizer",
       "forward-compute")


def job_messages(ranks: int, steps: int) -> list[tuple[bytes, bytes]]:
    job = OpTraceJob(job_id="bench", dp_size=ranks, pp_size=1, world_size=ranks)
    records = [
        OpTraceRecord(job_id="bench", dp_rank=rank, stage=0, rank=rank, step=step, optype=op,
                      start_ts=step + i * 0.01, duration=0.01, seq_id=i, mb_id=i // 2)
        for rank in range(ranks) for step in range(steps) for i, op in enumerate(OPS)
    ]
    return encode_records(job, records)


def decode_only_s(messages: list[tuple[bytes, bytes]]) -> float:
    started = time.process_time()
    for _, payload in messages:
        decode_optrace(payload)
    return time.process_time() - started


def stream_job_s(messages: list[tuple[bytes, bytes]], store: Path) -> tuple[float, int]:
    bus = MemoryBus(partitions=8)
    for key, payload in messages:
        bus.publish(OPTRACE_TOPIC, payload, key=key)
    sink = ClickHouseSink.open(store)
    try:
        job = BusStreamJob(bus, detectors=[], sink=sink, commit_interval_s=3600.0,
                           topics=(EVENTS_TOPIC, OPTRACE_TOPIC))
        started = time.process_time()
        while job.poll_once(timeout_s=0.0):
            pass
        job.commit()
        spent = time.process_time() - started
        return spent, job.stats().op_traces.emitted
    finally:
        sink.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpu", type=int, default=0, help="the core to pin to")
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.cpu})
    messages = job_messages(args.ranks, args.steps)
    ops = args.ranks * args.steps * len(OPS)
    decode, stream = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            decode.append(decode_only_s(messages))
            spent, written = stream_job_s(messages, Path(tmp) / f"store-{round_}")
            assert written == ops, (written, ops)
            stream.append(spent)
    decode_s, stream_s = statistics.median(decode), statistics.median(stream)
    print(f"{args.ranks:,} ranks x {args.steps} steps: {len(messages):,} messages, {ops:,} ops; "
          f"median of {args.rounds} rounds, CPU s")
    print(f"  decode alone        {decode_s:6.3f} s  {ops / decode_s:12,.0f} ops/s")
    print(f"  stream job + store  {stream_s:6.3f} s  {ops / stream_s:12,.0f} ops/s  "
          f"({stream_s / decode_s:.1f}x decode alone)")


if __name__ == "__main__":
    main()
