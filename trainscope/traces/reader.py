"""Streaming ingestion of Kineto/Chrome traces into compact columns, counting every event.

A trace is read with a streaming JSON parser (ijson), plain or gzip, so a multi-gigabyte file
never sits in memory: each event is reduced to a few integers on the fly (class, name id,
thread id, start, duration, correlation id, external id, bytes), about 60 bytes an event
instead of the ~300 its JSON takes. Every event is counted under a label — its class for
complete events, ``flow:<cat>`` for flows, ``metadata``, ``instant`` … — as read, kept or
skipped, and a skipped one with the reason, so nothing disappears without a count.

The rank comes from the trace's ``distributedInfo``, else from the caller (``--rank``), else
it is an error: a file name such as torch's ``host_pid.ts.pt.trace.json`` is never read as a
rank. Times are exact: ``ts``/``dur`` are parsed as decimals (microseconds with three
decimals) and turned into integer nanoseconds, ``baseTimeNanoseconds`` added to ``ts``.
"""

from __future__ import annotations

import gzip
import zlib
from array import array
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import IO, Any

import numpy as np

from trainscope.schemas.callpath import normalise_name
from trainscope.schemas.errors import TrainscopeError
from trainscope.traces.classes import (
    CLASS_INDEX,
    CLASSES,
    LAUNCH_FLOW_CATEGORIES,
    PROFILER_CATEGORIES,
    event_class,
)

TRACE_SUFFIXES = (".json", ".json.gz")
_READ_CHUNK = 1 << 20


class KinetoError(ValueError, TrainscopeError):
    """A trace that cannot be read; the message names the file and the position."""


@dataclass
class IngestCounts:
    """Events of one trace per label: read, kept, and skipped per reason."""

    read: Counter[str] = field(default_factory=Counter)
    kept: Counter[str] = field(default_factory=Counter)
    skipped: Counter[tuple[str, str]] = field(default_factory=Counter)

    @property
    def total_read(self) -> int:
        return sum(self.read.values())

    @property
    def total_kept(self) -> int:
        return sum(self.kept.values())

    def rows(self) -> list[tuple[str, int, int, int, str]]:
        """(label, read, kept, skipped, reasons) per label, classes first."""
        order = {name: i for i, name in enumerate(CLASSES)}
        out = []
        for label in sorted(self.read, key=lambda x: (order.get(x, len(order)), x)):
            reasons = {r: n for (lab, r), n in self.skipped.items() if lab == label}
            out.append((label, self.read[label], self.kept[label], sum(reasons.values()),
                        "; ".join(f"{r} ({n})" for r, n in sorted(reasons.items()))))
        return out

    def add(self, other: IngestCounts) -> None:
        self.read.update(other.read)
        self.kept.update(other.kept)
        self.skipped.update(other.skipped)


@dataclass
class Trace:
    """One rank's trace as columns: one entry per kept complete event."""

    path: Path
    rank: int
    rank_source: str
    world_size: int
    base_ns: int
    names: list[str]
    threads: list[tuple[Any, Any]]  # (pid, tid) per thread id
    cls: np.ndarray  # index into CLASSES
    name_id: np.ndarray
    thread: np.ndarray
    start_ns: np.ndarray  # absolute, ns since the epoch
    dur_ns: np.ndarray
    correlation: np.ndarray  # -1: none
    external: np.ndarray  # -1: none
    bytes_moved: np.ndarray
    # Launch flows (ac2g), one row each: (1 for the start at the runtime call, 0 for the end
    # at the device event; thread id; ts in ns since the epoch; flow id).
    flows: np.ndarray
    counts: IngestCounts

    def __len__(self) -> int:
        return len(self.start_ns)


def trace_files(paths: list[str | Path]) -> list[Path]:
    """Expand directories into the trace files they contain (sorted)."""
    out: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.name.endswith(TRACE_SUFFIXES))
            if not found:
                raise KinetoError(f"{path}: directory holds no *.json or *.json.gz trace")
            out.extend(found)
        elif path.exists():
            out.append(path)
        else:
            raise KinetoError(f"{path}: no such file or directory")
    return out


