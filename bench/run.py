#!/usr/bin/env python
"""jaxamp benchmarks: one entry point, every figure a ratio measured side by side.

Usage::

    python bench/run.py --quick --json bench/results-cpu-quick.json   # a few minutes, 2 CPUs
    python bench/run.py --smoke --json /tmp/smoke.json                # < 1 minute, for a test
    python bench/run.py --full --json bench/results-gpu.json          # gpt2-small shape, GPU

Every comparison runs in ONE process: the variants alternate in interleaved repeats (the order
flips every repeat) and the reported figure is the ratio of the medians, so machine noise hits
both sides alike. Compile times are the median of fresh ``lower().compile()`` runs with
``jax.clear_caches()`` before each one (tracing is included: it is part of what a user waits
for).

Measured (the JSON keys):

1. ``amp_step_runtime_ratio`` / ``amp_step_compile_ratio``: ``jaxamp.make_train_step``
   (float16 compute, ``DynamicLossScale``, ``clip_norm=1.0``) over a plain step with the same
   autocast forward (``value_and_grad`` + optax update; no loss scale, finite check or clip).
2. Precision fidelity of forward + backward: ``convert_count_amp`` / ``convert_count_hand``
   (``stablehlo.convert`` ops, autocast vs the hand-cast twin in ``gpt_handcast.py``),
   ``lossy_round_trips_amp``, ``matmul_flops_fraction_compute_dtype`` and
   ``trace_compile_ratio_amp_vs_plain``.
3. ``memory_bytes``: ``memory_analysis()`` of the compiled AMP step per compute dtype.
4. ``scaling``: the step ratios at several depths (not in ``--smoke``).
5. ``peer``: the same GPT in PyTorch (``bench/torch_gpt.py``, same weights and batch) trained
   with ``torch.autocast`` + ``GradScaler``, interleaved with jaxamp's AMP steps: tokens/s per
   compute dtype on each side and ``ratio_jaxamp_over_torch``. PyTorch is optional: without
   it (or with ``JAXAMP_BENCH_NO_TORCH=1``) ``peer`` is ``{"skipped": "torch not installed"}``.
   ``--peer-only`` runs this section alone. ``gpu_targets``: the Hopper targets, evaluated on
   an H100/H200 ``--full`` run and "pending" elsewhere.

On CPU, XLA computes float16/bfloat16 dots in float32, so CPU numbers show jaxamp's *overhead*,
never a speed-up.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import gc
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import flax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jmp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from gpt import GPT, GPTConfig, flops_per_token, init, lm_loss, make_batch, param_count  # noqa: E402
from gpt_handcast import HandCastGPT, handcast_loss  # noqa: E402

import jaxamp  # noqa: E402
from jaxamp._jaxpr import duplicate_casts, iter_eqns, lossy_round_trips  # noqa: E402

F16_POLICY = "params=float32,compute=float16,output=float32"
POLICIES = {
    "float32": "float32",
    "bfloat16": "params=float32,compute=bfloat16,output=float32",
    "float16": F16_POLICY,
}
TARGETS = {
    "amp_step_runtime_ratio": 1.03,
    "amp_step_compile_ratio": 1.3,
    "trace_compile_ratio_amp_vs_plain": 1.3,
}
# Dense bf16/f16 tensor-core peak FLOP/s per device (no sparsity), matched on device_kind.
PEAK_FLOPS = (("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("L4", 121e12),
              ("A10", 125e12), ("V100", 125e12))

# repeats x steps: interleaved timing blocks; compiles: fresh compiles per variant (median).
# peer_*: the PyTorch comparison (jaxamp and torch steps interleaved; torch on CPU is slow in
# float16, seconds per step, hence one step per block).
ALL_DTYPES = ("float32", "bfloat16", "float16")
MODES = {
    "smoke": dict(config=GPTConfig(layers=1, d_model=32, heads=2, seq=16), batch=4,
                  repeats=2, steps=2, warmup=2, compiles=1, fidelity_compiles=1,
                  depths=(), depth_repeats=0, depth_compiles=0,
                  peer_dtypes=("float32", "bfloat16"), peer_repeats=2, peer_steps=1,
                  peer_warmup=1, peer_compile=False),
    "quick": dict(config=GPTConfig(layers=4, d_model=128, heads=4, seq=128), batch=8,
                  repeats=25, steps=2, warmup=3, compiles=5, fidelity_compiles=3,
                  depths=(2, 4, 8), depth_repeats=15, depth_compiles=3,
                  peer_dtypes=ALL_DTYPES, peer_repeats=15, peer_steps=1, peer_warmup=3,
                  peer_compile=True),
    "standard": dict(config=GPTConfig(layers=4, d_model=256, heads=8, seq=256), batch=8,
                     repeats=25, steps=2, warmup=3, compiles=5, fidelity_compiles=3,
                     depths=(2, 4, 8, 12), depth_repeats=15, depth_compiles=3,
                     peer_dtypes=ALL_DTYPES, peer_repeats=11, peer_steps=1, peer_warmup=3,
                     peer_compile=True),
    # Sized for a few minutes of GPU time (about 40 compiles of a 12-layer model at most).
    "full": dict(config=GPTConfig(layers=12, d_model=768, heads=12, seq=1024), batch=8,
                 repeats=21, steps=5, warmup=5, compiles=3, fidelity_compiles=2,
                 depths=(2, 4, 8, 12), depth_repeats=11, depth_compiles=2,
                 peer_dtypes=ALL_DTYPES, peer_repeats=11, peer_steps=5, peer_warmup=5,
                 peer_compile=True),
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------------------------


def make_tx() -> optax.GradientTransformation:
    return optax.adamw(1e-3)


def amp_loss_of(model, policy: str) -> Callable:
    return jaxamp.autocast(lambda params, batch: lm_loss(model.apply, params, batch), policy)


def make_baseline_step(model, tx, policy: str):
    """Same autocast forward/backward as the AMP step; no loss scale, finite check or clip."""
    loss_fn = amp_loss_of(model, policy)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def make_amp_step(model, tx, policy: str, *, clip_norm: float | None = 1.0):
    return jaxamp.make_train_step(model, lm_loss, tx, policy=policy, clip_norm=clip_norm)


def copy_tree(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


class AmpRunner:
    """Threads a (donated) ``TrainState`` through ``steps`` calls of a ``make_train_step``."""

    def __init__(self, model, params, tx, batch, policy, loss_scale, clip_norm=1.0):
        self.step = make_amp_step(model, tx, policy, clip_norm=clip_norm)
        self.state = jaxamp.TrainState.create(model, copy_tree(params), tx,
                                              loss_scale=loss_scale)
        self.batch = batch

    def __call__(self, steps: int) -> None:
        state = self.state
        for _ in range(steps):
            state, _ = self.step(state, self.batch)
        jax.block_until_ready(state)
        self.state = state

    def skipped(self) -> int:
        return int(self.state.skipped_steps)

    def lower(self):
        return self.step.lower(self.state, self.batch)


class BaselineRunner:
    def __init__(self, model, params, tx, batch, policy):
        self.step = make_baseline_step(model, tx, policy)
        self.params = copy_tree(params)
        self.opt_state = tx.init(self.params)
        self.batch = batch

    def __call__(self, steps: int) -> None:
        params, opt_state = self.params, self.opt_state
        for _ in range(steps):
            params, opt_state, _ = self.step(params, opt_state, self.batch)
        jax.block_until_ready((params, opt_state))
        self.params, self.opt_state = params, opt_state

    def lower(self):
        return self.step.lower(self.params, self.opt_state, self.batch)


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# HLO / jaxpr readers
# ---------------------------------------------------------------------------------------------

_STABLEHLO_OP = re.compile(r"\b(stablehlo\.[a-z_]+|func\.call|chlo\.[a-z_]+)\b")
_CONVERT = re.compile(r"stablehlo\.convert\b[^\n]*?:\s*\(?tensor<(?:[\dx]*x)?(\w+)>\)?\s*->"
                      r"\s*tensor<(?:[\dx]*x)?(\w+)>")


def stablehlo_ops(text: str) -> Counter:
    return Counter(m.group(1) for m in _STABLEHLO_OP.finditer(text)
                   if not m.group(1).startswith("stablehlo.return"))


def convert_stats(text: str) -> dict:
    count = len(re.findall(r"stablehlo\.convert\b", text))
    kinds = Counter(f"{a}->{b}" for a, b in _CONVERT.findall(text))
    return {"count": count, "by_direction": dict(sorted(kinds.items()))}


_HLO_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+ = (?:\([^=]*?\)|\S+) ([a-z][\w\-]*)\(")
_HLO_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_HLO_CALLED = re.compile(r"(?:branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+)|"
                         r"false_computation=%?([\w.\-]+)|body=%?([\w.\-]+)|"
                         r"condition=%?([\w.\-]+))")


def compiled_hlo_ops(text: str) -> dict:
    """Opcode histogram of the compiled (optimized) HLO's control-flow level: the entry
    computation and the conditional branches / loop bodies it runs, not the bodies of fusions
    or the reducers of reduce ops. ``instructions_in_fusions`` counts everything else."""
    text = re.sub(r"/\*.*?\*/", "", text)
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in text.splitlines():
        m = _HLO_COMPUTATION.match(line)
        if m and "->" in line:
            current = m.group(2)
            comps[current] = []
            if m.group(1):
                entry = current
        elif current is not None and line.strip() != "}":
            comps[current].append(line)
    top, todo = set(), [entry] if entry else []
    while todo:
        name = todo.pop()
        if name in top or name not in comps:
            continue
        top.add(name)
        for line in comps[name]:
            for m in _HLO_CALLED.finditer(line):
                for g in m.groups():
                    if g:
                        todo += [n.strip().lstrip("%") for n in g.split(",")]
    ops: Counter = Counter()
    nested = 0
    for name, lines in comps.items():
        for line in lines:
            m = _HLO_INSTR.match(line)
            if not m:
                continue
            if name in top:
                ops[m.group(1)] += 1
            else:
                nested += 1
    return {"unfused_instructions": int(sum(ops.values())), "instructions_in_fusions": nested,
            "computations": len(comps), "fusion": ops["fusion"], "copy": ops["copy"],
            "conditional": ops["conditional"], "dot": ops["dot"], "by_op": dict(ops.most_common())}


def dot_flops(eqn) -> int:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    rhs_free = [d for i, d in enumerate(rhs) if i not in rc and i not in rb]
    return 2 * int(np.prod(lhs, dtype=np.int64)) * int(np.prod(rhs_free, dtype=np.int64))


def matmul_fraction(jaxpr, dtype) -> tuple[float, int, dict]:
    total, low = 0, 0
    by_dtype: Counter = Counter()
    for eqn in iter_eqns(jaxpr):
        if eqn.primitive.name != "dot_general":
            continue
        flops = dot_flops(eqn)
        total += flops
        dts = "x".join(str(v.aval.dtype) for v in eqn.invars)
        by_dtype[dts] += flops
        if all(np.dtype(v.aval.dtype) == np.dtype(dtype) for v in eqn.invars):
            low += flops
    return (low / total if total else 0.0), total, dict(by_dtype)


# ---------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------


_SETUP: dict = {}
# (compiled AMP step, its optax transformation) by (config, batch, policy name), kept from the
# compile and memory measurements so ``--smoke`` can time them again (a TrainState's pytree
# metadata holds the transformation, so the executable only accepts states built with it).
_AMP_EXECUTABLES: dict = {}


def setup(cfg: GPTConfig, batch_size: int):
    """(model, float32 params, batch) for a config, built once per process."""
    key = (cfg, batch_size)
    if key not in _SETUP:
        model = GPT(cfg)
        _SETUP[key] = (model, init(model, cfg), make_batch(cfg, batch_size))
    return _SETUP[key]


def compile_summary(comp: dict) -> dict:
    return {k: {"lower": med(v["lower_s"]), "xla_compile": med(v["compile_s"]),
                "total": med(v["total_s"])} for k, v in comp.items()}


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
    _AMP_EXECUTABLES[(cfg, batch_size, "float16")] = (first["amp"][1], tx)
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


def memory_dict(ma) -> dict:
    out = {k: int(getattr(ma, k)) for k in
           ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
            "alias_size_in_bytes", "generated_code_size_in_bytes")}
    peak = getattr(ma, "peak_memory_in_bytes", None)  # not reported by every jaxlib
    out["peak_memory_in_bytes"] = int(peak) if peak is not None else None
    return out


def hlo_diff(amp, base) -> dict:
    """Op counts of the AMP step vs the baseline, StableHLO and compiled HLO."""
    amp_ops, base_ops = stablehlo_ops(amp[0].as_text()), stablehlo_ops(base[0].as_text())
    extra = {k: amp_ops[k] - base_ops[k] for k in set(amp_ops) | set(base_ops)
             if amp_ops[k] != base_ops[k]}
    amp_c, base_c = compiled_hlo_ops(amp[1].as_text()), compiled_hlo_ops(base[1].as_text())
    return {
        "stablehlo_ops_amp": int(sum(amp_ops.values())),
        "stablehlo_ops_baseline": int(sum(base_ops.values())),
        "stablehlo_extra_ops_amp_by_op": dict(sorted(extra.items(), key=lambda kv: -kv[1])),
        "compiled_amp": {k: v for k, v in amp_c.items() if k != "by_op"},
        "compiled_baseline": {k: v for k, v in base_c.items() if k != "by_op"},
        "compiled_extra_unfused_by_op": {
            k: amp_c["by_op"].get(k, 0) - base_c["by_op"].get(k, 0)
            for k in sorted(set(amp_c["by_op"]) | set(base_c["by_op"]))
            if amp_c["by_op"].get(k, 0) != base_c["by_op"].get(k, 0)},
    }


def measure_fidelity(cfg: GPTConfig, batch_size: int, *, compiles: int,
                     hand_compile: bool = True) -> dict:
    """Forward + backward of the model: autocast vs hand-cast casts, dtypes, compile time.

    ``hand_compile``: also time the hand-cast model's compile (else only lower it).
    """
    model, params, batch = setup(cfg, batch_size)
    amp_loss = amp_loss_of(model, F16_POLICY)
    fwd = jax.make_jaxpr(amp_loss)(params, batch)
    fwd_bwd = jax.make_jaxpr(jax.value_and_grad(amp_loss))(params, batch)
    fraction, total_flops, by_dtype = matmul_fraction(fwd_bwd, jnp.float16)
    convs: dict = {}
    losses: dict = {}
    compiled_ops: dict = {}

    def on_first(name, lowered, compiled):
        convs[name] = convert_stats(lowered.as_text())
        compiled_ops[name] = {k: v for k, v in compiled_hlo_ops(compiled.as_text()).items()
                              if k in ("fusion", "unfused_instructions",
                                       "instructions_in_fusions")}
        compiled_ops[name]["stablehlo_ops"] = int(sum(stablehlo_ops(lowered.as_text()).values()))
        # The three losses agree: the hand-cast twin is the same model.
        losses[name] = float(compiled(params, batch)[0])

    def hand():
        return jax.jit(jax.value_and_grad(handcast_loss(HandCastGPT(cfg)))).lower(params, batch)

    builders = {
        "amp": lambda: jax.jit(jax.value_and_grad(amp_loss_of(model, F16_POLICY))).lower(
            params, batch),
        "plain": lambda: jax.jit(jax.value_and_grad(
            lambda p, b: lm_loss(model.apply, p, b))).lower(params, batch),
    }
    if hand_compile:
        builders["hand"] = hand
        # autocast under a float32 policy: autocast's own tracing cost, no dtype changes.
        builders["autocast_f32"] = lambda: jax.jit(jax.value_and_grad(
            amp_loss_of(model, "float32"))).lower(params, batch)
    else:
        convs["hand"] = convert_stats(hand().as_text())
    comp = interleaved_compile(builders, repeats=compiles, on_first=on_first)
    amp_conv, hand_conv, plain_conv = convs["amp"], convs["hand"], convs["plain"]
    amp_t, plain_t = med(comp["amp"]["total_s"]), med(comp["plain"]["total_s"])
    hand_t = med(comp["hand"]["total_s"]) if "hand" in comp else None
    return {
        "convert_count_amp": amp_conv["count"],
        "convert_count_hand": hand_conv["count"],
        "convert_count_plain_f32": plain_conv["count"],
        "convert_directions": {"amp": amp_conv["by_direction"],
                               "hand": hand_conv["by_direction"]},
        "lossy_round_trips_amp": len(lossy_round_trips(fwd)),
        "duplicate_casts_amp": len(duplicate_casts(fwd)),
        "matmul_flops_fraction_compute_dtype": fraction,
        "matmul_flops_fwd_bwd": total_flops,
        "matmul_flops_by_operand_dtypes": by_dtype,
        "losses_at_init": losses,
        "trace_compile_ratio_amp_vs_plain": amp_t / plain_t,
        "trace_compile_ratio_hand_vs_plain": hand_t / plain_t if hand_t else None,
        "trace_compile_ratio_autocast_f32_vs_plain": (
            med(comp["autocast_f32"]["total_s"]) / plain_t if "autocast_f32" in comp else None),
        "trace_compile_s": compile_summary(comp),
        "trace_compile_hlo_ops": compiled_ops,
    }


def measure_memory(cfg: GPTConfig, batch_size: int, known: dict) -> dict:
    """``memory_analysis()`` of the compiled AMP step per policy (``known``: already done)."""
    model, params, batch = setup(cfg, batch_size)
    tx = make_tx()
    out: dict = {}
    for name, policy in POLICIES.items():
        loss_scale = jaxamp.default_loss_scale(policy)
        if name in known:
            out[name] = known[name]
        else:
            state = jaxamp.TrainState.create(model, params, tx, loss_scale=loss_scale)
            compiled = make_amp_step(model, tx, policy).lower(state, batch).compile()
            _AMP_EXECUTABLES[(cfg, batch_size, name)] = (compiled, tx)
            ma = compiled.memory_analysis()
            out[name] = memory_dict(ma) if ma else None
        if out[name] is not None:
            out[name]["loss_scale"] = type(loss_scale).__name__
    return out


def memory_ratios(mem: dict) -> dict:
    base = (mem.get("float32") or {}).get("temp_size_in_bytes")
    return {k: (v["temp_size_in_bytes"] / base if base else None)
            for k, v in mem.items() if k != "float32" and v}


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


# ---------------------------------------------------------------------------------------------
# Peer: the same GPT in PyTorch (bench/torch_gpt.py), torch.autocast + GradScaler
# ---------------------------------------------------------------------------------------------

NO_TORCH_ENV = "JAXAMP_BENCH_NO_TORCH"  # set (non-empty, not "0"): behave as if torch is missing
PEER_SKIPPED = "torch not installed"
GPU_COMMAND = "python bench/run.py --full --json bench/results-gpu.json"
# Targets for the --full run on a Hopper GPU (H100/H200); evaluated only there.
GPU_TARGETS = (
    ("bf16_jaxamp_over_torch_amp", "bf16 tokens/s, jaxamp / torch AMP", ">= 1.0"),
    ("f16_dynamic_over_bf16", "f16 (dynamic loss scale) tokens/s / bf16 tokens/s", ">= 0.97"),
    ("bf16_peak_memory_vs_f32", "bf16 AMP step peak memory / f32", "<= 0.6"),
    ("bf16_mfu", "bf16 AMP step MFU", ">= 0.40"),
)


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

    if compile and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        # A fresh inductor cache: torch.compile's first step is a cold compile on every run,
        # as jax.jit's is (JAX's persistent compilation cache is off by default).
        cache = tempfile.mkdtemp(prefix="jaxamp-bench-inductor-")
        atexit.register(shutil.rmtree, cache, ignore_errors=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        inductor_cache = "fresh temporary TORCHINDUCTOR_CACHE_DIR (cold compile)"
    else:
        inductor_cache = ("TORCHINDUCTOR_CACHE_DIR from the environment (may be warm)"
                          if compile else None)
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
        if aot and (cfg, batch_size, dt) in _AMP_EXECUTABLES:
            compiled, tx = _AMP_EXECUTABLES[(cfg, batch_size, dt)]
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


def gpu_targets(res: dict) -> dict:
    """The Hopper targets: evaluated on an H100/H200 ``--full`` run, else pending."""
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


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def metadata(mode: str, started: float) -> dict:
    dev = jax.devices()[0]
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", *sys.argv]),
        "mode": mode,
        "wall_s": round(time.perf_counter() - started, 1),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "machine": platform.machine(), "cpu_count": os.cpu_count(),
                    "backend": jax.default_backend(), "device_kind": dev.device_kind,
                    "device_count": jax.device_count()},
        "versions": {"python": platform.python_version(), "jax": jax.__version__,
                     "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__")
                     else None, "flax": flax.__version__, "optax": optax.__version__,
                     "jmp": getattr(jmp, "__version__", None),
                     "jaxamp": getattr(jaxamp, "__version__", None)},
    }


def fmt_bytes(n) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def verdict(key: str, value: float) -> str:
    if key in TARGETS:
        return "met" if value <= TARGETS[key] else "MISSED"
    return ""


def tables(res: dict, peer: bool = True) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) for stdout and markdown alike; ``peer``: with the peer's."""
    if "amp_step_runtime_ratio" not in res:  # --peer-only
        return peer_tables(res) if peer else []
    out = []
    cfg = res["config"]
    rows = [
        ["amp_step_runtime_ratio", f"{res['amp_step_runtime_ratio']:.3f}", "<= 1.03",
         verdict("amp_step_runtime_ratio", res["amp_step_runtime_ratio"]),
         f"AMP {res['amp_step_ms']:.1f} ms vs baseline {res['baseline_step_ms']:.1f} ms/step; "
         f"per-repeat ratio median {res['amp_step_runtime_ratio_paired']:.3f}, IQR "
         + "-".join(f"{x:.3f}" for x in res["amp_step_runtime_ratio_paired_iqr"])
         + f"; min/min {res['amp_step_runtime_ratio_min']:.3f}; CPU-time ratio "
         f"{res['amp_step_cpu_time_ratio']:.3f}"],
        ["amp_step_compile_ratio", f"{res['amp_step_compile_ratio']:.3f}", "<= 1.3",
         verdict("amp_step_compile_ratio", res["amp_step_compile_ratio"]),
         f"AMP {res['amp_compile_s']:.2f} s vs baseline {res['baseline_compile_s']:.2f} s "
         f"(trace + lower + XLA compile; per-repeat ratio median "
         f"{res['amp_step_compile_ratio_paired']:.3f})"],
    ]
    if "amp_noscale_noclip_runtime_ratio" in res:
        rows.append(["(ablation) make_train_step, no scale/clip",
                     f"{res['amp_noscale_noclip_runtime_ratio']:.3f}", "", "",
                     "runtime ratio (finite check + skip only)"])
    rows += [
        ["convert_count_amp / _hand", f"{res['convert_count_amp']} / {res['convert_count_hand']}",
         "amp <= hand", "met" if res["convert_count_amp"] <= res["convert_count_hand"]
         else "MISSED", "stablehlo.convert ops in value_and_grad StableHLO"],
        ["lossy_round_trips_amp", str(res["lossy_round_trips_amp"]), "0",
         "met" if res["lossy_round_trips_amp"] == 0 else "MISSED", "f32->f16->f32 in forward"],
        ["matmul_flops_fraction_compute_dtype",
         f"{res['matmul_flops_fraction_compute_dtype']:.4f}", "1.0",
         "met" if res["matmul_flops_fraction_compute_dtype"] == 1.0 else "MISSED",
         f"{res['matmul_flops_fwd_bwd'] / 1e9:.2f} GFLOP of dot_general, fwd+bwd"],
        ["trace_compile_ratio_amp_vs_plain", f"{res['trace_compile_ratio_amp_vs_plain']:.3f}",
         "<= 1.3", verdict("trace_compile_ratio_amp_vs_plain",
                           res["trace_compile_ratio_amp_vs_plain"]),
         "value_and_grad(autocast loss) vs f32 loss; hand-cast: "
         + (f"{res['trace_compile_ratio_hand_vs_plain']:.3f}"
            if res["trace_compile_ratio_hand_vs_plain"] else "not timed")],
    ]
    out.append((f"AMP overhead and precision fidelity (GPT {cfg['layers']}x{cfg['d_model']}, "
                f"{cfg['heads']} heads, seq {cfg['seq']}, batch {cfg['batch']}, "
                f"{res['params'] / 1e6:.2f}M params, float16 compute)",
                ["metric", "value", "target", "", "detail"], rows))
    mem, ratios = res["memory_bytes"], res["memory_temp_ratio_vs_f32"]
    mrows = []
    for name, m in mem.items():
        if m is None:
            mrows.append([name, "n/a", "n/a", "n/a", ""])
            continue
        mrows.append([name, fmt_bytes(m["temp_size_in_bytes"]),
                      fmt_bytes(m["argument_size_in_bytes"]), fmt_bytes(m["output_size_in_bytes"]),
                      "1.000" if name == "float32" else f"{ratios.get(name, float('nan')):.3f}"])
    out.append(("Memory of the compiled AMP step (memory_analysis)",
                ["compute dtype", "temp", "arguments", "outputs", "temp vs f32"], mrows))
    if res.get("scaling"):
        srows = [[str(s["layers"]), f"{s['params'] / 1e6:.2f}M", f"{s['baseline_step_ms']:.1f}",
                  f"{s['amp_step_ms']:.1f}", f"{s['amp_step_runtime_ratio']:.3f}",
                  f"{s['amp_step_runtime_ratio_paired']:.3f}",
                  f"{s['amp_step_cpu_time_ratio']:.3f}",
                  f"{s['baseline_compile_s']:.2f}", f"{s['amp_compile_s']:.2f}",
                  f"{s['amp_step_compile_ratio']:.3f}",
                  f"{s['fusions_baseline']} / {s['fusions_amp']}"] for s in res["scaling"]]
        out.append((f"Scaling with depth (width {res['config']['d_model']}, float16 compute)",
                    ["layers", "params", "base ms", "AMP ms", "runtime ratio",
                     "per-repeat ratio", "CPU-time ratio", "base compile s", "AMP compile s",
                     "compile ratio", "fusions base / AMP"],
                    srows))
    if res.get("throughput"):
        tp = res["throughput"]
        trows = [[name, f"{tp[name]['step_ms']:.1f}", f"{tp[name]['tokens_per_s']:.0f}",
                  f"{tp[name]['mfu']:.3f}" if tp[name]["mfu"] is not None else "n/a"]
                 for name in POLICIES]
        peak = f"{tp['peak_flops']:.3g}" if tp["peak_flops"] else "unknown"
        out.append((f"Throughput of the AMP step ({tp['device_kind']}; MFU = "
                    f"{tp['flops_per_token']:.3g} FLOP/token x tokens/s over the dense bf16 "
                    f"peak, {peak} FLOP/s)",
                    ["compute dtype", "ms/step", "tokens/s", "MFU"], trows))
    return out + (peer_tables(res) if peer else [])


