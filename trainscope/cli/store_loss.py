"""What ``trainscope pipeline`` does once its store is lost (``--on-store-loss exit|wait``).

The stream job has stopped writing and committed nothing past its last verified checkpoint
(see :class:`trainscope.engine.core.StoreLost`). Its in-process state — windows it believes
written, detector state — may describe writes that the loss took, so it cannot simply go on:
``exit`` exits non-zero (a supervisor's restart, or the operator's, resumes from whatever store
is at the path then), ``wait`` waits for a store to be back at the path and then restarts this
same process (``exec``, same pid and arguments), which resumes from that store's checkpoint
or, for a store without one (or whose tables were replaced since), re-reads the bus from the
oldest retained message.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import click

from trainscope.config.settings import Settings

WAIT_FIRST_S = 1.0
WAIT_MAX_S = 30.0
# While waiting, one progress line at most this often (and whenever the reason changes).
PROGRESS_EVERY_S = 300.0


def store_not_back(store: Path | None, url: str | None, settings: Settings) -> str | None:
    """Why no store to write to is at ``store``/``url`` yet, else ``None``.

    An embedded store is only looked at, never opened here (this process held another chDB
    session): it is back when its directory holds a ClickHouse store again (the original
    restored or remounted). A server is back when it answers and has the database."""
    from trainscope.store.client import StoreError, connect, default_store_dir

    if url:
        try:
            client = connect(None, url, settings=settings)
            rows = client.query("SELECT count() FROM system.databases "
                                "WHERE name = currentDatabase()").result_rows
        except StoreError as exc:
            return str(exc)
        except Exception as exc:  # the client's own errors: still not back
            return f"{type(exc).__name__}: {exc}"
        return None if rows and rows[0][0] else "its database does not exist"
    path = Path(store or default_store_dir()).expanduser().resolve()
    if not path.is_dir():
        return f"{path} does not exist"
    if not (path / "metadata").is_dir():
        return (f"{path} holds no store (what is in it was left by the engine after the loss): "
                f"restore the store there, or stop this pipeline and start it on an empty "
                f"directory")
    return None


def after_store_loss(reason: str, mode: str, *, close: Callable[[], None],
                     stop_requested: Callable[[], bool], store: Path | None, url: str | None,
                     settings: Settings) -> NoReturn:
    """Say what happened in one line, close the bus and the store, then exit 1 (``exit``) or
    wait for the store and restart this process (``wait``); SIGTERM/Ctrl-C ends the wait."""
    line = (f"{reason}; stopped writing, nothing committed past the last checkpoint (a restart "
            f"re-reads the bus from there)")
    if mode == "exit":
        click.echo(f"Error: {line}; exiting (--on-store-loss exit)", err=True)
        _close_quietly(close)
        sys.exit(1)
    click.echo(f"Error: {line}; waiting for the store to come back (--on-store-loss wait)",
               err=True)
    _close_quietly(close)
    delay_s, said, said_at = WAIT_FIRST_S, "", time.monotonic()
    while True:
        why = store_not_back(store, url, settings)
        if why is None:
            break
        now = time.monotonic()
        if why != said or now - said_at >= PROGRESS_EVERY_S:
            click.echo(f"still waiting for the store: {why}", err=True)
            said, said_at = why, now
        if _sleep_unless_stopped(delay_s, stop_requested):
            raise click.ClickException("stopped while waiting for the lost store; nothing was "
                                       "committed past the last checkpoint")
        delay_s = min(delay_s * 2, WAIT_MAX_S)
    click.echo("the store is back: restarting to resume from its last checkpoint", err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, sys.orig_argv)


def _close_quietly(close: Callable[[], None]) -> None:
    try:
        close()
    except Exception as exc:  # a lost store may refuse even to close; the loss is said
        click.echo(f"closing after the store loss: {exc}", err=True)


def _sleep_unless_stopped(seconds: float, stop_requested: Callable[[], bool]) -> bool:
    """Sleep ``seconds`` in short steps; True as soon as a stop is requested."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        if stop_requested():
            return True
        time.sleep(0.1)
    return stop_requested()
