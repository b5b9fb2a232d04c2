"""The records that cross process boundaries: typed msgspec structs, one per kind.

Conventions every consumer relies on:
- timestamps are integer nanoseconds since the Unix epoch (UTC), durations integer nanoseconds;
- every struct carries ``v`` (the schema version it was written with);
- a rank of ``-1`` means "not tied to one rank" (a job-level finding, a host-level metric).

Span events are high-volume, so they travel as a columnar :class:`SpanBatch` whose numeric
columns are little-endian arrays in ``bytes`` fields: decoding is zero-copy into numpy
(``np.frombuffer``), which is what lets the window engine sustain millions of events per second
on one core. :class:`SpanEvent` is the same record in row form, for producers and tests that deal
with a handful of events at a time. Function summaries likewise travel as a columnar
:class:`SummaryBatch` (one per job and window); :class:`FunctionSummary` is their row form.
"""

from __future__ import annotations

import operator
import sys
from typing import Any

import msgspec
import numpy as np

# Step records and metric samples live in a module of their own; importable from here too.
from trainscope.schemas.step_metric import (
    MetricBatch,
    MetricSample,
    StepBatch,
    StepRecord,
)
from trainscope.schemas.version import SCHEMA_VERSION

LAYERS = (
    "step",
    "python",
    # record_function labels and other annotations, on the host and on the GPU timeline
    "user_annotation",
    "gpu_user_annotation",
    "torch_op",
    "cuda_kernel",
    "cuda_api",
    "memcpy",
    "collective",
    "dataloader",
    "gc",
    "sched",
    # device (CUDA event) time of the host phases and the collectives: see
    # trainscope/producers/torch/device_timing.py
    "gpu_phase",
    "gpu_collective",
)

CATEGORIES = (
    "gpu-compute",
    "compute",  # a rank's own compute in a job with no GPU evidence (CPU-only)
    "gpu-throttle",
    "gpu-memory",
    "pcie",
    "nvlink",
    "network",
    "dataloader",
    "python-gc",
    "cpu-contention",
    # Time on the host outside every instrumented function (loop-body Python, preprocessing):
    # the rank's peers wait on it though none of its measured functions grew (detector waits).
    "host",
    "stage-imbalance",
    "seq-imbalance",
    "hang",
    "no-data",  # a declared rank that never reported: its producer is not running (deployment)
    # Not performance: a rank sent more distinct functions (or windows) than the stream job's
    # caps allow, and what went over was set aside (trainscope/engine/caps.py).
    "cardinality",
    # A rank's host clock is off its peers' (its times were corrected; fix the host's clock).
    "clock-skew",
    # A job-level symptom (step time regressed) that no detector has narrowed down yet.
    "slowdown",
    # A rank its peers wait on, flagged from step records before its window closed; the
    # window's detectors say why (detectors/early.py).
    "straggler",
)


class WorkerInfo(msgspec.Struct, kw_only=True, frozen=True):
    """One worker's place in the job's parallel layout."""

    rank: int
    host: str = ""
    local_rank: int = 0
    dp_rank: int = 0
    pp_stage: int = 0
    tp_rank: int = 0
    cp_rank: int = 0


