"""``jaxamp.amp``, the optax transformation: a hand-written step equals make_train_step bit for
bit, and follows the PyTorch recipe (scale -> backward -> unscale_ -> clip_grad_norm_ -> step ->
update), checked against torch where it is installed and against a float64 NumPy copy of the
recipe everywhere."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from models import MLP, ce_loss

import jaxamp
from jaxamp.transform import AmpState

F16 = "params=float32,compute=float16,output=float32"




def _setup(n=16):
    model = MLP()
    x = jax.random.normal(jax.random.key(0), (n, 8))
    params = model.init(jax.random.key(1), x)["params"]
    return model, params, {"x": x, "y": jnp.arange(n) % 4}


def _poison(batch, row=0):
    return {**batch, "x": batch["x"].at[row, 0].set(jnp.inf)}


def _assert_bits_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb, strict=True):
        x, y = np.atleast_1d(np.asarray(x)), np.atleast_1d(np.asarray(y))
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


def _loss_scale():
    return jaxamp.DynamicLossScale(2.0**10, growth_interval=3, max_loss_scale=2.0**12)


def test_hand_written_step_matches_make_train_step_bit_for_bit():
    model, params, batch = _setup()
    inner = optax.adamw(optax.cosine_decay_schedule(1e-2, 50), weight_decay=0.1)
    # The hand-written step: the three-line change of the README.
    tx = jaxamp.amp(inner, loss_scale=_loss_scale(), clip_norm=1.0)
    loss_fn = jaxamp.autocast(lambda p, b: ce_loss(model.apply, p, b), F16)

    @jax.jit
    def train_step(params, opt_state, batch):
        def scaled(p):
            loss = loss_fn(p, batch)
            return jaxamp.scale_loss(loss, opt_state), loss

        grads, loss = jax.grad(scaled, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jaxamp.make_train_step(model, ce_loss, inner, clip_norm=1.0)
    state = jaxamp.TrainState.create(model, params, inner, policy=F16, loss_scale=_loss_scale())
    p, o = params, tx.init(params)
    bad = {2, 5, 6}
    skipped = []
    for i in range(10):
        b = _poison(batch) if i in bad else batch
        p, o, loss = train_step(p, o, b)
        state, m = step(state, b)
        _assert_bits_equal(state.params, p)
        _assert_bits_equal(state.opt_state, o)  # the whole AmpState, one layout
        _assert_bits_equal(state.loss_scale, o.loss_scale)
        np.testing.assert_array_equal(state.skipped_steps, o.skipped_steps)
        np.testing.assert_array_equal(m["grad_norm"], o.grad_norm)
        np.testing.assert_array_equal(m["loss"], loss)
        skipped.append(not bool(o.grads_finite))
    assert {i for i, s in enumerate(skipped) if s} == bad
    assert int(o.inner_state[0].count) == 10 - len(bad)  # the schedule saw applied steps only


def test_skipped_update_is_bit_identical_for_negative_zero_and_bf16_params():
    params = {"w": jnp.array([-0.0, 0.0, 1.5, -3.0]), "b": jnp.array([-0.0, 2.0], jnp.bfloat16)}
    tx = jaxamp.amp(optax.adam(1e-1), loss_scale=jaxamp.StaticLossScale(4.0))
    opt_state = tx.init(params)
    grads = {"w": jnp.array([1.0, jnp.nan, 1.0, 1.0]), "b": jnp.ones(2, jnp.bfloat16)}
    updates, new_state = jax.jit(tx.update)(grads, opt_state, params)
    _assert_bits_equal(optax.apply_updates(params, updates), params)
    _assert_bits_equal(new_state.inner_state, opt_state.inner_state)
    assert int(new_state.skipped_steps) == 1 and not bool(new_state.grads_finite)
    assert new_state.inner_state[0].mu["b"].dtype == jnp.bfloat16  # dtypes kept


def test_amp_accepts_jax_scalars_and_rejects_bad_input():
    params = {"w": jnp.ones(3)}
    grads = {"w": jnp.full(3, 8.0)}
    a = jaxamp.amp(optax.sgd(1.0), loss_scale=jaxamp.StaticLossScale(2.0), clip_norm=1.0)
    b = jaxamp.amp(optax.sgd(1.0), loss_scale=jaxamp.StaticLossScale(jnp.float32(2.0)),
                   clip_norm=jnp.float32(1.0))
    ua, _ = a.update(grads, a.init(params), params)
    ub, _ = b.update(grads, b.init(params), params)
    _assert_bits_equal(ua, ub)
    np.testing.assert_allclose(optax.tree.norm(ua), 1.0, rtol=1e-6)
    with pytest.raises(ValueError, match=r"clip_norm must be a positive finite number.*-1"):
        jaxamp.amp(optax.sgd(1.0), clip_norm=-1.0)
    with pytest.raises(ValueError, match="clip_norm"):
        jaxamp.amp(optax.sgd(1.0), clip_norm=jnp.ones(2))
    with pytest.raises(TypeError, match="loss_scale must be a jaxamp.DynamicLossScale.*float"):
        jaxamp.amp(optax.sgd(1.0), loss_scale=2.0**15)
    with pytest.raises(TypeError, match="tx must be an optax.GradientTransformation"):
        jaxamp.amp(lambda g: g)
    # a foreign optimizer state: a clear error, not an optax AttributeError
    with pytest.raises(TypeError, match="expected the state made by this transformation"):
        a.update(grads, optax.sgd(1.0).init(params), params)
    foreign = a.init(params)._replace(inner_state=optax.adam(1e-3).init(params))
    with pytest.raises(ValueError, match="does not match the optimizer"):
        a.update(grads, foreign, params)
    with pytest.raises(ValueError, match="found 0"):
        jaxamp.scale_loss(jnp.ones(()), optax.sgd(1.0).init(params))


def test_loss_scale_given_to_amp_stays_usable_and_chains():
    ls = jaxamp.DynamicLossScale(2.0**8)
    tx = optax.chain(jaxamp.amp(optax.sgd(1.0), loss_scale=ls), optax.scale(0.5))
    params = {"w": jnp.ones(2)}
    opt_state = tx.init(params)
    step = jax.jit(lambda g, s, p: tx.update(g, s, p), donate_argnums=(1,))
    for _ in range(3):
        u, opt_state = step({"w": jnp.full(2, 2.0**8)}, opt_state, params)
    np.testing.assert_array_equal(u["w"], -0.5)  # unscaled (2^8 / 2^8), then the chain's scale
    assert float(ls.loss_scale) == 2.0**8  # the object passed in was copied, not donated
    assert float(jaxamp.scale_loss(jnp.float32(1.0), opt_state)) == 2.0**8
    assert jaxamp.amp_state(opt_state) is opt_state[0]


# ---- the PyTorch recipe ---------------------------------------------------------------------
# scaler.scale(loss).backward(); scaler.unscale_(opt); clip_grad_norm_(max_norm);
# scaler.step(opt) (skipped on inf/nan); scaler.update(). Plain SGD, float32 compute.

_LR, _CLIP, _INIT, _INTERVAL, _STEPS = 0.1, 0.5, 2.0**10, 3, 12
_BAD = {2, 3, 8}


def _recipe_data():
    rng = np.random.default_rng(0)
    w1 = rng.normal(0, 0.5, (5, 7)).astype(np.float32)
    b1 = rng.normal(0, 0.1, 7).astype(np.float32)
    w2 = rng.normal(0, 0.5, (7, 3)).astype(np.float32)
    b2 = rng.normal(0, 0.1, 3).astype(np.float32)
    xs, ts = [], []
    for i in range(_STEPS):
        x = rng.normal(0, 1, (8, 5)).astype(np.float32)
        if i in _BAD:
            x[1, 2] = np.inf
        xs.append(x)
        ts.append(rng.normal(0, 1, (8, 3)).astype(np.float32))
    return {"w1": w1, "b1": b1, "w2": w2, "b2": b2}, xs, ts


def _jaxamp_recipe(params, xs, ts):
    def loss(p, x, t):
        y = jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
        return jnp.mean((y - t) ** 2)

    tx = jaxamp.amp(optax.sgd(_LR), clip_norm=_CLIP,
                    loss_scale=jaxamp.DynamicLossScale(_INIT, growth_interval=_INTERVAL))

    @jax.jit
    def step(p, o, x, t):
        grads = jax.grad(lambda p: jaxamp.scale_loss(loss(p, x, t), o))(p)
        updates, o = tx.update(grads, o, p)
        return optax.apply_updates(p, updates), o

    p = jax.tree.map(jnp.asarray, params)
    o = tx.init(p)
    scales = []
    for x, t in zip(xs, ts):
        scales.append(float(o.loss_scale.loss_scale))
        p, o = step(p, o, x, t)
    return jax.tree.map(np.asarray, p), scales, int(o.skipped_steps)


def _numpy_recipe(params, xs, ts):
    """The PyTorch recipe in float64 NumPy, written from torch's documentation."""
    p = {k: v.astype(np.float64) for k, v in params.items()}
    scale, tracker, scales, skipped = _INIT, 0, [], 0
    for x, t in zip(xs, ts):
        scales.append(scale)
        x, t = x.astype(np.float64), t.astype(np.float64)
        with np.errstate(all="ignore"):
            h = np.tanh(x @ p["w1"] + p["b1"])
            y = h @ p["w2"] + p["b2"]
            dy = scale * 2 * (y - t) / y.size  # backward of scale * mean((y - t)^2)
            dz = (dy @ p["w2"].T) * (1 - h**2)
            grads = {"w1": x.T @ dz, "b1": dz.sum(0), "w2": h.T @ dy, "b2": dy.sum(0)}
            grads = {k: g / scale for k, g in grads.items()}  # unscale_
        found_inf = not all(np.all(np.isfinite(g)) for g in grads.values())
        if not found_inf:
            norm = np.sqrt(sum(np.sum(g**2) for g in grads.values()))
            coef = _CLIP / (norm + 1e-6)  # clip_grad_norm_
            if coef < 1:
                grads = {k: g * coef for k, g in grads.items()}
            p = {k: p[k] - _LR * grads[k] for k in p}  # SGD step
        # scaler.update(): back off on inf, grow after `growth_interval` clean steps
        if found_inf:
            scale, tracker, skipped = scale * 0.5, 0, skipped + 1
        else:
            tracker += 1
            if tracker == _INTERVAL:
                scale, tracker = scale * 2.0, 0
    return p, scales, skipped


