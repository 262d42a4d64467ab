"""``bench/run.py --gpu``: the gpt2-small-shape train step on a GPU in float32, bfloat16 and
float16 (dynamic loss scaling), for three implementations of the same model:

* ``jaxamp``: ``bench/gpt.py`` (no dtype code) under ``jaxamp.make_train_step``;
  ``jaxamp-fused`` (bf16) with ``jax.nn.dot_product_attention`` (cuDNN's fused kernel on a GPU);
  ``jaxamp-norecompute`` / ``jaxamp-recompute``: recompute off / everywhere (issue 24's peak
  memory before and after, ``recompute_peak_memory``);
* ``hand``: ``bench/gpt_handcast.py``'s hand-written ``dtype=`` twin in the step a careful user
  writes with ``jmp`` (``_steps.hand_train_step``);
* ``torch``: ``bench/torch_gpt.py`` with ``torch.autocast`` + ``GradScaler`` +
  ``torch.compile``, from the same float32 weights and batch.

One process per framework (``--gpu-side``), each with its own time limit, so a hang in one
leaves the other's figures and neither allocator holds the GPU while the other runs. Variants
alternate in interleaved repeats and medians are reported: step time, tokens/s, MFU (FLOPs per
token ``6 N + 12 L d T``, ``gpt.flops_per_token``, against 790 TFLOP/s on an H200, measured here,
or the datasheet's ``PEAK_FLOPS``), compile time and peak device memory (JAX: the rise of
``memory_stats()``' peak over the live bytes, variants in order of their compiled footprint,
see :func:`peak_step`; PyTorch: ``max_memory_allocated`` after ``reset_peak_memory_stats``).

``--cpu-dry-run`` (or ``JAXAMP_GPU_DRY_RUN=1``) runs it all at toy size on CPU (PyTorch eager)
to prove the plumbing; its figures mean nothing.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DRY_RUN_ENV = "JAXAMP_GPU_DRY_RUN"
DTYPES = ("bfloat16", "float16", "float32")  # the order variants are built in: targets first
# Build order, so that a spent budget costs the least: the targets need jaxamp bf16, hand bf16,
# jaxamp f16 and jaxamp f32 first. (The default recomputes in lax.scan bodies only, issue 40:
# for these unrolled layers it is recompute off; issue 24's before/after needs both.)
JAX_ORDER = (("jaxamp", "bfloat16"), ("hand", "bfloat16"), ("jaxamp", "float16"),
             ("jaxamp", "float32"), ("jaxamp-norecompute", "bfloat16"),
             ("jaxamp-recompute", "bfloat16"),
             ("jaxamp-norecompute", "float16"), ("jaxamp-fused", "bfloat16"),
             ("hand", "float16"), ("hand", "float32"))
# Dense bf16 matmul rate measured on this workplace's H200s (8192^3 bf16, random data): the
# issue's MFU reference. Elsewhere: the datasheet's dense bf16/f16 peak (no sparsity).
MEASURED_PEAK_FLOPS = (("H200", 790e12),)
PEAK_FLOPS = (("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("L4", 121e12),
              ("A10", 125e12), ("V100", 125e12))
GPU_SIZES = {
    # gpt2-small shape: 12 layers, d 768, 12 heads, context 1024; 16 x 1024 tokens per step.
    "gpu": dict(config=dict(layers=12, d_model=768, heads=12, seq=1024), batch=16,
                repeats=7, steps=4, warmup=3, torch_compile=True),
    "dry": dict(config=dict(layers=1, d_model=32, heads=2, seq=16), batch=2,
                repeats=2, steps=1, warmup=1, torch_compile=False),
}
# Comma-separated variant names (e.g. "jaxamp/bfloat16,hand/bfloat16,torch/bfloat16"): only
# those are built; the others are recorded as not selected. Default: all eleven.
VARIANTS_ENV = "JAXAMP_GPU_VARIANTS"


def selected(name: str) -> bool:
    chosen = [v.strip() for v in os.environ.get(VARIANTS_ENV, "").split(",") if v.strip()]
    return not chosen or name in chosen


def dry_run_requested(flag: bool = False) -> bool:
    return flag or os.environ.get(DRY_RUN_ENV, "") not in ("", "0")


def peak_flops(device_kind: str, platform: str) -> tuple[float | None, str]:
    """(dense bf16 peak FLOP/s, where it comes from) for MFU."""
    if platform != "gpu":
        return None, "no peak: not a GPU"
    for key, p in MEASURED_PEAK_FLOPS:
        if key.lower() in device_kind.lower():
            return p, f"{p / 1e12:.0f} TFLOP/s dense bf16, measured on this workplace's {key}s"
    for key, p in PEAK_FLOPS:
        if key.lower() in device_kind.lower():
            return p, f"{p / 1e12:.0f} TFLOP/s dense bf16, datasheet ({key})"
    return None, f"no peak known for {device_kind!r}"


def _write(path: Path | None, res: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=2, default=float) + "\n")
        os.replace(tmp, path)


def _tree_bytes(tree) -> int:
    import jax

    return int(sum(getattr(x, "nbytes", 0) for x in jax.tree_util.tree_leaves(tree)))


def _jax_memory_stats() -> dict | None:
    import jax

    try:
        return jax.devices()[0].memory_stats()
    except Exception:  # backends without allocator stats
        return None


def pad_bytes(stats: dict, expected: int | None) -> int:
    """The pad that makes a step's own peak show above the allocator's peak so far: live bytes
    up to that peak, less 80% of the step's expected footprint (padding to the full peak, ten
    gpt2-small steps ran an H200 out of memory)."""
    gap = stats["peak_bytes_in_use"] - stats["bytes_in_use"]
    return max(0, gap - int(0.8 * (expected or 0)))


def peak_step(step, expected: int | None = None) -> tuple[int | None, str]:
    """Runs ``step()``; (the device bytes it took at its peak over what was live before it,
    where that figure comes from). ``peak_bytes_in_use`` cannot be reset: a pad buffer
    (:func:`pad_bytes`) first fills the live bytes towards the peak so far. None without
    allocator statistics, or where the step's peak stayed under the earlier one."""
    import jax
    import jax.numpy as jnp

    stats = _jax_memory_stats()
    if not stats or "peak_bytes_in_use" not in stats:
        step()
        return None, "no memory_stats on this backend"
    n = pad_bytes(stats, expected)
    pad = jnp.zeros((n,), jnp.uint8) if n else None
    jax.block_until_ready(pad)
    before = _jax_memory_stats()
    step()
    after = _jax_memory_stats()
    del pad
    if after["peak_bytes_in_use"] <= max(before["peak_bytes_in_use"], before["bytes_in_use"]):
        return None, "memory_stats: hidden by an earlier larger peak"
    return (after["peak_bytes_in_use"] - before["bytes_in_use"],
            "memory_stats: peak rise over the live bytes (padded towards the earlier peak) "
            "+ own state")


