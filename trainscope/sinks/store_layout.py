"""Which table layout a store has, and moving an older store to this one.

A store records the layout of the pipeline's tables in ``store_layout``. A store without that
table but with pipeline tables was written before layouts were recorded: layout 1 (every time
an ``Int64`` of nanoseconds, plain ``String`` columns, no partitions); layout 2 kept the
quantile sketches as 64-bit arrays (:data:`OLDER_LAYOUTS`). The writer refuses a
store whose layout differs from :data:`~trainscope.schemas.ddl.LAYOUT_VERSION` with one line
that says what to do; :func:`migrate` rewrites each table into the current layout (create the
new table beside it, ``INSERT … SELECT`` the shared columns, swap the names, drop the old one).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pyarrow as pa

from trainscope.schemas.ddl import (
    CALL_PATHS_DDL,
    DEAD_LETTERS_DDL,
    LAYOUT_VERSION,
    TABLES,
    TIME_COLUMNS,
    ttl_clause,
)
from trainscope.sinks.narrow import SKETCH_TYPES
from trainscope.store.client import StoreError, _first_line

COMPONENT = "pipeline"
# What each older layout lacks, for the line that refuses such a store.
OLDER_LAYOUTS = {1: "times as Int64 ns only", 2: "sketches as 64-bit arrays"}
LAYOUT_DDL = """CREATE TABLE IF NOT EXISTS store_layout (
    `component` String,
    `version` UInt32,
    `written_ns` Int64
)
ENGINE = ReplacingMergeTree(written_ns)
ORDER BY (component)"""

# The tables whose layout the version describes, with their current DDL.
LAYOUT_TABLES: dict[str, str] = {
    **{name: table.ddl() for name, table in TABLES.items()},
    "dead_letters": DEAD_LETTERS_DDL,
    "call_paths": CALL_PATHS_DDL,
}


# Columns added to a table after stores with it exist, without a new layout: added in place
# (``ADD COLUMN IF NOT EXISTS``, a metadata change) when a writer opens the store; rows written
# before hold the column's default (0, '').
ADDED_COLUMNS: dict[str, tuple[str, ...]] = {
    # The payload's full size and digest; `payload` keeps only a bounded prefix since.
    "dead_letters": ("`payload_bytes` UInt64", "`payload_sha256` String"),
    # Each step's time in collectives (what the early flag reads, detectors/early.py).
    # ... and on the device (CUDA events), where the producer times it there.
    "step_records": ("`collective_ns` Int64 CODEC(T64, ZSTD(1))",
                     "`device_collective_ns` Int64 CODEC(T64, ZSTD(1))"),
}


def _saturated(column: str, element: pa.DataType) -> str:
    """SQL copying an older, wider array column into ``element``'s range, clamped."""
    info = np.iinfo(element.to_pandas_dtype())
    cast = "to" + str(element).capitalize().replace("Uint", "UInt")  # toInt16, toUInt32
    return f"arrayMap(x -> {cast}(greatest(least(x, {info.max}), {info.min})), `{column}`)"


# Columns a newer layout keeps in a narrower type (the sink's own, trainscope.sinks.narrow):
# copied saturated, not wrapped around (which is what ClickHouse's conversion does). No sketch
# written by trainscope holds a value outside.
NARROWED: dict[tuple[str, str], str] = {
    ("function_summaries", column): _saturated(column, element)
    for column, element in SKETCH_TYPES.items()
}


def add_columns(client: Any) -> None:
    existing = _existing_tables(client)
    for table, columns in ADDED_COLUMNS.items():
        if table in existing:
            adds = ", ".join(f"ADD COLUMN IF NOT EXISTS {column}" for column in columns)
            _command(client, f"ALTER TABLE `{table}` {adds}")


def _query(client: Any, sql: str, **parameters: Any) -> list[Any]:
    try:
        return client.query(sql, parameters=parameters).result_rows
    except Exception as exc:
        raise StoreError(_first_line(exc)) from None


def _command(client: Any, sql: str, settings: dict[str, Any] | None = None) -> None:
    try:
        client.command(sql, settings=settings)
    except Exception as exc:
        raise StoreError(_first_line(exc)) from None


def _existing_tables(client: Any) -> set[str]:
    rows = _query(client, "SELECT name FROM system.tables WHERE database = currentDatabase()")
    return {row[0] for row in rows}


