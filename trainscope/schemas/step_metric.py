"""Step records and metric samples, one per row or many as columns.

A rank ends a step every few milliseconds to seconds and a host agent reads a dozen counters per
GPU: at 10,000 ranks that is hundreds of thousands of these records per window, which the stream
job must not handle one Python object at a time. So, like span events and function summaries,
they travel as columnar batches: :class:`StepBatch` and :class:`MetricBatch` hold numeric columns
as packed little-endian arrays in ``bytes`` fields (zero-copy into numpy). :class:`StepRecord` and
:class:`MetricSample` are the same records in row form, for producers and tests that deal with a
handful at a time; the stream job packs rows into batches as it receives them.

Optional columns may be sent empty, meaning "all zero": most producers send no token counts.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
import numpy as np

from trainscope.schemas.version import SCHEMA_VERSION


class StepRecord(msgspec.Struct, tag="step", kw_only=True, frozen=True):
    """One training step on one rank."""

    v: int = SCHEMA_VERSION
    job_id: str
    rank: int
    step: int
    start_ns: int
    duration_ns: int
    samples: int = 0
    tokens: int = 0
    seq_len_mean: float = 0.0
    seq_len_max: int = 0
    # Time this step spent in the collectives and point-to-point calls the producer saw,
    # summed over calls (asynchronous ones overlap, so it can exceed the step); 0: not timed.
    # The rank its peers wait on waits least: what the early flag reads (detectors/early.py).
    collective_ns: int = 0
    # The same collectives' time on the device (CUDA events, issue: GPU truth), summed; 0: not
    # timed on the device. For NCCL, whose host calls return at once, the only clock on which
    # a rank is seen waiting for its peers; the early flag reads it where it is sent.
    device_collective_ns: int = 0


class MetricSample(msgspec.Struct, tag="metric", kw_only=True, frozen=True):
    """One reading of one hardware or host counter (NVML, NIC, PCIe, CPU)."""

    v: int = SCHEMA_VERSION
    job_id: str
    host: str = ""
    rank: int = -1
    device: int = -1
    ts_ns: int
    name: str
    value: float


# Numeric columns of a StepBatch, one entry per step record (the fields of a StepRecord).
STEP_BATCH_COLUMNS: dict[str, str] = {
    "rank": "<i4",
    "step": "<i4",
    "start_ns": "<i8",
    "duration_ns": "<i8",
    "samples": "<i8",
    "tokens": "<i8",
    "seq_len_mean": "<f8",
    "seq_len_max": "<i8",
    "collective_ns": "<i8",
    "device_collective_ns": "<i8",
}
_OPTIONAL_STEP_COLUMNS = frozenset(
    {"samples", "tokens", "seq_len_mean", "seq_len_max", "collective_ns",
     "device_collective_ns"})

# Numeric columns of a MetricBatch, one entry per sample; ``host`` and ``name`` index the
# batch's ``hosts`` and ``names``.
METRIC_BATCH_COLUMNS: dict[str, str] = {
    "rank": "<i4",
    "device": "<i4",
    "host": "<i4",
    "name": "<i4",
    "ts_ns": "<i8",
    "value": "<f8",
}
_OPTIONAL_METRIC_COLUMNS = frozenset({"host"})  # empty: every sample from hosts[0]


# Column shapes remembered per batch kind (see _Lengths).
_MAX_SHAPES = 4096


class _Lengths:
    """The byte length of every column of a batch kind, checked against its rows: built once
    per kind, since decoding runs the check once per batch (a few thousand a second per
    core), where looking up each column's dtype again cost more than the check."""

    def __init__(self, columns: dict[str, str], optional: frozenset[str]) -> None:
        self.names = tuple(columns)
        self.read = operator.attrgetter(*self.names)  # the columns' bytes, in that order
        self.widths = tuple(np.dtype(dtype).itemsize for dtype in columns.values())
        self.optional = tuple(name in optional for name in self.names)
        # The columns' lengths of batches that passed: a producer sends the same few shapes
        # (a round's one or two steps, the same columns filled) message after message, so
        # most batches are one tuple look-up, not a test per column (bounded: cleared when
        # full).
        self._passed: set[tuple[int, ...]] = set()

    def check(self, record: Any) -> int:
        """The record's rows; a ValueError naming the first column of the wrong length."""
        n = len(record.rank) // 4
        lengths = tuple(map(len, self.read(record)))
        if lengths in self._passed:
            return n
        for length, width, optional, name in zip(lengths, self.widths, self.optional,
                                                 self.names, strict=True):
            if length != n * width and not (optional and not length):
                raise ValueError(f"column {name} holds {length} bytes, expected {n * width} "
                                 f"({n} rows of {width} bytes)")
        if len(self._passed) >= _MAX_SHAPES:
            self._passed.clear()
        self._passed.add(lengths)
        return n


