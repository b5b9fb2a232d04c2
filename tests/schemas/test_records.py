"""Records, the wire codec and the JSON Schema export."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest
from record_samples import sample_records

from trainscope.schemas import (
    BadMessage,
    Finding,
    SpanBatch,
    decode_batch,
    encode_batch,
)
from trainscope.schemas.jsonschema import export


def test_every_record_kind_round_trips() -> None:
    records = sample_records()
    assert decode_batch(encode_batch(records)) == records


def test_span_batch_round_trips_events() -> None:
    batch = sample_records()[1]
    events = batch.to_events()
    assert [e.rank for e in events] == [0, 1, 2, 3]
    assert SpanBatch.from_events(events, host="h") == batch
    assert batch.column("duration_ns").tolist() == [5, 6, 7, 8]


def test_decode_error_names_field_and_value() -> None:
    payload = msgspec.msgpack.encode(
        {"records": [{"type": "step", "job_id": "j", "rank": "seven", "step": 0,
                      "start_ns": 0, "duration_ns": 1}]}
    )
    with pytest.raises(BadMessage, match=r"\$\.records\[0\]\.rank.*'seven'"):
        decode_batch(payload)


def test_garbage_and_unknown_kind_are_bad_messages() -> None:
    with pytest.raises(BadMessage, match="not a msgpack batch"):
        decode_batch(b"\xc1\x00garbage")
    payload = msgspec.msgpack.encode({"records": [{"type": "nope"}]})
    with pytest.raises(BadMessage, match="nope"):
        decode_batch(payload)


def test_span_batch_rejects_inconsistent_columns() -> None:
    good = sample_records()[1]
    with pytest.raises(ValueError, match="column start_ns holds 8 bytes"):
        msgspec.structs.replace(good, start_ns=b"\x00" * 8)
    with pytest.raises(ValueError, match="fn index 3 out of range"):
        msgspec.structs.replace(good, fn=np.array([0, 0, 0, 3], dtype="<i4").tobytes())


def test_finding_rejects_unknown_category() -> None:
    with pytest.raises(ValueError, match="unknown category 'slow'"):
        Finding(job_id="j", window_start_ns=0, window_end_ns=1, detector="d",
                category="slow", score=1.0, message="m")


def test_json_schema_export_writes_valid_schemas(tmp_path) -> None:
    written = export(tmp_path / "schemas")
    names = {p.name for p in written}
    assert {"SpanBatch.schema.json", "Finding.schema.json", "Batch.schema.json"} <= names
    finding = json.loads((tmp_path / "schemas" / "Finding.schema.json").read_text())
    assert finding["title"] == "Finding"
    assert "category" in json.dumps(finding)


def test_json_schema_export_refuses_a_file(tmp_path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(NotADirectoryError):
        export(target)
