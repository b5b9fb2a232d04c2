"""The ``trainscope`` command.

Subcommands live with the code they drive and are imported only when invoked, so
``trainscope --help`` stays fast and a machine without the stream stack can still run the agent.
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
from pathlib import Path
from typing import Any

import click

from trainscope import __version__
from trainscope.cli.extras import MissingExtra, missing_extra, missing_store_backend
from trainscope.schemas.untrusted import terminal_safe

# name → "module:attribute" of a click command
_LAZY = {
    "demo": "trainscope.cli.demo:demo",
    "pipeline": "trainscope.cli.pipeline:pipeline",
    "stream": "trainscope.cli.stream:stream",
    "whatif": "trainscope.cli.whatif:whatif",
    "plan": "trainscope.cli.plan:plan",
    "agent": "trainscope.cli.agent:agent",
    "profile": "trainscope.cli.profile:profile",
    "replay": "trainscope.cli.traces:replay",
    "analyze": "trainscope.cli.traces:analyze",
    "ui": "trainscope.cli.ui:ui",
}


# The lazy commands that are groups of subcommands: their messages name the subcommand too.
_GROUPS = frozenset({"stream", "replay"})
_COMMAND_KEY = "trainscope.command"

_CHATTY_LIBRARIES = frozenset({"aiokafka", "kafka", "urllib3", "clickhouse_connect"})


def _not_from_client_libraries(record: logging.LogRecord) -> bool:
    return record.name.partition(".")[0] not in _CHATTY_LIBRARIES


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        names = set(super().list_commands(ctx))
        names |= {name for name in _LAZY if self._available(name)}
        return sorted(names)

    @staticmethod
    def _available(name: str) -> bool:
        module = _LAZY[name].split(":")[0]
        try:
            return importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            return False

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        command = super().get_command(ctx, name)
        if command is not None or name not in _LAZY or not self._available(name):
            return command
        module, attr = _LAZY[name].split(":")
        return getattr(importlib.import_module(module), attr)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        # Remembered for invoke(): the words that name the command in a missing-extra line.
        ctx.meta[_COMMAND_KEY] = _command_path(self, ctx, args)
        return super().resolve_command(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        # Every command, its module's imports and the ones it makes lazily while it runs: a
        # missing optional package is one line naming what to install, never a traceback.
        try:
            return super().invoke(ctx)
        except ImportError as exc:
            missing = missing_extra(ctx.meta.get(_COMMAND_KEY, ""), exc)
            if missing is None:
                raise
            raise missing from None
        except click.ClickException as exc:
            missing = (None if isinstance(exc, MissingExtra)
                       else missing_store_backend(ctx.meta.get(_COMMAND_KEY, ""), exc))
            if missing is None:
                raise
            raise missing from None


def _command_path(group: click.Group, ctx: click.Context, args: list[str]) -> str:
    """``replay kineto`` from the arguments: the command, and its subcommand if it has some."""
    words = [a for a in args if not a.startswith("-")][:2]
    if not words or words[0] not in group.list_commands(ctx):
        return words[0] if words else ""
    if words[0] in _GROUPS and len(words) > 1:
        return " ".join(words)
    return words[0]


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="trainscope")
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
@click.pass_context
def cli(ctx: click.Context, verbose: int) -> None:
    """Online performance troubleshooting for large-model training.

    Finds the slow rank, the slow function and the cause; keeps the history in ClickHouse.
    """
    from trainscope.config.settings import Settings, SettingsError

    # Resolved once, here; every subcommand reads this object (trainscope.config.settings).
    try:
        ctx.obj = Settings.from_environ()
    except SettingsError as exc:
        raise click.ClickException(str(exc)) from None
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    for handler in logging.getLogger().handlers:
        # Log lines quote producers' job ids and names: no escape sequence reaches the terminal.
        handler.setFormatter(_TerminalSafeFormatter(handler.formatter))
    if verbose:
        # Asked for: the Kafka client's own lines too (the bus quiets them only when nobody
        # chose a level for them).
        logging.getLogger("aiokafka").setLevel(level)
    else:
        # Client libraries log every retry and reconnect (and reset their loggers' levels on
        # import); our own errors say what failed, once.
        for handler in logging.getLogger().handlers:
            handler.addFilter(_not_from_client_libraries)


class _TerminalSafeFormatter(logging.Formatter):
    """A handler's format with each message's control characters escaped (a traceback after
    it keeps its lines)."""

    def __init__(self, base: logging.Formatter | None) -> None:
        super().__init__(base._fmt if base is not None else None)

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = terminal_safe(record.message)
        return super().formatMessage(record)


@cli.command()
@click.argument("query")
@click.option("--store", type=click.Path(path_type=Path), help="chDB store directory "
              "(default: $TRAINSCOPE_STORE_DIR, else the demo's store under the user's data "
              "directory). It must exist.")
@click.option("--create", is_flag=True, help="Start an empty store if --store does not exist.")
@click.option("--url", help="ClickHouse server URL instead of a store, e.g. http://host:8123 "
              "(default: $TRAINSCOPE_CLICKHOUSE_URL; credentials from "
              "TRAINSCOPE_CLICKHOUSE_USER / _PASSWORD, never in the URL).")
@click.option("--format", "fmt", type=click.Choice(["table", "json", "csv"]), default="table",
              show_default=True)
def sql(query: str, store: Path | None, create: bool, url: str | None, fmt: str) -> None:
    """Run a read-only SQL QUERY on the store.

    Tables: function_summaries, step_records, metric_samples, findings, topologies,
    dead_letters, call_paths (after replay kineto --store), and op_traces, whatif_results
    after a what-if run. Each time is an Int64 of nanoseconds (start_ns, window_start_ns,
    ts_ns) and a DateTime64 of the same name without _ns (start, window_start, ts), e.g.
    toStartOfMinute(start). Queries run with
    ClickHouse's readonly=1: no writes, no DDL, no setting changes, no table functions that
    read files, URLs or other servers. A store that a running pipeline (or demo, or ui) owns
    is read through the owner's read-only endpoint, found in the store directory.
    """
    from trainscope.config.settings import from_context
    from trainscope.sinks.clickhouse import ClickHouseSink, run_query
    from trainscope.store.client import StoreError, check_read_only_sql, connect

    if store is not None and url is not None:
        raise click.UsageError("give either --store DIR or --url URL, not both")
    settings = from_context()
    store, url = settings.store(store, url)
    try:
        check_read_only_sql(query)
        if create and store is not None and not store.expanduser().exists():
            ClickHouseSink.open(store).close()  # an empty store with trainscope's tables
        client = connect(store, url, readonly=True, create=create, settings=settings)
        columns, rows = run_query(client, query)
    except StoreError as exc:
        text = str(exc)
        if text.startswith("no store at "):
            text += " (--create starts an empty one)"
        if "(READONLY)" in text:
            text += (
                "; trainscope sql only reads: no writes, DDL or setting changes, and no table "
                "functions that reach files, URLs or other servers"
            )
        raise click.ClickException(text) from None
    _print_rows(columns, rows, fmt)


def _print_rows(columns: list[str], rows: list[Any], fmt: str) -> None:
    if fmt == "json":
        for row in rows:
            click.echo(json.dumps(dict(zip(columns, row, strict=True)), default=str))
    elif fmt == "csv":
        import csv

        writer = csv.writer(sys.stdout)
        writer.writerow(columns)
        writer.writerows(rows)
    else:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        # Values are the producers' text (job ids, function names): Text objects are never
        # read as Rich markup, and terminal_safe escapes what a terminal would act on.
        table = Table()
        for column in columns:
            table.add_column(Text(terminal_safe(column)))
        for row in rows:
            table.add_row(*(Text(terminal_safe(v)) for v in row))
        Console(soft_wrap=True).print(table)
        click.echo(f"{len(rows)} row(s)", err=True)


@cli.group()
def schemas() -> None:
    """The record schemas."""


@schemas.command("export")
@click.argument("directory", type=click.Path(path_type=Path))
def schemas_export(directory: Path) -> None:
    """Write JSON Schema files for every record kind into DIRECTORY."""
    from trainscope.schemas.jsonschema import export

    try:
        written = export(directory)
    except OSError as exc:
        raise click.ClickException(f"cannot write schemas to {directory}: {exc}") from None
    for path in written:
        click.echo(str(path))


@cli.group()
def store() -> None:
    """The store's tables."""