_STEP_LENGTHS = _Lengths(STEP_BATCH_COLUMNS, _OPTIONAL_STEP_COLUMNS)
_METRIC_LENGTHS = _Lengths(METRIC_BATCH_COLUMNS, _OPTIONAL_METRIC_COLUMNS)


def _check_index(raw: bytes, entries: int, what: str) -> None:
    """Every value of an int32 index column below ``entries``."""
    if not raw:
        return
    # Read as unsigned, a negative index is huge: one reduction checks both bounds.
    if int(np.frombuffer(raw, dtype="<u4").max()) >= entries:
        index = np.frombuffer(raw, dtype="<i4")
        bad = int(index.min()) if index.min() < 0 else int(index.max())
        raise ValueError(f"{what} index {bad} out of range for {entries} {what}s")


def _pack(columns: dict[str, str], optional: frozenset[str], values: dict[str, Any]
          ) -> dict[str, bytes]:
    packed = {}
    for name, dtype in columns.items():
        column = values.pop(name, None)
        if column is None:
            if name in optional:
                packed[name] = b""
                continue
            raise TypeError(f"missing column {name}")
        array = np.ascontiguousarray(column, dtype=dtype)
        packed[name] = b"" if name in optional and not array.any() else array.tobytes()
    if values:
        raise TypeError(f"unknown columns: {sorted(values)}")
    return packed


def _joined(batches: Sequence[Any], name: str, dtype: str, optional: bool,
            raws: Sequence[bytes] | None = None) -> bytes:
    """One column of several batches, end to end (an empty optional column as zeros);
    ``raws``, the batches' bytes of it where the caller read them already."""
    if raws is None:
        raws = [getattr(b, name) for b in batches]
    if optional and not all(raws):
        if not any(raws):
            return b""
        width = np.dtype(dtype).itemsize
        raws = [raw or bytes(len(b) * width) for raw, b in zip(raws, batches, strict=True)]
    return b"".join(raws)


