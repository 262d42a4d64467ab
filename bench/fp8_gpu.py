"""FP8 matmuls on a GPU: does each planned FP8 GEMM become a cuBLASLt FP8 GEMM, and tokens/s of
the FP8 train step against the bf16 one, side by side in one process.

For ``gpt2-small`` (d_model 768) and ``d2048`` (whose GEMMs pass torchao's size threshold), the
``bench/gpt.py`` step under ``params=float32,compute=bfloat16,output=float32`` and the same with
``matmul=float8``. ``hlo``: :func:`jaxamp.fp8_gemms` (planned FP8 dots, ``__cublas$lt$matmul$f8``
calls compiled) and ``f16_fallback``, the f16 GEMMs that the bf16 step does not have (XLA's
silent ``TurnF8DotIntoF16Dot``); ``tokens_per_s`` of both steps (interleaved, medians).
A claim only once run on a GPU (``bash bench/gpu.sh OUTDIR``, stage ``fp8``).

Usage: ``python bench/fp8_gpu.py --json OUT.json [--cpu-dry-run]`` (toy sizes on CPU)
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

import jaxamp  # noqa: E402
from jaxamp.diagnostics._hlo import find_gemms  # noqa: E402

BF16 = "params=float32,compute=bfloat16,output=float32"
FP8 = BF16 + ",matmul=float8"
SHAPES = {  # name -> (config, batch)
    "gpt2-small": (GPTConfig(layers=12, d_model=768, heads=12, seq=1024, vocab=50304), 8),
    "d2048": (GPTConfig(layers=4, d_model=2048, heads=16, seq=1024, vocab=32768), 8),
}
DRY_SHAPES = {"gpt2-small": (GPTConfig(layers=2, d_model=64, heads=2, seq=32), 2),
              "d2048": (GPTConfig(layers=1, d_model=128, heads=2, seq=32), 2)}


def _f16(gemms) -> int:
    return sum(1 for g in gemms if "f16" in g.operand_dtypes)


def measure(name: str, cfg: GPTConfig, batch_size: int, *, dry: bool, steps: int,
            repeats: int) -> dict:
    model = GPT(cfg)
    params = init(model, cfg)
    batch = make_batch(cfg, batch_size)
    tx = optax.adamw(1e-4)
    rules = jaxamp.DEFAULT_OP_RULES
    if dry:  # toy sizes are below the size threshold: let every aligned matmul be FP8
        rules = rules.extend(handlers={"dot_general": jaxamp.FP8Matmuls(small=(0, 0), min_size=0)})
    out: dict = {"config": vars(cfg) | {"batch": batch_size}}
    states, steps_fn, gemms = {}, {}, {}
    for label, policy in (("bf16", BF16), ("fp8", FP8)):
        state = jaxamp.TrainState.create(model, params, tx, policy=policy)
        step = jaxamp.make_train_step(model, lm_loss, tx, policy=policy, op_rules=rules,
                                      donate=False)
        t0 = time.perf_counter()
        compiled = step.lower(state, batch).compile()
        out[f"{label}_compile_s"] = time.perf_counter() - t0
        gemms[label] = find_gemms(compiled.as_text())
        states[label], steps_fn[label] = state, step
        if label == "fp8":
            with_warning = jaxamp.fp8_gemms(step, state, batch)
            out["hlo"] = with_warning | {
                "fp8_gemm_calls_by_library": sorted(
                    {(g.library, g.target) for g in gemms[label]
                     if any(d and d.startswith("f8") for d in g.operand_dtypes)}),
                "f16_fallback": _f16(gemms["fp8"]) - _f16(gemms["bf16"]),
                "ok": (with_warning["fused"] == with_warning["planned"]
                       and _f16(gemms["fp8"]) == _f16(gemms["bf16"]))
                if with_warning["checked"] else None,
            }
    report = jaxamp.audit(lambda p, b: lm_loss(model.apply, p, b), params, batch, policy=FP8,
                          op_rules=rules)
    out["matmuls"] = {"fp8": sum(m["fp8"] == "yes" for m in report.matmuls),
                      "all": len(report.matmuls),
                      "why_not": sorted({m["reason"] for m in report.matmuls} - {""})}

    def runner(label):
        def run(n):
            s = states[label]
            for _ in range(n):
                s, m = steps_fn[label](s, batch)
            jax.block_until_ready(m["loss"])
        return run

    wall = interleaved_runtime({k: runner(k) for k in ("bf16", "fp8")}, repeats=repeats,
                                  steps=steps, warmup=1)
    tokens = batch_size * cfg.seq
    for label in ("bf16", "fp8"):
        out[f"{label}_tokens_per_s"] = tokens / med(wall[label])
    out["fp8_over_bf16_tokens_per_s"] = out["fp8_tokens_per_s"] / out["bf16_tokens_per_s"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, help="where the results go")
    ap.add_argument("--cpu-dry-run", action="store_true", help="toy sizes on CPU")
    ap.add_argument("--shapes", default="gpt2-small,d2048")
    args = ap.parse_args(argv)
    dry = args.cpu_dry_run
    table = DRY_SHAPES if dry else SHAPES
    results = {"backend": jax.default_backend(), "dry_run": dry,
               "device": str(jax.devices()[0].device_kind), "shapes": {},
               "command": "python bench/fp8_gpu.py --json OUT.json" + (" --cpu-dry-run"
                                                                      if dry else "")}
    for name in args.shapes.split(","):
        cfg, b = table[name]
        results["shapes"][name] = measure(name, cfg, b, dry=dry, steps=2 if dry else 10,
                                          repeats=2 if dry else 5)
        print(json.dumps({name: results["shapes"][name]}, default=str), flush=True)
    Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    for name, r in results["shapes"].items():
        print(f"{name}: FP8 GEMMs planned {r['hlo']['planned']}, fused {r['hlo']['fused']}, "
              f"f16 fallback {r['hlo']['f16_fallback']}; tokens/s bf16 "
              f"{r['bf16_tokens_per_s']:.0f} fp8 {r['fp8_tokens_per_s']:.0f} "
              f"(x{r['fp8_over_bf16_tokens_per_s']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
