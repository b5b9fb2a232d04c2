"""One outbox for every producer: through a real broker outage, the PyTorch producer and the
host agent alike never raise into their caller, keep counts that add up at every moment, drop
and count what does not fit, and deliver what they call acknowledged.

The test broker keeps everything in memory, so a restarted broker is empty: the check is that
everything acknowledged since the restart is on its topics, once, and nothing else is.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any, Protocol

import pytest
import torch

from trainscope.producers.agent.base import CollectorStats
from trainscope.producers.agent.daemon import Agent, AgentSettings
from trainscope.producers.torch import api
from trainscope.producers.torch.control import wait_until
from trainscope.schemas.codec import decode_batch
from trainscope.schemas.records import MetricSample, Record
from trainscope.schemas.summaries import summarize
from trainscope.transport.bus import EVENTS_TOPIC, METRICS_TOPIC, open_bus

pytestmark = pytest.mark.kafka

OUTAGE_S = 3.0
CAPACITY = 60  # small, so that the outage overflows it
# The PyTorch producer sends a few batches a second (its step records and window summaries
# as one batch each), the agent many more records: a smaller queue for it to overflow.
TORCH_CAPACITY = 6


class Run(Protocol):
    topics: tuple[str, ...]

    def produce(self, seconds: float) -> None: ...
    def counts(self) -> dict[str, int]: ...
    def stop(self) -> dict[str, int]: ...


class TorchRun:
    """A training loop with ``attach()``: step records and window summaries."""

    topics = (EVENTS_TOPIC,)

    def __init__(self, url: str) -> None:
        torch.set_num_threads(1)
        att = api.attach(bus=url, job_id="outbox-torch", window_s=0.5,
                         queue_size=TORCH_CAPACITY)
        assert att is not None
        self.att = att
        self.att.sender.backoff_max_s = 1.0  # see the broker come back within seconds
        self.model = torch.nn.Linear(16, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)

    def produce(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            step_started = time.monotonic()
            loss = self.model(torch.randn(8, 16)).square().mean()
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()  # raises nothing, whatever the bus does
            assert time.monotonic() - step_started < 1.0  # and never waits for it
            time.sleep(0.01)

    def counts(self) -> dict[str, int]:
        s = self.att.stats()
        assert s["errors"] == 0, s["errors_by_kind"]
        return {"submitted": s["records_submitted"], "acked": s["records_acked"],
                "dropped": s["records_dropped"], "failed": s["records_failed"],
                "queued": s["records_queued"], "in_flight": s["records_in_flight"]}

    def stop(self) -> dict[str, int]:
        self.att.detach()
        return self.counts()


class SteadyCollector:
    """Four GPUs' worth of readings and traced calls every interval."""

    name = "steady"

    def __init__(self) -> None:
        self.stats = CollectorStats()

    def start(self) -> None:
        pass

    def collect(self, window_start_ns: int, window_end_ns: int) -> list[Record]:
        out: list[Record] = []
        for rank in range(4):
            out.append(MetricSample(job_id="outbox-agent", rank=rank, device=rank,
                                    ts_ns=window_end_ns, name="sm_util_pct", value=90.0))
            out.append(summarize([1_000], job_id="outbox-agent", rank=rank, layer="cuda_api",
                                 name="cudaLaunchKernel", window_start_ns=window_start_ns,
                                 window_end_ns=window_end_ns))
        self.stats.samples += len(out)
        return out

    def stop(self, window_start_ns: int, window_end_ns: int) -> list[Record]:
        return []


class AgentRun:
    """The host agent's loop on its own thread: 8 condensed records per 0.2 s window."""

    topics = (METRICS_TOPIC, EVENTS_TOPIC)

    def __init__(self, url: str) -> None:
        self.bus = open_bus(url)
        settings = AgentSettings(interval_s=0.05, window_s=0.2, job_id="outbox-agent",
                                 queue_size=CAPACITY, close_timeout_s=10.0)
        self.agent = Agent(settings, self.bus, [SteadyCollector()])
        self.agent.outbox.backoff_max_s = 1.0
        self.agent.start()
        self.raised: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.agent.run()
        except BaseException as exc:  # the test's point: this never happens
            self.raised = exc

    def produce(self, seconds: float) -> None:
        self.thread.join(seconds)  # it produces by itself; only watch that it keeps running
        assert self.thread.is_alive() and self.raised is None

    def counts(self) -> dict[str, int]:
        s = self.agent.stats
        return {"submitted": s.records_submitted, "acked": s.records_published,
                "dropped": s.records_dropped, "failed": s.records_failed,
                "queued": s.records_queued, "in_flight": self.agent.outbox.stats()["in_flight"]}

    def stop(self) -> dict[str, int]:
        self.agent.stop()
        self.thread.join(30)
        assert not self.thread.is_alive() and self.raised is None
        self.bus.close()
        return self.counts()


def assert_adds_up(counts: dict[str, int]) -> None:
    assert counts["submitted"] == (
        counts["acked"] + counts["dropped"] + counts["failed"] + counts["queued"]
    ), counts
    assert 0 <= counts["in_flight"] <= counts["queued"] <= CAPACITY, counts


def records_on_broker(url: str, topics: tuple[str, ...]) -> Counter[str]:
    """Every record on ``topics`` (by value), read from the earliest offset until quiet."""
    bus = open_bus(url)
    seen: Counter[str] = Counter()
    try:
        consumer = bus.consumer(list(topics), "outbox-check")
        deadline = time.monotonic() + 30
        quiet_since = time.monotonic()
        while time.monotonic() < deadline:
            messages = consumer.poll(timeout_s=0.5)
            if messages:
                quiet_since = time.monotonic()
            elif seen and time.monotonic() - quiet_since > 2.0:
                break
            for message in messages:
                seen.update(repr(r) for r in decode_batch(message.value))
        consumer.close()
    finally:
        bus.close()
    return seen


@pytest.mark.parametrize("producer", [TorchRun, AgentRun], ids=["torch", "agent"])
def test_counts_add_up_and_acknowledged_records_arrive_across_an_outage(
    fresh_kafka_broker, producer: type[Any]
) -> None:
    broker = fresh_kafka_broker
    run: Run = producer(broker.url)
    try:
        run.produce(1.0)
        assert wait_until(lambda: run.counts()["acked"] > 0, timeout_s=20), run.counts()
        assert_adds_up(run.counts())

        broker.stop()
        started = time.monotonic()
        while time.monotonic() - started < OUTAGE_S:
            run.produce(0.5)
            assert_adds_up(run.counts())
        # What was in flight when the broker went is failed back to the queue once the bus
        # sees the outage (a stalled send, then a probe).
        assert wait_until(lambda: run.counts()["in_flight"] == 0, timeout_s=15), run.counts()
        down = run.counts()
        assert_adds_up(down)
        assert down["dropped"] > 0 and down["failed"] == 0, down  # the queue overflowed
        acked_before_restart = down["acked"]

        broker.start()
        assert wait_until(lambda: run.counts()["acked"] > acked_before_restart,
                          timeout_s=30), run.counts()
        run.produce(1.0)
    finally:
        final = run.stop()
    assert_adds_up(final)
    assert final["queued"] == 0 and final["failed"] == 0, final  # all acked, or dropped

    on_topic = records_on_broker(broker.url, run.topics)
    # Everything acknowledged since the restart is on the new broker, once; nothing else is.
    assert len(on_topic) == final["acked"] - acked_before_restart > 0
