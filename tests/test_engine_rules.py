"""Where autocast's rules meet (GitHub issue #23): collections keep their dtypes, built-in rules
follow the region they sit in, the train step takes the rules autocast takes, the root module
is matched by the path reports print, float64 is never narrowed, handlers, and the cost of the
evaluation (bodies evaluated a bounded number of times, repeated layers evaluated once)."""

from __future__ import annotations

import collections
import functools
import re
import sys
import threading
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

import jaxamp
import jaxamp.rules
from jaxamp import engine
from jaxamp import nnx_frontend as _nnx
from jaxamp._engine import attention, evaluator
from jaxamp._engine.jaxpr import duplicate_casts, iter_eqns, lossy_round_trips

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import trace_cost  # noqa: E402

F16 = "params=float32,compute=float16,output=float32"
BF16 = "params=float32,compute=bfloat16,output=float32"
LOW = {"float16", "bfloat16"}


def _casts(closed):
    return [(str(e.invars[0].aval.dtype), str(e.outvars[0].aval.dtype))
            for e in iter_eqns(closed) if e.primitive.name == "convert_element_type"]


def _dots(closed):
    return [str(e.outvars[0].aval.dtype) for e in iter_eqns(closed)
            if e.primitive.name == "dot_general"]


# ---- collections ----------------------------------------------------------------------------


class Decoder(nn.Module):
    """Flax's own decode-mode attention (a float32 ``cache`` collection written with
    ``dynamic_update_slice``), embedding and head."""

    vocab: int = 16

    @nn.compact
    def __call__(self, ids, decode=False):
        x = nn.Embed(self.vocab, 32)(ids)
        mask = None if decode else nn.make_causal_mask(ids)
        x = x + nn.MultiHeadDotProductAttention(num_heads=2, decode=decode)(x, mask=mask)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def _decode(policy, variables, first, steps=4):
    apply = jaxamp.autocast(Decoder().apply, policy)
    cache, tok, out, dtypes = variables["cache"], first, [], []
    for _ in range(steps):
        logits, new = apply({"params": variables["params"], "cache": cache}, tok, decode=True,
                            mutable=["cache"])
        cache = new["cache"]
        dtypes.append({str(x.dtype) for x in jax.tree.leaves(cache)
                       if jnp.issubdtype(x.dtype, jnp.floating)})
        tok = jnp.argmax(logits[:, -1], -1)[:, None]
        out.append(int(tok[0, 0]))
    return out, dtypes


@pytest.mark.parametrize("policy", [F16, BF16])
def test_a_float32_cache_stays_float32_through_a_decode_loop(policy):
    model = Decoder()
    variables = model.init(jax.random.key(3), jnp.zeros((1, 8), jnp.int32), decode=True)
    variables = {"params": model.init(jax.random.key(3), jnp.zeros((1, 8), jnp.int32))[
        "params"], "cache": variables["cache"]}
    first = jnp.array([[5]], jnp.int32)
    want, _ = _decode("float32", variables, first)
    got, dtypes = _decode(policy, variables, first)
    assert dtypes == [{"float32"}] * 4  # the cache keeps its stored dtype, step after step
    assert got == want
    # and the matmuls did run low: this is not a float32 run in disguise
    apply = jaxamp.autocast(model.apply, policy)
    closed = jax.make_jaxpr(lambda v, t: apply(v, t, decode=True, mutable=["cache"]))(
        variables, first)
    assert set(_dots(closed)) == {str(jnp.dtype(jaxamp.get_policy(policy).compute_dtype))}


# ---- built-in rules inherit the region's dtypes ---------------------------------------------


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(32, name="fc")(nn.LayerNorm(name="ln")(x))
        return x + nn.Dense(32, name="proj")(nn.gelu(h))


class Stack(nn.Module):
    layers: int = 3

    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(50, 32, name="embed")(ids)
        for i in range(self.layers):
            x = Block(name=f"blocks_{i}")(x)
        return nn.Dense(50, name="head")(nn.LayerNorm(name="ln_f")(x))


def _stack():
    ids = jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % 50
    model = Stack()
    return model, model.init(jax.random.key(0), ids), ids


