"""Tests for jaxamp.loss_scale."""

from __future__ import annotations

import dataclasses

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxamp.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale

DYN_FIELDS = (
    "loss_scale",
    "counter",
    "hysteresis_counter",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "min_loss_scale",
    "max_loss_scale",
    "hysteresis",
)
F32_FIELDS = {"loss_scale", "growth_factor", "backoff_factor", "min_loss_scale", "max_loss_scale"}


# --------------------------------------------------------------------------
# Pure-Python reference state machine (float32 arithmetic like the library).
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Ref:
    scale: np.float32
    counter: int
    hcounter: int
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    hysteresis: int = 1

    def step(self, finite: bool) -> None:
        f32 = np.float32
        if finite:
            self.counter += 1
            if self.counter == self.growth_interval:
                self.counter = 0
                self.hcounter = self.hysteresis
                self.scale = min(f32(self.scale) * f32(self.growth_factor), f32(self.max_scale))
        else:
            self.counter = 0
            self.hcounter -= 1
            if self.hcounter <= 0:
                self.scale = max(f32(self.scale) * f32(self.backoff_factor), f32(self.min_scale))
            self.hcounter = max(self.hcounter, 0)

    @property
    def at_min(self) -> bool:
        return self.scale <= np.float32(self.min_scale)


def make_pair(loss_scale: float = 2.0**16, **kw):
    state = DynamicLossScale(loss_scale, **kw)
    ref = Ref(
        scale=np.float32(loss_scale),
        counter=0,
        hcounter=kw.get("hysteresis", 1),
        growth_factor=kw.get("growth_factor", 2.0),
        backoff_factor=kw.get("backoff_factor", 0.5),
        growth_interval=kw.get("growth_interval", 2000),
        min_scale=kw.get("min_loss_scale", 1.0),
        max_scale=kw.get("max_loss_scale", 2.0**24),
        hysteresis=kw.get("hysteresis", 1),
    )
    return state, ref


_jit_adjust = jax.jit(lambda s, f: s.adjust(f))


def assert_matches(state: DynamicLossScale, ref: Ref, step: int) -> None:
    msg = f"step {step}"
    assert float(state.loss_scale) == float(ref.scale), msg
    assert int(state.counter) == ref.counter, msg
    assert int(state.hysteresis_counter) == ref.hcounter, msg
    assert bool(state.at_min) == ref.at_min, msg


def run_both(flags, loss_scale=2.0**16, **kw):
    """Drives jitted adjust and the reference; returns the scale trajectory."""
    state, ref = make_pair(loss_scale, **kw)
    scales = []
    for i, flag in enumerate(flags):
        state = _jit_adjust(state, jnp.asarray(bool(flag)))
        ref.step(bool(flag))
        assert_matches(state, ref, i)
        scales.append(float(state.loss_scale))
    return state, scales


# --------------------------------------------------------------------------
# Trajectories
# --------------------------------------------------------------------------


def test_grows_exactly_on_growth_interval_th_clean_step():
    state, scales = run_both([True] * 7, 4.0, growth_interval=3)
    assert scales == [4.0, 4.0, 8.0, 8.0, 8.0, 16.0, 16.0]
    assert int(state.counter) == 1


def test_overflow_resets_counter_and_backs_off():
    flags = [True, True, False, True, True, True]
    state, scales = run_both(flags, 64.0, growth_interval=3)
    assert scales == [64.0, 64.0, 32.0, 32.0, 32.0, 64.0]
    assert int(state.counter) == 0


def test_floor_is_sticky_and_reported():
    state, scales = run_both([False] * 5, 4.0, min_loss_scale=1.0)
    assert scales == [2.0, 1.0, 1.0, 1.0, 1.0]
    assert bool(state.at_min)
    assert not bool(DynamicLossScale(4.0).at_min)


def test_ceiling_clamps_growth():
    state, scales = run_both([True] * 4, 8.0, growth_interval=1, max_loss_scale=16.0)
    assert scales == [16.0, 16.0, 16.0, 16.0]
    # Backing off from the ceiling still works.
    state = _jit_adjust(state, False)
    assert float(state.loss_scale) == 8.0


