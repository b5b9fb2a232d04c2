"""The PyFlink windowing tier as a process of its own, and what the tests read back from the bus.

The Flink job runs in its own environment (``infra/setup-flink-env.sh``); where that is missing
the tests fail in CI and are skipped elsewhere, saying why.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from pipeline_procs import PipelineProcess, publish

from trainscope.cli.stream_flink import default_flink_python
from trainscope.transport.bus import Message, open_bus


def flink_python_or_skip() -> Path:
    python = default_flink_python()
    if not python.exists():
        reason = (f"no Flink environment at {python}: infra/setup-flink-env.sh makes it "
                  "(setup-test-host.sh runs it in CI)")
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return python


def seal(bootstrap_servers: str, topic: str) -> None:
    """Append an empty JSON batch to every partition of ``topic``, flushed on its own.

    The test broker (Tansu) reports a partition's latest offset as the first offset of its last
    record batch, so a bounded Flink job (``scan.bounded.mode = latest-offset``) would stop
    before the last batch's messages; after this, the last batch is the empty one. Harmless for
    every consumer: a batch of no records. A Kafka broker needs none of it."""
    from aiokafka import AIOKafkaProducer

    async def send() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap_servers)
        await producer.start()
        try:
            for partition in sorted(await producer.partitions_for(topic)):
                await producer.send_and_wait(topic, b'{"type":"batch"}', partition=partition)
        finally:
            await producer.stop()

    asyncio.run(send())


def publish_raw(bootstrap_servers: str, topic: str, payloads: list[bytes]) -> None:
    from aiokafka import AIOKafkaProducer

    async def send() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap_servers)
        await producer.start()
        try:
            for payload in payloads:
                await producer.send_and_wait(topic, payload, key=b"bad")
        finally:
            await producer.stop()

    asyncio.run(send())


def run_flink(url: str, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    """``trainscope stream flink --bounded`` to the end of what is on the bus."""
    return subprocess.run(
        [sys.executable, "-m", "trainscope.cli.main", "stream", "flink", "--bus", url, "--bounded",
         *args],
        capture_output=True, text=True, timeout=timeout_s, check=False,
    )


def read_topic(url: str, topic: str, idle_s: float = 3.0) -> list[Message]:
    """Every message on ``topic``, read by a group of its own until ``idle_s`` brings nothing."""
    bus = open_bus(url)
    consumer = bus.consumer([topic], f"reader-{uuid.uuid4().hex}")
    messages: list[Message] = []
    quiet_since = time.monotonic()
    try:
        while time.monotonic() - quiet_since < idle_s:
            got = consumer.poll(max_records=10_000, timeout_s=0.5)
            if got:
                messages += got
                quiet_since = time.monotonic()
    finally:
        consumer.close()
        bus.close()
    return messages


_SUMMARIES = r"""
import json, sys
from trainscope.sinks.clickhouse import connect
client = connect(sys.argv[1])
rows = client.query(
    "SELECT job_id, rank, layer, name, callpath_id, window_start_ns, count, total_ns, min_ns, "
    "max_ns, bytes_total, sketch_keys, sketch_counts FROM function_summaries FINAL").result_rows
findings = client.query("SELECT job_id, rank, category, function, detector FROM findings FINAL"
                        ).result_rows
steps = client.query("SELECT count() FROM step_records FINAL").result_rows[0][0]
print(json.dumps({"summaries": [list(map(lambda v: v if isinstance(v, (int, str, list)) else
                                         int(v), r)) for r in rows],
                  "findings": [list(r) for r in findings], "steps": steps}))
"""


def read_store(store: Path) -> dict:
    """Function summaries (one row per job, rank, function, call path and window), findings and
    the number of step records of a pipeline's store."""
    done = subprocess.run([sys.executable, "-c", _SUMMARIES, str(store)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


# Every 7th message is sent twice, as a producer re-sending after a timeout does: both engines
# must read it once.
JOB = ["--job-id", "flink-job", "--dp", "4", "--pp", "2", "--tp", "2", "--steps", "60",
       "--start-s", "1767225600", "--spans", "--fault", "slow-gpu:rank=5,factor=1.4",
       "--resend-every", "7"]
QUANTILES = (0.5, 0.9, 0.99)


def publish_json(url: str, *args: str) -> dict:
    os.environ["TRAINSCOPE_WIRE"] = "json"
    try:
        return publish(url, *args)
    finally:
        del os.environ["TRAINSCOPE_WIRE"]


def detect(url: str, store: Path, group: str, *args: str, logs: Path) -> dict:
    pipeline = PipelineProcess(url, store, group, "--close-idle-s", "2", "--idle-exit-s", "4",
                               "--no-auto-profile", *args, logs=logs)
    assert pipeline.wait() == 0, pipeline.err_text()
    assert "Traceback" not in pipeline.err_text()
    return pipeline.stats()


def by_key(rows: list[list]) -> dict[tuple, list]:
    """Summary rows by (job, rank, layer, name, call path, window)."""
    keyed = {tuple(r[:6]): r[6:] for r in rows}
    assert len(keyed) == len(rows), "a function's window is stored twice"
    return keyed
