"""The fast checks and the explaining checks of every record kind give the same verdicts.

Both are derived from one declaration per kind (``RULES`` in trainscope.schemas.validate), the
fast one as a single compiled test per record plus numpy reductions over a poll's joined
columns, the explaining one rule by rule and element by element. Records of every kind are
generated valid and then perturbed at a field or two, with values at and beyond each limit
(NaN, infinities, huge ints, long and empty strings, bad ranks, values of the wrong type), and
put together into mixed messages and polls.
"""

from __future__ import annotations

import math
import re
import string
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainscope.schemas.records import (
    ControlMessage,
    Finding,
    FindingCallPath,
    FunctionSummary,
    MetricSample,
    ProfileCallPaths,
    SpanBatch,
    SpanEvent,
    StepRecord,
    SummaryBatch,
    Topology,
    WorkerInfo,
)
from trainscope.schemas.rules import Int, Kind
from trainscope.schemas.validate import RULES, UNNAMED, Limits, Validator, checks_for

T0 = 1_767_225_600 * 10**9  # 2026-01-01
NOW = T0 + 86_400 * 10**9
SMALL = Limits(max_ranks=8, max_id_chars=8, max_name_chars=12, max_functions=4,
               max_sketch_buckets=4, max_devices=4, max_duration_ns=10**12, now_ns=lambda: NOW)
DEFAULT = Limits(now_ns=lambda: NOW)
LIMITS = st.sampled_from([SMALL, DEFAULT])


def _edges(limits: Limits) -> set[int]:
    """Each limit, one below and one above."""
    latest = NOW + limits.max_future_ns
    out = set()
    for x in (limits.min_time_ns, latest, limits.max_duration_ns, limits.max_ranks,
              limits.max_devices, limits.max_functions, limits.max_sketch_buckets, 0,
              2**31, 2**63, 2**64):
        out |= {x - 1, x, x + 1}
    return out


EDGES = sorted(_edges(SMALL) | _edges(DEFAULT) | {-(2**63), -(2**31) - 1, -(2**31), 2**40})
ODD = st.sampled_from(["seven", None, 1.5, [1]])  # what only a record built in Python holds
INTS = st.one_of(st.sampled_from(EDGES), st.integers(-2, 12), ODD)
FLOATS = st.one_of(st.sampled_from([math.nan, math.inf, -math.inf, -1.0, -0.0, 0.0, 0.5, 1.0,
                                    1.5, 1e308, 5e-324]), ODD)
TEXTS = st.one_of(st.sampled_from(["", "a", "x" * 8, "x" * 9, "é" * 12, "x" * 13, "x" * 300,
                                   "x" * 5000]), ODD)
JOBS = st.sampled_from(["j", "k"])
# World sizes already declared by earlier messages.
WORLDS = st.sampled_from([{}, {"j": 2}, {"j": 8, "k": 1}])


def _in(dtype: str) -> st.SearchStrategy[Any]:
    """Edge values that fit a column's dtype."""
    if dtype == "<f8":
        return st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 0.0, 2.5, 1e308])
    info = np.iinfo(dtype)
    return st.one_of(st.sampled_from([x for x in EDGES if info.min <= x <= info.max]),
                     st.integers(max(-2, int(info.min)), 12))


@st.composite
def _perturbed(draw: st.DrawFn, kind: type, base: dict[str, Any],
               pools: dict[str, st.SearchStrategy[Any]]) -> Any:
    """A valid record of ``kind`` with up to two of its fields drawn from ``pools`` instead."""
    fields = dict(base, job_id=draw(JOBS))
    for name in draw(st.lists(st.sampled_from(sorted(pools)), max_size=2, unique=True)):
        fields[name] = draw(pools[name])
    try:
        return kind(**fields)
    except (ValueError, TypeError):  # the struct's own checks refuse it: no example
        return None


def _ints(*names: str) -> dict[str, st.SearchStrategy[Any]]:
    return dict.fromkeys(names, INTS)


_COMMON = {"v": INTS, "job_id": TEXTS}
_WINDOW = {"window_start_ns": T0, "window_end_ns": T0 + 15 * 10**9}

