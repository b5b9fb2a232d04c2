"""What a detector's docstring says about its parameters, read back for ``trainscope detectors``.

Every built-in detector documents its constructor the way river documents its estimators: a
numpydoc ``Parameters`` section in the class docstring, one entry per argument, a header line
with its type, default and unit, then what it does, indented::

    z_min : float, default 6.0 (robust z)
        Robust z at which a rank becomes a suspect ...

and an ``Examples`` section that runs as a doctest. The docstring is the one place a setting
is explained; this module parses it so that ``trainscope detectors --help`` and
``--describe NAME`` print it, and ``tests/detectors/test_docs.py`` holds every built-in to it
(each argument documented, with the default the constructor really has). A plugin's docstring
is read the same way; one without the section is described as such, never an error.
"""

from __future__ import annotations

import inspect
import re
import textwrap
from dataclasses import dataclass
from importlib.metadata import EntryPoint

PARAMETERS = "Parameters"
EXAMPLES = "Examples"
# "name : type, default VALUE (unit)"; the default and the unit are optional for plugins.
_HEADER = re.compile(
    r"^(?P<name>\w+)(?:\s*:\s*(?P<type>[^,(]+?)?(?:,\s*default\s+(?P<default>\S+))?"
    r"(?:\s*\((?P<unit>.+)\))?)?\s*$"
)
_WIDTH = 100


@dataclass(frozen=True)
class ParameterDoc:
    """One entry of a Parameters section. ``default`` is the text the docstring gives."""

    name: str
    type: str | None
    default: str | None
    unit: str | None
    description: str


def sections(doc: str | None) -> dict[str, str]:
    """The numpydoc sections of a docstring (title → body), the summary under ``""``."""
    lines = inspect.cleandoc(doc or "").splitlines()
    out: dict[str, list[str]] = {"": []}
    title = ""
    i = 0
    while i < len(lines):
        underlined = (i + 1 < len(lines) and lines[i].strip()
                      and set(lines[i + 1].strip()) == {"-"}
                      and len(lines[i + 1].strip()) >= len(lines[i].strip()))
        if underlined:
            title = lines[i].strip()
            out[title] = []
            i += 2
            continue
        out[title].append(lines[i])
        i += 1
    return {t: "\n".join(body).strip("\n") for t, body in out.items()}


def parameters(doc: str | None) -> list[ParameterDoc]:
    """The entries of the docstring's Parameters section (empty when it has none)."""
    body = sections(doc).get(PARAMETERS)
    if not body:
        return []
    entries: list[tuple[re.Match[str], list[str]]] = []
    for line in body.splitlines():
        header = _HEADER.match(line) if line and not line[0].isspace() else None
        if header is not None:
            entries.append((header, []))
        elif entries:
            entries[-1][1].append(line)
    return [
        ParameterDoc(
            name=header["name"],
            type=(header["type"] or "").strip() or None,
            default=header["default"],
            unit=header["unit"],
            description=_paragraphs(description),
        )
        for header, description in entries
    ]


def _paragraphs(lines: list[str]) -> str:
    """Indented description lines → paragraphs separated by a blank line, each on one line."""
    text = textwrap.dedent("\n".join(lines)).strip()
    return "\n\n".join(" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip())


def summary(doc: str | None) -> str:
    """The docstring's text before its first section."""
    return sections(doc).get("", "")


@dataclass(frozen=True)
class DetectorDoc:
    """A registered detector's docstring, or why it could not be read (a plugin that fails to
    import)."""

    name: str
    target: str  # "module:attribute" of its entry point
    doc: str | None
    error: str | None = None

    @classmethod
    def load(cls, name: str, entry_point: EntryPoint) -> DetectorDoc:
        """Import the entry point's target (without building a detector) and read its doc."""
        try:
            target = entry_point.load()
        except Exception as exc:  # a broken plugin is described as broken, never raised
            return cls(name, entry_point.value, None, f"{type(exc).__name__}: {exc}")
        return cls(name, entry_point.value, inspect.getdoc(target))

    def describe(self) -> str:
        """What ``trainscope detectors --describe NAME`` prints: the summary, then each
        parameter's type, default and unit, and what it does."""
        lines = [f"{self.name} ({self.target})", ""]
        if self.error is not None:
            return "\n".join([*lines, f"fails to load: {self.error}"])
        for paragraph in re.split(r"\n\s*\n", summary(self.doc)):
            if paragraph.strip():
                lines += [*textwrap.wrap(" ".join(paragraph.split()), _WIDTH), ""]
        params = parameters(self.doc)
        if not params:
            return "\n".join([*lines, "Its docstring has no Parameters section."])
        lines.append("Parameters:")
        for p in params:
            lines.append(f"  {_header_text(p)}")
            for paragraph in p.description.split("\n\n"):
                lines += textwrap.wrap(paragraph, _WIDTH, initial_indent=" " * 6,
                                       subsequent_indent=" " * 6)
        return "\n".join(lines)

    def overview(self) -> list[str]:
        """The parameters one per line (name, default, unit), for ``--help``."""
        params = parameters(self.doc)
        if self.error is not None or not params:
            why = f"fails to load: {self.error}" if self.error is not None \
                else "its docstring has no Parameters section"
            return [f"  {self.name} ({self.target}): {why}"]
        width = max(len(p.name) for p in params)
        lines = [f"  {self.name} ({self.target})"]
        for p in params:
            default = p.default if p.default is not None else "-"
            lines.append(f"    {p.name:<{width}}  {default:>8}  {p.unit or ''}".rstrip())
        return lines


def _header_text(p: ParameterDoc) -> str:
    text = p.name + (f" : {p.type}" if p.type else "")
    if p.default is not None:
        text += f", default {p.default}"
    if p.unit:
        text += f" ({p.unit})"
    return text
