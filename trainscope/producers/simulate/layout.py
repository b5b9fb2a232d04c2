"""Where each rank sits in a DP × PP × TP job (Megatron order: TP fastest, then DP, then PP)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainscope.schemas.records import Topology, WorkerInfo


@dataclass(frozen=True)
class Layout:
    dp: int
    pp: int
    tp: int
    gpus_per_host: int = 8

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp", "gpus_per_host"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def rank(self, dp_rank: int, pp_stage: int, tp_rank: int) -> int:
        return tp_rank + self.tp * (dp_rank + self.dp * pp_stage)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp_rank, pp_stage, tp_rank) of a rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a job of {self.world_size} ranks")
        return (rank // self.tp) % self.dp, rank // (self.tp * self.dp), rank % self.tp

    def stage_grid(self, stage: int) -> np.ndarray:
        """Ranks of one stage as a (dp, tp) array."""
        dp = np.arange(self.dp)[:, None]
        tp = np.arange(self.tp)[None, :]
        return tp + self.tp * (dp + self.dp * stage)

    def host(self, rank: int) -> str:
        return f"node{rank // self.gpus_per_host:04d}"

    def topology(self, job_id: str) -> Topology:
        workers = []
        for rank in range(self.world_size):
            dp_rank, pp_stage, tp_rank = self.coords(rank)
            workers.append(
                WorkerInfo(
                    rank=rank,
                    host=self.host(rank),
                    local_rank=rank % self.gpus_per_host,
                    dp_rank=dp_rank,
                    pp_stage=pp_stage,
                    tp_rank=tp_rank,
                )
            )
        return Topology(
            job_id=job_id, dp_size=self.dp, pp_size=self.pp, tp_size=self.tp, workers=workers
        )
