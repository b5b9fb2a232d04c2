"""The pipeline on the in-memory bus: bad messages are counted and set aside, not fatal."""

from __future__ import annotations

from trainscope.cli.demo_job import publish_step
from trainscope.detectors.peer import PeerDiffDetector
from trainscope.engine.bus_job import BusStreamJob
from trainscope.producers.simulate import ClusterSpec, SimulatedCluster, parse_faults
from trainscope.transport.bus import DEAD_LETTER_TOPIC, EVENTS_TOPIC
from trainscope.transport.memory import MemoryBus


def test_corrupted_message_is_rejected_counted_and_dead_lettered() -> None:
    bus = MemoryBus()
    cluster = SimulatedCluster(ClusterSpec(dp=4, pp=1, tp=1, steps=40, seed=3, window_s=5.0),
                               parse_faults(["dataloader-stall:rank=2,ms=300"]))
    pipeline = BusStreamJob(bus, detectors=[PeerDiffDetector()], window_s=5.0)
    published = 0
    for output in cluster.run():
        published += publish_step(bus, cluster, output, output.step == 0)
        if output.step == 10:
            bus.publish(EVENTS_TOPIC, b"\x93not-a-batch")
            bus.publish(EVENTS_TOPIC, b"\x81\xa7records\x91\x81\xa4type\xa4step")
        pipeline.poll_once(timeout_s=0.0)
    while pipeline.poll_once(timeout_s=0.0):
        pass
    pipeline.finish()
    stats = pipeline.stats()
    assert stats.decode.received == published + 2
    assert stats.decode.rejected == 2
    assert bus.message_count(DEAD_LETTER_TOPIC) == 2
    # The stream went on: the stalled rank is still found after the bad messages.
    assert any(f.rank == 2 and f.category == "dataloader" for f in pipeline.findings
               if f.window_start_ns > cluster.spec.start_ns + 15 * 10**9)