def _footprint(ma: dict | None) -> int | None:  # memory_analysis' peak, else its sum
    return None if not ma else ma.get("peak_memory_in_bytes") or (
        ma["argument_size_in_bytes"] + ma["output_size_in_bytes"] - ma["alias_size_in_bytes"]
        + ma["temp_size_in_bytes"])


def time_variants(res: dict, runners: dict, size: dict, round_key: str, warmup: int,
                  hard_deadline: float) -> None:
    """Times the built ``runners`` interleaved, in the repeats that fit before
    ``hard_deadline`` (a round: each variant's ``round_key`` seconds): per variant step time,
    tokens/s, MFU and the samples; ``res["timing"]``."""
    from _steps import interleaved_runtime, med

    repeats = size["repeats"]
    if runners:
        per_round = sum(res["variants"][k][round_key] for k in runners)
        repeats = fit_repeats(dict(size, warmup=warmup + 1), per_round,
                              hard_deadline - time.monotonic() - 5)
        wall = interleaved_runtime(runners, repeats=repeats, steps=size["steps"], warmup=warmup)
        fpt, peak = res["flops_per_token"], res["peak_flops"]
        for name, times in wall.items():
            tps = size["batch"] * size["config"]["seq"] / med(times)
            res["variants"][name].update(
                step_ms=med(times) * 1e3, tokens_per_s=tps, model_tflops_per_s=fpt * tps / 1e12,
                mfu=fpt * tps / peak if peak else None,
                samples_ms=[round(t * 1e3, 3) for t in times])
    res["timing"] = {"repeats": repeats, "repeats_planned": size["repeats"],
                     "steps": size["steps"], "warmup": size["warmup"]}


