"""Plugins through entry points: loaded by name, broken ones reported and isolated."""

from __future__ import annotations

import dataclasses
import sys
import textwrap

import pytest

from trainscope.detectors.contract import contract_windows
from trainscope.detectors.registry import DetectorRunner, UnknownDetector, available, load
from trainscope.schemas.window import WindowView


@pytest.fixture
def plugin_dist(tmp_path, monkeypatch):
    """A real installed distribution (dist-info on sys.path) declaring two detector plugins."""
    pkg = tmp_path / "acme_detectors.py"
    pkg.write_text(textwrap.dedent("""
        class Good:
            name = "acme-good"
            def detect(self, window):
                if window.summaries.empty:
                    return []
                return [window.finding(self.name, category="hang", score=0.9, message="acme")]

        class Exploding:
            # Passes the contract, then raises on the windows of one job (a plugin's bug).
            name = "acme-exploding"
            def detect(self, window):
                if window.job_id == "explodes":
                    raise RuntimeError("boom")
                return []

        class Unpicklable:
            name = "acme-unpicklable"
            def __init__(self):
                import threading
                self.lock = threading.Lock()
            def detect(self, window):
                return []

        class HoldsLambda:
            name = "acme-holds-lambda"
            def __init__(self):
                self.key = lambda window: window.job_id
            def detect(self, window):
                return []

        class Mutating:
            name = "acme-mutating"
            def detect(self, window):
                if not window.steps.empty:
                    window.steps.loc[window.steps.index[0], "duration_ns"] = 0
                return []

        class Random:
            name = "acme-random"
            def detect(self, window):
                import os
                if window.summaries.empty:
                    return []
                score = os.urandom(1)[0] / 255
                return [window.finding(self.name, category="hang", score=score, message="?")]

        class RaisesOnEmpty:
            name = "acme-raises-on-empty"
            def detect(self, window):
                return [window.summaries["rank"].iloc[0]]

        raise_on_import = False
    """))
    (tmp_path / "broken_plugin.py").write_text("raise ImportError('missing dependency xyz')\n")
    dist = tmp_path / "acme_detectors-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-detectors\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[trainscope.detectors]\n"
        "acme-good = acme_detectors:Good\n"
        "acme-exploding = acme_detectors:Exploding\n"
        "acme-broken = broken_plugin:Detector\n"
        "acme-unpicklable = acme_detectors:Unpicklable\n"
        "acme-mutating = acme_detectors:Mutating\n"
        "acme-holds-lambda = acme_detectors:HoldsLambda\n"
        "acme-random = acme_detectors:Random\n"
        "acme-raises-on-empty = acme_detectors:RaisesOnEmpty\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("acme_detectors", None)


def job_window(job_id: str) -> WindowView:
    """A small window with data (the contract's synthetic job) of the job ``job_id``."""
    return dataclasses.replace(contract_windows(count=1)[0], job_id=job_id)


def test_builtins_are_registered() -> None:
    assert {"peer-diff", "step-time", "multivariate"} <= set(available())


def test_broken_plugin_is_reported_and_skipped(plugin_dist) -> None:
    result = load(["acme-good", "acme-broken", "peer-diff"])
    assert [d.name for d in result.detectors] == ["acme-good", "peer-diff"]
    assert "missing dependency xyz" in result.errors["acme-broken"]


def test_unknown_detector_name_is_a_loud_error() -> None:
    with pytest.raises(UnknownDetector, match=r"unknown detector.*no-such"):
        load(["no-such"])


