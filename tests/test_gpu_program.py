"""``jaxamp.gpu_program``: the GPU program compiled for an H200 on this CPU machine.

Tests marked ``gpu_compile`` need JAX's CUDA plugin (the ``gpu-compile`` extra) and skip
without it; CI installs it in one of its two venvs. What they check is read independently of
the report where it can be: XLA's ``memory_analysis()`` of the same compile, the ``dot_general``
equations of the step's jaxpr (traced for the same device), and the float8 ones among them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp._engine.jaxpr import iter_eqns
from jaxamp.diagnostics import gpu as gpu_mod

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
try:
    from gpt import GPT, GPTConfig, init, lm_loss, make_batch
finally:
    sys.path.remove(str(ROOT / "bench"))

PLUGIN = gpu_mod._plugin_installed()
BF16 = "params=float32,compute=bfloat16,output=float32"
F16 = "params=float32,compute=float16,output=float32"
FP8 = BF16 + ",matmul=float8"


def gpu_compile(test):
    """Marked ``gpu_compile``; skips where JAX's CUDA plugin is not installed."""
    return pytest.mark.gpu_compile(pytest.mark.skipif(
        not PLUGIN, reason="JAX's CUDA plugin is not installed (pip install -e "
                           "'.[gpu-compile]')")(test))


def _h200_device():
    return gpu_mod.gpu_target("h200").compile_device()


def tiny_gpt(policy: str, attention: str = "manual", op_rules=None):
    cfg = GPTConfig(layers=2, d_model=256, heads=4, seq=256, attention=attention)
    model = GPT(cfg)
    params = init(model, cfg)
    state = jaxamp.TrainState.create(model, params, optax.adamw(1e-3), policy=policy)
    kw = {} if op_rules is None else {"op_rules": op_rules}
    step = jaxamp.make_train_step(model, lm_loss, clip_norm=1.0, **kw)
    return step, state, make_batch(cfg, 4)


def traced_dots(step, state, batch):
    """The ``dot_general`` equations of the step traced for the H200 (as gpu_program traces
    it): (all, float8 ones)."""
    with jax.default_device(_h200_device()):
        closed = jax.make_jaxpr(step.traceable)(state, batch)
    dots = [e for e in iter_eqns(closed) if e.primitive.name == "dot_general"]
    f8 = [e for e in dots if all("float8" in str(v.aval.dtype) for v in e.invars[:2])]
    return dots, f8


def _dot_flops(eqn) -> int:
    """2 x output elements x contracted size of a traced ``dot_general``."""
    lhs = eqn.invars[0].aval.shape
    contracting = eqn.params["dimension_numbers"][0][0]
    return 2 * int(np.prod(eqn.outvars[0].aval.shape)) * int(
        np.prod([lhs[d] for d in contracting]))


def compiled_here(step, state, batch, triton: bool):
    """The step compiled for the H200 by hand (not through gpu_program): the reference the
    report's memory and HLO are checked against."""
    sharding = jax.sharding.SingleDeviceSharding(_h200_device())
    sds = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                       (state, batch))
    with jax.default_device(_h200_device()):
        return step.lower(*sds).compile(compiler_options={"xla_gpu_enable_triton_gemm": triton})


# ---- targets and errors (no plugin needed) -----------------------------------------------

def test_h200_rates_from_its_description():
    t = gpu_mod.gpu_target("h200")
    assert t.name == "NVIDIA H200" and t.compute_capability == (9, 0)
    assert t.memory_bandwidth == 4.8e12 and t.sm_count == 132
    peaks = t.peak_flops
    assert peaks["bf16"] == pytest.approx(132 * 1.98e9 * 4096)
    assert peaks["fp8"] == 2 * peaks["bf16"] and peaks["tf32"] == peaks["bf16"] / 2
    assert peaks["fp32"] == pytest.approx(2 * 128 * 132 * 1.98e9)
    assert gpu_mod.gpu_target("H100").memory_bandwidth == 3352320000000


