"""FP8 recipes (issue #43): ``fp8=rowwise`` against an independent quantise-dequantise reference
(forward, dgrad, wgrad), through the engine, on a model we did not write (tunix's Llama3)
against float32, and the size threshold ``FP8Matmuls(min_size=)`` chosen from the H200
estimate."""

from __future__ import annotations

import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxamp
from jaxamp.fp8 import fp8_dot_general, fp8_eligible

sys.path.insert(0, str(Path(__file__).parent))
import fp8_reference  # noqa: E402
import third_party as tp  # noqa: E402

BF16 = "params=float32,compute=bfloat16,output=float32"
E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
#: every aligned matmul in FP8 (these models are far below the default size threshold)
ALL = jaxamp.DEFAULT_OP_RULES.extend(handlers={"dot_general": jaxamp.FP8Matmuls(
    small=(0, 0), min_size=0)})


def _ref(x, dtype, axis=None):
    """``x`` quantised to ``dtype`` and dequantised by :func:`fp8_reference.quantize` (written
    without jaxamp), one scale per ``axis``-reduced amax (all axes: per tensor)."""
    q, scale = fp8_reference.quantize(x, dtype, axis=axis)
    return q * scale


def _rows_apart():
    """x, w, g whose rows (and w's columns) differ by orders of magnitude: one scale per
    tensor flushes the small ones, one per row does not."""
    k = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(k[0], (48, 32)) * jnp.logspace(-4, 2, 48)[:, None]
    w = jax.random.normal(k[1], (32, 64)) * jnp.logspace(-3, 1, 64)[None, :]
    g = jax.random.normal(k[2], (48, 64)) * jnp.logspace(-6, -1, 48)[:, None]
    return x, w, g


def test_rowwise_matmul_equals_the_reference_forward_dgrad_and_wgrad():
    """Forward: x per row (amax over K), w per column; dgrad: g per row (over N), w per row;
    wgrad: x and g per column (over the tokens M), as torchao's rowwise recipe quantises."""
    x, w, g = _rows_apart()
    dims = (((1,), (0,)), ((), ()))
    y, vjp = jax.vjp(lambda a, b: fp8_dot_general(a, b, dims, compute_dtype=jnp.float32,
                                                  recipe="rowwise"), x, w)
    dx, dw = vjp(g)
    want_y = _ref(x, E4M3, 1) @ _ref(w, E4M3, 0)
    want_dx = _ref(g, E4M3, 1) @ _ref(w, E4M3, 1).T  # E4M3 gradients, as torchao's rowwise
    want_dw = _ref(x, E4M3, 0).T @ _ref(g, E4M3, 0)
    for got, want in ((y, want_y), (dx, want_dx), (dw, want_dw)):
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6 * np.abs(want).max())
    # per tensor, the small rows lose most of their digits: rowwise keeps them
    small = slice(0, 8)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    tensorwise = fp8_dot_general(x, w, dims, compute_dtype=jnp.float32)

    def err(a):
        return np.linalg.norm(np.asarray(a)[small] - exact[small]) / np.linalg.norm(
            exact[small])
    assert err(y) < 0.05 < 0.3 < err(tensorwise)


def test_rowwise_with_the_weight_first_and_a_3d_activation_puts_the_axes_back():
    """An einsum ``kn,btk->nbt`` (the activation is the rhs, two free dims): the same numbers
    as the 2-D matmul, in the traced layout, forward and both gradients."""
    x, w, g = _rows_apart()
    dims = (((1,), (0,)), ((), ()))
    _, vjp = jax.vjp(lambda a, b: fp8_dot_general(a, b, dims, compute_dtype=jnp.float32,
                                                  recipe="rowwise"), x, w)
    dx, dw = vjp(g)
    x3, g3 = x.reshape(4, 12, 32), jnp.transpose(g.reshape(4, 12, 64), (2, 0, 1))
    y3, vjp3 = jax.vjp(lambda b, a: fp8_dot_general(
        b, a, (((0,), (2,)), ((), ())), compute_dtype=jnp.float32, recipe="rowwise",
        activation=1), w, x3)
    dw3, dx3 = vjp3(g3)
    want = np.einsum("kn,btk->nbt", _ref(w, E4M3, 0), _ref(x3, E4M3, 2))
    np.testing.assert_allclose(y3, want, rtol=2e-6, atol=1e-6 * np.abs(want).max())
    assert dx3.shape == x3.shape and dw3.shape == w.shape
    np.testing.assert_array_equal(dx3, dx.reshape(4, 12, 32))
    np.testing.assert_allclose(dw3, dw, rtol=1e-6, atol=1e-7 * np.abs(dw).max())


