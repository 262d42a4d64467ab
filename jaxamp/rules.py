"""Precision rules: which primitives run in which dtype, and which policy each module gets.

**Op rules** (:class:`OpRules`) sort JAX primitives into op classes, as torch autocast's op
lists sort ATen ops: ``matmul`` (the region's compute dtype, inputs and output), ``fp32``
(inputs cast to float32: exp/log, sums; softmax and hand-written norms follow, since a value
whose every consumer wants float32 is computed in float32), ``structural`` (the operand's
dtype; a stored value such as a param stays un-cast, so an embedding gathers rows, then casts
them), ``promote`` (the widest activation dtype) and ``as_traced`` (exactly as traced). A
primitive in no list runs as traced, with a warning naming it; an equation with a float64
operand or result runs as traced whatever its class. A primitive may also get a **handler**
(``DEFAULT_OP_RULES.extend(handlers={"dot_general": my_rule})``) that takes a
:class:`RuleCall` and returns the outputs, or None for the built-in rule.

**Module rules** (:class:`ModuleRules`) give a Flax module (linen or NNX) and, by inheritance,
its children a :class:`jmp.Policy`. Most specific first:

1. a path rule matching the module's path (:func:`module_path`; among several, the pattern
   with the most literal characters, a tie to the rule given last);
2. a class rule for the module's class or its nearest base in the MRO (user rules before the
   built-in ones for the same class);
3. the policy of the nearest ancestor module that matched a rule;
4. the default policy.

An override that sets only ``matmul=`` and/or ``fp8=`` is relative: the module keeps the policy
it would inherit, with that matmul dtype and FP8 recipe. The built-in class rules
(:data:`FP32_MODULES`, :data:`EMBED_MODULES`) are relative to the enclosing region too
(normalisation computes in float32 and returns the enclosing compute dtype); a user's rule for
the class is absolute.
The README's "What runs in which dtype" has the full table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import jmp
from flax import nnx

from jaxamp import policy_spec
from jaxamp._engine import primitives
from jaxamp._engine.op_rules import RuleCall
from jaxamp.fp8 import FP8_MATMULS
from jaxamp.policy import get_policy, opt_state_dtype, with_matmul

__all__ = ["DEFAULT_OP_RULES", "EMBED_MODULES", "FP32_MODULES", "MODULE_BASES", "ModuleRules",
           "OpRules", "RuleCall", "module_path"]

#: The default op lists (one registry of primitive facts: :mod:`jaxamp._engine.primitives`).
MATMUL_PRIMITIVES = primitives.MATMUL
FP32_PRIMITIVES = primitives.FP32
#: Subsets of FP32_PRIMITIVES the audit names in its advice (softmax's, and the sums).
SOFTMAX_PRIMITIVES = primitives.SOFTMAX
SUM_PRIMITIVES = primitives.SUM
STRUCTURAL_PRIMITIVES = primitives.STRUCTURAL
PROMOTE_PRIMITIVES = primitives.PROMOTE
AS_TRACED_PRIMITIVES = primitives.AS_TRACED

#: The values of :attr:`OpRules.recompute`.
RECOMPUTE = ("scan", True, False)


@dataclasses.dataclass(frozen=True)
class OpRules:
    """Primitive-name lists that decide each operation's dtype inside an autocast region.

    Attributes:
      matmul: run in the region's compute dtype (inputs cast to it, output in it).
      fp32: run in float32 (inputs cast up); the output stays float32.
      structural: keep the operand's dtype and do not commit a stored value to a dtype.
      promote: run in the widest activation dtype among the inputs.
      as_traced: known to run exactly as traced (a primitive in no list does too, with a
        warning).
      custom_vjp_as_traced: names of ``jax.custom_vjp`` functions that run exactly as traced,
        forward and backward (``"*"``: all); the others run both rules under the policy.
      handlers: ``(primitive name, handler)`` pairs (give a dict to :meth:`extend`): a handler
        takes a :class:`RuleCall` and returns the outputs (arrays), or None for the op class.
      recompute: where the cheap code between two matmuls (norms, softmax, activations,
        bias adds, dropout masks) is recomputed in the backward pass instead of keeping its
        float32 intermediates (:mod:`jaxamp._engine.recompute`; the forward is the same):
        ``"scan"`` (the default) inside ``lax.scan`` bodies only, where kept residuals are
        stacked per iteration; ``True`` everywhere (in straight-line code it costs kernel
        bytes: jaxamp/_engine/README.md); ``False`` never. A user's ``jax.checkpoint`` keeps
        its own policy.

    Example:
      >>> rules = DEFAULT_OP_RULES.extend(fp32={"tanh"})   # run tanh in float32 too
      >>> "tanh" in rules.fp32
      True
      >>> sorted(DEFAULT_OP_RULES.extend(custom_vjp_as_traced={"flash"}).custom_vjp_as_traced)
      ['flash']
    """

    matmul: frozenset[str] = MATMUL_PRIMITIVES
    fp32: frozenset[str] = FP32_PRIMITIVES
    structural: frozenset[str] = STRUCTURAL_PRIMITIVES
    promote: frozenset[str] = PROMOTE_PRIMITIVES
    as_traced: frozenset[str] = AS_TRACED_PRIMITIVES
    custom_vjp_as_traced: frozenset[str] = frozenset()
    handlers: tuple[tuple[str, Callable], ...] = ()
    recompute: bool | str = "scan"

    def __post_init__(self):
        if self.recompute not in RECOMPUTE or not isinstance(self.recompute, (bool, str)):
            raise ValueError(
                f"OpRules: recompute={self.recompute!r} is not one of {RECOMPUTE}. Write "
                f"recompute='scan' (the default: inside lax.scan bodies), True (everywhere) "
                f"or False (keep every residual).")

    def extend(self, *, handlers: Mapping[str, Callable] | None = None,
               recompute: bool | str | None = None, **lists: Iterable[str]) -> OpRules:
        """Returns rules with primitives moved into the named lists (and out of the others);
        ``custom_vjp_as_traced=`` adds function names to that list; ``handlers=`` maps
        primitive names to handlers (replacing an earlier handler of the same primitive);
        ``recompute=`` sets :attr:`recompute`."""
        if recompute is None:
            recompute = self.recompute
        elif recompute not in RECOMPUTE or not isinstance(recompute, (bool, str)):
            raise TypeError(f"OpRules.extend: recompute= must be one of {RECOMPUTE}, got "
                            f"{recompute!r}. Write recompute=False to keep every residual, "
                            f"recompute=True to recompute everywhere.")
        fields = {f.name: set(getattr(self, f.name)) for f in dataclasses.fields(self)
                  if f.name not in ("handlers", "recompute")}
        own = dict(self.handlers)
        if handlers is not None:
            if not isinstance(handlers, Mapping) or not all(
                    isinstance(k, str) and callable(h) for k, h in handlers.items()):
                raise TypeError(
                    f"OpRules.extend: handlers= must map primitive names to callables, got "
                    f"{handlers!r}. Example: handlers={{'dot_general': my_rule}}.")
            own.update(handlers)
        for key, names in lists.items():
            if key not in fields:
                raise ValueError(
                    f"OpRules.extend: unknown list {key!r}. Allowed: {sorted(fields)}. "
                    "Example: DEFAULT_OP_RULES.extend(fp32={'tanh'}).")
            if isinstance(names, str) or not all(isinstance(n, str) for n in names):
                fix = f"{{{names!r}}}" if isinstance(names, str) else "{'name', ...}"
                raise TypeError(
                    f"OpRules.extend: {key}= must be a collection of names (strings), got "
                    f"{names!r}. Write {key}={fix}.")
            if key == "custom_vjp_as_traced":  # function names, not primitives
                fields[key].update(names)
                continue
            for name in names:
                for other in (v for k, v in fields.items() if k != "custom_vjp_as_traced"):
                    other.discard(name)
                fields[key].add(name)
        return OpRules(**{k: frozenset(v) for k, v in fields.items()},
                       handlers=tuple(sorted(own.items())), recompute=recompute)

    def runs_custom_vjp_as_traced(self, name: str) -> bool:
        return "*" in self.custom_vjp_as_traced or name in self.custom_vjp_as_traced

    def classify(self, name: str) -> str:
        """A primitive's op class: 'matmul', 'fp32', 'structural', 'promote' or 'as_traced'."""
        for kind in ("matmul", "fp32", "structural", "promote"):
            if name in getattr(self, kind):
                return kind
        return "as_traced"

    def known(self, name: str) -> bool:
        """Whether ``name`` is in one of the lists (autocast warns of one in none)."""
        return self.classify(name) != "as_traced" or name in self.as_traced

    def handler(self, name: str) -> Callable | None:
        """The handler given for primitive ``name``, or None."""
        return next((fn for key, fn in self.handlers if key == name), None)


