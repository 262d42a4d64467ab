"""autocast on shapes real models have, each one a failure users hit (issue: real architectures).

Every test here failed on the first engine: stored operands of concatenate / pad /
dynamic_update_slice broadcast like a bias, PRNG keys in the trace, autocast inside autocast,
region exits that cast a float32 value down for a float32 consumer, primitives no list knew.
"""

from __future__ import annotations

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp._engine.jaxpr import duplicate_casts, iter_eqns, lossy_round_trips

F16 = "params=float32,compute=float16,output=float32"
BF16 = "params=float32,compute=bfloat16,output=float32"


class ClassToken(nn.Module):
    """ViT/DeiT: a learned class token concatenated to patch embeddings, plus positions."""

    d: int = 16
    n: int = 4

    @nn.compact
    def __call__(self, patches):
        b = patches.shape[0]
        x = nn.Dense(self.d)(patches)
        cls = self.param("cls", nn.initializers.normal(1.0), (1, 1, self.d))
        x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, self.d)), x], axis=1)
        return x + self.param("pos", nn.initializers.normal(1.0), (1, self.n + 1, self.d))


@pytest.mark.parametrize("policy", [F16, BF16])
def test_class_token_concatenate(policy):
    model = ClassToken()
    x = jax.random.normal(jax.random.key(0), (2, 4, 8))
    v = model.init(jax.random.key(1), x)
    out = jax.jit(jaxamp.autocast(model.apply, policy))(v, x)
    ref = model.apply(v, x)
    assert out.shape == ref.shape == (2, 5, 16)
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2)


def test_stored_operands_of_shape_changing_ops_are_not_broadcast():
    """pad / dynamic_update_slice / concatenate with a param operand keep float32 semantics."""

    def fn(p, x):
        h = x @ p["w"]                                      # an activation in the compute dtype
        padded = jnp.pad(p["row"], ((0, 0), (0, 3)))        # stored operand of pad
        upd = jax.lax.dynamic_update_slice(h, p["row"], (0, 0))  # param written into row 0
        cat = jnp.concatenate([p["row"], h], axis=0)        # param rows before activations
        return padded.sum() + upd, cat

    p = {"w": jnp.eye(4) * 2.0, "row": jnp.array([[7.0, 8.0, 9.0, 10.0]])}
    x = jnp.arange(12.0).reshape(3, 4)
    out_upd, out_cat = jaxamp.autocast(fn, F16)(p, x)
    ref_upd, ref_cat = fn(p, x)
    assert out_upd.shape == ref_upd.shape and out_cat.shape == ref_cat.shape
    # Only row 0 takes the param's values; every other row is x @ w (+ the pad's sum).
    np.testing.assert_array_equal(np.asarray(out_upd), np.asarray(ref_upd))
    np.testing.assert_array_equal(np.asarray(out_cat), np.asarray(ref_cat))


def test_float_input_concatenated_with_activations_keeps_its_shape():
    def fn(w, x, extra):
        return jnp.concatenate([x @ w, extra], axis=-1)

    w, x, extra = jnp.ones((3, 4)), jnp.ones((2, 3)), jnp.full((2, 1), 5.0)
    out = jaxamp.autocast(fn, F16)(w, x, extra)
    assert out.shape == (2, 5)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(fn(w, x, extra)))


class Dropper(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(8)(x)
        x = nn.Dropout(0.5, deterministic=not train)(x)
        return nn.Dense(2)(x)


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["typed", "raw"])
def test_dropout_keys_flow_through(make_key):
    model = Dropper()
    x = jnp.ones((4, 3))
    v = model.init(jax.random.key(0), x, False)
    key = make_key(3)
    fwd = jax.jit(jaxamp.autocast(model.apply, F16), static_argnums=2)
    out = fwd(v, x, True, rngs={"dropout": key})
    ref = model.apply(v, x, True, rngs={"dropout": key})
    np.testing.assert_allclose(out, ref, rtol=1e-2, atol=1e-2)  # the same mask
    other = fwd(v, x, True, rngs={"dropout": make_key(4)})
    assert not np.allclose(out, other)


