"""Building and merging function summaries outside the window engine.

Producers (the PyTorch hook, the host agent, trace replay) condense their own measurements with
these functions, so a summary made on a GPU host and one made by the window engine are the same
thing and merge the same way: :func:`summary_batches` reduces durations with the engine's own
group-by (:func:`trainscope.schemas.grouping.reduce_events`) into the columnar
:class:`SummaryBatch` that producers send.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import msgspec
import numpy as np

from trainscope.schemas import sketch
from trainscope.schemas.grouping import reduce_events
from trainscope.schemas.records import FunctionSummary, ProfileCallPaths, SummaryBatch

FunctionKey = tuple[str, str, int]  # layer, name, callpath_id
# Rows per batch: a batch of this many summaries with typical sketches stays a few hundred KiB,
# far below Kafka's default 1 MiB message limit.
MAX_BATCH_ROWS = 500


def summary_batches(
    durations_ns: Mapping[FunctionKey, Sequence[int] | np.ndarray],
    *,
    job_id: str,
    rank: int,
    window_start_ns: int,
    window_end_ns: int,
    bytes_total: Mapping[FunctionKey, int] | None = None,
    host: str = "",
    max_rows: int = MAX_BATCH_ROWS,
) -> list[SummaryBatch]:
    """The summaries of one rank's functions in one window, as columnar batches.

    ``durations_ns`` maps each function to the durations of its executions (functions without
    any are left out); ``bytes_total`` the bytes each function moved in the window.
    """
    keys = [key for key, values in durations_ns.items() if len(values)]
    if not keys:
        return []
    lengths = np.array([len(durations_ns[key]) for key in keys], dtype=np.int64)
    durations = np.concatenate([np.asarray(durations_ns[key], dtype=np.int64) for key in keys])
    fn = np.repeat(np.arange(len(keys), dtype=np.int64), lengths)
    parts = reduce_events(fn, durations, np.zeros(len(durations), dtype=np.int64))
    moved = np.array([(bytes_total or {}).get(key, 0) for key in keys], dtype=np.int64)
    offsets = np.searchsorted(parts.sketch_row, np.arange(len(keys) + 1))
    batches = []
    for lo, hi in _chunks(len(keys), max_rows):
        a, b = offsets[lo], offsets[hi]
        batches.append(
            SummaryBatch.from_arrays(
                job_id=job_id,
                host=host,
                window_start_ns=window_start_ns,
                window_end_ns=window_end_ns,
                layers=[layer for layer, _, _ in keys[lo:hi]],
                names=[name for _, name, _ in keys[lo:hi]],
                callpaths=[callpath for _, _, callpath in keys[lo:hi]],
                rank=np.full(hi - lo, rank),
                fn=np.arange(hi - lo),
                count=parts.count[lo:hi],
                total_ns=parts.total_ns[lo:hi],
                m2_ns2=parts.m2_ns2[lo:hi],
                min_ns=parts.min_ns[lo:hi],
                max_ns=parts.max_ns[lo:hi],
                bytes_total=moved[lo:hi],
                sketch_offsets=offsets[lo : hi + 1] - a,
                sketch_keys=parts.sketch_key[a:b],
                sketch_counts=parts.sketch_count[a:b],
            )
        )
    return batches


def batches_of(
    summaries: Sequence[FunctionSummary], host: str = "", max_rows: int = MAX_BATCH_ROWS
) -> list[SummaryBatch]:
    """Row summaries packed into columnar batches, one or more per job and window."""
    groups: dict[tuple[str, int, int], list[FunctionSummary]] = {}
    for s in summaries:
        groups.setdefault((s.job_id, s.window_start_ns, s.window_end_ns), []).append(s)
    return [
        SummaryBatch.from_summaries(group[lo:hi], host=host)
        for group in groups.values()
        for lo, hi in _chunks(len(group), max_rows)
    ]


def message_chunks(records: Sequence[Any], max_rows: int) -> list[list[Any]]:
    """Consecutive records grouped into bus messages of at most ``max_rows`` rows, a summary
    batch (or a profile's call-path part) weighing its rows (a larger one travels alone;
    :func:`summary_batches` bounds them)."""
    chunks: list[list[Any]] = []
    chunk: list[Any] = []
    rows = 0
    for record in records:
        weight = len(record) if isinstance(record, SummaryBatch | ProfileCallPaths) else 1
        if chunk and rows + weight > max_rows:
            chunks.append(chunk)
            chunk, rows = [], 0
        chunk.append(record)
        rows += weight
    if chunk:
        chunks.append(chunk)
    return chunks


def _chunks(n: int, size: int) -> Iterator[tuple[int, int]]:
    if size < 1:
        raise ValueError(f"max_rows must be >= 1, got {size}")
    for lo in range(0, n, size):
        yield lo, min(lo + size, n)


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
