"""The embedded store takes a window's Arrow tables in memory (chDB's ``Python()`` table
function, real chDB): the rows read back are the window's, converted to the tables' types as
the Arrow format's insert converts them, and a window written twice is stored once."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from trainscope.engine.embedded_job import EmbeddedStreamJob
from trainscope.producers.simulate import ClusterSpec, SimulatedCluster, parse_faults
from trainscope.schemas.codec import encode_batch
from trainscope.schemas.summaries import summary_batches
from trainscope.schemas.window import WindowView
from trainscope.sinks.arrow_insert import content_digest
from trainscope.sinks.clickhouse import ClickHouseSink, run_query
from trainscope.transport.bus import Message

WINDOW_S = 5.0


def simulated_windows() -> list[WindowView]:
    """The windows of a small simulated job with a slow GPU, as the stream job closes them;
    one rank also sends a summary of a 6-day wait, whose sketch key needs Int16's range."""
    spec = ClusterSpec(job_id="j", dp=2, pp=2, tp=2, steps=30, seed=5,
                       start_ns=1_767_225_600 * 10**9, send="spans")
    cluster = SimulatedCluster(spec, parse_faults(["slow-gpu:rank=3,factor=1.5"]))
    views: list[WindowView] = []
    pipeline = EmbeddedStreamJob(detectors=[], window_s=WINDOW_S,
                                 on_window=lambda view, _: views.append(view))
    for offset, output in enumerate(cluster.run()):
        records = [*output.spans, *output.steps, *output.metrics]
        if output.step == 0:
            long_ns = np.array([1, 6 * 86_400 * 10**9], dtype=np.int64)  # up to 6 days
            records = [*cluster.topology_records(), *records, *summary_batches(
                {("python", "very_long_wait", 7): long_ns}, job_id="j", rank=0,
                window_start_ns=spec.start_ns, window_end_ns=spec.start_ns + 10**9)]
        pipeline.process_messages([Message("trainscope.events", 0, offset, None,
                                           encode_batch(records))])
    pipeline.finish()
    assert len(views) >= 3 and all(not v.summaries.empty for v in views)
    return views


SUMMARY_COLUMNS = ("rank", "layer", "name", "callpath_id", "count", "total_ns", "m2_ns2",
                   "min_ns", "max_ns", "bytes_total", "sketch_keys", "sketch_counts")


def stored_summaries(sink: ClickHouseSink, window_start_ns: int) -> list[tuple]:
    columns = ", ".join(SUMMARY_COLUMNS)
    return sorted(run_query(sink.client, f"SELECT {columns} FROM function_summaries "
                                         f"WHERE window_start_ns = {window_start_ns}")[1])


def window_summaries(view: WindowView) -> list[tuple]:
    frame = view.summaries
    rows = zip(*(frame[c].tolist() for c in SUMMARY_COLUMNS), strict=True)
    return sorted(tuple(list(v) if isinstance(v, list | np.ndarray) else v for v in row)
                  for row in rows)


@pytest.fixture
def sink(tmp_path: Path):
    sink = ClickHouseSink.open(tmp_path / "store")
    yield sink
    sink.close()


def test_a_window_reads_back_as_it_was_written_and_a_second_write_is_dropped(
        sink: ClickHouseSink) -> None:
    views = simulated_windows()
    assert sink._in_memory is not None  # the embedded store's in-memory path is the one tested
    for view in views:
        sink.write_window(view, [])
    counts = {t: run_query(sink.client, f"SELECT count() FROM {t}")[1][0][0]
              for t in ("function_summaries", "step_records", "metric_samples")}
    assert counts == {"function_summaries": sum(len(v.summaries) for v in views),
                      "step_records": sum(len(v.steps) for v in views),
                      "metric_samples": sum(len(v.metrics) for v in views)}
    for view in views:
        stored = stored_summaries(sink, view.window_start_ns)
        assert stored == window_summaries(view)
    keys = run_query(sink.client, "SELECT max(arrayMax(sketch_keys)) FROM function_summaries")
    assert keys[1][0][0] > 1500  # keys past Int8, up to where Int16 is needed, not wrapped

    # The stream job replays what it had not checkpointed: the same windows rebuilt from the
    # same input by a new engine, no rows more (counted without FINAL or a merge: the inserts
    # themselves were dropped).
    for view in simulated_windows():
        sink.write_window(view, [])
    again = {t: run_query(sink.client, f"SELECT count() FROM {t}")[1][0][0] for t in counts}
    assert again == counts

    # A window whose content differs in one value is new content, and is stored.
    changed = views[0]
    summaries = changed.summaries.copy()
    summaries.loc[summaries.index[0], "count"] += 1
    sink.write_window(WindowView(changed.job_id, changed.window_start_ns,
                                 changed.window_end_ns, summaries=summaries), [])
    after = run_query(sink.client, "SELECT count() FROM function_summaries")[1][0][0]
    assert after == counts["function_summaries"] + len(summaries)


def test_the_digest_names_content_not_buffers() -> None:
    values = pa.array(range(10), pa.int64())
    table = pa.table({"a": values})
    assert content_digest(table) == content_digest(pa.table({"a": pa.array(range(10))}))
    # Slices of one parent share its buffers: their offset and length tell them apart.
    assert content_digest(table.slice(0, 5)) != content_digest(table.slice(5, 5))
    assert content_digest(table.slice(0, 5)) != content_digest(table.slice(0, 4))
    assert content_digest(table) != content_digest(pa.table({"b": values}))
    assert content_digest(table) != content_digest(
        pa.table({"a": pa.array([*range(9), 10], pa.int64())}))
    lists = pa.table({"k": pa.array([[1, 2], [3]], pa.large_list(pa.int16()))})
    assert content_digest(lists) != content_digest(
        pa.table({"k": pa.array([[1], [2, 3]], pa.large_list(pa.int16()))}))