def test_a_target_file_and_bad_targets(tmp_path):
    text = (ROOT / "jaxamp/diagnostics/gpu_targets/h100.txtpb").read_text()
    path = tmp_path / "mine.txtpb"
    path.write_text(text.replace("memory_bandwidth: 3352320000000", "memory_bandwidth: 1e12"))
    assert gpu_mod.gpu_target(str(path)).memory_bandwidth == 1e12
    with pytest.raises(ValueError, match=r"target='a100': expected one of h100, h200, a path"):
        jaxamp.gpu_program(lambda x: x, jnp.ones(2), target="a100")
    bad = tmp_path / "bad.txtpb"
    bad.write_text("gpu_device_info {\n  core_count: 132\n  fpus_per_core: 128\n}\n")
    with pytest.raises(ValueError, match=r"\(missing: memory_bandwidth, clock_rate_ghz\)"):
        gpu_mod.gpu_target(bad)
    with pytest.raises(ValueError, match="a device target must be a GPU, got a cpu device"):
        gpu_mod.gpu_target(jax.devices("cpu")[0])


def test_without_the_plugin_the_error_names_the_install(monkeypatch):
    monkeypatch.setattr(gpu_mod, "_PLUGINS", ("jax_plugins.no_such_plugin",))
    gpu_mod._compile_only_device.cache_clear()
    try:
        with pytest.raises(ModuleNotFoundError,
                           match=r"CUDA plugin, which is not installed\. Install it: pip "
                                 r"install \"jaxamp-flax\[gpu-compile\]\""):
            jaxamp.gpu_program(lambda x: x * 2, jnp.ones(4))
    finally:
        gpu_mod._compile_only_device.cache_clear()


@pytest.mark.skipif(PLUGIN, reason="the plugin is installed here")
def test_really_without_the_plugin():
    with pytest.raises(ModuleNotFoundError, match=r"gpu-compile"):
        jaxamp.gpu_program(lambda x: x * 2, jnp.ones(4))


# ---- the program, compiled for the H200 ----------------------------------------------------

@gpu_compile
@pytest.mark.parametrize(("policy", "triton"), [(BF16, False), (BF16, True), (F16, False)])
def test_gemm_libraries_and_temp_of_the_bench_gpt(policy, triton):
    step, state, batch = tiny_gpt(policy)
    report = jaxamp.gpu_program(step, state, batch, triton_gemm=triton)
    dots, _ = traced_dots(step, state, batch)
    low = "bf16" if "bfloat16" in policy else "f16"
    library = "triton" if triton else "cublaslt"
    # every dot_general of the step is one GEMM of that library, in the compute dtype
    assert report.gemm_libraries() == {f"{library} {low} x {low}": len(dots)}
    assert len(dots) == 39  # 2 layers x (qkv, scores, P@V, out, fc, proj) x 3 + head x 3
    compiled = compiled_here(step, state, batch, triton)
    assert report.memory["temp"] == compiled.memory_analysis().temp_size_in_bytes > 0
    assert report.hlo == compiled.as_text()
    assert report.estimated_seconds > 0 and report.bytes > 0
    assert report.flops == sum(_dot_flops(e) for e in dots)


@gpu_compile
@pytest.mark.parametrize(("triton", "recipe"), [(False, "current"), (False, "rowwise"),
                                                (False, "delayed")])
