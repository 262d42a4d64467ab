"""autocast on an unmodified Flax model: dtypes read from the jaxpr, numerics, composition."""

from __future__ import annotations

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models import HandAttention, init_testnet

import jaxamp
from jaxamp._engine.jaxpr import (
    duplicate_casts,
    iter_eqns,
    lossy_round_trips,
    readers,
    transposed_equations,
)
from jaxamp.diagnostics import format_precision_table

MARK = r"/?jaxamp<[^>]*>"  # the scope autocast gives each module call (opaque to jaxamp)
F16 = "params=float32,compute=float16,output=float32"
BF16 = "params=float32,compute=bfloat16,output=float32"
POLICIES = {"float16": F16, "bfloat16": BF16}
MATMULS = ("dot_general", "conv_general_dilated")
# The primitives that make up softmax / log-softmax / logsumexp and normalisation statistics.
FP32_OPS = ("exp", "log", "log1p", "rsqrt", "reduce_sum", "reduce_max")


def _dt(var) -> str:
    return str(var.aval.dtype)


def _module_path(eqn) -> str:
    stack = str(eqn.source_info.name_stack)
    return re.sub(MARK, "", stack)


OFF = jaxamp.DEFAULT_OP_RULES.extend(recompute=False)


def _forward_and_grad(policy, overrides=None, train=True, op_rules=jaxamp.DEFAULT_OP_RULES):
    model, variables, ids = init_testnet()
    fwd = jaxamp.autocast(model.apply, policy, overrides=overrides, op_rules=op_rules)

    def forward(v, ids):
        return fwd(v, ids, train=train, mutable=["batch_stats"])

    def loss(params, ids):
        logits, _ = forward({"params": params, "batch_stats": variables["batch_stats"]}, ids)
        return jaxamp.softmax_cross_entropy(logits, ids)

    fwd_jaxpr = jax.make_jaxpr(forward)(variables, ids)
    grad_jaxpr = jax.make_jaxpr(jax.value_and_grad(loss))(variables["params"], ids)
    return model, variables, ids, forward, loss, fwd_jaxpr, grad_jaxpr


@pytest.mark.parametrize("compute", ["float16", "bfloat16"])
def test_precision_partition_forward_and_backward(compute):
    *_, variables, ids, forward, loss, fwd_jaxpr, grad_jaxpr = _forward_and_grad(
        POLICIES[compute])
    for name, jaxpr in [("forward", fwd_jaxpr), ("value_and_grad", grad_jaxpr)]:
        eqns = list(iter_eqns(jaxpr))
        matmuls = [e for e in eqns if e.primitive.name in MATMULS]
        assert len(matmuls) >= (11 if name == "forward" else 30), name
        for e in matmuls:  # every matmul/conv, forward and backward, in the compute dtype
            assert {_dt(v) for v in e.invars} | {_dt(e.outvars[0])} == {compute}, (name, e)
        sensitive = [e for e in eqns if e.primitive.name in FP32_OPS
                     and jnp.issubdtype(e.invars[0].aval.dtype, jnp.floating)]
        assert len(sensitive) >= 10, name
        for e in sensitive:  # softmax, logsumexp, norm statistics, reductions in f32
            assert _dt(e.invars[0]) == "float32", (name, e, _module_path(e))
        # The divisions that normalise softmax and take LayerNorm means are f32 too.
        producers = {o: e for e in eqns for o in e.outvars}

        def from_sum(v, producers=producers):
            while isinstance(v, jax.extend.core.Var) and v in producers:
                e = producers[v]
                if e.primitive.name == "reduce_sum":
                    return True
                if e.primitive.name not in ("broadcast_in_dim", "reshape"):
                    return False
                v = e.invars[0]
            return False

        divs = [e for e in eqns if e.primitive.name == "div" and any(map(from_sum, e.invars))]
        assert len(divs) >= 5, name
        assert all(_dt(e.outvars[0]) == "float32" for e in divs), name
        assert duplicate_casts(jaxpr) == [], name
    # No value goes f32 -> low -> f32. (In the backward, the cotangent of a low-precision
    # value is low precision by construction; only forward values are checked there.)
    assert lossy_round_trips(fwd_jaxpr) == []
    # The backward is what runs in a transpose, by the full name stack: with recompute its
    # segments are transposed checkpoints, whose own equations keep their forward names (the
    # forward equations they replay are the forward's, checked above).
    back = transposed_equations(grad_jaxpr)
    assert back and not transposed_equations(fwd_jaxpr)
    assert [e for e in lossy_round_trips(grad_jaxpr) if id(e) not in back] == []
    *_, off_grad = _forward_and_grad(POLICIES[compute], op_rules=OFF)
    assert [e for e in lossy_round_trips(off_grad)
            if "transpose" not in str(e.source_info.name_stack)] == []
    value, grads = jax.jit(jax.value_and_grad(loss))(variables["params"], ids)
    assert value.dtype == jnp.float32
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
    logits, new_state = jax.jit(forward)(variables, ids)
    assert logits.dtype == jnp.float32  # output=float32
    assert {x.dtype for x in jax.tree.leaves(new_state)} == {jnp.dtype(jnp.float32)}


