"""Findings one alert explains are folded into it, a second fault is not; a partial profile
is not compared with the peers it did not cover."""

from __future__ import annotations

import pandas as pd

from trainscope.detectors.base import ALERT_THRESHOLD
from trainscope.detectors.explain import EXPLAINED_SCORE, fold_explained
from trainscope.detectors.features import always_on_view
from trainscope.detectors.registry import DetectorRunner
from trainscope.schemas.records import Finding
from trainscope.schemas.window import SUMMARY_COLUMNS, WindowView


def _finding(detector: str, rank: int, category: str, score: float = 0.9, **extra) -> Finding:
    return Finding(job_id="j", window_start_ns=0, window_end_ns=1, detector=detector, rank=rank,
                   category=category, score=score, message=f"{category} on rank {rank}", **extra)


def _alerted(findings: list[Finding]) -> set[tuple[str, int, str]]:
    return {(f.detector, f.rank, f.category) for f in findings if f.score >= ALERT_THRESHOLD}


def test_the_ranks_of_an_imbalanced_stage_are_not_alerted_again() -> None:
    stage = _finding("peer-diff", 6, "stage-imbalance", ranks=[6, 7], pp_stage=3,
                     victims=[0, 1, 2, 3, 4, 5])
    folded = fold_explained([stage, _finding("mixture", 6, "slowdown"),
                             _finding("mixture", 7, "slowdown"),
                             _finding("multivariate", 7, "compute")])
    assert _alerted(folded) == {("peer-diff", 6, "stage-imbalance")}
    for f in folded[1:]:
        assert f.score == EXPLAINED_SCORE and f.evidence["explained_by_rank"] == 6
        assert "[explained: part of pipeline stage 3's imbalance, found by peer-diff]" in f.message


def test_a_victim_is_not_a_network_culprit_but_a_second_fault_stays() -> None:
    culprit = _finding("peer-diff", 2, "gpu-compute", victims=[0, 1, 3])
    folded = fold_explained([culprit, _finding("mixture", 1, "network"),
                             _finding("mixture", 3, "gpu-throttle"),
                             _finding("peer-diff", 0, "dataloader")])
    assert _alerted(folded) == {("peer-diff", 2, "gpu-compute"), ("mixture", 3, "gpu-throttle"),
                                ("peer-diff", 0, "dataloader")}
    assert "it waits for rank 2 (gpu-compute)" in folded[1].message


def test_a_rank_waiting_far_more_than_the_straggler_costs_is_not_its_victim() -> None:
    """A slow link's rank sits in the DP group of a rank with GC pauses: it is on the GC
    rank's victim list, but its 182 ms/step cannot be waiting for 41 ms/step of GC pauses."""
    gc = _finding("peer-diff", 173, "python-gc", victims=[109, 45],
                  evidence={"excess_ns_per_step": 41e6})
    link = _finding("peer-diff", 109, "network", evidence={"excess_ns_per_step": 182e6})
    waiting = _finding("peer-diff", 45, "network", evidence={"excess_ns_per_step": 40e6})
    folded = fold_explained([gc, link, waiting])
    assert _alerted(folded) == {("peer-diff", 173, "python-gc"), ("peer-diff", 109, "network")}
    assert "it waits for rank 173 (python-gc)" in folded[2].message


def test_a_host_wait_is_folded_into_the_same_ranks_own_work_alert() -> None:
    loader = _finding("peer-diff", 2, "dataloader", function="next_batch", victims=[0, 1, 3])
    host = _finding("waits", 2, "host", victims=[0, 1, 3],
                    evidence={"outside_instrumented_ns_per_step": 14e6})
    other = _finding("waits", 1, "host", victims=[0, 2, 3])
    folded = fold_explained([loader, host, other])
    assert _alerted(folded) == {("peer-diff", 2, "dataloader"), ("waits", 1, "host")}
    assert folded[1].evidence["outside_instrumented_ns_per_step"] == 14e6
    assert "the same straggler, named with its own dataloader (next_batch)" in folded[1].message


def test_ranks_that_drew_longer_sequences_are_not_alerted_under_a_seq_imbalance() -> None:
    """A metrics-only detector sees the ranks with the longest sequences as busier GPUs; only
    a per-token comparison (peer-diff) can name a slow GPU beside the imbalance."""
    seq = _finding("step-time", -1, "seq-imbalance", score=0.8)
    folded = fold_explained([seq, _finding("mixture", 3, "gpu-compute"),
                             _finding("waits", 4, "host"), _finding("mixture", 5, "slowdown"),
                             _finding("peer-diff", 9, "gpu-compute",
                                      evidence={"per_token": 1.0}),
                             _finding("peer-diff", 8, "gpu-compute"),
                             _finding("mixture", 6, "gpu-throttle")])
    assert _alerted(folded) == {("step-time", -1, "seq-imbalance"),
                                ("peer-diff", 9, "gpu-compute"), ("mixture", 6, "gpu-throttle")}
    assert "the job's seq-imbalance" in folded[1].message
    assert folded[5].score == EXPLAINED_SCORE  # peer-diff without token counts: not per token
    weak = fold_explained([_finding("step-time", -1, "seq-imbalance", score=0.4),
                           _finding("mixture", 3, "gpu-compute")])
    assert _alerted(weak) == {("mixture", 3, "gpu-compute")}


