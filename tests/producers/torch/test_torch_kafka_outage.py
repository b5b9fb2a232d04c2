"""The real broker goes away mid-training and comes back: training never notices, and the
producer's counters tell the truth.

"Acked" means the broker acknowledged it. The test broker keeps everything in memory, so a
restarted broker is empty: what was acked before the outage is gone with the old process, and
the check is that everything acked since then is on the new broker's topic, and that the
counters add up at every point.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from kafka_broker import TansuBroker, free_port
from slow_proxy import SlowProxy
from torch_producer_helpers import TinyModel, steps_of, train

from trainscope.producers.torch.control import wait_until
from trainscope.schemas.codec import decode_batch
from trainscope.transport.bus import EVENTS_TOPIC, open_bus

pytestmark = pytest.mark.kafka


def _train_for(model: TinyModel, seconds: float) -> int:
    """Train in small chunks for ``seconds``; returns the number of steps run."""
    steps = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        train(model, steps=2)
        steps += 2
    return steps


QUEUE = 6  # records (batches) the producer holds for the bus


def _records_on_broker(url: str, group: str) -> tuple[Counter[str], set[int]]:
    """Every record on the events topic (by value), read from the earliest offset, and the
    steps of the step records among them."""
    bus = open_bus(url)
    seen: Counter[str] = Counter()
    steps: set[int] = set()
    try:
        consumer = bus.consumer([EVENTS_TOPIC], group)
        deadline = time.monotonic() + 30
        quiet_since = time.monotonic()
        while time.monotonic() < deadline:
            messages = consumer.poll(timeout_s=0.5)
            if messages:
                quiet_since = time.monotonic()
            elif seen and time.monotonic() - quiet_since > 2.0:
                break
            for message in messages:
                records = decode_batch(message.value)
                seen.update(repr(r) for r in records)
                steps.update(r.step for r in steps_of(records))
        consumer.close()
    finally:
        bus.close()
    return seen, steps


def assert_counts_add_up(stats: dict[str, Any]) -> None:
    assert stats["records_sent"] == (
        stats["records_acked"] + stats["records_send_failures"] + stats["records_in_flight"]
    ), stats
    assert stats["records_submitted"] == (
        stats["records_acked"] + stats["records_dropped"] + stats["records_failed"]
        + stats["records_queued"]
    ), stats


@pytest.mark.parametrize("outage_s", [3.0, 15.0])
def test_after_an_outage_everything_acked_is_on_the_topic(attach, fresh_kafka_broker, caplog,
                                                          outage_s: float) -> None:
    broker = fresh_kafka_broker
    caplog.set_level(logging.WARNING)
    # Step records and summaries go as a few batches a second: a queue the outage overflows.
    att = attach(bus=broker.url, window_s=0.5, queue_size=QUEUE)
    # Short backoff so the test sees the reconnect within seconds, not the default 10 s cap.
    att.sender.backoff_max_s = 1.0
    model = TinyModel()

    train(model, steps=4)
    assert wait_until(lambda: att.stats()["records_acked"] >= 2, timeout_s=20), att.stats()
    assert_counts_add_up(att.stats())

    broker.stop()
    started = time.monotonic()
    steps_during_outage = 0
    while time.monotonic() - started < outage_s:
        chunk_started = time.monotonic()
        steps_during_outage += _train_for(model, seconds=0.5)
        assert time.monotonic() - chunk_started < 1.5  # training never stalls on the bus
        assert_counts_add_up(att.stats())
    assert steps_during_outage > 20
    # What was in flight when the broker went is failed back to the queue once the bus sees
    # the outage (a stalled send, then a probe): seconds on a loaded machine.
    assert wait_until(lambda: att.stats()["records_in_flight"] == 0, timeout_s=15), att.stats()
    down = att.stats()
    assert not down["bus_up"] and down["records_in_flight"] == 0, down
    assert down["records_queued"] <= QUEUE and down["records_dropped"] > 0
    acked_before_restart = down["records_acked"]

    broker.start()
    assert wait_until(lambda: att.stats()["records_acked"] > acked_before_restart,
                      timeout_s=30), att.stats()
    first_new_step = att.stats()["steps"]
    train(model, steps=6)
    assert wait_until(
        lambda: (s := att.stats())["records_queued"] == 0 and s["records_in_flight"] == 0,
        timeout_s=30,
    ), att.stats()
    att.detach()
    final = att.stats()
    assert_counts_add_up(final)
    assert final["records_failed"] == 0 and final["records_send_failures"] > 0
    assert final["records_resent"] == final["records_send_failures"]  # each went again
    assert final["errors_by_kind"].get("sender", 0) == 0

    on_topic, steps = _records_on_broker(broker.url, "outage-check")
    acked_since_restart = final["records_acked"] - acked_before_restart
    # Everything acked since the old broker died is on the new one, and nothing else is.
    assert len(on_topic) == acked_since_restart > 0
    assert set(range(first_new_step, first_new_step + 6)) <= steps

    # The outage was logged once, its end once; aiokafka said nothing.
    assert not [r for r in caplog.records if r.name.startswith("aiokafka")]
    messages = [r.getMessage() for r in caplog.records]
    assert sum("cannot reach Kafka" in m for m in messages) == 1, messages
    assert sum("reachable again" in m for m in messages) == 1, messages
    assert len(messages) <= 5, messages  # + the queue filled, + the summary of drops


def test_a_slow_broker_gets_everything_once_and_the_counts_say_so(attach) -> None:
    """Every reply from the broker takes 0.4 s: slow, not down. Nothing is re-sent."""
    proxy_port = free_port()
    broker = TansuBroker(advertised_port=proxy_port)
    with broker, SlowProxy(broker.port, delay_s=0.4, port=proxy_port):
        att = attach(bus=f"kafka://127.0.0.1:{proxy_port}", window_s=0.5, queue_size=5000)
        model = TinyModel()
        for _ in range(6):
            train(model, steps=5)
            time.sleep(0.5)
        assert wait_until(
            lambda: (s := att.stats())["records_queued"] == 0 and s["records_in_flight"] == 0,
            timeout_s=90,
        ), att.stats()
        att.detach()
        final = att.stats()
        assert_counts_add_up(final)
        assert final["records_send_failures"] == 0 and final["records_resent"] == 0, final
        assert final["records_dropped"] == 0 and final["records_acked"] > 5
        on_topic, steps = _records_on_broker(f"kafka://127.0.0.1:{broker.port}", "slow-check")
    assert sum(on_topic.values()) == len(on_topic) == final["records_acked"]  # no duplicates
    assert set(range(30)) <= steps


def test_a_script_that_never_detaches_sends_everything_before_it_exits(fresh_kafka_broker,
                                                                       tmp_path) -> None:
    """The README's script calls attach() and never detach(): its last steps and its open
    windows are sent as the process exits."""
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(
        "import sys, torch, trainscope\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from torch_producer_helpers import TinyModel, train\n"
        "trainscope.attach(job_id='no-detach', window_s=60.0)\n"
        "train(TinyModel(), steps=37)\n")
    env = {**__import__("os").environ, "TRAINSCOPE_BUS": fresh_kafka_broker.url}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    seen, steps = _records_on_broker(fresh_kafka_broker.url, "no-detach-reader")
    assert steps == set(range(37)), sorted(steps)
    assert any(r.startswith("SummaryBatch(") for r in seen), list(seen)[:5]