steps = _perturbed(StepRecord, {"rank": 1, "step": 3, "start_ns": T0, "duration_ns": 10**8}, {
    **_COMMON, **_ints("rank", "step", "start_ns", "duration_ns", "samples", "tokens",
                       "seq_len_max"), "seq_len_mean": FLOATS})
metrics = _perturbed(MetricSample, {"ts_ns": T0, "name": "sm", "value": 1.0}, {
    **_COMMON, **_ints("rank", "device", "ts_ns"), "host": TEXTS, "name": TEXTS,
    "value": FLOATS})
events = _perturbed(SpanEvent, {"rank": 0, "layer": "op", "name": "mm", "start_ns": T0,
                                "duration_ns": 5}, {
    **_COMMON, **_ints("rank", "start_ns", "duration_ns", "step", "bytes_moved", "callpath_id"),
    "layer": TEXTS, "name": TEXTS})
summaries = _perturbed(FunctionSummary, {
    "rank": 1, "layer": "gc", "name": "gc", **_WINDOW, "count": 2, "total_ns": 10, "min_ns": 4,
    "max_ns": 6, "sketch_keys": [1, 2], "sketch_counts": [1, 1]}, {
    **_COMMON, **_ints("rank", "callpath_id", "window_start_ns", "window_end_ns", "count",
                       "total_ns", "min_ns", "max_ns", "bytes_total"),
    "m2_ns2": FLOATS, "layer": TEXTS, "name": TEXTS,
    "sketch_keys": st.lists(INTS, min_size=2, max_size=2),
    "sketch_counts": st.lists(INTS, min_size=2, max_size=2)})
findings = _perturbed(Finding, {"window_start_ns": T0, "window_end_ns": T0 + 1, "detector": "d",
                                "category": "hang", "score": 0.5, "message": "m"},
                      {**_COMMON, "score": FLOATS})
controls = _perturbed(ControlMessage, {"action": "profile"}, {**_COMMON, "rank": INTS})
callpaths = _perturbed(FindingCallPath, {
    "window_start_ns": T0, "window_end_ns": T0 + 1, "detector": "d", "rank": 0,
    "category": "hang", "score": 0.5, "peer_rank": 1, "request_id": "r", "profiled_from_ns": T0,
    "profiled_to_ns": T0 + 1, "steps": 1, "per_step": True, "message": "m"},
    {**_COMMON, "rank": INTS, "score": FLOATS})


@st.composite
def topologies(draw: st.DrawFn) -> Topology | None:
    sizes = st.one_of(st.integers(1, 3), st.sampled_from([8, 9, 2**17, 2**40]))
    workers = draw(st.lists(st.builds(
        WorkerInfo, rank=st.one_of(st.integers(0, 4), INTS), host=st.one_of(st.just(""), TEXTS),
        local_rank=st.one_of(st.just(0), INTS), dp_rank=st.one_of(st.just(0), INTS),
        pp_stage=st.one_of(st.just(0), INTS)), max_size=3))
    try:
        return Topology(job_id=draw(JOBS), dp_size=draw(sizes), pp_size=draw(sizes),
                        tp_size=draw(st.integers(1, 2)), workers=workers)
    except (ValueError, TypeError):
        return None


@st.composite
def profiles(draw: st.DrawFn) -> ProfileCallPaths | None:
    n = draw(st.integers(0, 5))
    lists: dict[str, list[Any]] = {
        name: draw(st.lists(st.integers(1, 100), min_size=n, max_size=n))
        for name in ("callpaths", "parents", "counts", "self_ns")}
    lists |= {"layers": ["op"] * n, "names": ["f"] * n, "total_ns": [100] * n}
    perturbed = draw(st.sampled_from(sorted(lists)))  # one list: a later rule is reached too
    pool = TEXTS if perturbed in ("layers", "names") else INTS
    lists[perturbed] = draw(st.lists(st.one_of(st.just(lists[perturbed][0] if n else 1), pool),
                                     min_size=n, max_size=n))
    try:
        return ProfileCallPaths(job_id=draw(JOBS), rank=draw(st.one_of(st.integers(0, 3), INTS)),
                                started_ns=T0, stopped_ns=draw(st.sampled_from([T0 - 1, T0 + 9])),
                                steps=draw(st.one_of(st.just(3), INTS)),
                                parts=draw(st.sampled_from([1, 2, 2**16 + 1])), **lists)
    except (ValueError, TypeError):
        return None


