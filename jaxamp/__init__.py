"""jaxamp: automatic mixed precision for JAX and Flax.

Per-module precision policies for unmodified Flax models (:func:`autocast`), float32 where the
numerics need it (:data:`DEFAULT_OP_RULES`, :data:`FP32_MODULES`), loss scaling
(:class:`DynamicLossScale`), the AMP update as an optax transformation (:func:`amp`) and a jitted
AMP train step built on it (:func:`make_train_step`), on one device or a mesh
(:func:`shard_state`; :func:`collectives` shows what crosses the wire), FP8 matmuls from a
policy's ``matmul=float8`` (:mod:`jaxamp.fp8`). The tools that
inspect a program or a run (:func:`audit`, :func:`precision_table`, :func:`locate_overflow`,
``python -m jaxamp.review``) live in :mod:`jaxamp.diagnostics` and are re-exported here.

Names are imported on first use (PEP 562), so ``python -m jaxamp.review``, a log reader, starts
without importing JAX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxamp._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "amp": "jaxamp.transform",
    "amp_state": "jaxamp.transform",
    "AmpState": "jaxamp.transform",
    "audit": "jaxamp.diagnostics",
    "audit_step": "jaxamp.diagnostics",
    "AuditReport": "jaxamp.diagnostics",
    "autocast": "jaxamp.engine",
    "collectives": "jaxamp.diagnostics",
    "default_loss_scale": "jaxamp.train",
    "DEFAULT_OP_RULES": "jaxamp.rules",
    "DEFAULT_POLICY": "jaxamp.train",
    "DTYPE_NAMES": "jaxamp.policy",
    "DynamicLossScale": "jaxamp.loss_scale",
    "EMBED_MODULES": "jaxamp.rules",
    "Finding": "jaxamp.diagnostics",
    "format_collectives": "jaxamp.diagnostics",
    "format_precision_table": "jaxamp.diagnostics",
    "FP32_MODULES": "jaxamp.rules",
    "FP8Matmuls": "jaxamp.fp8",
    "fp8_gemms": "jaxamp.diagnostics",
    "fp8_dot_general": "jaxamp.fp8",
    "fp8_eligible": "jaxamp.fp8",
    "get_policy": "jaxamp.policy",
    "gpu_program": "jaxamp.diagnostics",
    "locate_overflow": "jaxamp.diagnostics",
    "make_eval_step": "jaxamp.train",
    "make_train_step": "jaxamp.train",
    "MatmulPolicy": "jaxamp.policy",
    "nnx_update": "jaxamp.train",
    "ModuleRules": "jaxamp.rules",
    "NoOpLossScale": "jaxamp.loss_scale",
    "OpRules": "jaxamp.rules",
    "OverflowReport": "jaxamp.diagnostics",
    "policy_to_str": "jaxamp.policy",
    "precision_table": "jaxamp.diagnostics",
    "PrecisionTable": "jaxamp.diagnostics",
    "scale_loss": "jaxamp.transform",
    "shard_state": "jaxamp.sharding",
    "softmax_cross_entropy": "jaxamp.losses",
    "StaticLossScale": "jaxamp.loss_scale",
    "TrainState": "jaxamp.train",
}

__all__ = sorted(_EXPORTS, key=str.lower)

if TYPE_CHECKING:  # what static tools see; at run time __getattr__ imports on first use
    from jaxamp.diagnostics import (
        AuditReport,
        Finding,
        OverflowReport,
        PrecisionTable,
        audit,
        audit_step,
        collectives,
        format_collectives,
        format_precision_table,
        fp8_gemms,
        gpu_program,
        locate_overflow,
        precision_table,
    )
    from jaxamp.engine import autocast
    from jaxamp.fp8 import FP8Matmuls, fp8_dot_general, fp8_eligible
    from jaxamp.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
    from jaxamp.losses import softmax_cross_entropy
    from jaxamp.policy import DTYPE_NAMES, MatmulPolicy, get_policy, policy_to_str
    from jaxamp.rules import DEFAULT_OP_RULES, EMBED_MODULES, FP32_MODULES, ModuleRules, OpRules
    from jaxamp.sharding import shard_state
    from jaxamp.train import (
        DEFAULT_POLICY,
        TrainState,
        default_loss_scale,
        make_eval_step,
        make_train_step,
        nnx_update,
    )
    from jaxamp.transform import AmpState, amp, amp_state, scale_loss


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
