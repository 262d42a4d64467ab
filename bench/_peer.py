"""Section 5, the peer: the same GPT in PyTorch (``bench/torch_gpt.py``, same weights and
batch) trained with ``torch.autocast`` + ``GradScaler``, its steps interleaved with jaxamp's
AMP steps. PyTorch is optional: without it the section is ``{"skipped": ...}``."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from collections.abc import Callable

import jax
import numpy as np
from _steps import AMP_EXECUTABLES, POLICIES, AmpRunner, log, make_tx, setup
from _throughput import device_peak_flops
from _timing import interleaved_runtime, med, paired_ratio
from gpt import GPTConfig, flops_per_token, lm_loss, param_count

import jaxamp

NO_TORCH_ENV = "JAXAMP_BENCH_NO_TORCH"  # set (non-empty, not "0"): behave as if torch is missing
PEER_SKIPPED = "torch not installed"


def import_torch():
    """``(torch, None)``, or ``(None, why)`` when PyTorch cannot be imported (or the
    ``JAXAMP_BENCH_NO_TORCH`` environment variable asks to behave as if it could not)."""
    if os.environ.get(NO_TORCH_ENV, "") not in ("", "0"):
        return None, f"{NO_TORCH_ENV}={os.environ[NO_TORCH_ENV]} is set"
    try:
        import torch
    except Exception as e:  # ImportError, or a broken install (OSError from a shared library)
        return None, f"import torch failed: {type(e).__name__}: {e}"
    return torch, None


def use_fresh_inductor_cache() -> str:
    """A fresh inductor cache unless the environment names one: torch.compile's first step is
    then a cold compile on every run, as jax.jit's is (JAX's persistent compilation cache is
    off by default). Returns what was done, for the JSON."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return "TORCHINDUCTOR_CACHE_DIR from the environment (may be warm)"
    cache = tempfile.mkdtemp(prefix="jaxamp-bench-inductor-")
    atexit.register(shutil.rmtree, cache, ignore_errors=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    return "fresh temporary TORCHINDUCTOR_CACHE_DIR (cold compile)"


def host_threads() -> int:
    """CPUs this process may run on: the size XLA:CPU gives its intra-op thread pool
    (``tsl::port::MaxParallelism``, from the scheduler affinity mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def measure_peer(cfg: GPTConfig, batch_size: int, *, dtypes: tuple[str, ...], repeats: int,
                 steps: int, warmup: int, compile: bool, aot: bool = False
                 ) -> tuple[dict, dict, dict]:
    """jaxamp's AMP step vs PyTorch AMP on the same GPT, weights and batch, interleaved.

    Returns ``(peer, jaxamp_runners, jaxamp_times)``; the last two (by policy name) let
    ``--full`` derive its throughput table from the same run. ``aot``: time the AMP step
    executables compiled by the earlier sections (``--smoke``).
    """
    torch, why = import_torch()
    if torch is None:
        print(f"[bench] peer: PyTorch side skipped, {PEER_SKIPPED} ({why}); "
              f"install it with: pip install torch==2.13.0")
        return {"skipped": PEER_SKIPPED}, {}, {}
    import torch_gpt

    inductor_cache = use_fresh_inductor_cache() if compile else None
    model, params, batch = setup(cfg, batch_size)
    tx = make_tx()
    cuda = jax.default_backend() == "gpu" and torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    threads = host_threads()
    if cuda:
        # XLA's default float32 matmul precision on NVIDIA GPUs allows TF32; match it.
        torch.set_float32_matmul_precision("high")
        threads_note = "CUDA device; torch.set_float32_matmul_precision('high') (TF32, as XLA)"
    else:
        torch.set_num_threads(threads)
        threads_note = (f"torch.set_num_threads({threads}): the CPUs in this process's affinity "
                        f"mask, which is what XLA:CPU sizes its intra-op thread pool to")
    torch_params = torch_gpt.param_count(torch_gpt.TorchGPT(cfg))
    assert torch_params == param_count(params), (
        f"bench/torch_gpt.py has {torch_params} parameters, bench/gpt.py {param_count(params)}")
    batch_np = {k: np.asarray(v) for k, v in batch.items()}
    f32_loss = jax.jit(lambda p, b: lm_loss(model.apply, p, b))

    runners: dict[str, Callable[[int], None]] = {}
    first_s: dict = {"jaxamp": {}, "torch": {}}
    unsupported: dict = {}
    compile_errors: dict = {}
    trainers = {}
    for dt in dtypes:
        policy, compiled = POLICIES[dt], None
        if aot and (cfg, batch_size, dt) in AMP_EXECUTABLES:
            compiled, tx = AMP_EXECUTABLES[(cfg, batch_size, dt)]
        amp = AmpRunner(model, params, tx, batch, policy, jaxamp.default_loss_scale(policy))
        if compiled is not None:
            amp.step = compiled
        t0 = time.perf_counter()
        amp(1)  # compile (jitted steps) + one step
        first_s["jaxamp"][dt] = time.perf_counter() - t0
        runners[f"jaxamp/{dt}"] = amp
        log(f"[bench] peer: jaxamp {dt} first step {first_s['jaxamp'][dt]:.1f} s")
        try:
            tr = torch_gpt.TorchTrainer(cfg, batch_np, dt, device=device, params=params,
                                        compile=compile)
            first_s["torch"][dt] = tr.first()
        except Exception as e:  # e.g. a dtype the device's autocast does not support
            unsupported[dt] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            log(f"[bench] peer: torch {dt} unsupported here ({unsupported[dt]})")
            continue
        if tr.compile_error:
            compile_errors[dt] = tr.compile_error
        trainers[dt] = tr
        runners[f"torch/{dt}"] = tr
        log(f"[bench] peer: torch {dt} ({'compiled' if tr.compiled else 'eager'}) first step "
            f"{first_s['torch'][dt]:.1f} s")
    times, _ = interleaved_runtime(runners, repeats=repeats, steps=steps,
                                   warmup=max(warmup - 1, 0))
    total_steps = 1 + max(warmup - 1, 0) + repeats * steps
    tokens = batch_size * cfg.seq
    tps: dict = {"jaxamp": {}, "torch": {}}
    step_ms: dict = {"jaxamp": {}, "torch": {}}
    ratio, ratio_paired, ratio_min = {}, {}, {}
    loss_after: dict = {"jaxamp": {}, "torch": {}}
    for dt in dtypes:
        jt = times[f"jaxamp/{dt}"]
        tps["jaxamp"][dt] = tokens / med(jt)
        step_ms["jaxamp"][dt] = med(jt) * 1e3
        loss_after["jaxamp"][dt] = float(f32_loss(runners[f"jaxamp/{dt}"].state.params, batch))
        if dt in trainers:
            tt = times[f"torch/{dt}"]
            tps["torch"][dt] = tokens / med(tt)
            step_ms["torch"][dt] = med(tt) * 1e3
            ratio[dt] = tps["jaxamp"][dt] / tps["torch"][dt]
            ratio_paired[dt] = paired_ratio(tt, jt)  # per repeat: torch time / jaxamp time
            ratio_min[dt] = min(tt) / min(jt)  # stalls only add time: the best steps
            loss_after["torch"][dt] = trainers[dt].eval_loss()
        else:
            tps["torch"][dt] = step_ms["torch"][dt] = None
            ratio[dt] = ratio_paired[dt] = ratio_min[dt] = None
            loss_after["torch"][dt] = None
    compiled = compile and bool(trainers) and all(t.compiled for t in trainers.values())
    if not compile:
        compile_note = ("eager: torch.compile not tried in this mode (its CPU compile, about "
                        "30-40 s per dtype, does not fit the mode's time budget)")
    elif compiled:
        compile_note = "torch.compile(model) (inductor), default mode"
    else:
        compile_note = "torch.compile failed, eager fallback: " + "; ".join(
            f"{k}: {v}" for k, v in compile_errors.items())
    peak = device_peak_flops()
    fpt = flops_per_token(cfg, params)
    peer = {
        "torch_version": torch.__version__,
        "compiled": compiled,
        "compiled_by_dtype": {dt: trainers[dt].compiled for dt in trainers},
        "compile_note": compile_note,
        "compile_errors": compile_errors,
        "inductor_cache": inductor_cache,
        "device": (f"cuda ({torch.cuda.get_device_name(0)})" if cuda else "cpu"),
        "torch_num_threads": torch.get_num_threads(),
        "threads_note": threads_note,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "torch_cpu_native": None if cuda else cpu_native(torch),
        "dtypes": list(dtypes),
        "unsupported": unsupported,
        "params": {"jaxamp": param_count(params), "torch": torch_params},
        "recipe": {"jaxamp": "jaxamp.make_train_step(policy, clip_norm=1.0), loss scale "
                             "jaxamp.default_loss_scale(policy), optax.adamw(1e-3)",
                   "torch": "torch.autocast(device, dtype) around forward + float32 loss; "
                            "GradScaler (float16 only): scale(loss).backward(), unscale_, "
                            "clip_grad_norm_(1.0), step, update; AdamW(lr=1e-3, "
                            "weight_decay=1e-4)"},
        "steps_per_variant": total_steps,
        "first_step_s": first_s,
        "step_ms": step_ms,
        "tokens_per_s": tps,
        "mfu": {side: {dt: (fpt * v / peak if (peak and v) else None) for dt, v in d.items()}
                for side, d in tps.items()},
        "ratio_jaxamp_over_torch": ratio,
        "ratio_jaxamp_over_torch_paired": ratio_paired,
        "ratio_jaxamp_over_torch_min": ratio_min,
        "loss_at_init_float32": {"jaxamp": float(f32_loss(params, batch)),
                                 "torch": torch_gpt.TorchTrainer(
                                     cfg, batch_np, "float32", device=device,
                                     params=params).eval_loss()},
        "loss_after_float32_eval": loss_after,
        "torch_final_loss_scale": {dt: float(t.scaler.get_scale()) for dt, t in trainers.items()
                                   if t.scaler.is_enabled()},
        "jaxamp_skipped_steps": {dt: runners[f"jaxamp/{dt}"].skipped() for dt in dtypes},
        "runtime_samples_ms": {k: [round(t * 1e3, 3) for t in v] for k, v in times.items()},
    }
    jax_runners = {dt: runners[f"jaxamp/{dt}"] for dt in dtypes}
    jax_times = {dt: times[f"jaxamp/{dt}"] for dt in dtypes}
    return peer, jax_runners, jax_times


def cpu_native(torch) -> dict:
    """Whether PyTorch's oneDNN has native bfloat16/float16 kernels on this CPU."""
    out = {}
    for name, fn in (("bfloat16", "_is_mkldnn_bf16_supported"),
                     ("float16", "_is_mkldnn_fp16_supported")):
        try:
            out[name] = bool(getattr(torch.ops.mkldnn, fn)())
        except Exception:  # private API: absent in some builds
            out[name] = None
    return out
