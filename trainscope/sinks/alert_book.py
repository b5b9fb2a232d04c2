"""Which findings are alerts right now: the state behind the Alertmanager notifier.

An alert is one suspect of one job: ``(job_id, rank, category)`` (a job-level finding without a
rank is keyed by its pipeline stage instead). It fires in the first window in which a finding
for it reaches the threshold, and resolves once ``clear_after_windows`` consecutive windows of
its job passed without one, or once its job sent no window for ``stale_after_s`` (the job ended
or the pipeline lost it). Alertmanager identifies an alert by its labels, so the labels are
fixed when the alert fires: ``function`` is the function named in that window (by the strongest
finding that names one) and ``severity`` comes from that window's strongest score
(``critical`` at or above :data:`CRITICAL_SCORE`, else ``warning``). Annotations (message,
evidence, the dashboard link) follow the latest window.

Times: ``startsAt`` and ``endsAt`` are wall-clock times of the pipeline (when it first saw the
finding, when it saw it clear), because Alertmanager expires and resolves alerts by its own
clock; the window the data came from is in the annotations. Like Prometheus, a firing alert is
sent with an ``endsAt`` ``hold_s`` ahead, so Alertmanager resolves it by itself if the pipeline
dies and stops re-sending.

The book's state (:meth:`AlertBook.snapshot`, plain data) goes into the pipeline's checkpoint, so
a restarted pipeline keeps its alerts firing with their original ``startsAt`` instead of
firing them anew (see :mod:`trainscope.sinks.alertmanager`).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote, urlencode

from trainscope.schemas.records import Finding

ALERT_NAME = "TrainscopeFinding"
CRITICAL_SCORE = 0.8
STATE_VERSION = 1  # of AlertBook.snapshot(), checkpointed: a change needs a reader of the old

AlertKey = tuple[str, int, int, str]  # job_id, rank, pp_stage (rank-less findings), category


@dataclass
class Alert:
    key: AlertKey
    labels: dict[str, str]
    annotations: dict[str, str]
    generator_url: str
    starts_at_s: float
    ends_at_s: float | None = None  # set when it resolved
    windows_missed: int = 0

    def payload(self, now_s: float, hold_s: float) -> dict[str, Any]:
        """The alert as Alertmanager's v2 API takes it (``POST /api/v2/alerts``)."""
        ends_at_s = self.ends_at_s if self.ends_at_s is not None else now_s + hold_s
        body: dict[str, Any] = {
            "labels": dict(self.labels),
            "annotations": dict(self.annotations),
            "startsAt": _iso(self.starts_at_s),
            "endsAt": _iso(ends_at_s),
        }
        if self.generator_url:
            body["generatorURL"] = self.generator_url
        return body


@dataclass
class _Job:
    last_window_s: float  # wall clock when its last window was observed
    alerts: dict[AlertKey, Alert] = field(default_factory=dict)


