"""``bench/gpu.sh`` (the GPU run in one command) works end to end: its CPU dry run at toy size
writes every file and key the GPU session will read, and a spent time budget skips stages
without losing the results file. No GPU figure is produced or checked here."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu.sh"
TARGETS = {"bf16_jaxamp_over_torch_amp", "bf16_jaxamp_over_hand", "f16_dynamic_over_bf16",
           "bf16_peak_memory_vs_f32", "bf16_mfu"}
STAGES = ["env", "tests", "bench", "example-bfloat16", "example-float16", "fp8"]
# One variant per code path: autocast (no scaling), the hand-written jmp step with dynamic
# scaling, PyTorch AMP, and autocast with recompute off and everywhere (issue 24's "before" and
# "after"; the default recomputes in lax.scan bodies only, issue 40).
VARIANTS = ("jaxamp/bfloat16", "hand/float16", "torch/bfloat16", "jaxamp-norecompute/bfloat16",
            "jaxamp-recompute/bfloat16")


def has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except Exception:
        return False
    return True


def run_script(out: Path, env: dict, timeout: int = 400, dry: bool = True):
    args = ["bash", str(SCRIPT)] + (["--cpu-dry-run"] if dry else []) + [str(out)]
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHON": sys.executable, "JAX_PLATFORMS": "cpu",
                               **env})


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-dry")
    proc = run_script(out, {"JAXAMP_GPU_VARIANTS": ",".join(VARIANTS),
                            "JAXAMP_GPU_PYTEST_ARGS": "-k poisoned",
                            "JAXAMP_GPU_EXAMPLE_STEPS": "4"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, json.loads((out / "results-gpu.json").read_text()), proc.stdout


def test_files(dry_run):
    out, _, stdout = dry_run
    names = sorted(p.name for p in out.iterdir())
    assert names == ["example-bfloat16-curves.png", "example-bfloat16-metrics.jsonl",
                     "example-float16-curves.png", "example-float16-metrics.jsonl", "gpu.log",
                     "results-fp8.json", "results-gpu.json"]
    # The device tool brings back at most 8 files, none deeper than 2 folders: OUTDIR is flat.
    assert len(names) <= 8
    assert (out / "example-float16-curves.png").read_bytes()[:4] == b"\x89PNG"
    log = (out / "gpu.log").read_text()
    for stage in STAGES:
        assert f"stage {stage}: exit 0" in log, stage
    assert "CPU DRY RUN" in stdout and "target bf16_mfu" in stdout
    fp8 = json.loads((out / "results-fp8.json").read_text())
    assert set(fp8["shapes"]) == {"gpt2-small", "d2048"} and fp8["dry_run"] is True
    for r in fp8["shapes"].values():  # planned FP8 GEMMs counted; the check needs a GPU
        assert r["hlo"]["planned"] > 0 and r["hlo"]["checked"] is False
        assert r["fp8_tokens_per_s"] > 0 and r["bf16_tokens_per_s"] > 0
    # the FP8 recipes on gpu_estimate.py's fused-attention Llama3 (toy size here), each beside
    # the estimate of the program it ran; formed FP8 GEMMs (planned == formed) need a GPU
    llama = fp8["llama_recipes"]
    assert list(llama["variants"]) == ["jaxamp/bfloat16", "jaxamp-fp8/bfloat16",
                                       "jaxamp-fp8dl/bfloat16", "jaxamp-fp8rw/bfloat16"]
    assert llama["config"]["attention"] == "fused" and llama["config"]["num_layers"] == 1
    for name, r in llama["variants"].items():
        assert r["tokens_per_s"] > 0 and r["step_ms"] > 0 and r["estimated_ms"] > 0, name
        assert r["fp8_formed"] is None and r["measured_over_estimated"] > 0, name
        assert (r["fp8_planned"] > 0) == ("fp8" in name), name


def test_stages_and_env(dry_run):
    _, res, _ = dry_run
    g = res["gpu_sh"]
    assert g["dry_run"] is True and "--cpu-dry-run" in g["command"]
    assert [s["stage"] for s in g["stages"]] == STAGES
    assert all(s["rc"] == 0 and not s["timed_out"] for s in g["stages"]), g["stages"]
    env = g["env"]
    assert env["jax_backend"] == "cpu" and env["jax"][0].isdigit() and env["jmp"]
    tests = g["gpu_tests"]
    assert tests["passed"] == 1 and tests["failed"] == 0 and tests["errors"] == 0, tests
    assert list(tests["tests"]) == ["tests.test_gpu::test_poisoned_step_is_skipped_on_device"]


def test_bench_variants(dry_run):
    _, res, stdout = dry_run
    assert res["dry_run"] is True
    assert res["config"]["layers"] == 1  # toy size
    jax_v = res["jax"]["variants"]
    assert set(jax_v) == {f"{s}/{d}" for s in ("jaxamp", "hand")
                          for d in ("bfloat16", "float16", "float32")} | {
        "jaxamp-fused/bfloat16", "jaxamp-norecompute/bfloat16", "jaxamp-norecompute/float16",
        "jaxamp-recompute/bfloat16"}
    for name in ("jaxamp/bfloat16", "hand/float16"):
        v = jax_v[name]
        assert v["tokens_per_s"] > 0 and v["step_ms"] > 0 and v["compile_s"] > 0, name
        assert v["gemms"]["count"] >= 7 and v["skipped_steps"] == 0 and v["params_finite"]
        assert v["memory_analysis"]["temp_size_in_bytes"] > 0
        assert v["mfu"] is None  # no peak on CPU
        assert len(v["samples_ms"]) == res["jax"]["timing"]["repeats"]
    assert jax_v["jaxamp/float32"] == {"skipped": "not selected (JAXAMP_GPU_VARIANTS)"}
    # recompute off against everywhere (bfloat16, the one selected): XLA's temp bytes fall
    # (CPU has no memory_stats: the peak is for the GPU run)
    rec = res["jax"]["recompute_peak_memory"]
    assert set(rec) == {"bfloat16"}, rec
    assert "off -> " in stdout and rec["bfloat16"]["peak_bytes_before"] is None
    assert 0 < rec["bfloat16"]["temp_after_over_before"] < 1, rec
    assert "recompute=False" in jax_v["jaxamp-norecompute/bfloat16"]["recipe"]
    assert res["jax"]["complete"] and res["jax"]["process"]["status"] == "ok"
    assert res["jax"]["flops_per_token"] > 0 and "6 * N" in res["jax"]["flops_formula"]
    torch_res = res["torch"]
    if has_torch():
        v = torch_res["variants"]["torch/bfloat16"]
        assert v["tokens_per_s"] > 0 and v["compiled"] is False  # eager in the dry run
        assert torch_res["variants"]["torch/float32"]["skipped"].startswith("not selected")
    else:
        assert "skipped" in torch_res


def test_targets_pending(dry_run):
    _, res, _ = dry_run
    assert set(res["targets"]) == TARGETS
    for t in res["targets"].values():
        assert t["value"] is None and t["met"] is None
        assert t["status"] == "pending a Hopper GPU run" and "gpu.sh" in t["command"]


def test_examples(dry_run):
    out, res, _ = dry_run
    for dt in ("bfloat16", "float16"):
        e = res["gpu_sh"]["examples"][dt]
        s = e["summary"]
        assert s["steps"] == 4 and s["preset"] == "test" and dt in s["policy"]
        assert s["loss_scale_mode"] == ("dynamic" if dt == "float16" else "none")
        assert e["steps_logged"] == 4 and e["validation_curve"][0][0] == 0
        assert [p[0] for p in e["validation_curve"]] == [0, 4]  # eval every 4 steps
        # float16 may skip a step at this size (its scale starts at 2**16): the record of the
        # skips agrees with the run's own count.
        assert len(e["skipped_step_numbers"]) == s["skipped_steps"]
        if dt == "bfloat16":
            assert s["skipped_steps"] == 0
        rows = (out / f"example-{dt}-metrics.jsonl").read_text().splitlines()
        assert len(rows) == 4 and json.loads(rows[-1])["step"] == 4


def test_spent_budget_skips_stages_and_keeps_a_results_file(tmp_path):
    """With almost no budget left after the first stage, the rest are recorded as skipped and
    the merge still writes results-gpu.json (targets pending, bench marked incomplete)."""
    proc = run_script(tmp_path, {"JAXAMP_GPU_BUDGET_S": "30"}, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads((tmp_path / "results-gpu.json").read_text())
    stages = {s["stage"]: s for s in res["gpu_sh"]["stages"]}
    assert list(stages) == STAGES
    assert stages["env"]["skipped"] is False and stages["env"]["timeout_s"] <= 15
    for name in STAGES[2:]:
        assert stages[name]["skipped"] is True, stages
    assert res["bench_incomplete"] is True
    assert all(t["value"] is None for t in res["targets"].values())
    assert res["gpu_sh"]["examples"]["float16"]["summary"] is None
    assert "SKIPPED (whole budget" in proc.stdout


def test_usage_error():
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 2 and "usage: bash bench/gpu.sh" in proc.stderr


def _bench_module(name):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_targets_arithmetic_on_made_up_gpu_results():
    """The five targets from made-up per-variant figures: values, met / MISSED."""
    gpu = _bench_module("_gpu")
    jax_res = {"variants": {
        "jaxamp/bfloat16": {"tokens_per_s": 300.0, "mfu": 0.42, "peak_memory_bytes": 50},
        "hand/bfloat16": {"tokens_per_s": 320.0},
        "jaxamp/float16": {"tokens_per_s": 294.0},
        "jaxamp/float32": {"tokens_per_s": 100.0, "peak_memory_bytes": 100}}}
    torch_res = {"variants": {"torch/bfloat16": {"tokens_per_s": 250.0}}}
    values = gpu.gpu_target_values(jax_res, torch_res)
    assert values == pytest.approx({"bf16_jaxamp_over_torch_amp": 1.2,
                                    "bf16_jaxamp_over_hand": 0.9375,
                                    "f16_dynamic_over_bf16": 0.98,
                                    "bf16_peak_memory_vs_f32": 0.5, "bf16_mfu": 0.42})
    judged = gpu.judge_gpu_targets(values, evaluate=True)
    assert {k: t["status"] for k, t in judged.items()} == {
        "bf16_jaxamp_over_torch_amp": "met", "bf16_jaxamp_over_hand": "MISSED",
        "f16_dynamic_over_bf16": "met", "bf16_peak_memory_vs_f32": "met", "bf16_mfu": "met"}
    # A missing side leaves its target pending, never met.
    values = gpu.gpu_target_values(jax_res, {"skipped": "torch not installed"})
    judged = gpu.judge_gpu_targets(values, evaluate=True)
    assert judged["bf16_jaxamp_over_torch_amp"]["met"] is None
    assert judged["bf16_jaxamp_over_torch_amp"]["status"].startswith("pending")
    # Off a Hopper GPU nothing is judged.
    assert all(t["status"] == "pending a Hopper GPU run"
               for t in gpu.judge_gpu_targets(values, evaluate=False).values())


def test_fit_repeats_and_peak(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # peak_flops imports _throughput lazily
    gpu = _bench_module("_gpu")
    size = {"repeats": 7, "steps": 4, "warmup": 3}
    assert gpu.fit_repeats(size, per_round_s=0.5, time_left_s=1000) == 7
    assert gpu.fit_repeats(size, per_round_s=0.5, time_left_s=11) == 5  # (22 - 2) / 4
    assert gpu.fit_repeats(size, per_round_s=0.5, time_left_s=1) == 3  # never below 3
    assert gpu.fit_repeats({"repeats": 2, "steps": 1, "warmup": 1}, 1.0, 0.1) == 2
    assert gpu.peak_flops("NVIDIA H200", "gpu")[0] == 790e12
    assert gpu.peak_flops("NVIDIA A100-SXM4-80GB", "gpu")[0] == 312e12
    assert gpu.peak_flops("cpu", "cpu")[0] is None


def test_peak_padding_shows_every_step_and_stays_bounded(monkeypatch):
    """``_gpu.peak_step``'s pad (a model of the allocator: the peak never falls): ten steps of
    about 15 GiB, each seen as a rise over the padded peak, in any order, while the peak
    climbs by a fraction of theirs. (Padded up to the full earlier peak, it climbed by each
    step's whole peak and ran an H200 out of memory.)"""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    gpu = _bench_module("_gpu")
    gib = 2**30
    live, peak, seen = 3 * gib, 3 * gib, []
    steps = [15 * gib, 14 * gib, 16 * gib, 15 * gib, 14 * gib, 28 * gib, 15 * gib, 14 * gib,
             15 * gib, 16 * gib]
    for own in steps:
        pad = gpu.pad_bytes({"peak_bytes_in_use": peak, "bytes_in_use": live}, own)
        base = live + pad
        peak = max(peak, base, base + own)
        seen.append(peak - base if peak == base + own else None)
    assert seen == steps  # every step's own peak, none hidden
    assert peak < 3 * gib + 28 * gib + 0.2 * sum(steps) + gib  # not their sum (about 165 GiB)
    # without an expected footprint the pad reaches the peak (the step shows by any rise)
    assert gpu.pad_bytes({"peak_bytes_in_use": 10, "bytes_in_use": 4}, None) == 6
    assert gpu.pad_bytes({"peak_bytes_in_use": 10, "bytes_in_use": 4}, 100) == 0


def test_fused_attention_model_is_the_same_model(monkeypatch):
    """bench/gpt.py's ``attention="fused"`` (the ``jaxamp-fused`` variant) computes the same
    loss from the same parameters as the hand-written attention."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    gpt = _bench_module("gpt")
    cfg = gpt.GPTConfig(layers=1, d_model=32, heads=2, seq=16)
    model = gpt.GPT(cfg)
    params, batch = gpt.init(model, cfg), gpt.make_batch(cfg, 2)
    fused = gpt.GPT(cfg.replace(attention="fused"))
    manual_loss = float(gpt.lm_loss(model.apply, params, batch))
    assert abs(float(gpt.lm_loss(fused.apply, params, batch)) - manual_loss) < 1e-5
    with pytest.raises(ValueError, match="attention="):
        gpt.GPTConfig(attention="flash")
    # the hand-cast twin's "fused" (gpu_estimate.py's hand-fused): the same loss in float32,
    # jax.nn.dot_product_attention's XLA path on the CPU
    handcast = _bench_module("gpt_handcast")
    twin = handcast.HandCastGPT(cfg.replace(attention="fused"), jnp.float32)
    assert abs(float(handcast.handcast_loss(twin)(params, batch)) - manual_loss) < 1e-5
    assert handcast.attention_implementation() is None


def test_hand_cast_fused_twin_is_cudnn_attention_in_its_dtype_on_a_gpu(monkeypatch):
    """Traced for an H200 (as gpu_estimate.py traces it), the hand-cast twin with
    ``attention="fused"`` binds cuDNN's fused attention on bfloat16 query/key/value, forward
    and backward: the hand-written reference for the ``jaxamp-fused`` variant."""
    from jaxamp.diagnostics import gpu as gpu_mod

    if not gpu_mod._plugin_installed():
        pytest.skip("JAX's CUDA plugin is not installed (pip install -e '.[gpu-compile]')")
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    gpt, handcast = _bench_module("gpt"), _bench_module("gpt_handcast")
    cfg = gpt.GPTConfig(layers=1, d_model=64, heads=2, seq=64, attention="fused")
    params = jax.eval_shape(lambda: gpt.init(gpt.GPT(cfg), cfg))
    batch = gpt.make_batch(cfg, 2)
    loss = handcast.handcast_loss(handcast.HandCastGPT(cfg, jnp.bfloat16))
    device = gpu_mod.gpu_target("h200").compile_device()
    with jax.default_device(device):
        assert handcast.attention_implementation() == "cudnn"
        closed = jax.make_jaxpr(jax.grad(loss))(params, batch)
    from jaxamp._engine.jaxpr import iter_eqns

    calls = [e for e in iter_eqns(closed) if e.primitive.name.startswith("dot_product_attention")]
    assert sorted(e.primitive.name for e in calls) == ["dot_product_attention_bwd_wrapper",
                                                       "dot_product_attention_fwd_wrapper"]
    assert all(str(v.aval.dtype) == "bfloat16" for e in calls for v in e.invars[:3])
