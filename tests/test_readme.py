"""The README's usage snippet runs as written."""

import pathlib
import re

import jax.numpy as jnp

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _run_snippet(heading: str, scope: dict | None = None) -> dict:
    """Runs the first Python block after ``heading`` (in ``scope``); returns its variables."""
    text = README.read_text()
    section = text[text.index(heading):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope = {} if scope is None else scope
    exec(compile(code, "README.md", "exec"), scope)
    return scope


def _section(heading: str) -> str:
    text = README.read_text()
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end > 0 else None]


def test_quick_start_runs_on_a_cnn_with_batchnorm_and_dropout(capsys):
    """The quick start's three steps (apply, train, check) as written, on tests/models.py's CNN
    (BatchNorm, dropout, train=)."""
    import jax
    import optax
    from models import cnn_loss, cnn_state

    model, state0, batch = cnn_state()
    variables = {"params": state0.params, **state0.collections}
    scope = _run_snippet("## Quick start", {
        "jax": jax, "optax": optax, "model": model, "variables": variables,
        "images": batch["x"], "loss_fn": cnn_loss, "batch": batch})
    assert scope["logits"].dtype == jnp.float32  # output=float32
    assert int(scope["state"].step) == 1 and bool(jnp.isfinite(scope["metrics"]["loss"]))
    out = capsys.readouterr().out
    assert "Conv_0" in out and "BatchNorm" in out and "no findings" in out


def test_ci_runs_what_the_readme_says():
    """.ci/run installs and tests as README's "Set up" says, builds the docs with the README's
    command (warnings as errors), and installs torch so the PyTorch-recipe test runs."""
    ci = (README.parent / ".ci" / "run").read_text()
    install = re.search(r"^INSTALL_CMD='(.*)'$", ci, re.M).group(1)
    test = re.search(r"^TEST_CMD='(.*)'$", ci, re.M).group(1)
    setup = _section("## Set up")
    assert install in setup and test in setup
    docs = re.search(r"^DOCS_CMD='(.*)'$", ci, re.M).group(1)
    assert docs in _section("## Documentation") and "-W" in docs
    assert 'eval "${DOCS_CMD}"' in ci
    assert re.search(r"^TORCH_CMD='pip install torch==2\.13\.0'$", ci, re.M)
    first = ci[ci.index("=== 1/2"):ci.index("=== 2/2")]
    assert 'eval "${TORCH_CMD}"' in first and 'eval "${DOCS_CMD}"' in first
    # the gpu_compile tests run in the first venv, with the extra README names
    gpu = re.search(r"^GPU_COMPILE_CMD='(.*)'$", ci, re.M).group(1)
    assert gpu == 'pip install -e ".[gpu-compile]"' and gpu in setup
    assert 'eval "${GPU_COMPILE_CMD}"' in first
    assert "GPU_COMPILE_CMD" not in ci[ci.index("=== 2/2"):]


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


def test_equinox_snippet_runs(capsys):
    import pytest
    pytest.importorskip("equinox", reason="equinox installs on Python >= 3.12 in .ci/run")
    scope = _run_snippet("## Equinox and plain JAX")
    assert bool(jnp.isfinite(scope["loss"])) and int(scope["state"].step) == 1
    assert bool(jnp.isfinite(scope["metrics"]["loss"]))
    assert "no findings" in capsys.readouterr().out


def test_ci_installs_the_third_party_model_libraries_without_their_dependencies():
    """tests/test_third_party.py skips a library that is not installed: CI installs them, in
    both passes (eqx-zoo in the Python >= 3.12 one), with --no-deps (jax stays as installed)."""
    ci = (README.parent / ".ci" / "run").read_text()
    tunix = re.search(r"^THIRD_PARTY_CMD='(.*)'$", ci, re.M).group(1)
    eqx = re.search(r"^EQX_CMD='(.*)'$", ci, re.M).group(1)
    assert "--no-deps google-tunix==" in tunix and "--no-deps equinox==" in eqx
    assert "eqx-zoo==" in eqx and "jax" not in eqx.replace("jaxtyping", "")
    first = ci[ci.index("=== 1/2"):ci.index("=== 2/2")]
    second = ci[ci.index("=== 2/2"):]
    assert 'eval "${THIRD_PARTY_CMD}"' in first and 'eval "${EQX_CMD}"' not in first
    assert 'eval "${THIRD_PARTY_CMD}"' in second and 'eval "${EQX_CMD}"' in second
    assert second.index("--upgrade jax") < second.index('eval "${EQX_CMD}"')