#: The default rules; their one handler, :data:`jaxamp.fp8.FP8_MATMULS`, runs the eligible
#: matmuls of ``matmul=float8`` regions in FP8 (and defers everywhere else).
DEFAULT_OP_RULES = OpRules(handlers=(("dot_general", FP8_MATMULS),))

#: Module classes that compute in float32 and return the compute dtype of their region.
FP32_MODULES: tuple[type, ...] = (
    nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.BatchNorm, nn.InstanceNorm,
    nnx.LayerNorm, nnx.RMSNorm, nnx.GroupNorm, nnx.BatchNorm, nnx.InstanceNorm)

#: Module classes whose (gathered) output is returned in the compute dtype of their region.
EMBED_MODULES: tuple[type, ...] = (nn.Embed, nnx.Embed)

#: The module base classes a class rule may name.
MODULE_BASES: tuple[type, ...] = (nn.Module, nnx.Module)


def module_path(module: Any, path: Sequence[Any] | None = None) -> str:
    """A module's path as path rules match it and every jaxamp report prints it.

    The names below the root joined by ``/`` (``"blocks_0/mlp/fc"``); the root module is named
    by its class (``"GPT"``). ``path``: for a module that does not know it (NNX), else
    ``module.path``.
    """
    parts = module.path if path is None else path
    return "/".join(str(p) for p in parts) or type(module).__name__


