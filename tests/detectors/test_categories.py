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



def with_runqueue_wait(view: WindowView, rank: int, share_of_growth: float) -> WindowView:
    """The window with every rank's run-queue wait (the producer's schedstat figure): 1 ms per
    step on each, plus ``share_of_growth`` of ``rank``'s backward growth on ``rank``."""
    s = view.summaries
    backward = s[s["name"] == "backward"].set_index("rank")["total_ns"]
    growth_ns = float(backward[rank] - backward.drop(rank).median())
    rows = s[s["name"] == "backward"].copy()
    rows["layer"], rows["name"] = m.SCHED_LAYER, m.PROCESS_RUNQUEUE_WAIT
    rows["total_ns"] = rows["count"] * 1_000_000
    rows.loc[rows["rank"] == rank, "total_ns"] += int(share_of_growth * growth_ns)
    return dataclasses.replace(view, summaries=pd.concat([s, rows], ignore_index=True))


def test_compute_growth_that_the_ranks_cpu_wait_explains_is_cpu_contention() -> None:
    # A busy neighbour on the rank's core: its thread is runnable but not running inside
    # backward, which grows by the wall clock; its run-queue wait grew by most of that growth.
    views = [with_runqueue_wait(cpu_only(v), 5, 0.8) for v in example_windows(3, slow_rank=5)]
    detector = PeerDiffDetector()
    found = [f for v in views for f in detector.detect(v)]
    assert {(f.rank, f.category) for f in found} == {(5, "cpu-contention")}, found
    last = found[-1]
    assert last.score >= 0.5
    # One finding: the wait and the compute growth it explains are the same time, once.
    assert len(detector.detect(views[-1])) == 1
    assert last.evidence["runqueue_wait_excess_ns_per_step"] >= (
        0.5 * last.evidence["compute_growth_ns_per_step"])
    share = last.evidence["excess_ns_per_step"] / last.evidence["compute_growth_ns_per_step"]
    assert share <= 1.0, "the compute growth must not be added to the wait it explains"


def test_compute_growth_with_little_cpu_wait_stays_compute() -> None:
    views = [with_runqueue_wait(cpu_only(v), 5, 0.2) for v in example_windows(3, slow_rank=5)]
    detector = PeerDiffDetector()
    found = [f for v in views for f in detector.detect(v) if f.score >= 0.5]
    assert {(f.rank, f.category) for f in found} >= {(5, "compute")}, found
    assert (5, "cpu-contention") not in {(f.rank, f.category) for f in found if f.score >= 0.5}


def test_a_compute_suspect_whose_rank_waited_for_a_cpu_becomes_cpu_contention() -> None:
    # The rank's wait was not itself a suspect (its peers' waits are noisy), but it grew by
    # more than half the compute growth: the growth is the wait, named where it was felt.
    table = pd.DataFrame(
        {("torch_op", "forward"): [20e6, 20e6, 32e6, 20e6],
         (m.SCHED_LAYER, m.PROCESS_RUNQUEUE_WAIT): [1e6, 4e6, 10e6, 2e6]},
        index=pd.Index([0, 1, 2, 3], name="rank"))
    forward = Suspect(rank=2, layer="torch_op", name="forward", category="compute",
                      excess_ns=12e6, z=8.0, value_ns=32e6, reference_ns=20e6, source="peers")
    other = Suspect(rank=1, layer="torch_op", name="forward", category="compute",
                    excess_ns=12e6, z=8.0, value_ns=32e6, reference_ns=20e6, source="peers")
    kept = contended_compute([forward, other], table, pd.Series(0, index=table.index))
    assert [(s.rank, s.category, s.name) for s in kept] == [
        (2, "cpu-contention", "forward"), (1, "compute", "forward")]
    assert kept[0].evidence == {"compute_growth_ns_per_step": 12e6,
                                "runqueue_wait_excess_ns_per_step": 7e6}