def test_keys_as_inputs_and_outputs():
    def fn(key, x):
        k1, k2 = jax.random.split(key)
        return k2, x @ jax.random.normal(k1, (3, 3))

    key = jax.random.key(0)
    k_out, y = jaxamp.autocast(fn, F16)(key, jnp.ones((2, 3)))
    k_ref, y_ref = fn(key, jnp.ones((2, 3)))
    assert jax.random.key_data(k_out).tolist() == jax.random.key_data(k_ref).tolist()
    np.testing.assert_allclose(y, y_ref, rtol=1e-2, atol=1e-2)


class Inner(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.LayerNorm()(nn.Dense(8)(x))


def test_autocast_inside_autocast():
    model = Inner()
    x = jnp.ones((2, 4))
    v = model.init(jax.random.key(0), x)
    inner = jaxamp.autocast(model.apply, F16, overrides={nn.Dense: BF16})
    outer = jaxamp.autocast(lambda v, x: inner(v, x).sum(), F16)
    jaxpr = jax.make_jaxpr(outer)(v, x)
    dots = [e for e in iter_eqns(jaxpr) if e.primitive.name == "dot_general"]
    assert [str(e.outvars[0].aval.dtype) for e in dots] == ["float16"]
    np.testing.assert_allclose(outer(v, x), model.apply(v, x).sum(), rtol=1e-2, atol=1e-2)
    # The audit and the precision table accept an autocast forward too, as the README says.
    table = jaxamp.precision_table(inner, v, x)
    assert table


def _rms_after_embed(ids):
    class Net(nn.Module):
        @nn.compact
        def __call__(self, ids):
            x = nn.Embed(16, 8)(ids)
            var = jnp.mean(jnp.square(x), -1, keepdims=True)
            return nn.Dense(4)(x / jnp.sqrt(var + 1e-6))

    return Net()


def test_region_exit_feeding_float32_statistics_is_not_cast_down():
    ids = jnp.arange(6).reshape(2, 3)
    model = _rms_after_embed(ids)
    v = model.init(jax.random.key(0), ids)
    jaxpr = jax.make_jaxpr(jaxamp.autocast(model.apply, F16))(v, ids)
    assert lossy_round_trips(jaxpr) == []
    assert duplicate_casts(jaxpr) == []
    dots = [e for e in iter_eqns(jaxpr) if e.primitive.name == "dot_general"]
    assert {str(e.invars[0].aval.dtype) for e in dots} == {"float16"}
    sums = [e for e in iter_eqns(jaxpr) if e.primitive.name == "reduce_sum"]
    assert sums and {str(e.invars[0].aval.dtype) for e in sums} == {"float32"}


class NormPoolResidual(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(8, (3, 3))(x)
        y = nn.BatchNorm(use_running_average=not train)(x)
        y = nn.max_pool(y, (2, 2), strides=(2, 2))
        z = nn.Conv(8, (1, 1))(nn.max_pool(x, (2, 2), strides=(2, 2)))
        return (y + z).mean()


def test_batchnorm_max_pool_residual_has_no_round_trip():
    model = NormPoolResidual()
    x = jnp.ones((2, 8, 8, 3))
    v = model.init(jax.random.key(0), x)
    jaxpr = jax.make_jaxpr(jaxamp.autocast(model.apply, F16))(v, x)
    assert lossy_round_trips(jaxpr) == []
    assert duplicate_casts(jaxpr) == []
    pools = [e for e in iter_eqns(jaxpr) if e.primitive.name == "reduce_window_max"]
    assert len(pools) == 2
    # max pooling keeps its operand's dtype: the conv output pools in float16.
    assert "float16" in {str(e.invars[0].aval.dtype) for e in pools}


@pytest.mark.parametrize("name, fn", [
    ("log2", lambda x: jnp.log2(x)),
    ("exp2", lambda x: jnp.exp2(x)),
    ("logistic", lambda x: jax.nn.sigmoid(x)),
])
def test_sensitive_primitives_run_in_float32(name, fn):
    def f(w, x):
        return fn(jnp.abs(x @ w) + 1.0)

    w, x = jnp.ones((3, 3)), jnp.ones((2, 3))
    jaxpr = jax.make_jaxpr(jaxamp.autocast(f, F16))(w, x)
    ops = [e for e in iter_eqns(jaxpr) if e.primitive.name == name]
    if not ops:
        pytest.skip(f"{name} is not a primitive in jax {jax.__version__}")
    assert {str(e.invars[0].aval.dtype) for e in ops} == {"float32"}


def test_every_jax_primitive_is_classified():
    """No primitive of this JAX falls silently into 'run as traced'."""
    rules = jaxamp.DEFAULT_OP_RULES
    import jax.extend.core.primitives as prims

    names = {p.name for p in vars(prims).values() if isinstance(p, jax.extend.core.Primitive)}
    assert len(names) > 100
    unknown = sorted(n for n in names if not rules.known(n))
    assert unknown == [], f"primitives in no op list of jaxamp.rules: {unknown}"


def test_unclassified_primitive_warns_once():
    rules = jaxamp.DEFAULT_OP_RULES.extend(promote=set())
    rules = jaxamp.OpRules(matmul=rules.matmul, fp32=rules.fp32 - {"sin"},
                           structural=rules.structural, promote=rules.promote - {"sin"},
                           as_traced=rules.as_traced - {"sin"})

    def f(w, x):
        return jnp.sin(x @ w) + jnp.sin(x @ w * 2)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jaxamp.autocast(f, F16, op_rules=rules)(jnp.ones((3, 3)), jnp.ones((2, 3)))
    msgs = [str(w.message) for w in caught if "sin" in str(w.message)]
    assert len(msgs) == 1 and "op_rules" in msgs[0], msgs


class NormThenSilu(nn.Module):
    """Diffusion UNets: GroupNorm -> SiLU -> Conv. ``jax.nn.silu`` is a jitted function whose
    ``logistic`` computes in float32: the norm's float32 output must reach it as float32."""

    @nn.compact
    def __call__(self, x):
        h = nn.Conv(8, (3, 3))(x)
        return nn.Conv(4, (3, 3))(nn.silu(nn.GroupNorm(4)(h)))


@pytest.mark.parametrize("policy", [F16, BF16])
def test_module_output_into_a_jitted_helper_has_no_round_trip(policy):
    model = NormThenSilu()
    x = jax.random.normal(jax.random.key(0), (2, 6, 6, 3))
    v = model.init(jax.random.key(1), x)
    fwd = jaxamp.autocast(model.apply, policy)
    jaxpr = jax.make_jaxpr(fwd)(v, x)
    assert lossy_round_trips(jaxpr) == []
    logistic = [e for e in iter_eqns(jaxpr) if e.primitive.name == "logistic"]
    assert logistic and all(e.invars[0].aval.dtype == jnp.float32 for e in logistic)
    convs = [e for e in iter_eqns(jaxpr) if e.primitive.name == "conv_general_dilated"]
    low = jnp.dtype(jaxamp.get_policy(policy).compute_dtype)
    assert len(convs) == 2 and all(v.aval.dtype == low for e in convs for v in e.invars)
    np.testing.assert_allclose(jax.jit(fwd)(v, x), model.apply(v, x), rtol=3e-2, atol=3e-2)


def test_ops_on_stored_values_alone_keep_their_precision():
    """Timestep embeddings (an int input x frequencies, then sin/cos) and an L2 penalty on the
    weights: no activation is involved, so nothing may be rounded to the compute dtype."""

    def fn(p, t, x):
        freqs = jnp.exp(-jnp.log(10000.0) * jnp.arange(8) / 8)
        args = t[:, None].astype(jnp.float32) * freqs[None]
        temb = jnp.concatenate([jnp.sin(args), jnp.cos(args)], axis=-1)
        penalty = jnp.sum(jnp.square(p["w"]))
        return temb, penalty, x @ p["w"]

    p = {"w": jnp.full((4, 4), 300.0)}
    t, x = jnp.array([1, 333, 777, 999]), jnp.ones((2, 4))
    for policy in (F16, BF16):
        temb, penalty, y = jax.jit(jaxamp.autocast(fn, policy))(p, t, x)
        ref_temb, ref_penalty, _ = fn(p, t, x)
        np.testing.assert_allclose(temb, ref_temb, atol=1e-5)
        assert float(penalty) == float(ref_penalty) == 16 * 300.0 ** 2
        matmul = [e for e in iter_eqns(jax.make_jaxpr(jaxamp.autocast(fn, policy))(p, t, x))
                  if e.primitive.name == "dot_general"]
        low = jnp.dtype(jaxamp.get_policy(policy).compute_dtype)
        assert all(v.aval.dtype == low for e in matmul for v in e.invars)


def test_unstack_and_stack_are_classified():
    """jax 0.12 iterates over arrays (and split keys) with ``unstack`` and has a ``stack``
    primitive; both only move data, so a float16 activation stays float16 and no
    unknown-primitive warning is raised (both warned before)."""
    if "unstack" not in _jaxpr_primitives():
        pytest.skip("this jax iterates over arrays with slices (no unstack primitive)")

    def fn(w, x, keys):
        rows = [r for r in (x @ w)]  # unstack on jax >= 0.11
        drop = [jax.random.bernoulli(k, 0.5, r.shape) for k, r in zip(keys, rows)]
        return jnp.stack([jnp.where(d, r, 0.0) for d, r in zip(drop, rows)])

    w, x = jnp.ones((4, 4)), jnp.ones((3, 4))
    keys = jax.random.split(jax.random.key(0), 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jaxpr = jax.make_jaxpr(jaxamp.autocast(fn, F16))(w, x, keys)
    unstacks = [e for e in iter_eqns(jaxpr) if e.primitive.name == "unstack"]
    assert any(e.invars[0].aval.dtype == jnp.float16 for e in unstacks)


def _jaxpr_primitives() -> set:
    jaxpr = jax.make_jaxpr(lambda x: [r for r in x])(jnp.ones((2, 2)))
    return {e.primitive.name for e in jaxpr.jaxpr.eqns}


# ---- every primitive that ordinary array code reaches is classified ---------------------------

_X = jnp.linspace(0.1, 0.9, 16, dtype=jnp.float32).reshape(4, 4)
_I = jnp.arange(16, dtype=jnp.int32).reshape(4, 4)
#: (array arguments, static arguments) tried on every public function
_TRIES = [((_X,), ()), ((_X, _X), ()), ((_X,), (2,)), ((_X,), (0,)), ((_X, _X, _X), ()),
          ((_I,), ()), ((_I, _I), ()), ((_X > 0.5, _X, _X), ()), ((_X,), ((2, 2),)),
          ((_X,), (1, 0)), ((_X, _I), ()), ((_X,), (2, 1)), ((_I,), (2,))]
#: Not ordinary array code: callbacks hand values to Python.
_CALLBACKS = {"pure_callback", "io_callback", "debug_callback"}


def reached_primitives() -> dict[str, str]:
    """primitive name -> the first public function (of ``jnp``, ``jnp.linalg``, ``jnp.fft``,
    ``lax``, ``lax.linalg``, ``jax.nn``) found to trace to it, each function called with the
    first argument forms it accepts (sub-programs included)."""
    import inspect

    modules = {"jnp": jnp, "jnp.linalg": jnp.linalg, "jnp.fft": jnp.fft, "lax": jax.lax,
               "lax.linalg": jax.lax.linalg, "jax.nn": jax.nn}
    found: dict[str, str] = {}
    for mname, mod in modules.items():
        for name in sorted(dir(mod)):
            fn = getattr(mod, name)
            if name.startswith("_") or name in _CALLBACKS or not callable(fn) \
                    or inspect.isclass(fn):
                continue
            for arrays, static in _TRIES:
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        jaxpr = jax.make_jaxpr(lambda *a, fn=fn, s=static: fn(*a, *s))(*arrays)
                except Exception:  # not this argument form
                    continue
                for e in iter_eqns(jaxpr):
                    found.setdefault(e.primitive.name, f"{mname}.{name}")
    return found


def test_every_primitive_ordinary_code_reaches_is_classified():
    """Not only the exported primitive list: what ``jnp``/``lax``/``jax.nn`` functions trace to
    (``jnp.tile``'s ``tile``, ``jnp.corrcoef``'s ``platform_index``, jax 0.12's ``empty`` and
    ``jnp.frexp``'s ``call_hi_primitive`` are exported nowhere)."""
    found = reached_primitives()
    assert len(found) > 120 and {"tile", "dot_general", "reduce_sum"} <= set(found)
    unknown = {p: f for p, f in found.items() if not jaxamp.DEFAULT_OP_RULES.known(p)}
    assert unknown == {}, f"primitives in no op list (and a function reaching each): {unknown}"


def test_tile_keeps_the_activation_dtype_without_a_warning():
    """``jnp.tile`` (tunix's Qwen3-MoE tiles its routing weights) copies values: a float16
    activation stays float16, and autocast does not warn."""
    def fn(w, x):
        h = x @ w[:4]
        return jnp.tile(h[:, None, :], (1, 3, 1)).reshape(2, 12) @ w

    w, x = jnp.linspace(-1, 1, 48).reshape(12, 4), jnp.ones((2, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jaxpr = jax.make_jaxpr(jaxamp.autocast(fn, F16))(w, x)
    tiles = [e for e in iter_eqns(jaxpr) if e.primitive.name == "tile"]
    assert [str(e.invars[0].aval.dtype) for e in tiles] == ["float16"]
    np.testing.assert_allclose(jax.jit(jaxamp.autocast(fn, F16))(w, x), fn(w, x), rtol=2e-3)


# ---- cast elimination across recompute segments (issue #40) ---------------------------------
# A recompute segment (and a repeated module call) evaluates on fresh values: a copy made of a
# value outside was made again inside, and one made inside again after it. The cast checks
# read the forward through the segments' checkpoints (jaxamp._engine.jaxpr.flat_scopes).
RECOMPUTE = {"on": jaxamp.DEFAULT_OP_RULES.extend(recompute=True),
             "off": jaxamp.DEFAULT_OP_RULES.extend(recompute=False)}
LOW_DTYPES = ("float16", "bfloat16")


def cast_checks(closed) -> tuple[int, int, int]:
    """(values cast twice to one dtype, float32 -> low -> float32 round trips, casts between
    float16 and bfloat16) of a forward program, across its in-line calls."""
    low_to_low = [e for e in iter_eqns(closed) if e.primitive.name == "convert_element_type"
                  and {str(e.invars[0].aval.dtype), str(e.outvars[0].aval.dtype)}
                  == set(LOW_DTYPES)]
    return len(duplicate_casts(closed)), len(lossy_round_trips(closed)), len(low_to_low)


class PostLNLayer(nn.Module):
    """BERT's post-LN layer: the LayerNorm output feeds the FFN's matmul and, in the next
    segment, the residual add (transformers' FlaxBertLayer)."""

    @nn.compact
    def __call__(self, x):
        x = nn.LayerNorm()(x + nn.Dense(16)(x))
        return nn.LayerNorm()(x + nn.Dense(16)(nn.gelu(nn.Dense(32)(x))))


class GatedMLP(nn.Module):
    @nn.compact
    def __call__(self, h):
        gate = nn.gelu(nn.Dense(32, use_bias=False, name="gate_proj")(h))
        return nn.Dense(16, use_bias=False, name="down_proj")(
            gate * nn.Dense(32, use_bias=False, name="up_proj")(h))


class HandRMSNorm(nn.Module):
    """tunix's RMSNorm, written out (no policy region of its own, as Flax's norms have)."""

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.zeros, (x.shape[-1],))
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * (1 + scale)


class SharedMLPCalls(nn.Module):
    """tunix's Gemma: a normalisation's output read only by the matmuls of an MLP module that
    every layer calls (a shared module call, evaluated once and replayed)."""

    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = x + GatedMLP(name=f"mlp_{i}")(HandRMSNorm(name=f"norm_{i}")(x))
        return x


class TimestepBlocks(nn.Module):
    """A diffusion UNet's timestep embedding: every block computes silu(temb) (float32) of the
    same low-precision embedding, each in its own segment."""

    @nn.compact
    def __call__(self, x, t):
        temb = nn.Dense(16, name="temb")(t)
        for i in range(3):
            x = x + nn.Dense(16, name=f"proj_{i}")(nn.silu(temb))[:, None]
            x = nn.Dense(16, name=f"fc_{i}")(nn.LayerNorm(name=f"ln_{i}")(x))
        return x


@pytest.mark.parametrize("recompute", list(RECOMPUTE))
@pytest.mark.parametrize("policy", [F16, BF16])
@pytest.mark.parametrize("model", [PostLNLayer, SharedMLPCalls, TimestepBlocks],
                         ids=lambda m: m.__name__)
def test_no_value_is_cast_twice_across_recompute_segments(model, policy, recompute):
    x = jax.random.normal(jax.random.key(0), (2, 6, 16))
    args = (x, jnp.ones((2, 8))) if model is TimestepBlocks else (x,)
    variables = model().init(jax.random.key(1), *args)
    fwd = jaxamp.autocast(model().apply, policy, op_rules=RECOMPUTE[recompute])
    closed = jax.make_jaxpr(fwd)(variables, *args)
    assert cast_checks(closed) == (0, 0, 0)
    # the segments are there, and the old one-jaxpr-at-a-time check saw nothing wrong either
    segments = [e for e in iter_eqns(closed) if e.primitive.name in ("checkpoint", "remat2")]
    assert bool(segments) == (recompute == "on")
    assert duplicate_casts(closed, nested=False) == []


class TokensAndPositions(nn.Module):
    """GPT's input: token rows plus learned positions, then a matmul (issue #40)."""

    vocab: int

    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(self.vocab, 16, name="embed")(ids)
        x = x + self.param("pos", nn.initializers.normal(1.0), (ids.shape[-1], 16))
        return nn.Dense(16, name="fc")(x)


def _gathers_and_scatters(closed):
    eqns = list(iter_eqns(closed))
    gathers = [(str(e.invars[0].aval.dtype), e.invars[0].aval.shape) for e in eqns
               if e.primitive.name == "gather"]
    scatters = [(str(e.outvars[0].aval.dtype), e.outvars[0].aval.shape) for e in eqns
                if e.primitive.name == "scatter-add"]
    return gathers, scatters


@pytest.mark.parametrize("policy", [F16, BF16])
@pytest.mark.parametrize("vocab", [8, 64])
def test_a_small_table_is_gathered_low_and_its_gradient_summed_in_float32(policy, vocab):
    """A table with no more elements than the rows read from it (8 x 16 against 4 x 8 rows)
    is cast whole and its rows gathered in the compute dtype, so XLA can make them again where
    they are read (issue #40: the bench GPT copied and kept its embedding sum instead); a
    larger one (64 x 16) is not cast whole. Either way the rows are the same numbers and the
    table's gradient is a float32 scatter-add."""
    low = "float16" if policy == F16 else "bfloat16"
    model = TokensAndPositions(vocab)
    ids = jax.random.randint(jax.random.key(0), (4, 8), 0, vocab)
    params = model.init(jax.random.key(1), ids)

    def loss(p, apply):
        return jnp.mean(apply(p, ids).astype(jnp.float32) ** 2)

    amp = jax.value_and_grad(functools.partial(loss, apply=jaxamp.autocast(model.apply, policy)))
    gathers, scatters = _gathers_and_scatters(jax.make_jaxpr(amp)(params))
    if vocab == 8:  # 128 table elements, 512 gathered
        assert (low, (vocab, 16)) in gathers
    else:  # 1024 table elements
        assert ("float32", (vocab, 16)) in gathers and (low, (vocab, 16)) not in gathers
    assert scatters == [("float32", (vocab, 16))]
    value, grads = jax.jit(amp)(params)
    ref_value, ref_grads = jax.value_and_grad(functools.partial(loss, apply=model.apply))(params)
    np.testing.assert_allclose(value, ref_value, rtol=2e-2)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(g, r, rtol=5e-2, atol=5e-3)