def fit_repeats(size: dict, per_round_s: float, time_left_s: float) -> int:
    """Timing repeats that fit the time left: a round is one step of every variant; the timing
    runs ``warmup - 1 + repeats * steps`` rounds. At least 3 repeats (a median needs them)."""
    rounds = time_left_s / per_round_s if per_round_s > 0 else float("inf")
    fit = int((rounds - max(size["warmup"] - 1, 0)) / size["steps"])
    return max(min(3, size["repeats"]), min(size["repeats"], fit))


def memory_dict(ma) -> dict:
    """A compiled program's ``memory_analysis()`` as a dict of ints."""
    out = {k: int(getattr(ma, k)) for k in
           ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
            "alias_size_in_bytes", "generated_code_size_in_bytes")}
    peak = getattr(ma, "peak_memory_in_bytes", None)  # not reported by every jaxlib
    out["peak_memory_in_bytes"] = int(peak) if peak is not None else None
    return out


def run_info(mode: str, started: float) -> dict:
    """Date, command, mode and wall time of this run."""
    import datetime
    import shlex

    return {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": shlex.join(["python", *sys.argv]), "mode": mode,
            "wall_s": round(time.perf_counter() - started, 1)}


def metadata(mode: str, started: float) -> dict:
    """:func:`run_info`, machine and versions, as this (JAX) process sees them."""
    import platform

    import flax
    import jax
    import jmp
    import optax

    import jaxamp

    dev = jax.devices()[0]
    return run_info(mode, started) | {
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "machine": platform.machine(), "cpu_count": os.cpu_count(),
                    "backend": jax.default_backend(), "device_kind": dev.device_kind,
                    "device_count": jax.device_count()},
        "versions": {"python": platform.python_version(), "jax": jax.__version__,
                     "jaxlib": getattr(jax.lib, "__version__", None), "flax": flax.__version__,
                     "optax": optax.__version__, "jmp": getattr(jmp, "__version__", None),
                     "jaxamp": getattr(jaxamp, "__version__", None)},
    }


NO_TORCH_ENV = "JAXAMP_BENCH_NO_TORCH"  # set (non-empty, not "0"): behave as if torch is missing


def import_torch():
    """``(torch, None)``, or ``(None, why)`` when PyTorch cannot (or must not) be imported."""
    if os.environ.get(NO_TORCH_ENV, "") not in ("", "0"):
        return None, f"{NO_TORCH_ENV}={os.environ[NO_TORCH_ENV]} is set"
    try:
        import torch
    except Exception as e:  # ImportError, or a broken install (OSError from a shared library)
        return None, f"import torch failed: {type(e).__name__}: {e}"
    return torch, None


