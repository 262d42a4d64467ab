"""The jitted AMP train step: unscale-then-clip, skipping, loss-scale trajectories, parallelism."""

from __future__ import annotations

import os
import sys
import textwrap
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import multihost  # tests/multihost.py
import numpy as np
import optax
import pytest
from models import MLP, ce_loss

import jaxamp

F16 = "params=float32,compute=float16,output=float32"
F32 = "params=float32,compute=float32,output=float32"




def _setup(n=16, seed=0):
    model = MLP()
    x = jax.random.normal(jax.random.key(seed), (n, 8))
    y = jnp.arange(n) % 4
    params = model.init(jax.random.key(1), x)["params"]
    return model, params, {"x": x, "y": y}


def _copy(tree):
    return jax.tree.map(lambda a: np.array(a), tree)


def _bits_equal(a, b):
    return all(np.asarray(x).dtype == np.asarray(y).dtype
               and np.asarray(x).tobytes() == np.asarray(y).tobytes()
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def _poison(batch, value=jnp.inf, row=0):
    return {**batch, "x": batch["x"].at[row, 0].set(value)}


def test_unscale_then_clip_applies_clip_of_true_grads():
    model, params, batch = _setup()
    tx = optax.sgd(1.0)
    state = jaxamp.TrainState.create(model, params, tx, policy=F32,
                                     loss_scale=jaxamp.StaticLossScale(2.0**15))
    step = jaxamp.make_train_step(model, ce_loss, tx, policy=F32, clip_norm=1.0, donate=False)
    new_state, metrics = step(state, batch)
    true_grads = jax.grad(lambda p: ce_loss(model.apply, p, batch))(params)
    norm = optax.tree.norm(true_grads)
    assert float(norm) > 1.0  # clipping is active
    np.testing.assert_allclose(metrics["grad_norm"], norm, rtol=1e-6)
    expected = jax.tree.map(lambda p, g: p - g / norm, params, true_grads)
    for got, want in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got, want, atol=1e-6)
    # the update is clip(g), not clip(2^15 g) = the same direction... so check the size too:
    delta = optax.tree.norm(jax.tree.map(jnp.subtract, new_state.params, params))
    np.testing.assert_allclose(delta, 1.0, rtol=1e-5)


def test_f16_grads_above_256_are_clipped_without_overflow():
    # params stored in f16: their grads are f16 with elements far above 256
    def loss_fn(apply_fn, params, batch):
        return jnp.sum(apply_fn({"params": params}, batch["x"]))

    model = nn.Dense(1, use_bias=False)
    x = jnp.full((4, 3), 300.0)
    params = model.init(jax.random.key(0), x)["params"]
    tx = optax.sgd(1.0)
    policy = "params=float16,compute=float16,output=float32"
    with pytest.warns(UserWarning, match="float16 gradients below ~6e-8 underflow"):
        state = jaxamp.TrainState.create(model, params, tx, policy=policy,
                                         loss_scale=jaxamp.NoOpLossScale())
    assert state.params["kernel"].dtype == jnp.float16
    step = jaxamp.make_train_step(model, loss_fn, tx, policy=policy, clip_norm=1.0)
    before = _copy(state.params)
    state, metrics = step(state, {"x": x})
    assert bool(metrics["grads_finite"])
    np.testing.assert_allclose(metrics["grad_norm"], 1200.0 * np.sqrt(3), rtol=1e-3)
    delta = np.asarray(before["kernel"], np.float32) - np.asarray(state.params["kernel"],
                                                                  np.float32)
    np.testing.assert_allclose(delta, np.full((3, 1), 1 / np.sqrt(3)), rtol=2e-3)


@pytest.mark.parametrize("poison", [jnp.inf, jnp.nan])
def test_nonfinite_step_is_skipped_bit_identically(poison):
    model, params, batch = _setup()
    tx = optax.adamw(optax.cosine_decay_schedule(1e-2, 100), weight_decay=0.1)
    state = jaxamp.TrainState.create(model, params, tx, loss_scale=jaxamp.DynamicLossScale())
    step = jaxamp.make_train_step(model, ce_loss, tx, policy=F16, clip_norm=1.0)
    state, _ = step(state, batch)
    params_before, opt_before = _copy(state.params), _copy(state.opt_state)
    state, metrics = step(state, _poison(batch, poison))
    assert not bool(metrics["grads_finite"]) and bool(metrics["skipped"])
    assert int(metrics["skipped_steps"]) == 1 and int(state.skipped_steps) == 1
    assert float(metrics["loss_scale"]) == 2.0**16  # the scale used in the skipped step
    assert float(state.loss_scale.loss_scale) == 2.0**15  # ... then backed off
    assert _bits_equal(state.params, params_before)
    # adam's count (the schedule) did not advance
    assert _bits_equal(state.opt_state.inner_state, opt_before.inner_state)
    assert int(state.step) == 2  # TrainState.step counts attempted steps
    state, metrics = step(state, batch)
    assert bool(metrics["grads_finite"]) and not bool(metrics["skipped"])
    assert not _bits_equal(state.params, params_before)
    assert int(state.opt_state.inner_state[0].count) == 2


