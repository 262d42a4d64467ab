"""``jax.nn.dot_product_attention`` under autocast is re-dispatched in the compute dtype.

Traced in float32 it could only take the XLA path (cuDNN's fused kernel needs float16/bfloat16,
and ``implementation="cudnn"`` refuses float32 at trace time). autocast records the call and
binds it again on low-precision query/key/value, so on a GPU the fused kernel can be chosen;
on this CPU the XLA path runs, and the tests read its dtypes from the jaxpr.
"""

from __future__ import annotations

import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp._engine import attention
from jaxamp._engine.jaxpr import iter_eqns

F16 = "params=float32,compute=float16,output=float32"
BF16 = "params=float32,compute=bfloat16,output=float32"


class FusedAttention(nn.Module):
    heads: int = 2
    implementation: str | None = None

    @nn.compact
    def __call__(self, x, bias):
        b, t, d = x.shape
        qkv = nn.Dense(3 * d, name="qkv")(x).reshape(b, t, 3, self.heads, d // self.heads)
        y = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], bias=bias,
                                         is_causal=True, implementation=self.implementation)
        return nn.Dense(d, name="proj")(y.reshape(b, t, d))


def _setup(implementation=None):
    model = FusedAttention(implementation=implementation)
    x = jax.random.normal(jax.random.key(0), (2, 8, 16))
    bias = 0.1 * jax.random.normal(jax.random.key(2), (1, 2, 8, 8))
    params = model.init(jax.random.key(1), x, bias)["params"]

    def loss(p, x, bias):
        return jnp.mean(model.apply({"params": p}, x, bias) ** 2)

    return model, params, x, bias, loss


@pytest.mark.parametrize("policy", [F16, BF16])
def test_xla_path_runs_every_matmul_in_the_compute_dtype(policy):
    """implementation=None on a CPU (and "xla" anywhere): the recorded XLA path is re-evaluated,
    so the backward matmuls are low precision too, the softmax float32."""
    _, params, x, bias, loss = _setup()
    low = jnp.dtype(jaxamp.get_policy(policy).compute_dtype)
    amp = jaxamp.autocast(loss, policy)
    jaxpr = jax.make_jaxpr(jax.value_and_grad(amp))(params, x, bias)
    dots = [e for e in iter_eqns(jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) == 4 + 2 * 4 - 1  # qkv, 2 attention, proj; backward twice each but
    # the qkv input gradient (x is not differentiated)
    assert all(v.aval.dtype == low for e in dots for v in e.invars), \
        [[str(v.aval.dtype) for v in e.invars] for e in dots]
    exps = [e for e in iter_eqns(jaxpr) if e.primitive.name == "exp"]
    assert exps and all(e.invars[0].aval.dtype == jnp.float32 for e in exps)
    l_amp, g_amp = jax.jit(jax.value_and_grad(amp))(params, x, bias)
    l_ref, g_ref = jax.jit(jax.value_and_grad(loss))(params, x, bias)
    np.testing.assert_allclose(l_amp, l_ref, rtol=3e-2)
    a = np.concatenate([np.ravel(v) for v in jax.tree.leaves(g_amp)])
    r = np.concatenate([np.ravel(v) for v in jax.tree.leaves(g_ref)])
    assert a @ r / (np.linalg.norm(a) * np.linalg.norm(r)) > 0.999


@pytest.mark.parametrize("implementation,policy,backend", [
    ("cudnn", F16, "cpu"), ("cudnn", BF16, "cpu"), (None, F16, "gpu")])
def test_cudnn_calls_are_bound_again_on_low_precision_inputs(monkeypatch, implementation,
                                                             policy, backend):
    """cuDNN's fused kernel refuses float32 at trace time (and needs a GPU). autocast traces
    the XLA path in float32 and binds the call again as cuDNN on the compute dtype; ``None``
    on a GPU asks for cuDNN too. This CPU has no cuDNN, so a spy stands in for JAX's function
    (answering through its XLA path in float32) and records what autocast asked of it."""
    _, params, x, bias, _ = _setup()
    model = FusedAttention(implementation=implementation)

    def loss(p, x, bias):
        return jnp.mean(model.apply({"params": p}, x, bias) ** 2)

    calls = []
    real = attention.ORIGINAL

    def spy(query, key, value, bias=None, mask=None, **kw):
        calls.append((kw.get("implementation"), str(query.dtype), str(key.dtype),
                      str(value.dtype), str(bias.dtype)))
        f32 = [a.astype(jnp.float32) for a in (query, key, value, bias)]  # XLA:CPU has
        out = real(*f32, mask, **dict(kw, implementation="xla"))  # no f16 x f16 -> f32 dot
        return out.astype(query.dtype)

    # the spy is installed as another library's wrapper would be: autocast records and binds
    # again through it
    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    low = str(jnp.dtype(jaxamp.get_policy(policy).compute_dtype))
    out = jax.jit(jaxamp.autocast(loss, policy))(params, x, bias)
    assert calls == [("xla", "float32", "float32", "float32", "float32"),  # the f32 trace
                     ("cudnn", low, low, low, low)]  # bound again: fused, low precision
    assert jax.nn.dot_product_attention is spy
    monkeypatch.setattr(jax.nn, "dot_product_attention", real)
    ref = jnp.mean(FusedAttention().apply({"params": params}, x, bias) ** 2)
    np.testing.assert_allclose(out, ref, rtol=3e-2)


def test_an_explicit_cudnn_call_cuDNN_refuses_says_why():
    """No silent fallback for implementation="cudnn": JAX's own error reaches the user. Here a
    head size of 9, which cuDNN refuses; where JAX finds no cuDNN (no CUDA plugin installed)
    jax 0.12 says that first, jax 0.10 checks the head size first."""
    model = FusedAttention(implementation="cudnn")
    x = jax.random.normal(jax.random.key(0), (2, 8, 18))
    bias = 0.1 * jax.random.normal(jax.random.key(2), (1, 2, 8, 8))
    params = FusedAttention().init(jax.random.key(1), x, bias)["params"]  # same params
    fwd = jaxamp.autocast(lambda p: model.apply({"params": p}, x, bias), F16)
    with pytest.raises((NotImplementedError, RuntimeError),
                       match="head dim must be <= 128 and a multiple of 8|cuDNN is not detected"):
        jax.make_jaxpr(fwd)(params)


def test_outside_autocast_the_function_is_untouched():
    assert jax.nn.dot_product_attention is attention.ORIGINAL
    seen = []

    def other_thread():  # traced while another thread is inside an autocast trace
        q = jnp.ones((1, 4, 1, 8))
        seen.append(str(jax.make_jaxpr(jax.nn.dot_product_attention)(q, q, q)))

    def fn(q):
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        return jax.nn.dot_product_attention(q, q, q)

    jaxamp.autocast(fn, F16)(jnp.ones((1, 4, 1, 8)))
    assert seen and "jaxamp_attention" not in seen[0]
    assert jax.nn.dot_product_attention is attention.ORIGINAL
