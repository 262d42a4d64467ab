"""Tokens/s of the AMP step per compute dtype, and model FLOPs utilization (MFU) where the
device's peak is known (``--full``)."""

from __future__ import annotations

import jax
from _steps import POLICIES, AmpRunner, make_tx, setup
from _timing import interleaved_runtime, med
from gpt import GPTConfig, flops_per_token

import jaxamp

# Dense bf16/f16 tensor-core peak FLOP/s per device (no sparsity), matched on device_kind.
PEAK_FLOPS = (("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("L4", 121e12),
              ("A10", 125e12), ("V100", 125e12))


def device_peak_flops() -> float | None:
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return None
    return next((p for key, p in PEAK_FLOPS if key.lower() in dev.device_kind.lower()), None)


def throughput_summary(cfg: GPTConfig, batch_size: int, params, times: dict,
                       runners: dict) -> dict:
    """tokens/s and MFU per policy name from ``interleaved_runtime`` seconds per step."""
    tokens = batch_size * cfg.seq
    fpt = flops_per_token(cfg, params)
    peak = device_peak_flops()
    out: dict = {"flops_per_token": fpt, "peak_flops": peak,
                 "device_kind": jax.devices()[0].device_kind}
    for name in POLICIES:
        tps = tokens / med(times[name])
        out[name] = {"step_ms": med(times[name]) * 1e3, "tokens_per_s": tps,
                     "mfu": (fpt * tps / peak) if peak else None,
                     "skipped_steps": runners[name].skipped()}
    return out


def measure_throughput(cfg: GPTConfig, batch_size: int, *, repeats: int, steps: int,
                       warmup: int) -> dict:
    """tokens/s of the AMP step per compute dtype, and MFU where the device peak is known."""
    model, params, batch = setup(cfg, batch_size)
    tx = make_tx()
    runners = {name: AmpRunner(model, params, tx, batch, policy,
                               jaxamp.default_loss_scale(policy))
               for name, policy in POLICIES.items()}
    times, _ = interleaved_runtime(runners, repeats=repeats, steps=steps, warmup=warmup)
    return throughput_summary(cfg, batch_size, params, times, runners)
