"""Honest categories: no ``gpu-*`` category without GPU evidence in the job's data.

The contract's example job (2 stages x 4 ranks, rank 5's backward 1.4x slower) carries NVML
readings; stripped of them (and it has no CUDA layers) it is what a CPU-only gloo job sends.
"""

from __future__ import annotations

import dataclasses

import pandas as pd

from trainscope.detectors.contract import example_windows
from trainscope.detectors.features import gpu_evidence
from trainscope.detectors.peer import PeerDiffDetector
from trainscope.detectors.peer_own import Suspect, contended_compute
from trainscope.schemas import metrics as m
from trainscope.schemas.window import METRIC_COLUMNS, WindowView, empty_frame


def cpu_only(view: WindowView) -> WindowView:
    return dataclasses.replace(view, metrics=empty_frame(METRIC_COLUMNS))


def test_own_compute_of_a_cpu_only_job_is_compute() -> None:
    views = [cpu_only(v) for v in example_windows(3, slow_rank=5)]
    assert not any(gpu_evidence(v) for v in views)
    detector = PeerDiffDetector()
    found = [f for v in views for f in detector.detect(v)]
    assert {(f.rank, f.category) for f in found} == {(5, "compute")}, found
    assert found[-1].score >= 0.5 and found[-1].message.startswith("compute: rank 5")


def test_own_compute_of_a_gpu_job_stays_gpu_compute_in_windows_without_readings() -> None:
    first, *rest = example_windows(3, slow_rank=5)
    assert gpu_evidence(first)
    detector = PeerDiffDetector()
    found = [f for v in [first, *(cpu_only(v) for v in rest)] for f in detector.detect(v)]
    assert {(f.rank, f.category) for f in found} == {(5, "gpu-compute")}, found


def test_a_cuda_layer_is_gpu_evidence() -> None:
    view = cpu_only(example_windows(1)[0])
    summaries = view.summaries.copy()
    summaries.loc[summaries["name"] == "backward", "layer"] = "cuda_kernel"
    assert gpu_evidence(dataclasses.replace(view, summaries=summaries))



def with_runqueue_wait(view: WindowView, rank: int, share_of_growth: float,
                       base_ns: int = 1_000_000) -> WindowView:
    """The window with every rank's run-queue wait (the producer's schedstat figure):
    ``base_ns`` per step on each, plus ``share_of_growth`` of ``rank``'s backward growth on
    ``rank``."""
    s = view.summaries
    backward = s[s["name"] == "backward"].set_index("rank")["total_ns"]
    growth_ns = float(backward[rank] - backward.drop(rank).median())
    rows = s[s["name"] == "backward"].copy()
    rows["layer"], rows["name"] = m.SCHED_LAYER, m.PROCESS_RUNQUEUE_WAIT
    rows["total_ns"] = rows["count"] * base_ns
    rows.loc[rows["rank"] == rank, "total_ns"] += int(share_of_growth * growth_ns)
    return dataclasses.replace(view, summaries=pd.concat([s, rows], ignore_index=True))


def test_compute_growth_that_the_ranks_cpu_wait_explains_is_cpu_contention() -> None:
    # A busy neighbour on the rank's core: its thread is runnable but not running inside
    # backward, which grows by the wall clock; its run-queue wait grew by more than that.
    views = [with_runqueue_wait(cpu_only(v), 5, 1.2) for v in example_windows(3, slow_rank=5)]
    detector = PeerDiffDetector()
    found = [f for v in views for f in detector.detect(v)]
    assert {(f.rank, f.category) for f in found} == {(5, "cpu-contention")}, found
    last = found[-1]
    assert last.score >= 0.5 and last.function == m.PROCESS_RUNQUEUE_WAIT
    growth = last.evidence["compute_growth_ns_per_step"]
    assert last.evidence["runqueue_wait_excess_ns_per_step"] >= growth > 0
    # One finding: the wait and the compute growth it explains are the same time, once.
    assert last.evidence["excess_ns_per_step"] < 1.5 * growth


def test_compute_growth_with_less_cpu_wait_than_growth_stays_compute() -> None:
    views = [with_runqueue_wait(cpu_only(v), 5, 0.6) for v in example_windows(3, slow_rank=5)]
    detector = PeerDiffDetector()
    alerts = {(f.rank, f.category) for v in views for f in detector.detect(v) if f.score >= 0.5}
    assert (5, "compute") in alerts, alerts


def test_a_bigger_share_of_a_shared_cpu_is_not_contention() -> None:
    # Every rank waits 150 ms per step for a CPU (more busy ranks than cores); the rank with
    # more work of its own is runnable longer and waits longer too, but not twice as long.
    views = [with_runqueue_wait(cpu_only(v), 5, 1.2, base_ns=150_000_000)
             for v in example_windows(3, slow_rank=5)]
    detector = PeerDiffDetector()
    found = [f for v in views for f in detector.detect(v)]
    # Both are reported (here the wait stands out too), the compute growth as its own cause.
    assert (5, "compute") in {(f.rank, f.category) for f in found}, found
    assert not any("compute_growth_ns_per_step" in f.evidence for f in found), found


def test_a_compute_suspect_on_a_rank_not_waiting_for_a_cpu_is_kept() -> None:
    table = pd.DataFrame(
        {("torch_op", "forward"): [20e6, 20e6, 32e6, 32e6],
         (m.SCHED_LAYER, m.PROCESS_RUNQUEUE_WAIT): [1e6, 2e6, 30e6, 2e6]},
        index=pd.Index([0, 1, 2, 3], name="rank"))

    def suspect(rank: int, category: str, name: str, excess_ns: float) -> Suspect:
        return Suspect(rank=rank, layer="torch_op", name=name, category=category,
                       excess_ns=excess_ns, z=8.0, value_ns=0.0, reference_ns=0.0,
                       source="peers")

    contended = suspect(2, "cpu-contention", m.PROCESS_RUNQUEUE_WAIT, 28e6)
    kept = contended_compute(
        [suspect(2, "compute", "forward", 12e6), suspect(3, "compute", "forward", 12e6),
         contended], table, pd.Series(0, index=table.index))
    # Rank 3's compute is its own (no wait); rank 2's is its contention's, kept as evidence.
    assert [(s.rank, s.category) for s in kept] == [(3, "compute"), (2, "cpu-contention")]
    assert contended.evidence == {"compute_growth_ns_per_step": 12e6,
                                  "runqueue_wait_excess_ns_per_step": 28e6}
