"""Run the windowing tier's Flink SQL (:mod:`trainscope.engines.flink.sql`) on Flink.

Runs inside the Flink environment (``infra/setup-flink-env.sh``), never the main one:

    .venv-flink/bin/python -m trainscope.engines.flink.job --bootstrap-servers HOST:PORT …

which starts PyFlink's local mini-cluster, or unchanged on an existing cluster with
``flink run -py trainscope/engines/flink/job.py -pyexec .venv-flink/bin/python -- …``
(``trainscope stream flink --jobmanager HOST:PORT`` does that). No Python runs per record:
every operator is Flink SQL in the JVM, so the Python workers of PyFlink are never started.
Prints one JSON line when a bounded job finishes, ``Error: …`` (exit 1) when it cannot run.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `flink run -py job.py` runs it as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from trainscope.engines.flink.sql import JobConfig, statements
from trainscope.schemas.topics import DEAD_LETTER_TOPIC, EVENTS_TOPIC, SUMMARIES_TOPIC

JARS = ("flink-connector-kafka*.jar", "kafka-clients*.jar")
VIEW = "CREATE TEMPORARY VIEW "


def find_jars(folder: Path) -> list[Path]:
    """The two Kafka connector jars in ``folder``; raises FileNotFoundError naming the fix."""
    found = []
    for pattern in JARS:
        matches = sorted(glob.glob(str(folder / pattern)))
        if not matches:
            raise FileNotFoundError(
                f"no {pattern} in {folder} (run infra/setup-flink-env.sh, or pass --jars DIR)"
            )
        found.append(Path(matches[-1]))
    return found


def default_jars() -> Path:
    return Path(os.environ.get("TRAINSCOPE_FLINK_JARS") or Path(sys.prefix) / "jars")


def table_environment(parallelism: int, jars: list[Path], python: str):  # -> TableEnvironment
    from pyflink.table import EnvironmentSettings, TableEnvironment

    t_env = TableEnvironment.create(EnvironmentSettings.in_streaming_mode())
    conf = t_env.get_config()
    conf.set("pipeline.jars", ";".join(p.resolve().as_uri() for p in jars))
    conf.set("parallelism.default", str(parallelism))
    conf.set("python.executable", python)
    conf.set("pipeline.name", "trainscope windowing tier")
    # Without it every record is deep-copied between chained operators, arrays included: twice
    # the CPU per event (measured, benchmarks/README.md).
    conf.set("pipeline.object-reuse", "true")
    return t_env


def plan(t_env, statement_set, config: JobConfig) -> None:  # PyFlink objects: not imported here
    """Tables and views into ``t_env``, inserts into ``statement_set``.

    A view is registered as the Table its query makes, not as SQL text: every query that reads
    it then shares one plan of it (the span events are unnested once for the windows and the
    dead letters), where SQL views are expanded per query and planned twice."""
    for statement in statements(config):
        if statement.startswith("INSERT"):
            statement_set.add_insert_sql(statement)
        elif statement.startswith(VIEW):
            name, _, query = statement.removeprefix(VIEW).partition(" AS\n")
            t_env.create_temporary_view(name, t_env.sql_query(query))
        else:
            t_env.execute_sql(statement)


def latest_checkpoint(folder: Path) -> Path | None:
    """The newest complete checkpoint under ``folder`` (``<job id>/chk-<n>/_metadata``)."""
    done = sorted(folder.glob("*/chk-*/_metadata"), key=lambda p: p.stat().st_mtime)
    return done[-1].parent if done else None


def run(
    config: JobConfig, parallelism: int, jars: list[Path], wait: bool, checkpoint_s: float = 30.0,
    checkpoint_dir: Path | None = None,
) -> dict:
    t_env = table_environment(parallelism, jars, sys.executable)
    # A partition with nothing to read must not hold the watermark (and every window) back.
    # How long a batch's stamp is remembered to drop a re-sent copy (events_once).
    t_env.get_config().set("table.exec.state.ttl", "1 h")
    idle_ms = int(config.source_idle_s * 1000)
    t_env.get_config().set("table.exec.source.idle-timeout", f"{idle_ms} ms")
    if not config.bounded:
        # The Kafka source commits its offsets with checkpoints, and a job that fails is
        # restarted by Flink from the last one (windows and positions together).
        t_env.get_config().set("execution.checkpointing.interval",
                               f"{int(checkpoint_s * 1000)} ms")
    resumed = None
    if checkpoint_dir is not None and not config.bounded:
        # Checkpoints on disk, kept when the job stops; the next start resumes from the
        # newest: its open windows and its offsets together, so a restart loses nothing.
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        conf = t_env.get_config()
        conf.set("execution.checkpointing.storage", "filesystem")
        conf.set("execution.checkpointing.dir", checkpoint_dir.resolve().as_uri())
        conf.set("execution.checkpointing.externalized-checkpoint-retention",
                 "RETAIN_ON_CANCELLATION")
        resumed = latest_checkpoint(checkpoint_dir)
        if resumed is not None:
            conf.set("execution.state-recovery.path", resumed.as_uri())
    started = time.monotonic()
    statement_set = t_env.create_statement_set()
    plan(t_env, statement_set, config)
    result = statement_set.execute()
    client = result.get_job_client()
    job_id = str(client.get_job_id()) if client is not None else ""
    print(json.dumps({"flink_job_id": job_id, "state": "submitted",
                      "resumed_from": str(resumed) if resumed else None}),
          file=sys.stderr, flush=True)
    if wait:
        result.wait()
    return {"flink_job_id": job_id, "parallelism": parallelism, "bounded": config.bounded,
            "elapsed_s": round(time.monotonic() - started, 3)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap-servers", required=True, help="HOST:PORT[,HOST:PORT]")
    parser.add_argument("--window-s", type=float, default=15.0)
    parser.add_argument("--lateness-s", type=float, default=5.0)
    parser.add_argument("--source-idle-s", type=float, default=10.0)
    parser.add_argument("--events-topic", default=EVENTS_TOPIC)
    parser.add_argument("--summaries-topic", default=SUMMARIES_TOPIC)
    parser.add_argument("--dead-letter-topic", default=DEAD_LETTER_TOPIC)
    parser.add_argument("--group", default="trainscope-flink")
    parser.add_argument("--parallelism", type=int, default=1)
    parser.add_argument("--checkpoint-interval-s", type=float, default=30.0,
                        help="Unbounded jobs: how often Flink checkpoints (and commits offsets).")
    parser.add_argument("--checkpoint-dir", type=Path, default=None,
                        help="Unbounded jobs: keep checkpoints here and resume from the newest.")
    parser.add_argument("--bounded", action="store_true",
                        help="Read up to the latest offset at start, then finish.")
    parser.add_argument("--start-from", choices=("earliest-offset", "latest-offset"),
                        default="earliest-offset")
    parser.add_argument("--jars", type=Path, default=None)
    parser.add_argument("--kafka-property", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--print-sql", action="store_true")
    parser.add_argument("--detach", action="store_true",
                        help="Return once submitted (on a cluster) instead of waiting.")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    properties = []
    for item in args.kafka_property:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"Error: --kafka-property {item!r} is not KEY=VALUE", file=sys.stderr)
            return 2
        properties.append((f"properties.{key}", value))
    config = JobConfig(
        bootstrap_servers=args.bootstrap_servers, window_s=args.window_s,
        lateness_s=args.lateness_s, events_topic=args.events_topic,
        summaries_topic=args.summaries_topic, dead_letter_topic=args.dead_letter_topic,
        group=args.group, bounded=args.bounded, start_from=args.start_from,
        source_idle_s=args.source_idle_s, kafka_properties=tuple(properties),
    )
    try:
        text = statements(config)
    except ValueError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 2
    if args.print_sql:
        print(";\n\n".join(text) + ";")
        return 0
    try:
        jars = find_jars(args.jars or default_jars())
    except FileNotFoundError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    try:
        summary = run(config, args.parallelism, jars, wait=not args.detach,
                      checkpoint_s=args.checkpoint_interval_s,
                      checkpoint_dir=args.checkpoint_dir)
    except Exception as exc:  # Py4J wraps the JVM's exception; its first line says what failed
        print(f"Error: the Flink job failed: {_first_cause(exc)}", file=sys.stderr)
        return 1
    print(json.dumps(summary), flush=True)
    return 0


def _first_cause(exc: BaseException) -> str:
    """The innermost 'Caused by:' of a Java stack trace, else the exception's first line."""
    text = str(exc)
    causes = [line.strip() for line in text.splitlines() if line.strip().startswith("Caused by:")]
    line = causes[-1].removeprefix("Caused by:").strip() if causes else text.strip().split("\n")[0]
    return line[:500]


if __name__ == "__main__":
    sys.exit(main())
