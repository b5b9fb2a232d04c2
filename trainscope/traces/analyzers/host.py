"""Host-side causes: pageable host-to-device copies, synchronisations, data-loader waits.

``PageableCopies``: rule: any host-to-device copy from pageable memory (its name says
``Pageable``) takes GPU time that a pinned, asynchronous copy would hide.

``Synchronisations``: rule: the host spends at least ``share`` of the step time blocked in
``cudaDeviceSynchronize``/``cudaStreamSynchronize``/``cudaEventSynchronize`` inside the
profiled steps (``.item()`` on a GPU tensor is one; on a CPU tensor, as in torch's AdamW, it
is not).

``DataLoaderWaits``: rule: ``enumerate(DataLoader)…__next__`` annotations take at least
``share`` of the step time and at least ``min_ns`` per batch (a tiny step with a fast loader
is no problem).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from trainscope.traces.analyzers.base import Suggestion, TraceView, union
from trainscope.traces.cct import STEP_NODE

SYNC_RUNTIME = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")


class PageableCopies:
    name = "pageable-copies"

    def analyze(self, view: TraceView) -> list[Suggestion]:
        t = view.trace
        copies = [i for i in np.flatnonzero(view.of("gpu_memcpy")).tolist()
                  if "HtoD" in view.name(i) and "Pageable" in view.name(i)]
        if not copies:
            return []
        total = int(t.dur_ns[copies].sum())
        moved = int(t.bytes_moved[copies].sum())
        op = Counter(view.launching_op(i) for i in copies).most_common(1)[0][0]
        return [Suggestion(
            self.name, t.rank, total,
            f"{len(copies)} host-to-device copies from pageable memory ({moved / 1e6:.1f} MB, "
            f"{total / 1e6:.2f} ms of GPU time)",
            "copy from pinned memory without blocking: DataLoader(pin_memory=True) or "
            "tensor.pin_memory(), then .to('cuda', non_blocking=True)",
            where=op, evidence={"copies": float(len(copies)), "bytes": float(moved)},
        )]


class Synchronisations:
    name = "synchronisation"

    def __init__(self, share: float = 0.02) -> None:
        self.share = share

    def analyze(self, view: TraceView) -> list[Suggestion]:
        t = view.trace
        runtime = view.of("cuda_runtime", "cuda_driver")
        idx = [i for i in np.flatnonzero(runtime).tolist() if view.name(i) in SYNC_RUNTIME]
        if view.steps:
            # Only the program's own: the profiler synchronises when it stops, outside steps.
            idx = [i for i in idx if STEP_NODE in view.where(i).split(" → ")]
        step = view.step_ns
        if not idx or not step:
            return []
        s, e = union(t.start_ns[idx], t.start_ns[idx] + t.dur_ns[idx])
        blocked = int((e - s).sum())
        if blocked < self.share * step:
            return []
        paths = [view.where(i).split(" → ") for i in idx]
        items = sum(1 for p in paths if "aten::item" in p)
        longest = max(range(len(idx)), key=lambda k: int(t.dur_ns[idx[k]]))
        where = paths[longest]
        cut = where.index("aten::item") + 1 if "aten::item" in where else len(where)
        return [Suggestion(
            self.name, t.rank, blocked,
            f"the host is blocked on the GPU for {blocked / step:.0%} of the step time "
            f"({len(idx)} synchronisations, {items} of them from .item())",
            "keep values on the GPU (log loss every N steps, torch.where instead of "
            "if tensor:), drop explicit cudaDeviceSynchronize/torch.cuda.synchronize()",
            where=" → ".join(where[:cut]),
            evidence={"blocked_ns": float(blocked), "items": float(items)},
        )]


class DataLoaderWaits:
    name = "dataloader"

    def __init__(self, share: float = 0.05, min_ns: int = 1_000_000) -> None:
        self.share, self.min_ns = share, min_ns

    def analyze(self, view: TraceView) -> list[Suggestion]:
        t = view.trace
        idx = [i for i in np.flatnonzero(view.of("user_annotation")).tolist()
               if view.name(i).startswith("enumerate(DataLoader)")]
        step = view.step_ns
        if not idx or not step:
            return []
        waited = int(t.dur_ns[idx].sum())
        if waited < self.share * step or waited < self.min_ns * len(idx):
            return []
        return [Suggestion(
            self.name, t.rank, waited,
            f"waiting for the next batch takes {waited / step:.0%} of the step time "
            f"({len(idx)} batches, {waited / len(idx) / 1e6:.2f} ms each)",
            "load ahead: DataLoader(num_workers>0, persistent_workers=True, "
            "prefetch_factor=2..4, pin_memory=True); move decoding/augmentation off the "
            "training process",
            where=view.where(idx[0]), evidence={"batches": float(len(idx))},
        )]
