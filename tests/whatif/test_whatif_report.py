"""The report's verdict in words, for the three kinds of slowdown, and the model-fit warning."""

from __future__ import annotations

import json
import re

from click.testing import CliRunner

from trainscope.cli.whatif import whatif
from trainscope.whatif.generate import JobSpec
from trainscope.whatif.report import render

WORKERS = "Individual slow workers are the main cause."
STAGES = "Stage partitioning imbalance is the main cause"
SPREAD = "The slowdown is spread out"


def test_single_slow_worker(analyse_spec):
    r = analyse_spec(JobSpec(dp_size=4, pp_size=4, steps=4, worker_factor={(1, 2): 1.5}, seed=31))
    text = render(r)
    assert r.M_W > 0.5
    assert WORKERS in text and STAGES not in text and SPREAD not in text
    assert "Fixing the slowest worker removes" in text


def test_stage_imbalance(analyse_spec):
    r = analyse_spec(JobSpec(dp_size=4, pp_size=4, steps=4, stage_factor={3: 1.3}, seed=32))
    text = render(r)
    assert r.M_S > 0.5 and r.M_W < 0.5
    assert STAGES in text and WORKERS not in text and SPREAD not in text


def test_spread_out(analyse_spec):
    slow = {(0, 0): 1.2, (3, 1): 1.2, (5, 2): 1.2, (7, 0): 1.2, (2, 1): 1.2, (6, 2): 1.2}
    r = analyse_spec(JobSpec(dp_size=8, pp_size=4, steps=4, worker_factor=slow, seed=33))
    text = render(r)
    assert r.M_W < 0.5 and r.M_S < 0.5 and r.S > 1.05
    assert SPREAD in text and WORKERS not in text and STAGES not in text


def test_one_pipeline_stage_is_never_called_a_stage_imbalance(analyse_spec):
    """With one stage, the last stage is the whole job (M_S is 100% whatever happened): a slow
    data-parallel rank is named as such, not as the stages' partitioning."""
    r = analyse_spec(JobSpec(dp_size=4, pp_size=1, steps=4, worker_factor={(2, 0): 1.5}, seed=36))
    text = render(r)
    assert r.M_S == 1.0 and r.M_W > 0.5
    assert WORKERS in text and STAGES not in text and SPREAD not in text
    assert "the job has one pipeline stage, so there is no stage imbalance to weigh" in text
    assert "(M_S)" not in text


def test_no_negative_zero_percent(analyse_spec):
    for seed in range(3):
        text = render(analyse_spec(JobSpec(dp_size=2, pp_size=2, steps=2, seed=seed)))
        assert not re.search(r"-0(\.0+)?%", text), text


def test_trace_that_does_not_fit_is_flagged(trace_files):
    def stretch(df):
        # Forward computes recorded 3× longer than the gaps the schedule leaves for them: no
        # dependency model can replay that.
        fwd = df["optype"] == "forward-compute"
        df.loc[fwd, "duration"] *= 3
        return df

    trace, meta = trace_files(JobSpec(dp_size=2, pp_size=4, steps=3, seed=34), df=stretch)
    runner = CliRunner()
    result = runner.invoke(whatif, ["--trace", str(trace), "--meta", str(meta), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["fit"] != 0 and data["sim_error_median"] > 0.05
    assert any("does not fit the dependency model" in w for w in data["warnings"])
    report = runner.invoke(whatif, ["--trace", str(trace), "--meta", str(meta)])
    assert "warning: the trace does not fit the dependency model" in report.stdout
    # Once on a terminal (stdout and stderr together), in the report; with --json, on stderr.
    assert report.output.count("warning: the trace does not fit the dependency model") == 1
    assert "warning: the trace does not fit the dependency model" in result.stderr
    assert "does NOT fit" in report.stdout


def test_heatmap_has_a_fixed_scale_numbers_and_the_figures_in_its_title(analyse_spec):
    import matplotlib.pyplot as plt

    from trainscope.whatif.plots import figure, score_matrix

    r = analyse_spec(JobSpec(dp_size=3, pp_size=2, steps=3, worker_factor={(2, 1): 2.5}, seed=35))
    fig = figure(r)
    try:
        ax = fig.axes[0]
        assert ax.images[0].get_clim() == (1.0, 1.5)
        assert ax.images[0].get_array().max() <= 1.5  # a 2.5× worker is clipped to the scale
        cells = sorted(t.get_text() for t in ax.texts)
        assert cells == sorted(f"{v:.2f}" for v in score_matrix(r).ravel())
        assert max(score_matrix(r).ravel()) > 1.5
        title = ax.get_title()
        assert f"S = {r.S:.3f}" in title
        assert f"M_W = {r.M_W:.2f}" in title and f"M_S = {r.M_S:.2f}" in title
    finally:
        plt.close(fig)
