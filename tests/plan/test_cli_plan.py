"""`trainscope plan` as a user runs it: a real process reading a YAML file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

MODEL = dict(layers=32, hidden=4096, heads=32, seq_len=2048, vocab=50304, global_batch=256,
             precision="mixed", optimizer="adam", recompute=False)
CLUSTER = dict(hosts=8, gpus_per_host=8, gpu_memory_gib=80, peak_tflops=989,
               inter_host_gbit_per_s=200,
               links=[{"hosts": [0, 3], "gbit_per_s": 12}, {"hosts": [2, 5], "gbit_per_s": 12},
                      {"hosts": [6, 7], "gbit_per_s": 25}])
SEARCH = dict(top_k=3, micro_batch_sizes=[1])


def trainscope(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainscope.cli.main", *args],
                          capture_output=True, text=True, timeout=300, check=False)


def error_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("Error: ")
    return lines[0]


def write(tmp_path: Path, doc: object) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc), encoding="utf-8")
    return path


def test_json_recommendations_fit_and_beat_the_default_placement(tmp_path) -> None:
    path = write(tmp_path, {"model": MODEL, "cluster": CLUSTER, "search": SEARCH})
    done = trainscope("plan", str(path), "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    recs = out["recommendations"]
    assert len(recs) == 3
    assert [r["step_s"] for r in recs] == sorted(r["step_s"] for r in recs)
    for r in recs:
        assert 0 < r["memory"]["total_gib"] <= 80 and r["memory_headroom_gib"] >= 0
        assert r["step_s"] <= r["default_placement_step_s"] + 1e-9
        gpus = {tuple(p) for p in r["placement"]}
        assert len(r["placement"]) == 64 and len(gpus) == 64
        assert r["reason"]
    # The default placement of the winner crosses the 25 Gb/s link; the searched one avoids it.
    assert "keeps the pipeline traffic off the 25 Gb/s link between host 6 and host 7" in (
        recs[0]["reason"])
    assert recs[0]["slow_links_used"] == []
    uniform = out["uniform_links_choice"]
    assert uniform["measured_links_step_s"] > recs[0]["step_s"]
    # The 7B model's weights and Adam state alone do not fit on one GPU: dp64 is rejected.
    rejected = {r["config"]: r["reason"] for r in out["rejected"]}
    assert "GiB > 80 GiB" in rejected["dp64 pp1 tp1 mb1"]


def test_text_output_and_memory_rejection(tmp_path) -> None:
    small_gpus = dict(CLUSTER, gpu_memory_gib=2)
    path = write(tmp_path, {"model": MODEL, "cluster": small_gpus, "search": SEARCH})
    done = trainscope("plan", str(path), "--show-rejected")
    assert done.returncode == 0, done.stderr
    assert "No configuration fits" in done.stdout
    assert "dp1 pp8 tp8 mb1" in done.stdout
    line = next(x for x in done.stdout.splitlines() if x.strip().startswith("dp1 pp8 tp8 mb1"))
    assert "GiB > 2 GiB" in line and "stage" in line


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ("model: [1, 2", "not valid YAML"),
        ({"model": {**MODEL, "layers": "many"}, "cluster": CLUSTER},
         "model.layers: expected `int`, got `str`"),
        ({"model": {k: v for k, v in MODEL.items() if k != "heads"}, "cluster": CLUSTER},
         "model: object missing required field `heads`"),
        ({"model": {**MODEL, "layer": 3}, "cluster": CLUSTER}, "unknown field `layer`"),
        ({"model": MODEL}, "the 'cluster' section is missing"),
        ({"model": {**MODEL, "heads": 30}, "cluster": CLUSTER},
         "model.hidden (4096) must be a multiple of model.heads (30)"),
        ({"model": MODEL, "cluster": {**CLUSTER, "links": [{"hosts": [0, 9], "gbit_per_s": 5}]}},
         "cluster.links[0]: host 9 is not in a cluster of 8 hosts"),
        ({"model": {**MODEL, "precision": "fp8"}, "cluster": CLUSTER}, "model.precision"),
    ],
)
def test_bad_plan_files_are_one_line_errors(tmp_path, doc, needle) -> None:
    path = write(tmp_path, doc)
    line = error_line(trainscope("plan", str(path)))
    assert str(path) in line
    assert needle in line


def test_missing_file_is_a_one_line_error(tmp_path) -> None:
    line = error_line(trainscope("plan", str(tmp_path / "nope.yaml")))
    assert "nope.yaml: cannot read" in line


def test_the_documented_example_is_what_the_command_prints() -> None:
    root = Path(__file__).resolve().parents[2]
    readme = (root / "docs" / "planning.md").read_text(encoding="utf-8")
    block = readme.split("$ trainscope plan examples/plan-64gpu.yaml\n", 1)[1].split("```")[0]
    rows = [line for line in block.splitlines() if line[:3].strip().isdigit()]
    assert len(rows) == 3
    done = trainscope("plan", str(root / "examples" / "plan-64gpu.yaml"))
    assert done.returncode == 0, done.stderr
    for row in rows:
        assert row in done.stdout.splitlines()
    uniform = next(line for line in block.splitlines() if line.startswith("A planner"))
    assert uniform in done.stdout
