"""``trainscope demo``: a simulated job through the whole pipeline; the options the stream
commands share (``--detectors``, ``--window-s``)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from trainscope.detectors.base import ALERT_THRESHOLD


def resolve_layout(
    ranks: int | None, dp: int | None, pp: int | None, tp: int | None
) -> tuple[int, int, int]:
    """(dp, pp, tp) from what the user gave; unknown degrees default to 1 (dp fills the rest)."""
    if ranks is None and dp is None and pp is None and tp is None:
        return 4, 2, 2
    for name, value in (("--ranks", ranks), ("--dp", dp), ("--pp", pp), ("--tp", tp)):
        if value is not None and value < 1:
            raise click.BadParameter(f"must be >= 1, got {value}", param_hint=name)
    pp, tp = pp or 1, tp or 1
    if dp is None:
        if ranks is None:
            raise click.UsageError("give --ranks, or --dp with --pp/--tp")
        if ranks % (pp * tp):
            raise click.UsageError(f"--ranks {ranks} is not divisible by pp × tp = {pp * tp}")
        dp = ranks // (pp * tp)
    if ranks is not None and dp * pp * tp != ranks:
        raise click.UsageError(f"--ranks {ranks} does not match dp × pp × tp = {dp * pp * tp}")
    return dp, pp, tp


def load_detectors(names: str | None) -> list | None:
    """The detectors named in a ``--detectors a,b`` option, loaded from the registry (None: the
    option was not given, every registered detector runs). An unknown name, or a named one
    that cannot be loaded, is a one-line error."""
    if names is None:
        return None
    from trainscope.detectors.registry import UnknownDetector, load

    wanted = list(dict.fromkeys(n.strip() for n in names.split(",") if n.strip()))
    if not wanted:
        raise click.ClickException("--detectors names no detector")
    try:
        loaded = load(wanted)
    except UnknownDetector as exc:
        raise click.ClickException(f"--detectors: {exc}") from None
    for name, error in loaded.errors.items():
        raise click.ClickException(f"--detectors: {name} could not be loaded: {error}")
    return loaded.detectors


WINDOW_HELP = ("Window length in seconds; producers must cut the same windows. Default: "
               "$TRAINSCOPE_WINDOW_S, else 15.")
DETECTORS_HELP = ("Run only these detectors (comma-separated names, as `trainscope detectors` "
                  "lists them). Default: every registered one.")


@click.command()
@click.option("--ranks", type=int, help="World size. Default: 16 (dp 4 × pp 2 × tp 2).")
@click.option("--dp", type=int, help="Data-parallel degree.")
@click.option("--pp", type=int, help="Pipeline-parallel degree (stages).")
@click.option("--tp", type=int, help="Tensor-parallel degree.")
@click.option("--steps", type=click.IntRange(1), default=200, show_default=True)
@click.option("--fault", "faults", multiple=True, metavar="SPEC",
              help="Inject a fault, e.g. slow-gpu:rank=13,factor=1.4 (repeatable). Kinds: "
                   "slow-gpu, throttle, slow-link, dataloader-stall, gc-pause, "
                   "stage-imbalance, seq-imbalance; all take start=STEP.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--start-s", type=int, default=None,
              help="Start time of the simulated job, Unix seconds (default: so that it ends "
                   "about now). Fix it, with --seed, for byte-identical reruns.")
@click.option("--job-id", default="demo-job", show_default=True)
@click.option("--store", type=click.Path(path_type=Path),
              help="chDB store directory. Default: $TRAINSCOPE_STORE_DIR, else under the "
                   "user's data directory.")
@click.option("--no-store", is_flag=True, help="Do not write to ClickHouse.")
@click.option("--retention-days", type=click.IntRange(min=0), default=None,
              help="Keep the store's time series rows this many days after their time (whole "
                   "days are dropped); 0 keeps them forever. Default: leave the store's setting.")
@click.option("--bus", "bus_url", default="memory", show_default=True,
              help="memory, or kafka://HOST:PORT for a real broker.")
@click.option("--window-s", type=click.FloatRange(min=0.1), default=None, help=WINDOW_HELP)
@click.option("--threshold", type=click.FloatRange(0, 1), default=ALERT_THRESHOLD,
              show_default=True, help="Alert threshold on finding scores.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.option("--spans", is_flag=True,
              help="Send each rank's raw span events instead of the per-window function "
                   "summaries that real producers send (to compare the two paths).")
@click.option("--optrace", type=click.Path(file_okay=False, path_type=Path),
              help="Also write the job's op trace (optrace.parquet + optrace.yaml) into this "
                   "directory, for trainscope whatif.")
@click.option("--detectors", "detector_names", metavar="NAME[,NAME…]", help=DETECTORS_HELP)
def demo(
    ranks: int | None, dp: int | None, pp: int | None, tp: int | None, steps: int,
    faults: tuple[str, ...], seed: int, start_s: int | None, job_id: str, store: Path | None,
    no_store: bool, retention_days: int | None,
    bus_url: str, window_s: float | None, threshold: float, as_json: bool, spans: bool,
    optrace: Path | None, detector_names: str | None,
) -> None:
    """Run a simulated training job through the whole pipeline and diagnose it."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from trainscope.cli.demo_job import run_demo
    from trainscope.config.settings import from_context
    from trainscope.producers.simulate import ClusterSpec, FaultSpecError, parse_faults
    from trainscope.transport.bus import BusError

    settings = from_context()
    window_s = window_s if window_s is not None else settings.window_s
    dp, pp, tp = resolve_layout(ranks, dp, pp, tp)
    detectors = load_detectors(detector_names)
    try:
        parsed = parse_faults(list(faults))
    except FaultSpecError as exc:
        raise click.ClickException(f"bad --fault: {exc}") from None
    if start_s is None:
        start_s = time.time_ns() // 10**9 - 2 * steps  # steps take ~1-2 s of simulated time
    spec = ClusterSpec(job_id=job_id, dp=dp, pp=pp, tp=tp, steps=steps, seed=seed,
                       start_ns=start_s * 10**9)
    err = Console(stderr=True)
    out = Console(stderr=as_json)
    store = None if no_store else (store or settings.store_dir)
    sink = _open_sink(store, settings, retention_days)
    on_window = _alert_printer(out, threshold)

    progress = Progress(
        TextColumn("[bold]simulating[/] {task.fields[layout]}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("steps"), TimeElapsedColumn(), console=err, transient=True,
        disable=not err.is_terminal,
    )
    task = progress.add_task("steps", total=steps, layout=f"{dp}×{pp}×{tp}={dp * pp * tp} ranks")
    op_frames: list = []
    try:
        with progress:
            result = run_demo(
                spec, parsed, bus_url=bus_url, sink=sink, window_s=window_s,
                threshold=threshold, on_window=on_window,
                on_step=lambda s: progress.update(task, completed=s + 1),
                ops_sink=op_frames.append if optrace is not None else None,
                send="spans" if spans else "summaries", detectors=detectors,
            )
    except (ValueError, BusError) as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        if sink is not None:
            sink.close()
    for note in result.notes:
        err.print(f"[yellow]warning:[/] {note}")
    if optrace is not None:
        _write_optrace(optrace, op_frames, spec.op_trace_meta())
    if as_json:
        click.echo(json.dumps(result.as_json()))
        return
    _print_diagnosis(out, result, store, threshold)


def _open_sink(store: Path | None, settings: Any, retention_days: int | None) -> Any:
    """The store's writer, or None without a store; a store that cannot be opened is one line."""
    from trainscope.sinks.clickhouse import ClickHouseSink
    from trainscope.store.client import StoreError

    if store is None:
        return None
    try:
        return ClickHouseSink.open(store, settings=settings, retention_days=retention_days)
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None


def _alert_printer(out: Any, threshold: float) -> Callable[[Any, list[Any]], None]:
    """The ``on_window`` callback that prints one ALERT line per new suspect."""
    from rich.markup import escape

    from trainscope.schemas.untrusted import terminal_safe

    seen: set[tuple[int, int, str]] = set()

    def on_window(view: Any, findings: list[Any]) -> None:
        # Of one suspect's findings in a window, announce one that names the function.
        for f in sorted(findings, key=lambda f: not f.function):
            key = (f.rank, f.pp_stage, f.category)
            if f.score >= threshold and key not in seen:
                seen.add(key)
                # The job's id as the pipeline prints it: on a shared bus lines of several
                # demos (or a demo and a pipeline) must not be mistaken for one another.
                text = escape(terminal_safe(f"[{f.score:.2f}] {view.job_id}: {f.message}"))
                out.print(f"[bold red]ALERT[/] {text}", highlight=False)

    return on_window


def _write_optrace(directory: Path, frames: list, meta: dict[str, int]) -> None:
    import pandas as pd

    from trainscope.whatif.generate import write

    trace, meta_path = directory / "optrace.parquet", directory / "optrace.yaml"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        write(pd.concat(frames, ignore_index=True), meta, trace, meta_path)
    except OSError as exc:
        raise click.ClickException(f"cannot write the op trace to {directory}: {exc}") from None
    # Plain echo, not rich: the command must stay on one line to be copied.
    click.echo(f"op trace: {trace} ({sum(len(f) for f in frames):,} ops); analyse it with:\n"
               f"  trainscope whatif --trace {trace} --meta {meta_path}", err=True)


def _print_diagnosis(console, result, store: Path | None, threshold: float) -> None:
    from rich.markup import escape
    from rich.table import Table

    from trainscope.schemas.untrusted import terminal_safe

    def safe(text: object) -> str:
        """Producer text (job id, function names) shown as it is, never as Rich markup."""
        return escape(terminal_safe(text))

    stats = result.stats
    sent = f"sent as {result.summaries:,} function summaries" if result.summaries else "sent raw"
    console.print(
        f"\n[bold]{safe(result.job_id)}[/]: {result.ranks} ranks, {result.steps} steps, "
        f"{result.events:,} span events in {result.windows} windows, {sent}, "
        f"{result.elapsed_s:.1f} s ({result.events / max(result.elapsed_s, 1e-9):,.0f} events/s)"
    )
    console.print(
        f"messages: {stats.decode.received} received, {stats.decode.rejected} rejected; "
        f"late events: {stats.window.dropped}; rejected events: {stats.window.rejected}; "
        f"findings: {stats.detect.emitted}"
    )
    if not result.suspects:
        console.print(f"[green]Diagnosis: healthy[/] — no finding reached the alert threshold "
                      f"({threshold}).")
    else:
        table = Table(title="Diagnosis (most suspect first)")
        for column in ("#", "rank(s)", "category", "function", "score", "windows", "victims"):
            table.add_column(column)
        for i, s in enumerate(result.suspects, 1):
            who = (f"stage {s.pp_stage}" if s.category == "stage-imbalance"
                   else ("job" if s.rank < 0 else str(s.rank)))
            table.add_row(str(i), who, safe(s.category), safe(f"{s.layer}/{s.function}".strip("/")),
                          f"{s.score:.2f}", str(s.windows), str(len(s.victims)))
        console.print(table)
        console.print(f"[bold]Prime suspect:[/] {safe(result.suspects[0].message)}",
                      highlight=False)
    if store is not None:
        # Windows, not finding rows: several detectors may report one rank in one window.
        console.print(f"store: {safe(store)}  (try: trainscope sql \"SELECT rank, category, "
                      f"round(avg(score), 2) AS score, uniqExact(window_start_ns) AS windows "
                      f"FROM findings GROUP BY rank, category ORDER BY windows DESC, score DESC\" "
                      f"--store {safe(store)})", highlight=False)