class _Counting:
    """A binary stream that counts what was read, so errors can say where they happened."""

    def __init__(self, raw: IO[bytes], path: Path) -> None:
        self.raw, self.path, self.position = raw, path, 0

    def read(self, size: int = -1) -> bytes:
        try:
            data = self.raw.read(_READ_CHUNK if size < 0 else size)
        except EOFError:
            raise KinetoError(
                f"{self.path}: truncated gzip file: the compressed stream ends after "
                f"{self.position} bytes of JSON"
            ) from None
        except (OSError, zlib.error) as exc:
            raise KinetoError(f"{self.path}: corrupt gzip data ({exc})") from None
        self.position += len(data)
        return data


def _open(path: Path) -> _Counting:
    with path.open("rb") as probe:
        magic = probe.read(2)
    # Closed by whoever reads it (every reader closes it in a finally block).
    raw: IO[bytes] = gzip.open(path, "rb") if magic == b"\x1f\x8b" else path.open("rb")  # noqa: SIM115
    stream = _Counting(raw, path)
    if magic != b"\x1f\x8b":
        try:
            _check_json_start(path)
        except KinetoError:
            raw.close()
            raise
    return stream


# First bytes of the files people hand us by mistake: an op trace (Parquet) or its metadata.
_NOT_JSON_MAGIC = {b"PAR1": "a Parquet file", b"PK\x03\x04": "a ZIP archive"}


def _check_json_start(path: Path) -> None:
    """A trace is a JSON object: say so for any other file, before the JSON parser's error
    (which calls every bad byte an incomplete document, so it would read as a truncated trace).
    """
    with path.open("rb") as probe:
        head = probe.read(256)
    for magic, kind in _NOT_JSON_MAGIC.items():
        if head.startswith(magic):
            raise KinetoError(f"{path}: not JSON: it is {kind}; replay kineto reads Chrome/Kineto "
                              f"JSON traces (.json or .json.gz)")
    first = head.lstrip(b"\xef\xbb\xbf \t\r\n")[:1]
    if first and first not in b"{[":
        looks = " (it looks like YAML)" if _looks_like_yaml(head) else ""
        raise KinetoError(f"{path}: not JSON{looks}: a trace starts with '{{', this file with "
                          f"{first.decode('latin-1')!r}; replay kineto reads Chrome/Kineto JSON "
                          f"traces (.json or .json.gz)")


def _looks_like_yaml(head: bytes) -> bool:
    text = head.decode("utf-8", "replace").lstrip()
    first_line = text.splitlines()[0] if text else ""
    return text.startswith(("---", "%YAML")) or (":" in first_line and '"' not in first_line[:1])


def _json_error(path: Path, stream: _Counting, exc: Exception) -> KinetoError:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    truncated = "incomplete" in type(exc).__name__.lower() or "premature" in text
    return KinetoError(
        f"{path}: invalid JSON near byte {stream.position}: {text}"
        + (" — the file looks truncated" if truncated else "")
    )


def _header(path: Path) -> tuple[dict[str, Any], bool]:
    """Top-level values written before ``traceEvents``, and whether ``traceEvents`` is a list."""
    import ijson
    from ijson.common import ObjectBuilder

    values: dict[str, Any] = {}
    stream = _open(path)
    key: str | None = None
    builder: Any = None
    try:
        events = ijson.parse(stream)
        for prefix, event, value in events:
            if prefix == "" and event in ("map_key", "end_map"):
                if key is not None and builder is not None:
                    values[key] = builder.value
                key, builder = (value, ObjectBuilder()) if event == "map_key" else (None, None)
                if key == "traceEvents":
                    _, first, _ = next(events)
                    return values, first == "start_array"
            elif prefix == "" and event != "start_map":
                raise KinetoError(f"{path}: not a Chrome trace: the top level is not an object")
            elif builder is not None:
                builder.event(event, value)
    except ijson.JSONError as exc:
        raise _json_error(path, stream, exc) from None
    finally:
        stream.raw.close()
    return values, False


def _trailing(path: Path, key: str) -> Any:
    """A top-level value written after ``traceEvents`` (a second pass; rare)."""
    import ijson

    stream = _open(path)
    try:
        for value in ijson.items(stream, key):
            return value
    except ijson.JSONError as exc:
        raise _json_error(path, stream, exc) from None
    finally:
        stream.raw.close()
    return None


def _ns(value: Any) -> int:
    """Microseconds (int or exact decimal) → integer nanoseconds."""
    if type(value) is int:
        return value * 1000
    return round(value * 1000)


