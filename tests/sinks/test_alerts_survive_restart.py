"""Alerts survive restarts: the notifier's state is in the pipeline's checkpoint.

The process test is the rolling restart of issue 22: ``trainscope pipeline`` as its own process
over the real broker, Alertmanager unreachable while a fault crosses the alert threshold, the
pipeline SIGTERMed with the alert still queued, then the real Alertmanager started and the
pipeline restarted on the same store and group: the webhook receives the alert once, firing,
naming the rank, with the ``startsAt`` of the first run; a second rolling restart, Alertmanager
up, keeps it firing, and nothing more comes after further re-sends.
The unit tests take the state through a checkpoint and back, in process, with the real chDB
store; where Alertmanager is out of reach they pass a ``post`` stand-in that refuses.
"""

from __future__ import annotations

import json
import logging
import re
import time
from datetime import datetime
from pathlib import Path

import pytest
from alertmanager_proc import Alertmanager, WebhookReceiver, free_port, require_alertmanager
from kafka_broker import TansuBroker
from metrics_scrape import scrape_until, value
from pipeline_procs import PipelineProcess, publish

from trainscope.cli.demo_job import publish_step
from trainscope.detectors.peer import PeerDiffDetector
from trainscope.engine.bus_job import BusStreamJob
from trainscope.engine.checkpoint import Checkpoint, ExtraState, decode
from trainscope.producers.simulate import ClusterSpec, SimulatedCluster, parse_faults
from trainscope.schemas.records import Finding
from trainscope.schemas.window import WindowView
from trainscope.sinks.alert_book import AlertBook
from trainscope.sinks.alertmanager import AlertmanagerNotifier
from trainscope.sinks.clickhouse import ClickHouseSink
from trainscope.transport.memory import MemoryBus

W_NS = 5 * 10**9
WINDOW_S = 5.0


class Clock:
    def __init__(self) -> None:
        self.now_s = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now_s


def finding(rank: int, score: float = 0.9, category: str = "gpu-compute") -> Finding:
    return Finding(job_id="j", window_start_ns=0, window_end_ns=W_NS, detector="peer-diff",
                   rank=rank, category=category, score=score,
                   message=f"{category}: rank {rank} is slow", function="backward",
                   layer="torch_op")


# -- the state round-trip ---------------------------------------------------------------------


def test_the_book_restores_firing_and_resolved_alerts_with_their_times() -> None:
    clock = Clock()
    book = AlertBook(threshold=0.5, clear_after_windows=2, clock=clock)
    book.observe("j", 0, W_NS, [finding(3), finding(5)])
    clock.now_s += 10
    book.observe("j", W_NS, 2 * W_NS, [finding(3)])  # rank 5 missed one window
    book.observe("k", 0, W_NS, [finding(1)])
    clock.now_s += 10
    book.observe("k", W_NS, 2 * W_NS, [])
    [resolved] = book.observe("k", 2 * W_NS, 3 * W_NS, [])
    state = json.loads(json.dumps(book.snapshot()))  # plain data
    assert state == book.snapshot()  # deterministic: equal state, equal snapshot

    clock.now_s += 3600  # the pipeline was down an hour
    restored = AlertBook(threshold=0.5, clear_after_windows=2, clock=clock)
    restored.restore(state)
    assert restored.firing() == 2
    assert ([a.payload(0, 0) for a in restored.current()]
            == [a.payload(0, 0) for a in book.current()])  # startsAt, endsAt, labels kept
    assert restored.find(resolved.key, resolved.labels) is not None
    # Still firing: the same finding changes nothing, rank 5's second quiet window resolves it.
    [cleared] = restored.observe("j", 2 * W_NS, 3 * W_NS, [finding(3)])
    assert cleared.labels["rank"] == "5" and cleared.ends_at_s == clock.now_s
    # The downtime does not make job j stale: it counts as seen at the restart. The alert
    # resolved an hour ago is forgotten (resolved_kept_s), by its own endsAt.
    assert restored.expire() == []
    assert restored.find(resolved.key, resolved.labels) is None


def test_a_bad_book_state_is_refused_with_what_is_wrong() -> None:
    book = AlertBook(threshold=0.5)
    with pytest.raises(ValueError, match="version 7"):
        book.restore({"version": 7})
    with pytest.raises(ValueError, match="bad alert"):
        book.restore({"version": 1, "jobs": {"j": [{"key": ["j", 1]}]}, "resolved": []})
    assert book.firing() == 0


class Refusing:
    """A ``post`` stand-in for an Alertmanager that cannot be reached."""

    def __init__(self) -> None:
        self.tries = 0

    def __call__(self, url: str, alerts: list, timeout_s: float) -> None:
        self.tries += 1
        raise ConnectionRefusedError(111, "Connection refused")


