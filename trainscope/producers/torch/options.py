"""Resolve attach() settings once into a frozen object: argument → environment → default.

Rank and world size come from the arguments, else from an initialised ``torch.distributed``,
else from the launcher's environment (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK,
TORCHELASTIC_RUN_ID), else a single-process default.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainscope.config import env
from trainscope.config.env import (
    DEFAULT_WINDOW_S,
)

DEFAULT_QUEUE_SIZE = 10_000
DEFAULT_PROFILE_BUDGET_S = 60.0
DEFAULT_PROFILE_MAX_STEPS = 50


@dataclass(frozen=True)
class Options:
    job_id: str
    rank: int
    world_size: int
    local_rank: int
    host: str
    bus_url: str | None
    window_s: float
    queue_size: int
    profile_budget_s: float
    profile_max_steps: int
    optrace: bool
    # Parallel layout (Megatron order: tensor-parallel fastest, then data, then pipeline).
    pp_size: int = 1
    tp_size: int = 1

    @property
    def window_ns(self) -> int:
        return int(self.window_s * 1e9)

    @property
    def dp_size(self) -> int:
        return max(1, self.world_size // (self.pp_size * self.tp_size))

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tp_size) % self.dp_size

    @property
    def pp_stage(self) -> int:
        return self.rank // (self.tp_size * self.dp_size)


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def disabled(environ: Mapping[str, str] | None = None) -> bool:
    return _truthy((environ if environ is not None else os.environ).get(env.TRAINSCOPE_DISABLE))


def _number(name: str, raw: Any, kind: type, minimum: float) -> Any:
    try:
        value = kind(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a {kind.__name__}, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return value


def _distributed_identity() -> tuple[int, int] | None:
    """(rank, world size) from torch.distributed when it is initialised; torch may be absent."""
    import sys

    if "torch" not in sys.modules:
        return None
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:  # a half-initialised process group must not stop attach()
        return None
    return None


def resolve(
    *,
    job_id: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    host: str | None = None,
    bus: str | None = None,
    window_s: float | None = None,
    queue_size: int | None = None,
    profile_budget_s: float | None = None,
    profile_max_steps: int | None = None,
    optrace: bool | None = None,
    pp_size: int = 1,
    tp_size: int = 1,
    environ: Mapping[str, str] | None = None,
) -> Options:
    e = environ if environ is not None else os.environ
    dist_identity = _distributed_identity()
    if rank is None:
        rank = dist_identity[0] if dist_identity else int(e.get(env.RANK, "0"))
    if world_size is None:
        world_size = dist_identity[1] if dist_identity else int(e.get(env.WORLD_SIZE, "1"))
    if local_rank is None:
        local_rank = int(e.get(env.LOCAL_RANK, "0"))
    if job_id is None:
        job_id = e.get(env.TRAINSCOPE_JOB_ID) or e.get(env.TORCHELASTIC_RUN_ID) or ""
        if not job_id or job_id == "none":
            # Without a launcher there is no shared id; ranks of one job must then set it.
            job_id = f"local-{os.getpid()}" if world_size == 1 else "default"
    bus_url = bus if bus is not None else (e.get(env.TRAINSCOPE_BUS) or None)
    if window_s is None:
        window_s = e.get(env.TRAINSCOPE_WINDOW_S, DEFAULT_WINDOW_S)
    if queue_size is None:
        queue_size = e.get(env.TRAINSCOPE_QUEUE_SIZE, DEFAULT_QUEUE_SIZE)
    if profile_budget_s is None:
        profile_budget_s = e.get(env.TRAINSCOPE_PROFILE_BUDGET_S, DEFAULT_PROFILE_BUDGET_S)
    if profile_max_steps is None:
        profile_max_steps = e.get(env.TRAINSCOPE_PROFILE_MAX_STEPS, DEFAULT_PROFILE_MAX_STEPS)
    if optrace is None:
        optrace = _truthy(e.get(env.TRAINSCOPE_OPTRACE))
    options = Options(
        job_id=str(job_id),
        rank=_number("rank", rank, int, 0),
        world_size=_number("world_size", world_size, int, 1),
        local_rank=_number("local_rank", local_rank, int, 0),
        host=host or socket.gethostname(),
        bus_url=bus_url,
        window_s=_number(env.TRAINSCOPE_WINDOW_S, window_s, float, 0.1),
        queue_size=_number(env.TRAINSCOPE_QUEUE_SIZE, queue_size, int, 1),
        profile_budget_s=_number(env.TRAINSCOPE_PROFILE_BUDGET_S, profile_budget_s, float, 0.1),
        profile_max_steps=_number(env.TRAINSCOPE_PROFILE_MAX_STEPS, profile_max_steps, int, 1),
        optrace=bool(optrace),
        pp_size=_number("pp_size", pp_size, int, 1),
        tp_size=_number("tp_size", tp_size, int, 1),
    )
    if options.rank >= options.world_size:
        raise ValueError(f"rank {options.rank} is outside world_size {options.world_size}")
    if options.world_size % (options.pp_size * options.tp_size):
        raise ValueError(
            f"world_size {options.world_size} is not a multiple of pp_size*tp_size "
            f"({options.pp_size}*{options.tp_size})"
        )
    return options