def test_non_power_of_two_factors_clamp_to_bounds():
    # 10 * 3 = 30 > max 20 -> 20; 20 * 0.3 = 6 ; 6 * 0.3 = 1.8 < min 2 -> 2.
    flags = [True, False, False, False]
    _, scales = run_both(
        flags,
        10.0,
        growth_factor=3.0,
        backoff_factor=0.3,
        growth_interval=1,
        min_loss_scale=2.0,
        max_loss_scale=20.0,
    )
    assert scales == [20.0, float(np.float32(20.0) * np.float32(0.3)), 2.0, 2.0]


def test_hysteresis_tolerates_two_overflows_then_backs_off():
    flags = [False, False, False, False, True, True, False, False, False]
    state, scales = run_both(flags, 64.0, growth_interval=2, hysteresis=3)
    # 2 tolerated, 3rd backs off, 4th too (tolerance exhausted); growth at the
    # 2nd clean step restores hysteresis to 3, so again 2 tolerated.
    assert scales == [64.0, 64.0, 32.0, 16.0, 16.0, 32.0, 32.0, 32.0, 16.0]
    assert int(state.hysteresis_counter) == 0


def test_hysteresis_counter_does_not_underflow():
    state, _ = run_both([False] * 30, 2.0**10, hysteresis=2)
    assert int(state.hysteresis_counter) == 0
    assert float(state.loss_scale) == 1.0


def test_random_flag_sequence_matches_reference():
    rng = np.random.default_rng(1234)
    flags = rng.random(200) < 0.7
    run_both(
        flags,
        2.0**6,
        growth_interval=3,
        hysteresis=2,
        min_loss_scale=0.25,
        max_loss_scale=2.0**9,
    )


def test_scan_compiles_once_and_matches_reference():
    traces = []

    @jax.jit
    def run(state, flags):
        traces.append(1)

        def body(s, f):
            s = s.adjust(f)
            return s, (s.loss_scale, s.counter, s.hysteresis_counter, s.at_min)

        return jax.lax.scan(body, state, flags)

    kw = dict(growth_interval=3, hysteresis=2, min_loss_scale=0.5, max_loss_scale=2.0**8)
    rng = np.random.default_rng(7)
    for _ in range(2):
        flags = rng.random(50) < 0.6
        state, ref = make_pair(16.0, **kw)
        final, (scales, counters, hcs, at_mins) = run(state, jnp.asarray(flags))
        for i, f in enumerate(flags):
            ref.step(bool(f))
            assert float(scales[i]) == float(ref.scale), i
            assert int(counters[i]) == ref.counter, i
            assert int(hcs[i]) == ref.hcounter, i
            assert bool(at_mins[i]) == ref.at_min, i
        assert_matches(final, ref, 50)
    assert len(traces) == 1


# --------------------------------------------------------------------------
# Pytree behaviour
# --------------------------------------------------------------------------


def nondefault_state() -> DynamicLossScale:
    return DynamicLossScale(
        8.0,
        growth_factor=3.0,
        backoff_factor=0.25,
        growth_interval=7,
        min_loss_scale=0.5,
        max_loss_scale=1024.0,
        hysteresis=4,
        counter=5,
        hysteresis_counter=2,
    )


NONDEFAULT = dict(
    loss_scale=8.0,
    counter=5,
    hysteresis_counter=2,
    growth_factor=3.0,
    backoff_factor=0.25,
    growth_interval=7,
    min_loss_scale=0.5,
    max_loss_scale=1024.0,
    hysteresis=4,
)


def assert_fields(state: DynamicLossScale, expected: dict) -> None:
    for name in DYN_FIELDS:
        value = getattr(state, name)
        want_dtype = jnp.float32 if name in F32_FIELDS else jnp.int32
        assert jnp.asarray(value).dtype == want_dtype, name
        assert float(value) == expected[name], name


