"""The programs of today's code, compiled for the H200 on CPU and estimated
(``jaxamp.gpu_program``; no GPU needed).

    JAX_PLATFORMS=cpu python bench/gpu_estimate.py --json bench/results-gpu-estimate.json
    JAX_PLATFORMS=cpu python bench/gpu_estimate.py --model example \\
        --json bench/results-gpu-estimate-example.json
    JAX_PLATFORMS=cpu python bench/gpu_estimate.py --model llama \\
        --json bench/results-gpu-estimate-llama.json

Each variant is compiled in a subprocess for the built-in H200 description and read with
``jaxamp.gpu_program``'s reader; the table gives, per variant, the estimate and its ratio to a
reference variant (the hand-cast step). (The estimate against an H200's measured step times,
``--commit C --measured``, is in git: ``git show a1e47fe:bench/gpu_estimate.py``.)

``--model``: ``bench-gpt`` (default): the gpt2-small-shape step of ``bench/gpu.sh``
(``bench/gpt.py``, 12 layers, d 768, context 1024, batch 16 x 1024, AdamW, clip 1.0) and its
hand-cast twin (``jaxamp-fused``, ``hand-fused``: both with ``attention="fused"``);
``example``: the example's ``gpt2-small`` preset as ``examples/train_lm.py`` builds its step
(batch 8 x 1024; ``jaxamp-optbf16``: with ``--opt-state bfloat16``; ``jaxamp-fused``: with
``--attention fused``, the example's default since issue 40, which autocast runs as cuDNN's
fused attention; the other variants with ``--attention manual``, as they were first recorded
and as the hand-cast twin writes it) and its hand-cast twin (``bench/lm_handcast.py``);
``llama``: tunix's Llama3 (an NNX library we did not write: RMSNorm, SwiGLU, rotary,
grouped-query attention) at gpt2-small size (12 layers, d 768, 12 query / 4 key-value heads,
MLP 2048, vocabulary 32768, batch 8 x 1024) and its hand-cast twin
(``bench/llama_handcast.py``). A ``hand/...`` variant is the twin's plain ``jax.jit`` step
(``bench/_steps.py``'s ``hand_train_step``: grads, jmp loss scaling for float16, clip, the
model's optimizer). Every model's table is relative to ``hand/bfloat16`` (to
``jaxamp-norecompute/bfloat16`` when ``--variants`` leaves the twin out). GEMMs as cuBLAS
calls (no autotuner without a GPU; ``--triton-gemm`` for XLA's untuned Triton tiles).

Each row has the estimate's MFU (``mfu``): the model's FLOPs per step (``model_flops``: its
model file's ``flops_per_token``, ``6 N + 12 L d T``, times the step's tokens; the same for
both attention kinds) over the estimated step time and the target's dense bf16 Tensor Core
peak (``GpuProgram.mfu``). The estimate reads 0.63-0.74x of measured step times, so this MFU
is 1.35-1.6x what a measured step gives against the same peak. None for a model without
``flops_per_token`` (``llama``). ``attention_kernels``: the cuDNN fused-attention calls per
step by target and operand dtypes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TARGET = ROOT / "jaxamp" / "diagnostics" / "gpu_targets" / "h200.txtpb"
# (side, compute dtype) in gpu.sh's names; the hand-cast bf16 step is every model's reference.
VARIANTS = ("jaxamp/bfloat16", "jaxamp/float16", "jaxamp-norecompute/bfloat16",
            "jaxamp-norecompute/float16", "jaxamp-recompute/bfloat16", "hand/bfloat16",
            "hand/float16", "jaxamp/float32", "hand/float32", "jaxamp-fused/bfloat16",
            "hand-fused/bfloat16")
MODELS = {"bench-gpt": VARIANTS,
          "example": ("jaxamp/bfloat16", "jaxamp/float16", "jaxamp-norecompute/bfloat16",
                      "jaxamp-recompute/bfloat16", "jaxamp/float32", "jaxamp-optbf16/bfloat16",
                      "hand/bfloat16", "hand/float16", "jaxamp-fused/bfloat16",
                      "jaxamp-fused/float16"),
          "llama": ("jaxamp/bfloat16", "jaxamp/float16", "jaxamp-norecompute/bfloat16",
                    "jaxamp-recompute/bfloat16", "jaxamp/float32", "hand/bfloat16",
                    "hand/float16")}
REFERENCE = "hand/bfloat16"
CONFIG = dict(layers=12, d_model=768, heads=12, seq=1024)
BATCH = 16
LLAMA = dict(num_layers=12, vocab_size=32768, embed_dim=768, hidden_dim=2048, num_heads=12,
             head_dim=64, num_kv_heads=4, rope_theta=500_000, norm_eps=1e-5)
SMALL_BATCH = 8  # the example's and the Llama's steps: 8 x 1024 tokens


def _rules(side: str):
    """The op rules of a jaxamp variant: ``jaxamp-norecompute`` recompute off,
    ``jaxamp-recompute`` recompute everywhere (the default before issue 40), else the
    default (``None``)."""
    import jaxamp

    where = {"jaxamp-norecompute": False, "jaxamp-recompute": True}.get(side)
    return None if where is None else jaxamp.DEFAULT_OP_RULES.extend(recompute=where)


def _bench_gpt(name: str, sds, device):
    """(lower thunk) of one ``bench/gpt.py`` variant, as ``bench/_gpu.py`` builds it."""
    from _steps import POLICIES, AmpRunner, HandRunner, make_tx, setup
    from gpt import GPT, GPTConfig

    import jaxamp

    cfg = GPTConfig(**CONFIG)
    model, params, batch = setup(cfg, BATCH)
    side, dt = name.split("/")
    if side.startswith("jaxamp"):
        if side == "jaxamp-fused" and "attention" not in GPTConfig.__dataclass_fields__:
            raise ValueError("this code's GPTConfig has no attention= option")
        m = GPT(cfg.replace(attention="fused")) if side == "jaxamp-fused" else model
        rules = _rules(side)
        r = AmpRunner(m, params, make_tx(), batch, POLICIES[dt],
                      jaxamp.default_loss_scale(POLICIES[dt]), op_rules=rules)
        return lambda: r.step.lower(sds(r.state), sds(batch))
    # "hand-fused": the twin with jax.nn.dot_product_attention (cuDNN) in the compute dtype
    r = HandRunner(cfg.replace(attention="fused") if side == "hand-fused" else cfg, params,
                   make_tx(), batch, dt)
    return lambda: r.step.lower(*sds(r.args()))


POLICY = {"bfloat16": "params=float32,compute=bfloat16,output=float32",
          "float16": "params=float32,compute=float16,output=float32", "float32": "float32"}


def _example(name: str, sds, device):
    """The example's gpt2-small step, as ``examples/train_lm.py`` builds it."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    sys.path.insert(0, str(ROOT / "examples"))
    import lm_cli
    import lm_model
    import train_lm

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
    kind = "dynamic" if dt == "float16" else "none"
    loss_scale = lm_cli.make_loss_scale(kind, args)
    rules = _rules(side)
    model, tx = lm_model.GPT(config), train_lm.make_optimizer(args)
    ids = jax.ShapeDtypeStruct((SMALL_BATCH, config.block_size), jnp.int32)
    batch = {"inputs": ids, "targets": ids}
    if side == "hand":  # the dtype= twin in a plain jit step: same loss, optimizer, clip
        import lm_handcast
        from _steps import hand_scale_state, hand_train_step

        twin = lm_handcast.HandCastGPT(config, jnp.dtype(dt))
        step = hand_train_step(lambda p, b: train_lm.loss_fn(twin.apply, p, b), tx, dt,
                               clip_norm=args.clip_norm, period=args.growth_interval)
        params = lm_model.abstract_params(config)
        state = (params, jax.eval_shape(tx.init, params), hand_scale_state(dt),
                 jnp.zeros((), jnp.int32), batch)
        return lambda: step.lower(*sds(state))
    step = jaxamp.make_train_step(model, train_lm.loss_fn, tx, policy=policy,
                                  clip_norm=args.clip_norm or None,
                                  **({} if rules is None else {"op_rules": rules}))
    state = jax.eval_shape(lambda p: jaxamp.TrainState.create(
        model, p, tx, loss_scale=loss_scale, policy=policy), lm_model.abstract_params(config))
    return lambda: step.lower(sds(state), sds(batch))


