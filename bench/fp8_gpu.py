"""FP8 matmuls on a GPU: does each planned FP8 GEMM become a cuBLASLt FP8 GEMM, and tokens/s of
the FP8 train step against the bf16 one, side by side in one process.

For ``gpt2-small`` (d_model 768) and ``d2048`` (whose GEMMs pass torchao's size threshold), the
``bench/gpt.py`` step under ``params=float32,compute=bfloat16,output=float32`` and the same with
``matmul=float8``. ``hlo``: :func:`jaxamp.fp8_gemms` (planned FP8 dots, ``__cublas$lt$matmul$f8``
calls compiled) and ``f16_fallback``, the f16 GEMMs that the bf16 step does not have (XLA's
silent ``TurnF8DotIntoF16Dot``); ``tokens_per_s`` of both steps (interleaved, medians).
A claim only once run on a GPU (``bash bench/gpu.sh OUTDIR``, stage ``fp8``).

``--llama-layers N`` (key ``llama_recipes``): ``bench/gpu_estimate.py --model llama-fp8-fused
--d-model 2048``'s model (tunix's Llama3, fused attention, batch 4 x 2048) cut to N layers, its
bf16 step and each ``fp8=`` recipe (default eligibility) timed side by side, each beside the
estimate of the program it ran and its planned/formed FP8 GEMMs. ``--cpu-dry-run``: both parts
at toy size. Usage: ``python bench/fp8_gpu.py --json OUT.json [--cpu-dry-run] [--shapes S]``
``[--llama-layers N]`` (``--shapes ''``: the Llama3 alone).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import optax  # noqa: E402
from _steps import interleaved_runtime, med  # noqa: E402
from gpt import GPT, GPTConfig, init, lm_loss, make_batch  # noqa: E402
from gpu_estimate import LLAMA_SHAPES, _llama  # noqa: E402

import jaxamp  # noqa: E402
from jaxamp.diagnostics._hlo import find_gemms  # noqa: E402
from jaxamp.diagnostics.gpu import GpuProgram  # noqa: E402

BF16 = "params=float32,compute=bfloat16,output=float32"
FP8 = BF16 + ",matmul=float8"
SHAPES = {  # name -> (config, batch)
    "gpt2-small": (GPTConfig(layers=12, d_model=768, heads=12, seq=1024, vocab=50304), 8),
    "d2048": (GPTConfig(layers=4, d_model=2048, heads=16, seq=1024, vocab=32768), 8),
}
DRY_SHAPES = {"gpt2-small": (GPTConfig(layers=2, d_model=64, heads=2, seq=32), 2),
              "d2048": (GPTConfig(layers=1, d_model=128, heads=2, seq=32), 2)}
RUNS = tuple(f"jaxamp{s}/bfloat16" for s in ("", "-fp8", "-fp8dl", "-fp8rw"))


def _timed(variants: dict, steps: int, repeats: int) -> tuple[dict, dict]:
    """``{label: (step, state, batch)}``, each compiled once, timed side by side (interleaved,
    medians) beside the roofline estimate of the program that ran (``GpuProgram.read`` with the
    device's rates; on CPU an H200's, meaningless) and its planned/formed FP8 GEMMs (formed: on
    a GPU), as :func:`jaxamp.fp8_gemms` counts them -> (figures, ``{label: GpuProgram}``)."""
    gpu, out, progs, runs = jax.default_backend() == "gpu", {}, {}, {}
    for label, (step, state, batch) in variants.items():
        t0 = time.perf_counter()
        compiled = (lowered := step.lower(state, batch)).compile()
        prog = progs[label] = GpuProgram.read(compiled, jax.devices()[0] if gpu else "h200",
                                              lowered=lowered)
        out[label] = {"compile_s": time.perf_counter() - t0, "fp8_planned": prog.fp8_planned,
                      "fp8_formed": prog.fp8_formed if gpu else None, "fp8_formed_flops_share":
                      prog.fp8_formed_flops / max(prog.fp8_planned_flops, 1) if gpu else None}
        box = [state]  # run(n) threads the (donated) state through n calls
        def run(n, box=box, compiled=compiled, batch=batch):
            for _ in range(n):
                box[0], m = compiled(box[0], batch)
            jax.block_until_ready(m["loss"])
        runs[label] = run
    wall = interleaved_runtime(runs, repeats=repeats, steps=steps, warmup=1)
    for label, r in out.items():
        ms, est = 1e3 * med(wall[label]), 1e3 * progs[label].estimated_seconds
        r |= {"step_ms": ms, "estimated_ms": est, "measured_over_estimated": ms / est,
              "tokens_per_s": variants[label][2]["inputs"].size / ms * 1e3}
    return out, progs


def llama_recipes(dry: bool, layers: int, steps: int, repeats: int) -> dict:
    """:data:`RUNS` (gpu_estimate.py's bf16, current, delayed, rowwise) on its fused-attention
    Llama3 at d 2048 (``dry``: d 64, every aligned matmul FP8 but the first and the head)."""
    d = 64 if dry else 2048
    out, progs = _timed({name: _llama(name.replace("/", "all/") if dry and "fp8" in name
                                      else name, None, None, d, layers, "fused", run=True)
                         for name in RUNS}, steps, repeats)
    for r in out.values():
        r["over_bf16"] = r["tokens_per_s"] / out[RUNS[0]]["tokens_per_s"]
    return {"config": dict(LLAMA_SHAPES[d][0], num_layers=layers, attention="fused"), "variants":
            out, "batch": LLAMA_SHAPES[d][1:], "estimate_target": progs[RUNS[0]].target.source}


def measure(cfg: GPTConfig, batch_size: int, *, dry: bool, steps: int, repeats: int) -> dict:
    model, tx, rules = GPT(cfg), optax.adamw(1e-4), jaxamp.DEFAULT_OP_RULES
    params, batch = init(model, cfg), make_batch(cfg, batch_size)
    if dry:  # toy sizes are below the size threshold: let every aligned matmul be FP8
        rules = rules.extend(handlers={"dot_general": jaxamp.FP8Matmuls(small=(0, 0), min_size=0)})
    variants = {label: (jaxamp.make_train_step(model, lm_loss, tx, policy=policy, op_rules=rules,
                                               donate=False),
                        jaxamp.TrainState.create(model, params, tx, policy=policy), batch)
                for label, policy in (("bf16", BF16), ("fp8", FP8))}
    w = jaxamp.fp8_gemms(*variants["fp8"])  # warns where a planned FP8 dot formed no FP8 GEMM
    timed, progs = _timed(variants, steps, repeats)
    gemms = {label: find_gemms(prog.hlo) for label, prog in progs.items()}
    f16 = sum("f16" in g.operand_dtypes for g in gemms["fp8"]) - sum(
        "f16" in g.operand_dtypes for g in gemms["bf16"])  # XLA's silent TurnF8DotIntoF16Dot
    out: dict = {"config": vars(cfg) | {"batch": batch_size}, "hlo": w | {
        "fp8_gemm_calls_by_library": sorted({(g.library, g.target) for g in gemms["fp8"]
                                             if any(d and d.startswith("f8")
                                                    for d in g.operand_dtypes)}),
        "f16_fallback": f16, "ok": w["fused"] == w["planned"] and not f16 if w["checked"]
        else None}} | {f"{k}_{x}": r[x] for k, r in timed.items() for x in ("compile_s",
                                                                             "tokens_per_s")}
    report = jaxamp.audit(lambda p, b: lm_loss(model.apply, p, b), params, batch, policy=FP8,
                          op_rules=rules)
    out["matmuls"] = {"fp8": sum(m["fp8"] == "yes" for m in report.matmuls),
                      "all": len(report.matmuls),
                      "why_not": sorted({m["reason"] for m in report.matmuls} - {""})}
    out["fp8_over_bf16_tokens_per_s"] = out["fp8_tokens_per_s"] / out["bf16_tokens_per_s"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, help="where the results go")
    ap.add_argument("--cpu-dry-run", action="store_true", help="toy sizes on CPU")
    ap.add_argument("--shapes", default="gpt2-small,d2048", help="bench GPT shapes ('': none)")
    ap.add_argument("--llama-layers", type=int, default=0,
                    help="time the FP8 recipes on the Llama3 of N layers (0: not; dry run: 1)")
    args = ap.parse_args(argv)
    table = DRY_SHAPES if (dry := args.cpu_dry_run) else SHAPES
    steps, repeats = (2, 2) if dry else (10, 5)
    results = {"backend": jax.default_backend(), "dry_run": dry,
               "device": str(jax.devices()[0].device_kind), "shapes": {}, "command": " ".join(
                   ["python bench/fp8_gpu.py", *(sys.argv[1:] if argv is None else argv)])}
    for name in filter(None, args.shapes.split(",")):
        results["shapes"][name] = measure(*table[name], dry=dry, steps=steps, repeats=repeats)
        print(json.dumps({name: results["shapes"][name]}, default=str), flush=True)
    if args.llama_layers or dry:
        results["llama_recipes"] = llama_recipes(dry, args.llama_layers or 1, steps, repeats)
    Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    for name, r in results["shapes"].items():
        print(f"{name}: FP8 GEMMs planned {r['hlo']['planned']}, fused {r['hlo']['fused']}, "
              f"f16 fallback {r['hlo']['f16_fallback']}; tokens/s bf16 "
              f"{r['bf16_tokens_per_s']:.0f} fp8 {r['fp8_tokens_per_s']:.0f} "
              f"(x{r['fp8_over_bf16_tokens_per_s']:.2f})")
    for name, r in results.get("llama_recipes", {}).get("variants", {}).items():
        print(f"llama {name}: {r['tokens_per_s']:.0f} tokens/s (x{r['over_bf16']:.3f}), "
              f"{r['step_ms']:.2f} ms, est. {r['estimated_ms']:.2f}; FP8 GEMMs planned "
              f"{r['fp8_planned']}, formed {r['fp8_formed']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
