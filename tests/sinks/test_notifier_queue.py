"""The notifier's queue: bounded, newest state wins, drops counted, never blocks the caller.

The HTTP post is replaced by a stand-in that refuses (an Alertmanager we cannot reach) or
records; the real Alertmanager is in test_alertmanager.py.
"""

from __future__ import annotations

import threading
from datetime import datetime, timedelta

from trainscope.schemas.records import Finding
from trainscope.schemas.window import WindowView
from trainscope.sinks.alert_book import AlertBook
from trainscope.sinks.alertmanager import AlertmanagerNotifier

W = 15 * 10**9


def window(index: int, ranks: list[int]) -> tuple[WindowView, list[Finding]]:
    view = WindowView("j", index * W, (index + 1) * W)
    return view, [view.finding("peer-diff", rank=r, category="gpu-compute", score=0.9,
                               message=f"rank {r}") for r in ranks]


def test_a_full_queue_drops_the_oldest_and_counts_it() -> None:
    refused = threading.Event()

    def unreachable(url: str, alerts: list, timeout_s: float) -> None:
        refused.set()
        raise ConnectionRefusedError("stand-in: nothing listens")

    notifier = AlertmanagerNotifier("http://127.0.0.1:9", AlertBook(threshold=0.5),
                                    queue_size=2, max_backoff_s=60, post=unreachable)
    notifier.on_window(*window(0, [1, 2, 3, 4, 5]))  # not started: nothing is sent yet
    stats = notifier.stats()
    assert (stats.alerts_fired, stats.queued, stats.dropped) == (5, 2, 3)
    notifier.start()
    assert refused.wait(10)
    notifier.close(timeout_s=1)
    stats = notifier.stats()
    assert stats.posts_failed >= 1 and stats.alerts_sent == 0
    assert (stats.queued, stats.dropped) == (0, 5)  # what was still queued at close counts too


def test_the_latest_state_of_an_alert_replaces_a_queued_one() -> None:
    posted: list[list[dict]] = []
    sent = threading.Event()

    def record(url: str, alerts: list, timeout_s: float) -> None:
        posted.append(alerts)
        sent.set()

    notifier = AlertmanagerNotifier("http://127.0.0.1:9", AlertBook(threshold=0.5,
                                                                     clear_after_windows=1),
                                    post=record)
    notifier.on_window(*window(0, [7]))
    notifier.on_window(*window(1, []))  # resolved before anything was sent
    assert notifier.stats().superseded == 1
    notifier.start()
    assert sent.wait(10)
    notifier.close()
    [[alert]] = posted
    assert alert["labels"]["rank"] == "7"
    # The resolved state (endsAt when it cleared), not the firing one (endsAt 4 minutes ahead).
    starts, ends = (datetime.fromisoformat(alert[k]) for k in ("startsAt", "endsAt"))
    assert timedelta(0) <= ends - starts < timedelta(seconds=5)
    assert notifier.stats().alerts_resolved == 1
