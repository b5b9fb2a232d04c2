"""Throughput of the stream engines on the same input: embedded, Faust, and the PyFlink tier.

    python benchmarks/bench_flink.py [--steps 400] [--quick] [--udf]

One simulated 64-rank job (raw spans, a slow GPU) is published once, in the JSON wire format,
onto a real broker (Tansu). Then, one after the other, on the same topic:

- **embedded**: ``trainscope pipeline`` (decode, window, detect, write to chDB) in one process;
- **faust**: ``trainscope stream faust``, one worker, doing the same
  (decode, window, detect, chDB) behind its rekey agent;
- **flink p=1 / p=2**: ``trainscope stream flink --bounded`` (local mini-cluster), then
  ``trainscope pipeline --input summaries`` (the detection tier) on its output, and a Faust
  worker as that tier (``trainscope stream faust --input summaries``);
- **flink, empty topic**: the fixed cost of starting a job (JVM, planner, mini-cluster), so the
  per-event cost can be told from it;
- ``--udf``: the wire format we did not choose: the events topic read ``raw`` and decoded by a
  Python table function (msgpack → rows) inside the Flink job
  (``benchmarks/flink_udf_decode.py``), windowed by the same SQL.

CPU is measured with psutil over every process of each run (the CLI, the Flink environment's
Python, the JVM and any Python workers it starts), sampled every 0.2 s; rates are **events per
CPU-second** (what a core buys) besides wall-clock events/s. The machine is shared: CPU time,
not wall time, is the figure to compare.
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

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from flink_procs import read_topic, seal  # noqa: E402
from kafka_broker import TansuBroker  # noqa: E402

from trainscope.cli.stream_flink import default_flink_python  # noqa: E402
from trainscope.schemas.topics import EVENTS_TOPIC, SUMMARIES_TOPIC  # noqa: E402
from trainscope.transport.bus import open_bus  # noqa: E402


def measured(command: list[str], env: dict[str, str] | None = None) -> tuple[float, float, str]:
    """Run ``command``; (wall s, CPU s of it and all its descendants, stdout)."""
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, **(env or {})}, text=True)
    root = psutil.Process(process.pid)
    cpu: dict[int, float] = {}

    def sample() -> None:
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for proc in tree:
            try:
                times = proc.cpu_times()
            except psutil.NoSuchProcess:
                continue
            cpu[proc.pid] = times.user + times.system

    while process.poll() is None:
        sample()
        time.sleep(0.2)
    out, err = process.communicate()
    if process.returncode != 0:
        raise SystemExit(f"Error: {' '.join(command[:6])}… failed:\n{err[-3000:]}")
    return time.monotonic() - started, sum(cpu.values()), out + err


def copy_as_msgpack(url: str, source: str, target: str) -> None:
    """The events topic again, each message re-encoded as the msgpack wire."""
    from trainscope.schemas.codec import decode_envelope, encode_batch

    bus = open_bus(url)
    for message in read_topic(url, source):
        records = decode_envelope(message.value).records
        bus.publish(target, encode_batch(records, wire="msgpack"), key=message.key)
    bus.flush()
    bus.close()


def _counted(out: str) -> int:
    """Rows the decode job counted: its print sink writes ``+I[job, n, total]``."""
    for line in out.splitlines():
        if line.startswith("+I["):
            return int(line[3:-1].split(", ")[1])
    return 0


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainscope.cli.main", *args]


def pipeline(url: str, store: Path, group: str, *args: str) -> list[str]:
    return cli("pipeline", "--bus", url, "--store", str(store), "--group", group,
               "--close-idle-s", "2", "--idle-exit-s", "3", "--no-auto-profile", *args)


def faust(url: str, store: Path, app_id: str, *args: str) -> list[str]:
    return cli("stream", "faust", "--bus", url, "--store", str(store), "--app-id", app_id,
               "--close-idle-s", "2", "--idle-exit-s", "3", *args)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--quick", action="store_true", help="16 ranks, 60 steps")
    parser.add_argument("--udf", action="store_true",
                        help="Also measure the raw + Python UDF decode alternative.")
    args = parser.parse_args()
    if args.quick:
        args.dp, args.pp, args.tp, args.steps = 4, 2, 2, 60
    python = default_flink_python()
    if not python.exists():
        print(f"Error: no Flink environment at {python}: run infra/setup-flink-env.sh",
              file=sys.stderr)
        return 1
    job = ["--job-id", "bench", "--dp", str(args.dp), "--pp", str(args.pp), "--tp",
           str(args.tp), "--steps", str(args.steps), "--start-s", "1767225600", "--spans",
           "--fault", "slow-gpu:rank=13,factor=1.4"]
    results = []
    with TansuBroker() as broker, tempfile.TemporaryDirectory() as tmp:
        url, servers = broker.url, broker.bootstrap_servers
        _, _, out = measured([sys.executable, "-m", "trainscope.cli.publish_simulated", "--bus",
                              url, *job], env={"TRAINSCOPE_WIRE": "json"})
        sent = json.loads(out.strip().splitlines()[0])
        events = sent["events"]
        seal(servers, EVENTS_TOPIC)
        print(f"published {events:,} span events in {sent['messages']} JSON messages",
              flush=True)

        def record(name: str, wall: float, cpu: float, note: str = "") -> None:
            results.append({"run": name, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
                            "events_per_s": round(events / wall),
                            "events_per_cpu_s": round(events / cpu), "note": note})
            print(json.dumps(results[-1]), flush=True)

        wall, cpu, _ = measured(pipeline(url, Path(tmp) / "embedded", "embedded"))
        record("embedded pipeline (decode + window + detect + store)", wall, cpu)
        wall, cpu, _ = measured(faust(url, Path(tmp) / "faust", "bench-faust"))
        record("faust, 1 worker (rekey + decode + window + detect + store)", wall, cpu)

        # Fixed cost: the same job on a topic that holds nothing (but exists).
        empty = open_bus(url)
        empty.connect(["empty.events"])
        empty.close()
        wall0, cpu0, _ = measured(cli("stream", "flink", "--bus", url, "--bounded",
                                      "--events-topic", "empty.events",
                                      "--summaries-topic", "empty.summaries",
                                      "--group", "empty"))
        record("flink job on an empty topic (fixed cost)", wall0, cpu0)
        for parallelism in (1, 2):
            # p=1 writes where the detection tier reads; p=2 beside it.
            topic = SUMMARIES_TOPIC if parallelism == 1 else f"{SUMMARIES_TOPIC}.p2"
            wall, cpu, _ = measured(cli("stream", "flink", "--bus", url, "--bounded",
                                        "--parallelism", str(parallelism),
                                        "--summaries-topic", topic,
                                        "--group", f"flink-p{parallelism}"))
            rows = len(read_topic(url, topic))
            record(f"flink windowing p={parallelism}", wall, cpu,
                   f"{rows:,} summary/step records out")
            record(f"flink windowing p={parallelism}, less the fixed cost", wall - wall0,
                   cpu - cpu0)
        wall, cpu, _ = measured(pipeline(url, Path(tmp) / "tiered", "tiered",
                                         "--input", "summaries"))
        record("detection tier on flink's output (decode + detect + store)", wall, cpu)
        wall, cpu, _ = measured(faust(url, Path(tmp) / "faust-tier", "bench-faust-tier",
                                      "--input", "summaries"))
        record("faust, 1 worker, as the detection tier on flink's output", wall, cpu)
        if args.udf:
            copy_as_msgpack(url, EVENTS_TOPIC, "msgpack.events")
            seal(servers, "msgpack.events")
            for wire, topic in (("json", EVENTS_TOPIC), ("udf", "msgpack.events")):
                def decode(topic: str, wire: str = wire) -> tuple[float, float, str]:
                    return measured([str(python), str(REPO / "benchmarks" / "flink_udf_decode.py"),
                                     "--bootstrap-servers", servers, "--topic", topic,
                                     "--wire", wire])

                base_wall, base_cpu, _ = decode("empty.events")
                wall, cpu, out = decode(topic)
                how = ("JSON format + UNNEST" if wire == "json"
                       else "raw + Python UDTF (msgpack)")
                record(f"decode only, {how}", wall, cpu, f"{_counted(out):,} rows counted")
                record(f"decode only, {how}, less its empty-topic run", wall - base_wall,
                       cpu - base_cpu)
    print(json.dumps({"events": events, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