class AlertBook:
    """Thread-safe: the pipeline observes windows, the notifier's thread reads and expires."""

    def __init__(
        self,
        *,
        threshold: float,
        clear_after_windows: int = 2,
        stale_after_s: float = 600.0,
        resolved_kept_s: float = 900.0,
        dashboard_url: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        if clear_after_windows < 1:
            raise ValueError(f"clear_after_windows must be >= 1, got {clear_after_windows}")
        self.threshold = threshold
        self.clear_after_windows = clear_after_windows
        self.stale_after_s = stale_after_s
        self.resolved_kept_s = resolved_kept_s
        self.dashboard_url = dashboard_url.rstrip("/") if dashboard_url else None
        self.clock = clock
        self._jobs: dict[str, _Job] = {}
        # Resolved alerts are re-sent for a while, as Prometheus does, so an Alertmanager that
        # missed the first resolve (down, restarted) still resolves them.
        self._resolved: dict[AlertKey, Alert] = {}
        self._lock = threading.Lock()

    def observe(
        self, job_id: str, window_start_ns: int, window_end_ns: int, findings: Iterable[Finding]
    ) -> list[Alert]:
        """One closed window of one job; returns the alerts that fired or resolved in it."""
        now_s = self.clock()
        by_key: dict[AlertKey, list[Finding]] = {}
        for finding in findings:
            if finding.score >= self.threshold:
                by_key.setdefault(_key(job_id, finding), []).append(finding)
        changed: list[Alert] = []
        with self._lock:
            job = self._jobs.setdefault(job_id, _Job(last_window_s=now_s))
            job.last_window_s = now_s
            for key, found in by_key.items():
                alert = job.alerts.get(key)
                if alert is None:
                    alert = job.alerts[key] = self._fire(key, found, now_s)
                    self._resolved.pop(key, None)
                    changed.append(alert)
                alert.windows_missed = 0
                alert.annotations = self._annotations(job_id, found, window_start_ns,
                                                      window_end_ns)
                alert.generator_url = self._link(job_id, window_start_ns, window_end_ns)
            for key, alert in list(job.alerts.items()):
                if key in by_key:
                    continue
                alert.windows_missed += 1
                if alert.windows_missed >= self.clear_after_windows:
                    changed.append(self._resolve(job, key, now_s))
        return changed

    def flag(
        self, job_id: str, window_start_ns: int, window_end_ns: int, findings: Iterable[Finding]
    ) -> list[Alert]:
        """Findings raised before their window closed (the early flag): they fire now and
        resolve as any alert does, after windows without them; nothing else is resolved."""
        now_s = self.clock()
        changed: list[Alert] = []
        with self._lock:
            job = self._jobs.setdefault(job_id, _Job(last_window_s=now_s))
            for finding in findings:
                if finding.score < self.threshold:
                    continue
                key = _key(job_id, finding)
                alert = job.alerts.get(key)
                if alert is None:
                    alert = job.alerts[key] = self._fire(key, [finding], now_s)
                    self._resolved.pop(key, None)
                    changed.append(alert)
                alert.windows_missed = 0
                alert.annotations = self._annotations(job_id, [finding], window_start_ns,
                                                      window_end_ns)
                alert.generator_url = self._link(job_id, window_start_ns, window_end_ns)
        return changed

    def expire(self) -> list[Alert]:
        """Resolve the alerts of jobs silent for ``stale_after_s``; forget old resolved ones."""
        now_s = self.clock()
        changed: list[Alert] = []
        with self._lock:
            for job_id, job in list(self._jobs.items()):
                if now_s - job.last_window_s < self.stale_after_s:
                    continue
                for key in list(job.alerts):
                    changed.append(self._resolve(job, key, now_s))
                del self._jobs[job_id]
            for key, alert in list(self._resolved.items()):
                if alert.ends_at_s is not None and now_s - alert.ends_at_s > self.resolved_kept_s:
                    del self._resolved[key]
        return changed

    def current(self) -> list[Alert]:
        """Every firing alert and every recently resolved one: what a re-send sends."""
        with self._lock:
            firing = [a for job in self._jobs.values() for a in job.alerts.values()]
            return firing + list(self._resolved.values())

    def firing(self) -> int:
        with self._lock:
            return sum(len(job.alerts) for job in self._jobs.values())

    # -- checkpoints -------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The firing and recently resolved alerts as plain data (a checkpoint's part).

        Deterministic for one state, so equal snapshots mean nothing changed. When each job
        last sent a window is left out: the restored book counts its jobs as seen at the
        restart, so a pipeline's downtime does not make their alerts stale."""
        with self._lock:
            return {
                "version": STATE_VERSION,
                "jobs": {job_id: [alert_state(a) for a in job.alerts.values()]
                         for job_id, job in self._jobs.items() if job.alerts},
                "resolved": [alert_state(a) for a in self._resolved.values()],
            }

    def restore(self, state: Any) -> None:
        """Take the alerts of :meth:`snapshot`; raises ValueError naming what is wrong."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"alert book state of version {_version(state)}, "
                             f"expected {STATE_VERSION}")
        now_s = self.clock()
        jobs: dict[str, _Job] = {}
        try:
            for job_id, alerts in state["jobs"].items():
                job = jobs[str(job_id)] = _Job(last_window_s=now_s)
                for item in alerts:
                    alert = alert_from_state(item)
                    job.alerts[alert.key] = alert
            resolved = {a.key: a for a in map(alert_from_state, state["resolved"])}
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"bad alert book state: {type(exc).__name__}: {exc}") from None
        with self._lock:
            self._jobs, self._resolved = jobs, resolved

    def find(self, key: AlertKey, labels: dict[str, str]) -> Alert | None:
        """The firing or recently resolved alert of ``key`` that has these labels, if any."""
        with self._lock:
            job = self._jobs.get(key[0])
            alert = (job.alerts.get(key) if job is not None else None) or self._resolved.get(key)
            return alert if alert is not None and alert.labels == labels else None

    # -- building alerts ---------------------------------------------------------------------

    def _fire(self, key: AlertKey, found: list[Finding], now_s: float) -> Alert:
        job_id, rank, pp_stage, category = key
        named = [f for f in found if f.function]
        top = max(named or found, key=lambda f: f.score)
        function = f"{top.layer}/{top.function}" if top.layer and top.function else top.function
        labels = {
            "alertname": ALERT_NAME,
            "job_id": job_id,
            "category": category,
            "severity": "critical" if max(f.score for f in found) >= CRITICAL_SCORE else "warning",
        }
        # An empty label is no label to Alertmanager; leave it out rather than send "".
        if rank >= 0:
            labels["rank"] = str(rank)
        elif pp_stage >= 0:
            labels["stage"] = str(pp_stage)
        if function:
            labels["function"] = function
        return Alert(key=key, labels=labels, annotations={}, generator_url="",
                     starts_at_s=now_s)

    def _resolve(self, job: _Job, key: AlertKey, now_s: float) -> Alert:
        alert = job.alerts.pop(key)
        alert.ends_at_s = now_s
        self._resolved[key] = alert
        return alert

    def _annotations(
        self, job_id: str, found: list[Finding], window_start_ns: int, window_end_ns: int
    ) -> dict[str, str]:
        top = max(found, key=lambda f: (bool(f.function), f.score))
        evidence = {f"{f.detector}.{k}": round(v, 6) for f in found for k, v in f.evidence.items()}
        victims = sorted({v for f in found for v in f.victims})
        annotations = {
            "summary": f"{top.category} on rank {top.rank}" if top.rank >= 0 else top.category,
            "message": top.message,
            "score": f"{max(f.score for f in found):.2f}",
            "detectors": ",".join(sorted({f.detector for f in found})),
            "evidence": json.dumps(evidence, sort_keys=True),
            "window": f"{_iso(window_start_ns / 1e9)}/{_iso(window_end_ns / 1e9)}",
        }
        if victims:
            annotations["victims"] = ",".join(map(str, victims))
        link = self._link(job_id, window_start_ns, window_end_ns)
        if link:
            annotations["dashboard"] = link
        return annotations

    def _link(self, job_id: str, window_start_ns: int, window_end_ns: int) -> str:
        if self.dashboard_url is None:
            return ""
        query = urlencode({"from_ns": window_start_ns, "to_ns": window_end_ns})
        return f"{self.dashboard_url}/jobs/{quote(job_id, safe='')}?{query}"


def alert_state(alert: Alert) -> dict[str, Any]:
    """One alert as plain data, for a checkpoint."""
    return {
        "key": list(alert.key), "labels": dict(alert.labels),
        "annotations": dict(alert.annotations), "generator_url": alert.generator_url,
        "starts_at_s": alert.starts_at_s, "ends_at_s": alert.ends_at_s,
        "windows_missed": alert.windows_missed,
    }


def alert_from_state(state: dict[str, Any]) -> Alert:
    """The alert of :func:`alert_state`; raises ValueError naming what is wrong."""
    try:
        job_id, rank, pp_stage, category = state["key"]
        ends_at_s = state["ends_at_s"]
        return Alert(
            key=(str(job_id), int(rank), int(pp_stage), str(category)),
            labels={str(k): str(v) for k, v in state["labels"].items()},
            annotations={str(k): str(v) for k, v in state["annotations"].items()},
            generator_url=str(state["generator_url"]),
            starts_at_s=float(state["starts_at_s"]),
            ends_at_s=None if ends_at_s is None else float(ends_at_s),
            windows_missed=int(state["windows_missed"]),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"bad alert in the alert state: {type(exc).__name__}: {exc}") from None


def _version(state: object) -> object:
    return state.get("version") if isinstance(state, dict) else type(state).__name__


def _key(job_id: str, finding: Finding) -> AlertKey:
    stage = finding.pp_stage if finding.rank < 0 else -1
    return (job_id, finding.rank, stage, finding.category)


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z"
    )