def test_injected_overflows_skip_exactly_those_steps_and_scale_follows_reference():
    model, params, batch = _setup()
    tx = optax.adam(1e-3)
    ls = jaxamp.DynamicLossScale(2.0**10, growth_interval=3, hysteresis=2, max_loss_scale=2.0**12)
    state = jaxamp.TrainState.create(model, params, tx, loss_scale=ls)
    step = jaxamp.make_train_step(model, ce_loss, tx, policy=F16)
    bad_steps = {2, 3, 9, 15, 16, 17}
    scales, skipped = [], []
    for i in range(50):
        state, m = step(state, _poison(batch) if i in bad_steps else batch)
        scales.append(float(m["loss_scale"]))
        skipped.append(bool(m["skipped"]))
    assert {i for i, s in enumerate(skipped) if s} == bad_steps
    # reference state machine (Megatron semantics, see jaxamp.loss_scale)
    scale, counter, hyst, want = 2.0**10, 0, 2, []
    for i in range(50):
        want.append(scale)
        if i in bad_steps:
            counter, hyst = 0, max(hyst - 1, 0)
            if hyst <= 0:
                scale = max(scale / 2, 1.0)
        else:
            counter += 1
            if counter == 3:
                counter, hyst, scale = 0, 2, min(scale * 2, 2.0**12)
    assert scales == want
    assert len(set(scales)) > 3  # the scale really moved (grew, hit the ceiling, backed off)
    assert step._cache_size() == 1  # one compilation for the whole run


def test_full_precision_no_op_equals_plain_optax():
    model, params, batch = _setup()
    tx = optax.adamw(1e-2)
    state = jaxamp.TrainState.create(model, params, tx, policy=F32,
                                     loss_scale=jaxamp.NoOpLossScale())
    step = jaxamp.make_train_step(model, ce_loss, tx, policy=F32)
    p, o = params, tx.init(params)

    @jax.jit
    def plain(p, o, batch):
        loss, g = jax.value_and_grad(lambda p: ce_loss(model.apply, p, batch))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    for _ in range(5):
        state, m = step(state, batch)
        p, o, loss = plain(p, o, batch)
        np.testing.assert_allclose(m["loss"], loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(p)):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_gradient_underflow_needs_loss_scaling():
    # True gradients ~1e-8, below float16's smallest subnormal (~6e-8).
    def loss_fn(apply_fn, params, batch):
        pred = apply_fn({"params": params}, batch["x"])
        return 1e-8 * jnp.mean((pred[:, 0] - batch["y"]) ** 2)

    model = nn.Dense(1, use_bias=False)
    x = jax.random.normal(jax.random.key(0), (32, 4))
    batch = {"x": x, "y": x @ jnp.array([0.5, -1.0, 0.25, 2.0])}
    params = model.init(jax.random.key(1), x)["params"]
    tx = optax.sgd(2e6)
    grads = jax.grad(lambda p: loss_fn(model.apply, p, batch))(params)["kernel"]
    assert 0 < float(jnp.max(jnp.abs(grads))) < 6e-8

    def run(policy, loss_scale):
        with warnings.catch_warnings():  # float16 without scaling is this test's point
            warnings.simplefilter("ignore", UserWarning)
            state = jaxamp.TrainState.create(model, params, tx, policy=policy,
                                             loss_scale=loss_scale)
        step = jaxamp.make_train_step(model, loss_fn, tx, policy=policy)
        for _ in range(20):
            state, m = step(state, batch)
        return state.params["kernel"], m

    k32, _ = run(F32, jaxamp.NoOpLossScale())
    k16_plain, m_plain = run(F16, jaxamp.NoOpLossScale())
    k16_scaled, m_scaled = run(F16, jaxamp.DynamicLossScale())
    assert float(m_plain["grad_norm"]) == 0.0  # every gradient underflowed
    assert _bits_equal(k16_plain, params["kernel"])  # learned nothing
    assert float(jnp.linalg.norm(k32 - params["kernel"])) > 0.5  # f32 learned
    np.testing.assert_allclose(k16_scaled, k32, rtol=2e-2, atol=2e-2)


def test_micro_batch_accumulation_equals_one_big_step_and_poison_skips_window():
    model, params, batch = _setup(n=16)
    tx = optax.sgd(0.1)
    big = jaxamp.make_train_step(model, ce_loss, tx, policy=F16, donate=False)
    acc = jaxamp.make_train_step(model, ce_loss, tx, policy=F16, micro_batches=4, donate=False)
    state = jaxamp.TrainState.create(model, params, tx, loss_scale=jaxamp.DynamicLossScale())
    s_big, m_big = big(state, batch)
    s_acc, m_acc = acc(state, batch)
    np.testing.assert_allclose(m_acc["loss"], m_big["loss"], rtol=1e-3)
    np.testing.assert_allclose(m_acc["grad_norm"], m_big["grad_norm"], rtol=1e-2)
    for a, b in zip(jax.tree.leaves(s_acc.params), jax.tree.leaves(s_big.params)):
        np.testing.assert_allclose(a, b, atol=1e-3)
    s_bad, m_bad = acc(state, _poison(batch, row=13))  # only the last micro-batch is bad
    assert bool(m_bad["skipped"]) and _bits_equal(s_bad.params, state.params)


