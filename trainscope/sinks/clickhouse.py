"""The ClickHouse writer: summaries, step records, metric samples, findings, dead letters.

One client API for both deployments: an embedded chDB engine at a store directory
(``chdb:///abs/path`` through clickhouse-connect) or any ClickHouse server over HTTP. Writes are
batched per closed window (one insert per table), and replay-safe: the tables deduplicate
re-sent blocks and collapse equal keys on merge (see :mod:`trainscope.schemas.ddl`).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa

from trainscope import env
from trainscope._secrets import redact_url, scrub, url_has_password
from trainscope.detectors.base import WindowView
from trainscope.schemas.ddl import TABLES, all_ddl
from trainscope.schemas.records import SCHEMA_VERSION, Finding, Topology
from trainscope.sinks.store_access import other_owner, writes_a_file


class StoreError(RuntimeError):
    """The store cannot be opened or refused a statement; the text says why."""


def default_store_dir() -> Path:
    configured = os.environ.get(env.TRAINSCOPE_STORE_DIR)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "trainscope" / "store"


def connect(
    store: Path | str | None = None,
    url: str | None = None,
    *,
    readonly: bool = False,
    create: bool = True,
) -> Any:
    """A clickhouse-connect client for a chDB store directory or a server URL.

    ``readonly`` sets ClickHouse's ``readonly=1`` for the whole session: no writes, no DDL, no
    setting changes, and no table functions that reach files, URLs, object stores or other
    servers (``file()``, ``url()``, ``s3()``, ``remote()``, …). Without ``create`` the store
    directory must already hold a store, so a mistyped path is an error instead of a new, empty
    store. Server credentials come from the environment, never from the URL or the code.
    """
    import clickhouse_connect

    settings = {"readonly": 1} if readonly else None
    if url:
        return _connect_server(clickhouse_connect, url, settings)
    path = store_path(store, create=create)
    owner = other_owner(path)
    if owner is not None:
        raise StoreError(_in_use(path, owner))
    try:
        return clickhouse_connect.get_client(dsn=f"chdb://{path}", settings=settings)
    except Exception as exc:
        raise StoreError(f"cannot open store {path}: {_first_line(exc)}") from None


def store_path(store: Path | str | None, *, create: bool) -> Path:
    """The absolute store directory; with ``create`` it is made if missing."""
    path = Path(store or default_store_dir()).expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise StoreError(f"store path {path} is a file, expected a directory")
    if create:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create store directory {path}: {exc.strerror}") from None
    elif not path.exists():
        raise StoreError(f"no store at {path}: check the path (--create starts an empty one)")
    elif not (path / "metadata").is_dir():
        raise StoreError(
            f"{path} is not a trainscope store (no ClickHouse metadata in it): check the path"
        )
    return path


def _connect_server(clickhouse_connect: Any, url: str, settings: dict[str, int] | None) -> Any:
    shown = redact_url(url)
    if url_has_password(url):
        raise StoreError(
            f"the ClickHouse URL {shown} contains a password; remove it and set "
            f"{env.TRAINSCOPE_CLICKHOUSE_PASSWORD} instead"
        )
    try:
        return clickhouse_connect.get_client(
            dsn=url,
            username=os.environ.get(env.TRAINSCOPE_CLICKHOUSE_USER, "default"),
            password=_server_password(),
            settings=settings,
        )
    except Exception as exc:
        raise StoreError(f"cannot connect to ClickHouse at {shown}: {_first_line(exc)}") from None


def _server_password() -> str:
    return os.environ.get(env.TRAINSCOPE_CLICKHOUSE_PASSWORD, "")


def _in_use(path: Path, pid: int) -> str:
    who = f"process {pid}" if pid else "another process"
    return (
        f"store {path} is in use by {who} (an embedded store has a single owner, e.g. a "
        f"running `trainscope pipeline`): query it through a ClickHouse server with --url, "
        f"or stop that process and retry"
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    # The HTTP stack nests the reason deep in a retry report; the operator needs the reason.
    reason = _OS_ERROR.search(text)
    if reason and "Max retries exceeded" in text:
        text = reason.group(1)
    # Client libraries quote the server address (user info included) and sometimes the request.
    return scrub(text.splitlines()[0], [_server_password()])


_OS_ERROR = re.compile(r"\[Errno -?\d+\] ([^\"')]+)")


def check_read_only_sql(sql: str) -> None:
    """``StoreError`` for ``INTO OUTFILE``, the one write that ``readonly=1`` lets through.

    An embedded engine runs the query in this process, so ``INTO OUTFILE`` would write (or
    overwrite) a local file. Quoted text and comments are ignored when looking for it.
    """
    if writes_a_file(sql):
        raise StoreError("INTO OUTFILE is not allowed: queries are read-only (use --format csv)")


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


class ClickHouseSink:
    def __init__(self, client: Any) -> None:
        self.client = client
        self.stats = SinkStats()
        for ddl in all_ddl():
            self._command(ddl)

    @classmethod
    def open(cls, store: Path | str | None = None, url: str | None = None) -> ClickHouseSink:
        return cls(connect(store, url))

    def _command(self, sql: str) -> None:
        try:
            self.client.command(sql)
        except Exception as exc:
            raise StoreError(_first_line(exc)) from None

    def _insert(self, table: str, frame: pd.DataFrame) -> None:
        if frame.empty:
            return
        columns = list(TABLES[table].insert_columns)
        missing = [c for c in columns if c not in frame.columns]
        if missing:
            raise StoreError(f"rows for {table} lack columns {missing}")
        rows = frame[columns]
        try:
            if any(isinstance(dtype, pd.ArrowDtype) for dtype in rows.dtypes):
                # Arrow-backed columns (a window's sketches) go in as Arrow: insert_df would
                # convert them value by value, about 3x slower at a window of 600k summaries.
                self.client.insert_arrow(table, pa.Table.from_pandas(rows, preserve_index=False))
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
            self._insert("step_records", view.steps.assign(**job))
        if not view.metrics.empty:
            self._insert("metric_samples", view.metrics.assign(**job))
        self.write_findings(findings)
        self.stats.windows += 1

    def write_findings(self, findings: list[Finding]) -> None:
        if findings:
            columns = TABLES["findings"].insert_columns
            self._insert(
                "findings",
                pd.DataFrame({c: [getattr(f, c) for f in findings] for c in columns}),
            )

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
        """Rows of (topic, partition, offset, error, payload), in one insert."""
        if not rows:
            return
        received_ns = time.time_ns()
        try:
            self.client.insert(
                "dead_letters",
                [[received_ns, topic, partition, offset, error, payload.hex()]
                 for topic, partition, offset, error, payload in rows],
                column_names=["received_ns", "topic", "partition", "offset", "error", "payload"],
            )
        except Exception as exc:
            self.stats.errors += 1
            raise StoreError(f"insert into dead_letters failed: {_first_line(exc)}") from None
        self.stats.dead_letters += len(rows)

    def close(self) -> None:
        close = getattr(self.client, "close", None)
        if close is not None:
            close()
