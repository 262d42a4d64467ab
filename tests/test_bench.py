"""The benchmark entry point runs end to end (``bench/run.py --smoke``) and reports every key.

The PyTorch peer is optional: with torch installed the smoke run measures it, without it (or
with ``JAXAMP_BENCH_NO_TORCH=1``) the JSON says why it was skipped. Both paths are tested.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

RATIO_KEYS = ("amp_step_runtime_ratio", "amp_step_compile_ratio",
              "trace_compile_ratio_amp_vs_plain")
POSITIVE_KEYS = ("amp_step_ms", "baseline_step_ms", "amp_compile_s", "baseline_compile_s")
COUNT_KEYS = ("convert_count_amp", "convert_count_hand", "lossy_round_trips_amp")
MEMORY_FIELDS = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes")


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except Exception:  # not installed, or an install that cannot load
        return False
    return True


HAS_TORCH = _has_torch()
PEER_SKIPPED = {"skipped": "torch not installed"}


def run_bench(out: Path, *args: str, env: dict | None = None, timeout: int = 120):
    md = ROOT / "BENCHMARKS.md"
    before = md.read_text() if md.exists() else None
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), *args, "--json",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS",
                                                                             "cpu"),
                               **(env or {})})
    assert proc.returncode == 0, f"bench/run.py {args} failed:\n{proc.stdout}\n{proc.stderr}"
    after = md.read_text() if md.exists() else None
    assert before == after, f"bench/run.py {args} must not rewrite BENCHMARKS.md"
    return json.loads(out.read_text()), proc.stdout


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    return run_bench(tmp_path_factory.mktemp("bench") / "smoke.json", "--smoke")


def finite_positive(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def test_ratios_and_times_are_positive(smoke):
    res, _ = smoke
    for key in RATIO_KEYS + POSITIVE_KEYS:
        assert key in res, key
        assert finite_positive(res[key]), (key, res[key])


def test_counts(smoke):
    res, _ = smoke
    for key in COUNT_KEYS:
        assert isinstance(res[key], int) and res[key] >= 0, (key, res[key])
    assert res["convert_count_amp"] > 0 and res["convert_count_hand"] > 0
    assert res["lossy_round_trips_amp"] == 0


def test_matmuls_all_in_compute_dtype(smoke):
    res, _ = smoke
    assert res["matmul_flops_fraction_compute_dtype"] == 1.0
    assert res["matmul_flops_fwd_bwd"] > 0


def test_memory(smoke):
    res, _ = smoke
    mem = res["memory_bytes"]
    assert set(mem) == {"float32", "bfloat16", "float16"}
    for name, stats in mem.items():
        for field in MEMORY_FIELDS:
            assert isinstance(stats[field], int) and stats[field] >= 0, (name, field)
        assert stats["argument_size_in_bytes"] > 0, name
    for name in ("bfloat16", "float16"):
        assert finite_positive(res["memory_temp_ratio_vs_f32"][name]), name


def test_metadata_and_table(smoke):
    res, stdout = smoke
    meta = res["metadata"]
    assert meta["mode"] == "smoke" and "--smoke" in meta["command"]
    assert meta["machine"]["cpu_count"] >= 1 and meta["date"]
    for lib in ("python", "jax", "flax", "optax"):
        assert meta["versions"][lib], lib
    assert res["scaling"] == []  # skipped in --smoke
    assert res["amp_skipped_steps"] >= 0
    for key in RATIO_KEYS:
        assert key in stdout


def test_peer(smoke):
    res, stdout = smoke
    peer = res["peer"]
    if not HAS_TORCH:
        assert peer == PEER_SKIPPED
        return
    assert isinstance(peer["torch_version"], str) and isinstance(peer["compiled"], bool)
    assert peer["compiled"] is False  # --smoke runs PyTorch eagerly
    assert peer["params"]["torch"] == peer["params"]["jaxamp"] == res["params"]
    assert peer["dtypes"] == ["float32", "bfloat16"]
    assert peer["torch_num_threads"] >= 1
    for side in ("jaxamp", "torch"):
        for dt in peer["dtypes"]:
            assert finite_positive(peer["tokens_per_s"][side][dt]), (side, dt)
    for dt in peer["dtypes"]:
        assert finite_positive(peer["ratio_jaxamp_over_torch"][dt]), dt
    # Same model, weights, batch and optimizer: the float32 losses agree.
    loss0, after = peer["loss_at_init_float32"], peer["loss_after_float32_eval"]
    assert abs(loss0["jaxamp"] - loss0["torch"]) < 1e-4, loss0
    assert abs(after["jaxamp"]["float32"] - after["torch"]["float32"]) < 1e-3, after
    assert "Peer: jaxamp vs PyTorch" in stdout


def test_peer_skipped_without_torch(tmp_path):
    """JAXAMP_BENCH_NO_TORCH=1 behaves as if torch were not installed (--peer-only: fast)."""
    res, stdout = run_bench(tmp_path / "peer.json", "--smoke", "--peer-only",
                            env={"JAXAMP_BENCH_NO_TORCH": "1"}, timeout=60)
    assert res["peer"] == PEER_SKIPPED
    lines = [line for line in stdout.splitlines() if line.startswith("[bench] peer")]
    assert len(lines) == 1 and "skipped" in lines[0] and "torch not installed" in lines[0], stdout
    assert res["metadata"]["peer_only"] is True
    assert all(t["met"] is None for t in res["gpu_targets"].values())


def test_gpu_targets_pending_on_cpu(smoke):
    res, _ = smoke
    targets = res["gpu_targets"]
    assert set(targets) == {"bf16_jaxamp_over_torch_amp", "f16_dynamic_over_bf16",
                            "bf16_peak_memory_vs_f32", "bf16_mfu"}
    if res["metadata"]["machine"]["backend"] == "cpu":
        for t in targets.values():
            assert t["value"] is None and t["status"].startswith("pending"), t
            assert "--full" in t["command"]


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


def test_gpu_targets_on_hopper(monkeypatch):
    """The Hopper targets' arithmetic, on made-up --full results."""
    import types

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import run
    finally:
        sys.path.remove(str(ROOT / "bench"))
    fake = types.SimpleNamespace(device_kind="NVIDIA H200", platform="gpu")
    monkeypatch.setattr(run.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(run.jax, "devices", lambda *a: [fake])
    res = {"peer": {"ratio_jaxamp_over_torch": {"bfloat16": 1.05}},
           "throughput": {"bfloat16": {"tokens_per_s": 100.0, "mfu": 0.35},
                          "float16": {"tokens_per_s": 98.0, "mfu": 0.34}},
           "memory_bytes": {"float32": {"peak_memory_in_bytes": 1000},
                            "bfloat16": {"peak_memory_in_bytes": 550}}}
    t = run.gpu_targets(res)
    assert t["bf16_jaxamp_over_torch_amp"]["met"] is True
    assert t["f16_dynamic_over_bf16"]["value"] == pytest.approx(0.98)
    assert t["f16_dynamic_over_bf16"]["met"] is True
    assert t["bf16_peak_memory_vs_f32"]["value"] == pytest.approx(0.55)
    assert t["bf16_peak_memory_vs_f32"]["met"] is True
    assert t["bf16_mfu"]["met"] is False and t["bf16_mfu"]["status"] == "MISSED"
    res["peer"] = {"skipped": "torch not installed"}
    assert run.gpu_targets(res)["bf16_jaxamp_over_torch_amp"]["status"].startswith("pending")


def test_residuals_by_dtype_and_op_tiny_gpt():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import residuals
        from gpt import GPTConfig
    finally:
        sys.path.remove(str(ROOT / "bench"))
    res = residuals.measure_gpt(GPTConfig(layers=1, d_model=32, heads=2, seq=16), 2)
    runs = res["jaxamp"]["runs"]
    for name, r in runs.items():
        assert sum(r["by_dtype"].values()) == r["bytes"] > 0, name
        assert r["count"] > 0 and r["by_op"], name
    assert runs["float32"]["float32_share"] > 0.9  # float32 run: (nearly) all float32
    for low in ("float16", "bfloat16"):
        assert runs[low]["by_dtype"].get(low, 0) > 0  # something saved in the low dtype
        assert 0 < res["jaxamp"]["ratio_vs_float32"][low] < 1.0
        assert res["handcast"]["runs"][low]["bytes"] > 0
    if not HAS_TORCH:
        assert res["torch"] == PEER_SKIPPED
    else:
        assert res["torch"]["runs"]["float16"]["by_dtype"].get("float16", 0) > 0


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


def test_transformers_step_on_their_llama():
    """bench/transformers_step.py: the AMP step against the plain step on transformers'
    FlaxLlamaForCausalLM (a model we did not write), with the plain step with optax's clip
    timed beside them: no conditional, no skipped step, and XLA's cost estimate within 1% of
    the plain step's (bytes accessed: 1.004x on jax 0.10, 0.996x on 0.12, where the plain step
    copies donated buffers and the AMP step does not)."""
    pytest.importorskip("transformers", reason="transformers<5 has the Flax models")
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import transformers_step
    finally:
        sys.path.remove(str(ROOT / "bench"))
    row = transformers_step.measure("llama", 1, compiles=1, repeats=1, steps=1, warmup=1,
                                    clip_baseline=True)
    assert row["conditional_amp"] == 0 and row["skipped_steps"] == 0, row
    assert row["fusion_amp"] > row["fusion_baseline"] > 0
    assert 1.0 < row["xla_flops_ratio"] < 1.01 and 0.99 < row["xla_bytes_accessed_ratio"] < 1.01
    for key in ("compile_ratio", "runtime_ratio", "clip_baseline_runtime_ratio",
                "runtime_ratio_vs_clip_baseline"):  # one repeat: the interval is the ratio
        assert row[key] > 0 and row[f"{key}_ci95"] == pytest.approx([row[key]] * 2), row
    assert row["runtime_ratio_vs_clip_baseline"] == pytest.approx(
        row["amp_step_ms"] / row["clip_baseline_step_ms"])


def test_ratio_ci_brackets_the_ratio_of_medians_and_narrows():
    """bench/_timing.ratio_ci: the bootstrap interval of median(num) / median(den) holds the
    ratio, is seeded (same samples, same interval), narrows as repeats grow, and rejects
    samples that do not pair up."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from _timing import ratio_ci
    finally:
        sys.path.remove(str(ROOT / "bench"))
    import numpy as np

    rng = np.random.default_rng(3)
    widths = []
    for n in (15, 135):
        den = 100 * (1 + 0.05 * rng.standard_normal(n))
        num = 103 * (1 + 0.05 * rng.standard_normal(n))
        lo, hi = ratio_ci(list(num), list(den))
        assert lo < np.median(num) / np.median(den) < hi
        assert ratio_ci(list(num), list(den)) == [lo, hi]
        widths.append(hi - lo)
    assert widths[1] < widths[0] / 2  # about 1/sqrt(9) as wide
    assert ratio_ci([2.0, 2.0, 2.0], [1.0, 1.0, 1.0]) == [2.0, 2.0]
    with pytest.raises(ValueError, match="equally long"):
        ratio_ci([1.0, 2.0], [1.0])


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