def peer_tables(res: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    out = []
    peer = res.get("peer") or {}
    if "tokens_per_s" in peer:
        out.append(peer_table(peer))
    if res.get("gpu_targets"):
        out.append(("Hopper targets (H100/H200, `--full`)",
                    ["target", "metric", "value", "status"],
                    [[t["target"], t["what"], "n/a" if t["value"] is None
                      else f"{t['value']:.3f}", t["status"]]
                     for t in res["gpu_targets"].values()]))
    return out


def peer_table(peer: dict) -> tuple[str, list[str], list[list[str]]]:
    tps, ms, first = peer["tokens_per_s"], peer["step_ms"], peer["first_step_s"]
    rows = []
    for dt in peer["dtypes"]:
        if tps["torch"][dt] is None:
            torch_cells = ["unsupported", "n/a", "n/a", "n/a", "n/a"]
        else:
            torch_cells = [f"{tps['torch'][dt]:.0f}", f"{peer['ratio_jaxamp_over_torch'][dt]:.3f}",
                           f"{peer['ratio_jaxamp_over_torch_paired'][dt]:.3f}",
                           f"{peer['ratio_jaxamp_over_torch_min'][dt]:.3f}",
                           f"{ms['torch'][dt]:.1f}"]
        rows.append([dt, f"{tps['jaxamp'][dt]:.0f}", *torch_cells[:4],
                     f"{ms['jaxamp'][dt]:.1f}", torch_cells[4],
                     f"{first['jaxamp'][dt]:.1f} / "
                     + (f"{first['torch'][dt]:.1f}" if dt in first["torch"] else "n/a")])
    how = "torch.compile" if peer["compiled"] else "eager"
    return (f"Peer: jaxamp vs PyTorch {peer['torch_version']} AMP ({how}, {peer['device']}, "
            f"{peer['torch_num_threads']} torch threads; same GPT, weights and batch, "
            f"interleaved)",
            ["compute dtype", "jaxamp tokens/s", "torch tokens/s", "jaxamp / torch",
             "per-repeat ratio", "min/min", "jaxamp ms/step", "torch ms/step",
             "first step s, jaxamp / torch"], rows)


def peer_notes(res: dict) -> list[str]:
    """Markdown paragraphs under the peer table (or the reason it is missing)."""
    peer = res.get("peer") or {}
    if "tokens_per_s" not in peer:
        return [f"**Peer (PyTorch):** skipped, {peer.get('skipped', 'not measured')}. Install "
                "the CPU build with `pip install torch==2.13.0` (PyTorch is not a jaxamp "
                "dependency) and rerun.", ""]
    loss0, after = peer["loss_at_init_float32"], peer["loss_after_float32_eval"]
    lines = [
        f"Peer recipe: {peer['recipe']['torch']}; jaxamp: {peer['recipe']['jaxamp']}. Both "
        f"sides start from the same float32 weights ({peer['params']['torch']:,} parameters, "
        f"asserted equal; float32 loss at init {loss0['jaxamp']:.5f} jaxamp vs "
        f"{loss0['torch']:.5f} torch) and train on the same batch for "
        f"{peer['steps_per_variant']} steps per variant (float32 loss after them, jaxamp / "
        "torch: "
        + ", ".join(f"{dt} {after['jaxamp'][dt]:.3f} / "
                    + (f"{after['torch'][dt]:.3f}" if after["torch"][dt] is not None
                       else "n/a") for dt in peer["dtypes"])
        + f"). PyTorch: {peer['compile_note']}; {peer['threads_note']}. `jaxamp / torch` is "
        "the ratio of median tokens/s (above 1: jaxamp faster); `per-repeat ratio` is the "
        "median over repeats of torch's step time over jaxamp's in the same repeat; `min/min` "
        "compares the fastest steps (contention only ever adds time). The first "
        "step includes compilation (jax.jit's, or torch.compile's"
        + (", from an empty inductor cache" if peer.get("inductor_cache", "") and
           peer["inductor_cache"].startswith("fresh") else "") + ").", ""]
    stalls = {dt: max(v) / min(v) for dt in peer["dtypes"]
              if (v := peer["runtime_samples_ms"].get(f"torch/{dt}"))}
    if stalls and max(stalls.values()) > 5:
        lines += [
            "PyTorch's steps stalled in some repeats (slowest step up to "
            f"{max(stalls.values()):.0f}x the fastest), as an OpenMP thread pool does when "
            "other processes take its cores (the jaxamp steps of the same repeats did not); "
            "read the medians and the min/min ratios, not single repeats.", ""]
    if peer["unsupported"]:
        lines += ["Unsupported by PyTorch here: " + "; ".join(
            f"{k}: {v}" for k, v in peer["unsupported"].items()) + ".", ""]
    if res["metadata"]["machine"]["backend"] == "cpu":
        native = peer.get("torch_cpu_native") or {}
        bf16 = {True: "PyTorch's oneDNN runs bfloat16 matmuls natively on this CPU "
                      "(AVX512-BF16 or AMX) while XLA:CPU computes them in float32",
                False: "neither side has native bfloat16 matmuls on this CPU (XLA:CPU and "
                       "PyTorch compute them in float32)",
                None: "bfloat16 may be emulated in float32 (XLA:CPU does so; PyTorch's "
                      "oneDNN uses native bfloat16 instructions where the CPU has them)"
                }[native.get("bfloat16")]
        lines += [
            "**What these CPU peer numbers can and cannot say.** They compare two software "
            "stacks running the same training step on the same cores: framework overhead, "
            "kernel fusion, the optimizer update, the cost of AMP's casts and loss scaling. "
            "They say nothing about GPU speed-ups or about Tensor Cores. A CPU has no float16 "
            "tensor cores: XLA:CPU upcasts float16 to float32, and PyTorch's CPU float16 path "
            "is a slow fallback"
            + (" (no native oneDNN float16 kernels on this CPU)"
               if native.get("float16") is False else "")
            + f"; {bf16}. So the float16 and bfloat16 rows mostly measure each library's CPU "
            "kernels for those types, not what mixed precision buys on a GPU; the float32 row "
            "is the like-for-like comparison of the two stacks.", ""]
    return lines


def print_tables(res: dict) -> None:
    for title, header, rows in tables(res):
        widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
        print(f"\n{title}")
        print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
        print("  ".join("-" * w for w in widths))
        for row in rows:
            print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))