def test_params_stay_f32_and_tables_are_not_cast_whole():
    # the equations as the engine places them (recompute would put them in a checkpoint)
    model, variables, ids, forward, _, fwd_jaxpr, _ = _forward_and_grad(F16, op_rules=OFF)
    table = variables["params"]["embed"]["embedding"]
    leaves = jax.tree.leaves((variables, ids))
    table_var = fwd_jaxpr.jaxpr.invars[next(i for i, x in enumerate(leaves) if x is table)]
    ids_var = fwd_jaxpr.jaxpr.invars[-1]
    assert ids_var.aval.dtype == jnp.int32
    users = [e for e in fwd_jaxpr.jaxpr.eqns if table_var in e.invars]
    # the table is only gathered from (never cast whole); the gathered rows are f32 ...
    assert [e.primitive.name for e in users] == ["gather"]
    rows = users[0].outvars[0]
    assert _dt(rows) == "float32"
    # ... and cast once to f16 when they leave the Embed module
    row_casts = [e for e in fwd_jaxpr.jaxpr.eqns if rows in e.invars]
    assert [(e.primitive.name, _dt(e.outvars[0])) for e in row_casts] == [
        ("convert_element_type", "float16")]
    # token ids are never cast to float
    assert not [e for e in iter_eqns(fwd_jaxpr) if ids_var in e.invars
                and e.primitive.name == "convert_element_type"]
    # with recompute (the default) too, followed into the segment that holds the gather
    *_, default_fwd, _ = _forward_and_grad(F16)
    assert [e.primitive.name for e in readers(default_fwd, default_fwd.jaxpr.invars[
        next(i for i, x in enumerate(leaves) if x is table)])] == ["gather"]


def _matmul_dtypes_by_module(jaxpr):
    return [(_module_path(e), _dt(e.invars[0]), _dt(e.invars[1]))
            for e in iter_eqns(jaxpr) if e.primitive.name in MATMULS]


def test_class_override_switches_exactly_the_matched_modules():
    *_, fwd_jaxpr, grad_jaxpr = _forward_and_grad(F16, {nn.Dense: "compute=float32"})
    dense = ("qkv", "proj", "fc1", "fc2", "head")
    rows = _matmul_dtypes_by_module(fwd_jaxpr)
    assert len(rows) == 14  # conv, head, 6 in Flax MHA, qkv/2 einsums/proj, fc1, fc2
    for path, a, b in rows:
        leaf = path.rsplit("/", 1)[-1]
        expect = "float32" if leaf in dense else "float16"
        assert (a, b) == (expect, expect), path
    # backward: the matched modules' gradient matmuls follow their forward dtype
    grad_rows = _matmul_dtypes_by_module(grad_jaxpr)
    assert {a for p, a, _ in grad_rows if "mha" in p} == {"float16"}
    assert {a for p, a, _ in grad_rows if "fc1" in p} == {"float32"}


