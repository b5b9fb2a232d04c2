"""Arrow tables into the embedded store in memory, deduplicated as a re-sent block would be.

clickhouse-connect's chDB client inserts Arrow by writing it to a temporary file that chDB then
reads back (``INSERT … FROM INFILE``): at a 10,240-rank window (570,000 summaries with their
sketches) that is 0.5 s of a 1.5-s insert spent serialising and writing bytes that are already
in this process. chDB reads an Arrow table in place through its ``Python()`` table function, on
a connection of its own to the same engine (chDB shares one engine per path in a process); the
client library offers no such path, so this module holds that connection.

ClickHouse deduplicates an inserted block by a hash of its data, but not when the block comes
from ``INSERT … SELECT`` of a source it does not know to be stable, such as ``Python()``: a
window written twice (the stream job replays what it had not checkpointed) would be stored
twice until a merge. Each insert therefore names its content in ``insert_deduplication_token``:
a SHA-256 digest of the table's schema and of every chunk's buffers, offset and length, so that
equal content (and only equal content) is dropped the second time, as before. SHA-256 rather
than a faster non-cryptographic hash: a producer able to forge a collision could have another
window's rows dropped; with the SHA extensions of current x86 cores it digests about 1.4 GB/s,
under 0.1 s of a 10,240-rank window.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa


class EmbeddedArrowInserts:
    """Inserts into the embedded store at ``path``, which this process already owns through a
    clickhouse-connect client (the second connection shares its engine)."""

    def __init__(self, path: Path) -> None:
        import chdb

        self._conn: Any = chdb.connect(str(path))

    def insert(self, table: str, columns: Sequence[str], arrow: pa.Table) -> None:
        """``arrow``'s ``columns`` into ``table``, converted to the table's types as an insert
        of the Arrow format converts them."""
        names = ", ".join(f"`{c}`" for c in columns)
        token = f"{table}-{content_digest(arrow.select(list(columns)))}"
        # Python(arrow) names this frame's local: chDB resolves it off the calling frame.
        self._conn.query(
            f"INSERT INTO {table} ({names}) SELECT {names} FROM Python(arrow) "
            f"SETTINGS insert_deduplication_token = '{token}'")

    def close(self) -> None:
        self._conn.close()


def content_digest(table: pa.Table) -> str:
    """A digest of ``table``'s schema and values: equal for equal tables built the same way,
    different for any other content (a chunk's offset and length count, since slices of one
    parent share its buffers)."""
    digest = hashlib.sha256()
    digest.update(str(table.schema).encode())
    digest.update(len(table).to_bytes(8, "little"))
    for column in table.columns:
        for chunk in column.chunks:
            digest.update(chunk.offset.to_bytes(8, "little"))
            digest.update(len(chunk).to_bytes(8, "little"))
            for buffer in chunk.buffers():
                if buffer is None:
                    digest.update(b"\0")
                else:
                    digest.update(len(buffer).to_bytes(8, "little"))
                    digest.update(buffer)
    return digest.hexdigest()[:32]