def markdown_tables(tabs: list[tuple[str, list[str], list[list[str]]]]) -> list[str]:
    lines = []
    for title, header, rows in tabs:
        lines += [f"**{title}**", "", "| " + " | ".join(header) + " |",
                  "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |"
                  for row in rows]
        lines.append("")
    return lines


def markdown_section(res: dict) -> str:
    meta = res["metadata"]
    m, v = meta["machine"], meta["versions"]
    lines = [f"Measured {meta['date']} with `{meta['command']}` ({meta['wall_s']:.0f} s) on "
             f"{m['backend']} ({m['device_kind']}), {m['cpu_count']} CPUs, {m['platform']}; "
             f"python {v['python']}, jax {v['jax']}, flax {v['flax']}, optax {v['optax']}.", ""]
    lines += markdown_tables(tables(res, peer=False))
    hlo = res.get("hlo_ops")
    if hlo:
        ca, cb = hlo["compiled_amp"], hlo["compiled_baseline"]
        extra = ", ".join(f"{k} {v:+d}" for k, v in list(
            hlo["stablehlo_extra_ops_amp_by_op"].items())[:8])
        lines += [
            f"Where the AMP step's extra work goes: StableHLO {hlo['stablehlo_ops_amp']} ops vs "
            f"{hlo['stablehlo_ops_baseline']} for the baseline (largest differences: {extra}); "
            f"compiled HLO {ca['fusion']} vs {cb['fusion']} fusions, {ca['copy']} vs "
            f"{cb['copy']} copies, {ca['conditional']} vs {cb['conditional']} conditionals, "
            f"{ca['dot']} vs {cb['dot']} dots.", ""]
    tc, ops = res.get("trace_compile_s", {}), res.get("trace_compile_hlo_ops", {})
    if "hand" in tc and "autocast_f32" in tc:
        parts = [f"{name} {tc[name]['lower']:.2f} + {tc[name]['xla_compile']:.2f} s, "
                 f"{ops[name]['fusion']} fusions"
                 for name in ("plain", "autocast_f32", "hand", "amp") if name in tc]
        lines += [
            "Trace/compile of `value_and_grad(loss)` (lower + XLA compile, compiled fusions): "
            + "; ".join(parts) + ". `autocast_f32` is autocast under a float32 policy (its "
            "compiled HLO is the plain model's, so the difference is autocast's tracing); "
            "`hand` is the hand-cast float16 model.", ""]
    lines += markdown_tables(peer_tables(res))
    lines += peer_notes(res)
    if res.get("gpu_targets") and all(t["value"] is None for t in res["gpu_targets"].values()):
        lines += ["The Hopper targets are pending a GPU run; produce them on an H100/H200 "
                  f"with `{GPU_COMMAND}` (needs `pip install torch` for the peer target).", ""]
    return "\n".join(lines).rstrip() + "\n"