def test_step_jaxpr_keeps_the_forward_in_compute_dtype_and_update_in_f32():
    model, params, batch = _setup()
    tx = optax.adam(1e-3)
    state = jaxamp.TrainState.create(model, params, tx, loss_scale=jaxamp.DynamicLossScale())
    step = jaxamp.make_train_step(model, ce_loss, tx, policy=F16, clip_norm=1.0)
    text = step.lower(state, batch).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert dots and all("f16" in line and "f32" not in line.split("->")[-1] for line in dots)
    new_state, _ = step(state, batch)
    assert {x.dtype for x in jax.tree.leaves((new_state.params, new_state.opt_state))
            if jnp.issubdtype(x.dtype, jnp.floating)} == {jnp.dtype(jnp.float32)}


def test_low_precision_params_keep_their_optimizer_state_dtypes():
    model, params, batch = _setup()
    tx = optax.adamw(1e-3)
    policy = "params=bfloat16,compute=bfloat16,output=float32"
    state = jaxamp.TrainState.create(model, params, tx, policy=policy)
    step = jaxamp.make_train_step(model, ce_loss, tx, policy=policy)
    dtypes = jax.tree.map(lambda x: x.dtype, (state.params, state.opt_state.inner_state))
    for _ in range(2):
        state, m = step(state, batch)
    assert jax.tree.map(lambda x: x.dtype, (state.params, state.opt_state.inner_state)) == dtypes
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
    assert bool(m["grads_finite"])


def test_bf16_policy_defaults_to_no_loss_scaling():
    assert isinstance(jaxamp.default_loss_scale("compute=bfloat16"), jaxamp.NoOpLossScale)
    assert isinstance(jaxamp.default_loss_scale(F16), jaxamp.DynamicLossScale)
    model, params, _ = _setup()
    state = jaxamp.TrainState.create(model, params, optax.sgd(1.0), policy="c=bf16")
    assert isinstance(state.loss_scale, jaxamp.NoOpLossScale)


_DP_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np, optax, json, sys
    sys.path.insert(0, sys.argv[1])
    from test_train import _setup, ce_loss, _poison, F16
    import jaxamp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    assert jax.device_count() == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    model, params, batch = _setup(n=16)
    tx = optax.adam(1e-2)
    out = {}
    def run(mesh_arg, batches):
        state = jaxamp.TrainState.create(model, params, tx, loss_scale=jaxamp.DynamicLossScale())
        step = jaxamp.make_train_step(model, ce_loss, tx, policy=F16, clip_norm=1.0,
                                      mesh=mesh_arg)
        ms = []
        for b in batches:
            if mesh_arg is not None:
                b = jax.device_put(b, NamedSharding(mesh, P("data")))
            state, m = step(state, b)
            ms.append({k: float(v) for k, v in m.items()})
        return state, ms, step
    batches = [batch, _poison(batch, row=5), batch]
    s_dp, m_dp, step = run(mesh, batches)
    s_1, m_1, _ = run(None, batches)
    out["skipped"] = [m["skipped"] for m in m_dp]
    out["max_param_diff"] = max(float(jnp.max(jnp.abs(a - b))) for a, b in
                                zip(jax.tree.leaves(s_dp.params), jax.tree.leaves(s_1.params)))
    out["loss_diff"] = max(abs(a["loss"] - b["loss"]) for a, b in zip(m_dp, m_1))
    # every device holds the same params (replicated)
    out["replicas_identical"] = all(
        all(np.array_equal(np.asarray(s.data), np.asarray(leaf.addressable_shards[0].data))
            for s in leaf.addressable_shards) for leaf in jax.tree.leaves(s_dp.params))
    out["n_shards"] = len(jax.tree.leaves(s_dp.params)[0].addressable_shards)
    rows = jaxamp.collectives(step, s_dp, jax.device_put(batch, NamedSharding(mesh, P("data"))))
    reduces = [r for r in rows if r["kind"] == "all-reduce"]
    out["all_reduce_lines"] = len(reduces)
    out["f16_all_reduce"] = sum(r["dtype"] == "float16" for r in reduces)
    print(json.dumps(out))
