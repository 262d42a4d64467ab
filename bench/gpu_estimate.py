"""The programs of today's code, compiled for the H200 on CPU and estimated
(``jaxamp.gpu_program``; no GPU needed).

    JAX_PLATFORMS=cpu python bench/gpu_estimate.py [--model M] [--json OUT.json]

Each variant is compiled in a subprocess for the built-in H200 description and read with
``jaxamp.gpu_program``'s reader (``--commit C --measured``, the estimate against measured H200
step times: ``git show a1e47fe:bench/gpu_estimate.py``). ``--model``: ``bench-gpt`` (default):
``bench/gpu.sh``'s gpt2-small-shape step (``bench/gpt.py``, 12 layers, d 768, batch 16 x 1024,
AdamW, clip 1.0) and its hand-cast twin (``-fused``: ``attention="fused"``); ``example``: the
example's ``gpt2-small`` preset as ``examples/train_lm.py`` builds it (batch 8 x 1024;
``jaxamp-optbf16``: ``--opt-state bfloat16``; ``jaxamp-fused``: ``--attention fused``, cuDNN's
fused attention, the default since issue 40; the others ``--attention manual``, as the twin
``bench/lm_handcast.py`` writes it); ``llama``: tunix's Llama3 (NNX: RMSNorm, SwiGLU, rotary,
grouped-query attention) at gpt2-small size (12 layers, d 768, 12/4 heads, MLP 2048, vocabulary
32768, batch 8 x 1024) and its twin ``bench/llama_handcast.py``; ``llama-fp8``: the same under
bf16 and ``matmul=float8`` (``jaxamp-fp8``: default eligibility; ``jaxamp-fp8all``:
``FP8Matmuls(small=(0, 0), min_size=0)``; ``-fp8rw``/``-fp8rwall``, ``-fp8dl``/``-fp8dlall``:
the same with ``fp8=rowwise``, ``fp8=delayed``; a delayed step is lowered on the state its
first call makes, ``step.calibrate``), ``--d-model 2048`` for Llama 3.2 1B (16 layers, MLP 8192,
32/8 heads, vocabulary 128256, tied head) at batch 4 x 2048, ``--d-model 4096`` for Llama 3.1
8B's layers (MLP 14336, head 128, untied head; ``--layers 16`` fits AdamW on one H200),
``--layers`` to cut layers; ``llama-fp8-fused``: the same with the attention as
``jax.nn.dot_product_attention`` (cuDNN's fused attention; tunix writes it out with float32 scores;
``bench/fp8_gpu.py --llama-layers N`` times its recipes on a GPU). A ``hand/...`` variant is the
twin's plain ``jax.jit`` step (``bench/_steps.py``'s ``hand_train_step``). Ratios are to
``hand/bfloat16``, else ``jaxamp-norecompute/bfloat16``, else ``jaxamp/bfloat16``. GEMMs as cuBLAS
calls (no autotuner without a GPU; ``--triton-gemm`` for XLA's untuned Triton tiles). ``mfu``:
``model_flops`` (the model file's ``flops_per_token``, ``6 N + 12 L d T``, times the step's tokens;
None for the Llamas) over the estimated time and the target's dense bf16 peak; the estimate reads
0.63-0.74x of measured step times, so it is 1.35-1.6x a measured MFU. ``attention_kernels``: cuDNN
fused-attention calls per step by target and dtypes; ``ms_by_part``: :func:`breakdown`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TARGET = ROOT / "jaxamp" / "diagnostics" / "gpu_targets" / "h200.txtpb"
# (side, compute dtype) in gpu.sh's names; the hand-cast bf16 step is every model's reference.
VARIANTS = tuple("jaxamp/bfloat16 jaxamp/float16 jaxamp-norecompute/bfloat16 "
                 "jaxamp-norecompute/float16 jaxamp-recompute/bfloat16 hand/bfloat16 hand/float16 "
                 "jaxamp/float32 hand/float32 jaxamp-fused/bfloat16 hand-fused/bfloat16".split())
MODELS = {"bench-gpt": VARIANTS,
          "example": tuple("jaxamp/bfloat16 jaxamp/float16 jaxamp-norecompute/bfloat16 "
                           "jaxamp-recompute/bfloat16 jaxamp/float32 jaxamp-optbf16/bfloat16 "
                           "hand/bfloat16 hand/float16 jaxamp-fused/bfloat16 "
                           "jaxamp-fused/float16".split()),
          "llama": tuple("jaxamp/bfloat16 jaxamp/float16 jaxamp-norecompute/bfloat16 "
                         "jaxamp-recompute/bfloat16 jaxamp/float32 hand/bfloat16 "
                         "hand/float16".split()),
          "llama-fp8": tuple(f"jaxamp{s}/bfloat16" for s in ("", "-fp8", "-fp8all", "-fp8rw",
                                                             "-fp8rwall", "-fp8dl", "-fp8dlall"))}
MODELS["llama-fp8-fused"] = MODELS["llama-fp8"]
RECIPES = {"jaxamp-fp8rw": ",fp8=rowwise", "jaxamp-fp8dl": ",fp8=delayed"}
REFERENCE = "hand/bfloat16"
CONFIG = dict(layers=12, d_model=768, heads=12, seq=1024)
BATCH = 16
LLAMA = dict(num_layers=12, vocab_size=32768, embed_dim=768, hidden_dim=2048, num_heads=12,
             head_dim=64, num_kv_heads=4, rope_theta=500_000, norm_eps=1e-5)
SMALL_BATCH = 8  # the example's and the Llama's steps: 8 x 1024 tokens
# --d-model 2048: Llama 3.2 1B (tunix's llama3p2_1b), batch 4 x 2048 (same 8k tokens per step)
LLAMA_1B = dict(num_layers=16, vocab_size=128256, embed_dim=2048, hidden_dim=8192,
                num_heads=32, head_dim=64, num_kv_heads=8, rope_theta=500_000, norm_eps=1e-5,
                weight_tying=True)
# --d-model 4096: Llama 3.1 8B (tunix's llama3p1_8b, untied head), batch 4 x 2048
LLAMA_8B = dict(LLAMA_1B, num_layers=32, embed_dim=4096, hidden_dim=14336, head_dim=128,
                weight_tying=False)
LLAMA_SHAPES = {768: (LLAMA, SMALL_BATCH, 1024), 2048: (LLAMA_1B, 4, 2048),
                4096: (LLAMA_8B, 4, 2048),  # 64: a toy for fp8_gpu.py's CPU dry run
                64: (dict(LLAMA, vocab_size=256, embed_dim=64, hidden_dim=128, head_dim=16), 2, 32)}
FP8 = ",matmul=float8"  # "jaxamp-fp8": default eligibility; "jaxamp-fp8all": every matmul


def _rules(side: str):
    """A variant's op rules: recompute off / everywhere (issue 40's old default), FP8 for every
    aligned matmul but the first and the head (``jaxamp-fp8all``) or for those too
    (``...every``: the head in FP8, which no anchor recipe does), else the default."""
    import jaxamp

    if side.startswith("jaxamp-fp8") and side.endswith(("all", "every")):
        return jaxamp.DEFAULT_OP_RULES.extend(handlers={"dot_general": jaxamp.FP8Matmuls(
            small=(0, 0), min_size=0, keep_first_last=not side.endswith("every"))})
    return jaxamp.DEFAULT_OP_RULES.extend(
        recompute={"jaxamp-norecompute": False, "jaxamp-recompute": True}.get(side))


def _bench_gpt(name: str, sds, device):
    """(lower thunk) of one ``bench/gpt.py`` variant, as ``bench/_gpu.py`` builds it."""
    from _steps import POLICIES, AmpRunner, HandRunner, make_tx, setup
    from gpt import GPT, GPTConfig

    import jaxamp

    cfg = GPTConfig(**CONFIG)
    model, params, batch = setup(cfg, BATCH)
    side, dt = name.split("/")
    if side.startswith("jaxamp"):
        m = GPT(cfg.replace(attention="fused")) if side == "jaxamp-fused" else model
        r = AmpRunner(m, params, make_tx(), batch, POLICIES[dt],
                      jaxamp.default_loss_scale(POLICIES[dt]), op_rules=_rules(side))
        return lambda: r.step.lower(sds(r.state), sds(batch))
    # "hand-fused": the twin with jax.nn.dot_product_attention (cuDNN) in the compute dtype
    r = HandRunner(cfg.replace(attention="fused") if side == "hand-fused" else cfg, params,
                   make_tx(), batch, dt)
    return lambda: r.step.lower(*sds(r.args()))


def _hand(loss, tx, dt: str, sds, params, batch, **kw):
    """(lower thunk) of a hand-cast twin's plain jit step (``_steps.hand_train_step``)."""
    import jax
    from _steps import hand_carry, hand_train_step

    state = (*hand_carry(params, jax.eval_shape(tx.init, params), dt), batch)
    return lambda: hand_train_step(loss, tx, dt, **kw).lower(*sds(state))


