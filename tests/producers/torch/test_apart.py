"""Heavy work of ours in a forked child: the answer comes back; a failure or a hang is an error
the caller handles, and leaves no process behind."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from trainscope.producers.torch.apart import ApartError, run_apart


def test_the_work_runs_in_another_process_and_its_answer_comes_back() -> None:
    assert run_apart(lambda: {"pid": os.getpid(), "big": b"x" * 3_000_000}, 30.0)["pid"] \
        != os.getpid()
    assert len(run_apart(lambda: b"x" * 3_000_000, 30.0)) == 3_000_000  # more than a pipe holds


def test_a_failing_work_is_an_error_not_a_crash() -> None:
    def fail() -> None:
        raise ValueError("broken")

    with pytest.raises(ApartError, match="without an answer"):
        run_apart(fail, 30.0)


def test_a_child_that_hangs_is_killed_at_its_deadline_and_reaped() -> None:
    started = time.monotonic()
    with pytest.raises(ApartError, match="did not answer in time"):
        run_apart(lambda: time.sleep(60), 0.5)
    assert time.monotonic() - started < 10
    assert _zombie_children() == []  # killed and reaped


def _zombie_children() -> list[int]:
    """This process's children that ended and were never waited for."""
    zombies = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z" and int(fields[1]) == os.getpid():
            zombies.append(int(stat.parent.name))
    return zombies


def test_the_child_is_not_held_to_the_cores_its_parent_is_pinned_to() -> None:
    """A rank pinned to one core would otherwise lend that core to the child."""
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.fail("this test needs a process allowed on 2 cores or more")
    try:
        os.sched_setaffinity(0, {min(allowed)})
        child_cores = run_apart(lambda: os.sched_getaffinity(0), 30.0)
    finally:
        os.sched_setaffinity(0, allowed)
    assert child_cores >= allowed and child_cores != {min(allowed)}
