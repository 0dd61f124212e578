"""DESIGN.md's layer table: who may import whom. Checked on the source, not at run time."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("partitioner", "planner", "workers", "cluster", "edge_agent", "splitinfer")

# package -> modules it must never import (prefix match), with the files that are the
# one door for a heavy dependency listed in DOORS.
FORBIDDEN = {
    "partitioner": ("onnxruntime", "ray", "grpc", "kubernetes", "msgpack", "planner", "workers", "cluster", "edge_agent", "splitinfer"),
    "planner": ("onnxruntime", "ray", "grpc", "kubernetes", "workers", "cluster", "edge_agent", "splitinfer"),
    "workers": ("ray", "grpc", "kubernetes", "cluster", "edge_agent", "splitinfer"),
    "cluster": ("ray", "kubernetes", "edge_agent", "splitinfer"),
    "edge_agent": ("ray", "kubernetes", "splitinfer"),
    "splitinfer": ("ray", "kubernetes"),
}
DOORS = {
    ("workers/actors.py", "ray"),
    ("cluster/ray_cluster.py", "ray"),
    ("cluster/k8s.py", "kubernetes"),
}
# Imports allowed only inside a function (lazily), in exactly these files.
LAZY_ONLY = {
    ("partitioner/export.py", "onnxruntime"): "segment verification runs ONNX Runtime",
}
# edge_agent may reach into cluster and workers only through these modules.
EDGE_ALLOWED = ("cluster.protocol", "cluster.errors", "workers.engine", "workers.errors", "workers.coldstart", "workers._ort", "workers._weights")


def _imports(tree: ast.AST) -> list[tuple[str, bool]]:
    """(module, is_lazy) for every import; lazy means inside a function."""
    out: list[tuple[str, bool]] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                out.extend((a.name, lazy) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                out.append((child.module, lazy))
            visit(child, inner)

    visit(tree, False)
    return out


def _files() -> list[pathlib.Path]:
    return [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]


def _matches(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_layer_rules(path: pathlib.Path) -> None:
    rel = str(path.relative_to(ROOT))
    pkg = rel.split("/")[0]
    tree = ast.parse(path.read_text(), filename=rel)
    for module, lazy in _imports(tree):
        for banned in FORBIDDEN[pkg]:
            if not _matches(module, banned):
                continue
            if (rel, banned) in DOORS:
                continue
            if lazy and (rel, banned) in LAZY_ONLY:
                continue
            pytest.fail(f"{rel} imports {module}: {pkg} may not import {banned} (DESIGN.md layer table)")
        if pkg == "edge_agent" and (_matches(module, "cluster") or _matches(module, "workers")):
            assert any(_matches(module, ok) for ok in EDGE_ALLOWED), (
                f"{rel} imports {module}: the edge agent may use only {EDGE_ALLOWED}"
            )


def test_cli_imports_no_package_at_top_level() -> None:
    tree = ast.parse((ROOT / "splitinfer" / "cli.py").read_text())
    top = [m for m, lazy in _imports(tree) if not lazy]
    heavy = [m for m in top if m.split(".")[0] in PACKAGES + ("onnx", "onnxruntime", "numpy", "grpc")]
    assert heavy == [], f"splitinfer/cli.py must import subcommands lazily, found {heavy}"


def test_rules_catch_a_violation(tmp_path: pathlib.Path) -> None:
    tree = ast.parse("import os\ndef f():\n    import ray\nfrom grpc import aio\n")
    assert _imports(tree) == [("os", False), ("ray", True), ("grpc", False)]
