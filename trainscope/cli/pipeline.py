"""``trainscope pipeline``: the production stream job, reading a bus and writing a store."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from trainscope.cli.demo import DETECTORS_HELP, WINDOW_HELP, load_detectors
from trainscope.detectors.base import ALERT_THRESHOLD
from trainscope.detectors.registry import DEFAULT_MAX_JOBS
from trainscope.engine.caps import Caps
from trainscope.engine.checkpoint import DEFAULT_MAX_OPEN_BYTES, ExtraState
from trainscope.schemas.untrusted import terminal_safe

# Time each detector may take per window in `trainscope pipeline` (--detector-budget-s): well
# above what the built-ins take on a real job's window, well below a window's length.
DETECTOR_BUDGET_S = 10.0
# Exit status when a stop did not finish within --stop-timeout-s and the watchdog ended it.
FORCED_STOP_EXIT = 3

if TYPE_CHECKING:
    from collections.abc import Callable

    from trainscope.config.settings import Settings
    from trainscope.engine.bus_job import BusStreamJob
    from trainscope.loop.autoprofile import AutoProfiler
    from trainscope.schemas.records import Finding
    from trainscope.schemas.window import WindowView
    from trainscope.sinks.alertmanager import AlertmanagerNotifier
    from trainscope.sinks.clickhouse import ClickHouseSink
    from trainscope.transport.bus import Bus


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
@click.option("--group", default="trainscope-pipeline", show_default=True,
              help="Kafka consumer group, whose checkpoint the store keeps. One pipeline per "
                   "group: a second one is refused (to scale out, `trainscope stream faust`).")
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
              help="On SIGTERM/Ctrl-C, how long to try writing and committing before giving up. "
                   "The process is gone by then whatever it is doing (a detector mid-window, "
                   "a write): past it, one line and exit status 3, committing nothing more (a "
                   "restart re-reads from the last commit).")
@click.option("--on-store-loss", type=click.Choice(["exit", "wait"]), default="exit",
              show_default=True,
              help="When the store is lost under the pipeline (its directory deleted or moved, "
                   "a table or its data directory gone, a server's database dropped): both stop "
                   "writing, commit nothing past the last checkpoint and say so in one line; "
                   "exit: then exit 1 (a restart resumes from the store at the path then); "
                   "wait: wait for a store to be back at the path, then restart this process "
                   "to resume from its checkpoint.")
@click.option("--drain-on-stop", is_flag=True,
              help="On SIGTERM/Ctrl-C, close and write the open windows instead of "
                   "checkpointing them for the next run (for a pipeline stopped for good).")
@click.option("--max-open-bytes", type=click.IntRange(min=0), default=DEFAULT_MAX_OPEN_BYTES,
              show_default=True,
              help="Largest checkpoint of open windows (compressed bytes) stored with a commit; "
                   "beyond it, or at 0, a restart re-reads the open windows instead.")
@click.option("--idle-exit-s", type=float, default=None,
              help="Exit after this many seconds without messages, counted while partitions "
                   "are assigned (joining the group is not idleness; default: run until "
                   "stopped).")
@click.option("--stats-every-s", type=click.FloatRange(min=0.1), default=None,
              help="Also print the counters (one JSON line on stderr) this often.")
@click.option("--max-jobs", type=click.IntRange(min=1), default=DEFAULT_MAX_JOBS,
              show_default=True,
              help="Jobs whose windows and detector state are kept; beyond that the least "
                   "recently seen job's windows are closed and its state forgotten.")
@click.option("--max-functions-per-rank", type=click.IntRange(min=1),
              default=Caps.functions_per_rank, show_default=True,
              help="Distinct functions (layer, name, call path) one rank may name in one window. "
                   "A message that would pass this, --max-functions-per-job or "
                   "--max-open-windows is set aside whole as a dead letter with the reason, "
                   "counted (capped_messages) and reported as a `cardinality` finding.")
@click.option("--max-functions-per-job", type=click.IntRange(min=1),
              default=Caps.functions_per_job, show_default=True,
              help="Distinct functions all ranks of a job may name in one window.")
@click.option("--max-open-windows", type=click.IntRange(min=1), default=Caps.open_windows,
              show_default=True, help="Windows one job may have open at once.")
@click.option("--detector-budget-s", type=click.FloatRange(min=0), default=DETECTOR_BUDGET_S,
              show_default=True,
              help="Time each detector may spend on one window; past it the detector is "
                   "stopped, skipped for that window (counted in detector_over_budget) and "
                   "its state for the job starts over. 0: no budget.")
@click.option("--alertmanager", "alertmanager_url", metavar="URL",
              help="Send findings at or above the alert threshold to this Prometheus "
                   "Alertmanager (http://HOST:9093), through its v2 API. Firing alerts and "
                   "those not sent yet are kept in each checkpoint: a restart on the same store "
                   "and group resends them, with their original start.")
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
              help="Training steps each automatic profile covers (more, up to 50, for a "
                   "straggler slow only now and then: enough to hold two of its slow steps).")
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
             input_kind: str, on_store_loss: str, max_functions_per_rank: int,
             max_functions_per_job: int, max_open_windows: int,
             detector_budget_s: float) -> None:
    """Consume events from a bus, detect, and write to ClickHouse (a long-running stream job).

    At-least-once from the bus, exactly-once in the store: with every commit the open windows,
    the written ones and the detectors' state are checkpointed in the store, and a restart
    (after a crash, SIGKILL or SIGTERM) carries on from there, re-reading only what came after
    the last commit. SIGTERM or Ctrl-C checkpoints, commits and exits 0 (--drain-on-stop
    writes the open windows first); --idle-exit-s, the end of the stream, writes them.

    What-if op traces that jobs send (attach(optrace=True), `trainscope replay optrace`) are
    stored with each commit, for `trainscope whatif --job JOB`.

    \f
    Long because each option is a parameter; the work is in the helpers below.
    """
    import signal

    if bus_url.strip().lower() in ("memory", "memory://"):
        # An in-memory bus lives inside one process; no producer can publish to this one.
        raise click.ClickException(
            "--bus memory: nothing could ever arrive on an in-memory bus of its own; give "
            "--bus kafka://HOST:PORT (or run `trainscope demo`, which runs its producers and "
            "stream job in one process)")

    from trainscope.config.settings import from_context
    from trainscope.engine.allocator import keep_freed_memory
    from trainscope.engine.bus_job import INPUT_TOPICS, BusStreamJob, summaries_lateness_s
    from trainscope.engine.core import StoreLost
    from trainscope.schemas.topics import OPTRACE_TOPIC
    from trainscope.transport.bus import BusError, GroupHeldElsewhere
    from trainscope.transport.logonce import quiet_repeats

    # Handlers first: a SIGTERM while the store opens, the checkpoint is restored or the group
    # is joined must stop the job the same orderly way, not kill it.
    stopper = _Stopper(stop_timeout_s)
    signal.signal(signal.SIGTERM, stopper)
    signal.signal(signal.SIGINT, stopper)
    _start_watchdog(stop_timeout_s)
    quiet_repeats()
    keep_freed_memory()  # this process runs the stream job: windows reuse what windows freed
    if store is not None and url is not None:
        raise click.UsageError("give either --store DIR or --url URL, not both")
    settings = from_context()
    window_s = window_s if window_s is not None else settings.window_s
    if input_kind == "summaries":
        lateness_s = summaries_lateness_s(window_s, lateness_s)
    detectors = load_detectors(detector_names)  # before anything is opened: a typo fails fast
    notifier = _notifier(alertmanager_url, dashboard_url, alert_resend_s)
    sink, bus = _open_store_and_bus(settings, store, url, retention_days, bus_url)
    profiler = (_auto_profiler(bus, sink, auto_profile_steps, auto_profile_every_s,
                               auto_profile_max_pending) if auto_profile else None)
    try:
        job = BusStreamJob(
            bus, group=group, topics=(*INPUT_TOPICS[input_kind], OPTRACE_TOPIC), window_s=window_s,
            lateness_s=lateness_s, sink=sink, on_window=_on_findings(notifier, profiler),
            on_early=_on_findings(notifier, profiler, early=True),
            commit_interval_s=commit_interval_s,
            on_profile=profiler.on_profile if profiler is not None else None,
            job_idle_s=close_idle_s, source_idle_s=source_idle_s, stats_every_s=stats_every_s,
            max_jobs=max_jobs, max_open_bytes=max_open_bytes, detectors=detectors,
            caps=Caps(max_functions_per_rank, max_functions_per_job, max_open_windows),
            detector_budget_s=detector_budget_s or None,
            on_stats=lambda stats: click.echo(json.dumps(stats.as_dict()), err=True),
            extra_state=_alert_state(notifier),
        )
    except BusError as exc:  # e.g. the broker is down, or a TLS handshake or login failed
        bus.close()
        sink.close()
        if isinstance(exc, GroupHeldElsewhere):
            raise click.ClickException(_second_member(exc, group)) from None
        raise click.ClickException(str(exc)) from None
    stopper.attach(job)
    if metrics_port is not None:
        _serve_metrics(job, bus, sink, notifier, profiler, metrics_port, metrics_bind)
    if notifier is not None:
        notifier.start()
    click.echo(f"consuming {bus_url} as group {group}; SIGTERM or Ctrl-C to stop", err=True)
    try:
        job.run(idle_timeout_s=idle_exit_s if idle_exit_s is not None else float("inf"))
        complete = job.finish(drain=drain_on_stop or not job.stopping)
    except GroupHeldElsewhere as exc:
        # This member read nothing and committed nothing: leaving changes nothing for the
        # member that holds the group.
        _close_and_report(job, bus, sink, notifier, profiler, checkpointed=False)
        raise click.ClickException(_second_member(exc, group)) from None
    except StoreLost as exc:
        from trainscope.cli.store_loss import after_store_loss

        after_store_loss(
            str(exc), on_store_loss, stop_requested=lambda: stopper.requested,
            close=lambda: _close_and_report(job, bus, sink, notifier, profiler,
                                            checkpointed=False),
            store=store, url=url, settings=settings)
    _close_and_report(job, bus, sink, notifier, profiler, checkpointed=complete)
    if not complete:
        raise click.ClickException("stopped before every window was written and committed; "
                                   "a restart re-reads what was not committed")


def _second_member(exc: Exception, group: str) -> str:
    """The one line a refused second member of a group exits with."""
    return (f"{exc}. One `trainscope pipeline` per --group (its windows span every partition "
            f"of a job, its checkpoint is the group's): to share the work between processes "
            f"run `trainscope stream faust` workers instead (docs/stream-job.md); to read "
            f"everything a second time, into a store of its own, give this one another "
            f"--group than {group!r}")


def _notifier(url: str | None, dashboard_url: str | None,
              resend_s: float) -> AlertmanagerNotifier | None:
    if url is None:
        return None
    from trainscope.sinks.alert_book import AlertBook
    from trainscope.sinks.alertmanager import AlertmanagerNotifier

    try:
        return AlertmanagerNotifier(
            url, AlertBook(threshold=ALERT_THRESHOLD, dashboard_url=dashboard_url),
            resend_s=resend_s,
        )
    except ValueError as exc:
        raise click.ClickException(f"--alertmanager: {exc}") from None


def _alert_state(notifier: AlertmanagerNotifier | None) -> dict[str, ExtraState] | None:
    """Firing and unsent alerts go into each checkpoint: a restart resends them."""
    if notifier is None:
        return None
    return {"alertmanager": ExtraState(notifier.checkpoint_state, notifier.restore_state)}


def _open_store_and_bus(settings: Settings, store: Path | None, url: str | None,
                        retention_days: int | None, bus_url: str) -> tuple[ClickHouseSink, Bus]:
    from trainscope.sinks.clickhouse import ClickHouseSink
    from trainscope.store.client import StoreError
    from trainscope.transport.bus import BusError, open_bus

    store, url = settings.store(store, url)
    try:
        sink = ClickHouseSink.open(store, url, settings=settings, retention_days=retention_days)
        bus = open_bus(bus_url)
    except (StoreError, BusError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    return sink, bus


def _auto_profiler(bus: Bus, sink: ClickHouseSink, steps: int, every_s: float,
                   max_pending: int) -> AutoProfiler:
    from trainscope.loop.autoprofile import AutoProfiler
    from trainscope.loop.policy import ProfilePolicy

    return AutoProfiler(
        bus.publish, sink.write_finding_call_paths, steps=steps,
        policy=ProfilePolicy(threshold=ALERT_THRESHOLD, every_s=every_s,
                             max_pending=max_pending),
        announce=click.echo,
    )


def _on_findings(notifier: AlertmanagerNotifier | None, profiler: AutoProfiler | None,
                 *, early: bool = False) -> Callable[[WindowView, list[Finding]], None]:
    """What a closed window's findings set off, or (``early``) a flag raised before its window
    closed: an ALERT line, Alertmanager, a profile of the suspect (from a flag, so that its
    call path may be ready when the window closes)."""
    def on_findings(view: WindowView, findings: list[Finding]) -> None:
        for f in findings:
            if f.score >= ALERT_THRESHOLD:
                # Job ids and function names are the producers' text: escape what a terminal
                # would act on (trainscope.schemas.untrusted).
                click.echo(f"ALERT [{f.score:.2f}] {terminal_safe(view.job_id)}: "
                           f"{terminal_safe(f.message)}")
        if notifier is not None:
            (notifier.on_early if early else notifier.on_window)(view, findings)
        if profiler is not None:
            profiler.on_window(view, findings)

    return on_findings


def _profile_counts(profiler: AutoProfiler) -> dict[str, int]:
    return {**asdict(profiler.counts), **asdict(profiler.policy.counts)}


def _serve_metrics(job: BusStreamJob, bus: Bus, sink: ClickHouseSink,
                   notifier: AlertmanagerNotifier | None, profiler: AutoProfiler | None,
                   port: int, bind: str) -> None:
    from trainscope.engine.health_metrics import PipelineCollector, serve_metrics

    collector = PipelineCollector(
        job, notifier.stats if notifier is not None else None,
        (lambda: _profile_counts(profiler)) if profiler is not None else None,
    )
    try:
        serve_metrics(collector, port, bind)
    except OSError as exc:
        job.close()
        bus.close()
        sink.close()
        raise click.ClickException(
            f"--metrics-port {port}: cannot listen on {bind}: {exc}"
        ) from None


def _close_and_report(job: BusStreamJob, bus: Bus, sink: ClickHouseSink,
                      notifier: AlertmanagerNotifier | None,
                      profiler: AutoProfiler | None, *, checkpointed: bool) -> None:
    """Close everything, then print the final counts as one JSON line on stderr.
    ``checkpointed``: the final checkpoint was stored (alerts not sent are in it)."""
    job.close()
    bus.close()
    sink.close()
    final: dict[str, Any] = job.stats().as_dict()
    if notifier is not None:
        notifier.close(checkpointed=checkpointed)
        final["alertmanager"] = notifier.stats().as_dict()
    if profiler is not None:
        final["auto_profile"] = _profile_counts(profiler)
    click.echo(json.dumps(final), err=True)
    sys.stderr.flush()


class _Stopper:
    """The SIGTERM/SIGINT handler of ``trainscope pipeline``, installed before the pipeline
    exists; a stop asked for before then applies as soon as it does."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.requested = False
        self._job: BusStreamJob | None = None

    def __call__(self, signum: int, frame: object) -> None:
        self.requested = True
        if self._job is not None:
            self._job.request_stop(self.timeout_s)

    def attach(self, job: BusStreamJob) -> None:
        self._job = job
        if self.requested:
            job.request_stop(self.timeout_s)