def test_planned_fp8_dots_are_formed_fp8_gemms(triton, recipe):
    """Every planned FP8 dot is an FP8 GEMM for each ``fp8=`` recipe (rowwise: the GEMM with
    unit scales, its scale vectors applied after; delayed: compiled on the state the step's
    first call makes), and the report names the recipe."""
    rules = jaxamp.DEFAULT_OP_RULES.extend(
        handlers={"dot_general": jaxamp.FP8Matmuls(small=(0, 0), min_size=0)})
    step, state, batch = tiny_gpt(f"{FP8},fp8={recipe}", op_rules=rules)
    report = jaxamp.gpu_program(step, state, batch, triton_gemm=triton)
    dots, f8 = traced_dots(step, state, batch)
    # 2 layers x (qkv, out, fc, proj) x (forward, dgrad, wgrad), less the first matmul that
    # reads a param (block 0's qkv) and the head (the last), kept bf16
    assert len(f8) == 21
    assert report.fp8_planned == len(f8) == report.fp8_formed
    assert report.fp8_fallbacks == []
    assert report.fp8_recipes == {recipe: 21}
    assert f"21 GEMMs for 21 planned dots, 100% of their FLOPs ({recipe} 21)" in \
        report.to_markdown()
    # E4M3 x E4M3 forward GEMMs; in dgrad and wgrad E5M2 output gradients x E4M3, or (rowwise,
    # as torchao's recipe) E4M3 gradients
    library = "triton" if triton else "cublaslt-fp8"
    low = "triton" if triton else "cublaslt"
    fp8 = {f"{library} f8e4m3fn x f8e4m3fn": 21} if recipe == "rowwise" else {
        f"{library} f8e4m3fn x f8e4m3fn": 7, f"{library} f8e5m2 x f8e4m3fn": 14}
    assert report.gemm_libraries() == {**fp8, f"{low} bf16 x bf16": len(dots) - len(f8)}
    # fp8_gemms works on CPU through it
    counts = jaxamp.fp8_gemms(step, state, batch, target="h200", warn=False)
    assert counts["planned"] == counts["fused"] == len(f8) and counts["checked"]
    assert counts["fallback"] == 0


@gpu_compile
def test_fp8_on_a_gpu_without_fp8_is_named_as_fallbacks(tmp_path):
    """Compute capability 8.0 (an A100) has no FP8 GEMM: XLA converts every planned FP8 dot's
    operands up (TurnF8DotIntoF16Dot), silently; the report names each such GEMM."""
    text = (ROOT / "jaxamp/diagnostics/gpu_targets/h100.txtpb").read_text()
    a100 = tmp_path / "a100.txtpb"
    a100.write_text(text.replace("major: 9", "major: 8"))
    rules = jaxamp.DEFAULT_OP_RULES.extend(
        handlers={"dot_general": jaxamp.FP8Matmuls(small=(0, 0), min_size=0)})
    step, state, batch = tiny_gpt(FP8, op_rules=rules)
    report = jaxamp.gpu_program(step, state, batch, target=a100)
    assert report.target.compute_capability == (8, 0)
    assert report.fp8_planned == 21 and report.fp8_formed == 0
    assert len(report.fp8_fallbacks) == 21
    assert all(k.dtypes in (("f16", "f16"), ("bf16", "bf16")) for k in report.fp8_fallbacks)
    with pytest.warns(RuntimeWarning, match=r"21 FP8 matmuls were planned .* but XLA formed "
                                            r"FP8 GEMMs for 0 of those FLOPs \(0 GEMMs; 21 "
                                            r"silently ran as 16-bit dots"):
        counts = jaxamp.fp8_gemms(step, state, batch, target=a100)
    assert counts["fallback"] == 21


@gpu_compile
@pytest.mark.parametrize("policy", [BF16, F16])
def test_fused_attention_becomes_cudnn_forward_and_backward(policy):
    step, state, batch = tiny_gpt(policy, attention="fused")
    report = jaxamp.gpu_program(step, state, batch)
    low = "bf16" if "bfloat16" in policy else "f16"
    att = report.attention
    assert Counter(k.target for k in att) == {"__cudnn$fmhaSoftmax": 2,
                                               "__cudnn$fmhaSoftmaxBackward": 2}
    assert all(k.dtypes == (low, low) for k in att)
    # causal: the forward does Q K^T and P V on half the scores, the backward five GEMMs
    fwd = next(k for k in att if k.target == "__cudnn$fmhaSoftmax")
    assert fwd.flops == 2 * 2 * (4 * 4 * 256 * 256) * 64 // 2
    # the other matmuls stay GEMMs: 39 - 2 layers x 6 attention dots
    dots, _ = traced_dots(step, state, batch)
    assert len(dots) == 27
    assert report.gemm_libraries()[f"cublaslt {low} x {low}"] == 27


