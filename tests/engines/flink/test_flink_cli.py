"""`trainscope stream flink` says in one line what is missing or wrong, before any JVM starts."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from flink_procs import flink_python_or_skip


def trainscope(*args: str, env_extra: dict[str, str] | None = None
               ) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-m", "trainscope.cli.main", *args],
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, **(env_extra or {})})


def error_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0
    assert lines and lines[-1].startswith("Error: "), done.stderr
    return lines[-1]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_missing_flink_environment_names_the_setup_script(tmp_path: Path) -> None:
    done = trainscope("stream", "flink", "--bus", "kafka://127.0.0.1:9092",
                      env_extra={"TRAINSCOPE_FLINK_VENV": str(tmp_path / "nowhere")})
    line = error_line(done)
    assert str(tmp_path / "nowhere" / "bin" / "python") in line
    assert "infra/setup-flink-env.sh" in line


@pytest.mark.parametrize(("bus", "problem"), [
    ("memory", "the Flink job reads Kafka"),
    ("kafka://h:9092?security_protocol=SSL", "--kafka-property"),
])
def test_a_bus_flink_cannot_use_is_refused(bus: str, problem: str) -> None:
    assert problem in error_line(trainscope("stream", "flink", "--bus", bus))


def test_an_unreachable_broker_fails_fast(tmp_path: Path) -> None:
    python = flink_python_or_skip()
    port = closed_port()
    done = trainscope("stream", "flink", "--bus", f"kafka://127.0.0.1:{port}",
                      "--flink-python", str(python))
    assert f"cannot reach Kafka at 127.0.0.1:{port}" in error_line(done)


def test_missing_jars_and_the_sql_it_would_run(tmp_path: Path) -> None:
    python = flink_python_or_skip()
    job = [str(python), "-m", "trainscope.engines.flink.job", "--bootstrap-servers", "h:1"]
    done = subprocess.run([*job, "--jars", str(tmp_path)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 1
    assert done.stderr.strip() == (f"Error: no flink-connector-kafka*.jar in {tmp_path} "
                                   "(run infra/setup-flink-env.sh, or pass --jars DIR)")
    sql = trainscope("stream", "flink", "--bus", "kafka://h:1", "--flink-python", str(python),
                     "--window-s", "2.5", "--print-sql")
    assert sql.returncode == 0, sql.stderr
    assert "INTERVAL '2.500' SECOND(3)" in sql.stdout
    assert "'scan.bounded.mode'" not in sql.stdout  # unbounded unless --bounded
    bad = subprocess.run([*job, "--window-s", "0.0001"], capture_output=True, text=True,
                         timeout=120, check=False)
    assert bad.stderr.strip() == (
        "Error: window_s must be a whole number of milliseconds, got 0.0001")
