"""autocast in programs that spread themselves over devices (issue #11: float32 where it sums).

A hand-written tensor-parallel ``shard_map`` inside the model, plain ``jax.jit`` on FSDP-sharded
params with no mesh context, and a data-parallel conv net. Everything runs in ONE subprocess on
8 virtual CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``), reported as JSON
and asserted here, as in ``test_mesh.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import multihost  # tests/multihost.py
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxamp
from jaxamp._engine.jaxpr import iter_eqns

BF16 = "params=float32,compute=bfloat16,output=float32"
_PSUMS = ("psum", "psum_invariant")


def _rel(a, b) -> float:
    """max |a - b| / max |b| over a tree's leaves."""
    return max(float(jnp.max(jnp.abs(jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32)))
                     / max(float(jnp.max(jnp.abs(jnp.asarray(y, jnp.float32)))), 1e-30))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _exact(a, b) -> bool:
    return all(bool(jnp.array_equal(x, y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _dtypes(eqn) -> list[str]:
    return [str(v.aval.dtype) for v in eqn.invars]


# ---- 1. a tensor-parallel MLP the model writes itself, with shard_map and psum --------------
def _tp_loss(mesh):
    def tp_mlp(x, w1, w2):  # Megatron: column-parallel w1, row-parallel w2, one psum
        return lax.psum(jax.nn.gelu(x @ w1) @ w2, "model")

    mlp = jax.shard_map(tp_mlp, mesh=mesh, in_specs=(P("data"), P(None, "model"),
                                                     P("model", None)), out_specs=P("data"))

    def loss(p, x, y):
        h = x @ p["w_in"]
        logits = (h + mlp(h, p["w1"], p["w2"])) @ p["w_out"]
        return jnp.mean(jax.nn.logsumexp(logits, -1)
                        - jnp.take_along_axis(logits, y[:, None], -1)[:, 0])

    return loss


def _tp_setup():
    k = jax.random.split(jax.random.key(0), 6)
    p = {"w_in": jax.random.normal(k[0], (16, 32)) / 4,
         "w1": jax.random.normal(k[1], (32, 64)) / 6,
         "w2": jax.random.normal(k[2], (64, 32)) / 8,
         "w_out": jax.random.normal(k[3], (32, 10)) / 6}
    return p, jax.random.normal(k[4], (16, 16)), jax.random.randint(k[5], (16,), 0, 10)


def tensor_parallel_shard_map() -> dict:
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    loss = _tp_loss(mesh)
    p, x, y = _tp_setup()
    closed = jax.make_jaxpr(jaxamp.autocast(loss, BF16))(p, x, y)
    (sm,) = [e for e in iter_eqns(closed) if e.primitive.name == "shard_map"]
    body = list(iter_eqns(sm.params["jaxpr"]))
    ref = jax.jit(jax.value_and_grad(loss))(p, x, y)
    f32 = jax.jit(jax.value_and_grad(jaxamp.autocast(loss, "float32")))(p, x, y)
    amp = jax.jit(jax.value_and_grad(jaxamp.autocast(loss, BF16)))(p, x, y)
    return {
        "body_dots": [_dtypes(e) for e in body if e.primitive.name == "dot_general"],
        "body_psums": [_dtypes(e) for e in body if e.primitive.name in _PSUMS],
        "f32_exact": _exact(f32, ref),
        "loss": _rel(amp[0], ref[0]), "grads": _rel(amp[1], ref[1]),
        "grad_dtypes": sorted({str(g.dtype) for g in jax.tree.leaves(amp[1])}),
    }


# ---- 2. plain jax.jit of FSDP-sharded params: no mesh is set, 8 devices are visible --------
def _mlp_loss(p, x):
    h = x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]
    return jnp.mean(jnp.square(h @ p["w3"]))


def _mlp_setup():
    k = jax.random.split(jax.random.key(0), 4)
    return ({"w1": jax.random.normal(k[0], (32, 64)) / 6,
             "w2": jax.random.normal(k[1], (64, 32)) / 8,
             "w3": jax.random.normal(k[2], (32, 16)) / 6},
            jax.random.normal(k[3], (64, 32)))


def _reductions(rows) -> list[list]:
    return [[r["kind"], r["dtype"], r["op_name"]] for r in rows
            if r["kind"] in ("all-reduce", "reduce-scatter")]


def plain_jit_fsdp() -> dict:
    from jax.sharding import NamedSharding

    mesh = Mesh(np.array(jax.devices()), ("data",))
    p, x = _mlp_setup()
    ps = jax.device_put(p, NamedSharding(mesh, P("data")))  # FSDP: every param split
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    out = {}
    for name, flag in (("auto", None), ("off", False)):
        step = jax.jit(jax.grad(jaxamp.autocast(_mlp_loss, BF16, f32_weight_grads=flag)))
        out[name] = _reductions(jaxamp.collectives(step, ps, xs))
    grads = jax.jit(jax.grad(jaxamp.autocast(_mlp_loss, BF16)))(ps, xs)
    one = jax.jit(jax.grad(jaxamp.autocast(_mlp_loss, BF16, f32_weight_grads=True)))(p, x)
    out["vs_one_device"] = _rel(grads, one)
    out["vs_f32"] = _rel(grads, jax.grad(_mlp_loss)(p, x))
    return out


# ---- 3. a data-parallel conv net: the kernel gradients summed in float32 -------------------
def conv_data_parallel() -> dict:
    import flax.linen as nn
    from jax.sharding import NamedSharding

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.gelu(nn.Conv(8, (3, 3), strides=2, padding="SAME")(x))
            x = nn.gelu(nn.Conv(8, (3, 3), padding="VALID", kernel_dilation=2,
                                feature_group_count=2)(x))
            x = nn.Conv(4, (2, 2), padding=((1, 0), (0, 1)), use_bias=False)(x)
            return nn.Dense(3)(x.mean((1, 2)))

    net = Net()
    x = jax.random.normal(jax.random.key(0), (16, 12, 12, 3))
    y = jnp.arange(16) % 3
    params = net.init(jax.random.key(1), x)

    def loss(p, x, y):
        return jaxamp.softmax_cross_entropy(net.apply(p, x), y)

    mesh = Mesh(np.array(jax.devices()), ("data",))
    args = (jax.device_put(params, NamedSharding(mesh, P())),
            jax.device_put(x, NamedSharding(mesh, P("data"))),
            jax.device_put(y, NamedSharding(mesh, P("data"))))
    step = jax.jit(jax.grad(jaxamp.autocast(loss, BF16)))
    one = {flag: jax.jit(jax.grad(jaxamp.autocast(loss, BF16, f32_weight_grads=flag)))(
        params, x, y) for flag in (True, False)}
    kernels = lambda g: [v for k, v in jax.tree_util.tree_leaves_with_path(g)  # noqa: E731
                         if "kernel" in jax.tree_util.keystr(k)]
    off = jax.jit(jax.grad(jaxamp.autocast(loss, BF16, f32_weight_grads=False)))
    return {"reductions": _reductions(jaxamp.collectives(step, *args)),
            "off": _reductions(jaxamp.collectives(off, *args)),
            "vs_one_device": _rel(step(*args), one[True]),
            "f32_vs_bf16_kernel_grads": _rel(kernels(one[True]), kernels(one[False]))}


def script() -> dict:
    return {"tp": tensor_parallel_shard_map(), "fsdp": plain_jit_fsdp(),
            "conv": conv_data_parallel()}


def test_on_8_virtual_devices():
    out = multihost.script_on_devices("test_distributed")  # conftest: XLA:CPU's cheap compile

    # 1. the shard_map body is re-evaluated: its two matmuls in bf16, its psum in f32; the
    # float32 policy is plain JAX bit for bit; bf16 is within AMP tolerance of float32
    # (measured: loss 5.9e-5, grads 7.9e-3)
    tp = out["tp"]
    assert tp["body_dots"] == [["bfloat16", "bfloat16"]] * 2, tp
    assert tp["body_psums"] == [["float32"]], tp
    assert tp["f32_exact"], tp
    assert tp["loss"] < 1e-3 and tp["grads"] < 3e-2, tp
    assert tp["grad_dtypes"] == ["float32"], tp

    # 2. plain jax.jit, FSDP over 8 devices, no mesh context: every reduction across the data
    # axis (the three weight gradients) is float32; f32_weight_grads=False shows what it was
    # (bfloat16). The 8-device grads are the one-device run's (measured 2.2e-7; vs float32
    # 6.1e-3).
    fsdp = out["fsdp"]
    assert len(fsdp["auto"]) >= 3 and {r[1] for r in fsdp["auto"]} == {"float32"}, fsdp
    assert sum(r[2].endswith("dot_general") for r in fsdp["auto"]) >= 3, fsdp
    assert {r[1] for r in fsdp["off"]} == {"bfloat16"}, fsdp
    assert fsdp["vs_one_device"] < 1e-5 and fsdp["vs_f32"] < 3e-2, fsdp

    # 3. data-parallel conv net: the three kernel-gradient reductions are float32 (as is every
    # other reduction), bfloat16 with f32_weight_grads=False; the grads are the one-device
    # run's (measured 2.7e-7); the float32-output kernel transpose (restated from JAX's) agrees
    # with JAX's bf16 one to bf16 rounding (measured 2.5e-3)
    conv = out["conv"]
    kernel_sums = [r for r in conv["reductions"] if r[2].endswith("conv_general_dilated")]
    assert len(kernel_sums) == 3 and {r[1] for r in conv["reductions"]} == {"float32"}, conv
    assert {r[1] for r in conv["off"] if r[2].endswith("conv_general_dilated")} == {
        "bfloat16"}, conv
    assert conv["vs_one_device"] < 1e-5, conv
    assert conv["f32_vs_bf16_kernel_grads"] < 2e-2, conv


# ---- on one device, in process ------------------------------------------------------------
def _f32_output_dots(closed) -> int:
    return sum(e.primitive.name == "dot_general" and str(e.outvars[0].aval.dtype) == "float32"
               for e in iter_eqns(closed))


def test_one_device_keeps_jax_transposes_unless_asked():
    assert jax.device_count() == 1
    p, x = _mlp_setup()
    grad = {flag: jax.make_jaxpr(jax.grad(jaxamp.autocast(_mlp_loss, BF16,
                                                          f32_weight_grads=flag)))(p, x)
            for flag in (None, False, True)}
    assert str(grad[None]) == str(grad[False])  # the default on one device: unchanged
    assert _f32_output_dots(grad[None]) == 0 and _f32_output_dots(grad[True]) == 3
    # the float32 weight-grad matmul is a custom_jvp function: forward mode works through it
    t = jax.tree.map(jnp.ones_like, p)
    jvp = {flag: jax.jit(lambda p, t, flag=flag: jax.jvp(
        lambda q: jaxamp.autocast(_mlp_loss, BF16, f32_weight_grads=flag)(q, x), (p,), (t,)))(
        p, t) for flag in (False, True)}
    ref = jax.jvp(lambda q: _mlp_loss(q, x), (p,), (t,))
    for flag, (out, tangent) in jvp.items():  # measured: 2.9e-4, 1.0e-2 (bf16)
        assert abs(float(out - ref[0])) < 1e-2 * abs(float(ref[0])), (flag, out, ref)
        assert abs(float(tangent - ref[1])) < 3e-2 * abs(float(ref[1])), (flag, tangent, ref)


def test_f32_weight_grads_must_be_a_bool():
    import pytest

    with pytest.raises(TypeError, match="f32_weight_grads must be True, False or None"):
        jaxamp.autocast(_mlp_loss, BF16, f32_weight_grads="yes")
