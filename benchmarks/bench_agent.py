"""Agent CPU cost under a high CUDA call rate: in-kernel aggregation vs one event per call.

A stand-in training process (gcc-built libraries exporting CUDA runtime names, see
tests/producers/agent/fakecuda.py) calls ``cudaLaunchKernel`` at a paced rate — 100k calls/s
by default, spread over a few threads. Two observers are measured in the same run, one after
the other, on the same process and rate:

- ``in-kernel``: the real agent (``python -m trainscope.cli.agent``) at its default
  interval; the BPF program aggregates counts and log2 histograms in maps that the agent reads
  once per interval;
- ``perf-buffer``: the classic design — the same uprobes, but each return submits one event
  to a perf ring buffer and a Python consumer aggregates them.

The figure is the observer process's CPU time (all threads, from /proc/PID/task/*/schedstat)
over the measurement period, as a percentage of one core. The probes' own cost is paid inside
the traced process in both variants and is reported separately (the driver's CPU).

Needs root, bcc and kernel headers (infra/ebpf-host-setup.sh). Usage::

    python benchmarks/bench_agent.py [--rate 100000] [--threads 4] [--seconds 20]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "producers" / "agent"))

PERF_PROGRAM = r"""
#include <uapi/linux/ptrace.h>
struct event_t { u32 tgid; u32 fn; u64 delta_ns; };
BPF_HASH(tracked, u32, u8, 1024);
BPF_HASH(starts, u64, u64, 65536);
BPF_PERF_OUTPUT(events);
int entry(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!tracked.lookup(&tgid)) return 0;
    u64 ts = bpf_ktime_get_ns();
    starts.update(&id, &ts);
    return 0;
}
int ret(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    u64 *ts = starts.lookup(&id);
    if (!ts) return 0;
    struct event_t e = {.tgid = id >> 32, .fn = 0, .delta_ns = bpf_ktime_get_ns() - *ts};
    starts.delete(&id);
    events.perf_submit(ctx, &e, sizeof(e));
    return 0;
}
"""


def cpu_ns(pid: int) -> int:
    """On-CPU time of every thread of ``pid`` (ns)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError):  # a thread that just exited
            total += int((task / "schedstat").read_text().split()[0])
    return total


def perf_consumer(pid: int, library: str) -> None:
    """The per-event variant: aggregate every call in Python, like a naive tracer would."""
    import ctypes

    from bcc import BPF

    from trainscope.producers.agent.ebpf import _CFLAGS

    bpf = BPF(text=PERF_PROGRAM.encode(), cflags=_CFLAGS)
    bpf[b"tracked"][ctypes.c_uint32(pid)] = ctypes.c_uint8(1)
    bpf.attach_uprobe(name=library.encode(), sym=b"cudaLaunchKernel", fn_name=b"entry")
    bpf.attach_uretprobe(name=library.encode(), sym=b"cudaLaunchKernel", fn_name=b"ret")
    stats = {"events": 0, "lost": 0, "total_ns": 0}
    hist: dict[int, int] = {}

    def on_event(cpu: int, data: int, size: int) -> None:
        event = bpf[b"events"].event(data)
        stats["events"] += 1
        stats["total_ns"] += event.delta_ns
        slot = event.delta_ns.bit_length() - 1
        hist[slot] = hist.get(slot, 0) + 1

    def on_lost(count: int) -> None:
        stats["lost"] += count

    bpf[b"events"].open_perf_buffer(on_event, page_cnt=256, lost_cb=on_lost)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    print("ready", flush=True)
    while not stop:
        bpf.perf_buffer_poll(timeout=100)
    bpf.cleanup()
    print(json.dumps(stats), flush=True)


