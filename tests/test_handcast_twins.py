"""The hand-cast twins (``bench/lm_handcast.py``, ``bench/llama_handcast.py``): the references
``bench/gpu_estimate.py`` compares jaxamp's programs to on the example's GPT and tunix's Llama3.

A twin must be the same model (same parameter tree, the original's float32 loss from the
original's params) with the casts a careful user places: matmuls in the compute dtype, softmax
and norm statistics in float32. The dtypes are read from the lowered StableHLO (XLA:CPU's
compiled program upcasts low-precision arithmetic).
"""

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp

ROOT = Path(__file__).resolve().parents[1]
for _dir in ("bench", "examples", "tests"):
    if str(ROOT / _dir) not in sys.path:
        sys.path.insert(0, str(ROOT / _dir))

import lm_handcast  # noqa: E402
import lm_model  # noqa: E402
import third_party  # noqa: E402

LOW = {"bfloat16": "bf16", "float16": "f16"}
DOT = re.compile(r"stablehlo\.dot_general .*: \(tensor<([^>]*)>, tensor<([^>]*)>\)")
REDUCE = re.compile(r"stablehlo\.reduce\(.* applies stablehlo\.(\w+) across dimensions = "
                    r"\[([\d, ]*)\] : \(tensor<([^>]*)>")

needs_tunix = pytest.mark.skipif(not third_party.installed("tunix"),
                                 reason="tunix is not installed (.ci/run installs it)")


def dot_operand_types(text: str) -> list[tuple[str, str]]:
    """Element types of every ``dot_general``'s two operands in a lowered program."""
    return [(a.split("x")[-1], b.split("x")[-1]) for a, b in DOT.findall(text)]


def float_reductions(text: str) -> list[tuple[str, str, str]]:
    """``(kind, input shape, element type)`` of every floating-point ``reduce``."""
    out = []
    for kind, _, operand in REDUCE.findall(text):
        *shape, dtype = operand.split("x")
        if dtype.startswith(("f", "bf")):
            out.append((kind, "x".join(shape), dtype))
    return out


def tree_shapes(tree):
    return jax.tree.map(lambda x: (x.shape, x.dtype), tree)


# ---- the example's GPT (linen, nn.scan) ------------------------------------------------------

LM_CONFIG = dict(n_layer=2, n_head=2, d_model=64, block_size=32, attention="manual")


def _lm(tied: bool):
    config = lm_model.GPTConfig(**LM_CONFIG, tied=tied)
    model, params = lm_model.init_params(config, seed=0)
    ids = jax.random.randint(jax.random.key(1), (2, 33), 0, config.vocab_size)
    return config, model, params, {"inputs": ids[:, :-1], "targets": ids[:, 1:]}


def _lm_loss(model):
    return lambda params, batch: jaxamp.softmax_cross_entropy(
        model.apply({"params": params}, batch["inputs"]), batch["targets"])


@pytest.mark.parametrize("tied", [True, False])
def test_lm_twin_is_the_example_model(tied):
    """Same tree, float32 params at any compute dtype, the same init from the same seed, and
    from the example's params the example's float32 loss (bit for bit: same ops)."""
    config, model, params, batch = _lm(tied)
    ids = jnp.zeros((1, config.block_size), jnp.int32)
    for dtype in (jnp.float32, jnp.bfloat16):
        twin = lm_handcast.HandCastGPT(config, dtype)
        own = jax.jit(twin.init)(jax.random.key(0), ids)["params"]
        assert tree_shapes(own) == tree_shapes(params)  # all float32
        assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool((a == b).all()), own,
                                                params)))
    expected = float(jax.jit(_lm_loss(model))(params, batch))
    got = float(jax.jit(_lm_loss(lm_handcast.HandCastGPT(config, jnp.float32)))(params, batch))
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    for dtype in (jnp.bfloat16, jnp.float16):  # the same model in low precision
        low = float(jax.jit(_lm_loss(lm_handcast.HandCastGPT(config, dtype)))(params, batch))
        np.testing.assert_allclose(low, expected, rtol=1e-2)