def test_rowwise_zero_rows_stay_zero_and_bad_recipes_are_refused():
    x = jnp.zeros((16, 32)).at[3].set(2.0)
    y = fp8_dot_general(x, jnp.ones((32, 16)), (((1,), (0,)), ((), ())),
                        compute_dtype=jnp.float32, recipe="rowwise")
    assert np.all(np.isfinite(y)) and float(y[3, 0]) == 64.0 and float(jnp.abs(y).sum()) == 1024
    with pytest.raises(ValueError, match=r"recipe='rowwise' takes no batch dimensions, got "
                                         r"\(0,\).*use recipe='current'"):
        fp8_dot_general(jnp.ones((2, 16, 16)), jnp.ones((2, 16, 16)),
                        (((2,), (1,)), ((0,), (0,))), compute_dtype=jnp.float32,
                        recipe="rowwise")
    with pytest.raises(ValueError, match=r"recipe must be one of \('current', 'rowwise'"):
        fp8_dot_general(jnp.ones((16, 16)), jnp.ones((16, 16)), (((1,), (0,)), ((), ())),
                        compute_dtype=jnp.float32, recipe="colwise")


class _Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(64, use_bias=False, name="fc")(x))
        return nn.Dense(32, use_bias=False, name="proj")(h)


def test_the_step_runs_each_recipe_where_the_policy_and_overrides_say():
    """StableHLO: the rowwise dots read FP8 and their scales are vectors (one per row); the
    audit lists each matmul's recipe; an ``fp8=`` override changes one module only."""
    model = _Mlp()
    x = jax.random.normal(jax.random.key(0), (16, 32))
    params = model.init(jax.random.key(1), x)
    rules = jaxamp.DEFAULT_OP_RULES.extend(handlers={"dot_general": jaxamp.FP8Matmuls(
        small=(0, 0), min_size=0, keep_first_last=False)})

    def loss(params, x):
        return jnp.mean(model.apply(params, x).astype(jnp.float32) ** 2)
    policy = BF16 + ",matmul=float8,fp8=rowwise"
    report = jaxamp.audit(loss, params, x, policy=policy, op_rules=rules,
                          overrides={"proj": "fp8=current"})
    assert [(m["module"], m["fp8"], m["recipe"]) for m in report.matmuls] == [
        ("fc", "yes", "rowwise"), ("proj", "yes", "current")]
    assert "| fc | 16x32 @ 32x64 | float8_e4m3fn -> bfloat16 | yes | rowwise |" in \
        report.to_markdown()
    amp = jaxamp.autocast(loss, policy, op_rules=rules)
    text = jax.jit(jax.grad(amp)).lower(params, x).as_text()
    f8_dots = [line for line in text.splitlines()
               if "dot_general" in line and "f8E4M3FN" in line.split("->")[0]]
    # forward and wgrad of both, dgrad of proj (fc's input is not differentiated)
    assert len(f8_dots) == 5, f8_dots
    y = jax.jit(amp)(params, x)
    ref = loss(params, x)
    assert abs(float(y) - float(ref)) / float(ref) < 0.05