def _torch_recipe(params, xs, ts):
    torch = pytest.importorskip("torch")
    p = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    opt = torch.optim.SGD(list(p.values()), lr=_LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=_INIT, growth_interval=_INTERVAL)
    scales = []
    for x, t in zip(xs, ts):
        scales.append(float(scaler.get_scale()))
        opt.zero_grad()
        y = torch.tanh(torch.tensor(x) @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
        loss = torch.mean((y - torch.tensor(t)) ** 2)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(list(p.values()), _CLIP)
        scaler.step(opt)
        scaler.update()
    return {k: v.detach().numpy() for k, v in p.items()}, scales


def test_amp_follows_the_pytorch_recipe_float64_numpy_reference():
    params, xs, ts = _recipe_data()
    got, got_scales, skipped = _jaxamp_recipe(params, xs, ts)
    want, want_scales, want_skipped = _numpy_recipe(params, xs, ts)
    assert got_scales == want_scales and skipped == want_skipped == len(_BAD)
    assert len(set(want_scales)) >= 3  # the scale grew and backed off
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=2e-6)
    moved = max(np.max(np.abs(want[k] - params[k])) for k in want)
    assert moved > 0.05  # the comparison is not trivially between unchanged params


def test_amp_follows_the_pytorch_recipe_torch():
    params, xs, ts = _recipe_data()
    want, want_scales = _torch_recipe(params, xs, ts)
    got, got_scales, _ = _jaxamp_recipe(params, xs, ts)
    assert got_scales == want_scales
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=2e-6)


