"""Table layouts on the real engine: an older store is refused, then migrated; retention TTL.

The fixture of "a store written by trainscope before this change" is that trainscope's DDL,
copied here as it was (layout 1: times only as Int64 ns, plain String columns, no partitions;
layout 2: the quantile sketches as Array(Int64) keys and Array(UInt64) counts).
chDB lets one process own a store, so engine work runs in child processes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

OLD_DDL = [
    """CREATE TABLE IF NOT EXISTS step_records (
    `v` Int64,
    `job_id` String,
    `rank` Int64,
    `step` Int64,
    `start_ns` Int64,
    `duration_ns` Int64,
    `samples` Int64,
    `tokens` Int64,
    `seq_len_mean` Float64,
    `seq_len_max` Int64
)
ENGINE = ReplacingMergeTree
ORDER BY (job_id, rank, step)
SETTINGS non_replicated_deduplication_window = 10000""",
    """CREATE TABLE IF NOT EXISTS findings (
    `v` Int64,
    `job_id` String,
    `window_start_ns` Int64,
    `window_end_ns` Int64,
    `detector` String,
    `rank` Int64,
    `ranks` Array(Int64),
    `victims` Array(Int64),
    `pp_stage` Int64,
    `layer` String,
    `function` String,
    `category` String,
    `score` Float64,
    `evidence` Map(String, Float64),
    `message` String
)
ENGINE = ReplacingMergeTree
ORDER BY (job_id, window_start_ns, detector, rank, pp_stage, function)
SETTINGS non_replicated_deduplication_window = 10000""",
    """CREATE TABLE IF NOT EXISTS dead_letters (
    `received_ns` Int64,
    `topic` String,
    `partition` Int64,
    `offset` Int64,
    `error` String,
    `payload` String
)
ENGINE = MergeTree
ORDER BY (received_ns, topic, partition, offset)""",
]

# 2026-01-01T00:00:00Z and a minute and a day later.
T0_NS = 1_767_225_600 * 10**9

WRITE_OLD = r"""
import json, sys
import clickhouse_connect
client = clickhouse_connect.get_client(dsn="chdb://" + sys.argv[1])
ddl, t0 = json.loads(sys.stdin.read()), int(sys.argv[2])
for statement in ddl:
    client.command(statement)
client.insert("step_records",
              [[1, "old-job", rank, step, t0 + step * 30 * 10**9, 10**9 + rank, 8, 0, 0.0, 0]
               for rank in range(4) for step in range(6)],
              column_names=["v", "job_id", "rank", "step", "start_ns", "duration_ns",
                            "samples", "tokens", "seq_len_mean", "seq_len_max"])
client.insert("findings",
              [[1, "old-job", t0, t0 + 15 * 10**9, "robust_z", 3, [3], [1, 2], 0, "torch_op",
                "backward", "gpu-compute", 0.9, {"z": 7.5}, "rank 3 is slow"]],
              column_names=["v", "job_id", "window_start_ns", "window_end_ns", "detector",
                            "rank", "ranks", "victims", "pp_stage", "layer", "function",
                            "category", "score", "evidence", "message"])
# Over 100 days: more day partitions than one insert block may make by default.
client.insert("dead_letters", [[t0 + day * 86_400 * 10**9, "spans", 0, day, "bad", "00"]
                               for day in range(150)],
              column_names=["received_ns", "topic", "partition", "offset", "error", "payload"])
"""

READ = r"""
import json, sys
from trainscope.store.client import connect
client = connect(sys.argv[1], readonly=True, create=False)
rows = lambda sql: [list(map(str, row)) for row in client.query(sql).result_rows]
out = {}
for table in ("step_records", "findings", "dead_letters"):
    out[table] = rows(f"SELECT * FROM {table} ORDER BY ALL")
    out[table + " types"] = {row[0]: row[1] for row in
                             client.query(f"DESCRIBE TABLE {table}").result_rows}
