"""The JSON wire format: the same :class:`~trainscope.schemas.codec.Batch` of records, in a form
that Flink's built-in ``json`` format decodes without any Python (see
:mod:`trainscope.engines.flink`).

Producers send it when ``TRAINSCOPE_WIRE=json`` (msgpack stays the default: it is smaller and
decodes ~5x faster in Python); every consumer accepts both, told apart by the first byte
(``{`` never starts a msgpack batch, which is a fixmap/map). One message::

    {"type": "batch", "v": 1, "producer_id": 7, "seq": 3, "t_ms": 1767225600123,
     "spans": [{"job_id": …, "host": …, "layers": [...], "names": [...],
                "events": [[rank, fn, step, start_ns, duration_ns, bytes_moved,
                            callpath_id], …]}],
     "steps": [{"type": "step", "job_id": …, "rank": 3, "step": 17, …}],
     "records": [{"type": "topology", …}, …]}

Span events travel as one short array of integers each (``SPAN_EVENT_FIELDS``; ``callpath_id``
as the signed 64-bit integer of the same bits), so Flink unnests them in SQL and reads each
event's fields from its own seven-element array: with one array per column instead, each
event's field lookups went through whole columns, which Flink copies on every access (the job
ran 3x slower). Step records travel as their own rows (Flink windows them too; a
:class:`StepBatch` is sent as its rows, a :class:`MetricBatch` as its samples), and every other
record is its msgspec JSON form in ``records`` (Flink passes those on unchanged). ``t_ms`` is the
earliest event time in the message (ms since the epoch): the Flink job's watermarks are defined
on it.

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
    MetricBatch,
    Record,
    SpanBatch,
    StepBatch,
    StepRecord,
)

JSON_WIRE = "json"
MSGPACK_WIRE = "msgpack"
WIRES = (MSGPACK_WIRE, JSON_WIRE)


# The fields of one span event in ``SpanRows.events``, in order.
SPAN_EVENT_FIELDS = ("rank", "fn", "step", "start_ns", "duration_ns", "bytes_moved",
                     "callpath_id")


class SpanRows(msgspec.Struct, kw_only=True):
    """A :class:`SpanBatch` with one integer array per event (``SPAN_EVENT_FIELDS``)."""

    job_id: str
    host: str = ""
    layers: list[str]
    names: list[str]
    events: list[list[int]]


class JsonBatch(msgspec.Struct, tag="batch", kw_only=True):
    v: int = SCHEMA_VERSION
    producer_id: int = 0
    seq: int = 0
    t_ms: int = 0
    spans: list[SpanRows] = []
    steps: list[StepRecord] = []
    records: list[Record] = []


_encoder = msgspec.json.Encoder()
# A batch or one record: every member of the union is tagged by "type".
_decoder = msgspec.json.Decoder(JsonBatch | Record)  # type: ignore[arg-type]


def encode_json_batch(records: list[Record], producer_id: int = 0, seq: int = 0) -> bytes:
    spans: list[SpanRows] = []
    steps: list[StepRecord] = []
    rest: list[Record] = []
    earliest_ns: int | None = None
    for record in records:
        if isinstance(record, SpanBatch):
            table = np.empty((len(record), len(SPAN_EVENT_FIELDS)), dtype=np.int64)
            for i, name in enumerate(SPAN_EVENT_FIELDS):
                column = record.column(name)
                table[:, i] = column.view(np.int64) if column.dtype == np.uint64 else column
            spans.append(SpanRows(job_id=record.job_id, host=record.host,
                                  layers=record.layers, names=record.names,
                                  events=table.tolist()))
            if len(record):
                first = int(record.column("start_ns").min())
                earliest_ns = first if earliest_ns is None else min(earliest_ns, first)
        elif isinstance(record, StepRecord | StepBatch):
            # Flink windows step records as rows of their own: a batch travels as its rows.
            rows = record.to_records() if isinstance(record, StepBatch) else [record]
            steps += rows
            for row in rows:
                earliest_ns = (row.start_ns if earliest_ns is None
                               else min(earliest_ns, row.start_ns))
        elif isinstance(record, MetricBatch):
            rest += record.to_records()  # Flink passes metric samples on as rows
        else:
            rest.append(record)
    return _encoder.encode(JsonBatch(
        producer_id=producer_id, seq=seq, t_ms=(earliest_ns or 0) // 1_000_000,
        spans=spans, steps=steps, records=rest,
    ))


def decode_json(payload: bytes) -> tuple[list[Record], int, int, int]:
    """(records, producer id, sequence, schema version) of a JSON message; raises
    ``msgspec.ValidationError``/``DecodeError`` or ``ValueError`` (an event of the wrong
    width, a value out of range) on a bad one, which the codec turns into ``BadMessage``."""
    decoded: Any = _decoder.decode(payload)
    if not isinstance(decoded, JsonBatch):
        return [decoded], 0, 0, getattr(decoded, "v", SCHEMA_VERSION)
    records: list[Record] = []
    for i, span in enumerate(decoded.spans):
        records.append(_span_batch(i, span))
    records += decoded.steps
    records += decoded.records
    return records, decoded.producer_id, decoded.seq, decoded.v


def _span_batch(i: int, span: SpanRows) -> SpanBatch:
    width = len(SPAN_EVENT_FIELDS)
    try:
        table = np.asarray(span.events, dtype=np.int64)
    except (OverflowError, ValueError) as exc:
        table, problem = None, str(exc)
    else:
        problem = "" if table.shape[1:] == (width,) or not span.events else f"{table.shape}"
        table = table.reshape(-1, width) if not problem else None
    if table is None:
        raise ValueError(
            f"spans[{i}].events must be arrays of {width} 64-bit integers "
            f"({', '.join(SPAN_EVENT_FIELDS)}), got {problem}"
        )
    columns: dict[str, Any] = {}
    for k, name in enumerate(SPAN_EVENT_FIELDS):
        values = table[:, k]
        dtype = np.dtype(SPAN_COLUMNS[name])
        if dtype == np.uint64:
            values = values.view(np.uint64)
        elif dtype.itemsize < 8:
            info = np.iinfo(dtype)
            if len(values) and (values.min() < info.min or values.max() > info.max):
                raise ValueError(f"spans[{i}].events: a {name} is out of range for {dtype}")
        if name in ("bytes_moved", "callpath_id") and not values.any():
            continue  # all zero: sent empty, as a SpanBatch does
        columns[name] = values
    return SpanBatch.from_arrays(job_id=span.job_id, host=span.host, layers=span.layers,
                                 names=span.names, **columns)
