"""The detector contract, and the small windows it can be checked on without a pipeline.

Every detector — built-in or plugin — promises that it pickles (the pipeline checkpoints it), is
deterministic, can be deep-copied (the runner keeps one copy per job), does not mutate its input,
handles an empty window, gives scores in [0, 1] and puts only finite numbers in its evidence.
:func:`check_contract` checks those promises on any windows; :func:`contract_windows` makes a
few small ones directly as frames, so the registry can check a plugin as it loads it in
milliseconds, without the window engine above this layer. ``trainscope.testing.check_detector``
runs the same checks on windows of a simulated job run through the real pipeline.
"""

from __future__ import annotations

import copy
import math
import pickle
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from trainscope.detectors.base import Detector
from trainscope.schemas import metrics as m
from trainscope.schemas.errors import TrainscopeError
from trainscope.schemas.records import Topology, WorkerInfo
from trainscope.schemas.window import METRIC_COLUMNS, STEP_COLUMNS, SUMMARY_COLUMNS, WindowView


class ContractViolation(AssertionError, TrainscopeError):
    """A detector broke a promise of the contract; the message says which."""


# The synthetic job: 2 stages of data-parallel ranks, 4 steps of ~400 ms per window. The
# contract's windows have one rank whose backward pass is 40% slower, so detectors have
# something to find; the docstring examples ask for the faults they show.
_STAGES, _DP = 2, 4
_STEPS_PER_WINDOW = 4
_STEP_NS = 400_000_000
_WINDOW_NS = 2_000_000_000
_T0_NS = 1_767_225_600 * 10**9
_SLOW_RANK, _SLOW_FACTOR = 5, 1.4


def contract_windows(count: int = 4, seed: int = 7) -> list[WindowView]:
    """``count`` consecutive windows of a small synthetic job with one slow GPU."""
    return example_windows(count, seed=seed, slow_rank=_SLOW_RANK, slow_factor=_SLOW_FACTOR)


