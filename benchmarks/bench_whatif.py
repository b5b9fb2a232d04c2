"""Straggler what-if analysis time against job size (workers × steps), on one core.

For each job size a synthetic Megatron 1F1B trace (8 pipeline stages, 8 micro-batches, one
slow worker) is generated and written to Parquet; then the full ``trainscope whatif`` path is
timed: read the file, validate, build the schedule arrays, analyse (all replays). The baseline,
measured in the same run, is the time to only read the Parquet file, so the ratio column says
how many "file reads" the analysis costs, independent of how busy the machine is.

The last row times the same path on the real 8-worker production trace kept with the tests
(``tests/data/stragglers-ST``).

    python benchmarks/bench_whatif.py            # up to 10,240 workers × 50 steps
    python benchmarks/bench_whatif.py --quick    # up to 640 workers
"""

from __future__ import annotations

import os

# One core: pin BLAS/Arrow thread pools before numpy or pyarrow are imported.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:
    from trainscope.schemas.optrace import JobMeta

# (dp_size, pp_size, steps): 64 workers × 44 steps is the small target.
SIZES = [(8, 8, 44), (80, 8, 50), (320, 8, 50), (1280, 8, 50)]
MICROBATCHES = 8
REAL_TRACE = Path(__file__).resolve().parent.parent / "tests" / "data" / "stragglers-ST"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only sizes up to 640 workers")
    parser.add_argument("--repeat", type=int, default=1, help="best of N timings per size")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    import pyarrow as pa

    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)

    sizes = SIZES[:2] if args.quick else SIZES
    print(f"{'workers':>8} {'steps':>6} {'rows':>11} {'read s':>8} {'prepare s':>10} "
          f"{'analyse s':>10} {'total s':>8} {'× read':>7} {'S':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        for dp, pp, steps in sizes:
            row = measure(Path(tmp), dp, pp, steps, args.repeat)
            print_row(f"{dp * pp}", steps, row)
    from trainscope.schemas.optrace import read_meta

    meta = read_meta(REAL_TRACE / "meta-ST.yaml")
    row = time_analysis(REAL_TRACE / "trace-ST.parquet", meta, max(args.repeat, 5))
    print_row(f"ST {meta.workers}", int(row.pop("steps")), row, digits=4)


def print_row(label: str, steps: int, row: dict[str, float], digits: int = 2) -> None:
    f = f".{digits}f"
    print(f"{label:>8} {steps:>6} {int(row['rows']):>11,} {row['read']:>8{f}} "
          f"{row['prepare']:>10{f}} {row['analyse']:>10{f}} {row['total']:>8{f}} "
          f"{row['total'] / row['read']:>7.1f} {row['S']:>6.3f}", flush=True)


def measure(tmp: Path, dp: int, pp: int, steps: int, repeat: int) -> dict[str, float]:
    from trainscope.schemas.optrace import JobMeta
    from trainscope.whatif.generate import JobSpec, generate, write

    spec = JobSpec(dp_size=dp, pp_size=pp, microbatches=MICROBATCHES, steps=steps,
                   worker_factor={(dp // 2, pp // 2): 1.3}, seed=dp)
    df, meta_dict = generate(spec)
    path = tmp / f"trace_{dp}x{pp}.parquet"
    write(df, meta_dict, path, tmp / "meta.yaml")
    del df
    row = time_analysis(path, JobMeta.from_mapping(meta_dict), repeat)
    path.unlink()
    return row


def time_analysis(path: Path, meta: JobMeta, repeat: int) -> dict[str, float]:
    """Best of ``repeat`` runs of read → validate + layout → analyse."""
    import pandas as pd

    from trainscope.schemas.optrace import validate
    from trainscope.whatif.analysis import analyse
    from trainscope.whatif.layout import build_layout

    best: dict[str, float] = {}
    for _ in range(repeat):
        t0 = time.perf_counter()
        raw = pd.read_parquet(path)
        rows = len(raw)
        t1 = time.perf_counter()
        layout = build_layout(validate(raw, meta), meta)
        del raw
        t2 = time.perf_counter()
        result = analyse(layout)
        t3 = time.perf_counter()
        steps = layout.start_s.shape[1]
        del layout
        run = {"read": t1 - t0, "prepare": t2 - t1, "analyse": t3 - t2, "total": t3 - t0}
        best = run if not best or run["total"] < best["total"] else best
    return {**best, "rows": rows, "steps": steps, "S": result.S}


if __name__ == "__main__":
    main()
