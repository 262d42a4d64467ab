"""The engine's imports, read from the code's AST: no cycles (``TYPE_CHECKING`` and
function-level imports included), and no engine module imports the public package or the
diagnostics."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jaxamp"
ENGINE = {f"jaxamp.{name}" for name in (
    "_attention", "_compat", "_context", "_control", "_evaluator", "_jaxpr", "_op_rules",
    "_primitives", "_recompute", "_sharing", "_values", "_wgrad", "engine", "rules")}


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        found[".".join(parts)] = (path, is_package)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the jaxamp modules it imports anywhere in its code (relative imports
    resolved; ``from pkg import name`` is ``pkg.name`` where that is a module)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, (path, is_package) in modules.items():
        here = module.split(".") if is_package else module.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[:len(here) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source
                           for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != module:
                    graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_engine_modules_exist():
    assert ENGINE <= set(_modules())


def test_cycles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycle_through_the_engine():
    graph = import_graph()
    assert [c for c in cycles(graph) if ENGINE & set(c)] == []


def test_no_engine_module_imports_the_package_or_the_diagnostics():
    graph = import_graph()
    bad = {m: sorted(t for t in graph[m] if t == "jaxamp" or t.startswith("jaxamp.diagnostics"))
           for m in ENGINE}
    assert {m: t for m, t in bad.items() if t} == {}


def test_rule_modules_and_planners_do_not_import_the_interpreter():
    graph = import_graph()
    for module in ("_op_rules", "_control", "_recompute", "_sharing", "_context"):
        assert "jaxamp._evaluator" not in graph[f"jaxamp.{module}"], module