if "start" in out["step_records types"]:
    out["per minute"] = rows("SELECT toStartOfMinute(start) AS minute, count() "
                             "FROM step_records GROUP BY minute ORDER BY minute")
layout = client.query("EXISTS TABLE store_layout").result_rows[0][0]
out["layout"] = client.query("SELECT max(version) FROM store_layout").result_rows[0][0] \
    if layout else None
print(json.dumps(out))
"""


def run(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True,
                          timeout=120, check=False)


def old_store(tmp_path: Path) -> Path:
    store = tmp_path / "store"
    done = run("-c", WRITE_OLD, str(store), str(T0_NS), stdin=json.dumps(OLD_DDL))
    assert done.returncode == 0, done.stderr
    return store


def read(store: Path) -> dict:
    done = run("-c", READ, str(store))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_older_store_is_refused_with_one_line_naming_it_and_the_way_out(tmp_path) -> None:
    store = old_store(tmp_path)
    before = read(store)
    done = run("-m", "trainscope.cli.main", "demo", "--steps", "5", "--store", str(store))
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert errors == [
        f"Error: store {store.resolve()} has table layout 1 (times as Int64 ns only), this "
        f"trainscope writes layout 3: run `trainscope store migrate {store.resolve()}` first "
        "(it rewrites the tables in place; stop writers to the store before)"
    ], done.stderr
    after = read(store)
    assert after == before, "a refused store must be left as it was"
    assert after["layout"] is None


def test_migrate_keeps_every_row_and_gives_the_new_layout(tmp_path) -> None:
    store = old_store(tmp_path)
    before = read(store)
    assert before["step_records types"]["job_id"] == "String"
    assert "start" not in before["step_records types"]

    done = run("-m", "trainscope.cli.main", "store", "migrate", str(store))
    assert done.returncode == 0, done.stderr
    assert "step_records: 24 row(s) rewritten" in done.stdout
    assert "findings: 1 row(s) rewritten" in done.stdout
    assert "dead_letters: 150 row(s) rewritten" in done.stdout

    after = read(store)
    assert after["layout"] == 3
    assert after["findings"] == before["findings"]
    # Dead letters gained two columns since (payload_bytes, payload_sha256: 0 and '' in old
    # rows, added at the end), step records one (collective_ns, 0 in old rows); the rest of
    # each row is unchanged.
    for table in ("dead_letters", "step_records"):
        width = len(before[table][0])
        assert [row[:width] for row in after[table]] == before[table], table
    assert {row[width] for row in after["step_records"]} == {"0"}
    assert after["step_records types"]["job_id"] == "LowCardinality(String)"
    assert after["findings types"]["category"] == "LowCardinality(String)"
    assert after["step_records types"]["start"] == "DateTime64(9, 'UTC')"
    # Steps every 30 s from 00:00: two per minute on each of 4 ranks.
    assert after["per minute"] == [
        ["2026-01-01 00:00:00", "8"], ["2026-01-01 00:01:00", "8"], ["2026-01-01 00:02:00", "8"]]

    # Migrated: the writer takes it, and migrating again changes nothing.
    done = run("-m", "trainscope.cli.main", "demo", "--steps", "5", "--ranks", "4", "--dp", "2",
               "--pp", "2", "--tp", "1", "--store", str(store), "--json")
    assert done.returncode == 0, done.stderr
    done = run("-m", "trainscope.cli.main", "store", "migrate", str(store))
    assert done.returncode == 0, done.stderr
    assert "rewritten" not in done.stdout


RETENTION = r"""
import json, sys, time
from trainscope.sinks.clickhouse import ClickHouseSink
import pandas as pd
sink = ClickHouseSink.open(sys.argv[1])
now_ns, old_ns = time.time_ns(), int(sys.argv[2])
steps = pd.DataFrame({"v": 1, "job_id": "j", "rank": [0, 0], "step": [0, 1],
                      "start_ns": [old_ns, now_ns], "duration_ns": 10**9, "samples": 0,
                      "tokens": 0, "seq_len_mean": 0.0, "seq_len_max": 0, "collective_ns": 0,
                      "device_collective_ns": 0})
