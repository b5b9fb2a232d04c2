"""The ClickHouse writer: summaries, step records, metric samples, findings, dead letters.

One client API for both deployments: an embedded chDB engine at a store directory
(``chdb:///abs/path`` through clickhouse-connect) or any ClickHouse server over HTTP. Writes are
batched per closed window (one insert per table), and replay-safe: the tables deduplicate
re-sent blocks and collapse equal keys on merge (see :mod:`trainscope.schemas.ddl`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pandas as pd
import pyarrow as pa

from trainscope.config.secrets import redact_url
from trainscope.config.settings import Settings
from trainscope.schemas.ddl import MARKS_DDL, TABLES, all_ddl
from trainscope.schemas.records import (
    SCHEMA_VERSION,
    Finding,
    FindingCallPath,
    ProfileCallPaths,
    Topology,
)
from trainscope.schemas.untrusted import bounded_payload
from trainscope.schemas.whatif import SETUP_SQL as WHATIF_SETUP_SQL
from trainscope.schemas.whatif import OpTraceJob, stored_trace_rows
from trainscope.schemas.window import WindowView
from trainscope.sinks.arrow_insert import EmbeddedArrowInserts
from trainscope.sinks.narrow import SKETCH_TYPES, narrow_lists
from trainscope.sinks.store_layout import (
    add_columns,
    check_layout,
    record_layout,
    set_retention,
)
from trainscope.sinks.store_watch import StoreWatch
from trainscope.store.client import (
    StoreError,
    _first_line,
    connect,
    default_store_dir,
    embedded_path,
)
from trainscope.store.live import ReadEndpoint, serve_reads

# The columns of call_paths in the order of trainscope.traces.cct.call_path_rows.
CALL_PATH_COLUMNS = (
    "job_id", "rank", "window_start_ns", "window_end_ns", "callpath_id", "parent_id", "depth",
    "layer", "name", "path", "path_layers", "count", "total_ns", "self_ns", "steps",
)

# The tables the sink writes, whose loss it watches for (see trainscope.sinks.store_watch).
WATCHED_TABLES = (*TABLES, "dead_letters", "pipeline_checkpoints", "call_paths")

log = logging.getLogger(__name__)


def run_query(client: Any, sql: str) -> tuple[list[str], list[Sequence[Any]]]:
    try:
        result = client.query(sql)
    except Exception as exc:
        raise StoreError(_first_line(exc)) from None
    return list(result.column_names), result.result_rows


@dataclass
class SinkStats:
    windows: int = 0
    rows_written: int = 0
    dead_letters: int = 0
    errors: int = 0
    # Sketch keys or bucket counts outside the store's Int16 / UInt32, stored clamped
    # (trainscope.sinks.narrow); validation keeps the wire's within range, so this stays 0.
    sketch_values_clamped: int = 0


class ClickHouseSink:
    """The stream jobs' writer into a ClickHouse store: the
    :class:`~trainscope.engine.sink.Sink` of ``trainscope pipeline``, the demo and the Faust
    workers.

    It owns one clickhouse-connect client (an embedded chDB directory or a server over HTTP) and
    the store's tables: on construction it creates them, or checks that an existing store has
    this layout. Each closed window goes in with one insert per table, its sketches as Arrow;
    inserts are replay-safe (a re-sent block is deduplicated, equal keys collapse on merge), so
    a window rebuilt after a restart may be written again. A failure is raised as
    :class:`StoreError` with ClickHouse's first line (a failed write is counted in
    ``stats.errors``); retrying
    is the caller's business (the stream jobs retry with backoff). Opened on an embedded store
    (:meth:`open`), it serves the store's read endpoint until closed (see
    :mod:`trainscope.store.live`), so other processes can query the store it owns.

    It watches the store (:meth:`store_lost`): a store directory deleted or moved, a table or
    its data directory gone, a server's database dropped. The checkpoint of a group is stored
    with the tables' marks, and a checkpoint written for tables that have since been replaced
    is not read back (:meth:`read_checkpoint`): the stream job then re-reads the bus.
    """

    def __init__(self, client: Any, *, where: str = "at hand",
                 retention_days: int | None = None) -> None:
        """Creates the tables, or checks that the store's are in this layout (``where`` names
        the store in that error). ``retention_days`` sets how long rows of the time series
        tables are kept (0: forever); ``None`` leaves the store's setting as it is."""
        self.client = client
        self.stats = SinkStats()
        self.reads: ReadEndpoint | None = None
        new_store = check_layout(client, where) is None
        for ddl in all_ddl():
            self._command(ddl)
        add_columns(client)  # columns added since the store was made: additive, in place
        if new_store:
            record_layout(client)
        if retention_days is not None:
            set_retention(client, retention_days)
        self._command(MARKS_DDL)
        self.watch = StoreWatch(client, where, embedded_path(client), WATCHED_TABLES)
        self._lost: str | None = None
        self._marked: set[str] = set()  # groups whose marks this sink stored
        self._whatif_tables = False  # made (write_op_trace)
        path = embedded_path(client)
        # Arrow read in place by the embedded engine; a server takes it over HTTP as it is.
        self._in_memory = EmbeddedArrowInserts(path) if path is not None else None

    @classmethod
    def open(
        cls, store: Path | str | None = None, url: str | None = None,
        settings: Settings | None = None, *, retention_days: int | None = None,
    ) -> ClickHouseSink:
        client = connect(store, url, settings=settings)
        default_dir = settings.store_dir if settings is not None else default_store_dir()
        where = redact_url(url) if url else str(Path(store or default_dir).expanduser().resolve())
        sink = cls(client, where=where, retention_days=retention_days)
        if not url:
            # This process now owns the embedded store: others can read it only through us.
            sink.reads = serve_reads(where)
        return sink

    def _command(self, sql: str) -> None:
        try:
            self.client.command(sql)
        except Exception as exc:
            raise StoreError(_first_line(exc)) from None

    def _guard(self) -> None:
        """Refuse to write into a store that was lost (see :meth:`StoreWatch.moved`)."""
        if self._lost is None:
            self._lost = self.watch.moved()
        if self._lost is not None:
            raise StoreError(self._lost)

    def _insert(self, table: str, frame: pd.DataFrame, scalar: bool = False) -> None:
        """``scalar``: ``frame`` holds only numbers and strings (no lists, no dicts, which
        Arrow would read as structs), so it may go in as Arrow."""
        if frame.empty:
            return
        self._guard()
        columns = list(TABLES[table].insert_columns)
        missing = [c for c in columns if c not in frame.columns]
        if missing:
            raise StoreError(f"rows for {table} lack columns {missing}")
        rows = frame[columns]
        try:
            if scalar or any(isinstance(dtype, pd.ArrowDtype) for dtype in rows.dtypes):
                # As Arrow: insert_df converts value by value (and builds each LowCardinality
                # column's dictionary in Python), 3x slower at a window of 600k summaries
                # (its sketches are Arrow lists), and for the step records and metric samples
                # of a 10,240-rank window about a seventh of the store's time.
                arrow = pa.Table.from_pandas(rows, preserve_index=False)
                if table == "function_summaries":
                    arrow, clamped = narrow_lists(arrow, SKETCH_TYPES)
                    if clamped:
                        self.stats.sketch_values_clamped += clamped
                        log.warning("%d sketch value(s) outside the store's Int16 keys / UInt32 "
                                    "counts, stored clamped", clamped)
                if self._in_memory is not None:
                    self._in_memory.insert(table, columns, arrow)
                else:
                    self.client.insert_arrow(table, arrow)
            else:
                self.client.insert_df(table, rows)
        except Exception as exc:
            self.stats.errors += 1
            raise StoreError(f"insert into {table} failed: {_first_line(exc)}") from None
        self.stats.rows_written += len(frame)

    def write_window(self, view: WindowView, findings: list[Finding]) -> None:
        job = {"v": SCHEMA_VERSION, "job_id": view.job_id}
        if not view.summaries.empty:
            summaries = view.summaries.assign(
                **job, window_start_ns=view.window_start_ns, window_end_ns=view.window_end_ns
            )
            self._insert("function_summaries", summaries)
        if not view.steps.empty:
            self._insert("step_records", view.steps.assign(**job), scalar=True)
        if not view.metrics.empty:
            self._insert("metric_samples", view.metrics.assign(**job), scalar=True)
        self.write_findings(findings)
        self.stats.windows += 1

    def write_findings(self, findings: list[Finding]) -> None:
        if findings:
            columns = TABLES["findings"].insert_columns
            self._insert(
                "findings",
                pd.DataFrame({c: [getattr(f, c) for f in findings] for c in columns}),
            )

    def write_call_path_rows(self, rows: Sequence[tuple[object, ...]]) -> None:
        """Rows of ``call_paths`` (columns ``CALL_PATH_COLUMNS``), in one insert."""
        if not rows:
            return
        self._guard()
        try:
            self.client.insert("call_paths", list(rows), column_names=list(CALL_PATH_COLUMNS))
        except Exception as exc:
            self.stats.errors += 1
            raise StoreError(f"insert into call_paths failed: {_first_line(exc)}") from None
        self.stats.rows_written += len(rows)

    def write_profile(self, parts: Sequence[ProfileCallPaths]) -> None:
        """One on-demand profile session's call-path tree (all its parts) into ``call_paths``;
        the session, from its start to its stop, is the row's window."""
        self.write_call_path_rows(profile_rows(parts))

    def write_finding_call_paths(self, rows: Sequence[FindingCallPath]) -> None:
        if rows:
            columns = TABLES["finding_call_paths"].insert_columns
            self._insert("finding_call_paths",
                         pd.DataFrame({c: [getattr(r, c) for r in rows] for c in columns}))

    def write_op_trace(self, job: OpTraceJob, frame: pd.DataFrame) -> None:
        """Ops of a job's what-if op trace (validated: ``trainscope.schemas.optrace.validate``)
        and the job's sizes, for ``trainscope whatif --job``; the what-if tables are made with
        the first."""
        self._guard()
        rows = stored_trace_rows(job.job_id, frame)
        try:
            if not self._whatif_tables:
                for sql in WHATIF_SETUP_SQL:
                    self.client.command(sql)
                self._whatif_tables = True
            self.client.insert_df("op_traces", rows)
            self.client.insert("op_trace_jobs", [list(msgspec.structs.astuple(job))],
                               column_names=list(OpTraceJob.__struct_fields__))
        except Exception as exc:
            self.stats.errors += 1
            raise StoreError(f"insert into op_traces failed: {_first_line(exc)}") from None
        self.stats.rows_written += len(rows) + 1

    def write_topology(self, topology: Topology) -> None:
        w = topology.workers
        self._insert(
            "topologies",
            pd.DataFrame(
                [
                    {
                        "v": topology.v,
                        "job_id": topology.job_id,
                        "dp_size": topology.dp_size,
                        "pp_size": topology.pp_size,
                        "tp_size": topology.tp_size,
                        "cp_size": topology.cp_size,
                        "ranks": [x.rank for x in w],
                        "hosts": [x.host for x in w],
                        "dp_ranks": [x.dp_rank for x in w],
                        "pp_stages": [x.pp_stage for x in w],
                        "tp_ranks": [x.tp_rank for x in w],
                        "cp_ranks": [x.cp_rank for x in w],
                    }
                ]
            ),
        )

    def write_dead_letter(
        self, topic: str, partition: int, offset: int, error: str, payload: bytes
    ) -> None:
        self.write_dead_letters([(topic, partition, offset, error, payload)])

    def write_dead_letters(self, rows: Sequence[tuple[str, int, int, str, bytes]]) -> None:
        """Rows of (topic, partition, offset, error, payload), in one insert. Each row keeps
        at most DEAD_LETTER_PREFIX_BYTES of its payload (hex), with the payload's full size
        and SHA-256."""
        if not rows:
            return
        received_ns = time.time_ns()
        self._guard()
        try:
            self.client.insert(
                "dead_letters",
                [[received_ns, topic, partition, offset, error, k.prefix.hex(), k.size_bytes,
                  k.sha256]
                 for topic, partition, offset, error, payload in rows
                 for k in (bounded_payload(payload),)],
                column_names=["received_ns", "topic", "partition", "offset", "error", "payload",
                              "payload_bytes", "payload_sha256"],
            )
        except Exception as exc:
            self.stats.errors += 1
            raise StoreError(f"insert into dead_letters failed: {_first_line(exc)}") from None
        self.stats.dead_letters += len(rows)

    def store_lost(self) -> str | None:
        """One line naming the store and what it lost, if it is no longer the store this sink
        opened (see :class:`StoreWatch`), else ``None``. Once lost, always lost: what this
        process believes it wrote may be gone. Raises ``StoreError`` if the store cannot be
        asked (a server down: an outage, not a loss)."""
        if self._lost is None:
            self._lost = self.watch.lost()
        return self._lost

    def write_checkpoint(self, group: str, state: bytes) -> None:
        """The stream job's state at an offset commit (see ``pipeline_checkpoints``), and
        once per group the marks of the tables it describes (``store_marks``)."""
        self._guard()
        try:
            if group not in self._marked:
                self.client.insert("store_marks", [[group, time.time_ns(),
                                                    self.watch.marks_json()]],
                                   column_names=["group", "written_ns", "marks"])
                self._marked.add(group)
            self.client.insert(
                "pipeline_checkpoints",
                [[group, time.time_ns(), state.hex()]],
                column_names=["group", "written_ns", "state"],
            )
        except Exception as exc:
            self.stats.errors += 1
            raise StoreError(
                f"insert into pipeline_checkpoints failed: {_first_line(exc)}"
            ) from None

    def read_checkpoint(self, group: str) -> bytes | None:
        """The newest checkpoint of ``group``, or None."""
        try:
            result = self.client.query(
                "SELECT state FROM pipeline_checkpoints WHERE `group` = {group:String} "
                "ORDER BY written_ns DESC LIMIT 1",
                parameters={"group": group},
            )
        except Exception as exc:
            raise StoreError(f"reading pipeline_checkpoints failed: {_first_line(exc)}") from None
        rows = result.result_rows
        if not rows:
            return None
        changed = self._replaced_since_marked(group)
        if changed:
            log.warning("ignoring the last checkpoint of %s: store %s lost data since it was "
                        "written (%s replaced); re-reading the bus", group, self.watch.where,
                        changed)
            return None
        return bytes.fromhex(rows[0][0])

    def _replaced_since_marked(self, group: str) -> str | None:
        """The tables replaced since ``group``'s marks were stored, if any."""
        try:
            rows = self.client.query(
                "SELECT marks FROM store_marks WHERE `group` = {group:String} "
                "ORDER BY written_ns DESC LIMIT 1", parameters={"group": group},
            ).result_rows
        except Exception as exc:
            raise StoreError(f"reading store_marks failed: {_first_line(exc)}") from None
        return self.watch.stored_marks_differ(rows[0][0]) if rows else None

    def close(self) -> None:
        if self.reads is not None:
            self.reads.stop()
            self.reads = None
        if self._in_memory is not None:
            self._in_memory.close()
            self._in_memory = None
        close = getattr(self.client, "close", None)
        if close is not None:
            close()


def profile_rows(parts: Sequence[ProfileCallPaths]) -> list[tuple[object, ...]]:
    """``call_paths`` rows of one profile session: each path spelled out from its root."""
    if not parts:
        return []
    nodes: dict[int, tuple[int, str, str]] = {}
    for part in parts:
        nodes.update(zip(part.callpaths, zip(part.parents, part.layers, part.names, strict=True),
                         strict=True))
    first = parts[0]
    rows: list[tuple[object, ...]] = []
    for part in parts:
        for cp, count, total, own in zip(part.callpaths, part.counts, part.total_ns,
                                         part.self_ns, strict=True):
            path: list[tuple[str, str]] = []
            node = cp
            while node in nodes and len(path) < 10_000:  # a cycle in bad input ends here
                parent, layer, name = nodes[node]
                path.append((layer, name))
                node = parent
            path.reverse()
            parent, layer, name = nodes[cp]
            rows.append((first.job_id, first.rank, first.started_ns, first.stopped_ns, cp, parent,
                         len(path) - 1, layer, name, [n for _, n in path],
                         [la for la, _ in path], count, total, own, first.steps))
    return rows
