"""The store lost under a running ``trainscope pipeline`` (its own process, the real broker).

An embedded chDB engine keeps accepting inserts into a store whose directory was deleted or
moved, or whose table lost its data directory: it recreates the part directories and the rows
are gone at the next start. The pipeline must notice before it commits, say so in one line,
commit nothing past the loss, and exit 1 or wait (``--on-store-loss``); once the store is back
and the pipeline (re)started, every step record of the job is in it.

The accidents, as an operator makes them while the pipeline runs and a simulated job is being
published: ``rm -rf`` of the whole store directory; ``mv`` of it elsewhere (a volume unmounted,
then mounted back); and ``rm -rf`` of one table's data directory (``step_records``, found the
way an operator would, from its metadata file). A chDB store has one owning process, whose read
endpoint refuses writes, so no one can ``DROP TABLE`` in it while the pipeline runs: deleting
the table's data directory is the table lost mid-run.

``rm -rf`` of the store runs under ``--on-store-loss wait`` and is ended by SIGTERM while it
waits; the move waits and resumes by itself once the store is moved back; the table's loss
runs under ``exit`` and is restarted by hand.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from kafka_broker import TansuBroker
from pipeline_procs import PipelineProcess, dump_tables, start_publisher

from trainscope.schemas.topics import EVENTS_TOPIC, METRICS_TOPIC
from trainscope.transport.kafka import DEFAULT_PARTITIONS

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

DP, TP, STEPS = 2, 2, 60
RANKS = DP * TP
# --close-idle-s closes a job's windows after that much silence from it: on a loaded machine
# the publisher can stall for a second, and a window closed under it drops what comes next as
# late (a loss the test would blame on the store).
PIPELINE_ARGS = ("--window-s", "1", "--lateness-s", "0.5", "--commit-interval-s", "0.3",
                 "--close-idle-s", "5", "--source-idle-s", "1", "--stats-every-s", "0.3",
                 "--no-auto-profile")


def committed(broker: TansuBroker, group: str) -> dict[tuple[str, int], int]:
    """The group's committed offsets on the broker, per partition that has one (asked as an
    admin: a consumer would take part in the group)."""
    async def read() -> dict[tuple[str, int], int]:
        admin = AIOKafkaAdminClient(bootstrap_servers=broker.bootstrap_servers)
        await admin.start()
        try:
            offsets = await admin.list_consumer_group_offsets(group, partitions=[
                TopicPartition(topic, partition) for topic in (EVENTS_TOPIC, METRICS_TOPIC)
                for partition in range(DEFAULT_PARTITIONS)])
        finally:
            await admin.close()
        return {(tp.topic, tp.partition): meta.offset for tp, meta in offsets.items()
                if meta.offset >= 0}

    return asyncio.run(read())


def wait_for(what: str, condition: Callable[[], bool], pipeline: PipelineProcess,
             timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n" + (
            pipeline.err_text()[-4000:])
        time.sleep(0.05)


def commits(pipeline: PipelineProcess) -> int:
    """Commits so far, from the last stats line (--stats-every-s)."""
    lines = [line for line in pipeline.err_text().splitlines() if line.startswith('{"decode"')]
    return json.loads(lines[-1])["commits"] if lines else 0


def loss_lines(pipeline: PipelineProcess) -> list[str]:
    return [line for line in pipeline.err_text().splitlines() if " lost: " in line]


def publish_job(broker: TansuBroker, job: str, out: Path):
    # Paced so that the loss falls in the middle: ~10 s of publishing, 1 s windows.
    return start_publisher(broker.url, "--job-id", job, "--dp", str(DP), "--pp", "1", "--tp",
                           str(TP), "--steps", str(STEPS),
                           "--steps-per-s", "6", "--window-s", "1", out=out)


def stored_steps(store: Path, job: str) -> set[tuple[int, int]]:
    import ast

    rows = [ast.literal_eval(r) for r in dump_tables(store, ("step_records",))["step_records"]]
    return {(row[2], row[3]) for row in rows if row[1] == job}  # (rank, step)


@contextmanager
def killed_at_the_end(*processes: subprocess.Popen[bytes]) -> Iterator[None]:
    """Whatever the test asserts, no process of it outlives it."""
    try:
        yield
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()


def run_again(broker: TansuBroker, store: Path, group: str, logs: Path) -> str:
    """The pipeline started again on ``store`` and run until the bus is idle: its stderr."""
    again = PipelineProcess(broker.url, store, group, *PIPELINE_ARGS, "--idle-exit-s", "6",
                            logs=logs, verbose=True)
    assert again.wait(timeout_s=120) == 0, again.err_text()
    return again.err_text()


EVERY_STEP = {(rank, step) for rank in range(RANKS) for step in range(STEPS)}


def start_and_lose(broker: TansuBroker, tmp_path: Path, group: str, mode: str,
                   accident: Callable[[Path], None]) -> tuple[PipelineProcess, object, dict]:
    """Start the pipeline and the publisher; once a commit went through, the accident.
    Returns the pipeline, the publisher and the group's committed offsets right after it."""
    store = tmp_path / "store"
    pipeline = PipelineProcess(broker.url, store, group, *PIPELINE_ARGS, "--on-store-loss",
                               mode, "--idle-exit-s", "6", logs=tmp_path / "pipeline",
                               verbose=True)
    wait_for("the pipeline to consume", lambda: "consuming" in pipeline.err_text(), pipeline)
    publisher = publish_job(broker, "lost", tmp_path / "publisher.out")
    wait_for("a commit", lambda: commits(pipeline) >= 1, pipeline)
    assert publisher.poll() is None, "the job was sent before the loss: pace it slower"
    accident(store)
    return pipeline, publisher, committed(broker, group)


