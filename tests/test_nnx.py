"""Flax NNX: the same policies, float32 rules, train step and diagnostics as for linen."""

from __future__ import annotations

import functools
import re
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from models import init_testnet
from nnx_models import twin_of

import jaxamp
from jaxamp import nnx_frontend as _nnx
from jaxamp._engine.jaxpr import (
    duplicate_casts,
    iter_eqns,
    lossy_round_trips,
    readers,
    transposed_equations,
)

MARK = r"/?jaxamp<[^>]*>"  # the scope autocast gives each module call (opaque to jaxamp)
F16 = "params=float32,compute=float16,output=float32"
BF16 = "params=float32,compute=bfloat16,output=float32"
F32 = "params=float32,compute=float32,output=float32"
POLICIES = {"float16": F16, "bfloat16": BF16, "float32": F32}
MATMULS = ("dot_general", "conv_general_dilated")
FP32_OPS = ("exp", "log", "log1p", "rsqrt", "reduce_sum", "reduce_max")


def _dt(var) -> str:
    return str(var.aval.dtype)


def _path(eqn) -> str:
    return re.sub(MARK, "", str(eqn.source_info.name_stack))


def _matmuls(jaxpr):
    return [(_path(e), _dt(e.invars[0]), _dt(e.invars[1])) for e in iter_eqns(jaxpr)
            if e.primitive.name in MATMULS]


def _twins():
    linen, variables, ids = init_testnet()
    return linen, variables, ids, twin_of(variables)


def _nnx_loss(policy, overrides=None, train=True):
    """(loss(params, ids) -> (loss, new BatchNorm stats), params) for the NNX TestNet."""
    *_, ids, model = _twins()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    fwd = jaxamp.autocast(lambda m, i: m(i, train=train), policy, overrides=overrides)

    def loss(params, ids):
        m = nnx.merge(graphdef, params, rest, copy=True)
        logits = fwd(m, ids)
        return jaxamp.softmax_cross_entropy(logits, ids), nnx.state(m, nnx.BatchStat)

    return loss, params, ids, model, fwd


def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("compute", ["float16", "bfloat16"])
def test_nnx_precision_partition_forward_and_backward(compute):
    loss, params, ids, model, fwd = _nnx_loss(POLICIES[compute])
    graphdef, state = nnx.split(model)
    # (NNX lets a module's BatchNorm statistics be updated only inside its own trace)
    fwd_jaxpr = jax.make_jaxpr(lambda s, i: fwd(nnx.merge(graphdef, s, copy=True), i))(
        state, ids)
    grad_jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, has_aux=True))(params, ids)
    for name, jaxpr in [("forward", fwd_jaxpr), ("value_and_grad", grad_jaxpr)]:
        eqns = list(iter_eqns(jaxpr))
        matmuls = [e for e in eqns if e.primitive.name in MATMULS]
        # conv, head, 6 in nnx.MultiHeadAttention, qkv/2 einsums/proj, fc1, fc2 (+ backward)
        assert len(matmuls) >= (14 if name == "forward" else 30), name
        for e in matmuls:
            assert {_dt(v) for v in e.invars} | {_dt(e.outvars[0])} == {compute}, (name, e)
        sensitive = [e for e in eqns if e.primitive.name in FP32_OPS
                     and jnp.issubdtype(e.invars[0].aval.dtype, jnp.floating)]
        assert len(sensitive) >= 10, name
        for e in sensitive:  # both softmaxes, LayerNorm/BatchNorm statistics, the loss
            assert _dt(e.invars[0]) == "float32", (name, e, _path(e))
        paths = " ".join(p for p, *_ in _matmuls(jaxpr))  # NNX paths in the name stack
        assert "TestNet" in paths and "blocks/attn/qkv" in paths and "blocks/mha/query" in paths
        assert duplicate_casts(jaxpr) == [], name
    assert lossy_round_trips(fwd_jaxpr) == []
    # the backward by the full name stack: recompute's transposed checkpoints keep their
    # forward names inside (tests/test_autocast.py says why)
    back = transposed_equations(grad_jaxpr)
    assert back and not transposed_equations(fwd_jaxpr)
    assert [e for e in lossy_round_trips(grad_jaxpr) if id(e) not in back] == []
    # the softmax of nnx.MultiHeadAttention and of the hand-written attention, by module
    exps = {_path(e).split("/")[1] for e in iter_eqns(fwd_jaxpr) if e.primitive.name == "exp"}
    assert exps == {"mha", "attn"}
    # the embedding table is gathered from, never cast whole
    table = fwd_jaxpr.jaxpr.invars[[x is model.embed.embedding.get_value() for x in
                                    jax.tree.leaves((state, ids))].index(True)]
    # (followed into the recompute segment that holds the gather)
    assert [e.primitive.name for e in readers(fwd_jaxpr, table)] == ["gather"]
    (value, stats), grads = jax.eval_shape(jax.value_and_grad(loss, has_aux=True), params, ids)
    assert value.dtype == jnp.float32
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
    assert {s.dtype for s in jax.tree.leaves(stats)} == {jnp.dtype(jnp.float32)}
    assert jax.eval_shape(lambda s, i: fwd(nnx.merge(graphdef, s, copy=True), i), state,
                          ids).dtype == jnp.float32