def use_fresh_inductor_cache() -> str:
    """A fresh inductor cache unless the environment names one: torch.compile's first step is
    then a cold compile, as jax.jit's is. Returns what was done, for the JSON."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return "TORCHINDUCTOR_CACHE_DIR from the environment (may be warm)"
    cache = tempfile.mkdtemp(prefix="jaxamp-bench-inductor-")
    atexit.register(shutil.rmtree, cache, ignore_errors=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    return "fresh temporary TORCHINDUCTOR_CACHE_DIR (cold compile)"


def jax_side(size: dict, deadline: float, out: Path | None, hard_deadline: float) -> dict:
    """jaxamp and hand-cast variants in this process; written to ``out`` as they complete."""
    import jax
    import jax.numpy as jnp
    from _steps import POLICIES, AmpRunner, HandRunner, make_tx, setup
    from gpt import GPT, GPTConfig, flops_per_token, param_count

    import jaxamp
    from jaxamp.diagnostics._hlo import find_gemms, summarize

    started = time.perf_counter()
    cfg, batch_size = GPTConfig(**size["config"]), size["batch"]
    dev = jax.devices()[0]
    res: dict = {"framework": "jax", "jax_version": jax.__version__, "device": dev.device_kind,
                 "backend": jax.default_backend(), "config": {**cfg.__dict__,
                                                              "batch": batch_size},
                 "variants": {}, "complete": False}
    model, params, batch = setup(cfg, batch_size)
    peak, peak_note = peak_flops(dev.device_kind, dev.platform)
    res.update(params=param_count(params), flops_per_token=flops_per_token(cfg, params),
               peak_flops=peak, peak_note=peak_note, flops_formula="6 * N + 12 * layers * "
               "d_model * seq (N: parameters in matmuls; full T x T attention scores)")
    tx = make_tx()
    runners: dict = {}
    recompute = {"jaxamp-norecompute": False, "jaxamp-recompute": True}

    def _build(side: str, dt: str):
        if side in ("jaxamp", "jaxamp-fused", "jaxamp-norecompute", "jaxamp-recompute"):
            policy = POLICIES[dt]
            m = GPT(cfg.replace(attention="fused")) if side == "jaxamp-fused" else model
            rules = jaxamp.DEFAULT_OP_RULES.extend(recompute=recompute[side]) \
                if side in recompute else None
            r = AmpRunner(m, params, tx, batch, policy, jaxamp.default_loss_scale(policy),
                          op_rules=rules)
            return (r, lambda: r.step.lower(r.state, batch), _tree_bytes(r.state),
                    f"jaxamp.make_train_step(policy={policy!r}, clip_norm=1.0"
                    + (f", op_rules=DEFAULT_OP_RULES.extend(recompute={recompute[side]}))"
                       if rules else ")")
                    + (", jax.nn.dot_product_attention" if side == "jaxamp-fused" else ""))
        r = HandRunner(cfg, params, tx, batch, dt)
        return (r, lambda: r.step.lower(*r.args()), _tree_bytes(r.args()[:4]),
                f"HandCastGPT(dtype={dt}) + jmp loss scaling (float16), clip 1.0")

    for side, dt in JAX_ORDER:
        name = f"{side}/{dt}"
        if _skipped(res, name, deadline):
            continue
        try:
            r, lower, state_bytes, recipe = _build(side, dt)
            t0 = time.perf_counter()  # trace + lower + XLA compile (no state building)
            lowered = lower()
            t1 = time.perf_counter()
            compiled = lowered.compile()
        except Exception as e:  # one variant's failure must not cost the others
            res["variants"][name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            log(f"[gpu] {name}: FAILED to build ({res['variants'][name]['error']})")
            _write(out, res)
            continue
        t2 = time.perf_counter()
        r.step = compiled
        ma = compiled.memory_analysis()
        mad = memory_dict(ma) if ma else None
        runners[name] = r
        res["variants"][name] = {
            "recipe": recipe, "compile_s": t2 - t0, "trace_lower_s": t1 - t0,
            "xla_compile_s": t2 - t1, "memory_analysis": mad,
            "memory_analysis_footprint_bytes": _footprint(mad),
            "state_bytes": state_bytes + _tree_bytes(batch),
            "gemms": summarize(find_gemms(compiled.as_text())),
            "estimate": estimate(compiled, dev)}
        log(f"[gpu] {name}: compiled in {t2 - t0:.1f} s")
        _write(out, res)
    # First steps, smallest footprint first. The allocator's peak cannot be reset, so before
    # each first step the live bytes are padded up to the peak so far (peak_step): the
    # variant's own peak then shows as a rise, even below an earlier variant's.
    order = sorted(runners, key=lambda k: res["variants"][k]["memory_analysis_footprint_bytes"]
                   or 0)
    for name in order:
        v = res["variants"][name]
        t0 = time.perf_counter()
        try:
            rise, source = peak_step(lambda r=runners[name]: r(1),
                                     v["memory_analysis_footprint_bytes"])
        except Exception as e:  # e.g. out of memory: drop this variant, keep the others
            v["error"] = f"first step: {type(e).__name__}: {str(e)[:400]}"
            log(f"[gpu] {name}: FAILED at its first step ({v['error']})")
            del runners[name]
            continue
        v["first_step_s"] = time.perf_counter() - t0
        v["peak_memory_bytes"] = None if rise is None else rise + v["state_bytes"]
        v["peak_memory_source"] = source
    stats = _jax_memory_stats()
    res["process_peak_bytes_in_use"] = (stats or {}).get("peak_bytes_in_use")
    res["recompute_peak_memory"] = recompute_memory(res["variants"])
    _write(out, res)
    time_variants(res, runners, size, "first_step_s", max(size["warmup"] - 1, 0), hard_deadline)
    for name, r in runners.items():
        p = r.state.params if hasattr(r, "state") else r.carry[0]
        res["variants"][name].update(skipped_steps=r.skipped(), params_finite=bool(
            jax.tree_util.tree_reduce(lambda a, x: a and bool(jnp.isfinite(x).all()), p, True)))
    res["metadata"] = metadata("gpu-dry-run" if size is GPU_SIZES["dry"] else "gpu", started)
    res["complete"] = True
    _write(out, res)
    return res


def estimate(compiled, device) -> dict:
    """``jaxamp.gpu_program``'s estimate of a program compiled here, to set beside the measured
    step time (each GPU run checks the instrument again); the H200's rates on CPU."""
    from jaxamp.diagnostics.gpu import GpuProgram

    try:
        target = device if device.platform == "gpu" else "h200"
        prog = GpuProgram.read(compiled, target)
    except Exception as e:  # the estimate must never cost a measurement
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    return {"estimated_ms": 1e3 * prog.estimated_seconds, "kernel_bytes": prog.bytes,
            "launches": prog.launches, "flops": prog.flops, "target": prog.target.source,
            "gemm_libraries": prog.gemm_libraries()}