def test_every_field_is_a_leaf_with_fixed_dtype():
    state = nondefault_state()
    paths, _ = jax.tree_util.tree_flatten_with_path(state)
    assert [p[0].name for p, _ in paths] == list(DYN_FIELDS)
    assert_fields(state, NONDEFAULT)
    assert jax.tree_util.tree_leaves(NoOpLossScale()) == []
    (leaf,) = jax.tree_util.tree_leaves(StaticLossScale(3))
    assert leaf.dtype == jnp.float32 and float(leaf) == 3.0


def test_jit_identity_preserves_every_field():
    assert_fields(jax.jit(lambda s: s)(nondefault_state()), NONDEFAULT)
    assert float(jax.jit(lambda s: s)(StaticLossScale(5.0)).loss_scale) == 5.0
    assert isinstance(jax.jit(lambda s: s)(NoOpLossScale()), NoOpLossScale)


def test_config_survives_jit_adjust():
    # The jmp bug: min_loss_scale reset to its default under jit.
    state = nondefault_state()
    for _ in range(12):
        state = _jit_adjust(state, False)
    expected = dict(NONDEFAULT, loss_scale=0.5, counter=0, hysteresis_counter=0)
    assert_fields(state, expected)
    assert bool(state.at_min)


def test_flatten_unflatten_round_trip():
    state = nondefault_state()
    leaves, treedef = jax.tree_util.tree_flatten(state)
    assert_fields(jax.tree_util.tree_unflatten(treedef, leaves), NONDEFAULT)
    doubled = jax.tree_util.tree_map(lambda x: x * 2, state)
    assert float(doubled.min_loss_scale) == 1.0 and int(doubled.hysteresis) == 8


def test_unflatten_does_not_validate():
    _, treedef = jax.tree_util.tree_flatten(DynamicLossScale())
    bad = jax.tree_util.tree_unflatten(treedef, [object()] * len(DYN_FIELDS))
    assert isinstance(bad, DynamicLossScale)
    # Constructors accept tracers (no validation possible) under jit.
    out = jax.jit(lambda x: DynamicLossScale(x, min_loss_scale=x / 4).adjust(False))(8.0)
    assert float(out.loss_scale) == 4.0 and float(out.min_loss_scale) == 2.0


def test_flax_serialization_round_trip():
    data = flax.serialization.to_bytes(nondefault_state())
    restored = flax.serialization.from_bytes(DynamicLossScale(), data)
    assert isinstance(restored, DynamicLossScale)
    assert_fields(restored, NONDEFAULT)
    state_dict = flax.serialization.to_state_dict(nondefault_state())
    assert sorted(state_dict) == sorted(DYN_FIELDS)

    static = flax.serialization.from_bytes(
        StaticLossScale(1.0), flax.serialization.to_bytes(StaticLossScale(123.0))
    )
    assert static.loss_scale.dtype == jnp.float32 and float(static.loss_scale) == 123.0
    noop = flax.serialization.from_bytes(
        NoOpLossScale(), flax.serialization.to_bytes(NoOpLossScale())
    )
    assert isinstance(noop, NoOpLossScale)


def test_orbax_round_trip(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "ls", nondefault_state())
    ckpt.wait_until_finished()
    restored = ckpt.restore(tmp_path / "ls", DynamicLossScale())
    assert isinstance(restored, DynamicLossScale)
    assert_fields(restored, NONDEFAULT)
    # Leaves are saved under their field names, so a target-less restore is readable.
    raw = ckpt.restore(tmp_path / "ls")
    assert sorted(raw) == sorted(DYN_FIELDS) and float(raw["min_loss_scale"]) == 0.5


def test_flax_serialization_missing_field_raises():
    state_dict = flax.serialization.to_state_dict(nondefault_state())
    del state_dict["min_loss_scale"]
    with pytest.raises(ValueError, match="min_loss_scale"):
        flax.serialization.from_state_dict(DynamicLossScale(), state_dict)


