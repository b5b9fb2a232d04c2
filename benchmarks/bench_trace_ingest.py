"""Trace ingestion speed (events/s) and peak memory on a large Kineto trace.

The trace is the real H100 trace kept with the tests (``tests/data/kineto-cuda-h100``, written
by ``tensorboard_trace_handler`` with Python stacks: python_function, cpu_op, user and GPU
annotations, runtime/driver calls, kernels, copies, memsets, ac2g flows) tiled in time until it
holds ``--events`` events (1 M by default); correlation and external ids are shifted per tile
so launches still link. It is written plain and gzipped.

Each measurement runs in a fresh process and reports wall and CPU seconds (the machine is
shared: events per CPU second is the steadier figure, and the ratio uses it) and the process's
peak resident memory:

- ``json.load`` (baseline, same run): the standard library parsing the whole file into memory,
  what the replay did before; events/s here is the ratio's denominator;
- ``read``: the streaming reader alone (ijson, every event counted, columns built);
- ``read+condense``: the reader plus the calling-context tree and the function summaries,
  i.e. what ``trainscope replay kineto`` does before publishing or storing;
- ``gzip read+condense``: the same from the ``.json.gz`` file.

    python benchmarks/bench_trace_ingest.py                 # 1 M events
    python benchmarks/bench_trace_ingest.py --events 7000000 --no-json   # ~2 GB file
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = (ROOT / "tests" / "data" / "kineto-cuda-h100"
          / "vm_432.1795365115932599276.pt.trace.json.gz")

CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[3])
mode, path = sys.argv[1], sys.argv[2]
if mode != "json":  # imports are not timed
    from pathlib import Path
    from trainscope.traces.condense import condense
    from trainscope.traces.reader import read_trace
wall, cpu = time.perf_counter(), time.process_time()
if mode == "json":
    with open(path, "rb") as handle:
        events = len(json.load(handle)["traceEvents"])
else:
    trace = read_trace(Path(path), rank=0)
    events = trace.counts.total_read
    if mode == "condense":
        result = condense(trace, "bench", 15 * 10**9)
        # (a kernel of the last, partial tile may have lost its launch: not asserted)
        assert result.summaries
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
print(json.dumps({"events": events, "wall_s": wall, "cpu_s": cpu,
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def write_tiled(target: Path, events: int) -> int:
    """Tile the real trace until it holds ``events`` events; returns the number written."""
    with gzip.open(SOURCE, "rt") as handle:
        doc = json.load(handle)
    base = doc["traceEvents"]
    timed = [e for e in base if isinstance(e.get("ts"), int | float)]
    span_us = max(e["ts"] + e.get("dur", 0) for e in timed) - min(e["ts"] for e in timed)
    header = {k: v for k, v in doc.items() if k != "traceEvents"}
    written = 0
    with target.open("w") as out:
        out.write(json.dumps(header)[:-1] + ', "traceEvents": [\n')
        tile = 0
        while written < events:
            shift = tile * (span_us + 1000.0)
            for event in base:
                if written >= events:
                    break
                e = dict(event)
                if isinstance(e.get("ts"), int | float):
                    e["ts"] = round(e["ts"] + shift, 3)
                if e.get("cat") == "ac2g":
                    e["id"] = e["id"] + tile * 10**7
                args = e.get("args")
                if isinstance(args, dict) and ("correlation" in args or "External id" in args):
                    args = dict(args)
                    for key in ("correlation", "External id"):
                        if isinstance(args.get(key), int):
                            args[key] += tile * 10**7
                    e["args"] = args
                out.write(("" if written == 0 else ",\n") + json.dumps(e))
                written += 1
            tile += 1
        out.write("\n]}\n")
    return written


def measure(mode: str, path: Path) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", CHILD, mode, str(path), str(ROOT)],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--no-json", action="store_true",
                        help="skip the json.load baseline (a 2 GB file needs ~20 GB for it)")
    parser.add_argument("--no-gzip", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "big.json"
        t0 = time.perf_counter()
        n = write_tiled(plain, args.events)
        size = plain.stat().st_size
        print(f"trace: {n:,} events, {size / 2**20:,.0f} MiB plain "
              f"(written in {time.perf_counter() - t0:.0f} s)", flush=True)
        runs = [] if args.no_json else [("json.load (baseline)", "json", plain)]
        runs += [("read", "read", plain), ("read+condense", "condense", plain)]
        if not args.no_gzip:
            packed = Path(tmp) / "big.json.gz"
            with plain.open("rb") as src, gzip.open(packed, "wb", compresslevel=1) as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
            print(f"gzip: {packed.stat().st_size / 2**20:,.0f} MiB", flush=True)
            runs.append(("gzip read+condense", "condense", packed))
        baseline = None
        print("| step | events/s | events/CPU s | wall s | CPU s | peak RSS MiB | RSS ÷ file "
              "| vs json.load (CPU) |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for label, mode, path in runs:
            r = measure(mode, path)
            rate, cpu_rate = r["events"] / r["wall_s"], r["events"] / r["cpu_s"]
            if mode == "json":
                baseline = cpu_rate
            ratio = f"{cpu_rate / baseline:.2f}" if baseline else "-"
            print(f"| {label} | {rate:,.0f} | {cpu_rate:,.0f} | {r['wall_s']:.1f} | "
                  f"{r['cpu_s']:.1f} | "
                  f"{r['rss_mib']:,.0f} | {r['rss_mib'] * 2**20 / size:.2f} | {ratio} |",
                  flush=True)


if __name__ == "__main__":
    main()
