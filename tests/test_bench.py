"""The bench scripts that produce BENCHMARKS.md's figures run, on toy sizes: the PyTorch peer
is the Flax GPT, and the deterministic counts of ``step_counts.py`` and ``trace_cost.py``.
(``bench/gpu.sh`` and ``_gpu.py``: ``tests/test_gpu_sh.py``.)"""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except Exception:  # not installed, or an install that cannot load
        return False
    return True


HAS_TORCH = _has_torch()


def test_torch_is_not_a_dependency():
    text = (ROOT / "pyproject.toml").read_text()
    deps = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    assert "torch" not in deps.lower()



@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed (optional)")
def test_torch_gpt_matches_flax_gpt():
    """bench/torch_gpt.py is bench/gpt.py: same parameter count and, from the same weights,
    the same float32 loss."""
    import numpy as np

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import torch_gpt
        from gpt import GPT, GPTConfig, init, lm_loss, make_batch, param_count
    finally:
        sys.path.remove(str(ROOT / "bench"))
    for cfg in (GPTConfig(layers=1, d_model=32, heads=2, seq=16),
                GPTConfig(layers=2, d_model=48, heads=3, seq=24)):
        model = GPT(cfg)
        params, batch = init(model, cfg), make_batch(cfg, 3)
        assert torch_gpt.param_count(torch_gpt.TorchGPT(cfg)) == param_count(params)
        trainer = torch_gpt.TorchTrainer(cfg, {k: np.asarray(v) for k, v in batch.items()},
                                         "float32", params=params)
        expected = float(lm_loss(model.apply, params, batch))
        assert abs(trainer.eval_loss() - expected) < 1e-4, cfg
        # One step of each recipe runs (float16 uses the GradScaler).
        for dtype in ("bfloat16", "float16"):
            trainer = torch_gpt.TorchTrainer(cfg, {k: np.asarray(v) for k, v in batch.items()},
                                             dtype, params=params)
            trainer(1)
            assert np.isfinite(float(trainer.last_loss)), dtype



def test_step_counts_tiny_gpt():
    """bench/step_counts.py on a 1-layer GPT: the AMP step compiles with no conditional (the
    skip is a select) and no more copies than the plain step (the optimizer's moments update
    their donated buffers in place), its extra work a bounded share of the fused instructions."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import step_counts
    finally:
        sys.path.remove(str(ROOT / "bench"))
    row = step_counts.counts(1, d_model=32, heads=2, seq=16, batch=2)
    assert row["conditional_amp"] == 0
    assert row["copy_amp"] <= row["copy_baseline"], row
    assert row["fusion_amp"] > row["fusion_baseline"] > 0
    assert 1.0 < row["instructions_in_fusions_amp"] / row["instructions_in_fusions_baseline"] < 1.6
    # XLA's cost estimate: the norm, unscale x clip and selects add little work to a step whose
    # matmuls dominate (1.06x flops, 1.02x bytes at this tiny size; 1.002x / 1.005x at --quick's;
    # fewer bytes than the plain step on jax 0.12, whose optax update copies donated buffers)
    assert 1.0 < row["xla_flops_ratio"] < 1.1, row
    assert 0.95 < row["xla_bytes_accessed_ratio"] < 1.05, row



def test_nested_trace_cost_in_python_calls():
    """bench/trace_cost.py's deterministic measure: the Python function calls of tracing and
    lowering ``value_and_grad`` of ``checkpoint(scan(cond(...)))`` nested 1 and 3 deep, under
    autocast against plain (issue 23's target, 1.3x, is for time; the calls are what the two
    do, free of the machine's noise). A cached jitted call per re-bound primitive, measured
    and removed, read 1.29x at depth 1 on jax 0.12; the engine without it 1.19-1.22x."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import trace_cost
    finally:
        sys.path.remove(str(ROOT / "bench"))
    for depth in (1, 3):
        fns, params, x = trace_cost.nested(depth)
        for fn in fns.values():  # first use: imports, first-call caches
            trace_cost.call_count(fn, params, x)
        calls = {k: trace_cost.call_count(fn, params, x) for k, fn in fns.items()}
        assert calls["autocast"] < 1.26 * calls["plain"], (depth, calls)