class Topology(msgspec.Struct, tag="topology", kw_only=True, frozen=True):
    """Declared once per job: the parallel degrees and where every rank sits."""

    v: int = SCHEMA_VERSION
    job_id: str
    dp_size: int = 1
    pp_size: int = 1
    tp_size: int = 1
    cp_size: int = 1
    workers: list[WorkerInfo] = []

    @property
    def world_size(self) -> int:
        return self.dp_size * self.pp_size * self.tp_size * self.cp_size

    def __post_init__(self) -> None:
        for name in ("dp_size", "pp_size", "tp_size", "cp_size"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")


class SpanEvent(msgspec.Struct, tag="span", kw_only=True, frozen=True):
    """One execution of one function on one rank (row form of :class:`SpanBatch`)."""

    v: int = SCHEMA_VERSION
    job_id: str
    rank: int
    layer: str
    name: str
    start_ns: int
    duration_ns: int
    step: int = -1
    bytes_moved: int = 0
    callpath_id: int = 0


# Numeric columns of a SpanBatch and their dtypes (little-endian on the wire).
SPAN_COLUMNS: dict[str, str] = {
    "rank": "<i4",
    "fn": "<i4",
    "step": "<i4",
    "start_ns": "<i8",
    "duration_ns": "<i8",
    "bytes_moved": "<i8",
    "callpath_id": "<u8",
}
# Columns that may be sent empty, meaning "all zero" (most events move no bytes).
_OPTIONAL_SPAN_COLUMNS = frozenset({"bytes_moved", "callpath_id"})


class SpanBatch(msgspec.Struct, tag="spans", kw_only=True, frozen=True):
    """Many span events of one job, column by column.

    ``layers[i]``/``names[i]`` describe function ``i``; column ``fn`` holds, per event, the
    index of its function. Numeric columns are packed arrays (dtypes in ``SPAN_COLUMNS``).
    """

    v: int = SCHEMA_VERSION
    job_id: str
    host: str = ""
    layers: list[str]
    names: list[str]
    rank: bytes
    fn: bytes
    step: bytes
    start_ns: bytes
    duration_ns: bytes
    bytes_moved: bytes = b""
    callpath_id: bytes = b""

    def __post_init__(self) -> None:
        if len(self.layers) != len(self.names):
            raise ValueError(
                f"layers has {len(self.layers)} entries but names has {len(self.names)}"
            )
        n = len(self.rank) // 4
        for column, dtype in SPAN_COLUMNS.items():
            raw = getattr(self, column)
            if column in _OPTIONAL_SPAN_COLUMNS and not raw:
                continue
            width = np.dtype(dtype).itemsize
            if len(raw) % width or len(raw) // width != n:
                raise ValueError(
                    f"column {column} holds {len(raw)} bytes, expected {n * width} "
                    f"({n} events of {width} bytes)"
                )
        if n and self.layers:
            fn = np.frombuffer(self.fn, dtype=SPAN_COLUMNS["fn"])
            lo, hi = int(fn.min()), int(fn.max())
            if lo < 0 or hi >= len(self.names):
                bad = lo if lo < 0 else hi
                raise ValueError(f"fn index {bad} out of range for {len(self.names)} functions")
        elif n:
            raise ValueError(f"{n} events but no functions declared")

    def __len__(self) -> int:
        return len(self.rank) // 4

    def column(self, name: str) -> np.ndarray:
        """A read-only numpy view of one numeric column (zeros for an empty optional one)."""
        raw = getattr(self, name)
        dtype = SPAN_COLUMNS[name]
        if not raw:
            return np.zeros(len(self), dtype=dtype)
        return np.frombuffer(raw, dtype=dtype)

    @classmethod
    def from_arrays(
        cls,
        *,
        job_id: str,
        layers: list[str],
        names: list[str],
        host: str = "",
        **columns: Any,
    ) -> SpanBatch:
        packed = {}
        for name, dtype in SPAN_COLUMNS.items():
            values = columns.pop(name, None)
            if values is None:
                if name in _OPTIONAL_SPAN_COLUMNS:
                    packed[name] = b""
                    continue
                raise TypeError(f"missing column {name}")
            packed[name] = np.ascontiguousarray(values, dtype=dtype).tobytes()
        if columns:
            raise TypeError(f"unknown columns: {sorted(columns)}")
        return cls(job_id=job_id, host=host, layers=list(layers), names=list(names), **packed)

    @classmethod
    def from_events(cls, events: list[SpanEvent], host: str = "") -> SpanBatch:
        """Pack row events (all of one job) into one batch."""
        if not events:
            raise ValueError("cannot build a SpanBatch from no events")
        job_id = events[0].job_id
        functions: dict[tuple[str, str], int] = {}
        fn = []
        for event in events:
            if event.job_id != job_id:
                raise ValueError(f"events of two jobs in one batch: {job_id!r}, {event.job_id!r}")
            fn.append(functions.setdefault((event.layer, event.name), len(functions)))
        return cls.from_arrays(
            job_id=job_id,
            host=host,
            layers=[layer for layer, _ in functions],
            names=[name for _, name in functions],
            rank=[e.rank for e in events],
            fn=fn,
            step=[e.step for e in events],
            start_ns=[e.start_ns for e in events],
            duration_ns=[e.duration_ns for e in events],
            bytes_moved=[e.bytes_moved for e in events],
            callpath_id=[e.callpath_id for e in events],
        )

    def to_events(self) -> list[SpanEvent]:
        cols = {name: self.column(name).tolist() for name in SPAN_COLUMNS}
        return [
            SpanEvent(
                job_id=self.job_id,
                rank=cols["rank"][i],
                layer=self.layers[cols["fn"][i]],
                name=self.names[cols["fn"][i]],
                start_ns=cols["start_ns"][i],
                duration_ns=cols["duration_ns"][i],
                step=cols["step"][i],
                bytes_moved=cols["bytes_moved"][i],
                callpath_id=cols["callpath_id"][i],
            )
            for i in range(len(self))
        ]


class FunctionSummary(msgspec.Struct, tag="summary", kw_only=True, frozen=True):
    """Every execution of one function on one rank within one window, condensed.

    Mergeable: counts, totals, min/max and the sketch add up; ``m2_ns2`` (sum of squared
    deviations from the mean) merges with Chan's parallel formula. The sketch is a sparse
    log-bucket histogram, see :mod:`trainscope.schemas.sketch`.
    """

    v: int = SCHEMA_VERSION
    job_id: str
    rank: int
    layer: str
    name: str
    callpath_id: int = 0
    window_start_ns: int
    window_end_ns: int
    count: int
    total_ns: int
    m2_ns2: float = 0.0
    min_ns: int
    max_ns: int
    bytes_total: int = 0
    sketch_keys: list[int] = []
    sketch_counts: list[int] = []

    @property
    def mean_ns(self) -> float:
        return self.total_ns / self.count if self.count else 0.0

    @property
    def variance_ns2(self) -> float:
        return self.m2_ns2 / self.count if self.count else 0.0

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"count must be >= 0, got {self.count}")
        if self.window_end_ns <= self.window_start_ns:
            raise ValueError(
                f"window_end_ns {self.window_end_ns} is not after window_start_ns "
                f"{self.window_start_ns}"
            )
        if len(self.sketch_keys) != len(self.sketch_counts):
            raise ValueError(
                f"sketch_keys has {len(self.sketch_keys)} entries but sketch_counts has "
                f"{len(self.sketch_counts)}"
            )


