"""The stream job's process keeps the memory it frees: measured in real processes by the page
faults that allocating the same arrays again costs, and by a thread allocating more than a
thread's heap holds (glibc then takes it from the main heap, not from a mapping of its own)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

# Rounds of four 96-MiB arrays (what a 100,000-rank window's close allocates, several hundred
# MB) and of sixteen 2-MiB ones, allocated, written and freed; the minor page faults of the last
# five rounds, per round.
_ROUNDS = """
import resource, sys, threading
import numpy as np
from trainscope.engine.allocator import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "tuned" else False

def one_round():
    arrays = [np.ones((96 << 20) // 8) for _ in range(4)]
    arrays += [np.ones((2 << 20) // 8) for _ in range(16)]
    del arrays

one_round()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    one_round()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 5
in_thread = []
worker = threading.Thread(target=lambda: in_thread.append(float(np.ones(40 << 20).sum())))
worker.start()
worker.join()
print(applied, faults, in_thread == [float(40 << 20)])
"""

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="mallopt is glibc's; elsewhere keep_freed_memory() does nothing",
)


def faults_per_round(mode: str, **environ: str) -> tuple[str, int, str]:
    out = subprocess.run([sys.executable, "-c", _ROUNDS, mode], check=True, text=True,
                         capture_output=True, env={**os.environ, **environ}, timeout=120)
    applied, faults, thread_ok = out.stdout.split()
    return applied, int(faults), thread_ok


def test_freed_memory_is_reused_without_faulting_it_in_again() -> None:
    # 416 MiB a round: glibc's defaults map the large arrays afresh (in 2-MiB pages where
    # the kernel gives numpy huge pages: at least 4 x 48 faults; else 4 x 24,576).
    applied, default_faults, thread_ok = faults_per_round("default")
    assert (applied, thread_ok) == ("False", "True")
    assert default_faults >= 4 * 48
    applied, faults, thread_ok = faults_per_round("tuned")
    assert (applied, thread_ok) == ("True", "True")  # a 320-MiB array in a thread still works
    assert faults < 32, (faults, default_faults)


def test_it_can_be_turned_off() -> None:
    applied, faults, _ = faults_per_round("tuned", TRAINSCOPE_KEEP_FREED_MEMORY="0")
    assert applied == "False"
    assert faults >= 4 * 48