def _literal(pattern: str) -> int:
    return len(pattern.replace("*", "").replace("?", ""))


def _path_regex(pattern: str) -> re.Pattern[str]:
    """'a/layers_*/attn' -> regex; '*' stays inside one path segment, '**' crosses segments."""
    out = []
    for part in re.split(r"(\*\*|\*|\?)", pattern):
        out.append({"**": ".*", "*": "[^/]*", "?": "[^/]"}.get(part, re.escape(part)))
    return re.compile("".join(out) + r"\Z")


def _fp32_within(inherited: jmp.Policy) -> jmp.Policy:
    """The built-in normalisation rule: float32 compute, the enclosing compute dtype out."""
    return jmp.Policy(inherited.param_dtype, jnp.float32, inherited.compute_dtype)


def _embed_within(inherited: jmp.Policy) -> jmp.Policy:
    """The built-in embedding rule: rows gathered as stored, the enclosing compute dtype out
    (a tied head, ``embed.attend``, keeps the enclosing ``matmul=``)."""
    return dataclasses.replace(inherited, output_dtype=inherited.compute_dtype)


#: A class rule's policy: absolute (a user's rule) or relative to the policy the module would
#: inherit (the built-in rules, and a user's rule that sets only ``matmul=``).
ClassPolicy = jmp.Policy | Callable[[jmp.Policy], jmp.Policy]


@contextlib.contextmanager
def _naming(key: Any):
    """A bad override value's error, prefixed with its key: ``overrides[Dense]: ...``."""
    try:
        yield
    except (ValueError, TypeError) as e:
        name = key.__name__ if isinstance(key, type) else repr(key)
        raise type(e)(f"overrides[{name}]: {e}") from None


def read_overrides(overrides: Any) -> Any:
    """``overrides`` with each policy string read into its :class:`PolicySpec` (a bad string
    raises now, prefixed with its key), so a caller that builds rules at every trace (the train
    step) parses each string once; anything that is not a mapping is returned for
    :meth:`ModuleRules.create` to refuse."""
    if not isinstance(overrides, Mapping):
        return overrides
    out = {}
    for key, value in overrides.items():
        with _naming(key):
            out[key] = policy_spec.read(value) if isinstance(value, str) else value
    return out


def _rule_policy(key: Any, value: Any, default: jmp.Policy) -> ClassPolicy:
    """An override's policy, its string parsed once: one that sets only ``matmul=``/``fp8=``
    (``"matmul=bfloat16"``) is relative (the inherited policy with that matmul dtype);
    anything else is absolute."""
    with _naming(key):
        parsed = policy_spec.read(value) if isinstance(value, str) else value
        if getattr(parsed, "opt_state", None) is not None or opt_state_dtype(value) is not None:
            raise ValueError(
                f"Override {getattr(parsed, 'text', value)!r} sets opt_state=: the optimizer "
                "state is one for the whole model, stored in the dtype of the train state's "
                "policy. Set it there, e.g. "
                "TrainState.create(..., policy='params=float32,compute=bfloat16,output=float32,"
                "opt_state=bfloat16'), and leave it out of overrides.")
        if getattr(parsed, "relative", False):
            with_matmul(default, parsed)  # validate now (against the default), before tracing
            return functools.partial(_matmul_within, parsed=parsed, key=key)
        return get_policy(parsed)