def layout_version(client: Any) -> int | None:
    """The store's layout; ``None`` for a store without pipeline tables (nothing to check)."""
    existing = _existing_tables(client)
    if "store_layout" in existing:
        rows = _query(client, "SELECT max(version) FROM store_layout "
                              "WHERE component = {component:String}", component=COMPONENT)
        if rows and rows[0][0]:
            return int(rows[0][0])
    return 1 if existing & set(LAYOUT_TABLES) else None


def check_layout(client: Any, where: str) -> int | None:
    """The store's layout (see :func:`layout_version`); ``StoreError`` naming the store and
    the way out if it is another than this one."""
    version = layout_version(client)
    if version is None or version == LAYOUT_VERSION:
        return version
    if version > LAYOUT_VERSION:
        raise StoreError(
            f"store {where} has table layout {version}, newer than this trainscope's "
            f"{LAYOUT_VERSION}: upgrade trainscope to write to it"
        )
    raise StoreError(
        f"store {where} has table layout {version} ({OLDER_LAYOUTS[version]}), this trainscope "
        f"writes layout {LAYOUT_VERSION}: run `trainscope store migrate {where}` first "
        f"(it rewrites the tables in place; stop writers to the store before)"
    )


def record_layout(client: Any) -> None:
    _command(client, LAYOUT_DDL)
    try:
        client.insert("store_layout", [[COMPONENT, LAYOUT_VERSION, time.time_ns()]],
                      column_names=["component", "version", "written_ns"])
    except Exception as exc:
        raise StoreError(f"insert into store_layout failed: {_first_line(exc)}") from None


def _stored_columns(client: Any, table: str) -> list[str]:
    """Columns a writer supplies (computed ones are left to the engine)."""
    rows = _query(client, "SELECT name FROM system.columns WHERE database = currentDatabase() "
                          "AND table = {table:String} AND default_kind NOT IN "
                          "('MATERIALIZED', 'ALIAS') ORDER BY position", table=table)
    return [row[0] for row in rows]


def migrate(client: Any) -> dict[str, int]:
    """Rewrite an older store's pipeline tables in this layout; returns rows per table moved.

    Each table is copied, not altered, because partition keys and sort keys cannot change in
    place. A table is swapped in only after its copy is complete; run again after a failure
    (a leftover ``*_migrating`` table from an interrupted run is dropped and redone).
    """
    version = layout_version(client)
    moved: dict[str, int] = {}
    if version == LAYOUT_VERSION:
        return moved
    if version is not None and version > LAYOUT_VERSION:
        check_layout(client, "at hand")
    existing = _existing_tables(client)
    for table, ddl in LAYOUT_TABLES.items():
        if table not in existing:
            continue
        staging = f"{table}_migrating"
        _command(client, f"DROP TABLE IF EXISTS `{staging}`")
        _command(client, ddl.replace(f"EXISTS {table} (", f"EXISTS `{staging}` (", 1))
        wanted = _stored_columns(client, staging)
        have = set(_stored_columns(client, table))
        shared = [c for c in wanted if c in have]
        columns = ", ".join(f"`{c}`" for c in shared)
        values = ", ".join(NARROWED.get((table, c), f"`{c}`") for c in shared)
        # Whole old table in one statement; the engine streams it block by block. Without
        # deduplication (two equal blocks of the copy are both rows of the old table) and
        # without the limit of 100 day partitions per block (the old table has no days).
        _command(client, f"INSERT INTO `{staging}` ({columns}) SELECT {values} FROM `{table}`",
                 settings={"insert_deduplicate": 0, "max_partitions_per_insert_block": 0})
        moved[table] = int(_query(client, f"SELECT count() FROM `{staging}`")[0][0])
        _command(client, f"EXCHANGE TABLES `{staging}` AND `{table}`")
        _command(client, f"DROP TABLE `{staging}`")
    record_layout(client)
    return moved


def set_retention(client: Any, retention_days: int) -> None:
    """Keep rows of the time series tables ``retention_days`` days (0: keep them forever)."""
    existing = _existing_tables(client)
    for table in TIME_COLUMNS:
        if table not in existing:
            continue
        if retention_days == 0:
            if "TTL " in _engine_full(client, table):
                _command(client, f"ALTER TABLE `{table}` REMOVE TTL")
            continue
        clause = ttl_clause(table, retention_days)
        if clause.removeprefix("TTL ") not in _engine_full(client, table):
            _command(client, f"ALTER TABLE `{table}` MODIFY {clause}")


def _engine_full(client: Any, table: str) -> str:
    rows = _query(client, "SELECT engine_full FROM system.tables "
                          "WHERE database = currentDatabase() AND name = {table:String}",
                  table=table)
    return str(rows[0][0]) if rows else ""
