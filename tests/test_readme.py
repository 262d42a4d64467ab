"""The README's usage snippet runs as written."""

import pathlib
import re

import jax.numpy as jnp

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _run_snippet(heading: str) -> dict:
    """Runs the first Python block after ``heading``; returns its variables."""
    text = README.read_text()
    section = text[text.index(heading):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    return scope


def test_usage_snippet_runs():
    scope = _run_snippet("## Usage")
    metrics = scope["metrics"]
    assert metrics["loss"].dtype == jnp.float32 and bool(jnp.isfinite(metrics["loss"]))
    state = scope["state"]
    assert int(state.step) == 1
    # a first step at scale 2^16 may overflow in f16: then it is skipped and counted
    assert int(state.skipped_steps) == int(metrics["skipped"]) == 1 - int(metrics["grads_finite"])


def test_nnx_snippet_runs():
    scope = _run_snippet("## Flax NNX")
    assert int(scope["state"].step) == 1 and bool(jnp.isfinite(scope["metrics"]["loss"]))
    assert scope["logits"].dtype == jnp.float32 and scope["logits"].shape == (32, 10)