def _forward_only_fp8(lhs, rhs, dimension_numbers, **kwargs):
    """``fp8_dot_general``'s forward with the exact backward of the plain dot: what the
    gradient would be if no backward recipe rounded anything."""
    @jax.custom_vjp
    def dot(a, b):
        return fp8_dot_general(a, b, dimension_numbers, **kwargs)

    def bwd(res, g):
        a, b = res
        _, vjp = jax.vjp(lambda a, b: jax.lax.dot_general(
            a, b, dimension_numbers, preferred_element_type=jnp.float32), a, b)
        da, db = vjp(g.astype(jnp.float32))
        return da.astype(a.dtype), db.astype(b.dtype)

    dot.defvjp(lambda a, b: (dot(a, b), (a, b)), bwd)
    return dot(lhs, rhs)


def test_tunix_llama3_in_fp8_stays_close_to_float32_for_every_recipe(monkeypatch):
    """A model we did not write, every projection but the first and the head in FP8, against
    float32: loss within 2% for both recipes. The gradient cosine (bf16: 0.9998) is 0.981 with
    current's E5M2 gradients and 0.987 with rowwise's E4M3 ones, short of the issue's 0.99; with
    the forward alone in FP8 (the backward exact) it is 0.989: on this 64-wide model E4M3's
    3-bit mantissa in every forward projection is already below 0.99, whatever the backward
    does (BENCHMARKS.md, "FP8 recipes"). Asserted at what it is, so a regression shows."""
    case = tp.case("tunix", "llama3")
    params, f = case.functional()
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(f))(params, case.batch)

    def cosine(recipe):
        amp = jaxamp.autocast(f, f"{BF16},matmul=float8,fp8={recipe}", op_rules=ALL)
        lowered = jax.jit(jax.value_and_grad(amp)).lower(params, case.batch)
        assert lowered.as_text().count("f8E4M3FN") > 20  # its projections did run in FP8
        loss, grads = lowered.compile()(params, case.batch)
        assert abs(float(loss) - float(ref_loss)) / float(ref_loss) < 0.02, recipe
        got, ref = (np.concatenate([np.ravel(np.asarray(g, np.float64))
                                    for g in jax.tree.leaves(t)]) for t in (grads, ref_grads))
        return got @ ref / (np.linalg.norm(got) * np.linalg.norm(ref))

    cosines = {recipe: cosine(recipe) for recipe in ("current", "rowwise")}
    monkeypatch.setattr(jaxamp.fp8, "fp8_dot_general", _forward_only_fp8)
    cosines["forward only"] = cosine("current")
    assert 0.978 <= cosines["current"] < cosines["rowwise"] < cosines["forward only"] < 0.99, \
        cosines


@pytest.mark.skipif(not tp.installed("tunix"), reason="tunix is not installed (.ci/run has it)")
def test_tunix_llama3_at_llama_1b_widths_under_the_default_policy_stays_close_to_float32():
    """The issue's tunix Llama at the widths FP8 is for: Llama 3.2 1B's layers (d 2048, MLP
    8192, 32/8 heads; 1 of them, vocabulary 512), tunix's own dummy weights (std 0.02), under
    plain ``matmul=float8``, so the default eligibility decides: q, o, gate, up and down in
    FP8 (k/v, N = 512, and the first matmul stay bf16). Loss within 2% and gradient cosine
    >= 0.99 of float32 for each recipe, overall and for every parameter (each projection's
    weight gradient reads 0.996-0.998)."""
    from flax import nnx

    from jaxamp.diagnostics._hlo import planned_fp8_dots

    m = tp.import_bare("tunix.models.llama3.model")
    creator = tp.import_bare("tunix.models.dummy_model_creator")
    config = m.ModelConfig(num_layers=1, vocab_size=512, embed_dim=2048, hidden_dim=8192,
                           num_heads=32, head_dim=64, num_kv_heads=8, rope_theta=500_000,
                           norm_eps=1e-5, weight_tying=True)
    model = creator.create_dummy_model(m.Llama3, config, random_seed=1)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ids = jax.random.randint(jax.random.key(2), (2, 65), 0, 512)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:]}

    def f(params, batch):
        return tp._tunix_loss(nnx.merge(graphdef, params, rest, copy=True), batch)

    ref_loss, ref_grads = jax.jit(jax.value_and_grad(f))(params, batch)
    ref = [np.ravel(np.asarray(g, np.float64)) for g in jax.tree.leaves(ref_grads)]

    def cos(a, b):
        return a @ b / (np.linalg.norm(a) * np.linalg.norm(b))

    for recipe in ("current", "rowwise"):
        amp = jaxamp.autocast(f, f"{BF16},matmul=float8,fp8={recipe}")
        lowered = jax.jit(jax.value_and_grad(amp)).lower(params, batch)
        # 4 projections (5, less the first) x forward, dgrad, wgrad
        assert len(planned_fp8_dots(lowered.as_text())) == 12, recipe
        loss, grads = lowered.compile()(params, batch)
        assert abs(float(loss) - float(ref_loss)) / float(ref_loss) < 0.02, recipe
        got = [np.ravel(np.asarray(g, np.float64)) for g in jax.tree.leaves(grads)]
        assert cos(np.concatenate(got), np.concatenate(ref)) >= 0.99, recipe
        worst = min(cos(a, b) for a, b in zip(got, ref))
        assert worst >= 0.99, (recipe, worst)


