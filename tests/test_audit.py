"""jaxamp.audit / audit_step (GitHub issue #5, part 1): the precision audit of a tiny config of
the example GPT (examples/lm_model.py) reproduces the mixed-precision reference table, flags
exactly the offending rows of a deliberately wrong setup, and flags clip-before-unscale and a
model cast wholesale to float16. Tracing only: nothing is compiled."""

from __future__ import annotations

import io
import json
import sys
import warnings
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from rich.console import Console

import jaxamp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import lm_model  # noqa: E402

F16 = "params=float32,compute=float16,output=float32"
BF16 = "params=float32,compute=bfloat16,output=float32"
CFG = lm_model.GPTConfig(vocab_size=32, n_layer=2, n_head=2, d_model=16, block_size=8)
SEED_ROWS = ["Embedding lookup", "Q/K/V Linear", "Attention scores", "Softmax", "LayerNorm",
             "FFN Linear", "CrossEntropy loss", "Parameter update"]


@pytest.fixture(scope="module")
def gpt():
    # shapes only: the audit traces, it never compiles or runs
    model = lm_model.GPT(CFG)
    params = lm_model.abstract_params(CFG)
    ids = jax.ShapeDtypeStruct((2, CFG.block_size), jnp.int32)

    def loss(p, ids):
        return jaxamp.softmax_cross_entropy(model.apply({"params": p}, ids), ids)

    return model, params, ids, loss


def seed(report) -> dict[str, dict]:
    rows = report.reference_table()
    assert [r["row"] for r in rows] == SEED_ROWS
    return {r["row"]: r for r in rows}


@pytest.mark.parametrize("policy,low", [(F16, "float16"), (BF16, "bfloat16")])
def test_reference_table_reproduced_for_the_example_gpt(gpt, policy, low):
    _, params, ids, loss = gpt
    report = jaxamp.audit(loss, params, ids, policy=policy,
                          opt_state=jax.eval_shape(optax.adam(1e-3).init, params))
    assert report.findings == [], report.to_markdown()
    rows = seed(report)
    expected = {
        "Embedding lookup": (f"float32 -> {low}", low),
        "Q/K/V Linear": (low, low),
        "Attention scores": (low, low),
        "Softmax": ("float32", "float32"),
        "LayerNorm": ("float32", "float32"),
        "FFN Linear": (low, low),
        "CrossEntropy loss": ("float32", "float32"),
        "Parameter update": ("-", "float32"),
    }
    for name, (fwd, bwd) in expected.items():
        assert (rows[name]["forward"], rows[name]["backward"]) == (fwd, bwd), rows[name]
        assert rows[name]["ok"] is True, rows[name]
    # the mapping from module paths to seed rows
    assert rows["Embedding lookup"]["modules"] == ["embed"]
    assert rows["Q/K/V Linear"]["modules"] == ["blocks/attn/qkv"]
    assert rows["Attention scores"]["modules"] == ["blocks/attn"]
    assert rows["Softmax"]["modules"] == ["blocks/attn"]
    assert rows["LayerNorm"]["modules"] == ["blocks/ln1", "blocks/ln2", "ln_f"]
    assert rows["FFN Linear"]["modules"] == ["blocks/mlp/fc", "blocks/mlp/proj"]
    assert rows["CrossEntropy loss"]["modules"] == ["(top level)"]


def test_rows_extend_the_precision_table(gpt):
    _, params, ids, loss = gpt
    report = jaxamp.audit(loss, params, ids, policy=F16)
    table = jaxamp.precision_table(loss, params, ids, policy=F16)
    assert [{k: r[k] for k in ("module", "op", "forward", "backward")}
            for r in report.rows] == table
    by = {(r["module"], r["op"]): r for r in report.rows}
    assert by[("blocks/attn", "exp/log")]["category"] == "softmax"
    assert by[("blocks/ln1", "reduction")]["category"] == "normalisation"
    assert by[("blocks/mlp/fc", "matmul")]["category"] == "matmul"
    assert by[("(top level)", "exp/log")]["category"] == "loss"
    # every row names a module as overrides= writes its path (jaxamp.rules.module_path), also
    # for equations hoisted out of the nn.scan body (their name stack lost the root module)
    names = {"GPT", "embed", "blocks", "blocks/ln1", "blocks/ln2", "blocks/attn",
             "blocks/attn/qkv", "blocks/attn/proj", "blocks/mlp", "blocks/mlp/fc",
             "blocks/mlp/proj", "ln_f"}
    assert {r["module"].split(".")[0] for r in table} - {"(top level)", "(output)"} <= names
    assert {"blocks/ln1", "blocks/attn", "embed"} <= {r["module"] for r in table}
    data = json.loads(report.to_json())
    assert set(data) == {"policy", "rows", "findings", "matmuls", "reference_table",
                         "seed_rows"}
    assert data["reference_table"][3]["row"] == "Softmax"
    assert data["seed_rows"] == data["reference_table"]
    md = report.to_markdown()
    assert "| Softmax | float32 | float32 |" in md and "No findings." in md
    out = io.StringIO()
    report.print(Console(file=out, width=140))
    assert "Softmax" in out.getvalue() and "no findings" in out.getvalue()


