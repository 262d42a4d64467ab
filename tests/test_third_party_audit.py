"""The diagnostics on models of third-party libraries, unmodified (tests/third_party.py):
the audit of each train step finds nothing and its reference table agrees (float16 and
bfloat16), and every module path any report prints (precision table, audit rows, findings,
reference rows, matmuls, overflow report) is a valid ``overrides=`` key, as printed and with
the root class in front; paths are the module structure, not tunix's ``jax.named_scope`` s.
Each test skips where its library is not installed (eqx-zoo needs Python 3.12).
"""

from __future__ import annotations

import warnings

import optax
import pytest
import third_party as tp
from corpus import POLICIES

import jaxamp
from jaxamp import diagnostics

CASES = list(tp.THIRD_PARTY)
NOT_PATHS = {"(top level)", "(output)", "(params)", "(train step)"}


def _printed_paths(*reports) -> set[str]:
    """Every module path the reports print (rows, findings, reference rows, matmuls)."""
    paths = set()
    for rep in reports:
        if isinstance(rep, diagnostics.AuditReport):
            paths |= {r["module"] for r in rep.rows}
            paths |= {f.module for f in rep.findings}
            paths |= {m for r in rep.reference_table() for m in r["modules"]}
            paths |= {m["module"] for m in rep.matmuls}
        elif isinstance(rep, diagnostics.OverflowReport):
            paths |= {r["module"] for r in rep.rows}
        else:  # a PrecisionTable
            paths |= {r["module"] for r in rep}
    return paths - NOT_PATHS


def _unmatched(step, state, batch) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jaxamp.precision_table(step, state, batch)
    return [str(w.message) for w in caught if "matched no module" in str(w.message)]


@pytest.mark.parametrize("dtype", list(POLICIES))
@pytest.mark.parametrize("library,name", CASES, ids=[f"{lib}-{n}" for lib, n in CASES])
def test_third_party_audit_is_clean_and_its_paths_are_overrides(library, name, dtype):
    case = tp.case(library, name)
    policy = POLICIES[dtype]
    state, step = case.state(policy, optax.adam(1e-3)), case.train_step()
    report = jaxamp.audit(step, state, case.batch)
    assert report.findings == [], report.to_markdown()
    ref = report.reference_table()
    assert ref and all(r["ok"] for r in ref), ref
    if dtype != "float16":
        return  # the paths do not depend on the compute dtype
    # (precision_table prints the audit's rows: tests/test_audit.py). The overflow report
    # names modules with the same paths: read on one model per library (~20 s each)
    overflow = [jaxamp.locate_overflow(step, state, case.batch)] \
        if (library, name) in (("tunix", "llama3"), ("eqx-zoo", "qwen3")) else []
    paths = _printed_paths(report, *overflow)
    if case.kind == "equinox":  # no Flax modules: everything is top level
        assert paths == set(), paths
        return
    root = type(case.model).__name__
    assert root in paths and "layers/0" in paths and "layers/1/attn" in paths, sorted(paths)
    # structure, not jax.named_scope: no 'attention', 'einsum', 'rms_norm' scope in a path
    assert not any(s in p.split("/") for p in paths for s in ("attention", "einsum",
                                                               "rms_norm")), sorted(paths)
    # as printed, then with the root class in front (each pattern that matches nothing warns;
    # one trace per form: of two patterns for one module only the longer one is used)
    for keys in (paths, {p if p == root else f"{root}/{p}" for p in paths}):
        over = case.train_step(overrides={p: "float32" for p in keys})
        assert _unmatched(over, state, case.batch) == []


def test_a_printed_path_sets_that_module_only():
    """The q projection of one tunix layer, copied from the report: only its matmuls change."""
    case = tp.case("tunix", "llama3")
    state = case.state(POLICIES["float16"], optax.adam(1e-3))
    rows = jaxamp.precision_table(case.train_step(), state, case.batch)
    q = "layers/1/attn/q_proj"
    assert {(r["module"], r["op"]) for r in rows} >= {(q, "matmul"), ("layers/0/attn/q_proj",
                                                                      "matmul")}
    for key in (q, f"Llama3/{q}"):
        over = jaxamp.precision_table(case.train_step(overrides={key: "float32"}), state,
                                      case.batch)
        matmuls = {r["module"]: r["forward"] for r in over if r["op"] == "matmul"}
        assert matmuls.pop(q) == "float32"
        assert set(matmuls.values()) == {"float16"}, matmuls
