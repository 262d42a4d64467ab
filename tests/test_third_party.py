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
import jax.numpy as jnp
import numpy as np
import pytest
import third_party as tp
from corpus import POLICIES, measure_third_party, problems

import jaxamp
from jaxamp._engine.jaxpr import duplicate_casts, iter_eqns, lossy_round_trips

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


# ---- cast elimination with recompute on and off (issue #40) ---------------------------------
RECOMPUTE = {"on": jaxamp.DEFAULT_OP_RULES.extend(recompute=True),
             "off": jaxamp.DEFAULT_OP_RULES.extend(recompute=False)}


def cast_checks(closed) -> tuple[int, int, int]:
    """(values cast twice to one dtype, float32 -> low -> float32 round trips, casts between
    float16 and bfloat16) of a forward program, read across its recompute segments'
    checkpoints and its shared calls."""
    low_to_low = [e for e in iter_eqns(closed) if e.primitive.name == "convert_element_type"
                  and {str(e.invars[0].aval.dtype), str(e.outvars[0].aval.dtype)}
                  == {"float16", "bfloat16"}]
    return len(duplicate_casts(closed)), len(lossy_round_trips(closed)), len(low_to_low)


@pytest.mark.parametrize("recompute", list(RECOMPUTE))
@pytest.mark.parametrize("dtype", list(POLICIES))
@pytest.mark.parametrize("library,name", CASES, ids=[f"{lib}-{n}" for lib, n in CASES])
def test_third_party_forward_casts_each_value_once(library, name, dtype, recompute):
    """tunix's Gemma2 cast its pre-FFW norm's output twice with recompute on: once in the
    segment that ends in the norm, once more in the shared feed-forward call (issue #40)."""
    case = tp.case(library, name)
    params, f = case.functional()
    amp = jaxamp.autocast(f, POLICIES[dtype], op_rules=RECOMPUTE[recompute])
    assert cast_checks(jax.make_jaxpr(amp)(params, case.batch)) == (0, 0, 0)


def _transformers_model(name: str):
    """A tiny transformers Flax model (transformers < 5: version 5 removed them)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "FlaxGPT2LMHeadModel"):
        pytest.skip(f"transformers {transformers.__version__} has no Flax models")
    if name == "gpt2":
        return transformers.FlaxGPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=64), seed=0)
    return transformers.FlaxBertForMaskedLM(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        max_position_embeddings=16, vocab_size=64), seed=0)


@pytest.mark.parametrize("recompute", list(RECOMPUTE))
@pytest.mark.parametrize("dtype", list(POLICIES))
@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_transformers_flax_forward_casts_each_value_once(name, dtype, recompute):
    """transformers' Flax GPT-2 and BERT, unmodified, where transformers < 5 is installed (CI
    does not: tests/test_engine_regressions.py has their patterns in small linen modules).
    BERT's post-LN output, read by the FFN matmul and by the next segment's residual add, was
    cast twice with recompute on (issue #40)."""
    model = _transformers_model(name)
    ids = jax.random.randint(jax.random.key(0), (2, 9), 0, 64)

    def loss(params, ids):
        logits = model(ids[:, :-1], params=params).logits
        return jaxamp.softmax_cross_entropy(logits, ids[:, 1:])

    amp = jaxamp.autocast(loss, POLICIES[dtype], op_rules=RECOMPUTE[recompute])
    closed = jax.make_jaxpr(amp)(model.params, ids)
    assert cast_checks(closed) == (0, 0, 0)
    assert {str(e.outvars[0].aval.dtype) for e in iter_eqns(closed)
            if e.primitive.name == "dot_general"} == {dtype}
    assert jnp.isfinite(jax.jit(amp)(model.params, ids))