def test_wrong_setup_flags_exactly_the_offending_rows(gpt):
    _, params, ids, loss = gpt
    rules = jaxamp.DEFAULT_OP_RULES.extend(promote={"exp", "log", "reduce_sum"})
    report = jaxamp.audit(loss, params, ids, policy=F16, overrides={nn.LayerNorm: "float16"},
                          op_rules=rules)
    rows = seed(report)
    bad = {name for name, r in rows.items() if r["ok"] is False}
    assert bad == {"Softmax", "LayerNorm", "CrossEntropy loss"}, rows
    for name in bad:
        assert "float16" in rows[name]["forward"], rows[name]
    assert {f.reference_row for f in report.findings} == bad
    by_kind: dict[str, set[str]] = {}
    for f in report.findings:
        by_kind.setdefault(f.kind, set()).add(f.module)
    assert by_kind == {
        "softmax_low_precision": {"blocks/attn"},
        "normalisation_low_precision": {"blocks/ln1", "blocks/ln2", "ln_f"},
        "loss_low_precision": {"(top level)"},
    }
    soft = next(f for f in report.findings if f.kind == "softmax_low_precision")
    assert "exp (forward, float16)" in soft.detail


def test_params_cast_wholesale_to_float16_are_flagged(gpt):
    _, params, ids, loss = gpt
    half = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float16), params)
    opt_state = jax.eval_shape(optax.adam(1e-3).init, half)  # float16 moments
    report = jaxamp.audit(loss, half, ids, policy="float16", opt_state=opt_state)
    kinds = report.kinds()
    assert {"params_low_precision", "opt_state_low_precision"} <= kinds
    rows = seed(report)
    assert rows["Parameter update"]["backward"] == "float16"
    assert rows["Parameter update"]["ok"] is False
    f = next(f for f in report.findings if f.kind == "params_low_precision")
    assert f.module == "(params)" and "float16" in f.detail


@jax.custom_vjp
def fused_matmul(a, b):
    return a @ b


fused_matmul.defvjp(lambda a, b: (a @ b, (a, b)), lambda r, g: (g @ r[1].T, r[0].T @ g))