def recompute_memory(variants: dict) -> dict:
    """Per compute dtype, the jaxamp step's peak and XLA temp bytes with recompute off ("before"
    issue 24) and everywhere ("after": ``jaxamp-recompute``, else the default step), ratios."""
    def temp(v):
        return (v.get("memory_analysis") or {}).get("temp_size_in_bytes")

    out = {}
    for dt in ("bfloat16", "float16"):
        on = variants.get(f"jaxamp-recompute/{dt}") or {}
        on = on if "compile_s" in on else variants.get(f"jaxamp/{dt}") or {}
        off = variants.get(f"jaxamp-norecompute/{dt}") or {}
        if "compile_s" not in on or "compile_s" not in off:
            continue
        out[dt] = {"peak_bytes_before": off.get("peak_memory_bytes"),
                   "peak_bytes_after": on.get("peak_memory_bytes"),
                   "peak_after_over_before": _ratio(on.get("peak_memory_bytes"),
                                                    off.get("peak_memory_bytes")),
                   "temp_bytes_before": temp(off), "temp_bytes_after": temp(on),
                   "temp_after_over_before": _ratio(temp(on), temp(off))}
    return out


def torch_side(size: dict, deadline: float, out: Path | None, hard_deadline: float) -> dict:
    """PyTorch AMP variants in this process (JAX only builds the weights, on the CPU)."""
    import numpy as np
    from _steps import setup
    from gpt import GPTConfig, flops_per_token, param_count

    torch, why = import_torch()
    if torch is None:
        res = {"framework": "torch", "skipped": why, "complete": True}
        _write(out, res)
        return res
    import torch_gpt

    cfg, batch_size = GPTConfig(**size["config"]), size["batch"]
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    compile = size["torch_compile"]
    res: dict = {"framework": "torch", "torch_version": torch.__version__,
                 "device": torch.cuda.get_device_name(0) if cuda else "cpu",
                 "compile": compile, "variants": {}, "complete": False,
                 "inductor_cache": use_fresh_inductor_cache() if compile else None}
    if cuda:
        torch.set_float32_matmul_precision("high")  # TF32 for float32 matmuls, as XLA does
    _, params, batch = setup(cfg, batch_size)
    peak, peak_note = peak_flops(res["device"], "gpu" if cuda else "cpu")
    res.update(params=param_count(params), flops_per_token=flops_per_token(cfg, params),
               peak_flops=peak, peak_note=peak_note,
               float32_matmul_precision=torch.get_float32_matmul_precision())
    batch_np = {k: np.asarray(v) for k, v in batch.items()}
    trainers: dict = {}
    for dt in DTYPES:
        name = f"torch/{dt}"
        if _skipped(res, name, deadline):
            continue
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        try:
            tr = torch_gpt.TorchTrainer(cfg, batch_np, dt, device=device, params=params,
                                        compile=compile)
            first = tr.first()
            t0 = time.perf_counter()
            tr(max(size["warmup"] - 1, 1))
            per_step = (time.perf_counter() - t0) / max(size["warmup"] - 1, 1)
        except Exception as e:  # e.g. a dtype this device's autocast does not support
            res["variants"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            log(f"[gpu] {name}: failed ({res['variants'][name]['error']})")
            continue
        v = {"recipe": "torch.autocast + GradScaler (float16) + clip_grad_norm_(1.0) + AdamW"
                       + (" + torch.compile" if tr.compiled else " (eager)"),
             "compiled": tr.compiled, "compile_error": tr.compile_error,
             "first_step_s": first, "compile_s": first, "warm_step_s": per_step}
        v["peak_memory_bytes"], v["peak_memory_source"] = (
            int(torch.cuda.max_memory_allocated() - before), "torch.cuda.max_memory_allocated "
            "after reset_peak_memory_stats, less memory allocated before") if cuda else (
            None, "no CUDA")
        res["variants"][name] = v
        trainers[name] = tr
        log(f"[gpu] {name}: first step (compile) {first:.1f} s")
        _write(out, res)
    time_variants(res, trainers, size, "warm_step_s", 0, hard_deadline)
    for name, tr in trainers.items():
        res["variants"][name].update(
            final_loss_scale=float(tr.scaler.get_scale()) if tr.scaler.is_enabled() else None,
            last_loss=float(tr.last_loss) if tr.last_loss is not None else None)
    res["complete"] = True
    _write(out, res)
    return res


def side_main(side: str, dry: bool, budget_s: float, out: Path) -> int:
    """Entry of ``run.py --gpu-side {jax,torch}``: one framework, results to ``out``."""
    size = GPU_SIZES["dry" if dry else "gpu"]
    # Leave room for the timing after the last compile: new compiles stop at 70% of the
    # budget, and the timing repeats shrink to what is left (the parent kills at 100%).
    now = time.monotonic()
    (jax_side if side == "jax" else torch_side)(size, now + 0.7 * budget_s, out,
                                                now + 0.95 * budget_s)
    return 0


def _run_side(side: str, dry: bool, budget_s: float, tmp: Path) -> dict:
    """One side in a subprocess with a hard time limit; its (partial) JSON, annotated."""
    out = tmp / f"gpu-{side}.json"
    env = dict(os.environ)
    if side == "torch" or dry:  # torch: JAX only builds the weights, keep it off the GPU
        env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, str(HERE / "run.py"), "--gpu-side", side, "--budget-s",
           f"{budget_s:.0f}", "--json", str(out)] + (["--cpu-dry-run"] if dry else [])
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, timeout=budget_s, stdout=sys.stderr,
                              stderr=sys.stderr)
        status = "ok" if proc.returncode == 0 else f"exit status {proc.returncode}"
    except subprocess.TimeoutExpired:
        status = f"timed out after {budget_s:.0f} s"
    res = json.loads(out.read_text()) if out.exists() else {"variants": {}}
    res["process"] = {"status": status, "wall_s": round(time.perf_counter() - t0, 1),
                      "command": " ".join(cmd[1:])}
    return res