def _matmul_within(inherited: jmp.Policy, parsed: policy_spec.PolicySpec, key: Any
                   ) -> jmp.Policy:
    with _naming(key):  # under an ancestor's rule with compute=float16, while tracing
        return with_matmul(inherited, parsed)


@dataclasses.dataclass(frozen=True)
class ModuleRules:
    """A default policy plus validated per-class and per-path overrides (:meth:`create`)."""

    default: jmp.Policy
    class_rules: tuple[tuple[type, ClassPolicy], ...]
    path_rules: tuple[tuple[str, re.Pattern[str], ClassPolicy], ...]

    @classmethod
    def create(cls, policy: str | jmp.Policy,
               overrides: Mapping[Any, str | jmp.Policy] | None = None) -> ModuleRules:
        """Validates a policy and its overrides (eagerly, before any tracing)."""
        default = get_policy(policy)
        if overrides is None:
            overrides = {}
        if not isinstance(overrides, Mapping):
            raise TypeError(
                f"overrides must be a dict mapping a Flax module class (linen or NNX) or a path "
                f"pattern to a policy, got {type(overrides).__name__}. Example: "
                "{nn.Dense: 'compute=float32', 'decoder/layers_*/attn': 'float32'}.")
        class_rules: list[tuple[type, ClassPolicy]] = []
        path_rules: list[tuple[str, re.Pattern[str], jmp.Policy]] = []
        for key, value in overrides.items():
            pol = _rule_policy(key, value, default)
            if isinstance(key, str):
                pattern = key.strip().strip("/")
                if not pattern:
                    raise ValueError(
                        f"override key {key!r} is an empty path pattern. Use a module path such as "
                        "'decoder/layers_*/attn' ('*' matches within one path segment, '**' "
                        "across segments), or the root module's class name.")
                path_rules.append((pattern, _path_regex(pattern), pol))
            elif isinstance(key, type) and issubclass(key, MODULE_BASES):
                class_rules.append((key, pol))
            else:
                hint = ""
                if isinstance(key, MODULE_BASES):
                    hint = f" Use its class, {type(key).__name__}, or its path."
                raise TypeError(
                    f"override key {key!r} is not a flax.linen.Module or flax.nnx.Module "
                    f"subclass or a path pattern string.{hint} Example: "
                    "{nn.Dense: 'compute=float32'} or {nnx.Linear: 'compute=float32'}.")
        class_rules += [(c, _fp32_within) for c in FP32_MODULES]
        class_rules += [(c, _embed_within) for c in EMBED_MODULES]
        return cls(default, tuple(class_rules), tuple(path_rules))

    def match(self, module: Any, path: Sequence[Any] | None = None,
              inherited: jmp.Policy | None = None, root: str | None = None
              ) -> tuple[jmp.Policy | None, str | None]:
        """Returns (policy, matched path pattern or None), or (None, None) to inherit.

        ``path``: as :func:`module_path` takes it. ``inherited``: the policy the module would
        inherit, which relative rules apply to. ``root``: the root module's class name, which
        a pattern may start with (``"GPT/blocks_0"`` matches what ``"blocks_0"`` matches)."""
        text = module_path(module, path)
        texts = (text,) if root is None or text == type(module).__name__ and not (
            module.path if path is None else path) else (text, f"{root}/{text}")
        best = None
        for pattern, regex, pol in self.path_rules:
            if any(regex.match(t) for t in texts):
                if best is None or _literal(pattern) >= _literal(best[0]):
                    best = (pattern, pol)
        if best is not None:
            return self._resolve(best[1], inherited), best[0]
        for base in type(module).__mro__:
            for klass, pol in self.class_rules:
                if klass is base:
                    return self._resolve(pol, inherited), None
        return None, None

    def _resolve(self, pol: ClassPolicy, inherited: jmp.Policy | None) -> jmp.Policy:
        if callable(pol) and not isinstance(pol, jmp.Policy):
            return pol(self.default if inherited is None else inherited)
        return pol
