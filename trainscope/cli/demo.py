"""``trainscope demo`` and ``trainscope pipeline``: the stream job from the command line."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click

from trainscope.detectors.base import ALERT_THRESHOLD
from trainscope.detectors.registry import DEFAULT_MAX_JOBS
from trainscope.engine.checkpoint import DEFAULT_MAX_OPEN_BYTES


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
    from trainscope.sinks.clickhouse import ClickHouseSink
    from trainscope.store.client import StoreError
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
    sink = None
    if not no_store:
        store = store or settings.store_dir
        try:
            sink = ClickHouseSink.open(store, settings=settings, retention_days=retention_days)
        except StoreError as exc:
            raise click.ClickException(str(exc)) from None

    seen: set[tuple[int, int, str]] = set()

    def on_window(view, findings) -> None:
        # Of one suspect's findings in a window, announce one that names the function.
        for f in sorted(findings, key=lambda f: not f.function):
            key = (f.rank, f.pp_stage, f.category)
            if f.score >= threshold and key not in seen:
                seen.add(key)
                out.print(f"[bold red]ALERT[/] [{f.score:.2f}] {f.message}", highlight=False)

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
    _print_diagnosis(out, result, store if sink else None, threshold)


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
    from rich.table import Table

    stats = result.stats
    sent = f"sent as {result.summaries:,} function summaries" if result.summaries else "sent raw"
    console.print(
        f"\n[bold]{result.job_id}[/]: {result.ranks} ranks, {result.steps} steps, "
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
            table.add_row(str(i), who, s.category, f"{s.layer}/{s.function}".strip("/"),
                          f"{s.score:.2f}", str(s.windows), str(len(s.victims)))
        console.print(table)
        console.print(f"[bold]Prime suspect:[/] {result.suspects[0].message}", highlight=False)
    if store is not None:
        console.print(f"store: {store}  (try: trainscope sql \"SELECT category, count() "
                      f"FROM findings GROUP BY category\" --store {store})")


@click.command()
@click.option("--bus", "bus_url", required=True, help="kafka://HOST:PORT of the broker.")
@click.option("--store", type=click.Path(path_type=Path),
              help="chDB store directory. Default: $TRAINSCOPE_STORE_DIR, else under the "
                   "user's data directory.")
@click.option("--url", help="ClickHouse server URL instead of a store. Default: "
                            "$TRAINSCOPE_CLICKHOUSE_URL.")
@click.option("--retention-days", type=click.IntRange(min=0), default=None,
              help="Keep the store's time series rows this many days after their time (whole "
                   "days are dropped); 0 keeps them forever. Default: leave the store's setting.")
@click.option("--group", default="trainscope-pipeline", show_default=True)
@click.option("--window-s", type=click.FloatRange(min=0.1), default=None, help=WINDOW_HELP)
@click.option("--lateness-s", type=click.FloatRange(min=0), default=5.0, show_default=True)
@click.option("--commit-interval-s", type=click.FloatRange(min=0), default=5.0,
              show_default=True, help="How often written windows are committed.")
@click.option("--close-idle-s", type=click.FloatRange(min=0.1), default=30.0, show_default=True,
              help="Close a job's windows once it sent nothing for this long (time spent "
                   "waiting on the bus).")
@click.option("--source-idle-s", type=click.FloatRange(min=0.1), default=10.0,
              show_default=True,
              help="A partition that delivered nothing for this long stops holding windows "
                   "open (time spent waiting on the bus).")
@click.option("--stop-timeout-s", type=click.FloatRange(min=1), default=30.0, show_default=True,
              help="On SIGTERM/Ctrl-C, how long to try writing and committing before giving up.")
@click.option("--drain-on-stop", is_flag=True,
              help="On SIGTERM/Ctrl-C, close and write the open windows instead of "
                   "checkpointing them for the next run (for a pipeline stopped for good).")
@click.option("--max-open-bytes", type=click.IntRange(min=0), default=DEFAULT_MAX_OPEN_BYTES,
              show_default=True,
              help="Largest checkpoint of open windows (compressed bytes) stored with a commit; "
                   "beyond it, or at 0, a restart re-reads the open windows instead.")
@click.option("--idle-exit-s", type=float, default=None,
              help="Exit after this many seconds without messages (default: run until stopped).")
@click.option("--stats-every-s", type=click.FloatRange(min=0.1), default=None,
              help="Also print the counters (one JSON line on stderr) this often.")
@click.option("--max-jobs", type=click.IntRange(min=1), default=DEFAULT_MAX_JOBS,
              show_default=True,
              help="Jobs whose windows and detector state are kept; beyond that the least "
                   "recently seen job's windows are closed and its state forgotten.")
@click.option("--alertmanager", "alertmanager_url", metavar="URL",
              help="Send findings at or above the alert threshold to this Prometheus "
                   "Alertmanager (http://HOST:9093), through its v2 API.")
@click.option("--alert-resend-s", type=click.FloatRange(min=0.1), default=60.0,
              show_default=True, help="How often firing alerts are re-sent to Alertmanager.")
@click.option("--dashboard-url", metavar="URL",
              help="Base URL of `trainscope ui`, for the link in each alert.")
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=None,
              help="Serve the pipeline's counters at http://BIND:PORT/metrics (Prometheus).")
@click.option("--metrics-bind", default="127.0.0.1", show_default=True,
              help="Address the /metrics server binds to.")
@click.option("--auto-profile/--no-auto-profile", default=True, show_default=True,
              help="On a finding at or above the alert threshold that names a rank, ask that "
                   "rank and one healthy peer (over the control topic) to profile themselves, "
                   "diff their call paths and store the result with the finding "
                   "(finding_call_paths).")
@click.option("--auto-profile-steps", type=click.IntRange(min=1), default=5, show_default=True,
              help="Training steps each automatic profile covers.")
@click.option("--auto-profile-every-s", type=click.FloatRange(min=0), default=600.0,
              show_default=True,
              help="At most one automatic profile per job and suspect rank this often.")
@click.option("--auto-profile-max-pending", type=click.IntRange(min=1), default=4,
              show_default=True,
              help="At most this many automatic profiles awaited at once, over all jobs.")
@click.option("--detectors", "detector_names", metavar="NAME[,NAME…]", help=DETECTORS_HELP)
@click.option("--input", "input_kind", type=click.Choice(["events", "summaries"]),
              default="events", show_default=True,
              help="events: read the producers' events and metrics topics and window them here. "
                   "summaries: read the window summaries and step records of a windowing tier "
                   "(`trainscope stream flink`) and the metrics topic; windows then wait one "
                   "window more (--lateness-s is at least --window-s), as the tier may emit a "
                   "window's rows in two parts.")
def pipeline(bus_url: str, store: Path | None, url: str | None, retention_days: int | None,
             group: str, window_s: float | None,
             lateness_s: float, commit_interval_s: float, close_idle_s: float,
             source_idle_s: float, stop_timeout_s: float, idle_exit_s: float | None,
             stats_every_s: float | None, max_jobs: int, drain_on_stop: bool,
             max_open_bytes: int, alertmanager_url: str | None, alert_resend_s: float,
             dashboard_url: str | None, metrics_port: int | None, metrics_bind: str,
             detector_names: str | None, auto_profile: bool, auto_profile_steps: int,
             auto_profile_every_s: float, auto_profile_max_pending: int,
             input_kind: str) -> None:
    """Consume events from a bus, detect, and write to ClickHouse (a long-running stream job).

    At-least-once from the bus, exactly-once in the store: with every commit the open windows,
    the written ones and the detectors' state are checkpointed in the store, and a restart
    (after a crash, SIGKILL or SIGTERM) carries on from there, re-reading only what came after
    the last commit. SIGTERM or Ctrl-C checkpoints, commits and exits 0 (--drain-on-stop
    writes the open windows first); --idle-exit-s, the end of the stream, writes them.
    """
    import signal

    from trainscope.config.settings import from_context
    from trainscope.engine.bus_job import INPUT_TOPICS, BusStreamJob, summaries_lateness_s
    from trainscope.sinks.clickhouse import ClickHouseSink
    from trainscope.store.client import StoreError
    from trainscope.transport.bus import BusError, open_bus
    from trainscope.transport.logonce import quiet_repeats

    # Handlers first: a SIGTERM while the store opens, the checkpoint is restored or the group
    # is joined must stop the job the same orderly way, not kill it.
    stopper = _Stopper(stop_timeout_s)
    signal.signal(signal.SIGTERM, stopper)
    signal.signal(signal.SIGINT, stopper)
    quiet_repeats()
    if store is not None and url is not None:
        raise click.UsageError("give either --store DIR or --url URL, not both")
    settings = from_context()
    store, url = settings.store(store, url)
    window_s = window_s if window_s is not None else settings.window_s
    if input_kind == "summaries":
        lateness_s = summaries_lateness_s(window_s, lateness_s)
    detectors = load_detectors(detector_names)  # before anything is opened: a typo fails fast
    notifier = None
    if alertmanager_url is not None:
        from trainscope.sinks.alert_book import AlertBook
        from trainscope.sinks.alertmanager import AlertmanagerNotifier

        try:
            notifier = AlertmanagerNotifier(
                alertmanager_url,
                AlertBook(threshold=ALERT_THRESHOLD, dashboard_url=dashboard_url),
                resend_s=alert_resend_s,
            )
        except ValueError as exc:
            raise click.ClickException(f"--alertmanager: {exc}") from None
    try:
        sink = ClickHouseSink.open(store, url, settings=settings,
                                   retention_days=retention_days)
        bus = open_bus(bus_url)
    except (StoreError, BusError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None

    profiler = None
    if auto_profile:
        from trainscope.loop.autoprofile import AutoProfiler
        from trainscope.loop.policy import ProfilePolicy

        profiler = AutoProfiler(
            bus.publish, sink.write_finding_call_paths, steps=auto_profile_steps,
            policy=ProfilePolicy(threshold=ALERT_THRESHOLD, every_s=auto_profile_every_s,
                                 max_pending=auto_profile_max_pending),
            announce=click.echo,
        )

    def on_window(view, findings) -> None:
        for f in findings:
            if f.score >= ALERT_THRESHOLD:
                click.echo(f"ALERT [{f.score:.2f}] {view.job_id}: {f.message}")
        if notifier is not None:
            notifier.on_window(view, findings)
        if profiler is not None:
            profiler.on_window(view, findings)

    try:
        p = BusStreamJob(bus, group=group, topics=INPUT_TOPICS[input_kind], window_s=window_s,
                     lateness_s=lateness_s, sink=sink,
                     on_window=on_window, commit_interval_s=commit_interval_s,
                     on_profile=profiler.on_profile if profiler is not None else None,
                     job_idle_s=close_idle_s, source_idle_s=source_idle_s,
                     stats_every_s=stats_every_s, max_jobs=max_jobs,
                     max_open_bytes=max_open_bytes, detectors=detectors,
                     on_stats=lambda stats: click.echo(json.dumps(stats.as_dict()), err=True))
    except BusError as exc:  # e.g. the broker is down, or a TLS handshake or login failed
        bus.close()
        sink.close()
        raise click.ClickException(str(exc)) from None

    stopper.attach(p)
    if metrics_port is not None:
        from trainscope.engine.health_metrics import PipelineCollector, serve_metrics

        try:
            serve_metrics(
                PipelineCollector(
                    p, notifier.stats if notifier else None,
                    (lambda: {**asdict(profiler.counts), **asdict(profiler.policy.counts)})
                    if profiler is not None else None,
                ),
                metrics_port, metrics_bind,
            )
        except OSError as exc:
            p.close()
            bus.close()
            sink.close()
            raise click.ClickException(
                f"--metrics-port {metrics_port}: cannot listen on {metrics_bind}: {exc}"
            ) from None
    if notifier is not None:
        notifier.start()
    click.echo(f"consuming {bus_url} as group {group}; SIGTERM or Ctrl-C to stop", err=True)
    p.run(idle_timeout_s=idle_exit_s if idle_exit_s is not None else float("inf"))
    complete = p.finish(drain=drain_on_stop or not p.stopping)
    p.close()
    bus.close()
    sink.close()
    final = p.stats().as_dict()
    if notifier is not None:
        notifier.close()
        final["alertmanager"] = notifier.stats().as_dict()
    if profiler is not None:
        final["auto_profile"] = {**asdict(profiler.counts), **asdict(profiler.policy.counts)}
    click.echo(json.dumps(final), err=True)
    sys.stderr.flush()
    if not complete:
        raise click.ClickException("stopped before every window was written and committed; "
                                   "a restart re-reads what was not committed")


class _Stopper:
    """The SIGTERM/SIGINT handler of ``trainscope pipeline``, installed before the pipeline
    exists; a stop asked for before then applies as soon as it does."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.requested = False
        self._pipeline: Any = None

    def __call__(self, signum: int, frame: object) -> None:
        self.requested = True
        if self._pipeline is not None:
            self._pipeline.request_stop(self.timeout_s)

    def attach(self, pipeline: Any) -> None:
        self._pipeline = pipeline
        if self.requested:
            pipeline.request_stop(self.timeout_s)
