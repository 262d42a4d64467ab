"""Section 1 (and 4): what the AMP machinery costs. ``jaxamp.make_train_step`` (float16
compute, ``DynamicLossScale``, ``clip_norm=1.0``) against a plain step with the same autocast
forward: step runtime and compile ratios, the HLO they differ by, and the same ratios at
several depths (``scaling``)."""

from __future__ import annotations

import time

from _hlo import hlo_diff
from _memory import memory_dict
from _steps import (
    AMP_EXECUTABLES,
    F16_POLICY,
    AmpRunner,
    BaselineRunner,
    make_amp_step,
    make_baseline_step,
    make_tx,
    setup,
)
from _timing import (
    compile_summary,
    interleaved_compile,
    interleaved_runtime,
    med,
    paired_iqr,
    paired_ratio,
)
from gpt import GPTConfig, param_count

import jaxamp


def measure_step(cfg: GPTConfig, batch_size: int, *, repeats: int, steps: int, warmup: int,
                 compiles: int, ablation: bool, hlo: bool, aot: bool = False) -> dict:
    """AMP step vs baseline step (float16 compute): compile, runtime, optional HLO counts.

    ``aot``: time the executables of the compile measurement instead of the jitted steps
    (saves two compiles; used by ``--smoke``, where the timings only check the plumbing).
    """
    model, params, batch = setup(cfg, batch_size)
    tx = make_tx()
    runners = {
        "amp": AmpRunner(model, params, tx, batch, F16_POLICY, jaxamp.DynamicLossScale()),
        "baseline": BaselineRunner(model, params, tx, batch, F16_POLICY),
    }
    if ablation:  # make_train_step with no loss scale and no clip: the skip machinery alone
        runners["amp_noscale_noclip"] = AmpRunner(model, params, tx, batch, F16_POLICY,
                                                  jaxamp.NoOpLossScale(), clip_norm=None)

    builders = {"amp": lambda: make_amp_step(model, tx, F16_POLICY).lower(
                    runners["amp"].state, batch),
                "baseline": lambda: make_baseline_step(model, tx, F16_POLICY).lower(
                    runners["baseline"].params, runners["baseline"].opt_state, batch)}
    first: dict = {}
    comp = interleaved_compile(builders, repeats=compiles,
                               on_first=lambda k, lo, co: first.__setitem__(k, (lo, co)))
    out: dict = {"config": {**cfg.__dict__, "batch": batch_size},
                 "params": param_count(params)}
    AMP_EXECUTABLES[(cfg, batch_size, "float16")] = (first["amp"][1], tx)
    ma = first["amp"][1].memory_analysis()
    out["memory_float16"] = memory_dict(ma) if ma else None
    if hlo:
        out["hlo_ops"] = hlo_diff(first["amp"], first["baseline"])
    out["amp_compile_s"] = med(comp["amp"]["total_s"])
    out["baseline_compile_s"] = med(comp["baseline"]["total_s"])
    out["amp_step_compile_ratio"] = out["amp_compile_s"] / out["baseline_compile_s"]
    out["amp_step_compile_ratio_paired"] = paired_ratio(comp["amp"]["total_s"],
                                                        comp["baseline"]["total_s"])
    out["compile_breakdown_s"] = compile_summary(comp)
    if aot:
        for name in builders:
            runners[name].step = first[name][1]
    first.clear()

    times, cpu = interleaved_runtime(runners, repeats=repeats, steps=steps, warmup=warmup)
    out.update({
        "timing": "aot-executables" if aot else "jitted-steps",
        "amp_step_ms": med(times["amp"]) * 1e3,
        "baseline_step_ms": med(times["baseline"]) * 1e3,
        "amp_step_runtime_ratio": med(times["amp"]) / med(times["baseline"]),
        "amp_step_runtime_ratio_paired": paired_ratio(times["amp"], times["baseline"]),
        "amp_step_runtime_ratio_paired_iqr": paired_iqr(times["amp"], times["baseline"]),
        "amp_step_runtime_ratio_min": min(times["amp"]) / min(times["baseline"]),
        "amp_step_cpu_time_ratio": med(cpu["amp"]) / med(cpu["baseline"]),
        "amp_skipped_steps": runners["amp"].skipped(),
        "runtime_samples_ms": {k: [round(t * 1e3, 3) for t in v] for k, v in times.items()},
    })
    if ablation:
        out["amp_noscale_noclip_step_ms"] = med(times["amp_noscale_noclip"]) * 1e3
        out["amp_noscale_noclip_runtime_ratio"] = (med(times["amp_noscale_noclip"])
                                                   / med(times["baseline"]))
    if not aot and hasattr(runners["amp"].step, "_validate"):
        # Python-side cost per call of make_train_step's argument check (_Step._validate;
        # newer jaxamp runs its checks while tracing, once per input signature, instead).
        r = runners["amp"]
        n = 50
        t0 = time.perf_counter()
        for _ in range(n):
            r.step._validate(r.state, r.batch)
        out["amp_step_call_check_us"] = (time.perf_counter() - t0) / n * 1e6
    return out


# The per-depth row of ``scaling``: these keys of a ``measure_step`` result, and its fusions.
SCALING_KEYS = ("params", "amp_step_ms", "baseline_step_ms", "amp_step_runtime_ratio",
                "amp_step_runtime_ratio_paired", "amp_step_runtime_ratio_paired_iqr",
                "amp_compile_s", "baseline_compile_s", "amp_step_compile_ratio",
                "amp_step_compile_ratio_paired", "amp_step_runtime_ratio_min",
                "amp_step_cpu_time_ratio", "amp_skipped_steps")


def scaling_row(layers: int, r: dict) -> dict:
    """One ``scaling`` entry from the ``measure_step`` result ``r`` at this depth."""
    s = {k: r[k] for k in SCALING_KEYS}
    for op, name in (("fusion", "fusions"), ("copy", "copies"), ("conditional", "conditionals")):
        s[f"{name}_amp"] = r["hlo_ops"]["compiled_amp"][op]
        s[f"{name}_baseline"] = r["hlo_ops"]["compiled_baseline"][op]
    return {"layers": layers, **s}
