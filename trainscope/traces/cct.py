"""Calling-context trees: Python frame → annotation → framework op → runtime call → kernel.

Every kept event of a :class:`~trainscope.traces.reader.Trace` gets the id of its call path
(:func:`trainscope.schemas.callpath.callpath_id`, the same ids the live profiler and the
function summaries carry):

- host events (Python frames, ``record_function`` annotations, ATen ops, runtime and driver
  calls) nest by time on their thread: the parent is the innermost event that encloses the
  event. An event that starts inside one and ends after it (``record_function`` starts inside
  its ``__enter__`` frame and ends after it) hangs under the innermost one enclosing it whole;
- device events (kernels, copies, memsets) hang under the runtime call with the same
  ``correlation`` id, or, where the trace has none, the one their launch flow (``ac2g``)
  starts at;
- a ``gpu_user_annotation`` hangs under the ``user_annotation`` with the same external id.

``ProfilerStep#N`` is one node (``ProfilerStep#*``) so the steps of a trace, and of two ranks
or runs, share their paths. A node's ``total_ns`` is the time of the events at that path
(inclusive of what they call); ``self_ns`` takes away the time of their host-side children.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from trainscope.schemas.callpath import callpath_id, enclosing_depth
from trainscope.traces.classes import CLASS_INDEX, CLASSES, DEVICE_CLASSES, layer_of
from trainscope.traces.reader import Trace

_STEP = re.compile(r"^ProfilerStep#\d+$")
STEP_NODE = "ProfilerStep#*"
# Tie-break for host events with equal start and duration: the outer one first.
_HOST_ORDER = {c: i for i, c in enumerate(("python_function", "user_annotation", "cpu_op",
                                            "cuda_runtime", "cuda_driver"))}
_DEVICE = np.array([c in DEVICE_CLASSES for c in CLASSES])
_RUNTIME = (CLASS_INDEX["cuda_runtime"], CLASS_INDEX["cuda_driver"])
_GPU_ANNOTATION = CLASS_INDEX["gpu_user_annotation"]
_ANNOTATION = CLASS_INDEX["user_annotation"]

Node = tuple[int, str, str]  # parent id, layer, name


@dataclass
class CallTree:
    """Per event of a trace: its call path id, layer and self time; and the node table."""

    callpath: np.ndarray  # uint64 per event
    layer_id: np.ndarray  # int8 per event, index into layer_names
    layer_names: list[str]
    self_ns: np.ndarray
    nodes: dict[int, Node] = field(default_factory=dict)
    unlinked_device: int = 0  # device events whose launch was not found

    def layer_is(self, layer: str) -> np.ndarray:
        if layer not in self.layer_names:
            return np.zeros(len(self.layer_id), dtype=bool)
        return self.layer_id == self.layer_names.index(layer)


def node_name(name: str) -> str:
    return STEP_NODE if _STEP.match(name) else name


# Events are walked a slice at a time, so the Python lists a walk needs stay small even for
# a trace of tens of millions of events.
_CHUNK = 1 << 16


def build(trace: Trace) -> CallTree:
    """The calling-context tree of a trace: host events nest by time on their thread, then
    device events hang under their launch (the module docstring says how)."""
    builder = _Builder(trace)
    builder.walk_host()
    unlinked = builder.attach_device()
    return CallTree(callpath=builder.callpath, layer_id=builder.layer_id,
                    layer_names=builder.layer_names, self_ns=builder.self_ns,
                    nodes=builder.nodes, unlinked_device=unlinked)


class _Builder:
    """The state of one :func:`build`: a call path id per event, filled by the host walk and
    then by the device pass, and the node table both add to."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.callpath = np.zeros(len(trace), dtype=np.uint64)
        self.self_ns = trace.dur_ns.copy()
        self.nodes: dict[int, Node] = {}
        self._ids: dict[Node, int] = {}
        self._layers()
        self.host = ~_DEVICE[trace.cls]
        # Flows are needed only for device work that carries no correlation id (older traces).
        uncorrelated = ~self.host & (trace.cls != _GPU_ANNOTATION) & (trace.correlation < 0)
        self.need_flows = bool(uncorrelated.any()) and len(trace.flows) > 0
        self.launch_at: dict[tuple[int, int], int] = {}  # (thread, start) of a runtime call
        self.annotation_by_ext: dict[int, int] = {}

    def _layers(self) -> None:
        """Per distinct (class, name id): its layer and node name; a small integer per layer."""
        trace = self.trace
        pairs, self.pair_index = np.unique(trace.cls.astype(np.int64) << 32 | trace.name_id,
                                           return_inverse=True)
        self.layer_names: list[str] = []
        self.pair_info: list[tuple[str, str]] = []
        pair_layer = np.zeros(len(pairs), dtype=np.int8)
        for k, pair in enumerate(pairs.tolist()):
            name = trace.names[pair & 0xFFFFFFFF]
            layer = layer_of(CLASSES[pair >> 32], name)
            if layer not in self.layer_names:
                self.layer_names.append(layer)
            pair_layer[k] = self.layer_names.index(layer)
            self.pair_info.append((layer, node_name(name)))
        self.layer_id = (pair_layer[self.pair_index] if len(trace)
                         else np.zeros(0, dtype=np.int8))

    def node(self, parent: int, layer: str, name: str) -> int:
        key = (parent, layer, name)
        cp = self._ids.get(key)
        if cp is None:
            cp = self._ids[key] = callpath_id(parent, layer, name)
            self.nodes[cp] = key
        return cp

    def walk_host(self) -> None:
        """Host events by thread and time, each under the innermost one enclosing it; takes
        each child's time from its parent's self time, and notes where runtime calls and
        annotations are for the device pass."""
        trace, self_ns, pair_info, node = self.trace, self.self_ns, self.pair_info, self.node
        host_idx = np.flatnonzero(self.host)
        tie = np.array([_HOST_ORDER.get(c, 9) for c in CLASSES])[trace.cls[host_idx]]
        order = host_idx[np.lexsort((tie, -trace.dur_ns[host_idx], trace.start_ns[host_idx],
                                     trace.thread[host_idx]))]
        launch_at = self.launch_at if self.need_flows else None
        annotation_by_ext = self.annotation_by_ext
        stack: list[tuple[int, int, int]] = []  # (end ns, call path, event index)
        current = -1
        for lo in range(0, len(order), _CHUNK):
            chunk = order[lo:lo + _CHUNK]
            cps = np.zeros(len(chunk), dtype=np.uint64)
            columns = zip(chunk.tolist(), trace.thread[chunk].tolist(),
                          trace.start_ns[chunk].tolist(), trace.dur_ns[chunk].tolist(),
                          trace.cls[chunk].tolist(), self.pair_index[chunk].tolist(),
                          trace.external[chunk].tolist(), strict=True)
            for j, (i, t, s, d, c, pair, ext) in enumerate(columns):
                end = s + d
                if t != current:
                    stack.clear()
                    current = t
                depth = enclosing_depth(stack, s, end)
                if depth >= 0:
                    parent = stack[depth][1]
                    self_ns[stack[depth][2]] -= d
                else:
                    parent = 0
                layer, name = pair_info[pair]
                cp = node(parent, layer, name)
                cps[j] = cp
                stack.append((end, cp, i))
                if c in _RUNTIME:
                    if launch_at is not None:
                        launch_at[(t, s)] = cp
                elif c == _ANNOTATION and ext >= 0:
                    annotation_by_ext.setdefault(ext, cp)
            self.callpath[chunk] = cps

    def attach_device(self) -> int:
        """Device events under their launch: the runtime call with their correlation id, else
        the one their launch flow starts at; a GPU annotation under the annotation with its
        external id. Returns how many device events found no launch."""
        trace, pair_info, node = self.trace, self.pair_info, self.node
        device_idx = np.flatnonzero(~self.host)
        launched = self._launches_by_correlation(device_idx)
        flow_in, launch_by_flow = self._launches_by_flow()
        annotation_by_ext, need_flows = self.annotation_by_ext, self.need_flows
        unlinked = 0
        for lo in range(0, len(device_idx), _CHUNK):
            chunk = device_idx[lo:lo + _CHUNK]
            cps = np.zeros(len(chunk), dtype=np.uint64)
            columns = zip(trace.thread[chunk].tolist(), trace.start_ns[chunk].tolist(),
                          trace.cls[chunk].tolist(), self.pair_index[chunk].tolist(),
                          launched[lo:lo + _CHUNK].tolist(), trace.external[chunk].tolist(),
                          strict=True)
            for j, (t, s, c, pair, parent, ext) in enumerate(columns):
                if c == _GPU_ANNOTATION:
                    parent = annotation_by_ext.get(ext, 0)
                else:
                    if not parent and need_flows:
                        flow = flow_in.get((t, s))
                        parent = launch_by_flow.get(flow, 0) if flow is not None else 0
                    if not parent:
                        unlinked += 1
                cps[j] = node(parent, *pair_info[pair])
            self.callpath[chunk] = cps
        return unlinked

    def _launches_by_correlation(self, device_idx: np.ndarray) -> np.ndarray:
        """Per device event, the call path of the runtime call with its correlation id (0:
        none), from sorted arrays rather than a dictionary per launch."""
        trace = self.trace
        runtime = np.isin(trace.cls, _RUNTIME) & (trace.correlation >= 0)
        corr_keys = trace.correlation[runtime]
        corr_order = np.argsort(corr_keys, kind="stable")
        corr_keys, corr_paths = corr_keys[corr_order], self.callpath[runtime][corr_order]
        corr_dev = trace.correlation[device_idx]
        if not len(corr_keys):
            return np.zeros(len(device_idx), dtype=np.uint64)
        k = np.minimum(np.searchsorted(corr_keys, corr_dev), len(corr_keys) - 1)
        return np.where((corr_dev >= 0) & (corr_keys[k] == corr_dev), corr_paths[k], 0)

    def _launches_by_flow(self) -> tuple[dict[tuple[int, int], int], dict[int, int]]:
        """(thread, start) of a flow's end → its flow id, and flow id → the call path of the
        runtime call it starts at (empty unless flows are needed)."""
        flow_in: dict[tuple[int, int], int] = {}
        launch_by_flow: dict[int, int] = {}
        if self.need_flows:
            for start_flag, t, s, flow in self.trace.flows.tolist():
                if start_flag:
                    if (t, s) in self.launch_at:
                        launch_by_flow[flow] = self.launch_at[(t, s)]
                else:
                    flow_in[(t, s)] = flow
        return flow_in, launch_by_flow