@pytest.mark.parametrize("override", ["float32", "compute=float16"])
def test_norms_and_embeddings_inside_an_override_take_its_dtypes(override):
    model, variables, ids = _stack()
    fwd = jaxamp.autocast(model.apply, BF16, overrides={"blocks_0": override})
    closed = jax.make_jaxpr(fwd)(variables, ids)
    assert lossy_round_trips(closed) == []
    low_to_low = [c for c in _casts(closed) if c[0] in LOW and c[1] in LOW]
    assert low_to_low == []
    # the override did take effect, and the rest of the model stayed bfloat16
    want = "float32" if override == "float32" else "float16"
    assert _dots(closed)[:2] == [want, want] and set(_dots(closed)[2:]) == {"bfloat16"}


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "no-recompute"])
def test_a_float16_override_under_bfloat16_casts_each_value_once(recompute):
    """Issue #40: with ``{"blocks_0": "compute=float16"}`` under a bfloat16 default, blocks_0's
    float16 output leaves it as float32 (output=float32) for blocks_1's LayerNorm and residual
    add, each in a recompute segment of its own: both cast it, the second now reads the
    first's copy. No float32 -> low -> float32 round trip and no float16 <-> bfloat16 cast,
    read across the segments' checkpoints."""
    model, variables, ids = _stack()
    rules = jaxamp.DEFAULT_OP_RULES.extend(recompute=recompute)
    fwd = jaxamp.autocast(model.apply, BF16, overrides={"blocks_0": "compute=float16"},
                          op_rules=rules)
    closed = jax.make_jaxpr(fwd)(variables, ids)
    assert duplicate_casts(closed) == []
    assert lossy_round_trips(closed) == []
    assert [c for c in _casts(closed) if c[0] in LOW and c[1] in LOW and c[0] != c[1]] == []
    assert _dots(closed)[:2] == ["float16", "float16"]
    assert set(_dots(closed)[2:]) == {"bfloat16"}
    segments = [e for e in iter_eqns(closed) if e.primitive.name in ("checkpoint", "remat2")]
    assert bool(segments) == recompute


def test_a_user_class_rule_for_a_norm_still_wins():
    model, variables, ids = _stack()
    fwd = jaxamp.autocast(model.apply, F16, overrides={nn.LayerNorm: "float32"})
    closed = jax.make_jaxpr(fwd)(variables, ids)
    # the float32 LayerNorm output reaches the next Dense as float32 then is cast down once
    assert ("float32", "float16") in _casts(closed)


# ---- the train step takes autocast's rules --------------------------------------------------


def _loss(apply_fn, params, batch):
    logits = apply_fn({"params": params}, batch["ids"])
    return jaxamp.softmax_cross_entropy(logits, batch["ids"])


def _tanh_dtypes(closed):
    return sorted({str(e.invars[0].aval.dtype) for e in iter_eqns(closed)
                   if e.primitive.name == "tanh"})


def test_op_rules_reach_the_train_step():
    model, variables, ids = _stack()
    rules = jaxamp.DEFAULT_OP_RULES.extend(fp32={"tanh"})
    fwd = jaxamp.autocast(model.apply, F16, op_rules=rules)
    assert _tanh_dtypes(jax.make_jaxpr(fwd)(variables, ids)) == ["float32"]
    assert _tanh_dtypes(jax.make_jaxpr(jaxamp.autocast(model.apply, F16))(
        variables, ids)) == ["float16"]
    state = jaxamp.TrainState.create(model, variables["params"], optax.sgd(0.1), policy=F16)
    batch = {"ids": ids}
    for op_rules, want in ((rules, ["float32"]), (jaxamp.DEFAULT_OP_RULES, ["float16"])):
        step = jaxamp.make_train_step(model, _loss, op_rules=op_rules, donate=False)
        text = step.lower(state, batch).as_text()
        tanh = re.findall(r"stablehlo.tanh[^\n]*tensor<[^>]*x(f16|f32)>", text)
        assert tanh and set(tanh) == {want[0].replace("float", "f")}
    ev = jaxamp.make_eval_step(model, _loss, policy=F16, op_rules=rules)
    assert np.isfinite(float(ev(variables["params"], batch)))
    with pytest.raises(TypeError, match="make_train_step: op_rules must be a jaxamp.OpRules"):
        jaxamp.make_train_step(model, _loss, op_rules={"fp32": {"tanh"}})
    with pytest.raises(TypeError, match="f32_weight_grads must be True, False or None"):
        jaxamp.make_eval_step(model, _loss, f32_weight_grads="yes")


