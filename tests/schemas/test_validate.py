"""Value checks on decoded records: every bad field is named, with its value and record index."""

from __future__ import annotations

import contextlib
import math
import re

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainscope.schemas.codec import BadMessage, decode_batch, encode_batch
from trainscope.schemas.records import (
    FunctionSummary,
    MetricSample,
    SpanBatch,
    SpanEvent,
    StepRecord,
    SummaryBatch,
    Topology,
    WorkerInfo,
)
from trainscope.schemas.validate import InvalidRecord, Limits, Validator

T0 = 1_767_225_600 * 10**9  # 2026-01-01
NOW = T0 + 86_400 * 10**9


def validator(**limits: int) -> Validator:
    return Validator(Limits(now_ns=lambda: NOW, **limits))


def batch(**columns: list[int]) -> SpanBatch:
    base = {"rank": [0, 1, 2], "fn": [0, 0, 0], "step": [0, 0, 0],
            "start_ns": [T0, T0 + 1, T0 + 2], "duration_ns": [5, 5, 5]}
    return SpanBatch.from_arrays(job_id="j", layers=["torch_op"], names=["forward"],
                                 **(base | columns))


def step(**fields: object) -> StepRecord:
    return StepRecord(**({"job_id": "j", "rank": 1, "step": 3, "start_ns": T0,
                          "duration_ns": 10**8} | fields))


def summary(**fields: object) -> FunctionSummary:
    return FunctionSummary(**({"job_id": "j", "rank": 1, "layer": "gc", "name": "gc.collect",
                               "window_start_ns": T0, "window_end_ns": T0 + 15 * 10**9,
                               "count": 2, "total_ns": 10, "min_ns": 4, "max_ns": 6} | fields))


def summaries(**columns: list) -> SummaryBatch:
    """Two rows of what producers send: one function on ranks 0 and 1."""
    base = {"rank": [0, 1], "fn": [0, 0], "count": [2, 2], "total_ns": [10, 12],
            "min_ns": [4, 5], "max_ns": [6, 7], "m2_ns2": [2.0, 2.0],
            "sketch_offsets": [0, 1, 2], "sketch_keys": [7, 8], "sketch_counts": [2, 2]}
    return SummaryBatch.from_arrays(job_id="j", window_start_ns=T0,
                                    window_end_ns=T0 + 15 * 10**9, layers=["gc"],
                                    names=["gc.collect"], **(base | columns))


def reason(records: list, v: Validator | None = None) -> str:
    with pytest.raises(InvalidRecord) as info:
        (v or validator()).validate(records)
    return str(info.value)


def test_valid_records_pass() -> None:
    topology = Topology(job_id="j", dp_size=4, workers=[WorkerInfo(rank=r, dp_rank=r)
                                                        for r in range(4)])
    metric = MetricSample(job_id="j", ts_ns=T0, name="sm_clock_mhz", value=1980.0)
    validator().validate([topology, batch(), step(), summary(), summaries(), metric])


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        (step(rank=2**40), "records[0] (step): rank=1099511627776 not in [0, 131071], no topology"),
        (step(rank=2**27), "rank=134217728 not in [0, 131071]"),
        (step(rank=-1), "rank=-1 not in [0, 131071]"),
        (step(start_ns=0), "start_ns=0 not in [946684800000000000, "),
        (step(start_ns=NOW + 2 * 86_400 * 10**9), "start_ns="),
        (step(duration_ns=-5), "duration_ns=-5 not in [0, "),
        (step(seq_len_mean=math.nan), "seq_len_mean=nan is not a finite number"),
        (MetricSample(job_id="j", ts_ns=T0, name="x", value=math.inf), "value=inf"),
        (MetricSample(job_id="", ts_ns=T0, name="x", value=1.0), "job_id is empty"),
        (MetricSample(job_id="j", ts_ns=T0, name="x" * 300, value=1.0),
         "name has 300 characters, more than 256"),
        (summary(total_ns=2**64 - 1), "total_ns=18446744073709551615 not in"),
        (summary(min_ns=9), "min_ns=9 is above max_ns=6"),
        (summary(m2_ns2=-1.0), "m2_ns2=-1.0 is not a finite number"),
        (summaries(rank=[0, 2**20]), "records[0] (summaries): rank[1]=1048576 not in [0, 131071]"),
        (summaries(min_ns=[4, 9]), "min_ns[1]=9 is above max_ns[1]=7"),
        (summaries(m2_ns2=[math.nan, 1.0]), "m2_ns2[0]=nan is not a finite number"),
        (summaries(total_ns=[-1, 1]), "total_ns[0]=-1 not in"),
        (summaries(count=[2, -1]), "count[1]=-1 not in [0, "),
        (summaries(sketch_counts=[2, -2]), "sketch_counts[1]=-2 not in"),
        # The store keeps sketches as Int16 keys and UInt32 counts (trainscope.schemas.ddl).
        (summaries(sketch_counts=[2, 2**32]), "sketch_counts[1]=4294967296 not in [0, 4294967295]"),
        (summaries(sketch_keys=[40_000, 8]), "sketch_keys[0]=40000 not in [-32768, 32767]"),
        (summary(sketch_keys=[7], sketch_counts=[2**32]),
         "sketch_counts[0]=4294967296 not in [0, 4294967295]"),
        (SummaryBatch.from_arrays(job_id="j", window_start_ns=0, window_end_ns=10,
                                  layers=["gc"], names=["gc.collect"], rank=[0], fn=[0],
                                  count=[1], total_ns=[1], min_ns=[1], max_ns=[1]),
         "window_start_ns=0 not in"),
        (batch(rank=[0, 2**31 - 1, 1]), "rank[1]=2147483647 not in [0, 131071]"),
        (batch(start_ns=[T0, 0, T0]), "start_ns[1]=0 not in"),
        (batch(duration_ns=[5, 5, -1]), "duration_ns[2]=-1 not in"),
        (SpanEvent(job_id="j", rank=0, layer="", name="f", start_ns=T0, duration_ns=1),
         "layer is empty"),
        (Topology(job_id="j", dp_size=2**40), "world size 1099511627776"),
        (Topology(job_id="j", dp_size=2, workers=[WorkerInfo(rank=5)]),
         "workers[0]: rank=5 not in [0, 1]"),
    ],
)
def test_each_bad_value_is_named(record: object, expected: str) -> None:
    assert expected in reason([record])


