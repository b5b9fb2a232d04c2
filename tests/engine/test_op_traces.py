"""What-if op traces on the bus are written to the store by the stream job, so that
``trainscope whatif --job`` analyses a job that sent its trace live: the real ST production
trace, published as ``trainscope replay optrace`` and ``attach(optrace=True)`` publish it, gives
the same what-if from the store as from its file; a bad message is a dead letter with its
reason while the others of its poll are kept; a message read twice is stored once."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pandas as pd
import pytest

from trainscope.engine import op_traces
from trainscope.engine.bus_job import BusStreamJob
from trainscope.engine.health_metrics import PREFIX, PipelineCollector
from trainscope.producers.replay.optrace import encode_optrace, read_optrace
from trainscope.schemas.optrace import (
    STORED_INT_RANGE,
    JobMeta,
    TraceError,
    load_trace,
    read_meta,
    validate,
)
from trainscope.schemas.topics import DEAD_LETTER_TOPIC, EVENTS_TOPIC, OPTRACE_TOPIC
from trainscope.schemas.whatif import (
    DDL,
    OpTraceBatch,
    OpTraceJob,
    OpTraceRecord,
    encode_records,
)
from trainscope.sinks.clickhouse import ClickHouseSink, run_query
from trainscope.transport.memory import MemoryBus
from trainscope.whatif import store as whatif_store
from trainscope.whatif.analysis import analyse
from trainscope.whatif.layout import build_layout

ST = Path(__file__).resolve().parents[1] / "data" / "stragglers-ST"


@pytest.fixture
def sink(tmp_path):
    sink = ClickHouseSink.open(tmp_path / "store")
    yield sink
    sink.close()


def _drain(pipeline: BusStreamJob) -> None:
    """Read everything, then commit: op traces are written before a commit."""
    while pipeline.poll_once(timeout_s=0.0):
        pass
    assert pipeline.commit()


def _publish(bus: MemoryBus, messages: list[tuple[bytes, bytes]]) -> None:
    for key, payload in messages:
        bus.publish(OPTRACE_TOPIC, payload, key=key)


def _what_if(frame: pd.DataFrame, meta, source: str) -> dict:
    result = analyse(build_layout(frame, meta, source)).to_dict()
    return {k: result[k] for k in ("S", "M_W", "M_S", "S_stage", "S_dp_rank", "S_worker",
                                   "steps", "workers")}


def test_the_st_trace_from_the_bus_gives_the_what_if_of_its_file(sink) -> None:
    bus = MemoryBus(partitions=4)
    job, frame = read_optrace(ST / "trace-ST.parquet", ST / "meta-ST.yaml", "ST")
    messages = encode_optrace(job, frame)
    _publish(bus, messages)
    _publish(bus, messages[:3])  # re-sent (a producer's retry, a replay): stored once
    pipeline = BusStreamJob(bus, detectors=[], sink=sink, topics=(EVENTS_TOPIC, OPTRACE_TOPIC))
    _drain(pipeline)

    stats = pipeline.stats()
    resent_ops = sum(len(msgspec.msgpack.decode(p, type=OpTraceBatch).records)
                     for _, p in messages[:3])
    assert stats.op_traces.received == stats.op_traces.emitted == len(frame) + resent_ops
    assert stats.op_traces.rejected == stats.op_traces.dropped == 0
    assert stats.decode.received == stats.decode.emitted == len(messages) + 3
    assert stats.window.received == 0  # an op trace feeds no window
    stored = run_query(sink.client, "SELECT count() FROM op_traces FINAL WHERE job_id = 'ST'")
    assert stored[1][0][0] == len(frame)

    raw, meta = whatif_store.read_trace(sink.client, "ST")
    file_meta = read_meta(ST / "meta-ST.yaml")
    assert meta == file_meta
    from_store = _what_if(validate(raw, meta, "store"), meta, "store")
    from_file = _what_if(load_trace(ST / "trace-ST.parquet", file_meta), file_meta, "file")
    assert from_store == from_file
    assert from_file["S"] > 1.0  # the trace's stragglers: a real slowdown to attribute


def _ops(job_id: str, count: int, **change) -> list[OpTraceRecord]:
    base = dict(job_id=job_id, dp_rank=0, stage=0, rank=0, step=1, optype="forward-compute",
                start_ts=10.0, duration=0.01)
    return [OpTraceRecord(**{**base, "seq_id": i, "start_ts": 10.0 + i, **change})
            for i in range(count)]


def test_bad_op_traces_are_dead_letters_with_their_reason_and_the_rest_is_kept(sink) -> None:
    bus = MemoryBus(partitions=1)
    job = OpTraceJob(job_id="J", dp_size=2, pp_size=1, world_size=2)
    good = encode_records(job, _ops("J", 4))
    bad = {
        "undecodable": b"\x93\x01\x02",
        "world size": encode_records(OpTraceJob(job_id="J", dp_size=2, pp_size=1,
                                                world_size=3), _ops("J", 1))[0][1],
        "unknown optype": encode_records(job, _ops("J", 2, optype="warp-drive"))[0][1],
        "rank range": encode_records(job, _ops("J", 2, rank=5))[0][1],
        "negative": encode_records(job, _ops("J", 2, duration=-1.0))[0][1],
        "sizes changed": encode_records(OpTraceJob(job_id="J", dp_size=1, pp_size=2,
                                                   world_size=2), _ops("J", 1))[0][1],
        "other job": encode_records(job, _ops("K", 1))[0][1],
    }
    _publish(bus, good)
    for payload in bad.values():
        bus.publish(OPTRACE_TOPIC, payload)
    _publish(bus, encode_records(job, _ops("J", 3, dp_rank=1, rank=1)))
    dead = bus.consumer([DEAD_LETTER_TOPIC], "dead")
    pipeline = BusStreamJob(bus, detectors=[], sink=sink, topics=(EVENTS_TOPIC, OPTRACE_TOPIC))
    _drain(pipeline)

    reasons = [m.key.decode(errors="replace") for m in dead.poll(max_records=100)]
    assert len(reasons) == len(bad), reasons
    expected = ["op trace:", "world_size 3 does not match", "unknown optype 'warp-drive'",
                "rank 5 (row 0) is outside 0..1", "negative duration",
                "differ from its earlier messages'", "an op of job 'K' in its message"]
    for part in expected:  # each bad message once, named by its place on the bus
        (reason,) = [r for r in reasons if part in r]
        assert reason.startswith(f"{OPTRACE_TOPIC}[0]@"), reason
    stats = pipeline.stats()
    assert stats.decode.rejected == len(bad) and stats.decode.emitted == 2
    assert stats.op_traces.emitted == 7
    assert stats.op_traces.rejected == 1 + 2 + 2 + 2 + 1 + 1  # every op of a bad message
    rows = run_query(sink.client, "SELECT dp_rank, count() FROM op_traces FINAL "
                                  "WHERE job_id = 'J' GROUP BY dp_rank ORDER BY dp_rank")[1]
    assert [tuple(r) for r in rows] == [(0, 4), (1, 3)]
    letters = run_query(sink.client, "SELECT count() FROM dead_letters")[1][0][0]
    assert letters == len(bad)
    scraped = {m.name.removeprefix(PREFIX): m.samples[0].value
               for m in PipelineCollector(pipeline).collect() if "op_trace" in m.name}
    assert scraped == {"op_trace_ops_written": 7, "op_trace_ops_rejected": 9,
                       "op_trace_ops_dropped": 0}


def test_a_store_the_pipeline_wrote_without_op_traces_says_how_to_get_one(sink) -> None:
    """The stream job makes the what-if tables with its first op trace; before, a read says
    what is missing and how a job sends it (and makes no table: it may be a read-only one)."""
    with pytest.raises(TraceError, match=r"job 'J': no op trace in the store \(a job sends one "
                                         r"with attach\(optrace=True\)"):
        whatif_store.read_trace(sink.client, "J")


def test_extreme_values_never_stop_the_stream_job(sink) -> None:
    """Values at the ends of their wire types, in fields the store narrows: each message is
    stored or a dead letter, and the job goes on to the next message."""
    bus = MemoryBus(partitions=1)
    job = OpTraceJob(job_id="X", dp_size=1, pp_size=1, world_size=1)
    extremes = [dict(rank=2**63 - 1), dict(rank=-(2**63)), dict(dp_rank=2**40),
                dict(seq_id=2**62), dict(step=2**64 - 1), dict(start_ts=float("inf")),
                dict(duration=float("nan")), dict(mb_id=-(2**63)), dict(optype="")]
    huge = OpTraceJob(job_id="X", dp_size=2**40, pp_size=1, world_size=2**40)
    for change in extremes:
        bus.publish(OPTRACE_TOPIC, encode_records(job, _ops("X", 1, **change))[0][1])
    bus.publish(OPTRACE_TOPIC, encode_records(huge, _ops("X", 1))[0][1])
    _publish(bus, encode_records(job, _ops("X", 2)))
    pipeline = BusStreamJob(bus, detectors=[], sink=sink, sink_retry_s=5.0,
                            topics=(EVENTS_TOPIC, OPTRACE_TOPIC))
    _drain(pipeline)
    stats = pipeline.stats()
    # Each one a dead letter: none narrowed into another value, none failing the write.
    assert stats.decode.received == len(extremes) + 2
    assert stats.decode.rejected == len(extremes) + 1 and stats.decode.emitted == 1
    assert stats.op_traces.emitted == 2 and stats.op_traces.dropped == 0
    assert stats.sink_retries == 0 and not pipeline.write_failed
    stored = run_query(sink.client, "SELECT rank, step, seq_id FROM op_traces FINAL "
                                    "WHERE job_id = 'X' ORDER BY seq_id")[1]
    assert [tuple(r) for r in stored] == [(0, 1, 0), (0, 1, 1)]


def test_the_checked_ranges_are_the_stored_columns_types() -> None:
    declared = dict(re.findall(r"`(\w+)` (Int32|Int64)", DDL["op_traces"]))
    kinds = {(-(2**31), 2**31 - 1): "Int32", (-(2**63), 2**63 - 1): "Int64"}
    assert {c: kinds[r] for c, r in STORED_INT_RANGE.items()} == declared


def _stored_ops(sink: ClickHouseSink) -> int:
    if not run_query(sink.client, "EXISTS TABLE op_traces")[1][0][0]:
        return 0  # made with the first op trace written
    return run_query(sink.client, "SELECT count() FROM op_traces")[1][0][0]


def test_op_traces_are_written_before_a_commit_not_with_every_poll(sink, monkeypatch) -> None:
    """A large job sends op traces all the time: a write per poll would give the store tens of
    small inserts a second. They wait for the next commit (whose positions cover them), or
    until ``MAX_PENDING_OPS`` wait."""
    bus = MemoryBus(partitions=1)
    job = OpTraceJob(job_id="P", dp_size=1, pp_size=1, world_size=1)
    pipeline = BusStreamJob(bus, detectors=[], sink=sink, commit_interval_s=3600.0,
                            topics=(EVENTS_TOPIC, OPTRACE_TOPIC))
    for step in range(3):
        _publish(bus, encode_records(job, _ops("P", 2, step=step)))
        assert pipeline.poll_once(timeout_s=0.0) == 1
    assert _stored_ops(sink) == 0 and pipeline.stats().op_traces.emitted == 0
    assert pipeline.commit()
    assert _stored_ops(sink) == 6 and pipeline.stats().op_traces.emitted == 6

    monkeypatch.setattr(op_traces, "MAX_PENDING_OPS", 4)
    _publish(bus, encode_records(job, _ops("P", 2, step=3)))
    pipeline.poll_once(timeout_s=0.0)
    assert _stored_ops(sink) == 6  # 2 wait
    _publish(bus, encode_records(job, _ops("P", 2, step=4)))
    pipeline.poll_once(timeout_s=0.0)
    assert _stored_ops(sink) == 10  # 4 waited: written without a commit


def test_two_jobs_in_one_poll_are_stored_apart_with_their_own_sizes(sink) -> None:
    bus = MemoryBus(partitions=2)
    a = OpTraceJob(job_id="A", dp_size=2, pp_size=1, world_size=2)
    b = OpTraceJob(job_id="B", dp_size=1, pp_size=2, world_size=2)
    for step in range(2):  # interleaved, as two jobs' ranks publish them
        _publish(bus, encode_records(a, _ops("A", 2, step=step, dp_rank=1, rank=1)))
        _publish(bus, encode_records(b, _ops("B", 3, step=step, stage=1, rank=1)))
    pipeline = BusStreamJob(bus, detectors=[], sink=sink, topics=(EVENTS_TOPIC, OPTRACE_TOPIC))
    _drain(pipeline)
    assert pipeline.stats().op_traces.emitted == 10
    for job, ops, meta in ((a, 4, JobMeta(dp_size=2, pp_size=1, world_size=2)),
                           (b, 6, JobMeta(dp_size=1, pp_size=2, world_size=2))):
        raw, stored_meta = whatif_store.read_trace(sink.client, job.job_id)
        assert len(raw) == ops and stored_meta == meta
