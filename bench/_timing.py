"""Interleaved timing: variants alternate within each repeat (the order flips every repeat), so
machine noise hits every side alike; medians and per-repeat ratios of the samples."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable

import jax
import numpy as np


def interleaved_runtime(runners: dict[str, Callable[[int], None]], *, repeats: int,
                        steps: int, warmup: int) -> tuple[dict, dict]:
    """Seconds per step of each runner, per repeat: (wall-clock, process CPU time). Runners
    alternate and the order flips each repeat. CPU time (all threads of this process) is less
    disturbed by other processes competing for the cores than wall-clock time."""
    for run in runners.values():
        run(warmup)
    names = list(runners)
    wall: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            gc.collect()
            c0, t0 = time.process_time(), time.perf_counter()
            runners[name](steps)
            t1, c1 = time.perf_counter(), time.process_time()
            wall[name].append((t1 - t0) / steps)
            cpu[name].append((c1 - c0) / steps)
    return wall, cpu


def interleaved_compile(builders: dict[str, Callable[[], object]], *, repeats: int,
                        on_first: Callable[[str, object, object], None] | None = None
                        ) -> dict[str, dict[str, list[float]]]:
    """Fresh ``lower`` + ``compile`` wall times; ``builders[k]()`` returns a Lowered object
    built from a fresh ``jax.jit`` (tracing happens inside it). ``on_first(name, lowered,
    compiled)`` runs after the first repeat's compile of each variant, outside the timing."""
    names = list(builders)
    out = {k: {"lower_s": [], "compile_s": [], "total_s": []} for k in names}
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            jax.clear_caches()
            gc.collect()
            t0 = time.perf_counter()
            lowered = builders[name]()
            t1 = time.perf_counter()
            compiled = lowered.compile()
            t2 = time.perf_counter()
            out[name]["lower_s"].append(t1 - t0)
            out[name]["compile_s"].append(t2 - t1)
            out[name]["total_s"].append(t2 - t0)
            if r == 0 and on_first is not None:
                on_first(name, lowered, compiled)
    return out


def med(xs) -> float:
    return float(statistics.median(xs))


def paired_ratio(num: list[float], den: list[float]) -> float:
    """Median over repeats of the ratio within each repeat (cancels slow load drift)."""
    return med([a / b for a, b in zip(num, den, strict=True)])


def paired_iqr(num: list[float], den: list[float]) -> list[float]:
    ratios = [a / b for a, b in zip(num, den, strict=True)]
    return [float(np.percentile(ratios, 25)), float(np.percentile(ratios, 75))]


def ratio_ci(num: list[float], den: list[float], *, level: float = 0.95,
             resamples: int = 2000, seed: int = 0) -> list[float]:
    """Bootstrap interval of ``median(num) / median(den)``: the repeats (pairs of samples
    taken side by side) resampled with replacement, ``level`` percentile interval. Seeded, so
    the same samples give the same interval. It is the spread this run's own samples allow;
    a shared machine's drift between runs comes on top of it (BENCHMARKS.md: a cell read
    1.057 [1.019-1.094] in one run and 1.020 in the next)."""
    a, b = np.asarray(num, float), np.asarray(den, float)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"ratio_ci: num and den must be equally long non-empty sample lists, "
                         f"got {a.shape} and {b.shape}")
    idx = np.random.default_rng(seed).integers(0, a.size, (resamples, a.size))
    ratios = np.median(a[idx], axis=1) / np.median(b[idx], axis=1)
    tail = (1.0 - level) / 2 * 100
    return [float(np.percentile(ratios, tail)), float(np.percentile(ratios, 100 - tail))]


def compile_summary(comp: dict) -> dict:
    return {k: {"lower": med(v["lower_s"]), "xla_compile": med(v["compile_s"]),
                "total": med(v["total_s"])} for k, v in comp.items()}
