"""The real broker goes away mid-training and comes back: training never notices."""

from __future__ import annotations

import time

import pytest
from torch_producer_helpers import TinyModel, by_type, train

from trainscope.producers.torch.control import wait_until
from trainscope.schemas.codec import decode_batch
from trainscope.schemas.records import StepRecord
from trainscope.streams.bus import EVENTS_TOPIC, open_bus

pytestmark = pytest.mark.kafka


def _train_for(model: TinyModel, seconds: float) -> int:
    """Train in small chunks for ``seconds``; returns the number of steps run."""
    steps = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        train(model, steps=2)
        steps += 2
    return steps


def _steps_on_broker(url: str, group: str) -> set[int]:
    bus = open_bus(url)
    try:
        consumer = bus.consumer([EVENTS_TOPIC], group)
        seen: set[int] = set()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            messages = consumer.poll(timeout_s=0.5)
            if not messages and seen:
                break
            for message in messages:
                seen.update(r.step for r in by_type(decode_batch(message.value), StepRecord))
        consumer.close()
        return seen
    finally:
        bus.close()


def test_broker_stopped_mid_training_then_restarted(attach, fresh_kafka_broker) -> None:
    broker = fresh_kafka_broker
    att = attach(bus=broker.url, window_s=0.5, queue_size=200)
    # Short backoff so the test sees the reconnect within seconds, not the default 10 s cap.
    att.sender.backoff_max_s = 1.0
    model = TinyModel()

    train(model, steps=4)
    assert wait_until(lambda: att.stats()["records_sent"] >= 5, timeout_s=20), att.stats()

    broker.stop()
    outage_started = time.monotonic()
    steps_during_outage = _train_for(model, seconds=4.0)  # must not raise, must not stall
    outage_s = time.monotonic() - outage_started
    assert steps_during_outage > 20 and outage_s < 6.0
    assert wait_until(lambda: att.stats()["bus_errors"] >= 1, timeout_s=20), att.stats()
    # Fill the bounded queue while the broker is down: the excess is dropped and counted.
    while att.stats()["records_dropped"] == 0:
        train(model, steps=20)
    down = att.stats()
    assert not down["bus_up"] and down["records_queued"] <= 200

    broker.start()
    sent_before = down["records_sent"]
    assert wait_until(
        lambda: att.stats()["bus_up"] and att.stats()["records_sent"] > sent_before,
        timeout_s=30,
    ), att.stats()
    assert wait_until(lambda: att.stats()["records_queued"] == 0, timeout_s=30), att.stats()
    first_new_step = att.stats()["steps"]
    train(model, steps=6)
    assert wait_until(lambda: att.stats()["records_queued"] == 0, timeout_s=30), att.stats()
    att.detach()
    # The restarted broker is empty (memory storage): what it holds was sent after the outage,
    # including steps run after the restart.
    seen = _steps_on_broker(broker.url, "outage-check")
    assert set(range(first_new_step, first_new_step + 6)) <= seen
    final = att.stats()
    assert final["steps"] == first_new_step + 6
    assert final["records_dropped"] > 0 and final["errors_by_kind"].get("sender", 0) == 0
