"""attach() publishes over TLS: settings in the bus URL, the key password in the environment."""

from __future__ import annotations

import logging
import time

import pytest
from kafka_tls import CLIENT_KEY_PASSWORD
from torch_producer_helpers import TinyModel, steps_of, train

from trainscope.producers.torch.control import wait_until
from trainscope.schemas.codec import decode_batch
from trainscope.transport.bus import EVENTS_TOPIC, open_bus

pytestmark = pytest.mark.kafka


def test_attach_publishes_steps_over_tls(attach, tls_kafka_broker, monkeypatch, caplog,
                                         capfd) -> None:
    monkeypatch.setenv("TRAINSCOPE_KAFKA_SSL_KEY_PASSWORD", CLIENT_KEY_PASSWORD)
    caplog.set_level(logging.DEBUG)
    job = f"tls-job-{time.monotonic_ns()}"
    att = attach(bus=tls_kafka_broker.url(), job_id=job, window_s=0.5)
    train(TinyModel(), steps=8)
    assert wait_until(lambda: att.stats()["records_sent"] >= 8, timeout_s=30), att.stats()
    att.detach()
    assert att.stats()["bus_errors"] == 0

    bus = open_bus(tls_kafka_broker.url())
    try:
        consumer = bus.consumer([EVENTS_TOPIC], f"reader-{job}")
        steps: set[int] = set()
        deadline = time.monotonic() + 20
        while len(steps) < 8 and time.monotonic() < deadline:
            for message in consumer.poll(timeout_s=0.5):
                steps.update(r.step for r in steps_of(decode_batch(message.value))
                             if r.job_id == job)
        consumer.close()
    finally:
        bus.close()
    assert steps >= set(range(8))
    out, err = capfd.readouterr()
    assert CLIENT_KEY_PASSWORD not in out + err + caplog.text


@pytest.mark.parametrize("url", ["kafka://trainer:hunter2@127.0.0.1:9093",
                                 "kafka://127.0.0.1:9093?sasl_password=hunter2"])
def test_attach_refuses_a_secret_in_the_bus_url_without_echoing_it(attach, url: str) -> None:
    with pytest.raises(ValueError) as refused:
        attach(bus=url)
    assert "hunter2" not in str(refused.value)
    assert "TRAINSCOPE_KAFKA_SASL_PASSWORD" in str(refused.value)
