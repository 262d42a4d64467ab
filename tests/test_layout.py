"""The package layout (GitHub issue #15): the runtime core and jaxamp.diagnostics, no private
name crossing a module boundary outside the core, a JAX-free log reader, one definition of the
policy parser and the module path format, no repeated code blocks."""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import jaxamp
from jaxamp import diagnostics, policy_spec
from jaxamp.diagnostics import metrics

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "jaxamp"
CORE = {p for p in PKG.glob("*.py")}  # jaxamp/*.py: the runtime core (one package)


def _imports(path: Path):
    """(module imported from, name) for every ``from jaxamp... import name`` in ``path``."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and \
                node.module.split(".")[0] == "jaxamp":
            for alias in node.names:
                yield node.module, alias.name


def test_no_underscore_name_crosses_a_module_boundary_outside_the_core():
    checked = sorted((PKG / "diagnostics").glob("*.py")) + sorted((ROOT / "examples").glob(
        "*.py")) + sorted((ROOT / "bench").glob("*.py"))
    assert len(checked) > 20
    bad = [f"{p.relative_to(ROOT)}: from {m} import {n}" for p in checked
           for m, n in _imports(p) if n.startswith("_")]
    assert bad == []
    # the core never imports the diagnostics (diagnostics -> core only; __init__ re-exports
    # them and jaxamp/review.py is the command-line shim)
    up = [f"{p.name}: {m}" for p in CORE for m, _ in _imports(p)
          if m.startswith("jaxamp.diagnostics")
          and p.name not in ("__init__.py", "review.py")]
    assert up == []


def test_the_core_and_diagnostics_layout():
    assert {p.name for p in (PKG / "diagnostics").glob("*.py")} >= {
        "__init__.py", "_audit.py", "_trace.py", "_report.py", "_step.py", "_reference.py",
        "overflow.py", "review.py", "metrics.py"}
    for name in ("audit.py", "overflow.py", "_audit_trace.py", "_seed_table.py"):
        assert not (PKG / name).exists(), name
    # the public names resolve, lazily, to the same objects from both packages
    from jaxamp import diagnostics
    assert jaxamp.audit is diagnostics.audit and jaxamp.locate_overflow is \
        diagnostics.locate_overflow
    assert callable(jaxamp.autocast) and callable(jaxamp.audit)  # not shadowed by modules
    assert set(jaxamp.__all__) <= set(dir(jaxamp)) and "make_train_step" in jaxamp.__all__
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        jaxamp.nope  # noqa: B018


def test_the_public_names_are_listed_once_in_the_stub():
    """``__all__`` is the stub's ``from M import X as X`` lines (what type checkers read), each
    resolving to its module's object; the names moved out of the top level still resolve, with
    a DeprecationWarning that names the module to import them from."""
    stub = (PKG / "__init__.pyi").read_text()
    names = re.findall(r"^from (jaxamp[\w.]*) import (\w+) as \2$", stub, re.M)
    assert sorted(n for _, n in names) == sorted(jaxamp.__all__) and len(jaxamp.__all__) <= 30
    assert "__all__" not in stub and "TYPE_CHECKING" not in (PKG / "__init__.py").read_text()
    for module, name in names:
        assert getattr(jaxamp, name) is getattr(importlib.import_module(module), name), name
    with pytest.warns(DeprecationWarning, match=r"jaxamp\.AuditReport is deprecated.*"
                      r"from jaxamp\.diagnostics import AuditReport"):
        assert jaxamp.AuditReport is diagnostics.AuditReport
    with pytest.warns(DeprecationWarning, match="from jaxamp.transform import AmpState"):
        assert jaxamp.AmpState is importlib.import_module("jaxamp.transform").AmpState
    assert "AuditReport" not in jaxamp.__all__ and "AuditReport" not in dir(jaxamp)


def test_no_public_name_is_also_a_submodule():
    """Importing ``pkg.name`` sets the attribute ``name`` of ``pkg`` to that module, and a lazy
    ``__getattr__`` never runs for it again: with ``diagnostics/collectives.py`` beside the
    function ``collectives``, ``from jaxamp.diagnostics import format_collectives`` made
    ``jaxamp.collectives(...)`` raise "'module' object is not callable"."""
    for pkg in (jaxamp, diagnostics):
        here = Path(pkg.__file__).parent
        submodules = {p.stem for p in here.glob("*.py")} | {p.parent.name
                                                           for p in here.glob("*/__init__.py")}
        assert set(pkg.__all__) & submodules == set(), pkg.__name__
    code = ("import jaxamp; from jaxamp.diagnostics import format_collectives; "
            "print(callable(jaxamp.collectives), callable(jaxamp.diagnostics.collectives))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.stdout.split() == ["True", "True"], out.stderr[-2000:]


def test_the_log_reader_imports_no_jax(tmp_path):
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "jaxamp.review", "--help"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0 and "usage: python -m jaxamp.review" in out.stdout
    imported = {line.split("|")[-1].strip() for line in out.stderr.splitlines()
                if line.startswith("import time:")}
    assert "jaxamp.diagnostics.review" in imported and "jaxamp.policy_spec" in imported
    assert {"jax", "flax", "optax", "jmp", "numpy"} & {m.split(".")[0] for m in imported} == set()


def test_one_policy_parser():
    for spec in ("p=f32", "F32", "full", "params=float32", " p = f32 , o = f32 "):
        assert policy_spec.parse(spec)["compute"] == "float32", spec
        assert jaxamp.policy_to_str(jaxamp.get_policy(spec)) == to_str(spec)
    assert policy_spec.parse("c=bf16") == {"params": "float32", "compute": "bfloat16",
                                          "output": "bfloat16"}
    # the same error text from the JAX-free parser and from get_policy
    for bad in ("p=f64", "c=int8", "x=f16", "p=f32,,", ""):
        with pytest.raises(ValueError) as a:
            policy_spec.parse(bad)
        with pytest.raises(ValueError) as b:
            jaxamp.get_policy(bad)
        assert str(a.value) == str(b.value) and "Example:" in str(a.value)
    # the default policy and the float16 rule, written once
    assert jaxamp.DEFAULT_POLICY is policy_spec.DEFAULT_POLICY
    assert [policy_spec.loss_scaling(c) for c in ("float16", "f16", "bfloat16", "float32")] == \
        ["dynamic", "dynamic", "none", "none"]
    assert type(jaxamp.default_loss_scale("c=f16")).__name__ == "DynamicLossScale"
    assert type(jaxamp.default_loss_scale("c=bf16")).__name__ == "NoOpLossScale"


def to_str(spec: str) -> str:
    return policy_spec.to_str(policy_spec.parse(spec))


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="fc")(nn.LayerNorm(name="ln")(x))


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2, name="head")(_Block(name="block")(x))


def test_reports_print_module_paths_as_overrides_write_them():
    model = _Net()
    x = jnp.ones((4, 8))
    params = model.init(jax.random.key(0), x)["params"]

    def loss(p, x):
        return jnp.mean(model.apply({"params": p}, x) ** 2)

    rows = jaxamp.precision_table(loss, params, x)
    matmuls = {r["module"]: r["forward"] for r in rows if r["op"] == "matmul"}
    assert matmuls == {"block/fc": "float16", "head": "float16"}
    # a path the table printed, given back as an override key, selects that module
    rows = jaxamp.precision_table(loss, params, x, overrides={"block/fc": "float32"})
    matmuls = {r["module"]: r["forward"] for r in rows if r["op"] == "matmul"}
    assert matmuls == {"block/fc": "float32", "head": "float16"}
    report = jaxamp.locate_overflow(model, {"params": params}, x, loss_fn=lambda y: jnp.mean(y))
    assert {"block/fc", "block/ln", "head"} <= {r["module"] for r in report.rows}


def test_deprecated_names_still_work_and_warn():
    model = nn.Dense(4)
    x = jnp.ones((2, 3))
    params = model.init(jax.random.key(0), x)["params"]
    report = jaxamp.audit(lambda p, x: jnp.mean(model.apply({"params": p}, x)), params, x)
    with pytest.warns(DeprecationWarning, match="reference_table"):
        old = report.seed_rows()
    # a Dense model has no Transformer parts: only the rows it has (GitHub issue #26)
    assert old == report.reference_table()
    assert [r["row"] for r in old] == ["CrossEntropy loss", "Parameter update"]
    finding = diagnostics.Finding("k", "m", "d", "LayerNorm")
    with pytest.warns(DeprecationWarning, match="reference_row"):
        assert finding.seed_row == "LayerNorm"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert json.loads(report.to_json())["seed_rows"] == old


def test_metrics_format_round_trip_and_torn_lines(tmp_path):
    path = tmp_path / metrics.METRICS_FILE
    with metrics.MetricsWriter(path) as log:
        for step in (1, 2, 3):
            log.write(metrics.step_record(step, {
                "loss": float("nan") if step == 2 else 1.0 / step, "loss_scale": 2.0**15,
                "grad_norm": 0.5, "grads_finite": step != 2, "skipped": step == 2,
                "skipped_steps": int(step >= 2)}, tokens_per_s=10.0))
    text = path.read_text()
    assert "NaN" not in text and json.loads(text.splitlines()[1])["loss"] is None
    with open(path, "a") as f:
        f.write('{"step": 4, "loss": 0.2')  # a kill in the middle of a line
    rows = metrics.read_metrics(path)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[2]["loss"] == pytest.approx(1 / 3)
    # resume from step 2: later lines and the torn one go; appending continues from there
    with metrics.MetricsWriter(path, keep_through=2) as log:
        log.write(metrics.step_record(3, {"loss": 0.3}))
    assert [(r["step"], r["loss"]) for r in metrics.read_metrics(path)] == \
        [(1, 1.0), (2, None), (3, 0.3)]
    # a complete line that is not a record is an error naming the line
    with open(path, "a") as f:
        f.write('{"loss": 1.0}\n')
    with pytest.raises(metrics.MetricsError, match="line 4: missing or non-numeric 'step'"):
        metrics.read_metrics(path)
    metrics.write_summary(tmp_path / metrics.SUMMARY_FILE, {"final_val_loss": float("inf")})
    assert metrics.read_summary(tmp_path / metrics.SUMMARY_FILE) == {"final_val_loss": None}


def _blocks(path: Path, size: int):
    """(six stripped lines, (file, line)) for every window of ``size`` non-trivial lines."""
    # blank lines, comments, quotes or a bracket alone do not break a repeated block
    numbered = [(n, line.strip()) for n, line in enumerate(path.read_text().splitlines(), 1)
                if len(line.strip()) > 3 and not line.strip().startswith("#")]
    for i in range(len(numbered) - size + 1):
        window = [w for _, w in numbered[i:i + size]]
        # code and docstrings, not doctest prompts or imports
        if not any(w.startswith((">>>", "...", "import ", "from ")) for w in window):
            yield tuple(window), (str(path.relative_to(ROOT)), numbered[i][0])


def test_no_block_of_six_lines_is_repeated_inside_the_package():
    first: dict[tuple, tuple[str, int]] = {}
    repeated = []
    for path in sorted(PKG.rglob("*.py")):
        for block, (file, line) in _blocks(path, 6):
            if block not in first:
                first[block] = (file, line)
            elif first[block][0] != file or line - first[block][1] >= 6:  # not an overlap
                repeated.append(f"{first[block]} and {(file, line)}: {block[0]}")
    assert repeated == []


INTERNALS = ("eqn.params[", "jax.core.", "jax._src", "._cache_size")
COMPAT = PKG / "_engine" / "compat.py"


def test_jax_internals_are_read_only_in_compat():
    """Equation params, jax.core, jax._src and jit's cache are read through
    jaxamp/_engine/compat.py's typed accessors: one file to change when JAX moves them."""
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
             for p in sorted(PKG.rglob("*.py")) if p != COMPAT
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if any(s in line for s in INTERNALS)]
    assert found == []
    compat = COMPAT.read_text()
    assert all(s in compat for s in ("eqn.params[", "_cache_size"))  # the check can see them
