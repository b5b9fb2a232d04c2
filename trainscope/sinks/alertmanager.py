"""Send alerts to Prometheus Alertmanager (``POST /api/v2/alerts``), never blocking the pipeline.

:meth:`AlertmanagerNotifier.on_window` is the pipeline's ``on_window`` hook: it updates the
:class:`~trainscope.sinks.alert_book.AlertBook` and queues what changed; a daemon thread posts.
Every ``resend_s`` the thread re-sends every firing alert (and recently resolved ones), as
Prometheus does, so Alertmanager keeps them alive and one that restarted learns them again.

The queue holds the latest state of each alert, keyed by its labels: a newer state of an alert
replaces a queued one (counted in ``superseded``, not lost, since only the latest state
matters). It holds at most ``queue_size`` alerts; beyond that the oldest is dropped and counted.
While Alertmanager is unreachable the thread retries with backoff, and the pipeline goes on.

Restarts: :meth:`AlertmanagerNotifier.checkpoint_state` (the book's alerts and those not yet
accepted by Alertmanager, plain data) is stored with each of the pipeline's checkpoints, taken
on the pipeline's thread at the same point of the input as the rest, and
:meth:`AlertmanagerNotifier.restore_state` takes it back before :meth:`start`: the restarted
pipeline sends what was pending and every firing alert at once, with their original
``startsAt``. Alertmanager identifies alerts by their labels, so an alert it already had is not
notified again. Alerts still queued at shutdown are counted as dropped and named in one log line.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from trainscope.schemas.records import Finding
from trainscope.schemas.window import WindowView
from trainscope.sinks.alert_book import Alert, AlertBook, alert_from_state, alert_state

log = logging.getLogger(__name__)

API_PATH = "/api/v2/alerts"
MAX_ALERTS_PER_POST = 500
NAMED_AT_SHUTDOWN = 10  # alerts named in the line about those not sent at shutdown

Post = Callable[[str, list[dict[str, Any]], float], None]


@dataclass
class NotifierStats:
    """``alerts_sent``: alert states Alertmanager accepted; ``posts_failed``: posts that raised
    or got a non-2xx answer (their alerts are re-queued); ``dropped``: alert states that did not
    fit in the queue or were still queued at close; ``restored``: alert states taken from the
    last checkpoint and queued at start (firing, recently resolved or not sent yet)."""

    alerts_fired: int = 0
    alerts_resolved: int = 0
    alerts_sent: int = 0
    posts: int = 0
    posts_failed: int = 0
    superseded: int = 0
    dropped: int = 0
    queued: int = 0
    firing: int = 0
    restored: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class AlertmanagerNotifier:
    def __init__(
        self,
        url: str,
        book: AlertBook,
        *,
        resend_s: float = 60.0,
        hold_s: float | None = None,
        queue_size: int = 10_000,
        timeout_s: float = 5.0,
        max_backoff_s: float = 30.0,
        post: Post | None = None,
    ) -> None:
        """``hold_s``: how far ahead a firing alert's ``endsAt`` lies (default 4 × resend_s,
        as Prometheus); ``post``: how a batch is sent (default: HTTP with urllib)."""
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"Alertmanager URL must start with http:// or https://, got {url!r}")
        if resend_s <= 0 or queue_size < 1:
            raise ValueError(f"resend_s must be > 0 and queue_size >= 1, got {resend_s}, "
                             f"{queue_size}")
        self.url = url.rstrip("/") + API_PATH
        self.book = book
        self.resend_s = resend_s
        self.hold_s = 4 * resend_s if hold_s is None else hold_s
        self.queue_size = queue_size
        self.timeout_s = timeout_s
        self.max_backoff_s = max_backoff_s
        self.post = post or _post_json
        self._queue: OrderedDict[tuple[tuple[str, str], ...], Alert] = OrderedDict()
        self._in_flight: list[Alert] = []  # taken from the queue, not yet accepted
        self._stats = NotifierStats()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # -- the pipeline's side (must never block or raise) ---------------------------------------

    def on_window(self, view: WindowView, findings: list[Finding]) -> None:
        self._observe(view, findings, self.book.observe)

    def on_early(self, view: WindowView, findings: list[Finding]) -> None:
        """Findings flagged before their window closed: fired now, nothing resolved."""
        self._observe(view, findings, self.book.flag)

    def _observe(self, view: WindowView, findings: list[Finding],
                 book: Callable[[str, int, int, list[Finding]], list[Alert]]) -> None:
        try:
            changed = book(view.job_id, view.window_start_ns, view.window_end_ns, findings)
        except Exception:  # a bug here must not stop the stream job
            log.exception("alert book failed on findings of %s", view.job_id)
            return
        self._count(changed)
        if changed:
            self._enqueue(changed)

    def start(self) -> AlertmanagerNotifier:
        self._thread = threading.Thread(target=self._run, name="alertmanager-notifier",
                                        daemon=True)
        self._thread.start()
        return self

    def close(self, timeout_s: float = 5.0, *, checkpointed: bool = False) -> None:
        """Send what is queued (up to ``timeout_s``), then stop; what is left counts as dropped
        and is named in one log line. ``checkpointed``: the pipeline's final checkpoint, which
        holds them, was stored (a restart resends them)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with self._wake:
            left = self._in_flight + list(self._queue.values())
            self._stats.dropped += len(left)
            self._queue.clear()
            self._in_flight = []
        if left:
            log.warning(
                "%d alert(s) not sent to Alertmanager at %s by shutdown: %s; %s", len(left),
                self.url, _describe(left),
                "the checkpoint holds them and the next run on this store and group resends "
                "them" if checkpointed else "no final checkpoint holds them: a restart resends "
                "only what an earlier checkpoint held",
            )

    # -- checkpoints (the pipeline's thread) -----------------------------------------------------

    def checkpoint_state(self) -> dict[str, Any]:
        """The book's alerts and those not accepted by Alertmanager yet, as plain data; equal
        states mean nothing changed (the pipeline checkpoints again only when it changed)."""
        book = self.book.snapshot()
        with self._wake:
            pending = [alert_state(a) for a in self._in_flight + list(self._queue.values())]
        return {"book": book, "pending": pending}

    def restore_state(self, state: dict[str, Any]) -> None:
        """Take a :meth:`checkpoint_state` back, before :meth:`start`: what was pending and
        every alert of the book are queued to be sent first. Raises ValueError naming what is
        wrong (and then changes nothing)."""
        if not isinstance(state, dict) or not isinstance(state.get("pending"), list):
            raise ValueError("alert state without its list of pending alerts")
        pending = [alert_from_state(item) for item in state["pending"]]
        self.book.restore(state.get("book"))
        restored: OrderedDict[tuple[tuple[str, str], ...], Alert] = OrderedDict()
        # A pending alert the book still holds is the book's own object, whose annotations
        # the next windows update; one it forgot (resolved long ago) is sent as it was.
        for alert in [self.book.find(a.key, a.labels) or a for a in pending]:
            restored.setdefault(_identity(alert), alert)
        for alert in self.book.current():
            restored.setdefault(_identity(alert), alert)
        with self._wake:
            for identity, alert in restored.items():
                self._queue.setdefault(identity, alert)
            self._stats.restored += len(restored)
            while len(self._queue) > self.queue_size:
                self._queue.popitem(last=False)
                self._stats.dropped += 1
            self._wake.notify()

    def stats(self) -> NotifierStats:
        with self._wake:
            self._stats.queued = len(self._queue)
        self._stats.firing = self.book.firing()
        return self._stats

    # -- the sending thread --------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                self._loop()
                return
            except Exception:  # a bug must not silence alerting for the rest of the run
                log.exception("Alertmanager notifier failed; restarting it in 1 s")
                with self._wake:
                    if self._stopping:
                        return
                    self._wake.wait(1.0)

    def _loop(self) -> None:
        next_resend_s = time.monotonic() + self.resend_s
        backoff_s = 0.0
        while True:
            with self._wake:
                while not self._queue and not self._stopping:
                    wait_s = next_resend_s - time.monotonic()
                    if wait_s <= 0:
                        break
                    self._wake.wait(wait_s)
                if self._stopping and not self._queue:
                    return
            if time.monotonic() >= next_resend_s:
                next_resend_s = time.monotonic() + self.resend_s
                expired = self.book.expire()
                self._count(expired)
                self._enqueue(self.book.current())
            if self._send_batch():
                backoff_s = 0.0
                continue
            backoff_s = min(self.max_backoff_s, max(0.5, backoff_s * 2))
            with self._wake:
                if self._stopping:
                    return  # close() counts what is left
                self._wake.wait(backoff_s)

    def _send_batch(self) -> bool:
        with self._wake:
            batch = [self._queue.popitem(last=False)[1]
                     for _ in range(min(MAX_ALERTS_PER_POST, len(self._queue)))]
            self._in_flight = batch  # still pending for a checkpoint taken meanwhile
        if not batch:
            return True
        now_s = self.book.clock()
        self._stats.posts += 1
        try:
            self.post(self.url, [a.payload(now_s, self.hold_s) for a in batch], self.timeout_s)
        except Exception as exc:
            self._stats.posts_failed += 1
            if self._stats.posts_failed == 1 or self._stats.posts_failed % 100 == 0:
                log.warning("Alertmanager at %s unreachable (%d failed posts so far): %s",
                            self.url, self._stats.posts_failed, exc)
            self._requeue(batch)
            return False
        with self._wake:
            self._in_flight = []
        self._stats.alerts_sent += len(batch)
        return True

    # -- the queue -----------------------------------------------------------------------------

    def _enqueue(self, alerts: list[Alert]) -> None:
        with self._wake:
            for alert in alerts:
                identity = _identity(alert)
                if self._queue.pop(identity, None) is not None:
                    self._stats.superseded += 1
                self._queue[identity] = alert
            while len(self._queue) > self.queue_size:
                self._queue.popitem(last=False)
                self._stats.dropped += 1
            self._wake.notify()

    def _requeue(self, batch: list[Alert]) -> None:
        """Failed alerts go back in front, unless a newer state of them was queued meanwhile."""
        with self._wake:
            self._in_flight = []
            for alert in reversed(batch):
                identity = _identity(alert)
                if identity in self._queue:
                    self._stats.superseded += 1
                    continue
                self._queue[identity] = alert
                self._queue.move_to_end(identity, last=False)
            while len(self._queue) > self.queue_size:
                self._queue.popitem(last=True)
                self._stats.dropped += 1

    def _count(self, changed: list[Alert]) -> None:
        with self._wake:  # called from the pipeline's thread and the sending one
            for alert in changed:
                if alert.ends_at_s is None:
                    self._stats.alerts_fired += 1
                else:
                    self._stats.alerts_resolved += 1


def _identity(alert: Alert) -> tuple[tuple[str, str], ...]:
    """What Alertmanager tells alerts apart by: their labels."""
    return tuple(sorted(alert.labels.items()))


def _describe(alerts: list[Alert]) -> str:
    """``job: category on rank N (firing)``, for the first few; control characters from
    producers' text are escaped, not sent to the terminal."""
    names = []
    for alert in alerts[:NAMED_AT_SHUTDOWN]:
        labels = alert.labels
        where = (f" on rank {labels['rank']}" if "rank" in labels
                 else f" on stage {labels['stage']}" if "stage" in labels else "")
        state = "firing" if alert.ends_at_s is None else "resolved"
        names.append(_printable(f"{labels.get('job_id', '?')}: "
                                f"{labels.get('category', '?')}{where} ({state})"))
    more = len(alerts) - len(names)
    return "; ".join(names) + (f" and {more} more" if more > 0 else "")


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _post_json(url: str, alerts: list[dict[str, Any]], timeout_s: float) -> None:
    request = urllib.request.Request(
        url, data=json.dumps(alerts).encode(), method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:200].decode(errors="replace")
        raise RuntimeError(f"HTTP {exc.code} from {url}: {detail}") from None
