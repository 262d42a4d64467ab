"""The diagnostics package's shape (GitHub issue #41), read from the code's own AST: short
functions, imports of the modules they use (never the ``jaxamp`` package), no import cycle
through a diagnostics module, and one report base class."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "jaxamp"
DIAG = sorted((PKG / "diagnostics").glob("*.py"))


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in PKG.rglob("*.py")}


def _imported(path: Path) -> set[str]:
    """The jaxamp modules ``path`` imports, anywhere in it (functions and TYPE_CHECKING
    included), relative imports resolved; ``from pkg import name`` counts the module
    ``pkg.name`` when there is one, else ``pkg``."""
    name = _module(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def test_no_function_in_diagnostics_is_over_100_lines():
    long = [f"{p.name}:{n.name} ({n.end_lineno - n.lineno + 1} lines)" for p in DIAG
            for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
            and n.end_lineno - n.lineno + 1 > 100]
    assert long == []


def test_diagnostics_import_modules_not_the_jaxamp_package():
    bad = [f"{p.name} imports the package jaxamp" for p in DIAG if "jaxamp" in _imported(p)]
    # by the module's relative path (``from ..policy import x``): not ``from jaxamp import
    # policy`` nor ``from .. import policy``, which run the package first
    for p in DIAG:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import) and any(
                    a.name.split(".")[0] == "jaxamp" for a in node.names):
                bad.append(f"{p.name}:{node.lineno} import jaxamp...")
            elif isinstance(node, ast.ImportFrom) and (
                    node.module is None or node.module.split(".")[0] == "jaxamp"):
                bad.append(f"{p.name}:{node.lineno} from {node.module or '.'} import ...")
    assert bad == []
    # and the checker sees the imports it should: the audit reads the engine and the trace
    assert {"jaxamp.engine", "jaxamp.diagnostics._trace"} <= _imported(
        PKG / "diagnostics" / "_audit.py")


def test_no_import_cycle_runs_through_the_diagnostics():
    graph = {m: _imported(p) for m, p in MODULES.items()}

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for n in graph[todo.pop()]:
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        return seen

    cycles = sorted(m for m in graph if m.startswith("jaxamp.diagnostics") and m in reach(m))
    assert cycles == []
    # the engine (everything outside diagnostics but the package and the log reader's
    # command-line shim) never imports a diagnostics module, at run time or for typing
    up = sorted(m for m, deps in graph.items() if not m.startswith("jaxamp.diagnostics")
                and m not in ("jaxamp", "jaxamp.review")
                and any(d.startswith("jaxamp.diagnostics") for d in deps))
    assert up == []


def test_every_report_derives_from_the_one_base():
    from jaxamp.diagnostics import (
        AuditReport,
        GpuProgram,
        OverflowReport,
        PrecisionTable,
        RunReview,
    )
    from jaxamp.diagnostics._base import Report

    for cls in (AuditReport, GpuProgram, OverflowReport, PrecisionTable, RunReview):
        assert issubclass(cls, Report), cls
        assert "to_json" not in vars(cls), cls  # one JSON writer
