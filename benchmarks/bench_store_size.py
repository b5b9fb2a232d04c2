"""Stored bytes per GPU-hour: what a demo job leaves in the store, per rank and hour of job time.

Runs ``trainscope demo`` (the whole pipeline, per-window function summaries as real producers
send them, metric samples, findings) into a fresh chDB store, merges every table's parts
(``OPTIMIZE … FINAL``, the state a store reaches after background merges), and divides
``sum(bytes_on_disk)`` of the active parts by ranks × job hours (the span of the job's step
records). Per table figures are printed too.

Run it against two checkouts to compare table layouts, e.g. before and after a DDL change:

    PYTHONPATH=/path/to/old python benchmarks/bench_store_size.py
    PYTHONPATH=/path/to/new python benchmarks/bench_store_size.py
    python benchmarks/bench_store_size.py --quick     # 16 ranks × 100 steps
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

START_S = 1_767_225_600

# chDB lets one process own a store: measure in a child after the demo exits.
MEASURE = r"""
import json, sys
from trainscope.store.client import connect
client = connect(sys.argv[1], create=False)
tables = [r[0] for r in client.query(
    "SELECT name FROM system.tables WHERE database = currentDatabase() "
    "AND engine LIKE '%MergeTree'").result_rows]
for table in tables:
    client.command(f"OPTIMIZE TABLE `{table}` FINAL")
per_table = dict(client.query(
    "SELECT table, sum(bytes_on_disk) FROM system.parts "
    "WHERE active AND database = currentDatabase() GROUP BY table").result_rows)
rows = dict(client.query(
    "SELECT table, sum(rows) FROM system.parts "
    "WHERE active AND database = currentDatabase() GROUP BY table").result_rows)
ranks, span_ns = client.query(
    "SELECT uniqExact(rank), max(start_ns + duration_ns) - min(start_ns) "
    "FROM step_records").result_rows[0]
print(json.dumps({"per_table": {k: int(v) for k, v in per_table.items()},
                  "rows": {k: int(v) for k, v in rows.items()},
                  "ranks": int(ranks), "span_ns": int(span_ns)}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 ranks × 100 steps")
    args = parser.parse_args()
    ranks, steps = (16, 100) if args.quick else (64, 600)
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        demo = [sys.executable, "-m", "trainscope.cli.main", "demo", "--ranks", str(ranks),
                "--dp", str(ranks // 4), "--pp", "2", "--tp", "2", "--steps", str(steps),
                "--fault", "slow-gpu:rank=5,factor=1.4", "--start-s", str(START_S),
                "--store", str(store), "--json"]
        # From the temporary directory: ``python -m`` puts the working directory first on the
        # path, which would pick a checkout there over the one PYTHONPATH names.
        done = subprocess.run(demo, capture_output=True, text=True, check=False, cwd=tmp)
        if done.returncode != 0:
            sys.exit(f"Error: demo failed: {done.stderr.strip().splitlines()[-1:]}")
        done = subprocess.run([sys.executable, "-c", MEASURE, str(store)],
                              capture_output=True, text=True, check=False, cwd=tmp)
        if done.returncode != 0:
            sys.exit(f"Error: measuring the store failed: {done.stderr.strip()[-500:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
    gpu_hours = result["ranks"] * result["span_ns"] / 3.6e12
    total = sum(result["per_table"].values())
    print(f"job: {result['ranks']} ranks × {result['span_ns'] / 1e9:.0f} s = "
          f"{gpu_hours:.3f} GPU-hours")
    print(f"{'table':<22} {'rows':>10} {'bytes':>12} {'bytes/GPU-hour':>15}")
    for table, size in sorted(result["per_table"].items(), key=lambda kv: -kv[1]):
        print(f"{table:<22} {result['rows'].get(table, 0):>10,} {size:>12,} "
              f"{size / gpu_hours:>15,.0f}")
    print(f"{'total':<22} {'':>10} {total:>12,} {total / gpu_hours:>15,.0f}")


if __name__ == "__main__":
    main()