@st.composite
def _columns(draw: st.DrawFn, sizes: dict[str, int],
             valid: dict[str, tuple[st.SearchStrategy[Any], str]]) -> dict[str, list[Any]]:
    """Valid values of each column (``sizes`` elements), one element of one column perhaps
    swapped for an edge value of its dtype (one: a later column's rule is reached too)."""
    out = {name: draw(st.lists(values, min_size=sizes[name], max_size=sizes[name]))
           for name, (values, _) in valid.items()}
    name = draw(st.sampled_from(sorted(valid)))
    if out[name] and draw(st.booleans()):
        out[name][draw(st.integers(0, len(out[name]) - 1))] = draw(_in(valid[name][1]))
    return out


def _dictionary(draw: st.DrawFn) -> tuple[list[str], list[str]]:
    functions = draw(st.integers(1, 5))
    name = st.text(string.ascii_letters, min_size=1, max_size=4)
    layers = ["op"] * functions
    if draw(st.booleans()):
        layers[draw(st.integers(0, functions - 1))] = draw(TEXTS.filter(
            lambda x: isinstance(x, str)))
    return layers, draw(st.lists(name, min_size=functions, max_size=functions))


@st.composite
def span_batches(draw: st.DrawFn) -> SpanBatch | None:
    layers, names = _dictionary(draw)
    n = draw(st.integers(0, 4))
    valid = {"rank": (st.integers(0, 3), "<i4"), "step": (st.integers(-1, 9), "<i4"),
             "start_ns": (st.integers(T0, T0 + 10**9), "<i8"),
             "duration_ns": (st.integers(0, 10**6), "<i8")}
    if draw(st.booleans()):  # else sent empty: all zero
        valid["bytes_moved"] = (st.integers(0, 10), "<i8")
    columns = draw(_columns(dict.fromkeys(valid, n), valid))
    return SpanBatch.from_arrays(job_id=draw(JOBS), layers=layers, names=names,
                                 fn=[draw(st.integers(0, len(names) - 1)) for _ in range(n)],
                                 **columns)


@st.composite
def summary_batches(draw: st.DrawFn) -> SummaryBatch | None:
    layers, names = _dictionary(draw)
    n = draw(st.integers(0, 4))
    buckets = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    valid = {"rank": (st.integers(0, 3), "<i4"), "count": (st.integers(0, 3), "<i8"),
             "total_ns": (st.integers(0, 99), "<i8"), "m2_ns2": (st.floats(0.0, 9.0), "<f8"),
             "min_ns": (st.integers(0, 5), "<i8"), "max_ns": (st.integers(5, 9), "<i8"),
             "bytes_total": (st.integers(0, 9), "<i8"),
             "sketch_keys": (st.integers(-9, 9), "<i4"),
             "sketch_counts": (st.integers(0, 9), "<i8")}
    sizes = dict.fromkeys(valid, n) | dict.fromkeys(("sketch_keys", "sketch_counts"),
                                                     sum(buckets))
    try:
        return SummaryBatch.from_arrays(
            job_id=draw(JOBS), **_WINDOW, layers=layers, names=names,
            callpaths=draw(st.lists(st.sampled_from([0, 7, 2**64 - 1]), min_size=len(names),
                                    max_size=len(names))),
            fn=[draw(st.integers(0, len(names) - 1)) for _ in range(n)],
            sketch_offsets=np.concatenate([[0], np.cumsum(buckets, dtype=np.int64)]),
            **draw(_columns(sizes, valid)),
        )
    except ValueError:
        return None


KINDS: dict[type, st.SearchStrategy[Any]] = {
    StepRecord: steps, MetricSample: metrics, SpanEvent: events, FunctionSummary: summaries,
    Finding: findings, ControlMessage: controls, FindingCallPath: callpaths,
    Topology: topologies(), ProfileCallPaths: profiles(), SpanBatch: span_batches(),
    SummaryBatch: summary_batches(),
}
records = st.one_of(*KINDS.values())
messages = st.lists(records, min_size=1, max_size=4).map(lambda m: [r for r in m if r is not None])


