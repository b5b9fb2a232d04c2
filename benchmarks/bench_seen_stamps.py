"""What the stream job's memory of producer stamps costs over a long run of a large job.

The stream job drops a batch a producer re-sent by its stamp (producer id, sequence, payload
digest; ``trainscope.engine.delivery.SeenBatches``), and each checkpoint (every few seconds)
stores the stamps it keeps. This benchmark plays a job of ``--ranks`` ranks, one producer per
rank (each training process stamps its own batches), sending ``--messages-per-window``
messages per rank per window (9.1 at 10,240 ranks in ``bench_pipeline.py``: a summary batch
and the step batches of the sender rounds that ended a step), for ``--minutes`` of job time,
with 15 s windows closing 5 s after their end. Every simulated minute it prints the stamps
kept, the process's resident memory, and what one checkpoint of the stamps costs (pickled and
compressed as ``trainscope.engine.checkpoint.encode`` does): CPU seconds and bytes.

It times the SeenBatches on the import path. For the figures before it kept stamps by window
(2026-12-07), run it with ``PYTHONPATH`` at a checkout of that time: that class had
``first_time`` and the checkpoint kept ``recent(4096)`` stamps per producer, which this script
calls when it finds them.

Run:  taskset -c 1 python benchmarks/bench_seen_stamps.py [--ranks 10240] [--minutes 20]
"""

from __future__ import annotations

import argparse
import math
import pickle
import time
import zlib
from pathlib import Path

from trainscope.engine.delivery import SeenBatches

WINDOW_S = 15.0
LATENESS_S = 5.0
JOB = "job"


def rss_mib() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096 / 2**20


def stamps_kept(seen: SeenBatches) -> int:
    if hasattr(seen, "_digests"):
        return len(seen)
    return sum(len(stamps) for stamps in seen._seen.values())  # type: ignore[attr-defined]


def checkpoint_cost(seen: SeenBatches) -> tuple[int, float, int]:
    """Stamps in one checkpoint, CPU seconds to take it, compressed bytes."""
    t0 = time.process_time()
    kept = seen.recent(4096) if hasattr(seen, "recent") else seen  # type: ignore[attr-defined]
    blob = zlib.compress(pickle.dumps(kept, protocol=pickle.HIGHEST_PROTOCOL), 1)
    return stamps_kept(kept), time.process_time() - t0, len(blob)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=10_240)
    parser.add_argument("--minutes", type=int, default=20)
    parser.add_argument("--messages-per-window", type=float, default=9.125)
    args = parser.parse_args()

    seen = SeenBatches()
    by_window = hasattr(seen, "keep")
    tick_s = WINDOW_S / args.messages_per_window  # each rank sends once a tick
    ticks = math.ceil(args.minutes * 60 / tick_s)
    print(f"{'by window' if by_window else 'per producer'}: {args.ranks:,} producers, "
          f"{args.ranks / tick_s:,.0f} messages/s of job time, {args.minutes} min")
    print(f"{'min':>4} {'stamps kept':>12} {'RSS MiB':>8} {'ckpt stamps':>12} "
          f"{'ckpt CPU s':>10} {'ckpt MB':>8} {'us/msg':>7}")
    base_rss = rss_mib()
    cpu_s = 0.0
    messages = 0
    next_report_s = 60.0
    for tick in range(ticks):
        seq = tick + 1  # each producer's next batch
        now_s = tick * tick_s
        window = int(now_s // WINDOW_S)
        closed_before = int((now_s - LATENESS_S) // WINDOW_S)
        t0 = time.process_time()
        if by_window:
            resent, keep = seen.resent, seen.keep
            windows = {JOB: window}
            for rank in range(1, args.ranks + 1):
                digest = (seq * 2654435761 + rank) & 0xFFFFFFFF
                if not resent(rank, seq, digest):
                    keep(rank, seq, digest, windows)
            seen.forget_closed(lambda _job, before=closed_before: before)
        else:
            first_time = seen.first_time  # type: ignore[attr-defined]
            for rank in range(1, args.ranks + 1):
                first_time(rank, seq, (seq * 2654435761 + rank) & 0xFFFFFFFF)
        cpu_s += time.process_time() - t0
        messages += args.ranks
        if now_s + tick_s >= next_report_s:
            next_report_s += 60.0
            stamps, ckpt_s, ckpt_bytes = checkpoint_cost(seen)
            print(f"{round((now_s + tick_s) / 60):>4} {stamps_kept(seen):>12,} "
                  f"{rss_mib() - base_rss:>8,.0f} {stamps:>12,} {ckpt_s:>10.2f} "
                  f"{ckpt_bytes / 1e6:>8.1f} {cpu_s / messages * 1e6:>7.2f}", flush=True)


if __name__ == "__main__":
    main()