def _ratio(a, b):
    return a / b if (a is not None and b) else None


def gpu_target_values(jax_res: dict, torch_res: dict) -> dict:
    """The five targets' values from the two sides' results (None: not measured)."""
    def tps(res, name, key="tokens_per_s"):
        return (res.get("variants", {}).get(name) or {}).get(key)

    return {
        "bf16_jaxamp_over_torch_amp": _ratio(tps(jax_res, "jaxamp/bfloat16"),
                                             tps(torch_res, "torch/bfloat16")),
        "bf16_jaxamp_over_hand": _ratio(tps(jax_res, "jaxamp/bfloat16"),
                                        tps(jax_res, "hand/bfloat16")),
        "f16_dynamic_over_bf16": _ratio(tps(jax_res, "jaxamp/float16"),
                                        tps(jax_res, "jaxamp/bfloat16")),
        "bf16_peak_memory_vs_f32": _ratio(tps(jax_res, "jaxamp/bfloat16", "peak_memory_bytes"),
                                          tps(jax_res, "jaxamp/float32", "peak_memory_bytes")),
        "bf16_mfu": tps(jax_res, "jaxamp/bfloat16", "mfu"),
    }


def _skipped(res: dict, name: str, deadline: float) -> bool:
    """Whether variant ``name`` is skipped (not selected, or the budget spent); records why."""
    if not selected(name):
        res["variants"][name] = {"skipped": f"not selected ({VARIANTS_ENV})"}
        return True
    if time.monotonic() > deadline:
        res["variants"][name] = {"skipped": "time budget spent before its compile"}
        log(f"[gpu] {name}: skipped (time budget)")
        return True
    return False


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parent_metadata(jax_res: dict, torch_res: dict, dry: bool, started: float) -> dict:
    """The run's metadata; machine and versions as the JAX process saw them."""
    meta = (jax_res.get("metadata") or {}) | run_info("gpu-dry-run" if dry else "gpu", started)
    meta.setdefault("versions", {})["torch"] = torch_res.get("torch_version")
    return meta