# ---- the size threshold: min(K, N) >= 2048 by the H200 estimate (BENCHMARKS.md) ------------


@pytest.mark.parametrize(("k", "n", "reason"), [
    (768, 2048, "small"),     # gpt2-small's MLP up-projection: loses by the estimate
    (2048, 768, "small"),     # and its down-projection (torchao's K <= 1024 rule kept it)
    (2048, 512, "small"),     # Llama 3.2 1B's k/v projections (GQA): lose a little
    (2048, 2048, None),       # its q/o projections
    (2048, 8192, None),       # its MLP
    (8192, 2048, None),
])
def test_the_default_size_threshold_is_min_k_n_2048(k, n, reason):
    rule = jaxamp.FP8Matmuls()
    assert rule.min_size == 2048
    dims = (((1,), (0,)), ((), ()))
    assert fp8_eligible((8192, k), (k, n), dims, small=rule.small,
                        min_size=rule.min_size) == reason
    # min_size=0 with small=(0, 0): every aligned matmul
    assert fp8_eligible((8192, k), (k, n), dims, small=(0, 0), min_size=0) is None


def test_a_bad_min_size_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"min_size must be an int >= 0, got -1\. Example: "
                                         r"FP8Matmuls\(min_size=0\)"):
        jaxamp.FP8Matmuls(min_size=-1)
    with pytest.raises(ValueError, match=r"min_size must be an int >= 0, got '2048'"):
        jaxamp.FP8Matmuls(min_size="2048")


def test_audit_reads_the_default_threshold_on_a_wide_and_a_narrow_layer():
    """Through the engine with the default rule: the 2048 x 2048 layer runs in FP8, the
    2048 -> 512 one (a GQA k/v projection's shape) stays bf16 with reason ``small``."""

    class Wide(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(2048, use_bias=False, name="inp")(x)
            y = nn.Dense(2048, use_bias=False, name="q")(x)
            z = nn.Dense(512, use_bias=False, name="kv")(x)
            return nn.Dense(16, use_bias=False, name="head")(y[:, :512] + z)

    model = Wide()
    x = jnp.ones((16, 2048))
    params = jax.eval_shape(model.init, jax.random.key(0), x)
    params = jax.tree.map(lambda s: jnp.full(s.shape, 1e-2, s.dtype), params)
    report = jaxamp.audit(lambda p, x: jnp.sum(model.apply(p, x).astype(jnp.float32)), params,
                          x, policy=BF16 + ",matmul=float8")
    assert [(m["module"], m["fp8"], m["reason"]) for m in report.matmuls] == [
        ("inp", "no", "first"), ("q", "yes", ""), ("kv", "no", "small"), ("head", "no", "last")]
