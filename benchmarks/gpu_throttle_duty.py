"""How NVML's clocks-event reasons and SM clock read on a busy GPU versus one that waits.

Needs a CUDA GPU, torch and nvidia-ml-py. In a synchronous training job a slow GPU computes all
the time while its peers spend part of each step waiting for it in collectives. This script
reproduces both sides on one GPU: a step of ``period_ms`` that runs bf16 matrix products for
``duty`` of the step and waits for the rest, either idle (host sleeps) or in a one-block spin
kernel (``torch.cuda._sleep``, like a NCCL kernel waiting for a peer). NVML is read every
``interval_ms`` in a thread, as the host agent reads it, and the script prints, per condition, the
share of readings carrying a throttling reason (``THROTTLING_REASONS_MASK``), the share with
``sw_power_cap``, the mean SM clock and power.

The peer detector's throttle rule compares a suspect with its peers (``detectors/peer.py``);
these figures say how far a straggler's throttled share and clock can sit from its waiting
peers' without any fault. Usage::

    python benchmarks/gpu_throttle_duty.py [--seconds 8] [--period-ms 400] [--interval-ms 50]
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import pynvml as nv
import torch

THROTTLING_REASONS_MASK = 0x004 | 0x008 | 0x020 | 0x040 | 0x080  # as trainscope.schemas.metrics
SW_POWER_CAP = 0x004


def sample(handle: object, stop: threading.Event, interval_s: float, out: list[dict]) -> None:
    reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
    reasons = reasons or nv.nvmlDeviceGetCurrentClocksThrottleReasons
    while not stop.is_set():
        out.append({
            "reasons": int(reasons(handle)),
            "sm_mhz": nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM),
            "power_w": nv.nvmlDeviceGetPowerUsage(handle) / 1e3,
            "util": nv.nvmlDeviceGetUtilizationRates(handle).gpu,
        })
        time.sleep(interval_s)


def run(duty: float, wait: str, seconds: float, period_s: float, handle: object,
        interval_s: float) -> dict:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    spin_cycles_per_s = 1.7e9  # roughly the SM clock: torch.cuda._sleep counts GPU cycles
    readings: list[dict] = []
    stop = threading.Event()
    thread = threading.Thread(target=sample, args=(handle, stop, interval_s, readings))
    thread.start()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < duty * period_s:
            for _ in range(4):
                a @ b
            torch.cuda.synchronize()
        rest = period_s - (time.perf_counter() - t0)
        if rest > 0 and wait == "spin":
            torch.cuda._sleep(int(rest * spin_cycles_per_s))
            torch.cuda.synchronize()
        elif rest > 0:
            time.sleep(rest)
    stop.set()
    thread.join()
    n = len(readings)
    return {
        "duty": duty,
        "wait": wait,
        "readings": n,
        "throttled_share": sum(bool(r["reasons"] & THROTTLING_REASONS_MASK) for r in readings) / n,
        "power_cap_share": sum(bool(r["reasons"] & SW_POWER_CAP) for r in readings) / n,
        "reasons_seen": sorted({hex(r["reasons"]) for r in readings}),
        "sm_mhz_mean": round(sum(r["sm_mhz"] for r in readings) / n),
        "sm_mhz_min": min(r["sm_mhz"] for r in readings),
        "sm_mhz_max": max(r["sm_mhz"] for r in readings),
        "power_w_mean": round(sum(r["power_w"] for r in readings) / n),
        "util_mean": round(sum(r["util"] for r in readings) / n),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--period-ms", type=float, default=400.0)
    parser.add_argument("--interval-ms", type=float, default=50.0)
    args = parser.parse_args()
    nv.nvmlInit()
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    print(json.dumps({"gpu": nv.nvmlDeviceGetName(handle),
                      "driver": nv.nvmlSystemGetDriverVersion()}))
    conditions = [(0.0, "idle"), (1.0, "idle"), (0.7, "spin"), (0.7, "idle"), (0.5, "spin"),
                  (0.5, "idle")]
    run(1.0, "idle", 2.0, args.period_ms / 1e3, handle, args.interval_ms / 1e3)  # warm up
    for duty, wait in conditions:
        print(json.dumps(run(duty, wait, args.seconds, args.period_ms / 1e3, handle,
                             args.interval_ms / 1e3)), flush=True)


if __name__ == "__main__":
    main()
