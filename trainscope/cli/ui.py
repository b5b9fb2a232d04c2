"""``trainscope ui``: serve the dashboard."""

from __future__ import annotations

from pathlib import Path

import click

from trainscope.ui.queries import RUNNING_WITHIN_S  # plain constants: no web stack imported

# The detectors' alert threshold; the ui layer does not import the detectors for one number,
# so a test checks the two agree.
ALERT_THRESHOLD = 0.5


@click.command()
@click.option("--store", type=click.Path(path_type=Path),
              help="chDB store directory (default: the demo's store). It must exist.")
@click.option("--url", help="ClickHouse server URL instead of a store (credentials from "
              "TRAINSCOPE_CLICKHOUSE_USER / _PASSWORD).")
@click.option("--port", type=click.IntRange(1, 65535), default=8321, show_default=True)
@click.option("--bind", default="127.0.0.1", show_default=True,
              help="Address to listen on; anything but loopback exposes the store's data.")
@click.option("--threshold", type=click.FloatRange(0, 1), default=ALERT_THRESHOLD,
              show_default=True, help="Findings at or above this score are shown.")
@click.option("--refresh-s", type=click.FloatRange(min=1), default=10.0, show_default=True,
              help="How often the page of a running job reloads its data.")
@click.option("--running-s", type=click.FloatRange(min=1), default=RUNNING_WITHIN_S,
              show_default=True,
              help="A job whose last step record is younger than this is shown as running, "
                   "an older one as ended. Step records are written as windows close, so keep "
                   "it above the pipeline's window length plus its lateness and commit interval.")
def ui(store: Path | None, url: str | None, port: int, bind: str, threshold: float,
       refresh_s: float, running_s: float) -> None:
    """Serve a read-only web dashboard of the store: jobs, step time, rank × time heatmaps,
    function breakdowns, findings and what-if results.

    The store is opened with ClickHouse's readonly=1. An embedded store that a running pipeline
    owns is read through the pipeline's read-only endpoint, so a running job can be watched;
    when that pipeline stops or restarts, the dashboard follows the store to its next owner, or
    opens it itself. A store the dashboard opened is handed over to a pipeline (or any
    command that writes it) that starts on it meanwhile.
    """
    import uvicorn

    from trainscope.store.client import StoreError, connect, default_store_dir, store_path
    from trainscope.store.handover import FollowedStore
    from trainscope.ui.app import create_app
    from trainscope.ui.queries import DashboardQueries

    if store is not None and url is not None:
        raise click.UsageError("give either --store DIR or --url URL, not both")
    _check_free(bind, port)
    followed: FollowedStore | None = None
    try:
        if url:
            client: object = connect(None, url, readonly=True, create=False)
        else:
            client = followed = FollowedStore(store_path(store, create=False))
            followed.open()
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None
    if followed is not None:
        followed.yield_on_signal()
    source = url or str(Path(store or default_store_dir()).expanduser())
    queries = DashboardQueries(client, threshold=threshold, running_s=running_s)
    app = create_app(queries, source=source, refresh_s=refresh_s)
    click.echo(f"trainscope ui on http://{bind}:{port}/ ({source})", err=True)
    try:
        uvicorn.run(app, host=bind, port=port, log_level="warning")
    finally:
        if followed is not None:
            followed.close()


def _check_free(bind: str, port: int) -> None:
    """A one-line error now rather than the web server's log lines and exit later."""
    import socket

    try:
        infos = socket.getaddrinfo(bind, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(infos[0][4])
    except OSError as exc:
        raise click.ClickException(f"--bind {bind} --port {port}: cannot listen there: "
                                   f"{exc.strerror or exc}") from None
