"""``trainscope replay kineto`` and ``trainscope analyze``: whole profiler traces, their call
paths and what to do about them.

Composition only: reading and condensing are in :mod:`trainscope.traces`, publishing in
:mod:`trainscope.producers.replay`, writing in :mod:`trainscope.sinks.traces`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from trainscope.cli.replay import publish, replay
from trainscope.config import env
from trainscope.config.env import DEFAULT_WINDOW_S

if TYPE_CHECKING:
    from trainscope.traces.cct import PathTimes


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
    from trainscope.store.client import StoreError

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


@click.command("analyze")
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path))
@click.option("--rank", type=click.IntRange(min=0), default=None,
              help="With TRACE: the rank of a single trace without distributedInfo. With "
              "--job: the suspect rank whose call paths are compared with its peers'.")
@click.option("--suspect", type=click.IntRange(min=0), default=None,
              help="Rank to compare with its peers (default: the rank with the most excess "
              "time in its own work, less its excess time in collectives).")
@click.option("--baseline", "baseline", multiple=True, type=click.Path(path_type=Path),
              help="Traces of an earlier run (repeatable): the call paths of TRACE… (all ranks "
              "merged) are compared with these.")
@click.option("--job", "job_id", default=None,
              help="Compare call paths of --rank with its peers from the store's call_paths.")
@_store_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of the report.")
@click.option("--flamegraph", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the calling-context trees as a speedscope JSON file (host and GPU "
              "profile per rank; opens in speedscope.app).")
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True,
              help="Suggestions to list.")
def analyze(paths: tuple[Path, ...], rank: int | None, suspect: int | None,
            baseline: tuple[Path, ...], job_id: str | None, store: Path | None,
            url: str | None, as_json: bool, flamegraph: Path | None, top: int) -> None:
    """Say where the time goes in profiler traces and what to try, most time at stake first.

    TRACE… are Kineto/Chrome traces (files or directories, plain or gzip), one per rank. Each
    rank's trace runs through the analyzers (GPU time by kernel class, idle GPU and its cause,
    communication/computation overlap, launch-bound ops, tiny kernels, pageable copies,
    synchronisations, data-loader waits). With several ranks, the calling-context tree of the
    most different rank (or --suspect) is compared with its peers'; with --baseline, the run
    is compared with an earlier one. --job J --rank R does the peer comparison on the call
    paths a replay stored (--store/--url).
    """
    import json

    from trainscope.traces.reader import KinetoError

    if store is not None and url is not None:
        raise click.UsageError("give either --store DIR or --url URL, not both")
    if job_id is not None:
        if paths or rank is None:
            raise click.UsageError("--job takes --rank R (the suspect) and no TRACE")
        report = _stored_report(job_id, rank, store, url)
    else:
        if not paths:
            raise click.UsageError("give TRACE… (files or directories), or --job J --rank R")
        try:
            report = _trace_report(paths, rank, suspect, baseline, flamegraph)
        except KinetoError as exc:
            raise click.ClickException(str(exc)) from None
    if as_json:
        report["suggestions"] = report["suggestions"][:top]
        click.echo(json.dumps(report, default=str))
        return
    _print_report(report, top)


def _trace_report(paths: tuple[Path, ...], rank: int | None, suspect: int | None,
                  baseline: tuple[Path, ...], flamegraph: Path | None) -> dict[str, object]:
    import dataclasses
    import json

    from trainscope.traces.analyzers import TraceView, breakdown, run_all
    from trainscope.traces.condense import condense
    from trainscope.traces.reader import read_trace, trace_files

    files = trace_files(list(paths))
    if rank is not None and len(files) > 1:
        raise click.UsageError("--rank names the rank of one trace; several were given")
    trees: dict[int, PathTimes] = {}
    suggestions = []
    kernels: dict[int, dict[str, int]] = {}
    host: dict[int, dict[str, object]] = {}
    sources: dict[int, str] = {}
    for path in files:
        trace = read_trace(path, rank)
        if trace.rank in trees:
            raise click.ClickException(f"{path}: rank {trace.rank} again; one file per rank")
        result = condense(trace, "analyze", 10**18)  # one window: the whole trace
        view = TraceView(trace, result.tree, len(result.steps))  # type: ignore[arg-type]
        suggestions.extend(run_all(view))
        trees[trace.rank] = result.whole()
        if view.device.any():
            kernels[trace.rank] = breakdown(view)
        else:  # a CPU-only trace: where the host's time went instead
            host[trace.rank] = _host_time(trees[trace.rank])
        sources[trace.rank] = path.name
    suggestions.sort(key=lambda s: -s.at_stake_ns)
    report: dict[str, object] = {
        "ranks": {str(r): sources[r] for r in sorted(trees)},
        "suggestions": [dataclasses.asdict(s) for s in suggestions],
        "gpu_time_by_kernel_class_ns": {str(r): k for r, k in sorted(kernels.items())},
        "host_time_without_gpu": {str(r): h for r, h in sorted(host.items())},
    }
    if len(trees) > 1 or suspect is not None:
        report["peer_diff"] = _peer_diff(trees, suspect)
    if baseline:
        before: PathTimes | None = None
        for path in trace_files(list(baseline)):
            t = condense(read_trace(path, rank), "baseline", 10**18).whole()
            before = t if before is None else before.merged(t)
        now: PathTimes | None = None
        for t in trees.values():
            now = t if now is None else now.merged(t)
        assert before is not None and now is not None
        report["run_diff"] = _chain_report(now, [before])
    if flamegraph is not None:
        from trainscope.traces.flamegraph import speedscope

        doc = speedscope({f"rank {r}": t for r, t in sorted(trees.items())})
        try:
            flamegraph.write_text(json.dumps(doc))
        except OSError as exc:
            raise click.ClickException(f"cannot write {flamegraph}: {exc.strerror}") from None
        report["flamegraph"] = str(flamegraph)
    return report


HOST_FUNCTIONS_SHOWN = 5


def _host_time(tree: PathTimes) -> dict[str, object]:
    """A trace without GPU activity: its host time and the functions with the most self time
    (Python frames, torch ops, annotations), as shares of it."""
    functions = tree.self_by_function()
    total_ns = sum(functions.values())
    return {"total_ns": total_ns, "steps": tree.steps,
            "most_self_time_ns": [{"layer": layer, "name": name, "self_ns": ns}
                                  for (layer, name), ns in
                                  list(functions.items())[:HOST_FUNCTIONS_SHOWN]]}


def _peer_diff(trees: dict[int, object], suspect: int | None) -> dict[str, object]:
    from trainscope.traces.cct import PathTimes

    typed: dict[int, PathTimes] = {r: t for r, t in trees.items() if isinstance(t, PathTimes)}
    if suspect is not None and suspect not in typed:
        raise click.UsageError(f"--suspect {suspect}: no trace of that rank")
    if len(typed) < 2:
        raise click.UsageError("comparing a rank with its peers needs traces of 2+ ranks")
    from trainscope.traces.diff import diff, suspect_score

    candidates = [suspect] if suspect is not None else sorted(typed)
    best: dict[str, object] | None = None
    best_score = 0.0
    for r in candidates:
        peers = [t for q, t in typed.items() if q != r]
        score = suspect_score(diff(typed[r], peers))
        if best is None or score > best_score:
            best, best_score = _chain_report(typed[r], peers), score
            best["rank"] = r
    assert best is not None
    best["peers"] = len(typed) - 1
    return best


def _chain_report(times: object, baseline: list[object]) -> dict[str, object]:
    from trainscope.traces.diff import diff, hot_chain

    chain = hot_chain(diff(times, baseline))  # type: ignore[arg-type]
    return {
        "excess_ns": chain[-1].delta_ns if chain else 0.0,
        "per_step": chain[-1].per_step if chain else False,
        "chain": [{"layer": d.path[-1][0], "name": d.path[-1][1], "value_ns": d.value_ns,
                   "baseline_ns": d.baseline_ns, "delta_ns": d.delta_ns,
                   "delta_total_ns": d.delta_total_ns} for d in chain],
    }


def _stored_report(job_id: str, rank: int, store: Path | None,
                   url: str | None) -> dict[str, object]:
    from trainscope.store.client import StoreError, connect
    from trainscope.traces.cct import PathTimes

    try:
        client = connect(store, url, readonly=True, create=False)
        rows = client.query(
            "SELECT rank, callpath_id, any(parent_id), any(layer), any(name), sum(count), "
            "sum(total_ns), sum(self_ns) FROM call_paths WHERE job_id = {job:String} "
            "GROUP BY rank, callpath_id", parameters={"job": job_id}).result_rows
        steps = dict(client.query(
            "SELECT rank, sum(steps) FROM (SELECT rank, window_start_ns, any(steps) AS steps "
            "FROM call_paths WHERE job_id = {job:String} GROUP BY rank, window_start_ns) "
            "GROUP BY rank", parameters={"job": job_id}).result_rows)
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None
    except Exception as exc:
        raise click.ClickException(f"reading call_paths failed: {exc}") from None
    trees: dict[int, PathTimes] = {}
    for r, cp, parent, layer, name, count, total, own in rows:
        t = trees.setdefault(int(r), PathTimes({}, {}, {}, {}, int(steps.get(r, 0))))
        t.nodes[int(cp)] = (int(parent), layer, name)
        t.count[int(cp)], t.total_ns[int(cp)], t.self_ns[int(cp)] = int(count), int(total), \
            int(own)
    if rank not in trees:
        raise click.ClickException(
            f"no call paths of job {job_id!r} rank {rank} in the store (replay its trace with "
            "trainscope replay kineto --store)")
    return {"ranks": {str(r): "store" for r in sorted(trees)}, "suggestions": [],
            "gpu_time_by_kernel_class_ns": {}, "host_time_without_gpu": {},
            "peer_diff": _peer_diff(trees, rank)}


def _print_report(report: dict[str, object], top: int) -> None:
    for r, classes in report["gpu_time_by_kernel_class_ns"].items():  # type: ignore[attr-defined]
        total = sum(classes.values()) or 1
        shares = ", ".join(f"{k} {v / total:.0%}" for k, v in classes.items() if v)
        click.echo(f"rank {r}: GPU time {total / 1e6:.2f} ms: {shares}")
    for r, host in report["host_time_without_gpu"].items():  # type: ignore[attr-defined]
        total = host["total_ns"] or 1
        steps = f" over {host['steps']} steps" if host["steps"] else ""
        shares = ", ".join(f"{f['name'][:70]} {f['self_ns'] / total:.0%}"
                           for f in host["most_self_time_ns"])
        click.echo(f"rank {r}: no GPU activity; host time {host['total_ns'] / 1e6:.2f} ms{steps}, "
                   f"most self time in: {shares}")
    suggestions = report["suggestions"]
    if suggestions:
        click.echo("Suggestions (most time at stake first):")
    for n, s in enumerate(suggestions[:top], 1):  # type: ignore[index]
        click.echo(f"{n:2d}. [{s['analyzer']}] rank {s['rank']}, {s['at_stake_ns'] / 1e6:.2f} ms "
                   f"at stake: {s['found']}")
        click.echo(f"    try: {s['advice']}")
        if s["where"]:
            click.echo(f"    where: {s['where']}")
    if not suggestions and "peer_diff" not in report and "run_diff" not in report:
        click.echo("no suggestions: none of the analyzers' rules fired"
                   + (" (most read GPU activity; this trace has none)"
                      if report["host_time_without_gpu"] else ""))
    for key, title in (("peer_diff", "rank {rank} vs its {peers} peer(s)"),
                       ("run_diff", "this run vs the baseline")):
        part = report.get(key)
        if not part:
            continue
        heading = title.format(**part)  # type: ignore[arg-type]
        unit = "ms/step" if part["per_step"] else "ms"  # type: ignore[index]
        chain = part["chain"]  # type: ignore[index]
        if not chain:
            click.echo(f"Call paths, {heading}: no path takes longer")
            continue
        excess = chain[-1]["delta_ns"]
        shown = [d for d in chain if d["delta_ns"] >= 0.5 * excess]
        total = chain[-1]["delta_total_ns"]
        over = f" ({total / 1e6:+.3f} ms over the trace)" if part["per_step"] else ""  # type: ignore[index]
        click.echo(f"Call paths, {heading}: +{excess / 1e6:.3f} {unit}{over} under "
                   + " → ".join(d["name"] for d in shown))
        click.echo("  path: " + " → ".join(d["name"] for d in chain))
        for d in shown:
            click.echo(f"  {d['delta_ns'] / 1e6:+10.3f} {unit} ({d['value_ns'] / 1e6:.3f} vs "
                       f"{d['baseline_ns'] / 1e6:.3f})  {d['layer']}: {d['name'][:90]}")
    if report.get("flamegraph"):
        click.echo(f"flame graph (speedscope): {report['flamegraph']}")
