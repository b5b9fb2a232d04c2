"""Producer text is data: terminals get no control character and no Rich markup from it, and a
dead letter keeps a bounded prefix of its payload with the payload's size and digest.

Over the real broker: a producer whose job id and function name hold escape sequences (clear
screen, an OSC 8 hyperlink, BEL, CR) and Rich markup publishes a job with a slow GPU, so the
function is named in a finding; a 1.5 MiB message of garbage goes to the same topic. Then
``trainscope pipeline`` (its ALERT lines), ``trainscope sql`` on its store and ``trainscope
demo`` (whose only producer text is its ``--job-id``: it runs its own simulator) print them.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from kafka_broker import TansuBroker
from pipeline_procs import PipelineProcess

from trainscope.schemas.untrusted import DEAD_LETTER_PREFIX_BYTES, terminal_safe
from trainscope.transport.bus import DEAD_LETTER_TOPIC, EVENTS_TOPIC
from trainscope.transport.kafka import KafkaBus

ESC, BEL = "\x1b", "\x07"
HOSTILE = (f"{ESC}[2J{ESC}]8;;http://evil.example/{BEL}click{ESC}]8;;{BEL}{BEL}\r"
           "[red]red[/][link=http://evil.example]x[/link]")
JOB_ID = "job-" + HOSTILE
FUNCTION = "bwd-" + HOSTILE
# What a terminal may receive: printable text, newlines and tabs.
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")

# A producer whose backward op carries the hostile name (the simulator's own producer code).
PRODUCER = r"""
import sys
from trainscope.producers.simulate import records
records._NAMES[records._FN["backward"]] = sys.argv[1]
from trainscope.cli.publish_simulated import main
sys.exit(main(sys.argv[2:]))
"""
WIDE = {**os.environ, "COLUMNS": "2000", "PYTHONUNBUFFERED": "1"}


def assert_terminal_safe(text: str, what: str) -> None:
    assert not CONTROL.findall(text), f"{what} printed control characters: {text!r}"
    # The markup is shown as it was sent, with the escapes made visible.
    assert "[red]red[/][link=http://evil.example]x[/link]" in text, text
    assert "\\x1b[2J\\x1b]8;;http://evil.example/\\x07click" in text, text


def publish_oversized(servers: str, payload: bytes) -> None:
    """Over Kafka's default 1 MiB message limit, which our bus refuses to send: a raw client."""
    from aiokafka import AIOKafkaProducer

    async def send() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=servers,
                                    max_request_size=len(payload) + 1024 * 1024)
        await producer.start()
        try:
            await producer.send_and_wait(EVENTS_TOPIC, payload, key=b"garbage")
        finally:
            await producer.stop()

    asyncio.run(send())


def dead_letters_on_topic(url: str) -> list:
    bus = KafkaBus.from_url(url)
    consumer = bus.consumer([DEAD_LETTER_TOPIC], f"check-{uuid.uuid4().hex[:8]}")
    try:
        for _ in range(50):
            letters = consumer.poll(timeout_s=0.2)
            if letters:
                return letters
        return []
    finally:
        consumer.close()
        bus.close()


@pytest.mark.kafka
def test_hostile_text_reaches_no_terminal_and_dead_letters_are_bounded(
    fresh_kafka_broker: TansuBroker, tmp_path: Path
) -> None:
    url = fresh_kafka_broker.url
    bus = KafkaBus.from_url(url)
    bus.connect([EVENTS_TOPIC, DEAD_LETTER_TOPIC])
    bus.close()
    garbage = os.urandom(1536 * 1024)  # 1.5 MiB that no decoder takes
    publish_oversized(fresh_kafka_broker.bootstrap_servers, garbage)
    done = subprocess.run(
        [sys.executable, "-c", PRODUCER, FUNCTION, "--bus", url, "--job-id", JOB_ID,
         "--dp", "4", "--pp", "2", "--tp", "1", "--steps", "48", "--seed", "3",
         "--fault", "slow-gpu:rank=5,factor=1.6"],
        capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr

    store = tmp_path / "store"
    pipeline = PipelineProcess(url, store, "text", "--close-idle-s", "3", "--idle-exit-s", "4",
                               "--no-auto-profile", logs=tmp_path / "pipeline")
    try:
        assert pipeline.wait(timeout_s=180) == 0, pipeline.err_text()
    finally:
        if pipeline.process.poll() is None:
            pipeline.kill()
    out = pipeline.out_text()
    alerts = [line for line in out.splitlines() if line.startswith("ALERT")]
    assert alerts and any(terminal_safe(FUNCTION) in line for line in alerts), out
    assert_terminal_safe(out, "trainscope pipeline")
    assert not CONTROL.findall(pipeline.err_text()), pipeline.err_text()  # its log lines
    assert pipeline.stats()["decode"]["rejected"] == 1

    # trainscope sql: the findings naming the function, and the dead letter's row.
    query = ("SELECT job_id, function, (SELECT count() FROM dead_letters) AS letters, "
             "(SELECT max(length(payload)) FROM dead_letters) AS hex_chars, "
             "(SELECT max(payload_bytes) FROM dead_letters) AS size, "
             "(SELECT any(payload_sha256) FROM dead_letters) AS digest "
             "FROM findings WHERE function LIKE 'bwd-%' LIMIT 1")
    sql = subprocess.run([sys.executable, "-m", "trainscope.cli.main", "sql", query,
                          "--store", str(store)],
                         capture_output=True, text=True, timeout=120, check=False, env=WIDE)
    assert sql.returncode == 0, sql.stderr
    assert_terminal_safe(sql.stdout, "trainscope sql")
    assert terminal_safe(JOB_ID) in sql.stdout and terminal_safe(FUNCTION) in sql.stdout
    digest = hashlib.sha256(garbage).hexdigest()
    # One row, bounded: the prefix as hex, with the whole payload's size and digest.
    row = sql.stdout.splitlines()[3]
    cells = [cell.strip() for cell in row.split("\u2502")[1:-1]]  # │ between cells
    assert cells == [terminal_safe(JOB_ID), terminal_safe(FUNCTION), "1",
                     str(2 * DEAD_LETTER_PREFIX_BYTES), str(len(garbage)), digest], row

    # The dead-letter topic got it too (it used to be over the 1 MiB limit and never did).
    (letter,) = dead_letters_on_topic(url)
    assert letter.value == garbage[:DEAD_LETTER_PREFIX_BYTES]
    key = (letter.key or b"").decode()
    assert f"payload {len(garbage)} bytes sha256:{digest}" in key, key
    assert f"(first {DEAD_LETTER_PREFIX_BYTES} kept)" in key, key


def test_demo_prints_a_hostile_job_id_as_text(tmp_path: Path) -> None:
    """The demo's producers are its own simulator: its producer text is the --job-id."""
    done = subprocess.run(
        [sys.executable, "-m", "trainscope.cli.main", "demo", "--job-id", JOB_ID, "--steps", "40",
         "--dp", "4", "--pp", "2", "--tp", "1", "--fault", "slow-gpu:rank=5,factor=1.6",
         "--no-store", "--seed", "3"],
        capture_output=True, text=True, timeout=120, check=False, env=WIDE)
    assert done.returncode == 0, done.stderr
    assert "ALERT" in done.stdout and "Prime suspect" in done.stdout, done.stdout
    assert_terminal_safe(done.stdout, "trainscope demo")
    assert not CONTROL.findall(done.stderr), done.stderr