def test_path_override_and_unmatched_pattern_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        *_, fwd_jaxpr, _ = _forward_and_grad(F16, {"blocks/attn": "float32"})
    for path, a, b in _matmul_dtypes_by_module(fwd_jaxpr):
        expect = "float32" if path.startswith("blocks/attn") else "float16"
        assert (a, b) == (expect, expect), path
    # the hand-written softmax inside the f32 region is f32 as everywhere
    model, variables, ids = init_testnet()
    fwd = jaxamp.autocast(model.apply, F16, overrides={"decoder/layers_*/attn": "float32"})
    with pytest.warns(UserWarning, match=r"'decoder/layers_\*/attn' matched no module"):
        jax.make_jaxpr(lambda v, i: fwd(v, i, train=False))(variables, ids)


def test_path_rule_beats_class_rule_and_children_inherit():
    model, variables, ids = init_testnet()
    overrides = {nn.Dense: "compute=float32", "blocks/attn": "compute=bfloat16"}
    fwd = jaxamp.autocast(model.apply, F16, overrides=overrides)
    jaxpr = jax.make_jaxpr(lambda v, i: fwd(v, i, train=False))(variables, ids)
    rows = dict(((p, a) for p, a, _ in _matmul_dtypes_by_module(jaxpr)))
    # attn itself matched the path rule; its child Dense layers match the class rule (more
    # specific than inheriting), its own einsums inherit attn's bf16.
    assert rows["blocks/attn/bqhd,bkhd->bhqk"] == "bfloat16"
    assert rows["blocks/attn/qkv"] == "float32"
    assert rows["blocks/fc1"] == "float32"
    assert rows["blocks/mha/query"] == "float16"


