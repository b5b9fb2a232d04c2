"""Vectorised group-by reductions shared by the window engine's two passes.

Both passes (events → partial summaries, partial summaries → final summaries) sort rows by an
integer group key once and reduce contiguous runs with ``ufunc.reduceat``: no Python loop over
events or groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainscope.schemas import sketch

# Sketch keys of durations from 1 ns to ~10^17 ns fit below this; composite keys use it as radix.
SKETCH_RADIX = 2048


@dataclass
class Partials:
    """Summary statistics per group key; the sketch as (group index, bucket key, count) rows."""

    # int64 group key: sorted where reduce_events or merge_partials made the partials
    # (unique unless reduced per unit), in the order sent for a summary batch's rows
    group: np.ndarray
    count: np.ndarray
    total_ns: np.ndarray
    m2_ns2: np.ndarray
    min_ns: np.ndarray
    max_ns: np.ndarray
    bytes_total: np.ndarray
    sketch_row: np.ndarray  # index into ``group``, non-decreasing: a row's entries are contiguous
    sketch_key: np.ndarray
    sketch_count: np.ndarray

    @classmethod
    def concat(cls, parts: list[Partials]) -> Partials:
        offsets = np.cumsum([0] + [len(p.group) for p in parts[:-1]])
        return cls(
            group=np.concatenate([p.group for p in parts]),
            count=np.concatenate([p.count for p in parts]),
            total_ns=np.concatenate([p.total_ns for p in parts]),
            m2_ns2=np.concatenate([p.m2_ns2 for p in parts]),
            min_ns=np.concatenate([p.min_ns for p in parts]),
            max_ns=np.concatenate([p.max_ns for p in parts]),
            bytes_total=np.concatenate([p.bytes_total for p in parts]),
            sketch_row=np.concatenate(
                [p.sketch_row + off for p, off in zip(parts, offsets, strict=True)]
            ),
            sketch_key=np.concatenate([p.sketch_key for p in parts]),
            sketch_count=np.concatenate([p.sketch_count for p in parts]),
        )

    def take(self, rows: np.ndarray) -> Partials:
        """The subset of groups at ``rows`` (sorted indices), with their sketch rows."""
        remap = np.full(len(self.group), -1, dtype=np.int64)
        remap[rows] = np.arange(len(rows))
        keep = remap[self.sketch_row] >= 0
        return Partials(
            group=self.group[rows],
            count=self.count[rows],
            total_ns=self.total_ns[rows],
            m2_ns2=self.m2_ns2[rows],
            min_ns=self.min_ns[rows],
            max_ns=self.max_ns[rows],
            bytes_total=self.bytes_total[rows],
            sketch_row=remap[self.sketch_row[keep]],
            sketch_key=self.sketch_key[keep],
            sketch_count=self.sketch_count[keep],
        )


def _runs(sorted_keys: np.ndarray) -> np.ndarray:
    """Start index of each run of equal keys."""
    if len(sorted_keys) == 0:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])


def _sketch_rows(
    row: np.ndarray, key: np.ndarray, count: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    composite = row.astype(np.int64) * SKETCH_RADIX + np.clip(key, 0, SKETCH_RADIX - 1)
    order = np.argsort(composite, kind="stable")
    composite = composite[order]
    starts = _runs(composite)
    counts = np.add.reduceat(count[order], starts) if len(starts) else count[:0]
    unique = composite[starts]
    # The keys keep their type (32 bits on the wire): the frames hand them on as they are.
    return unique // SKETCH_RADIX, (unique % SKETCH_RADIX).astype(key.dtype, copy=False), counts


def reduce_events(
    group: np.ndarray,
    duration_ns: np.ndarray,
    bytes_moved: np.ndarray,
    unit: np.ndarray | None = None,
) -> Partials:
    """Summaries of raw events, grouped by ``group``; with ``unit`` (non-decreasing, e.g. the
    message each event came in), one partial per (group, unit), so a partial never depends on
    which other messages shared the call."""
    order = np.argsort(group, kind="stable")
    keys = group[order]
    d = duration_ns[order]
    if unit is None:
        starts = _runs(keys)
    else:
        # The stable sort keeps units in order within a group: a run ends where either changes.
        u = unit[order]
        starts = (
            np.flatnonzero(np.r_[True, (keys[1:] != keys[:-1]) | (u[1:] != u[:-1])])
            if len(keys)
            else np.zeros(0, dtype=np.int64)
        )
    n = len(keys)
    count = np.diff(np.r_[starts, n])
    total = np.add.reduceat(d, starts) if n else d[:0]
    mean = total / np.maximum(count, 1)
    dev = d - np.repeat(mean, count)
    row = np.repeat(np.arange(len(starts)), count)
    s_row, s_key, s_count = _sketch_rows(row, sketch.bucket_keys(d), np.ones(n, dtype=np.int64))
    return Partials(
        group=keys[starts],
        count=count,
        total_ns=total,
        m2_ns2=np.add.reduceat(dev * dev, starts) if n else mean[:0],
        min_ns=np.minimum.reduceat(d, starts) if n else d[:0],
        max_ns=np.maximum.reduceat(d, starts) if n else d[:0],
        bytes_total=np.add.reduceat(bytes_moved[order], starts) if n else d[:0],
        sketch_row=s_row,
        sketch_key=s_key,
        sketch_count=s_count,
    )


def merge_partials(p: Partials) -> Partials:
    """Merge partial summaries with equal group keys (Chan et al. for the variance).

    Within a group, partials are merged in an order fixed by their own values, not by their
    arrival: floating-point sums depend on order, and a window replayed after a restart must
    give the same bits.
    """
    if len(p.group) < 2 or (p.group[1:] > p.group[:-1]).all():
        return p  # sorted and unique: nothing to merge or move
    order = np.lexsort((p.m2_ns2, p.bytes_total, p.max_ns, p.min_ns, p.total_ns, p.count,
                        p.group))
    keys = p.group[order]
    starts = _runs(keys)
    if len(starts) == len(keys):  # nothing to merge
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        # Sketch rows must follow the new row order (the frame splits them by row).
        s_row, s_key, s_count = _sketch_rows(inverse[p.sketch_row], p.sketch_key, p.sketch_count)
        return Partials(
            group=keys,
            count=p.count[order],
            total_ns=p.total_ns[order],
            m2_ns2=p.m2_ns2[order],
            min_ns=p.min_ns[order],
            max_ns=p.max_ns[order],
            bytes_total=p.bytes_total[order],
            sketch_row=s_row,
            sketch_key=s_key,
            sketch_count=s_count,
        )
    count_i = p.count[order]
    total_i = p.total_ns[order]
    count = np.add.reduceat(count_i, starts)
    total = np.add.reduceat(total_i, starts)
    members = np.diff(np.r_[starts, len(keys)])
    mean = total / np.maximum(count, 1)
    mean_i = total_i / np.maximum(count_i, 1)
    spread = count_i * (mean_i - np.repeat(mean, members)) ** 2
    group_of_row = np.empty(len(keys), dtype=np.int64)
    group_of_row[order] = np.repeat(np.arange(len(starts)), members)
    s_row, s_key, s_count = _sketch_rows(
        group_of_row[p.sketch_row], p.sketch_key, p.sketch_count
    )
    return Partials(
        group=keys[starts],
        count=count,
        total_ns=total,
        m2_ns2=np.add.reduceat(p.m2_ns2[order] + spread, starts),
        min_ns=np.minimum.reduceat(p.min_ns[order], starts),
        max_ns=np.maximum.reduceat(p.max_ns[order], starts),
        bytes_total=np.add.reduceat(p.bytes_total[order], starts),
        sketch_row=s_row,
        sketch_key=s_key,
        sketch_count=s_count,
    )
