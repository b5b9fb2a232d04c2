"""What the planner is told: the model, the cluster and its links, read from one YAML file.

```yaml
model:
  layers: 32
  hidden: 4096
  heads: 32
  seq_len: 2048
  vocab: 50304
  global_batch: 512          # sequences per optimizer step
  precision: mixed           # fp32 | bf16 | mixed (bf16 weights, fp32 grads and master copy)
  optimizer: adam            # adam | sgd (no momentum)
  recompute: false           # full activation recomputation per layer
cluster:
  hosts: 8
  gpus_per_host: 8
  gpu_memory_gib: 80
  peak_tflops: 989           # dense 16-bit peak of one GPU
  mfu: 0.5                   # share of the peak a layer reaches (default 0.5)
  backward_over_forward: 2.0 # (default 2; recomputation adds one forward)
  intra_host_gbit_per_s: 2400
  inter_host_gbit_per_s: 200 # between two GPUs on different hosts (one NIC per GPU)
  links:                     # host pairs that are slower (or faster) than that
    - {hosts: [3, 7], gbit_per_s: 12}
  gpu_links:                 # one GPU's network link, e.g. a degraded NIC
    - {host: 2, gpu: 5, gbit_per_s: 50}
search:                      # optional
  top_k: 5
  micro_batch_sizes: [1, 2, 4]
  virtual_stages: [1]
```

Every problem is a :class:`PlanInputError` whose text names the file and the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec
import numpy as np
import yaml

from trainscope.schemas.errors import TrainscopeError

GBIT = 1e9 / 8  # bytes per second in one Gb/s
GIB = 2**30


class PlanInputError(ValueError, TrainscopeError):
    """A model, cluster or link description that cannot be used; the text names where."""


class ModelSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    global_batch: int
    precision: Literal["fp32", "bf16", "mixed"] = "mixed"
    optimizer: Literal["adam", "sgd"] = "adam"
    recompute: bool = False
    ffn_hidden: int = 0  # 0: 4 × hidden

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    def check(self) -> None:
        for name in ("layers", "hidden", "heads", "seq_len", "vocab", "global_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(
                f"model.hidden ({self.hidden}) must be a multiple of model.heads ({self.heads})"
            )


class HostLink(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    hosts: tuple[int, int]
    gbit_per_s: float


class GpuLink(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    host: int
    gpu: int
    gbit_per_s: float


class ClusterSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    hosts: int
    gpus_per_host: int
    gpu_memory_gib: float
    peak_tflops: float
    mfu: float = 0.5  # share of peak a transformer layer reaches
    backward_over_forward: float = 2.0  # a backward's time over its forward's (no recompute)
    hbm_gbyte_per_s: float = 2000.0  # bounds the optimizer step
    intra_host_gbit_per_s: float = 2400.0
    inter_host_gbit_per_s: float = 200.0
    links: tuple[HostLink, ...] = ()
    gpu_links: tuple[GpuLink, ...] = ()

    @property
    def gpus(self) -> int:
        return self.hosts * self.gpus_per_host

    def check(self) -> None:
        for name in ("hosts", "gpus_per_host"):
            if getattr(self, name) < 1:
                raise ValueError(f"cluster.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("gpu_memory_gib", "peak_tflops", "hbm_gbyte_per_s",
                     "intra_host_gbit_per_s", "inter_host_gbit_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"cluster.{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"cluster.mfu must be in (0, 1], got {self.mfu}")
        if not self.backward_over_forward > 0:
            raise ValueError(
                f"cluster.backward_over_forward must be > 0, got {self.backward_over_forward}")
        for i, link in enumerate(self.links):
            a, b = link.hosts
            where = f"cluster.links[{i}]"
            if not (0 <= a < self.hosts and 0 <= b < self.hosts):
                raise ValueError(f"{where}: host {a if not 0 <= a < self.hosts else b} is not "
                                 f"in a cluster of {self.hosts} hosts (0..{self.hosts - 1})")
            if a == b:
                raise ValueError(f"{where}: a link joins two different hosts, got [{a}, {b}]")
            if not link.gbit_per_s > 0:
                raise ValueError(f"{where}.gbit_per_s must be > 0, got {link.gbit_per_s}")
        for i, g in enumerate(self.gpu_links):
            where = f"cluster.gpu_links[{i}]"
            if not 0 <= g.host < self.hosts:
                raise ValueError(f"{where}: host {g.host} is not in 0..{self.hosts - 1}")
            if not 0 <= g.gpu < self.gpus_per_host:
                raise ValueError(f"{where}: gpu {g.gpu} is not in 0..{self.gpus_per_host - 1}")
            if not g.gbit_per_s > 0:
                raise ValueError(f"{where}.gbit_per_s must be > 0, got {g.gbit_per_s}")


class SearchSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    top_k: int = 5
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4)
    virtual_stages: tuple[int, ...] = (1,)

    def check(self) -> None:
        if self.top_k < 1:
            raise ValueError(f"search.top_k must be >= 1, got {self.top_k}")
        for name in ("micro_batch_sizes", "virtual_stages"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise ValueError(f"search.{name} must be a non-empty list of integers >= 1")


class PlanFile(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    model: ModelSpec
    cluster: ClusterSpec | None = None
    search: SearchSpec = SearchSpec()


@dataclass(frozen=True)
class Links:
    """Bandwidth between any two GPUs (global index host × gpus_per_host + local).

    Inside a host every pair gets ``intra_bytes_per_s``; between hosts the host-pair matrix,
    capped by each end's own network link (``gpu_cap_bytes_per_s``, infinite when unknown)."""

    gpus_per_host: int
    intra_bytes_per_s: float
    host_bytes_per_s: np.ndarray  # (hosts, hosts), diagonal unused
    gpu_cap_bytes_per_s: np.ndarray  # (gpus,)

    @property
    def hosts(self) -> int:
        return len(self.host_bytes_per_s)

    def between(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Bandwidth between GPUs ``a`` and ``b`` (broadcasting integer arrays)."""
        ha, hb = a // self.gpus_per_host, b // self.gpus_per_host
        inter = np.minimum(
            self.host_bytes_per_s[ha, hb],
            np.minimum(self.gpu_cap_bytes_per_s[a], self.gpu_cap_bytes_per_s[b]),
        )
        return np.where(ha == hb, self.intra_bytes_per_s, inter)

    @classmethod
    def uniform(cls, cluster: ClusterSpec) -> Links:
        """What a configurator that assumes every network link is nominal would use."""
        hosts = np.full((cluster.hosts, cluster.hosts), cluster.inter_host_gbit_per_s * GBIT)
        return cls(cluster.gpus_per_host, cluster.intra_host_gbit_per_s * GBIT, hosts,
                   np.full(cluster.gpus, np.inf))

    @classmethod
    def of(cls, cluster: ClusterSpec) -> Links:
        base = cls.uniform(cluster)
        for link in cluster.links:
            a, b = link.hosts
            base.host_bytes_per_s[a, b] = base.host_bytes_per_s[b, a] = link.gbit_per_s * GBIT
        for g in cluster.gpu_links:
            base.gpu_cap_bytes_per_s[g.host * cluster.gpus_per_host + g.gpu] = g.gbit_per_s * GBIT
        return base


def load_plan_file(path: Path, *, need_cluster: bool = True) -> PlanFile:
    """Read and check a plan YAML file; every problem is one PlanInputError naming the place."""
    try:
        raw: Any = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise PlanInputError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "not valid YAML"
        raise PlanInputError(f"{path}: not valid YAML{where}: {problem}") from None
    return parse_plan(raw, str(path), need_cluster=need_cluster)


def parse_plan(raw: Any, source: str, *, need_cluster: bool = True) -> PlanFile:
    if not isinstance(raw, dict):
        raise PlanInputError(f"{source}: expected a mapping with 'model' and 'cluster' sections")
    try:
        plan = msgspec.convert(raw, PlanFile)
    except msgspec.ValidationError as exc:
        # msgspec says "Expected `int`, got `str` - at `$.model.layers`": name the field first.
        text = str(exc)
        message, _, at = text.partition(" - at `$")
        field = at.rstrip("`").lstrip(".") if at else ""
        raise PlanInputError(
            f"{source}: {field + ': ' if field else ''}{message[0].lower() + message[1:]}"
        ) from None
    if need_cluster and plan.cluster is None:
        raise PlanInputError(f"{source}: the 'cluster' section is missing")
    try:
        plan.model.check()
        if plan.cluster is not None:
            plan.cluster.check()
        plan.search.check()
    except ValueError as exc:
        raise PlanInputError(f"{source}: {exc}") from None
    return plan
