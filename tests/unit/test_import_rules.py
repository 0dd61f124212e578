"""The import rules of docs/architecture.md, read from its tables and checked on the source.

The page is the one statement of the rules: this test parses its three tables
(layers, doors, imports only inside functions) and checks every import in the six
packages against them, so the page and the check cannot drift. The rule that no
layer imports another layer's private (`_`) names needs no table. The tests at the
end plant a violation of each row and check that the checker catches it.
"""

from __future__ import annotations

import ast
import pathlib
import re
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"
PAGE_NAME = "docs/architecture.md"


# -- the tables --------------------------------------------------------------------------


@dataclass(frozen=True)
class Layer:
    name: str
    """Dotted name: 'cluster.protocol'."""
    path: str
    """Its files: 'cluster/protocol/' (the longest matching path wins)."""
    may_import: tuple[str, ...]
    """Project modules it may import from other layers (a layer, or a module of one)."""


@dataclass(frozen=True)
class Door:
    dependency: str
    """Top-level third-party module: 'ray'."""
    module_level: tuple[str, ...]
    """Layers or files that may import it anywhere."""
    in_functions: tuple[str, ...]
    """Layers or files that may import it only inside a function."""


@dataclass(frozen=True)
class LazyOnly:
    path: str
    """The file."""
    modules: tuple[str, ...]
    """Modules it imports only inside functions."""


@dataclass(frozen=True)
class Rules:
    layers: tuple[Layer, ...]
    doors: tuple[Door, ...]
    lazy_only: tuple[LazyOnly, ...]


def read_tables(text: str) -> list[list[dict[str, str]]]:
    """Every markdown table of `text`, as rows keyed by the header's cells."""
    tables: list[list[dict[str, str]]] = []
    block: list[list[str]] = []
    for line in text.splitlines() + [""]:
        if line.lstrip().startswith("|"):
            block.append([c.strip() for c in line.strip().strip("|").split("|")])
            continue
        if len(block) >= 2:
            header, rows = block[0], [r for r in block[2:] if len(r) == len(block[0])]
            tables.append([dict(zip(header, r)) for r in rows])
        block = []
    return tables


def _names(cell: str) -> tuple[str, ...]:
    """The `code` spans of a cell; a cell without any ('none') names nothing."""
    return tuple(re.findall(r"`([^`]+)`", cell))


def _table(tables: list[list[dict[str, str]]], *columns: str) -> list[dict[str, str]]:
    found = [t for t in tables if t and all(c in t[0] for c in columns)]
    if len(found) != 1:
        raise AssertionError(f"{PAGE_NAME} must have exactly one table with columns {columns}, found {len(found)}")
    return found[0]


def parse_rules(text: str) -> Rules:
    """The rules stated by the page's tables."""
    tables = read_tables(text)
    layers = tuple(
        Layer(name=_names(r["Layer"])[0], path=_names(r["Files"])[0], may_import=_names(r["May import from the project"]))
        for r in _table(tables, "Layer", "Files", "May import from the project")
    )
    doors = tuple(
        Door(dependency=_names(r["Dependency"])[0], module_level=_names(r["Imported in"]),
             in_functions=_names(r["Imported only inside a function in"]))
        for r in _table(tables, "Dependency", "Imported in", "Imported only inside a function in")
    )
    lazy_only = tuple(
        LazyOnly(path=_names(r["File"])[0], modules=_names(r["Imports only inside a function"]))
        for r in _table(tables, "File", "Imports only inside a function")
    )
    return Rules(layers=layers, doors=doors, lazy_only=lazy_only)


# -- the checker -------------------------------------------------------------------------


@dataclass(frozen=True)
class Import:
    name: str
    """What is imported, in full: `from a.b import c` is 'a.b.c'."""
    module: str
    """The module named by the statement: 'a.b'."""
    lazy: bool
    """Inside a function (runs only when it is called)."""
    line: int


