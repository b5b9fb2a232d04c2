"""`trainscope plan --from-job`: links measured by a (simulated) job with a slow NIC, read back
from a real chDB store, steer the placement away from that GPU's network link."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("chdb", reason="needs the embedded ClickHouse engine (the embedded extra)")

# Balanced stages (a small vocabulary) and large activations: pipeline transfers matter.
PLAN = {
    "model": dict(layers=8, hidden=4096, heads=32, seq_len=4096, vocab=1024, global_batch=64),
    "cluster": dict(hosts=1, gpus_per_host=8, gpu_memory_gib=80, peak_tflops=989),
    "search": dict(top_k=2, micro_batch_sizes=[1]),
}
SLOW_RANK = 5  # dp 2, stage 0, tp 1 of a dp4 × pp4 × tp2 job: host node0000, GPU 5


def trainscope(*args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "trainscope.cli.main", *args],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return done


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("planjob")
    started = str(int(time.time()) - 600)  # measurements about ten minutes old
    out = {}
    for name, faults in (("slow", ["--fault", f"slow-link:rank={SLOW_RANK}"]), ("healthy", [])):
        store = base / name
        trainscope("demo", "--dp", "4", "--pp", "4", "--tp", "2", "--steps", "30",
                   "--job-id", "plan-job", "--start-s", started, "--store", str(store),
                   "--json", *faults)
        out[name] = store
    (base / "plan.yaml").write_text(yaml.safe_dump(PLAN), encoding="utf-8")
    out["plan"] = base / "plan.yaml"
    return out


def plan_json(stores: dict[str, Path], which: str) -> dict:
    done = trainscope("plan", str(stores["plan"]), "--from-job", "plan-job", "--store",
                      str(stores[which]), "--json")
    return json.loads(done.stdout)


@pytest.mark.slow
def test_plan_from_job_avoids_the_slow_link(stores) -> None:
    out = plan_json(stores, "slow")
    measured = out["measured"]
    assert measured["ranks"] == 32 and measured["nic_ranks"] == 32
    assert measured["hosts"] == ["node0000", "node0001", "node0002", "node0003"]
    coverage = "\n".join(measured["coverage"])
    assert f"slow: rank {SLOW_RANK} (node0000 GPU 5)" in coverage
    # Ages are shown: the demo's measurements are about ten minutes old.
    assert re.search(r"newest (9|10|11) min old", coverage), coverage
    slow_gbit = measured["nic"][str(SLOW_RANK)]["gbit_per_s"]
    assert slow_gbit < 0.5 * measured["nominal_gbit_per_s"]
    best = out["recommendations"][0]
    # The winner sends nothing over GPU 5's network link; Megatron's order of it would.
    assert best["slow_links_used"] == []
    assert "network link of GPU 5 on host 0" in best["reason"]
    assert best["step_s"] < best["default_placement_step_s"]
    # The job's own configuration is scored as placed now and re-placed.
    whatif = out["job_whatif"]
    assert whatif["config"] == "dp4 pp4 tp2 mb1"
    assert whatif["current_slow_links_used"], "the demo's placement crosses the slow link"
    assert whatif["replaced_step_s"] <= whatif["current_step_s"]


@pytest.mark.slow
def test_a_healthy_job_reports_no_slow_link(stores) -> None:
    out = plan_json(stores, "healthy")
    assert "slow:" not in "\n".join(out["measured"]["coverage"])
    assert all(r["slow_links_used"] == [] for r in out["recommendations"])
    assert "network link of GPU" not in out["recommendations"][0]["reason"]
    assert out["job_whatif"]["current_slow_links_used"] == []


@pytest.mark.slow
def test_an_unknown_job_is_a_one_line_error(stores) -> None:
    done = subprocess.run([sys.executable, "-m", "trainscope.cli.main", "plan", str(stores["plan"]),
                           "--from-job", "nope", "--store", str(stores["slow"])],
                          capture_output=True, text=True, timeout=300, check=False)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0 and len(lines) == 1, done.stderr
    assert lines[0] == "Error: job 'nope': no topology in the store (is the job id right?)"


@pytest.mark.slow
def test_calibration_takes_the_jobs_compute_times(stores) -> None:
    """The demo's ranks run a 24 ms forward and a 48 ms backward per micro-batch; the achieved
    share of the peak follows from the model file's FLOPs (a middle stage: 2 layers, tp 2)."""
    done = trainscope("plan", str(stores["plan"]), "--from-job", "plan-job", "--store",
                      str(stores["healthy"]), "--calibrate", "--json")
    calibration = json.loads(done.stdout)["calibration"]
    m = PLAN["model"]
    b, s, h = 1, m["seq_len"], m["hidden"]
    layer_flops = 2 * b * s * (4 * h * h + 2 * h * 4 * h) + 4 * b * s * s * h
    expected = 2 * layer_flops / 2 / (0.024 * 989e12)
    assert calibration["mfu"] == pytest.approx(expected, rel=0.03)
    assert calibration["backward_over_forward"] == pytest.approx(2.0, rel=0.03)
    assert calibration["ranks"] == 32
