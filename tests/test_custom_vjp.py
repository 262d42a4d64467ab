"""``jax.custom_vjp`` functions under autocast: both rules run under the region's policy.

A hand-written attention kernel with its own backward (the way flash-attention ports are
written) and a straight-through activation whose custom gradient differs from autodiff's: the
matmuls of forward and backward run in the compute dtype, the softmax in float32, the custom
rule is kept (the straight-through gradient is not autodiff's zero), gradients agree with
float32, and ``OpRules.custom_vjp_as_traced`` opts a function out.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp._engine.jaxpr import iter_eqns

F16 = "params=float32,compute=float16,output=float32"
BF16 = "params=float32,compute=bfloat16,output=float32"


@jax.custom_vjp
def attention(q, k, v):
    p = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k) / np.sqrt(q.shape[-1]), axis=-1)
    return jnp.einsum("bqk,bkd->bqd", p, v)


def _attention_fwd(q, k, v):
    p = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k) / np.sqrt(q.shape[-1]), axis=-1)
    return jnp.einsum("bqk,bkd->bqd", p, v), (q, k, v, p)


def _attention_bwd(res, g):
    q, k, v, p = res
    dv = jnp.einsum("bqk,bqd->bkd", p, g)
    dp = jnp.einsum("bqd,bkd->bqk", g, v)
    ds = p * (dp - jnp.sum(p * dp, axis=-1, keepdims=True)) / np.sqrt(q.shape[-1])
    return jnp.einsum("bqk,bkd->bqd", ds, k), jnp.einsum("bqk,bqd->bkd", ds, q), dv


attention.defvjp(_attention_fwd, _attention_bwd)


@jax.custom_vjp
def quantize_ste(x):
    """Rounds to quarters; the straight-through estimator passes the gradient unchanged
    (autodiff of the rounding would give zero)."""
    return jnp.round(x * 4.0) / 4.0


quantize_ste.defvjp(lambda x: (quantize_ste(x), None), lambda _, g: (g,))


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        q, k, v = (nn.Dense(16, name=n)(x) for n in ("q", "k", "v"))
        h = nn.Dense(16, name="out")(attention(q, k, v))
        return nn.Dense(1, name="head")(quantize_ste(h))


@pytest.fixture(scope="module")
def setup():
    model = Net()
    x = jax.random.normal(jax.random.key(0), (2, 8, 16))
    params = model.init(jax.random.key(1), x)["params"]

    def loss(p, x):
        return jnp.mean(model.apply({"params": p}, x) ** 2)

    return loss, params, x


def _dtypes(jaxpr, prim):
    return [tuple(str(v.aval.dtype) for v in e.invars) for e in iter_eqns(jaxpr)
            if e.primitive.name == prim]


@pytest.mark.parametrize("policy", [F16, BF16])
def test_custom_vjp_rules_run_under_the_policy(setup, policy):
    loss, params, x = setup
    low = str(jnp.dtype(jaxamp.get_policy(policy).compute_dtype))
    amp = jaxamp.autocast(loss, policy)
    jaxpr = jax.make_jaxpr(jax.value_and_grad(amp))(params, x)
    dots = _dtypes(jaxpr, "dot_general")
    # 4 Dense forward + 2 attention forward; backward: 4 x 2 Dense + 4 in _attention_bwd
    assert len(dots) >= 6 + 8 + 4
    assert all(d == (low, low) for d in dots), dots
    assert _dtypes(jaxpr, "exp") and all(d == ("float32",) for d in _dtypes(jaxpr, "exp"))
    assert all(d == ("float32",) for d in _dtypes(jaxpr, "reduce_sum"))

    (l_amp, g_amp) = jax.jit(jax.value_and_grad(amp))(params, x)
    (l_ref, g_ref) = jax.jit(jax.value_and_grad(loss))(params, x)
    np.testing.assert_allclose(l_amp, l_ref, rtol=3e-2)
    a = np.concatenate([np.ravel(v) for v in jax.tree.leaves(g_amp)])
    b = np.concatenate([np.ravel(v) for v in jax.tree.leaves(g_ref)])
    assert a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) > 0.999
    assert jax.tree.map(lambda g: g.dtype, g_amp) == jax.tree.map(lambda g: g.dtype, g_ref)


def test_custom_rule_is_kept(setup):
    """The straight-through gradient reaches every layer below quantize_ste; autodiff of the
    rounding (a rule lost on the way) would make all of them exactly zero."""
    loss, params, x = setup
    g = jax.jit(jax.grad(jaxamp.autocast(loss, F16)))(params, x)
    ref = jax.jit(jax.grad(loss))(params, x)
    for name in ("q", "k", "v", "out"):
        assert float(jnp.abs(g[name]["kernel"]).max()) > 0
        np.testing.assert_allclose(g[name]["kernel"], ref[name]["kernel"], rtol=0.1,
                                   atol=2e-2 * float(jnp.abs(ref[name]["kernel"]).max()))


def test_custom_vjp_as_traced_opts_a_function_out(setup):
    loss, params, x = setup
    amp = jaxamp.autocast(
        loss, F16, op_rules=jaxamp.DEFAULT_OP_RULES.extend(custom_vjp_as_traced={"attention"}))
    dots = _dtypes(jax.make_jaxpr(jax.value_and_grad(amp))(params, x), "dot_general")
    f32 = [d for d in dots if d == ("float32", "float32")]
    assert len(f32) == 2 + 4  # attention's own forward and backward matmuls, as written
    assert len(dots) - len(f32) >= 4 + 8  # the Dense layers stay float16
    everything = jaxamp.autocast(
        loss, F16, op_rules=jaxamp.DEFAULT_OP_RULES.extend(custom_vjp_as_traced={"*"}))
    jaxpr = jax.make_jaxpr(jax.value_and_grad(everything))(params, x)
    assert len([d for d in _dtypes(jaxpr, "dot_general") if d == ("float32",) * 2]) == 6
    np.testing.assert_allclose(jax.jit(amp)(params, x), loss(params, x), rtol=3e-2)


@pytest.mark.parametrize("bad", ["attention", [1]])
def test_custom_vjp_as_traced_rejects_bad_values(bad):
    with pytest.raises(TypeError, match="custom_vjp_as_traced= must be a collection of names"):
        jaxamp.DEFAULT_OP_RULES.extend(custom_vjp_as_traced=bad)
