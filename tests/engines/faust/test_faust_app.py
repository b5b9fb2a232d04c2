"""The Faust app against the embedded engine, over the real broker: same recorded jobs, same
tables, same findings — with two workers, and with one of them SIGKILLed mid-job."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer
from faust_procs import IDLE, FaustWorker, uncommitted
from flink_procs import publish_raw, read_topic
from kafka_broker import TansuBroker
from pipeline_procs import (
    TABLES,
    PipelineProcess,
    dump_tables,
    publish,
    start_publisher,
    what_if,
)

from trainscope.schemas.codec import decode_envelope
from trainscope.schemas.topics import DEAD_LETTER_TOPIC, EVENTS_TOPIC, METRICS_TOPIC

# Four jobs whose keys hash to the four partitions of the repartition topic (Kafka's murmur2),
# so that however two workers split them, both get work. A slow GPU in one of them.
JOBS = [
    ["--job-id", f"job-{n}", "--dp", "2", "--pp", "2", "--tp", "2", "--steps", "120",
     "--seed", str(n), *(["--fault", "slow-gpu:rank=3,factor=1.5"] if n == 2 else [])]
    for n in (0, 1, 2, 4)
]
def union(stores: list[Path]) -> dict[str, list[str]]:
    """Every table's rows over the workers' stores, sorted. Each worker owns a chDB store of
    its own; with one shared ClickHouse server, ``FINAL`` would merge a window that two
    workers wrote. Here only rows identical to the byte merge: a rebuilt window that differed
    from its first writing would show up twice and fail the comparison."""
    merged: dict[str, list[str]] = {}
    for store in stores:
        for table, rows in dump_tables(store).items():
            merged.setdefault(table, []).extend(rows)
    return {table: sorted(set(rows)) if table.endswith(" FINAL") else sorted(rows)
            for table, rows in merged.items()}


def embedded(url: str, tmp_path: Path) -> dict[str, list[str]]:
    p = PipelineProcess(url, tmp_path / "embedded", "embedded", "--commit-interval-s", "0.5",
                        *IDLE, logs=tmp_path / "embedded")
    assert p.wait() == 0, p.err_text()
    assert p.stats()["window"]["dropped"] == 0
    return {table: sorted(rows) for table, rows in dump_tables(tmp_path / "embedded").items()}


def assert_same_tables(expected: dict[str, list[str]], got: dict[str, list[str]]) -> None:
    assert expected["function_summaries"] and expected["findings"], "the reference wrote nothing"
    for table in TABLES:
        # FINAL: a window a worker rebuilt after a takeover may be written twice, identically;
        # the store's replacing merge keeps one (as with the embedded job's restarts).
        assert got[table + " FINAL"] == expected[table + " FINAL"], table


@pytest.mark.kafka
@pytest.mark.slow
def test_two_faust_workers_write_what_the_embedded_engine_writes(
    fresh_kafka_broker: TansuBroker, tmp_path: Path
) -> None:
    url = fresh_kafka_broker.url
    for job in JOBS:
        assert publish(url, *job)["bus"]["failed"] == 0
    workers = [FaustWorker(url, tmp_path / f"w{i}", "contract", tmp_path / f"w{i}")
               for i in range(2)]
    stats = [w.wait() for w in workers]
    # Both workers took part: the jobs were spread over them by key.
    assert all(s["sink"]["emitted"] > 0 for s in stats), stats
    assert sum(s["window"]["dropped"] for s in stats) == 0
    got = union([tmp_path / "w0", tmp_path / "w1"])
    expected = embedded(url, tmp_path)
    assert_same_tables(expected, got)
    assert asyncio.run(uncommitted(fresh_kafka_broker.bootstrap_servers, "contract")) == {}
    # Without a takeover nothing is written twice, not even before the merge.
    for table in TABLES:
        assert got[table] == expected[table], table


@pytest.mark.kafka
@pytest.mark.slow
def test_a_message_no_worker_can_read_is_dead_lettered_and_the_worker_goes_on(
    fresh_kafka_broker: TansuBroker, tmp_path: Path
) -> None:
    """Four bytes and a text line among a job's messages: the worker sets both aside on the
    dead-letter topic with their reason, counts them as rejected, commits past them, and
    writes the job as the embedded engine does."""
    url = fresh_kafka_broker.url
    bad = [b"\x00\x01\x02\x03", b"not a trainscope message"]
    publish_raw(fresh_kafka_broker.bootstrap_servers, EVENTS_TOPIC, bad[:1])
    assert publish(url, *JOBS[2])["bus"]["failed"] == 0  # the one with a slow GPU
    publish_raw(fresh_kafka_broker.bootstrap_servers, EVENTS_TOPIC, bad[1:])
    stats = FaustWorker(url, tmp_path / "w0", "bad-input", tmp_path / "w0").wait()
    assert stats["decode"]["rejected"] == 2, stats
    letters = read_topic(url, DEAD_LETTER_TOPIC)
    assert sorted(m.value for m in letters) == sorted(bad)
    # The reason names where the message was read: the repartition topic, partition, offset.
    assert all(m.key.startswith(b"bad-input-by-job[") for m in letters), letters
    assert asyncio.run(uncommitted(fresh_kafka_broker.bootstrap_servers, "bad-input")) == {}
    got = union([tmp_path / "w0"])
    assert_same_tables(embedded(url, tmp_path), got)


@pytest.mark.kafka
@pytest.mark.slow
def test_a_worker_killed_mid_job_is_replaced_by_the_other(
    fresh_kafka_broker: TansuBroker, tmp_path: Path
) -> None:
    """The jobs are published live; one of two workers is SIGKILLed while they run. The other
    takes its partitions over (after the group's session timeout), rebuilds the open windows
    from the committed positions and takes each job's state from the jobs table: the union of
    the two stores equals an uninterrupted embedded run's, findings included.

    The takeover goes through the rebalance paths where faust-streaming 0.15.3 alone lost
    records (see trainscope.engines.faust.consumer); a failure names the stage: producer
    messages never forwarded (with their offsets), rows missing, or offsets left uncommitted."""
    url = fresh_kafka_broker.url
    publishers = [start_publisher(url, *job, "--steps-per-s", "6", out=tmp_path / f"pub{i}")
                  for i, job in enumerate(JOBS)]
    # Idle closing and exit above the takeover time (session timeout 10 s, then a rebalance of
    # up to 10 s): meanwhile a job whose records all came through the victim sends nothing,
    # and the survivor may have nothing else to do.
    idle = ("--close-idle-s", "25", "--idle-exit-s", "30")
    victim = FaustWorker(url, tmp_path / "w0", "failover", tmp_path / "w0", idle)
    survivor = FaustWorker(url, tmp_path / "w1", "failover", tmp_path / "w1", idle)
    time.sleep(10)  # both joined and working: publishing takes ~20 s
    assert victim.process.poll() is None, victim.err_text()
    assert any(p.poll() is None for p in publishers), "the jobs ended before the kill"
    victim.process.send_signal(signal.SIGKILL)
    victim.process.wait(timeout=30)
    for p in publishers:
        assert p.wait(timeout=120) == 0
    stats = survivor.wait(timeout_s=150)
    assert stats["sink"]["emitted"] > 0
    got = union([tmp_path / "w0", tmp_path / "w1"])
    expected = embedded(url, tmp_path)
    # Counted on the broker, so that a loss names its stage.
    lost, sent = asyncio.run(never_forwarded(fresh_kafka_broker.bootstrap_servers, "failover"))
    assert not lost, (f"{sum(map(len, lost.values()))} of {sent} producer messages never "
                      f"reached the repartition topic, at offsets {lost}")
    assert_same_tables(expected, got)
    # The survivor committed everything it handled before it stopped.
    assert asyncio.run(uncommitted(fresh_kafka_broker.bootstrap_servers, "failover")) == {}


@pytest.mark.kafka
@pytest.mark.slow
def test_a_lone_worker_killed_mid_job_and_started_again_loses_nothing(
    fresh_kafka_broker: TansuBroker, tmp_path: Path
) -> None:
    """One worker, SIGKILLed while the jobs are published live, then started again as a new
    process: it restores the jobs table from its changelog and reads on from the committed
    positions; both runs' stores together equal an uninterrupted embedded run's."""
    url = fresh_kafka_broker.url
    publishers = [start_publisher(url, *job, "--steps-per-s", "6", out=tmp_path / f"pub{i}")
                  for i, job in enumerate(JOBS)]
    first = FaustWorker(url, tmp_path / "w0", "restart", tmp_path / "w0")
    deadline = time.monotonic() + 60
    while "settled" not in first.err_text():  # working: a job's state is in the table
        assert time.monotonic() < deadline and first.process.poll() is None, first.err_text()
        time.sleep(0.2)
    time.sleep(2)
    assert any(p.poll() is None for p in publishers), "the jobs ended before the kill"
    first.process.send_signal(signal.SIGKILL)
    first.process.wait(timeout=30)
    # Idle closing above the time the group takes to forget the dead member.
    second = FaustWorker(url, tmp_path / "w1", "restart", tmp_path / "w1",
                         ("--close-idle-s", "25", "--idle-exit-s", "30"))
    for p in publishers:
        assert p.wait(timeout=120) == 0
    assert second.wait(timeout_s=150)["window"]["dropped"] == 0
    got = union([tmp_path / "w0", tmp_path / "w1"])
    assert_same_tables(embedded(url, tmp_path), got)
    assert asyncio.run(uncommitted(fresh_kafka_broker.bootstrap_servers, "restart")) == {}


async def never_forwarded(servers: str, app_id: str) -> tuple[dict[str, list[int]], int]:
    """Producer messages (by their stamp) that no rekey agent forwarded, as their offsets per
    source partition, and the count of all of them."""
    consumer = AIOKafkaConsumer(EVENTS_TOPIC, METRICS_TOPIC, f"{app_id}-by-job",
                                bootstrap_servers=servers, auto_offset_reset="earliest",
                                enable_auto_commit=False, group_id=None)
    await consumer.start()
    sent: dict[tuple[int, int], str] = {}
    forwarded: set[tuple[int, int]] = set()
    try:
        quiet = 0
        while quiet < 3:
            polled = await consumer.getmany(timeout_ms=1000)
            quiet = 0 if polled else quiet + 1
            for messages in polled.values():
                for m in messages:
                    envelope = decode_envelope(m.value)
                    stamp = (envelope.producer_id, envelope.seq)
                    if m.topic.endswith("-by-job"):
                        forwarded.add(stamp)
                    else:
                        sent[stamp] = f"{m.topic}[{m.partition}]@{m.offset}"
    finally:
        await consumer.stop()
    lost: dict[str, list[int]] = {}
    for stamp in sent.keys() - forwarded:
        where, _, offset = sent[stamp].rpartition("@")
        lost.setdefault(where, []).append(int(offset))
    return {where: sorted(offsets) for where, offsets in sorted(lost.items())}, len(sent)


ST = Path(__file__).resolve().parents[2] / "data" / "stragglers-ST"  # a real production trace


@pytest.mark.kafka
@pytest.mark.slow
def test_a_faust_worker_stores_the_op_traces_jobs_send(
    fresh_kafka_broker: TansuBroker, tmp_path: Path
) -> None:
    """The ST production trace published as ``trainscope replay optrace`` publishes it (its
    op trace, and the summaries and steps made from it): the worker stores the op trace, and
    ``trainscope whatif --job ST`` on the worker's store gives the trace file's what-if."""
    import pandas as pd

    url = fresh_kafka_broker.url
    replayed = subprocess.run(
        [sys.executable, "-m", "trainscope.cli.main", "replay", "optrace",
         str(ST / "trace-ST.parquet"), "--meta", str(ST / "meta-ST.yaml"), "--job", "ST",
         "--bus", url], capture_output=True, text=True, timeout=120, check=False)
    assert replayed.returncode == 0, replayed.stderr
    stats = FaustWorker(url, tmp_path / "w0", "optrace", tmp_path / "w0").wait()
    ops = len(pd.read_parquet(ST / "trace-ST.parquet"))
    assert stats["op_traces"] == {"received": ops, "emitted": ops, "rejected": 0,
                                  "dropped": 0}, stats
    assert stats["decode"]["rejected"] == 0, stats
    assert asyncio.run(uncommitted(fresh_kafka_broker.bootstrap_servers, "optrace")) == {}
    from_store, note = what_if("--job", "ST", "--store", str(tmp_path / "w0"))
    assert "result stored in whatif_results for job 'ST'" in note, note
    from_file, _ = what_if("--trace", str(ST / "trace-ST.parquet"), "--meta",
                           str(ST / "meta-ST.yaml"))
    assert from_store == from_file