def test_store_deleted_wait_sigterm_then_a_fresh_store_gets_every_step(
    fresh_kafka_broker: TansuBroker, tmp_path: Path,
) -> None:
    """``rm -rf`` of the store under ``--on-store-loss wait``: one line, no commit past the
    loss, and SIGTERM ends the wait (exit 1). Restarted on a fresh empty directory (no
    checkpoint in it), the pipeline re-reads the bus from the oldest message and the store
    gets every step record of the job."""
    broker, store = fresh_kafka_broker, tmp_path / "store"
    pipeline, publisher, at_loss = start_and_lose(broker, tmp_path, "deleted", "wait",
                                                  shutil.rmtree)
    with killed_at_the_end(pipeline.process, publisher):
        wait_for("the wait", lambda: "still waiting for the store" in pipeline.err_text(),
                 pipeline)
        stopped = time.monotonic()
        assert pipeline.terminate(timeout_s=30) == 1, pipeline.err_text()
        assert time.monotonic() - stopped < 10
        publisher.wait(timeout=120)
    [line] = loss_lines(pipeline)
    # Gone, or recreated by the engine's background merges before the check: both are said.
    assert re.match(rf"Error: store {re.escape(str(store))} lost: its directory (is gone|was "
                    r"replaced \(deleted or moved, then recreated\)); stopped writing, nothing "
                    r"committed past the last checkpoint", line), line
    assert "stopped while waiting for the lost store" in pipeline.err_text()
    assert at_loss, "commits went through before the loss"
    assert committed(broker, "deleted") == at_loss  # nothing committed past the loss
    sent = json.loads((tmp_path / "publisher.out").read_text().splitlines()[-1])
    assert sum(at_loss.values()) < sent["messages"]

    shutil.rmtree(store, ignore_errors=True)  # whatever the engine recreated after the loss
    store.mkdir()
    err = run_again(broker, store, "deleted", tmp_path / "again")
    assert "no checkpoint of deleted in the store: reading trainscope.events[" in err
    assert stored_steps(store, "lost") == EVERY_STEP


def test_store_moved_wait_resumes_when_it_is_back(
    fresh_kafka_broker: TansuBroker, tmp_path: Path,
) -> None:
    """``mv`` of the store elsewhere (a volume unmounted): one line, then the pipeline waits,
    committing nothing, until the store is moved back; it then restarts itself (same pid),
    resumes from the store's last checkpoint and the store gets every step record."""
    broker, store = fresh_kafka_broker, tmp_path / "store"
    away = tmp_path / "store.away"
    pipeline, publisher, at_loss = start_and_lose(broker, tmp_path, "moved", "wait",
                                                  lambda s: s.rename(away))
    with killed_at_the_end(pipeline.process, publisher):
        wait_for("the loss line", lambda: "still waiting for the store" in pipeline.err_text(),
                 pipeline)
        time.sleep(1.5)  # waiting, not consuming: nothing may be committed meanwhile
        assert pipeline.process.poll() is None, pipeline.err_text()
        assert committed(broker, "moved") == at_loss
        shutil.rmtree(store, ignore_errors=True)  # what the engine recreated after the loss
        away.rename(store)  # the volume is back
        assert pipeline.wait(timeout_s=120) == 0, pipeline.err_text()
        publisher.wait(timeout=120)
    err = pipeline.err_text()
    [line] = loss_lines(pipeline)
    assert line.startswith(f"Error: store {store} lost: its directory "), line
    assert line.endswith("waiting for the store to come back (--on-store-loss wait)")
    assert "the store is back: restarting" in err
    assert re.search(r"restored checkpoint of moved: \d+ job", err), err[-3000:]
    assert stored_steps(store, "lost") == EVERY_STEP


def _table_data_dir(store: Path, table: str) -> Path:
    """A table's data directory, found from its metadata file (``ATTACH TABLE _ UUID '…'``)."""
    sql = (store / "metadata" / "default" / f"{table}.sql").read_text()
    uuid = re.search(r"UUID '([0-9a-f-]+)'", sql)
    assert uuid, sql
    return store / "store" / uuid[1][:3] / uuid[1]


def test_table_data_deleted_exit_then_the_restart_rebuilds_it(
    fresh_kafka_broker: TansuBroker, tmp_path: Path,
) -> None:
    """``rm -rf`` of ``step_records``' data directory under ``--on-store-loss exit``: one line
    naming the table, exit 1, no commit past the loss. Restarted on the same store, the
    pipeline finds the checkpoint describes a table that is gone, does not use it, re-reads
    the bus from the oldest message and the store gets every step record again."""
    broker, store = fresh_kafka_broker, tmp_path / "store"
    pipeline, publisher, at_loss = start_and_lose(
        broker, tmp_path, "table", "exit",
        lambda s: shutil.rmtree(_table_data_dir(s, "step_records")))
    with killed_at_the_end(pipeline.process, publisher):
        assert pipeline.wait(timeout_s=60) == 1, pipeline.err_text()
        publisher.wait(timeout=120)
    [line] = loss_lines(pipeline)
    assert re.match(rf"Error: store {re.escape(str(store))} lost: data directory "
                    r"(deleted|replaced) of step_records; stopped writing", line), line
    assert line.endswith("exiting (--on-store-loss exit)")
    assert committed(broker, "table") == at_loss

    err = run_again(broker, store, "table", tmp_path / "again")
    assert (f"ignoring the last checkpoint of table: store {store} lost data since it was "
            "written (step_records replaced)") in err
    assert "no checkpoint of table in the store: reading trainscope.events[" in err
    assert stored_steps(store, "lost") == EVERY_STEP
