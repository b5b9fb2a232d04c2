"""Findings trainscope's own profiling explains: what a profile costs the job it looks at.

An on-demand profile (the closed loop's, or ``trainscope profile``) slows the ranks it covers:
torch's profiler stops on the training thread, and condensing its events (seconds of Python on
a thread of the rank) holds the GIL the training thread needs between its ops. In a
Python-heavy loop a 5-step profile made its rank 4–5× slower for about 6 s (fault matrix case
(b), ``benchmarks/README.md``): its peers waited for it, and the job's ``slowdown`` and the
rank's ``compute`` were alerted, trainscope's cost reported as the job's fault (and a reason to
profile again).

The PyTorch producer reports, as ``profiler_busy_s`` samples, the time a session of its rank
spent recording or being condensed. In a window where some ranks of a job did, an alert
is kept as evidence below the alert threshold, with the profile named in its message, when

- it is new: its rank and category were not alerted in the job's last three windows, not
  counting those a profile ran in (a fault alerted before the profile, which the profile was
  most likely asked for, stays an alert through it, however long the profile takes and even
  where a detector held it below the threshold for a window; the runner
  remembers each window's alerts after this fold and before ``explain.fold_explained``, so a
  fault another alert explained is not new either), and
- it looks like what a profile costs: on a profiled rank, its step time, compute, host time,
  GC, data loading or run-queue wait; on any rank or the job as a whole, a slowdown, waiting
  (``network``) or a run-queue wait.

A finding of any other kind (a throttled GPU, a hang, a stage imbalance) stays an alert.
"""

from __future__ import annotations

import numpy as np

from trainscope.detectors.base import ALERT_THRESHOLD
from trainscope.detectors.explain import explained
from trainscope.schemas.metrics import PROFILER_BUSY_S
from trainscope.schemas.records import Finding
from trainscope.schemas.window import WindowView

# What a profile's cost looks like on the rank it profiles, and on every rank of its job.
_PROFILED_RANK_SYMPTOMS = frozenset({"slowdown", "compute", "gpu-compute", "host", "python-gc",
                                     "dataloader", "cpu-contention", "network"})
_JOB_SYMPTOMS = frozenset({"slowdown", "network", "cpu-contention"})

Alerted = frozenset[tuple[int, str]]


def profile_busy_s(view: WindowView) -> dict[int, float]:
    """Per rank, the seconds its profile sessions recorded or were condensed in the window
    (at most the window's length: a report covers the producer's round it ends)."""
    metrics = view.metrics
    if metrics.empty:
        return {}
    busy = metrics[metrics["name"].to_numpy() == PROFILER_BUSY_S]
    if busy.empty:
        return {}
    ranks = busy["rank"].to_numpy()
    seconds = busy["value"].to_numpy(dtype=float)
    window_s = (view.window_end_ns - view.window_start_ns) / 1e9
    return {int(r): min(float(seconds[ranks == r].sum()), window_s) for r in np.unique(ranks)}


def alerted(findings: list[Finding]) -> Alerted:
    """Each alert's (rank, category): what :func:`fold_own_cost` remembers of a window."""
    return frozenset((f.rank, f.category) for f in findings if f.score >= ALERT_THRESHOLD)


def fold_own_cost(findings: list[Finding], busy_s: dict[int, float],
                  alerted_before: Alerted) -> list[Finding]:
    """``findings`` of one window of one job, with the new alerts (not in ``alerted_before``)
    that look like the cost of the profiles in ``busy_s`` (rank → seconds) kept as evidence."""
    if not busy_s:
        return findings
    ranks = sorted(busy_s)
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    total_s = sum(busy_s.values())  # evidence: every profiled rank's time together
    why = (f"trainscope's own profile of {who} was recording or being condensed for "
           f"{max(busy_s.values()):.1f} s of this window; a profile slows the ranks it covers")
    out = []
    for f in findings:
        if (f.score >= ALERT_THRESHOLD and (f.rank, f.category) not in alerted_before
                and (f.category in _JOB_SYMPTOMS
                     or (f.rank in busy_s and f.category in _PROFILED_RANK_SYMPTOMS))):
            f = explained(f, why, explained_by_profile_s=round(total_s, 3),
                          explained_by_rank=float(f.rank if f.rank in busy_s else ranks[0]))
        out.append(f)
    return out
