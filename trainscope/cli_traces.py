"""``trainscope replay kineto`` and ``trainscope analyze``: whole profiler traces, their call
paths and what to do about them.

Composition only: reading and condensing are in :mod:`trainscope.traces`, publishing in
:mod:`trainscope.producers.replay`, writing in :mod:`trainscope.sinks.traces`.
"""

from __future__ import annotations

from pathlib import Path

import click

from trainscope import env
from trainscope.env import DEFAULT_WINDOW_S
from trainscope.producers.replay.cli import publish, replay


def _store_options(command: click.Command) -> click.Command:
    command = click.option(
        "--url", help="ClickHouse server URL instead of a store, e.g. http://host:8123 "
        "(credentials from TRAINSCOPE_CLICKHOUSE_USER / _PASSWORD, never in the URL).",
    )(command)
    return click.option(
        "--store", type=click.Path(path_type=Path),
        help="chDB store directory to write the summaries, steps and call paths into "
        "(created if missing).",
    )(command)


@replay.command("kineto")
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--rank", type=click.IntRange(min=0), default=None,
              help="Rank of a trace without distributedInfo (one file only; a trace that has "
              "distributedInfo must agree with it).")
@click.option("--job", "job_id", default=None,
              help="Job id for the records (default: the traces' directory name).")
@click.option("--bus", "bus_url", envvar=env.TRAINSCOPE_BUS, default=None,
              help=f"Bus URL (kafka://HOST:PORT); default ${env.TRAINSCOPE_BUS}.")
@_store_options
@click.option("--window-s", type=click.FloatRange(min=0.001), envvar=env.TRAINSCOPE_WINDOW_S,
              default=DEFAULT_WINDOW_S, show_default=True, help="Summary window length.")
@click.option("--top", type=click.IntRange(min=0), default=10, show_default=True,
              help="Functions to list (by total time).")
def kineto(paths: tuple[Path, ...], rank: int | None, job_id: str | None, bus_url: str | None,
           store: Path | None, url: str | None, window_s: float, top: int) -> None:
    """Replay PyTorch profiler (Kineto) Chrome traces: one file per rank, or a directory.

    Every event class is read (python_function, user_annotation, gpu_user_annotation, cpu_op,
    cuda_runtime/cuda_driver, kernel, gpu_memcpy/memset, ac2g launch flows, and the older
    spellings Operator, Kernel, Runtime, Memcpy, Memset) and becomes function summaries whose
    layer names the class; the counts of events read, kept and skipped (with the reason) are
    printed per file. Files are streamed (plain or gzip), never loaded whole.

    The rank comes from the trace's distributedInfo, else from --rank, else it is an error.
    With --store or --url the summaries, step records and calling-context tree (table
    call_paths) are written to ClickHouse; with --bus the summaries are published.
    """
    from trainscope.producers.replay.kineto import records_of
    from trainscope.traces.cct import call_path_rows
    from trainscope.traces.condense import condense
    from trainscope.traces.reader import KinetoError, read_trace, trace_files

    if store is not None and url is not None:
        raise click.UsageError("give either --store DIR or --url URL, not both")
    try:
        files = trace_files(list(paths))
    except KinetoError as exc:
        raise click.ClickException(str(exc)) from None
    if rank is not None and len(files) > 1:
        raise click.UsageError(
            f"--rank names the rank of one trace, but {len(files)} files were given; traces "
            "of several ranks carry their rank in distributedInfo"
        )
    job = job_id or files[0].resolve().parent.name or "replay"
    window_ns = int(window_s * 1e9)
    records: list[object] = []
    call_paths: list[tuple[object, ...]] = []
    totals: dict[tuple[str, str], tuple[int, int]] = {}
    seen: dict[int, Path] = {}
    for path in files:
        try:
            trace = read_trace(path, rank)
            result = condense(trace, job, window_ns)
        except KinetoError as exc:
            raise click.ClickException(str(exc)) from None
        if trace.rank in seen:
            raise click.ClickException(
                f"{path}: rank {trace.rank} again (also {seen[trace.rank].name}); one file per rank"
            )
        seen[trace.rank] = path
        records.extend(records_of(result))
        for w, times in sorted(result.windows.items()):
            call_paths.extend(call_path_rows(job, trace.rank, w, w + window_ns, times))
        for batch in result.summaries:
            counts, totals_ns = batch.column("count"), batch.column("total_ns")
            for i, f in enumerate(batch.column("fn").tolist()):
                key = (batch.layers[f], batch.names[f])
                count, total = totals.get(key, (0, 0))
                totals[key] = (count + int(counts[i]), total + int(totals_ns[i]))
        _echo_counts(trace, result)
    ranked = sorted(totals.items(), key=lambda item: -item[1][1])[:top]
    for (layer, name), (count, total_ns) in ranked:
        click.echo(f"  {total_ns / 1e6:12.3f} ms {count:8d}x  {layer:19s} {name[:80]}")
    if store is not None or url is not None:
        _write_store(store, url, records, call_paths)
    if bus_url:
        publish(bus_url, job, records)
    elif store is None and url is None:
        click.echo("no --bus, --store or --url given: nothing was published or stored")


def _echo_counts(trace: object, result: object) -> None:
    from trainscope.traces.condense import Condensed
    from trainscope.traces.reader import Trace

    assert isinstance(trace, Trace) and isinstance(result, Condensed)
    counts = trace.counts
    skipped = counts.total_read - counts.total_kept
    rows = sum(len(batch) for batch in result.summaries)
    click.echo(
        f"{trace.path.name}: rank {trace.rank} (from {trace.rank_source}), "
        f"{counts.total_read:,} events read, {counts.total_kept:,} kept, {skipped:,} skipped; "
        f"{rows:,} summaries, {len(result.steps)} steps, "
        f"{len(result.tree.nodes) if result.tree else 0:,} call paths"
    )
    click.echo(f"  {'event class':24s} {'read':>9s} {'kept':>9s} {'skipped':>9s}  why skipped")
    for label, read, kept, skip, reasons in counts.rows():
        click.echo(f"  {label:24s} {read:9,d} {kept:9,d} {skip:9,d}  {reasons}".rstrip())
    if result.tree and result.tree.unlinked_device:
        click.echo(f"  {result.tree.unlinked_device:,} device events without their launch "
                   "(no runtime call with the same correlation id): kept at the root")


def _write_store(store: Path | None, url: str | None, records: list[object],
                 call_paths: list[tuple[object, ...]]) -> None:
    from trainscope.schemas.records import StepRecord, SummaryBatch
    from trainscope.sinks.clickhouse import ClickHouseSink
    from trainscope.sinks.traces import write_call_paths, write_steps, write_summaries
    from trainscope.store import StoreError

    try:
        sink = ClickHouseSink.open(store, url)
        try:
            write_summaries(sink, [r for r in records if isinstance(r, SummaryBatch)])
            write_steps(sink, [r for r in records if isinstance(r, StepRecord)])
            write_call_paths(sink, call_paths)
        finally:
            sink.close()
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"stored {sink.stats.rows_written:,} rows (function_summaries, step_records, "
               f"call_paths) in {url or store}")