class FusedHead(nn.Module):
    """A model with a hand-written custom_vjp matmul (run as traced, float32, when opted out)."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8, name="fc")(x)
        w = self.param("w", nn.initializers.lecun_normal(), (8, 4))
        return fused_matmul(h, w)


def test_float32_matmul_in_a_low_precision_region_is_flagged():
    model = FusedHead()
    x = jnp.ones((2, 8))
    params = model.init(jax.random.key(0), x)["params"]

    def fwd(p, x):
        return model.apply({"params": p}, x)

    # by default both rules of the custom_vjp run under the policy: nothing to flag
    assert "matmul_f32_in_low_precision_region" not in jaxamp.audit(
        fwd, params, x, policy=F16).kinds()
    # opted out, it runs as traced, and the audit sees what autocast did (same OpRules)
    as_traced = jaxamp.DEFAULT_OP_RULES.extend(custom_vjp_as_traced={"fused_matmul"})
    report = jaxamp.audit(fwd, params, x, policy=F16, op_rules=as_traced)
    (f,) = [f for f in report.findings if f.kind == "matmul_f32_in_low_precision_region"]
    assert f.module == "FusedHead" and "float16" in f.detail and "custom_vjp" in f.detail
    # the Dense child ran in float16 and is not flagged
    assert not any(f.module == "FusedHead/fc" for f in report.findings)
    # a module deliberately given a float32 rule is not flagged
    ok = jaxamp.audit(fwd, params, x, policy=F16, overrides={FusedHead: "float32"},
                      op_rules=as_traced)
    assert "matmul_f32_in_low_precision_region" not in ok.kinds()


# ---- audit_step: clip before unscale ---------------------------------------------------------


@pytest.fixture(scope="module")
def step_setup():
    model = nn.Dense(4)
    x = jnp.ones((2, 3))
    params = model.init(jax.random.key(0), x)["params"]
    amp = jaxamp.autocast(lambda p, x: jnp.mean(model.apply({"params": p}, x) ** 2), F16)
    return model, params, x, amp


def test_audit_step_flags_clipping_scaled_gradients(step_setup):
    _, params, x, amp = step_setup
    tx, clip = optax.adam(1e-3), optax.clip_by_global_norm(1.0)

    def clip_then_unscale(params, opt_state, x, ls):
        grads = jax.grad(lambda p: ls.scale(amp(p, x)))(params)
        grads, _ = clip.update(grads, clip.init(params))  # on scaled grads: wrong
        grads = ls.unscale(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def unscale_then_clip(params, opt_state, x, ls):
        grads = ls.unscale(jax.grad(lambda p: ls.scale(amp(p, x)))(params))
        grads, _ = clip.update(grads, clip.init(params))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def logs_scaled_norm(params, x):  # a python-float scale, the norm only logged
        grads = jax.grad(lambda p: amp(p, x) * 1024.0)(params)
        norm = optax.tree.norm(grads)
        return jax.tree.map(lambda g: g / 1024.0, grads), norm

    def skips_on_a_scaled_norm(params, x):  # a finite check reads the scaled norm: fine
        grads = jax.grad(lambda p: amp(p, x) * 1024.0)(params)
        ok = jnp.isfinite(optax.tree.norm(grads))
        return jax.tree.map(lambda g: jnp.where(ok, g / 1024.0, 0.0), grads)

    def skips_on_and_logs_a_scaled_norm(params, x):  # the logged norm is off by the scale
        grads = jax.grad(lambda p: amp(p, x) * 1024.0)(params)
        norm = optax.tree.norm(grads)
        return jax.tree.map(lambda g: jnp.where(jnp.isfinite(norm), g / 1024.0, 0.0),
                            grads), norm

    ls, opt_state = jaxamp.DynamicLossScale(), tx.init(params)
    assert jaxamp.audit_step(skips_on_a_scaled_norm, params, x).findings == []
    assert [f.kind for f in jaxamp.audit_step(skips_on_and_logs_a_scaled_norm, params,
                                              x).findings] == ["grad_norm_of_scaled_grads"]
    bad = jaxamp.audit_step(clip_then_unscale, params, opt_state, x, ls)
    assert [f.kind for f in bad.findings] == ["clip_before_unscale"]
    assert "unscale first" in bad.findings[0].detail.lower()
    assert jaxamp.audit_step(unscale_then_clip, params, opt_state, x, ls).findings == []
    assert [f.kind for f in jaxamp.audit_step(logs_scaled_norm, params, x).findings] == [
        "grad_norm_of_scaled_grads"]


@pytest.mark.parametrize("clip_norm", [None, 1.0])
def test_audit_step_passes_jaxamps_own_step(step_setup, clip_norm):
    model, params, x, _ = step_setup
    tx = optax.adam(1e-3)
    state = jaxamp.TrainState.create(model, params, tx, loss_scale=jaxamp.DynamicLossScale())
    step = jaxamp.make_train_step(model, lambda apply, p, b: jnp.mean(apply({"params": p},
                                                                            b["x"]) ** 2),
                                  tx, policy=F16, clip_norm=clip_norm)
    report = jaxamp.audit_step(step, state, {"x": x}, params=state.params,
                               opt_state=state.opt_state)
    assert report.findings == []
    assert report.reference_table() == []
    assert any(r["op"] == "matmul" and r["forward"] == "float16" for r in report.rows)


def test_audit_step_reads_a_micro_batched_step(step_setup):
    """Micro-batches put the backward inside a scan: audit_step follows it there (jax 0.12
    scan equations carry ft_in/ft_out, not num_consts/num_carry)."""
    model, params, x, _ = step_setup
    tx = optax.adam(1e-3)
    state = jaxamp.TrainState.create(model, params, tx, loss_scale=jaxamp.DynamicLossScale())
    step = jaxamp.make_train_step(model, lambda apply, p, b: jnp.mean(apply({"params": p},
                                                                            b["x"]) ** 2),
                                  tx, policy=F16, clip_norm=1.0, micro_batches=2)
    report = jaxamp.audit_step(step, state, {"x": jnp.ones((4, 3))}, params=state.params,
                               opt_state=state.opt_state)
    assert report.findings == []
    assert any(r["op"] == "matmul" and r["forward"] == "float16" for r in report.rows)


def test_audit_step_flags_clipping_scaled_micro_batch_gradients(step_setup):
    _, params, x, amp = step_setup
    tx, clip = optax.adam(1e-3), optax.clip_by_global_norm(1.0)

    def accumulate_clip_unscale(params, opt_state, x, ls):
        def body(acc, xb):
            g = jax.grad(lambda p: ls.scale(amp(p, xb)))(params)
            return jax.tree.map(jnp.add, acc, g), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, _ = jax.lax.scan(body, zeros, x.reshape(2, -1, x.shape[-1]))
        grads, _ = clip.update(grads, clip.init(params))  # on scaled grads: wrong
        updates, opt_state = tx.update(ls.unscale(grads), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    ls, opt_state = jaxamp.DynamicLossScale(), tx.init(params)
    report = jaxamp.audit_step(accumulate_clip_unscale, params, opt_state, jnp.ones((4, 3)), ls)
    assert [f.kind for f in report.findings] == ["clip_before_unscale"]


def test_float64_matmuls_in_a_low_precision_region_are_a_finding():
    """Issue 46: under x64 a float64 batch made the matmuls float64 and the audit reported
    nothing: a policy that changes nothing is a finding, naming the input and the cast."""
    import numpy as np

    model = nn.Sequential([nn.Dense(8), nn.gelu, nn.Dense(4)])

    def loss(params, batch):
        return jnp.mean(model.apply({"params": params}, batch["x"]) ** 2)

    with jax.enable_x64(True):
        batch = {"x": np.ones((4, 3))}
        params = model.init(jax.random.key(0), batch["x"].astype(np.float32))["params"]
        with pytest.warns(UserWarning, match="matmuls ran in float64"):
            report = jaxamp.audit(loss, params, batch, policy=F16)
        assert [(f.kind, f.module) for f in report.findings] == [
            ("matmul_f64_in_low_precision_region", "layers_0"),
            ("matmul_f64_in_low_precision_region", "layers_2")]
        assert report.findings[0].detail == (
            "matmul(s) ran in float64 although this module's policy computes in float16: "
            "dot_general (backward, float64), dot_general (forward, float64). With "
            "jax_enable_x64 on, float64 values are left alone, and the float64 input "
            "batch['x'] (float64[4,3]) made them float64, so the policy changes nothing there. "
            "Cast it to float32 before the call (np.asarray(x, np.float32) where the batch is "
            "made).")
        report = jaxamp.audit(loss, params, {"x": batch["x"].astype(np.float32)}, policy=F16)
        assert report.findings == []


# ---- models from outside Flax's own layers (GitHub issue #42) --------------------------------


class Proj(nnx.Module):
    """tunix's ``Einsum``: a projection whose ``__call__`` runs under ``jax.named_scope``."""

    def __init__(self, shape, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), shape) * 0.3)

    @jax.named_scope("einsum")
    def __call__(self, x):
        return x @ self.w