def test_full_precision_policy_is_the_plain_model():
    model, variables, ids = init_testnet()
    fwd = jaxamp.autocast(model.apply, "params=float32,compute=float32,output=float32")
    jaxpr = jax.make_jaxpr(lambda v, i: fwd(v, i, train=False))(variables, ids)
    plain = jax.make_jaxpr(lambda v, i: model.apply(v, i, train=False))(variables, ids)
    dtypes = {str(v.aval.dtype) for e in iter_eqns(jaxpr) for v in e.outvars}
    plain_dtypes = {str(v.aval.dtype) for e in iter_eqns(plain) for v in e.outvars}
    assert dtypes == plain_dtypes
    assert not [e for e in iter_eqns(jaxpr) if e.primitive.name == "convert_element_type"
                and jnp.issubdtype(e.invars[0].aval.dtype, jnp.floating)]
    out = jax.jit(lambda v, i: fwd(v, i, train=False))(variables, ids)
    ref = jax.jit(lambda v, i: model.apply(v, i, train=False))(variables, ids)
    np.testing.assert_allclose(out, ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("compute", ["float16", "bfloat16"])
def test_mixed_forward_close_to_f32(compute):
    model, variables, ids = init_testnet()
    out = jax.jit(jaxamp.autocast(lambda v, i: model.apply(v, i, train=False),
                                  POLICIES[compute]))(variables, ids)
    ref = model.apply(variables, ids, train=False)
    tol = {"float16": 0.02, "bfloat16": 0.1}[compute]  # logits are O(1); max |error|
    assert float(jnp.max(jnp.abs(out - ref))) < tol
    assert float(jnp.max(jnp.abs(ref))) > 1.0  # the comparison is not trivially small


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_layernorm_and_softmax_with_large_offset(dtype):
    rng = np.random.default_rng(0)
    # the spread survives quantisation at 1e4 (f16 keeps steps of 8 there, bf16 steps of 64)
    spread = 4.0 if dtype == jnp.float16 else 256.0
    x = jnp.asarray(1e4 + rng.standard_normal((4, 256)) * spread, dtype)
    x32 = x.astype(jnp.float32)  # the same (quantised) inputs, reference computed in f32
    ln = nn.LayerNorm()
    params = ln.init(jax.random.key(0), x32)
    policy = f"params=float32,compute={jnp.dtype(dtype).name},output=float32"
    ours = jax.jit(jaxamp.autocast(ln.apply, policy))(params, x)
    ref = ln.apply(params, x32)
    np.testing.assert_allclose(ours, ref, atol=1e-3)
    naive_ln = nn.LayerNorm(dtype=dtype, param_dtype=dtype, force_float32_reductions=False)
    naive = naive_ln.apply(jax.tree.map(lambda p: p.astype(dtype), params), x)
    assert not np.allclose(np.asarray(naive, np.float32), ref, atol=1e-1)

    scores = x if dtype == jnp.float16 else (x - 1e4) / 64  # O(1) spread in both cases
    ours_sm = jax.jit(jaxamp.autocast(lambda s: jax.nn.softmax(s, axis=-1), policy))(scores)
    ref_sm = jax.nn.softmax(scores.astype(jnp.float32), axis=-1)
    np.testing.assert_allclose(ours_sm, ref_sm, atol=1e-3)
    naive_sm = jnp.exp(scores) / jnp.sum(jnp.exp(scores), axis=-1, keepdims=True)
    assert not np.all(np.isfinite(np.asarray(naive_sm, np.float32))) or \
        not np.allclose(np.asarray(naive_sm, np.float32), ref_sm, atol=1e-3)


def test_hand_attention_softmax_is_f32_and_mask_saturates():
    attn = HandAttention(heads=2)
    x = jax.random.normal(jax.random.key(0), (2, 8, 16))
    params = attn.init(jax.random.key(1), x)
    fwd = jaxamp.autocast(attn.apply, F16)
    jaxpr = jax.make_jaxpr(fwd)(params, x)
    exps = [e for e in iter_eqns(jaxpr) if e.primitive.name == "exp"]
    assert exps and all(_dt(e.invars[0]) == "float32" for e in exps)
    out = jax.jit(fwd)(params, x)
    assert bool(jnp.all(jnp.isfinite(out)))
    np.testing.assert_allclose(out, attn.apply(params, x), atol=2e-2)


# ---- composition with transformations and control flow ----------------------------------

@jax.custom_jvp
def _straight_through_round(x):
    return jnp.round(x)


@_straight_through_round.defjvp
def _st_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return jnp.round(x), t * 1.0


@jax.custom_vjp
def _grad_times_three(x):
    return x


_grad_times_three.defvjp(lambda x: (x, None), lambda _, g: (3.0 * g,))


def _control_flow_fn(w, x):
    h = jax.jit(lambda a, b: a @ b)(x, w)  # nested jit
    h = jax.lax.cond(h.sum() > 0, lambda z: z @ w.T @ w, lambda z: -z, h)
    h = _straight_through_round(h * 4.0) / 4.0
    h = _grad_times_three(h)
    h = jax.checkpoint(lambda z: jnp.tanh(z @ w.T @ w))(h)

    def body(carry, xs):
        return carry + jnp.sum(xs @ w), None

    total, _ = jax.lax.scan(body, jnp.zeros(()), h.reshape(2, -1, h.shape[-1]))
    h = jax.lax.fori_loop(0, 3, lambda i, z: z * 0.5, h)
    return jnp.sum(h) + total


def test_control_flow_and_custom_rules_compose_with_grad_jit_vmap():
    w = jax.random.normal(jax.random.key(0), (8, 8)) / 3
    x = jax.random.normal(jax.random.key(1), (4, 8))
    amp = jaxamp.autocast(_control_flow_fn, F16)
    jaxpr = jax.make_jaxpr(jax.grad(amp))(w, x)
    dots = [e for e in iter_eqns(jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) >= 12
    assert all(_dt(e.invars[0]) == _dt(e.invars[1]) == "float16" for e in dots)
    value = jax.jit(amp)(w, x)
    assert value.dtype == jnp.float32
    np.testing.assert_allclose(value, jax.jit(_control_flow_fn)(w, x), rtol=2e-2, atol=2e-2)
    g = jax.jit(jax.grad(amp))(w, x)
    g_ref = jax.jit(jax.grad(_control_flow_fn))(w, x)
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, g_ref, rtol=5e-2, atol=5e-2)
    # the custom_vjp rule is kept: its 3x shows in the gradient w.r.t. x of a tiny function
    gx = jax.jit(jax.grad(jaxamp.autocast(lambda x: jnp.sum(_grad_times_three(x) * 2.0), F16)))(x)
    np.testing.assert_allclose(gx, 6.0 * jnp.ones_like(x))
    # the custom_jvp straight-through rule survives autocast (round has zero derivative)
    gs = jax.jit(jax.grad(jaxamp.autocast(lambda x: jnp.sum(_straight_through_round(x * 3)),
                                          F16)))(x)
    np.testing.assert_allclose(gs, 3.0 * jnp.ones_like(x))
    # vmap over autocast equals autocast of each example
    xs = jax.random.normal(jax.random.key(2), (3, 4, 8))
    batched = jax.jit(jax.vmap(amp, in_axes=(None, 0)))(w, xs)
    single = jax.jit(amp)
    np.testing.assert_allclose(batched, jnp.stack([single(w, xi) for xi in xs]), rtol=1e-6)


def test_relu_custom_jvp_runs_in_compute_dtype():
    f = jaxamp.autocast(lambda w, x: jnp.sum(jax.nn.relu(x @ w) @ w), F16)
    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    jaxpr = jax.make_jaxpr(jax.grad(f))(w, x)
    maxes = [e for e in iter_eqns(jaxpr) if e.primitive.name == "max"]
    assert maxes and all(_dt(e.outvars[0]) == "float16" for e in maxes)
    selects = [e for e in iter_eqns(jaxpr) if e.primitive.name == "select_n"]
    assert selects and all(_dt(e.outvars[0]) == "float16" for e in selects)  # relu's own JVP
    np.testing.assert_allclose(jax.grad(f)(w, x), jax.grad(
        lambda w, x: jnp.sum(jax.nn.relu(x @ w) @ w))(w, x), rtol=1e-3)


@pytest.mark.parametrize("loop", ["scan", "while"])
def test_carry_keeps_f32_accumulator(loop):
    def fn(xs):
        if loop == "scan":
            return jax.lax.fori_loop(0, 5, lambda i, acc: acc + xs[i] @ xs[i].T,
                                     jnp.zeros((2, 2)))
        n = jnp.sum(xs > -1).astype(jnp.int32) // 6  # a traced bound: a real while loop
        return jax.lax.fori_loop(0, n, lambda i, acc: acc + xs[i] @ xs[i].T, jnp.zeros((2, 2)))
    xs = jax.random.normal(jax.random.key(0), (5, 2, 3))
    amp = jaxamp.autocast(fn, F16)
    jaxpr = jax.make_jaxpr(amp)(xs)
    loops = [e for e in iter_eqns(jaxpr) if e.primitive.name == loop]
    assert loops
    carry_dtypes = {_dt(v) for e in loops for v in e.outvars if v.aval.shape == (2, 2)}
    assert carry_dtypes == {"float32"}
    dots = [e for e in iter_eqns(jaxpr) if e.primitive.name == "dot_general"]
    assert dots and all(_dt(e.invars[0]) == "float16" for e in dots)
    np.testing.assert_allclose(jax.jit(amp)(xs), fn(xs), rtol=1e-2, atol=1e-2)


# ---- bad input -------------------------------------------------------------------------

class _NotAModule:
    pass


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"policy": "compute=float8"}, ValueError, "float8"),
    ({"policy": "params=f32,compute=int8"}, ValueError, "int8"),
    ({"policy": "params=f32,,compute=f16"}, ValueError, "mpty"),
    ({"policy": "weights=f32"}, ValueError, "weights"),
    ({"policy": 16}, TypeError, "int"),
    ({"overrides": {_NotAModule: "float32"}}, TypeError, "_NotAModule.*flax.linen.Module"),
    ({"overrides": {42: "float32"}}, TypeError, "42.*not a flax.linen.Module"),
    ({"overrides": {nn.Dense(3): "float32"}}, TypeError, "Use its class, Dense"),
    ({"overrides": {"": "float32"}}, ValueError, "empty path pattern"),
    ({"overrides": {nn.Dense: "compute=fp16"}}, ValueError, "fp16"),
    ({"overrides": {nn.Dense: "params=f32,params=f16"}}, ValueError, "uplicate"),
    ({"overrides": [(nn.Dense, "float32")]}, TypeError, "overrides must be a dict"),
    ({"overrides": {nn.Dense: 3}}, TypeError, "int"),
    ({"op_rules": {"fp32": ["exp"]}}, TypeError, "op_rules must be a jaxamp.OpRules"),
])
def test_bad_configuration_is_rejected_before_tracing(kwargs, exc, match):
    kwargs = {"policy": F16, **kwargs}
    with pytest.raises(exc, match=match):
        jaxamp.autocast(lambda x: x, kwargs.pop("policy"), **kwargs)


