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


def pair(loss) -> dict:
    """The plain and the autocast (float16) ``value_and_grad`` of ``loss(params, x)``."""
    return {"plain": jax.value_and_grad(loss),
            "autocast": jax.value_and_grad(jaxamp.autocast(loss, F16_POLICY))}


def gpt_fns(cfg: GPTConfig, batch: int):
    """:func:`pair` of the bench GPT's loss, abstract params and batch."""
    model = GPT(cfg)
    ids = jax.ShapeDtypeStruct((1, cfg.seq), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), ids)["params"]
    toks = jax.ShapeDtypeStruct((batch, cfg.seq), jnp.int32)
    return pair(lambda p, b: lm_loss(model.apply, p, b)), params, {"inputs": toks,
                                                                   "targets": toks}


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
    """:func:`pair` of :func:`nested_loss`, abstract params and input."""
    params = {"w": jax.ShapeDtypeStruct((width, width), jnp.float32)}
    return pair(nested_loss(depth)), params, jax.ShapeDtypeStruct((8, width), jnp.float32)


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


def compare(fns: dict, params, b, repeats: int) -> dict:
    """Medians of :func:`time_once` (``{plain,autocast}_{trace,lower,cpu}_s``, ``_s``: trace +
    lower), per-repeat ratios, and :func:`call_count` of each."""
    names, parts = list(fns), ("trace", "lower", "cpu")
    samples = {k: {m: [] for m in parts} for k in names}
    for name in names:  # warm-up: imports, first-use caches
        time_once(fns[name], params, b)
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            for m, t in zip(parts, time_once(fns[name], params, b)):
                samples[name][m].append(t)
    med = statistics.median
    for v in samples.values():
        v["total"] = [a + c for a, c in zip(v["trace"], v["lower"])]
    out = {}
    for k in names:
        out |= {f"{k}_calls": call_count(fns[k], params, b), f"{k}_s": med(samples[k]["total"]),
                **{f"{k}_{m}_s": med(samples[k][m]) for m in parts}}
    amp, plain = samples["autocast"], samples["plain"]
    return out | {"calls_ratio": out["autocast_calls"] / out["plain_calls"],
                  "ratio": med([a / p for a, p in zip(amp["total"], plain["total"])]),
                  "cpu_ratio": med([a / p for a, p in zip(amp["cpu"], plain["cpu"])])}


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
    deep = a.model == "nested"
    print("| depth | evaluations of the busiest jaxpr | plain s | autocast s |" if deep else
          "| layers | plain s (trace+lower) | autocast s (trace+lower) |",
          "ratio | CPU-time ratio | calls ratio |")
    print("|---" * (7 if deep else 6) + "|")
    rows = []
    for n in a.depth if deep else a.layers:
        if deep:
            fns, params, x = nested(n)
            row = {"depth": n, "evaluations": evaluations(fns["autocast"], params, x),
                   **compare(fns, params, x, a.repeats)}
            cells = (f"| {n} | {row['evaluations']} | {row['plain_s']:.3f} | "
                     f"{row['autocast_s']:.3f}")
        else:
            cfg = GPTConfig(layers=n, d_model=a.d_model, heads=a.heads, seq=a.seq, vocab=a.vocab)
            row = {"layers": n, **compare(*gpt_fns(cfg, a.batch), a.repeats)}
            cells = (f"| {n} | {row['plain_s']:.2f} ({row['plain_trace_s']:.2f}+"
                     f"{row['plain_lower_s']:.2f}) | {row['autocast_s']:.2f} "
                     f"({row['autocast_trace_s']:.2f}+{row['autocast_lower_s']:.2f})")
        rows.append(row)
        print(f"{cells} | {row['ratio']:.2f}x | {row['cpu_ratio']:.2f}x | "
              f"{row['calls_ratio']:.3f}x |", flush=True)
    print(json.dumps({"jax": jax.__version__, "model": a.model, "rows": rows}))


if __name__ == "__main__":
    main()
