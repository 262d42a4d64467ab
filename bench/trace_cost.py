"""Trace + lower cost of ``jax.value_and_grad`` under autocast vs plain float32, by depth.

Two models: the bench GPT by number of layers (``--model gpt``), and
``checkpoint(scan(cond(...)))`` nested 1..N deep (``--model nested --depth 1 2 3 4``), the
control flow whose cost used to grow as 4^depth; for ``nested`` the table also gives how often
the engine evaluated its busiest jaxpr (bounded independent of depth). (transformers'
``FlaxGPT2LMHeadModel``, ``--model hf-gpt2``: ``git show a1e47fe:bench/trace_cost.py``.)

Abstract params: the 124M shapes (d=768, 12 heads, vocab 50257, batch 8 x 1024) cost no memory.
Each repeat times a fresh ``jax.jit(...).trace`` and ``.lower()`` of both variants, interleaved,
after ``jax.clear_caches()``: medians and the median per-repeat ratio, of wall-clock and of
process CPU time. "calls ratio": the Python function calls of one more trace + lower of each
(cProfile's count), the same on every run to a few in 10^5: the work, free of the machine's
noise.

    python bench/trace_cost.py --layers 2 6 12 --repeats 5
    python bench/trace_cost.py --model nested --depth 1 2 3 4 --repeats 25
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import statistics
import time

import jax
import jax.numpy as jnp
from gpt import GPT, GPTConfig, lm_loss
from jax import lax

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


def nested_loss(depth: int):
    """``(p, x) -> scalar``: ``checkpoint(scan(cond(inner)))`` nested ``depth`` deep around a
    tanh layer (``tests/test_engine_rules.py`` counts its evaluations)."""
    def inner(x, w):
        return jnp.tanh(x @ w) * 0.5 + x

    f = inner
    for _ in range(depth):
        def level(x, w, g=f):
            def body(c, _):
                return lax.cond(c.sum() > 0, lambda c: g(c, w), lambda c: c * 0.5, c), None
            return jax.checkpoint(lambda x: lax.scan(body, x, None, length=2)[0])(x)
        f = level
    return lambda p, x: f(x, p["w"]).sum()


def nested(depth: int, width: int = 256):
    """The plain and autocast ``value_and_grad`` of :func:`nested_loss` and abstract inputs."""
    plain = nested_loss(depth)
    amp = jaxamp.autocast(plain, F16_POLICY)
    params = {"w": jax.ShapeDtypeStruct((width, width), jnp.float32)}
    x = jax.ShapeDtypeStruct((8, width), jnp.float32)
    return {"plain": jax.value_and_grad(plain), "autocast": jax.value_and_grad(amp)}, params, x


def evaluations(fn, *args) -> int:
    """How often the engine evaluated its most-evaluated jaxpr while tracing ``fn``."""
    jax.clear_caches()
    with jaxamp.engine.counting_evaluations() as counts:
        jax.jit(fn).trace(*args)
    return max(counts.values())


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


def call_count(fn, params, batch) -> int:
    """Python function calls (cProfile's count) of a fresh ``jax.jit(fn)`` trace + lower: the
    same on every run (after a first one has filled the caches of first use), so a ratio of
    two is free of the machine's noise."""
    jax.clear_caches()
    gc.collect()
    prof = cProfile.Profile()
    prof.enable()
    jax.jit(fn).trace(params, batch).lower()
    prof.disable()
    return pstats.Stats(prof).total_calls


def measure(cfg: GPTConfig, batch: int, repeats: int) -> dict:
    model, params, b = specs(cfg, batch)
    return {"layers": cfg.layers, **compare(builders(model), params, b, repeats)}


def compare(fns: dict, params, b, repeats: int) -> dict:
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
    calls = {name: call_count(fns[name], params, b) for name in names}
    return {
        "plain_calls": calls["plain"], "autocast_calls": calls["autocast"],
        "calls_ratio": calls["autocast"] / calls["plain"],
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
    ap.add_argument("--model", choices=["gpt", "nested"], default="gpt")
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 6, 12])
    ap.add_argument("--depth", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--batch", type=int, default=8)
    a = ap.parse_args()
    if a.model == "nested":
        return main_nested(a)
    rows = []
    print("| layers | plain s (trace+lower) | autocast s (trace+lower) | ratio | CPU-time ratio | "
          "calls ratio |")
    print("|---|---|---|---|---|---|")
    for n in a.layers:
        cfg = GPTConfig(layers=n, d_model=a.d_model, heads=a.heads, seq=a.seq, vocab=a.vocab)
        row = measure(cfg, a.batch, a.repeats)
        rows.append(row)
        print(f"| {n} | {row['plain_s']:.2f} ({row['plain_trace_s']:.2f}+"
              f"{row['plain_lower_s']:.2f}) | {row['autocast_s']:.2f} "
              f"({row['autocast_trace_s']:.2f}+{row['autocast_lower_s']:.2f}) | "
              f"{row['ratio']:.2f}x | {row['cpu_ratio']:.2f}x | {row['calls_ratio']:.3f}x |",
              flush=True)
    print(json.dumps({"jax": jax.__version__, "model": a.model, "rows": rows}))


def main_nested(a) -> None:
    rows = []
    print("| depth | evaluations of the busiest jaxpr | plain s | autocast s | ratio | "
          "CPU-time ratio | calls ratio |")
    print("|---|---|---|---|---|---|---|")
    for depth in a.depth:
        fns, params, x = nested(depth)
        row = {"depth": depth, "evaluations": evaluations(fns["autocast"], params, x),
               **compare(fns, params, x, a.repeats)}
        rows.append(row)
        print(f"| {depth} | {row['evaluations']} | {row['plain_s']:.3f} | "
              f"{row['autocast_s']:.3f} | {row['ratio']:.2f}x | {row['cpu_ratio']:.2f}x | "
              f"{row['calls_ratio']:.3f}x |", flush=True)
    print(json.dumps({"jax": jax.__version__, "model": "nested", "rows": rows}))


if __name__ == "__main__":
    main()