def _names_a_rule(kind: Kind, reason: str) -> bool:
    """Does the reason begin with one of the kind's rules: a value's name, a row's label, or
    the fixed start of a rule's own reason text (a number where it starts with the value)?"""
    starts = [re.escape("unusable values (")]
    for rule in (*kind.fields, *kind.columns, *(r for g in kind.groups for r in g.rules)):
        if isinstance(rule, Int) and rule.reason.startswith("{value}"):
            starts.append(r"-?\d")
        elif isinstance(rule, Int) and not rule.reason.startswith("{name}"):
            starts.append(re.escape(rule.reason.split("{")[0]))
        else:
            starts.append(re.escape(rule.name) + r"[=\[ ]")
    starts += [re.escape(g.label.split("{")[0]) for g in kind.groups if g.label]
    return re.match("|".join(starts), reason) is not None


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.__name__)
@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_each_record_gets_the_same_verdict_from_both_checks(kind: type, data: st.DataObject
                                                           ) -> None:
    """Per record: the compiled test passes exactly when no rule tried alone fails, and a
    failing record's reason names the rule; for a batch, the columns' reductions pass exactly
    when no element fails its rule."""
    limits, world = data.draw(LIMITS), data.draw(WORLDS)
    record = data.draw(KINDS[kind])
    if record is None:
        return
    checks = checks_for(limits)[type(record)]
    latest = NOW + limits.max_future_ns
    try:
        fast = bool(checks.ok(record, {}, world, latest))
    except Exception:
        fast = False
    reason = checks.explain(record, {}, world, latest)
    assert fast == (reason is None), (fast, reason, record)
    if reason is not None:
        assert "\n" not in reason and _names_a_rule(RULES[kind], reason), reason
    if fast and checks.columnar:
        end = world.get(record.job_id) or limits.max_ranks
        column_reason = checks.column_reason(record, end, "why", latest)
        assert checks.columns_ok([(record, end)], latest) == (column_reason is None), (
            column_reason, record)
        if column_reason is not None:
            assert _names_a_rule(RULES[kind], column_reason), column_reason


def _reference(limits: Limits, poll: list[list[Any]]) -> tuple[list[str | None], dict]:
    """Each message explained in turn; a valid one's topologies count for the next."""
    v = Validator(limits)
    verdicts: list[str | None] = []
    for records in poll:
        error = v.explain(records)
        verdicts.append(None if error is None else str(error))
        if error is None:
            v.remember_world_sizes({t.job_id: t.world_size for t in records
                                    if isinstance(t, Topology)})
    return verdicts, v.world_sizes()


@settings(max_examples=250, deadline=None)
@given(LIMITS, st.lists(messages, min_size=1, max_size=3))
def test_a_poll_gets_the_verdicts_of_explaining_each_message(limits: Limits,
                                                            poll: list[list[Any]]) -> None:
    """Fast path (one compiled test per record, columns joined over the poll, re-checked one
    message at a time only on a failure) against the reference, message by message: the same
    verdicts, the same reasons, the same world sizes remembered."""
    v = Validator(limits)
    fast = [None if e is None else str(e) for e in v.validate_many(poll)]
    expected, world = _reference(limits, poll)
    assert fast == expected
    assert v.world_sizes() == world
    assert not any(UNNAMED in e for e in fast if e is not None)


def test_batches_of_jobs_of_different_sizes_are_checked_together() -> None:
    """Joined over a poll, each batch's ranks are held to its own job's world size."""
    def batch(job: str, ranks: list[int]) -> SpanBatch:
        n = len(ranks)
        return SpanBatch.from_arrays(job_id=job, layers=["op"], names=["mm"], rank=ranks,
                                     fn=[0] * n, step=[0] * n, start_ns=[T0] * n,
                                     duration_ns=[1] * n)

    v = Validator(DEFAULT)
    v.validate([Topology(job_id="j", dp_size=2), Topology(job_id="k", dp_size=4)])
    assert v.validate_many([[batch("j", [0, 1])], [batch("k", [3, 2])]]) == [None, None]
    errors = v.validate_many([[batch("k", [3])], [batch("j", [0, 2])]])
    assert errors[0] is None
    assert str(errors[1]) == ("records[0] (spans): rank[1]=2 not in [0, 1], job 'j' declares a "
                              "world size of 2")
