"""The optimizer state stored in bfloat16 with stochastic rounding (GitHub issue #44):
``jaxamp.amp(tx, state_dtype=jnp.bfloat16)`` and the policy's ``opt_state=bfloat16``.

* stochastic rounding is unbiased, exact on what bfloat16 holds, and keeps inf/nan/-0;
* round-to-nearest stalls on updates below half an ulp, stochastic rounding does not: the
  drift against float32 over 4000 steps stays within a bound derived from its variance;
* against independent references (optax in float32, NumPy): where every state value is a
  bfloat16 number, the bfloat16-state run IS the float32 run, bit for bit;
* bytes: exactly half for Adam's/AdamW's/Lion's moments, and the compiled step's
  ``memory_analysis``: arguments smaller by exactly that, temporaries not larger;
* a skipped step keeps the state bit-identical (the rounding key too); schedules, injected
  hyperparameters and ``optax.MultiSteps`` work; ``make_train_step`` reads ``opt_state=``
  and equals the hand-written ``jaxamp.amp`` step bit for bit; on a mesh the state keeps its
  shardings (8 virtual devices, in a subprocess).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import multihost  # tests/multihost.py
import numpy as np
import optax
import pytest
from models import MLP, ce_loss

import jaxamp
from jaxamp.state_dtype import (
    RNG_IMPL,
    StoredState,
    rounding_bits,
    stochastic_round,
    with_state_dtype,
)

BF16_POLICY = "params=float32,compute=bfloat16,output=float32"
BF16_STATE = BF16_POLICY + ",opt_state=bfloat16"


def _bits_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.asarray(x).dtype == np.asarray(y).dtype
        and np.array_equal(np.atleast_1d(np.asarray(x)).view(np.uint8),
                           np.atleast_1d(np.asarray(y)).view(np.uint8))
        for x, y in zip(la, lb, strict=True))


def _setup(n=16):
    model = MLP()
    x = jax.random.normal(jax.random.key(0), (n, 8))
    params = model.init(jax.random.key(1), x)["params"]
    return model, params, {"x": x, "y": jnp.arange(n) % 4}


def _adam(state):
    """The ScaleByAdamState inside a (wrapped) adam/adamw state."""
    return next(x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(
        x, optax.ScaleByAdamState)) if isinstance(x, optax.ScaleByAdamState))


# ---- stochastic rounding itself ------------------------------------------------------------


def test_stochastic_round_is_exact_where_bfloat16_is_and_unbiased_elsewhere():
    sr = jax.jit(stochastic_round)
    # every value bfloat16 holds (both signs, zeros, subnormals, the largest, infinities)
    # comes back unchanged whatever the bits
    exact = np.arange(0, 2**16, dtype=np.uint16).view(ml_dtypes.bfloat16)
    exact = exact[~np.isnan(exact)].astype(np.float32)
    for bits in (0, 0xFFFF, 0x8000):
        out = np.asarray(sr(exact, jnp.full(exact.shape, bits, jnp.uint16)))
        assert out.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(out.astype(np.float32).view(np.uint32),
                                      exact.view(np.uint32))
    # NaN stays NaN, also one whose payload lies in the 16 bits that are dropped
    nans = np.array([0x7FC00000, 0x7F800001, 0xFF800001], np.uint32).view(np.float32)
    assert np.isnan(np.asarray(sr(nans, jnp.zeros(3, jnp.uint16))).astype(np.float32)).all()
    # x = lower + f * ulp rounds up exactly when the 16 random bits reach (1 - f) * 2**16
    x = np.float32(1.0 + 2**-7 * 0.25)  # f = 1/4: low bits 0x4000
    up = [float(sr(jnp.float32(x), jnp.uint16(b))) for b in (0xBFFF, 0xC000)]
    assert up == [1.0, 1.0 + 2**-7]
    assert float(sr(-x, jnp.uint16(0xC000))) == -(1.0 + 2**-7)  # magnitudes round alike
    # unbiased: the mean of 2**16 draws (all 16-bit patterns once) is x itself, exactly
    every = jnp.arange(2**16, dtype=jnp.uint32).astype(jnp.uint16)
    for value in (1.0 + 2**-7 * 0.25, -3.14159, 1e-3, 6.0e-39, 1.7e38):
        v = np.float32(value)
        mean = np.mean(np.asarray(sr(jnp.full(2**16, v), every)).astype(np.float64))
        assert mean == pytest.approx(float(v), rel=1e-7, abs=1e-45), value


def test_rounding_bits_are_uniform_and_new_with_every_key():
    """The 16 bits stochastic rounding uses, for 2**18 elements: each byte of them uniform
    (chi-square over 256 bins: 255 degrees of freedom, mean 255, sd 22.6; the bound is 6.4
    sd), pairs of neighbours unrelated, and another key draws other bits (equal by chance:
    2**-16 of the elements)."""
    shape = (256, 1024)
    keys = jax.random.key_data(jax.random.split(jax.random.key(7, impl=RNG_IMPL), 2))
    bits = np.asarray(jax.jit(rounding_bits, static_argnums=1)(keys[0], shape)) & 0xFFFF
    expected = bits.size / 256

    def chi2(values):
        return float((((np.bincount(values, minlength=256) - expected) ** 2) / expected).sum())

    assert chi2(bits.ravel() >> 8) < 400 and chi2(bits.ravel() & 0xFF) < 400
    flat = bits.ravel()
    pairs = ((flat[:-1:2] >> 12) << 4) | (flat[1::2] >> 12)  # 16 x 16 bins of neighbours
    assert float((((np.bincount(pairs, minlength=256) - pairs.size / 256) ** 2)
                  / (pairs.size / 256)).sum()) < 400
    other = np.asarray(rounding_bits(keys[1], shape)) & 0xFFFF
    assert np.mean(other == bits) < 2e-4  # chance: 1.5e-5


def test_round_to_nearest_stalls_and_stochastic_rounding_tracks_float32():
    """A second moment with b = 0.999 (``optax.scale_by_rms``, RMSProp's: Adam's ``nu``)
    stored in bfloat16. It starts at 1.0 and the squared gradient is 1.5: each step moves it
    by (1 - b) * (1.5 - nu) <= 5e-4, below half a bfloat16 ulp in [1, 2) (u / 2 = 2**-8 =
    3.9e-3). Rounded to nearest it never moves; in float32 it reaches 1.5 - 0.5 * b**4000 =
    1.4908 after 4000 steps.

    The bound. The stored value minus the float32 one is d_t = b * d_{t-1} + e_t, e_t the
    rounding error of step t (the float32 run's own rounding, 3e-5 here, is negligible).
    Stochastic rounding makes E[e_t | past] = 0; it rounds x_t up with probability p_t (its
    distance from the bfloat16 number below, in ulps), so Var(e_t) = u**2 p_t (1 - p_t). In
    general p_t (1 - p_t) <= 1/4, and Var(d) <= u**2 / (4 (1 - b**2)): sigma <= 0.087 for any
    update. Here the number below x_t is the stored s_{t-1} itself and u * p_t is the step's
    increment (1 - b)(g**2 - s_{t-1}) = (1 - b) * 0.5 * b**(t-1) (the float32 trajectory), so
    Var(d_T) <= sum_t b**(2(T-t)) u (1 - b) 0.5 b**(t-1) = 0.5 u b**(T-1) (1 - b**T):
    sigma_T = 0.0084. Over n = 4096 independent elements the RMS drift estimates it within
    sqrt(1 / (2n)) = 1.1%, so RMS <= 1.5 sigma_T, and |mean drift| <= 6 sigma_T / sqrt(n) =
    7.9e-4. Rounding to nearest drifts by 0.49 on every element, 58 sigma_T.
    """
    n, steps, b = 4096, 4000, 0.999
    u = 2.0**-7
    g = jnp.full((n,), math.sqrt(1.5), jnp.float32)
    params = {"w": jnp.zeros((n,))}
    inner = optax.scale_by_rms(decay=b, initial_scale=1.0)

    def run(tx):
        def body(s, _):
            return tx.update({"w": g}, s, params)[1], None
        return jax.jit(lambda s: jax.lax.scan(body, s, None, length=steps)[0])(tx.init(params))

    f32 = np.asarray(run(inner).nu["w"], np.float64)
    out = run(jaxamp.amp(inner, loss_scale=jaxamp.NoOpLossScale(), state_dtype=jnp.bfloat16))
    stored = out.inner_state.inner_state.nu["w"]
    assert stored.dtype == jnp.bfloat16 and int(out.skipped_steps) == 0

    def naive(nu, _):  # the same update, stored rounded to nearest
        return (b * nu.astype(jnp.float32) + (1 - b) * g * g).astype(jnp.bfloat16), None
    rtn = jax.jit(lambda: jax.lax.scan(naive, jnp.ones((n,), jnp.bfloat16), None,
                                       length=steps)[0])()

    np.testing.assert_allclose(f32, 1.5 - 0.5 * b**steps, rtol=1e-4)  # its own rounding
    sigma_t = math.sqrt(0.5 * u * b**(steps - 1) * (1 - b**steps))
    assert 0.0083 < sigma_t < 0.0085 < u / (2 * math.sqrt(1 - b**2))
    d_rtn = np.asarray(rtn, np.float64) - f32
    d_sr = np.asarray(stored, np.float64) - f32
    assert np.all(np.asarray(rtn, np.float64) == 1.0)  # stalled: not one step was kept
    assert np.all(d_rtn < -0.49)
    rms = math.sqrt(np.mean(d_sr**2))
    assert abs(d_sr.mean()) <= 6 * sigma_t / math.sqrt(n), d_sr.mean()
    assert rms <= 1.5 * sigma_t, rms
    # measured (jax 0.10.2 and 0.12, CPU): mean drift -1e-4, RMS 0.0085 (1.02 sigma_T)


# ---- independent references ---------------------------------------------------------------


def _grads(step: int, shape) -> dict:
    """Small integers (a dyadic state stays short enough for bfloat16)."""
    values = np.array([1.0, -2.0, 3.0, 1.0, -1.0, 2.0], np.float32)
    return {"w": jnp.asarray(np.resize(np.roll(values, step), shape))}


def _exact_in_bf16(tree) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(x).astype(ml_dtypes.bfloat16)
                              .astype(np.float32))
               for x in jax.tree.leaves(tree) if np.ndim(x) and np.asarray(x).dtype.kind == "f")


@pytest.mark.parametrize("name", ["sgd_momentum", "adam"])
def test_bfloat16_state_is_the_float32_run_where_every_state_value_is_a_bfloat16_number(name):
    """A constant factor (a moment stored twice too large, an update read from the unrounded
    or the wrong copy) would break the bit-for-bit equality and the float64 NumPy
    reference. Every state value of the float32 reference is checked to be exact in
    bfloat16, so stochastic rounding has nothing to round."""
    shape = (6,)
    params = {"w": jnp.zeros(shape)}
    if name == "sgd_momentum":
        inner = optax.sgd(0.5, momentum=0.5)
    else:
        inner = optax.adam(0.25, b1=0.5, b2=0.5, eps=2**-10)
    tx = jaxamp.amp(inner, loss_scale=jaxamp.NoOpLossScale(), state_dtype=jnp.bfloat16)
    ref_state, state = inner.init(params), tx.init(params)
    p_ref, p = params, params
    w64 = np.zeros(shape)
    m64, v64 = np.zeros(shape), np.zeros(shape)
    update_ref = jax.jit(inner.update)
    update = jax.jit(tx.update)
    for t in range(1, 5):
        g = _grads(t, shape)
        u_ref, ref_state = update_ref(g, ref_state, p_ref)
        u, state = update(g, state, p)
        p_ref, p = optax.apply_updates(p_ref, u_ref), optax.apply_updates(p, u)
        assert _exact_in_bf16(ref_state), (t, ref_state)  # the premise
        assert _bits_equal(u, u_ref) and _bits_equal(p, p_ref), t
        stored = state.inner_state.inner_state
        assert _bits_equal(jax.tree.map(lambda x: x.astype(jnp.float32), stored),
                           jax.tree.map(lambda x: x.astype(jnp.float32), ref_state))
        # NumPy, float64: the textbook recurrences
        g64 = np.asarray(g["w"], np.float64)
        if name == "sgd_momentum":
            m64 = g64 + 0.5 * m64
            w64 = w64 - 0.5 * m64
        else:
            m64, v64 = 0.5 * m64 + 0.5 * g64, 0.5 * v64 + 0.5 * g64**2
            w64 = w64 - 0.25 * (m64 / (1 - 0.5**t)) / (np.sqrt(v64 / (1 - 0.5**t)) + 2**-10)
        np.testing.assert_allclose(np.asarray(p["w"]), w64, rtol=1e-6, atol=1e-7)
    assert np.abs(w64).max() > 0.5  # the params moved: a factor would show


# ---- bytes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [optax.adam, optax.adamw, optax.lion],
                         ids=["adam", "adamw", "lion"])
def test_moments_take_exactly_half_the_bytes(make):
    _, params, _ = _setup()
    n = sum(x.size for x in jax.tree.leaves(params))
    moments = 1 if make is optax.lion else 2
    f32 = jaxamp.amp(make(1e-3)).init(params).inner_state
    bf16 = jaxamp.amp(make(1e-3), state_dtype=jnp.bfloat16).init(params).inner_state

    def floating_arrays(tree):
        return sum(x.nbytes for x in jax.tree.leaves(tree)
                   if x.ndim and jnp.issubdtype(x.dtype, jnp.floating))

    assert floating_arrays(f32) == 4 * moments * n
    assert floating_arrays(bf16) == 2 * moments * n == floating_arrays(f32) // 2
    assert isinstance(bf16, StoredState) and bf16.rounding_key.nbytes == 8  # uint32[2]
    # counts stay int32 scalars
    counts = [x for x in jax.tree.leaves(bf16.inner_state) if not x.ndim]
    assert counts and all(x.dtype == jnp.int32 for x in counts)


def test_the_compiled_step_holds_half_the_moments_and_no_more_temporaries():
    """memory_analysis() of make_train_step's CPU compile (adamw): the arguments shrink by
    exactly the moments' half (less the 8-byte key), and the temporaries do not grow (a
    rounding that materialised its random bits, or an update reading a copy of the old
    moments, would add 2-24 bytes per parameter; a few hundred bytes of scalars and keys do
    not depend on the size)."""
    import flax.linen as nn

    model = nn.Sequential([nn.Dense(256), nn.gelu, nn.Dense(256), nn.gelu, nn.Dense(4)])
    batch = {"x": jax.random.normal(jax.random.key(0), (16, 64)), "y": jnp.arange(16) % 4}
    params = model.init(jax.random.key(1), batch["x"])["params"]
    n = sum(x.size for x in jax.tree.leaves(params))
    figures = {}
    for policy in (BF16_POLICY, BF16_STATE):
        state = jaxamp.TrainState.create(model, params, optax.adamw(1e-3), policy=policy)
        step = jaxamp.make_train_step(model, ce_loss)
        figures[policy] = step.lower(state, batch).compile().memory_analysis()
    f32, bf16 = figures[BF16_POLICY], figures[BF16_STATE]
    assert n > 80_000
    assert f32.argument_size_in_bytes - bf16.argument_size_in_bytes == 2 * 2 * n - 8
    assert bf16.temp_size_in_bytes <= f32.temp_size_in_bytes + 0.05 * n, (
        bf16.temp_size_in_bytes, f32.temp_size_in_bytes, n)


# ---- skips, schedules, MultiSteps, the train step -------------------------------------------


def test_a_skipped_step_keeps_the_state_and_the_key_bit_identical():
    params = {"w": jnp.linspace(-1.0, 1.0, 8)}
    tx = jaxamp.amp(optax.adamw(optax.linear_schedule(1e-2, 0.0, 10)),
                    loss_scale=jaxamp.StaticLossScale(8.0), state_dtype=jnp.bfloat16)
    update = jax.jit(tx.update)
    state = tx.init(params)
    keys = [np.asarray(state.inner_state.rounding_key)]
    for i in range(6):
        g = {"w": jnp.full(8, 0.3) if i not in (2, 3) else jnp.full(8, 0.3).at[1].set(jnp.nan)}
        u, new = update(g, state, params)
        if i in (2, 3):  # skipped: updates -0.0, stored state and key bit-identical
            assert _bits_equal(new.inner_state, state.inner_state)
            assert _bits_equal(optax.apply_updates(params, u), params)
        else:
            assert not np.array_equal(new.inner_state.rounding_key,
                                      state.inner_state.rounding_key)
        state = new
        keys.append(np.asarray(state.inner_state.rounding_key))
    assert int(state.skipped_steps) == 2
    assert int(_adam(state).count) == 4  # the schedule saw applied steps only
    # the key advanced once per applied update: it is the key of 4 updates without skips
    clean = tx.init(params)
    for _ in range(4):
        _, clean = update({"w": jnp.full(8, 0.3)}, clean, params)
    assert _bits_equal(clean.inner_state, state.inner_state)


def test_injected_hyperparameters_stay_float32_and_multisteps_works():
    params = {"w": jnp.linspace(-1.0, 1.0, 8)}
    inner = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
    tx = jaxamp.amp(inner, loss_scale=jaxamp.NoOpLossScale(), state_dtype=jnp.bfloat16)
    state = tx.init(params)
    lr = state.inner_state.inner_state.hyperparams["learning_rate"]
    assert lr.dtype == jnp.float32 and float(lr) == np.float32(1e-3)  # not rounded to bf16
    _, state = jax.jit(tx.update)({"w": jnp.ones(8)}, state, params)
    assert state.inner_state.inner_state.hyperparams["learning_rate"].dtype == jnp.float32

    # MultiSteps: its accumulated gradients are stored in bfloat16 too; the inner optimizer
    # moves every second step, and the run follows the float32 one
    def multi():
        return optax.MultiSteps(optax.adam(0.1), every_k_schedule=2)
    runs = {}
    for dtype in (None, jnp.bfloat16):
        tx = jaxamp.amp(multi(), loss_scale=jaxamp.NoOpLossScale(), state_dtype=dtype)
        p, s = params, tx.init(params)
        update = jax.jit(tx.update)
        seen = []
        for i in range(6):
            u, s = update({"w": jnp.sin(p["w"] * 3.0 + i)}, s, p)
            p = optax.apply_updates(p, u)
            seen.append(p["w"])
        runs[dtype] = (seen, s)
    seen, s = runs[jnp.bfloat16]
    assert s.inner_state.inner_state.acc_grads["w"].dtype == jnp.bfloat16
    assert int(s.inner_state.inner_state.gradient_step) == 3
    for i, before in enumerate([params["w"], *seen[:-1]]):
        assert (not np.array_equal(seen[i], before)) == (i % 2 == 1), i
        np.testing.assert_allclose(seen[i], runs[None][0][i], atol=2e-3)


def test_make_train_step_reads_opt_state_from_the_policy_and_equals_amp():
    model, params, batch = _setup()
    inner = optax.adamw(optax.cosine_decay_schedule(1e-2, 50), weight_decay=0.1)
    tx = jaxamp.amp(inner, loss_scale=jaxamp.NoOpLossScale(), clip_norm=1.0,
                    state_dtype=jnp.bfloat16)
    loss_fn = jaxamp.autocast(lambda p, b: ce_loss(model.apply, p, b), BF16_POLICY)

    @jax.jit
    def train_step(params, opt_state, batch):
        grads = jax.grad(lambda p: jaxamp.scale_loss(loss_fn(p, batch), opt_state))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    state = jaxamp.TrainState.create(model, params, inner, policy=BF16_STATE)
    assert isinstance(state.opt_state.inner_state, StoredState) and state.tx is inner
    step = jaxamp.make_train_step(model, ce_loss, inner, clip_norm=1.0)
    p, o = params, tx.init(params)
    for i in range(6):
        b = batch if i != 3 else {**batch, "x": batch["x"].at[0, 0].set(jnp.inf)}
        p, o = train_step(p, o, b)
        state, m = step(state, b)
        assert _bits_equal(state.params, p) and _bits_equal(state.opt_state, o), i
        assert bool(m["skipped"]) == (i == 3)
    assert _adam(state.opt_state).mu["Dense_0"]["kernel"].dtype == jnp.bfloat16
    assert int(_adam(state.opt_state).count) == 5
    # the policy is the state's: a step given another one refuses it, before compiling
    with pytest.raises(ValueError, match="opt_state=bfloat16"):
        jaxamp.make_train_step(model, ce_loss, policy=BF16_POLICY)(state, batch)


def test_float32_storage_and_bad_state_dtypes():
    # float32 storage of a bfloat16 model's optimizer: the moments in float32, no key
    params = {"w": jnp.ones(4, jnp.bfloat16)}
    tx = jaxamp.amp(optax.adam(1e-2), loss_scale=jaxamp.NoOpLossScale(),
                    state_dtype=jnp.float32)
    state = tx.init(params)
    assert state.inner_state.rounding_key is None
    _, state = jax.jit(tx.update)({"w": jnp.full(4, 0.5, jnp.bfloat16)}, state, params)
    assert _adam(state).nu["w"].dtype == jnp.float32
    assert float(_adam(state).nu["w"][0]) == pytest.approx(0.001 * 0.25, rel=1e-6)
    with pytest.raises(ValueError, match=r"jaxamp.amp: the optimizer state cannot be stored "
                                         r"in float16.*second moment.*write bfloat16"):
        jaxamp.amp(optax.adam(1e-3), state_dtype=jnp.float16)
    with pytest.raises(ValueError, match=r"jaxamp.amp: the optimizer state is stored in "
                                         r"jnp.bfloat16 or jnp.float32 .*got <class "
                                         r"'jax.numpy.int8'>.*state_dtype=jnp.bfloat16"):
        jaxamp.amp(optax.adam(1e-3), state_dtype=jnp.int8)
    with pytest.raises(TypeError, match="tx must be an optax.GradientTransformation"):
        with_state_dtype(lambda g: g, jnp.bfloat16)


def test_audit_step_accepts_the_rounded_state_and_flags_a_plain_bfloat16_one():
    model, params, batch = _setup()
    state = jaxamp.TrainState.create(model, params, optax.adam(1e-3), policy=BF16_STATE)
    step = jaxamp.make_train_step(model, ce_loss)
    kinds = {f.kind for f in jaxamp.audit_step(step, state, batch).findings}
    assert "opt_state_low_precision" not in kinds
    # audit(step, ...): the reference table's "Parameter update" row is float32 (the update
    # runs in float32; the moments are only stored in bfloat16)
    row = next(r for r in jaxamp.audit(step, state, batch).reference_table()
               if r["row"] == "Parameter update")
    assert row["backward"] == "float32" and row["ok"], row
    plain = state.replace(policy=jaxamp.get_policy(BF16_POLICY), tx=optax.adam(1e-3),
                          opt_state=state.opt_state._replace(inner_state=jax.tree.map(
                              lambda x: x.astype(jnp.bfloat16) if x.ndim else x,
                              state.opt_state.inner_state.inner_state)))
    report = jaxamp.audit_step(jaxamp.make_train_step(model, ce_loss), plain, batch)
    found = [f for f in report.findings if f.kind == "opt_state_low_precision"]
    assert found and "opt_state=bfloat16" in found[0].detail


# ---- on a mesh (8 virtual devices, one subprocess) ------------------------------------------


def script() -> dict:
    """FSDP over 8 devices with opt_state=bfloat16 against one device (run in a subprocess
    by :func:`test_on_a_mesh_the_state_keeps_its_shardings`)."""
    import flax.linen as nn
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            part = nn.with_partitioning
            x = nn.gelu(nn.Dense(64, kernel_init=part(nn.initializers.lecun_normal(),
                                                      (None, "data")))(x))
            return nn.Dense(8, kernel_init=part(nn.initializers.lecun_normal(),
                                                ("data", None)))(x)

    model = Net()
    x = jax.random.normal(jax.random.key(0), (32, 16))
    batch = {"x": x, "y": jnp.arange(32) % 8}
    variables = model.init(jax.random.key(1), x)
    policy = "params=float32,compute=float32,output=float32,opt_state=bfloat16"
    mesh = Mesh(np.array(jax.devices()).reshape(8), ("data",))
    out = {}
    runs = {}
    for where in ("one", "mesh"):
        state = jaxamp.TrainState.create(model, variables, optax.adamw(1e-2), policy=policy)
        if where == "mesh":
            state = jaxamp.shard_state(state, mesh)
            step = jaxamp.make_train_step(model, ce_loss, mesh=mesh)
            batch_in = jax.device_put(batch, NamedSharding(mesh, P("data")))
        else:
            step = jaxamp.make_train_step(model, ce_loss)
            batch_in = batch
        for i in range(4):
            state, _ = step(state, batch_in)
            if i == 0:  # after one step, from the same state: only the rounding can differ
                runs[where] = jax.device_get(state)  # the step donates the state

        if where == "mesh":
            adam = _adam(state.opt_state)
            out["mu_spec"] = list(adam.mu["Dense_0"]["kernel"].value.sharding.spec)
            out["nu_spec"] = list(adam.nu["Dense_1"]["kernel"].value.sharding.spec)
            out["param_spec"] = list(state.params["Dense_0"]["kernel"].value.sharding.spec)
            key = state.opt_state.inner_state.rounding_key
            out["key_replicated"] = key.sharding.is_fully_replicated
            out["compiles"] = step._cache_size()  # after 4 steps
    unbox = nn.unbox
    one, mesh_state = _adam(unbox(runs["one"].opt_state)), _adam(unbox(runs["mesh"].opt_state))
    a = np.concatenate([np.ravel(np.asarray(v, np.float32))
                        for v in jax.tree.leaves((one.mu, one.nu))])
    b = np.concatenate([np.ravel(np.asarray(v, np.float32))
                        for v in jax.tree.leaves((mesh_state.mu, mesh_state.nu))])
    out["moment_dtype"] = str(mesh_state.mu["Dense_0"]["kernel"].dtype)
    out["same_fraction"] = float(np.mean(a == b))
    # distance in bfloat16 ulps (float32 values of bfloat16 numbers: 16 trailing zero bits)
    ulps = (a.view(np.int32) >> 16).astype(np.int64) - (b.view(np.int32) >> 16)
    out["max_ulps"] = int(np.max(np.abs(ulps[np.sign(a) == np.sign(b)]), initial=0))
    out["sign_flips"] = int(np.sum(np.sign(a) != np.sign(b)))
    out["params_rel"] = float(max(np.max(np.abs(np.asarray(p) - np.asarray(q)))
                                  for p, q in zip(jax.tree.leaves(unbox(runs["one"].params)),
                                                  jax.tree.leaves(unbox(runs["mesh"].params)))))
    out["same_key"] = bool(np.array_equal(runs["one"].opt_state.inner_state.rounding_key,
                                          runs["mesh"].opt_state.inner_state.rounding_key))
    return out


def test_on_a_mesh_the_state_keeps_its_shardings():
    out = multihost.script_on_devices("test_state_dtype")
    assert out["moment_dtype"] == "bfloat16"
    assert out["mu_spec"] == out["param_spec"] == [None, "data"]  # FSDP: moments follow
    assert out["nu_spec"] == ["data", None] and out["key_replicated"]
    assert out["compiles"] == 1  # the output state kept its shardings
    # the same random bits whatever the sharding: after a step the stored moments equal one
    # device's (the partitioned gradient sums may differ in the last float32 bit, and then a
    # rounding at a carry boundary differs by one bfloat16 ulp)
    assert out["same_key"] and out["same_fraction"] > 0.99
    assert out["max_ulps"] <= 1 and out["sign_flips"] == 0, out
    assert out["params_rel"] < 1e-5
