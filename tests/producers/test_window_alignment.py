"""The host agent and the in-process recorder cut the same windows: multiples of the window
length since the Unix epoch, as the stream job does. So what one collection interval produced
(the agent's GPU readings and traced calls, and the training process's own summaries of the
same moments) meets in one window of the pipeline, the window detectors see as one.
"""

from __future__ import annotations

import threading
import time

from trainscope.engine.embedded_job import EmbeddedStreamJob
from trainscope.producers.agent.base import CollectorStats
from trainscope.producers.agent.daemon import Agent, AgentSettings
from trainscope.schemas.codec import encode_batch
from trainscope.schemas.recorder import WindowRecorder
from trainscope.schemas.records import FunctionSummary, MetricSample, Record
from trainscope.schemas.summaries import summarize
from trainscope.schemas.window import WindowView
from trainscope.transport.bus import ALL_TOPICS, EVENTS_TOPIC, rank_key
from trainscope.transport.memory import MemoryBus

JOB = "aligned"
WINDOW_S = 0.5
WINDOW_NS = int(WINDOW_S * 1e9)


class IntervalCollector:
    """Stands in for NVML and eBPF: every interval it reports one reading and one traced call
    named after the interval, and the "training process" (the recorder ``attach()`` runs)
    records a span of its own in the middle of the same interval."""

    name = "intervals"

    def __init__(self, recorder: WindowRecorder) -> None:
        self.stats = CollectorStats()
        self.recorder = recorder
        # Per interval: the window the agent files it in, and the middle of the interval.
        self.intervals: list[tuple[int, int]] = []
        self._previous_ns = 0

    def start(self) -> None:
        self._previous_ns = time.time_ns()

    def collect(self, window_start_ns: int, window_end_ns: int) -> list[Record]:
        now_ns = time.time_ns()
        i = len(self.intervals)
        middle_ns = (self._previous_ns + now_ns) // 2
        self.intervals.append((window_start_ns, middle_ns))
        self._previous_ns = now_ns
        self.recorder.add("torch_op", f"interval-{i}", middle_ns, 1_000)
        return [
            MetricSample(job_id=JOB, rank=0, device=0, ts_ns=now_ns, name=f"interval.{i}",
                         value=float(i)),
            summarize([1_000], job_id=JOB, rank=0, layer="cuda_api", name=f"interval-{i}",
                      window_start_ns=window_start_ns, window_end_ns=window_end_ns),
        ]

    def stop(self, window_start_ns: int, window_end_ns: int) -> list[FunctionSummary]:
        return []


def _windows_of(views: list[WindowView]) -> dict[tuple[str, str], set[int]]:
    """(source, interval name) -> the starts of the windows it was filed in."""
    found: dict[tuple[str, str], set[int]] = {}
    for view in views:
        for name in view.metrics["name"]:
            found.setdefault(("agent reading", name.replace(".", "-")), set()).add(
                view.window_start_ns)
        for layer, name in zip(view.summaries["layer"], view.summaries["name"], strict=True):
            source = "agent summary" if layer == "cuda_api" else "recorder summary"
            found.setdefault((source, name), set()).add(view.window_start_ns)
    return found


def test_one_intervals_agent_and_recorder_records_meet_in_one_pipeline_window() -> None:
    bus = MemoryBus()
    recorder = WindowRecorder.for_window(WINDOW_S)
    collector = IntervalCollector(recorder)
    agent = Agent(AgentSettings(interval_s=0.1, window_s=WINDOW_S, job_id=JOB), bus, [collector])
    agent.start()
    runner = threading.Thread(target=agent.run, kwargs={"max_windows": 4})
    runner.start()
    runner.join(30)
    assert not runner.is_alive()
    assert agent.stats.records_failed == agent.stats.records_dropped == 0
    for window_start_ns, functions in recorder.take_all():
        batches = recorder.summaries(JOB, 0, window_start_ns, functions)
        bus.publish(EVENTS_TOPIC, encode_batch(batches), key=rank_key(JOB, 0))

    views: list[WindowView] = []
    pipeline = EmbeddedStreamJob(detectors=[], window_s=WINDOW_S,
                                 on_window=lambda view, findings: views.append(view))
    consumer = bus.consumer(list(ALL_TOPICS), "alignment")
    while messages := consumer.poll(timeout_s=0):
        pipeline.process_messages(messages)
    pipeline.finish()
    assert pipeline.stats().decode.rejected == 0

    assert views and all(v.window_start_ns % WINDOW_NS == 0 for v in views)  # the epoch grid
    assert all(v.window_end_ns - v.window_start_ns == WINDOW_NS for v in views)
    found = _windows_of(views)
    agreeing = 0
    for i, (window_start_ns, middle_ns) in enumerate(collector.intervals):
        name = f"interval-{i}"
        # The agent's readings and calls of one interval share the window it was collected in.
        agent_windows = found[("agent reading", name)] | found[("agent summary", name)]
        assert agent_windows == {window_start_ns}, (name, agent_windows)
        # The span from the middle of the interval shares it too, unless this interval was
        # late enough (a loaded machine) to run its middle over a window boundary.
        if middle_ns // WINDOW_NS * WINDOW_NS == window_start_ns:
            assert found[("recorder summary", name)] == agent_windows, (name, found)
            agreeing += 1
    assert agreeing >= len(collector.intervals) // 2 > 0, collector.intervals
