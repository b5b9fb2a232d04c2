"""``trainscope agent``: the host daemon's command line.

The main CLI registers this command with ``cli.add_command(agent)``; ``python -m
trainscope.cli.agent`` runs it on its own (the systemd unit and the DaemonSet do).
"""

from __future__ import annotations

import json
import logging
import signal
import sys
from types import FrameType

import click

from trainscope.config.settings import from_context
from trainscope.producers.agent.base import Collector
from trainscope.producers.agent.daemon import Agent, AgentSettings

log = logging.getLogger("trainscope.agent")


def _configure_logging(verbose: bool) -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(stream=sys.stderr, format="trainscope agent: %(message)s")
    # Our own loggers only: third-party libraries keep their levels.
    level = logging.DEBUG if verbose else logging.INFO
    for name in ("trainscope.agent", "trainscope.producers.agent"):
        logging.getLogger(name).setLevel(level)


def build_collectors(
    settings: AgentSettings,
    *,
    nvml: bool,
    ebpf: bool,
    pids: tuple[int, ...],
    functions: list[str] | None = None,
) -> list[Collector]:
    from trainscope.producers.agent.ebpf import EbpfCollector
    from trainscope.producers.agent.host import HostCollector
    from trainscope.producers.agent.nvml import NvmlSampler

    collectors: list[Collector] = [HostCollector(host=settings.host, job_id=settings.job_id)]
    if nvml:
        collectors.append(NvmlSampler(host=settings.host, default_job_id=settings.job_id))
    if ebpf:
        collectors.append(
            EbpfCollector(default_job_id=settings.job_id, pids=pids or None, functions=functions)
        )
    return collectors


@click.command("agent")
@click.option(
    "--bus",
    "bus_url",
    default="memory",
    show_default=True,
    envvar="TRAINSCOPE_BUS",
    help="Where to publish: 'memory' (nothing leaves this host) or kafka://HOST:PORT.",
)
@click.option(
    "--interval",
    "interval_s",
    type=float,
    default=1.0,
    show_default=True,
    help="Seconds between two reads of the collectors.",
)
@click.option(
    "--window",
    "window_s",
    type=float,
    default=None,
    help="Seconds between two publications of condensed records: the summary window, shared "
    "with the producers and the stream job. Default: $TRAINSCOPE_WINDOW_S, else 15.",
)
@click.option("--no-ebpf", is_flag=True, help="Do not trace CUDA/NCCL calls and scheduling.")
@click.option("--no-nvml", is_flag=True, help="Do not sample GPUs through NVML.")
@click.option(
    "--job-id",
    default="unknown",
    show_default=True,
    envvar="TRAINSCOPE_JOB_ID",
    help="Job id for processes whose environment names none.",
)
@click.option(
    "--pid",
    "pids",
    type=int,
    multiple=True,
    help="Trace only this process (repeatable); default: every CUDA/NCCL process.",
)
@click.option(
    "--probes",
    default=None,
    help="Comma-separated CUDA/NCCL functions to probe (default: all of them; leave out "
    "cudaLaunchKernel where launch rates are very high).",
)
@click.option(
    "--duration",
    "duration_s",
    type=float,
    default=None,
    help="Stop after this many seconds (default: run until SIGTERM/SIGINT).",
)
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=None,
              help="Serve the agent's counters at http://BIND:PORT/metrics (Prometheus).")
@click.option("--metrics-bind", default="127.0.0.1", show_default=True,
              help="Address the /metrics server binds to.")
@click.option("-v", "--verbose", is_flag=True, help="Log every published window.")
def agent(
    bus_url: str,
    interval_s: float,
    window_s: float | None,
    no_ebpf: bool,
    no_nvml: bool,
    job_id: str,
    pids: tuple[int, ...],
    probes: str | None,
    duration_s: float | None,
    metrics_port: int | None,
    metrics_bind: str,
    verbose: bool,
) -> None:
    """Observe the training processes of this host without touching them (NVML, eBPF)."""
    from trainscope.transport.bus import open_bus

    _configure_logging(verbose)
    try:
        if window_s is None:
            window_s = from_context().window_s
        settings = AgentSettings(interval_s=interval_s, window_s=window_s, job_id=job_id)
        bus = open_bus(bus_url)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if bus_url in ("memory", "memory://"):
        log.warning(
            "bus 'memory': records stay inside this process and nothing leaves the "
            "host; pass --bus kafka://HOST:PORT to ship them"
        )
    functions = None if probes is None else [f.strip() for f in probes.split(",") if f.strip()]
    try:
        collectors = build_collectors(
            settings, nvml=not no_nvml, ebpf=not no_ebpf, pids=pids, functions=functions
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    daemon = Agent(settings, bus, collectors)
    if metrics_port is not None:
        from trainscope.producers.agent.metrics import serve_metrics

        try:
            serve_metrics(daemon, metrics_port, metrics_bind)
        except OSError as exc:
            bus.close()
            raise click.ClickException(
                f"--metrics-port {metrics_port}: cannot listen on {metrics_bind}: {exc}"
            ) from None

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("received %s: stopping", signal.Signals(signum).name)
        daemon.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    daemon.start()
    if duration_s is not None:
        signal.signal(signal.SIGALRM, on_signal)
        signal.setitimer(signal.ITIMER_REAL, duration_s)
    try:
        stats = daemon.run()
    finally:
        bus.close()
    log.info("stopped; stats: %s", json.dumps(stats.as_dict(), sort_keys=True))


if __name__ == "__main__":
    agent(prog_name="trainscope agent")
