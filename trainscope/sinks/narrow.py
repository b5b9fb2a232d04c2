"""List columns cast to the store's narrower element types, saturated rather than wrapped.

The quantile sketches travel as 32-bit keys and 64-bit counts but are stored as ``Int16`` and
``UInt32`` (:mod:`trainscope.schemas.ddl`). ClickHouse converts a wider Arrow integer into a
narrower column by wrapping it around (40,000 becomes -25,536), so the sink casts first, in
Arrow: values within range as they are, any outside clamped to the type's bounds and counted.
Validation already rejects sketches outside these ranges on the wire; what could still reach
here is a count that many merged partials of one window summed past ``UInt32``.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

# function_summaries' sketch columns, element type as stored (kept equal to the DDL by a test).
SKETCH_TYPES: dict[str, pa.DataType] = {"sketch_keys": pa.int16(), "sketch_counts": pa.uint32()}


def narrow_lists(table: pa.Table, types: dict[str, pa.DataType]) -> tuple[pa.Table, int]:
    """``table`` with each of ``types``' list columns cast to that element type; returns it
    and how many elements were outside the type's range (clamped)."""
    clamped = 0
    for name, element in types.items():
        index = table.schema.get_field_index(name)
        if index < 0:
            continue
        chunks = []
        for chunk in table.column(index).chunks:
            if chunk.null_count:  # the store's arrays are not nullable: a null is stored empty
                chunk = chunk.fill_null(pa.scalar([], chunk.type))
            # A sliced chunk's offsets point into its parent's values: rebase them on the
            # values this chunk holds, so only those are cast and counted.
            offsets = chunk.offsets
            if offsets[0].as_py():
                offsets = pc.subtract(offsets, offsets[0])
            values, outside = _narrowed(chunk.flatten(), element)
            clamped += outside
            list_type = pa.large_list(element) if pa.types.is_large_list(chunk.type) \
                else pa.list_(element)
            chunks.append(type(chunk).from_arrays(offsets, values, type=list_type))
        table = table.set_column(index, name, pa.chunked_array(chunks, chunks[0].type)
                                 if chunks else table.column(index).cast(pa.large_list(element)))
    return table, clamped


def _narrowed(values: pa.Array, element: pa.DataType) -> tuple[pa.Array, int]:
    if len(values) == 0:
        return values.cast(element), 0
    info = np.iinfo(element.to_pandas_dtype())
    low, high = pc.min_max(values).values()
    if low.as_py() >= info.min and high.as_py() <= info.max:
        return values.cast(element), 0
    outside = pc.sum(pc.or_(pc.less(values, info.min), pc.greater(values, info.max))).as_py()
    clamped = values
    if low.as_py() < info.min:
        clamped = pc.max_element_wise(clamped, info.min)
    if high.as_py() > info.max:
        clamped = pc.min_element_wise(clamped, info.max)
    return clamped.cast(element), int(outside)