def _rel(a, b) -> float:
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


@functools.cache
def _f32_reference():
    linen, variables, ids = init_testnet()

    def loss(p):  # plain float32 linen, no autocast: the independent reference
        logits, new = linen.apply({"params": p, "batch_stats": variables["batch_stats"]}, ids,
                                  mutable=["batch_stats"])
        return jaxamp.softmax_cross_entropy(logits, ids), new["batch_stats"]

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(variables["params"])


@pytest.mark.parametrize("compute", ["float32", "float16", "bfloat16"])
def test_nnx_and_linen_twins_give_the_same_loss_and_gradients(compute):
    linen, variables, ids, model = _twins()
    policy = POLICIES[compute]
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def nnx_loss(p):
        m = nnx.merge(graphdef, p, rest, copy=True)
        logits = jaxamp.autocast(lambda m, i: m(i), policy)(m, ids)
        return jaxamp.softmax_cross_entropy(logits, ids), nnx.to_pure_dict(
            nnx.state(m, nnx.BatchStat))

    def linen_loss(p, policy=policy):
        logits, new = jaxamp.autocast(linen.apply, policy)(
            {"params": p, "batch_stats": variables["batch_stats"]}, ids, mutable=["batch_stats"])
        return jaxamp.softmax_cross_entropy(logits, ids), new["batch_stats"]

    (lv, lstats), lg = jax.jit(jax.value_and_grad(linen_loss, has_aux=True))(variables["params"])
    (nv, nstats), ng = jax.jit(jax.value_and_grad(nnx_loss, has_aux=True))(params)
    ng = nnx.to_pure_dict(ng)
    assert jax.tree.structure(ng) == jax.tree.structure(lg)  # the same names, param by param
    if compute == "float32":
        rv, rg = lv, lg
    else:
        (rv, _), rg = _f32_reference()
    tol = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-1}[compute]  # NNX vs linen
    ref_tol = {"float32": 1e-5, "float16": 3e-2, "bfloat16": 2e-1}[compute]  # vs float32
    assert abs(float(nv - lv)) <= tol * abs(float(lv))
    assert abs(float(nv - rv)) <= ref_tol * abs(float(rv))
    gmax = max(float(jnp.max(jnp.abs(r))) for r in jax.tree.leaves(rg))
    for a, b, r in zip(jax.tree.leaves(ng), jax.tree.leaves(lg), jax.tree.leaves(rg),
                       strict=True):
        assert a.dtype == jnp.float32
        if float(jnp.max(jnp.abs(r))) < 1e-6 * gmax:  # zero in exact arithmetic (the conv
            assert float(jnp.max(jnp.abs(a))) <= max(ref_tol * 1e-1, 1e-6) * gmax  # BN)
            continue
        assert _rel(a, b) <= tol, (compute, _rel(a, b))
        assert _rel(a, r) <= ref_tol, (compute, _rel(a, r))
    for a, b in zip(jax.tree.leaves(nstats), jax.tree.leaves(lstats["bn"]), strict=True):
        assert _rel(a, b) <= tol


