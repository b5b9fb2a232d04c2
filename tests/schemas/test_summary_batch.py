"""The columnar SummaryBatch: round trips, validation, and agreement with row summaries."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest

from trainscope.schemas import (
    BadMessage,
    FunctionSummary,
    SummaryBatch,
    decode_batch,
    encode_batch,
    summaries,
)
from trainscope.schemas.jsonschema import export


def rows() -> list[FunctionSummary]:
    rng = np.random.default_rng(3)
    out = []
    for rank in range(3):
        for name in ("forward", "backward"):
            durations = rng.integers(1_000, 50_000, 20 + rank)
            out.append(summaries.summarize(
                durations, job_id="j", rank=rank, layer="torch_op", name=name,
                window_start_ns=0, window_end_ns=10, bytes_moved=[rank * 7],
                callpath_id=11 if name == "forward" else 0,
            ))
    return out


def test_row_summaries_round_trip_through_a_batch_and_the_codec() -> None:
    original = rows()
    batch = SummaryBatch.from_summaries(original, host="h")
    assert len(batch) == len(original)
    assert sorted(zip(batch.layers, batch.names, batch.callpaths, strict=True)) == [
        ("torch_op", "backward", 0), ("torch_op", "forward", 11)]
    (decoded,) = decode_batch(encode_batch([batch]))
    assert decoded == batch
    assert decoded.to_summaries() == original


def test_summary_batches_from_durations_match_row_summaries() -> None:
    rng = np.random.default_rng(5)
    durations = {("torch_op", f"op{i}", i): rng.integers(1, 10**7, 1 + 13 * i) for i in range(9)}
    moved = {("torch_op", "op3", 3): 4096}
    made = summaries.summary_batches(durations, job_id="j", rank=4, window_start_ns=100,
                                     window_end_ns=200, bytes_total=moved, max_rows=4)
    assert [len(b) for b in made] == [4, 4, 1]  # split to bound the message size
    got = {(s.layer, s.name, s.callpath_id): s for b in made for s in b.to_summaries()}
    for key, values in durations.items():
        expected = summaries.summarize(values, job_id="j", rank=4, layer=key[0], name=key[1],
                                       callpath_id=key[2], window_start_ns=100,
                                       window_end_ns=200, bytes_moved=[moved.get(key, 0)])
        s = got[key]
        assert (s.count, s.total_ns, s.min_ns, s.max_ns, s.bytes_total) == (
            expected.count, expected.total_ns, expected.min_ns, expected.max_ns,
            expected.bytes_total)
        assert s.m2_ns2 == pytest.approx(expected.m2_ns2, rel=1e-9)
        assert (s.sketch_keys, s.sketch_counts) == (expected.sketch_keys, expected.sketch_counts)


def test_a_batch_holds_one_job_and_one_window() -> None:
    first, second = rows()[:2]
    with pytest.raises(ValueError, match="two jobs or windows"):
        SummaryBatch.from_summaries([first, msgspec.structs.replace(second, window_end_ns=20)])


def test_inconsistent_batches_are_rejected_naming_the_column() -> None:
    good = SummaryBatch.from_summaries(rows())
    with pytest.raises(ValueError, match="column total_ns holds 8 bytes, expected 48"):
        msgspec.structs.replace(good, total_ns=b"\x00" * 8)
    with pytest.raises(ValueError, match="fn index 2 out of range for 2 functions"):
        msgspec.structs.replace(good, fn=np.array([0, 1, 0, 1, 0, 2], "<i4").tobytes())
    offsets = good.column("sketch_offsets").copy()
    offsets[2], offsets[3] = offsets[3], offsets[2]
    with pytest.raises(ValueError, match="sketch_offsets must rise"):
        msgspec.structs.replace(good, sketch_offsets=offsets.tobytes())
    with pytest.raises(ValueError, match="one entry per function"):
        msgspec.structs.replace(good, callpaths=[0])
    with pytest.raises(ValueError, match="window_end_ns 0 is not after"):
        msgspec.structs.replace(good, window_end_ns=0)


def test_a_malformed_batch_on_the_wire_names_the_field() -> None:
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(SummaryBatch.from_summaries(rows())))
    raw["count"] = "many"
    with pytest.raises(BadMessage, match=r"\$\.records\[0\]\.count.*'many'"):
        decode_batch(msgspec.msgpack.encode({"records": [raw]}))
    raw["count"] = b"\x01" * 8  # valid bytes, wrong length: the struct's own check
    with pytest.raises(BadMessage, match=r"column count holds 8 bytes.*records\[0\]"):
        decode_batch(msgspec.msgpack.encode({"records": [raw]}))


def test_json_schema_describes_the_batch(tmp_path) -> None:
    export(tmp_path)
    schema = json.loads((tmp_path / "SummaryBatch.schema.json").read_text())
    props = schema["$defs"]["SummaryBatch"]["properties"]
    assert props["type"]["enum"] == ["summaries"]
    assert {"sketch_offsets", "callpaths", "window_start_ns"} <= set(props)
    assert "SummaryBatch" in (tmp_path / "Batch.schema.json").read_text()
