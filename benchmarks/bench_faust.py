"""Throughput of the Faust app against the embedded engine, on the same input over a real broker.

A simulated job (per-window function summaries, as the PyTorch producer sends them) is published
to the test broker (Tansu) first; then, each on its own, ``trainscope pipeline`` (the embedded
engine) and ``trainscope stream faust`` with ONE worker read it all, window it, run the
detectors and write to a chDB store of their own, and exit once idle.

The figure is summaries (window engine input: summaries, step records and metric samples) per
CPU second of the whole process (user + system, from wait4): "per core", and insensitive to the
other load of a shared machine. It includes start-up (imports, opening the store, joining the
group), which is the same order for both. Wall time is shown beside it.

Run:  PYTHONPATH=. python benchmarks/bench_faust.py [--steps N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from kafka_broker import TansuBroker

IDLE_EXIT_S = 3.0


def publish(url: str, steps: int) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "trainscope.cli.publish_simulated", "--bus", url, "--dp", "8",
         "--pp", "2", "--tp", "2", "--steps", str(steps), "--seed", "1",
         "--fault", "slow-gpu:rank=9,factor=1.5"],
        capture_output=True, text=True, check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(command: list[str], err: Path) -> tuple[dict, float, float]:
    """(final stats line, CPU seconds, wall seconds) of a command that exits when idle."""
    started = time.monotonic()
    with err.open("wb") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
        print(f"running {command[3]} ...", flush=True)
        _, status, usage = os.wait4(process.pid, 0)
    wall_s = time.monotonic() - started
    text = err.read_text(errors="replace")
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{command[3:5]} failed:\n{text[-3000:]}")
    stats = next(json.loads(line) for line in reversed(text.splitlines()) if line.startswith("{"))
    return stats, usage.ru_utime + usage.ru_stime, wall_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=480)
    args = parser.parse_args()
    cli = [sys.executable, "-m", "trainscope.cli.main"]
    idle = ["--close-idle-s", "2", "--idle-exit-s", str(IDLE_EXIT_S)]
    with TansuBroker() as broker, tempfile.TemporaryDirectory() as tmp:
        sent = publish(broker.url, args.steps)
        print(f"published: {sent['messages']} messages, 32 ranks, {args.steps} steps")
        rows = []
        for name, command in (
            ("embedded (trainscope pipeline)",
             [*cli, "pipeline", "--bus", broker.url, "--store", f"{tmp}/embedded",
              "--group", "bench", "--no-auto-profile", *idle]),
            ("faust, 1 worker (trainscope stream faust)",
             [*cli, "stream", "faust", "--bus", broker.url, "--store", f"{tmp}/faust",
              "--app-id", "bench-faust", *idle]),
        ):
            stats, cpu_s, wall_s = run(command, Path(tmp) / f"{len(rows)}.err")
            received = stats["window"]["received"]
            rows.append((name, received, cpu_s, wall_s, stats["sink"]["emitted"]))
        print(f"{'engine':44} {'summaries':>10} {'windows':>8} {'CPU s':>7} {'wall s':>7} "
              f"{'summaries/CPU s':>16}")
        for name, received, cpu_s, wall_s, windows in rows:
            print(f"{name:44} {received:>10} {windows:>8} {cpu_s:>7.1f} {wall_s:>7.1f} "
                  f"{received / cpu_s:>16,.0f}")
        base = rows[0][1] / rows[0][2]
        print(f"faust / embedded, summaries per CPU second: {rows[1][1] / rows[1][2] / base:.2f}")


if __name__ == "__main__":
    main()