def example_windows(
    count: int = 4,
    *,
    dp: int = _DP,
    seed: int = 7,
    slow_rank: int | None = None,
    slow_factor: float = _SLOW_FACTOR,
    stalled_rank: int | None = None,
    stall_ms: float = 150.0,
) -> list[WindowView]:
    """``count`` consecutive 2 s windows of a synthetic job of 2 pipeline stages × ``dp`` ranks
    (rank r is stage ``r // dp``, data-parallel rank ``r % dp``), 4 steps of 400 ms each.

    ``slow_rank`` runs its backward pass ``slow_factor`` times slower (a slow GPU: the other
    ranks wait for it in the all-reduce, it does not); ``stalled_rank`` waits ``stall_ms`` per
    step for its data loader. The same arguments give the same windows.
    """
    rng = np.random.default_rng(seed)
    workers = [WorkerInfo(rank=r, host=f"host{r // 4}", local_rank=r % 4, dp_rank=r % dp,
                          pp_stage=r // dp) for r in range(_STAGES * dp)]
    topology = Topology(job_id="contract-job", dp_size=dp, pp_size=_STAGES, workers=workers)
    faults = _Faults(slow_rank, slow_factor, stalled_rank, stall_ms * 1e6)
    return [_window(i, rng, topology, faults) for i in range(count)]


@dataclass(frozen=True)
class _Faults:
    slow_rank: int | None
    slow_factor: float
    stalled_rank: int | None
    stall_ns: float


def _window(
    index: int, rng: np.random.Generator, topology: Topology, faults: _Faults
) -> WindowView:
    start = _T0_NS + index * _WINDOW_NS
    summaries, steps, metrics = [], [], []
    for rank in range(topology.world_size):
        slow = faults.slow_factor if rank == faults.slow_rank else 1.0
        stall = faults.stall_ns if rank == faults.stalled_rank else 0.0
        forward = 100e6 * (1 + rng.normal(0, 0.01))
        backward = 200e6 * slow * (1 + rng.normal(0, 0.01))
        wait = max(_STEP_NS - forward - backward, 0) + (80e6 if rank != faults.slow_rank else 0)
        functions = [("step", "step", _STEP_NS), ("torch_op", "forward", forward),
                     ("torch_op", "backward", backward), ("collective", "all_reduce", wait),
                     ("dataloader", "next", 5e6 * (1 + rng.normal(0, 0.02)) + stall)]
        for layer, name, per_step_ns in functions:
            total = int(per_step_ns * _STEPS_PER_WINDOW)
            summaries.append((rank, layer, name, 0, _STEPS_PER_WINDOW, total, 0,
                              int(per_step_ns), int(per_step_ns), 0))
        for k in range(_STEPS_PER_WINDOW):
            step = index * _STEPS_PER_WINDOW + k
            steps.append((rank, step, start + k * _STEP_NS, int(_STEP_NS * slow + stall), 8, 8192,
                          1024, 2048, 0, 0))
        for name, value in ((m.SM_CLOCK_MHZ, 1400.0), (m.SM_UTIL_PCT, 99.0),
                            (m.POWER_W, 690.0), (m.THROTTLE_REASONS, 4.0)):
            metrics.append((rank, f"host{rank // 4}", rank % 4, start, name,
                            value * (1 + rng.normal(0, 0.005)) if name != m.THROTTLE_REASONS
                            else value))
    return WindowView(
        job_id=topology.job_id,
        window_start_ns=start,
        window_end_ns=start + _WINDOW_NS,
        summaries=pd.DataFrame(summaries, columns=list(SUMMARY_COLUMNS)),
        steps=pd.DataFrame(steps, columns=list(STEP_COLUMNS)),
        metrics=pd.DataFrame(metrics, columns=list(METRIC_COLUMNS)),
        topology=topology,
    )


def _require(condition: bool, promise: str) -> None:
    if not condition:
        raise ContractViolation(promise)


def check_contract(factory: Callable[[], Detector], windows: list[WindowView]) -> None:
    """Raise ContractViolation (an AssertionError) naming the first broken promise."""
    detector = factory()
    _require(isinstance(detector, Detector), "must have a `name` and a `detect(window)` method")
    _require(isinstance(detector.name, str) and bool(detector.name),
             "name must be a non-empty string")
    _require(detector.detect(WindowView("job", 0, 10**9)) == [],
             "an empty window gives no finding")

    frozen = [(w.summaries.copy(), w.steps.copy(), w.metrics.copy()) for w in windows]
    first = [detector.detect(w) for w in windows]
    for findings in first:
        for f in findings:
            unknown = sorted(k for k, v in f.evidence.items() if not math.isfinite(v))
            # A NaN reads as "nan ms/step" in a message, breaks JSON readers of the store, and
            # is not equal to itself (the determinism checks below could not pass).
            _require(not unknown, f"evidence {', '.join(unknown)} not a finite number: "
                     "leave out what is not known")
    for w, (s, st, mt) in zip(windows, frozen, strict=True):
        for before, after in ((s, w.summaries), (st, w.steps), (mt, w.metrics)):
            try:
                pd.testing.assert_frame_equal(before, after)
            except AssertionError:
                raise ContractViolation("detect must not mutate the window's frames") from None

    twin = factory()
    twin.detect(WindowView("job", 0, 10**9))
    _require([twin.detect(w) for w in windows] == first,
             "deterministic: two fresh instances gave different findings")

    # The runner gives every job a deep copy of one instance: a copy must start fresh too.
    try:
        clone = copy.deepcopy(factory())
    except Exception as exc:
        raise ContractViolation(
            f"must deep-copy (one copy per job): {type(exc).__name__}: {exc}"
        ) from None
    _require([clone.detect(w) for w in windows] == first, "a deep copy must act like a new one")

    half = len(windows) // 2
    original = factory()
    for w in windows[:half]:
        original.detect(w)
    try:
        restored = pickle.loads(pickle.dumps(original))
    except Exception as exc:
        raise ContractViolation(f"must pickle (checkpoints): {type(exc).__name__}: {exc}") from None
    tail = [original.detect(w) for w in windows[half:]]
    _require(tail == [restored.detect(w) for w in windows[half:]],
             "a pickled and restored detector must continue exactly like the original")
    for findings in first:
        for f in findings:
            _require(0.0 <= f.score <= 1.0, f"score {f.score} outside [0, 1]")
            _require(bool(f.job_id), "findings carry the window's job")
