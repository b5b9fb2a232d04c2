"""``trainscope stream flink``: start the PyFlink windowing tier (:mod:`trainscope.engines.flink`).

This command runs in the main environment; the job runs in the Flink environment made by
``infra/setup-flink-env.sh`` (apache-flink pins numpy<2.2, which the main environment's river
cannot use), started with that environment's interpreter. ``flink_command`` is the command
itself; :func:`register` attaches it to the ``trainscope stream`` group
(:mod:`trainscope.cli.stream`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import click

from trainscope.schemas.topics import DEAD_LETTER_TOPIC, EVENTS_TOPIC, SUMMARIES_TOPIC

PACKAGE_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = PACKAGE_DIR.parent
JOB_FILE = PACKAGE_DIR / "engines" / "flink" / "job.py"
# Where infra/setup-flink-env.sh puts the environment unless TRAINSCOPE_FLINK_VENV says otherwise.
FLINK_VENV_VARIABLE = "TRAINSCOPE_FLINK_VENV"


def default_flink_python() -> Path:
    venv = os.environ.get(FLINK_VENV_VARIABLE) or str(REPO_ROOT / ".venv-flink")
    return Path(venv) / "bin" / "python"


def bootstrap_servers(bus_url: str) -> str:
    """HOST:PORT[,HOST:PORT] of a ``kafka://`` URL; raises click.UsageError otherwise."""
    if not bus_url.startswith("kafka://"):
        raise click.UsageError(f"--bus {bus_url!r}: the Flink job reads Kafka (kafka://HOST:PORT)")
    servers, _, query = bus_url.removeprefix("kafka://").partition("?")
    if query:
        raise click.UsageError(
            "--bus: TLS/SASL settings in the URL are not passed to the Flink job; give them as "
            "--kafka-property KEY=VALUE (Kafka client properties)"
        )
    if not servers:
        raise click.UsageError(f"--bus {bus_url!r}: no HOST:PORT")
    return servers


def check_reachable(servers: str, timeout_s: float = 3.0) -> None:
    """Fail fast with one line when no bootstrap server accepts a connection: the Kafka source
    would otherwise retry for a minute before the job fails."""
    errors = []
    for server in servers.split(","):
        host, _, port = server.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=timeout_s):
                return
        except (OSError, ValueError) as exc:
            errors.append(f"{server}: {exc}")
    raise click.ClickException(f"cannot reach Kafka at {servers} ({'; '.join(errors)})")


@click.command("flink")
@click.option("--bus", "bus_url", required=True, help="kafka://HOST:PORT of the broker.")
@click.option("--window-s", type=click.FloatRange(min=0.001), default=None,
              help="Window length; must be the detection tier's. Default: $TRAINSCOPE_WINDOW_S, "
                   "else 15.")
@click.option("--lateness-s", type=click.FloatRange(min=0), default=5.0, show_default=True,
              help="How far behind the newest event time the watermark runs.")
@click.option("--source-idle-s", type=click.FloatRange(min=0.1), default=10.0,
              show_default=True,
              help="A partition that delivered nothing for this long stops holding the "
                   "watermark (table.exec.source.idle-timeout).")
@click.option("--parallelism", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--bounded", is_flag=True,
              help="Read the events topic up to its latest offsets at start, emit every window, "
                   "and exit (tests, benchmarks, backfills). Default: run until stopped.")
@click.option("--checkpoint-interval-s", type=click.FloatRange(min=1), default=30.0,
              show_default=True,
              help="Unbounded jobs: how often Flink checkpoints its windows and commits the "
                   "offsets they cover; a failed job restarts from the last checkpoint.")
@click.option("--checkpoint-dir", type=click.Path(path_type=Path), default=None,
              help="Unbounded jobs: keep checkpoints in this folder (a path every TaskManager "
                   "can read, on a cluster) and resume from the newest at start, so stopping "
                   "and starting the job loses no open window. Default: in memory.")
@click.option("--group", default="trainscope-flink", show_default=True,
              help="Consumer group whose committed offsets the job starts from.")
@click.option("--events-topic", default=EVENTS_TOPIC, show_default=True)
@click.option("--summaries-topic", default=SUMMARIES_TOPIC, show_default=True)
@click.option("--dead-letter-topic", default=DEAD_LETTER_TOPIC, show_default=True)
@click.option("--kafka-property", "kafka_properties", multiple=True, metavar="KEY=VALUE",
              help="A Kafka client property for the job's sources and sinks "
                   "(e.g. security.protocol=SSL); repeatable.")
