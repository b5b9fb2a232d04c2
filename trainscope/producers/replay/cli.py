"""``trainscope replay``: publish existing traces as if they came from live ranks."""

from __future__ import annotations

from pathlib import Path

import click

from trainscope import env
from trainscope.env import DEFAULT_WINDOW_S
from trainscope.streams.bus import BusError, open_bus


@click.group("replay")
def replay() -> None:
    """Publish existing traces (torch.profiler/Kineto, what-if op traces) on the bus."""


@replay.command("kineto")
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--job", "job_id", default=None,
              help="Job id for the published records (default: the traces' directory name).")
@click.option("--bus", "bus_url", envvar=env.TRAINSCOPE_BUS, default=None,
              help=f"Bus URL (kafka://HOST:PORT); default ${env.TRAINSCOPE_BUS}. Without one, "
              "only the summary table is printed.")
@click.option("--window-s", type=click.FloatRange(min=0.001), envvar=env.TRAINSCOPE_WINDOW_S,
              default=DEFAULT_WINDOW_S, show_default=True, help="Summary window length.")
@click.option("--top", type=click.IntRange(min=0), default=10, show_default=True,
              help="Functions to list (by total time).")
def kineto(paths: tuple[Path, ...], job_id: str | None, bus_url: str | None, window_s: float,
           top: int) -> None:
    """Replay PyTorch profiler (Kineto) Chrome traces: one file per rank, or a directory.

    Ranks come from the trace's distributedInfo, else from the file name (…rank3…).
    Plain .json and .json.gz are read.
    """
    from trainscope.producers.replay.kineto import KinetoError, condense, load, trace_files

    try:
        files = trace_files(list(paths))
        traces = [load(path) for path in files]
    except KinetoError as exc:
        raise click.ClickException(str(exc)) from None
    ranks = [t.rank for t in traces]
    duplicate = sorted({r for r in ranks if ranks.count(r) > 1})
    if duplicate:
        raise click.ClickException(f"several traces claim rank(s) {duplicate}; one file per rank")
    job = job_id or files[0].resolve().parent.name or "replay"
    window_ns = int(window_s * 1e9)
    records: list[object] = []
    totals: dict[tuple[str, str], tuple[int, int]] = {}
    for trace in traces:
        try:
            result = condense(trace, job, window_ns)
        except KinetoError as exc:
            raise click.ClickException(str(exc)) from None
        records.extend(result.steps)
        records.extend(result.summaries)
        for batch in result.summaries:
            counts, totals_ns = batch.column("count"), batch.column("total_ns")
            for i, f in enumerate(batch.column("fn").tolist()):
                key = (batch.layers[f], batch.names[f])
                count, total = totals.get(key, (0, 0))
                totals[key] = (count + int(counts[i]), total + int(totals_ns[i]))
        rows = sum(len(batch) for batch in result.summaries)
        click.echo(f"{trace.path.name}: rank {trace.rank}, {result.events} events, "
                   f"{rows} summaries, {len(result.steps)} steps")
    ranked = sorted(totals.items(), key=lambda item: -item[1][1])[:top]
    for (layer, name), (count, total_ns) in ranked:
        click.echo(f"  {total_ns / 1e6:12.3f} ms {count:8d}x  {layer:12s} {name[:80]}")
    _publish(bus_url, job, records)


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
    try:
        for key, payload in payloads:
            bus.publish(OPTRACE_TOPIC, payload, key=key)
        bus.flush()
    except BusError as exc:
        raise click.ClickException(f"could not publish to {bus_url}: {exc}") from None
    finally:
        bus.close()
    click.echo(f"published op trace of job {job}: {len(payloads)} messages to {OPTRACE_TOPIC}")


def _publish(bus_url: str | None, job: str, records: list[object]) -> None:
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
