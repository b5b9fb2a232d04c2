"""Communication / computation overlap on the GPU.

Rule: when communication kernels (NCCL) take at least ``min_share`` of the GPU's busy time and
less than ``overlapped`` of their time runs alongside compute kernels, the exposed part is time
the step waits for the network.
"""

from __future__ import annotations

import numpy as np

from trainscope.traces.analyzers.base import Suggestion, TraceView, overlap_ns, union
from trainscope.traces.analyzers.kernels import kernel_class


class CommOverlap:
    name = "comm-overlap"

    def __init__(self, min_share: float = 0.05, overlapped: float = 0.5) -> None:
        self.min_share, self.overlapped = min_share, overlapped

    def analyze(self, view: TraceView) -> list[Suggestion]:
        t = view.trace
        kernels = np.flatnonzero(view.of("kernel"))
        comm = np.array([kernel_class(view.name(int(i)), "kernel") == "communication"
                         for i in kernels], dtype=bool)
        if not comm.any():
            return []
        c, k = kernels[comm], kernels[~comm]
        comm_iv = union(t.start_ns[c], t.start_ns[c] + t.dur_ns[c])
        compute_iv = union(t.start_ns[k], t.start_ns[k] + t.dur_ns[k])
        comm_ns = int((comm_iv[1] - comm_iv[0]).sum())
        busy_s, busy_e = view.device_busy
        busy = int((busy_e - busy_s).sum())
        hidden = overlap_ns(comm_iv, compute_iv)
        if comm_ns < self.min_share * busy or hidden >= self.overlapped * comm_ns:
            return []
        exposed = comm_ns - hidden
        return [Suggestion(
            self.name, t.rank, exposed,
            f"communication kernels take {comm_ns / 1e6:.2f} ms, only {hidden / comm_ns:.0%} "
            "of it overlapped with compute",
            "overlap communication with compute: DDP(bucket_cap_mb=…, "
            "gradient_as_bucket_view=True), FSDP backward/forward prefetch, no "
            "synchronisation between backward and the optimizer step",
            where=view.launching_op(int(c[0])),
            evidence={"comm_ns": float(comm_ns), "overlapped_ns": float(hidden)},
        )]
