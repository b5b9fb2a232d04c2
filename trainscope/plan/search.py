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

Proposals are scored incrementally (:class:`~trainscope.plan.incremental.IncrementalScore`:
only the replicas and stages a swap touches), and after the cooling :func:`polish` descends
greedily until ``patience(groups)`` proposals in a row improve nothing: that is when the search
counts as converged. ``scoring="full"`` is the search as it was before (every proposal scored
from scratch, no polish), kept as the reference the benchmark and tests compare with.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from trainscope.plan.incremental import IncrementalScore
from trainscope.plan.latency import LatencyModel, default_slots

SCORINGS = ("incremental", "full")


@dataclass(frozen=True)
class SearchResult:
    slots: np.ndarray  # (dp, pp)
    step_s: float
    evaluated: int
    # Convergence evidence: the proposal (annealing, then polish) at which the best placement
    # last improved, and how many were made: the gap is at least patience(groups) when the
    # incremental search ends by converging.
    last_improved: int = 0
    proposals: int = 0


class FullScore:
    """The reference scorer: every proposed placement re-scored from scratch by the full model
    (what the search did before :class:`IncrementalScore`; same interface)."""

    def __init__(self, model: LatencyModel, slots: np.ndarray) -> None:
        self.model, self.current = model, slots.copy()
        self._flat = self.current.reshape(-1)  # a view: swapping in _flat changes current
        self.total = float(model.step_s(self.current[None])[0])
        self._pending: tuple[int, int, float] | None = None

    def propose(self, a: int, b: int) -> float:
        flat = self._flat
        flat[a], flat[b] = flat[b], flat[a]
        new = float(self.model.step_s(self.current[None])[0])
        self._pending = (a, b, new)
        return new

    def accept(self) -> None:
        assert self._pending is not None
        self.total, self._pending = self._pending[2], None

    def reject(self) -> None:
        assert self._pending is not None
        a, b, _ = self._pending
        self._flat[a], self._flat[b] = self._flat[b], self._flat[a]
        self._pending = None

    def placement(self) -> np.ndarray:
        return self.current.copy()


def default_iterations(groups: int) -> int:
    """Proposals per annealing run: 2,000 + 100 per group, at most 20,000 (as before
    incremental scoring). More cooling finds nothing better on the benchmark's clusters: at
    4,096 GPUs the best stops improving within the first 834 proposals and a 5× longer cooling
    ends at the same step time (benchmarks/README.md); :func:`polish` then runs until it stops
    improving."""
    return min(20_000, 2_000 + 100 * groups)


def anneal(
    model: LatencyModel,
    *,
    start: np.ndarray | None = None,
    iterations: int | None = None,
    seed: int = 0,
    scoring: str = "incremental",
) -> SearchResult:
    """One annealing run. ``scoring``: "incremental" (only the replicas and stages a swap
    touches are re-scored) or "full" (every proposal from scratch; the reference). The best
    placement is re-scored from scratch at the end and returned with that score."""
    if scoring not in SCORINGS:
        raise ValueError(f"scoring {scoring!r}: expected one of {', '.join(SCORINGS)}")
    cfg = model.cfg
    groups = cfg.dp * cfg.pp
    first = (default_slots(cfg) if start is None else start).copy()
    score = (IncrementalScore(model, first) if scoring == "incremental"
             else FullScore(model, first))
    cost = score.total
    best, best_cost, last_improved = first, cost, 0
    if groups < 2:
        return SearchResult(best, best_cost, 1)
    if iterations is None:
        iterations = default_iterations(groups)
    rng = np.random.default_rng(seed)
    t_start, t_end = 0.3 * cost, 1e-5 * cost
    cooling = (t_end / t_start) ** (1.0 / max(iterations - 1, 1))
    temperature = t_start
    pairs = rng.integers(0, groups, size=(iterations, 2)).tolist()
    draws = rng.random(iterations).tolist()
    for k in range(iterations):
        a, b = pairs[k]
        if a != b:
            new = score.propose(a, b)
            if new <= cost or draws[k] < math.exp((cost - new) / temperature):
                score.accept()
                cost = new
                if new < best_cost:
                    best, best_cost, last_improved = score.placement(), new, k + 1
            else:
                score.reject()
        temperature *= cooling
    quiet = polished = 0
    if scoring == "incremental":  # "full" is the search as it was, kept as the reference
        best, best_cost, quiet, polished = polish(model, best, rng)
    # The incremental total must be the full model's score of the same placement.
    full = float(model.step_s(best))
    if not math.isclose(full, best_cost, rel_tol=1e-9):
        raise AssertionError(f"incremental score {best_cost!r} != full score {full!r}")
    proposals = iterations + polished
    last = iterations + polished - quiet if polished > quiet else last_improved
    return SearchResult(best, full, proposals + 1, last, proposals)


def polish(model: LatencyModel, start: np.ndarray,
           rng: np.random.Generator) -> tuple[np.ndarray, float, int, int]:
    """Greedy descent from the annealer's best: random swaps, only strict improvements kept,
    until ``patience(groups)`` proposals in a row improve nothing — the convergence test. It
    samples the swaps, it does not try all groups²/2 of them: the benchmark tries every single
    swap of its recommendation. Returns the placement, its score, the proposals since the last
    improvement and the proposals made (at most 50 × patience, a bound on time)."""
    groups = model.cfg.dp * model.cfg.pp
    score = IncrementalScore(model, start)
    limit, made, quiet = patience(groups), 0, 0
    while quiet < limit and made < 50 * limit:
        a, b = (int(x) for x in rng.integers(0, groups, 2))
        made += 1
        quiet += 1
        if a == b:
            continue
        # A relative margin so float rounding of equal placements does not count as progress.
        if score.propose(a, b) < score.total * (1 - 1e-12):
            score.accept()
            quiet = 0
        else:
            score.reject()
    return score.placement(), score.total, quiet, made


def patience(groups: int) -> int:
    """Proposals in a row without improvement that end the search: 4 per group (each group is
    then proposed for a swap 8 times on average), at least 1,000."""
    return max(1_000, 4 * groups)


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
           iterations: int | None = None, scoring: str = "incremental") -> SearchResult:
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
        result = anneal(model, start=first, iterations=iterations, seed=seed + k,
                        scoring=scoring)
        evaluated += result.evaluated
        if best is None or result.step_s < best.step_s:
            best = result
    assert best is not None
    return SearchResult(best.slots, best.step_s, evaluated, best.last_improved, best.proposals)
