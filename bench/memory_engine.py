"""Saved residuals of reverse-mode AD, by dtype: what a step keeps between forward and backward.

:func:`saved_residuals` traces ``jax.vjp`` of a loss with respect to the params and reads the
residuals its pullback closes over (``jax.tree.leaves`` of the returned function), params and
the batch excluded (a residual that *is* an input costs no memory of its own). The count is
taken from the traced program, so it is platform-independent: what a GPU keeps is the same.

``python bench/memory_engine.py`` prints, for the bench GPT (4 layers, d 256, seq 256,
batch 8), transformers' Flax GPT-2 and Llama (when ``transformers`` is installed) and the
corpus models (``tests/corpus_models.py``), the residual bytes of float16/bfloat16 autocast
relative to the float32 run, with the float32 share, with recompute on (everywhere,
``OpRules(recompute=True)``, the default before issue 40), off (``recompute=False``) and the
default (``"scan"``: in ``lax.scan`` bodies only; for these unrolled models the same as off,
but for the corpus's scanned one), and XLA:CPU's compiled temp memory of the float32-policy
train step with recompute on and off.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import jax
import jax.extend.core as jcore
import numpy as np

import jaxamp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

POLICIES = {
    "float32": "float32",
    "float16": "params=float32,compute=float16,output=float32",
    "bfloat16": "params=float32,compute=bfloat16,output=float32",
}
try:
    OFF = jaxamp.DEFAULT_OP_RULES.extend(recompute=False)
except (TypeError, ValueError):  # a jaxamp from before recompute (--only temp-default)
    OFF = None
try:  # recompute everywhere
    ON = jaxamp.DEFAULT_OP_RULES.extend(recompute=True)
except (TypeError, ValueError):
    ON = jaxamp.DEFAULT_OP_RULES


def saved_residuals(loss, params, *args) -> dict[str, int]:
    """Bytes of the residuals ``jax.vjp(lambda p: loss(p, *args), params)`` keeps, by dtype
    name (inputs excluded; each residual counted once)."""
    def residuals(p, *a):
        _, pullback = jax.vjp(lambda q: loss(q, *a), p)
        return jax.tree.leaves(pullback)

    closed = jax.make_jaxpr(residuals)(params, *args)
    jaxpr = closed.jaxpr
    inputs = set(jaxpr.invars)
    out: collections.Counter = collections.Counter()
    seen = set()
    for v in jaxpr.outvars:
        if not isinstance(v, jcore.Var) or v in inputs or v in seen:
            continue  # an input (a param, the batch), a literal, or counted already
        seen.add(v)
        aval = v.aval
        if not hasattr(aval, "dtype") or jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key):
            continue
        out[np.dtype(aval.dtype).name] += int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize
    return dict(out)


def summary(by_dtype: dict[str, int]) -> tuple[int, float]:
    """(total bytes, float32 share)."""
    total = sum(by_dtype.values())
    return total, (by_dtype.get("float32", 0) / total if total else 0.0)


def compare(loss, params, *args) -> dict:
    """Residual bytes per policy, recompute on (everywhere), off and the default, and each
    ratio to float32's with recompute off."""
    rows: dict = {}
    for name, policy in POLICIES.items():
        for label, rules in (("on", ON), ("off", OFF), ("default", jaxamp.DEFAULT_OP_RULES)):
            fn = jaxamp.autocast(loss, policy, op_rules=rules)
            by = saved_residuals(fn, params, *args)
            total, f32 = summary(by)
            rows[f"{name}/{label}"] = {"bytes": total, "f32_share": f32, "by_dtype": by}
    base = rows["float32/off"]["bytes"]
    for row in rows.values():
        row["ratio"] = row["bytes"] / base
    return rows


def bench_gpt():
    from gpt import GPT, GPTConfig, init, lm_loss, make_batch

    cfg = GPTConfig(layers=4, d_model=256, heads=4, seq=256)
    model = GPT(cfg)
    return (lambda p, b: lm_loss(model.apply, p, b)), init(model, cfg), make_batch(cfg, 8)


