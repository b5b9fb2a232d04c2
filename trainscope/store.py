"""Opening the ClickHouse store: an embedded chDB directory or a ClickHouse server.

The findings sink and the what-if store both write to it; the helper lives below both so that
neither imports the other. Only the client is opened here; each user creates its own tables.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from trainscope import env
from trainscope.schemas.errors import TrainscopeError


class StoreError(RuntimeError, TrainscopeError):
    """The store cannot be opened or refused a statement; the text says why."""


def default_store_dir() -> Path:
    configured = os.environ.get(env.TRAINSCOPE_STORE_DIR)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "trainscope" / "store"


def connect(store: Path | str | None = None, url: str | None = None) -> Any:
    """A clickhouse-connect client for a chDB store directory or a server URL.

    Server credentials come from the environment, never from code or command lines.
    """
    import clickhouse_connect

    if url:
        try:
            return clickhouse_connect.get_client(
                dsn=url,
                username=os.environ.get(env.TRAINSCOPE_CLICKHOUSE_USER, "default"),
                password=os.environ.get(env.TRAINSCOPE_CLICKHOUSE_PASSWORD, ""),
            )
        except Exception as exc:
            raise StoreError(f"cannot connect to ClickHouse at {url}: {_first_line(exc)}") from None
    path = Path(store or default_store_dir()).expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise StoreError(f"store path {path} is a file, expected a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(f"cannot create store directory {path}: {exc.strerror}") from None
    try:
        return clickhouse_connect.get_client(dsn=f"chdb://{path}")
    except Exception as exc:
        raise StoreError(f"cannot open store {path}: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
