"""Bounded work per window and per job: caps on distinct functions and open windows, a time
budget per detector and window, and a stop that keeps --stop-timeout-s whatever a detector does.

The process tests run ``trainscope pipeline`` as its own process over the real broker, beside a
hostile producer: one rank naming 1,048,576 distinct functions in one window, in valid summary
batches of the project's own schema and codec, each message under 1 MiB. Before the caps that
held the main thread in peer-diff for over 15 minutes at 1.7 GB and ignored SIGTERM for 10.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from kafka_broker import TansuBroker
from pipeline_procs import PipelineProcess, publish

from trainscope.detectors.budget import OverBudget, time_budget
from trainscope.detectors.registry import DetectorRunner
from trainscope.engine.caps import CapGuard, Caps, Refusal, _pairs
from trainscope.engine.embedded_job import EmbeddedStreamJob
from trainscope.schemas.codec import encode_batch
from trainscope.schemas.records import (
    Finding,
    MetricBatch,
    MetricSample,
    SpanBatch,
    StepBatch,
    StepRecord,
    SummaryBatch,
)
from trainscope.schemas.window import WindowView
from trainscope.transport.bus import EVENTS_TOPIC, Message, open_bus

WINDOW_S = 5
WINDOW_NS = WINDOW_S * 10**9
HOSTILE_NAMES = 1 << 20
NAMES_PER_MESSAGE = 10_000  # ~0.93 MB encoded: under the 1 MiB a Kafka message may hold
# Peak resident memory of the pipeline process (VmHWM) with the hostile rank beside a normal
# job: measured ~0.8 GiB, where the same process with the normal job alone peaks at ~0.5 GiB;
# before the caps this run reached 1.7 GB and kept growing. Documented in docs/stream-job.md.
PEAK_RSS_BOUND_BYTES = 2**30
STOP_TIMEOUT_S = 5
# The process itself has to go away after the stop: interpreter teardown, chDB closing.
EXIT_SLACK_S = 2.0
NORMAL_JOB = ["--job-id", "normal", "--dp", "2", "--pp", "2", "--tp", "2", "--steps", "40",
              "--window-s", str(WINDOW_S), "--fault", "slow-gpu:rank=5,factor=1.5"]


def summaries(job: str, rank: int, names: list[str], window_start_ns: int,
              fn: np.ndarray | None = None) -> SummaryBatch:
    """``fn``: the rows' functions (default: each of ``names`` once, in order)."""
    fn = np.arange(len(names)) if fn is None else fn
    n = len(fn)
    return SummaryBatch.from_arrays(
        job_id=job, window_start_ns=window_start_ns, window_end_ns=window_start_ns + WINDOW_NS,
        layers=["torch_op"] * len(names), names=names, rank=[rank] * n, fn=fn,
        count=np.ones(n), total_ns=np.full(n, 1_000_000), min_ns=np.full(n, 1_000_000),
        max_ns=np.full(n, 1_000_000),
    )


def hostile_payloads(names: int, window_start_ns: int) -> list[bytes]:
    """One rank of job ``hostile`` naming ``names`` distinct functions in one window."""
    payloads = []
    for first in range(0, names, NAMES_PER_MESSAGE):
        last = min(names, first + NAMES_PER_MESSAGE)
        chunk = [f"hostile.generated_fn_{i:08d}" for i in range(first, last)]
        payloads.append(encode_batch([summaries("hostile", 0, chunk, window_start_ns)]))
    assert max(len(p) for p in payloads) < 2**20
    return payloads


def publish_payloads(url: str, payloads: list[bytes]) -> None:
    bus = open_bus(url)
    try:
        for i, payload in enumerate(payloads):
            bus.publish(EVENTS_TOPIC, payload, key=b"hostile/0")
            if i % 16 == 15:  # the producer holds at most 64 MiB pending
                bus.flush()
        bus.flush()
    finally:
        bus.close()


def window_now_ns() -> int:
    return time.time_ns() // WINDOW_NS * WINDOW_NS


_FINDINGS = r"""
import json, sys
from trainscope.sinks.clickhouse import connect
client = connect(sys.argv[1])
rows = client.query("SELECT job_id, window_start_ns, detector, rank, category, function, "
                    "evidence FROM findings ORDER BY ALL").result_rows
dead = client.query("SELECT error FROM dead_letters ORDER BY offset").result_rows
print(json.dumps({"findings": [list(r[:6]) + [dict(r[6])] for r in rows],
                  "dead_letters": [r[0] for r in dead]}))
"""


