#!/usr/bin/env python
"""Saved residuals: the bytes reverse-mode AD keeps between forward and backward, by dtype and
by the op that produced them, params (and the batch) excluded.

Deterministic and platform-independent (what the program saves, not what an allocator did), so
the ratios hold on a GPU too. Measured for:

* jaxamp ``autocast`` of the bench GPT (``bench/gpt.py``) under float32, float16 and bfloat16
  (``jax.ad_checkpoint.print_saved_residuals``, read back line by line);
* the hand-cast twin (``bench/gpt_handcast.py``) in float16 and bfloat16;
* the PyTorch twin (``bench/torch_gpt.py``, same weights) under ``torch.autocast``, where torch
  is installed: every tensor autograd saves (``torch.autograd.graph.saved_tensors_hooks``),
  parameters excluded, each storage counted once;
* transformers' ``FlaxGPT2LMHeadModel`` and ``FlaxLlamaForCausalLM`` (small configs), under
  jaxamp, where ``transformers<5`` is installed.

    python bench/residuals.py                      # the bench GPT, 4 layers, d 256, seq 256
    python bench/residuals.py --layers 2 --d-model 128 --seq 128 --batch 4 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from gpt import GPT, GPTConfig, init, lm_loss, make_batch  # noqa: E402
from gpt_handcast import HandCastGPT, handcast_loss  # noqa: E402
from jax.ad_checkpoint import print_saved_residuals  # noqa: E402

import jaxamp  # noqa: E402

POLICIES = {"float32": "float32", "float16": "params=float32,compute=float16,output=float32",
            "bfloat16": "params=float32,compute=bfloat16,output=float32"}
_LINE = re.compile(r"^(\w+)\[([\d,]*)\] (.*)$")
_OP = re.compile(r"output of (\S+)")


def _dtype_bytes(name: str) -> int:
    short = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "f64": "float64",
             "i32": "int32", "i64": "int64", "i8": "int8", "u8": "uint8", "u32": "uint32",
             "bool": "bool", "i16": "int16"}
    return jnp.dtype(short.get(name, name)).itemsize


def _dtype_name(name: str) -> str:
    return {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "i32": "int32",
            "bool": "bool"}.get(name, name)


def summarize(items: list[tuple[str, int, str]]) -> dict:
    """``[(dtype, bytes, op)]`` -> totals by dtype and by producing op."""
    by_dtype: Counter = Counter()
    by_op: Counter = Counter()
    for dtype, nbytes, op in items:
        by_dtype[dtype] += nbytes
        by_op[f"{op} ({dtype})"] += nbytes
    total = sum(by_dtype.values())
    return {"bytes": int(total), "count": len(items),
            "by_dtype": dict(by_dtype.most_common()),
            "float32_share": by_dtype.get("float32", 0) / total if total else 0.0,
            "by_op": dict(by_op.most_common(12))}


def jax_residuals(fn, *args) -> dict:
    """What ``jax.vjp(fn, *args)`` saves, arguments and literals excluded."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(fn, *args)
    items = []
    for line in out.getvalue().splitlines():
        m = _LINE.match(line.strip())
        if not m or "from the argument" in m.group(3) or "from a literal" in m.group(3):
            continue
        shape = [int(d) for d in m.group(2).split(",") if d]
        nbytes = int(np.prod(shape, dtype=np.int64)) * _dtype_bytes(m.group(1))
        op = _OP.search(m.group(3))
        items.append((_dtype_name(m.group(1)), nbytes, op.group(1) if op else m.group(3)[:40]))
    return summarize(items)


def torch_residuals(cfg: GPTConfig, params, batch, dtype: str) -> dict:
    """What autograd saves in the PyTorch twin's autocast forward (params excluded)."""
    import torch
    import torch.nn.functional as F
    from torch_gpt import TorchGPT, load_flax_params

    model = TorchGPT(cfg)
    load_flax_params(model, jax.tree.map(np.asarray, params))
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set = set()
    items = []

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        key = (ptr, t.storage_offset(), tuple(t.shape), t.dtype)
        if ptr not in param_ptrs and key not in seen:
            seen.add(key)
            op = type(t.grad_fn).__name__.removesuffix("Backward0") if t.grad_fn else "leaf"
            items.append((str(t.dtype).removeprefix("torch."), t.numel() * t.element_size(),
                          op))
        return t

    ids = torch.from_numpy(np.array(batch["inputs"], np.int64))
    tgt = torch.from_numpy(np.array(batch["targets"], np.int64))
    ctx = (contextlib.nullcontext() if dtype == "float32"
           else torch.autocast("cpu", dtype=getattr(torch, dtype)))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
        logits = model(ids)
        F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten())
    return summarize(items)


