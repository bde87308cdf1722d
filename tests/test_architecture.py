"""The shape of the library: imports run downward (no cycle), at most 8 levels deep (the command line
counted as one module; the torch-free engine specs and the stored block format are the floor the
registry added under design and the ledger's caches), and only the engines package knows which engines exist. Every import counts,
those inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE_ORDER = ("ledger", "inputs", "engines", "design", "experiments", "report", "audit")


def modules() -> dict[str, Path]:
    found = {}
    for path in SRC.rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            else:
                continue
            # A package's empty __init__ is only a namespace: importing through it ties nothing.
            graph[name] |= {t for t in targets if t in known and t != name and known[t].read_text().strip()}
    return graph


def levels(graph: dict[str, set[str]]) -> dict[str, int]:
    level: dict[str, int] = {}

    def visit(name: str, path: tuple[str, ...]) -> int:
        assert name not in path, "import cycle: " + " -> ".join((*path[path.index(name) :], name))
        if name not in level:
            level[name] = 1 + max((visit(target, (*path, name)) for target in graph[name]), default=0)
        return level[name]

    for name in graph:
        visit(name, ())
    return level


def command_line_as_one(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph with the command line (``python -m``'s ``__main__`` and the ``cli`` package) as one module:
    how the commands are spread over files adds no level to the library."""

    def merged(name: str) -> str:
        return "stagereplay.cli" if name == "stagereplay.__main__" or name.startswith("stagereplay.cli.") else name

    one: dict[str, set[str]] = {}
    for name, targets in graph.items():
        one.setdefault(merged(name), set()).update(merged(target) for target in targets)
    return {name: targets - {name} for name, targets in one.items()}


def test_imports_have_no_cycle_and_at_most_eight_levels():
    graph = import_graph()
    levels(graph)  # no cycle, among the command line's own modules too
    deepest = levels(command_line_as_one(graph))
    assert max(deepest.values()) <= 8, sorted(deepest.items(), key=lambda item: -item[1])[:8]


def package_floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each package of the library (``stagereplay.<package>``, the command line one with ``__main__``) on its
    floor: one above the highest package it imports, as ``farm-studio look`` draws the house."""

    def package(name: str) -> str:
        parts = name.split(".")
        return "cli" if parts[1:2] == ["__main__"] else parts[1] if len(parts) > 2 else ""

    between: dict[str, set[str]] = {}
    for name, targets in graph.items():
        if package(name):
            between.setdefault(package(name), set()).update(package(t) for t in targets if package(t) != package(name))
    return levels({name: targets - {""} for name, targets in between.items()})


def test_the_packages_stand_on_seven_floors():
    floors = package_floors(import_graph())
    assert max(floors.values()) <= 7, sorted(floors.items(), key=lambda item: -item[1])
    assert floors["ledger"] == 1 and floors["cli"] == max(floors.values()), floors


def test_design_factors_asks_the_knobs_and_imports_no_engine_but_the_spec():
    """E6's factors are engine-neutral: what an engine does with a factor is its knob (``engines.spec.Knob``)."""
    from_engines = {t for t in import_graph()["stagereplay.design.factors"] if t.startswith("stagereplay.engines")}
    assert from_engines <= {"stagereplay.engines.spec", "stagereplay.engines.spec.EngineSpec"}, from_engines


def test_packages_import_only_downward():
    rank = {package: index for index, package in enumerate(PACKAGE_ORDER)}
    upward = []
    for name, targets in import_graph().items():
        parts = name.split(".")
        if len(parts) < 3 or parts[1] not in rank:
            continue
        for target in targets:
            other = target.split(".")
            if len(other) >= 3 and other[1] in rank and rank[other[1]] > rank[parts[1]]:
                upward.append(f"{name} -> {target}")
    assert upward == []


def engine_names_in(source: str) -> list[str]:
    """Where a module's source names an engine: its name as a string, its class or its module."""
    from stagereplay.engines.registry import SPECS

    engine_names = set(SPECS)
    classes = {spec.engine_class_path.partition(":")[2] for spec in SPECS.values()}
    # Each engine's own folder (engines/<name>/), and every module in it.
    folders = {spec.engine_class_path.partition(":")[0].rpartition(".")[0] for spec in SPECS.values()}

    def in_a_folder(module: str) -> bool:
        return any(module == folder or module.startswith(f"{folder}.") for folder in folders)

    named = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and node.value in engine_names:
            named.append(f"{node.lineno}: the string {node.value!r}")
        elif isinstance(node, ast.Name) and node.id in classes:
            named.append(f"{node.lineno}: {node.id}")
        elif isinstance(node, ast.alias) and (node.name in classes or in_a_folder(node.name)):
            named.append(f"{node.lineno}: imports {node.name}")
        elif isinstance(node, ast.ImportFrom) and in_a_folder(node.module or ""):
            named.append(f"{node.lineno}: imports from {node.module}")
    return named


# The imports from an engine's own folder that the engine knobs are to cut (design/factors asking a knob, not
# an engine's modules): listed, so that no other appears and each one cut must leave this list.
ENGINE_SEAMS_TO_CUT: list[str] = []


def test_only_the_engines_package_names_an_engine():
    """No module outside engines/ spells an engine's name as a string, nor its class, nor imports from its
    folder: a third engine is a spec in the registry and a folder, never a string to find in a dozen files."""
    named = [
        f"{name}:{where}"
        for name, path in modules().items()
        if not name.startswith("stagereplay.engines")
        for where in engine_names_in(path.read_text())
    ]
    assert named == ENGINE_SEAMS_TO_CUT


def test_the_engine_name_check_finds_a_string_a_class_and_a_module():
    source = (
        'ENGINE = "llamacpp"\n'
        "from stagereplay.engines.transformers.engine import TransformersEngine\n"
        "engine = LlamaCppEngine\n"
        'OTHER = "transformers is a library"\n'
    )
    assert sorted(engine_names_in(source)) == [
        "1: the string 'llamacpp'",
        "2: imports TransformersEngine",
        "2: imports from stagereplay.engines.transformers.engine",
        "3: LlamaCppEngine",
    ]
