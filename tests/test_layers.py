"""Layers that point one way: the package's imports form a DAG of declared layers, without cycles.

The test reads every module of ``trainscope`` with :mod:`ast` — every ``import`` and
``from … import``, at module level or inside a function, relative ones resolved — and fails,
naming the importing module and line, on an import between modules that forms a cycle, and on an
import from one layer into another that the DAG below does not allow.

Two kinds of import are treated specially, and only these:

- imports under ``if TYPE_CHECKING:`` never run, so they cannot form an import-time cycle and are
  left out of the cycle check; they still name a dependency, so the layer check counts them;
- importing ``a.b.c`` also runs the package ``__init__`` of ``a`` and ``a.b``; those implicit
  imports are not edges (``trainscope/__init__.py`` is the top layer and would otherwise sit on
  every path), only the module that is named is.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

# The sources next to this test, whatever copy of the package is installed.
PACKAGE_DIR = Path(__file__).resolve().parent.parent / "trainscope"

# -- the layers --------------------------------------------------------------------------------
# Which modules make up each layer: ``a.b`` names that module (or package ``__init__``) only,
# ``a.b.*`` everything under it. A module named exactly wins over a pattern, a longer pattern over
# a shorter one. A module that matches nothing fails the test, so each new one is placed on
# purpose.
LAYERS: dict[str, tuple[str, ...]] = {
    # Records, WindowView, topics and keys, wire codec, DDL, JSON Schema, the error base, the
    # quantile sketch and summary builders, call-path ids, the op-type vocabulary and op-trace
    # format: everything that defines what a record contains.
    "schemas": ("trainscope.schemas", "trainscope.schemas.*"),
    # Documented environment variable names and the defaults they override, the one place
    # that keeps secrets out of URLs, errors and logs, and the frozen settings resolved from
    # them once per command.
    "config": ("trainscope.config", "trainscope.config.*"),
    # Opening a ClickHouse store (chDB directory or server): shared by the sinks and the what-if
    # store, so neither has to reach into the other.
    "store": ("trainscope.store", "trainscope.store.*"),
    # The bus: its protocol, the in-memory and Kafka implementations and the ``open_bus``
    # factory. A layer of its own below producers and the stream engine because both publish
    # or consume through it, and it knows nothing of either.
    "transport": ("trainscope.transport", "trainscope.transport.*"),
    "detectors": ("trainscope.detectors", "trainscope.detectors.*"),
    # Whole profiler traces: streaming ingestion, calling-context trees, analyzers. Reads files
    # and makes records; no bus, no store, so producers and commands alike can use it.
    "traces": ("trainscope.traces", "trainscope.traces.*"),
    "sinks": ("trainscope.sinks", "trainscope.sinks.*"),
    "whatif": ("trainscope.whatif", "trainscope.whatif.*"),
    # The read-only web dashboard: its ClickHouse queries and the web app.
    "ui": ("trainscope.ui", "trainscope.ui.*"),
    # Configuration what-if: memory and latency models, placement search, recommendations.
    "plan": ("trainscope.plan", "trainscope.plan.*"),
    # Each producer is its own unit: none uses another's internals.
    "producers": ("trainscope.producers",),
    "producers.agent": ("trainscope.producers.agent", "trainscope.producers.agent.*"),
    "producers.replay": ("trainscope.producers.replay", "trainscope.producers.replay.*"),
    "producers.simulate": ("trainscope.producers.simulate", "trainscope.producers.simulate.*"),
    "producers.torch": ("trainscope.producers.torch", "trainscope.producers.torch.*"),
    # The closed loop: which findings get an on-demand profile (policy), asking for it and
    # diffing the profiles that come back (autoprofile). Beside the engine, composed on top.
    "loop": ("trainscope.loop", "trainscope.loop.*"),
    # The window engine and the stream jobs built on it, their checkpoints and their /metrics.
    "engine": ("trainscope.engine", "trainscope.engine.*"),
    # The stream job on Faust: the engine driven by Faust agents, on Faust's consumer made not
    # to skip messages across rebalances.
    "engines.faust": ("trainscope.engines.faust", "trainscope.engines.faust.*"),
    # The PyFlink windowing tier: Flink SQL and the script that runs it. Runs in the Flink
    # environment (numpy<2.2, no river, no chDB), so it stands on the schemas alone.
    "engines.flink": ("trainscope.engines.flink", "trainscope.engines.flink.*"),
    # Composition: every command, the demo, the package's own attach()/step(), and the detector
    # contract check for plugin authors (it runs a simulated job through the pipeline). May
    # import anything.
    "top": (
        "trainscope",
        "trainscope.testing",
        "trainscope.engines",
        "trainscope.cli",
        "trainscope.cli.*",
    ),
}

# -- the allowed dependencies (a DAG; a layer may always import itself) ----------------------
# layer -> {lower layer: why}. The top layer is not listed: it may import every layer.
ENV = (
    "settings are documented environment-variable names (trainscope.config.env), resolved "
    "once into a frozen Settings (trainscope.config.settings)"
)
PUBLISH = (
    "publishing on the bus is what this producer is for; it goes through the bus protocol and "
    "the open_bus factory, never through the window engine"
)
ALLOWED: dict[str, dict[str, str]] = {
    "schemas": {},
    "config": {
        "schemas": "SettingsError derives from the common TrainscopeError",
    },
    "store": {
        "schemas": "StoreError derives from the common TrainscopeError",
        "config": ENV,
    },
    "transport": {
        "schemas": "topic names, partition keys, and BusError's base TrainscopeError",
        "config": ENV,
    },
    "detectors": {
        "schemas": "a detector reads a WindowView of records and returns Findings",
        "config": "a detector whose package is missing is named with the extra that installs "
        "it (config.extras)",
    },
    "traces": {
        "schemas": "traces become summaries, step records and call-path ids",
    },
    "sinks": {
        "schemas": "the sink writes records and WindowViews into the tables of the DDL",
        "config": ENV,
        "store": "the sink writes through a client opened by the shared store helper",
    },
    "whatif": {
        "schemas": "op types, the op-trace format and the what-if tables",
        "config": ENV,
        "store": "traces and results are written through the shared store helper",
    },
    "ui": {
        "store": "the dashboard reads the store through the shared read-only opener",
    },
    "plan": {
        "schemas": "the error base, metric names and the op-type vocabulary",
        "config": ENV,
        "store": "bandwidths a running job measured are read from the store",
        "whatif": "the latency model's reference replays on the what-if event simulator",
    },
    "producers": {},
    "producers.agent": {
        "schemas": "the agent makes metric samples and function summaries",
        "config": ENV,
        "transport": PUBLISH,
    },
    "producers.replay": {
        "schemas": "replay turns Kineto traces and op-trace files into records and envelopes",
        "traces": "a Kineto trace is read and condensed by the trace ingestion",
        "config": ENV,
        "transport": PUBLISH,
    },
    "producers.simulate": {
        # No bus: the simulated cluster only makes records; whoever runs it publishes them.
        "schemas": "the simulated cluster makes records and op traces",
    },
    "producers.torch": {
        "schemas": "the in-process producer makes records, summaries and op traces",
        "config": ENV,
        "transport": PUBLISH,
    },
    "loop": {
        "schemas": "findings and windows in, control messages and call-path records out",
        "detectors": "a finding triggers a profile at the detectors' alert threshold",
        "traces": "the suspect's and the peer's call-path trees are diffed by the trace diff",
    },
    "engines.flink": {
        "schemas": "topic names, the sketch's bucket mapping and the JSON wire format the SQL "
        "reads and writes; nothing else, as the Flink environment has nothing else",
    },
    "engines.faust": {
        "schemas": "the jobs' topology records",
        "transport": "topic names and the bus message the Faust agents hand to the engine",
        "engine": "Faust's agents drive the same window engine and stream job as the embedded "
        "runner, with its deduplication of re-sent batches",
        "detectors": "a worker is built with the detectors it runs (their protocol only)",
    },
    "engine": {
        "schemas": "the engine turns records into WindowViews",
        "config": ENV,
        "transport": "a stream job consumes from and produces to the bus",
        "detectors": "the stream job runs the detectors on each closed window, and the early "
        "flag on step records between windows; it uses only their public protocol, registry "
        "and the early flag (see PUBLIC)",
    },
}

# Where a layer may import only some modules of another: the public face of that layer.
PUBLIC: dict[tuple[str, str], frozenset[str]] = {
    ("engine", "detectors"): frozenset(
        {"trainscope.detectors.base", "trainscope.detectors.registry",
         "trainscope.detectors.early"}
    ),
    ("loop", "detectors"): frozenset({"trainscope.detectors.base"}),
    ("engines.faust", "detectors"): frozenset({"trainscope.detectors.base"}),
    ("detectors", "config"): frozenset({"trainscope.config.extras"}),
}


@dataclass(frozen=True)
class Import:
    importer: str
    target: str
    line: int
    type_only: bool

    def where(self) -> str:
        return f"{self.importer} (line {self.line}) imports {self.target}"


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = ("trainscope", *path.relative_to(PACKAGE_DIR).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The trainscope module a dotted name refers to (a name inside a module resolves to it)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports_of(module: str, source: str, is_package: bool = False) -> list[Import]:
    found: list[Import] = []
    seen: set[tuple[str, int]] = set()

    def add(name: str, line: int, type_only: bool) -> None:
        target = _resolve(name)
        if target is not None and target != module and (target, line) not in seen:
            seen.add((target, line))
            found.append(Import(module, target, line, type_only))

    def visit(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_only)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno, type_only)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                # ``from pkg import sub`` imports the submodule ``pkg.sub`` when there is one.
                submodule = f"{source}.{alias.name}"
                add(submodule if submodule in MODULES else source, node.lineno, type_only)
        for child in ast.iter_child_nodes(node):
            visit(child, type_only)

    visit(ast.parse(source, module), False)
    return found


IMPORTS = [
    imp
    for module, path in MODULES.items()
    for imp in _imports_of(module, path.read_text(encoding="utf-8"), path.name == "__init__.py")
]


def layer_of(module: str) -> str | None:
    best: tuple[tuple[bool, int], str] | None = None
    for layer, patterns in LAYERS.items():
        for pattern in patterns:
            exact = not pattern.endswith(".*")
            if module == pattern if exact else module.startswith(pattern[:-1]):
                rank = (exact, len(pattern))
                if best is None or rank > best[0]:
                    best = (rank, layer)
    return None if best is None else best[1]


def test_the_declared_dependencies_form_a_dag() -> None:
    assert set(ALLOWED) | {"top"} == set(LAYERS), "every layer but top lists what it may import"
    visiting: set[str] = set()
    done: set[str] = set()

    def walk(layer: str, path: tuple[str, ...]) -> None:
        assert layer not in visiting, f"the layer DAG has a cycle: {' -> '.join(path)}"
        if layer in done:
            return
        visiting.add(layer)
        for lower in ALLOWED.get(layer, {}):
            assert lower in LAYERS and lower != "top", f"{layer} may import unknown {lower}"
            walk(lower, (*path, lower))
        visiting.discard(layer)
        done.add(layer)

    for layer in LAYERS:
        walk(layer, (layer,))


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(m for m in MODULES if layer_of(m) is None)
    assert not unplaced, f"modules in no layer (add them to LAYERS in {__name__}): {unplaced}"


def _layer_breaks(imports: list[Import]) -> list[str]:
    broken: list[str] = []
    for imp in imports:
        source, target = layer_of(imp.importer), layer_of(imp.target)
        if source is None or target is None or source == target or source == "top":
            continue
        if target not in ALLOWED[source]:
            broken.append(f"{imp.where()}: layer {source} may not import layer {target}")
        elif (source, target) in PUBLIC and imp.target not in PUBLIC[(source, target)]:
            allowed = sorted(PUBLIC[(source, target)])
            broken.append(f"{imp.where()}: {source} may use only {allowed} of {target}")
    return broken


def test_imports_follow_the_layers() -> None:
    assert len(MODULES) > 50 and len(IMPORTS) > 100, "the walk found too little; is it broken?"
    broken = _layer_breaks(IMPORTS)
    assert not broken, "imports against the layer order:\n" + "\n".join(broken)


def _cycles(edges: dict[str, list[Import]]) -> list[list[Import]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for imp in edges.get(node, []):
            if imp.target not in index:
                connect(imp.target)
                low[node] = min(low[node], low[imp.target])
            elif imp.target in on_stack:
                low[node] = min(low[node], index[imp.target])
        if low[node] == index[node]:
            component: set[str] = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(edges):
        if node not in index:
            connect(node)

    cycles: list[list[Import]] = []
    for component in components:
        # Walk inside the component from its smallest module until a module repeats.
        start = min(component)
        path: list[Import] = []
        seen = {start: 0}
        node = start
        while True:
            imp = next(i for i in edges[node] if i.target in component)
            path.append(imp)
            if imp.target in seen:
                cycles.append(path[seen[imp.target] :])
                break
            seen[imp.target] = len(path)
            node = imp.target
    return cycles


def test_no_import_cycles() -> None:
    edges: dict[str, list[Import]] = {}
    for imp in IMPORTS:
        if not imp.type_only:
            edges.setdefault(imp.importer, []).append(imp)
    cycles = _cycles(edges)
    assert not cycles, "import cycles:\n" + "\n".join(
        " -> ".join(imp.where() for imp in cycle) for cycle in cycles
    )


def test_the_checks_catch_planted_breaks() -> None:
    """The walkers themselves: local, relative and type-only imports; a cycle is named."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from trainscope.producers.torch.runtime import Attachment\n"
        "def f():\n"
        "    from ..detectors import registry\n"
        "    from . import clickhouse\n"
    )
    found = _imports_of("trainscope.sinks.planted", source)
    assert found == [
        Import("trainscope.sinks.planted", "trainscope.producers.torch.runtime", 3, True),
        Import("trainscope.sinks.planted", "trainscope.detectors.registry", 5, False),
        Import("trainscope.sinks.planted", "trainscope.sinks.clickhouse", 6, False),
    ]
    breaks = _layer_breaks(found)
    assert len(breaks) == 2
    assert breaks[0].startswith("trainscope.sinks.planted (line 3) imports")
    planted = {
        "x.a": [Import("x.a", "x.b", 3, False)],
        "x.b": [Import("x.b", "x.a", 7, False)],
    }
    assert [[i.line for i in c] for c in _cycles(planted)] == [[3, 7]]
