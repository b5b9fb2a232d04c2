"""The settings every part of a trainscope command shares, resolved once.

``trainscope`` resolves :class:`Settings` when it starts (``Settings.from_environ()``) and hands
the same frozen object to each subcommand, so the store location, the ClickHouse server and
credentials and the window length are decided in one place, in one order: an explicit option,
then the environment variable (:mod:`trainscope.config.env`), then the default. Before, the store
directory was resolved in three places that disagreed (``trainscope sql`` ignored
``TRAINSCOPE_CLICKHOUSE_URL``, ``trainscope whatif --job`` ignored the default directory), and the
stream job windowed at 15 s whatever ``TRAINSCOPE_WINDOW_S`` told the producers.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from trainscope.config import env
from trainscope.schemas.errors import TrainscopeError

# The XDG base-directory variable for user data (not trainscope's own: see env.py).
XDG_DATA_HOME = "XDG_DATA_HOME"
# The shortest window any part accepts (the producers' and the stream job's lower bound).
MIN_WINDOW_S = 0.1


class SettingsError(ValueError, TrainscopeError):
    """An environment variable holds a value trainscope cannot use; the text names it."""


@dataclass(frozen=True)
class Settings:
    """``store_dir``: the embedded chDB store (``store_dir_configured``: named by
    ``TRAINSCOPE_STORE_DIR`` rather than the default under the user's data directory);
    ``clickhouse_url``: a server to use instead (None: the embedded store); ``window_s``: the
    summary window length that producers, the agent and the stream job must share. The
    password is never part of ``repr``."""

    store_dir: Path
    store_dir_configured: bool = False
    clickhouse_url: str | None = None
    clickhouse_user: str = "default"
    clickhouse_password: str = field(default="", repr=False)
    window_s: float = env.DEFAULT_WINDOW_S

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Settings:
        e = os.environ if environ is None else environ
        return cls(
            store_dir=store_dir_from(e),
            store_dir_configured=bool(e.get(env.TRAINSCOPE_STORE_DIR)),
            clickhouse_url=e.get(env.TRAINSCOPE_CLICKHOUSE_URL) or None,
            clickhouse_user=e.get(env.TRAINSCOPE_CLICKHOUSE_USER) or "default",
            clickhouse_password=e.get(env.TRAINSCOPE_CLICKHOUSE_PASSWORD, ""),
            window_s=_window_s(e),
        )

    def store(
        self, store_dir: Path | str | None, url: str | None, *, default_dir: bool = True
    ) -> tuple[Path | None, str | None]:
        """(store directory, server URL) for a command's ``--store`` / ``--url`` options.

        What was given wins. With neither: the server of ``TRAINSCOPE_CLICKHOUSE_URL`` (a
        deployment's deliberate choice), else the store directory — the default one only with
        ``default_dir``, else (None, None) when ``TRAINSCOPE_STORE_DIR`` is unset.
        """
        if store_dir is not None or url is not None:
            return (Path(store_dir) if store_dir is not None else None), url
        if self.clickhouse_url:
            return None, self.clickhouse_url
        if default_dir or self.store_dir_configured:
            return self.store_dir, None
        return None, None


def from_context() -> Settings:
    """The settings the running ``trainscope`` command resolved when it started; resolved now
    when a subcommand runs on its own (``python -m trainscope.cli.whatif``)."""
    import click

    ctx = click.get_current_context(silent=True)
    found = ctx.find_object(Settings) if ctx is not None else None
    return found if found is not None else Settings.from_environ()


def store_dir_from(e: Mapping[str, str]) -> Path:
    """The embedded store directory: ``TRAINSCOPE_STORE_DIR``, else
    ``$XDG_DATA_HOME/trainscope/store`` (``~/.local/share/trainscope/store``)."""
    configured = e.get(env.TRAINSCOPE_STORE_DIR)
    if configured:
        return Path(configured).expanduser()
    base = e.get(XDG_DATA_HOME) or str(Path.home() / ".local" / "share")
    return Path(base) / "trainscope" / "store"


def _window_s(e: Mapping[str, str]) -> float:
    raw = e.get(env.TRAINSCOPE_WINDOW_S)
    if raw is None or raw.strip() == "":
        return env.DEFAULT_WINDOW_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < MIN_WINDOW_S:
        raise SettingsError(f"{env.TRAINSCOPE_WINDOW_S} must be a number of seconds >= "
                            f"{MIN_WINDOW_S}, got {raw!r}")
    return value
