"""Opening the ClickHouse store: an embedded chDB directory or a ClickHouse server.

The findings sink and the what-if store both write to it; the helper lives below both so that
neither imports the other. Only the client is opened here; each user creates its own tables.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from trainscope.config import env
from trainscope.config.secrets import redact_url, scrub, url_has_password
from trainscope.config.settings import Settings, store_dir_from
from trainscope.schemas.errors import TrainscopeError
from trainscope.store.access import ask_owner_to_yield, other_owner, writes_a_file

_HANDOVER_TRIES = 3


class StoreError(RuntimeError, TrainscopeError):
    """The store cannot be opened or refused a statement; the text says why."""


def default_store_dir() -> Path:
    """The embedded store directory the environment configures (see trainscope.config.settings)."""
    return store_dir_from(os.environ)


def connect(
    store: Path | str | None = None,
    url: str | None = None,
    *,
    readonly: bool = False,
    create: bool = True,
    settings: Settings | None = None,
) -> Any:
    """A clickhouse-connect client for a chDB store directory or a server URL.

    ``readonly`` sets ClickHouse's ``readonly=1`` for the whole session: no writes, no DDL, no
    setting changes, and no table functions that reach files, URLs, object stores or other
    servers (``file()``, ``url()``, ``s3()``, ``remote()``, …). Without ``create`` the store
    directory must already hold a store, so a mistyped path is an error instead of a new, empty
    store. Server credentials come from ``settings`` (resolved from the environment when not
    given), never from the URL or the code. A store another process owns is read through its
    read endpoint; opened to write, it is asked for first if that process only reads it
    (``trainscope ui``, see :mod:`trainscope.store.handover`).
    """
    import clickhouse_connect

    session = {"readonly": 1} if readonly else None
    if url:
        return _connect_server(clickhouse_connect, url, session, settings)
    path = store_path(store, create=create)
    # A reader asked to hand the store over may find another reader took it meanwhile (a
    # second dashboard on the store): that one is asked in turn.
    for _ in range(_HANDOVER_TRIES):
        owner = other_owner(path)
        if owner is None:
            break
        if readonly:
            return _connect_live(clickhouse_connect, path, owner)
        if not ask_owner_to_yield(path, owner):
            raise StoreError(_in_use(path, owner))
    else:
        if (owner := other_owner(path)) is not None:
            raise StoreError(_in_use(path, owner))
    try:
        return clickhouse_connect.get_client(dsn=f"chdb://{path}", settings=session)
    except Exception as exc:
        raise StoreError(f"cannot open store {path}: {_first_line(exc)}") from None


def embedded_path(client: Any) -> Path | None:
    """The store directory of a client that opened an embedded store in this process (its
    owner), else ``None`` (a server, or another owner's read endpoint)."""
    uri = str(getattr(client, "uri", ""))
    return Path(uri.removeprefix("chdb://")) if uri.startswith("chdb://") else None


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
        raise StoreError(f"no store at {path}: check the path")
    elif not (path / "metadata").is_dir():
        raise StoreError(
            f"{path} is not a trainscope store (no ClickHouse metadata in it): check the path"
        )
    return path


def _connect_server(
    clickhouse_connect: Any, url: str, session: dict[str, int] | None, settings: Settings | None
) -> Any:
    shown = redact_url(url)
    user, password = _credentials(settings)
    if url_has_password(url):
        raise StoreError(
            f"the ClickHouse URL {shown} contains a password; remove it and set "
            f"{env.TRAINSCOPE_CLICKHOUSE_PASSWORD} instead"
        )
    try:
        return clickhouse_connect.get_client(
            dsn=url,
            username=user,
            password=password,
            settings=session,
        )
    except Exception as exc:
        raise StoreError(
            f"cannot connect to ClickHouse at {shown}: {_first_line(exc, [password])}"
        ) from None


def _credentials(settings: Settings | None) -> tuple[str, str]:
    """(user, password) of the ClickHouse server: from the settings resolved once per command,
    or from the environment for a library caller that has none."""
    if settings is not None:
        return settings.clickhouse_user, settings.clickhouse_password
    e = os.environ
    return e.get(env.TRAINSCOPE_CLICKHOUSE_USER) or "default", e.get(
        env.TRAINSCOPE_CLICKHOUSE_PASSWORD, "")


def _connect_live(clickhouse_connect: Any, path: Path, owner: int) -> Any:
    """A client of the read endpoint that the store's owner serves (see trainscope.store.live);
    the owner runs each query read-only whatever the client asks."""
    from trainscope.store.live import read_endpoint

    found = read_endpoint(path)
    if found is None or (owner and found.pid != owner):
        raise StoreError(_in_use(path, owner, serves=False))
    token = os.environ.get(env.TRAINSCOPE_STORE_READ_TOKEN, "")
    if found.token_required and not token:
        raise StoreError(
            f"store {path} is owned by process {found.pid}, whose read endpoint {found.url} "
            f"requires a token: set {env.TRAINSCOPE_STORE_READ_TOKEN}")
    try:
        # compress=False: the endpoint answers uncompressed on loopback anyway; no session:
        # nothing a session could hold (settings) is accepted there.
        return clickhouse_connect.get_client(
            host=found.host, port=found.port, username="default", password=token,
            compress=False, autogenerate_session_id=False)
    except Exception as exc:
        raise StoreError(
            f"store {path} is owned by process {found.pid}; its read endpoint {found.url} "
            f"did not answer: {_first_line(exc, [token])}") from None


def _in_use(path: Path, pid: int, *, serves: bool = True) -> str:
    who = f"process {pid}{_command_of(pid)}" if pid else "another process"
    if serves:
        return (
            f"store {path} is in use by {who}: an embedded store has a single owner (e.g. a "
            f"running `trainscope pipeline`), and other processes can only read it; stop that "
            f"process and retry"
        )
    return (
        f"store {path} is in use by {who}, which serves no read endpoint (an embedded store "
        f"has a single owner; `trainscope pipeline` and `trainscope ui` serve reads to other "
        f"commands unless {env.TRAINSCOPE_STORE_READ_BIND}=off): restart it with that unset, "
        f"query a ClickHouse server with --url, or stop that process and retry"
    )


def _command_of(pid: int) -> str:
    """`` (`trainscope pipeline`)`` for a trainscope command, else the start of the process's
    command line in parentheses; empty when it cannot be read (another OS, a process gone)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return ""
    args = [a for a in args if a]
    for i, arg in enumerate(args[:-1]):
        if arg == "trainscope.cli.main" or Path(arg).name == "trainscope":
            command = next((a for a in args[i + 1:] if not a.startswith("-")), "")
            return f" (`trainscope {command}`)" if command else " (`trainscope`)"
    line = " ".join(args)
    return f" ({line[:60]}{'…' if len(line) > 60 else ''})" if line else ""


def _first_line(exc: BaseException, secrets: list[str] | None = None) -> str:
    text = str(exc).strip() or type(exc).__name__
    # The HTTP stack nests the reason deep in a retry report; the operator needs the reason.
    reason = _OS_ERROR.search(text)
    if reason and "Max retries exceeded" in text:
        text = reason.group(1)
    # Client libraries quote the server address (user info included) and sometimes the request.
    if secrets is None:
        secrets = [_credentials(None)[1]]
    return scrub(text.splitlines()[0], secrets)


_OS_ERROR = re.compile(r"\[Errno -?\d+\] ([^\"')]+)")


def check_read_only_sql(sql: str) -> None:
    """``StoreError`` for ``INTO OUTFILE``, the one write that ``readonly=1`` lets through.

    An embedded engine runs the query in this process, so ``INTO OUTFILE`` would write (or
    overwrite) a local file. Quoted text and comments are ignored when looking for it.
    """
    if writes_a_file(sql):
        raise StoreError("INTO OUTFILE is not allowed: queries are read-only (use --format csv)")