def _llama(name: str, sds, device):
    """tunix's Llama3 (NNX) at gpt2-small size under jaxamp's step, as its users run it; or
    its hand-cast twin in a plain jit step (``hand/...``)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    sys.path.insert(0, str(ROOT / "tests"))
    from third_party import import_bare

    import jaxamp

    m = import_bare("tunix.models.llama3.model")
    side, dt = name.split("/")
    tokens = jnp.zeros((SMALL_BATCH, 1024), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(1024), tokens.shape)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((1024, 1024), bool)), (SMALL_BATCH, 1024, 1024))

    def loss(model, batch):
        logits, _ = model(batch["inputs"], batch["positions"], None, batch["mask"])
        return jaxamp.softmax_cross_entropy(logits, batch["targets"])

    batch = {"inputs": tokens, "targets": tokens, "positions": positions, "mask": mask}
    if side == "hand":  # the dtype= twin in a plain jit step: same loss, AdamW, clip
        from _steps import hand_scale_state, hand_train_step
        from llama_handcast import HandCastLlama3

        tx = optax.adamw(1e-3)
        graphdef, params = nnx.split(nnx.eval_shape(
            lambda: HandCastLlama3(m.ModelConfig(**LLAMA), dtype=jnp.dtype(dt),
                                   rngs=nnx.Rngs(0))))
        step = hand_train_step(lambda p, b: loss(nnx.merge(graphdef, p), b), tx, dt,
                               clip_norm=1.0)
        state = (params, jax.eval_shape(tx.init, params), hand_scale_state(dt),
                 jnp.zeros((), jnp.int32), batch)
        return lambda: step.lower(*sds(state))
    model = m.Llama3(m.ModelConfig(**LLAMA), rngs=nnx.Rngs(0))
    rules = _rules(side)
    state = jaxamp.TrainState.create(model, tx=optax.adamw(1e-3), policy=POLICY[dt])
    step = jaxamp.make_train_step(loss_fn=loss, clip_norm=1.0,
                                  **({} if rules is None else {"op_rules": rules}))
    return lambda: step.lower(sds(state), sds(batch))


BUILDERS = {"bench-gpt": _bench_gpt, "example": _example, "llama": _llama}


def child(out: Path, triton_gemm: bool, model: str, names: list[str]) -> None:
    """Builds and compiles each variant with the ``jaxamp`` and ``bench/`` on ``sys.path``
    (a subprocess of :func:`compile_tree`); writes ``<variant>.hlo`` and ``<variant>.json``."""
    import jax
    from jax.experimental import topologies

    sys.path.insert(0, str(Path.cwd() / "bench"))
    topo = topologies.get_topology_desc(platform="cuda", target_config=TARGET.read_text(),
                                        topology="1x1x1")
    device = topo.devices[0]
    sharding = jax.sharding.SingleDeviceSharding(device)

    def sds(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
                            if hasattr(x, "shape") else x, tree)

    for name in names:
        t0 = time.perf_counter()
        try:
            lower = BUILDERS[model](name, sds, device)
            with jax.default_device(device):
                lowered = lower()
            compiled = lowered.compile(
                compiler_options={"xla_gpu_enable_triton_gemm": triton_gemm})
        except Exception as e:  # a variant this code cannot build
            (out / f"{name.replace('/', '_')}.json").write_text(
                json.dumps({"error": f"{type(e).__name__}: {str(e)[:300]}"}))
            print(f"[estimate] {name}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
            continue
        ma = compiled.memory_analysis()
        (out / f"{name.replace('/', '_')}.hlo").write_text(compiled.as_text())
        (out / f"{name.replace('/', '_')}.json").write_text(json.dumps({
            "temp": ma.temp_size_in_bytes, "argument": ma.argument_size_in_bytes,
            "output": ma.output_size_in_bytes, "alias": ma.alias_size_in_bytes,
            "compile_s": round(time.perf_counter() - t0, 1)}))
        print(f"[estimate] {name}: compiled in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr)


def compile_tree(tree: Path, out: Path, triton_gemm: bool, model: str,
                 names: list[str]) -> None:
    """Runs :func:`child` in a subprocess whose ``jaxamp`` is the one in ``tree``."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(tree))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(out), "--model",
           model, "--variants", ",".join(names)] + (["--triton-gemm"] if triton_gemm else [])
    subprocess.run(cmd, cwd=tree, env=env, check=True)