def _example(name: str, sds, device):
    """The example's gpt2-small step, as ``examples/train_lm.py`` builds it."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    sys.path.insert(0, str(ROOT / "examples"))
    import lm_cli
    import lm_model
    import train_lm
    from _steps import POLICIES as POLICY

    import jaxamp

    side, dt = name.split("/")
    attention = "fused" if side == "jaxamp-fused" else "manual"
    args = train_lm.build_parser().parse_args(
        ["--preset", "gpt2-small", "--policy", POLICY[dt], "--batch-size", str(SMALL_BATCH),
         "--attention", attention])
    config = dataclasses.replace(lm_model.PRESETS["gpt2-small"], attention=attention)
    # "jaxamp-optbf16": AdamW's moments stored in bfloat16 (--opt-state bfloat16)
    policy = jaxamp.get_policy(POLICY[dt] + (",opt_state=bfloat16"
                                             if side == "jaxamp-optbf16" else ""))
    loss_scale = lm_cli.make_loss_scale("dynamic" if dt == "float16" else "none", args)
    model, tx = lm_model.GPT(config), train_lm.make_optimizer(args)
    ids = jax.ShapeDtypeStruct((SMALL_BATCH, config.block_size), jnp.int32)
    batch = {"inputs": ids, "targets": ids}
    if side == "hand":  # the dtype= twin in a plain jit step: same loss, optimizer, clip
        import lm_handcast

        twin = lm_handcast.HandCastGPT(config, jnp.dtype(dt))
        return _hand(lambda p, b: train_lm.loss_fn(twin.apply, p, b), tx, dt, sds,
                     lm_model.abstract_params(config), batch, clip_norm=args.clip_norm,
                     period=args.growth_interval)
    step = jaxamp.make_train_step(model, train_lm.loss_fn, tx, policy=policy,
                                  clip_norm=args.clip_norm or None, op_rules=_rules(side))
    state = jax.eval_shape(lambda p: jaxamp.TrainState.create(
        model, p, tx, loss_scale=loss_scale, policy=policy), lm_model.abstract_params(config))
    return lambda: step.lower(sds(state), sds(batch))


def _fused_block(self, x, segment_pos, cache, attn_mask):
    """tunix Llama3's ``Attention.block`` (no cache) with the attention itself as
    ``jax.nn.dot_product_attention(is_causal=True)`` (cuDNN's fused flash attention on a GPU,
    grouped-query heads as they are): ``--model llama-fp8-fused``."""
    import jax
    from third_party import import_bare

    rope = import_bare("tunix.models.llama3.model").apply_rope
    q = rope(self.q_proj(x), segment_pos, head_dim=self.head_dim)
    k = rope(self.k_proj(x), segment_pos, head_dim=self.head_dim)
    out = jax.nn.dot_product_attention(q, k, self.v_proj(x), scale=self.scale, is_causal=True)
    return None, self.o_proj(out)


def _llama(name: str, sds, device, d_model: int = 768, layers: int | None = None,
           attention: str = "manual", run: bool = False):
    """tunix's Llama3 (NNX) at ``LLAMA_SHAPES[d_model]`` under jaxamp's step, as its users run
    it (``jaxamp-fp8*``: with ``matmul=float8``); or its hand-cast twin in a plain jit step
    (``hand/...``). ``run``: the jaxamp step's ``(step, state, batch)`` of real arrays, to be
    timed (``bench/fp8_gpu.py``), instead of the lower thunk of their shapes."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    sys.path.insert(0, str(ROOT / "tests"))
    from _steps import POLICIES as POLICY
    from third_party import import_bare

    import jaxamp

    m = import_bare("tunix.models.llama3.model")
    if attention == "fused":  # this process compiles only this model's variants
        m.Attention.block = _fused_block
    side, dt = name.split("/")
    shape, batch_size, seq = LLAMA_SHAPES[d_model]
    config = m.ModelConfig(**dict(shape, num_layers=layers or shape["num_layers"]))
    build = (lambda f, *a: f(*a)) if run else jax.eval_shape  # shapes only: lowered, not run

    def loss(model, batch):
        logits, _ = model(batch["inputs"], batch["positions"], None, batch["mask"])
        return jaxamp.softmax_cross_entropy(logits, batch["targets"])

    def make_batch():
        ids = jax.random.randint(jax.random.key(0), (batch_size, seq), 0, config.vocab_size)
        return {"inputs": ids, "targets": jnp.roll(ids, -1, 1),
                "positions": jnp.broadcast_to(jnp.arange(seq), ids.shape),
                "mask": jnp.broadcast_to(jnp.tri(seq, dtype=bool), (batch_size, seq, seq))}

    batch = build(make_batch)
    if side == "hand":  # the dtype= twin in a plain jit step: same loss, AdamW, clip
        from llama_handcast import HandCastLlama3

        graphdef, params = nnx.split(nnx.eval_shape(
            lambda: HandCastLlama3(config, dtype=jnp.dtype(dt), rngs=nnx.Rngs(0))))
        return _hand(lambda p, b: loss(nnx.merge(graphdef, p), b), optax.adamw(1e-3), dt, sds,
                     params, batch, clip_norm=1.0)
    policy = POLICY[dt] + (FP8 if side.startswith("jaxamp-fp8") else "") + RECIPES.get(
        side.removesuffix("all").removesuffix("every"), "")
    state = build(lambda: jaxamp.TrainState.create(
        m.Llama3(config, rngs=nnx.Rngs(0)), tx=optax.adamw(1e-3), policy=policy))
    step = jaxamp.make_train_step(loss_fn=loss, clip_norm=1.0, op_rules=_rules(side))
    if side.startswith("jaxamp-fp8dl"):  # with the amax histories the first call makes
        state = build(step.calibrate, state, batch)
    return (step, state, batch) if run else lambda: step.lower(sds(state), sds(batch))