INTRO = """# Benchmarks

`bench/run.py` measures what jaxamp costs and what it buys, on a small GPT written with no dtype
code (`bench/gpt.py`) and its hand-cast twin (`bench/gpt_handcast.py`).

```bash
. .venv/bin/activate
python bench/run.py --quick --json bench/results-cpu-quick.json   # a few minutes on 2 CPU cores
python bench/run.py --smoke --json /tmp/smoke.json                # < 1 minute (used by a test)
pip install torch==2.13.0   # optional, CPU build: adds the PyTorch peer (section 5)
python bench/run.py --quick --peer-only --json /tmp/peer.json     # the peer comparison alone
```

Every figure is a ratio of two variants measured side by side in one process: the variants
alternate in interleaved repeats and the medians are compared, so machine noise hits both sides
alike. Compile times are medians of fresh `lower().compile()` runs (tracing included) after
`jax.clear_caches()`.

**CPU numbers show overhead, not speed-up.** XLA on CPU computes float16/bfloat16 matmuls in
float32, so a float16 step is no faster than a float32 one there. The CPU runs compare the full
AMP step (`jaxamp.make_train_step`: loss scaling, finite check and skip, clipping) with a plain
step that uses the *same* autocast forward and backward, and so isolate what the AMP machinery
adds. Memory figures come from XLA's `memory_analysis()` of the compiled step.

**Peer.** The last section trains the same GPT written in PyTorch (`bench/torch_gpt.py`: same
architecture, parameter count asserted equal, loaded with the very same float32 weights) with
PyTorch's AMP recipe (`torch.autocast` + `GradScaler` for float16, `clip_grad_norm_(1.0)`,
AdamW with optax's hyper-parameters, `torch.compile` where it works) on the same batch, its
steps interleaved with jaxamp's in the same process, and reports tokens/s per compute dtype and
the ratio jaxamp / torch. PyTorch is not a dependency of jaxamp: without it the section is
skipped and the JSON says so (`"peer": {"skipped": "torch not installed"}`).

The JSON written by `--json` holds every figure below plus the raw samples and metadata (date,
machine, versions, command line).

## CPU, `--quick`

<!-- bench:cpu-quick:start -->
_Not yet run._
<!-- bench:cpu-quick:end -->

### Reading the CPU figures

* **Step runtime.** Per parameter leaf, the AMP step adds one reduction for the global norm
  (also the finite check and the clip's norm), the unscale and clip multiplies, and it runs the
  optimizer update inside a `lax.cond` (skipped steps leave params and optimizer state
  bit-identical). On XLA:CPU that is about 40% more small kernels (fusions) per step. The
  measured cost sits around the 3% target at every depth; on a shared 2-core machine the
  spread between repeats (per-repeat IQR about +-5%) is larger than the effect, so read the
  runtime ratio, the per-repeat median, min/min and CPU-time ratios together.
* **Step compile.** XLA:CPU compile time follows the number of fusions, and the AMP step has
  about 1.4x the baseline's (the per-leaf norm and scale cannot fuse into the update that sits
  inside the conditional). The fusion ratio is the same at every depth (see the table); the
  compile-time ratio is noisy around it.
* **Autocast compile.** autocast's own tracing is cheap: under a float32 policy it produces the
  very same compiled HLO as the plain model, with the same lowering time. The float16 program
  costs XLA:CPU more to compile whoever writes it: the hand-cast float16 model is also well
  above the plain float32 one (XLA:CPU has no native float16 arithmetic and upcasts it, about
  37% more fusions). Expect different ratios on a GPU.
* **Memory.** On CPU, temporaries do not shrink with float16/bfloat16 compute: XLA:CPU keeps
  float32 temporaries for the upcast math, and the float32 master params and Adam state are
  the same in every policy. Activation savings need the GPU run.

## GPU figures

Pending a GPU run (tokens/s and MFU for float32/bfloat16/float16 AMP steps on the gpt2-small
shape, 12 layers x 768, sequence 1024, batch 8, the PyTorch peer on CUDA, and the Hopper
targets: bf16 jaxamp >= torch AMP, f16 with dynamic loss scaling within 3% of bf16, bf16 peak
memory <= 0.6x f32, bf16 MFU >= 40%). Produce them on a GPU machine (with
`pip install torch` for the peer) with:

```bash
python bench/run.py --full --json bench/results-gpu.json
```

<!-- bench:gpu-full:start -->
_Pending a GPU run._
<!-- bench:gpu-full:end -->
"""


