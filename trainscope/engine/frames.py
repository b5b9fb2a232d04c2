"""A closed window's input as the data frames of its :class:`WindowView`.

Rows are sorted by their key, never by arrival: function ids follow the order records first
named them, steps and metrics the order they came in, and neither may decide the rows, or a
replayed window would not be byte-identical.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa

from trainscope.engine.keys import FunctionTable, function_of, rank_of
from trainscope.schemas.grouping import Partials, merge_partials
from trainscope.schemas.records import MetricBatch, StepBatch
from trainscope.schemas.window import METRIC_COLUMNS, STEP_COLUMNS, WindowView

_STR = pd.Series(["x"]).dtype


def summary_frame(functions: FunctionTable, parts: list[Partials]) -> pd.DataFrame:
    """One row per (rank, function) of the window, sorted by (rank, layer, name, call path)."""
    if not parts:
        return WindowView("", 0, 1).summaries
    group = np.concatenate([p.group for p in parts]) if len(parts) > 1 else parts[0].group
    if len(group) > 1 and _has_repeats(group):
        # Some (rank, function) arrived more than once: merge them (spans come in several
        # batches per window; a producer may send a window twice). merge_partials merges in
        # an order fixed by the values, so the result does not depend on arrival order.
        parts = [merge_partials(Partials.concat(parts) if len(parts) > 1 else parts[0])]
        group = parts[0].group
    # Otherwise (summary batches, typically) nothing merges and the rows only need sorting:
    # numeric columns are gathered in numpy, the sketches in Arrow, each value copied once.
    fid = function_of(group)
    rank = rank_of(group)
    order: np.ndarray | None = np.lexsort((functions.order()[fid], rank))
    if (order[1:] > order[:-1]).all():
        order = None  # already in order
    else:
        fid, rank = fid[order], rank[order]
    columns = {
        name: _gather([getattr(p, name) for p in parts], order).astype(dtype, copy=False)
        for name, dtype in (("count", np.int64), ("total_ns", np.int64),
                            ("m2_ns2", np.float64), ("min_ns", np.int64),
                            ("max_ns", np.int64), ("bytes_total", np.int64))
    }
    # The sketches stay flat: Arrow list columns over the partials' arrays, built without a
    # Python object per row (a row still reads as a list). Lists of Python ints cost about
    # 3 µs per summary at typical sketch sizes, more than the rest of the window together.
    offsets = [np.searchsorted(p.sketch_row, np.arange(len(p.group) + 1)) for p in parts]
    sketch_offsets, entries = _list_layout(offsets, order)
    return pd.DataFrame(
        {
            "rank": rank,
            "layer": _string_column(functions.layer, fid),
            "name": _string_column(functions.name, fid),
            "callpath_id": np.asarray(functions.callpath, dtype=np.uint64)[fid],
            **columns,
            "sketch_keys": _list_column(sketch_offsets, entries,
                                        [p.sketch_key for p in parts]),
            "sketch_counts": _list_column(sketch_offsets, entries,
                                          [p.sketch_count for p in parts]),
        }
    )


def step_frame(steps: list[StepBatch]) -> pd.DataFrame:
    """One row per step record, sorted by every column (int64 and float64 columns)."""
    if not steps:
        return WindowView("", 0, 1).steps
    columns = {c: _joined(steps, c) for c in STEP_COLUMNS}
    columns = {c: v.astype(np.float64 if v.dtype.kind == "f" else np.int64, copy=False)
               for c, v in columns.items()}
    order = np.lexsort([columns[c] for c in reversed(STEP_COLUMNS)])
    return pd.DataFrame({c: v[order] for c, v in columns.items()})


def metric_frame(samples: list[MetricBatch]) -> pd.DataFrame:
    """One row per metric sample, sorted by (rank, name, device, host, time, value)."""
    if not samples:
        return WindowView("", 0, 1).metrics
    batch = MetricBatch.concat(samples)
    host = np.array(batch.hosts, dtype=object)[batch.column("host")]
    name = np.array(batch.names, dtype=object)[batch.column("name")]
    rank = batch.column("rank").astype(np.int64)
    device = batch.column("device").astype(np.int64)
    ts_ns = batch.column("ts_ns").astype(np.int64)
    value = batch.column("value").astype(np.float64)
    # Strings sort as their places in the sorted dictionary (the same order, integer keys).
    order = np.lexsort((value, ts_ns, _sort_key(batch.hosts, batch.column("host")), device,
                        _sort_key(batch.names, batch.column("name")), rank))
    columns = {"rank": rank, "host": host, "device": device, "ts_ns": ts_ns, "name": name,
               "value": value}
    return pd.DataFrame({c: columns[c][order] for c in METRIC_COLUMNS})


def _joined(batches: list[StepBatch], name: str) -> np.ndarray:
    return np.concatenate([b.column(name) for b in batches]) if len(batches) > 1 \
        else batches[0].column(name)


def _sort_key(words: list[str], index: np.ndarray) -> np.ndarray:
    place = np.empty(len(words), dtype=np.int64)
    place[sorted(range(len(words)), key=words.__getitem__)] = np.arange(len(words))
    return place[index]


def _has_repeats(keys: np.ndarray) -> bool:
    # A sort and a comparison of neighbours: numpy 2's hash-based unique took 10x longer on
    # a window of 0.5 M keys.
    ordered = np.sort(keys)
    return bool((ordered[1:] == ordered[:-1]).any())


def _gather(chunks: list[np.ndarray], order: np.ndarray | None) -> np.ndarray:
    values = np.concatenate(chunks) if len(chunks) > 1 else chunks[0]
    return values if order is None else values[order]


def _string_column(values: list[str], index: np.ndarray) -> pd.api.extensions.ExtensionArray:
    # Taken in Arrow: the same column pandas makes of Python strings, without one per row.
    return pd.array(pa.array(values, type=pa.string()).take(pa.array(index)), dtype=_STR)


def _list_layout(offsets: list[np.ndarray], order: np.ndarray | None
                 ) -> tuple[np.ndarray, np.ndarray | None]:
    """The list offsets of the rows of all chunks (row ``i`` of chunk ``c`` spans entries
    ``offsets[c][i]:offsets[c][i + 1]`` of that chunk), in ``order`` when given, and which
    entries of the chunks joined they take (None: all, as they are)."""
    if len(offsets) == 1:
        starts = offsets[0]
    else:  # each chunk's offsets shifted past the entries of the chunks before it
        shift = np.cumsum([0] + [int(o[-1]) for o in offsets[:-1]])
        starts = np.concatenate([offsets[0]] + [o[1:] + s for o, s in
                                                zip(offsets[1:], shift[1:], strict=True)])
    if order is None:
        return starts.astype(np.int64, copy=False), None
    lengths = np.diff(starts)[order]
    new = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=new[1:])
    # Entry j of new row r is old entry starts[order[r]] + (j - new[r]): one repeat, no loop.
    # In 32 bits where the entries fit: half the memory to write and read (8 M entries in a
    # window of 10,240 ranks).
    index = np.int32 if new[-1] < np.iinfo(np.int32).max else np.int64
    entries = np.repeat((starts[:-1][order] - new[:-1]).astype(index), lengths)
    entries += np.arange(new[-1], dtype=index)
    return new, entries


def _list_column(offsets: np.ndarray, entries: np.ndarray | None, values: list[np.ndarray]
                 ) -> pd.arrays.ArrowExtensionArray:
    """An Arrow list column over the chunks' values joined (``entries`` of them, when given),
    cut at ``offsets``: gathered in numpy once for both sketch columns' layout; Arrow's
    ``take`` of a list column cost about as much as the rest of closing the window. The values
    keep their wire type (32-bit sketch keys, 64-bit counts): the store narrows them further,
    and widening the keys first cost a copy of 8 M values a window at 10,240 ranks."""
    flat = np.concatenate(values) if len(values) > 1 else values[0]
    if entries is not None:
        flat = flat[entries]
    return pd.arrays.ArrowExtensionArray(pa.LargeListArray.from_arrays(
        pa.array(offsets, type=pa.int64()), pa.array(flat)))
