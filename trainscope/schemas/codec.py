"""The wire format: one bus message is a msgpack-encoded :class:`Batch` of records.

Every batch is stamped with its producer's id and a sequence number at encoding, so a batch that
a producer re-sends (after a timeout it cannot tell from a loss) carries the same stamp and the
pipeline drops the copy. ``producer_id`` 0 means unstamped (older producers): never deduplicated.

Decoding validates every field against the structs; a malformed message raises
:class:`BadMessage` whose text names the field path and the offending value, so a dead-letter
entry says exactly what was wrong. No other exception escapes :func:`decode_batch`, whatever the
bytes. Value checks that types cannot express (ranges, finite numbers, bounded strings) live in
:mod:`trainscope.schemas.validate`.

Producers may send the JSON form instead (:mod:`trainscope.schemas.json_wire`, which Flink reads
natively): ``TRAINSCOPE_WIRE=json`` in the producer's environment, or ``wire="json"``.
:func:`decode_envelope` takes either, by the first byte.
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
from collections.abc import Iterable
from typing import Any, Union

import msgspec

from trainscope.schemas.errors import TrainscopeError
from trainscope.schemas.function_tables import FunctionTables, WireSummaryBatch
from trainscope.schemas.json_wire import JSON_WIRE, WIRES, decode_json, encode_json_batch
from trainscope.schemas.records import RECORD_TYPES, SCHEMA_VERSION, Record, SummaryBatch


class Batch(msgspec.Struct, kw_only=True):
    """The envelope of one bus message."""

    v: int = SCHEMA_VERSION
    records: list[Record]
    producer_id: int = 0
    seq: int = 0


class BadMessage(ValueError, TrainscopeError):
    """A bus message that cannot be decoded; the text names the field and value."""


# Every record kind, a summary batch in its wire form.
_WireRecord = Union[tuple(WireSummaryBatch if t is SummaryBatch else t  # noqa: UP007
                          for t in RECORD_TYPES)]  # type: ignore[valid-type]


class _WireBatch(msgspec.Struct, kw_only=True):
    """What :class:`Batch` decodes from, a summary batch's function table left encoded
    (:mod:`trainscope.schemas.function_tables`)."""

    v: int = SCHEMA_VERSION
    records: list[_WireRecord]
    producer_id: int = 0
    seq: int = 0


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_WireBatch)
_tables = FunctionTables()
_PATH = re.compile(r"`(\$[^`]*)`")
_STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")


class _Stamp:
    """This process's producer id and batch counter; a forked child gets an id of its own."""

    def __init__(self) -> None:
        self.renew()
        os.register_at_fork(after_in_child=self.renew)

    def renew(self) -> None:
        self.producer_id = secrets.randbits(63) | 1  # never 0
        self.seq = itertools.count(1)


_stamp = _Stamp()


# Read here rather than through trainscope.config.settings (a layer above the schemas): every
# producer encodes through this function, and the wire must not depend on which one it is.
_WIRE_VARIABLE = "TRAINSCOPE_WIRE"


def default_wire() -> str:
    """``msgpack`` unless ``TRAINSCOPE_WIRE`` names another wire; an unknown name raises."""
    wire = os.environ.get(_WIRE_VARIABLE, "").strip().lower() or WIRES[0]
    if wire not in WIRES:
        raise ValueError(
            f"{_WIRE_VARIABLE}={wire!r} is not a wire format; known: {', '.join(WIRES)}"
        )
    return wire


def encode_batch(records: Iterable[Record], wire: str | None = None) -> bytes:
    """One bus message, stamped with this process's producer id and its next sequence."""
    return encode_stamped(records, _stamp.producer_id, next(_stamp.seq), wire)


def encode_stamped(
    records: Iterable[Record], producer_id: int, seq: int, wire: str | None = None
) -> bytes:
    """One bus message with the given stamp: for a sender that stands for many producers (a
    benchmark or test playing one producer per rank)."""
    wire = default_wire() if wire is None else wire
    if wire == JSON_WIRE:
        return encode_json_batch(list(records), producer_id, seq)
    return _encoder.encode(Batch(records=list(records), producer_id=producer_id, seq=seq))


def decode_batch(payload: bytes) -> list[Record]:
    return decode_envelope(payload).records


def decode_envelope(payload: bytes) -> Batch:
    """The whole envelope, with the producer stamp, for consumers that deduplicate."""
    if payload[:1] == b"{":
        return _decode_json_envelope(payload)
    try:
        wire = _decoder.decode(payload)
        records = wire.records
        for i, record in enumerate(records):
            if type(record) is WireSummaryBatch:
                records[i] = _tables.batch(record, i)
    except msgspec.ValidationError as exc:
        raise BadMessage(_describe(exc, payload)) from None
    except msgspec.DecodeError as exc:
        raise BadMessage(f"not a msgpack batch ({len(payload)} bytes): {exc}") from None
    except Exception as exc:  # e.g. UnicodeDecodeError for a string that is not UTF-8
        raise BadMessage(
            f"not a msgpack batch ({len(payload)} bytes): {type(exc).__name__}: {exc}"
        ) from None
    if wire.v > SCHEMA_VERSION:
        raise BadMessage(f"batch schema version {wire.v} is newer than {SCHEMA_VERSION}")
    return Batch(v=wire.v, records=records, producer_id=wire.producer_id, seq=wire.seq)


def _decode_json_envelope(payload: bytes) -> Batch:
    try:
        records, producer_id, seq, version = decode_json(payload)
    except msgspec.ValidationError as exc:
        raise BadMessage(f"JSON message ({len(payload)} bytes): {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadMessage(f"not a JSON batch ({len(payload)} bytes): {exc}") from None
    except Exception as exc:  # a column of the wrong length, a value out of range
        raise BadMessage(
            f"JSON message ({len(payload)} bytes): {type(exc).__name__}: {exc}"
        ) from None
    if version > SCHEMA_VERSION:
        raise BadMessage(f"batch schema version {version} is newer than {SCHEMA_VERSION}")
    return Batch(records=records, producer_id=producer_id, seq=seq)


def _describe(exc: msgspec.ValidationError, payload: bytes) -> str:
    """msgspec names the path (`$.records[3].rank`); add the value found there."""
    text = str(exc)
    match = _PATH.search(text)
    if not match:
        return text
    try:
        value = _walk(msgspec.msgpack.decode(payload), match.group(1))
    except Exception:  # the path is a hint; the message is bad either way
        return text
    return f"{text} (value: {_short(value)})"


def _walk(node: Any, path: str) -> Any:
    for field, index in _STEP.findall(path[1:]):
        node = node[field] if field else node[int(index)]
    return node


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
