"""Section 2: precision fidelity of forward + backward. ``stablehlo.convert`` counts of
autocast vs the hand-cast twin (``gpt_handcast.py``), lossy round trips and duplicate casts,
the fraction of matmul FLOPs in the compute dtype, and trace + compile time against the plain
float32 model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from _hlo import compiled_hlo_ops, convert_stats, matmul_fraction, stablehlo_ops
from _steps import F16_POLICY, amp_loss_of, setup
from _timing import compile_summary, interleaved_compile, med
from gpt import GPTConfig, lm_loss
from gpt_handcast import HandCastGPT, handcast_loss

from jaxamp._jaxpr import duplicate_casts, lossy_round_trips


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
