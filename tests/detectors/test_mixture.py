"""The Gaussian-mixture detector on the simulated cluster's metric stream."""

from __future__ import annotations

import warnings

import pandas as pd
import pytest

from trainscope.detectors.base import ALERT_THRESHOLD
from trainscope.detectors.mixture import MixtureDetector
from trainscope.engine.embedded_job import EmbeddedStreamJob
from trainscope.producers.simulate import ClusterSpec, SimulatedCluster, parse_faults
from trainscope.schemas import metrics as m
from trainscope.schemas.records import Finding, StepRecord
from trainscope.schemas.window import WindowView
from trainscope.testing import check_detector


def run(spec: ClusterSpec, faults: list[str], mark_step: int = 0) -> tuple[list[Finding], int, int]:
    """Findings, closed windows, and when the first rank started step ``mark_step`` (ns)."""
    pipeline = EmbeddedStreamJob(detectors=[MixtureDetector()], window_s=15)
    mark_ns = 2**63
    for records in SimulatedCluster(spec, faults=parse_faults(faults)).batches():
        for r in records:
            if isinstance(r, StepRecord) and r.step == mark_step:
                mark_ns = min(mark_ns, r.start_ns)
        pipeline.process_records(records)
    pipeline.finish()
    return pipeline.findings, pipeline.windows, mark_ns


def test_flags_the_throttled_device_and_names_the_sm_clock() -> None:
    spec = ClusterSpec(job_id="j", dp=4, pp=2, tp=2, steps=120, seed=1)
    findings, windows, _ = run(spec, ["throttle:rank=3"])
    assert findings, "the throttled rank was not flagged"
    assert {f.rank for f in findings} == {3}
    # Every full window once the model is trained flags it: not the first three (grace
    # windows and training) nor the last one, which closes after the final step.
    assert len(findings) >= windows - 4
    for f in findings:
        assert f.category == "gpu-throttle" and f.detector == "mixture"
        assert f.score >= ALERT_THRESHOLD
        assert f.evidence[f"z:{m.SM_CLOCK_MHZ}"] < -3
        assert f.evidence[f"value:{m.SM_CLOCK_MHZ}"] == pytest.approx(1200, rel=0.02)
        assert f.evidence[f"peers:{m.SM_CLOCK_MHZ}"] > 1900
        assert m.SM_CLOCK_MHZ in f.message


def test_a_milder_throttle_that_starts_mid_run_is_found_when_it_starts() -> None:
    spec = ClusterSpec(job_id="j", dp=4, pp=2, tp=2, steps=120, seed=4)
    findings, _, fault_start_ns = run(spec, ["throttle:rank=9,mhz=1750,start=60"], 60)
    assert findings and {(f.rank, f.category) for f in findings} == {(9, "gpu-throttle")}
    # Nothing before the fault: every flagged window ends after the fault's first step began.
    assert all(f.window_end_ns > fault_start_ns for f in findings)
    assert min(f.window_start_ns for f in findings) <= fault_start_ns + 30 * 10**9


@pytest.mark.parametrize(
    "dp,pp,tp,seed", [(4, 2, 2, 1), (4, 2, 2, 2), (8, 4, 1, 6), (8, 4, 1, 12), (2, 1, 4, 3)]
)
def test_quiet_on_healthy_runs(dp: int, pp: int, tp: int, seed: int) -> None:
    spec = ClusterSpec(job_id="j", dp=dp, pp=pp, tp=tp, steps=120, seed=seed)
    findings, windows, _ = run(spec, [])
    assert windows >= 5
    assert findings == []


def test_other_causes_get_their_own_category() -> None:
    spec = ClusterSpec(job_id="j", dp=4, pp=2, tp=2, steps=120, seed=1)
    for fault, rank, category in [
        ("slow-link:rank=6", 6, "network"),
        ("dataloader-stall:rank=2", 2, "dataloader"),
    ]:
        findings, _, _ = run(spec, [fault])
        assert findings and {(f.rank, f.category) for f in findings} == {(rank, category)}


def test_detector_contract() -> None:
    check_detector(MixtureDetector)


def test_identical_vectors_train_one_component_without_library_warnings() -> None:
    # An edge window can leave a single feature with the same deviation (0) on every rank:
    # there is nothing to split into several components.
    ranks = range(44)
    steps = pd.DataFrame({
        "rank": list(ranks), "step": 7, "start_ns": 10**9, "duration_ns": 1_100_000_000,
        "samples": 8, "tokens": 32768, "seq_len_mean": 4096, "seq_len_max": 4096,
    })
    window = WindowView(job_id="j", window_start_ns=0, window_end_ns=15 * 10**9, steps=steps)
    detector = MixtureDetector()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert detector.detect(window) == []
    (model,) = detector._models.values()
    assert model["gmm"].n_components == 1