# Numeric columns of a SummaryBatch: one entry per row (function summary) ...
SUMMARY_COLUMNS: dict[str, str] = {
    "rank": "<i4",
    "fn": "<i4",
    "count": "<i8",
    "total_ns": "<i8",
    "m2_ns2": "<f8",
    "min_ns": "<i8",
    "max_ns": "<i8",
    "bytes_total": "<i8",
}
# ... and the sketches of all rows, flattened: row i owns entries
# ``sketch_offsets[i]:sketch_offsets[i + 1]`` of ``sketch_keys``/``sketch_counts``.
SUMMARY_SKETCH_COLUMNS: dict[str, str] = {
    "sketch_offsets": "<i8",
    "sketch_keys": "<i4",
    "sketch_counts": "<i8",
}
_SUMMARY_ALL_COLUMNS = {**SUMMARY_COLUMNS, **SUMMARY_SKETCH_COLUMNS}
# (column, bytes per value, one value per row (else per sketch entry)), offsets aside.
_SUMMARY_WIDTHS = tuple(
    (name, np.dtype(dtype).itemsize, name in SUMMARY_COLUMNS)
    for name, dtype in _SUMMARY_ALL_COLUMNS.items()
    if name != "sketch_offsets"
)
# Those columns of a batch at once, in that order (one call, not a getattr per column).
_SUMMARY_WIDTH_COLUMNS = operator.attrgetter(*(name for name, _, _ in _SUMMARY_WIDTHS))


def _values(raw: bytes, native: str, dtype: str) -> list[int]:
    """A packed little-endian column as Python ints (``native``: its struct code here)."""
    if _LITTLE_ENDIAN:
        return memoryview(raw).cast(native).tolist()
    return np.frombuffer(raw, dtype=dtype).tolist()  # type: ignore[no-any-return]


_LITTLE_ENDIAN = sys.byteorder == "little"