@gpu_compile
def test_the_platform_is_read_from_where_the_step_is_traced_for():
    """The same fused-attention step traced for the CPU keeps JAX's XLA attention (its
    matmuls in the jaxpr); traced for the H200 (``jax.default_device``, as gpu_program and a
    step on GPU devices set it) it binds cuDNN's fused attention instead."""
    step, state, batch = tiny_gpt(BF16, attention="fused")
    names = Counter(e.primitive.name for e in iter_eqns(jax.make_jaxpr(step.traceable)(
        state, batch)))
    with jax.default_device(_h200_device()):
        gpu = Counter(e.primitive.name for e in iter_eqns(jax.make_jaxpr(step.traceable)(
            state, batch)))
    assert names["dot_product_attention_fwd_wrapper"] == 0 and names["dot_general"] == 39
    assert gpu["dot_product_attention_fwd_wrapper"] == 2  # one per layer
    assert gpu["dot_product_attention_bwd_wrapper"] == 2
    assert gpu["dot_general"] == 27


@gpu_compile
def test_function_form_report_and_cli(tmp_path):
    def f(x, w):
        return jnp.tanh(x @ w).sum()

    x, w = jnp.ones((256, 512), jnp.bfloat16), jnp.ones((512, 1024), jnp.bfloat16)
    report = jaxamp.gpu_program(jax.jit(jax.grad(f, argnums=1)), x, w, target="h100")
    assert report.target.name == "NVIDIA H100 80GB HBM3"
    assert report.gemm_libraries() == {"cublaslt bf16 x bf16": 2}  # x @ w, x^T @ dy
    assert [g.flops for g in report.gemms()] == [2 * 256 * 512 * 1024] * 2
    data = json.loads(report.to_json())
    assert data["summary"]["gemm_libraries"] == {"cublaslt bf16 x bf16": 2}
    assert data["memory"]["temp"] == report.memory["temp"]
    assert "| GEMMs | 2 cublaslt bf16 x bf16 |" in report.to_markdown()
    script = tmp_path / "make.py"
    script.write_text("import jax, jax.numpy as jnp\n"
                      "def make():\n"
                      "    f = lambda x, w: jnp.tanh(x @ w).sum()\n"
                      "    return (jax.grad(f, argnums=1), jnp.ones((256, 512), jnp.bfloat16),"
                      " jnp.ones((512, 1024), jnp.bfloat16))\n")
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "jaxamp.diagnostics.gpu", f"{script}:make",
                           "--json", str(out)], capture_output=True, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr
    assert "GEMMs            2 cublaslt bf16 x bf16" in proc.stdout
    assert json.loads(out.read_text())["summary"]["gemm_libraries"] == {
        "cublaslt bf16 x bf16": 2}