def test_ranks_are_bounded_by_the_topology_declared_before_them() -> None:
    v = validator()
    text = reason([Topology(job_id="j", dp_size=4), step(rank=4)], v)
    assert text.startswith("records[1] (step): rank=4 not in [0, 3], job 'j' declares a world "
                           "size of 4")
    # The rejected message declared nothing: the next message is checked without a topology.
    assert v.world_size("j") is None
    v.validate([Topology(job_id="j", dp_size=4)])
    assert v.world_size("j") == 4
    v = validator()
    v.validate([Topology(job_id="j", dp_size=2)])
    assert "rank[2]=2 not in [0, 1], job 'j' declares a world size of 2" in reason([batch()], v)


def test_a_record_of_the_wrong_python_type_is_rejected_not_raised() -> None:
    text = reason([step(rank="seven")])
    assert text.startswith("records[0] (step): ")


def test_limits_are_configurable() -> None:
    v = validator(max_ranks=8)
    assert "rank=8 not in [0, 7]" in reason([step(rank=8)], v)
    with pytest.raises(ValueError, match="max_ranks"):
        Limits(max_ranks=2**21)


def test_the_payloads_that_crashed_decoding_are_bad_messages() -> None:
    for payload in (bytes.fromhex("8101a1fa"), b"\x91\xa1\xff", b"\x81\xa7records\x91\xa1\xfe"):
        with pytest.raises(BadMessage):
            decode_batch(payload)


@settings(max_examples=3000, deadline=None)
@given(st.binary(max_size=64))
def test_arbitrary_bytes_decode_or_raise_bad_message(payload: bytes) -> None:
    try:
        records = decode_batch(payload)
    except BadMessage:
        return
    with contextlib.suppress(InvalidRecord):
        validator().validate(records)


_ints = st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from([0, -1, 2**31, 2**40, T0]))
_floats = st.floats(allow_nan=True, allow_infinity=True)
_texts = st.one_of(st.text(max_size=8), st.just(""), st.just("x" * 5000))


def _built(factory):  # a struct whose own checks refuse the values is no example
    def build(**fields: object) -> object:
        try:
            return factory(**fields)
        except ValueError:
            return None
    return build


@settings(max_examples=1500, deadline=None)
@given(st.builds(_built(step), rank=_ints, step=_ints, start_ns=_ints, duration_ns=_ints,
                 samples=_ints, seq_len_mean=_floats, job_id=_texts)
       | st.builds(_built(summary), rank=_ints, total_ns=_ints, m2_ns2=_floats, min_ns=_ints,
                   max_ns=_ints, name=_texts, window_start_ns=_ints)
       | st.builds(_built(MetricSample), job_id=_texts, ts_ns=_ints, name=_texts, value=_floats,
                   rank=_ints, device=_ints))
def test_any_field_values_are_accepted_or_named_never_raised(record: object) -> None:
    """Whatever values survive decoding, validation accepts or names them; and an accepted
    record fits the window engine's int64 columns."""
    if record is None:
        return
    try:
        payload = encode_batch([record])
        records = decode_batch(payload)
    except (BadMessage, OverflowError, msgspec.ValidationError, ValueError):
        return
    try:
        validator().validate(records)
    except InvalidRecord as exc:
        assert str(exc).startswith("records[0] (")
        return
    for name in ("rank", "start_ns", "duration_ns", "total_ns", "ts_ns", "min_ns", "max_ns"):
        if hasattr(records[0], name):
            np.array([getattr(records[0], name)], dtype=np.int64)


