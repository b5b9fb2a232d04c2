"""Kafka over real TLS (stunnel in front of the test broker, client certificates required).

The bus, the pipeline (through the demo and ``trainscope pipeline``) publish and consume through
the TLS endpoint with settings from the URL and the key password from the environment. A wrong
CA fails with one line that names the CA file, and the key password shows up nowhere.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import uuid

import pytest
from kafka_tls import CLIENT_KEY_PASSWORD, tls_env

from trainscope.transport.bus import BusError, open_bus

pytestmark = pytest.mark.kafka


def trainscope(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainscope.cli.main", *args], capture_output=True,
                          text=True, timeout=timeout_s, check=False,
                          env={**os.environ, **tls_env()})


def test_bus_publishes_and_consumes_over_tls(tls_kafka_broker, monkeypatch, caplog) -> None:
    monkeypatch.setenv("TRAINSCOPE_KAFKA_SSL_KEY_PASSWORD", CLIENT_KEY_PASSWORD)
    caplog.set_level(logging.DEBUG)
    topic = f"tls-{uuid.uuid4().hex[:8]}"
    bus = open_bus(tls_kafka_broker.url())
    try:
        assert "SSL, CA file" in repr(bus) and CLIENT_KEY_PASSWORD not in repr(bus)
        for i in range(50):
            bus.publish(topic, f"m{i}".encode(), key=b"k")
        bus.flush(timeout_s=30)
        consumer = bus.consumer([topic], "tls-reader")
        seen: list[bytes] = []
        deadline = time.monotonic() + 30
        while len(seen) < 50 and time.monotonic() < deadline:
            seen += [m.value for m in consumer.poll(timeout_s=0.5)]
        consumer.close()
    finally:
        bus.close()
    assert seen == [f"m{i}".encode() for i in range(50)]
    assert bus.counts["delivered"] == 50
    assert CLIENT_KEY_PASSWORD not in caplog.text


def test_wrong_ca_fails_with_one_line_that_names_the_ca(tls_kafka_broker, monkeypatch,
                                                       caplog) -> None:
    monkeypatch.setenv("TRAINSCOPE_KAFKA_SSL_KEY_PASSWORD", CLIENT_KEY_PASSWORD)
    caplog.set_level(logging.DEBUG)
    wrong = tls_kafka_broker.pki.wrong_ca
    bus = open_bus(tls_kafka_broker.url(ca=wrong))
    try:
        with pytest.raises(BusError) as failure:
            bus.connect(timeout_s=20)
    finally:
        bus.close()
    text = str(failure.value)
    port = tls_kafka_broker.tls_port
    assert "\n" not in text
    assert f"Kafka TLS handshake with 127.0.0.1:{port} failed: certificate verify failed" in text
    assert f"(CA file {wrong})" in text
    assert CLIENT_KEY_PASSWORD not in text + caplog.text


def test_pipeline_cli_with_wrong_ca_prints_one_line_and_no_secret(tls_kafka_broker,
                                                                  tmp_path) -> None:
    url = tls_kafka_broker.url(ca=tls_kafka_broker.pki.wrong_ca)
    done = trainscope("pipeline", "--bus", url, "--store", str(tmp_path / "store"),
                      "--idle-exit-s", "1", timeout_s=120)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("Error: cannot reach Kafka at 127.0.0.1:")
    assert "certificate verify failed" in lines[0] and "wrong-ca.pem" in lines[0]
    assert CLIENT_KEY_PASSWORD not in done.stdout + done.stderr


@pytest.mark.slow
def test_demo_publishes_and_the_pipeline_consumes_over_tls(tls_kafka_broker, tmp_path) -> None:
    store = tmp_path / "store"
    done = trainscope("demo", "--bus", tls_kafka_broker.url(), "--store", str(store),
                      "--ranks", "8", "--dp", "2", "--pp", "2", "--tp", "2", "--steps", "40",
                      "--fault", "slow-gpu:rank=5,factor=1.5", "--json",
                      "--start-s", "1767225600", "--job-id", f"tls-{uuid.uuid4().hex[:6]}")
    assert done.returncode == 0, done.stderr
    assert CLIENT_KEY_PASSWORD not in done.stdout + done.stderr
    result = json.loads(done.stdout)
    assert result["events"] > 0 and result["windows"] >= 2
    assert result["findings"][0]["rank"] == 5


def test_tls_settings_from_the_environment_alone(tls_kafka_broker, monkeypatch) -> None:
    pki = tls_kafka_broker.pki
    for name, value in {"TRAINSCOPE_KAFKA_SSL_CAFILE": pki.ca,
                        "TRAINSCOPE_KAFKA_SSL_CERTFILE": pki.client_cert,
                        "TRAINSCOPE_KAFKA_SSL_KEYFILE": pki.client_key,
                        "TRAINSCOPE_KAFKA_SSL_KEY_PASSWORD": CLIENT_KEY_PASSWORD}.items():
        monkeypatch.setenv(name, str(value))
    topic = f"tls-env-{uuid.uuid4().hex[:8]}"
    bus = open_bus(f"kafka://127.0.0.1:{tls_kafka_broker.tls_port}")  # SSL inferred
    try:
        bus.connect([topic], timeout_s=20)
        bus.publish(topic, b"hello", key=b"k")
        bus.flush(timeout_s=20)
        consumer = bus.consumer([topic], "tls-env-reader")
        seen: list[bytes] = []
        deadline = time.monotonic() + 20
        while not seen and time.monotonic() < deadline:
            seen += [m.value for m in consumer.poll(timeout_s=0.5)]
        consumer.close()
    finally:
        bus.close()
    assert seen == [b"hello"]