def test_nnx_class_and_path_rules_and_unmatched_warning():
    loss, params, ids, model, fwd = _nnx_loss(F16, {nnx.Linear: "compute=float32"})
    rows = _matmuls(jax.make_jaxpr(fwd)(model, ids))
    assert len(rows) == 14
    for path, a, b in rows:
        leaf = path.rsplit("/", 1)[-1]
        expect = "float32" if leaf in ("qkv", "proj", "fc1", "fc2", "head") else "float16"
        assert (a, b) == (expect, expect), path
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss, params, ids, model, fwd = _nnx_loss(F16, {"blocks/attn": "float32"})
        jaxpr = jax.make_jaxpr(fwd)(model, ids)
    rows = _matmuls(jaxpr)
    assert {a for p, a, _ in rows if p.startswith("blocks/attn")} == {"float32"}
    assert {a for p, a, _ in rows if not re.search("blocks/attn", p)} == {"float16"}
    # precedence as for linen: the path rule beats inheritance, a class rule beats both
    *_, model, fwd = _nnx_loss(F16, {nnx.Linear: "compute=float32",
                                     "blocks/attn": "compute=bfloat16"})
    got = {p: a for p, a, _ in _matmuls(jax.make_jaxpr(fwd)(model, ids))}
    assert got["blocks/attn/bqhd,bkhd->bhqk"] == "bfloat16"
    assert got["blocks/attn/qkv"] == "float32"
    assert got["blocks/mha/query"] == "float16"
    fwd = jaxamp.autocast(lambda m, i: m(i, train=False), F16,
                          overrides={"decoder/layers_*/attn": "float32"})
    with pytest.warns(UserWarning, match=r"'decoder/layers_\*/attn' matched no module"):
        jax.make_jaxpr(fwd)(model, ids)
    with pytest.raises(TypeError, match=r"is not a flax.linen.Module or flax.nnx.Module "
                                        r"subclass.*Use its class, Linear"):
        jaxamp.autocast(fwd, F16, overrides={model.head: "float32"})


def _wrapped_calls():
    return {c: c.__dict__.get("__call__") for c in [nnx.Module, *_nnx._subclasses(nnx.Module)]}


def test_user_model_and_classes_are_unchanged_and_batch_stats_written_back():
    model, x = BNNet(rngs=nnx.Rngs(0)), _bn_batch()["x"]
    model.eval()  # BatchNorm uses its running statistics
    before_classes = _wrapped_calls()
    before = _bits(nnx.state(model))
    out = jax.jit(jaxamp.autocast(lambda m, x: m(x), F16))(model, x)
    assert _bits(nnx.state(model)) == before
    assert _wrapped_calls() == before_classes and not _nnx.installed()
    assert not [v for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)
                and v.has_metadata(_nnx.PATH_KEY)]
    # the three forms agree: a module, a function of one, the split/merge functional form
    graphdef, state = nnx.split(model)
    forms = [jaxamp.autocast(model, F16)(x),
             jaxamp.autocast(lambda g, s, x: nnx.merge(g, s)(x), F16)(graphdef, state, x),
             nnx.jit(jaxamp.autocast(lambda m, x: m(x), F16))(model, x)]
    for y in forms:
        np.testing.assert_allclose(y, out, rtol=1e-6, atol=1e-6)
    assert float(jnp.max(jnp.abs(out - model(x)))) < 2e-2  # close to the float32 model
    # train mode: like calling the model, the BatchNorm statistics are updated in place
    # (float32, equal to the float32 model's own update), the params are not
    model.train()
    plain = BNNet(rngs=nnx.Rngs(0))
    plain(x)
    params = _bits(nnx.state(model, nnx.Param))
    jaxamp.autocast(lambda m, x: m(x), F16)(model, x)
    assert _bits(nnx.state(model, nnx.Param)) == params
    got, want = nnx.state(model, nnx.BatchStat), nnx.state(plain, nnx.BatchStat)
    assert _bits(got) != _bits(nnx.state(BNNet(rngs=nnx.Rngs(0)), nnx.BatchStat))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == jnp.float32
        np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-3)