sink._insert("step_records", steps)
sink.close()
sink = ClickHouseSink.open(sys.argv[1], retention_days=7)
sink.client.command("OPTIMIZE TABLE step_records FINAL")
left = [row[0] for row in sink.client.query("SELECT step FROM step_records").result_rows]
ttl = sink.client.query("SELECT engine_full FROM system.tables WHERE name = 'step_records'"
                        ).result_rows[0][0]
print(json.dumps({"left": left, "ttl": "TTL " in ttl}))
"""


def test_retention_drops_days_older_than_it(tmp_path) -> None:
    old_ns = time.time_ns() - 30 * 86_400 * 10**9
    done = run("-c", RETENTION, str(tmp_path / "store"), str(old_ns))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"left": [1], "ttl": True}


def test_migrate_names_a_missing_store_and_creates_none(tmp_path) -> None:
    missing = tmp_path / "no-store"
    done = run("-m", "trainscope.cli.main", "store", "migrate", str(missing))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [f"Error: no store at {missing}: check the path"]
    assert not missing.exists()


RESEND = r"""
import json, sys
import pandas as pd
from trainscope.sinks.clickhouse import ClickHouseSink
sink = ClickHouseSink.open(sys.argv[1])
midnight_ns = int(sys.argv[2])
# One batch across midnight: the engine splits it into one part per day.
steps = pd.DataFrame({"v": 1, "job_id": "j", "rank": 0, "step": range(6),
                      "start_ns": [midnight_ns + (s - 3) * 10**9 for s in range(6)],
                      "duration_ns": 10**9, "samples": 0, "tokens": 0, "seq_len_mean": 0.0,
                      "seq_len_max": 0, "collective_ns": 0,
                      "device_collective_ns": 0})
for _ in range(2):
    sink._insert("step_records", steps)
rows = sink.client.query("SELECT toString(toDate(start)), count() FROM step_records "
                         "GROUP BY 1 ORDER BY 1").result_rows
parts = sink.client.query("SELECT count() FROM system.parts WHERE active "
                          "AND table = 'step_records'").result_rows[0][0]
print(json.dumps({"rows": rows, "parts": parts}))
"""


def test_a_batch_across_midnight_sent_twice_is_stored_once(tmp_path) -> None:
    midnight_ns = T0_NS + 86_400 * 10**9
    done = run("-c", RESEND, str(tmp_path / "store"), str(midnight_ns))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"rows": [["2026-01-01", 3], ["2026-01-02", 3]], "parts": 2}


AS_BEFORE_COLLECTIVE_NS = r"""
import sys
from trainscope.sinks.clickhouse import ClickHouseSink
sink = ClickHouseSink.open(sys.argv[1])
sink.client.command("ALTER TABLE step_records DROP COLUMN collective_ns")
sink.client.command("ALTER TABLE step_records DROP COLUMN device_collective_ns")
sink.client.command("INSERT INTO step_records (v, job_id, rank, step, start_ns, duration_ns, "
                    "samples, tokens, seq_len_mean, seq_len_max) VALUES (1, 'j', 0, 0, 1, 2, "
                    "0, 0, 0, 0)")
sink.close()
"""

WRITE_COLLECTIVE_NS = r"""
import json, sys
import pandas as pd
from trainscope.sinks.clickhouse import ClickHouseSink
sink = ClickHouseSink.open(sys.argv[1])
sink._insert("step_records", pd.DataFrame({
    "v": 1, "job_id": "j", "rank": 0, "step": [1], "start_ns": 3, "duration_ns": 4,
    "samples": 0, "tokens": 0, "seq_len_mean": 0.0, "seq_len_max": 0, "collective_ns": 5,
    "device_collective_ns": 6}))
