"""GPU time by kernel class (GEMM, attention, communication, memory, other).

Rule: when kernels outside GEMM, attention, communication and memory (elementwise ops,
reductions, normalisation, optimizer updates) take at least ``share`` of the GPU's busy time,
fusing them pays: each reads and writes its tensors from memory once more.
"""

from __future__ import annotations

import re
from collections import Counter

import numpy as np

from trainscope.traces.analyzers.base import Suggestion, TraceView

KERNEL_CLASSES = ("gemm", "attention", "communication", "memory", "other")
_COMM = re.compile(r"^nccl|allreduce|allgather|reducescatter|all_to_all|sendrecv", re.I)
_ATTENTION = re.compile(r"fmha|flash|attention|attn", re.I)
_GEMM = re.compile(r"gemm|xmma|matmul|cublas|cutlass|wgmma|nvjet|splitkreduce", re.I)


def kernel_class(name: str, event_class: str) -> str:
    if event_class in ("gpu_memcpy", "gpu_memset"):
        return "memory"
    if _COMM.search(name):
        return "communication"
    if _ATTENTION.search(name):
        return "attention"
    if _GEMM.search(name):
        return "gemm"
    return "other"


def breakdown(view: TraceView) -> dict[str, int]:
    """GPU time (ns) per kernel class, over kernels, copies and memsets."""
    from trainscope.traces.classes import CLASSES

    out = dict.fromkeys(KERNEL_CLASSES, 0)
    t = view.trace
    for i in np.flatnonzero(view.device).tolist():
        out[kernel_class(view.name(i), CLASSES[t.cls[i]])] += int(t.dur_ns[i])
    return out


class KernelMix:
    name = "kernel-mix"

    def __init__(self, share: float = 0.3) -> None:
        self.share = share

    def analyze(self, view: TraceView) -> list[Suggestion]:
        times = breakdown(view)
        total = sum(times.values())
        if not total or times["other"] < self.share * total:
            return []
        t = view.trace
        by_op: Counter[str] = Counter()
        for i in np.flatnonzero(view.of("kernel")).tolist():
            if kernel_class(view.name(i), "kernel") == "other":
                by_op[view.launching_op(i)] += int(t.dur_ns[i])
        op, _ = by_op.most_common(1)[0] if by_op else ("", 0)
        shares = ", ".join(f"{k} {v / total:.0%}" for k, v in times.items() if v)
        return [Suggestion(
            self.name, t.rank, times["other"],
            f"elementwise/reduction kernels take {times['other'] / total:.0%} of GPU time "
            f"({shares})",
            "fuse them: torch.compile the model, fused optimizers (foreach/fused=True), "
            "fused layer norm / activation kernels",
            where=op, evidence={k: float(v) for k, v in times.items()},
        )]
