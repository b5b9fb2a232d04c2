"""On-demand fine-grained profiling: torch.profiler for K steps, summarised in-process.

A request (from the control topic) arms the controller; the training thread starts the
profiler at the next step boundary and stops it after K steps or when the time budget is spent,
whichever comes first. Only one session runs per process. Stopping hands the raw result to the
sender thread, which walks the event tree and condenses it per function:

- ``python`` (Python frames), ``user_annotation`` (``record_function`` blocks), ``torch_op``
  (ATen ops), ``cuda_kernel``, ``cuda_api`` (runtime calls such as cudaLaunchKernel) and
  ``memcpy``/memset;
- ``callpath_id`` identifies the chain Python frame → op → kernel that led to the event: it is a
  hash of the parent's call-path id, the layer and the name, so a kernel's id is derived from
  the op that launched it, and that op's from the Python frame that called it. The table
  ``id → (parent id, layer, name)`` is kept on the session report.

The low-level profiler API is used (enable/disable, then the event tree) instead of
``torch.profiler.profile.stop()``, which parses the whole trace on the calling thread.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trainscope.schemas.callpath import (  # moved; kept for code written against the old place
    callpath_id,
    normalise_name,
)
from trainscope.schemas.records import ControlMessage, SummaryBatch
from trainscope.schemas.summaries import FunctionKey, summary_batches

if TYPE_CHECKING:
    from trainscope.producers.torch.runtime import Attachment

# Distinct (window, layer, name, call path) entries one session may produce; the rest are
# folded into their function without a call path (counted in ``folded``).
MAX_FUNCTIONS = 20_000

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
    done: threading.Event = field(default_factory=threading.Event)


class ProfileController:
    def __init__(self, att: Attachment, budget_s: float, max_steps: int) -> None:
        self.att = att
        self.budget_ns = int(budget_s * 1e9)
        self.max_steps = max_steps
        self._lock = threading.Lock()
        self._pending: ControlMessage | None = None
        self._active: ProfileReport | None = None
        self._steps_left = 0
        self.reports: list[ProfileReport] = []
        self.counts = {"requested": 0, "started": 0, "completed": 0, "rejected": 0}

    # -- control thread -----------------------------------------------------------------------
    def request(self, message: ControlMessage) -> None:
        with self._lock:
            self.counts["requested"] += 1
            if self._pending is not None or self._active is not None or message.steps < 1:
                self.counts["rejected"] += 1
                self.att.guard.warn_once(
                    "profile busy",
                    "trainscope: profiling request %r ignored: a session is already pending or "
                    "running (one per process), or it asked for no steps",
                    message.request_id,
                )
                return
            self._pending = message

    @property
    def active(self) -> bool:
        return self._active is not None

    # -- training thread ----------------------------------------------------------------------
    def on_step_end(self, now_ns: int) -> None:
        """Called at every step boundary; cheap unless a session starts or ends."""
        if self._active is not None:
            self._steps_left -= 1
            self._active.steps_profiled += 1
            if self._steps_left <= 0:
                self._stop("steps done")
            elif now_ns - self._active.started_ns > self.budget_ns:
                self._stop("time budget spent")
        elif self._pending is not None:
            self._start()

    def _start(self) -> None:
        with self._lock:
            message, self._pending = self._pending, None
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
        self._steps_left = steps
        self._active = report
        self.counts["started"] += 1

    def _stop(self, reason: str) -> None:
        report, self._active = self._active, None
        if report is None:
            return
        result = _disable()
        report.stopped_ns = time.time_ns()
        report.stop_reason = reason
        att = self.att

        def summarise() -> list[SummaryBatch]:
            try:
                summaries = summarise_result(result, att, report)
                report.summaries = sum(len(batch) for batch in summaries)
                self.counts["completed"] += 1
                self.reports.append(report)
                return summaries
            finally:
                report.done.set()

        att.sender.submit_task(summarise)

    def abort(self) -> None:
        """At detach: a running session is stopped and its result discarded."""
        if self._active is not None:
            self._active = None
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


def _enable() -> None:
    from torch.autograd.profiler import _enable_profiler, _prepare_profiler

    config, activities = _config()
    _prepare_profiler(config, activities)
    _enable_profiler(config, activities)


def _disable() -> Any:
    from torch.autograd.profiler import _disable_profiler

    return _disable_profiler()


def summarise_result(result: Any, att: Attachment, report: ProfileReport) -> list[SummaryBatch]:
    """Condense the profiler's event tree into per-(window, function, call path) summaries."""
    from torch._C._profiler import RecordScope, _EventType

    user_scope = RecordScope.USER_SCOPE
    python_tags = {_EventType.PyCall, _EventType.PyCCall}
    durations: dict[tuple[int, str, str, int], list[int]] = {}
    window_ns = att.recorder.window_ns
    roots = result.experimental_event_tree()
    stack: list[tuple[Any, int]] = [(root, 0) for root in reversed(roots)]
    # Device events the tree did not attach to their launch: linked afterwards through the
    # correlation id they share with the runtime call (cudaLaunchKernel) that launched them.
    unlinked: list[Any] = []
    launches: dict[int, int] = {}
    while stack or unlinked:
        if not stack:
            event = unlinked.pop()
            parent = launches.get(int(event.correlation_id), 0)
            layer = classify_kineto(event.name)
        else:
            event, parent = stack.pop()
            tag = event.tag
            if tag in python_tags:
                layer = "python"
            elif tag == _EventType.TorchOp:
                # record_function blocks (user scope) are annotations, as in Kineto traces,
                # so live and replayed call paths share their ids.
                layer = "user_annotation" if event.extra_fields.scope == user_scope else "torch_op"
            elif tag == _EventType.Kineto:
                layer = classify_kineto(event.name)
                if parent == 0 and layer != "cuda_api":
                    unlinked.append(event)
                    continue
            else:
                # Allocations and backend events are not functions; walk on below them.
                stack.extend((child, parent) for child in reversed(event.children))
                continue
        name = normalise_name(event.name)
        cp = callpath_id(parent, layer, name)
        report.callpaths.setdefault(cp, (parent, layer, name))
        if layer == "cuda_api" and event.correlation_id:
            launches[int(event.correlation_id)] = cp
        start = int(event.start_time_ns)
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
        bucket.append(max(0, int(event.duration_time_ns)))
        report.events += 1
        stack.extend((child, cp) for child in reversed(event.children))
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