def model_flops(model: str) -> int | None:
    """Training FLOPs of one step of ``model``: its model file's ``flops_per_token`` times
    the step's tokens (shapes only: nothing is initialised); None for ``llama``."""
    import jax
    import jax.numpy as jnp

    if model == "bench-gpt":
        sys.path.insert(0, str(HERE))
        from gpt import GPT, GPTConfig, flops_per_token

        cfg = GPTConfig(**CONFIG)
        ids = jax.ShapeDtypeStruct((1, cfg.seq), jnp.int32)
        params = jax.eval_shape(GPT(cfg).init, jax.random.key(0), ids)["params"]
        return flops_per_token(cfg, params) * BATCH * cfg.seq
    if model == "example":
        sys.path.insert(0, str(ROOT / "examples"))
        import lm_model

        config = lm_model.PRESETS["gpt2-small"]
        return lm_model.flops_per_token(config) * SMALL_BATCH * config.block_size
    return None


def attention_calls(prog) -> list[dict]:
    """``[{"target", "dtypes", "calls"}]``: the program's cuDNN fused-attention kernel runs
    per step (loop trips counted), by custom-call target and operand dtypes."""
    calls: dict[tuple, int] = {}
    for k in prog.attention:
        calls[(k.target, k.dtypes)] = calls.get((k.target, k.dtypes), 0) + k.times
    return [{"target": t, "dtypes": list(d), "calls": n} for (t, d), n in calls.items()]