def test_lm_twin_refuses_fused_attention():
    """The twin writes attention out: a fused-attention config is refused, naming the fix."""
    config = lm_model.GPTConfig(**{**LM_CONFIG, "attention": "fused"})
    ids = jnp.zeros((1, config.block_size), jnp.int32)
    with pytest.raises(ValueError, match=r"attention='fused'.*attention='manual'"):
        lm_handcast.HandCastGPT(config).init(jax.random.key(0), ids)


@pytest.mark.parametrize("compute", ["bfloat16", "float16"])
def test_lm_twin_casts(compute):
    """Lowered forward: the 7 matmuls (qkv, scores, weights @ V, proj, fc, proj in the scan
    body, the tied head) on ``compute`` operands, every float reduction (LayerNorm, softmax,
    cross-entropy) in float32; the gradient's matmuls in ``compute`` too."""
    config, _, params, batch = _lm(True)
    loss = _lm_loss(lm_handcast.HandCastGPT(config, jnp.dtype(compute)))
    low = LOW[compute]
    text = jax.jit(loss).lower(params, batch).as_text()
    assert dot_operand_types(text) == [(low, low)] * 7
    red = float_reductions(text)
    assert {dtype for *_, dtype in red} == {"f32"}
    b, h, t, d = 2, config.n_head, config.block_size, config.d_model
    assert red.count(("maximum", f"{b}x{h}x{t}x{t}", "f32")) == 1  # softmax (scan body)
    assert red.count(("add", f"{b}x{h}x{t}x{t}", "f32")) == 1
    assert red.count(("add", f"{b}x{t}x{d}", "f32")) == 6  # mean, mean of squares: ln1, ln2, ln_f
    grad_text = jax.jit(jax.grad(loss)).lower(params, batch).as_text()
    assert dot_operand_types(grad_text) == [(low, low)] * 21  # forward + two per matmul


# ---- tunix's Llama3 (NNX) -------------------------------------------------------------------

def _llama(dtype):
    """(tunix's dummy Llama3, the twin holding its params, batch, loss)."""
    from flax import nnx
    from llama_handcast import HandCastLlama3

    case = third_party.tunix_llama3()
    twin = HandCastLlama3(case.model.config, dtype=dtype, rngs=nnx.Rngs(0))
    assert jax.tree.structure(nnx.state(twin)) == jax.tree.structure(nnx.state(case.model))
    assert tree_shapes(nnx.state(twin)) == tree_shapes(nnx.state(case.model))  # all float32
    nnx.update(twin, nnx.state(case.model))
    return case.model, twin, case.batch, case.loss


def _functional(model, loss):
    from flax import nnx

    graphdef, state = nnx.split(model)
    return state, lambda s, batch: loss(nnx.merge(graphdef, s), batch)


@needs_tunix
def test_llama_twin_is_tunix_llama3():
    """The twin's nnx state is tunix's (paths, shapes, sharding metadata: the tree structures
    are equal), it initialises the same values from the same Rngs, and with tunix's params in
    float32 it gives tunix's loss; in bf16 and f16, a loss close to it."""
    from flax import nnx
    from llama_handcast import HandCastLlama3, tunix

    config = tunix.ModelConfig(num_layers=2, vocab_size=64, embed_dim=64, hidden_dim=128,
                               num_heads=4, head_dim=16, num_kv_heads=2, rope_theta=10_000,
                               norm_eps=1e-5)
    fresh, twin = (tunix.Llama3(config, rngs=nnx.Rngs(3)),
                   HandCastLlama3(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(3)))
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool((a == b).all()),
                                            nnx.state(fresh), nnx.state(twin))))
    original, twin, batch, loss = _llama(jnp.float32)
    state, f = _functional(original, loss)
    expected = float(jax.jit(f)(state, batch))
    state, f = _functional(twin, loss)
    np.testing.assert_allclose(float(jax.jit(f)(state, batch)), expected, rtol=1e-6)
    for dtype in (jnp.bfloat16, jnp.float16):
        state, f = _functional(_llama(dtype)[1], loss)
        np.testing.assert_allclose(float(jax.jit(f)(state, batch)), expected, rtol=1e-2)


