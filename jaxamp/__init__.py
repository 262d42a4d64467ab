"""jaxamp: automatic mixed precision for JAX and Flax.

Per-module precision policies for unmodified Flax models (:func:`autocast`), float32 where the
numerics need it (:data:`DEFAULT_OP_RULES`, :data:`FP32_MODULES`), loss scaling
(:class:`DynamicLossScale`), the AMP update as an optax transformation (:func:`amp`) and a jitted
AMP train step built on it (:func:`make_train_step`), on one device or a mesh
(:func:`shard_state`; :func:`collectives` shows what crosses the wire), FP8 matmuls from a
policy's ``matmul=float8`` (:mod:`jaxamp.fp8`). The tools that
inspect a program or a run (:func:`audit`, :func:`precision_table`, :func:`locate_overflow`,
``python -m jaxamp.review``) live in :mod:`jaxamp.diagnostics`; the functions are re-exported
here, their report types are read from there.

Names are imported on first use (PEP 562), so ``python -m jaxamp.review``, a log reader, starts
without importing JAX. They are listed once, in ``__init__.pyi`` (what type checkers read).
"""

from __future__ import annotations

from jaxamp._lazy import lazy_exports, stub_exports

__version__ = "0.1.0"

#: name -> the module defining it, read from ``__init__.pyi``: the one list of public names
_EXPORTS = stub_exports(__file__)
__all__ = sorted(_EXPORTS, key=str.lower)

#: No longer public at the top level (deprecated in 0.1.0; CHANGELOG): each still resolves,
#: with a DeprecationWarning naming the module to import it from.
_DEPRECATED = {
    "AmpState": "jaxamp.transform",
    "AuditReport": "jaxamp.diagnostics",
    "DTYPE_NAMES": "jaxamp.policy",
    "Finding": "jaxamp.diagnostics",
    "format_collectives": "jaxamp.diagnostics",
    "format_precision_table": "jaxamp.diagnostics",
    "fp8_dot_general": "jaxamp.fp8",
    "fp8_eligible": "jaxamp.fp8",
    "MatmulPolicy": "jaxamp.policy",
    "OverflowReport": "jaxamp.diagnostics",
    "PrecisionTable": "jaxamp.diagnostics",
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, _DEPRECATED)
