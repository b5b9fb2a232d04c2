"""Run the stream job and simulated producers as processes of their own, and read their stores.

The production shape: ``trainscope pipeline`` in one process, producers in others, a real broker
between them. A chDB store can be opened by one process only, once, so tables are read by a
short-lived child process too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

TABLES = ("function_summaries", "step_records", "metric_samples", "findings", "topologies")


def publish(url: str, *args: str, timeout_s: float = 300) -> dict:
    """Publish a simulated job (see ``trainscope.cli.publish_simulated``); its summary."""
    done = subprocess.run(
        [sys.executable, "-m", "trainscope.cli.publish_simulated", "--bus", url, *args],
        capture_output=True, text=True, timeout=timeout_s, check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def start_publisher(url: str, *args: str, out: Path) -> subprocess.Popen[bytes]:
    with out.open("wb") as sink:
        return subprocess.Popen(
            [sys.executable, "-m", "trainscope.cli.publish_simulated", "--bus", url, *args],
            stdout=sink, stderr=subprocess.STDOUT,
        )


class PipelineProcess:
    """``trainscope pipeline`` as a child process; stdout and stderr kept in files."""

    def __init__(
        self, url: str, store: Path, group: str, *args: str, logs: Path, verbose: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        self.logs = logs
        self.stdout = logs.with_suffix(".out")
        self.stderr = logs.with_suffix(".err")
        with self.stdout.open("wb") as out, self.stderr.open("wb") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "trainscope.cli.main", *(["-v"] if verbose else []),
                 "pipeline", "--bus", url,
                 "--store", str(store), "--group", group, *args],
                stdout=out, stderr=err,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            )

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def terminate(self, timeout_s: float = 60) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout_s)

    def wait(self, timeout_s: float = 300) -> int:
        return self.process.wait(timeout=timeout_s)

    def err_text(self) -> str:
        return self.stderr.read_text(errors="replace")

    def out_text(self) -> str:
        return self.stdout.read_text(errors="replace")

    def stats(self) -> dict:
        """The JSON stats line the pipeline prints on stderr when it stops."""
        for line in reversed(self.err_text().splitlines()):
            if line.startswith("{"):
                return json.loads(line)
        raise AssertionError(f"no stats line in the pipeline's stderr:\n{self.err_text()}")


_DUMP = r"""
import json, sys
from trainscope.sinks.clickhouse import connect
client = connect(sys.argv[1])
out = {}
for table in sys.argv[2:]:
    for final in ("", " FINAL"):
        rows = client.query(f"SELECT * FROM {table}{final} ORDER BY ALL").result_rows
        out[table + final] = [repr(r) for r in rows]
print(json.dumps(out))
"""


def _run_json(script: str, *args: str) -> Any:
    """What ``script`` prints as JSON, run in a process of its own (chDB holds one store per
    process: the pipeline's, or a test's own)."""
    done = subprocess.run([sys.executable, "-c", script, *args],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def dump_tables(store: Path, tables: tuple[str, ...] = TABLES) -> dict[str, list[str]]:
    """Every row of every table, plain and ``FINAL``, as exact text, in a canonical order."""
    return _run_json(_DUMP, str(store), *tables)


_QUERY = r"""
import json, sys
from trainscope.sinks.clickhouse import connect
print(json.dumps(connect(sys.argv[1]).query(sys.argv[2]).result_rows, default=str))
"""


def query_store(store: Path, sql: str) -> list[list]:
    """The rows of one query on a store the pipeline wrote (from its own process: chDB holds
    one store per process)."""
    return _run_json(_QUERY, str(store), sql)


_DIAGNOSE = r"""
import json, sys
from trainscope.detectors.diagnosis import diagnose
from trainscope.detectors.registry import load
from trainscope.schemas.records import Finding
from trainscope.sinks.clickhouse import connect
client = connect(sys.argv[1])
result = client.query("SELECT * FROM findings WHERE job_id = {job:String} "
                      "AND ({detector:String} = '' OR detector = {detector:String})",
                      parameters={"job": sys.argv[2], "detector": sys.argv[3]})
findings = [Finding(**dict(zip(result.column_names, row))) for row in result.result_rows]
# The order the pipeline produced them in: by window, then by detector.
order = {d.name: i for i, d in enumerate(load().detectors)}
findings.sort(key=lambda f: (f.window_start_ns, order.get(f.detector, len(order))))
print(json.dumps({"findings": len(findings),
                  "suspects": [s.as_json() for s in diagnose(findings)]}))
"""


def diagnose_store(store: Path, job_id: str, detector: str = "") -> dict:
    """The diagnosis of one job from the findings in a store (of one detector, if given), as
    ``trainscope demo`` gives it."""
    return _run_json(_DIAGNOSE, str(store), job_id, detector)


_DASHBOARD_FINDINGS = r"""
import json, sys
from trainscope.detectors.base import ALERT_THRESHOLD
from trainscope.store.client import connect
from trainscope.ui.queries import DashboardQueries
queries = DashboardQueries(connect(sys.argv[1], None, readonly=True, create=False),
                           threshold=ALERT_THRESHOLD)
print(json.dumps(queries.findings(sys.argv[2]), default=str))
"""


def dashboard_findings(store: Path, job_id: str) -> list[dict]:
    """The alerts of one job as the dashboard's job page lists them, each with its call path."""
    return _run_json(_DASHBOARD_FINDINGS, str(store), job_id)


def host_contention(finding: dict) -> bool:
    """A job-level ``cpu-contention`` finding: the job's ranks take turns waiting for a CPU,
    measured (their run-queue wait explains what they wait on each other). On a 2-core machine
    running a second test worker beside a multi-rank job, a healthy job may get one; it names
    no rank and blames no code, so it starts no profile."""
    return finding["category"] == "cpu-contention" and finding["rank"] == -1


def what_if(*args: str) -> tuple[dict, str]:
    """``trainscope whatif ... --json``: its figures, and what it said on stderr."""
    done = subprocess.run([sys.executable, "-m", "trainscope.cli.main", "whatif", *args,
                           "--json"], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    return {k: result[k] for k in ("S", "M_W", "M_S", "S_stage", "S_dp_rank", "S_worker",
                                   "steps", "workers", "fit")}, done.stderr
