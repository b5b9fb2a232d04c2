"""Search over placements: which slot (tp consecutive GPUs of one host) each tensor-parallel
group (replica d, stage s) gets.

Simulated annealing swaps the slots of two groups at a time and accepts a worse placement with
the Metropolis probability; the temperature falls geometrically from 30% of the starting step
time to almost nothing (a slow link can make one swap cost tens of per cent, and the way out
of a bad placement may pass through worse ones), and the best placement ever seen is kept.
:func:`search` runs it from Megatron's default placement and from random ones. A swap is the
natural move: every placement is a permutation of slots and two swaps reach any other. For
small clusters :func:`exhaustive` scores every permutation (vectorised, in chunks) and is the
reference the annealer is tested against.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from trainscope.plan.latency import LatencyModel, default_slots


@dataclass(frozen=True)
class SearchResult:
    slots: np.ndarray  # (dp, pp)
    step_s: float
    evaluated: int


def anneal(
    model: LatencyModel,
    *,
    start: np.ndarray | None = None,
    iterations: int | None = None,
    seed: int = 0,
) -> SearchResult:
    cfg = model.cfg
    groups = cfg.dp * cfg.pp
    current = (default_slots(cfg) if start is None else start).copy()
    flat = current.reshape(-1)  # a view: swapping in flat changes current
    cost = float(model.step_s(current[None])[0])
    best, best_cost = current.copy(), cost
    if groups < 2:
        return SearchResult(best, best_cost, 1)
    if iterations is None:
        iterations = min(20_000, 2_000 + 100 * groups)
    rng = np.random.default_rng(seed)
    t_start, t_end = 0.3 * cost, 1e-5 * cost
    cooling = (t_end / t_start) ** (1.0 / max(iterations - 1, 1))
    temperature = t_start
    pairs = rng.integers(0, groups, size=(iterations, 2))
    draws = rng.random(iterations)
    for k in range(iterations):
        a, b = pairs[k]
        if a != b:
            flat[a], flat[b] = flat[b], flat[a]
            new = float(model.step_s(current[None])[0])
            if new <= cost or draws[k] < math.exp((cost - new) / temperature):
                cost = new
                if new < best_cost:
                    best, best_cost = current.copy(), new
            else:
                flat[a], flat[b] = flat[b], flat[a]
        temperature *= cooling
    return SearchResult(best, best_cost, iterations + 1)


def _permutations(groups: int, chunk: int) -> Iterator[np.ndarray]:
    it = itertools.permutations(range(groups))
    while True:
        block = list(itertools.islice(it, chunk))
        if not block:
            return
        yield np.asarray(block, dtype=np.int64)


def exhaustive(model: LatencyModel, chunk: int = 20_000) -> SearchResult:
    """Every placement of a small configuration (groups! permutations)."""
    cfg = model.cfg
    groups = cfg.dp * cfg.pp
    if groups > 9:
        raise ValueError(f"{groups} groups: {math.factorial(groups)} placements is too many")
    best_cost, best, seen = math.inf, None, 0
    for block in _permutations(groups, chunk):
        slots = block.reshape(len(block), cfg.dp, cfg.pp)
        cost = model.step_s(slots)
        i = int(np.argmin(cost))
        seen += len(block)
        if cost[i] < best_cost:
            best_cost, best = float(cost[i]), slots[i].copy()
    assert best is not None
    return SearchResult(best, best_cost, seen)


def search(model: LatencyModel, *, start: np.ndarray | None = None,
           restarts: int | None = None, seed: int = 0,
           iterations: int | None = None) -> SearchResult:
    """The best of annealing runs from ``start`` (default: Megatron's placement) and
    ``restarts`` random ones
    (default: 2 up to 64 groups, where a run is cheap and the landscape small enough for a
    random start to matter; none beyond, where the default start is the best one we have)."""
    cfg = model.cfg
    if restarts is None:
        restarts = 2 if cfg.dp * cfg.pp <= 64 else 0
    rng = np.random.default_rng(seed)
    best: SearchResult | None = None
    evaluated = 0
    for k in range(restarts + 1):
        first = start if k == 0 else rng.permutation(cfg.dp * cfg.pp).reshape(cfg.dp, cfg.pp)
        result = anneal(model, start=first, iterations=iterations, seed=seed + k)
        evaluated += result.evaluated
        if best is None or result.step_s < best.step_s:
            best = result
    assert best is not None
    return SearchResult(best.slots, best.step_s, evaluated)