def _readme_block(heading):
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text[text.index(heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_hand_written_step_runs():
    scope: dict = {}
    exec(compile(_readme_block("## Usage"), "README.md", "exec"), scope)
    exec(compile(_readme_block("## Your own train step"), "README.md", "exec"), scope)
    amp = scope["amp"]
    assert isinstance(amp, AmpState) and amp.grad_norm.dtype == jnp.float32
    assert int(amp.skipped_steps) == 1 - int(amp.grads_finite)
    assert scope["loss"].dtype == jnp.float32 and bool(jnp.isfinite(scope["loss"]))


def test_readme_real_training_loop_snippet_runs():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train=False):
            x = nn.BatchNorm(use_running_average=not train)(nn.Dense(16)(x))
            return nn.Dense(4)(nn.Dropout(0.2, deterministic=not train)(nn.relu(x)))

    x = jax.random.normal(jax.random.key(0), (8, 5))
    scope = {"jax": jax, "jnp": jnp, "jaxamp": jaxamp, "model": Net(), "x": x,
             "tx": optax.sgd(0.1), "batch": {"x": x, "y": jnp.arange(8) % 4}}
    exec(compile(_readme_block("What real training loops need"), "README.md", "exec"), scope)
    state, metrics = scope["state"], scope["metrics"]
    assert set(state.collections) == {"batch_stats"} and "acc" in metrics["aux"]
    assert int(state.step) == 1


def _variadic_reduces(fn, *args) -> int:
    """The norm's reductions: ``reduce`` equations (two sums at once) in ``fn``'s jaxpr."""
    return sum(e.primitive.name == "reduce" for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns)


@pytest.mark.parametrize("n_vectors", [0, 1, 2, 41])
def test_vector_leaves_share_one_norm_reduction_with_the_same_norm_and_skips(n_vectors):
    """Vector leaves (biases, norm scales) are summed in one reduction over their
    concatenation, matrices one each: the norm still equals float64 NumPy's, for vectors of
    every size (a 0-d scalar, one element, none) beside the matrices, an inf in one vector is
    still a skip bit for bit, and a 1e20 element of one still takes the scaled sum."""
    rng = np.random.default_rng(3)
    sizes = [(), (1,), (0,), (7,), (300,)]
    grads = {"m1": rng.normal(0, 1.0, (16, 8)).astype(np.float32),
             "m2": rng.normal(0, 1e-3, (4, 4, 3)).astype(np.float32)}
    for i in range(n_vectors):
        grads[f"v{i:02d}"] = rng.normal(0, 10.0 ** (i % 5 - 2), sizes[i % 5]).astype(np.float32)
    params = {k: np.ones(np.shape(g), np.float32) for k, g in grads.items()}
    tx = jaxamp.amp(optax.sgd(0.5), loss_scale=jaxamp.StaticLossScale(4.0), clip_norm=0.5)
    state = tx.init(params)
    grouped = 1 if n_vectors >= 2 else n_vectors
    assert _variadic_reduces(tx.update, grads, state, params) == 2 + grouped + 1
    # sharded gradients: one reduction per leaf, where each lies (the norm unchanged below)
    apart = jaxamp.amp(optax.sgd(0.5), loss_scale=jaxamp.StaticLossScale(4.0), clip_norm=0.5,
                       group_vectors=False)
    assert _variadic_reduces(apart.update, grads, state, params) == 2 + n_vectors + 1
    with pytest.raises(TypeError, match="group_vectors must be True or False, got 1"):
        jaxamp.amp(optax.sgd(0.5), group_vectors=1)

    def run(g64):
        scaled = {k: jnp.asarray(np.float32(g) * np.float32(4.0)) for k, g in g64.items()}
        return jax.jit(tx.update)(scaled, state, params)

    g64 = {k: np.asarray(g, np.float64) for k, g in grads.items()}
    updates, new = run(g64)
    norm = np.sqrt(sum(np.sum(g**2) for g in g64.values()))
    assert bool(new.grads_finite)
    np.testing.assert_allclose(float(new.grad_norm), norm, rtol=1e-6)
    scaled = {k: jnp.asarray(np.float32(g) * np.float32(4.0)) for k, g in g64.items()}
    np.testing.assert_allclose(float(jax.jit(apart.update)(scaled, state, params)[1].grad_norm),
                               norm, rtol=1e-6)
    got = optax.apply_updates(params, updates)
    for k in grads:  # plain SGD, clipped: a gradient off by any factor shows here
        np.testing.assert_allclose(np.asarray(got[k]), 1.0 - 0.5 * g64[k] * min(1, 0.5 / norm),
                                   rtol=1e-6, atol=1e-7)
    if n_vectors < 4:
        return
    bad = dict(g64, v03=np.where(np.arange(7) == 2, np.inf, g64["v03"]))
    updates, skipped = run(bad)
    _assert_bits_equal(optax.apply_updates(params, updates), params)
    assert not bool(skipped.grads_finite) and float(skipped.grad_norm) == np.inf
    big = dict(g64, v04=np.where(np.arange(300) == 5, 1e20, g64["v04"]))
    updates, new = run(big)
    norm = np.sqrt(sum(np.sum(g**2) for g in big.values()))
    assert bool(new.grads_finite) and norm > 1e19
    np.testing.assert_allclose(float(new.grad_norm), norm, rtol=1e-6)


@pytest.mark.parametrize("alone", [False, True], ids=["grouped", "scalar-alone"])
def test_finite_gradients_above_the_float32_norm_range_are_applied_and_clipped(alone):
    """Elements ~1e20 (their float32 sum of squares overflows): the norm is taken scaled, so
    the step is applied and clipped, equal to the float64 NumPy recipe; a scalar leaf too,
    summed with the vector ``c`` or alone (XLA folds constant factors of a one-element
    product, the scaled sum must not be folded)."""
    rng = np.random.default_rng(1)
    grads = {"a": rng.normal(0, 1e20, (64, 3)).astype(np.float32),
             "b": np.float32(-3e20), "c": rng.normal(0, 1.0, 5).astype(np.float32)}
    if alone:
        del grads["c"]
    params = {k: np.ones(np.shape(g), np.float32) for k, g in grads.items()}
    scale = 2.0**8
    tx = jaxamp.amp(optax.sgd(0.5), loss_scale=jaxamp.StaticLossScale(scale), clip_norm=2.0)
    state = tx.init(params)
    scaled = {k: jnp.asarray(g * np.float32(scale)) for k, g in grads.items()}
    updates, state = jax.jit(tx.update)(scaled, state, params)
    got = jax.tree.map(np.asarray, optax.apply_updates(params, updates))
    g64 = {k: np.asarray(g, np.float64) for k, g in grads.items()}
    norm = np.sqrt(sum(np.sum(g**2) for g in g64.values()))
    assert bool(state.grads_finite) and int(state.skipped_steps) == 0
    np.testing.assert_allclose(float(state.grad_norm), norm, rtol=1e-6)
    for k in grads:
        assert np.all(np.isfinite(got[k]))
        np.testing.assert_allclose(got[k], 1.0 - 0.5 * g64[k] * 2.0 / norm, rtol=1e-6,
                                   atol=1e-7)
    # an inf among them is still a skip, bit for bit
    scaled["b"] = jnp.float32(np.inf)
    updates, state2 = jax.jit(tx.update)(scaled, state, params)
    _assert_bits_equal(optax.apply_updates(params, updates), params)
    assert not bool(state2.grads_finite) and float(state2.grad_norm) == np.inf