def read_trace(path: Path, rank: int | None = None) -> Trace:
    """Stream one trace file into columns; ``rank`` is used only when it has no
    ``distributedInfo`` (and must agree with it when it has one)."""
    header, is_list = _header(path)
    if not is_list:
        raise KinetoError(f"{path}: not a Chrome trace: no 'traceEvents' list at the top level")
    columns, counts = _Columns(), IngestCounts()
    _read_events(path, columns, counts)
    info = header.get("distributedInfo")
    if info is None and rank is None:
        info = _trailing(path, "distributedInfo")
    resolved, source, world = _rank(path, info, rank)
    base = header.get("baseTimeNanoseconds")
    if base is None:
        base = _trailing(path, "baseTimeNanoseconds") or 0
    if type(base) is not int:
        raise KinetoError(f"{path}: baseTimeNanoseconds is {base!r}, expected an integer")
    if not counts.total_read:
        raise KinetoError(f"{path}: the trace holds no events (traceEvents is empty)")
    if not counts.total_kept:
        found = ", ".join(f"{label} ({n})" for label, n in counts.read.most_common(6))
        raise KinetoError(
            f"{path}: none of its {counts.total_read} events is of a known class "
            f"(found: {found}); known classes: {', '.join(CLASSES)} and their older spellings"
        )
    return columns.trace(path, resolved, source, world, base, counts)


class _Columns:
    """The kept events of a trace as growing typed arrays, and the names and threads their
    small ids index, until :meth:`trace` turns them into a :class:`Trace`."""

    def __init__(self) -> None:
        # Narrow types where they suffice: ~44 bytes an event while reading.
        self.cls, self.name, self.thread = array("b"), array("i"), array("i")
        self.start, self.dur = array("q"), array("q")
        self.corr, self.ext, self.bytes = array("q"), array("q"), array("q")
        # Four values per launch flow: start (1) or end (0), thread id, ts in ns, flow id.
        self.flows = array("q")
        self.names: list[str] = []
        self.name_ids: dict[str, int] = {}  # raw name → id of its normalised name
        self._normal_ids: dict[str, int] = {}
        self.threads: list[tuple[Any, Any]] = []
        self.thread_ids: dict[tuple[Any, Any], int] = {}

    def add_name(self, name: str) -> int:
        """The id of a raw name not seen before."""
        # Names that differ only in an object address are one function.
        normal = normalise_name(name)
        name_id = self._normal_ids.get(normal)
        if name_id is None:
            name_id = self._normal_ids[normal] = len(self.names)
            self.names.append(normal)
        self.name_ids[name] = name_id
        return name_id

    def add_thread(self, key: tuple[Any, Any]) -> int:
        """The id of a (pid, tid) not seen before."""
        thread = self.thread_ids[key] = len(self.threads)
        self.threads.append(key)
        return thread

    def trace(
        self, path: Path, rank: int, source: str, world: int, base: int, counts: IngestCounts
    ) -> Trace:
        def column(values: array, dtype: str) -> np.ndarray:
            return np.frombuffer(values, dtype=dtype)  # a view: no copy

        start = column(self.start, "int64") + base
        self.start = array("q")
        flow_rows = np.frombuffer(self.flows, dtype=np.int64).reshape(-1, 4).copy()
        flow_rows[:, 2] += base
        return Trace(
            path=path, rank=rank, rank_source=source, world_size=world, base_ns=base,
            names=self.names, threads=self.threads, cls=column(self.cls, "int8"),
            name_id=column(self.name, f"int{8 * self.name.itemsize}"),
            thread=column(self.thread, f"int{8 * self.thread.itemsize}"), start_ns=start,
            dur_ns=column(self.dur, "int64"), correlation=column(self.corr, "int64"),
            external=column(self.ext, "int64"), bytes_moved=column(self.bytes, "int64"),
            flows=flow_rows,
            counts=counts,
        )