class ScopedAttention(nnx.Module):
    def __init__(self, d, rngs):
        self.q_proj, self.k_proj = Proj((d, d), rngs), Proj((d, d), rngs)
        self.v_proj, self.o_proj = Proj((d, d), rngs), Proj((d, d), rngs)

    @jax.named_scope("attention")
    def __call__(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        w = jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) / 4.0, axis=-1)
        return self.o_proj(w @ v)


class ScopedLM(nnx.Module):
    def __init__(self, rngs, d=16, vocab=32):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.attn = ScopedAttention(d, rngs)
        self.norm = nnx.RMSNorm(d, rngs=rngs)
        self.head = Proj((d, vocab), rngs)

    def __call__(self, ids):
        x = self.embed(ids)
        with jax.named_scope("residual"):
            x = x + self.attn(x)
        return self.head(self.norm(x))


def _scoped_loss(model, ids):
    with jax.named_scope("loss"):  # a scope outside every module: top level
        return jaxamp.softmax_cross_entropy(model(ids), ids)


def _scoped_step(policy=F16, overrides=None):
    model = ScopedLM(nnx.Rngs(0))
    ids = jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % 32
    state = jaxamp.TrainState.create(model, tx=optax.adam(1e-3), policy=policy)
    step = jaxamp.make_train_step(loss_fn=_scoped_loss, overrides=overrides)
    return step, state, ids


