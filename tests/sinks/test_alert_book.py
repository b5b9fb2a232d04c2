"""The alert book: when a finding fires, stays, resolves, and what Alertmanager is sent."""

from __future__ import annotations

import pytest

from trainscope.schemas.records import Finding
from trainscope.sinks.alert_book import AlertBook

W = 15 * 10**9


class Clock:
    def __init__(self) -> None:
        self.now_s = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now_s


def finding(rank: int = 7, score: float = 0.9, category: str = "gpu-compute", **kw) -> Finding:
    return Finding(job_id="j", window_start_ns=0, window_end_ns=W, detector=kw.pop("detector",
                   "peer-diff"), rank=rank, category=category, score=score,
                   message=f"{category}: rank {rank} is slow", **kw)


def test_fires_once_keeps_firing_and_resolves_after_quiet_windows() -> None:
    clock = Clock()
    book = AlertBook(threshold=0.5, clear_after_windows=2, clock=clock)
    [fired] = book.observe("j", 0, W, [finding(layer="torch_op", function="backward",
                                               evidence={"excess_ms": 230.0}),
                                       finding(detector="mixture", score=0.6)])
    assert fired.labels == {"alertname": "TrainscopeFinding", "job_id": "j", "rank": "7",
                            "category": "gpu-compute", "function": "torch_op/backward",
                            "severity": "critical"}
    assert book.observe("j", W, 2 * W, [finding(score=0.55)]) == []  # still firing: no change
    clock.now_s += 30
    assert book.observe("j", 2 * W, 3 * W, []) == []  # one quiet window is not enough
    [resolved] = book.observe("j", 3 * W, 4 * W, [finding(score=0.2)])  # below threshold
    assert resolved is fired and resolved.ends_at_s == clock.now_s
    payload = resolved.payload(clock.now_s, hold_s=240)
    assert payload["startsAt"].endswith("Z") and payload["endsAt"] > payload["startsAt"]
    assert book.firing() == 0 and book.current() == [resolved]  # re-sent while kept


def test_a_firing_alert_is_held_ahead_so_alertmanager_resolves_it_if_we_die() -> None:
    clock = Clock()
    book = AlertBook(threshold=0.5, clock=clock)
    [alert] = book.observe("j", 0, W, [finding(score=0.6)])
    payload = alert.payload(clock.now_s, hold_s=240)
    assert alert.labels["severity"] == "warning"
    assert "function" not in alert.labels  # no detector named one
    assert payload["endsAt"] == alert.payload(clock.now_s + 240, hold_s=0)["endsAt"]


def test_a_silent_job_resolves_its_alerts_and_old_resolved_ones_are_forgotten() -> None:
    clock = Clock()
    book = AlertBook(threshold=0.5, stale_after_s=600, resolved_kept_s=900, clock=clock)
    book.observe("j", 0, W, [finding()])
    clock.now_s += 599
    assert book.expire() == []
    clock.now_s += 2
    [resolved] = book.expire()
    assert resolved.ends_at_s == clock.now_s and book.firing() == 0
    clock.now_s += 901
    book.expire()
    assert book.current() == []


def test_job_level_findings_are_keyed_by_stage_and_links_name_the_window() -> None:
    book = AlertBook(threshold=0.5, dashboard_url="http://ui:8321/")
    alerts = book.observe("my job", W, 2 * W, [
        finding(rank=-1, pp_stage=2, category="stage-imbalance"),
        finding(rank=-1, pp_stage=3, category="stage-imbalance"),
    ])
    assert sorted(a.labels["stage"] for a in alerts) == ["2", "3"]
    assert all("rank" not in a.labels for a in alerts)
    assert alerts[0].annotations["dashboard"] == (
        f"http://ui:8321/jobs/my%20job?from_ns={W}&to_ns={2 * W}")


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="threshold"):
        AlertBook(threshold=1.5)
    with pytest.raises(ValueError, match="clear_after_windows"):
        AlertBook(threshold=0.5, clear_after_windows=0)


def test_an_early_flag_fires_at_once_resolves_nothing_and_clears_like_any_alert() -> None:
    clock = Clock()
    book = AlertBook(threshold=0.5, clear_after_windows=2, clock=clock)
    [window_alert] = book.observe("j", 0, W, [finding(rank=3)])
    # Mid-window, rank 7 is flagged from its step records: it fires; rank 3's alert is left
    # as it was (a flag is no closed window, so it counts no quiet window for others).
    [flag] = book.flag("j", W, 2 * W, [finding(rank=7, category="straggler", detector="early"),
                                       finding(rank=9, score=0.3, category="straggler",
                                               detector="early")])
    assert flag.labels["category"] == "straggler" and flag.labels["rank"] == "7"
    assert book.firing() == 2 and window_alert.ends_at_s is None
    # The window closes: rank 7 is explained (gpu-compute), the flag is not repeated; after
    # two windows without it, it resolves as any alert does.
    assert [a.labels["category"] for a in book.observe(
        "j", W, 2 * W, [finding(rank=3), finding(rank=7)])] == ["gpu-compute"]
    resolved = book.observe("j", 2 * W, 3 * W, [finding(rank=3), finding(rank=7)])
    assert resolved == [flag] and flag.ends_at_s is not None
