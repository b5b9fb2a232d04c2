"""Hand-made Kineto traces for analyzer rules that the recorded traces do not show."""

from __future__ import annotations

import json
from pathlib import Path


class TraceBuilder:
    """Host ops that each launch one device event (``cudaLaunchKernel`` + correlation id)."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self._corr = 0

    def host(self, name: str, ts_us: float, dur_us: float, cat: str = "cpu_op",
             tid: int = 1) -> TraceBuilder:
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid,
                            "ts": ts_us, "dur": dur_us})
        return self

    def launch(self, op: str, kernel: str, ts_us: float, dur_us: float, *, stream: int = 7,
               cat: str = "kernel", launch_us: float = 5.0, host_ts_us: float | None = None,
               **args: object) -> TraceBuilder:
        self._corr += 1
        at = ts_us - launch_us - 1 if host_ts_us is None else host_ts_us
        self.host(op, at, launch_us)
        self.events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel",
                            "pid": 1, "tid": 1, "ts": at, "dur": launch_us,
                            "args": {"correlation": self._corr}})
        self.events.append({"ph": "X", "cat": cat, "name": kernel, "pid": 0, "tid": stream,
                            "ts": ts_us, "dur": dur_us,
                            "args": {"correlation": self._corr, **args}})
        return self

    def write(self, path: Path, rank: int = 0) -> Path:
        path.write_text(json.dumps({
            "distributedInfo": {"rank": rank, "world_size": 1},
            "baseTimeNanoseconds": 1_700_000_000_000_000_000, "traceEvents": self.events}))
        return path


def busy_gemm(n: int = 20, dur_us: float = 500.0) -> TraceBuilder:
    """Back-to-back long GEMMs: a GPU that is never idle, never launch-bound."""
    b = TraceBuilder()
    for k in range(n):
        b.launch("aten::mm", "sm90_xmma_gemm_bf16bf16_bf16f32", 1000 + k * dur_us, dur_us,
                 host_ts_us=10 + k * 6)
    return b
