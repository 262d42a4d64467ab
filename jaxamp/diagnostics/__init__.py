"""Diagnostics: tools that read a mixed-precision program or run and say what is wrong.

- :func:`audit`, :func:`audit_step`, :func:`precision_table`: the dtype of every part of a traced
  program (forward and backward) against the mixed-precision reference table.
- :func:`collectives`: every collective of the partitioned program (kind, dtype, bytes).
- :func:`fp8_gemms`: whether each planned FP8 matmul became a cuBLASLt FP8 GEMM (compiled HLO).
- :func:`gpu_program`: the program a GPU will run, compiled for an H100/H200 with or without
  one: kernels, GEMM libraries, fused attention, FP8 GEMMs, memory, a roofline estimate.
- :func:`locate_overflow`: runs a failing batch and finds the module where inf/nan starts.
- :mod:`jaxamp.diagnostics.review` (``python -m jaxamp.review``): reads a run's logs; imports no
  JAX.

This package uses the runtime core (``jaxamp.policy``, ``jaxamp.rules``, ``jaxamp.engine``, ...)
only through its public names and the documented internal modules ``jaxamp._engine.jaxpr`` and
``jaxamp._engine.compat``. Names are imported on first use, so the JAX-free log reader stays
JAX-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS = {
    "AuditReport": "jaxamp.diagnostics._audit",
    "Finding": "jaxamp.diagnostics._audit",
    "PrecisionTable": "jaxamp.diagnostics._audit",
    "audit": "jaxamp.diagnostics._audit",
    "audit_step": "jaxamp.diagnostics._audit",
    "format_precision_table": "jaxamp.diagnostics._audit",
    "precision_table": "jaxamp.diagnostics._audit",
    "collectives": "jaxamp.diagnostics._collectives",
    "format_collectives": "jaxamp.diagnostics._collectives",
    "fp8_gemms": "jaxamp.diagnostics.fp8_hlo",
    "GpuProgram": "jaxamp.diagnostics.gpu",
    "gpu_program": "jaxamp.diagnostics.gpu",
    "OverflowReport": "jaxamp.diagnostics.overflow",
    "locate_overflow": "jaxamp.diagnostics.overflow",
    "RunFinding": "jaxamp.diagnostics.review",
    "RunReview": "jaxamp.diagnostics.review",
    "review_metrics": "jaxamp.diagnostics.review",
    "review_run": "jaxamp.diagnostics.review",
}

__all__ = sorted(_EXPORTS, key=str.lower)

if TYPE_CHECKING:
    from ._audit import (
        AuditReport,
        Finding,
        PrecisionTable,
        audit,
        audit_step,
        format_precision_table,
        precision_table,
    )
    from ._collectives import collectives, format_collectives
    from .fp8_hlo import fp8_gemms
    from .gpu import GpuProgram, gpu_program
    from .overflow import OverflowReport, locate_overflow
    from .review import RunFinding, RunReview, review_metrics, review_run


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
