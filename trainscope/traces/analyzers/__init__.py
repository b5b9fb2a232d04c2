"""Analyzers with suggestions: one rule each, run on one rank's trace; the report lists their
suggestions with the most time at stake first."""

from __future__ import annotations

from trainscope.traces.analyzers.base import Analyzer, Suggestion, TraceView
from trainscope.traces.analyzers.host import DataLoaderWaits, PageableCopies, Synchronisations
from trainscope.traces.analyzers.idle import IdleGpu
from trainscope.traces.analyzers.kernels import KernelMix, breakdown
from trainscope.traces.analyzers.launches import LaunchBound, TinyKernels
from trainscope.traces.analyzers.overlap import CommOverlap

__all__ = ["ANALYZERS", "Analyzer", "Suggestion", "TraceView", "breakdown", "run_all"]


def default_analyzers() -> list[Analyzer]:
    return [KernelMix(), IdleGpu(), CommOverlap(), LaunchBound(), TinyKernels(),
            PageableCopies(), Synchronisations(), DataLoaderWaits()]


ANALYZERS = tuple(a.name for a in default_analyzers())


def run_all(view: TraceView, analyzers: list[Analyzer] | None = None) -> list[Suggestion]:
    found = [s for a in (analyzers or default_analyzers()) for s in a.analyze(view)]
    return sorted(found, key=lambda s: -s.at_stake_ns)