def test_class_patching_is_thread_safe():
    """Calls in a thread that is not tracing are not intercepted while another thread traces,
    and two threads tracing under different policies keep their own regions."""
    x = _bn_batch()["x"]
    model, plain_model = BNNet(rngs=nnx.Rngs(0)), BNNet(rngs=nnx.Rngs(0))
    model.eval()
    plain_model.eval()
    ref = np.asarray(plain_model(x))
    errors: list = []
    start = threading.Barrier(3)

    def plain():
        start.wait()
        for _ in range(50):
            y = plain_model(x)  # eager float32: bit-identical if untouched
            if np.asarray(y).tobytes() != ref.tobytes():
                errors.append("plain call changed while another thread traced")

    def traced(policy, want):
        start.wait()
        for _ in range(10):
            fwd = jaxamp.autocast(lambda m, x: m(x), policy, overrides={"fc1": "float32"})
            rows = _matmuls(jax.make_jaxpr(fwd)(model, x))
            if [a for p, a, _ in rows] != ["float32", want] or rows[0][0] != "BNNet/fc1":
                errors.append((policy, rows))

    threads = [threading.Thread(target=plain),
               threading.Thread(target=traced, args=(F16, "float16")),
               threading.Thread(target=traced, args=(BF16, "bfloat16"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert not _nnx.installed()


# ---------------------------------------------------------------------------------------------
# The train step
# ---------------------------------------------------------------------------------------------


class BNNet(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(8, 32, rngs=rngs)
        self.bn = nnx.BatchNorm(32, rngs=rngs)
        self.fc2 = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.fc2(nnx.relu(self.bn(self.fc1(x))))


def _bn_batch(n=16, seed=0):
    x = jax.random.normal(jax.random.key(seed), (n, 8))
    return {"x": x, "y": jnp.arange(n) % 4}


def bn_loss(model, batch):
    return jaxamp.softmax_cross_entropy(model(batch["x"]), batch["y"])


def test_nnx_step_skips_bit_identically_and_compiles_once():
    model = BNNet(rngs=nnx.Rngs(0))
    tx = optax.adamw(optax.cosine_decay_schedule(1e-2, 100), weight_decay=0.1)
    state = jaxamp.TrainState.create(model, tx=tx, policy=F16,
                                     loss_scale=jaxamp.DynamicLossScale(2.0**10))
    assert set(state.collections) == {"nnx_state"}
    step = jaxamp.make_train_step(loss_fn=bn_loss, clip_norm=1.0)
    batch = _bn_batch()
    bad = {3, 4, 11}
    for i in range(20):
        poison = jnp.inf if i % 2 else jnp.nan
        b = {**batch, "x": batch["x"].at[0, 0].set(poison)} if i in bad else batch
        before = _bits((state.params, state.opt_state.inner_state, state.collections))
        state, m = step(state, b)
        after = _bits((state.params, state.opt_state.inner_state, state.collections))
        assert bool(m["skipped"]) == (i in bad), i
        assert (after == before) == (i in bad), i  # bit-identical exactly on skipped steps
    assert int(state.skipped_steps) == len(bad)
    # the schedule did not advance
    assert int(state.opt_state.inner_state[0].count) == 20 - len(bad)
    assert step._cache_size() == 1
    # the trained state goes back into the model object
    jaxamp.nnx_update(model, state)
    np.testing.assert_array_equal(model.bn.mean.get_value(),
                                  state.collections["nnx_state"]["bn"]["mean"])
    np.testing.assert_array_equal(model.fc1.kernel.get_value(),
                                  state.params["fc1"]["kernel"])


def test_nnx_step_matches_an_independent_float32_sgd_reference():
    """Plain SGD, no clipping: the step's params and BatchNorm statistics equal NNX's own
    float32 training loop (nnx.value_and_grad), and float16 stays close to it."""
    batch = _bn_batch()
    lr, steps = 0.5, 3
    ref = BNNet(rngs=nnx.Rngs(0))

    @nnx.jit
    def ref_step(model, batch):
        loss, grads = nnx.value_and_grad(bn_loss)(model, batch)
        nnx.update(model, jax.tree.map(lambda p, g: p - lr * g, nnx.state(model, nnx.Param),
                                       grads))
        return loss

    ref_losses = [float(ref_step(ref, batch)) for _ in range(steps)]
    for policy, tol in [(F32, 1e-5), (F16, 2e-2)]:
        state = jaxamp.TrainState.create(BNNet(rngs=nnx.Rngs(0)), tx=optax.sgd(lr),
                                         policy=policy)
        step = jaxamp.make_train_step(loss_fn=bn_loss)
        losses = []
        for _ in range(steps):
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
        if policy == F16:  # the dynamic scale starts at 2**16 and may skip; compare applied
            assert int(state.skipped_steps) <= 1
            continue
        np.testing.assert_allclose(losses, ref_losses, rtol=tol)
        want = nnx.to_pure_dict(nnx.state(ref))
        got = {**state.params}
        for path, a in jax.tree_util.tree_leaves_with_path(want):
            keys = [k.key for k in path]
            tree = state.params if keys[-1] in ("kernel", "bias", "scale") else \
                state.collections["nnx_state"]
            for k in keys:
                tree = tree[k]
            assert _rel(tree, a) <= tol, keys
        assert got  # the step changed real params
    # float16, loss scale fixed so that no step is skipped: close to the float32 reference
    state = jaxamp.TrainState.create(BNNet(rngs=nnx.Rngs(0)), tx=optax.sgd(lr), policy=F16,
                                     loss_scale=jaxamp.StaticLossScale(128.0))
    step = jaxamp.make_train_step(loss_fn=bn_loss)
    for _ in range(steps):
        state, m = step(state, batch)
    assert int(state.skipped_steps) == 0
    want = jax.tree.leaves(nnx.to_pure_dict(nnx.state(ref, nnx.Param)))
    scale = max(float(jnp.max(jnp.abs(b))) for b in want)
    for a, b in zip(jax.tree.leaves(state.params), want, strict=True):
        assert float(jnp.max(jnp.abs(a - b))) <= 2e-2 * scale  # relative to the params' scale
    # micro-batches on a model without batch statistics: one big step, to float32 rounding
    mlp = lambda: nnx.Sequential(nnx.Linear(8, 16, rngs=nnx.Rngs(1)), nnx.gelu,  # noqa: E731
                                 nnx.Linear(16, 4, rngs=nnx.Rngs(2)))
    outs = []
    for micro in (1, 4):
        state = jaxamp.TrainState.create(mlp(), tx=optax.sgd(lr), policy=F32)
        state, _ = jaxamp.make_train_step(loss_fn=bn_loss, micro_batches=micro)(state, batch)
        outs.append(state.params)
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_bad_nnx_inputs_are_rejected_before_jit():
    model = BNNet(rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"params and tx are required.*NNX model: "
                                        r"TrainState.create\(model, tx="):
        jaxamp.TrainState.create(model)
    with pytest.raises(TypeError, match="nnx_update: model must be a flax.nnx.Module, got dict"):
        jaxamp.nnx_update({}, None)


# ---------------------------------------------------------------------------------------------
# Diagnostics
# ---------------------------------------------------------------------------------------------


def test_diagnostics_name_nnx_modules_by_their_paths():
    linen, variables, ids, model = _twins()
    rows = jaxamp.precision_table(lambda m, i: m(i, train=False), model, ids)
    lrows = jaxamp.precision_table(lambda v, i: linen.apply(v, i, train=False), variables, ids)
    assert {r["module"] for r in rows} == {r["module"] for r in lrows}
    assert {"blocks/attn/qkv", "blocks/mha/query", "bn"} <= {
        r["module"] for r in rows}
    by = {(r["module"], r["op"]): r for r in rows}
    assert by[("blocks/mha", "exp/log")]["forward"] == "float32"
    assert by[("blocks/fc1", "matmul")]["backward"] == "float16"
    assert jaxamp.audit(lambda m, i: m(i, train=False), model, ids).findings == []

    class Big(nnx.Module):  # 30 x 4 x 1000 = 120000 > float16's 65504
        def __init__(self):
            self.fc1 = nnx.Linear(4, 8, kernel_init=nnx.initializers.constant(1e3),
                                  rngs=nnx.Rngs(0))
            self.fc2 = nnx.Linear(8, 1, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.fc2(nnx.relu(self.fc1(x)))

    rep = jaxamp.locate_overflow(Big(), jnp.full((2, 4), 30.0), loss_fn=lambda y: jnp.mean(y))
    assert rep.first_nonfinite["module"] == "fc1"
    assert rep.row("fc1")["param_grad_max_abs"] is not None