def _ratios(runs: dict) -> dict:
    base = runs.get("float32", {}).get("bytes")
    return {k: v["bytes"] / base for k, v in runs.items() if base and k != "float32"}


def measure_gpt(cfg: GPTConfig, batch_size: int) -> dict:
    model = GPT(cfg)
    params, batch = init(model, cfg), make_batch(cfg, batch_size)
    out: dict = {"config": {**cfg.__dict__, "batch": batch_size}}
    jaxamp_runs = {}
    for name, pol in POLICIES.items():
        fn = jaxamp.autocast(lambda p, b: lm_loss(model.apply, p, b), pol)
        jaxamp_runs[name] = jax_residuals(fn, params, batch)
    out["jaxamp"] = {"runs": jaxamp_runs, "ratio_vs_float32": _ratios(jaxamp_runs)}
    hand = {"float32": jaxamp_runs["float32"]}
    for name in ("float16", "bfloat16"):
        hand[name] = jax_residuals(handcast_loss(HandCastGPT(cfg, jnp.dtype(name))), params,
                                   batch)
    out["handcast"] = {"runs": {k: v for k, v in hand.items() if k != "float32"},
                       "ratio_vs_float32": _ratios(hand)}
    try:
        import torch  # noqa: F401
    except Exception:  # not installed (torch is never a dependency)
        out["torch"] = {"skipped": "torch not installed"}
    else:
        runs = {name: torch_residuals(cfg, params, batch, name) for name in POLICIES}
        out["torch"] = {"runs": runs, "ratio_vs_float32": _ratios(runs),
                        "note": "torch.autocast on CPU (its CPU op lists)"}
    return out


def measure_transformers(batch_size: int = 2, seq: int = 64) -> dict:
    """transformers' Flax GPT-2 and Llama (small configs) under jaxamp, if installed."""
    try:
        import transformers
        from transformers import (
            FlaxGPT2LMHeadModel,
            FlaxLlamaForCausalLM,
            GPT2Config,
            LlamaConfig,
        )
    except Exception as e:  # optional: transformers<5 has the Flax models
        return {"skipped": f"transformers (<5) not importable: {type(e).__name__}"}
    models = {
        "FlaxGPT2LMHeadModel": FlaxGPT2LMHeadModel(GPT2Config(
            n_layer=2, n_embd=128, n_head=4, n_positions=seq, vocab_size=1000)),
        "FlaxLlamaForCausalLM": FlaxLlamaForCausalLM(LlamaConfig(
            num_hidden_layers=2, hidden_size=128, intermediate_size=352,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
            vocab_size=1000)),
    }
    ids = jax.random.randint(jax.random.key(0), (batch_size, seq + 1), 0, 1000)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:]}
    out: dict = {"transformers_version": transformers.__version__}
    for name, m in models.items():
        def loss(p, b, m=m):
            ids = b["inputs"]
            pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
            logits = m.module.apply({"params": p}, ids, jnp.ones_like(ids), pos).logits
            return jaxamp.softmax_cross_entropy(logits, b["targets"])

        runs = {pol: jax_residuals(jaxamp.autocast(loss, spec), m.params, batch)
                for pol, spec in POLICIES.items()}
        out[name] = {"runs": runs, "ratio_vs_float32": _ratios(runs)}
    return out


def print_table(res: dict) -> None:
    rows = []
    for side in ("jaxamp", "handcast", "torch"):
        sec = res["gpt"].get(side, {})
        for name, r in sec.get("runs", {}).items():
            rows.append((f"bench GPT, {side}", name, r))
    for name, sec in res.get("transformers", {}).items():
        if isinstance(sec, dict):
            for pol, r in sec.get("runs", {}).items():
                rows.append((name, pol, r))
    f32 = {}
    print(f"{'model':34} {'dtype':9} {'MiB':>9} {'vs f32':>7} {'f32 share':>9}  top producer")
    for model, pol, r in rows:
        if pol == "float32":
            f32[model] = r["bytes"]
        base = f32.get(model) or res["gpt"]["jaxamp"]["runs"]["float32"]["bytes"]
        top = next(iter(r["by_op"]), "")
        print(f"{model:34} {pol:9} {r['bytes'] / 2**20:9.2f} {r['bytes'] / base:7.3f} "
              f"{r['float32_share']:9.1%}  {top}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    cfg = GPTConfig(layers=args.layers, d_model=args.d_model, heads=args.heads, seq=args.seq)
    res = {"gpt": measure_gpt(cfg, args.batch)}
    if not args.no_transformers:
        res["transformers"] = measure_transformers()
    print_table(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return res


if __name__ == "__main__":
    main()
