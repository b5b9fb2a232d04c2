"""The JSON wire format: the same :class:`~trainscope.schemas.codec.Batch` of records, in a form
that Flink's built-in ``json`` format decodes without any Python (see
:mod:`trainscope.streams.flink`).

Producers send it when ``TRAINSCOPE_WIRE=json`` (msgpack stays the default: it is smaller and
decodes ~5x faster in Python); every consumer accepts both, told apart by the first byte
(``{`` never starts a msgpack batch, which is a fixmap/map). One message::

    {"type": "batch", "v": 1, "producer_id": 7, "seq": 3, "t_ms": 1767225600123,
     "spans": [{"job_id": …, "host": …, "layers": [...], "names": [...],
                "rank": [...], "fn": [...], "step": [...], "start_ns": [...],
                "duration_ns": [...], "bytes_moved": [...], "callpath_id": [...]}],
     "steps": [{"type": "step", "job_id": …, "rank": 3, "step": 17, …}],
     "records": [{"type": "topology", …}, …]}

Span batches stay columnar (one JSON array per column, so Flink unnests them in SQL), step
records travel as their own rows (Flink windows them too), and every other record is its
msgspec JSON form in ``records`` (Flink passes those on unchanged). ``t_ms`` is the earliest
event time in the message (ms since the epoch): the Flink job's watermarks are defined on it.

A single record (``{"type": "summary", …}``, ``{"type": "step", …}``) is also a message: it is
what the Flink job writes to the summaries topic.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from trainscope.schemas.records import (
    SCHEMA_VERSION,
    SPAN_COLUMNS,
    Record,
    SpanBatch,
    StepRecord,
)

JSON_WIRE = "json"
MSGPACK_WIRE = "msgpack"
WIRES = (MSGPACK_WIRE, JSON_WIRE)


class SpanColumns(msgspec.Struct, kw_only=True):
    """A :class:`SpanBatch` with JSON arrays for columns."""

    job_id: str
    host: str = ""
    layers: list[str]
    names: list[str]
    rank: list[int]
    fn: list[int]
    step: list[int]
    start_ns: list[int]
    duration_ns: list[int]
    bytes_moved: list[int] = []
    callpath_id: list[int] = []


class JsonBatch(msgspec.Struct, tag="batch", kw_only=True):
    v: int = SCHEMA_VERSION
    producer_id: int = 0
    seq: int = 0
    t_ms: int = 0
    spans: list[SpanColumns] = []
    steps: list[StepRecord] = []
    records: list[Record] = []


_encoder = msgspec.json.Encoder()
# A batch or one record: every member of the union is tagged by "type".
_decoder = msgspec.json.Decoder(JsonBatch | Record)  # type: ignore[arg-type]


def encode_json_batch(records: list[Record], producer_id: int = 0, seq: int = 0) -> bytes:
    spans: list[SpanColumns] = []
    steps: list[StepRecord] = []
    rest: list[Record] = []
    earliest_ns: int | None = None
    for record in records:
        if isinstance(record, SpanBatch):
            columns = {name: record.column(name).tolist() for name in SPAN_COLUMNS}
            if not record.bytes_moved:
                columns["bytes_moved"] = []
            if not record.callpath_id:
                columns["callpath_id"] = []
            spans.append(SpanColumns(job_id=record.job_id, host=record.host,
                                     layers=record.layers, names=record.names, **columns))
            if len(record):
                first = int(record.column("start_ns").min())
                earliest_ns = first if earliest_ns is None else min(earliest_ns, first)
        elif isinstance(record, StepRecord):
            steps.append(record)
            earliest_ns = (record.start_ns if earliest_ns is None
                           else min(earliest_ns, record.start_ns))
        else:
            rest.append(record)
    return _encoder.encode(JsonBatch(
        producer_id=producer_id, seq=seq, t_ms=(earliest_ns or 0) // 1_000_000,
        spans=spans, steps=steps, records=rest,
    ))


def decode_json(payload: bytes) -> tuple[list[Record], int, int, int]:
    """(records, producer id, sequence, schema version) of a JSON message; raises
    ``msgspec.ValidationError``/``DecodeError`` or ``ValueError`` (a column of the wrong
    length) on a bad one, which the codec turns into ``BadMessage``."""
    decoded: Any = _decoder.decode(payload)
    if not isinstance(decoded, JsonBatch):
        return [decoded], 0, 0, getattr(decoded, "v", SCHEMA_VERSION)
    records: list[Record] = []
    for i, span in enumerate(decoded.spans):
        n = len(span.rank)
        columns: dict[str, Any] = {}
        for name, dtype in SPAN_COLUMNS.items():
            values = getattr(span, name)
            if name in ("bytes_moved", "callpath_id") and not values:
                continue
            if len(values) != n:
                raise ValueError(
                    f"spans[{i}].{name} has {len(values)} values, rank has {n}"
                )
            try:  # numpy refuses a value outside the column's type
                columns[name] = np.asarray(values, dtype=dtype)
            except (OverflowError, TypeError, ValueError) as exc:
                raise ValueError(f"spans[{i}].{name}: {exc} (column type {dtype})") from None
        records.append(SpanBatch.from_arrays(job_id=span.job_id, host=span.host,
                                             layers=span.layers, names=span.names, **columns))
    records += decoded.steps
    records += decoded.records
    return records, decoded.producer_id, decoded.seq, decoded.v
