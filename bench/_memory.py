"""Section 3: ``memory_analysis()`` of the compiled AMP step per compute dtype, and its
temporaries relative to float32."""

from __future__ import annotations

from _steps import AMP_EXECUTABLES, POLICIES, make_amp_step, make_tx, setup
from gpt import GPTConfig

import jaxamp


def memory_dict(ma) -> dict:
    out = {k: int(getattr(ma, k)) for k in
           ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
            "alias_size_in_bytes", "generated_code_size_in_bytes")}
    peak = getattr(ma, "peak_memory_in_bytes", None)  # not reported by every jaxlib
    out["peak_memory_in_bytes"] = int(peak) if peak is not None else None
    return out


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
            state = jaxamp.TrainState.create(model, params, tx, policy=policy,
                                             loss_scale=loss_scale)
            compiled = make_amp_step(model, tx, policy).lower(state, batch).compile()
            AMP_EXECUTABLES[(cfg, batch_size, name)] = (compiled, tx)
            ma = compiled.memory_analysis()
            out[name] = memory_dict(ma) if ma else None
        if out[name] is not None:
            out[name]["loss_scale"] = type(loss_scale).__name__
    return out


def memory_ratios(mem: dict) -> dict:
    base = (mem.get("float32") or {}).get("temp_size_in_bytes")
    return {k: (v["temp_size_in_bytes"] / base if base else None)
            for k, v in mem.items() if k != "float32" and v}
