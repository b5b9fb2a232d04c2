"""Every built-in detector documents its parameters and shows itself at work, as river documents
its estimators: a numpydoc Parameters section naming each constructor argument with its type,
default and unit, and an example that runs (here, with ``doctest``) and shows a finding."""

from __future__ import annotations

import ast
import doctest
import importlib
import inspect
from importlib.metadata import EntryPoint

import pytest

from trainscope.detectors.docs import EXAMPLES, PARAMETERS, DetectorDoc, parameters, sections
from trainscope.detectors.registry import available, is_builtin

BUILTINS = {name: ep for name, ep in sorted(available().items()) if is_builtin(ep)}
# The detectors' modules, and those their examples and the --describe text rely on.
MODULES = sorted({ep.module for ep in BUILTINS.values()}
                 | {"trainscope.detectors.contract", "trainscope.detectors.docs"})


def doc_problems(cls: type) -> list[str]:
    """What the class docstring lacks: a Parameters entry (with type, default, unit and a
    description) for each constructor argument, in order, or an example that detects."""
    doc = cls.__doc__ or ""
    found = sections(doc)
    problems = [f"no {title} section" for title in (PARAMETERS, EXAMPLES) if title not in found]
    signature = inspect.signature(cls).parameters
    documented = {p.name: p for p in parameters(doc)}
    if list(documented) != list(signature):
        problems.append(f"documents {list(documented)}, the constructor takes {list(signature)}")
    for name, p in documented.items():
        if not (p.type and p.unit and p.description and p.default):
            problems.append(f"{name}: the entry needs a type, a default, a unit and a description")
        elif name in signature:
            real = signature[name]
            if str(real.annotation) != p.type:
                problems.append(f"{name}: documented as {p.type}, annotated {real.annotation}")
            if ast.literal_eval(p.default) != real.default:
                problems.append(f"{name}: documented default {p.default}, real {real.default!r}")
    examples = doctest.DocTestParser().get_examples(found.get(EXAMPLES, ""))
    if not any(".detect(" in e.source for e in examples):
        problems.append("no example that runs detect()")
    return problems


def test_the_built_ins_are_those_of_pyproject() -> None:
    assert set(BUILTINS) == {"peer-diff", "multivariate", "step-time", "mixture", "waits"}


@pytest.mark.parametrize("name", list(BUILTINS))
def test_a_built_in_documents_every_parameter_and_has_an_example(name: str) -> None:
    assert doc_problems(BUILTINS[name].load()) == []


@pytest.mark.parametrize("module", MODULES)
def test_the_examples_run(module: str) -> None:
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    report: list[str] = []
    for test in doctest.DocTestFinder().find(importlib.import_module(module)):
        runner.run(test, out=report.append)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, "".join(report)
    if module in {ep.module for ep in BUILTINS.values()}:
        assert results.attempted > 0


def test_the_check_sees_what_a_docstring_lacks() -> None:
    class Undocumented:
        """Finds things."""

        name = "undocumented"

        def __init__(self, z_min: float = 6.0) -> None:
            self.z_min = z_min

    class Stale:
        """Finds things.

        Parameters
        ----------
        z_min : float, default 5.0 (robust z)
            Where a rank becomes a suspect.

        Examples
        --------
        >>> Stale().detect(None)
        []
        """

        name = "stale"

        def __init__(self, z_min: float = 6.0, window: int = 3) -> None:
            self.z_min, self.window = z_min, window

        def detect(self, window: object) -> list[object]:
            return []

    assert doc_problems(Undocumented) == [
        "no Parameters section", "no Examples section",
        "documents [], the constructor takes ['z_min']", "no example that runs detect()",
    ]
    assert doc_problems(Stale) == [
        "documents ['z_min'], the constructor takes ['z_min', 'window']",
        "z_min: documented default 5.0, real 6.0",
    ]


def test_entries_without_a_default_or_unit_are_read_too() -> None:
    # A plugin may write plain numpydoc; the command line shows what it has.
    doc = """A plugin.

    Parameters
    ----------
    threshold : float
        When to report.

        A second paragraph.
    quiet
        Report less.
    """
    read = parameters(doc)
    assert [(p.name, p.type, p.default, p.unit) for p in read] == [
        ("threshold", "float", None, None), ("quiet", None, None, None)]
    assert read[0].description == "When to report.\n\nA second paragraph."


def test_a_plugin_without_the_section_or_that_fails_to_load_is_described_as_such() -> None:
    plain = DetectorDoc("acme", "acme:Plain", "Finds acme things.")
    assert plain.overview() == ["  acme (acme:Plain): its docstring has no Parameters section"]
    assert plain.describe().splitlines()[-1] == "Its docstring has no Parameters section."
    broken = DetectorDoc.load("acme", EntryPoint("acme", "no_such_module_xyz:D", "g"))
    assert broken.error is not None and broken.error.startswith("ModuleNotFoundError")
    assert broken.describe().splitlines()[-1] == f"fails to load: {broken.error}"
