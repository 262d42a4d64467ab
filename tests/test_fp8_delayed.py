"""``fp8=delayed`` (issue #43): per-tensor FP8 scales from an amax history of earlier steps,
kept in ``TrainState.opt_state.fp8``. One matmul against an independent quantise-dequantise
reference (numpy + ml_dtypes), the train step's history update, the first call's calibration,
skipped steps, zero tensors, micro-batches, loop bodies, checkpoints and an 8-device mesh."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import flax.linen as nn
import fp8_reference
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp._engine.compat import name_scopes
from jaxamp._engine.context import MARKS
from jaxamp._engine.jaxpr import duplicate_casts, iter_eqns, lossy_round_trips
from jaxamp.fp8 import DelayedScaling, FP8Matmuls, delayed_scope, fp8_delayed_dot_general
from jaxamp.policy import fp8_recipe, get_policy, policy_to_str

sys.path.insert(0, str(Path(__file__).parent))

DELAYED = "params=float32,compute=bfloat16,output=float32,matmul=float8,fp8=delayed"
CURRENT = "params=float32,compute=bfloat16,output=float32,matmul=float8"
DIMS = (((1,), (0,)), ((), ()))
E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2


def _rules(history=4, reduction="max"):
    """Every aligned matmul in FP8 (no size threshold, no first/last exclusion)."""
    return jaxamp.DEFAULT_OP_RULES.extend(handlers={"dot_general": FP8Matmuls(
        small=(0, 0), min_size=0, keep_first_last=False,
        delayed=DelayedScaling(history=history, reduction=reduction))})


def _ref_quantize(x, amax, dtype):
    """Quantised with the scale of ``amax`` (not the tensor's own): :func:`fp8_reference.quantize`,
    written without jaxamp; what exceeds the range saturates."""
    return fp8_reference.quantize(x, dtype, amax=amax)


def _ref_amax(history, reduction):
    h = np.where(np.isfinite(history), history, 0.0)
    return h[:, 0] if reduction == "most_recent" else h.max(axis=1)


def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


# ---- the policy key ---------------------------------------------------------------------------


def test_fp8_delayed_per_policy_and_per_override():
    p = get_policy(DELAYED)
    assert fp8_recipe(p) == "delayed" and policy_to_str(p) == DELAYED
    assert fp8_recipe(get_policy("c=bf16,matmul=fp8,fp8=delayed")) == "delayed"
    # per override: only the overridden module's matmul keeps a history
    model, params, batch = _net()
    step = jaxamp.make_train_step(model, _loss, overrides={"proj": "fp8=delayed"},
                                  op_rules=_rules(), donate=False)
    state = jaxamp.TrainState.create(model, params, optax.sgd(0.1), policy=CURRENT)
    # the audit of the step lists each FP8 matmul's recipe, before the first call and after
    before = {m["module"]: m["recipe"] for m in jaxamp.audit(step, state, batch).matmuls
              if m["fp8"] == "yes"}
    state, _ = step(state, batch)
    assert sorted(state.opt_state.fp8) == ["Net/proj#0"]
    assert state.opt_state.fp8["Net/proj#0"].shape == (3, 4)
    after = {m["module"]: m["recipe"] for m in jaxamp.audit(step, state, batch).matmuls
             if m["fp8"] == "yes"}
    assert before == after and after["proj"] == "delayed" and after["fc"] == "current", after
    with pytest.raises(ValueError, match=r"Allowed fp8 recipes: current, rowwise, delayed"):
        get_policy("c=bf16,matmul=fp8,fp8=late")


def test_bad_delayed_options_name_the_value_and_the_fix():
    with pytest.raises(ValueError, match=r"history must be an int >= 1.*got 0.*history=1024"):
        DelayedScaling(history=0)
    with pytest.raises(ValueError, match=r"reduction must be one of \('max', 'most_recent'\), "
                                         r"got 'mean'.*reduction='max'"):
        DelayedScaling(reduction="mean")
    with pytest.raises(TypeError, match=r"delayed must be a jaxamp.fp8.DelayedScaling, got 16"):
        FP8Matmuls(delayed=16)
    with pytest.raises(ValueError, match=r"history must be f32\[3, L\].*got shape \(4,\)"):
        fp8_delayed_dot_general(jnp.ones((16, 16)), jnp.ones((16, 16)), DIMS, jnp.ones(4),
                                compute_dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"recipe='delayed' scales from an amax history"):
        jaxamp.fp8.fp8_dot_general(jnp.ones((16, 16)), jnp.ones((16, 16)), DIMS,
                                   compute_dtype=jnp.float32, recipe="delayed")


# ---- one matmul against the reference ---------------------------------------------------------


@pytest.mark.parametrize("reduction", ["max", "most_recent"])
def test_one_delayed_matmul_equals_the_reference_given_its_history(reduction):
    k = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(k[0], (48, 32)) * 3.0
    w = jax.random.normal(k[1], (32, 64)) * 0.05
    g = jax.random.normal(k[2], (48, 64)) * 1e-3
    # rows x, w, g; newest first. most_recent: x's scale from 2.0 while |x| reaches ~10, so
    # the large entries saturate (what delayed scaling does to an outlier); max: from 16.0
    history = np.array([[2.0, 16.0, np.inf, 1.0], [0.1, 0.3, 0.0, 0.2],
                        [4e-3, 1e-3, 2e-3, np.nan]], np.float32)
    f = functools.partial(fp8_delayed_dot_general, dimension_numbers=DIMS,
                          compute_dtype=jnp.float32, reduction=reduction)
    y, vjp = jax.vjp(lambda a, b, h: f(a, b, history=h), x, w, jnp.asarray(history))
    dx, dw, dh = vjp(g)
    ax, aw, ag = _ref_amax(history, reduction)
    xq, sx = _ref_quantize(x, ax, E4M3)
    wq, sw = _ref_quantize(w, aw, E4M3)
    gq, sg = _ref_quantize(g, ag, E5M2)
    for got, want in ((y, (xq @ wq) * (sx * sw)), (dx, (gq @ wq.T) * (sg * sw)),
                      (dw, (xq.T @ gq) * (sx * sg))):
        # float32 sums of exact products: 1e-6 of the largest (a sum that nearly cancels
        # keeps the absolute error, not the relative)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    # the scales are the history's, not the tensors' own
    assert sx != _ref_quantize(x, float(jnp.max(jnp.abs(x))), E4M3)[1]
    if reduction == "most_recent":
        assert np.max(np.abs(xq)) == 448.0  # saturated
    # the history's gradient: this call's amaxes in column 0, zeros elsewhere
    want = np.zeros_like(history)
    want[:, 0] = [np.max(np.abs(x)), np.max(np.abs(w)), np.max(np.abs(g))]
    np.testing.assert_array_equal(dh, want)


def test_a_zero_tensor_and_a_zero_history_stay_finite():
    zero_history = jnp.zeros((3, 4))
    x, w = jnp.zeros((16, 32)), jnp.full((32, 16), 600.0)

    def f(x, w, h):
        return fp8_delayed_dot_general(x, w, DIMS, h, compute_dtype=jnp.float32)

    y, vjp = jax.vjp(f, x, w, zero_history)
    dx, dw, dh = vjp(jnp.zeros((16, 16)))
    for a in (y, dx, dw, dh):
        assert np.isfinite(np.asarray(a)).all()
    np.testing.assert_array_equal(y, 0.0)
    np.testing.assert_array_equal(dh[:, 0], [0.0, 600.0, 0.0])
    # amax 0 -> scale 1: w's 600 saturates at E4M3's 448, as the reference says
    y = f(jnp.ones((16, 32)), w, zero_history)
    wq, sw = _ref_quantize(np.asarray(w), 0.0, E4M3)
    assert sw == 1.0 and wq.max() == 448.0
    np.testing.assert_array_equal(y, 32 * 448.0)


# ---- the train step ---------------------------------------------------------------------------


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(32, name="fc")(x)
        return nn.Dense(16, name="proj")(nn.gelu(h))


def _loss(apply_fn, params, batch):
    return jnp.mean((apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)


def _net(rows=8, seed=0):
    model = Net()
    k = jax.random.split(jax.random.key(seed), 3)
    batch = {"x": jax.random.normal(k[0], (rows, 16)) * 2.0,
             "y": jax.random.normal(k[1], (rows, 16))}
    return model, model.init(k[2], batch["x"])["params"], batch


def _bf16_exact(x):
    return np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)


def _linear_case(rows=8):
    """One Dense without bias, ``loss = mean(x @ W * t)``: the output gradient is ``t / (B*N)``
    exactly (powers of two), inputs and weights bfloat16-exact."""
    model = nn.Dense(16, use_bias=False)
    rng = np.random.default_rng(0)
    x = _bf16_exact(rng.standard_normal((rows, 16)) * 3.0)
    t = rng.choice([-2.0, -1.0, 0.5, 1.0], size=(rows, 16)).astype(np.float32)
    w = _bf16_exact(rng.standard_normal((16, 16)) * 0.2)
    return model, {"kernel": jnp.asarray(w)}, {"x": jnp.asarray(x), "t": jnp.asarray(t)}


def _linear_loss(apply_fn, params, batch):
    return jnp.mean(apply_fn({"params": params}, batch["x"]) * batch["t"])


def _with_history(state, history):
    return state.replace(opt_state=state.opt_state._replace(
        fp8={"Dense#0": jnp.asarray(history)}))


HISTORY = np.array([[4.0, 9.0, 0.0, 0.0], [0.25, 1.0, 0.0, 0.0],
                    [1e-3, 4e-3, 0.0, 0.0]], np.float32)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_a_step_scales_with_the_history_and_pushes_this_steps_amaxes(micro_batches):
    model, params, batch = _linear_case()
    tx = optax.sgd(0.5)
    state = _with_history(jaxamp.TrainState.create(model, params, tx, policy=DELAYED), HISTORY)
    step = jaxamp.make_train_step(model, _linear_loss, micro_batches=micro_batches,
                                  op_rules=_rules(), donate=False)
    new, metrics = step(state, batch)
    assert not bool(metrics["skipped"])
    x, t, w = (np.asarray(batch["x"], np.float64), np.asarray(batch["t"], np.float64),
               np.asarray(params["kernel"], np.float64))
    g = t / t.size  # d mean(y * t) / dy
    # the weight gradient with the history's scales (max reduction)
    ax, _, ag = _ref_amax(HISTORY, "max")
    xq, sx = _ref_quantize(x, ax, E4M3)
    gq, sg = _ref_quantize(g, ag, E5M2)
    np.testing.assert_allclose(new.params["kernel"], w - 0.5 * (xq.T @ gq) * (sx * sg),
                               rtol=1e-6, atol=1e-7)
    # this step's amaxes pushed in (the max over micro-batches: an amax, not a sum), the
    # oldest column dropped
    want = np.concatenate([[[np.abs(x).max()], [np.abs(w).max()], [np.abs(g).max()]],
                           HISTORY[:, :-1]], axis=1)
    np.testing.assert_array_equal(new.opt_state.fp8["Dense#0"], want.astype(np.float32))


@pytest.mark.parametrize("bad", ["nan_input", "inf_target"])
def test_a_skipped_step_leaves_the_history_bit_identical(bad):
    model, params, batch = _linear_case()
    state = _with_history(jaxamp.TrainState.create(model, params, optax.sgd(0.5),
                                                   policy=DELAYED), HISTORY)
    step = jaxamp.make_train_step(model, _linear_loss, op_rules=_rules(), donate=False)
    key = "x" if bad == "nan_input" else "t"
    batch = dict(batch, **{key: batch[key].at[3, 5].set(np.nan if key == "x" else np.inf)})
    new, metrics = step(state, batch)
    assert bool(metrics["skipped"]) and int(new.skipped_steps) == 1
    assert _bits(new.opt_state.fp8) == _bits(state.opt_state.fp8)
    assert _bits(new.params) == _bits(state.params)


def test_a_zero_batch_step_stays_finite_and_records_amax_zero():
    model, params, batch = _linear_case()
    state = _with_history(jaxamp.TrainState.create(model, params, optax.sgd(0.5),
                                                   policy=DELAYED), np.zeros((3, 4), np.float32))
    step = jaxamp.make_train_step(model, _linear_loss, op_rules=_rules(reduction="most_recent"),
                                  donate=False)
    zero = {"x": jnp.zeros_like(batch["x"]), "t": batch["t"]}
    new, metrics = step(state, zero)  # a zero history and a zero input: scales 1, no 0/0
    assert not bool(metrics["skipped"]) and np.isfinite(float(metrics["loss"]))
    np.testing.assert_array_equal(new.opt_state.fp8["Dense#0"][0], 0.0)  # amax(x) = 0
    new, metrics = step(new, batch)  # most_recent amax 0 again: scale 1, finite
    assert not bool(metrics["skipped"]) and np.isfinite(float(metrics["grad_norm"]))


class Blocks(nn.Module):
    """An input projection, two structurally equal blocks (repeated calls autocast would
    evaluate once and replay), a head."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(32, name="inp")(x)
        for i in range(2):
            h = h + nn.Dense(32, name=f"blocks_{i}")(nn.gelu(h))
        return nn.Dense(16, name="head")(h)


def test_the_first_call_calibrates_and_then_runs_as_current_scaling():
    """The calibration pass scales with the first batch's own amaxes, so the first step with
    those histories takes the scales fp8=current would: the same params, bit for bit. Each
    repeated block keeps its own history."""
    _, _, batch = _net()
    model = Blocks()
    params = model.init(jax.random.key(1), batch["x"])["params"]
    tx = optax.sgd(0.1)
    out = {}
    for policy in (CURRENT, DELAYED):
        step = jaxamp.make_train_step(model, _loss, op_rules=_rules(), donate=False)
        out[policy] = step(jaxamp.TrainState.create(model, params, tx, policy=policy), batch)[0]
    delayed = out[DELAYED]
    assert sorted(delayed.opt_state.fp8) == ["Blocks/blocks_0#0", "Blocks/blocks_1#0",
                                             "Blocks/head#0", "Blocks/inp#0"]
    assert _bits(delayed.params) == _bits(out[CURRENT].params)
    assert out[CURRENT].opt_state.fp8 == {}
    for h in delayed.opt_state.fp8.values():
        h = np.asarray(h)
        assert (h[:, 0] > 0).all() and (h[:, 2:] == 0).all()
        np.testing.assert_array_equal(h[:, 0], h[:, 1])  # calibration and step: one batch
    x_amax = float(jnp.max(jnp.abs(batch["x"])))
    assert float(delayed.opt_state.fp8["Blocks/inp#0"][0, 0]) == x_amax


class _Layer(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return nn.gelu(nn.Dense(32, name="d")(h)), None


class Scanned(nn.Module):
    """Three layers as one ``nn.scan`` (params stacked on axis 0), or (``shared``) one layer's
    params for every iteration (``variable_broadcast``: a loop over shared weights)."""

    shared: bool = False

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(32, name="inp")(x)
        how = dict(variable_broadcast="params", split_rngs={"params": False}) if self.shared \
            else dict(variable_axes={"params": 0}, split_rngs={"params": True})
        h, _ = nn.scan(_Layer, length=3, **how)(name="layers")(h, None)
        return nn.Dense(16, name="head")(h)


class Unrolled(nn.Module):
    """:class:`Scanned` written out: the same layers, one module each."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(32, name="inp")(x)
        for i in range(3):
            h, _ = _Layer(name=f"layers_{i}")(h, None)
        return nn.Dense(16, name="head")(h)


def _decisions(jaxpr) -> set:
    return {MARKS[p.name].decision for e in iter_eqns(jaxpr) for p in name_scopes(e)
            if p.name in MARKS and MARKS[p.name].decision}


def _steps(model, params, batch, n=3):
    step = jaxamp.make_train_step(model, _loss, op_rules=_rules(), donate=False)
    state = step.calibrate(jaxamp.TrainState.create(model, params, optax.sgd(0.1),
                                                    policy=DELAYED), batch)
    decisions = _decisions(jax.make_jaxpr(step.traceable)(state, batch).jaxpr)
    for _ in range(n):
        state, metrics = step(state, batch)
        assert not bool(metrics["skipped"])
    return state, decisions


def test_scanned_layers_keep_a_history_each_as_the_unrolled_model_does():
    """A scan over stacked layers is evaluated layer by layer under a delayed policy: each
    layer keeps its own history, and three steps equal the unrolled model's bit for bit
    (params and histories)."""
    _, _, batch = _net()
    params = Scanned().init(jax.random.key(1), batch["x"])["params"]
    scanned, decisions = _steps(Scanned(), params, batch)
    assert sorted(scanned.opt_state.fp8) == ["Scanned/head#0", "Scanned/inp#0", "layers/d#0",
                                             "layers/d#1", "layers/d#2"]
    assert decisions == {"delayed"}
    layers = {f"layers_{i}": jax.tree.map(lambda a, i=i: a[i], params["layers"])
              for i in range(3)}
    unrolled, decisions = _steps(Unrolled(), {**params, **layers}, batch)
    assert decisions == {"delayed"}
    for i in range(3):
        assert _bits(jax.tree.map(lambda a, i=i: a[i], scanned.params["layers"])) == \
            _bits(unrolled.params[f"layers_{i}"])
        assert _bits(scanned.opt_state.fp8[f"layers/d#{i}"]) == \
            _bits(unrolled.opt_state.fp8[f"Unrolled/layers_{i}/d#0"])
    assert _bits(scanned.opt_state.fp8["Scanned/inp#0"]) == \
        _bits(unrolled.opt_state.fp8["Unrolled/inp#0"])


def test_nnx_scanned_layers_keep_a_history_each():
    """``nnx.scan`` over layers made by ``nnx.vmap`` (the NNX example's blocks)."""
    from flax import nnx

    class Stack(nnx.Module):
        def __init__(self, rngs):
            self.inp = nnx.Linear(16, 32, rngs=rngs)

            @nnx.split_rngs(splits=3)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def layers(rngs):
                return nnx.Linear(32, 32, rngs=rngs)

            self.layers = layers(rngs)
            self.head = nnx.Linear(32, 16, rngs=rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
            def run(layer, h):
                return nnx.gelu(layer(h))

            return self.head(run(self.layers, self.inp(x)))

    _, _, batch = _net()
    step = jaxamp.make_train_step(
        loss_fn=lambda model, b: jnp.mean((model(b["x"]) - b["y"]) ** 2), op_rules=_rules(),
        donate=False)
    state = jaxamp.TrainState.create(Stack(nnx.Rngs(0)), tx=optax.sgd(0.1), policy=DELAYED)
    state = step.calibrate(state, batch)
    layers = sorted(k for k in state.opt_state.fp8 if k not in ("Stack/inp#0", "Stack/head#0"))
    assert len(layers) == 3 and len(state.opt_state.fp8) == 5, sorted(state.opt_state.fp8)
    assert _decisions(jax.make_jaxpr(step.traceable)(state, batch).jaxpr) == {"delayed"}
    new, metrics = step(state, batch)
    assert not bool(metrics["skipped"])
    assert all(float(new.opt_state.fp8[k][0, 1]) > 0 for k in layers)  # pushed per layer


def test_the_example_gpt_evaluated_layer_by_layer_casts_each_value_once():
    """The cast checks on a model with ``nn.scan`` blocks and attention (the example's GPT,
    ``test`` preset) evaluated layer by layer under delayed scaling: no value cast twice, no
    float32 -> low -> float32 round trip, no cast between two low dtypes."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
    import lm_model

    model, params = lm_model.init_params(lm_model.PRESETS["test"])
    ids = jax.random.randint(jax.random.key(0), (2, 33), 0, 256)
    batch = {"x": ids[:, :-1], "y": ids[:, 1:]}

    def loss(apply_fn, params, b):
        return jaxamp.softmax_cross_entropy(apply_fn({"params": params}, b["x"]), b["y"])

    step = jaxamp.make_train_step(model, loss, op_rules=_rules(), donate=False)
    state = step.calibrate(jaxamp.TrainState.create(model, params, optax.sgd(0.1),
                                                    policy=DELAYED), batch)
    assert len(state.opt_state.fp8) == 9  # 4 projections x 2 layers, and the head
    amp = jaxamp.autocast(model.apply, DELAYED, op_rules=_rules())
    with delayed_scope(state.opt_state.fp8):
        jaxpr = jax.make_jaxpr(lambda p, x: amp({"params": p}, x))(params, batch["x"])
    assert duplicate_casts(jaxpr) == [] and lossy_round_trips(jaxpr) == []
    low = {"bfloat16", "float16"}
    assert not [e for e in iter_eqns(jaxpr) if e.primitive.name == "convert_element_type"
                and {str(e.invars[0].aval.dtype), str(e.params["new_dtype"])} <= low
                and e.invars[0].aval.dtype != e.params["new_dtype"]]


def test_a_matmul_in_a_loop_over_shared_weights_falls_back_to_current_and_says_so():
    """One weight for every iteration (no stack of layers): one equation runs them all and
    cannot keep a history each."""
    _, _, batch = _net()
    model = Scanned(shared=True)
    params = model.init(jax.random.key(1), batch["x"])["params"]
    state, decisions = _steps(model, params, batch, n=1)
    assert sorted(state.opt_state.fp8) == ["Scanned/head#0", "Scanned/inp#0"]
    assert decisions == {"delayed", "current (loop body)"}


def test_lowering_a_state_without_its_histories_is_refused_naming_the_fix():
    """``step.lower`` does not calibrate: a program lowered without the histories would run
    every delayed matmul with current scaling, silently (the example compiled its step so)."""
    model, params, batch = _net()
    step = jaxamp.make_train_step(model, _loss, op_rules=_rules(), donate=False)
    state = jaxamp.TrainState.create(model, params, optax.sgd(0.1), policy=DELAYED)
    with pytest.raises(ValueError, match=r"step.lower: the policy .*fp8=delayed.*no amax "
                                         r"histories.*state = step.calibrate\(state, batch\)"):
        step.lower(state, batch)
    calibrated = step.calibrate(state, batch)
    new, _ = step.lower(calibrated, batch).compile()(calibrated, batch)
    assert _bits(new.params) == _bits(step(state, batch)[0].params)
    # a policy without delayed matmuls lowers as it is
    step.lower(jaxamp.TrainState.create(model, params, optax.sgd(0.1), policy=CURRENT), batch)


def test_a_state_whose_histories_do_not_match_the_program_is_refused():
    model, params, batch = _net()
    state = jaxamp.TrainState.create(model, params, optax.sgd(0.1), policy=DELAYED)
    state = state.replace(opt_state=state.opt_state._replace(fp8={"Other/fc#0": jnp.ones((3, 4))}))
    step = jaxamp.make_train_step(model, _loss, op_rules=_rules(), donate=False)
    with pytest.raises(ValueError, match=r"'Net/fc#0' has no amax history in the state, which "
                                         r"holds 1 \(Other/fc#0\).*_replace\(fp8=\{\}\)"):
        step(state, batch)


def test_a_resume_with_another_history_length_names_both():
    """A state whose histories keep 4 steps, resumed by a step that keeps 8: refused while the
    step is traced (the new length was silently ignored), naming both lengths and the fixes."""
    model, params, batch = _net()
    state = jaxamp.TrainState.create(model, params, optax.sgd(0.1), policy=DELAYED)
    state, _ = jaxamp.make_train_step(model, _loss, op_rules=_rules(history=4),
                                      donate=False)(state, batch)
    longer = jaxamp.make_train_step(model, _loss, op_rules=_rules(history=8), donate=False)
    with pytest.raises(ValueError, match=r"amax history of 'Net/\w+#0' holds 4 steps, but the "
                                         r"step's FP8Matmuls\(delayed=DelayedScaling\(history="
                                         r"8\)\) keeps 8.*DelayedScaling\(history=4\)"):
        longer(state, batch)


# ---- checkpoints ------------------------------------------------------------------------------


def test_a_checkpoint_resumes_bit_identically(tmp_path):
    """Saved and restored as examples/lm_checkpoint.py does (orbax StandardSave/Restore into
    an abstract state): the resumed run continues with the numbers of an uninterrupted one."""
    import orbax.checkpoint as ocp

    model, params, batch0 = _net()
    batches = [batch0] + [_net(seed=s)[2] for s in (1, 2, 3)]
    tx = optax.adam(1e-2)
    step = jaxamp.make_train_step(model, _loss, op_rules=_rules(), donate=False)
    fresh = jaxamp.TrainState.create(model, params, tx, policy=DELAYED)
    state = fresh
    for b in batches:
        state, _ = step(state, b)
        if b is batches[1]:
            saved = state
    mgr = ocp.CheckpointManager(tmp_path, options=ocp.CheckpointManagerOptions(
        enable_async_checkpointing=False))
    mgr.save(2, args=ocp.args.StandardSave(saved))
    mgr.wait_until_finished()
    # a new process knows the histories' shapes from the calibration's (traced, not run)
    target = jax.eval_shape(step.calibrate, fresh, batch0)
    assert sorted(target.opt_state.fp8) == ["Net/fc#0", "Net/proj#0"]
    restored = mgr.restore(2, args=ocp.args.StandardRestore(target))
    restored = jax.tree.map(np.asarray, restored)
    assert _bits(restored.opt_state.fp8) == _bits(saved.opt_state.fp8)
    for b in batches[2:]:
        restored, _ = step(restored, b)
    assert _bits(restored.params) == _bits(state.params)
    assert _bits(restored.opt_state) == _bits(state.opt_state)
    h = np.asarray(state.opt_state.fp8["Net/fc#0"])
    assert (h > 0).all()  # four steps (with calibration, five amaxes) filled the history


# ---- 8 virtual devices ------------------------------------------------------------------------


def _mesh_run(mesh=None, model=None) -> dict:
    net, params, batch = _net(rows=32)
    if model is None:
        model = net
    else:  # stacked layers (Scanned), a history each
        params = model.init(jax.random.key(1), batch["x"])["params"]
    tx = optax.sgd(0.5)
    state = jaxamp.TrainState.create(model, params, tx, policy=DELAYED)
    kw = {}
    if mesh is not None:
        state = jaxamp.shard_state(state, mesh)
        kw = {"mesh": mesh}
    step = jaxamp.make_train_step(model, _loss, micro_batches=2, op_rules=_rules(),
                                  f32_weight_grads=True, donate=False, **kw)
    for _ in range(3):
        state, _ = step(state, batch)
    return {k: np.asarray(v).tolist() for k, v in state.opt_state.fp8.items()}


def script() -> dict:
    """Run in a subprocess with 8 virtual CPU devices (:func:`multihost.script_on_devices`)."""
    from jax.sharding import Mesh

    assert jax.device_count() == 8
    mesh = Mesh(np.array(jax.devices()), ("data",))
    return {"one": _mesh_run(), "mesh": _mesh_run(mesh),
            "scanned_one": _mesh_run(model=Scanned()), "scanned_mesh": _mesh_run(mesh, Scanned())}


def test_on_a_mesh_each_tensor_keeps_one_history_of_the_global_max():
    import multihost

    out = multihost.script_on_devices("test_fp8_delayed")
    one, mesh = out["one"], out["mesh"]
    assert sorted(mesh) == sorted(one) == ["Net/fc#0", "Net/proj#0"]
    for site in one:
        a, b = np.asarray(one[site]), np.asarray(mesh[site])
        assert a.shape == b.shape == (3, 4)
        # x and w: the global max over the devices' rows, exactly; the output gradient's
        # amax as close as the two programs' bfloat16 roundings allow
        np.testing.assert_array_equal(b[:2], a[:2])
        np.testing.assert_allclose(b[2], a[2], rtol=2e-2)
        assert (a[:, :3] > 0).all()
    # the input's amax is the whole batch's (one device sees 4 of its 32 rows)
    assert one["Net/fc#0"][0][0] == float(jnp.max(jnp.abs(_net(rows=32)[2]["x"])))
    # scanned layers on the mesh: a history per layer, each the global max too
    one, mesh = out["scanned_one"], out["scanned_mesh"]
    assert sorted(mesh) == sorted(one) == ["Scanned/head#0", "Scanned/inp#0", "layers/d#0",
                                           "layers/d#1", "layers/d#2"]
    for site in one:
        a, b = np.asarray(one[site]), np.asarray(mesh[site])
        np.testing.assert_array_equal(b[:2], a[:2])
        np.testing.assert_allclose(b[2], a[2], rtol=2e-2)
