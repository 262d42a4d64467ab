"""The library API's traps (GitHub issue #27, items 1 and 10): what would be silently wrong or
fail deep inside JAX is refused up front, with the fix in the message."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest
from models import MLP, ce_loss
from test_amp import _setup

import jaxamp

F32 = "params=float32,compute=float32,output=float32"


# ---- 1. jaxamp.amp(...) handed where the plain optimizer goes ------------------------------


@pytest.mark.parametrize("wrap", [
    lambda: jaxamp.amp(optax.sgd(0.1)),
    lambda: optax.chain(optax.clip(1.0), jaxamp.amp(optax.sgd(0.1))),
], ids=["amp", "chain-with-amp"])
def test_amp_transformation_as_the_states_optimizer_is_refused(wrap):
    """Before: accepted; the step wrapped it in amp again and unscaled twice, so every update
    was 65536x too small (loss scale 2**16) without an error."""
    model, params, _ = _setup()
    with pytest.raises(TypeError) as e:
        jaxamp.TrainState.create(model, params, wrap())
    msg = str(e.value)
    assert msg.startswith("TrainState.create: tx is (or contains) jaxamp.amp(...)"), msg
    assert "unscaled twice" in msg and "Pass the plain optimizer" in msg
    assert "make_train_step(model, loss_fn, clip_norm=...)" in msg


def test_amp_state_slipped_into_a_state_is_refused_by_the_step():
    model, params, batch = _setup()
    state = jaxamp.TrainState.create(model, params, optax.sgd(0.1), policy=F32)
    tx = jaxamp.amp(optax.sgd(0.1))
    bad = state.replace(tx=tx, opt_state=tx.init(state.params))
    step = jaxamp.make_train_step(model, ce_loss, donate=False)
    with pytest.raises(TypeError, match=r"^step: tx is \(or contains\) jaxamp.amp"):
        step(bad, batch)


def test_the_plain_optimizer_is_applied_once_unscaled():
    """The fix the message gives: plain sgd in the state, loss scaling in the step; the update
    is exactly -lr * the float32 gradient (not divided by the scale once more)."""
    model, params, batch = _setup()
    state = jaxamp.TrainState.create(model, params, optax.sgd(0.1), policy=F32,
                                     loss_scale=jaxamp.StaticLossScale(2.0**16))
    new, _ = jaxamp.make_train_step(model, ce_loss, donate=False)(state, batch)
    grads = jax.grad(lambda p: ce_loss(model.apply, p, batch))(params)
    for p, g, q in zip(jax.tree.leaves(params), jax.tree.leaves(grads),
                       jax.tree.leaves(new.params), strict=True):
        # amp twice would give -0.1 * g / 65536 (~1e-9 here)
        np.testing.assert_allclose(q - p, -0.1 * g, rtol=1e-3, atol=1e-7)


# ---- 10. a Python-float loss, an integer policy, a bfloat16 clip_norm ---------------------


@pytest.mark.parametrize("value", [1.0, np.float32(1.0)], ids=["float", "np.float32"])
def test_python_or_numpy_number_loss_is_a_clear_error(value):
    """Before: it passed the scalar check, then AttributeError: 'TypedFloat' object has no
    attribute 'astype' from inside the step."""
    model, params, batch = _setup()
    state = jaxamp.TrainState.create(model, params, optax.sgd(0.1), policy=F32)
    step = jaxamp.make_train_step(model, lambda apply_fn, p, b: value, donate=False)
    with pytest.raises(TypeError) as e:
        step(state, batch)
    msg = str(e.value)
    assert msg.startswith(f"step: loss_fn returned a {type(value).__name__} (")
    assert "a constant" in msg and "no float(...), .item()" in msg


INT_POLICY = jmp.Policy(param_dtype=jnp.float32, compute_dtype=jnp.int8,
                        output_dtype=jnp.float32)


@pytest.mark.parametrize("where", ["TrainState.create", "make_train_step", "make_eval_step",
                                   "autocast", "autocast overrides", "get_policy"])
def test_policy_with_integer_compute_is_refused_where_it_is_taken(where):
    """Before: TrainState.create accepted it and the step failed 15 frames deep in numpy."""
    model, params, _ = _setup()
    calls = {
        "TrainState.create": lambda: jaxamp.TrainState.create(model, params, optax.sgd(0.1),
                                                              policy=INT_POLICY),
        "make_train_step": lambda: jaxamp.make_train_step(model, ce_loss, policy=INT_POLICY),
        "make_eval_step": lambda: jaxamp.make_eval_step(model, ce_loss, policy=INT_POLICY),
        "autocast": lambda: jaxamp.autocast(model.apply, INT_POLICY),
        "autocast overrides": lambda: jaxamp.autocast(model.apply, F32,
                                                      overrides={MLP: INT_POLICY}),
        "get_policy": lambda: jaxamp.get_policy(INT_POLICY),
    }
    with pytest.raises(ValueError) as e:
        calls[where]()
    msg = str(e.value)
    key = "overrides[MLP]: " if where == "autocast overrides" else ""  # the key it came under
    assert msg.startswith(f"{key}jmp.Policy with compute_dtype=int8: the compute dtype is not a "
                          "floating type"), msg
    assert "Use float32, float16 or bfloat16" in msg


@pytest.mark.parametrize("field", ["param_dtype", "output_dtype"])
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, jnp.complex64])
def test_every_policy_dtype_must_be_floating(field, dtype):
    kw = {"param_dtype": jnp.float32, "compute_dtype": jnp.float16, "output_dtype": jnp.float32}
    kw[field] = dtype
    with pytest.raises(ValueError, match=rf"^jmp.Policy with {field}={np.dtype(dtype).name}"):
        jaxamp.get_policy(jmp.Policy(**kw))


def test_float_jmp_policies_are_returned_unchanged():
    for dtype in (jnp.float32, jnp.float16, jnp.bfloat16):
        p = jmp.Policy(jnp.float32, dtype, jnp.float32)
        assert jaxamp.get_policy(p) is p


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32, jnp.int32])
def test_jax_scalar_clip_norm_of_any_real_dtype_is_accepted(dtype):
    """Before: a bfloat16 jnp.array(1.0) was refused as "not a positive finite number" (NumPy
    does not count bfloat16 as np.number). The step clips exactly as with clip_norm=1.0."""
    model, params, batch = _setup()

    def run(clip):
        state = jaxamp.TrainState.create(model, params, optax.sgd(1.0), policy=F32)
        step = jaxamp.make_train_step(model, ce_loss, clip_norm=clip, donate=False)
        return step(state, batch)

    (ref, m_ref), (got, m_got) = run(1.0), run(jnp.array(1.0, dtype))
    assert float(m_got["grad_norm"]) == float(m_ref["grad_norm"])
    assert float(m_ref["grad_norm"]) > 1.0  # the clip is active
    for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(got.params), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize("bad", [jnp.array(jnp.inf, jnp.bfloat16), jnp.array(0, jnp.bfloat16),
                                 jnp.array(-1, jnp.bfloat16), jnp.array(1 + 1j),
                                 jnp.array(True), jnp.ones(2, jnp.bfloat16)])
def test_clip_norm_still_refuses_non_positive_non_finite_and_non_real(bad):
    with pytest.raises(ValueError, match="clip_norm must be a positive finite number or None"):
        jaxamp.make_train_step(MLP(), ce_loss, clip_norm=bad)