rows = sink.client.query("SELECT step, collective_ns, device_collective_ns FROM step_records "
                         "ORDER BY step").result_rows
print(json.dumps([list(row) for row in rows]))
"""


def test_a_store_from_before_the_collective_times_takes_them_and_keeps_its_rows(
        tmp_path) -> None:
    store = str(tmp_path / "store")
    done = run("-c", AS_BEFORE_COLLECTIVE_NS, store)
    assert done.returncode == 0, done.stderr
    done = run("-c", WRITE_COLLECTIVE_NS, store)
    assert done.returncode == 0, done.stderr
    # The older row holds the new columns' defaults; the new one its values.
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [[0, 0, 0], [1, 5, 6]]


# Layout 2's function_summaries, as trainscope wrote it (sketches as 64-bit arrays).
LAYOUT2_DDL = [
    """CREATE TABLE IF NOT EXISTS function_summaries (
    `v` Int64,
    `job_id` LowCardinality(String),
    `rank` Int64,
    `layer` LowCardinality(String),
    `name` LowCardinality(String),
    `callpath_id` UInt64,
    `window_start_ns` Int64 CODEC(Delta, ZSTD(1)),
    `window_end_ns` Int64 CODEC(Delta, ZSTD(1)),
    `count` Int64 CODEC(T64, ZSTD(1)),
    `total_ns` Int64 CODEC(T64, ZSTD(1)),
    `m2_ns2` Float64 CODEC(Gorilla, ZSTD(1)),
    `min_ns` Int64 CODEC(T64, ZSTD(1)),
    `max_ns` Int64 CODEC(T64, ZSTD(1)),
    `bytes_total` Int64 CODEC(T64, ZSTD(1)),
    `sketch_keys` Array(Int64) CODEC(ZSTD(1)),
    `sketch_counts` Array(UInt64) CODEC(ZSTD(1)),
    `mean_ns` Float64 MATERIALIZED if(count = 0, 0, total_ns / count),
    `window_start` DateTime64(9, 'UTC') ALIAS fromUnixTimestamp64Nano(window_start_ns, 'UTC'),
    `window_end` DateTime64(9, 'UTC') ALIAS fromUnixTimestamp64Nano(window_end_ns, 'UTC')
)
ENGINE = ReplacingMergeTree
PARTITION BY toDate(fromUnixTimestamp64Nano(window_start_ns, 'UTC'))
ORDER BY (job_id, window_start_ns, rank, layer, name, callpath_id)
SETTINGS non_replicated_deduplication_window = 10000, ttl_only_drop_parts = 1""",
    """CREATE TABLE IF NOT EXISTS store_layout (
    `component` String,
    `version` UInt32,
    `written_ns` Int64
)
ENGINE = ReplacingMergeTree(written_ns)
ORDER BY (component)""",
]

WRITE_LAYOUT2 = r"""
import json, sys
import clickhouse_connect
client = clickhouse_connect.get_client(dsn="chdb://" + sys.argv[1])
ddl, t0 = json.loads(sys.stdin.read()), int(sys.argv[2])
for statement in ddl:
    client.command(statement)
client.insert("store_layout", [["pipeline", 2, 1]],
              column_names=["component", "version", "written_ns"])
# The longest key a duration has (2,184, an Int64's); a count past UInt32 (never written by
# trainscope, which validates them; here to show the copy saturates it).
client.insert("function_summaries",
              [[1, "old-job", rank, "torch_op", "aten::mm", 0, t0, t0 + 15 * 10**9, 3, 30, 2.0,
                9, 11, 0, [0, 1500, 2184], [1, 1, 5_000_000_000 if rank else 1]]
               for rank in range(2)],
              column_names=["v", "job_id", "rank", "layer", "name", "callpath_id",
                            "window_start_ns", "window_end_ns", "count", "total_ns", "m2_ns2",
                            "min_ns", "max_ns", "bytes_total", "sketch_keys", "sketch_counts"])