def test_bad_op_rules_and_fn():
    with pytest.raises(ValueError, match="unknown list 'fp16'.*Allowed"):
        jaxamp.DEFAULT_OP_RULES.extend(fp16={"exp"})
    with pytest.raises(TypeError, match=r"fp32=\{'tanh'\}"):
        jaxamp.DEFAULT_OP_RULES.extend(fp32="tanh")
    with pytest.raises(TypeError, match="fn must be callable"):
        jaxamp.autocast("model", F16)


def test_op_rules_are_extendable():
    rules = jaxamp.DEFAULT_OP_RULES.extend(fp32={"tanh"})
    assert "tanh" in rules.fp32 and "tanh" not in rules.promote
    f = jaxamp.autocast(lambda w, x: jnp.tanh(x @ w), F16, op_rules=rules)
    jaxpr = jax.make_jaxpr(f)(jnp.ones((4, 4)), jnp.ones((2, 4)))
    (tanh,) = [e for e in iter_eqns(jaxpr) if e.primitive.name == "tanh"]
    assert _dt(tanh.invars[0]) == "float32"


def test_precision_table_reports_dtypes_per_module():
    model, variables, ids = init_testnet()

    def loss(params, ids):
        v = {"params": params, "batch_stats": variables["batch_stats"]}
        return jaxamp.softmax_cross_entropy(model.apply(v, ids, train=False), ids)

    rows = jaxamp.precision_table(loss, variables["params"], ids, policy=F16)
    by = {(r["module"], r["op"]): r for r in rows}
    for mod in ("blocks/fc1", "blocks/mha/query", "head"):
        assert (by[(mod, "matmul")]["forward"], by[(mod, "matmul")]["backward"]) == (
            "float16", "float16")
    assert by[("conv", "conv")]["forward"] == "float16"
    for ln in ("blocks/ln1", "ln_f"):
        assert by[(ln, "reduction")]["forward"] == "float32"
        assert by[(ln, "elementwise")]["forward"] == "float32"
    assert by[("blocks/attn", "exp/log")] == {
        "module": "blocks/attn", "op": "exp/log", "forward": "float32",
        "backward": "float32"}
    assert by[("embed", "gather")]["forward"] == "float32"  # rows gathered, then cast
    assert rows[-1] == {"module": "(output)", "op": "output", "forward": "float32",
                        "backward": "-"}
    assert "| head | matmul | float16 | float16 |" in format_precision_table(rows)