@pytest.mark.parametrize(
    "state",
    [NoOpLossScale(), StaticLossScale(2.0**15), nondefault_state()],
    ids=["noop", "static", "dynamic"],
)
def test_lax_cond_keeps_dtypes(state):
    @jax.jit
    def f(s, pred):
        return jax.lax.cond(pred, lambda s: s.adjust(True), lambda s: s.adjust(False), s)

    before = [(x.dtype, x.shape) for x in jax.tree_util.tree_leaves(state)]
    for pred in (True, False):
        out = f(state, pred)
        assert type(out) is type(state)
        assert [(x.dtype, x.shape) for x in jax.tree_util.tree_leaves(out)] == before
    if isinstance(state, DynamicLossScale):
        assert float(f(state, True).counter) == 6
        assert float(f(state, False).hysteresis_counter) == 1


def test_vmap_over_batch_of_states():
    states = [
        DynamicLossScale(2.0**k, growth_interval=2, hysteresis=h, counter=c)
        for k, h, c in [(4, 1, 0), (5, 2, 1), (0, 1, 1), (24, 3, 1)]
    ]
    batch = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *states)
    flags = jnp.array([False, True, False, True])
    out = jax.jit(jax.vmap(lambda s, f: s.adjust(f)))(batch, flags)
    assert out.loss_scale.shape == (4,)
    for i, s in enumerate(states):
        single = _jit_adjust(s, flags[i])
        for name in DYN_FIELDS:
            assert getattr(out, name)[i] == getattr(single, name), (i, name)
    np.testing.assert_array_equal(out.loss_scale, [8.0, 64.0, 1.0, 2.0**24])
    np.testing.assert_array_equal(out.at_min, [False, False, True, False])


# --------------------------------------------------------------------------
# scale / unscale
# --------------------------------------------------------------------------


def test_unscale_returns_float32_divided_by_scale():
    state = DynamicLossScale(2.0**10)
    grads = {
        "a": jnp.array([1024.0, -2048.0, 3.0], jnp.float32),
        "b": jnp.array([512.0, 1.0], jnp.bfloat16),
        "step": jnp.array([3, 4], jnp.int32),
    }
    out = jax.jit(state.unscale)(grads)
    assert out["a"].dtype == jnp.float32 and out["b"].dtype == jnp.float32
    np.testing.assert_array_equal(out["a"], [1.0, -2.0, 3.0 / 1024.0])
    np.testing.assert_array_equal(out["b"], [0.5, 1.0 / 1024.0])
    assert out["step"].dtype == jnp.int32
    np.testing.assert_array_equal(out["step"], [3, 4])


def test_unscale_f16_large_values_no_inf():
    state = StaticLossScale(2.0**15)
    g = jnp.array([300.0, 60000.0, -1000.0], jnp.float16)  # > 256, scaled grads
    out = jax.jit(state.unscale)(g)
    assert out.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(out)))
    np.testing.assert_array_equal(out, np.array([300.0, 60000.0, -1000.0]) / 2.0**15)
    # Squared norm in f32 after unscaling is fine (it would be inf in f16).
    assert bool(jnp.isfinite(jnp.sum(out**2)))
    assert not bool(jnp.isfinite(jnp.sum(g**2)))


def test_scale_f32_loss_and_dtype_preservation():
    state = DynamicLossScale(2.0**16)
    loss = jnp.float32(0.75)
    out = jax.jit(state.scale)(loss)
    assert out.dtype == jnp.float32 and float(out) == 0.75 * 2.0**16
    tree = {"h": jnp.array([0.5], jnp.float16), "i": jnp.array([2], jnp.int32)}
    out = jax.jit(StaticLossScale(4.0).scale)(tree)
    assert out["h"].dtype == jnp.float16 and float(out["h"][0]) == 2.0
    assert out["i"].dtype == jnp.int32 and int(out["i"][0]) == 2