def path_of(nodes: dict[int, Node], cp: int) -> list[tuple[str, str]]:
    """(layer, name) from the root down to ``cp``."""
    out: list[tuple[str, str]] = []
    seen = 0
    while cp and cp in nodes and seen < 10_000:
        parent, layer, name = nodes[cp]
        out.append((layer, name))
        cp, seen = parent, seen + 1
    return out[::-1]


@dataclass
class PathTimes:
    """A calling-context tree with times: per call path, count, inclusive and self time."""

    nodes: dict[int, Node]
    count: dict[int, int]
    total_ns: dict[int, int]
    self_ns: dict[int, int]
    steps: int = 0  # profiler steps the times cover (0: unknown)

    def merged(self, other: PathTimes) -> PathTimes:
        out = PathTimes({**self.nodes, **other.nodes}, dict(self.count), dict(self.total_ns),
                        dict(self.self_ns), self.steps + other.steps)
        for cp, value in other.count.items():
            out.count[cp] = out.count.get(cp, 0) + value
            out.total_ns[cp] = out.total_ns.get(cp, 0) + other.total_ns[cp]
            out.self_ns[cp] = out.self_ns.get(cp, 0) + other.self_ns[cp]
        return out

    def per_step(self) -> dict[int, float]:
        scale = 1 / self.steps if self.steps else 1.0
        return {cp: ns * scale for cp, ns in self.total_ns.items()}

    def self_by_function(self) -> dict[tuple[str, str], int]:
        """Self time (ns) per (layer, name) over all the call paths it appears on, most first:
        where the host's time went, whatever called it."""
        out: dict[tuple[str, str], int] = {}
        for cp, ns in self.self_ns.items():
            _, layer, name = self.nodes[cp]
            out[(layer, name)] = out.get((layer, name), 0) + ns
        return dict(sorted(out.items(), key=lambda item: -item[1]))


