"""The ClickHouse DDL against the structs, checked on the real engine (chDB).

chDB allows one store per process, so the engine work runs in a child process.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import typing

from trainscope.schemas.ddl import BUS_ONLY, TABLES, clickhouse_type
from trainscope.schemas.records import RECORD_TYPES

SCRIPT = """
import json, sys
import clickhouse_connect
from trainscope.schemas.ddl import all_ddl, TABLES
client = clickhouse_connect.get_client(dsn="chdb://" + sys.argv[1])
for ddl in all_ddl():
    client.command(ddl)
out = {}
for name in TABLES:
    rows = client.query(f"SELECT name, type, compression_codec FROM system.columns "
                        f"WHERE database = currentDatabase() AND table = '{name}'").result_rows
    out[name] = {row[0]: row[1] for row in rows}
    out[name + " codecs"] = {row[0]: row[2] for row in rows if row[2]}
    out[name + " partition"] = client.query(
        f"SELECT partition_key FROM system.tables WHERE name = '{name}'").result_rows[0][0]
print(json.dumps(out))
"""


def test_tables_on_the_engine_match_the_structs(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "store")],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr
    described = json.loads(done.stdout.strip().splitlines()[-1])
    for name, table in TABLES.items():
        hints = typing.get_type_hints(table.struct)
        columns = described[name]
        for field in table.struct.__struct_fields__:
            if field in table.skip:
                assert field not in columns
                continue
            assert field in columns, f"{name} lacks column {field}"
            expected = table.types.get(field) or clickhouse_type(hints[field])
            assert columns[field] == expected, (name, field)
        extra = set(columns) - set(table.struct.__struct_fields__)
        assert extra == set(table.extra), (name, extra)
        # Codecs as declared (the engine spells out defaults: Delta → Delta(8)).
        codecs = described[name + " codecs"]
        assert set(codecs) == set(table.codecs), name
        for column, codec in table.codecs.items():
            assert re.sub(r"\(\d+\)", "", codecs[column]) == re.sub(r"\(\d+\)", "", codec), (
                name, column)
        expected_partition = (
            f"toDate(fromUnixTimestamp64Nano({table.time_column}, 'UTC'))"
            if table.time_column else ""
        )
        assert described[name + " partition"] == expected_partition, name


def test_time_series_tables_have_a_datetime_twin_per_ns_time() -> None:
    for name in ("function_summaries", "step_records", "metric_samples", "findings"):
        table = TABLES[name]
        for column in table.columns():
            if column.endswith("_ns") and column.removesuffix("_ns") in (
                    "window_start", "window_end", "start", "ts"):
                twin = table.columns()[column.removesuffix("_ns")]
                assert twin.startswith("DateTime64(9, 'UTC') ALIAS "), (name, column)
                assert f"fromUnixTimestamp64Nano({column}, 'UTC')" in twin, (name, column)
        assert table.time_column, name


def test_every_record_kind_is_stored_or_declared_bus_only() -> None:
    stored = {table.struct for table in TABLES.values()}
    assert not stored & set(BUS_ONLY)
    assert stored | set(BUS_ONLY) == set(RECORD_TYPES)
