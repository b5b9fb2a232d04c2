"""Two questions asked before a store is opened or queried, answered without the engine.

Who holds the embedded store? chDB allows one owning process per store directory; the engine
takes an exclusive ``flock`` on the store's ``status`` file and writes its pid there
("PID: 1234"). Asking first gives a clear message where opening would only print the engine's
own error text and fail with an unrelated one.

Does a query write a file? ``readonly=1`` refuses every write inside the engine, but an embedded
engine runs ``INTO OUTFILE`` in this process, where it writes (or overwrites) a local file.
"""

from __future__ import annotations

import fcntl
import os
import re
from pathlib import Path

_SQL_QUOTED = re.compile(
    r"""'(?:[^'\\]|\\.|'')*'|"(?:[^"\\]|\\.|"")*"|`(?:[^`\\]|\\.|``)*`"""
    r"""|--[^\n]*|\#[^\n]*|/\*.*?\*/""",
    re.DOTALL,
)
_INTO_OUTFILE = re.compile(r"\bINTO\s+OUTFILE\b", re.IGNORECASE)


def other_owner(path: Path) -> int | None:
    """The pid of another process that holds the store (0 if it wrote none), else ``None``."""
    status = path / "status"
    try:
        text = status.read_text(errors="replace")
    except OSError:
        return None
    pid = 0
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "PID" and value.strip().isdigit():
            pid = int(value.strip())
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