""")


def test_data_parallel_on_8_virtual_devices(tmp_path):
    out = _run_8_devices(tmp_path, _DP_SCRIPT)
    assert out["skipped"] == [0.0, 1.0, 0.0]  # the poisoned shard made every device skip
    assert out["n_shards"] == 8 and out["replicas_identical"]
    assert out["max_param_diff"] < 1e-3 and out["loss_diff"] < 1e-3
    assert out["all_reduce_lines"] > 0 and out["f16_all_reduce"] == 0


# ---- bad input, rejected before compiling ------------------------------------------------

def test_a_batch_of_zero_rows_is_refused_before_jit():
    """Issue 46: it was accepted and became a skipped step (loss nan, skip_reason 2); the
    batch size is known before jit."""
    model, params, batch = _setup()
    state = jaxamp.TrainState.create(model, params, optax.sgd(0.1), policy=F16)
    step = jaxamp.make_train_step(model, ce_loss)
    empty = {"x": batch["x"][:0], "y": batch["y"][:0]}
    with pytest.raises(ValueError) as info:
        step(state, empty)
    assert str(info.value) == (
        "step: the batch has 0 rows (batch['x'] has shape (0, 8)); a train step needs at least "
        "one example: the mean loss over none is NaN, and the step would be skipped. Leave "
        "empty batches out of the loop (e.g. drop a last, empty batch).")
    with pytest.raises(ValueError, match=r"^step: the batch has 0 rows"):
        jaxamp.make_train_step(model, ce_loss, micro_batches=2)(state, empty)
    assert int(state.step) == 0  # nothing ran


def test_bad_inputs_are_rejected_before_jit():
    model, params, batch = _setup()
    tx = optax.sgd(0.1)
    state = jaxamp.TrainState.create(model, params, tx)
    step = jaxamp.make_train_step(model, ce_loss, tx, policy=F16)
    with pytest.raises(ValueError, match="disagree on the batch size.*'x'.*16.*'y'.*8"):
        step(state, {"x": batch["x"], "y": batch["y"][:8]})
    vec = jaxamp.make_train_step(
        model, lambda f, p, b: jnp.mean(f({"params": p}, b["x"]), axis=0), tx, policy=F16)
    with pytest.raises(ValueError, match=r"floating scalar, got shape=\(4,\)"):
        vec(state, batch)
    ints = jaxamp.make_train_step(model, lambda f, p, b: jnp.argmax(f({"params": p}, b["x"])),
                                  tx, policy=F16)
    with pytest.raises(ValueError, match="floating scalar.*int32"):
        ints(state, batch)
    with pytest.raises(TypeError, match=r"params must be floating point, got int32 at .*'w'"):
        jaxamp.TrainState.create(model, {"w": jnp.ones(3, jnp.int32)}, tx)
    with pytest.raises(ValueError, match="clip_norm must be a positive finite number"):
        jaxamp.make_train_step(model, ce_loss, tx, clip_norm=0.0)
    with pytest.raises(ValueError, match="clip_norm.*inf"):
        jaxamp.make_train_step(model, ce_loss, tx, clip_norm=float("inf"))
    with pytest.raises(ValueError, match="micro_batches must be an integer >= 1, got 0"):
        jaxamp.make_train_step(model, ce_loss, tx, micro_batches=0)
    accum = jaxamp.make_train_step(model, ce_loss, tx, micro_batches=3)
    with pytest.raises(ValueError, match="batch size 16 must be divisible by micro_batches"):
        accum(state, batch)
    with pytest.raises(ValueError, match="different optimizer"):
        jaxamp.make_train_step(model, ce_loss, optax.adam(1e-3))(state, batch)
    with pytest.raises(TypeError, match="loss_scale must be"):
        jaxamp.TrainState.create(model, params, tx, loss_scale=2.0**16)
    with pytest.raises(ValueError, match="loss_scale"):
        jaxamp.DynamicLossScale(0.0)
    with pytest.raises(ValueError, match="growth_factor"):
        jaxamp.DynamicLossScale(growth_factor=1.0)
    with pytest.raises(ValueError, match="backoff_factor"):
        jaxamp.DynamicLossScale(backoff_factor=1.5)
    with pytest.raises(ValueError, match="compute"):
        jaxamp.make_train_step(model, ce_loss, tx, policy="compute=float8")


# ---- one source of truth: the state's policy and loss scale ---------------------------------

def test_default_create_and_step_pair_scales_the_float16_loss():
    model, params, batch = _setup()
    tx = optax.sgd(0.1)
    state = jaxamp.TrainState.create(model, params, tx)  # no policy=, no loss_scale=
    step = jaxamp.make_train_step(model, ce_loss, tx)  # no policy=
    assert jaxamp.get_policy(jaxamp.DEFAULT_POLICY) == state.policy
    assert isinstance(state.loss_scale, jaxamp.DynamicLossScale)
    text = step.lower(state, batch).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert dots and all("f16" in line for line in dots)  # the pair computes in float16 ...
    state, m = step(state, batch)
    assert float(m["loss_scale"]) == 2.0**16  # ... and scales its loss


def test_policy_mismatch_raises_before_compiling():
    model, params, batch = _setup()
    tx = optax.sgd(0.1)
    state = jaxamp.TrainState.create(model, params, tx, policy="params=float32,compute=bfloat16")
    assert isinstance(state.loss_scale, jaxamp.NoOpLossScale)
    step = jaxamp.make_train_step(model, ce_loss, tx, policy=F16)
    with pytest.raises(ValueError, match=r"policy=.*float16.*created with policy=.*bfloat16"):
        step(state, batch)
    with pytest.raises(ValueError, match="Give the policy once"):
        step.lower(state, batch)  # raised while tracing: before lowering, let alone compiling
    # the step that takes the state's policy runs it in bfloat16
    text = jaxamp.make_train_step(model, ce_loss, tx).lower(state, batch).as_text()
    assert all("bf16" in line for line in text.splitlines() if "stablehlo.dot_general" in line)


def test_float16_without_scaling_warns_only_when_asked_for():
    model, params, _ = _setup()
    with pytest.warns(UserWarning, match="underflow to zero.*Omit loss_scale="):
        jaxamp.TrainState.create(model, params, optax.sgd(0.1), policy=F16,
                                 loss_scale=jaxamp.NoOpLossScale())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jaxamp.TrainState.create(model, params, optax.sgd(0.1), policy=F32,
                                 loss_scale=jaxamp.NoOpLossScale())


def test_inputs_stay_usable_and_a_donated_state_is_refused():
    model, params, batch = _setup()
    tx = optax.adam(1e-3)
    ls, rng = jaxamp.DynamicLossScale(2.0**8), jax.random.key(3)
    state = jaxamp.TrainState.create(model, params, tx, loss_scale=ls, rng=rng)
    step = jaxamp.make_train_step(model, ce_loss, tx)
    new_state, _ = step(state, batch)  # donates state's buffers
    assert float(ls.loss_scale) == 2.0**8 and int(ls.counter) == 0  # still readable
    np.testing.assert_array_equal(jax.random.key_data(rng), jax.random.key_data(
        jax.random.key(3)))
    assert float(jax.tree.leaves(params)[0].sum()) == float(jax.tree.leaves(params)[0].sum())
    with pytest.raises(ValueError, match="donated to an earlier step call"):
        step(state, batch)
    step(new_state, batch)


def test_foreign_opt_state_and_jax_scalar_arguments():
    model, params, batch = _setup()
    tx = optax.sgd(0.1)
    state = jaxamp.TrainState.create(model, params, tx, policy=F32)
    step = jaxamp.make_train_step(model, ce_loss, tx, donate=False)
    foreign = state.replace(opt_state=optax.adam(1e-3).init(state.params))
    with pytest.raises(ValueError, match="optimizer state does not match the optimizer"):
        step(foreign, batch)
    a, _ = jaxamp.make_train_step(model, ce_loss, clip_norm=0.5, micro_batches=2,
                                  donate=False)(state, batch)
    b, _ = jaxamp.make_train_step(model, ce_loss, clip_norm=jnp.float32(0.5),
                                  micro_batches=jnp.int32(2), donate=False)(state, batch)
    assert _bits_equal(a.params, b.params) and not _bits_equal(a.params, state.params)
    with pytest.raises(ValueError, match="has_aux=True"):
        jaxamp.make_train_step(model, lambda f, p, b: (ce_loss(f, p, b), 1.0))(state, batch)
    with pytest.raises(ValueError, match=r"must return \(loss, aux\)"):
        jaxamp.make_train_step(model, ce_loss, has_aux=True)(state, batch)


# ---- dropout: the state's RNG ----------------------------------------------------------------

class DropMLP(nn.Module):
    rate: float = 0.5

    @nn.compact
    def __call__(self, x, train: bool = True):
        h = nn.gelu(nn.Dense(32)(x))
        # nn.Dropout of ones is the (scaled) mask: returned so the test can see it
        mask = nn.Dropout(self.rate, deterministic=not train)(jnp.ones_like(h))
        return nn.Dense(4)(h * mask), mask


def drop_loss(apply_fn, params, batch, rng):
    logits, mask = apply_fn({"params": params}, batch["x"], rngs={"dropout": rng})
    return jaxamp.softmax_cross_entropy(logits, batch["y"]), {"kept": mask != 0}


def _drop_run(policy, n_steps, state=None, micro_batches=1):
    _, _, batch = _setup()
    model = DropMLP()
    params = model.init(jax.random.key(1), batch["x"], train=False)["params"]
    tx = optax.sgd(0.1)
    if state is None:
        state = jaxamp.TrainState.create(model, params, tx, policy=policy,
                                         rng=jax.random.key(42))
    step = jaxamp.make_train_step(model, drop_loss, has_aux=True, micro_batches=micro_batches)
    out = []
    for _ in range(n_steps):
        state, m = step(state, batch)
        out.append((float(m["loss"]), np.asarray(m["aux"]["kept"])))
    return state, out


def test_dropout_masks_match_f32_differ_per_step_and_resume_reproduces_them():
    _, f16 = _drop_run(F16, 3)
    _, f32 = _drop_run(F32, 3)
    for (l16, k16), (l32, k32) in zip(f16, f32):
        np.testing.assert_array_equal(k16, k32)  # same keys -> same masks in f16 and f32
        np.testing.assert_allclose(l16, l32, rtol=1e-2)
        assert 0.3 < k16.mean() < 0.7  # rate 0.5: dropout really ran
    assert not np.array_equal(f16[0][1], f16[1][1])  # a new mask every step
    assert not np.array_equal(f16[1][1], f16[2][1])
    # resume: the state round-trips through host memory (as a checkpoint does)
    state, first = _drop_run(F16, 1)
    restored = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)) if not jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key) else jax.random.wrap_key_data(
            np.asarray(jax.random.key_data(x))), state)
    _, rest = _drop_run(F16, 2, state=restored)
    for (l_a, k_a), (l_b, k_b) in zip(f16, first + rest):
        np.testing.assert_array_equal(k_a, k_b)
        assert l_a == l_b


def test_dropout_keys_differ_per_micro_batch():
    _, out = _drop_run(F32, 1, micro_batches=2)
    kept = out[0][1]  # [16, 32]: the two micro-batches' masks, back in batch order
    assert kept.shape == (16, 32)
    _, whole = _drop_run(F32, 1)
    assert not np.array_equal(kept[:8], kept[8:]) and not np.array_equal(kept, whole[0][1])


def test_loss_fn_needing_rng_without_state_rng_is_a_clear_error():
    model, params, batch = _setup()
    state = jaxamp.TrainState.create(DropMLP(), params, optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"takes an rng but the state has none.*rng=jax"):
        jaxamp.make_train_step(loss_fn=drop_loss, has_aux=True)(state, batch)


# ---- BatchNorm: mutable collections ---------------------------------------------------------

class BNNet(nn.Module):
    """A small CNN with BatchNorm."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(
            nn.Conv(8, (3, 3))(x)))
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(
            nn.Conv(8, (3, 3), strides=2)(x)))
        return nn.Dense(4)(jnp.mean(x, axis=(1, 2)))


