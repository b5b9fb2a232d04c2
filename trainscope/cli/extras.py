"""What to install when an optional part of trainscope is missing.

The core installs light (see pyproject.toml); each command's heavier needs come from an extra.
A command that meets a missing module must say in one line what to install, never show a
traceback: :func:`missing_extra` turns the import error into that line, and the lazy command
group in :mod:`trainscope.cli.main` applies it to every command, so no command repeats it.
"""

from __future__ import annotations

import importlib.util

import click

from trainscope.config.extras import MODULE_EXTRAS, OTHER_PACKAGES

# The extra a command is documented with; it wins when several extras provide the module, so
# `trainscope ui` names 'ui' and `trainscope whatif` names 'whatif' for the same pandas.
COMMAND_EXTRA: dict[str, str] = {
    "ui": "ui",
    "whatif": "whatif",
    "agent": "host",
    "stream": "stream",
}
DEFAULT_EXTRA = "embedded"


class MissingExtra(click.ClickException):
    """A command cannot run without an optional package: one line, exit code 1."""

    def show(self, file: object = None) -> None:
        # Without click's "Error: " prefix: the line is the whole message.
        click.echo(self.format_message(), err=True)


def missing_module(exc: BaseException) -> str | None:
    """The top-level name of the module whose absence caused ``exc``, if we know what installs it.

    Follows ``__cause__``/``__context__``, since our modules re-raise an import error with a
    message of their own (``raise ImportError(...) from exc``).
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ImportError) and current.name:
            top = current.name.partition(".")[0]
            if top in MODULE_EXTRAS or top in OTHER_PACKAGES:
                return top
        current = current.__cause__ or current.__context__
    return None


def install_line(command: str, module: str) -> str:
    """``trainscope ui needs the 'ui' extra: pip install 'trainscope[ui]'``."""
    prefix = f"trainscope {command}" if command else "trainscope"
    if module in OTHER_PACKAGES:
        what, how = OTHER_PACKAGES[module]
        return f"{prefix} needs {what}: {how}"
    extras = MODULE_EXTRAS[module]
    preferred = COMMAND_EXTRA.get(command.partition(" ")[0], DEFAULT_EXTRA)
    extra = preferred if preferred in extras else extras[0]
    return (f"{prefix} needs the '{extra}' extra ({module} is missing): "
            f"pip install 'trainscope[{extra}]'")


def missing_extra(command: str, exc: BaseException) -> MissingExtra | None:
    """The one-line error for ``exc`` if a known optional module is missing, else None."""
    module = missing_module(exc)
    return None if module is None else MissingExtra(install_line(command, module))


def missing_store_backend(command: str, exc: click.ClickException) -> MissingExtra | None:
    """An embedded store that could not be opened because chDB is not installed.

    The store layer reports clickhouse-connect's own advice (``pip install
    clickhouse-connect[chdb]``), which would install chDB without the rest of the pipeline.
    """
    if "chdb" not in exc.format_message().lower():
        return None
    try:
        require(command, "chdb")
    except MissingExtra as missing:
        return missing
    return None


def require(command: str, *modules: str) -> None:
    """Stop ``command`` with the one line if any of ``modules`` is not installed.

    For what is imported deep inside a run (a thread, a plotting step at the end), where the
    import error would otherwise come after work was done, or from inside a library.
    """
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # a finder that refuses the name outright
            found = False
        if not found:
            raise MissingExtra(install_line(command, module))
