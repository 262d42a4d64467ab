# The public names of ``jaxamp``, listed once: type checkers read this stub (PEP 561) and
# ``jaxamp/__init__.py`` reads it at import to resolve each name lazily (PEP 562).
from jaxamp.diagnostics import audit as audit
from jaxamp.diagnostics import audit_step as audit_step
from jaxamp.diagnostics import collectives as collectives
from jaxamp.diagnostics import fp8_gemms as fp8_gemms
from jaxamp.diagnostics import gpu_program as gpu_program
from jaxamp.diagnostics import locate_overflow as locate_overflow
from jaxamp.diagnostics import precision_table as precision_table
from jaxamp.engine import autocast as autocast
from jaxamp.fp8 import FP8Matmuls as FP8Matmuls
from jaxamp.loss_scale import DynamicLossScale as DynamicLossScale
from jaxamp.loss_scale import NoOpLossScale as NoOpLossScale
from jaxamp.loss_scale import StaticLossScale as StaticLossScale
from jaxamp.losses import softmax_cross_entropy as softmax_cross_entropy
from jaxamp.policy import get_policy as get_policy
from jaxamp.policy import policy_to_str as policy_to_str
from jaxamp.rules import DEFAULT_OP_RULES as DEFAULT_OP_RULES
from jaxamp.rules import EMBED_MODULES as EMBED_MODULES
from jaxamp.rules import FP32_MODULES as FP32_MODULES
from jaxamp.rules import ModuleRules as ModuleRules
from jaxamp.rules import OpRules as OpRules
from jaxamp.sharding import shard_state as shard_state
from jaxamp.train import DEFAULT_POLICY as DEFAULT_POLICY
from jaxamp.train import TrainState as TrainState
from jaxamp.train import default_loss_scale as default_loss_scale
from jaxamp.train import make_eval_step as make_eval_step
from jaxamp.train import make_train_step as make_train_step
from jaxamp.train import nnx_update as nnx_update
from jaxamp.transform import amp as amp
from jaxamp.transform import amp_state as amp_state
from jaxamp.transform import scale_loss as scale_loss

__version__: str
