"""One record of every kind, for the wire-format tests (msgpack and JSON alike)."""

from __future__ import annotations

from trainscope.schemas import (
    ControlMessage,
    Finding,
    FunctionSummary,
    MetricSample,
    SpanBatch,
    SpanEvent,
    StepRecord,
    Topology,
    WorkerInfo,
)


def sample_records() -> list:
    events = [
        SpanEvent(job_id="j", rank=r, layer="torch_op", name="forward", start_ns=10 * r,
                  duration_ns=5 + r, step=1, bytes_moved=r, callpath_id=7)
        for r in range(4)
    ]
    return [
        Topology(job_id="j", dp_size=2, tp_size=2, workers=[WorkerInfo(rank=0, host="h")]),
        SpanBatch.from_events(events, host="h"),
        StepRecord(job_id="j", rank=1, step=3, start_ns=1, duration_ns=2, tokens=4096),
        MetricSample(job_id="j", rank=1, ts_ns=5, name="sm_clock_mhz", value=1980.0),
        FunctionSummary(job_id="j", rank=1, layer="gc", name="gc.collect", window_start_ns=0,
                        window_end_ns=10, count=1, total_ns=3, min_ns=3, max_ns=3,
                        sketch_keys=[55], sketch_counts=[1]),
        Finding(job_id="j", window_start_ns=0, window_end_ns=10, detector="d", rank=1,
                category="gpu-compute", score=0.9, evidence={"z": 9.0}, message="m"),
        ControlMessage(job_id="j", action="profile", rank=1, steps=5),
    ]
