"""Launch-bound ops and many tiny kernels.

``LaunchBound``: a kernel that runs for less time than the gap before it on its stream was
waiting for its launch, not for the GPU. Rule: when those gaps add up to at least ``share`` of
the GPU's active span, the ops that launch such kernels are named.

``TinyKernels``: rule: at least ``min_count`` kernels and at least ``share`` of all kernels run
shorter than ``tiny_ns``; each costs a launch (its runtime call) for little work.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from trainscope.traces.analyzers.base import Suggestion, TraceView


class LaunchBound:
    name = "launch-bound"

    def __init__(self, share: float = 0.1) -> None:
        self.share = share

    def analyze(self, view: TraceView) -> list[Suggestion]:
        t = view.trace
        idx = np.flatnonzero(view.device)
        span = view.device_span_ns
        if len(idx) < 2 or not span:
            return []
        kernel = view.of("kernel")
        waited: Counter[str] = Counter()
        count = 0
        for stream in np.unique(t.thread[idx]).tolist():
            on = idx[t.thread[idx] == stream]
            on = on[np.argsort(t.start_ns[on], kind="stable")]
            ends = np.maximum.accumulate(t.start_ns[on] + t.dur_ns[on])
            gaps = t.start_ns[on][1:] - ends[:-1]
            for j in np.flatnonzero((gaps > t.dur_ns[on][1:]) & kernel[on][1:]).tolist():
                i = int(on[j + 1])
                waited[view.launching_op(i)] += int(gaps[j])
                count += 1
        total = sum(waited.values())
        if total < self.share * span:
            return []
        op, op_ns = waited.most_common(1)[0]
        return [Suggestion(
            self.name, t.rank, total,
            f"{count} kernels ran shorter than the wait for their launch; those waits add up "
            f"to {total / span:.0%} of the GPU's active span (most under {op}: "
            f"{op_ns / 1e6:.2f} ms)",
            "cut launches: CUDA graphs (torch.compile(mode='reduce-overhead')), fused ops, "
            "a larger micro-batch so each kernel does more work",
            where=op, evidence={"kernels": float(count), "wait_ns": float(total)},
        )]


class TinyKernels:
    name = "tiny-kernels"

    def __init__(self, tiny_ns: int = 10_000, share: float = 0.5, min_count: int = 100) -> None:
        self.tiny_ns, self.share, self.min_count = tiny_ns, share, min_count

    def analyze(self, view: TraceView) -> list[Suggestion]:
        t = view.trace
        kernels = np.flatnonzero(view.of("kernel"))
        tiny = kernels[t.dur_ns[kernels] < self.tiny_ns]
        if len(tiny) < max(self.min_count, self.share * len(kernels)):
            return []
        launches = view.of("cuda_runtime", "cuda_driver")
        launch_names = [i for i in np.flatnonzero(launches).tolist()
                        if "Launch" in view.name(i)]
        per_launch = float(np.median(t.dur_ns[launch_names])) if launch_names else 0.0
        at_stake = int(per_launch * len(tiny))
        by_op = Counter(view.launching_op(int(i)) for i in tiny)
        op, n = by_op.most_common(1)[0]
        return [Suggestion(
            self.name, t.rank, at_stake,
            f"{len(tiny)} of {len(kernels)} kernels run under {self.tiny_ns / 1e3:.0f} µs "
            f"(most from {op}: {n}); each costs a launch of ~{per_launch / 1e3:.1f} µs on "
            "the host",
            "fuse them: torch.compile, foreach/fused optimizers (e.g. AdamW(fused=True)), "
            "CUDA graphs",
            where=op, evidence={"tiny": float(len(tiny)), "kernels": float(len(kernels))},
        )]