def test_fused_attention_runs_in_compute_dtype_with_f32_softmax():
    # jax.nn.dot_product_attention is treated like torch's scaled_dot_product_attention:
    # its matmuls run in the compute dtype, its softmax in float32.
    q = jax.random.normal(jax.random.key(0), (2, 8, 2, 16))
    fn = jaxamp.autocast(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
                         F16)
    jaxpr = jax.make_jaxpr(fn)(q, q, q)
    dots = [e for e in iter_eqns(jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) == 2 and all(_dt(e.invars[0]) == _dt(e.invars[1]) == "float16" for e in dots)
    exps = [e for e in iter_eqns(jaxpr) if e.primitive.name == "exp"]
    assert exps and all(_dt(e.invars[0]) == "float32" for e in exps)
    ref = jax.nn.dot_product_attention(q, q, q, is_causal=True)
    np.testing.assert_allclose(jax.jit(fn)(q, q, q), ref, atol=5e-3)


def test_random_uniforms_stay_float32_so_dropout_masks_do_not_depend_on_the_policy():
    # jax.random.uniform bitcasts random bits to float32 in [1, 2): cast to float16 there it
    # would keep 10 of its 23 mantissa bits (uniforms on a 1/1024 grid, a biased dropout rate).
    x = jax.random.normal(jax.random.key(1), (64, 64))
    key = jax.random.key(0)

    def f(x, key):
        keep = jax.random.bernoulli(key, 0.5, x.shape)
        return jnp.where(keep, x * 2.0, 0.0)

    fn = jaxamp.autocast(f, F16)
    jaxpr = jax.make_jaxpr(fn)(x, key)
    lts = [e for e in iter_eqns(jaxpr) if e.primitive.name == "lt"]
    assert lts and all(_dt(e.invars[0]) == "float32" for e in lts)
    np.testing.assert_array_equal(jax.jit(fn)(x, key) != 0, f(x, key) != 0)


def test_replicated_activation_made_varying_in_shard_map_keeps_compute_dtype():
    # Inside shard_map jax inserts pvary where a replicated value meets a per-device one; as an
    # unknown primitive it ran as traced, so a float16 activation went back to float32 there.
    from jax.sharding import Mesh, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    w = jax.random.normal(jax.random.key(0), (8, 8))
    x = jax.random.normal(jax.random.key(1), (4, 8))
    fn = jaxamp.autocast(lambda w, x: x @ w + jnp.tanh(w @ w)[:4], F16)
    sharded = jax.shard_map(fn, mesh=mesh, in_specs=(PartitionSpec(), PartitionSpec("d")),
                            out_specs=PartitionSpec("d"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "primitive in no list" warning
        jaxpr = jax.make_jaxpr(sharded)(w, x)
    pvary = [e for e in iter_eqns(jaxpr) if e.primitive.name == "pvary"]
    adds = [e for e in iter_eqns(jaxpr) if e.primitive.name == "add"]
    # the replicated param w is cast where it is used (after its pvary); the activation stays f16
    assert {_dt(e.invars[0]) for e in pvary if e.invars[0].aval.shape == (4, 8)} == {"float16"}
    assert adds and all(_dt(e.outvars[0]) == "float16" for e in adds)


def test_region_marker_is_deprecated_and_still_matches_each_module_call():
    import jaxamp.engine

    with pytest.warns(DeprecationWarning, match="REGION_MARKER is deprecated"):
        marker = jaxamp.engine.REGION_MARKER
    model = nn.Dense(4)
    params = model.init(jax.random.key(0), jnp.ones((2, 3)))
    jaxpr = jax.make_jaxpr(jaxamp.autocast(model.apply, F16))(params, jnp.ones((2, 3)))
    stacks = [str(e.source_info.name_stack) for e in iter_eqns(jaxpr.jaxpr)]
    found = {m.group(0) for s in stacks for m in [marker.search(s)] if m}
    assert len(found) == 1 and all(marker.search(s) for s in stacks if "Dense" in s)
    assert "REGION_MARKER" not in jaxamp.engine.__all__
