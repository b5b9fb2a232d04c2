"""The `trainscope` command as a user runs it: a real process, a real chDB store."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def trainscope(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainscope.cli.main", *args],
        capture_output=True, text=True, timeout=timeout_s, check=False,
    )


def error_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("Error: ")
    return lines[0]


@pytest.fixture(scope="module")
def demo_store(tmp_path_factory) -> tuple[Path, dict]:
    store = tmp_path_factory.mktemp("demo") / "store"
    done = trainscope("demo", "--ranks", "64", "--dp", "8", "--pp", "4", "--tp", "2",
                      "--fault", "slow-gpu:rank=13,factor=1.4", "--json", "--store", str(store))
    assert done.returncode == 0, done.stderr
    return store, json.loads(done.stdout)


@pytest.mark.slow
def test_demo_puts_the_slow_gpu_first(demo_store) -> None:
    _, result = demo_store
    assert set(result) == {"findings", "ranks", "events", "summaries", "windows", "elapsed_s"}
    top = result["findings"][0]
    assert (top["rank"], top["category"]) == (13, "gpu-compute")
    assert top["score"] >= 0.5 and top["ranks"] == [13]
    assert result["ranks"] == 64 and result["events"] > 500_000 and result["windows"] >= 10
    # The ranks sent their spans condensed: a summary per rank, function and window at most.
    assert 0 < result["summaries"] <= 64 * 10 * result["windows"]


@pytest.mark.slow
def test_sql_answers_on_the_demo_store(demo_store) -> None:
    store, result = demo_store
    done = trainscope("sql", "SELECT count() AS n FROM findings WHERE rank = 13", "--store",
                      str(store), "--format", "json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[0])["n"] >= result["windows"] - 2
    done = trainscope("sql", "SELECT count() FROM step_records", "--store", str(store),
                      "--format", "csv")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[1] == str(64 * 200)


@pytest.mark.slow
def test_bad_sql_prints_clickhouse_error(demo_store) -> None:
    store, _ = demo_store
    line = error_line(trainscope("sql", "SELEC count() FROM findings", "--store", str(store)))
    assert "Syntax error" in line
    line = error_line(trainscope("sql", "SELECT nope FROM findings", "--store", str(store)))
    assert "nope" in line


def test_store_path_that_is_a_file_is_a_clear_error(tmp_path) -> None:
    path = tmp_path / "not-a-dir"
    path.write_text("x")
    line = error_line(trainscope("demo", "--steps", "2", "--store", str(path)))
    assert f"store path {path} is a file" in line


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("slow-cpu:rank=1", "unknown fault kind 'slow-cpu'"),
        ("slow-gpu:factor=2", "needs rank"),
        ("slow-gpu:rank=x", "bad value rank='x'"),
        ("gc-pause:rank=1,often=3", "unknown parameter 'often'"),
        ("slow-gpu:rank=99", "names rank 99 but the job has 16 ranks"),
    ],
)
def test_unknown_fault_spec_is_a_clear_error(spec: str, needle: str) -> None:
    assert needle in error_line(trainscope("demo", "--no-store", "--steps", "2", "--fault", spec))


def test_layout_mismatch_is_a_usage_error() -> None:
    done = trainscope("demo", "--no-store", "--ranks", "10", "--dp", "2", "--pp", "2")
    assert done.returncode == 2 and "does not match dp × pp × tp = 4" in done.stderr


def test_healthy_demo_text_output(tmp_path) -> None:
    done = trainscope("demo", "--steps", "60", "--store", str(tmp_path / "s"))
    assert done.returncode == 0, done.stderr
    assert "Diagnosis: healthy" in done.stdout
    assert f"store: {tmp_path / 's'}" in done.stdout


def test_schemas_export(tmp_path) -> None:
    done = trainscope("schemas", "export", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "SpanBatch.schema.json").exists()


REPLAY = """
import sys
from trainscope.testing import sample_windows
from trainscope.sinks.clickhouse import ClickHouseSink, run_query
sink = ClickHouseSink.open(sys.argv[1])
window = sample_windows(steps=20)[1]
finding = window.finding("t", rank=1, category="hang", score=1.0, message="m")
for _ in range(2):  # the same window delivered twice
    sink.write_window(window, [finding])
counts = [run_query(sink.client, f"SELECT count() FROM {t}")[1][0][0]
          for t in ("function_summaries", "step_records", "metric_samples", "findings")]
print(len(window.summaries), len(window.steps), len(window.metrics), 1, *counts)
"""


def test_sink_is_replay_safe(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-c", REPLAY, str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    numbers = [int(x) for x in done.stdout.split()]
    expected, stored = numbers[:4], numbers[4:]
    assert expected[0] > 0 and expected[1] > 0
    assert stored == expected