@store.command("migrate")
@click.argument("directory", required=False, type=click.Path(path_type=Path))
@click.option("--url", help="ClickHouse server URL instead of a store directory.")
def store_migrate(directory: Path | None, url: str | None) -> None:
    """Rewrite a store's pipeline tables in this trainscope's table layout.

    A store written by an older trainscope (times only as Int64 nanoseconds) is refused by
    the pipeline and the demo until it is migrated. Each table is copied into the new layout
    and swapped in; stop writers to the store first. A store already in this layout is left
    as it is.
    """
    from trainscope.schemas.ddl import LAYOUT_VERSION
    from trainscope.sinks.store_layout import migrate
    from trainscope.store.client import StoreError, connect

    if (directory is None) == (url is None):
        raise click.UsageError("give either a store DIRECTORY or --url URL")
    if directory is not None and not directory.exists():
        raise click.ClickException(f"no store at {directory}: check the path")
    try:
        moved = migrate(connect(directory, url, create=False))
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None
    for table, rows in moved.items():
        click.echo(f"{table}: {rows} row(s) rewritten")
    click.echo(f"store is in table layout {LAYOUT_VERSION}")


# The command's own -h/--help adds what the detectors' docstrings say about their parameters,
# which needs the entry points loaded: too slow for a help text built when the CLI starts.
@cli.command("detectors", context_settings={"help_option_names": []})
@click.option("--describe", metavar="NAME",
              help="Print what detector NAME does and each of its parameters: type, default, "
                   "unit and meaning, from its docstring.")
@click.option("-h", "--help", "show_help", is_flag=True,
              help="Show this message and the parameters of every registered detector, and exit.")
@click.pass_context
def detectors_list(ctx: click.Context, describe: str | None, show_help: bool) -> None:
    """List the detectors registered under the trainscope.detectors entry points.

    Each detector's parameters are documented in its class docstring (unit, default, what it
    does); --help lists them all and --describe NAME prints them in full.
    """
    from trainscope.detectors.docs import DetectorDoc
    from trainscope.detectors.registry import available, load

    registered = dict(sorted(available().items()))
    if show_help:
        click.echo(ctx.get_help())
        click.echo("\nParameters (name, default, unit; --describe NAME says what each does):")
        for name, ep in registered.items():
            click.echo("\n" + "\n".join(DetectorDoc.load(name, ep).overview()))
        return
    if describe is not None:
        if describe not in registered:
            raise click.ClickException(
                f"--describe: unknown detector {describe}; registered: {', '.join(registered)}")
        click.echo(DetectorDoc.load(describe, registered[describe]).describe())
        return
    result = load()
    loaded = {d.name for d in result.detectors}
    for name, ep in registered.items():
        state = "ok" if name not in result.errors else f"BROKEN: {result.errors[name]}"
        click.echo(f"{name:16} {ep.value:55} {state}")
    if not loaded and not result.errors:
        click.echo("no detectors registered", err=True)


def main() -> None:
    cli(prog_name="trainscope")


if __name__ == "__main__":
    main()