def test_a_poll_is_checked_together_and_each_message_gets_its_own_verdict() -> None:
    v = validator()
    polls = [
        [batch()],
        [Topology(job_id="j", dp_size=2), batch(rank=[0, 1, 1], duration_ns=[5, -7, 5])],
        [batch(rank=[0, 1, 2])],  # the rejected topology does not count: rank 2 is fine
        [Topology(job_id="k", dp_size=2), StepRecord(job_id="k", rank=1, step=0, start_ns=T0,
                                                     duration_ns=1)],
    ]
    errors = v.validate_many(polls)
    assert [e is None for e in errors] == [True, False, True, True]
    assert str(errors[1]) == ("records[1] (spans): duration_ns[1]=-7 not in "
                              "[0, 604800000000000]")
    assert v.world_size("j") is None and v.world_size("k") == 2
    # All valid: the fast path gives the same verdicts without the column fallback.
    assert v.validate_many([[batch()], [batch(rank=[1, 1, 0])]]) == [None, None]
    assert "rank[0]=5 not in [0, 1]" in str(v.validate_many(
        [[batch()], [StepRecord(job_id="k", rank=0, step=0, start_ns=T0, duration_ns=1),
                     SpanBatch.from_arrays(job_id="k", layers=["l"], names=["n"], rank=[5],
                                           fn=[0], step=[0], start_ns=[T0], duration_ns=[1])]]
    )[1])


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        (summaries(rank=[0, 2**20]), "rank[1]=1048576 not in [0, 131071]"),
        (summaries(rank=[-1, 0]), "rank[0]=-1 not in"),
        (summaries(min_ns=[4, 9]), "min_ns[1]=9 is above max_ns[1]=7"),
        (summaries(max_ns=[6, 10**18]), "max_ns[1]=1000000000000000000 not in"),
        (summaries(m2_ns2=[math.nan, 1.0]), "m2_ns2[0]=nan is not a finite number"),
        (summaries(total_ns=[-1, 1]), "total_ns[0]=-1 not in"),
        (summaries(count=[-1, 2]), "count[0]=-1 not in [0, "),
        (summaries(sketch_counts=[2, -2]), "sketch_counts[1]=-2 not in"),
        (summaries(sketch_keys=[7, -40_000]), "sketch_keys[1]=-40000 not in [-32768, 32767]"),
    ],
)
def test_summary_columns_checked_together_still_name_the_bad_message(bad: SummaryBatch,
                                                                     expected: str) -> None:
    """Once a function dictionary has been seen, a poll's summary batches have their columns
    checked together (the fast path); a bad value still rejects only its own message, named."""
    v = validator()
    v.validate([summaries()])  # the dictionary is now known
    errors = v.validate_many([[summaries()], [step(), bad], [summaries(rank=[1, 0])]])
    assert [e is None for e in errors] == [True, False, True]
    assert str(errors[1]).startswith("records[1] (summaries): ") and expected in str(errors[1])


def profile_tree(**fields: object):
    from trainscope.schemas.records import ProfileCallPaths

    return ProfileCallPaths(**({
        "job_id": "j", "rank": 1, "request_id": "r", "started_ns": T0, "stopped_ns": T0 + 10**9,
        "steps": 3, "callpaths": [11, 12], "parents": [0, 11], "layers": ["python", "torch_op"],
        "names": ["main", "aten::mm"], "counts": [3, 6], "total_ns": [100, 60],
        "self_ns": [40, 60],
    } | fields))


@pytest.mark.parametrize(("fields", "named"), [
    ({"self_ns": [40, 61]}, "call path 1: self_ns=61 not in [0, 60]"),
    ({"names": ["main", ""]}, "call path 1: name is empty"),
    ({"callpaths": [0, 12]}, "call path 0: callpath=0"),
    ({"counts": [-1, 6]}, "call path 0: count=-1"),
    ({"stopped_ns": T0 - 1}, "session length=-1"),
    ({"rank": 7}, "rank=7 not in [0, 3]"),
])
def test_a_profile_tree_with_an_unusable_value_is_rejected(fields, named) -> None:
    v = validator()
    good = Topology(job_id="j", dp_size=4)
    v.validate([good, profile_tree()])
    with pytest.raises(InvalidRecord, match=re.escape(named)):
        v.validate([profile_tree(**fields)])


def test_a_profile_tree_whose_columns_disagree_does_not_decode() -> None:
    tree = msgspec.structs.asdict(profile_tree())
    tree["parents"] = [0]
    payload = msgspec.msgpack.encode({"records": [{"type": "profile_callpaths", **tree}]})
    with pytest.raises(BadMessage, match="one entry per call path"):
        decode_batch(payload)
    with pytest.raises(ValueError, match="part 2 not in"):
        profile_tree(part=2, parts=2)


def test_profile_trees_are_weighed_by_their_paths_in_bus_messages() -> None:
    from trainscope.schemas.summaries import message_chunks

    trees = [profile_tree(), profile_tree(), profile_tree()]
    assert [len(c) for c in message_chunks(trees, 4)] == [2, 1]
    assert decode_batch(encode_batch(trees)) == trees