@needs_tunix
@pytest.mark.parametrize("compute", ["bfloat16", "float16"])
def test_llama_twin_casts(compute):
    """Lowered forward: the 19 matmuls (q, k, v, scores, weights @ V, o, gate, up, down per
    layer, the head) on ``compute`` operands; every float reduction (RMSNorm, softmax,
    cross-entropy) in float32; the gradient's matmuls in ``compute`` too."""
    _, twin, batch, loss = _llama(jnp.dtype(compute))
    state, f = _functional(twin, loss)
    low = LOW[compute]
    text = jax.jit(f).lower(state, batch).as_text()
    assert dot_operand_types(text) == [(low, low)] * 19
    red = float_reductions(text)
    assert {dtype for *_, dtype in red} == {"f32"}
    b, t = batch["inputs"].shape
    assert red.count(("maximum", f"{b}x4x{t}x{t}", "f32")) == 2  # softmax, per layer
    assert red.count(("add", f"{b}x4x{t}x{t}", "f32")) == 2
    # the mean of squares of 5 RMSNorms (2 per layer, final) and cross-entropy's sum of
    # exponentials (this config's vocabulary, 64, is also its width)
    assert red.count(("add", f"{b}x{t}x64", "f32")) == 5 + 1
    grad_text = jax.jit(jax.grad(f)).lower(state, batch).as_text()
    assert dot_operand_types(grad_text) == [(low, low)] * 57


# ---- bench/gpu_estimate.py's hand/... variants ------------------------------------------------

@pytest.mark.parametrize(("model", "dots"), [
    ("example", 21),  # nn.scan: one body of 6 matmuls and the tied head, forward + backward
    pytest.param("llama", 3 * (12 * 9 + 1), marks=needs_tunix)])
def test_gpu_estimate_hand_variants_lower(model, dots):
    """The builders of ``hand/bfloat16`` and ``hand/float16`` lower (at their gpt2-small size,
    on abstract values: no compile): every matmul of the step on compute-dtype operands,
    float32 params, and float16's step carries jmp's loss scale and counter (2 more inputs)."""
    import gpu_estimate

    def sds(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
                            if hasattr(x, "shape") else x, tree)

    n_args = {}
    for compute in ("bfloat16", "float16"):
        lowered = gpu_estimate.BUILDERS[model](f"hand/{compute}", sds, None)()
        low = LOW[compute]
        assert dot_operand_types(lowered.as_text()) == [(low, low)] * dots
        params = lowered.args_info[0][0]
        assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
        n_args[compute] = len(jax.tree.leaves(lowered.args_info))
    assert n_args["float16"] == n_args["bfloat16"] + 2
    assert "hand/bfloat16" in gpu_estimate.MODELS[model]
    assert "hand/float16" in gpu_estimate.MODELS[model]


@needs_tunix
@pytest.mark.parametrize(("d_model", "variant", "fp8_dots"), [
    (768, "jaxamp/bfloat16", 0),
    (768, "jaxamp-fp8/bfloat16", 0),  # the default eligibility: min(K, N) < 2048 everywhere
    (768, "jaxamp-fp8all/bfloat16", 3 * 6),  # all 7 but the first (q_proj), kept bf16
    (768, "jaxamp-fp8rwall/bfloat16", 3 * 6),  # the same, rowwise
    # at d 2048 o, gate, up, down (k/v: N 512 < 2048; q: the first)
    (2048, "jaxamp-fp8/bfloat16", 3 * 4),
    (2048, "jaxamp-fp8rw/bfloat16", 3 * 4),
    (2048, "jaxamp-fp8dl/bfloat16", 3 * 4)])