class Recording:
    """A ``post`` stand-in that accepts and keeps every batch."""

    def __init__(self) -> None:
        self.posted: list[list[dict]] = []

    def __call__(self, url: str, alerts: list, timeout_s: float) -> None:
        self.posted.append(alerts)


def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.01)


def test_a_queued_alert_is_named_at_shutdown_and_sent_by_the_next_notifier(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    refusing = Refusing()
    first = AlertmanagerNotifier("http://127.0.0.1:1", AlertBook(threshold=0.5, clock=clock),
                                 resend_s=60, max_backoff_s=0.05, post=refusing).start()
    first.on_window(WindowView("j\x1b[31m", 0, W_NS), [finding(6)])
    wait_until(lambda: refusing.tries >= 2)
    state = first.checkpoint_state()
    with caplog.at_level(logging.WARNING, logger="trainscope.sinks.alertmanager"):
        first.close(checkpointed=True)
    assert first.stats().dropped == 1
    [line] = [r.getMessage() for r in caplog.records if "by shutdown" in r.getMessage()]
    assert "1 alert(s) not sent" in line and "gpu-compute on rank 6 (firing)" in line
    assert "\x1b" not in line and "\\x1b[31m" in line  # the producer's text, escaped
    assert "the next run on this store and group resends them" in line
    [pending] = state["pending"]
    assert pending["labels"]["rank"] == "6"

    clock.now_s += 120
    recording = Recording()
    second = AlertmanagerNotifier("http://127.0.0.1:1", AlertBook(threshold=0.5, clock=clock),
                                  resend_s=60, post=recording)
    second.restore_state(json.loads(json.dumps(state)))
    assert second.stats().restored == 1 and second.stats().firing == 1
    second.start()
    wait_until(lambda: recording.posted)
    second.close()
    [[alert]] = recording.posted
    assert alert["labels"]["rank"] == "6" and alert["labels"]["job_id"] == "j\x1b[31m"
    assert alert["startsAt"] == first.book.current()[0].payload(0, 0)["startsAt"]
    assert second.stats().dropped == 0 and second.stats().alerts_sent == 1


def test_a_bad_notifier_state_changes_nothing() -> None:
    notifier = AlertmanagerNotifier("http://127.0.0.1:1", AlertBook(threshold=0.5),
                                    post=Recording())
    with pytest.raises(ValueError, match="pending"):
        notifier.restore_state({"book": {}})
    with pytest.raises(ValueError, match="version"):
        notifier.restore_state({"book": {"version": 0}, "pending": []})
    assert notifier.stats().queued == 0 and notifier.stats().firing == 0


def test_a_checkpoint_of_before_the_alert_state_reads_without_it() -> None:
    """The 0.1.0 checkpoint (tests/data/checkpoint-0.1.0) has no ``extra``: it reads as None."""
    data = Path(__file__).parents[1] / "data" / "checkpoint-0.1.0" / "checkpoint.bin"
    checkpoint = decode(data.read_bytes())
    assert isinstance(checkpoint, Checkpoint) and checkpoint.extra is None


START_NS = 1_767_225_600 * 10**9


def faulty_job_on(bus: MemoryBus, start_ns: int = START_NS, seed: int = 3) -> int:
    """40 steps of a job whose rank 5 is slow, from ``start_ns``; where they ended."""
    cluster = SimulatedCluster(
        ClusterSpec(job_id="sick", dp=4, pp=2, tp=1, steps=40, seed=seed, window_s=WINDOW_S,
                    start_ns=start_ns),
        parse_faults(["slow-gpu:rank=5,factor=1.5"]),
    )
    end_ns = start_ns
    for out in cluster.run():
        publish_step(bus, cluster, out, out.step == 0 and start_ns == START_NS)
        end_ns = max([end_ns] + [r.start_ns + r.duration_ns for r in out.steps])
    return end_ns


def stream_job(bus: MemoryBus, sink: ClickHouseSink, notifier: AlertmanagerNotifier
               ) -> BusStreamJob:
    return BusStreamJob(
        bus, group="alerts", sink=sink, window_s=WINDOW_S, lateness_s=1.0,
        detectors=[PeerDiffDetector()], on_window=notifier.on_window,
        # A job that pauses has its windows closed after 0.3 s of polling.
        commit_interval_s=3600.0, job_idle_s=0.3, source_idle_s=0.2,
        extra_state={"alertmanager": ExtraState(notifier.checkpoint_state,
                                                notifier.restore_state)},
    )


def stored_state(sink: ClickHouseSink) -> dict:
    blob = sink.read_checkpoint("alerts")
    assert blob is not None
    extra = decode(blob).extra
    assert extra is not None
    return extra["alertmanager"]


def test_the_stream_job_checkpoints_the_alerts_with_its_positions(tmp_path: Path) -> None:
    """The state goes into the checkpoint stored with each commit, a commit stores it again
    when only it changed (Alertmanager accepted what was pending), and a restarted job hands
    it back before it polls: the job's later windows keep the alert firing, not fire it anew."""
    bus = MemoryBus()
    end_ns = faulty_job_on(bus)
    sink = ClickHouseSink.open(tmp_path / "store")
    try:
        refusing = Refusing()
        first_notifier = AlertmanagerNotifier("http://127.0.0.1:1", AlertBook(threshold=0.5),
                                              max_backoff_s=0.05, post=refusing).start()
        first = stream_job(bus, sink, first_notifier)
        wait_until(lambda: first.poll_once(timeout_s=0.02) == 0 and refusing.tries > 0
                   and first.engine.open_windows() == 0)
        assert first.finish(drain=False)  # SIGTERM: open windows and alerts to the checkpoint
        first_notifier.close(checkpointed=True)
        state = stored_state(sink)
        fired = {a["labels"]["rank"] for a in state["pending"]}
        assert fired == {"5"} and first_notifier.stats().dropped == 1

        recording = Recording()
        second_notifier = AlertmanagerNotifier("http://127.0.0.1:1", AlertBook(threshold=0.5),
                                               post=recording)
        second = stream_job(bus, sink, second_notifier)
        assert second_notifier.stats().restored == 1
        assert second.commit()  # nothing new: no checkpoint needed
        assert stored_state(sink) == state
        second_notifier.start()
        wait_until(lambda: second_notifier.stats().alerts_sent == 1)
        assert second.commit()
        assert stored_state(sink)["pending"] == []  # accepted: checkpointed as such
        windows = second.windows
        faulty_job_on(bus, end_ns, seed=4)  # the job goes on, rank 5 still slow
        while second.poll_once(timeout_s=0.0):
            pass
        assert second.finish(drain=True)
        assert second.windows > windows
        second_notifier.close(checkpointed=True)
    finally:
        sink.close()
    starts = {a["startsAt"] for batch in recording.posted for a in batch}
    assert len(starts) == 1  # one alert, never fired anew
    assert second_notifier.stats().alerts_fired == 0 and second_notifier.book.firing() == 1


class Hook:
    """An ExtraState hook whose save or restore can be made to raise (a hook with a bug)."""

    def __init__(self, value: object, *, save_raises: bool = False,
                 restore_raises: bool = False) -> None:
        self.value, self.save_raises, self.restore_raises = value, save_raises, restore_raises
        self.restored: list[object] = []

    def save(self) -> object:
        if self.save_raises:
            raise RuntimeError("save failed (test)")
        return self.value

    def restore(self, state: object) -> None:
        if self.restore_raises:
            raise ValueError("state of another version (test)")
        self.restored.append(state)


def test_a_hook_that_fails_costs_only_its_own_state(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    bus = MemoryBus()
    faulty_job_on(bus)
    sink = ClickHouseSink.open(tmp_path / "store")

    def job(**hooks: Hook) -> BusStreamJob:
        return BusStreamJob(bus, group="hooks", sink=sink, window_s=WINDOW_S,
                            detectors=[PeerDiffDetector()], commit_interval_s=3600.0,
                            extra_state={n: ExtraState(h.save, h.restore)
                                         for n, h in hooks.items()})

    try:
        first = job(good=Hook({"n": 1}), bad=Hook(None, save_raises=True))
        first.poll_once(timeout_s=0.0)
        with caplog.at_level(logging.ERROR, logger="trainscope.engine.bus_job"):
            assert first.finish(drain=False)  # the checkpoint is stored all the same
        assert [r.getMessage() for r in caplog.records] == ["bad state not checkpointed"]
        open_windows = first.engine.open_windows()
        assert open_windows > 0

        good, newcomer = Hook(None), Hook(None)
        second = job(good=good, newcomer=newcomer)
        assert good.restored == [{"n": 1}]
        assert newcomer.restored == []  # nothing was stored under its name
        assert second.engine.open_windows() == open_windows

        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="trainscope.engine.bus_job"):
            third = job(good=Hook(None, restore_raises=True))
        assert third.engine.open_windows() == open_windows  # the job's own state is restored
        assert any("ignoring the good state in the last checkpoint of hooks: state of "
                   "another version" in r.getMessage() for r in caplog.records)
    finally:
        sink.close()


# -- the rolling restart, as processes ----------------------------------------------------------

ALERT_LINE = r"^ALERT \[\d\.\d\d\] sick: .*rank 6"


def _wait_for_text(read, pattern: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        text = read()
        if re.search(pattern, text, re.MULTILINE):
            return text
        assert time.monotonic() < deadline, f"no {pattern!r} in:\n{text}"
        time.sleep(0.1)


def _firing(notifications: list[dict]) -> list[dict]:
    return [n for n in notifications if n["status"] == "firing"]


# A firing alert is held in Alertmanager four re-sends ahead: for the runs before a restart
# 40 s, longer than a restart takes even on a busy machine, so Alertmanager does not resolve it
# by itself meanwhile; the last run re-sends every second, to see re-sends make no duplicate.
RESEND_S = 10.0
LAST_RESEND_S = 1.0
SENT = "trainscope_alertmanager_alerts_sent_total"


@pytest.mark.kafka
@pytest.mark.slow
def test_an_alert_queued_at_sigterm_reaches_alertmanager_once_across_restarts(
    fresh_kafka_broker: TansuBroker, webhook: WebhookReceiver, tmp_path: Path,
) -> None:
    """Run 1 fires the alert with Alertmanager down and is SIGTERMed; run 2, Alertmanager up,
    delivers it; run 3, after a second rolling restart, keeps it firing: one notification."""
    require_alertmanager()
    port = free_port()  # nothing listens here until Alertmanager starts, after the SIGTERM

    def pipeline(name: str, resend_s: float = RESEND_S, *extra: str) -> PipelineProcess:
        return PipelineProcess(
            fresh_kafka_broker.url, tmp_path / "store", "rolling", "--window-s", "5",
            "--close-idle-s", "1", "--source-idle-s", "1", "--commit-interval-s", "0.5",
            "--alert-resend-s", str(resend_s), "--no-auto-profile",
            "--alertmanager", f"http://127.0.0.1:{port}", *extra, logs=tmp_path / name)

    first = pipeline("first")
    try:
        publish(fresh_kafka_broker.url, "--job-id", "sick", "--dp", "4", "--pp", "2", "--tp",
                "2", "--steps", "20", "--window-s", "5", "--fault", "slow-gpu:rank=6,factor=1.4")
        _wait_for_text(first.out_text, ALERT_LINE, timeout_s=60)
        _wait_for_text(first.err_text, "Alertmanager at .* unreachable", timeout_s=30)
    finally:
        code = first.terminate()
    stopped_s = time.time()
    assert code == 0, first.err_text()
    assert first.stats()["alertmanager"]["dropped"] == 1
    [line] = [x for x in first.err_text().splitlines() if "by shutdown" in x]
    assert "1 alert(s) not sent to Alertmanager" in line
    assert "sick: gpu-compute on rank 6 (firing)" in line
    assert "the checkpoint holds them" in line

    (tmp_path / "am").mkdir()
    manager = Alertmanager(tmp_path / "am", webhook.url, port=port)
    runs: list[PipelineProcess] = []
    try:
        manager.wait_ready()
        runs.append(pipeline("second"))
        notifications = webhook.wait_for(_firing, timeout_s=60)
        time.sleep(1.5)  # a duplicate would come within a group interval (1 s)
        assert runs[0].terminate() == 0, runs[0].err_text()
        # The second rolling restart, Alertmanager up: the alert was sent, and is kept firing.
        runs.append(pipeline("third", LAST_RESEND_S,
                             "--metrics-port", str(metrics_port := free_port())))
        # Sent at the restart, then re-sent each second; a duplicate would follow within a
        # group interval.
        scrape_until(metrics_port, lambda m: value(m, SENT) >= 3, timeout_s=60)
        time.sleep(1.5)
        later = webhook.wait_for(lambda n: False, timeout_s=0)
        active = manager.alerts()
    finally:
        for run in runs:
            if run.process.poll() is None:
                run.terminate()
        manager.stop()
    assert later == notifications, "a second notification came"
    [notification] = notifications
    assert notification["status"] == "firing"
    [alert] = notification["alerts"]
    assert (alert["labels"]["rank"], alert["labels"]["category"]) == ("6", "gpu-compute")
    # Fired by the first run: the restarted ones kept it, they did not fire it anew.
    starts_s = datetime.fromisoformat(alert["startsAt"]).timestamp()
    assert starts_s < stopped_s
    assert [(a["labels"]["rank"], datetime.fromisoformat(a["startsAt"]).timestamp(),
             a["status"]["state"]) for a in active] == [("6", starts_s, "active")]
    second, third = (run.stats()["alertmanager"] for run in runs)
    assert "by shutdown" not in runs[0].err_text()  # nothing left unsent this time
    for final in (second, third):
        assert final["restored"] == 1 and final["alerts_fired"] == 0 and final["dropped"] == 0
    assert third["alerts_sent"] >= 3
