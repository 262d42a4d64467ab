"""Activation memory (GitHub issue #24): the residuals autocast's programs keep for the backward
pass, by dtype (:func:`saved_residuals`), with recompute segments on and off. Most
tests ask for segments everywhere (``ON``: ``recompute=True``); the default makes them in
``lax.scan`` bodies only (issue #40), which the last tests check."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from gpt import GPT, GPTConfig, init, lm_loss, make_batch  # noqa: E402

BF16 = "params=float32,compute=bfloat16,output=float32"
F16 = "params=float32,compute=float16,output=float32"
ON = jaxamp.DEFAULT_OP_RULES.extend(recompute=True)  # segments everywhere
OFF = jaxamp.DEFAULT_OP_RULES.extend(recompute=False)


def saved_residuals(loss, params, *args) -> dict[str, int]:
    """Bytes of the residuals ``jax.vjp(lambda p: loss(p, *args), params)`` keeps, by dtype
    name: the leaves of the pullback, read from the traced program (so a GPU keeps the same),
    inputs (params, the batch) excluded, each array counted once."""
    def residuals(p, *a):
        _, pullback = jax.vjp(lambda q: loss(q, *a), p)
        return jax.tree.leaves(pullback)

    jaxpr = jax.make_jaxpr(residuals)(params, *args).jaxpr
    inputs, seen = set(jaxpr.invars), set()
    out: collections.Counter = collections.Counter()
    for v in jaxpr.outvars:
        if not isinstance(v, jcore.Var) or v in inputs or v in seen:
            continue  # an input, a literal, or counted already
        seen.add(v)
        aval = v.aval
        if not hasattr(aval, "dtype") or jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key):
            continue
        out[np.dtype(aval.dtype).name] += int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize
    return dict(out)


def summary(by_dtype: dict[str, int]) -> tuple[int, float]:
    """(total bytes, float32 share)."""
    total = sum(by_dtype.values())
    return total, (by_dtype.get("float32", 0) / total if total else 0.0)


@pytest.fixture(scope="module")
def small_gpt():
    cfg = GPTConfig(layers=2, d_model=32, heads=2, seq=32, vocab=64)
    model = GPT(cfg)
    return (lambda p, b: lm_loss(model.apply, p, b)), init(model, cfg), make_batch(cfg, 4)


@pytest.mark.parametrize("policy", [BF16, F16])
def test_low_precision_keeps_a_third_of_float32s_residuals(small_gpt, policy):
    loss, params, batch = small_gpt
    f32, _ = summary(saved_residuals(jaxamp.autocast(loss, "float32", op_rules=OFF),
                                     params, batch))
    on, f32_share = summary(saved_residuals(jaxamp.autocast(loss, policy, op_rules=ON),
                                             params, batch))
    off, off_share = summary(saved_residuals(jaxamp.autocast(loss, policy, op_rules=OFF),
                                             params, batch))
    assert on / f32 <= 0.35 and f32_share <= 0.10, (on / f32, f32_share)
    # the switch keeps what JAX's autodiff saves primitive by primitive (float32 LayerNorm
    # products, softmax outputs, GELU intermediates)
    assert off / f32 > 0.6 and off_share > 0.3, (off / f32, off_share)


def test_recompute_changes_no_forward_value_and_gradients_only_by_rounding(small_gpt):
    loss, params, batch = small_gpt
    for policy, tol in (("float32", 1e-5), (BF16, None)):
        on = jax.jit(jax.value_and_grad(jaxamp.autocast(loss, policy, op_rules=ON)))(params, batch)
        off = jax.jit(jax.value_and_grad(jaxamp.autocast(loss, policy, op_rules=OFF)))(
            params, batch)
        np.testing.assert_allclose(on[0], off[0], rtol=1e-6)
        a, b = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(g[1])]) for g in (on, off))
        if tol is not None:
            np.testing.assert_allclose(a, b, rtol=tol, atol=tol * np.abs(b).max())
            r = b  # the float32 gradients
        else:  # as close to float32 as without recompute (bfloat16's rounding)
            cos = [float(x @ r / np.linalg.norm(x) / np.linalg.norm(r)) for x in (a, b)]
            assert cos[0] > 0.999 and abs(cos[0] - cos[1]) < 1e-4, cos
    # outside any transformation the segments run in place: the forward is bit for bit
    eager_on = jaxamp.autocast(loss, BF16, op_rules=ON)(params, batch)
    eager_off = jaxamp.autocast(loss, BF16, op_rules=OFF)(params, batch)
    assert float(eager_on) == float(eager_off)


def test_the_kept_softmax_max_is_of_the_logits_the_backward_recomputes():
    # Under jit XLA feeds the forward softmax the unrounded float32 value of the bfloat16
    # matmul output (excess precision), the backward recomputes from the rounded residual:
    # a kept max of the unrounded logits lies up to 128 below the recomputed ones at ~50000,
    # exp(g - max) overflows and the gradient is NaN. Recompute off keeps the softmax output.
    # The reference: the gradient evaluated op by op (no excess precision: bfloat16 logits).
    x = jax.random.normal(jax.random.key(0), (64, 64))
    w = 2500.0 * jax.random.normal(jax.random.key(1), (64, 64))  # logits ~ +-50000

    def loss(w, x):
        return jnp.sum(jax.nn.softmax(x @ w, axis=-1) * x)

    grad = jax.grad(jaxamp.autocast(loss, BF16, op_rules=ON))
    on, ref = jax.jit(grad)(w, x), grad(w, x)
    assert np.isfinite(ref).all() and np.isfinite(on).all(), int((~np.isfinite(on)).sum())
    np.testing.assert_array_equal(on, ref)  # CPU: bit for bit


#: The model of issue 46: an input Dense, then two ``x + Dense(gelu(Dense(LayerNorm(x))))``
#: blocks, in bfloat16; prints the sha256 of the logits, loss and gradients with recompute on
#: and off (jitted), for the XLA_FLAGS it runs under.
_MLP_BLOCKS = r'''
import hashlib, json
import flax.linen as nn, jax, numpy as np
import jaxamp

class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(64)(nn.gelu(nn.Dense(128)(nn.LayerNorm()(x))))

class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(64)(x)
        return nn.Dense(48)(Block()(Block()(x)))

model = Model()
x = jax.random.normal(jax.random.key(0), (8, 16, 32))
y = jax.random.randint(jax.random.key(1), (8, 16), 0, 48)
params = model.init(jax.random.key(2), x)["params"]

def loss(p):
    logits = model.apply({"params": p}, x)
    return jaxamp.softmax_cross_entropy(logits, y), logits

out = {}
for on in (True, False):
    rules = jaxamp.DEFAULT_OP_RULES.extend(recompute=on)
    f = jaxamp.autocast(loss, "params=float32,compute=bfloat16,output=float32", op_rules=rules)
    (value, logits), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(params)
    out["on" if on else "off"] = {
        name: hashlib.sha256(b"".join(np.asarray(a).tobytes() for a in jax.tree.leaves(t))
                             ).hexdigest()
        for name, t in (("loss", value), ("logits", logits), ("grads", grads))}
print(json.dumps(out))
'''


def _mlp_blocks(xla_flags: str) -> dict:
    import json
    import os
    import subprocess

    env = dict(os.environ, XLA_FLAGS=" ".join([os.environ.get("XLA_FLAGS", ""), xla_flags]))
    res = subprocess.run([sys.executable, "-c", _MLP_BLOCKS], capture_output=True, text=True,
                         timeout=300, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_recompute_differs_only_by_xlas_excess_precision_as_readme_says():
    """Issue 46: README said "the forward computes the same values in the same dtypes" with
    recompute; on this bfloat16 model recompute on vs off changed the logits by up to one
    bfloat16 step and the loss from 3.88164 to 3.88088. Why: the program is the same, but
    without recompute XLA's excess precision (``xla_allow_excess_precision``, on by default)
    hands a bfloat16 matmul output to the op it fuses it into unrounded, while a recompute
    segment reads its input rounded (``jaxamp._engine.recompute._rounded``). With excess precision
    off the two are bit-identical, forward and backward, and recompute's forward is the one
    it computes under either setting. README says exactly that."""
    strict = _mlp_blocks("--xla_allow_excess_precision=false")
    assert strict["on"] == strict["off"]  # logits, loss and gradients: bit for bit
    default = _mlp_blocks("")
    for value in ("logits", "loss"):  # recompute's forward rounds as the program says
        assert default["on"][value] == strict["on"][value], value
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "The forward computes the same values in the same dtypes" not in readme
    assert ("With `XLA_FLAGS=--xla_allow_excess_precision=false` recompute on and off give "
            "bit-identical results, forward and gradients, and recompute's forward is the same "
            "under either setting") in readme


def test_a_users_checkpoint_policy_wins_inside_its_scope():
    x = jnp.linspace(-2.0, 2.0, 4 * 64).reshape(4, 64)
    w = jnp.full((64, 64), 0.01)

    def block(w, x):
        h = jax.nn.gelu(x @ w)
        return jnp.sum(jax.nn.softmax(h * 3.0) ** 2)

    saving = jax.checkpoint(block, policy=jax.checkpoint_policies.everything_saveable)
    plain_on = summary(saved_residuals(jaxamp.autocast(block, BF16, op_rules=ON), w, x))[0]
    plain_off = summary(saved_residuals(jaxamp.autocast(block, BF16, op_rules=OFF), w, x))[0]
    assert plain_on < plain_off  # outside a checkpoint, the segment keeps less
    kept_on = saved_residuals(jaxamp.autocast(saving, BF16, op_rules=ON), w, x)
    kept_off = saved_residuals(jaxamp.autocast(saving, BF16, op_rules=OFF), w, x)
    assert kept_on == kept_off and summary(kept_on)[0] > plain_on


def test_recompute_switch_is_checked():
    assert jaxamp.DEFAULT_OP_RULES.recompute == "scan" and ON.recompute is True
    assert not OFF.recompute and OFF.extend(fp32={"tanh"}).recompute is False
    assert OFF.extend(recompute="scan").recompute == "scan"
    for bad in ("no", 1, "loops"):
        with pytest.raises(TypeError, match=r"recompute= must be one of \('scan', True, "
                                            r"False\), got " + repr(bad)):
            jaxamp.DEFAULT_OP_RULES.extend(recompute=bad)
    with pytest.raises(ValueError, match="recompute='always' is not one of"):
        jaxamp.OpRules(recompute="always")


def _checkpoints(jaxpr) -> int:
    from jaxamp._engine.jaxpr import iter_eqns

    return sum(e.primitive.name in ("remat", "remat2", "checkpoint") for e in iter_eqns(jaxpr))


def test_the_default_recomputes_in_scan_bodies_only(small_gpt):
    """Issue #40: straight-line code keeps what JAX keeps (the program of recompute=False,
    equation for equation), a ``lax.scan`` body (a scanned layer stack) gets the segments
    (the residuals of recompute=True, which there lower both the GPU program's kernel bytes
    and its temp memory: ``git show a1e47fe:BENCHMARKS.md``, "What each piece of recompute
    does to the GPU program")."""
    loss, params, batch = small_gpt
    for policy in (BF16, F16):
        def program(rules, f=loss, policy=policy):
            return str(jax.make_jaxpr(jax.grad(jaxamp.autocast(f, policy, op_rules=rules)))(
                params, batch))

        assert program(jaxamp.DEFAULT_OP_RULES) == program(OFF)
        assert _checkpoints(jax.make_jaxpr(jax.grad(jaxamp.autocast(loss, policy)))(
            params, batch)) == 0

    # the same blocks under lax.scan: the default keeps what recompute=True keeps
    w = {"w1": jax.random.normal(jax.random.key(0), (3, 32, 128)) / 6,
         "w2": jax.random.normal(jax.random.key(1), (3, 128, 32)) / 12,
         "g": jnp.ones((3, 32))}
    x = jax.random.normal(jax.random.key(2), (4, 16, 32))

    def block(h, p):
        n = (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + 1e-5)
        return h + jax.nn.gelu((n * p["g"]) @ p["w1"]) @ p["w2"], None

    def scanned(w, x):
        return jnp.sum(jax.lax.scan(block, x, w)[0] ** 2)

    def unrolled(w, x):
        for i in range(3):
            x = block(x, jax.tree.map(lambda a, i=i: a[i], w))[0]
        return jnp.sum(x ** 2)

    for policy in (BF16, F16):
        kept = {label: summary(saved_residuals(jaxamp.autocast(f, policy, op_rules=rules),
                                               w, x))[0]
                for label, f, rules in (("scan", scanned, jaxamp.DEFAULT_OP_RULES),
                                        ("scan on", scanned, ON), ("scan off", scanned, OFF),
                                        ("unrolled", unrolled, jaxamp.DEFAULT_OP_RULES),
                                        ("unrolled off", unrolled, OFF))}
        assert kept["scan"] == kept["scan on"] < kept["scan off"], kept
        assert kept["unrolled"] == kept["unrolled off"], kept
        # and the gradients are recompute=True's, bit for bit, and close to recompute off's
        g = {label: jax.jit(jax.grad(jaxamp.autocast(scanned, policy, op_rules=rules)))(w, x)
             for label, rules in (("default", jaxamp.DEFAULT_OP_RULES), ("on", ON),
                                  ("off", OFF))}
        for a, b, c in zip(*(jax.tree.leaves(g[k]) for k in ("default", "on", "off"))):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_allclose(a, c, rtol=0.05, atol=0.05 * float(np.abs(c).max()))


def test_the_diagnostics_read_the_program_with_recompute_off(small_gpt):
    from jaxamp.diagnostics._trace import trace_model

    loss, params, batch = small_gpt

    # recompute's rules put the segments (and the param casts) in checkpoints ...
    default = jax.make_jaxpr(jax.grad(jaxamp.autocast(loss, BF16, op_rules=ON)))(params, batch)
    assert _checkpoints(default) > 10
    # ... the audit's trace of the same function under the same rules has none; it keeps
    # the rules it was given (what it checks the program against)
    t = trace_model(loss, (params, batch), policy=BF16, overrides=None,
                    op_rules=ON, argnums=0)
    assert _checkpoints(t.jaxpr) == 0 and t.op_rules.recompute
    report = jaxamp.audit(loss, params, batch, policy=BF16)
    assert not [f for f in report.findings if "remat" in f.detail or "checkpoint" in f.detail]


def _residual_ratio(loss, params, batch):
    """(residual bytes under float16 / float32's with recompute off, float32 share)."""
    f32, _ = summary(saved_residuals(jaxamp.autocast(loss, "float32", op_rules=OFF),
                                     params, batch))
    on, share = summary(saved_residuals(jaxamp.autocast(loss, F16, op_rules=ON), params, batch))
    return on / f32, share


def test_a_residual_sum_is_kept_once_not_as_its_two_operands():
    # corpus T5: the residual stream x (its float32 embedding rows, at first) plus the
    # attention's output projection. A segment starting at that sum would keep both operands;
    # it starts after it and keeps the sum (0.407x of float32's residuals before, 0.366x now)
    sys.path.insert(0, str(ROOT / "tests"))
    from corpus_models import t5

    case = t5()
    ratio, share = _residual_ratio(lambda p, b: case.loss(case.model.apply, p, b),
                                   case.params, case.batch)
    assert ratio <= 0.37 and share <= 0.10, (ratio, share)


def test_a_tanh_before_a_matmul_keeps_its_output_and_not_its_input():
    # Dense(tanh(Dense(x))): tanh's derivative reads only its output, the array the second
    # matmul keeps. In the segment of the bias add, the checkpoint kept the first matmul's
    # output too; evaluated plainly, JAX keeps 1 - tanh beside tanh.
    params = {"w1": jax.random.normal(jax.random.key(0), (16, 64)) / 4,
              "b": jnp.linspace(-1, 1, 64), "w2": jax.random.normal(jax.random.key(1), (64, 4))}
    x = jax.random.normal(jax.random.key(2), (8, 16))

    def loss(p, x):
        return jnp.sum(jnp.tanh(x @ p["w1"] + p["b"]) @ p["w2"])

    tanh16 = 8 * 64 * 2  # (the low copies of x and w2 are made again in the backward)
    kept = saved_residuals(jaxamp.autocast(loss, F16, op_rules=ON), params, x)
    assert kept == {"float16": tanh16}
    # recompute off: tanh, 1 - tanh and the low copies of x and w2
    assert saved_residuals(jaxamp.autocast(loss, F16, op_rules=OFF), params, x) == {
        "float16": 2 * tanh16 + 8 * 16 * 2 + 64 * 4 * 2}
    # the same values: the gradients are those of recompute off
    for policy in ("float32", F16):
        on = jax.jit(jax.grad(jaxamp.autocast(loss, policy, op_rules=ON)))(params, x)
        off = jax.jit(jax.grad(jaxamp.autocast(loss, policy, op_rules=OFF)))(params, x)
        for a, b in zip(jax.tree.leaves(on), jax.tree.leaves(off)):
            np.testing.assert_array_equal(a, b)


def test_a_tanh_whose_output_the_matmul_casts_keeps_its_smaller_input():
    # The tanh runs in a float32 module (its float16 input cast up), the matmul after it in
    # float16: the matmul keeps its own float16 copy, so the tail keeps its input (float16),
    # not the float32 output it would have to keep beside that copy.
    import flax.linen as nn

    class Act(nn.Module):
        def __call__(self, h):
            return jnp.tanh(h)

    class Head(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(Act()(nn.Dense(64, use_bias=False)(x)))

    model, x = Head(), jax.random.normal(jax.random.key(2), (8, 16))
    params = model.init(jax.random.key(0), x)["params"]

    def loss(p, x):
        return jnp.sum(model.apply({"params": p}, x))

    kept = saved_residuals(jaxamp.autocast(loss, F16, overrides={Act: "float32"}, op_rules=ON),
                           params, x)
    assert kept == {"float16": 2 * 8 * 64 * 2}, kept  # tanh's input and the matmul's copy


@pytest.mark.parametrize("name", ["bert", "gpt2", "t5", "llama", "moe", "vit", "clip",
                                  "resnet", "unet", "scan_remat_vmap"])
def test_every_corpus_model_keeps_at_most_040_of_float32s_residuals(name):
    # git show a1e47fe:BENCHMARKS.md (bench/memory_engine.py); scan_remat_vmap, whose vmapped heads
    # are Dense(tanh(Dense)), read 0.449 before a trailing tanh kept its output (0.371)
    sys.path.insert(0, str(ROOT / "tests"))
    from corpus_models import CORPUS

    case = CORPUS[name]()
    ratio, _ = _residual_ratio(lambda p, b: case.loss(case.model.apply, p, b), case.params,
                               case.batch)
    assert ratio <= 0.40, ratio


def _barrier_arrays(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of every array through an ``optimization_barrier`` of the StableHLO."""
    import re

    out = []
    for line in text.splitlines():
        if "stablehlo.optimization_barrier" in line:
            for dims, dtype in re.findall(r"tensor<([\dx]*?)x?(f32|bf16|f16)>",
                                          line.split("->")[-1]):
                out.append((dtype, tuple(int(d) for d in dims.split("x") if d)))
    return out


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
@pytest.mark.parametrize("policy", [BF16, F16])
def test_no_float32_attention_weights_cross_a_barrier(name, policy):
    """A float32 softmax read by ``P @ V`` in the low dtype: the segment casts it down inside
    its checkpoint, so the cotangent entering the backward's ``prevent_cse`` barrier is the
    matmul's low-precision one. Cast outside, the cotangent was cast up to float32 before the
    barrier and XLA wrote it out in full: a float32 [B, H, T, T] array per layer, 0.87x the
    step's speed on an H200 (a1e47fe:bench/recompute_gpu.py). Barrier arrays read from StableHLO."""
    sys.path.insert(0, str(ROOT / "tests"))
    from corpus_models import CORPUS

    case = CORPUS[name]()
    loss = jaxamp.autocast(lambda p, b: case.loss(case.model.apply, p, b), policy,
                           op_rules=ON)
    text = jax.jit(jax.grad(loss)).lower(case.params, case.batch).as_text()
    arrays = _barrier_arrays(text)
    low = "bf16" if "bfloat16" in policy else "f16"
    # [B, H, T, T] with H > 1 (bert's [B, 1, T, T] padding bias is an input, kept as it is)
    weights = [s for d, s in arrays if len(s) == 4 and s[0] == 4 and s[1] > 1 and s[2] == s[3]]
    assert (low, weights[0]) in arrays  # the low-precision cotangents do cross
    f32 = [s for d, s in arrays if d == "f32" and s in weights]
    assert not f32, f32
