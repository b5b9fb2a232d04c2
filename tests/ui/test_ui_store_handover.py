"""The dashboard and the pipeline on one embedded store, as they come and go
(``trainscope.store.handover``).

Real processes throughout: ``trainscope demo`` writes a store, ``trainscope ui`` serves it, and
``trainscope pipeline`` on a real broker starts on the same store, stops, and starts again. An
embedded store has one owning process at a time; the dashboard must neither keep the pipeline
out nor fail once the pipeline it read through has gone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dashboard_procs import get, serve
from pipeline_procs import PipelineProcess

from trainscope.store.live import Endpoint, read_endpoint

pytestmark = pytest.mark.kafka
ST = Path(__file__).parents[1] / "data" / "stragglers-ST"  # a real production op trace


def _jobs_when_served(url: str, answers: list[tuple[int, str]], timeout_s: float = 20) -> list:
    """The dashboard's job ids once it answers 200; every other answer on the way is kept."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, body = get(url + "/api/jobs")
        if status == 200:
            return [job["job_id"] for job in json.loads(body)]
        answers.append((status, body.decode(errors="replace")))
        assert time.monotonic() < deadline, answers
        time.sleep(0.2)


def _owner_endpoint(store: Path, pid: int, timeout_s: float = 60) -> Endpoint:
    deadline = time.monotonic() + timeout_s
    while (found := read_endpoint(store)) is None or found.pid != pid:
        assert time.monotonic() < deadline, f"process {pid} never served the store: {found}"
        time.sleep(0.1)
    return found


def test_the_dashboard_and_the_pipeline_take_turns_on_one_store(
        fresh_kafka_broker, tmp_path: Path) -> None:
    store = (tmp_path / "store").resolve()
    demo = subprocess.run(
        [sys.executable, "-m", "trainscope.cli.main", "demo", "--ranks", "8", "--dp", "4",
         "--pp", "2", "--tp", "1", "--steps", "30", "--store", str(store)],
        capture_output=True, text=True, timeout=300, check=False)
    assert demo.returncode == 0, demo.stderr
    others: list[tuple[int, str]] = []  # what the dashboard answered while the store moved
    with serve(store, tmp_path / "ui.log") as url:
        assert _jobs_when_served(url, others) == ["demo-job"]
        ui = read_endpoint(store)
        assert ui is not None and ui.yields  # the dashboard opened the store: it serves reads

        # A pipeline started on the store the dashboard holds asks for it and gets it (it was
        # refused before), and the dashboard reads the store through the pipeline.
        first = PipelineProcess(fresh_kafka_broker.url, store, "handover", logs=tmp_path / "p1")
        served = _owner_endpoint(store, first.process.pid)
        assert not served.yields
        assert _jobs_when_served(url, others) == ["demo-job"]

        # The pipeline stops: the dashboard goes on answering (it answered 500 on every page
        # before), the store opened by the dashboard again.
        assert first.terminate() == 0, first.err_text()
        assert _jobs_when_served(url, others) == ["demo-job"]
        again = _owner_endpoint(store, ui.pid)
        assert again.yields

        # A what-if run that imports a trace into the store gets it too, and the dashboard has
        # the store back as soon as it is done, with the new job.
        whatif = subprocess.run(
            [sys.executable, "-m", "trainscope.cli.main", "whatif", "--trace",
             str(ST / "trace-ST.parquet"), "--meta", str(ST / "meta-ST.yaml"), "--job",
             "st-trace", "--store", str(store), "--json"],
            capture_output=True, text=True, timeout=300, check=False)
        assert whatif.returncode == 0, whatif.stderr
        assert sorted(_jobs_when_served(url, others, timeout_s=10)) == ["demo-job", "st-trace"]
        _owner_endpoint(store, ui.pid, timeout_s=10)

        # And the next pipeline gets the store again.
        second = PipelineProcess(fresh_kafka_broker.url, store, "handover", logs=tmp_path / "p2")
        _owner_endpoint(store, second.process.pid)
        assert sorted(_jobs_when_served(url, others)) == ["demo-job", "st-trace"]
        assert second.terminate() == 0, second.err_text()
    # The dashboard never failed: at most "retry in a few seconds" while the store moved.
    assert all(status == 503 and "retry in a few seconds" in text for status, text in others), \
        others