def rows(out: Path, names: list[str], flops: int | None = None) -> list[dict]:
    """One row per compiled variant, read with today's reader; ``flops``: the model's FLOPs
    per step (:func:`model_flops`), for the estimate's MFU."""
    from jaxamp.diagnostics.gpu import GpuProgram

    result = []
    for name in names:
        base = out / name.replace("/", "_")
        info = json.loads(base.with_suffix(".json").read_text())
        if "error" in info:
            result.append({"variant": name, "error": info["error"]})
            continue
        prog = GpuProgram.read(base.with_suffix(".hlo").read_text(), "h200")
        result.append({"variant": name, "estimated_ms": 1e3 * prog.estimated_seconds,
                       "kernel_bytes": prog.bytes, "launches": prog.launches,
                       "flops": prog.flops, "temp_bytes": info["temp"],
                       "argument_bytes": info["argument"],
                       "gemm_libraries": prog.gemm_libraries(),
                       "attention": [k.target for k in prog.attention],
                       "attention_kernels": attention_calls(prog),
                       "model_flops": flops, "mfu": prog.mfu(flops) if flops else None,
                       "compile_s": info["compile_s"]})
    reference = REFERENCE if any(r["variant"] == REFERENCE for r in result) else \
        "jaxamp-norecompute/bfloat16"
    ref = next((r for r in result if r["variant"] == reference and "error" not in r), None)
    for r in result:
        if ref is None or "error" in r:
            continue
        r["estimated_ratio"] = r["estimated_ms"] / ref["estimated_ms"]
        r["bytes_ratio"] = r["kernel_bytes"] / ref["kernel_bytes"]
        r["temp_ratio"] = r["temp_bytes"] / ref["temp_bytes"]
    return result


def table(result: list[dict]) -> str:
    head = ("| variant | est. ms | est. ratio | kernel GB | bytes ratio | temp MiB | launches "
            "| est. MFU |\n|---|---|---|---|---|---|---|---|")
    lines = [head]

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    for r in result:
        if "error" in r:
            lines.append(f"| {r['variant']} | not built: {r['error'][:60]} |" + " |" * 6)
            continue
        lines.append(
            f"| {r['variant']} | {r['estimated_ms']:.2f} | {f(r.get('estimated_ratio'), '.3f')} | "
            f"{r['kernel_bytes'] / 1e9:.1f} | "
            f"{f(r.get('bytes_ratio'), '.3f')} | {r['temp_bytes'] / 2**20:,.0f} | "
            f"{r['launches']} | {f(r.get('mfu'), '.1%')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="bench-gpt")
    ap.add_argument("--variants", default=None, help="comma-separated (default: the model's)")
    ap.add_argument("--triton-gemm", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    names = [v for v in (a.variants or ",".join(MODELS[a.model])).split(",") if v]
    if a.child is not None:
        child(a.child, a.triton_gemm, a.model, names)
        return 0
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        compile_tree(ROOT, out, a.triton_gemm, a.model, names)
        result = rows(out, names, model_flops(a.model))
    print(table(result))
    if a.json:
        import jax

        a.json.write_text(json.dumps({
            "commit": "HEAD", "model": a.model, "target": "built-in h200",
            "gemms": "triton" if a.triton_gemm else "cublas",
            "config": {"bench-gpt": CONFIG, "llama": LLAMA}.get(a.model, "gpt2-small preset"),
            "batch": BATCH if a.model == "bench-gpt" else SMALL_BATCH, "rows": result,
            "metadata": {"command": " ".join(["python", *sys.argv]),
                         "date": time.strftime("%Y-%m-%d"), "jax": jax.__version__,
                         "wall_s": round(time.perf_counter() - started, 1)}},
            indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
