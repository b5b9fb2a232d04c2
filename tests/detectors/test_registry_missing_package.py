"""A detector whose package is not installed: not loaded, one line naming what to install."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainscope.detectors import registry

HIDE_RIVER = """
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "river":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Refuse())
sys.argv = ["trainscope", *sys.argv[1:]]
from trainscope.cli.main import main
main()
"""
LINE = "needs river, which is not installed: pip install 'trainscope[stream]'"


def trainscope_without_river(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", HIDE_RIVER, *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_the_demo_without_river_says_once_what_to_install(tmp_path: Path) -> None:
    done = trainscope_without_river("demo", "--ranks", "8", "--steps", "20", "--no-store",
                                    "--fault", "slow-gpu:rank=5,factor=1.4", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "isolated" not in done.stderr, done.stderr
    about = [line for line in done.stderr.splitlines() if "multivariate" in line]
    assert about == [f"WARNING trainscope.engine.core: detector multivariate not loaded: {LINE}"]
    assert "ALERT" in done.stdout and "rank 5" in done.stdout  # the other detectors ran


def test_detectors_lists_it_as_not_loaded(tmp_path: Path) -> None:
    done = trainscope_without_river("detectors", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("multivariate"))
    assert line.endswith(f"BROKEN: {LINE}"), line
    assert done.stderr == "", done.stderr


def test_a_declared_package_that_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any package a detector declares, not only ones an extra installs."""
    monkeypatch.setitem(registry.BUILTIN_REQUIRES, "trainscope.detectors.multivariate",
                        ("river", "no_such_package_trainscope"))
    result = registry.load(["multivariate", "step-time"])
    assert [d.name for d in result.detectors] == ["step-time"]
    assert result.errors == {"multivariate": "needs no_such_package_trainscope, which is not "
                             "installed: pip install no_such_package_trainscope"}
