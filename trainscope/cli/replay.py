"""``trainscope replay``: publish existing traces as if they came from live ranks."""

from __future__ import annotations

import time
from pathlib import Path

import click

from trainscope.config import env
from trainscope.config.env import DEFAULT_WINDOW_S
from trainscope.transport.bus import BusError, open_bus


# `replay kineto` is added to this group by trainscope.cli.traces, because it also writes to
# the store.
@click.group("replay")
def replay() -> None:
    """Publish existing traces (torch.profiler/Kineto, what-if op traces) on the bus."""


@replay.command("optrace")
@click.argument("trace", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--meta", required=True, type=click.Path(exists=True, dir_okay=False,
                                                        path_type=Path),
              help="YAML with the job's parallel sizes (dp_size, pp_size, ...).")
@click.option("--job", "job_id", default=None, help="Job id (default: the trace file's stem).")
@click.option("--bus", "bus_url", envvar=env.TRAINSCOPE_BUS, required=True,
              help=f"Bus URL (kafka://HOST:PORT); default ${env.TRAINSCOPE_BUS}.")
@click.option("--online/--no-online", default=True, show_default=True,
              help="Also publish the trace as its ranks would have sent it live (topology, "
              "step records, function summaries), for the stream job's detectors.")
@click.option("--window-s", type=click.FloatRange(min=0.001), envvar=env.TRAINSCOPE_WINDOW_S,
              default=DEFAULT_WINDOW_S, show_default=True,
              help="The stream job's window length (its --window-s), for --online.")
def optrace(trace: Path, meta: Path, job_id: str | None, bus_url: str, online: bool,
            window_s: float) -> None:
    """Publish a what-if op trace (Parquet or CSV) with its job metadata.

    With --online (the default) the same job also goes on the events topic as live ranks
    would send it: the trace's steps back to back, ending now, each op a span of its worker,
    so `trainscope pipeline` diagnoses it; `trainscope whatif --trace` on the same file gives
    the what-if answer beside the findings.
    """
    from trainscope.producers.replay.optrace import OPTRACE_TOPIC, encode_optrace, read_optrace
    from trainscope.producers.replay.optrace_online import online_records, trace_length_ns
    from trainscope.schemas.optrace import TraceError

    job = job_id or trace.name.split(".")[0]
    try:
        job_meta, frame = read_optrace(trace, meta, job)
        payloads = encode_optrace(job_meta, frame)
    except TraceError as exc:
        raise click.ClickException(str(exc)) from None
    records = (online_records(job_meta, frame, time.time_ns() - trace_length_ns(frame),
                              window_s) if online else [])
    try:
        bus = open_bus(bus_url)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--bus") from None
    from trainscope.producers.replay.publish import publish_encoded, publish_records

    try:
        publish_encoded(bus, OPTRACE_TOPIC, payloads)
        sent = publish_records(bus, job, records) if records else 0
    except BusError as exc:
        raise click.ClickException(f"could not publish to {bus_url}: {exc}") from None
    finally:
        bus.close()
    click.echo(f"published op trace of job {job}: {len(payloads)} messages to {OPTRACE_TOPIC}")
    if online:
        click.echo(f"published {sent} records of job {job} (topology, steps, summaries) for "
                   f"the stream job, {window_s:g}-s windows")


def publish(bus_url: str | None, job: str, records: list[object]) -> None:
    if not bus_url:
        click.echo("no --bus given: summaries were not published")
        return
    from trainscope.producers.replay.publish import publish_records

    try:
        bus = open_bus(bus_url)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--bus") from None
    try:
        sent = publish_records(bus, job, records)
    except BusError as exc:
        raise click.ClickException(f"could not publish to {bus_url}: {exc}") from None
    finally:
        bus.close()
    click.echo(f"published {sent} records of job {job} to {bus_url}")
