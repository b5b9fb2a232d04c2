"""Is the store still the one the pipeline opened? Noticing a store that vanished under it.

An embedded chDB engine keeps its tables in memory: with the store directory deleted (a disk
cleaned, a volume unmounted) or a table's data directory removed, inserts still succeed — the
engine recreates the part directories but not the tables' metadata — and everything written
from then on is gone at the next start. A ClickHouse server that lost its database refuses the
inserts instead, which looks like an outage. Neither may be followed by an offset commit.

:class:`StoreWatch` takes the store's identity when the sink opens it — the store directory's
device and inode, its ``metadata`` directory, and per pipeline table its UUID and (embedded) the
inode of its data directory — and :meth:`StoreWatch.lost` compares it with what is there now:
one ``system.tables`` query and a few ``stat`` calls, cheap enough to run around every
checkpoint. The same per-table marks are stored beside the checkpoints (``store_marks``), so a
restart can tell that a table was replaced since its checkpoint was written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from trainscope.store.client import StoreError, _first_line


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def table_marks(client: Any, tables: tuple[str, ...], embedded: bool,
                data_dirs: dict[str, Path] | None = None) -> dict[str, str]:
    """Per table of ``tables`` that exists: its UUID, and for an embedded store the inode of
    its data directory (``uuid:inode``; a directory deleted and recreated has another inode,
    the UUID stays). Raises ``StoreError`` if the store cannot be asked. ``data_dirs``, if
    given, receives each table's data directory."""
    try:
        rows = client.query(
            "SELECT name, toString(uuid), data_paths FROM system.tables "
            "WHERE database = currentDatabase() AND name IN {tables:Array(String)}",
            parameters={"tables": list(tables)},
        ).result_rows
    except Exception as exc:
        raise StoreError(_first_line(exc)) from None
    marks: dict[str, str] = {}
    for name, uuid, data_paths in rows:
        if embedded and data_dirs is not None and data_paths:
            data_dirs[str(name)] = Path(data_paths[0])
        mark = str(uuid)
        if embedded and data_paths:
            identity = _identity(Path(data_paths[0]))
            mark += f":{identity[1] if identity else 'gone'}"
        marks[str(name)] = mark
    return marks


class StoreWatch:
    """The identity of one opened store and the check that it still holds."""

    def __init__(self, client: Any, where: str, path: Path | None,
                 tables: tuple[str, ...]) -> None:
        """``path``: the embedded store directory, ``None`` for a server."""
        self.client = client
        self.where = where
        self.path = path
        self.tables = tables
        self.directory = _identity(path) if path is not None else None
        self.data_dirs: dict[str, Path] = {}
        self.marks = table_marks(client, tables, path is not None, self.data_dirs)

    def moved(self) -> str | None:
        """:meth:`lost` for an embedded store from the file system alone (a few ``stat``
        calls, no query): cheap enough before every insert. An insert into a store moved
        away still appends to the files the engine holds open (its deduplication log), so
        the original, moved back, would take the rows written since for duplicates; checked
        before each insert, that can only happen to an insert already under way."""
        if self.path is None:
            return None
        if _identity(self.path) != self.directory or not (self.path / "metadata").is_dir():
            return self.lost()
        for table, directory in self.data_dirs.items():
            identity = _identity(directory)
            if identity is None or f"{self.marks[table].split(':')[0]}:{identity[1]}" != (
                    self.marks[table]):
                return self.lost()
        return None

    def lost(self) -> str | None:
        """What is missing if the store is no longer the one opened (one phrase naming the
        store and what is gone), else ``None``. Raises ``StoreError`` when the store cannot be
        asked at all (a server down is an outage, not a loss: the caller retries)."""
        problems: list[str] = []
        if self.path is not None:
            now = _identity(self.path)
            if now is None:
                problems.append("its directory is gone")
            elif now != self.directory:
                problems.append("its directory was replaced (deleted or moved, then recreated)")
            elif not (self.path / "metadata").is_dir():
                problems.append("its metadata directory is gone")
            if problems:  # every table went with it: no need to list them
                return f"store {self.where} lost: " + "; ".join(problems)
        try:
            marks = table_marks(self.client, self.tables, self.path is not None)
        except StoreError as exc:
            if self.path is not None or "UNKNOWN_DATABASE" not in str(exc):
                raise
            return f"store {self.where} lost: its database is gone ({exc})"
        missing: list[str] = []
        gone: list[str] = []
        replaced: list[str] = []
        for table, then in self.marks.items():
            now = marks.get(table)
            if now is None:
                missing.append(table)
            elif now.endswith(":gone"):
                gone.append(table)
            elif now != then:
                replaced.append(table)
        if missing:
            problems.append("tables dropped: " + ", ".join(missing))
        if gone:
            problems.append("data directory deleted of " + ", ".join(gone))
        if replaced:
            problems.append("data directory replaced of " + ", ".join(replaced))
        if not problems:
            return None
        return f"store {self.where} lost: " + "; ".join(problems)

    def stored_marks_differ(self, stored: str) -> str | None:
        """The tables whose marks differ from ``stored`` (JSON written with a checkpoint), as
        a phrase, else ``None``: the checkpoint then describes tables that are not these."""
        try:
            then = json.loads(stored)
        except ValueError:
            return None
        changed = sorted(t for t, mark in then.items() if self.marks.get(t) != mark)
        return ", ".join(changed) if changed else None

    def marks_json(self) -> str:
        return json.dumps(self.marks, sort_keys=True)
