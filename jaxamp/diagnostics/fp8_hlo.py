"""Did each planned FP8 GEMM become one? Compares the FP8 dots of the lowered program with the
FP8 GEMMs of the compiled one (docs/api/diagnostics.rst, "FP8 GEMMs").

Example:
    >>> import jax.numpy as jnp
    >>> from jaxamp.fp8 import fp8_dot_general
    >>> f = lambda x, w: fp8_dot_general(x, w, (((1,), (0,)), ((), ())),
    ...                                  compute_dtype=jnp.bfloat16)
    >>> r = fp8_gemms(f, jnp.ones((16, 32)), jnp.ones((32, 16)), warn=False)
    >>> r["planned"], r["checked"] or r["backend"]
    (1, 'cpu')
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax

from ._hlo import FP8_GEMM_TARGETS, planned_fp8_dots
from .gpu import GpuProgram, gpu_program

__all__ = ["FP8_GEMM_TARGET", "count_fp8_gemm_calls", "count_planned_fp8_dots", "fp8_gemms"]

#: The custom-call target of cuBLASLt's FP8 GEMM in compiled XLA:GPU HLO.
FP8_GEMM_TARGET = FP8_GEMM_TARGETS[0]

def count_planned_fp8_dots(stablehlo: str) -> int:
    """``dot_general`` s with two FP8 operands in StableHLO text (``lower(...).as_text()``)."""
    return len(planned_fp8_dots(stablehlo))


def count_fp8_gemm_calls(compiled_hlo: str) -> int:
    """Custom calls to :data:`FP8_GEMM_TARGET` in compiled HLO text
    (``lower(...).compile().as_text()``)."""
    return compiled_hlo.count(f'custom_call_target="{FP8_GEMM_TARGET}"')


def fp8_gemms(fn: Callable, *args: Any, warn: bool = True, target: Any = None) -> dict:
    """Lowers and compiles ``jax.jit(fn)`` on ``args`` (or uses ``fn`` if it is already jitted:
    a train step) and compares the planned FP8 dots with the FP8 GEMMs XLA emitted.

    Without ``target``, the program is compiled for JAX's default backend: on a GPU the
    comparison is made, elsewhere only the planned dots are counted. With ``target``
    (``"h100"``, ``"h200"``, a target-config file or a GPU device; see
    :func:`jaxamp.gpu_program`, which needs JAX's CUDA plugin) it is compiled for that GPU, on
    any machine.

    Planned and formed are compared by FLOPs (XLA may merge two FP8 dots that share an
    operand into one GEMM).

    Returns ``{"backend", "planned", "fused", "checked", "fallback"}`` (plus
    ``"planned_flops"`` and ``"fused_flops"`` when compiled for a GPU): ``fused`` the number of
    FP8 GEMMs (``__cublas$lt$matmul$f8`` calls, or Triton GEMMs of float8 operands, which XLA
    forms when Triton GEMMs are on; :attr:`jaxamp.diagnostics.gpu.GpuProgram.fp8_formed`; None
    when not compiled for a GPU), ``checked`` whether the
    comparison was made, ``fallback`` how many planned FP8 dots did not become an FP8 GEMM
    (the GEMMs fed FP8 data that multiply in 16 bits; None when not compiled for a GPU). With
    ``warn`` (default), a ``RuntimeWarning`` names the shortfall.
    """
    if target is not None:
        report = gpu_program(fn, *args, target=target)
    else:
        jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
        lowered = jitted.lower(*args)
        backend = jax.default_backend()
        if backend != "gpu" or count_planned_fp8_dots(lowered.as_text()) == 0:
            return {"backend": backend, "planned": count_planned_fp8_dots(lowered.as_text()),
                    "fused": None, "checked": False, "fallback": None}
        report = GpuProgram.read(lowered.compile(), jax.devices()[0], lowered=lowered)
    planned, fused = report.fp8_planned, report.fp8_formed
    short = report.fp8_formed_flops < report.fp8_planned_flops
    fallbacks = report.fp8_fallbacks
    out = {"backend": "gpu", "planned": planned, "fused": fused, "checked": True,
           "fallback": len(fallbacks) or (max(planned - fused, 1) if short else 0),
           "planned_flops": report.fp8_planned_flops, "fused_flops": report.fp8_formed_flops}
    if warn and short:
        names = ", ".join(k.name for k in fallbacks[:5]) or "no GEMM reads FP8 data"
        warnings.warn(
            f"jaxamp: {planned} FP8 matmuls were planned ({report.fp8_planned_flops:.3g} FLOPs) "
            f"but XLA formed FP8 GEMMs for {report.fp8_formed_flops:.3g} of those FLOPs "
            f"({fused} GEMMs; {out['fallback']} silently ran as 16-bit dots: {names}; no FP8 "
            "speed-up there). Usual causes: a GPU older than Hopper (SM < 8.9), dims XLA "
            "cannot align, or a layout it does not rewrite; see jaxamp.audit(...).matmuls for "
            "the planned matmuls and raise the size threshold (FP8Matmuls(min_size=...)) or "
            "exclude the module with an override {'path': 'matmul=bfloat16'}.",
            RuntimeWarning, stacklevel=2)
    return out
