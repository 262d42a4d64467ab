"""jaxamp.locate_overflow (GitHub issue #5, part 2): one forward and backward under a float16
policy names the layer planted to overflow (and no other), and reports the fraction of true
gradients that float16 flushes to zero without and with the loss scale."""

from __future__ import annotations

import io
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from rich.console import Console

import jaxamp

F16 = "params=float32,compute=float16,output=float32"


class Net(nn.Module):
    """Unmodified MLP: Dense -> Dense -> Dense -> LayerNorm -> head."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32, name="fc1")(x))
        x = nn.relu(nn.Dense(32, name="fc2")(x))
        x = nn.relu(nn.Dense(32, name="fc3")(x))
        x = nn.LayerNorm(name="ln")(x)
        return nn.Dense(4, name="head")(x)


@pytest.fixture(scope="module")
def net():
    model = Net()
    x = jax.random.normal(jax.random.key(1), (8, 16))
    y = jax.random.normal(jax.random.key(2), (8, 4))
    variables = jax.jit(model.init)(jax.random.key(0), x)
    return model, variables, x, y


def plant(variables, module: str, factor: float):
    """The variables with ``module``'s kernel multiplied by ``factor``."""
    def f(path, leaf):
        keys = jax.tree_util.keystr(path)
        return leaf * factor if f"'{module}'" in keys and "kernel" in keys else leaf
    return jax.tree_util.tree_map_with_path(f, variables)


def test_names_the_planted_overflowing_layer_and_no_other(net):
    model, variables, x, y = net
    mse = lambda out: jnp.mean((out - y) ** 2)  # noqa: E731

    healthy = jaxamp.locate_overflow(model.apply, variables, x, policy=F16, loss_fn=mse,
                                     loss_scale=128.0)
    assert healthy.first_nonfinite is None and healthy.overflowing == []
    assert {r["status"] for r in healthy.rows} <= {"ok", "underflow"}, healthy.to_markdown()
    assert healthy.row("fc2")["forward_dtypes"].startswith("float16")

    # fc2's weights x1e5: its float16 matmul output exceeds 65504
    report = jaxamp.locate_overflow(model, plant(variables, "fc2", 1e5), x, policy=F16,
                                    loss_fn=mse, loss_scale=128.0)
    assert report.first_nonfinite == {"module": "fc2", "pass": "forward",
                                      "primitive": "dot_general", "dtype": "float16"}
    assert report.overflowing == ["fc2"]
    assert report.row("fc2")["status"] == "overflow"
    assert report.row("fc2")["forward_nonfinite"] > 0
    # fc1 ran before the overflow: its activations are finite
    assert report.row("fc1")["forward_nonfinite"] == 0
    assert report.row("fc1")["forward_max_abs"] < jaxamp.diagnostics.overflow.F16_MAX
    assert [r["module"] for r in report.rows if r["status"] == "overflow"] == ["fc2"]
    assert "fc2" in report.summary()

    data = json.loads(report.to_json())
    assert data["first_nonfinite"]["module"] == "fc2"
    assert {r["module"] for r in data["rows"]} >= {"fc1", "fc2", "ln", "head"}
    out = io.StringIO()
    report.print(Console(file=out, width=160))
    assert "overflow" in out.getvalue() and "fc2" in out.getvalue()
    assert "| fc2 | overflow |" in report.to_markdown()


def test_underflow_fractions_with_and_without_the_loss_scale(net):
    model, variables, x, y = net
    # a loss so small that the true float32 gradients are ~1e-8: below float16's 2**-24
    tiny = lambda out: 1e-8 * jnp.mean((out - y) ** 2)  # noqa: E731
    report = jaxamp.locate_overflow(model.apply, variables, x, policy=F16, loss_fn=tiny,
                                    loss_scale=2.0**15)
    params_u, acts_u = report.underflow["param_grads"], report.underflow["activation_grads"]
    assert params_u["count"] > 0 and acts_u["count"] > 0
    assert params_u["unscaled"] > 0.9 and acts_u["unscaled"] > 0.9
    assert params_u["scaled"] < 0.02 and acts_u["scaled"] < 0.02
    assert report.first_nonfinite is None
    fc1 = report.row("fc1")
    assert fc1["underflow_unscaled"] > 0.9 and fc1["underflow_scaled"] < 0.05
    assert 0 < fc1["true_grad_max_abs"] < 1e-6
    # the loss scale's effect is visible in the backward values the policy computed
    assert fc1["param_grad_max_abs"] == pytest.approx(fc1["true_grad_max_abs"] * 2.0**15,
                                                      rel=0.05)
    assert "flushed to zero" in report.summary()


def test_locates_an_overflow_inside_the_scanned_blocks_of_the_example_gpt():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import lm_model

    cfg = lm_model.GPTConfig(vocab_size=32, n_layer=1, n_head=2, d_model=16, block_size=8)
    model, params = lm_model.init_params(cfg)
    ids = jax.random.randint(jax.random.key(3), (2, cfg.block_size), 0, cfg.vocab_size)
    # the MLP's first Dense of the (nn.scan-stacked) blocks, scaled far beyond float16
    params = plant(params, "fc", 1e7)
    report = jaxamp.locate_overflow(
        model.apply, {"params": params}, ids, policy=F16, loss_scale=256.0,
        loss_fn=lambda logits: jaxamp.softmax_cross_entropy(logits, ids))
    assert report.first_nonfinite["module"] == "blocks/mlp/fc"
    assert report.first_nonfinite["pass"] == "forward"
    assert report.overflowing[0] == "blocks/mlp/fc"
    for module in ("embed", "blocks/ln1", "blocks/attn", "blocks/attn/qkv"):
        assert report.row(module)["status"] != "overflow", report.to_markdown()
    assert report.row("blocks/attn/qkv")["forward_dtypes"].startswith("float16")
