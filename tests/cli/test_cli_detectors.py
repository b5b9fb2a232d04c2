"""``--detectors a,b`` on ``trainscope demo`` and ``trainscope pipeline``: only the named detectors
run; a name that is not registered is a one-line error listing the registered ones. And
``trainscope detectors --help`` / ``--describe NAME``: each detector's parameters, as its
docstring documents them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from pipeline_procs import PipelineProcess, publish

from trainscope.detectors.docs import parameters
from trainscope.detectors.peer import PeerDiffDetector
from trainscope.detectors.registry import available, is_builtin

REGISTERED = "registered: mixture, multivariate, peer-diff, step-time, waits"


def trainscope(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainscope.cli.main", *args],
        capture_output=True, text=True, timeout=timeout_s, check=False,
    )


def error_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0
    assert len(lines) == 1, done.stderr
    return lines[0]


def detectors_in(store: Path, job_id: str | None = None) -> list[str]:
    """The detectors with findings in ``store`` (of ``job_id`` only, if given)."""
    where = f" WHERE job_id = '{job_id}'" if job_id else ""
    done = trainscope("sql", f"SELECT DISTINCT detector FROM findings{where} ORDER BY detector",
                      "--store", str(store), "--format", "csv")
    assert done.returncode == 0, done.stderr
    return done.stdout.split()[1:]


@pytest.mark.parametrize("command", ["demo", "pipeline"])
def test_an_unknown_detector_is_a_one_line_error_listing_the_registered_ones(
    command: str, tmp_path: Path
) -> None:
    # The pipeline's broker address is never reached: the names are checked first.
    where = (["--no-store", "--steps", "2"] if command == "demo"
             else ["--bus", "kafka://127.0.0.1:9", "--store", str(tmp_path / "store")])
    line = error_line(trainscope(command, *where, "--detectors", "peer-diff,peer-dif"))
    assert line == f"Error: --detectors: unknown detector(s) peer-dif; {REGISTERED}"
    assert not (tmp_path / "store").exists()


def test_a_list_without_names_is_an_error() -> None:
    line = error_line(trainscope("demo", "--no-store", "--steps", "2", "--detectors", " , "))
    assert line == "Error: --detectors names no detector"


def test_demo_runs_only_the_named_detectors(tmp_path: Path) -> None:
    fault = ["--fault", "slow-gpu:rank=5,factor=1.5", "--steps", "80", "--start-s", "1767225600"]
    done = trainscope("demo", *fault, "--detectors", "step-time, peer-diff",
                      "--store", str(tmp_path / "some"))
    assert done.returncode == 0, done.stderr
    assert detectors_in(tmp_path / "some") == ["peer-diff"]  # step-time finds nothing here
    done = trainscope("demo", *fault, "--store", str(tmp_path / "all"))
    assert done.returncode == 0, done.stderr
    assert len(detectors_in(tmp_path / "all")) > 1  # without the option, the others find it too


@pytest.mark.kafka
def test_pipeline_runs_only_the_named_detectors(kafka_broker, tmp_path: Path) -> None:
    topic_group = f"detectors-{tmp_path.name}"
    publish(kafka_broker.url, "--job-id", topic_group, "--dp", "4", "--pp", "2", "--tp", "2",
            "--steps", "80", "--start-s", "1767225600", "--fault", "slow-gpu:rank=5,factor=1.5")
    pipeline = PipelineProcess(kafka_broker.url, tmp_path / "store", topic_group,
                               "--detectors", "peer-diff", "--close-idle-s", "2",
                               "--idle-exit-s", "4", logs=tmp_path / "pipeline")
    assert pipeline.wait() == 0, pipeline.err_text()
    # Its own job's: a new group reads the topic from its start, where the jobs of tests that
    # ran before on this broker are too (a clock-skew test's skewed rank, for one).
    assert detectors_in(tmp_path / "store", topic_group) == ["peer-diff"]


def test_help_lists_each_detectors_parameters_from_its_docstring() -> None:
    done = trainscope("detectors", "--help")
    assert done.returncode == 0, done.stderr
    assert "Usage: trainscope detectors [OPTIONS]" in done.stdout
    assert "--describe NAME" in done.stdout
    builtins = {name: ep for name, ep in available().items() if is_builtin(ep)}
    assert len(builtins) == 5
    for name, ep in builtins.items():
        assert f"  {name} ({ep.value})\n" in done.stdout
        documented = parameters(ep.load().__doc__)
        assert documented
        for p in documented:  # name, default and unit on one line
            line = rf"^ +{p.name} +{re.escape(str(p.default))} +{re.escape(str(p.unit))}$"
            assert re.search(line, done.stdout, re.MULTILINE), (name, p.name)
    assert re.search(r"^ +z_min +6\.0 +robust z$", done.stdout, re.MULTILINE)


def test_describe_prints_what_each_parameter_does() -> None:
    done = trainscope("detectors", "--describe", "peer-diff")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "peer-diff (trainscope.detectors.peer:PeerDiffDetector)"
    assert lines[2].startswith("Finds the rank whose own work grew")
    assert "  min_excess_ns : float, default 1e6 (ns per step)" in lines
    flat = " ".join(done.stdout.split())
    for p in parameters(PeerDiffDetector.__doc__):
        assert " ".join(p.description.split()) in flat, p.name
    assert ">>>" not in done.stdout  # the example stays in the docstring


def test_describe_an_unknown_detector_is_a_one_line_error() -> None:
    line = error_line(trainscope("detectors", "--describe", "peer-dif"))
    assert line == f"Error: --describe: unknown detector peer-dif; {REGISTERED}"