def test_gpu_estimate_llama_fp8_variants_plan(d_model, variant, fp8_dots):
    """``--model llama-fp8``'s builders lower (one decoder layer, abstract values: no compile)
    with FP8 dots planned as the policy and the eligibility say: forward, dgrad and wgrad of
    each eligible projection; the tied/untied head (``last``) stays bf16."""
    import gpu_estimate

    from jaxamp.diagnostics._hlo import planned_fp8_dots

    def sds(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
                            if hasattr(x, "shape") else x, tree)

    lowered = gpu_estimate.BUILDERS["llama-fp8"](variant, sds, None, d_model=d_model,
                                                 layers=1)()
    assert len(planned_fp8_dots(lowered.as_text())) == fp8_dots
    assert variant in gpu_estimate.MODELS["llama-fp8"]
    recipes = {m.split(".", 1)[1] for m in gpu_estimate.FP8_SCOPE.findall(
        lowered.as_text(debug_info=True))}
    want = "delayed" if "fp8dl" in variant else "rowwise" if "fp8rw" in variant else "current"
    assert recipes == ({f"{want}>"} if fp8_dots else set()), recipes


@pytest.mark.parametrize("recipe", ["current", "rowwise"])
def test_gpu_estimate_reads_the_fp8_scope_the_engine_writes(recipe):
    """``breakdown()``'s FP8-scaling part is the kernels in an FP8 matmul's name scope: the
    pattern must match the scope the engine writes (it silently read 0 ms once the marks got
    their autocast call's number)."""
    import flax.linen as nn
    import gpu_estimate

    model = nn.Dense(32, use_bias=False)
    x = jnp.ones((16, 32))
    params = model.init(jax.random.key(0), x)
    rules = jaxamp.DEFAULT_OP_RULES.extend(handlers={"dot_general": jaxamp.FP8Matmuls(
        small=(0, 0), min_size=0, keep_first_last=False)})
    f = jaxamp.autocast(model.apply, f"p=f32,c=bf16,o=bf16,matmul=float8,fp8={recipe}",
                        op_rules=rules)
    names = gpu_estimate.FP8_SCOPE.findall(jax.jit(f).lower(params, x).as_text(debug_info=True))
    assert names and all(n.endswith(f".{recipe}>") for n in names)


@needs_tunix
def test_gpu_estimate_llama_with_fused_attention_is_tunix_llama_but_its_attention():
    """``--model llama-fp8-fused``: tunix's Llama3 whose attention is
    ``jax.nn.dot_product_attention`` (cuDNN's on a GPU): the same params, the same loss as
    tunix's own attention (a causal mask) to float32 rounding, FP8 planned as in tunix's."""
    import gpu_estimate

    from jaxamp.diagnostics._hlo import planned_fp8_dots

    m = third_party.import_bare("tunix.models.llama3.model")
    case = third_party.case("tunix", "llama3")
    want = float(case.loss(case.model, case.batch))
    manual = m.Attention.block
    try:
        m.Attention.block = gpu_estimate._fused_block
        got = float(case.loss(case.model, case.batch))
    finally:
        m.Attention.block = manual
    assert got == pytest.approx(want, rel=1e-5)  # (bit for bit here: XLA's own attention)

    def sds(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
                            if hasattr(x, "shape") else x, tree)
    try:
        lowered = gpu_estimate.BUILDERS["llama-fp8-fused"]("jaxamp-fp8/bfloat16", sds, None,
                                                           d_model=2048, layers=1)()
    finally:
        m.Attention.block = manual
    assert len(planned_fp8_dots(lowered.as_text())) == 3 * 4
    assert "BHGTS" not in lowered.as_text(debug_info=True)  # tunix's attention einsum is gone