BUILDERS = {"bench-gpt": _bench_gpt, "example": _example, "llama": _llama, "llama-fp8": _llama,
            "llama-fp8-fused": functools.partial(_llama, attention="fused")}


def child(out: Path, triton_gemm: bool, model: str, names: list[str], **shape) -> None:
    """Compiles each variant (:func:`compile_tree`'s subprocess): ``<variant>.hlo/.mlir/.json``."""
    import jax

    from jaxamp.diagnostics.gpu import gpu_target

    sys.path.insert(0, str(Path.cwd() / "bench"))
    device = gpu_target(TARGET).compile_device()
    sharding = jax.sharding.SingleDeviceSharding(device)

    def sds(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
                            if hasattr(x, "shape") else x, tree)

    for name in names:
        t0, base = time.perf_counter(), out / name.replace("/", "_")
        try:
            lower = BUILDERS[model](name, sds, device, **shape)
            with jax.default_device(device):
                lowered = lower()
            compiled = lowered.compile(compiler_options={"xla_gpu_enable_triton_gemm": triton_gemm})
        except Exception as e:  # a variant this code cannot build
            base.with_suffix(".json").write_text(
                json.dumps({"error": f"{type(e).__name__}: {str(e)[:300]}"}))
            print(f"[estimate] {name}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
            continue
        ma = compiled.memory_analysis()
        base.with_suffix(".hlo").write_text(compiled.as_text())
        base.with_suffix(".mlir").write_text(lowered.as_text())
        base.with_suffix(".json").write_text(json.dumps({
            "temp": ma.temp_size_in_bytes, "argument": ma.argument_size_in_bytes,
            "output": ma.output_size_in_bytes, "alias": ma.alias_size_in_bytes,
            "compile_s": round(time.perf_counter() - t0, 1)}))
        print(f"[estimate] {name}: compiled in {time.perf_counter() - t0:.1f} s", file=sys.stderr)


def compile_tree(tree: Path, out: Path, model: str, names: list[str], args: list[str]) -> None:
    """Runs :func:`child` in a subprocess whose ``jaxamp`` is the one in ``tree``; ``args``:
    more of its command line (``--triton-gemm``, ``--d-model``, ``--layers``)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(tree))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(out), "--model",
           model, "--variants", ",".join(names), *args]
    subprocess.run(cmd, cwd=tree, env=env, check=True)


def model_flops(model: str) -> int | None:
    """Training FLOPs of one step: the model file's ``flops_per_token`` x tokens; None: Llama."""
    import jax
    import jax.numpy as jnp

    sys.path[:0] = [str(HERE), str(ROOT / "examples")]
    if model == "bench-gpt":
        from gpt import GPT, GPTConfig, flops_per_token

        cfg = GPTConfig(**CONFIG)
        ids = jax.ShapeDtypeStruct((1, cfg.seq), jnp.int32)
        params = jax.eval_shape(GPT(cfg).init, jax.random.key(0), ids)["params"]
        return flops_per_token(cfg, params) * BATCH * cfg.seq
    import lm_model

    config = lm_model.PRESETS["gpt2-small"]
    return lm_model.flops_per_token(config) * SMALL_BATCH * config.block_size \
        if model == "example" else None


def attention_calls(prog) -> list[dict]:
    """``[{"target", "dtypes", "calls"}]``: cuDNN fused-attention runs per step (loops counted)."""
    calls: dict[tuple, int] = {}
    for k in prog.attention:
        calls[(k.target, k.dtypes)] = calls.get((k.target, k.dtypes), 0) + k.times
    return [{"target": t, "dtypes": list(d), "calls": n} for (t, d), n in calls.items()]


# tunix Llama3's attention core: score/value einsums, softmax, mask, rotary (not projections)
ATTENTION = re.compile(r"BHGTS|/attention/(?!\w+_proj/)")
#: the name scope of an FP8 matmul (its decision mark: ``jaxamp_matmul<CALL.RECIPE>``)
FP8_SCOPE = re.compile(r"jaxamp_matmul<\d+\.(?:current|rowwise|delayed)[^>]*>")


def breakdown(prog) -> dict[str, float]:
    """Estimated ms by part: ``gemm_bf16`` (other matmuls: projections, MLP, head), ``gemm_fp8``,
    ``fp8_scaling`` (kernels of an FP8 matmul's name scope: amax, quantise, as XLA names fusion
    roots), ``attention`` (:data:`ATTENTION`, GEMMs included), ``rest`` (optimizer, norms...)."""
    out = dict.fromkeys(("gemm_bf16", "gemm_fp8", "fp8_scaling", "attention", "rest"), 0.0)
    for k in prog.kernels:
        gemm = k.kind in ("gemm", "attention", "convolution")
        part = "gemm_fp8" if gemm and k.fp8 else "attention" if ATTENTION.search(
            k.op_name) or k.kind == "attention" else "gemm_bf16" if gemm else \
            "fp8_scaling" if FP8_SCOPE.search(k.op_name) else "rest"
        out[part] += 1e3 * prog.target.seconds(k) * k.times
    return out


def rows(out: Path, names: list[str], flops: int | None = None) -> list[dict]:
    """One row per compiled variant; ``flops`` (:func:`model_flops`) for the estimate's MFU."""
    from jaxamp.diagnostics.gpu import GpuProgram

    result = []
    for name in names:
        base = out / name.replace("/", "_")
        info = json.loads(base.with_suffix(".json").read_text())
        if "error" in info:
            result.append({"variant": name, "error": info["error"]})
            continue
        prog = GpuProgram.read(base.with_suffix(".hlo").read_text(), "h200",
                               lowered=base.with_suffix(".mlir").read_text())
        result.append({"variant": name, "estimated_ms": 1e3 * prog.estimated_seconds,
                       "kernel_bytes": prog.bytes, "launches": prog.launches,
                       "flops": prog.flops, "temp_bytes": info["temp"],
                       "argument_bytes": info["argument"],
                       "gemm_libraries": prog.gemm_libraries(),
                       "attention_kernels": attention_calls(prog),
                       "fp8_planned": prog.fp8_planned, "fp8_formed": prog.fp8_formed,
                       "fp8_formed_flops_share": prog.fp8_formed_flops
                       / max(prog.fp8_planned_flops, 1), "ms_by_part": breakdown(prog),
                       "model_flops": flops, "mfu": prog.mfu(flops) if flops else None,
                       "compile_s": info["compile_s"]})
    reference = next((v for v in (REFERENCE, "jaxamp-norecompute/bfloat16", "jaxamp/bfloat16")
                      if v in names), None)
    ref = next((r for r in result if r["variant"] == reference and "error" not in r), None)
    for r in result:
        if ref is None or "error" in r:
            continue
        r["estimated_ratio"] = r["estimated_ms"] / ref["estimated_ms"]
        r["bytes_ratio"] = r["kernel_bytes"] / ref["kernel_bytes"]
        r["temp_ratio"] = r["temp_bytes"] / ref["temp_bytes"]
    return result


def table(result: list[dict]) -> str:
    """The markdown table: est. ratio is the reference's tokens/s over the variant's (>1 is
    slower); FP8 GEMMs: formed/planned; the estimated ms of the parts (:func:`breakdown`)."""
    lines = ["| variant | est. ms | est. ratio | tok/s x | kernel GB | bytes ratio | temp MiB | "
             "launches | est. MFU | FP8 GEMMs | ms: GEMM bf16 / FP8 / scaling / attention / rest |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    for r in result:
        if "error" in r:
            lines.append(f"| {r['variant']} | not built: {r['error'][:60]} |" + " |" * 9)
            continue
        ratio = r.get("estimated_ratio")
        lines.append(
            f"| {r['variant']} | {r['estimated_ms']:.2f} | {f(ratio, '.3f')} | "
            f"{f(ratio and 1 / ratio, '.3f')} | {r['kernel_bytes'] / 1e9:.1f} | "
            f"{f(r.get('bytes_ratio'), '.3f')} | {r['temp_bytes'] / 2**20:,.0f} | "
            f"{r['launches']} | {f(r.get('mfu'), '.1%')} | "
            f"{r['fp8_formed']}/{r['fp8_planned']} | "
            + " / ".join(f"{v:.2f}" for v in r["ms_by_part"].values()) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="bench-gpt")
    ap.add_argument("--variants", default=None, help="comma-separated (default: the model's)")
    ap.add_argument("--triton-gemm", action="store_true")
    ap.add_argument("--d-model", type=int, choices=sorted(LLAMA_SHAPES), default=768,
                    help="llama*: 768 (gpt2-small shape), 2048 (Llama 3.2 1B) or 4096 (3.1 8B)")
    ap.add_argument("--layers", type=int, default=None, help="llama*: fewer decoder layers")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    names = [v for v in (a.variants or ",".join(MODELS[a.model])).split(",") if v]
    if a.child is not None:
        child(a.child, a.triton_gemm, a.model, names,
              **({"d_model": a.d_model, "layers": a.layers} if "llama" in a.model else {}))
        return 0
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        compile_tree(ROOT, out, a.model, names, ["--d-model", str(a.d_model), "--layers", str(
            a.layers or 0)] + ["--triton-gemm"] * a.triton_gemm)
        result = rows(out, names, model_flops(a.model))
    print(table(result))
    if a.json:
        import jax

        shape, batch, seq = LLAMA_SHAPES[a.d_model]
        a.json.write_text(json.dumps({
            "commit": "HEAD", "model": a.model, "target": "built-in h200",
            "gemms": "triton" if a.triton_gemm else "cublas", "rows": result,
            **({"config": CONFIG, "batch": BATCH} if a.model == "bench-gpt" else
               {"config": dict(shape, num_layers=a.layers or shape["num_layers"]),
                "batch": [batch, seq]} if "llama" in a.model else
               {"config": "gpt2-small preset", "batch": SMALL_BATCH}),
            "metadata": {"command": " ".join(["python", *sys.argv]),
                         "date": time.strftime("%Y-%m-%d"), "jax": jax.__version__,
                         "wall_s": round(time.perf_counter() - started, 1)}},
            indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
