"""The README's tour as a new user walks it: a fresh virtual environment, the README's first
command as written, then every command of the tour in order, as written. None may print a
traceback or fail; the dashboard must answer.

The commands are read from the README itself (the first ``bash`` block under "Set up", the
``bash`` block under "Then"), so the README cannot drift from what works. The environment is
new and has only what the first command installs (pip's cache makes it quick after the test
set-up installed the same packages once).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DASHBOARD = "http://127.0.0.1:8321/"


def bash_block_after(heading: str) -> list[str]:
    """The commands of the first ``bash`` block after ``heading`` (continuation lines joined)."""
    text = README.read_text(encoding="utf-8")
    start = text.index(heading)
    block = re.search(r"```bash\n(.*?)```", text[start:], re.S)
    assert block, f"no bash block after {heading!r} in the README"
    joined = block[1].replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip()]


def test_the_readme_names_a_first_command_and_a_tour() -> None:
    first = bash_block_after("## Set up")
    assert len(first) == 1 and first[0].startswith("pip install -e '.[")
    tour = bash_block_after("### Then")
    assert tour[-1] == "trainscope ui" and len(tour) >= 4


def _run(command: str, env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, shell=True, cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout_s, check=False)


def _no_traceback(command: str, done: subprocess.CompletedProcess[str]) -> None:
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{command!r} exited {done.returncode}:\n{output[-3000:]}"
    assert "Traceback" not in output, f"{command!r} printed a traceback:\n{output[-3000:]}"


def _serve_and_fetch(command: str, env: dict[str, str]) -> None:
    """A command that serves until stopped: it must answer on the dashboard's address."""
    server = subprocess.Popen(shlex.split(command), cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(DASHBOARD, timeout=5) as answer:
                    assert answer.status == 200
                    assert "demo-job" in answer.read().decode()
                break
            except OSError:
                assert server.poll() is None, f"{command!r} stopped: {server.stdout.read()}"
                assert time.monotonic() < deadline, f"{command!r} did not answer in 60 s"
                time.sleep(0.5)
    finally:
        server.terminate()
        output, _ = server.communicate(timeout=30)
    assert "Traceback" not in output, f"{command!r} printed a traceback:\n{output[-3000:]}"


@pytest.mark.slow
def test_a_fresh_environment_runs_the_first_command_and_the_tour(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {
        key: value for key, value in os.environ.items()
        if not key.startswith(("TRAINSCOPE_", "PYTHON", "VIRTUAL_ENV"))
    }
    env.update(
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        VIRTUAL_ENV=str(venv),
        HOME=str(tmp_path / "home"),
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_PROGRESS_BAR="off",
    )
    if "XDG_CACHE_HOME" not in env:  # the home above is new: keep pip's cache of this machine
        env["XDG_CACHE_HOME"] = str(Path.home() / ".cache")
    first = bash_block_after("## Set up")[0]
    done = _run(first, env, timeout_s=1500)
    _no_traceback(first, done)
    assert "Prime suspect: gpu-compute: rank 13" in done.stdout, done.stdout[-2000:]
    for command in bash_block_after("### Then"):
        if command == "trainscope ui":
            _serve_and_fetch(command, env)
            continue
        done = _run(command, env, timeout_s=300)
        _no_traceback(command, done)
        if command.startswith("trainscope sql") and "FROM findings" in command:
            _alerts_only_the_fault(done.stdout)


def _alerts_only_the_fault(table: str) -> None:
    """What the README says of the tour's first query: rank 13's gpu-compute comes first, and
    every other row is evidence below the alert threshold (0.5)."""
    rows = [[cell.strip() for cell in line.strip("│ ").split("│")]
            for line in table.splitlines() if line.startswith("│")]
    assert rows, table
    assert rows[0][:2] == ["13", "gpu-compute"] and float(rows[0][2]) >= 0.5, table
    assert all(float(row[2]) < 0.5 for row in rows[1:]), table
