"""A closed window's sketch columns: rows gathered from several chunks, in a given order."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from trainscope.engine.frames import _list_column, _list_layout


def reference(offsets: list[np.ndarray], values: list[np.ndarray],
              order: np.ndarray | None) -> list[list[int]]:
    """Arrow's own take of a chunked list column (what the window close did before)."""
    lists = pa.chunked_array([pa.LargeListArray.from_arrays(pa.array(o, type=pa.int64()),
                                                            pa.array(v))
                              for o, v in zip(offsets, values, strict=True)])
    if order is not None:
        lists = lists.take(pa.array(order))
    return lists.to_pylist()


@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("ordered", [False, True])
def test_rows_gathered_in_numpy_are_arrows_own(chunks: int, ordered: bool) -> None:
    rng = np.random.default_rng(chunks)
    offsets, keys, counts = [], [], []
    for _ in range(chunks):
        lengths = rng.integers(0, 6, size=rng.integers(1, 40))  # empty sketches included
        o = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=o[1:])
        offsets.append(o)
        keys.append(rng.integers(-50, 50, size=o[-1]).astype(np.int32))
        counts.append(rng.integers(1, 1000, size=o[-1]))
    rows = sum(len(o) - 1 for o in offsets)
    order = None if ordered else rng.permutation(rows)
    layout, entries = _list_layout(offsets, order)
    for values in (keys, counts):
        column = _list_column(layout, entries, values)
        assert [list(v) for v in column] == reference(
            offsets, [v.astype(np.int64) for v in values], order)
        # The values keep their own type (32-bit keys, 64-bit counts), as on the wire.
        assert column.dtype.pyarrow_dtype == pa.large_list(pa.from_numpy_dtype(values[0].dtype))
