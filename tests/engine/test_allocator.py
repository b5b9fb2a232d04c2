"""The stream job's process keeps the memory it frees: measured in real processes by the page
faults that allocating the same arrays again costs."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

# Rounds of sixteen 2-MiB arrays (below numpy's huge-page threshold), allocated and freed; the
# minor page faults of the last ten rounds, per round.
_ROUNDS = """
import resource, sys
import numpy as np
from trainscope.engine.allocator import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "tuned" else False

def one_round():
    arrays = [np.ones((2 << 20) // 8) for _ in range(16)]
    del arrays

one_round()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    one_round()
print(applied, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 10)
"""

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="mallopt is glibc's; elsewhere keep_freed_memory() does nothing",
)


def faults_per_round(mode: str, **environ: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", _ROUNDS, mode], check=True, text=True,
                         capture_output=True, env={**os.environ, **environ}, timeout=120)
    applied, faults = out.stdout.split()
    return applied, int(faults)


def test_freed_memory_is_reused_without_faulting_it_in_again() -> None:
    # 32 MiB a round is 8,192 pages: glibc's defaults give them back and fault them in again.
    assert faults_per_round("default") == ("False", pytest.approx(8192, rel=0.25))
    applied, faults = faults_per_round("tuned")
    assert applied == "True"
    assert faults < 200


def test_it_can_be_turned_off() -> None:
    applied, faults = faults_per_round("tuned", TRAINSCOPE_KEEP_FREED_MEMORY="0")
    assert applied == "False"
    assert faults > 4000
