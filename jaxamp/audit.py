"""The precision table: which dtype every part of a function actually ran in, from its jaxpr.

``precision_table(fn, *args, policy=...)`` traces ``jax.value_and_grad`` of the autocast
function and groups every equation by module path (from the name stack Flax linen records) and
op class, listing the dtypes seen in the forward and in the backward pass. It reads the traced
program, not the configuration, so it shows what a GPU would run (StableHLO dtypes; XLA on CPU
upcasts low-precision matmuls later, at compile time).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import jmp
import numpy as np

from jaxamp.autocast import autocast

__all__ = ["format_precision_table", "precision_table"]

_OP_CLASSES = {
    "dot_general": "matmul", "conv_general_dilated": "conv", "gather": "gather",
    "exp": "exp/log", "log": "exp/log", "log1p": "exp/log", "expm1": "exp/log",
    "reduce_sum": "reduction", "reduce_max": "reduction", "reduce_min": "reduction",
    "reduce_prod": "reduction", "cumsum": "reduction", "argmax": "reduction",
    "rsqrt": "rsqrt/sqrt", "sqrt": "rsqrt/sqrt", "convert_element_type": "cast",
}
_NOISE = re.compile(r"jaxamp<\d+>|rematted_computation|checkpoint|remat")
_TRANSFORM = re.compile(r"^(jvp|transpose|vmap|pjit|jit)\((.*)\)$")


def _clean_path(stack: str) -> tuple[str, bool]:
    """Module path and whether the equation belongs to the backward pass."""
    backward = "transpose(" in stack
    parts = []
    for part in stack.split("/"):
        while True:
            m = _TRANSFORM.match(part)
            if not m:
                break
            part = m.group(2)
        part = _NOISE.sub("", part)
        if part and not any(c in part for c in ",->") and part not in parts[-1:]:
            parts.append(part)
    return "/".join(parts) or "(top level)", backward


def _walk(jaxpr: jcore.Jaxpr, prefix: str) -> Iterator[tuple[jcore.JaxprEqn, str]]:
    for eqn in jaxpr.eqns:
        stack = str(eqn.source_info.name_stack)
        full = f"{prefix}/{stack}" if prefix and stack else (prefix or stack)
        yield eqn, full
        for sub in jcore.jaxprs_in_params(eqn.params):
            yield from _walk(sub, full)


def _dtypes(eqn) -> set[str]:
    out = set()
    for v in list(eqn.invars) + list(eqn.outvars):
        dtype = getattr(v.aval, "dtype", None)
        if dtype is not None and jnp.issubdtype(dtype, jnp.floating):
            out.add(np.dtype(dtype).name)
    return out


def precision_table(fn: Callable, *args: Any, policy: str | jmp.Policy =
                    "params=float32,compute=float16,output=float32",
                    overrides: dict | None = None, argnums: int = 0) -> list[dict[str, str]]:
    """Rows ``{"module", "op", "forward", "backward"}`` for ``fn`` run under ``policy``.

    Args:
      fn: a loss or forward function (its float outputs are summed for the backward pass).
      *args: example arguments; ``args[argnums]`` is what gradients are taken with respect to.
      policy, overrides: as for :func:`jaxamp.autocast`.
      argnums: which argument the backward pass differentiates.

    Returns:
      One row per (module path, op class) with the float dtypes seen, comma-separated
      (``"-"`` when the pass has no such op). The last row is the function's output.
    """
    amp = autocast(fn, policy, overrides=overrides)

    def scalar(*a):
        outs = [o for o in jax.tree.leaves(amp(*a)) if jnp.issubdtype(o.dtype, jnp.floating)]
        return sum(jnp.sum(o.astype(jnp.float32)) for o in outs), outs

    closed = jax.make_jaxpr(jax.value_and_grad(scalar, argnums=argnums, has_aux=True))(*args)
    table: dict[tuple[str, str], dict[str, set[str]]] = {}
    for eqn, stack in _walk(closed.jaxpr, ""):
        name = eqn.primitive.name
        if any(True for _ in jcore.jaxprs_in_params(eqn.params)):
            continue  # its body's equations are listed instead
        op = _OP_CLASSES.get(name, "elementwise")
        dtypes = _dtypes(eqn)
        if not dtypes:
            continue
        module, backward = _clean_path(stack)
        entry = table.setdefault((module, op), {"forward": set(), "backward": set()})
        entry["backward" if backward else "forward"] |= dtypes
    rows = [{"module": m, "op": op, "forward": ",".join(sorted(d["forward"])) or "-",
             "backward": ",".join(sorted(d["backward"])) or "-"}
            for (m, op), d in sorted(table.items())]
    out_shapes = jax.eval_shape(amp, *args)
    out_dtypes = sorted({np.dtype(o.dtype).name for o in jax.tree.leaves(out_shapes)})
    rows.append({"module": "(output)", "op": "output", "forward": ",".join(out_dtypes),
                 "backward": "-"})
    return rows


def format_precision_table(rows: list[dict[str, str]]) -> str:
    """The rows as a Markdown table."""
    lines = ["| module | op | forward | backward |", "|---|---|---|---|"]
    lines += [f"| {r['module']} | {r['op']} | {r['forward']} | {r['backward']} |" for r in rows]
    return "\n".join(lines)