def bn_loss(apply_fn, params, batch):  # written as for a stateless model
    return jaxamp.softmax_cross_entropy(apply_fn({"params": params}, batch["x"]), batch["y"])


def _bn_setup(n=16):
    x = jax.random.normal(jax.random.key(0), (n, 8, 8, 3))
    y = (jnp.mean(x[..., 0], axis=(1, 2)) > 0).astype(jnp.int32) + 2 * (
        jnp.mean(x[..., 1], axis=(1, 2)) > 0).astype(jnp.int32)
    model = BNNet()
    variables = model.init(jax.random.key(1), x, train=False)
    return model, variables, {"x": x, "y": y}


def test_batch_stats_update_in_f32_on_applied_steps_and_stay_bit_identical_on_skipped():
    model, variables, batch = _bn_setup()
    tx = optax.adam(1e-2)
    state = jaxamp.TrainState.create(model, variables, tx)  # float16, dynamic scaling
    assert set(state.collections) == {"batch_stats"}
    step = jaxamp.make_train_step(model, bn_loss, tx, clip_norm=1.0, donate=False)
    new, m = step(state, batch)
    assert not bool(m["skipped"])
    # reference: the float32 model's own BatchNorm update
    _, want = model.apply(variables, batch["x"], mutable=["batch_stats"])
    for got, ref, old in zip(jax.tree.leaves(new.collections["batch_stats"]),
                             jax.tree.leaves(want["batch_stats"]),
                             jax.tree.leaves(state.collections["batch_stats"])):
        assert got.dtype == jnp.float32
        assert not np.array_equal(got, old)
        np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-3)
    bad, m = step(new, {**batch, "x": batch["x"].at[3, 2, 2, 0].set(jnp.inf)})
    assert bool(m["skipped"])
    for a, b in zip(jax.tree.leaves(bad.collections), jax.tree.leaves(new.collections)):
        np.testing.assert_array_equal(a, b)
    assert _bits_equal(bad.collections, new.collections) and _bits_equal(bad.params, new.params)