def test_ranks_taking_turns_for_a_cpu_explain_their_own_but_not_a_straggler() -> None:
    """On a busy host the ranks of a job take turns waiting for a CPU (a job-level
    cpu-contention); a rank's compute alert is then one of those turns, unless its groups have
    waited on it window after window: a real straggler (a 4-rank DDP job with 60 extra matmuls
    in one rank's forward, beside a busy test run, lost its alert to this once)."""
    contention = _finding("waits", -1, "cpu-contention", score=1.0, ranks=[0, 1, 2, 3],
                          evidence={"runqueue_wait_ns_per_step": 8e6})
    compute = _finding("peer-diff", 2, "compute", function="forward", victims=[0, 1, 3])
    turn = _finding("peer-diff", 1, "compute", function="forward", victims=[0, 2, 3])

    def late(windows: float) -> Finding:
        return _finding("waits", 2, "host", score=0.3, victims=[0, 1, 3],
                        evidence={"peers_wait_ns_per_step": 15e6,
                                  "consecutive_windows": windows})

    assert _alerted(fold_explained([contention, compute, turn, late(2.0)])) == {
        ("waits", -1, "cpu-contention"), ("peer-diff", 2, "compute")}
    # Waited on in this window only: as likely a turn as a straggler.
    for findings in ([contention, compute, turn, late(1.0)], [contention, compute, turn]):
        folded = fold_explained(findings)
        assert _alerted(folded) == {("waits", -1, "cpu-contention")}
        assert "the job's cpu-contention" in folded[1].message


def test_nothing_is_folded_without_an_explaining_alert() -> None:
    weak = _finding("peer-diff", 2, "gpu-compute", score=0.45, victims=[0, 1, 3])
    network = _finding("mixture", 1, "network")
    job_level = _finding("step-time", -1, "slowdown")
    assert fold_explained([weak, network, job_level]) == [weak, network, job_level]
    # The suspect's own findings from other detectors are not its own victims.
    same = [_finding("peer-diff", 2, "compute", victims=[0, 1]),
            _finding("mixture", 2, "slowdown", victims=[0, 1])]
    assert fold_explained(same) == same


class _Says:
    """A detector that says what it is given, for the runner's folding."""

    def __init__(self, name: str, findings: list[Finding]) -> None:
        self.name = name
        self.findings = findings

    def detect(self, window: WindowView) -> list[Finding]:
        return list(self.findings)


def test_the_runner_folds_across_detectors() -> None:
    runner = DetectorRunner([
        _Says("peer-diff", [_finding("peer-diff", 6, "stage-imbalance", ranks=[6, 7],
                                     pp_stage=3)]),
        _Says("mixture", [_finding("mixture", 7, "slowdown")]),
    ])
    found = runner.run(WindowView("j", 0, 1))
    assert _alerted(found) == {("peer-diff", 6, "stage-imbalance")}
    assert runner.findings_emitted == 2


def _summaries(rows: list[tuple[int, str, str, int, int]]) -> pd.DataFrame:
    return pd.DataFrame([dict(rank=r, layer=layer, name=name, callpath_id=cp, count=1,
                              total_ns=total, m2_ns2=0, min_ns=total, max_ns=total,
                              bytes_total=0) for r, layer, name, cp, total in rows],
                        columns=list(SUMMARY_COLUMNS))


def test_an_on_demand_profile_of_some_ranks_is_not_compared_with_their_peers() -> None:
    always_on = [(r, "torch_op", "forward", 0, 10_000_000) for r in range(4)]
    # The closed loop profiled ranks 1 (the suspect's peer) and 2: their Python frames.
    profile = [(r, "python", "train.py(73): <module>", 7 + r, 88_000_000) for r in (1, 2)]
    view = WindowView("j", 0, 2_000_000_000, summaries=_summaries(always_on + profile))
    seen = always_on_view(view)
    assert set(seen.summaries["layer"]) == {"torch_op"} and len(seen.summaries) == 4
    assert len(view.summaries) == 6  # the view stored is the whole window
    # Every rank with call paths (a replayed profiler trace): they are the data.
    traced = [(r, "python", "train.py(73): <module>", 7, 88_000_000) for r in range(4)]
    whole = WindowView("j", 0, 2_000_000_000, summaries=_summaries(always_on + traced))
    assert always_on_view(whole) is whole
