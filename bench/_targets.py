"""The targets: the CPU ratios' bounds, and the Hopper (H100/H200) ``--full`` targets,
evaluated only on such a run and "pending" elsewhere."""

from __future__ import annotations

TARGETS = {
    "amp_step_runtime_ratio": 1.02,
    "amp_step_compile_ratio": 1.25,
    "trace_compile_ratio_amp_vs_plain": 1.3,
}
# (--full; the GPU issue's run is bench/gpu.sh, which writes bench/results-gpu.json.)
GPU_COMMAND = "python bench/run.py --full --json bench/results-gpu-full.json"
# Targets for the --full run on a Hopper GPU (H100/H200); evaluated only there.
GPU_TARGETS = (
    ("bf16_jaxamp_over_torch_amp", "bf16 tokens/s, jaxamp / torch AMP", ">= 1.0"),
    ("f16_dynamic_over_bf16", "f16 (dynamic loss scale) tokens/s / bf16 tokens/s", ">= 0.97"),
    ("bf16_peak_memory_vs_f32", "bf16 AMP step peak memory / f32", "<= 0.6"),
    ("bf16_mfu", "bf16 AMP step MFU", ">= 0.40"),
)


def gpu_targets(res: dict) -> dict:
    """The Hopper targets: evaluated on an H100/H200 ``--full`` run, else pending."""
    import jax  # here: ``run.py --gpu``'s parent process must not start JAX at all

    kind = jax.devices()[0].device_kind
    hopper = jax.default_backend() == "gpu" and any(k in kind for k in ("H100", "H200"))
    values: dict = dict.fromkeys(k for k, _, _ in GPU_TARGETS)
    if hopper:
        peer, tp = res.get("peer", {}), res.get("throughput", {})
        mem = res.get("memory_bytes", {})
        values["bf16_jaxamp_over_torch_amp"] = peer.get("ratio_jaxamp_over_torch", {}).get(
            "bfloat16")
        if tp:
            values["f16_dynamic_over_bf16"] = (tp["float16"]["tokens_per_s"]
                                               / tp["bfloat16"]["tokens_per_s"])
            values["bf16_mfu"] = tp["bfloat16"]["mfu"]
        peaks = {k: (v or {}).get("peak_memory_in_bytes") for k, v in mem.items()}
        if peaks.get("float32") and peaks.get("bfloat16"):
            values["bf16_peak_memory_vs_f32"] = peaks["bfloat16"] / peaks["float32"]
    out = {}
    for key, what, target in GPU_TARGETS:
        v = values[key]
        op, bound = target.split()
        met = None if v is None else (v >= float(bound) if op == ">=" else v <= float(bound))
        out[key] = {"what": what, "target": target, "value": v, "met": met,
                    "status": "pending a Hopper GPU run" if v is None
                    else ("met" if met else "MISSED"), "command": GPU_COMMAND}
    return out


def verdict(key: str, value: float) -> str:
    if key in TARGETS:
        return "met" if value <= TARGETS[key] else "MISSED"
    return ""


# The GPU issue's five targets for ``run.py --gpu`` (bench/gpu.sh), evaluated on an H100/H200
# only; ``_gpu.gpu_target_values`` computes the values.
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
    """Each target: value, met, and status "met" / "MISSED" / "pending ..." (not a Hopper GPU
    run, or the value was not measured)."""
    out = {}
    for key, what, target in GPU_RUN_TARGETS:
        v = values.get(key) if evaluate else None
        op, bound = target.split()
        met = None if v is None else (v >= float(bound) if op == ">=" else v <= float(bound))
        if not evaluate:
            status = "pending a Hopper GPU run"
        elif v is None:
            status = "pending: not measured in this run"
        else:
            status = "met" if met else "MISSED"
        out[key] = {"what": what, "target": target, "value": v, "met": met, "status": status,
                    "command": GPU_RUN_COMMAND}
    return out