def test_batchnorm_cnn_trains_with_micro_batches():
    model, variables, batch = _bn_setup(n=32)
    tx = optax.adam(3e-2)
    state = jaxamp.TrainState.create(model, variables, tx)
    step = jaxamp.make_train_step(model, bn_loss, tx, clip_norm=1.0, micro_batches=2)
    losses = []
    for _ in range(30):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert np.mean(losses[-3:]) < 0.6 * losses[0]
    # eval mode reads the running statistics the step kept
    logits = model.apply({"params": state.params, **state.collections}, batch["x"],
                         train=False)
    assert float(jnp.mean(jnp.argmax(logits, -1) == batch["y"])) > 0.6
    eval_step = jaxamp.make_eval_step(model, lambda f, p, b: bn_loss(
        lambda v, x: f(v, x, train=False), p, b))
    np.testing.assert_allclose(eval_step(state, batch), jaxamp.softmax_cross_entropy(
        logits, batch["y"]), rtol=1e-2)


# ---- auxiliary outputs -------------------------------------------------------------------

def aux_loss(apply_fn, params, batch):
    logits = apply_fn({"params": params}, batch["x"])
    per_example = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    correct = jnp.sum(jnp.argmax(logits, -1) == batch["y"])
    return jnp.mean(per_example), {"per_example": per_example, "correct": correct,
                                   "acc": correct / batch["y"].shape[0]}


def _aux_reference(model, params, batch):
    logits = model.apply({"params": params}, batch["x"])
    per_example = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    correct = jnp.sum(jnp.argmax(logits, -1) == batch["y"])
    return per_example, correct


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_aux_flows_to_metrics_under_micro_batches(micro_batches):
    model, params, batch = _setup()
    tx = optax.sgd(0.1)
    state = jaxamp.TrainState.create(model, params, tx, policy=F32)
    step = jaxamp.make_train_step(model, aux_loss, has_aux=True, micro_batches=micro_batches)
    _, m = step(state, batch)
    per_example, correct = _aux_reference(model, params, batch)
    aux = m["aux"]
    assert aux["per_example"].shape == (16,) and aux["per_example"].dtype == jnp.float32
    np.testing.assert_allclose(aux["per_example"], per_example, rtol=1e-5)  # batch order
    assert aux["correct"].dtype == jnp.int32 and int(aux["correct"]) == int(correct)
    np.testing.assert_allclose(aux["acc"], int(correct) / 16, rtol=1e-6)
    np.testing.assert_allclose(m["loss"], jnp.mean(per_example), rtol=1e-5)