def test_a_plugin_that_breaks_the_contract_is_not_loaded_and_says_why(plugin_dist) -> None:
    names = ["acme-good", "acme-unpicklable", "acme-holds-lambda", "acme-mutating",
             "acme-random", "acme-raises-on-empty", "acme-exploding"]
    result = load(names)
    assert [d.name for d in result.detectors] == ["acme-good", "acme-exploding"]
    assert result.errors == {
        "acme-unpicklable": "fails the detector contract: must deep-copy (one copy per job): "
                            "TypeError: cannot pickle '_thread.lock' object",
        "acme-holds-lambda": "fails the detector contract: must pickle (checkpoints): "
                             "AttributeError: Can't pickle local object "
                             "'HoldsLambda.__init__.<locals>.<lambda>'",
        "acme-mutating": "fails the detector contract: detect must not mutate the window's "
                         "frames",
        "acme-random": "fails the detector contract: deterministic: two fresh instances gave "
                       "different findings",
        "acme-raises-on-empty": "fails the detector contract: IndexError: single positional "
                                "indexer is out-of-bounds",
    }
    # Without the check they load (and would fail later, far from their cause).
    unchecked = load(names, check_plugins=False)
    assert [d.name for d in unchecked.detectors] == names and not unchecked.errors


def test_a_raising_detector_is_isolated(plugin_dist) -> None:
    runner = DetectorRunner(load(["acme-exploding", "acme-good"]).detectors)
    window = job_window("explodes")
    findings = runner.run(window) + runner.run(window)
    assert [f.detector for f in findings] == ["acme-good", "acme-good"]
    assert runner.errors == {"acme-exploding": 2}


class Counting:
    """Remembers how many windows it saw, and says so in its finding."""

    name = "counting"

    def __init__(self) -> None:
        self.seen = 0

    def detect(self, window):
        self.seen += 1
        return [window.finding(self.name, category="hang", score=0.1,
                               message=f"window {self.seen} of {window.job_id}")]


def test_every_job_gets_its_own_detector_state() -> None:
    template = Counting()
    runner = DetectorRunner([template])
    messages = [f.message for job in ("a", "b", "a", "a", "b")
                for f in runner.run(WindowView(job, 0, 10**9))]
    assert messages == ["window 1 of a", "window 1 of b", "window 2 of a", "window 3 of a",
                        "window 2 of b"]
    assert template.seen == 0, "the instance handed over is a template, never run"


def test_jobs_beyond_the_bound_are_forgotten_least_recently_seen_first(caplog) -> None:
    runner = DetectorRunner([Counting()], max_jobs=2)
    for job in ("a", "b", "a", "c"):  # c pushes out b, seen before a's second window
        runner.run(WindowView(job, 0, 10**9))
    assert runner.jobs() == ["a", "c"] and runner.evicted_jobs == 1
    assert "detector state of job b evicted" in caplog.text
    (finding,) = runner.run(WindowView("b", 0, 10**9))
    assert finding.message == "window 1 of b", "an evicted job starts afresh"


def test_plugins_are_cloned_per_job_too(plugin_dist) -> None:
    runner = DetectorRunner(load(["acme-good"]).detectors)
    findings = runner.run(job_window("a")) + runner.run(job_window("b"))
    assert [(f.job_id, f.detector) for f in findings] == [("a", "acme-good"), ("b", "acme-good")]
    assert runner.jobs() == ["a", "b"]


class Sleepy:
    name = "sleepy"

    def detect(self, window: WindowView) -> list:
        import time

        started = time.perf_counter()
        while time.perf_counter() - started < 0.01:  # busy, so the time is spent here
            pass
        raise RuntimeError("after the work")


def test_time_in_each_detector_is_summed_even_when_it_raises() -> None:
    import pickle

    runner = DetectorRunner([Counting(), Sleepy()])
    for job in ("a", "b"):
        runner.run(WindowView(job, 0, 10**9))
    assert set(runner.detect_seconds) == {"counting", "sleepy"}
    assert runner.detect_seconds["sleepy"] >= 0.02
    assert runner.detect_seconds["counting"] < runner.detect_seconds["sleepy"]
    # A checkpoint from before the field existed restores with it empty.
    old = pickle.loads(pickle.dumps(runner))
    del old.__dict__["detect_seconds"]
    restored = pickle.loads(pickle.dumps(old))
    assert restored.detect_seconds == {}
    restored.run(WindowView("a", 0, 10**9))
    assert restored.detect_seconds["sleepy"] > 0
