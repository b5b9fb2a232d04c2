"""Decoding a summary batch's function table once per distinct table, not once per message.

Every rank sends, window after window, a :class:`SummaryBatch` whose ``layers``, ``names`` and
``callpaths`` are the same lists (and ranks of one job mostly the same ones). Decoding them is
most of a batch's decode: about 110 Python strings per message, 9 µs of the 14 µs msgspec
spends on a 60-function batch here. The stream job's decoder therefore reads those three fields
as raw msgpack (:class:`msgspec.Raw`, no object made) and looks the table up by its bytes; a
table seen before is the same three lists, whose strings already carry their hashes, so the
validator's and the window engine's look-ups by table cost less as well.

The wire format does not change: producers encode plain lists, and a batch decoded here equals
the one :class:`SummaryBatch`'s own decoder makes.
"""

from __future__ import annotations

from typing import Any

import msgspec

from trainscope.schemas.records import SummaryBatch

TABLE_FIELDS = ("layers", "names", "callpaths")

# A bound on the tables remembered (cleared when full: a producer that sends a new table with
# every message costs a decode, never memory).
_MAX_TABLES = 4096


def _wire_type() -> type[msgspec.Struct]:
    """SummaryBatch's fields, with the function table's as raw msgpack; same tag and names."""
    fields: list[tuple[Any, ...]] = []
    for info in msgspec.structs.fields(SummaryBatch):
        kind: Any = msgspec.Raw if info.name in TABLE_FIELDS else info.type
        default = () if info.default is msgspec.NODEFAULT else (info.default,)
        fields.append((info.name, kind, *default))
    config = SummaryBatch.__struct_config__
    return msgspec.defstruct("WireSummaryBatch", fields, tag=config.tag,
                             tag_field=config.tag_field, kw_only=True, frozen=True)


WireSummaryBatch = _wire_type()
_VALUE_FIELDS = tuple(f for f in SummaryBatch.__struct_fields__ if f not in TABLE_FIELDS)


class FunctionTables:
    """The function tables of the batches decoded lately, by their encoded bytes."""

    def __init__(self) -> None:
        self._tables: dict[tuple[bytes, bytes, bytes], tuple[list[str], list[str], list[int]]] = {}
        self._strings = msgspec.msgpack.Decoder(list[str])
        self._ints = msgspec.msgpack.Decoder(list[int])

    def batch(self, wire: Any, index: int) -> SummaryBatch:
        """The :class:`SummaryBatch` of ``wire`` (a :data:`WireSummaryBatch` that was record
        ``index`` of its message); raises :class:`msgspec.ValidationError` naming the path."""
        key = (bytes(wire.layers), bytes(wire.names), bytes(wire.callpaths))
        table = self._tables.get(key)
        if table is None:
            table = self._decode(key, index)
            if len(self._tables) >= _MAX_TABLES:
                self._tables.clear()
            self._tables[key] = table
        values = {name: getattr(wire, name) for name in _VALUE_FIELDS}
        try:
            return SummaryBatch(layers=table[0], names=table[1], callpaths=table[2], **values)
        except ValueError as exc:  # the struct's own checks, as msgspec reports them
            raise msgspec.ValidationError(_at(str(exc), f"$.records[{index}]")) from None

    def _decode(self, key: tuple[bytes, bytes, bytes], index: int
                ) -> tuple[list[str], list[str], list[int]]:
        decoders = (self._strings, self._strings, self._ints)
        decoded = []
        for name, raw, decoder in zip(TABLE_FIELDS, key, decoders, strict=True):
            try:
                decoded.append(decoder.decode(raw))
            except msgspec.ValidationError as exc:
                raise msgspec.ValidationError(_at(str(exc), f"$.records[{index}].{name}")) \
                    from None
        return decoded[0], decoded[1], decoded[2]


def _at(text: str, path: str) -> str:
    """msgspec's text with the path made the message's: within a list it says "at `$[3]`"."""
    if "`$" in text:
        return text.replace("`$", f"`{path}", 1)
    return f"{text} - at `{path}`"
