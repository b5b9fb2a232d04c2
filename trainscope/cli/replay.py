"""``trainscope replay``: publish existing traces as if they came from live ranks."""

from __future__ import annotations

from pathlib import Path

import click

from trainscope.config import env
from trainscope.transport.bus import BusError, open_bus


@click.group("replay")
def replay() -> None:
    """Publish existing traces (torch.profiler/Kineto, what-if op traces) on the bus.

    ``replay kineto`` is added to this group by :mod:`trainscope.cli.traces`, because it also
    writes to the store.
    """


@replay.command("optrace")
@click.argument("trace", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--meta", required=True, type=click.Path(exists=True, dir_okay=False,
                                                        path_type=Path),
              help="YAML with the job's parallel sizes (dp_size, pp_size, ...).")
@click.option("--job", "job_id", default=None, help="Job id (default: the trace file's stem).")
@click.option("--bus", "bus_url", envvar=env.TRAINSCOPE_BUS, required=True,
              help=f"Bus URL (kafka://HOST:PORT); default ${env.TRAINSCOPE_BUS}.")
def optrace(trace: Path, meta: Path, job_id: str | None, bus_url: str) -> None:
    """Publish a what-if op trace (Parquet or CSV) with its job metadata."""
    from trainscope.producers.replay.optrace import OPTRACE_TOPIC, encode_optrace, read_optrace
    from trainscope.schemas.optrace import TraceError

    job = job_id or trace.name.split(".")[0]
    try:
        payloads = encode_optrace(*read_optrace(trace, meta, job))
    except TraceError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        bus = open_bus(bus_url)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--bus") from None
    from trainscope.producers.replay.publish import publish_encoded

    try:
        publish_encoded(bus, OPTRACE_TOPIC, payloads)
    except BusError as exc:
        raise click.ClickException(f"could not publish to {bus_url}: {exc}") from None
    finally:
        bus.close()
    click.echo(f"published op trace of job {job}: {len(payloads)} messages to {OPTRACE_TOPIC}")


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
