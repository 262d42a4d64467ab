"""The audit decides what a normalisation layer is by the engine's own rule (GitHub issues #23,
#26): a class in ``jaxamp.FP32_MODULES``, not a class *named* like a norm. Look-alikes of
transformers' Flax ``FlaxWav2Vec2EncoderLayerStableLayerNorm`` (a whole pre-LN encoder layer)
and ``FlaxConvWithWeightNorm`` (a weight-normalised convolution), with the exact (erf) GELU that
HF's ``"gelu"`` activation is, audit clean; a LayerNorm planted in float16 is still found.
Tracing only."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import jaxamp

gelu = functools.partial(nn.gelu, approximate=False)  # transformers' ACT2FN["gelu"] in Flax


class FlaxConvWithWeightNorm(nn.Module):
    """As transformers' wav2vec2 positional convolution: weight = g * v / ||v||."""

    features: int = 16
    kernel: int = 4

    @nn.compact
    def __call__(self, x):
        v = self.param("weight_v", nn.initializers.normal(0.02),
                       (self.kernel, x.shape[-1], self.features))
        g = self.param("weight_g", nn.initializers.ones, (1, 1, self.features))
        b = self.param("bias", nn.initializers.zeros, (self.features,))
        w = g * v / jnp.linalg.norm(v, axis=(0, 1), keepdims=True)
        y = jax.lax.conv_general_dilated(x, w, (1,), "SAME",
                                         dimension_numbers=("NWC", "WIO", "NWC"))
        return gelu(y + b)


class FlaxWav2Vec2FeedForward(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = gelu(nn.Dense(4 * x.shape[-1], name="intermediate_dense")(x))
        return nn.Dense(x.shape[-1], name="output_dense")(h)


class FlaxWav2Vec2EncoderLayerStableLayerNorm(nn.Module):
    """A pre-LN encoder layer named as transformers names it: attention, dropout, LayerNorms,
    feed-forward."""

    heads: int = 2

    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        h = nn.LayerNorm(name="layer_norm")(x)
        h = nn.MultiHeadDotProductAttention(num_heads=self.heads, name="attention")(h, h)
        x = x + nn.Dropout(0.1, deterministic=deterministic)(h)
        h = FlaxWav2Vec2FeedForward(name="feed_forward")(nn.LayerNorm(name="final_layer_norm")(x))
        return x + h


class Encoder(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = x + FlaxConvWithWeightNorm(x.shape[-1], name="pos_conv_embed")(x)
        for i in range(2):
            x = FlaxWav2Vec2EncoderLayerStableLayerNorm(name=f"layers_{i}")(x)
        return nn.LayerNorm(name="layer_norm")(x)


@pytest.fixture(scope="module")
def encoder():
    model = Encoder()
    x = jax.ShapeDtypeStruct((2, 8, 16), jnp.float32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros(x.shape)))["params"]

    def loss(p, x):
        return jnp.mean(model.apply({"params": p}, x) ** 2)

    return params, x, loss


@pytest.mark.parametrize("policy", ["p=f32,c=f16,o=f32", "p=f32,c=bf16,o=f32"])
def test_hf_style_encoder_layers_audit_clean(encoder, policy):
    params, x, loss = encoder
    report = jaxamp.audit(loss, params, x, policy=policy)
    assert report.findings == [], report.to_markdown()
    # the exact GELU's erf ran in the compute dtype (forward and backward), as autocast runs it
    low = policy.split("c=")[1].split(",")[0].replace("f16", "float16").replace("bf16",
                                                                              "bfloat16")
    rows = {(r["module"], r["op"]): r for r in report.rows}
    assert low in rows[("layers_0/feed_forward", "elementwise")]["backward"]
    # ... and the rows that are normalisation are exactly the LayerNorms
    norm = {r["module"] for r in report.rows if r.get("category") == "normalisation"}
    assert norm == {"layer_norm", "layers_0/layer_norm", "layers_0/final_layer_norm",
                    "layers_1/layer_norm", "layers_1/final_layer_norm"}
    ref = {r["row"]: r for r in report.reference_table()}
    assert ref["LayerNorm"]["ok"] is True
    assert "layers_0" not in ref["LayerNorm"]["modules"]


def test_a_planted_float16_layer_norm_is_still_found(encoder):
    params, x, loss = encoder
    # a LayerNorm set to float16, under op rules that let its statistics follow (what a
    # model cast wholesale with .astype(jnp.float16) computes)
    rules = jaxamp.DEFAULT_OP_RULES.extend(promote={"reduce_sum", "rsqrt"})
    report = jaxamp.audit(loss, params, x, policy="p=f32,c=f16,o=f32", op_rules=rules,
                          overrides={"layers_1/final_layer_norm": "float16"})
    norms = [f for f in report.findings if f.kind == "normalisation_low_precision"]
    assert [f.module for f in norms] == ["layers_1/final_layer_norm"], report.to_markdown()
    assert norms[0].reference_row == "LayerNorm"
    assert "(forward, float16)" in norms[0].detail
    ref = {r["row"]: r for r in report.reference_table()}
    assert ref["LayerNorm"]["ok"] is False and "float16" in ref["LayerNorm"]["forward"]


def test_a_bounded_exp_is_not_a_softmax_but_a_real_one_is():
    """exp(-x**2) (erf's derivative) lies in [0, 1]; exp(x) in float16 is the softmax risk."""
    class Gauss(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(8)(x)
            return nn.Dense(2)(jnp.exp(-h * h))  # an RBF written by hand: (-h) * h

    class Raw(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(jax.lax.exp(nn.Dense(8)(x)))

    x = jnp.ones((2, 3))
    rules = jaxamp.DEFAULT_OP_RULES.extend(promote={"exp"})  # exp runs in the compute dtype
    for model, expected in ((Gauss(), set()), (Raw(), {"softmax_low_precision"})):
        params = model.init(jax.random.key(0), x)["params"]
        report = jaxamp.audit(lambda p, x, m=model: jnp.mean(m.apply({"params": p}, x)), params, x,
                              policy="p=f32,c=f16,o=f32", op_rules=rules)
        assert report.kinds() == expected, report.to_markdown()
