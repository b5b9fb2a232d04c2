"""Readable units: no function longer than a screen or two without a reason, and the core
classes say what they are.

A function of more than ``MAX_FUNCTION_LINES`` lines (``def`` to its last line, decorators
excluded) must say why in its docstring, in a paragraph that starts with ``Long because``: a
copy of an upstream function kept line for line, a click command whose body is mostly its
options' plumbing, a state machine that reads best in one place.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "trainscope"
MAX_FUNCTION_LINES = 80
REASON = "Long because"

# The classes a newcomer meets first; each says in its docstring what it is and what it owns.
CORE_CLASSES = (
    "trainscope.producers.torch.runtime:Attachment",
    "trainscope.producers.torch.sender:Sender",
    "trainscope.engine.windows:WindowEngine",
    "trainscope.sinks.clickhouse:ClickHouseSink",
    "trainscope.transport.kafka:KafkaBus",
    "trainscope.producers.agent.daemon:Agent",
    "trainscope.detectors.peer:PeerDiffDetector",
)


def _long_functions() -> list[str]:
    found = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines <= MAX_FUNCTION_LINES:
                continue
            if REASON in (ast.get_docstring(node) or ""):
                continue
            where = path.relative_to(PACKAGE_DIR.parent)
            found.append(f"{where}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_is_long_without_a_reason() -> None:
    long = _long_functions()
    assert not long, (
        f"functions over {MAX_FUNCTION_LINES} lines without '{REASON} …' in their docstring:\n"
        + "\n".join(long)
    )


def test_the_check_sees_a_long_function() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    tree = ast.parse(f"def f():\n{body}\n")
    node = tree.body[0]
    assert isinstance(node, ast.FunctionDef)
    assert node.end_lineno is not None and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES


def test_core_classes_have_docstrings() -> None:
    missing = []
    for spec in CORE_CLASSES:
        module, _, name = spec.partition(":")
        cls = getattr(importlib.import_module(module), name)
        doc = cls.__doc__ or ""
        if len(doc.split()) < 8:
            missing.append(spec)
    assert not missing, f"core classes without a docstring that says what they are: {missing}"