def _start_watchdog(timeout_s: float) -> None:
    """End the process ``timeout_s`` after SIGTERM or SIGINT, if it is still there then.

    The orderly stop runs in the main thread, after whatever that thread is doing: a detector
    (bounded by --detector-budget-s, but a plugin may sit in one long native call, during which
    Python runs no signal handler at all), a write being retried. So the deadline is kept by a
    daemon thread woken through the interpreter's wakeup fd, which the C-level signal handler
    writes at once, whatever the main thread is doing. Past the deadline it writes one line
    and exits without flushing or committing anything more, as a crash would: at-least-once
    holds (the next run re-reads from the last commit), and nothing unstored was committed,
    because positions are committed only after the checkpoint that covers them is stored."""
    import os
    import signal
    import threading
    import time

    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    stops = {signal.SIGTERM, signal.SIGINT}

    def watch() -> None:
        # The fd carries the number of every signal with a Python handler (SIGALRM of the
        # detector budget too): wait for a stop.
        while not stops.intersection(os.read(read_fd, 64)):
            pass
        time.sleep(timeout_s)
        os.write(2, (f"trainscope pipeline: not stopped {timeout_s:g} s after the stop signal "
                     f"(--stop-timeout-s); exiting now with status {FORCED_STOP_EXIT}, "
                     "committing nothing more: a restart re-reads from the last commit\n"
                     ).encode())
        os._exit(FORCED_STOP_EXIT)

    threading.Thread(target=watch, name="stop-deadline", daemon=True).start()
