"""Questions asked before a store is opened or queried, answered without the engine.

Who holds the embedded store? chDB allows one owning process per store directory; the engine
takes an exclusive ``flock`` on the store's ``status`` file and writes its pid there
("PID: 1234"). Asking first gives a clear message where opening would only print the engine's
own error text and fail with an unrelated one. Will it hand the store over? An owner that only
reads it (``trainscope ui``) does, to a process that must write it
(:mod:`trainscope.store.handover`).

Does a query write a file? ``readonly=1`` refuses every write inside the engine, but an embedded
engine runs ``INTO OUTFILE`` in this process, where it writes (or overwrites) a local file.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import signal
import time
from pathlib import Path

log = logging.getLogger(__name__)

YIELD_SIGNAL = signal.SIGUSR1
"""What a writer sends a reading owner that should hand the store over."""

YIELD_WAIT_S = 15.0  # a query running in the reader finishes first (bounded by its time limit)

_SQL_QUOTED = re.compile(
    r"""'(?:[^'\\]|\\.|'')*'|"(?:[^"\\]|\\.|"")*"|`(?:[^`\\]|\\.|``)*`"""
    r"""|--[^\n]*|\#[^\n]*|/\*.*?\*/""",
    re.DOTALL,
)
_INTO_OUTFILE = re.compile(r"\bINTO\s+OUTFILE\b", re.IGNORECASE)


def status_pid(path: Path) -> int | None:
    """The pid the store's last owner wrote (0 if none), ``None`` without a status file; the
    owner may have gone since (see :func:`other_owner`)."""
    try:
        text = (path / "status").read_text(errors="replace")
    except OSError:
        return None
    pid = 0
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "PID" and value.strip().isdigit():
            pid = int(value.strip())
    return pid


def other_owner(path: Path) -> int | None:
    """The pid of another process that holds the store (0 if it wrote none), else ``None``."""
    status = path / "status"
    pid = status_pid(path)
    if pid is None:
        return None
    if pid == os.getpid():
        return None  # this process opened it already; the engine shares it within a process
    try:
        fd = os.open(status, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return pid
    except OSError:
        return None
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def writes_a_file(sql: str) -> bool:
    """Whether ``sql`` has an ``INTO OUTFILE`` clause (quoted text and comments ignored)."""
    return _INTO_OUTFILE.search(_SQL_QUOTED.sub(" ", sql)) is not None


def ask_owner_to_yield(path: Path, owner: int, wait_s: float = YIELD_WAIT_S) -> bool:
    """Whether ``owner``, which holds the store at ``path``, was a reader that handed it over
    when asked (within ``wait_s``). False at once for an owner that only reads but does not
    say it yields (e.g. serving no endpoint), or that writes."""
    from trainscope.store.live import read_endpoint  # the HTTP stack, only when asked

    endpoint = read_endpoint(path)
    if endpoint is None or not endpoint.yields or endpoint.pid != owner:
        return False
    try:
        os.kill(owner, YIELD_SIGNAL)
    except OSError:
        return False  # gone already (then the store is free), or not ours to signal
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if other_owner(path) is None:
            log.info("store %s: process %d, which only read it, handed it over", path, owner)
            return True
        time.sleep(0.05)
    return False