"""

READ_SUMMARIES = r"""
import json, sys
from trainscope.store.client import connect
client = connect(sys.argv[1], readonly=True, create=False)
print(json.dumps({
    "rows": [[row[1], row[2], row[14], row[15]] for row in client.query(
        "SELECT * FROM function_summaries ORDER BY job_id, rank").result_rows],
    "types": {row[0]: row[1] for row in client.query(
        "DESCRIBE TABLE function_summaries").result_rows if row[0].startswith("sketch")},
    "layout": client.query("SELECT max(version) FROM store_layout").result_rows[0][0]}))
"""

WRITE_SKETCHES = r"""
import json, sys
import pandas as pd, pyarrow as pa
from trainscope.sinks.clickhouse import ClickHouseSink
sink = ClickHouseSink.open(sys.argv[1])
t0 = int(sys.argv[2]) + 60 * 10**9
lists = pd.ArrowDtype(pa.large_list(pa.int64()))
sink._insert("function_summaries", pd.DataFrame({
    "v": 1, "job_id": "new-job", "rank": [0, 1], "layer": "torch_op", "name": "aten::mm",
    "callpath_id": 0, "window_start_ns": t0, "window_end_ns": t0 + 15 * 10**9, "count": 3,
    "total_ns": 30, "m2_ns2": 2.0, "min_ns": 9, "max_ns": 11, "bytes_total": 0,
    "sketch_keys": pd.Series([[0, 2184], [7]], dtype=lists),
    "sketch_counts": pd.Series([[2, 1], [2**32 + 1]], dtype=lists)}))
print(json.dumps({"clamped": sink.stats.sketch_values_clamped}))
"""


def test_a_layout_2_store_is_refused_then_migrated_into_the_narrow_sketches(tmp_path) -> None:
    store = tmp_path / "store"
    done = run("-c", WRITE_LAYOUT2, str(store), str(T0_NS), stdin=json.dumps(LAYOUT2_DDL))
    assert done.returncode == 0, done.stderr
    done = run("-m", "trainscope.cli.main", "demo", "--steps", "5", "--store", str(store))
    assert done.returncode != 0
    assert [line for line in done.stderr.splitlines() if line.startswith("Error:")] == [
        f"Error: store {store.resolve()} has table layout 2 (sketches as 64-bit arrays), this "
        f"trainscope writes layout 3: run `trainscope store migrate {store.resolve()}` first "
        "(it rewrites the tables in place; stop writers to the store before)"
    ], done.stderr

    done = run("-m", "trainscope.cli.main", "store", "migrate", str(store))
    assert done.returncode == 0, done.stderr
    assert "function_summaries: 2 row(s) rewritten" in done.stdout
    done = run("-c", READ_SUMMARIES, str(store))
    assert done.returncode == 0, done.stderr
    after = json.loads(done.stdout.strip().splitlines()[-1])
    assert after["layout"] == 3
    assert after["types"] == {"sketch_keys": "Array(Int16)", "sketch_counts": "Array(UInt32)"}
    assert after["rows"] == [["old-job", 0, [0, 1500, 2184], [1, 1, 1]],
                             ["old-job", 1, [0, 1500, 2184], [1, 1, 2**32 - 1]]]

    # The sink writes into it; a count past UInt32 is stored saturated and counted, not
    # wrapped round (ClickHouse's own conversion would store 1).
    done = run("-c", WRITE_SKETCHES, str(store), str(T0_NS))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"clamped": 1}
    done = run("-c", READ_SUMMARIES, str(store))
    rows = json.loads(done.stdout.strip().splitlines()[-1])["rows"]
    assert rows == [["new-job", 0, [0, 2184], [2, 1]], ["new-job", 1, [7], [2**32 - 1]],
                    *after["rows"]]
