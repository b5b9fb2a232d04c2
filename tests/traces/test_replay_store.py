"""``trainscope replay kineto`` publishes on the bus and writes the store: summaries, steps and
the calling-context tree, which one SQL query reads per call path and rank."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from click.testing import CliRunner

from trainscope.cli import replay as replay_cli
from trainscope.cli.traces import replay
from trainscope.producers.replay.kineto import records_of
from trainscope.schemas.codec import decode_batch
from trainscope.schemas.records import StepRecord, SummaryBatch
from trainscope.traces.condense import condense
from trainscope.traces.reader import read_trace, trace_files
from trainscope.transport.bus import EVENTS_TOPIC
from trainscope.transport.memory import MemoryBus


def test_the_command_publishes_every_rank(gloo_traces: Path, monkeypatch) -> None:
    bus = MemoryBus()
    monkeypatch.setattr(replay_cli, "open_bus", lambda url: bus)
    # The same window as the expectation below: the trace's wall-clock times fall anywhere
    # in a window, so with another length the two may split it differently.
    result = CliRunner().invoke(replay, ["kineto", str(gloo_traces), "--job", "J", "--bus",
                                         "memory", "--window-s", "1"])
    assert result.exit_code == 0, result.output
    records = [r for m in bus.consumer([EVENTS_TOPIC], "c").poll(max_records=100_000)
               for r in decode_batch(m.value)]
    ranks = {int(r.column("rank")[0]) if isinstance(r, SummaryBatch) else r.rank
             for r in records}
    assert ranks == {0, 1} and {r.job_id for r in records} == {"J"}
    assert f"published {len(records)} records" in result.output
    expected = sum(len(records_of(condense(read_trace(p), "J", 10**9)))
                   for p in trace_files([gloo_traces]))
    assert len(records) == expected
    assert sorted((r.rank, r.step) for r in records if isinstance(r, StepRecord)) == [
        (r, s) for r in (0, 1) for s in (1, 2, 3)]


# chDB allows one store per process: the store is written and queried in a child process.
QUERY = """
import json, sys
import clickhouse_connect
client = clickhouse_connect.get_client(dsn="chdb://" + sys.argv[1])
q = lambda sql: client.query(sql).result_rows
print(json.dumps({
  "paths": q("SELECT rank, arrayStringConcat(path, ' > '), sum(total_ns) FROM call_paths "
             "WHERE name = 'extra_work' GROUP BY rank, path"),
  "labels": q("SELECT rank, sum(count), sum(total_ns) FROM function_summaries "
              "WHERE layer = 'user_annotation' AND name = 'extra_work' GROUP BY rank"),
  "layers": q("SELECT DISTINCT layer FROM function_summaries ORDER BY layer"),
  "steps": q("SELECT count() FROM step_records"),
}))
"""


def test_the_store_answers_call_path_questions_in_one_query(gloo_traces: Path, tmp_path):
    store = tmp_path / "store"
    done = subprocess.run(
        [sys.executable, "-m", "trainscope.cli.main", "replay", "kineto", str(gloo_traces),
         "--store", str(store)], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "stored" in done.stdout
    done = subprocess.run([sys.executable, "-c", QUERY, str(store)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    # Straight from the trace of rank 1 (the one with the extra block).
    expected = defaultdict(int)
    for path in trace_files([gloo_traces]):
        trace = read_trace(path)
        extra = trace.names.index("extra_work") if "extra_work" in trace.names else -1
        expected[trace.rank] += int(trace.dur_ns[trace.name_id == extra].sum())
    assert [(r, n) for r, n in expected.items() if n] == [(1, expected[1])]
    ((rank, path, total),) = got["paths"]
    assert rank == 1 and total == expected[1]
    assert path.endswith("ProfilerStep#* > extra_work") and "_loop" in path
    assert got["labels"] == [[1, 3, expected[1]]]  # a record_function label, like any op
    assert {"python", "torch_op", "user_annotation"} <= {row[0] for row in got["layers"]}
    assert got["steps"] == [[6]]
