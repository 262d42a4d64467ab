"""The example GPT's attention option (issue 40): ``GPTConfig.attention="fused"`` (the default,
``jax.nn.dot_product_attention``) and ``"manual"`` (written out) under autocast.

* Traced for the CPU, both run XLA's attention: the seed's reference table and the precision
  table are the same for both (matmuls in the compute dtype, softmax in float32).
* Traced for an H200 (``jax.default_device``, as ``jaxamp.gpu_program`` and a step on a GPU
  trace it; needs JAX's CUDA plugin, ``gpu_compile``), "fused" becomes cuDNN's fused
  attention: the reference table reads its Attention scores and Softmax rows from that one
  equation each way, and the compiled program holds ``__cudnn$fmha`` forward and backward
  calls with operands in the compute dtype; "manual" holds none.

Tiny shapes: cuDNN's flash attention wants a head size that is a multiple of 8.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxamp
from jaxamp.diagnostics import gpu as gpu_mod

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
import lm_model  # noqa: E402
import train_lm  # noqa: E402

BF16 = "params=float32,compute=bfloat16,output=float32"
F16 = "params=float32,compute=float16,output=float32"
LOW = {BF16: "bfloat16", F16: "float16"}
SHORT = {"bfloat16": "bf16", "float16": "f16"}
SEED_ROWS = ["Embedding lookup", "Q/K/V Linear", "Attention scores", "Softmax", "LayerNorm",
             "FFN Linear", "CrossEntropy loss", "Parameter update"]
PLUGIN = gpu_mod._plugin_installed()


def gpu_compile(test):
    """Marked ``gpu_compile``; skips where JAX's CUDA plugin is not installed."""
    return pytest.mark.gpu_compile(pytest.mark.skipif(
        not PLUGIN, reason="JAX's CUDA plugin is not installed (pip install -e "
                           "'.[gpu-compile]')")(test))


def _h200():
    return jax.default_device(gpu_mod.gpu_target("h200").compile_device())


def example_step(policy: str, attention: str, *, n_layer: int = 2):
    """The example's train step (``train_lm.loss_fn``, AdamW, clip 1.0) of a tiny config:
    ``(step, state, batch)``, the state as shapes only (nothing is initialised)."""
    cfg = lm_model.GPTConfig(n_layer=n_layer, n_head=2, d_model=64, block_size=128,
                             attention=attention)
    model = lm_model.GPT(cfg)
    tx = optax.adamw(1e-3)
    state = jax.eval_shape(lambda p: jaxamp.TrainState.create(model, p, tx, policy=policy),
                           lm_model.abstract_params(cfg))
    step = jaxamp.make_train_step(model, train_lm.loss_fn, tx, clip_norm=1.0)
    ids = jnp.zeros((2, cfg.block_size), jnp.int32)
    return step, state, {"inputs": ids, "targets": ids}


def seed_rows(report) -> dict[str, dict]:
    rows = report.reference_table()
    assert [r["row"] for r in rows] == SEED_ROWS, report.to_markdown()
    return {r["row"]: r for r in rows}


def check_reference_table(report, low: str) -> None:
    """The seed's table, as README's "The example" section shows it, for either option."""
    assert report.findings == [], report.to_markdown()
    rows = seed_rows(report)
    expected = {
        "Embedding lookup": (f"float32 -> {low}", low), "Q/K/V Linear": (low, low),
        "Attention scores": (low, low), "Softmax": ("float32", "float32"),
        "LayerNorm": ("float32", "float32"), "FFN Linear": (low, low),
        "CrossEntropy loss": ("float32", "float32"), "Parameter update": ("-", "float32")}
    for name, (fwd, bwd) in expected.items():
        assert (rows[name]["forward"], rows[name]["backward"]) == (fwd, bwd), rows[name]
        assert rows[name]["ok"] is True, rows[name]
    assert rows["Attention scores"]["modules"] == rows["Softmax"]["modules"] == ["blocks/attn"]


@pytest.mark.parametrize("attention", ["fused", "manual"])
@pytest.mark.parametrize("policy", [BF16, F16])
def test_reference_table_on_the_cpu(policy, attention):
    step, state, batch = example_step(policy, attention)
    report = jaxamp.audit(step, state, batch)
    check_reference_table(report, LOW[policy])
    ops = {(r["module"], r["op"]) for r in report.rows}
    assert {("blocks/attn", "matmul"), ("blocks/attn", "exp/log")} <= ops  # XLA's attention
    assert ("blocks/attn", "attention") not in ops


@gpu_compile
@pytest.mark.parametrize("attention", ["fused", "manual"])
def test_reference_table_traced_for_the_gpu(attention):
    """Traced for the H200, "fused" is one cuDNN equation each way (op ``attention``): its
    query/key/value, output and gradients in the compute dtype, its softmax statistics in
    float32, which the reference table reads as the Attention scores and Softmax rows."""
    step, state, batch = example_step(BF16, attention)
    with _h200():
        report = jaxamp.audit(step, state, batch)
        table = jaxamp.precision_table(step, state, batch)
    check_reference_table(report, "bfloat16")
    by = {(r["module"], r["op"]): r for r in table}
    if attention == "fused":
        row = by[("blocks/attn", "attention")]
        assert (row["forward"], row["backward"]) == ("bfloat16,float32", "bfloat16,float32")
        assert ("blocks/attn", "matmul") not in by and ("blocks/attn", "exp/log") not in by
    else:
        assert ("blocks/attn", "attention") not in by
        assert by[("blocks/attn", "matmul")]["forward"] == "bfloat16"
        assert by[("blocks/attn", "exp/log")]["forward"] == "float32"


@gpu_compile
@pytest.mark.parametrize("policy", [BF16, F16])
def test_fused_attention_compiles_to_cudnn_forward_and_backward(policy):
    """The example (``nn.scan`` over the blocks) compiled for the H200: one cuDNN fused
    attention call forward and one backward per layer, operands in the compute dtype; with
    "manual" there is none, and its attention matmuls are GEMMs instead."""
    low = SHORT[LOW[policy]]
    reports = {}
    for attention in ("fused", "manual"):
        step, state, batch = example_step(policy, attention)
        reports[attention] = jaxamp.gpu_program(step, state, batch, target="h200")
    fused = reports["fused"].attention
    # the scanned layers: each call sits in a loop of n_layer trips
    assert Counter(k.target for k in fused) == {"__cudnn$fmhaSoftmax": 1,
                                                 "__cudnn$fmhaSoftmaxBackward": 1}
    assert all(k.times == 2 for k in fused)
    assert all(k.dtypes and set(k.dtypes) == {low} for k in fused), [k.dtypes for k in fused]
    assert reports["manual"].attention == []
    gemms = {name: sum(k.times for k in r.kernels if k.kind == "gemm")
             for name, r in reports.items()}
    # per layer: Q K^T and P V forward, four more matmuls backward
    assert gemms["manual"] - gemms["fused"] == 2 * 6
    assert set(reports["fused"].gemm_libraries()) == {f"cublaslt {low} x {low}",
                                                      f"cudnn {low} x {low}"}
    assert set(reports["manual"].gemm_libraries()) == {f"cublaslt {low} x {low}"}


def test_on_the_cpu_the_option_changes_no_precision_table():
    """Traced for the CPU, ``jax.nn.dot_product_attention`` takes XLA's path, which autocast
    re-binds like any other code: the precision table is the written-out attention's."""
    tables = {a: jaxamp.precision_table(*example_step(BF16, a, n_layer=1))
              for a in ("fused", "manual")}
    assert tables["fused"] == tables["manual"]
