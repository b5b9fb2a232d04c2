"""A summary batch's function table decoded once per distinct table: same batches, shared
lists, paths named in errors, a bounded memory."""

from __future__ import annotations

import msgspec
import pytest

from trainscope.schemas import BadMessage, SummaryBatch, decode_batch, encode_batch, function_tables
from trainscope.schemas.function_tables import FunctionTables, WireSummaryBatch


def batch(rank: int, names: list[str], callpaths: list[int] | None = None) -> SummaryBatch:
    n = len(names)
    return SummaryBatch.from_arrays(
        job_id="j", host=f"h{rank}", window_start_ns=10**18, window_end_ns=10**18 + 15,
        layers=["torch_op"] * n, names=names, callpaths=callpaths,
        rank=[rank] * n, fn=list(range(n)), count=[1 + i for i in range(n)],
        total_ns=[100 * (i + 1) for i in range(n)], min_ns=[100] * n, max_ns=[100] * n,
        sketch_offsets=list(range(n + 1)), sketch_keys=[7] * n, sketch_counts=[1] * n,
    )


def test_batches_decode_as_the_struct_does_and_share_a_repeated_table() -> None:
    sent = [batch(0, ["forward", "backward"]), batch(1, ["forward", "backward"]),
            batch(2, ["forward", "backward"], callpaths=[3, 4]), batch(3, ["optimizer"])]
    got = [decode_batch(encode_batch([b]))[0] for b in sent]
    plain = msgspec.msgpack.Decoder(SummaryBatch)
    for b, g in zip(sent, got, strict=True):
        assert g == plain.decode(msgspec.msgpack.encode(b)) == b
        assert type(g) is SummaryBatch
    # The second message's table is the first's lists; another table (call paths differ) is not.
    assert got[1].names is got[0].names and got[1].layers is got[0].layers
    assert got[1].callpaths is got[0].callpaths
    assert got[2].names is not got[0].names and got[2].callpaths == [3, 4]
    assert got[3].names == ["optimizer"]


def test_a_bad_table_names_the_record_and_the_element() -> None:
    good = msgspec.msgpack.decode(msgspec.msgpack.encode(batch(0, ["a", "b", "c"])))
    bad_name = dict(good, names=["a", "b", 5])
    with pytest.raises(BadMessage, match=r"Expected `str`, got `int` - at `\$\.records\[1\]\."
                                          r"names\[2\]`"):
        decode_batch(msgspec.msgpack.encode({"records": [good, bad_name]}))
    not_a_list = dict(good, layers="torch_op")
    with pytest.raises(BadMessage, match=r"Expected `array`, got `str` - at `\$\.records\[0\]"
                                          r"\.layers`"):
        decode_batch(msgspec.msgpack.encode({"records": [not_a_list]}))
    short = dict(good, callpaths=[0])  # the struct's own check, after the table's decode
    with pytest.raises(BadMessage, match=r"one entry per function.*records\[0\]"):
        decode_batch(msgspec.msgpack.encode({"records": [short]}))


def test_the_tables_remembered_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(function_tables, "_MAX_TABLES", 8)
    tables = FunctionTables()
    wire = msgspec.msgpack.Decoder(WireSummaryBatch)
    for i in range(50):
        sent = batch(0, [f"f{i}", "g"])
        got = tables.batch(wire.decode(msgspec.msgpack.encode(sent)), 0)
        assert got == sent
        assert len(tables._tables) <= 8