def find_imports(tree: ast.AST, rel: str) -> list[Import]:
    """Every import of a module's source; relative imports are resolved against `rel`."""
    package = rel[: -len(".py")].split("/")[:-1]  # a module's package, or an __init__'s own
    out: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend(Import(a.name, a.name, lazy, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = package[: len(package) - child.level + 1] if child.level else []
                module = ".".join(base + ([child.module] if child.module else []))
                for a in child.names:
                    name = module if a.name == "*" else f"{module}.{a.name}"
                    out.append(Import(name, module, lazy, child.lineno))
            visit(child, inner)

    visit(tree, False)
    return out


def _matches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _longest(candidates: list[tuple[int, Layer]]) -> Layer | None:
    return max(candidates, key=lambda c: c[0])[1] if candidates else None


def layer_of_file(rel: str, rules: Rules) -> Layer | None:
    return _longest([(len(x.path), x) for x in rules.layers if rel.startswith(x.path)])


def layer_of_module(name: str, rules: Rules) -> Layer | None:
    """The layer a project module belongs to; None for anything outside the project."""
    return _longest([(len(x.name), x) for x in rules.layers if _matches(name, x.name)])


def _is_private(name: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in name.split("."))


def check_source(rel: str, source: str, rules: Rules) -> list[str]:
    """The breaches of `rules` by the module at `rel` (a path relative to the repository)."""
    layer = layer_of_file(rel, rules)
    if layer is None:
        return [f"{rel} belongs to no layer; add its folder to the layer table of {PAGE_NAME}"]
    doors = {d.dependency: d for d in rules.doors}
    lazy_only = {x.path: x.modules for x in rules.lazy_only}
    where = f"({PAGE_NAME})"
    out: list[str] = []
    for imp in find_imports(ast.parse(source, filename=rel), rel):
        at = f"{rel}:{imp.line} imports {imp.name}"
        if not imp.lazy:
            for banned in lazy_only.get(rel, ()):
                if _matches(imp.module, banned):
                    out.append(f"{at} at module level: {rel} imports {banned} only inside a function {where}")
        target = layer_of_module(imp.name, rules)
        if target is not None:
            if target is layer:
                continue
            if not any(_matches(imp.name, ok) for ok in layer.may_import):
                allowed = ", ".join(layer.may_import) or "nothing"
                out.append(f"{at}: layer {layer.name} may import {allowed} of the project {where}")
            elif _is_private(imp.name):
                out.append(f"{at}: a private name of layer {target.name}; give what is shared a public name {where}")
            continue
        door = doors.get(imp.module.split(".")[0])
        if door is None:
            continue
        places = door.module_level + (door.in_functions if imp.lazy else ())
        if rel not in places and layer.name not in places:
            fences = ", ".join(door.module_level) + (
                f" (inside a function also {', '.join(door.in_functions)})" if door.in_functions else "")
            out.append(f"{at}: {door.dependency} is imported only in {fences} {where}")
    return out


# -- the rules on the code ---------------------------------------------------------------

RULES = parse_rules(PAGE.read_text())
PACKAGES = tuple(sorted({x.path.split("/")[0] for x in RULES.layers}))


def _files() -> list[pathlib.Path]:
    return [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_keeps_the_import_rules(path: pathlib.Path) -> None:
    rel = str(path.relative_to(ROOT))
    breaches = check_source(rel, path.read_text(), RULES)
    assert breaches == [], "\n".join(breaches)


def test_the_page_states_the_six_packages_and_their_rules() -> None:
    assert PACKAGES == ("cluster", "edge_agent", "partitioner", "planner", "splitinfer", "workers")
    names = {x.name for x in RULES.layers}
    for layer in RULES.layers:
        for ok in layer.may_import:
            assert layer_of_module(ok, RULES) is not None, f"{layer.name} may import {ok}, which is in no layer"
    for door in RULES.doors:
        for place in door.module_level + door.in_functions:
            assert place in names or (ROOT / place).is_file(), f"door of {door.dependency}: {place} is no layer or file"
    for lazy in RULES.lazy_only:
        assert (ROOT / lazy.path).is_file(), lazy.path
    assert {d.dependency for d in RULES.doors} >= {"ray", "kubernetes", "onnxruntime", "grpc"}


# -- the test of the test: a planted breach of each rule is caught -----------------------

def _file_in(layer: Layer) -> str:
    return f"{layer.path}planted_module.py"


def _layer(name: str) -> Layer:
    found = [x for x in RULES.layers if x.name == name]
    assert found, name
    return found[0]


def _forbidden_project_imports() -> list[tuple[str, str]]:
    """(layer, module) pairs its row forbids: every other layer it may not import, and
    for a layer it may import only some modules of, another module of that layer."""
    pairs = []
    for layer in RULES.layers:
        for other in RULES.layers:
            if other is layer:
                continue
            planted = f"{other.name}.planted"
            if not any(_matches(planted, ok) for ok in layer.may_import):
                pairs.append((layer.name, planted))
    return pairs


@pytest.mark.parametrize(("layer", "module"), _forbidden_project_imports())
def test_a_planted_import_across_the_layer_table_fails(layer: str, module: str) -> None:
    rel = _file_in(_layer(layer))
    for source in (f"import {module}\n", f"def f():\n    from {module} import thing\n"):
        breaches = check_source(rel, source, RULES)
        assert len(breaches) == 1 and f"layer {layer} may import" in breaches[0], (source, breaches)


def test_every_layer_that_may_not_import_everything_has_a_planted_breach() -> None:
    planted = {layer for layer, _ in _forbidden_project_imports()}
    for layer in RULES.layers:
        everything = all(layer_of_file(o.path, RULES) is layer or any(_matches(o.name, ok) for ok in layer.may_import)
                         for o in RULES.layers)
        assert everything or layer.name in planted, layer.name
    # The rows that matter most: the protocol stands alone; the agent gets two modules of workers.
    assert ("cluster.protocol", "cluster.planted") in _forbidden_project_imports()
    assert ("edge_agent", "workers.planted") in _forbidden_project_imports()
    assert ("edge_agent", "cluster.planted") in _forbidden_project_imports()


@pytest.mark.parametrize("layer", [x.name for x in RULES.layers if x.may_import])
def test_an_allowed_import_passes_and_its_private_module_fails(layer: str) -> None:
    row = _layer(layer)
    rel = _file_in(row)
    for ok in row.may_import:
        assert check_source(rel, f"from {ok} import thing\n", RULES) == []
        breaches = check_source(rel, f"from {ok}._hidden import thing\n", RULES)
        assert len(breaches) == 1 and "private name" in breaches[0], breaches
        breaches = check_source(rel, f"from {ok} import _hidden\n", RULES)
        assert len(breaches) == 1 and "private name" in breaches[0], breaches
    # Within a layer a private module is shared freely.
    assert check_source(rel, f"from {row.name}._hidden import thing\n", RULES) == []


def _outside(door: Door) -> list[str]:
    """One file of each layer whose row does not name this dependency."""
    places = door.module_level + door.in_functions
    return [_file_in(x) for x in RULES.layers if x.name not in places]


@pytest.mark.parametrize("door", RULES.doors, ids=lambda d: d.dependency)
def test_a_planted_import_through_no_door_fails(door: Door) -> None:
    outside = _outside(door)
    assert outside, f"{door.dependency} is allowed everywhere: its row fences nothing"
    for rel in outside:
        for source in (f"import {door.dependency}\n", f"def f():\n    from {door.dependency}.sub import x\n"):
            breaches = check_source(rel, source, RULES)
            assert len(breaches) == 1 and f"{door.dependency} is imported only in" in breaches[0], (rel, breaches)
    for place in door.module_level:
        rel = place if place.endswith(".py") else _file_in(_layer(place))
        assert check_source(rel, f"import {door.dependency}\n", RULES) == []
    for place in door.in_functions:
        rel = place if place.endswith(".py") else _file_in(_layer(place))
        assert check_source(rel, f"def f():\n    import {door.dependency}\n", RULES) == []
        breaches = check_source(rel, f"import {door.dependency}\n", RULES)
        assert len(breaches) == 1 and f"{door.dependency} is imported only in" in breaches[0], (rel, breaches)


@pytest.mark.parametrize("row", RULES.lazy_only, ids=lambda x: x.path)
def test_a_planted_module_level_import_in_a_lazy_file_fails(row: LazyOnly) -> None:
    assert row.modules
    for module in row.modules:
        assert check_source(row.path, f"def main():\n    import {module}.sub\n", RULES) == []
        breaches = check_source(row.path, f"import {module}.sub\n", RULES)
        assert any("only inside a function" in b for b in breaches), breaches


def test_imports_are_found_in_every_form() -> None:
    source = (
        "import os\nimport a.b as c\nfrom x.y import z, w\ndef f():\n    import ray\n"
        "class K:\n    def m(self):\n        from grpc import aio\nfrom . import sibling\nfrom ..up import thing\n"
    )
    got = [(i.name, i.module, i.lazy) for i in find_imports(ast.parse(source), "cluster/protocol/mod.py")]
    assert got == [
        ("os", "os", False), ("a.b", "a.b", False), ("x.y.z", "x.y", False), ("x.y.w", "x.y", False),
        ("ray", "ray", True), ("grpc.aio", "grpc", True),
        ("cluster.protocol.sibling", "cluster.protocol", False), ("cluster.up.thing", "cluster.up", False),
    ]


def test_a_relative_import_is_checked_as_its_absolute_name() -> None:
    breaches = check_source("cluster/protocol/mod.py", "from .. import gateway\n", RULES)
    assert len(breaches) == 1 and "imports cluster.gateway" in breaches[0], breaches


def test_a_file_outside_every_layer_is_reported() -> None:
    breaches = check_source("elsewhere/mod.py", "import os\n", RULES)
    assert breaches and "belongs to no layer" in breaches[0]


def test_tables_are_read_by_their_headers() -> None:
    text = "intro\n\n| A | B |\n|---|---|\n| `x` | `y`, `z` |\n| `w` | none |\n\nafter\n| C |\n|---|\n| `q` |\n"
    tables = read_tables(text)
    assert tables == [[{"A": "`x`", "B": "`y`, `z`"}, {"A": "`w`", "B": "none"}], [{"C": "`q`"}]]
    assert _names(tables[0][0]["B"]) == ("y", "z") and _names(tables[0][1]["B"]) == ()
