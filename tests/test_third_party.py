"""Models of third-party libraries, unmodified (tests/third_party.py): tunix's NNX Llama3,
Qwen3, Qwen3-MoE and Gemma2, and eqx-zoo's Equinox Qwen3, under float16 and bfloat16.

Per model and policy, against the same model in float32 (the numbers CORPUS.md's third-party
table shows, from ``tests/corpus.py``): every matmul of forward and backward in the compute
dtype, exp/log/rsqrt and every sum of the forward in float32, no lossy round trip, no value
cast twice, no cast between float16 and bfloat16, no unclassified primitive; loss within 2% and
gradient cosine >= 0.99 (as ``problems`` checks: tighter); five train steps that reduce the
loss (tests/test_third_party_audit.py: the diagnostics on the same models). Each test skips
where its library is not installed (eqx-zoo needs Python 3.12).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import third_party as tp
from corpus import POLICIES, measure_third_party, problems

CASES = list(tp.THIRD_PARTY)


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
