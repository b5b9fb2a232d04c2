"""``trainscope stream faust`` workers as child processes, for the tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

IDLE = ["--close-idle-s", "3", "--idle-exit-s", "6"]


class FaustWorker:
    """``trainscope stream faust`` as a child process; stdout and stderr kept in files."""

    def __init__(self, url: str, store: Path, app_id: str, logs: Path,
                 idle: tuple[str, ...] = tuple(IDLE)) -> None:
        self.stderr = logs.with_suffix(".err")
        with logs.with_suffix(".out").open("wb") as out, self.stderr.open("wb") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "trainscope.cli", "-v", "stream", "faust", "--bus", url,
                 "--store", str(store), "--app-id", app_id, *idle],
                stdout=out, stderr=err, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )

    def err_text(self) -> str:
        return self.stderr.read_text(errors="replace")

    def wait(self, timeout_s: float = 150) -> dict:
        """Its final counts (the JSON line on stderr) once it exited 0."""
        assert self.process.wait(timeout=timeout_s) == 0, self.err_text()
        assert "Traceback" not in self.err_text(), self.err_text()
        for line in reversed(self.err_text().splitlines()):
            if line.startswith("{"):
                return json.loads(line)
        raise AssertionError(f"no stats line:\n{self.err_text()}")