def cli(argv: list[str]) -> int:
    """``run.py --gpu`` / ``--gpu-side``; the parent never imports JAX."""
    import argparse

    ap = argparse.ArgumentParser(prog="bench/run.py --gpu")
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--gpu-side", choices=("jax", "torch"), default=None)
    ap.add_argument("--cpu-dry-run", action="store_true")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    json_path = Path(a.json) if a.json else None
    if a.gpu_side:
        return side_main(a.gpu_side, dry_run_requested(a.cpu_dry_run), a.budget_s, json_path)
    gpu_main(dry_run_requested(a.cpu_dry_run), a.budget_s, json_path)
    if json_path:
        print(f"[bench] wrote {json_path}")
    return 0


# The GPU issue's five targets, evaluated on an H100/H200 only (values: gpu_target_values).
GPU_RUN_TARGETS = (
    ("bf16_jaxamp_over_torch_amp", "bf16 tokens/s, jaxamp / PyTorch AMP (torch.compile)",
     ">= 1.0"),
    ("bf16_jaxamp_over_hand", "bf16 tokens/s, jaxamp autocast / hand-written dtype= Flax",
     ">= 0.97"),
    ("f16_dynamic_over_bf16", "f16 (dynamic loss scale) tokens/s / bf16 tokens/s, jaxamp",
     ">= 0.97"),
    ("bf16_peak_memory_vs_f32", "jaxamp bf16 step peak device memory / f32", "<= 0.6"),
    ("bf16_mfu", "jaxamp bf16 step MFU (dense bf16 peak)", ">= 0.40"),
)
GPU_RUN_COMMAND = ("bash bench/gpu.sh OUTDIR  (python bench/run.py --gpu --json "
                   "OUTDIR/results-gpu.json)")