def test_report_paths_are_module_structure_not_name_scopes():
    """User ``jax.named_scope``s (tunix wraps every ``__call__`` in one) stay out of report
    paths, and every printed path, with or without the root class, is a valid override."""
    step, state, ids = _scoped_step()
    rows = jaxamp.precision_table(step, state, ids)
    assert ("(top level)", "exp/log") in {(r["module"], r["op"]) for r in rows}  # the loss
    paths = {r["module"] for r in rows} - {"(top level)", "(output)"}
    assert paths == {"ScopedLM", "embed", "attn", "attn/q_proj", "attn/k_proj", "attn/v_proj",
                     "attn/o_proj", "norm", "head"}, paths
    matmuls = {r["module"]: (r["forward"], r["backward"]) for r in rows if r["op"] == "matmul"}
    assert matmuls["attn/q_proj"] == ("float16", "float16")  # not lumped into attn
    for keys in (paths, {p if p == "ScopedLM" else f"ScopedLM/{p}" for p in paths}):
        over, state, ids = _scoped_step(overrides={p: "float32" for p in keys})
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            jaxamp.precision_table(over, state, ids)
    over, state, ids = _scoped_step(overrides={"ScopedLM/attn/v_proj": "float32"})
    rows = jaxamp.precision_table(over, state, ids)
    matmuls = {r["module"]: r["forward"] for r in rows if r["op"] == "matmul"}
    assert matmuls.pop("attn/v_proj") == "float32" and set(matmuls.values()) == {"float16"}


def test_the_reference_table_never_contradicts_a_clean_audit():
    """tunix's layout: Q/K/V projections are modules under a named scope. Their backward
    matmuls belong to the Q/K/V row (float16 both ways), not to the attention scores."""
    step, state, ids = _scoped_step()
    report = jaxamp.audit(step, state, ids)
    assert report.findings == [], report.to_markdown()
    rows = {r["row"]: r for r in report.reference_table()}
    assert (rows["Q/K/V Linear"]["forward"], rows["Q/K/V Linear"]["backward"]) == (
        "float16", "float16")
    assert rows["Q/K/V Linear"]["modules"] == ["attn/k_proj", "attn/q_proj", "attn/v_proj"]
    assert all(r["ok"] for r in rows.values()), rows


def _gqa_params():
    k = jax.random.split(jax.random.key(0), 4)
    return {"wq": jax.random.normal(k[0], (16, 4, 8)) * 0.3,
            "wkv": jax.random.normal(k[1], (2, 16, 2, 8)) * 0.3,
            "wo": jax.random.normal(k[2], (4, 8, 16)) * 0.3,
            "head": jax.random.normal(k[3], (16, 32)) * 0.3}


def _gqa_loss(p, batch):
    """Plain JAX (no Flax module: everything is top level), grouped-query attention written
    with ``jnp.repeat`` (eqx-zoo's), RoPE-style positions cast twice from one integer array."""
    x = jax.nn.one_hot(batch["inputs"], 16)
    pos = jnp.arange(x.shape[1])
    q = jnp.einsum("btd,dhk->bthk", x, p["wq"]) * jnp.cos(pos.astype(jnp.float32))[:, None, None]
    kv = jnp.einsum("btd,cdhk->cbthk", x, p["wkv"])
    k = jnp.repeat(kv[0] * jnp.sin(pos.astype(jnp.float32))[:, None, None], 2, axis=2)
    v = jnp.repeat(kv[1], 2, axis=2)
    w = jax.nn.softmax(jnp.einsum("bthk,bshk->bhts", q, k), axis=-1)
    h = jnp.einsum("bhts,bshk,hkd->btd", w, v, p["wo"])
    return jaxamp.softmax_cross_entropy(h @ p["head"], batch["targets"])


@pytest.mark.parametrize("policy", [F16, BF16])
def test_backward_sums_of_a_model_without_modules_are_not_the_loss(policy):
    """The backward of ``jnp.repeat`` sums cotangents in their (low) dtype: JAX's transpose of
    a broadcast, as in every module; not "the loss", which already is float32. Two integer ->
    float32 casts of one array (user code, as traced) are not autocast's duplicate casts."""
    ids = jnp.arange(24, dtype=jnp.int32).reshape(2, 12) % 16
    batch = {"inputs": ids, "targets": ids}
    report = jaxamp.audit(_gqa_loss, _gqa_params(), batch, policy=policy)
    assert report.findings == [], report.to_markdown()
    rows = {r["row"]: r for r in report.reference_table()}
    assert rows["CrossEntropy loss"]["ok"] and rows["CrossEntropy loss"]["forward"] == "float32"
    # the same loss computed in low precision is still the loss
    rules = jaxamp.DEFAULT_OP_RULES.extend(promote={"exp", "log", "reduce_sum"})
    bad = jaxamp.audit(_gqa_loss, _gqa_params(), batch, policy=policy, op_rules=rules)
    assert "loss_low_precision" in bad.kinds(), bad.to_markdown()
