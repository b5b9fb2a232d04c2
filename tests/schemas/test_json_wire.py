"""The JSON wire format (what the PyFlink job reads) carries the same records as msgpack."""

from __future__ import annotations

import json

import numpy as np
import pytest
from record_samples import sample_records

from trainscope.engine.embedded_job import EmbeddedStreamJob
from trainscope.schemas import (
    BadMessage,
    SpanBatch,
    StepRecord,
)
from trainscope.schemas.codec import decode_envelope, default_wire, encode_batch


def kinds_first(records: list) -> list:
    """JSON messages group span batches, then step records, then the rest."""
    rank = {SpanBatch: 0, StepRecord: 1}
    return sorted(records, key=lambda r: rank.get(type(r), 2))


def test_every_record_kind_round_trips_through_json() -> None:
    records = sample_records()
    payload = encode_batch(records, wire="json")
    assert payload.startswith(b'{"type":"batch"')
    batch = decode_envelope(payload)
    assert batch.records == kinds_first(records)
    assert batch.producer_id != 0 and batch.seq > 0  # stamped like msgpack batches


def test_span_events_travel_as_arrays_with_the_earliest_start() -> None:
    batch = SpanBatch.from_arrays(
        job_id="j", layers=["torch_op"], names=["mm"], rank=[0, 1], fn=[0, 0], step=[1, 1],
        start_ns=[5_000_000_123, 4_000_000_999], duration_ns=[7, 9],
        callpath_id=[2**64 - 1, 3],  # the full unsigned range survives
    )
    message = json.loads(encode_batch([batch], wire="json"))
    assert message["t_ms"] == 4000
    assert message["spans"][0]["events"] == [[0, 0, 1, 5_000_000_123, 7, 0, -1],
                                             [1, 0, 1, 4_000_000_999, 9, 0, 3]]
    back = decode_envelope(encode_batch([batch], wire="json")).records[0]
    assert back == batch and back.column("callpath_id")[0] == np.uint64(2**64 - 1)


def test_one_record_is_a_message_too() -> None:
    """What the Flink job writes to the summaries topic: one JSON record per message."""
    step = sample_records()[2]
    payload = json.dumps({"type": "step", "v": 1, "job_id": "j", "rank": 1, "step": 3,
                          "start_ns": 1, "duration_ns": 2, "tokens": 4096}).encode()
    batch = decode_envelope(payload)
    assert batch.records == [step] and batch.producer_id == 0  # never taken for a re-send


@pytest.mark.parametrize(("payload", "error"), [
    (b"{not json", "not a JSON batch"),
    (b'{"type": "batch", "spans": [{"job_id": "j", "layers": ["a"], "names": ["b"], '
     b'"events": [[0, 0, 0, 1, 1, 0]]}]}', r"spans\[0\]\.events must be arrays of 7"),
    (b'{"type": "batch", "spans": [{"job_id": "j", "layers": ["a"], "names": ["b"], '
     b'"events": [[0, 0, 0, 1, 1, 0, 0], [0, 0]]}]}', r"spans\[0\]\.events must be"),
    (b'{"type": "batch", "spans": [{"job_id": "j", "layers": ["a"], "names": ["b"], '
     b'"events": [[4294967296, 0, 0, 1, 1, 0, 0]]}]}', r"a rank is out of range for int32"),
    (b'{"type": "batch", "spans": [{"job_id": "j", "layers": ["a"], "names": ["b"], '
     b'"events": [[0, 3, 0, 1, 1, 0, 0]]}]}', r"fn index 3 out of range"),
    (b'{"type": "step", "job_id": "j", "rank": "seven"}', r"\$\.rank"),
    (b'{"type": "nope"}', "nope"),
    (b'{"type": "batch", "v": 99}', "newer"),
])
def test_bad_json_is_a_bad_message_naming_the_problem(payload: bytes, error: str) -> None:
    with pytest.raises(BadMessage, match=error):
        decode_envelope(payload)


def test_wire_comes_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("TRAINSCOPE_WIRE", raising=False)
    assert default_wire() == "msgpack"
    monkeypatch.setenv("TRAINSCOPE_WIRE", "JSON")
    assert default_wire() == "json"
    assert encode_batch(sample_records()).startswith(b"{")
    monkeypatch.setenv("TRAINSCOPE_WIRE", "avro")
    with pytest.raises(ValueError, match="TRAINSCOPE_WIRE='avro' is not a wire format"):
        encode_batch(sample_records())


def test_the_embedded_pipeline_windows_json_like_msgpack() -> None:
    from trainscope.producers.simulate import ClusterSpec, SimulatedCluster
    from trainscope.transport.bus import Message

    def run(wire: str):
        spec = ClusterSpec(job_id="j", dp=2, pp=2, tp=1, steps=40, seed=3,
                           start_ns=1767225600 * 10**9, send="spans")
        cluster = SimulatedCluster(spec, [])
        views = []
        pipeline = EmbeddedStreamJob(detectors=[], on_window=lambda v, _: views.append(v))
        for offset, output in enumerate(cluster.run()):
            records = [*output.spans, *output.steps]
            if output.step == 0:
                records = cluster.topology_records() + records
            message = Message("trainscope.events", 0, offset, None,
                              encode_batch(records, wire=wire))
            pipeline.process_messages([message])
        pipeline.finish()
        return pipeline, views

    msgpack, msgpack_views = run("msgpack")
    json_, json_views = run("json")
    assert json_.stats().decode.rejected == 0
    assert json_.windows == msgpack.windows > 0
    assert json_.stats().window.received == msgpack.stats().window.received
    for ours, theirs in zip(msgpack_views, json_views, strict=True):
        assert ours.summaries.equals(theirs.summaries)
        assert ours.steps.equals(theirs.steps)
