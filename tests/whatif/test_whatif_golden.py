"""A real 8-worker Megatron production trace against its published what-if figures.

The trace and the figures come from the public data of the OSDI '25 what-if paper
(Apache-2.0, see tests/data/stragglers-ST/). The expected values are read from the published
files, never typed in here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from trainscope.schemas.optrace import load_trace, read_meta
from trainscope.whatif.analysis import WhatIf, analyse, layout_graph, observe
from trainscope.whatif.layout import build_layout
from trainscope.whatif.simulate import simulate

DATA = Path(__file__).resolve().parent.parent / "data" / "stragglers-ST"


def published(name: str) -> dict:
    return json.loads((DATA / name).read_text())


@pytest.fixture(scope="module")
def layout():
    meta = read_meta(DATA / "meta-ST.yaml")
    return build_layout(load_trace(DATA / "trace-ST.parquet", meta), meta)


@pytest.fixture(scope="module")
def result(layout) -> WhatIf:
    return analyse(layout)


def test_slowdown_matches_the_published_one(result):
    expected = published("result-ST.json")["blocking_slowdown"]
    assert pytest.approx(expected, rel=0.01) == result.S
    assert result.fit == 0 and result.warnings == []


def test_characterisation_matches(result):
    assert pytest.approx(published("ms-ST.json")["Ms"], abs=0.05) == result.M_S
    assert pytest.approx(published("mw-ST.json")["Mw"], abs=0.05) == result.M_W
    # One worker is 3% of 8, rounded up.
    assert len(result.top_workers) == 1


def test_per_step_slowdown_ranks_steps_in_the_published_order(result):
    expected = [int(step) for step in published("result-ST.json")["blocking_step_slowdown"]]
    ours = sorted(result.S_per_step, key=lambda step: -result.S_per_step[step])
    assert ours == expected


def test_replay_with_launch_delays_reproduces_observed_steps(layout, result):
    observed = published("result-ST.json")["step_t_base"]
    graph = layout_graph(layout)
    obs = observe(layout, graph)
    replay = simulate(graph, obs.effective_s, obs.effective_s.shape[1:], obs.delay_s)
    expected = np.array([observed[str(step)] for step in layout.step_ids])
    np.testing.assert_allclose(replay.step_time_s, expected, rtol=0.01)
    assert result.sim_error_p90 < 0.01


def test_no_delay_and_ideal_step_times_match(result):
    figures = published("result-ST.json")
    nodelay = np.mean(list(figures["step_t_nodelay"].values()))
    ideal = np.mean(list(figures["step_t_noblk"].values()))
    assert result.step_time_nodelay_s == pytest.approx(nodelay, rel=0.01)
    assert result.step_time_ideal_s == pytest.approx(ideal, rel=0.01)


def test_attribution_names_the_published_culprits(result):
    figures = published("result-ST.json")
    for ours, theirs in (
        (result.S_stage, figures["blocking_decompose_by_stage"]),
        (result.S_dp_rank, figures["blocking_decompose_by_dp_rank"]),
    ):
        assert max(ours, key=ours.get) == int(max(theirs, key=theirs.get))
        for key, value in theirs.items():
            assert ours[int(key)] == pytest.approx(value, rel=0.01)
