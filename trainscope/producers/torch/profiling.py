"""On-demand fine-grained profiling: torch.profiler for K steps, summarised in-process.

A request (from the control topic) arms the controller; the training thread starts the
profiler at the next step boundary and stops it after K steps or when the time budget is spent,
whichever comes first. Only one session runs per process, and the next starts once the last
is summarised. Stopping hands the raw result to the sender's task thread, which walks the
event tree and condenses it per function:

- ``python`` (Python frames), ``user_annotation`` (``record_function`` blocks), ``torch_op``
  (ATen ops), ``cuda_kernel``, ``cuda_api`` (runtime calls such as cudaLaunchKernel),
  ``memcpy``/memset, and ``collective`` for the ops and kernels of collectives (``c10d::``,
  ``gloo:``, NCCL), as the trace ingestion names them;
- ``callpath_id`` identifies the chain Python frame → op → kernel that led to the event: it is a
  hash of the parent's call-path id, the layer and the name, so a kernel's id is derived from
  the op that launched it, and that op's from the Python frame that called it. The table
  ``id → (parent id, layer, name)`` is kept on the session report and published, with each
  path's count and time over the session, as :class:`ProfileCallPaths` records (the stream job
  stores them in ``call_paths`` and diffs a suspect rank's tree against a peer's).

The low-level profiler API is used (enable/disable, then the event tree) instead of
``torch.profiler.profile.stop()``, which parses the whole trace on the calling thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trainscope.schemas.callpath import (
    callpath_id,
    collective_or,
    enclosing_depth,
    normalise_name,
)
from trainscope.schemas.metrics import PROFILER_BUSY_S
from trainscope.schemas.records import (
    ControlMessage,
    MetricSample,
    ProfileCallPaths,
    SummaryBatch,
)
from trainscope.schemas.summaries import FunctionKey, summary_batches

if TYPE_CHECKING:
    from trainscope.producers.torch.runtime import Attachment

# Distinct (window, layer, name, call path) entries one session may produce; the rest are
# folded into their function without a call path (counted in ``folded``).
MAX_FUNCTIONS = 20_000
# Call paths per ProfileCallPaths record: with names of a few hundred characters a part stays
# far below Kafka's 1 MiB message limit.
CALLPATHS_PER_PART = 1_000
# Reports a process keeps (``ProfileController.reports``), newest last.
KEPT_REPORTS = 16
# A session still busy is reported at most this often (and once more when it ends).
BUSY_REPORT_NS = 400_000_000
# Device-side layers: their time overlaps the host's, so it is not taken from a parent's self time.
_DEVICE_LAYERS = frozenset({"cuda_kernel", "memcpy"})

_RUNTIME_PREFIXES = ("cuda", "cu", "hip", "nccl")


def classify_kineto(name: str) -> str:
    """Layer of a Kineto (device-side or runtime) event, from its name."""
    lowered = name.lower()
    if lowered.startswith(_RUNTIME_PREFIXES):
        return "cuda_api"  # cudaLaunchKernel, cudaMemcpyAsync, cuLaunchKernelEx, ...
    if lowered.startswith(("memcpy", "memset")):
        return "memcpy"  # device copies: "Memcpy HtoD (Pageable -> Device)"
    return "cuda_kernel"


@dataclass
class ProfileReport:
    request_id: str
    steps_requested: int
    steps_profiled: int = 0
    started_ns: int = 0
    stopped_ns: int = 0
    stop_reason: str = ""
    summaries: int = 0
    events: int = 0
    folded: int = 0
    callpaths: dict[int, tuple[int, str, str]] = field(default_factory=dict)
    # Per call path over the whole session: executions, their time, and their host-side
    # children's time (for self time).
    path_counts: dict[int, int] = field(default_factory=dict)
    path_total_ns: dict[int, int] = field(default_factory=dict)
    path_child_ns: dict[int, int] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)


class ProfileController:
    def __init__(self, att: Attachment, budget_s: float, max_steps: int) -> None:
        self.att = att
        self.budget_ns = int(budget_s * 1e9)
        self.max_steps = max_steps
        self._lock = threading.Lock()
        # A request not yet started, and the session running: while both are None the step
        # boundary (``Attachment.end_step``) does not call :meth:`on_step_end` at all.
        self.pending: ControlMessage | None = None
        self.session: ProfileReport | None = None
        # The last session, until the task thread has summarised it: the next one waits, or
        # torch's Python tracer would record the summarising itself (on every thread alive at
        # start), the next summary would take longer, and so on: in a stress run, back-to-back
        # sessions grew a rank to 18 GB and held one in the profiler's stop for minutes.
        self._summarising: ProfileReport | None = None
        self._steps_left = 0
        # The latest sessions' reports (their call-path tables): a long job profiled on every
        # finding would otherwise keep all of them.
        self.reports: deque[ProfileReport] = deque(maxlen=KEPT_REPORTS)
        self.counts = {"requested": 0, "started": 0, "completed": 0, "rejected": 0}
        # From a session's start to the end of its condensing (0: none since the last report),
        # and up to when :meth:`busy_report` has reported it.
        self._busy_from_ns = 0
        self._busy_to_ns = 0
        self._reported_to_ns = 0

    # -- control thread -----------------------------------------------------------------------
    def request(self, message: ControlMessage) -> None:
        with self._lock:
            self.counts["requested"] += 1
            if self.pending is not None or self.session is not None or message.steps < 1:
                self.counts["rejected"] += 1
                self.att.guard.warn_once(
                    "profile busy",
                    "trainscope: profiling request %r ignored: a session is already pending or "
                    "running (one per process), or it asked for no steps",
                    message.request_id,
                )
                return
            self.pending = message

    @property
    def active(self) -> bool:
        return self.session is not None

    # -- sender thread ------------------------------------------------------------------------
    def busy_report(self, now_ns: int, job_id: str, rank: int, host: str) -> list[MetricSample]:
        """How long since the last report a session of ours recorded or was condensed
        (``profiler_busy_s``); nothing while none did. A profile slows its rank (the
        profiler's stop, then a walk over its events holding the GIL): the stream job explains
        that as trainscope's own cost instead of alerting it."""
        with self._lock:
            start, end = self._busy_from_ns, self._busy_to_ns
            if not start or (not end and now_ns - self._reported_to_ns < BUSY_REPORT_NS):
                return []  # the sender's rounds come faster while a session sends its parts
            until_ns = end or now_ns  # a session ends before the report that sees it
            busy_ns = max(0, until_ns - max(start, self._reported_to_ns))
            self._reported_to_ns = now_ns
            if end:
                self._busy_from_ns = self._busy_to_ns = 0
        return [MetricSample(job_id=job_id, host=host, rank=rank, ts_ns=until_ns,
                             name=PROFILER_BUSY_S, value=round(busy_ns / 1e9, 3))]

    # -- training thread ----------------------------------------------------------------------
    def on_step_end(self, now_ns: int) -> None:
        """Called at every step boundary; cheap unless a session starts or ends."""
        if self.session is not None:
            self._steps_left -= 1
            self.session.steps_profiled += 1
            if self._steps_left <= 0:
                self._stop("steps done")
            elif now_ns - self.session.started_ns > self.budget_ns:
                self._stop("time budget spent")
        elif self.pending is not None and (
                self._summarising is None or self._summarising.done.is_set()):
            self._start()

    def _start(self) -> None:
        with self._lock:
            message, self.pending = self.pending, None
        if message is None:
            return
        from torch.autograd import _profiler_enabled

        if _profiler_enabled():
            self.counts["rejected"] += 1
            self.att.guard.warn_once(
                "profile user profiler",
                "trainscope: profiling request ignored: torch.profiler is already running",
            )
            return
        _enable()
        steps = min(message.steps, self.max_steps)
        report = ProfileReport(request_id=message.request_id, steps_requested=message.steps)
        report.started_ns = time.time_ns()
        with self._lock:
            self._busy_from_ns, self._busy_to_ns = report.started_ns, 0
        self._steps_left = steps
        self.session = report
        self.counts["started"] += 1

    def _stop(self, reason: str) -> None:
        report, self.session = self.session, None
        if report is None:
            return
        result = _disable()
        report.stopped_ns = time.time_ns()
        report.stop_reason = reason
        self._summarising = report
        att = self.att

        def summarise() -> list[SummaryBatch | ProfileCallPaths]:
            try:
                summaries = summarise_result(result, att, report)
                report.summaries = sum(len(batch) for batch in summaries)
                self.counts["completed"] += 1
                self.reports.append(report)
                return [*summaries, *call_path_parts(report, att.options.job_id,
                                                     att.options.rank)]
            finally:
                with self._lock:
                    self._busy_to_ns = time.time_ns()
                report.done.set()

        att.sender.submit_task(summarise)

    def abort(self) -> None:
        """At detach: a running session is stopped and its result discarded."""
        if self.session is not None:
            self.session = None
            with self._lock:
                self._busy_to_ns = time.time_ns()
            try:
                _disable()
            except Exception as exc:
                self.att.guard.report("profiler stop", exc)


def _config() -> tuple[Any, set[Any]]:
    import torch
    from torch._C._profiler import ProfilerActivity, _ExperimentalConfig
    from torch.autograd import ProfilerConfig, ProfilerState

    activities = {ProfilerActivity.CPU}
    if torch.cuda.is_available():
        activities.add(ProfilerActivity.CUDA)
    config = ProfilerConfig(
        ProfilerState.KINETO,
        False,  # record shapes
        False,  # profile memory
        True,  # with_stack: Python frames, needed for call paths
        False,  # with_flops
        False,  # with_modules
        _ExperimentalConfig(),
    )
    return config, activities


# A record_function block opened on the training thread as the session starts: it tells the
# training thread's events from those of other threads (see summarise_result).
THREAD_MARK = "trainscope#training-thread"


def _enable() -> None:
    from torch.autograd.profiler import _enable_profiler, _prepare_profiler, record_function

    config, activities = _config()
    _prepare_profiler(config, activities)
    _enable_profiler(config, activities)
    with record_function(THREAD_MARK):
        pass


def _disable() -> Any:
    from torch.autograd.profiler import _disable_profiler

    return _disable_profiler()


def _thread_of_mark(roots: list[Any]) -> int | None:
    """The profiler's id of the thread that opened ``THREAD_MARK`` (None if it is missing)."""
    stack = list(reversed(roots))
    while stack:
        event = stack.pop()
        if event.name == THREAD_MARK:
            return int(event.start_tid)
        stack.extend(reversed(event.children))
    return None


# Tie-break for host events with equal start and duration: the outer one first.
_HOST_ORDER = {"python": 0, "user_annotation": 1, "torch_op": 2, "cuda_api": 3}


def summarise_result(result: Any, att: Attachment, report: ProfileReport) -> list[SummaryBatch]:
    """Condense the profiler's events into per-(window, function, call path) summaries.

    Host events nest by time on their thread, as in :mod:`trainscope.traces.cct`, so live and
    replayed call paths share their ids: an event hangs under the innermost one that encloses
    it whole. (The profiler's own tree puts a ``record_function`` block under the
    ``__enter__`` frame that opened it, and what runs inside the block beside it.) Device
    events hang under the runtime call with the same correlation id.
    """
    durations: dict[tuple[int, str, str, int], list[int]] = {}
    window_ns = att.recorder.window_ns
    host, device = _flatten(result.experimental_event_tree())
    host.sort(key=lambda e: (e[0], e[1], -e[2], _HOST_ORDER.get(e[3], 9)))

    def add(start: int, duration: int, parent: int, layer: str, name: str) -> int:
        cp = callpath_id(parent, layer, name)
        report.callpaths.setdefault(cp, (parent, layer, name))
        window = start // window_ns * window_ns
        key = (window, layer, name, cp)
        bucket = durations.get(key)
        if bucket is None:
            if len(durations) >= MAX_FUNCTIONS:
                report.folded += 1
                key = (window, layer, name, 0)
                bucket = durations.setdefault(key, [])
            else:
                bucket = durations[key] = []
        bucket.append(duration)
        report.events += 1
        report.path_counts[cp] = report.path_counts.get(cp, 0) + 1
        report.path_total_ns[cp] = report.path_total_ns.get(cp, 0) + duration
        return cp

    launches: dict[int, int] = {}
    stack: list[tuple[int, int]] = []  # (end ns, call path) of the enclosing events
    thread = None
    for tid, start, duration, layer, name, correlation in host:
        end = start + duration
        if tid != thread:
            stack.clear()
            thread = tid
        depth = enclosing_depth(stack, start, end)
        parent = stack[depth][1] if depth >= 0 else 0
        cp = add(start, duration, parent, layer, name)
        if parent:
            report.path_child_ns[parent] = report.path_child_ns.get(parent, 0) + duration
        stack.append((end, cp))
        if layer == "cuda_api" and correlation:
            launches[correlation] = cp
    for start, duration, layer, name, correlation in device:
        add(start, duration, launches.get(correlation, 0), layer, name)
    by_window: dict[int, dict[FunctionKey, list[int]]] = {}
    for (window, layer, name, cp), values in durations.items():
        by_window.setdefault(window, {})[(layer, name, cp)] = values
    options = att.options
    return [
        batch
        for window, functions in sorted(by_window.items())
        for batch in summary_batches(
            functions,
            job_id=options.job_id,
            rank=options.rank,
            window_start_ns=window,
            window_end_ns=window + window_ns,
        )
    ]


HostEvent = tuple[int, int, int, str, str, int]  # thread, start, duration, layer, name, corr.
DeviceEvent = tuple[int, int, str, str, int]  # start, duration, layer, name, correlation


def _flatten(roots: list[Any]) -> tuple[list[HostEvent], list[DeviceEvent]]:
    """The functions among the profiler's events, host and device apart.

    Python frames of other threads than the training thread are left out (their ops are
    kept): those threads (our own sender and control listener, loaders' helpers) mostly wait,
    and their waits grow with the session's length, which is not where a rank's steps spend
    their time. Allocations and backend events are not functions either.
    """
    from torch._C._profiler import RecordScope, _EventType

    user_scope = RecordScope.USER_SCOPE
    python_tags = {_EventType.PyCall, _EventType.PyCCall}
    training = _thread_of_mark(roots)
    host: list[HostEvent] = []
    device: list[DeviceEvent] = []
    stack = list(reversed(roots))
    while stack:
        event = stack.pop()
        stack.extend(reversed(event.children))
        tag = event.tag
        if tag in python_tags:
            if training is not None and event.start_tid != training:
                continue
            layer = "python"
        elif tag == _EventType.TorchOp:
            if event.name == THREAD_MARK:
                continue
            # record_function blocks (user scope) are annotations, as in Kineto traces.
            layer = "user_annotation" if event.extra_fields.scope == user_scope else "torch_op"
        elif tag == _EventType.Kineto:
            layer = classify_kineto(event.name)
        else:
            continue
        start = int(event.start_time_ns)
        duration = max(0, int(event.duration_time_ns))
        name = normalise_name(event.name)
        on_device = layer in _DEVICE_LAYERS
        layer = collective_or(layer, name)  # as the trace ingestion has it
        correlation = int(getattr(event, "correlation_id", 0) or 0)
        if on_device:
            device.append((start, duration, layer, name, correlation))
        else:
            host.append((int(event.start_tid), start, duration, layer, name, correlation))
    return host, device


def call_path_parts(report: ProfileReport, job_id: str, rank: int,
                    per_part: int = CALLPATHS_PER_PART) -> list[ProfileCallPaths]:
    """The session's calling-context tree with its times, in records of ``per_part`` paths."""
    ids = sorted(report.path_counts)
    chunks = [ids[lo:lo + per_part] for lo in range(0, len(ids), per_part)] or [[]]
    parts = []
    for index, chunk in enumerate(chunks):
        nodes = [report.callpaths[cp] for cp in chunk]
        totals = [report.path_total_ns[cp] for cp in chunk]
        parts.append(ProfileCallPaths(
            job_id=job_id,
            rank=rank,
            request_id=report.request_id,
            started_ns=report.started_ns,
            stopped_ns=max(report.stopped_ns, report.started_ns),
            steps=report.steps_profiled,
            part=index,
            parts=len(chunks),
            callpaths=chunk,
            parents=[parent for parent, _, _ in nodes],
            layers=[layer for _, layer, _ in nodes],
            names=[name for _, _, name in nodes],
            counts=[report.path_counts[cp] for cp in chunk],
            total_ns=totals,
            # Children may overlap on other threads: self time never goes below 0.
            self_ns=[max(0, total - report.path_child_ns.get(cp, 0))
                     for cp, total in zip(chunk, totals, strict=True)],
        ))
    return parts
