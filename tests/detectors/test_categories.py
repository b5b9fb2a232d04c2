"""Honest categories: no ``gpu-*`` category without GPU evidence in the job's data.

The contract's example job (2 stages x 4 ranks, rank 5's backward 1.4x slower) carries NVML
readings; stripped of them (and it has no CUDA layers) it is what a CPU-only gloo job sends.
"""

from __future__ import annotations

import dataclasses

from trainscope.detectors.contract import example_windows
from trainscope.detectors.features import gpu_evidence
from trainscope.detectors.peer import PeerDiffDetector
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