@gpu_compile
def test_without_jax_platforms_cpu_the_error_says_so():
    code = ("import jaxamp, jax.numpy as jnp\n"
            "try:\n"
            "    jaxamp.gpu_program(lambda x: x * 2, jnp.ones(4))\n"
            "except RuntimeError as e:\n"
            "    print('ERR', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("a GPU machine: the plugin starts without JAX_PLATFORMS=cpu")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert "ERR jaxamp.gpu_program: JAX's CUDA plugin gave no compile-only GPU" in proc.stdout
    assert "JAX_PLATFORMS=cpu" in proc.stdout


@gpu_compile
def test_the_readme_example_prints_what_readme_shows(capsys):
    """README's GPU-program block, run on what it names (the bench GPT at gpt2-small shape,
    bf16, batch 16 x 1024, from ShapeDtypeStructs), prints the lines README shows."""
    import re

    text = (ROOT / "README.md").read_text()
    section = text[text.index("## The GPU program, from a laptop"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    cfg = GPTConfig(layers=12, d_model=768, heads=12, seq=1024)
    model = GPT(cfg)
    params = jax.eval_shape(lambda: init(model, cfg))
    state = jax.eval_shape(lambda p: jaxamp.TrainState.create(
        model, p, optax.adamw(1e-3), policy=BF16), params)
    batch = jax.eval_shape(lambda: make_batch(cfg, 16))
    step = jaxamp.make_train_step(model, lm_loss, clip_norm=1.0)
    exec(compile(code, "README.md", "exec"), {"jaxamp": jaxamp, "step": step, "state": state,
                                              "batch": batch})
    shown = [line[2:] for line in code.splitlines() if line.startswith("# ")]
    printed = capsys.readouterr().out.splitlines()
    if jax.__version__.startswith("0.10."):  # README's figures are jax 0.10.2's
        assert printed == shown
    else:  # a newer XLA moves the figures a little, not what runs where
        keep = ("target", "GEMMs", "fused attention", "FP8 GEMMs")
        assert [p for p in printed if p.startswith(keep)] == \
            [p for p in shown if p.startswith(keep)]


def _tunix_llama3(policy: str, op_rules=None):
    """tunix's Llama3 as its users build it (``tests/third_party.py``'s loader), at a size
    whose every matmul XLA keeps a GEMM (at the corpus' 12 tokens and 16-wide heads it turns
    some into loop fusions): 2 layers, d 128, 4 query / 2 key-value heads of 32, MLP 256,
    64 tokens."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import third_party
    finally:
        sys.path.remove(str(ROOT / "tests"))
    if not third_party.installed("tunix"):
        pytest.skip("tunix is not installed (.ci/run installs it)")
    m = third_party.import_bare("tunix.models.llama3.model")
    config = m.ModelConfig(num_layers=2, vocab_size=256, embed_dim=128, hidden_dim=256,
                           num_heads=4, head_dim=32, num_kv_heads=2, rope_theta=10_000,
                           norm_eps=1e-5)
    model = third_party._dummy(m, "Llama3", config, 1)
    ids = jax.random.randint(jax.random.key(2), (2, 65), 0, 256)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:]}
    state = jaxamp.TrainState.create(model, tx=optax.adamw(1e-3), policy=policy)
    kw = {} if op_rules is None else {"op_rules": op_rules}
    return (jaxamp.make_train_step(loss_fn=third_party._tunix_loss, clip_norm=1.0, **kw),
            state, batch)


@gpu_compile
@pytest.mark.parametrize(("policy", "triton"), [(BF16, False), (F16, True), (FP8, False),
                                                (FP8, True)])
def test_a_model_we_did_not_write(policy, triton):
    """tunix's NNX Llama3 (RoPE, grouped-query attention, SwiGLU, its own RMSNorm) under each
    policy: the GEMMs are the traced dot_generals, in the compute dtype or FP8 as planned, and
    the temp bytes are XLA's own."""
    rules = jaxamp.DEFAULT_OP_RULES.extend(handlers={"dot_general": jaxamp.FP8Matmuls(
        small=(0, 0), min_size=0)}) if policy == FP8 else None
    step, state, batch = _tunix_llama3(policy, rules)
    report = jaxamp.gpu_program(step, state, batch, triton_gemm=triton)
    dots, f8 = traced_dots(step, state, batch)
    low = "bf16" if "bfloat16" in policy else "f16"
    library = "triton" if triton else "cublaslt"
    libs = report.gemm_libraries()
    assert libs.pop(f"{library} {low} x {low}") > 0
    assert all(k.startswith("triton f8" if triton else "cublaslt-fp8 f8") for k in libs)
    # XLA's DotMerger makes one GEMM of two dots that share an operand (k_proj and v_proj,
    # SwiGLU's gate and up read the same input): the FLOPs are the traced dots' all the same
    assert report.flops == sum(_dot_flops(e) for e in dots)
    assert report.fp8_planned == len(f8) and report.fp8_formed == sum(libs.values())
    assert report.fp8_formed_flops == report.fp8_planned_flops == sum(_dot_flops(e)
                                                                       for e in f8)
    assert report.fp8_fallbacks == []
    if policy == FP8:
        assert len(f8) == 39 and report.fp8_formed == 29  # 10 merged, none lost
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # merged FP8 dots are no shortfall
            counts = jaxamp.fp8_gemms(step, state, batch, target="h200")
        assert counts["fallback"] == 0 and counts["fused_flops"] == counts["planned_flops"]
    compiled = compiled_here(step, state, batch, triton)
    assert report.memory["temp"] == compiled.memory_analysis().temp_size_in_bytes