def measure(variant: str, fake, rate: int, threads: int, seconds: float) -> dict:
    warmup_s = 2.0
    calls_per_thread = int(rate / threads * (warmup_s + seconds + 2.0))
    item = f"cudaLaunchKernel:{calls_per_thread}:0:0:0:{rate // threads}"
    driver = subprocess.Popen(
        [str(fake.driver)] + [item] * threads,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert driver.stdout.readline().strip() == "ready"
    if variant == "none":  # no probes: what the calls cost the traced process by themselves
        command = [sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.read()"]
        ready = "ready"
    elif variant == "in-kernel":
        command = [
            sys.executable,
            "-m",
            "trainscope.cli.agent",
            "--pid",
            str(driver.pid),
            "--no-nvml",
        ]
        ready = "collectors running"
    else:
        command = [sys.executable, __file__, "--perf-consumer", str(driver.pid), str(fake.cudart)]
        ready = "ready"
    observer = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    stream = observer.stderr if variant == "in-kernel" else observer.stdout
    assert stream is not None
    while ready not in (line := stream.readline()):
        if not line:
            raise RuntimeError(f"{variant} observer exited: {observer.communicate()}")
    go_at = time.monotonic()
    driver.stdin.write("go\n")
    driver.stdin.flush()
    time.sleep(warmup_s)  # let the rate settle before measuring
    obs0, drv0, t0 = cpu_ns(observer.pid), cpu_ns(driver.pid), time.monotonic()
    time.sleep(seconds)
    obs1, drv1, t1 = cpu_ns(observer.pid), cpu_ns(driver.pid), time.monotonic()
    while not driver.stdout.readline().startswith("done"):
        pass
    done_at = time.monotonic()
    driver.stdin.write("bye\n")
    driver.stdin.flush()
    driver.wait()
    observer.send_signal(signal.SIGTERM)
    out, err = observer.communicate(timeout=60)
    total_calls = calls_per_thread * threads
    result = {
        "variant": variant,
        "observer_cpu_pct": 100.0 * (obs1 - obs0) / ((t1 - t0) * 1e9),
        "driver_cpu_pct": 100.0 * (drv1 - drv0) / ((t1 - t0) * 1e9),
        "calls": total_calls,
        "achieved_calls_per_s": total_calls / (done_at - go_at),
    }
    if variant == "none":
        result["observed_events"] = 0
    elif variant == "in-kernel":
        line = next(ln for ln in err.splitlines() if "stopped; stats: " in ln)
        stats = json.loads(line.split("stopped; stats: ", 1)[1])["collectors"]["ebpf"]["stats"]
        result["observed_events"] = stats["events"]  # includes a few sched events
    else:
        stats = json.loads(out.strip().splitlines()[-1])
        result["observed_events"] = stats["events"]
        result["lost_events"] = stats["lost"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=int, default=100_000, help="calls per second")
    parser.add_argument("--threads", type=int, default=4, help="calling threads")
    parser.add_argument("--seconds", type=float, default=20.0, help="measurement period")
    parser.add_argument(
        "--perf-consumer", nargs=2, metavar=("PID", "LIBRARY"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.perf_consumer:
        perf_consumer(int(args.perf_consumer[0]), args.perf_consumer[1])
        return
    import fakecuda

    with tempfile.TemporaryDirectory() as tmp:
        fake = fakecuda.build(Path(tmp))
        results = [
            measure(v, fake, args.rate, args.threads, args.seconds)
            for v in ("none", "in-kernel", "perf-buffer")
        ]
    print(
        f"target rate {args.rate} calls/s on {args.threads} threads, "
        f"{args.seconds:.0f} s measured, {os.cpu_count()} CPUs"
    )
    print(
        "| variant | observer CPU (% of one core) | traced process CPU | achieved calls/s "
        "| events seen / calls | lost |"
    )
    print("|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['variant']} | {r['observer_cpu_pct']:.2f} | {r['driver_cpu_pct']:.0f} | "
            f"{r['achieved_calls_per_s']:,.0f} | {r['observed_events']:,} / {r['calls']:,} | "
            f"{r.get('lost_events', 0):,} |"
        )
    none, kernel, perf = results
    ratio = perf["observer_cpu_pct"] / max(kernel["observer_cpu_pct"], 1e-9)
    print(
        f"perf-buffer / in-kernel observer CPU: {ratio:.0f}x; "
        f"in-kernel agent below 2% of a core: {kernel['observer_cpu_pct'] < 2.0}"
    )
    probe_us = (kernel["driver_cpu_pct"] - none["driver_cpu_pct"]) / 100 / args.rate * 1e6
    print(f"probe cost paid by the traced process: about {probe_us:.1f} us of CPU per call")


if __name__ == "__main__":
    main()
