"""jaxamp: automatic mixed precision for JAX and Flax.

Per-module precision policies for unmodified Flax models (:func:`autocast`), float32 where the
numerics need it (:data:`DEFAULT_OP_RULES`, :data:`FP32_MODULES`), loss scaling
(:class:`DynamicLossScale`), the AMP update as an optax transformation (:func:`amp`) and a jitted
AMP train step built on it (:func:`make_train_step`).
"""

from jaxamp.audit import (
    AuditReport,
    Finding,
    audit,
    audit_step,
    format_precision_table,
    precision_table,
)
from jaxamp.autocast import autocast
from jaxamp.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from jaxamp.losses import softmax_cross_entropy
from jaxamp.overflow import OverflowReport, locate_overflow
from jaxamp.policy import DTYPE_NAMES, get_policy, policy_to_str
from jaxamp.rules import DEFAULT_OP_RULES, EMBED_MODULES, FP32_MODULES, ModuleRules, OpRules
from jaxamp.train import (
    DEFAULT_POLICY,
    TrainState,
    default_loss_scale,
    make_eval_step,
    make_train_step,
    nnx_update,
)
from jaxamp.transform import AmpState, amp, amp_state, scale_loss

__version__ = "0.1.0"

__all__ = [
    "AmpState",
    "AuditReport",
    "DEFAULT_OP_RULES",
    "DEFAULT_POLICY",
    "DTYPE_NAMES",
    "DynamicLossScale",
    "EMBED_MODULES",
    "FP32_MODULES",
    "Finding",
    "ModuleRules",
    "NoOpLossScale",
    "OpRules",
    "OverflowReport",
    "StaticLossScale",
    "TrainState",
    "amp",
    "amp_state",
    "audit",
    "audit_step",
    "autocast",
    "default_loss_scale",
    "format_precision_table",
    "get_policy",
    "locate_overflow",
    "make_eval_step",
    "make_train_step",
    "nnx_update",
    "policy_to_str",
    "precision_table",
    "scale_loss",
    "softmax_cross_entropy",
]
