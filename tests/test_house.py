"""The shape of the house (GitHub issue #41), read from the code's own AST: the import graph
(no cycle among jaxamp's modules, ``TYPE_CHECKING`` and function-level imports included; the
engine never imports the package, the diagnostics or the interpreter it is run by; the
diagnostics import modules, never the package), short functions, no stale primitive name, and
one report base class."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "jaxamp"
ENGINE = {"jaxamp._engine", "jaxamp.engine", "jaxamp.rules"} | {
    f"jaxamp._engine.{name}" for name in (
        "attention", "compat", "context", "control", "evaluator", "jaxpr", "op_rules", "primitives",
        "recompute", "sharing", "values", "wgrad")}
#: Names that were in jaxamp's lists and are primitives of no supported JAX (0.10.2, 0.12).
STALE = {"core_call", "custom_vjp_call_jaxpr", "xla_call", "xla_pmap", "copy_p", "pjit",
         "remat", "checkpoint", "expand_dims", "logistic_cross_entropy", "scatter_add",
         "scatter_mul", "scatter_min", "scatter_max"}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in sorted(PKG.rglob("*.py"))}


def _trees():
    return {m: ast.parse(p.read_text(), str(p)) for m, p in MODULES.items()}


def imported(module: str, tree: ast.Module) -> set[str]:
    """The jaxamp modules ``module`` imports anywhere in its code, relative imports resolved;
    ``from pkg import name`` counts the module ``pkg.name`` where there is one, else ``pkg``."""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
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
            if t and t != module:
                out.add(t)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_checks_see_what_they_look_for():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert ENGINE <= set(MODULES)
    tree = ast.parse("from .. import policy\nfrom ._trace import x\n"
                     "if TYPE_CHECKING:\n    from jaxamp.engine import autocast")
    assert imported("jaxamp.diagnostics._audit", tree) == {
        "jaxamp.policy", "jaxamp.diagnostics._trace", "jaxamp.engine"}


def test_no_import_cycle_among_jaxamp_modules():
    trees = _trees()
    assert cycles({m: imported(m, t) for m, t in trees.items()}) == []


def test_the_engine_imports_neither_the_package_nor_the_diagnostics_nor_its_interpreter():
    trees = _trees()
    graph = {m: imported(m, trees[m]) for m in ENGINE}
    up = {m: sorted(t for t in deps if t == "jaxamp" or t.startswith("jaxamp.diagnostics"))
          for m, deps in graph.items()}
    assert {m: t for m, t in up.items() if t} == {}
    assert graph["jaxamp._engine"] == set()  # importing one engine module loads no other
    for module in ("op_rules", "control", "recompute", "sharing", "context"):
        assert "jaxamp._engine.evaluator" not in graph[f"jaxamp._engine.{module}"], module


def test_the_diagnostics_import_modules_by_relative_path_not_the_package():
    """``from ..policy import x``, not ``from jaxamp import policy`` nor ``import jaxamp``,
    which run the package's ``__init__`` first."""
    bad = []
    for module, tree in _trees().items():
        if not module.startswith("jaxamp.diagnostics"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(
                    a.name.split(".")[0] == "jaxamp" for a in node.names):
                bad.append(f"{module}:{node.lineno}")
            elif isinstance(node, ast.ImportFrom) and (
                    node.module is None or node.module.split(".")[0] == "jaxamp"):
                bad.append(f"{module}:{node.lineno}")
    assert bad == []


def test_no_function_over_100_lines_and_a_short_make_train_step():
    long = {}
    for module, tree in _trees().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                limit = 80 if node.name == "make_train_step" else 100
                if (n := node.end_lineno - node.lineno + 1) > limit:
                    long[f"{module}:{node.lineno} {node.name}"] = n
    assert long == {}


def test_no_module_names_a_stale_primitive():
    found = {}
    for module, tree in _trees().items():
        names = {n.value for n in ast.walk(tree)
                 if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        if names & STALE:
            found[module] = sorted(names & STALE)
    assert found == {}


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


#: Where a regex may read a name: the readers of HLO and other text (file -> the functions that
#: may, None: all of it), and the deprecated ``jaxamp.engine.REGION_MARKER`` (kept for users;
#: jaxamp reads no marker back).
TEXT_READERS = {
    "jaxamp/diagnostics/_hlo.py": None,
    "jaxamp/diagnostics/gpu.py": {"_proto_field", "parse_target_config"},  # target configs
    "jaxamp/diagnostics/_collectives.py": None,
    "jaxamp/rules.py": {"_path_regex"},  # path globs
    "jaxamp/diagnostics/_reference.py": None,  # module-name heuristics
    "jaxamp/engine.py": {"__getattr__"},
}
_MARK_WORDS = ("jaxamp", "attention", "matmul", "marker", "region", "decision", "scope")
_RE_CALLS = {"compile", "search", "match", "fullmatch", "findall", "finditer", "sub", "split"}


def regex_reads_of_marks(tree: ast.Module) -> list[tuple[str, int]]:
    """``(enclosing function, line)`` of each ``re`` call whose pattern mentions a region, an
    attention call or a decision: its string constants, names and the module-level strings
    those names are bound to."""
    bound: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    bound[target.id] = ast.unparse(node.value)

    def text(expr: ast.AST) -> str:
        out = ast.unparse(expr)
        for n in ast.walk(expr):
            if isinstance(n, ast.Name) and n.id in bound:
                out += " " + bound[n.id]
        return out.lower()

    found = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.FunctionDef | ast.ClassDef) else where
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                    and isinstance(child.func.value, ast.Name) and child.func.value.id == "re"
                    and child.func.attr in _RE_CALLS and child.args
                    and any(w in text(child.args[0]) for w in _MARK_WORDS)):
                found.append((where, child.lineno))
            visit(child, inner)

    visit(tree, "<module>")
    return found


def test_the_mark_check_sees_a_regex_read_of_a_mark():
    tree = ast.parse('import re\nMARK = r"jaxamp<(\\d+)>"\nP = re.compile(MARK)\n'
                     'def f(s):\n    return re.search(r"jaxamp_matmul<([^>]*)>", s)\n'
                     'def g(s):\n    return re.sub(r"\\s+", " ", s)\n')
    assert regex_reads_of_marks(tree) == [("<module>", 3), ("f", 5)]


def test_no_regex_reads_a_region_an_attention_call_or_a_decision_back_from_a_name():
    """Regions, recorded attention calls and FP8 decisions are typed data (issue #41): a table
    of marks keyed by scope name, looked up, never parsed out of a name."""
    bad = []
    for path in MODULES.values():
        rel = str(path.relative_to(ROOT))
        allowed = TEXT_READERS.get(rel, set())
        for where, line in regex_reads_of_marks(ast.parse(path.read_text())):
            if allowed is not None and where not in allowed:
                bad.append(f"{rel}:{line} ({where})")
    assert bad == []


def test_the_readme_architecture_names_every_module():
    """README's "Architecture" tree names every module of the package (by file name or, for the
    diagnostics' private helpers, by stem), so a new module cannot land without its line."""
    text = (ROOT / "README.md").read_text()
    start = text.index("## Architecture")
    block = text[start:text.index("```", text.index("```", start) + 3)]
    named = set(re.findall(r"[\w.]+", block))
    missing = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "jaxamp").rglob("*.py"))
               if p.name not in named and p.stem not in named and p.name != "__init__.py"]
    assert not missing, f"README's Architecture block does not name {missing}"