class SummaryBatch(msgspec.Struct, tag="summaries", kw_only=True, frozen=True):
    """The function summaries of one job and one window, column by column.

    The columnar form of many :class:`FunctionSummary` records, which is what producers send:
    ``layers[i]``/``names[i]``/``callpaths[i]`` describe function ``i`` and column ``fn`` holds,
    per row, the index of its function. Numeric columns are packed little-endian arrays (dtypes
    in ``SUMMARY_COLUMNS`` and ``SUMMARY_SKETCH_COLUMNS``); ``sketch_offsets`` has one entry
    more than there are rows.
    """

    v: int = SCHEMA_VERSION
    job_id: str
    host: str = ""
    window_start_ns: int
    window_end_ns: int
    layers: list[str]
    names: list[str]
    callpaths: list[int]
    rank: bytes
    fn: bytes
    count: bytes
    total_ns: bytes
    m2_ns2: bytes
    min_ns: bytes
    max_ns: bytes
    bytes_total: bytes
    sketch_offsets: bytes
    sketch_keys: bytes
    sketch_counts: bytes

    def __post_init__(self) -> None:
        if self.window_end_ns <= self.window_start_ns:
            raise ValueError(
                f"window_end_ns {self.window_end_ns} is not after window_start_ns "
                f"{self.window_start_ns}"
            )
        functions = len(self.layers)
        if len(self.names) != functions or len(self.callpaths) != functions:
            raise ValueError(
                f"layers, names and callpaths must have one entry per function, got "
                f"{functions}, {len(self.names)} and {len(self.callpaths)}"
            )
        # Decoding runs this once per batch of a few dozen rows: plain length checks first,
        # then as few numpy calls as possible.
        n = len(self.rank) // 4
        entries = len(self.sketch_keys) // 4
        for raw, (column, width, per_row) in zip(_SUMMARY_WIDTH_COLUMNS(self), _SUMMARY_WIDTHS,
                                                 strict=True):
            expected = (n if per_row else entries) * width
            if len(raw) != expected:
                raise ValueError(
                    f"column {column} holds {len(raw)} bytes, expected "
                    f"{expected} ({expected // width} {'rows' if per_row else 'entries'} "
                    f"of {width} bytes)"
                )
        if len(self.sketch_offsets) != (n + 1) * 8:
            raise ValueError(
                f"column sketch_offsets holds {len(self.sketch_offsets)} bytes, expected "
                f"{(n + 1) * 8} (rows + 1 of 8 bytes)"
            )
        # A few dozen values a batch: Python over a memoryview costs less than numpy's calls.
        offsets = _values(self.sketch_offsets, "q", "<i8")
        if offsets[0] != 0 or offsets[-1] != entries or offsets != sorted(offsets):
            raise ValueError(
                f"sketch_offsets must rise from 0 to {entries} (the sketch entries), "
                f"got {offsets[0]}..{offsets[-1]}"
            )
        if not n:
            return
        if not functions:
            raise ValueError(f"{n} rows but no functions declared")
        # Read as unsigned, a negative index is huge: one reduction checks both bounds.
        if max(_values(self.fn, "I", "<u4")) >= functions:
            fn = np.frombuffer(self.fn, dtype="<i4")
            bad = int(fn.min()) if fn.min() < 0 else int(fn.max())
            raise ValueError(f"fn index {bad} out of range for {functions} functions")

    def __len__(self) -> int:
        return len(self.rank) // 4

    def column(self, name: str) -> np.ndarray:
        """A read-only numpy view of one numeric column."""
        return np.frombuffer(getattr(self, name), dtype=_SUMMARY_ALL_COLUMNS[name])

    @classmethod
    def from_arrays(
        cls,
        *,
        job_id: str,
        window_start_ns: int,
        window_end_ns: int,
        layers: list[str],
        names: list[str],
        callpaths: list[int] | None = None,
        host: str = "",
        **columns: Any,
    ) -> SummaryBatch:
        """Pack numpy arrays (or lists); ``m2_ns2``, ``bytes_total`` and the sketch may be left
        out (zeros, no sketch)."""
        n = len(columns["rank"]) if "rank" in columns else 0
        defaults = {"m2_ns2": np.zeros(n), "bytes_total": np.zeros(n, dtype=np.int64),
                    "sketch_offsets": np.zeros(n + 1, dtype=np.int64),
                    "sketch_keys": (), "sketch_counts": ()}
        packed = {}
        for name, dtype in _SUMMARY_ALL_COLUMNS.items():
            values = columns.pop(name, None)
            if values is None:
                if name not in defaults:
                    raise TypeError(f"missing column {name}")
                values = defaults[name]
            packed[name] = np.ascontiguousarray(values, dtype=dtype).tobytes()
        if columns:
            raise TypeError(f"unknown columns: {sorted(columns)}")
        return cls(
            job_id=job_id,
            host=host,
            window_start_ns=window_start_ns,
            window_end_ns=window_end_ns,
            layers=list(layers),
            names=list(names),
            callpaths=[0] * len(layers) if callpaths is None else list(callpaths),
            **packed,
        )

    @classmethod
    def from_summaries(cls, summaries: list[FunctionSummary], host: str = "") -> SummaryBatch:
        """Pack row summaries, all of one job and one window, into one batch."""
        if not summaries:
            raise ValueError("cannot build a SummaryBatch from no summaries")
        first = summaries[0]
        key = (first.job_id, first.window_start_ns, first.window_end_ns)
        functions: dict[tuple[str, str, int], int] = {}
        fn = []
        keys: list[int] = []
        counts: list[int] = []
        offsets = [0]
        for s in summaries:
            if (s.job_id, s.window_start_ns, s.window_end_ns) != key:
                raise ValueError(
                    f"summaries of two jobs or windows in one batch: {key}, "
                    f"{(s.job_id, s.window_start_ns, s.window_end_ns)}"
                )
            fn.append(functions.setdefault((s.layer, s.name, s.callpath_id), len(functions)))
            keys += s.sketch_keys
            counts += s.sketch_counts
            offsets.append(len(keys))
        return cls.from_arrays(
            job_id=first.job_id,
            host=host,
            window_start_ns=first.window_start_ns,
            window_end_ns=first.window_end_ns,
            layers=[layer for layer, _, _ in functions],
            names=[name for _, name, _ in functions],
            callpaths=[callpath for _, _, callpath in functions],
            rank=[s.rank for s in summaries],
            fn=fn,
            count=[s.count for s in summaries],
            total_ns=[s.total_ns for s in summaries],
            m2_ns2=[s.m2_ns2 for s in summaries],
            min_ns=[s.min_ns for s in summaries],
            max_ns=[s.max_ns for s in summaries],
            bytes_total=[s.bytes_total for s in summaries],
            sketch_offsets=offsets,
            sketch_keys=keys,
            sketch_counts=counts,
        )

    def to_summaries(self) -> list[FunctionSummary]:
        """The rows as :class:`FunctionSummary` records (for tests and small consumers)."""
        cols = {name: self.column(name).tolist() for name in _SUMMARY_ALL_COLUMNS}
        offsets = cols["sketch_offsets"]
        out = []
        for i in range(len(self)):
            f = cols["fn"][i]
            lo, hi = offsets[i], offsets[i + 1]
            out.append(
                FunctionSummary(
                    job_id=self.job_id,
                    rank=cols["rank"][i],
                    layer=self.layers[f],
                    name=self.names[f],
                    callpath_id=self.callpaths[f],
                    window_start_ns=self.window_start_ns,
                    window_end_ns=self.window_end_ns,
                    count=cols["count"][i],
                    total_ns=cols["total_ns"][i],
                    m2_ns2=cols["m2_ns2"][i],
                    min_ns=cols["min_ns"][i],
                    max_ns=cols["max_ns"][i],
                    bytes_total=cols["bytes_total"][i],
                    sketch_keys=cols["sketch_keys"][lo:hi],
                    sketch_counts=cols["sketch_counts"][lo:hi],
                )
            )
        return out