def _read_events(path: Path, columns: _Columns, counts: IngestCounts) -> None:
    """Stream ``traceEvents`` into ``columns``, counting every event as read, kept or skipped.

    This loop runs once per event of a multi-gigabyte trace, so a complete event's work stays
    inline (bound appends, dictionary lookups); only the other events and the rare cases (a
    name or thread seen for the first time, a skip, an error) call out.
    """
    import ijson

    read, kept = counts.read, counts.kept
    a_cls, a_name, a_thread = columns.cls.append, columns.name.append, columns.thread.append
    a_start, a_dur, a_corr = columns.start.append, columns.dur.append, columns.corr.append
    a_ext, a_bytes = columns.ext.append, columns.bytes.append
    name_ids, thread_ids = columns.name_ids, columns.thread_ids
    class_of: dict[str, str | None] = {}
    stream = _open(path)
    try:
        for index, event in enumerate(ijson.items(stream, "traceEvents.item")):
            if type(event) is not dict:
                _skip(counts, "(not an object)", "not a JSON object")
                continue
            ph = event.get("ph")
            cat = event.get("cat")
            cat = cat if isinstance(cat, str) else ""
            if ph != "X":
                _other_event(columns, counts, event, ph, cat)
                continue
            cls = class_of.get(cat, "?")
            if cls == "?":
                cls = class_of[cat] = event_class(cat)
            if cls is None:
                label = cat or "(no category)"
                _skip(counts, label, "the profiler's own span"
                      if cat.lower() in PROFILER_CATEGORIES else "not a known event class")
                continue
            name, ts, dur = event.get("name"), event.get("ts"), event.get("dur")
            if (not isinstance(name, str) or not isinstance(ts, int | Decimal)
                    or not isinstance(dur, int | Decimal)):
                raise KinetoError(
                    f"{path}: traceEvents[{index}] is a complete event without a valid "
                    f"name/ts/dur: {str(event)[:120]}"
                )
            read[cls] += 1
            kept[cls] += 1
            name_id = name_ids.get(name)
            if name_id is None:
                name_id = columns.add_name(name)
            key = (event.get("pid"), event.get("tid"))
            thread = thread_ids.get(key)
            if thread is None:
                thread = columns.add_thread(key)
            args = event.get("args")
            if type(args) is dict:
                corr, ext, moved = (args.get("correlation"), args.get("External id"),
                                    args.get("bytes"))
            else:
                corr = ext = moved = None
            a_cls(CLASS_INDEX[cls])
            a_name(name_id)
            a_thread(thread)
            a_start(_ns(ts))
            a_dur(max(0, _ns(dur)))
            a_corr(corr if type(corr) is int else -1)
            a_ext(ext if type(ext) is int else -1)
            a_bytes(moved if type(moved) is int else 0)
    except ijson.JSONError as exc:
        raise _json_error(path, stream, exc) from None
    finally:
        stream.raw.close()


def _skip(counts: IngestCounts, label: str, reason: str) -> None:
    counts.read[label] += 1
    counts.skipped[(label, reason)] += 1


def _other_event(
    columns: _Columns, counts: IngestCounts, event: dict[str, Any], ph: Any, cat: str
) -> None:
    """An event that is not a complete one: a launch flow is kept, the rest counted."""
    if ph in ("s", "t", "f"):
        label = f"flow:{cat or '(no category)'}"
        flow_id, ts = event.get("id"), event.get("ts")
        if cat.lower() not in LAUNCH_FLOW_CATEGORIES:
            _skip(counts, label, "not a launch flow (only those link events)")
        elif type(flow_id) is not int or not isinstance(ts, int | Decimal):
            _skip(counts, label, "no integer id or no ts")
        else:
            counts.read[label] += 1
            counts.kept[label] += 1
            key = (event.get("pid"), event.get("tid"))
            thread = columns.thread_ids.get(key)
            if thread is None:
                thread = columns.add_thread(key)
            columns.flows.extend((ph == "s", thread, _ns(ts), flow_id))
    elif ph == "M":
        _skip(counts, "metadata", "process/thread names, not timed")
    elif ph in ("i", "I"):
        _skip(counts, "instant", "instant event, no duration")
    else:
        _skip(counts, f"ph:{ph}", "event type not read (only X, flows, M, i)")


def _rank(path: Path, info: Any, rank: int | None) -> tuple[int, str, int]:
    world = 0
    if isinstance(info, dict):
        world = info.get("world_size") if type(info.get("world_size")) is int else 0
        if type(info.get("rank")) is int:
            found = int(info["rank"])
            if rank is not None and rank != found:
                raise KinetoError(
                    f"{path}: --rank {rank} disagrees with the trace's distributedInfo "
                    f"(rank {found})"
                )
            return found, "distributedInfo", world
    if rank is not None:
        return rank, "--rank", world
    raise KinetoError(
        f"{path}: cannot tell the rank: the trace has no distributedInfo (a process without "
        "torch.distributed); pass --rank N for a single file"
    )


def iter_traces(paths: list[Path], rank: int | None = None) -> Iterator[Trace]:
    """Read traces one after the other (each is released before the next is read)."""
    for path in paths:
        yield read_trace(path, rank)