_DP_AUX_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np, optax, json, sys
    sys.path.insert(0, sys.argv[1])
    from test_train import _setup, aux_loss, F32
    import jaxamp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    assert jax.device_count() == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    model, params, batch = _setup(n=16)
    tx = optax.sgd(0.5)  # plain SGD, no clip: a constant factor on the grads shows
    state = jaxamp.TrainState.create(model, params, tx, policy=F32)
    step = jaxamp.make_train_step(model, aux_loss, has_aux=True, micro_batches=2, mesh=mesh)
    sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
    ms = []
    for _ in range(2):
        state, m = step(state, sharded)
        ms.append(m)
    # the single-device float32 reference, by hand
    p, ref = params, []
    for _ in range(2):
        (loss, aux), g = jax.value_and_grad(lambda p: aux_loss(model.apply, p, batch),
                                            has_aux=True)(p)
        ref.append((loss, aux))
        p = jax.tree.map(lambda a, b: a - 0.5 * b, p, g)
    out = {
        "param_diff": max(float(jnp.max(jnp.abs(a - b))) for a, b in
                          zip(jax.tree.leaves(state.params), jax.tree.leaves(p))),
        "param_moved": max(float(jnp.max(jnp.abs(a - b))) for a, b in
                           zip(jax.tree.leaves(p), jax.tree.leaves(params))),
        "loss_diff": max(abs(float(m["loss"]) - float(r[0])) for m, r in zip(ms, ref)),
        "per_example_shape": list(ms[0]["aux"]["per_example"].shape),
        "per_example_diff": max(float(jnp.max(jnp.abs(m["aux"]["per_example"]
                                                      - r[1]["per_example"])))
                                for m, r in zip(ms, ref)),
        "correct": [[int(m["aux"]["correct"]), int(r[1]["correct"])] for m, r in zip(ms, ref)],
        "acc_diff": max(abs(float(m["aux"]["acc"]) - float(r[1]["acc"]))
                        for m, r in zip(ms, ref)),
    }
    print(json.dumps(out))
