"""The stream job's own metrics, read from the collector as a scrape of ``/metrics`` reads
them (the endpoint itself, over HTTP, is tested with ``trainscope pipeline`` as its own process
in tests/sinks/test_pipeline_health.py)."""

from __future__ import annotations

import numpy as np

from trainscope.engine.embedded_job import EmbeddedStreamJob
from trainscope.engine.health_metrics import PREFIX, PipelineCollector
from trainscope.schemas import SpanBatch
from trainscope.schemas.codec import encode_stamped
from trainscope.transport.bus import Message

S = 10**9
T0_NS = 1_767_225_600 * S


def spans(rank: int, start_ns: int) -> SpanBatch:
    return SpanBatch.from_arrays(
        job_id="job", layers=["torch_op"], names=["forward"], rank=np.full(4, rank),
        fn=np.zeros(4), step=np.zeros(4), start_ns=start_ns + np.arange(4) * 1000,
        duration_ns=np.full(4, 500), bytes_moved=np.zeros(4))


def gauge(collector: PipelineCollector, name: str) -> float:
    [family] = [m for m in collector.collect() if m.name == PREFIX + name]
    [sample] = family.samples
    return sample.value


def test_the_stamps_kept_gauge_follows_the_open_windows_batches() -> None:
    job = EmbeddedStreamJob(detectors=[], window_s=1.0, lateness_s=0.0)
    collector = PipelineCollector(job)
    assert gauge(collector, "stamps_kept") == 0
    offset = 0
    for half in range(8):  # 4 windows, 3 producers sending twice a window
        job.process_messages([
            Message("events", 0, offset + rank, None,
                    encode_stamped([spans(rank, T0_NS + half * S // 2)], rank + 1, half + 1))
            for rank in range(3)])
        offset += 3
        assert gauge(collector, "stamps_kept") == len(job.seen) > 0
    assert len(job.seen) <= 3 * 2 * 3  # the windows open and the one before them, not all 24
    job.finish()  # every window closed: only the last one's batches wait for the one after
    assert gauge(collector, "stamps_kept") == 3 * 2
