"""Rank configurations: enumerate, reject what does not fit, place the rest, explain the best.

Every (dp, pp, tp, micro-batch) with dp·pp·tp = all GPUs and a shape the model divides into is
a candidate. One that needs more memory on some stage than a GPU has is rejected with the
stage and the figures. The others are scored with Megatron's default placement on the
measured links and, optimistically, as if every network link were nominal; the most promising
``shortlist`` (at least ``top_k``) get a placement search, and the top ``top_k`` are returned
with the reason they win. As a baseline, the configuration a planner that assumes uniform
links would choose (the best by the uniform-link model, default placement) is scored on the
measured links too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trainscope.plan.costs import stage_costs
from trainscope.plan.latency import LatencyModel, default_slots, group_gpus
from trainscope.plan.memory import MemoryEstimate, in_flight, worst_stage
from trainscope.plan.search import search
from trainscope.plan.spec import GBIT, GIB, ClusterSpec, Links, ModelSpec, SearchSpec
from trainscope.plan.transformer import ParallelConfig

# A link slower than this share of the typical network link is called slow in reasons.
SLOW_SHARE = 0.75


@dataclass
class Candidate:
    cfg: ParallelConfig
    memory: MemoryEstimate
    step_s: float = float("nan")  # searched placement, measured links
    default_step_s: float = float("nan")  # Megatron's placement, measured links
    uniform_step_s: float = float("nan")  # Megatron's placement, all links nominal
    slots: np.ndarray | None = None
    reason: str = ""
    slow_links_used: list[dict[str, Any]] = field(default_factory=list)

    def headroom_gib(self, cluster: ClusterSpec) -> float:
        return cluster.gpu_memory_gib - self.memory.total_bytes / GIB


@dataclass
class Rejected:
    cfg: ParallelConfig
    reason: str


@dataclass
class Plan:
    cluster: ClusterSpec
    model: ModelSpec
    ranked: list[Candidate]
    rejected: list[Rejected]
    uniform_choice: Candidate | None  # what a uniform-link planner would run
    notes: list[str] = field(default_factory=list)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def configurations(model: ModelSpec, cluster: ClusterSpec,
                   search_spec: SearchSpec) -> tuple[list[ParallelConfig], list[Rejected]]:
    ok, bad = [], []
    n = cluster.gpus
    for tp in divisors(cluster.gpus_per_host):
        for pp in divisors(n // tp):
            dp = n // (tp * pp)
            for mb in search_spec.micro_batch_sizes:
                for v in search_spec.virtual_stages:
                    cfg = ParallelConfig(dp, pp, tp, mb, v)
                    problem = cfg.problem(model, cluster.gpus_per_host)
                    if problem is None and v > 1:
                        problem = "interleaved schedules are not modelled yet"
                    if problem:
                        bad.append(Rejected(cfg, problem))
                    else:
                        ok.append(cfg)
    return ok, bad


def memory_problem(model: ModelSpec, cluster: ClusterSpec,
                   cfg: ParallelConfig) -> tuple[MemoryEstimate, str | None]:
    worst = worst_stage(model, cfg)
    limit = cluster.gpu_memory_gib * GIB
    if worst.total_bytes <= limit:
        return worst, None
    held = in_flight(cfg, cfg.microbatches(model), worst.stage)
    chunks = f"{held} micro-batch{'es' if held > 1 else ''} of {cfg.micro_batch} in flight"
    return worst, (
        f"stage {worst.stage} needs {worst.total_bytes / GIB:.1f} GiB > "
        f"{cluster.gpu_memory_gib:g} GiB (weights+grads+optimizer "
        f"{(worst.weights_bytes + worst.grads_bytes + worst.optimizer_bytes) / GIB:.1f} GiB, "
        f"activations {worst.activations_bytes / GIB:.1f} GiB, {chunks})"
    )


def plan(
    model: ModelSpec,
    cluster: ClusterSpec,
    links: Links,
    search_spec: SearchSpec | None = None,
    *,
    shortlist: int = 8,
    seed: int = 0,
    iterations: int | None = None,
    scoring: str = "incremental",
) -> Plan:
    """``scoring`` is the placement search's (see :func:`~trainscope.plan.search.anneal`):
    "full" re-scores every proposal from scratch, the reference the benchmark compares with."""
    search_spec = search_spec or SearchSpec()
    uniform = Links.uniform(cluster)
    configs, rejected = configurations(model, cluster, search_spec)
    candidates: list[Candidate] = []
    for cfg in configs:
        memory, problem = memory_problem(model, cluster, cfg)
        if problem:
            rejected.append(Rejected(cfg, problem))
            continue
        c = Candidate(cfg, memory)
        costs = stage_costs(model, cluster, cfg)
        m = cfg.microbatches(model)
        slots = default_slots(cfg)
        c.default_step_s = float(LatencyModel(cfg, costs, links, m).step_s(slots))
        c.uniform_step_s = float(LatencyModel(cfg, costs, uniform, m).step_s(slots))
        candidates.append(c)
    result = Plan(cluster, model, [], rejected, None)
    if not candidates:
        return result
    result.uniform_choice = min(candidates, key=lambda c: c.uniform_step_s)
    order = sorted(candidates, key=lambda c: min(c.default_step_s, c.uniform_step_s))
    shortlist = max(shortlist, search_spec.top_k)
    for c in order[:shortlist]:
        costs = stage_costs(model, cluster, c.cfg)
        latency = LatencyModel(c.cfg, costs, links, c.cfg.microbatches(model))
        found = search(latency, seed=seed, iterations=iterations, scoring=scoring)
        c.slots, c.step_s = found.slots, found.step_s
    searched = sorted((c for c in order[:shortlist]), key=lambda c: c.step_s)
    result.ranked = searched[: search_spec.top_k]
    for c in result.ranked:
        c.reason = explain(c, links)
        assert c.slots is not None
        c.slow_links_used = slow_links_used(c.cfg, c.slots, links)
    return result


# -- reasons -------------------------------------------------------------------------------------


def slow_links(links: Links) -> list[tuple[str, tuple[int, ...], float]]:
    """("hosts", (a, b), bytes/s) and ("gpu", (g,), bytes/s) well below the typical link."""
    h = links.hosts
    off = links.host_bytes_per_s[~np.eye(h, dtype=bool)] if h > 1 else np.array([np.inf])
    caps = links.gpu_cap_bytes_per_s[np.isfinite(links.gpu_cap_bytes_per_s)]
    typical = float(np.median(off)) if h > 1 else float(np.median(caps)) if len(caps) else 0.0
    if len(caps):
        typical = min(typical, float(np.median(caps)))
    found: list[tuple[str, tuple[int, ...], float]] = []
    for a in range(h):
        for b in range(a + 1, h):
            if links.host_bytes_per_s[a, b] < SLOW_SHARE * typical:
                found.append(("hosts", (a, b), float(links.host_bytes_per_s[a, b])))
    for g, cap in enumerate(links.gpu_cap_bytes_per_s):
        if cap < SLOW_SHARE * typical:
            found.append(("gpu", (g,), float(cap)))
    return found


LinkKey = tuple[str, tuple[int, ...]]  # ("hosts", (a, b)) or ("gpu", (g,))


def traffic(cfg: ParallelConfig, slots: np.ndarray, links: Links) -> dict[LinkKey, set[str]]:
    """Which kinds of traffic ("pipeline", "data-parallel", "tensor-parallel") cross each slow
    link in this placement."""
    per_host = links.gpus_per_host
    gpus = group_gpus(slots, cfg.tp)  # (dp, pp, tp)
    edges: list[tuple[str, np.ndarray, np.ndarray]] = []
    if cfg.pp > 1:
        edges.append(("pipeline", gpus[:, :-1, :], gpus[:, 1:, :]))
    if cfg.dp > 1:
        edges.append(("data-parallel", gpus, np.roll(gpus, -1, axis=0)))
    if cfg.tp > 1:
        edges.append(("tensor-parallel", gpus, np.roll(gpus, -1, axis=2)))
    found: dict[LinkKey, set[str]] = {}
    for kind, key, _bw in slow_links(links):
        for name, a, b in edges:
            a, b = a.ravel(), b.ravel()
            ha, hb = a // per_host, b // per_host
            cross = ha != hb
            if kind == "hosts":
                x, y = key
                hit = cross & (((ha == x) & (hb == y)) | ((ha == y) & (hb == x)))
            else:
                hit = cross & ((a == key[0]) | (b == key[0]))
            if hit.any():
                found.setdefault((kind, key), set()).add(name)
    return found


def slow_links_used(cfg: ParallelConfig, slots: np.ndarray,
                    links: Links) -> list[dict[str, Any]]:
    return [{"link": describe_link(kind, key, links), "traffic": sorted(kinds)}
            for (kind, key), kinds in sorted(traffic(cfg, slots, links).items())]


def describe_link(kind: str, key: tuple[int, ...], links: Links) -> str:
    if kind == "hosts":
        a, b = key
        speed = links.host_bytes_per_s[a, b] / GBIT
        return f"the {speed:.0f} Gb/s link between host {a} and host {b}"
    g = key[0]
    host, local = divmod(g, links.gpus_per_host)
    return (f"the {links.gpu_cap_bytes_per_s[g] / GBIT:.0f} Gb/s network link of GPU {local} "
            f"on host {host}")


def explain(c: Candidate, links: Links) -> str:
    assert c.slots is not None
    parts = []
    before = traffic(c.cfg, default_slots(c.cfg), links)
    after = traffic(c.cfg, c.slots, links)
    for (kind, key), kinds in sorted(before.items()):
        avoided = sorted(kinds - after.get((kind, key), set()))
        if avoided:
            parts.append(f"keeps the {' and '.join(avoided)} traffic off "
                         f"{describe_link(kind, key, links)}")
    for (kind, key), kinds in sorted(after.items()):
        added = sorted(kinds - before.get((kind, key), set()))
        kept = sorted(kinds & before.get((kind, key), set()))
        if added:
            parts.append(f"moves only {' and '.join(added)} traffic onto "
                         f"{describe_link(kind, key, links)}")
        if kept:
            parts.append(f"still sends {' and '.join(kept)} traffic over "
                         f"{describe_link(kind, key, links)} (the search found nothing "
                         "faster without it)")
    if c.default_step_s > c.step_s * 1.005:
        parts.append(f"{c.default_step_s / c.step_s - 1:.0%} faster than Megatron's default "
                     "placement of this configuration")
    return "; ".join(parts) if parts else "no slow link on its paths; fastest by the model"


# -- output --------------------------------------------------------------------------------------


def placement_json(cfg: ParallelConfig, slots: np.ndarray, per_host: int) -> list[list[int]]:
    """[host, local GPU] of every rank (Megatron rank order: tp fastest, then dp, then pp)."""
    gpus = group_gpus(slots, cfg.tp)  # (dp, pp, tp)
    ordered = gpus.transpose(1, 0, 2).reshape(-1)  # rank = tp + TP·(d + DP·s)
    return [[int(g // per_host), int(g % per_host)] for g in ordered]


def candidate_json(c: Candidate, model: ModelSpec, cluster: ClusterSpec) -> dict[str, Any]:
    return {
        "config": {"dp": c.cfg.dp, "pp": c.cfg.pp, "tp": c.cfg.tp,
                   "micro_batch": c.cfg.micro_batch, "virtual_stages": c.cfg.virtual_stages,
                   "microbatches": c.cfg.microbatches(model)},
        "label": c.cfg.label(),
        "step_s": round(c.step_s, 6),
        "default_placement_step_s": round(c.default_step_s, 6),
        "uniform_links_step_s": round(c.uniform_step_s, 6),
        "memory": c.memory.as_json(),
        "memory_headroom_gib": round(c.headroom_gib(cluster), 3),
        "reason": c.reason,
        "slow_links_used": c.slow_links_used,
        "placement": (placement_json(c.cfg, c.slots, cluster.gpus_per_host)
                      if c.slots is not None else None),
    }
