"""Idle GPU time and its cause.

Rule: when the GPU is idle for at least ``share`` of the span between its first and last work
of the trace, the gaps are attributed to what the host was doing meanwhile: waiting for data
(a DataLoader annotation), for communication (a collective op), on a synchronisation
(``cudaDeviceSynchronize``, ``.item()``), or anything else on the host (Python, launches).
"""

from __future__ import annotations

import numpy as np

from trainscope.traces.analyzers.base import Suggestion, TraceView, overlap_ns, union

ADVICE = {
    "data": "the GPU waits for input: DataLoader(num_workers>0, pin_memory=True, "
            "persistent_workers=True), prefetch the next batch",
    "communication": "the GPU waits for communication: overlap it with compute (DDP "
                     "bucket_cap_mb, gradient_as_bucket_view; FSDP prefetch)",
    "synchronisation": "the host blocks on the GPU and then refills its queue: remove "
                       ".item()/.cpu()/cudaDeviceSynchronize from the step",
    "host": "the host cannot keep the GPU fed (Python and launch overhead): larger "
            "micro-batch, torch.compile, CUDA graphs",
}
SYNC_NAMES = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize",
              "aten::item", "aten::_local_scalar_dense")


class IdleGpu:
    name = "idle-gpu"

    def __init__(self, share: float = 0.1, min_ns: int = 100_000) -> None:
        self.share, self.min_ns = share, min_ns

    def _intervals(self, view: TraceView, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        t = view.trace
        return union(t.start_ns[mask], t.start_ns[mask] + t.dur_ns[mask])

    def analyze(self, view: TraceView) -> list[Suggestion]:
        busy_s, busy_e = view.device_busy
        span = view.device_span_ns
        idle = span - int((busy_e - busy_s).sum())
        if not span or idle < max(self.min_ns, self.share * span):
            return []
        gaps = (busy_e[:-1], busy_s[1:])
        t = view.trace
        names = np.array([view.name(i) for i in range(len(t))], dtype=object)
        host = ~view.device & ~view.of("gpu_user_annotation")
        masks = {
            "data": host & np.array([n.startswith("enumerate(DataLoader)") for n in names],
                                    dtype=bool),
            "communication": host & view.tree.layer_is("collective"),
            "synchronisation": host & np.isin(names, SYNC_NAMES),
        }
        causes = {k: overlap_ns(gaps, self._intervals(view, m)) for k, m in masks.items()}
        causes["host"] = max(0, idle - sum(causes.values()))
        cause = max(causes, key=lambda k: causes[k])
        detail = ", ".join(f"{k} {v / idle:.0%}" for k, v in causes.items() if v)
        return [Suggestion(
            self.name, t.rank, idle,
            f"GPU idle {idle / span:.0%} of its active span ({idle / 1e6:.2f} ms of "
            f"{span / 1e6:.2f} ms); while idle the host was in: {detail}",
            ADVICE[cause], evidence={k: float(v) for k, v in causes.items()},
        )]
