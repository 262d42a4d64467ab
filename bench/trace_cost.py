"""Trace + lower cost of ``jax.value_and_grad`` under autocast vs plain float32, by depth.

Abstract params (``jax.ShapeDtypeStruct``): tracing and lowering do not touch the data, so the
124M shapes (d=768, 12 heads, vocab 50257, batch 8 x 1024) cost no memory. Each repeat times a
fresh ``jax.jit(...).trace`` and ``.lower()`` of both variants, interleaved (order flipped every
repeat) after ``jax.clear_caches()``; the table reports medians and the median per-repeat ratio,
of wall-clock time and of process CPU time (trace and lower are single-threaded Python, so CPU
time is the figure least disturbed by other processes on a shared machine).

    python bench/trace_cost.py --layers 2 6 12 --repeats 5
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import jax
import jax.numpy as jnp
from gpt import GPT, GPTConfig, lm_loss

import jaxamp

F16_POLICY = "params=float32,compute=float16,output=float32"


def specs(cfg: GPTConfig, batch: int):
    model = GPT(cfg)
    ids = jax.ShapeDtypeStruct((1, cfg.seq), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), ids)["params"]
    toks = jax.ShapeDtypeStruct((batch, cfg.seq), jnp.int32)
    return model, params, {"inputs": toks, "targets": toks}


def builders(model, policy=F16_POLICY):
    def plain(p, b):
        return lm_loss(model.apply, p, b)

    amp = jaxamp.autocast(plain, policy)
    return {"plain": jax.value_and_grad(plain), "autocast": jax.value_and_grad(amp)}


def time_once(fn, params, batch) -> tuple[float, float, float]:
    """(trace s, lower s, process CPU s of both) of a fresh ``jax.jit(fn)``."""
    jax.clear_caches()
    gc.collect()
    c0, t0 = time.process_time(), time.perf_counter()
    traced = jax.jit(fn).trace(params, batch)
    t1 = time.perf_counter()
    traced.lower()
    t2, c2 = time.perf_counter(), time.process_time()
    return t1 - t0, t2 - t1, c2 - c0


def measure(cfg: GPTConfig, batch: int, repeats: int) -> dict:
    model, params, b = specs(cfg, batch)
    fns = builders(model)
    names = list(fns)
    samples = {k: {"trace": [], "lower": [], "cpu": []} for k in names}
    for name in names:  # warm-up: imports, first-use caches
        time_once(fns[name], params, b)
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            tr, lo, cpu = time_once(fns[name], params, b)
            samples[name]["trace"].append(tr)
            samples[name]["lower"].append(lo)
            samples[name]["cpu"].append(cpu)
    med = statistics.median
    tot = {k: [a + c for a, c in zip(v["trace"], v["lower"])] for k, v in samples.items()}
    return {
        "layers": cfg.layers,
        "plain_s": med(tot["plain"]), "autocast_s": med(tot["autocast"]),
        "plain_trace_s": med(samples["plain"]["trace"]),
        "plain_lower_s": med(samples["plain"]["lower"]),
        "autocast_trace_s": med(samples["autocast"]["trace"]),
        "autocast_lower_s": med(samples["autocast"]["lower"]),
        "ratio": med([a / p for a, p in zip(tot["autocast"], tot["plain"])]),
        "plain_cpu_s": med(samples["plain"]["cpu"]),
        "autocast_cpu_s": med(samples["autocast"]["cpu"]),
        "cpu_ratio": med([a / p for a, p in zip(samples["autocast"]["cpu"],
                                                samples["plain"]["cpu"])]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 6, 12])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--batch", type=int, default=8)
    a = ap.parse_args()
    rows = []
    print("| layers | plain s (trace+lower) | autocast s (trace+lower) | ratio | CPU-time ratio |")
    print("|---|---|---|---|---|")
    for n in a.layers:
        cfg = GPTConfig(layers=n, d_model=a.d_model, heads=a.heads, seq=a.seq, vocab=a.vocab)
        row = measure(cfg, a.batch, a.repeats)
        rows.append(row)
        print(f"| {n} | {row['plain_s']:.2f} ({row['plain_trace_s']:.2f}+"
              f"{row['plain_lower_s']:.2f}) | {row['autocast_s']:.2f} "
              f"({row['autocast_trace_s']:.2f}+{row['autocast_lower_s']:.2f}) | "
              f"{row['ratio']:.2f}x | {row['cpu_ratio']:.2f}x |", flush=True)
    print(json.dumps({"jax": jax.__version__, "rows": rows}))


if __name__ == "__main__":
    main()
