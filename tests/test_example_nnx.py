"""The example's ``--api nnx``: the GPT written in NNX (examples/lm_model_nnx.py) trains like
the linen one, with the same params and checkpoints (kept apart from tests/test_example.py)."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import lm_model  # noqa: E402
import lm_model_nnx  # noqa: E402
import train_lm  # noqa: E402

import jaxamp  # noqa: E402


def test_nnx_model_has_no_dtype_code():
    tree = ast.parse((EXAMPLES / "lm_model_nnx.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword):
            assert node.arg not in ("dtype", "param_dtype", "precision"), ast.dump(node)
        if isinstance(node, ast.Attribute):
            assert node.attr not in ("astype", "float16", "bfloat16", "float32"), node.attr


@pytest.mark.parametrize("attention", ["fused", "manual"])
def test_nnx_model_is_the_linen_model_on_the_same_params(attention):
    config = lm_model.GPTConfig(n_layer=2, n_head=2, d_model=32, block_size=16, tied=False,
                                attention=attention)
    _, params = lm_model.init_params(config)
    model, nnx_params = lm_model_nnx.init_params(config)
    assert jax.tree.map(jnp.shape, nnx_params) == jax.tree.map(jnp.shape, params)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 16)), jnp.int32)
    ref = lm_model.GPT(config).apply({"params": params}, ids)
    np.testing.assert_allclose(model.apply({"params": params}, ids), ref, rtol=1e-5,
                               atol=1e-5)
    policy = "params=float32,compute=float16,output=float32"
    got = jax.jit(jaxamp.autocast(model.apply, policy))({"params": params}, ids)
    want = jax.jit(jaxamp.autocast(lm_model.GPT(config).apply, policy))({"params": params}, ids)
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)  # same f16 program, up to
    assert float(jnp.max(jnp.abs(got - ref))) < 5e-2  # rounding; close to float32


def _run(out: Path, api: str) -> dict:
    argv = ["--api", api, "--preset", "tiny", "--steps", "40", "--batch-size", "8",
            "--lr", "3e-3", "--warmup", "10", "--eval-interval", "20", "--eval-batches", "4",
            "--checkpoint-interval", "40", "--no-compare-f32", "--out", str(out)]
    assert train_lm.main(argv) == 0
    return json.loads((out / "summary.json").read_text())


def test_api_nnx_trains_the_tiny_preset_like_linen(tmp_path):
    linen, nnx = _run(tmp_path / "linen", "linen"), _run(tmp_path / "nnx", "nnx")
    assert nnx["initial_val_loss"] - nnx["final_val_loss"] > 1.0  # it learned
    assert abs(nnx["final_val_loss"] - linen["final_val_loss"]) <= 0.02 * linen[
        "final_val_loss"]
    # the same checkpoint layout: the linen run's checkpoint resumes under --api nnx
    argv = ["--api", "nnx", "--preset", "tiny", "--steps", "42", "--batch-size", "8",
            "--lr", "3e-3", "--warmup", "10", "--eval-interval", "20", "--eval-batches", "4",
            "--checkpoint-interval", "40", "--no-compare-f32", "--out", str(tmp_path / "linen"),
            "--resume"]
    assert train_lm.main(argv) == 0