def test_noop_and_static_interface():
    noop = NoOpLossScale()
    assert noop.loss_scale.dtype == jnp.float32 and float(noop.loss_scale) == 1.0
    assert jax.jit(lambda s: s.adjust(False))(noop).loss_scale == 1.0
    assert not bool(noop.at_min)
    out = jax.jit(noop.unscale)(jnp.array([3.0], jnp.float16))
    assert out.dtype == jnp.float32 and float(out[0]) == 3.0
    static = StaticLossScale(8)
    assert static.loss_scale.dtype == jnp.float32
    after = jax.jit(lambda s: s.adjust(False))(static)
    assert float(after.loss_scale) == 8.0 and not bool(after.at_min)
    assert float(jax.jit(static.unscale)(jnp.float32(4.0))) == 0.5


# --------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(loss_scale=0.0), "loss_scale must be finite and > 0"),
        (dict(loss_scale=-4.0), "loss_scale must be finite and > 0"),
        (dict(loss_scale=float("nan")), "loss_scale must be finite and > 0"),
        (dict(loss_scale=float("inf")), "loss_scale must be finite and > 0"),
        (dict(growth_factor=0.5), r"must be > 1, got 0.5. Use e.g. growth_factor=2.0"),
        (dict(growth_factor=1.0), "growth_factor must be > 1"),
        (dict(growth_factor=float("inf")), "growth_factor must be > 1"),
        (dict(growth_factor=float("nan")), "growth_factor must be > 1"),
        (dict(backoff_factor=0.0), r"backoff_factor must be in the open interval \(0, 1\)"),
        (dict(backoff_factor=1.0), r"backoff_factor must be in the open interval \(0, 1\)"),
        (dict(backoff_factor=float("nan")), "backoff_factor must be in the open interval"),
        (dict(growth_interval=0), "growth_interval must be >= 1"),
        (dict(growth_interval=2.5), "growth_interval must be an integer"),
        (dict(min_loss_scale=0.0), "min_loss_scale must be finite and > 0"),
        (dict(min_loss_scale=float("inf")), "min_loss_scale must be finite and > 0"),
        (dict(max_loss_scale=float("inf")), "max_loss_scale must be finite and > 0"),
        (
            dict(loss_scale=1.0, min_loss_scale=4.0, max_loss_scale=2.0),
            "max_loss_scale must be >= min_loss_scale",
        ),
        (dict(loss_scale=0.5), r"loss_scale=0.5 < min_loss_scale=1.0"),
        (dict(loss_scale=2.0**25), r"loss_scale must be within \[min_loss_scale, max_loss_scale\]"),
        (dict(hysteresis=0), "hysteresis must be >= 1"),
        (dict(hysteresis=1.5), "hysteresis must be an integer"),
        (dict(growth_interval=3, counter=3), r"counter must be in \[0, growth_interval\)"),
        (dict(hysteresis=2, hysteresis_counter=3), r"hysteresis_counter must be in \[0, hyst"),
        (dict(growth_factor=np.array([2.0, 2.0])), "growth_factor must be a scalar"),
    ],
)
def test_dynamic_validation(kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        DynamicLossScale(**kwargs)
    assert str(info.value).startswith("DynamicLossScale: ")


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf"), np.float32(-2.0)])
def test_static_validation(value):
    with pytest.raises(ValueError, match=r"StaticLossScale: loss_scale must be finite and > 0"):
        StaticLossScale(value)


@pytest.mark.parametrize("kwargs", [dict(growth_interval=True), dict(loss_scale="big")])
def test_non_numbers_raise_type_error(kwargs):
    with pytest.raises(TypeError, match="DynamicLossScale: .* must be a real number"):
        DynamicLossScale(**kwargs)


def test_valid_edge_values_accepted():
    s = DynamicLossScale(
        1.0,
        growth_interval=1,
        min_loss_scale=1.0,
        max_loss_scale=1.0,
        growth_factor=np.float32(1.5),
        backoff_factor=0.999,
        hysteresis=np.int64(5),
    )
    assert bool(s.at_min) and int(s.hysteresis_counter) == 5
    assert int(DynamicLossScale(growth_interval=2000.0).growth_interval) == 2000


# --------------------------------------------------------------------------
# Validation in float32, the dtype every scale and factor is stored in (issue #13)
# --------------------------------------------------------------------------

F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)


