"""The sketch columns cast to the store's Int16 / UInt32: exact within range, clamped and
counted outside it (ClickHouse itself would wrap 40,000 round to -25,536)."""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa

from trainscope.schemas.ddl import TABLES
from trainscope.schemas.sketch import bucket_keys
from trainscope.sinks.narrow import SKETCH_TYPES, narrow_lists


def sketches(keys: list[list[int] | None], counts: list[list[int]]) -> pa.Table:
    return pa.table({"rank": pa.array(range(len(keys)), pa.int64()),
                     "sketch_keys": pa.array(keys, pa.large_list(pa.int64())),
                     "sketch_counts": pa.array(counts, pa.large_list(pa.int64()))})


def test_the_element_types_are_the_tables() -> None:
    stored = TABLES["function_summaries"].types
    for column, element in SKETCH_TYPES.items():
        (name,) = re.fullmatch(r"Array\((\w+)\)", stored[column]).groups()
        assert name.lower() == str(element), column


def test_every_key_a_duration_can_have_fits_in_int16() -> None:
    longest = bucket_keys(np.array([np.iinfo(np.int64).max, 1, 0]))
    assert longest.tolist() == [2184, 0, 0]
    assert np.iinfo(np.int16).max >= 2184


def test_values_within_range_are_kept_exactly() -> None:
    table = sketches([[0, 2184, 1500], [], [7]], [[1, 2**32 - 1, 3], [], [9]])
    narrowed, clamped = narrow_lists(table, SKETCH_TYPES)
    assert clamped == 0
    assert narrowed.schema.field("sketch_keys").type == pa.large_list(pa.int16())
    assert narrowed.schema.field("sketch_counts").type == pa.large_list(pa.uint32())
    assert narrowed.column("sketch_keys").to_pylist() == table.column("sketch_keys").to_pylist()
    assert narrowed.column("sketch_counts").to_pylist() == \
        table.column("sketch_counts").to_pylist()
    assert narrowed.column("rank") == table.column("rank")


def test_values_outside_are_clamped_and_counted_only_where_the_slice_holds_them() -> None:
    table = sketches([[1, 40_000], None, [-70_000, 3]], [[5, 2**32 + 7], [], [1, 2]])
    narrowed, clamped = narrow_lists(table, SKETCH_TYPES)
    assert clamped == 3
    assert narrowed.column("sketch_keys").to_pylist() == [[1, 32767], [], [-32768, 3]]
    assert narrowed.column("sketch_counts").to_pylist() == [[5, 2**32 - 1], [], [1, 2]]
    # The frames the sink gets may be slices: the rows before the slice are not counted.
    narrowed, clamped = narrow_lists(table.slice(1, 2), SKETCH_TYPES)
    assert clamped == 1
    assert narrowed.column("sketch_keys").to_pylist() == [[], [-32768, 3]]
    assert narrowed.column("sketch_counts").to_pylist() == [[], [1, 2]]


def test_a_table_of_several_chunks_keeps_them() -> None:
    first = sketches([[1], [2, 3]], [[1], [1, 1]])
    table = pa.concat_tables([first, first.slice(1)])
    narrowed, clamped = narrow_lists(table, SKETCH_TYPES)
    assert clamped == 0 and narrowed.column("sketch_keys").num_chunks == 2
    assert narrowed.column("sketch_keys").to_pylist() == [[1], [2, 3], [2, 3]]