class StepBatch(msgspec.Struct, tag="steps", kw_only=True, frozen=True):
    """Many step records of one job, column by column (dtypes in ``STEP_BATCH_COLUMNS``)."""

    v: int = SCHEMA_VERSION
    job_id: str
    rank: bytes
    step: bytes
    start_ns: bytes
    duration_ns: bytes
    samples: bytes = b""
    tokens: bytes = b""
    seq_len_mean: bytes = b""
    seq_len_max: bytes = b""
    collective_ns: bytes = b""
    device_collective_ns: bytes = b""

    def __post_init__(self) -> None:
        _STEP_LENGTHS.check(self)

    def __len__(self) -> int:
        return len(self.rank) // 4

    def column(self, name: str) -> np.ndarray:
        """A read-only numpy view of one column (zeros for an empty optional one)."""
        raw = getattr(self, name)
        dtype = STEP_BATCH_COLUMNS[name]
        if not raw:
            return np.zeros(len(self), dtype=dtype)
        return np.frombuffer(raw, dtype=dtype)

    @classmethod
    def from_arrays(cls, *, job_id: str, **columns: Any) -> StepBatch:
        return cls(job_id=job_id,
                   **_pack(STEP_BATCH_COLUMNS, _OPTIONAL_STEP_COLUMNS, columns))

    @classmethod
    def from_records(cls, records: Sequence[StepRecord]) -> StepBatch:
        """Pack row records, all of one job, into one batch."""
        if not records:
            raise ValueError("cannot build a StepBatch from no step records")
        job_id = records[0].job_id
        if any(r.job_id != job_id for r in records):
            other = next(r.job_id for r in records if r.job_id != job_id)
            raise ValueError(f"step records of two jobs in one batch: {job_id!r}, {other!r}")
        return cls.from_arrays(
            job_id=job_id, **{name: [getattr(r, name) for r in records]
                              for name in STEP_BATCH_COLUMNS})

    @classmethod
    def concat(cls, batches: Sequence[StepBatch]) -> StepBatch:
        """The batches' rows end to end (all of one job)."""
        if len(batches) == 1:
            return batches[0]
        # Every column of every batch read in one pass (thousands of one-step batches a poll:
        # a getattr per column and batch cost more than the joins).
        by_column = zip(*map(_STEP_LENGTHS.read, batches), strict=True)
        return cls(job_id=batches[0].job_id, **{
            name: _joined(batches, name, dtype, name in _OPTIONAL_STEP_COLUMNS, raws)
            for (name, dtype), raws in zip(STEP_BATCH_COLUMNS.items(), by_column, strict=True)})

    def take(self, rows: np.ndarray) -> StepBatch:
        """The rows ``rows`` (indices or a mask), as a batch of their own."""
        return StepBatch(job_id=self.job_id, **{
            name: self.column(name)[rows].tobytes() if getattr(self, name) else b""
            for name in STEP_BATCH_COLUMNS})

    def to_records(self) -> list[StepRecord]:
        cols = {name: self.column(name).tolist() for name in STEP_BATCH_COLUMNS}
        return [StepRecord(job_id=self.job_id, **{name: cols[name][i] for name in cols})
                for i in range(len(self))]


