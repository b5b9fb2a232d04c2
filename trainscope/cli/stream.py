"""``trainscope stream``: the stream job on a stream engine of its own (Faust)."""

from __future__ import annotations

from pathlib import Path

import click

from trainscope.cli.demo import DETECTORS_HELP, WINDOW_HELP, load_detectors


@click.group()
def stream() -> None:
    """Run the stream job on a stream engine, scaled out over several processes."""


@stream.command()
@click.option("--bus", "bus_url", required=True, help="kafka://HOST:PORT of the broker.")
@click.option("--store", type=click.Path(path_type=Path),
              help="chDB store directory of this worker (one process owns one). Default: "
                   "$TRAINSCOPE_STORE_DIR, else under the user's data directory.")
@click.option("--url", help="ClickHouse server URL instead of a store (the one all workers "
                            "share). Default: $TRAINSCOPE_CLICKHOUSE_URL.")
@click.option("--app-id", default="trainscope-faust", show_default=True,
              help="Faust app id: the consumer group, and the prefix of its internal topics. "
                   "Every worker of one deployment uses the same; no `trainscope pipeline` "
                   "may use it as --group (a shared group never settles).")
@click.option("--partitions", type=click.IntRange(min=1), default=4, show_default=True,
              help="Partitions of the repartition topic and the jobs table: the most workers "
                   "that can share the work. Fixed once the topics exist.")
@click.option("--window-s", type=click.FloatRange(min=0.1), default=None, help=WINDOW_HELP)
@click.option("--lateness-s", type=click.FloatRange(min=0), default=5.0, show_default=True)
@click.option("--close-idle-s", type=click.FloatRange(min=0.1), default=30.0, show_default=True,
              help="Close a job's windows once it sent nothing for this long. Keep it above "
                   "the time a dead worker's partitions take to get a new owner (session "
                   "timeout 10 s plus the rebalance): a job whose records came through that "
                   "worker sends nothing meanwhile.")
@click.option("--source-idle-s", type=click.FloatRange(min=0.1), default=30.0,
              show_default=True,
              help="A producers' partition that delivered nothing for this long stops holding "
                   "windows open. Keep it above the time a dead worker's partitions take to "
                   "get a new owner (session timeout 10 s plus the rebalance).")
@click.option("--idle-exit-s", type=float, default=None,
              help="Exit once every window is written and nothing arrived for this long.")
@click.option("--detectors", "detector_names", metavar="NAME[,NAME…]", help=DETECTORS_HELP)
@click.option("--input", "input_kind", type=click.Choice(["events", "summaries"]),
              default="events", show_default=True,
              help="events: read the producers' events and metrics topics and window them. "
                   "summaries: be the detection tier behind `trainscope stream flink`: read its "
                   "window summaries and step records and the metrics topic (--lateness-s is "
                   "then at least --window-s, as for `trainscope pipeline --input summaries`).")
def faust(bus_url: str, store: Path | None, url: str | None, app_id: str, partitions: int,
          window_s: float | None, lateness_s: float, close_idle_s: float, source_idle_s: float,
          idle_exit_s: float | None, detector_names: str | None, input_kind: str) -> None:
    """One Faust worker of the stream job; start several (same --app-id) to share the work.

    Messages are re-keyed by job through the topic APP-ID-by-job, so one job's records meet in
    one worker, which windows them, runs the detectors and writes to the store with the code
    of `trainscope pipeline`. A worker that dies is replaced by the others: they rebuild its
    open windows from the committed positions and take each job's written-up-to mark and
    detector state, topology and world size from the jobs table (changelog topic
    APP-ID-jobs-changelog). The app id must differ from every `trainscope pipeline --group`.
    Prints its counts as one JSON line on stderr when it stops.
    """
    from trainscope.config.settings import from_context
    from trainscope.engine.bus_job import INPUT_TOPICS, summaries_lateness_s
    from trainscope.engines.faust.app import (
        REBALANCE_TIMEOUT_S,
        SESSION_TIMEOUT_S,
        FaustOptions,
        build_app,
        run_worker,
    )
    from trainscope.sinks.clickhouse import ClickHouseSink
    from trainscope.store.client import StoreError

    if not bus_url.startswith("kafka://"):
        raise click.UsageError(f"--bus {bus_url!r}: Faust needs a kafka://HOST:PORT broker")
    if store is not None and url is not None:
        raise click.UsageError("give either --store DIR or --url URL, not both")
    takeover_s = SESSION_TIMEOUT_S + REBALANCE_TIMEOUT_S
    for name, value in (("--close-idle-s", close_idle_s), ("--source-idle-s", source_idle_s)):
        if value < takeover_s:
            click.echo(f"Warning: {name} {value:g} is below the {takeover_s:g} s a dead worker's "
                       "partitions may take to get a new owner: records that come through it "
                       "meanwhile can be counted late", err=True)
    settings = from_context()
    store, url = settings.store(store, url)
    detectors = load_detectors(detector_names)
    window_s = window_s if window_s is not None else settings.window_s
    if input_kind == "summaries":
        lateness_s = summaries_lateness_s(window_s, lateness_s)
    options = FaustOptions(
        broker=bus_url, app_id=app_id, partitions=partitions, topics=INPUT_TOPICS[input_kind],
        window_s=window_s, lateness_s=lateness_s, source_idle_s=source_idle_s,
        close_idle_s=close_idle_s, idle_exit_s=idle_exit_s,
    )
    try:
        sink = ClickHouseSink.open(store, url, settings=settings)
    except (StoreError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    try:
        app, job = build_app(options, sink, detectors)
        run_worker(app, job)
    finally:
        sink.close()


# `trainscope stream flink` lives with the Flink tier's own code (it must not import the
# Faust app's dependencies, nor they its).
from trainscope.cli.stream_flink import register  # noqa: E402

register(stream)
