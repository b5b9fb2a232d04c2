"""Building and merging :class:`FunctionSummary` records outside the window engine.

In-process producers (the PyTorch hook, the host agent) condense their own measurements with
these functions, so a summary made on a GPU host and one made by the window engine are the same
thing and merge the same way.
"""

from __future__ import annotations

import msgspec
import numpy as np

from trainscope.schemas import sketch
from trainscope.schemas.records import FunctionSummary


def summarize(
    durations_ns: np.ndarray | list[int],
    *,
    job_id: str,
    rank: int,
    layer: str,
    name: str,
    window_start_ns: int,
    window_end_ns: int,
    bytes_moved: np.ndarray | list[int] | None = None,
    callpath_id: int = 0,
) -> FunctionSummary:
    durations = np.asarray(durations_ns, dtype=np.int64)
    if durations.size == 0:
        raise ValueError(f"no durations to summarise for {layer}/{name} on rank {rank}")
    mean = durations.mean()
    keys, counts = sketch.sketch_of(durations)
    return FunctionSummary(
        job_id=job_id,
        rank=rank,
        layer=layer,
        name=name,
        callpath_id=callpath_id,
        window_start_ns=window_start_ns,
        window_end_ns=window_end_ns,
        count=int(durations.size),
        total_ns=int(durations.sum()),
        m2_ns2=float(((durations - mean) ** 2).sum()),
        min_ns=int(durations.min()),
        max_ns=int(durations.max()),
        bytes_total=0 if bytes_moved is None else int(np.asarray(bytes_moved).sum()),
        sketch_keys=keys,
        sketch_counts=counts,
    )


def merge(a: FunctionSummary, b: FunctionSummary) -> FunctionSummary:
    """Merge two summaries of the same function and rank; the window becomes their union."""
    if (a.job_id, a.rank, a.layer, a.name, a.callpath_id) != (
        b.job_id,
        b.rank,
        b.layer,
        b.name,
        b.callpath_id,
    ):
        raise ValueError(
            f"cannot merge summaries of different functions: {a.layer}/{a.name}@{a.rank} "
            f"and {b.layer}/{b.name}@{b.rank}"
        )
    count = a.count + b.count
    delta = b.mean_ns - a.mean_ns
    m2 = a.m2_ns2 + b.m2_ns2 + delta * delta * a.count * b.count / count if count else 0.0
    keys, counts = sketch.merge(a.sketch_keys, a.sketch_counts, b.sketch_keys, b.sketch_counts)
    return msgspec.structs.replace(
        a,
        window_start_ns=min(a.window_start_ns, b.window_start_ns),
        window_end_ns=max(a.window_end_ns, b.window_end_ns),
        count=count,
        total_ns=a.total_ns + b.total_ns,
        m2_ns2=m2,
        min_ns=min(a.min_ns, b.min_ns),
        max_ns=max(a.max_ns, b.max_ns),
        bytes_total=a.bytes_total + b.bytes_total,
        sketch_keys=keys,
        sketch_counts=counts,
    )


def quantile_ns(summary: FunctionSummary, q: float) -> float:
    return sketch.quantile(summary.sketch_keys, summary.sketch_counts, q)
