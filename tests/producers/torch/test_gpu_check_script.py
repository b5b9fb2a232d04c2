"""The GPU check of issue 25 (``benchmarks/gpu_device_timing.py``) runs end to end.

GPU machines are lent rarely and briefly: the script must not fail on its first GPU run. Here
it runs in its dry-run mode, on the CPU with the host-clock stand-in event it names as such;
its figures mean nothing on a CPU, but every step of it (calibrating the injected work, two
attached loops, reading the summaries back, the verdicts) runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[3] / "benchmarks" / "gpu_device_timing.py"


def test_the_gpu_check_runs_end_to_end_on_a_cpu_dry_run() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run-cpu", "--steps", "12", "--width", "64",
         "--matmul-size", "64", "--extra-ms", "1"],
        capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["gpu"].startswith("none (dry run")
    assert set(result["shown"]) == {"forward_device_excess_is_the_injected_work",
                                    "backward_and_optimizer_device_unchanged",
                                    "no_dropped_or_unsettled_device_times"}
    assert result["shown"]["no_dropped_or_unsettled_device_times"] is True, result
    for config in ("plain", "injected"):
        phases = result[config]["per_call"]
        assert set(phases) == {"forward", "backward", "optimizer.step"}, phases
        assert all(p["device_calls"] == 12 == p["host_calls"] for p in phases.values()), phases
    assert result["injected_ms_alone"] > 0 and result["injected_matmuls"] >= 1


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="a CUDA device is here: the script would run its check, not refuse")
def test_without_a_gpu_the_check_says_so() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "no CUDA device here: run on a GPU machine, or pass --dry-run-cpu")
