"""``trainscope stream faust`` workers as child processes, for the tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from trainscope.schemas.topics import EVENTS_TOPIC, METRICS_TOPIC, OPTRACE_TOPIC

# A job quiet this long has its windows closed. 3 s was too short for a loaded CI machine: the
# workers' event loops stalled 6-8 s ("woke up too late") and one worker counted 8,367
# events late.
IDLE = ["--close-idle-s", "12", "--idle-exit-s", "15"]


class FaustWorker:
    """``trainscope stream faust`` as a child process; stdout and stderr kept in files."""

    def __init__(self, url: str, store: Path, app_id: str, logs: Path,
                 idle: tuple[str, ...] = tuple(IDLE)) -> None:
        self.stderr = logs.with_suffix(".err")
        with logs.with_suffix(".out").open("wb") as out, self.stderr.open("wb") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "trainscope.cli.main", "-v", "stream", "faust", "--bus", url,
                 "--store", str(store), "--app-id", app_id, *idle],
                stdout=out, stderr=err, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                cwd=logs.parent,  # the operator's working directory: nothing may be left there
            )
        self.cwd = logs.parent

    def err_text(self) -> str:
        return self.stderr.read_text(errors="replace")

    def wait(self, timeout_s: float = 150) -> dict:
        """Its final counts (the JSON line on stderr) once it exited 0."""
        assert self.process.wait(timeout=timeout_s) == 0, self.err_text()
        assert "Traceback" not in self.err_text(), self.err_text()
        # Faust's data directory (`<app id>-data/` by default) is not made where it was run.
        assert not list(self.cwd.glob("*-data")), sorted(self.cwd.iterdir())
        for line in reversed(self.err_text().splitlines()):
            if line.startswith("{"):
                return json.loads(line)
        raise AssertionError(f"no stats line:\n{self.err_text()}")


async def uncommitted(servers: str, app_id: str) -> dict[str, int]:
    """Per partition of the sources and the repartition topic, the messages past the group's
    committed position ("topic[partition]" → count; empty when the group committed all). Once
    the workers drained the stream and stopped, anything here was handled but never committed,
    and a commit rule that stalls shows here."""
    consumer = AIOKafkaConsumer(bootstrap_servers=servers, group_id=app_id,
                                enable_auto_commit=False)
    await consumer.start()
    try:
        await consumer.topics()  # fills the metadata partitions_for_topic reads
        tps = [TopicPartition(topic, p) for topic in (EVENTS_TOPIC, METRICS_TOPIC, OPTRACE_TOPIC,
                                                      f"{app_id}-by-job")
               for p in sorted(consumer.partitions_for_topic(topic) or ())]
        ends = await consumer.end_offsets(tps)
        behind = {}
        for tp in tps:
            committed = await consumer.committed(tp) or 0
            if ends[tp] > committed:
                behind[f"{tp.topic}[{tp.partition}]"] = ends[tp] - committed
        return behind
    finally:
        await consumer.stop()