def path_times(tree: CallTree, trace: Trace, steps: int = 0,
               mask: np.ndarray | None = None) -> PathTimes:
    """Times per call path over the events of ``trace`` (those in ``mask`` if given)."""
    cp, dur, own = tree.callpath, trace.dur_ns, tree.self_ns
    if mask is not None:
        cp, dur, own = cp[mask], dur[mask], own[mask]
    if not len(cp):
        return PathTimes(dict(tree.nodes), {}, {}, {}, steps)
    keys, inverse, counts = np.unique(cp, return_inverse=True, return_counts=True)
    totals = np.bincount(inverse, weights=dur.astype(np.float64))
    selfs = np.bincount(inverse, weights=own.astype(np.float64))
    ks = keys.tolist()
    # bincount sums in float64: exact below 2**53 ns (104 days) per path.
    return PathTimes(
        dict(tree.nodes),
        dict(zip(ks, counts.tolist(), strict=True)),
        dict(zip(ks, np.rint(totals).astype(np.int64).tolist(), strict=True)),
        dict(zip(ks, np.rint(selfs).astype(np.int64).tolist(), strict=True)),
        steps,
    )


def call_path_rows(job_id: str, rank: int, window_start_ns: int, window_end_ns: int,
                   times: PathTimes) -> list[tuple[object, ...]]:
    """Rows of the ``call_paths`` table (see :mod:`trainscope.schemas.ddl`)."""
    rows = []
    for cp, count in times.count.items():
        parent, layer, name = times.nodes[cp]
        path = path_of(times.nodes, cp)
        rows.append((job_id, rank, window_start_ns, window_end_ns, cp, parent, len(path) - 1,
                     layer, name, [n for _, n in path], [la for la, _ in path], count,
                     times.total_ns[cp], times.self_ns[cp], times.steps))
    return rows