def write_markdown(path: Path, key: str, body: str) -> None:
    start, end = f"<!-- bench:{key}:start -->", f"<!-- bench:{key}:end -->"
    text = path.read_text() if path.exists() else INTRO
    block = f"{start}\n{body}{end}"
    if start in text and end in text:
        i, j = text.index(start), text.index(end) + len(end)
        text = text[:i] + block + text[j:]
    else:
        text = text.rstrip() + f"\n\n## {key}\n\n{block}\n"
    path.write_text(text)


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def core_sections(cfg: GPTConfig, batch: int, spec: dict, small: bool,
                  lap: Callable[[str], None]) -> dict:
    """Sections 1-4: AMP step vs baseline, precision fidelity, memory, scaling with depth."""
    log("[bench] 1/5 AMP step vs baseline step (runtime, compile, HLO)")
    res: dict = measure_step(cfg, batch, repeats=spec["repeats"], steps=spec["steps"],
                             warmup=spec["warmup"], compiles=spec["compiles"],
                             ablation=not small, hlo=True, aot=small)
    lap("step")
    log("[bench] 2/5 precision fidelity (forward + backward)")
    res.update(measure_fidelity(cfg, batch, compiles=spec["fidelity_compiles"],
                                hand_compile=not small))
    lap("fidelity")
    log("[bench] 3/5 memory")
    res["memory_bytes"] = measure_memory(cfg, batch, {"float16": res.pop("memory_float16")})
    res["memory_temp_ratio_vs_f32"] = memory_ratios(res["memory_bytes"])
    res["scaling"] = []
    for depth in spec["depths"]:
        lap("memory" if not res["scaling"] else "scaling")
        log(f"[bench] 4/5 scaling: {depth} layers")
        if depth == cfg.layers and spec["depth_repeats"] <= spec["repeats"]:
            r = res
        else:
            r = measure_step(cfg.replace(layers=depth), batch, repeats=spec["depth_repeats"],
                             steps=spec["steps"], warmup=spec["warmup"],
                             compiles=spec["depth_compiles"], ablation=False, hlo=True)
        s = {k: r[k] for k in ("params", "amp_step_ms", "baseline_step_ms",
                                "amp_step_runtime_ratio", "amp_step_runtime_ratio_paired",
                                "amp_step_runtime_ratio_paired_iqr", "amp_compile_s",
                                "baseline_compile_s", "amp_step_compile_ratio",
                                "amp_step_compile_ratio_paired", "amp_step_runtime_ratio_min",
                                "amp_step_cpu_time_ratio", "amp_skipped_steps")}
        s["fusions_amp"] = r["hlo_ops"]["compiled_amp"]["fusion"]
        s["fusions_baseline"] = r["hlo_ops"]["compiled_baseline"]["fusion"]
        res["scaling"].append({"layers": depth, **s})
    lap("scaling" if spec["depths"] else "memory")
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small model, a few minutes on CPU")
    size.add_argument("--smoke", action="store_true",
                      help="tiny model, 2 timing repeats (< 60 s); no markdown")
    size.add_argument("--full", action="store_true",
                      help="gpt2-small shape (12x768, seq 1024, batch 8) + tokens/s and MFU")
    ap.add_argument("--json", metavar="PATH", help="write all results and metadata here")
    ap.add_argument("--markdown", metavar="PATH", default=None,
                    help="rewrite this file's bench section (default: BENCHMARKS.md, except "
                         "with --smoke)")
    ap.add_argument("--no-markdown", action="store_true", help="do not touch any markdown")
    ap.add_argument("--peer-only", action="store_true",
                    help="only the PyTorch peer comparison (section 5); never writes markdown")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    mode = ("smoke" if args.smoke else "quick" if args.quick else "full" if args.full
            else "standard")
    spec = MODES[mode]
    cfg, batch = spec["config"], spec["batch"]
    small = mode == "smoke"
    log(f"[bench] mode={mode} backend={jax.default_backend()} config={cfg} batch={batch}")

    sections: dict[str, float] = {}
    mark = [time.perf_counter()]

    def lap(name: str) -> None:
        now = time.perf_counter()
        sections[name] = round(sections.get(name, 0.0) + now - mark[0], 1)
        mark[0] = now

    if args.peer_only:
        _, params, _ = setup(cfg, batch)
        res: dict = {"config": {**cfg.__dict__, "batch": batch}, "params": param_count(params)}
    else:
        res = core_sections(cfg, batch, spec, small, lap)
    log("[bench] 5/5 peer: the same GPT in PyTorch, interleaved with jaxamp steps")
    res["peer"], jax_runners, jax_times = measure_peer(
        cfg, batch, dtypes=spec["peer_dtypes"], repeats=spec["peer_repeats"],
        steps=spec["peer_steps"], warmup=spec["peer_warmup"], compile=spec["peer_compile"],
        aot=small)
    if mode == "full":
        if set(jax_times) >= set(POLICIES):  # the peer run timed every policy: reuse it
            _, params, _ = setup(cfg, batch)
            res["throughput"] = throughput_summary(cfg, batch, params, jax_times, jax_runners)
        else:
            log("[bench] throughput float32 / bfloat16 / float16")
            res["throughput"] = measure_throughput(cfg, batch, repeats=spec["depth_repeats"],
                                                   steps=spec["steps"], warmup=spec["warmup"])
    del jax_runners
    res["gpu_targets"] = gpu_targets(res)
    res["targets"] = {k: {"target": f"<= {t}", "met": res[k] <= t} for k, t in TARGETS.items()
                      if k in res}
    lap("peer")
    res["metadata"] = metadata(mode, started)
    res["metadata"]["section_s"] = sections
    res["metadata"]["peer_only"] = args.peer_only

    print_tables(res)
    print(f"\n[bench] {mode} finished in {res['metadata']['wall_s']:.0f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2, default=float) + "\n")
        print(f"[bench] wrote {args.json}")
    md = args.markdown or (None if small else str(HERE.parent / "BENCHMARKS.md"))
    if md and not args.no_markdown and not args.peer_only:
        key = f"{jax.default_backend()}-{mode}"
        write_markdown(Path(md), key, markdown_section(res))
        print(f"[bench] rewrote the bench:{key} section of {md}")
    return res


if __name__ == "__main__":
    main()