# ---- the root module's path -----------------------------------------------------------------


def test_the_root_module_is_matched_by_its_class_name():
    model, variables, ids = _stack()
    fwd = jaxamp.autocast(model.apply, F16, overrides={"Stack": "float32"})
    with warnings_as_errors():
        closed = jax.make_jaxpr(fwd)(variables, ids)
    assert set(_dots(closed)) == {"float32"}  # everything inherits the root's rule


@pytest.mark.parametrize("key,n_f32", [("blocks_0", 2), ("blocks_*/fc", 3)])
def test_a_root_prefixed_path_matches_below_the_root_linen(key, n_f32):
    """Reports name the root by its class; ``Root/path`` is the same module as ``path``."""
    model, variables, ids = _stack()
    dots = []
    for k in (key, f"Stack/{key}"):
        fwd = jaxamp.autocast(model.apply, F16, overrides={k: "float32"})
        with warnings_as_errors():
            dots.append(_dots(jax.make_jaxpr(fwd)(variables, ids)))
    assert dots[0] == dots[1] and dots[0].count("float32") == n_f32, dots


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return self.fc(x)


class NnxStack(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([NnxBlock(rngs) for _ in range(2)])
        self.head = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = jax.nn.relu(layer(x))
        return self.head(x)


@pytest.mark.parametrize("key", ["layers/1/fc", "NnxStack/layers/1/fc", "NnxStack/layers/1"])
def test_a_root_prefixed_path_matches_below_the_root_nnx(key):
    model = NnxStack(nnx.Rngs(0))
    fwd = jaxamp.autocast(model, F16, overrides={key: "float32"})
    with warnings_as_errors():
        closed = jax.make_jaxpr(fwd)(jnp.ones((2, 8)))
    assert sorted(_dots(closed)) == ["float16", "float16", "float32"]  # layers/1/fc only


def test_an_unmatched_path_names_the_nearest_real_ones_and_the_callers_line():
    model, variables, ids = _stack()
    fwd = jaxamp.autocast(model.apply, F16, overrides={"block_0/fc": "float32"})
    with pytest.warns(UserWarning, match=r"matched no module.*'blocks_0/fc'") as rec:
        jax.make_jaxpr(fwd)(variables, ids)
    assert rec[0].filename == __file__


class warnings_as_errors:
    def __enter__(self):
        import warnings
        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


# ---- float64 --------------------------------------------------------------------------------


def test_float64_is_left_alone():
    with jax.enable_x64(True):
        x = jnp.array([1.0, 2.0], jnp.float64)
        w = jnp.ones((2, 2), jnp.float64)

        def f(x, w):
            return jnp.tanh(x @ w) + 1e-12, jnp.exp(x.astype(jnp.float32))

        out64, out32 = jaxamp.autocast(f, "float32")(x, w)
        assert out64.dtype == jnp.float64 and float(out64[0] - jnp.tanh(3.0)) != 0.0
        np.testing.assert_array_equal(out64, f(x, w)[0])  # bit for bit as plain JAX
        with pytest.warns(UserWarning, match=r"the float64 inputs x \(float64\[2\]\), w "
                                             r"\(float64\[2,2\]\) made them float64"):
            closed = jax.make_jaxpr(jaxamp.autocast(f, F16))(x, w)
        assert _dots(closed) == ["float64"]
        # the one cast of a float64 value is the function's own astype (its float32 result
        # is then autocast's to place: exp runs in float32)
        assert [c for c in _casts(closed) if c[0] == "float64"] == [("float64", "float32")]


def test_a_policy_that_float64_inputs_make_do_nothing_says_so_once():
    """Issue 46: under x64 a float64 NumPy batch made every matmul float64, forward and
    backward, so float16 and bfloat16 runs gave the same loss, in silence. The loss is still
    the same (float64 is left alone), but the step warns once, naming the input and the cast."""
    from models import MLP, ce_loss

    with jax.enable_x64(True):
        batch = {"x": np.random.default_rng(0).standard_normal((16, 8)), "y": np.arange(16) % 4}
        model = MLP()
        params = model.init(jax.random.key(1), batch["x"].astype(np.float32))["params"]
        losses = {}
        for compute in ("float16", "bfloat16"):
            policy = f"params=float32,compute={compute},output=float32"
            state = jaxamp.TrainState.create(model, params, optax.sgd(0.1), policy=policy)
            step = jaxamp.make_train_step(model, ce_loss)
            with pytest.warns(UserWarning) as seen:
                state, metrics = step(state, batch)
            assert [str(w.message) for w in seen] == [
                f"jaxamp.autocast: matmuls ran in float64 where the policy asks for {compute}: "
                "with jax_enable_x64 on, float64 values are left alone (as torch autocast "
                "leaves them), and the float64 input batch['x'] (float64[16,8]) made them "
                "float64, so the policy changes nothing there. Cast it to float32 before the "
                "call (np.asarray(x, np.float32) where the batch is made)."]
            with warnings_as_errors():  # once: the step is traced once
                state, _ = step(state, batch)
            losses[compute] = float(metrics["loss"])
        assert losses["float16"] == losses["bfloat16"]
        # the cast it names: float32 inputs run the policy, and nothing is said
        state = jaxamp.TrainState.create(model, params, optax.sgd(0.1), policy=F16)
        with warnings_as_errors():
            _, metrics = jaxamp.make_train_step(model, ce_loss)(
                state, {**batch, "x": batch["x"].astype(np.float32)})
        assert float(metrics["loss"]) != losses["float16"]


# ---- handlers ---------------------------------------------------------------------------------


def test_a_handler_rewrites_one_primitive_and_can_defer():
    seen = []

    def rule(call: jaxamp.rules.RuleCall):  # the handler's argument, public in jaxamp.rules
        assert isinstance(call, jaxamp.rules.RuleCall)
        seen.append((call.policy.compute_dtype, call.stored))
        if all(call.stored):  # x @ w, both the function's inputs: run it in float32
            return [lax.dot_general(call.cast(0, jnp.float32), call.cast(1, jnp.float32),
                                    call.eqn.params["dimension_numbers"])]
        return None  # the built-in matmul rule

    rules = jaxamp.DEFAULT_OP_RULES.extend(handlers={"dot_general": rule})
    def g(w, x):
        h = x @ w
        return h @ h.T

    f = jaxamp.autocast(g, F16, op_rules=rules)
    closed = jax.make_jaxpr(f)(jnp.ones((4, 4)), jnp.ones((2, 4)))
    assert _dots(closed) == ["float32", "float16"]
    assert [s for _, s in seen] == [[True, True], [False, False]]  # h @ h.T: computed
    with pytest.raises(TypeError, match="handlers= must map primitive names to callables"):
        jaxamp.DEFAULT_OP_RULES.extend(handlers={"dot_general": 3})


def test_a_handlers_decision_reaches_the_audits_matmul_listing_of_each_repeated_layer():
    """RuleCall.decided records a decision as typed data (a mark in the name stack), which the
    audit looks up for every matmul, also in the layers autocast evaluates once and replays."""
    def rule(call: jaxamp.rules.RuleCall):
        with call.decided(f"mine {call.eqn.invars[1].aval.shape[1]}"):
            return call.default()

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(3):
                x = nn.Dense(8, name=f"layer_{i}")(x)
            return nn.Dense(4, name="head")(x)

    x = jnp.ones((2, 8))
    params = Net().init(jax.random.key(0), x)["params"]
    rules = jaxamp.DEFAULT_OP_RULES.extend(handlers={"dot_general": rule})
    report = jaxamp.audit(lambda p, x: jnp.mean(Net().apply({"params": p}, x) ** 2), params, x,
                          policy=BF16, op_rules=rules)
    assert [(m["module"], m["reason"]) for m in report.matmuls] == [
        ("layer_0", "mine 8"), ("layer_1", "mine 8"), ("layer_2", "mine 8"), ("head", "mine 4")]


# ---- evaluation cost ------------------------------------------------------------------------


def _nested(depth):
    return trace_cost.nested_loss(depth)  # bench/trace_cost.py times the same functions


@pytest.fixture
def evaluations(monkeypatch):
    counts: collections.Counter = collections.Counter()
    alive = []  # each counted jaxpr, kept alive: a freed one's id can be a new one's (flaky)
    real = evaluator.Evaluator.eval

    def counting(self, closed, *args, **kwargs):
        jaxpr = evaluator.open_jaxpr(closed)[0]
        alive.append(jaxpr)
        counts[id(jaxpr)] += 1
        return real(self, closed, *args, **kwargs)

    monkeypatch.setattr(evaluator.Evaluator, "eval", counting)
    return counts


def test_nested_control_flow_is_evaluated_a_bounded_number_of_times(evaluations):
    """checkpoint(scan(cond(...))) nested 1..4 deep: each body is evaluated at most twice (a
    carry that widens once), whatever the depth, so the total grows linearly (it was
    4/16/64/256 evaluations of the innermost body)."""
    p, x = {"w": jnp.full((8, 8), 0.1)}, jnp.ones((2, 8))
    totals = []
    for depth in range(1, 5):
        evaluations.clear()
        jax.make_jaxpr(jax.value_and_grad(jaxamp.autocast(_nested(depth), F16)))(p, x)
        assert max(evaluations.values()) <= 2
        totals.append(sum(evaluations.values()))
    steps = np.diff(totals)
    assert (steps == steps[0]).all(), totals  # linear in depth


def test_repeated_layers_are_evaluated_once_and_give_the_same_program(evaluations,
                                                                      monkeypatch):
    model, variables, ids = _stack()
    # the evaluation counts below are those of sharing alone (recompute segments are
    # programs of their own, one per segment when unshared); with them too, no jaxpr is
    # evaluated twice
    off = jaxamp.DEFAULT_OP_RULES.extend(recompute=False)

    def program(rules=off):  # a fresh function each time: make_jaxpr caches traces per function
        fwd = jaxamp.autocast(model.apply, F16, op_rules=rules)
        return fwd, jax.make_jaxpr(jax.value_and_grad(lambda v: fwd(v, ids).sum()))(variables)

    _, shared_on = program(jaxamp.DEFAULT_OP_RULES.extend(recompute=True))
    assert set(evaluations.values()) == {1}
    evaluations.clear()
    fwd, shared = program()
    bodies = dict(evaluations)
    monkeypatch.setattr(engine, "SHARE_REPEATED_CALLS", False)
    evaluations.clear()
    _, plain = program()
    assert str(shared_on) != str(plain)
    evaluations.clear()
    _, plain = program()
    # no jaxpr is evaluated twice; unshared, only the top one and gelu's / the norm's inner
    # jitted bodies (JAX hands every call the same jaxpr) are evaluated
    assert set(evaluations.values()) == {1} and set(bodies.values()) == {1}
    inner = set(evaluations) - set(bodies)
    assert len(inner) == 1  # the top-level jaxpr (a fresh one per trace)
    assert str(shared) == str(plain)
    # blocks 1 and 2 take block 0's evaluation (block 0's input is the stored embedding
    # output, the others an activation: two evaluations of the block structure) on top of the
    # top-level jaxpr and the same inner bodies
    assert len(bodies) == len(evaluations) + 2
    # each replayed layer keeps its own module path in the name stacks
    fwd_closed = jax.make_jaxpr(fwd)(variables, ids)
    paths = [re.sub(r"/?jaxamp<[^>]*>", "", str(e.source_info.name_stack))
             for e in iter_eqns(fwd_closed) if e.primitive.name == "dot_general"]
    assert paths == ["Stack/" + p for i in range(3) for p in (f"blocks_{i}/fc",
                                                              f"blocks_{i}/proj")] + [
        "Stack/head"]


# ---- patches: threads and other wrappers -----------------------------------------------------


class Tiny(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return self.fc(x)


class TinyLinen(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(x)


def test_threads_and_other_wrappers_coexist():
    """An NNX model traced under f16 and a linen one under bf16 in two threads, 20 times each:
    each sees its own policy. A wrapper of nnx.Linear.__call__ installed before the traces and
    one installed during a trace, and a wrapper of jax.nn.dot_product_attention installed
    during one, are all in place afterwards (and called)."""
    x = jnp.ones((2, 4))
    nnx_model = Tiny(nnx.Rngs(0))
    linen_model = TinyLinen()
    linen_vars = linen_model.init(jax.random.key(0), x)
    original_call = nnx.Linear.__dict__["__call__"]
    original_attention = jax.nn.dot_product_attention
    calls = collections.Counter()

    def before(self, *a, **k):
        calls["before"] += 1
        return original_call(self, *a, **k)

    nnx.Linear.__call__ = before
    errors: list = []
    start = threading.Barrier(2)
    installed: dict = {}

    def nnx_thread():
        start.wait()
        for i in range(20):
            def fn(m, x):  # reads this iteration's i while it is traced
                if i == 3 and "during" not in installed:  # noqa: B023 - installed mid-trace
                    current = nnx.Linear.__dict__["__call__"]

                    def during(self, *a, **k):
                        calls["during"] += 1
                        return current(self, *a, **k)

                    installed["during"] = during
                    nnx.Linear.__call__ = during
                    att = jax.nn.dot_product_attention

                    def attention(*a, **k):
                        calls["attention"] += 1
                        return att(*a, **k)

                    installed["attention"] = attention
                    jax.nn.dot_product_attention = attention
                return m(x)
            dots = _dots(jax.make_jaxpr(jaxamp.autocast(fn, F16))(nnx_model, x))
            if dots != ["float16"]:
                errors.append(("nnx", dots))

    def linen_thread():
        start.wait()
        for _ in range(20):
            dots = _dots(jax.make_jaxpr(jaxamp.autocast(linen_model.apply, BF16))(
                linen_vars, x))
            if dots != ["bfloat16"]:
                errors.append(("linen", dots))

    threads = [threading.Thread(target=nnx_thread), threading.Thread(target=linen_thread)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert nnx.Linear.__dict__["__call__"] is installed["during"]
        assert jax.nn.dot_product_attention is installed["attention"]
        before_calls = calls["before"]
        nnx_model(x)  # outside any trace: both wrappers run, jaxamp's passes through
        q = jnp.ones((1, 2, 1, 4))
        jax.nn.dot_product_attention(q, q, q)
        assert calls["before"] == before_calls + 1 and calls["during"] >= 1
        assert calls["attention"] >= 1
        assert not _nnx.installed()
    finally:
        nnx.Linear.__call__ = original_call
        jax.nn.dot_product_attention = original_attention
    assert jax.nn.dot_product_attention is attention.ORIGINAL


# ---- a BatchNorm written for pmap -----------------------------------------------------------


class PmapBatchNorm(nn.Module):
    axis_name: str | None = "batch"

    @nn.compact
    def __call__(self, x, train=True):
        x = nn.Dense(8)(x)
        return nn.BatchNorm(use_running_average=not train, axis_name=self.axis_name)(x)


def test_a_pmap_batchnorm_without_axis_name_is_refused_with_the_fix_and_axis_name_none_trains():
    x = jax.random.normal(jax.random.key(1), (16, 3))

    def run(model, **kw):
        variables = model.init(jax.random.key(0), x, train=False)
        state = jaxamp.TrainState.create(model, variables, optax.sgd(0.1), policy=F16)
        step = jaxamp.make_train_step(
            model, lambda apply, p, b: (apply({"params": p}, b) ** 2).mean(), **kw)
        return variables, *step(state, x)

    with pytest.raises(ValueError, match=r"axis_name='batch'.*global batch"):
        run(PmapBatchNorm())
    with pytest.raises(TypeError, match=r"axis_name must be the name \(a str\).*got 3"):
        run(PmapBatchNorm(), axis_name=3)
    variables, state, metrics = run(PmapBatchNorm(axis_name=None))
    # the running mean moved by (1 - momentum) x the whole batch's mean of the Dense output
    # (computed in float16 from the same params: float16 rounding)
    dense = variables["params"]["Dense_0"]
    want = 0.01 * (x @ dense["kernel"] + dense["bias"]).mean(0)
    stats = state.collections["batch_stats"]["BatchNorm_0"]["mean"]
    assert stats.dtype == jnp.float32 and bool(metrics["grads_finite"])
    np.testing.assert_allclose(stats, want, rtol=2e-2, atol=1e-4)


# Flax's examples/imagenet/models.py (ResNetBlock, ResNet), as written for jax.pmap: every
# BatchNorm is partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
# epsilon=1e-5, axis_name="batch"); a tiny config.
class ImagenetBlock(nn.Module):
    filters: int
    conv: Any
    norm: Any
    act: Any
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x):
        residual = x
        y = self.conv(self.filters, (3, 3), self.strides)(x)
        y = self.act(self.norm()(y))
        y = self.conv(self.filters, (3, 3))(y)
        y = self.norm(scale_init=nn.initializers.zeros_init())(y)
        if residual.shape != y.shape:
            residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(residual)
            residual = self.norm(name="norm_proj")(residual)
        return self.act(residual + y)


class ImagenetResNet(nn.Module):
    stage_sizes: tuple[int, ...] = (1, 1)
    num_classes: int = 4
    num_filters: int = 8

    @nn.compact
    def __call__(self, x, train: bool = True):
        conv = functools.partial(nn.Conv, use_bias=False, dtype=jnp.float32)
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                                 epsilon=1e-5, dtype=jnp.float32, axis_name="batch")
        x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(x)
        x = nn.relu(norm(name="bn_init")(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for i, block_size in enumerate(self.stage_sizes):
            for j in range(block_size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = ImagenetBlock(self.num_filters * 2 ** i, strides=strides, conv=conv,
                                  norm=norm, act=nn.relu)(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, dtype=jnp.float32)(x)


def _imagenet_loss(apply_fn, params, batch):
    logits = apply_fn({"params": params}, batch["x"], train=True)
    return jaxamp.softmax_cross_entropy(logits, batch["y"])


def test_a_model_written_for_pmap_trains_unmodified_with_axis_name():
    """make_train_step(axis_name="batch") on Flax's imagenet ResNet: one step equals the pmap
    recipe (per-device loss and BatchNorm statistics, pmean'd over the "batch" axis: here 2
    devices as a vmap with that axis name) in params, batch statistics and loss."""
    model = ImagenetResNet()
    x = jax.random.normal(jax.random.key(0), (8, 16, 16, 3))
    y = jnp.arange(8) % 4
    variables = model.init(jax.random.key(1), x, train=False)
    f32 = "params=float32,compute=float32,output=float32"
    state = jaxamp.TrainState.create(model, variables, optax.sgd(0.5), policy=f32)
    step = jaxamp.make_train_step(model, _imagenet_loss, axis_name="batch", donate=False)
    new, metrics = step(state, {"x": x, "y": y})

    def device_loss(params, stats, xb, yb):  # what the pmap train step of the example runs
        logits, upd = model.apply({"params": params, "batch_stats": stats}, xb, train=True,
                                  mutable=["batch_stats"])
        return jaxamp.softmax_cross_entropy(logits, yb), upd["batch_stats"]

    (loss, stats), grads = jax.vmap(
        jax.value_and_grad(device_loss, has_aux=True), in_axes=(None, None, 0, 0),
        axis_name="batch")(variables["params"], variables["batch_stats"],
                           x.reshape(2, 4, 16, 16, 3), y.reshape(2, 4))
    grads = jax.tree.map(lambda g: g.mean(0), grads)  # lax.pmean(grads, "batch")
    want_params = jax.tree.map(lambda p, g: p - 0.5 * g, variables["params"], grads)
    want_stats = jax.tree.map(lambda s: s[0], stats)
    for a, b in zip(jax.tree.leaves(want_stats), jax.tree.leaves(new.collections)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    assert float(metrics["loss"]) == pytest.approx(float(loss.mean()), rel=1e-5)
    for a, b in zip(jax.tree.leaves(want_params), jax.tree.leaves(new.params)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
    # the statistics are the global batch's: one device's half alone gives other ones
    _, half = jax.vmap(device_loss, in_axes=(None, None, 0, 0), axis_name="batch")(
        variables["params"], variables["batch_stats"], x[None, :4], y[None, :4])
    assert not np.allclose(jax.tree.leaves(half)[0][0], jax.tree.leaves(want_stats)[0],
                           rtol=1e-3)

    # and it trains under float16 (dynamic loss scale), unmodified
    state = jaxamp.TrainState.create(model, variables, optax.adam(3e-3), policy=F16)
    step = jaxamp.make_train_step(model, _imagenet_loss, axis_name="batch")
    losses = []
    for _ in range(6):
        state, metrics = step(state, {"x": x, "y": y})
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] and int(state.skipped_steps) <= 1, losses