""")


def _run_8_devices(tmp_path, script_text):
    script = tmp_path / "dp.py"
    script.write_text(script_text)
    return multihost.json_from([sys.executable, str(script), os.path.dirname(__file__)],
                               timeout=300)


def test_data_parallel_aux_and_sgd_update_match_one_float32_device(tmp_path):
    out = _run_8_devices(tmp_path, _DP_AUX_SCRIPT)
    # plain SGD: grads summed once more across 8 devices would show as an 8x larger step
    assert out["param_moved"] > 1e-2 and out["param_diff"] < 1e-5, out
    assert out["loss_diff"] < 1e-5 and out["acc_diff"] < 1e-6
    assert out["per_example_shape"] == [16] and out["per_example_diff"] < 1e-5
    assert all(a == b for a, b in out["correct"])


# ---- issue 24 / 27: the fused skip, the scaled norm, an inf loss -------------------------------


class _Linear(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x @ self.param("w", lambda k: jnp.array([[0.5], [-1.0], [2.0]]))


def test_step_stablehlo_has_no_conditional_and_selects_the_update():
    model, params, batch = _setup()
    tx = optax.adamw(optax.cosine_decay_schedule(1e-2, 100))
    for micro in (1, 2):
        state = jaxamp.TrainState.create(model, params, tx, policy=F16)
        step = jaxamp.make_train_step(model, ce_loss, tx, clip_norm=1.0, micro_batches=micro)
        text = step.lower(state, batch).as_text()
        assert "stablehlo.case" not in text and "stablehlo.if" not in text, micro
        # params (4 leaves), adam mu/nu (8) and count: each a select of new vs old
        assert text.count("stablehlo.select") >= 13, micro


@pytest.mark.parametrize("micro_batches,has_aux", [(1, False), (2, True)])
def test_loss_is_traced_once(micro_batches, has_aux):
    model, params, batch = _setup()
    calls = []

    def loss_fn(apply_fn, p, b):
        calls.append(1)
        loss = ce_loss(apply_fn, p, b)
        return (loss, {"l": loss}) if has_aux else loss

    tx = optax.sgd(0.1)
    state = jaxamp.TrainState.create(model, params, tx, policy=F16)
    step = jaxamp.make_train_step(model, loss_fn, tx, micro_batches=micro_batches,
                                  has_aux=has_aux)
    step.lower(state, batch)
    assert len(calls) == 1


def test_finite_gradients_whose_norm_overflows_float32_are_applied_and_clipped():
    # loss = 1e20 * sum(x @ w): gradients ~1e21 per element, their float32 sum of squares
    # overflows (> 3.4e38) though every gradient is finite.
    model = _Linear()
    x = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    params = model.init(jax.random.key(0), x)["params"]

    def loss_fn(apply_fn, p, b):
        return 1e20 * jnp.sum(apply_fn({"params": p}, b["x"]))

    want_g = 1e20 * np.asarray(x, np.float64).sum(0)[:, None]
    w0 = np.asarray(params["w"], np.float64)
    for clip, lr in ((1.0, 0.1), (None, 1e-21)):
        state = jaxamp.TrainState.create(model, params, optax.sgd(lr), policy=F32)
        step = jaxamp.make_train_step(model, loss_fn, clip_norm=clip)
        state, m = step(state, {"x": x})
        norm = np.linalg.norm(want_g)
        assert bool(m["grads_finite"]) and not bool(m["skipped"]) and int(m["skip_reason"]) == 0
        np.testing.assert_allclose(float(m["grad_norm"]), norm, rtol=1e-6)
        g = want_g * (min(1.0, clip / norm) if clip else 1.0)
        got = np.asarray(state.params["w"])
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, w0 - lr * g, rtol=1e-6, atol=1e-6)
        if clip:
            np.testing.assert_allclose(np.linalg.norm(got - w0), lr * clip, rtol=1e-5)


def test_inf_loss_with_finite_gradients_is_a_skipped_step_with_its_reason():
    model, params, batch = _setup()
    tx = optax.adamw(optax.cosine_decay_schedule(1e-2, 100))

    def loss_fn(apply_fn, p, b):  # the inf term has zero gradient: grads stay finite
        return ce_loss(apply_fn, p, b) - jax.lax.stop_gradient(jnp.mean(jnp.log(b["z"])))

    state = jaxamp.TrainState.create(model, params, tx, policy=F16,
                                     loss_scale=jaxamp.DynamicLossScale(2.0**10))
    step = jaxamp.make_train_step(model, loss_fn)
    ok, bad = {**batch, "z": jnp.ones(16)}, {**batch, "z": jnp.zeros(16)}  # loss + inf
    state, m = step(state, ok)
    assert int(m["skip_reason"]) == 0 and bool(m["loss_finite"])
    before = _copy(state)
    state, m = step(state, bad)
    assert float(m["loss"]) == np.inf
    assert not bool(m["loss_finite"]) and bool(m["grads_finite"]) and bool(m["skipped"])
    assert int(m["skip_reason"]) == jaxamp.train.SKIP_NONFINITE_LOSS
    assert int(m["skipped_steps"]) == 1 and np.isfinite(float(m["grad_norm"]))
    assert _bits_equal(state.params, before.params)
    assert _bits_equal(state.opt_state.inner_state, before.opt_state.inner_state)  # count too
    assert float(state.loss_scale.loss_scale) == 2.0**10  # no back-off for a loss inf
    state, m = step(state, _poison(ok))  # inf input: gradients and loss, the scale backs off
    assert int(m["skip_reason"]) == (jaxamp.train.SKIP_NONFINITE_GRADS
                                     | jaxamp.train.SKIP_NONFINITE_LOSS) == 3
    assert float(state.loss_scale.loss_scale) == 2.0**9
    state, m = step(state, ok)
    assert int(m["skip_reason"]) == 0 and int(state.opt_state.inner_state[0].count) == 2



def test_the_loss_scale_and_the_count_live_once_in_opt_state():
    """Issue #41: ``opt_state`` is ``jaxamp.amp(tx)``'s state, the one copy of the loss scale and
    the skipped count; ``state.loss_scale``/``skipped_steps`` read it, ``replace`` writes it
    (on a subclass too), and ``apply_gradients`` is still flax's plain update."""
    model, params, batch = _setup()
    tx = optax.adam(1e-2)
    state = jaxamp.TrainState.create(model, params, tx, policy=F16,
                                     loss_scale=jaxamp.StaticLossScale(8.0))
    assert isinstance(state.opt_state, jaxamp.transform.AmpState)
    assert state.loss_scale is state.opt_state.loss_scale
    assert float(jaxamp.scale_loss(jnp.float32(2.0), state.opt_state)) == 16.0
    assert jax.tree.structure(state.opt_state.inner_state) == jax.tree.structure(
        tx.init(params))
    moved = state.replace(loss_scale=jaxamp.StaticLossScale(4.0), skipped_steps=jnp.int32(3))
    assert float(moved.opt_state.loss_scale.loss_scale) == 4.0
    assert int(moved.opt_state.skipped_steps) == 3 and float(state.loss_scale.loss_scale) == 8.0
    new, m = jaxamp.make_train_step(model, ce_loss, donate=False)(moved, batch)
    assert float(m["loss_scale"]) == 4.0 and int(new.skipped_steps) == 3 == int(m["skipped_steps"])

    class Sub(jaxamp.TrainState):
        extra: int = 0

    sub = Sub.create(model, params, tx, policy=F16, extra=1)
    assert int(sub.replace(skipped_steps=jnp.int32(5)).skipped_steps) == 5
    grads = jax.tree.map(jnp.ones_like, state.params)
    applied = state.apply_gradients(grads=grads)
    updates, inner = tx.update(grads, state.opt_state.inner_state, state.params)
    assert _bits_equal(applied.params, optax.apply_updates(state.params, updates))
    assert _bits_equal(applied.opt_state.inner_state, inner) and int(applied.step) == 1
    assert applied.loss_scale is state.loss_scale