class Finding(msgspec.Struct, tag="finding", kw_only=True, frozen=True):
    """What a detector concluded about one window of one job.

    ``score`` is in [0, 1]; findings at or above the alert threshold are alerts. ``rank`` is the
    prime suspect (``-1`` for job-level findings), ``ranks`` every rank the finding covers (a
    whole stage for stage imbalance), ``victims`` ranks that only waited for the suspect.
    """

    v: int = SCHEMA_VERSION
    job_id: str
    window_start_ns: int
    window_end_ns: int
    detector: str
    rank: int = -1
    ranks: list[int] = []
    victims: list[int] = []
    pp_stage: int = -1
    layer: str = ""
    function: str = ""
    category: str
    score: float
    evidence: dict[str, float] = {}
    message: str

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise ValueError(f"unknown category {self.category!r}; known: {', '.join(CATEGORIES)}")


class ControlMessage(msgspec.Struct, tag="control", kw_only=True, frozen=True):
    """A request to producers, e.g. "profile rank 17 of job J for 5 steps"."""

    v: int = SCHEMA_VERSION
    job_id: str
    action: str
    rank: int = -1
    steps: int = 0
    request_id: str = ""
    issued_ns: int = 0


class ProfileCallPaths(msgspec.Struct, tag="profile_callpaths", kw_only=True, frozen=True):
    """The calling-context tree of one on-demand profile session of one rank, with its times.

    Row ``i`` is one call path: ``callpaths[i]`` its id (the ``callpath_id`` of the session's
    function summaries), ``parents[i]`` its parent's id (0 at a root), ``layers[i]``/``names[i]``
    the node, ``counts[i]`` and ``total_ns[i]`` its executions and their time over the whole
    session (inclusive of what it calls), ``self_ns[i]`` less its host-side children.
    ``steps`` training steps were profiled between ``started_ns`` and ``stopped_ns``, at the
    request ``request_id`` (of the :class:`ControlMessage`). A large tree travels in ``parts``
    records (``part`` = 0 … parts - 1), each small enough for one bus message; a parent may be in
    another part.
    """

    v: int = SCHEMA_VERSION
    job_id: str
    rank: int
    request_id: str = ""
    started_ns: int
    stopped_ns: int
    steps: int
    part: int = 0
    parts: int = 1
    callpaths: list[int]
    parents: list[int]
    layers: list[str]
    names: list[str]
    counts: list[int]
    total_ns: list[int]
    self_ns: list[int]

    def __post_init__(self) -> None:
        n = len(self.callpaths)
        lengths = {len(getattr(self, c)) for c in
                   ("parents", "layers", "names", "counts", "total_ns", "self_ns")}
        if lengths != {n}:
            raise ValueError(
                f"callpaths, parents, layers, names, counts, total_ns and self_ns must have one "
                f"entry per call path ({n}), got lengths {sorted(lengths)}"
            )
        if not 0 <= self.part < self.parts:
            raise ValueError(f"part {self.part} not in [0, parts={self.parts})")

    def __len__(self) -> int:
        return len(self.callpaths)


