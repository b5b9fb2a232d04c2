"""The window engine's jobs as a checkpoint holds them (:mod:`trainscope.engine.checkpoint`).

A snapshot keeps every job's open windows and what windowing them further needs. Partials are
kept as they arrived, not merged: a window finished from a snapshot is then the same function of
the same inputs as one never interrupted, row for row. Progress per source is left out: after a
restart the sources deliver again (see :meth:`WindowEngine.expect_sources`). Each rank's clock
offset and the records held while it is estimated (:mod:`trainscope.engine.clocks`) are kept.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from trainscope.engine.state import JobState, OpenWindow
from trainscope.schemas.records import MetricBatch, MetricSample, StepBatch, StepRecord
from trainscope.schemas.step_metric import metrics_by_job, steps_by_job

_ENCODER = msgspec.msgpack.Encoder()
# Checkpoints of older versions hold rows: they are packed into batches on restore.
_STEPS = msgspec.msgpack.Decoder(list[StepBatch | StepRecord])
_METRICS = msgspec.msgpack.Decoder(list[MetricBatch | MetricSample])


def take(window_ns: int, jobs: dict[str, JobState]) -> dict[str, Any]:
    """The snapshot of ``jobs`` (picklable; shares their arrays, so pickle it at once)."""
    kept = {
        job_id: dataclasses.replace(
            job, progress_ns={}, rank_progress={}, last_arrival_s=0.0, reported_late=False,
            windows={},
            functions=dataclasses.replace(job.functions, dictionaries={}),
        )
        for job_id, job in jobs.items()
    }
    # Steps and metrics as msgpack (pickling row structs one by one cost ~25 µs each).
    windows = {
        job_id: {
            index: (window.partials, _ENCODER.encode(window.steps),
                    _ENCODER.encode(window.metrics))
            for index, window in job.windows.items()
        }
        for job_id, job in jobs.items()
    }
    return {"window_ns": window_ns, "jobs": kept, "windows": windows}


def restore(snapshot: dict[str, Any], window_ns: int, now_s: float) -> dict[str, JobState]:
    """The jobs of ``snapshot``, as seen first at ``now_s``; ValueError if its windows are not
    ``window_ns`` long."""
    if snapshot.get("window_ns") != window_ns:
        raise ValueError(
            f"the checkpoint's windows are {snapshot.get('window_ns', 0) / 1e9:g} s long, "
            f"this engine's {window_ns / 1e9:g} s: restart with the same --window-s"
        )
    jobs: dict[str, JobState] = {}
    for job_id, job in snapshot["jobs"].items():
        _fill_new_fields(job)
        job.windows = {
            index: OpenWindow(partials, list(steps_by_job(_STEPS.decode(steps)).values()),
                              list(metrics_by_job(_METRICS.decode(metrics)).values()))
            for index, (partials, steps, metrics) in snapshot["windows"][job_id].items()
        }
        job.last_arrival_s = now_s
        job.first_seen_s = now_s
        job.restored_before = max(job.restored_before, job.closed_before)
        jobs[job_id] = job
    return jobs


def _fill_new_fields(job: JobState) -> None:
    """A job pickled by an older version lacks the fields added since: give them defaults."""
    for spec in dataclasses.fields(JobState):
        if spec.name in vars(job):
            continue
        if spec.default_factory is not dataclasses.MISSING:
            setattr(job, spec.name, spec.default_factory())
        elif spec.default is not dataclasses.MISSING:
            setattr(job, spec.name, spec.default)
