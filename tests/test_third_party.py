"""Models of third-party libraries, unmodified (tests/third_party.py): tunix's NNX Llama3,
Qwen3, Qwen3-MoE and Gemma2, and eqx-zoo's Equinox Qwen3, under float16 and bfloat16.

Per model and policy, against the same model in float32 (the numbers CORPUS.md's third-party
table shows, from ``tests/corpus.py``): every matmul of forward and backward in the compute
dtype, exp/log/rsqrt and every sum of the forward in float32, no lossy round trip, no value
cast twice, no cast between float16 and bfloat16, no unclassified primitive; loss within 2% and
gradient cosine >= 0.99 (as ``problems`` checks: tighter); five train steps that reduce the
loss. The audit of the train step finds nothing and its reference table agrees, and every
module path any report prints (precision table, audit rows, findings, reference rows,
matmuls, overflow report) is a valid ``overrides=`` key, as printed and with the root class
in front. Each test skips where its library is not installed (eqx-zoo needs Python 3.12).
"""

from __future__ import annotations

import warnings

import jax
import numpy as np
import optax
import pytest
import third_party as tp
from corpus import POLICIES, measure_third_party, problems

import jaxamp

CASES = list(tp.THIRD_PARTY)
NOT_PATHS = {"(top level)", "(output)", "(params)", "(train step)"}


@pytest.mark.parametrize("dtype", list(POLICIES))
@pytest.mark.parametrize("library,name", CASES, ids=[f"{lib}-{n}" for lib, n in CASES])
def test_third_party_model_under_amp(library, name, dtype):
    tp.case(library, name)  # skips where the library is not installed
    row = measure_third_party(library, name, dtype)
    assert row["matmuls"] > 0 and row["sensitive"] > 0  # the program was read at all
    assert row["low_matmuls"] == row["matmuls"], row
    assert row["sensitive_f32"] == row["sensitive"], row["sensitive_not_f32"]
    assert (row["round_trips"], row["duplicate_casts"], row["low_to_low"]) == (0, 0, 0), row
    assert row["unknown"] == []
    assert row["loss_diff"] <= 0.02 and row["grad_cos"] >= 0.99, row
    assert row["losses"][5] < row["losses"][0], row["losses"]  # five steps reduce the loss
    assert problems(row) == []


def _printed_paths(*reports) -> set[str]:
    """Every module path the reports print (rows, findings, reference rows, matmuls)."""
    paths = set()
    for rep in reports:
        if isinstance(rep, jaxamp.AuditReport):
            paths |= {r["module"] for r in rep.rows}
            paths |= {f.module for f in rep.findings}
            paths |= {m for r in rep.reference_table() for m in r["modules"]}
            paths |= {m["module"] for m in rep.matmuls}
        elif isinstance(rep, jaxamp.OverflowReport):
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
    reports = [report, jaxamp.precision_table(step, state, case.batch)]
    if dtype == "float16":
        reports.append(jaxamp.locate_overflow(step, state, case.batch))
    paths = _printed_paths(*reports)
    if case.kind == "equinox":  # no Flax modules: everything is top level
        assert paths == set(), paths
        return
    root = type(case.model).__name__
    assert root in paths and "layers/0" in paths and "layers/1/attn" in paths, sorted(paths)
    # structure, not jax.named_scope: no 'attention', 'einsum', 'rms_norm' scope in a path
    assert not any(s in p.split("/") for p in paths for s in ("attention", "einsum",
                                                               "rms_norm")), sorted(paths)
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


def test_tunix_models_need_no_tunix_package_init():
    """The bare import runs none of tunix's package ``__init__`` (transformers, grain, ...)."""
    tp.case("tunix", "llama3")
    import sys
    assert "tunix.models.llama3.model" in sys.modules
    assert not hasattr(sys.modules["tunix"], "__version__")  # its __init__ sets it
    assert "transformers" not in sys.modules and "grain" not in sys.modules


@pytest.mark.parametrize("library,name", [("tunix", "llama3"), ("eqx-zoo", "qwen3")])
def test_float32_reference_is_the_library_model(library, name):
    """The functional form the references differentiate is the model itself: same loss as
    calling the library's model directly (no constant-factor slip in the harness)."""
    case = tp.case(library, name)
    params, f = case.functional()
    direct = float(case.loss(case.model, case.batch))
    assert float(f(params, case.batch)) == pytest.approx(direct, rel=1e-6)
    # dummy weights of std 0.4: logits of a real size, so the loss is far from log(vocab)
    assert abs(direct - np.log(tp.VOCAB)) > 0.3
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))