def read_store(store: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", _FINDINGS, str(store)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def last_stats(p: PipelineProcess) -> dict:
    for line in reversed(p.err_text().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {}


def peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


def wait_for(p: PipelineProcess, condition, timeout_s: float, what: str) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = last_stats(p)
        if stats and condition(stats):
            return stats
        assert p.process.poll() is None, p.err_text()[-3000:]
        assert time.monotonic() < deadline, f"{what}; last stats {stats}\n{p.err_text()[-3000:]}"
        time.sleep(0.2)


@pytest.mark.kafka
@pytest.mark.slow
def test_a_million_function_names_beside_a_normal_job(
    fresh_kafka_broker: TansuBroker, tmp_path: Path
) -> None:
    """The normal job's findings are those it gets alone; the hostile rank is capped, dead-
    lettered and reported; memory stays bounded; SIGTERM is obeyed within --stop-timeout-s,
    also while a detector holds the main thread (a third run, with no budget)."""
    url = fresh_kafka_broker.url
    common = ["--window-s", str(WINDOW_S), "--close-idle-s", "2", "--source-idle-s", "1",
              "--commit-interval-s", "0.5", "--stop-timeout-s", str(STOP_TIMEOUT_S),
              "--no-auto-profile"]
    phases = {"start": time.monotonic()}
    publish(url, *NORMAL_JOB)
    phases["published normal"] = time.monotonic()
    alone = PipelineProcess(url, tmp_path / "alone", "alone", *common, "--idle-exit-s", "3",
                            logs=tmp_path / "alone")
    alone_peak = 0
    try:
        deadline = time.monotonic() + 120
        while alone.process.poll() is None and time.monotonic() < deadline:
            # The same process without the hostile rank, for comparison; it may just exit.
            with contextlib.suppress(OSError, AssertionError):
                alone_peak = max(alone_peak, peak_rss_bytes(alone.process.pid))
            time.sleep(0.2)
        assert alone.wait(timeout_s=10) == 0, alone.err_text()
    finally:
        if alone.process.poll() is None:
            alone.kill()
    phases["alone run"] = time.monotonic()
    normal_windows = alone.stats()["detect"]["received"]
    normal_messages = alone.stats()["decode"]["received"]
    expected = read_store(tmp_path / "alone")["findings"]
    assert expected, "the normal job alone has no findings: its fault was not found"

    phases["read alone"] = time.monotonic()
    payloads = hostile_payloads(HOSTILE_NAMES, window_now_ns())
    publish_payloads(url, payloads)
    phases["published hostile"] = time.monotonic()
    mixed = PipelineProcess(url, tmp_path / "mixed", "mixed", *common, "--drain-on-stop",
                            "--stats-every-s", "0.5", logs=tmp_path / "mixed")
    try:
        # Every message read, and every window of both jobs closed (the hostile job's one).
        stats = wait_for(mixed, lambda s: s["decode"]["received"] >= len(payloads)
                         + normal_messages
                         and s["detect"]["received"] >= normal_windows + 1, 180,
                         "the pipeline did not get through both jobs")
        phases["mixed run"] = time.monotonic()
        peak = peak_rss_bytes(mixed.process.pid)
        started = time.monotonic()
        mixed.process.send_signal(signal.SIGTERM)
        code = mixed.wait(timeout_s=60)
        stop_s = time.monotonic() - started
    finally:
        if mixed.process.poll() is None:
            mixed.kill()
    assert code == 0, mixed.err_text()[-3000:]
    assert stop_s <= STOP_TIMEOUT_S + EXIT_SLACK_S, stop_s
    assert peak < PEAK_RSS_BOUND_BYTES, f"peak RSS {peak / 2**20:.0f} MiB"

    phases["mixed stop"] = time.monotonic()
    final = mixed.stats()
    # The first message fits the per-rank cap; every later one would pass it.
    assert final["capped_messages"] == len(payloads) - 1, final
    assert final["capped_rows"] == HOSTILE_NAMES - NAMES_PER_MESSAGE
    assert final["decode"]["rejected"] == len(payloads) - 1
    got = read_store(tmp_path / "mixed")
    normal = [f for f in got["findings"] if f[0] == "normal"]
    assert [f[:6] for f in normal] == [f[:6] for f in expected]
    [cardinality] = [f for f in got["findings"] if f[0] == "hostile"
                     and f[4] == "cardinality"]
    assert cardinality[3] == 0  # the rank
    assert cardinality[6]["new_functions"] == HOSTILE_NAMES - NAMES_PER_MESSAGE
    assert cardinality[6]["messages"] == len(payloads) - 1
    capped = [e for e in got["dead_letters"] if "--max-functions-per-rank" in e]
    assert len(capped) == len(payloads) - 1
    assert "job 'hostile' rank 0" in capped[0], capped[0]
    phases["read mixed"] = time.monotonic()
    print({b: round(phases[b] - phases[a], 1) for a, b in itertools.pairwise(phases)})
    print(f"peak RSS {peak / 2**20:.0f} MiB (the normal job alone: {alone_peak / 2**20:.0f} MiB), "
          f"stop {stop_s:.2f} s, stats {stats}")

    sigterm_while_a_detector_holds_the_loop(url, tmp_path, final["decode"]["received"])


# A detector plugin that holds the main thread on a window of thousands of functions, as
# peer-diff did on the hostile window (about 20 s of pandas per window of 10,000 functions until
# it scored all functions at once; now well under a second). Found through the entry-point group
# like any plugin, from a distribution on the child's path; on the contract's small windows it
# returns at once.
SLOW_PLUGIN = """
import time


class HoldingDetector:
    name = "holding"

    def detect(self, window):
        if window.summaries["name"].nunique() >= 1000:
            until = time.monotonic() + 60
            while time.monotonic() < until:  # CPU work in Python, as a slow detector's
                pass
        return []
"""


def holding_plugin(directory: Path) -> dict[str, str]:
    """The environment that makes detector ``holding`` available to a child process."""
    directory.mkdir()
    (directory / "holding_detector.py").write_text(SLOW_PLUGIN)
    info = directory / "holding_detector-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: holding-detector\nVersion: 0\n")
    (info / "entry_points.txt").write_text(
        "[trainscope.detectors]\nholding = holding_detector:HoldingDetector\n")
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": os.pathsep.join([str(directory), *([path] if path else [])])}


def sigterm_while_a_detector_holds_the_loop(url: str, tmp_path: Path, messages: int) -> None:
    """No time budget: a detector holds the main thread for a minute on the hostile window
    (``holding``, above). SIGTERM arrives while it runs: the process is gone within
    --stop-timeout-s, with the watchdog's one line and exit status 3."""
    held = PipelineProcess(url, tmp_path / "held", "held", "--window-s", str(WINDOW_S),
                           "--close-idle-s", "2", "--source-idle-s", "1",
                           "--stop-timeout-s", "3", "--detector-budget-s", "0",
                           "--detectors", "holding", "--stats-every-s", "0.2",
                           "--no-auto-profile", logs=tmp_path / "held",
                           env=holding_plugin(tmp_path / "plugin"))
    try:
        wait_for(held, lambda s: s["decode"]["received"] >= messages, 120,
                 "the held pipeline did not read every message")
        # Every message is handled; a stats line follows every poll (0.2 s apart when idle),
        # so none for 1.5 s means the poll loop is held: by the detector on the hostile window.
        deadline = time.monotonic() + 60
        lines, quiet_since = -1, time.monotonic()
        while time.monotonic() - quiet_since < 1.5:
            assert time.monotonic() < deadline, held.err_text()[-3000:]
            assert held.process.poll() is None, held.err_text()[-3000:]
            now_lines = len(held.err_text().splitlines())
            if now_lines != lines:
                lines, quiet_since = now_lines, time.monotonic()
            time.sleep(0.1)
        started = time.monotonic()
        held.process.send_signal(signal.SIGTERM)
        code = held.wait(timeout_s=60)
        stop_s = time.monotonic() - started
    finally:
        if held.process.poll() is None:
            held.kill()
    assert code == 3, held.err_text()[-3000:]
    assert stop_s <= 3 + EXIT_SLACK_S, stop_s
    assert "not stopped 3 s after the stop signal (--stop-timeout-s)" in held.err_text()
    print(f"held pipeline: SIGTERM obeyed in {stop_s:.2f} s")


# -- units: the caps ------------------------------------------------------------------------

T0 = 1_767_225_600 * 10**9


def message(offset: int, *records, partition: int = 0) -> Message:
    return Message(EVENTS_TOPIC, partition, offset, None, encode_batch(list(records)))


def names(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def test_caps_per_rank_per_job_and_open_windows_refuse_whole_messages() -> None:
    caps = Caps(functions_per_rank=10, functions_per_job=15, open_windows=2)
    job = EmbeddedStreamJob(detectors=[], window_s=WINDOW_S, caps=caps)
    job.process_messages([
        message(0, summaries("j", 0, names("a", 8), T0)),
        # The same names again: not new, admitted.
        message(1, summaries("j", 0, names("a", 8), T0)),
        # 8 + 3 new > 10 for rank 0: refused whole, none of its rows windowed.
        message(2, summaries("j", 0, names("b", 3), T0)),
        # Rank 1: 7 new for the job (8 + 7 = 15), admitted; one more is over the job's cap.
        message(3, summaries("j", 1, names("c", 7), T0)),
        message(4, summaries("j", 2, names("d", 1), T0)),
        # A second window opens; a third would be over the open-window cap.
        message(5, summaries("j", 0, names("a", 1), T0 + WINDOW_NS)),
        message(6, summaries("j", 0, names("a", 1), T0 + 2 * WINDOW_NS)),
        # Another job is unaffected.
        message(7, summaries("k", 0, names("a", 10), T0)),
    ])
    stats = job.stats()
    assert stats.capped_messages == 3
    assert stats.capped_rows == 3 + 1 + 1
    assert stats.decode.rejected == 3
    job.finish()
    first = [v for v in job.findings if v.job_id == "j" and v.window_start_ns == T0]
    [card0, card2] = [f for f in first if f.category == "cardinality"]
    assert (card0.rank, card0.evidence["messages"], card0.evidence["rows"]) == (0, 2, 4)
    assert (card2.rank, card2.evidence["new_functions"]) == (2, 1)
    assert card0.score >= 0.5 and "set aside as dead letters" in card0.message
    assert job.windows == 3  # j's first two and k's: j's third never opened


def spans(job: str, rank: int, names: list[str], start_ns: int,
          callpaths: list[int] | None = None) -> SpanBatch:
    n = len(names)
    extra = {} if callpaths is None else {"callpath_id": callpaths}
    return SpanBatch.from_arrays(job_id=job, layers=["torch_op"] * n, names=names,
                                 rank=[rank] * n, fn=list(range(n)), step=[0] * n,
                                 start_ns=[start_ns] * n, duration_ns=[1000] * n, **extra)


def test_span_events_count_by_function_and_call_path() -> None:
    """Raw span events take the same caps: one function under two call paths is two."""
    views: list[WindowView] = []
    job = EmbeddedStreamJob(detectors=[], window_s=WINDOW_S,
                            caps=Caps(functions_per_rank=4, functions_per_job=100),
                            on_window=lambda view, _: views.append(view))
    job.process_messages([
        message(0, spans("s", 0, ["f", "g"], T0 + 1, callpaths=[1, 2])),
        message(1, spans("s", 0, ["f", "f"], T0 + 2, callpaths=[1, 2])),  # (f, 2) is new: 3
        message(2, spans("s", 0, ["f", "g"], T0 + 3, callpaths=[1, 2])),  # nothing new
        message(3, spans("s", 0, ["h", "i"], T0 + 4, callpaths=[5, 6])),  # 3 + 2 > 4
        message(4, spans("s", 1, ["h", "i"], T0 + 5)),  # another rank
    ])
    stats = job.stats()
    assert (stats.capped_messages, stats.capped_rows) == (1, 2)
    job.finish()
    [window] = [v for v in views if not v.summaries.empty]
    rows = window.summaries
    assert sorted(zip(rows["rank"], rows["name"], rows["callpath_id"], strict=True)) == [
        (0, "f", 1), (0, "f", 2), (0, "g", 2), (1, "h", 0), (1, "i", 0)]


def test_a_job_whose_every_message_is_refused_is_still_reported() -> None:
    """No window of the job ever opens, so none closes to carry the report: it is made at
    once, as a window of findings alone (no rows, no detectors run on it)."""
    job = EmbeddedStreamJob(detectors=[], window_s=WINDOW_S, caps=Caps(functions_per_rank=10))
    job.process_messages([message(0, summaries("z", 3, names("x", 11), T0)),
                          message(1, summaries("z", 3, names("y", 11), T0))])
    [finding] = job.findings
    assert (finding.job_id, finding.rank, finding.category) == ("z", 3, "cardinality")
    assert finding.evidence == {"messages": 2, "rows": 22, "new_functions": 22}
    assert finding.window_start_ns == T0
    assert job.windows == 0


def test_a_window_closed_frees_its_count() -> None:
    """The cap is per window: once a window closes, the next one starts from nothing."""
    job = EmbeddedStreamJob(detectors=[], window_s=WINDOW_S, lateness_s=0,
                            caps=Caps(functions_per_rank=5, functions_per_job=5, open_windows=2))
    for w in range(6):
        batch = summaries("j", 0, names(f"w{w}.", 5), T0 + w * WINDOW_NS)
        job.process_messages([message(w, batch)])
    assert job.stats().capped_messages == 0
    assert job.windows == 5
    assert len(job.caps._jobs["j"].windows) <= 2  # closed windows' counts are gone


# -- units: the time budget ------------------------------------------------------------------


class SlowDetector:
    """Stand-in for a detector that takes too long on some windows: it spins (in Python, so the
    budget's signal lands) for 30 s on windows of job ``slow`` after its first, and counts what
    it saw. It catches every Exception, as careless plugin code does: the budget must still
    stop it."""

    name = "slow"

    def __init__(self, spin_s: float = 30.0) -> None:
        self.spin_s = spin_s
        self.windows_seen = 0

    def detect(self, window: WindowView) -> list[Finding]:
        self.windows_seen += 1  # state changed before the budget runs out
        if window.job_id == "slow" and self.windows_seen > 1:
            until = time.monotonic() + self.spin_s
            while time.monotonic() < until:
                try:  # noqa: SIM105 - the careless plugin of the docstring: a broad except
                    sum(range(1000))
                except Exception:
                    pass
        return [Finding(job_id=window.job_id, window_start_ns=window.window_start_ns,
                        window_end_ns=window.window_end_ns, detector=self.name,
                        category="slowdown", score=0.1, message=f"seen {self.windows_seen}")]


def view(job: str, index: int) -> WindowView:
    return WindowView(job, T0 + index * WINDOW_NS, T0 + (index + 1) * WINDOW_NS)


def test_a_detector_over_budget_is_stopped_counted_and_starts_over() -> None:
    runner = DetectorRunner([SlowDetector()])
    assert len(runner.run(view("fast", 0), budget_s=0.3)) == 1
    assert len(runner.run(view("slow", 0), budget_s=0.3)) == 1
    started = time.monotonic()
    assert runner.run(view("slow", 1), budget_s=0.3) == []
    assert time.monotonic() - started < 2.0
    assert runner.over_budget == {"slow": 1}
    # The stopped instance was replaced by a fresh copy: no half-updated count carries on.
    [instance] = runner.for_job("slow")
    assert instance.windows_seen == 0
    # Other jobs keep their state; the budget is per call, so a fast window still runs.
    [fast] = runner.for_job("fast")
    assert fast.windows_seen == 1
    assert runner.run(view("fast", 1), budget_s=0.3)[0].message == "seen 2"


def test_the_budget_puts_back_an_outer_alarm() -> None:
    """pytest-timeout (signal method) and the budget share SIGALRM: the outer one survives."""
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(1))
    outer = signal.setitimer(signal.ITIMER_REAL, 0.6)  # pytest-timeout's, if it set one
    try:
        with pytest.raises(OverBudget), time_budget(0.1):
            while True:
                sum(range(100))
        deadline = time.monotonic() + 5
        while not fired and time.monotonic() < deadline:
            sum(range(100))
        assert fired == [1]
    finally:
        signal.signal(signal.SIGALRM, previous)
        signal.setitimer(signal.ITIMER_REAL, *outer)


class GeneralPathOnly(CapGuard):
    """The reference: every message through the general path, as before the one-row path."""

    def admit(self, records: list) -> Refusal | None:
        return self._admit_named(records)


def test_a_message_of_one_step_or_sample_is_admitted_as_the_general_path_would() -> None:
    """Nine in ten messages are a rank's one step of a sender round, and most others a rank's
    summaries under a function dictionary it sent before; both take paths of their own. Mixed
    with several ranks' samples over several windows, over windows that close and a cap of 4
    open windows (some one-row messages would open a fifth, some come for windows closed
    already), they admit and refuse exactly what the general path does and leave the same
    state."""
    rng = np.random.default_rng(5)
    closed_before = {"j": 0}
    guards = [cls(Caps(functions_per_rank=15, functions_per_job=36, open_windows=4),
                  WINDOW_NS, lambda job: closed_before.get(job, 0))
              for cls in (CapGuard, GeneralPathOnly)]
    verdicts: list[list[Refusal | None]] = [[], []]
    dictionaries = [[f"f{i}" for i in rng.choice(120, n, replace=False)] for n in (3, 6, 11, 16)]
    for poll in range(900):
        if poll % 60 == 59:
            closed_before["j"] += 1
            for guard in guards:
                guard.closed("j", (closed_before["j"] - 1) * WINDOW_NS)
        window = closed_before["j"] + int(rng.integers(-1, 6))
        rank = int(rng.integers(0, 8))
        kind = rng.integers(0, 4)
        if kind == 0:
            message: list = [StepBatch.from_records([StepRecord(
                job_id="j", rank=rank, step=poll, start_ns=window * WINDOW_NS + 1,
                duration_ns=10)])]
        elif kind == 1:
            message = [MetricBatch.from_records([MetricSample(
                job_id="j", rank=rank, host="h", ts_ns=window * WINDOW_NS + 1, name="sm",
                value=1.0)])]
        elif kind == 2:  # several ranks' samples over neighbouring windows (a host's)
            message = [MetricBatch.from_records([MetricSample(
                job_id="j", rank=int(r), host="h", ts_ns=(window + int(w)) * WINDOW_NS + 1,
                name="sm", value=1.0) for r, w in zip(rng.integers(0, 8, 6),
                                                      rng.integers(-1, 2, 6), strict=True)])]
        else:
            # Half the ranks send a dictionary they sent before (the usual case, whose ids
            # are known), half one new to the job.
            names = (dictionaries[int(rng.integers(0, len(dictionaries)))]
                     if rng.random() < 0.5 else
                     [f"f{i}" for i in rng.choice(120, int(rng.integers(1, 12)), replace=False)])
            # A third with rows in another order, some functions twice, some not at all.
            fn = (rng.integers(0, len(names), len(names) + 1) if rng.random() < 0.33
                  else None)
            message = [summaries("j", rank, names, window * WINDOW_NS, fn)]
        for guard, seen in zip(guards, verdicts, strict=True):
            seen.append(guard.admit(message))
    assert verdicts[0] == verdicts[1]
    refused = [v for v in verdicts[0] if v is not None]
    assert any("open" in v.reason for v in refused) and any("per rank" in v.reason or
                                                             "per job" in v.reason
                                                             for v in refused)
    fast, general = (g._jobs["j"] for g in guards)
    assert fast.windows.keys() == general.windows.keys()
    for index, window in fast.windows.items():
        other = general.windows[index]
        assert window.functions == other.functions
        assert np.array_equal(window.named, other.named)
        assert {r: f.tolist() for r, f in window.ranks.items()} == {
            r: f.tolist() for r, f in other.ranks.items()}


def test_distinct_window_rank_pairs_are_those_numpy_finds() -> None:
    """A batch's (window, rank) pairs, packed one int64 each: the same as numpy's unique over
    pairs, for windows before the epoch, windows far apart (unpacked) and the largest ranks."""
    rng = np.random.default_rng(11)
    for trial in range(300):
        n = int(rng.integers(1, 40))
        low = int(rng.integers(-5, 10**9))
        span = [3, 2**31 + 5][trial % 2 and trial % 3 == 0]
        index = low + rng.integers(0, span, n)
        rank = rng.integers(0, [8, 2**31 - 1][trial % 5 == 0], n)
        expected = [tuple(p) for p in np.unique(np.stack([index, rank]), axis=1).T.tolist()]
        assert _pairs(index, rank) == expected