class MetricBatch(msgspec.Struct, tag="metrics", kw_only=True, frozen=True):
    """Many metric samples of one job, column by column (dtypes in ``METRIC_BATCH_COLUMNS``);
    columns ``host`` and ``name`` hold, per sample, an index into ``hosts`` and ``names``."""

    v: int = SCHEMA_VERSION
    job_id: str
    hosts: list[str] = msgspec.field(default_factory=lambda: [""])
    names: list[str]
    rank: bytes
    device: bytes
    host: bytes = b""
    name: bytes
    ts_ns: bytes
    value: bytes

    def __post_init__(self) -> None:
        n = _METRIC_LENGTHS.check(self)
        if n and not self.hosts:
            raise ValueError(f"{n} samples but no hosts declared")
        _check_index(self.host, len(self.hosts), "host")
        if n and not self.names:
            raise ValueError(f"{n} samples but no metric names declared")
        _check_index(self.name, len(self.names), "name")

    def __len__(self) -> int:
        return len(self.rank) // 4

    def column(self, name: str) -> np.ndarray:
        """A read-only numpy view of one column (zeros for an empty optional one)."""
        raw = getattr(self, name)
        dtype = METRIC_BATCH_COLUMNS[name]
        if not raw:
            return np.zeros(len(self), dtype=dtype)
        return np.frombuffer(raw, dtype=dtype)

    @classmethod
    def from_arrays(cls, *, job_id: str, hosts: list[str], names: list[str], **columns: Any
                    ) -> MetricBatch:
        return cls(job_id=job_id, hosts=list(hosts), names=list(names),
                   **_pack(METRIC_BATCH_COLUMNS, _OPTIONAL_METRIC_COLUMNS, columns))

    @classmethod
    def from_records(cls, records: Sequence[MetricSample]) -> MetricBatch:
        """Pack row samples, all of one job, into one batch."""
        if not records:
            raise ValueError("cannot build a MetricBatch from no metric samples")
        job_id = records[0].job_id
        hosts: dict[str, int] = {}
        names: dict[str, int] = {}
        host, name = [], []
        for r in records:
            if r.job_id != job_id:
                raise ValueError(f"metric samples of two jobs in one batch: {job_id!r}, "
                                 f"{r.job_id!r}")
            host.append(hosts.setdefault(r.host, len(hosts)))
            name.append(names.setdefault(r.name, len(names)))
        return cls.from_arrays(
            job_id=job_id, hosts=list(hosts), names=list(names), host=host, name=name,
            rank=[r.rank for r in records], device=[r.device for r in records],
            ts_ns=[r.ts_ns for r in records], value=[r.value for r in records])

    @classmethod
    def concat(cls, batches: Sequence[MetricBatch]) -> MetricBatch:
        """The batches' samples end to end (all of one job), their dictionaries merged."""
        if len(batches) == 1:
            return batches[0]
        hosts: dict[str, int] = {}
        names: dict[str, int] = {}
        host_parts, name_parts = [], []
        for b in batches:
            host_ids = np.array([hosts.setdefault(h, len(hosts)) for h in b.hosts],
                                dtype="<i4")
            name_ids = np.array([names.setdefault(n, len(names)) for n in b.names],
                                dtype="<i4")
            host_parts.append(host_ids[b.column("host")] if len(b) else host_ids[:0])
            name_parts.append(name_ids[b.column("name")] if len(b) else name_ids[:0])
        host = np.concatenate(host_parts)
        return cls(
            job_id=batches[0].job_id, hosts=list(hosts) or [""], names=list(names),
            host=host.tobytes() if host.any() else b"",
            name=np.concatenate(name_parts).tobytes(),
            **{column: b"".join(getattr(b, column) for b in batches)
               for column in ("rank", "device", "ts_ns", "value")})

    def take(self, rows: np.ndarray) -> MetricBatch:
        """The samples ``rows`` (indices or a mask), as a batch of their own."""
        return MetricBatch(job_id=self.job_id, hosts=self.hosts, names=self.names, **{
            name: self.column(name)[rows].tobytes() if getattr(self, name) else b""
            for name in METRIC_BATCH_COLUMNS})

    def to_records(self) -> list[MetricSample]:
        hosts, names = self.hosts, self.names
        rank, device, ts_ns, value = (self.column(c).tolist()
                                      for c in ("rank", "device", "ts_ns", "value"))
        host, name = self.column("host").tolist(), self.column("name").tolist()
        return [MetricSample(job_id=self.job_id, host=hosts[host[i]], rank=rank[i],
                             device=device[i], ts_ns=ts_ns[i], name=names[name[i]],
                             value=value[i])
                for i in range(len(self))]


def steps_by_job(records: Iterable[StepRecord | StepBatch]) -> dict[str, StepBatch]:
    """Rows and batches of step records, one batch per job (rows packed, batches joined)."""
    rows: dict[str, list[StepRecord]] = {}
    batches: dict[str, list[StepBatch]] = {}
    for record in records:
        if isinstance(record, StepBatch):
            if len(record):
                batches.setdefault(record.job_id, []).append(record)
        else:
            rows.setdefault(record.job_id, []).append(record)
    for job_id, job_rows in rows.items():
        batches.setdefault(job_id, []).append(StepBatch.from_records(job_rows))
    return {job_id: StepBatch.concat(parts) for job_id, parts in batches.items()}


def metrics_by_job(records: Iterable[MetricSample | MetricBatch]) -> dict[str, MetricBatch]:
    """Rows and batches of metric samples, one batch per job (rows packed, batches joined)."""
    rows: dict[str, list[MetricSample]] = {}
    batches: dict[str, list[MetricBatch]] = {}
    for record in records:
        if isinstance(record, MetricBatch):
            if len(record):
                batches.setdefault(record.job_id, []).append(record)
        else:
            rows.setdefault(record.job_id, []).append(record)
    for job_id, job_rows in rows.items():
        batches.setdefault(job_id, []).append(MetricBatch.from_records(job_rows))
    return {job_id: MetricBatch.concat(parts) for job_id, parts in batches.items()}
