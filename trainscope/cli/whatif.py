"""``trainscope whatif``: straggler what-if analysis of one job's op trace."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from trainscope.config.settings import Settings, from_context


@click.command("whatif")
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Op trace, .parquet or .csv (one row per op).",
)
@click.option(
    "--meta",
    "meta_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Job metadata YAML: dp_size, pp_size, tp_size, dsp_size, vpp_size, world_size.",
)
@click.option(
    "--job",
    "job_id",
    help="Analyse this job's trace from the store "
    "(with --trace: first import the trace into the store under this id).",
)
@click.option(
    "--store",
    "store_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Embedded ClickHouse (chDB) directory [env TRAINSCOPE_STORE_DIR].",
)
@click.option("--url", help="ClickHouse server URL [env TRAINSCOPE_CLICKHOUSE_URL].")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a report.")
@click.option(
    "--heatmap",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the stage × DP-rank heatmap of worker scores to this PNG "
    "(fixed colour scale 1.0-1.5, score printed in each cell).",
)
@click.option(
    "--timeline",
    type=click.Path(file_okay=False, path_type=Path),
    help="Write whatif_timeline.json into this directory: the real and the ideal run of "
    "every analysed step, one process per worker and run, one thread per stream (Chrome "
    "Trace Event Format: open in ui.perfetto.dev or chrome://tracing).",
)
def whatif(
    trace_path: Path | None,
    meta_path: Path | None,
    job_id: str | None,
    store_dir: Path | None,
    url: str | None,
    as_json: bool,
    heatmap: Path | None,
    timeline: Path | None,
) -> None:
    """How much slower is this job because of stragglers, and who is to blame.

    Replays the job's dependency graph with every op at its typical duration and compares:
    S = real / ideal step time, attributed to op types, DP ranks, stages and workers; M_W and
    M_S say whether a few slow workers or the last pipeline stage explain it. The replay with
    launch delays kept must reproduce the observed step times: when its median error is above
    5% the result carries a warning and a non-zero "fit" flag.
    """
    from rich.console import Console

    from trainscope.cli.extras import require
    from trainscope.schemas.optrace import TraceError

    if heatmap is not None:
        # The heatmap is drawn after the whole analysis: say it cannot be before doing the work.
        require("whatif", "matplotlib")
    err = Console(stderr=True)
    try:
        _run(err, trace_path, meta_path, job_id, store_dir, url, as_json, heatmap, timeline)
    except TraceError as exc:
        raise click.ClickException(str(exc)) from None


def _run(
    err: Any, trace_path, meta_path, job_id, store_dir, url, as_json, heatmap, timeline
) -> None:
    from trainscope.schemas.optrace import load_trace, read_meta, validate
    from trainscope.whatif import store as st
    from trainscope.whatif.analysis import analyse
    from trainscope.whatif.layout import build_layout

    if trace_path is None and job_id is None:
        raise click.UsageError("give --trace FILE --meta FILE, or --job JOB_ID")
    if trace_path is not None and meta_path is None:
        raise click.UsageError("--trace needs --meta FILE.yaml (the job's parallel sizes)")
    if store_dir is not None and url is not None:
        raise click.UsageError("give either --store DIR or --url URL, not both")

    client = None
    owner: int | None = None  # of the store, when another process owns it
    if job_id is not None:
        settings = from_context()
        # Only a store someone named: the what-if tables do not go into the demo's default one.
        store_dir, url = settings.store(store_dir, url, default_dir=False)
        if store_dir is None and url is None:
            raise click.UsageError("--job needs a store: --store DIR or --url URL")
        # Importing a trace may start a store; reading a job needs an existing one. A store a
        # running pipeline owns is read through its read endpoint, and the result not stored.
        owner = _owner(store_dir) if trace_path is None else None
        client = _connect(st, store_dir, url, create=trace_path is not None, settings=settings,
                          read_only=owner is not None)

    with err.status("loading the trace", spinner="dots") as status:
        if trace_path is not None:
            meta = read_meta(meta_path)
            frame = load_trace(trace_path, meta)
            source = str(trace_path)
            if client is not None:
                status.update("importing the trace into the store")
                st.write_trace(client, job_id, frame, meta)
        else:
            raw, meta = st.read_trace(client, job_id)
            source = f"job {job_id!r}"
            frame = validate(raw, meta, source)
        status.update("building the schedule")
        layout = build_layout(frame, meta, source)
        del frame
        result = analyse(layout, progress=status.update)
    if as_json:  # the readable report carries its warnings itself; printed twice on a terminal
        for warning in result.warnings:
            err.print(f"[yellow]warning:[/yellow] {warning}", highlight=False)
    if client is not None and owner is not None:
        err.print(f"result not stored: process {owner} owns store {store_dir} (a running "
                  "`trainscope pipeline`), which other processes can only read; run again "
                  "once it has stopped to keep the result in whatif_results", highlight=False)
    elif client is not None:
        st.write_result(client, job_id, result)
        err.print(f"result stored in whatif_results for job {job_id!r}", highlight=False)
    if heatmap is not None:
        from trainscope.whatif.plots import heatmap as draw

        err.print(f"heatmap written to {draw(result, heatmap)}", highlight=False)
    if timeline is not None:
        from trainscope.whatif.timeline import write_timeline

        err.print(
            f"timeline written to {write_timeline(layout, result, timeline)}", highlight=False
        )
    if as_json:
        sys.stdout.write(json.dumps(result.to_dict()) + "\n")
    else:
        from trainscope.whatif.report import render

        click.echo(render(result))


def _owner(store_dir: Path | None) -> int | None:
    """The pid of another process that owns the embedded store ``store_dir``, else None."""
    from trainscope.store.access import other_owner
    from trainscope.store.client import StoreError, store_path

    if store_dir is None:
        return None
    try:
        return other_owner(store_path(store_dir, create=False))
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None


def _connect(
    st: Any, store_dir: Path | None, url: str | None, create: bool, settings: Settings, *,
    read_only: bool = False,
) -> Any:
    from trainscope.store.client import StoreError

    try:
        return st.connect(store_dir=store_dir, url=url, create=create, settings=settings,
                          read_only=read_only)
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None
    except Exception as exc:  # the client raises many types; the user needs one line
        where = f"store {store_dir}" if store_dir is not None else "the ClickHouse URL"
        raise click.ClickException(f"cannot open {where}: {exc}") from None


if __name__ == "__main__":
    whatif()