@click.option("--flink-python", type=click.Path(path_type=Path), default=None,
              help="Interpreter of the Flink environment. Default: "
                   "$TRAINSCOPE_FLINK_VENV/bin/python, else .venv-flink/bin/python in the "
                   "repository (made by infra/setup-flink-env.sh).")
@click.option("--jars", type=click.Path(path_type=Path), default=None,
              help="Folder with the Kafka connector jars. Default: the Flink environment's jars/.")
@click.option("--jobmanager", metavar="HOST:PORT", default=None,
              help="Submit to this running Flink cluster (`flink run -m`) instead of starting a "
                   "local mini-cluster; returns once submitted.")
@click.option("--print-sql", is_flag=True, help="Print the job's SQL statements and exit.")
def flink_command(bus_url: str, window_s: float | None, lateness_s: float, source_idle_s: float,
                  parallelism: int, bounded: bool, checkpoint_interval_s: float,
                  checkpoint_dir: Path | None, group: str,
                  events_topic: str,
                  summaries_topic: str, dead_letter_topic: str, kafka_properties: tuple[str, ...],
                  flink_python: Path | None, jars: Path | None, jobmanager: str | None,
                  print_sql: bool) -> None:
    """Window the events topic on Flink into the summaries topic (the windowing tier).

    Producers must send the JSON wire format (TRAINSCOPE_WIRE=json); the detection tier is
    `trainscope pipeline --input summaries` with the same --window-s. Messages Flink cannot read
    go to the dead-letter topic with the reason as their key.
    """
    from trainscope.config.settings import from_context

    servers = bootstrap_servers(bus_url)
    window_s = window_s if window_s is not None else from_context().window_s
    python = flink_python or default_flink_python()
    if not python.exists():
        raise click.ClickException(
            f"no Flink environment at {python}: run infra/setup-flink-env.sh "
            "(or pass --flink-python PATH)"
        )
    job_args = [
        "--bootstrap-servers", servers, "--window-s", repr(window_s),
        "--lateness-s", repr(lateness_s), "--source-idle-s", repr(source_idle_s),
        "--parallelism", str(parallelism), "--group", group,
        "--checkpoint-interval-s", repr(checkpoint_interval_s),
        "--events-topic", events_topic, "--summaries-topic", summaries_topic,
        "--dead-letter-topic", dead_letter_topic,
        *(["--bounded"] if bounded else []),
        *(["--jars", str(jars)] if jars is not None else []),
        *(["--checkpoint-dir", str(checkpoint_dir)] if checkpoint_dir is not None else []),
        *[arg for prop in kafka_properties for arg in ("--kafka-property", prop)],
    ]
    if print_sql:
        job_args.append("--print-sql")
    else:
        check_reachable(servers)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    if jobmanager is not None and not print_sql:
        flink = _flink_cli(python)
        # The job only plans in Python, on this machine (-pyclientexec); -pyexec would run
        # Python functions on the TaskManagers, and the job has none.
        command = [str(flink), "run", "-m", jobmanager, "-d", "-py", str(JOB_FILE),
                   "-pyclientexec", str(python), "-pyexec", str(python), *job_args, "--detach"]
    else:
        command = [str(python), "-m", "trainscope.engines.flink.job", *job_args]
    if not print_sql:
        click.echo(f"starting the Flink job ({'cluster ' + jobmanager if jobmanager else 'local'}"
                   f", parallelism {parallelism}): {events_topic} -> {summaries_topic}", err=True)
    job = subprocess.Popen(command, env=env)
    stopped: list[int] = []

    def stop(received: int, _frame: object) -> None:
        # Stopping this command stops the job (a service manager signals only its main process).
        stopped.append(received)
        job.send_signal(received)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop)
    returncode = job.wait()
    if stopped:
        click.echo("Flink job stopped", err=True)
    elif returncode != 0:
        sys.exit(returncode)  # the job printed its own `Error: …` line


def _flink_cli(python: Path) -> Path:
    done = subprocess.run(
        [str(python), "-c", "import pyflink, pathlib; "
                            "print(pathlib.Path(pyflink.__file__).parent / 'bin' / 'flink')"],
        capture_output=True, text=True, check=False,
    )
    if done.returncode != 0:
        raise click.ClickException(f"{python} cannot import pyflink: run infra/setup-flink-env.sh")
    return Path(done.stdout.strip())


def register(group: click.Group) -> None:
    """Attach ``trainscope stream flink`` to another ``stream`` group."""
    group.add_command(flink_command)