def judge_gpu_targets(values: dict, *, evaluate: bool) -> dict:
    """Each target: value, met, status "met" / "MISSED" / "pending ..." (no Hopper, no value)."""
    out = {}
    for key, what, target in GPU_RUN_TARGETS:
        v = values.get(key) if evaluate else None
        op, bound = target.split()
        met = None if v is None else (v >= float(bound) if op == ">=" else v <= float(bound))
        status = ("pending a Hopper GPU run" if not evaluate else "pending: not measured in "
                  "this run" if v is None else "met" if met else "MISSED")
        out[key] = {"what": what, "target": target, "value": v, "met": met, "status": status,
                    "command": GPU_RUN_COMMAND}
    return out


def gpu_main(dry: bool, budget_s: float, json_path: Path | None) -> dict:
    """``run.py --gpu``: both sides, one subprocess each, then the targets."""
    started = time.perf_counter()
    tmp = Path(json_path).parent if json_path else Path(os.environ.get("TMPDIR", "/tmp"))
    tmp.mkdir(parents=True, exist_ok=True)
    jax_budget = 0.55 * budget_s
    log(f"[gpu] {'CPU DRY RUN (toy size, figures mean nothing)' if dry else 'GPU run'}: "
        f"budget {budget_s:.0f} s (jax {jax_budget:.0f} s, then torch the rest)")
    jax_res = _run_side("jax", dry, jax_budget, tmp)
    torch_budget = max(budget_s - (time.perf_counter() - started), 10.0)
    torch_res = _run_side("torch", dry, torch_budget, tmp)
    for side in ("jax", "torch"):
        (tmp / f"gpu-{side}.json").unlink(missing_ok=True)
    backend = jax_res.get("backend")
    hopper = backend == "gpu" and any(k in (jax_res.get("device") or "")
                                      for k in ("H100", "H200"))
    values = gpu_target_values(jax_res, torch_res)
    res = {"dry_run": dry, "config": jax_res.get("config"), "jax": jax_res, "torch": torch_res,
           "targets": judge_gpu_targets(values, evaluate=hopper and not dry),
           "metadata": parent_metadata(jax_res, torch_res, dry, started) | {
               "budget_s": budget_s}}
    _write(json_path, res)
    print_gpu_table(res)
    return res


def gpu_rows(res: dict) -> list[list[str]]:
    rows = []
    variants = {k: v for side in ("jax", "torch")
                for k, v in ((res.get(side) or {}).get("variants") or {}).items()}
    for name, v in variants.items():
        if "tokens_per_s" not in v:
            rows.append([name, "-", "-", "-", "-", "-", "-", v.get("skipped") or v.get("error")
                         or "not timed"])
            continue
        mem = v.get("peak_memory_bytes")
        est = (v.get("estimate") or {}).get("estimated_ms")
        rows.append([name, f"{v['step_ms']:.1f}", "-" if est is None else f"{est:.1f}",
                     f"{v['tokens_per_s']:,.0f}",
                     "n/a" if v.get("mfu") is None else f"{100 * v['mfu']:.1f}%",
                     "n/a" if mem is None else f"{mem / 2**30:.2f} GiB",
                     f"{v.get('compile_s', 0):.1f}", v.get("recipe", "")])
    return rows


GPU_HEADER = ["variant", "step ms", "est. ms", "tokens/s", "MFU", "peak memory", "compile s",
              "recipe"]


def print_gpu_table(res: dict) -> None:
    print(("CPU DRY RUN: " if res["dry_run"] else "") + "gpt2-small-shape train step "
          f"{res.get('config')}")
    rows = [GPU_HEADER] + gpu_rows(res)
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(GPU_HEADER) - 1)]
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1])
    for key, t in (res.get("targets") or {}).items():
        if isinstance(t, dict):  # {"error": ...} where the targets could not be judged
            print(f"target {key}: {t['what']} {t['target']}: "
                  f"{'n/a' if t['value'] is None else format(t['value'], '.3f')} -> "
                  f"{t['status']}")