@pytest.mark.parametrize(
    "make, match",
    [
        # finite in float64, inf once stored as float32
        (lambda: StaticLossScale(1e39), r"StaticLossScale: loss_scale=1e\+39 overflows float32"),
        (lambda: DynamicLossScale(1.0, max_loss_scale=1e39),
         r"DynamicLossScale: max_loss_scale=1e\+39 overflows float32"),
        (lambda: DynamicLossScale(1e39, max_loss_scale=1e40), "loss_scale=1e\\+39 overflows"),
        # 0.0 or subnormal once stored as float32
        (lambda: DynamicLossScale(1.0, min_loss_scale=1e-46),
         r"DynamicLossScale: min_loss_scale=1e-46 underflows float32"),
        (lambda: DynamicLossScale(1.0, min_loss_scale=1e-40), "min_loss_scale=1e-40 underflows"),
        (lambda: StaticLossScale(1e-40), "StaticLossScale: loss_scale=1e-40 underflows float32"),
        # factors that round to exactly 1 (never grow / never back off) or to 0
        (lambda: DynamicLossScale(growth_factor=1 + 1e-9),
         r"growth_factor must be > 1 in float32, .*rounds to 1.0"),
        (lambda: DynamicLossScale(backoff_factor=1 - 1e-9),
         r"backoff_factor must be in the open interval \(0, 1\) in float32"),
        (lambda: DynamicLossScale(backoff_factor=1e-46),
         r"backoff_factor must be in the open interval \(0, 1\) in float32"),
        (lambda: DynamicLossScale(growth_factor=1e39), "growth_factor=1e\\+39 overflows float32"),
    ],
)
def test_values_are_validated_in_float32(make, match):
    with pytest.raises(ValueError, match=match) as info:
        make()
    msg = str(info.value)
    if "overflows" in msg:
        assert f"{F32_MAX:g}" in msg  # names the allowed range
    if "underflows" in msg:
        assert f"{F32_TINY:g}" in msg


def test_float32_extremes_that_fit_are_kept_exactly():
    """The largest and smallest normal float32 values are accepted and stored unchanged; the
    scale then stays inside [min, max] when it backs off/grows past them (never 0 or inf)."""
    s = DynamicLossScale(F32_TINY, min_loss_scale=F32_TINY, max_loss_scale=F32_MAX,
                         growth_interval=1)
    assert s.loss_scale.dtype == jnp.float32 and float(s.loss_scale) == F32_TINY
    down = jax.jit(lambda s: s.adjust(False))(s)
    assert float(down.loss_scale) == F32_TINY  # floor holds: not 0.0
    top = DynamicLossScale(F32_MAX, min_loss_scale=1.0, max_loss_scale=F32_MAX, growth_interval=1)
    up = jax.jit(lambda s: s.adjust(True))(top)
    assert float(up.loss_scale) == F32_MAX  # ceiling holds: not inf
    assert float(StaticLossScale(F32_MAX).loss_scale) == F32_MAX


def test_pytree_leaves_are_the_dataclass_fields():
    """Every dataclass field is a leaf, in declaration order, keyed by its name (checkpoints
    name them), and comes back under jit with its non-default value."""
    assert [f.name for f in dataclasses.fields(DynamicLossScale)] == list(DYN_FIELDS)
    assert [f.name for f in dataclasses.fields(StaticLossScale)] == ["loss_scale"]
    assert dataclasses.fields(NoOpLossScale) == ()
    paths = jax.tree_util.tree_leaves_with_path(nondefault_state())
    assert [jax.tree_util.keystr(p) for p, _ in paths] == [f".{n}" for n in DYN_FIELDS]
    leaves, treedef = jax.tree_util.tree_flatten(nondefault_state())
    assert_fields(jax.jit(lambda xs: jax.tree_util.tree_unflatten(treedef, xs))(leaves),
                  NONDEFAULT)
