"""`trainscope sql` is read-only, refuses mistyped stores and never echoes a secret.

Every check runs the real command against a real chDB store. No modern ClickHouse server is
reachable here, so the ``--url`` path is covered by what the client sends (a stand-in for the
server records it) and by the same engine code running embedded: ``readonly=1`` is ClickHouse's
own setting, enforced by the engine in both cases.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from trainscope.config import env
from trainscope.store import client as store_client

MAKE_STORE = """
import sys
from trainscope.testing import sample_windows
from trainscope.sinks.clickhouse import ClickHouseSink
sink = ClickHouseSink.open(sys.argv[1])
window = sample_windows(steps=20)[1]
sink.write_window(window, [window.finding("t", rank=1, category="hang", score=1.0, message="m")])
sink.close()
"""



def trainscope(*args: str, env_extra: dict[str, str] | None = None,
               timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    import os

    environ = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "trainscope.cli.main", *args], capture_output=True,
                          text=True, timeout=timeout_s, check=False, env=environ)


def error_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0, done.stdout
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("Error: ")
    return lines[0]


def findings_count(store: Path) -> int:
    done = trainscope("sql", "SELECT count() FROM findings", "--store", str(store),
                      "--format", "csv")
    assert done.returncode == 0, done.stderr
    return int(done.stdout.splitlines()[1])


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sql") / "store"
    done = subprocess.run([sys.executable, "-c", MAKE_STORE, str(path)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert findings_count(path) == 1
    return path


@pytest.mark.parametrize(
    "statement",
    [
        "DROP TABLE findings",
        "TRUNCATE TABLE findings",
        "ALTER TABLE findings DELETE WHERE 1",
        "INSERT INTO findings (job_id) VALUES ('x')",
        "CREATE TABLE t (x Int8) ENGINE = Memory",
        "RENAME TABLE findings TO f2",
        "SET readonly = 0",
        "SELECT count() FROM findings SETTINGS readonly = 0",
        "SYSTEM DROP MARK CACHE",
    ],
)
def test_writes_and_ddl_are_refused(store: Path, statement: str) -> None:
    line = error_line(trainscope("sql", statement, "--store", str(store)))
    assert "readonly" in line.lower()
    assert findings_count(store) == 1


@pytest.mark.parametrize(
    "source",
    [
        "file('/etc/passwd', 'LineAsString')",
        "url('http://127.0.0.1:9/x.csv', 'CSV')",
        "s3('http://127.0.0.1:9/bucket/x.csv', 'CSV')",
        "remote('127.0.0.1:9', system.one)",
        "remoteSecure('127.0.0.1:9', system.one)",
        "executable('id', 'TSV', 'x String')",
        "mysql('127.0.0.1:9', 'db', 't', 'u', 'p')",
        "postgresql('127.0.0.1:9', 'db', 't', 'u', 'p')",
        "sqlite('/etc/passwd', 't')",
        "hdfs('hdfs://127.0.0.1:9/x', 'CSV')",
    ],
)
def test_table_functions_that_reach_outside_are_refused(store: Path, source: str) -> None:
    line = error_line(trainscope("sql", f"SELECT * FROM {source} LIMIT 1", "--store", str(store)))
    assert "readonly" in line.lower()
    assert "root:" not in line


def test_reads_still_work_including_harmless_table_functions(store: Path) -> None:
    done = trainscope("sql", "SELECT count() AS n FROM numbers(5) WHERE number IN "
                      "(SELECT rank FROM findings)", "--store", str(store), "--format", "csv")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["n", "1"]


def test_into_outfile_is_refused_and_writes_nothing(store: Path, tmp_path: Path) -> None:
    target = tmp_path / "out.csv"
    line = error_line(trainscope("sql", f"SELECT * FROM findings INTO OUTFILE '{target}'",
                                 "--store", str(store)))
    assert "INTO OUTFILE is not allowed" in line
    assert not target.exists()
    # The words inside a string literal are data, not a clause.
    done = trainscope("sql", "SELECT 'into outfile' AS s", "--store", str(store),
                      "--format", "csv")
    assert done.returncode == 0 and done.stdout.splitlines()[1] == "into outfile"


def test_a_mistyped_store_is_an_error_and_is_not_created(store: Path) -> None:
    typo = store.parent / "stroe"
    line = error_line(trainscope("sql", "SELECT 1", "--store", str(typo)))
    assert f"no store at {typo}: check the path (--create starts an empty one)" in line
    assert not typo.exists()


def test_a_directory_that_is_no_store_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    line = error_line(trainscope("sql", "SELECT 1", "--store", str(tmp_path)))
    assert "is not a trainscope store" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_create_starts_an_empty_store(tmp_path: Path) -> None:
    path = tmp_path / "new"
    done = trainscope("sql", "SELECT count() AS n FROM findings", "--store", str(path),
                      "--create", "--format", "csv")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["n", "0"]
    assert findings_count(path) == 0  # and from now on it is a store


@pytest.mark.kafka
def test_a_store_whose_owner_serves_no_reads_gives_one_line_that_says_what_to_do(
    fresh_kafka_broker, tmp_path: Path,
) -> None:
    """An owner started with its read endpoint off: the refusal names the process and the ways
    out. (With the endpoint on, the default, sql reads the live store: tests/store.)"""
    # A broker of its own: on the shared one the pipeline would read other tests' jobs and,
    # stopped, write their windows, so the store's contents would say nothing.
    store = tmp_path / "store"
    pipeline = subprocess.Popen(
        [sys.executable, "-m", "trainscope.cli.main", "pipeline", "--bus", fresh_kafka_broker.url,
         "--store", str(store), "--group", f"sql-lock-{time.monotonic_ns()}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, env.TRAINSCOPE_STORE_READ_BIND: "off"})
    try:
        assert pipeline.stderr is not None
        assert pipeline.stderr.readline().startswith("consuming ")  # it owns the store now
        line = error_line(trainscope("sql", "SELECT count() FROM findings", "--store", str(store)))
    finally:
        pipeline.terminate()
        pipeline.wait(timeout=30)
    assert line == (
        f"Error: store {store.resolve()} is in use by process {pipeline.pid} "
        f"(`trainscope pipeline`), which serves no read endpoint (an embedded store has a "
        f"single owner; `trainscope pipeline` and "
        f"`trainscope ui` serve reads to other commands unless "
        f"{env.TRAINSCOPE_STORE_READ_BIND}=off): restart it with that unset, query a ClickHouse "
        f"server with --url, or stop that process and retry"
    )
    assert findings_count(store) == 0  # once the pipeline stopped, the store opens


def test_a_password_in_the_url_is_refused_without_echoing_it() -> None:
    line = error_line(trainscope("sql", "SELECT 1", "--url", "http://bob:hunter2@127.0.0.1:9/"))
    assert "contains a password" in line and env.TRAINSCOPE_CLICKHOUSE_PASSWORD in line
    assert "hunter2" not in line


def test_an_unreachable_server_does_not_echo_the_password() -> None:
    from kafka_broker import free_port

    done = trainscope("sql", "SELECT 1", "--url", f"http://127.0.0.1:{free_port()}",
                      env_extra={env.TRAINSCOPE_CLICKHOUSE_USER: "bob",
                                 env.TRAINSCOPE_CLICKHOUSE_PASSWORD: "hunter2"})
    line = error_line(done)
    assert "cannot connect to ClickHouse at http://127.0.0.1:" in line
    assert "hunter2" not in done.stderr + done.stdout


def test_server_clients_are_opened_read_only(monkeypatch) -> None:
    """A stand-in replaces ``clickhouse_connect.get_client``: no ClickHouse server is reachable
    here. It records that ``readonly=1`` goes to the server for ``sql --url`` and not for the
    pipeline's writer."""
    import clickhouse_connect

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(clickhouse_connect, "get_client", lambda **kw: calls.append(kw) or kw)
    monkeypatch.setenv(env.TRAINSCOPE_CLICKHOUSE_PASSWORD, "hunter2")
    store_client.connect(url="http://127.0.0.1:8123", readonly=True)
    store_client.connect(url="http://127.0.0.1:8123")
    assert calls[0]["settings"] == {"readonly": 1} and calls[0]["password"] == "hunter2"
    assert calls[1]["settings"] is None


@pytest.mark.parametrize(
    ("sql", "refused"),
    [
        ("SELECT 1 INTO OUTFILE 'x'", True),
        ("select 1 into\n  outfile 'x' format CSV", True),
        ("SELECT 'a''b INTO OUTFILE' AS s", False),
        ('SELECT 1 AS "INTO OUTFILE"', False),
        ("SELECT 1 -- INTO OUTFILE 'x'", False),
        ("SELECT /* INTO OUTFILE */ 1", False),
    ],
)
def test_into_outfile_detection_ignores_quotes_and_comments(sql: str, refused: bool) -> None:
    if refused:
        with pytest.raises(store_client.StoreError, match="INTO OUTFILE"):
            store_client.check_read_only_sql(sql)
    else:
        store_client.check_read_only_sql(sql)