class FindingCallPath(msgspec.Struct, tag="finding_callpath", kw_only=True, frozen=True):
    """The call path that explains a finding: what the stream job's automatic profile of the
    suspect rank and one healthy peer found (the differential calling-context tree).

    The first fields name the finding (as in ``findings``). ``path``/``path_layers`` run from
    the root to the deepest path that explains the excess, ``path_delta_ns[i]`` is the excess
    per step of the path's first ``i + 1`` nodes, so the cost of any block on the way, e.g. a
    ``record_function`` label, is ``path_delta_ns[indexOf(path, 'label') - 1]``.
    ``suspect_ns``/``peer_ns``/``delta_ns`` are the deepest path's time per step on each rank
    and their difference (totals over the session where a session does not know its steps;
    then ``per_step`` is false). An empty ``path`` means the profiles showed no excess.
    """

    v: int = SCHEMA_VERSION
    job_id: str
    window_start_ns: int
    window_end_ns: int
    detector: str
    rank: int
    category: str
    function: str = ""
    score: float
    peer_rank: int
    request_id: str
    profiled_from_ns: int
    profiled_to_ns: int
    steps: int
    per_step: bool
    callpath_id: int = 0
    path: list[str] = []
    path_layers: list[str] = []
    path_delta_ns: list[float] = []
    suspect_ns: float = 0.0
    peer_ns: float = 0.0
    delta_ns: float = 0.0
    message: str


Record = (
    Topology
    | SpanEvent
    | SpanBatch
    | StepRecord
    | StepBatch
    | MetricSample
    | MetricBatch
    | FunctionSummary
    | SummaryBatch
    | Finding
    | ControlMessage
    | ProfileCallPaths
    | FindingCallPath
)

RECORD_TYPES: tuple[type[msgspec.Struct], ...] = (
    Topology,
    SpanEvent,
    SpanBatch,
    StepRecord,
    StepBatch,
    MetricSample,
    MetricBatch,
    FunctionSummary,
    SummaryBatch,
    Finding,
    ControlMessage,
    ProfileCallPaths,
    FindingCallPath,
)
