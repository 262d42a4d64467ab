#!/usr/bin/env python
"""jaxamp benchmarks: one entry point, every figure a ratio measured side by side.

Usage::

    python bench/run.py --quick --json bench/results-cpu-quick.json   # a few minutes, 2 CPUs
    python bench/run.py --smoke --json /tmp/smoke.json                # < 1 minute, for a test
    python bench/run.py --full --json /tmp/full.json                  # gpt2-small shape, GPU
    python bench/run.py --gpu --json OUT/results-gpu.json             # the GPU issue's run
    python bench/run.py --gpu --cpu-dry-run --json /tmp/gpu-dry.json  # the same, toy size, CPU

``--gpu`` (``_gpu.py``, run by ``bench/gpu.sh``) is its own mode: jaxamp, the hand-cast twin
and PyTorch AMP in float32/bfloat16/float16 at the gpt2-small shape, one process per framework,
and the GPU issue's five targets.

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

Layout (``bench/`` is a script directory: this file puts it on ``sys.path``): ``_steps.py``
(the steps, runners and shared setup), ``_timing.py`` (interleaved timing), ``_hlo.py`` (HLO
and jaxpr readers), one module per section (``_overhead.py`` 1 and 4, ``_fidelity.py`` 2,
``_memory.py`` 3, ``_peer.py`` 5, ``_throughput.py`` tokens/s and MFU), ``_targets.py``,
``_report.py`` (tables, stdout, metadata) and ``_markdown.py`` (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
if __name__ == "__main__" and {"--gpu", "--gpu-side"} & set(sys.argv[1:]):
    # --gpu: a light parent that starts one process per framework (and never JAX itself).
    from _gpu import cli

    sys.exit(cli(sys.argv[1:]))

import jax  # noqa: E402
from _fidelity import measure_fidelity  # noqa: E402
from _gpu import dry_run_requested, gpu_main, side_main  # noqa: E402
from _markdown import markdown_section, write_markdown  # noqa: E402
from _memory import measure_memory, memory_ratios  # noqa: E402
from _overhead import measure_step, scaling_row  # noqa: E402
from _peer import measure_peer  # noqa: E402
from _report import metadata, print_tables  # noqa: E402
from _steps import POLICIES, log, setup  # noqa: E402
from _targets import TARGETS, gpu_targets  # noqa: E402
from _throughput import measure_throughput, throughput_summary  # noqa: E402
from gpt import GPTConfig, param_count  # noqa: E402

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
                  repeats=31, steps=2, warmup=3, compiles=7, fidelity_compiles=3,
                  depths=(2, 4, 8), depth_repeats=31, depth_compiles=7,
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
        res["scaling"].append(scaling_row(depth, r))
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
    size.add_argument("--gpu", action="store_true",
                      help="the GPU run of bench/gpu.sh: jaxamp / hand-cast Flax / PyTorch AMP "
                           "in f32, bf16, f16 at the gpt2-small shape, one process per "
                           "framework, and the five GPU targets (see _gpu.py)")
    size.add_argument("--gpu-side", choices=("jax", "torch"), default=None,
                      help=argparse.SUPPRESS)  # one framework's process, started by --gpu
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="with --gpu: toy sizes on CPU to test the plumbing (also "
                         "JAXAMP_GPU_DRY_RUN=1); the figures mean nothing")
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="with --gpu: wall-clock budget of the whole measurement; variants "
                         "not compiled in time are recorded as skipped")
    ap.add_argument("--json", metavar="PATH", help="write all results and metadata here")
    ap.add_argument("--markdown", metavar="PATH", default=None,
                    help="rewrite this file's bench section (default: BENCHMARKS.md, except "
                         "with --smoke)")
    ap.add_argument("--no-markdown", action="store_true", help="do not touch any markdown")
    ap.add_argument("--peer-only", action="store_true",
                    help="only the PyTorch peer comparison (section 5); never writes markdown")
    args = ap.parse_args(argv)
    if args.gpu_side:  # no JAX backend is touched before this: the GPU is this process's
        side_main(args.gpu_side, dry_run_requested(args.cpu_dry_run), args.budget_s,
                  Path(args.json) if args.json else None)
        return {}
    if args.gpu:
        return gpu_main(dry_run_requested(args.cpu_dry_run), args.budget_s,
                        Path(args.json) if args.json else None)
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