def hf_models():
    """transformers' Flax GPT-2 and Llama, small configs (None if transformers is missing)."""
    try:
        import transformers as tf
    except ImportError:
        return {}
    import jax.numpy as jnp

    ids = jax.random.randint(jax.random.key(0), (4, 128), 0, 512)
    out = {}
    for name, model in (
            ("hf_gpt2", tf.FlaxGPT2LMHeadModel(tf.GPT2Config(
                vocab_size=512, n_positions=128, n_embd=256, n_layer=2, n_head=4))),
            ("hf_llama", tf.FlaxLlamaForCausalLM(tf.LlamaConfig(
                vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=128)))):
        def loss(p, ids, model=model):
            logits = model(ids, params=p).logits.astype(jnp.float32)
            return jaxamp.softmax_cross_entropy(logits[:, :-1], ids[:, 1:])

        out[name] = (loss, model.params, ids)
    return out


def corpus_models():
    from corpus_models import CORPUS

    out = {}
    for name, make in CORPUS.items():
        case = make()
        out[name] = ((lambda p, b, case=case: case.loss(case.model.apply, p, b)),
                     case.params, case.batch)
    return out


def f32_step_temp(recompute: bool | None) -> int | None:
    """XLA's compiled temp bytes of the bench GPT's float32-policy train step (recompute
    None: the imported jaxamp's default rules, for a jaxamp from before the switch)."""
    import optax
    from gpt import GPT, GPTConfig, init, lm_loss, make_batch

    cfg = GPTConfig(layers=4, d_model=256, heads=4, seq=256)
    model = GPT(cfg)
    tx = optax.adamw(1e-3)
    state = jaxamp.TrainState.create(model, init(model, cfg), tx, policy="float32")
    rules = {None: jaxamp.DEFAULT_OP_RULES, True: ON}.get(recompute, OFF)
    step = jaxamp.make_train_step(model, lm_loss, tx, policy="float32", op_rules=rules)
    ma = step.lower(state, make_batch(cfg, 8)).compile().memory_analysis()
    return None if ma is None else int(ma.temp_size_in_bytes)


def report(models: dict) -> dict:
    out = {}
    for name, (loss, params, *args) in models.items():
        rows = compare(loss, params, *args)
        out[name] = rows
        print(f"{name:10s} " + "  ".join(
            f"{k} {r['ratio']:.3f} (f32 {100 * r['f32_share']:.0f}%)" for k, r in rows.items()
            if not k.startswith("float32/off")), flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=["gpt", "hf", "corpus", "temp", "temp-default"],
                        action="append",
                        help="temp-default: only the float32-policy step's temp bytes under "
                             "the imported jaxamp's default rules (run it with PYTHONPATH at "
                             "a checkout from before recompute to get the baseline)")
    parser.add_argument("--json", type=Path)
    a = parser.parse_args()
    only = set(a.only or ["gpt", "hf", "corpus", "temp"])
    models = {}
    if "gpt" in only:
        models["bench_gpt"] = bench_gpt()
    if "hf" in only:
        models.update(hf_models())
    if "corpus" in only:
        models.update(corpus_models())
    out = {"jax": jax.__version__, "models": report(models)}
    if "temp-default" in only:
        temp = f32_step_temp(None)
        out["f32_step_temp_bytes"] = {"default": temp}
        print(f"float32-policy step temp bytes (XLA:{jax.default_backend()}), default rules "
              f"of jaxamp at {Path(jaxamp.__file__).parent}: {temp}")
    if "temp" in only:
        on, off = f32_step_temp(True), f32_step_temp(False)
        out["f32_step_temp_bytes"] = {"on": on, "off": off}
        print(f"float32-policy step temp bytes (XLA:{jax.default_backend()}): recompute on "
              f"{on}, off {off}" + (f", on/off {on / off:.3f}" if on and off else ""))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
