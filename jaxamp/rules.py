"""Precision rules: which primitives run in which dtype, and which policy each module gets.

Two kinds of rules decide the dtype of every operation that :func:`jaxamp.autocast` rewrites.

**Op rules** (:class:`OpRules`) classify JAX primitives, the way torch autocast's op lists classify
ATen ops:

================  ============================================================  ====================
class             JAX primitives (defaults)                                     torch autocast
================  ============================================================  ====================
``matmul``        ``dot_general``, ``conv_general_dilated``                     "lower_precision_fp"
                  -> run in the region's compute dtype, output in it too        (mm, conv, bmm, ...)
``fp32``          ``exp``, ``log``, ``log1p``, ``expm1``, ``pow``, ``rsqrt``,   "fp32" list (exp,
                  ``reduce_sum``, ``reduce_prod``, ``cumsum``, ``tan``, ...     log, sum, norms)
                  -> inputs cast to float32
``structural``    ``reshape``, ``transpose``, ``gather``, ``slice``,            (no analog: views)
                  ``reduce_max``, ... -> keep the operand's dtype; a stored
                  value (a param) stays un-cast, so an embedding gathers
                  rows *then* casts them (a table no larger than the rows
                  read from it is cast whole, its rows gathered low: the
                  same numbers, its gradient still summed in float32)
``promote``       elementwise arithmetic, ``select_n``, ``concatenate``, ...    "promote" list
                  -> the widest activation dtype (params and constants
                  follow it; with only params/inputs, as traced, left
                  un-cast until an activation or a matmul uses the result)
================  ============================================================  ====================

``as_traced`` primitives run exactly as traced (float32 inputs), which is always safe: integer
and bit operations, random numbers, typed sub-computations such as ``scatter-add``, ``sort`` and
``reduce``. A primitive in no list (one that a newer JAX adds) runs as traced too, and autocast
warns with its name, so it never goes unnoticed; classify it with :meth:`OpRules.extend`.
An equation with a float64 operand or result (under ``jax_enable_x64``) runs as traced
whatever its class: autocast never narrows float64 (as torch autocast leaves it alone), FP8
matmuls included; where that leaves a matmul of a low-precision region in float64, autocast
warns, naming the float64 inputs (the policy changes nothing there).

A primitive can also get a **handler** of its own (``DEFAULT_OP_RULES.extend(handlers={
"dot_general": my_rule})``): a function of a :class:`jaxamp.rules.RuleCall` (the equation, its
operands after region crossings, the region's policy, the built-in rule as ``call.default()``)
that returns the outputs, or None to use the built-in rule. The engine's own rules are a table
of the same shape (:mod:`jaxamp._engine.op_rules`, :mod:`jaxamp._engine.control`).

Softmax, log-softmax and logsumexp need no entry of their own: they are built from ``exp``,
``log`` and ``reduce_sum``, and a value whose every consumer wants float32 is computed in
float32 too (so ``x - max(x)`` before the ``exp`` is float32, not only the ``exp``). The same
propagation keeps the statistics of a hand-written RMSNorm/LayerNorm in float32.

**Module rules** give a Flax module, linen or NNX (and, by inheritance, its children) a
:class:`jmp.Policy`: the default policy, then per class (``{nn.Dense: "compute=float32"}``) or
per path pattern (``{"decoder/layers_*/attn": "float32"}``; NNX paths read as NNX names them,
``"blocks/3/attn"``). Precedence, most specific first:

1. a path rule matching the module's path (among several, the pattern with the most literal
   characters wins; a tie goes to the rule given last);
2. a class rule for the module's class or its nearest base class in the MRO (user rules before
   the built-in ones for the same class);
3. the policy of the nearest ancestor module that matched a rule (Haiku's scoping);
4. the default policy.

An override that sets only ``matmul=`` (``{"lm_head": "matmul=bfloat16"}``, ``{nnx.Linear:
"matmul=float8"}``) is relative too: the module keeps the policy it would inherit, with that
matmul dtype (:class:`jaxamp.policy.MatmulPolicy`).

Built-in class rules (:data:`FP32_MODULES`, :data:`EMBED_MODULES`) are relative to the region
they sit in: normalisation layers compute in float32 and return the compute dtype of the
enclosing region ("FP16 input -> FP32 compute -> FP16 output"; inside a module that a rule
made float32, a float32 output); embeddings gather float32 rows and return them in the
enclosing region's compute dtype. A user's class rule for the same class is absolute and wins.

Paths are the names below the root module joined by ``/`` (:func:`module_path`); the root
module itself is matched by its class name (``"GPT"``), as every jaxamp report prints it, and a
pattern may start with it (``"GPT/blocks_0"`` matches what ``"blocks_0"`` matches). Paths are
the module structure: a ``jax.named_scope`` opened by the model is no part of them.
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

__all__ = [
    "DEFAULT_OP_RULES",
    "EMBED_MODULES",
    "FP32_MODULES",
    "MODULE_BASES",
    "ModuleRules",
    "OpRules",
    "RuleCall",
    "module_path",
]

#: The default op lists (one registry of primitive facts: :mod:`jaxamp._engine.primitives`).
MATMUL_PRIMITIVES = primitives.MATMUL
FP32_PRIMITIVES = primitives.FP32
#: The ``fp32`` primitives behind softmax, log-softmax and logsumexp, and the accumulating ones
#: (sums): the groups the audit names in its advice. Both are subsets of FP32_PRIMITIVES.
SOFTMAX_PRIMITIVES = primitives.SOFTMAX
SUM_PRIMITIVES = primitives.SUM
STRUCTURAL_PRIMITIVES = primitives.STRUCTURAL
PROMOTE_PRIMITIVES = primitives.PROMOTE
#: Primitives known to run exactly as traced: integer and bit operations, random numbers,
#: typed sub-computations (scatter, sort, generic reduce), effects and references, and the
#: higher-order primitives that autocast re-evaluates itself (jit, scan, cond, ...).
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
      as_traced: known to run exactly as traced (float32 inputs): integer/bit operations,
        random numbers, typed sub-computations. A primitive in no list runs as traced too,
        with a warning that names it.
      custom_vjp_as_traced: Python names of ``jax.custom_vjp`` functions that run exactly as
        traced, forward and backward (``"*"``: all of them). Every other ``custom_vjp``
        function keeps its rules and runs both of them under the region's policy.
      handlers: ``(primitive name, handler)`` pairs: a handler takes a
        :class:`jaxamp.rules.RuleCall` and returns the equation's outputs (a list of arrays), or
        None to leave the equation to its op class. Give them as a dict to :meth:`extend`.
      recompute: where the cheap code between two matmuls (normalisations, softmax,
        activation functions, bias adds, dropout masks) is recomputed in the backward pass
        from its inputs instead of keeping its (often float32) intermediates as residuals
        (:mod:`jaxamp._engine.recompute`); the forward's values are the same either way.
        ``"scan"`` (the default): inside the bodies of ``lax.scan`` (``nn.scan``,
        ``nnx.scan``, a scanned layer stack) only, where every kept residual is written into
        a per-iteration stack and read back; there recomputing lowers both the kernel bytes
        and the temp memory of the GPU program. ``True``: everywhere. In straight-line code
        XLA already fuses what it keeps into the kernels that make it, and a recompute
        segment (a checkpoint with an ``optimization_barrier``) adds kernel bytes: compiled
        for an H200, recompute everywhere costs the gpt2-small-shape bench GPT 18% more
        kernel bytes for 8% less temp memory (BENCHMARKS.md, History: the recompute
        study). ``False``: keeps every intermediate JAX's autodiff saves.
        Inside a user's ``jax.checkpoint`` its own policy decides.

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
        """Whether the ``custom_vjp`` function called ``name`` runs exactly as traced."""
        return "*" in self.custom_vjp_as_traced or name in self.custom_vjp_as_traced

    def classify(self, name: str) -> str:
        """Returns 'matmul', 'fp32', 'structural', 'promote' or 'as_traced' (in
        ``as_traced``, or in no list: see :meth:`known`) for a primitive name."""
        for kind in ("matmul", "fp32", "structural", "promote"):
            if name in getattr(self, kind):
                return kind
        return "as_traced"

    def known(self, name: str) -> bool:
        """Whether ``name`` is in one of the lists (a primitive in none runs as traced, and
        autocast warns)."""
        return self.classify(name) != "as_traced" or name in self.as_traced

    def handler(self, name: str) -> Callable | None:
        """The handler given for primitive ``name``, or None."""
        for key, fn in self.handlers:
            if key == name:
                return fn
        return None


#: The default rules; their one handler, :data:`jaxamp.fp8.FP8_MATMULS`, runs the eligible
#: matmuls of ``matmul=float8`` regions in FP8 (and defers everywhere else).
DEFAULT_OP_RULES = OpRules(handlers=(("dot_general", FP8_MATMULS),))

#: Module classes (linen and NNX) that compute in float32 and return the compute dtype of the
#: region they are in.
FP32_MODULES: tuple[type, ...] = (
    nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.BatchNorm, nn.InstanceNorm,
    nnx.LayerNorm, nnx.RMSNorm, nnx.GroupNorm, nnx.BatchNorm, nnx.InstanceNorm)

#: Module classes (linen and NNX) whose (gathered) output is returned in the compute dtype of
#: the region they are in.
EMBED_MODULES: tuple[type, ...] = (nn.Embed, nnx.Embed)

#: The module base classes a class rule may name.
MODULE_BASES: tuple[type, ...] = (nn.Module, nnx.Module)


def module_path(module: Any, path: Sequence[Any] | None = None) -> str:
    """A linen module's path as path rules match it and as every jaxamp report prints it.

    The names below the root module joined by ``/`` (``"blocks_0/mlp/fc"``, what
    ``overrides={"blocks_*/mlp/fc": ...}`` matches); the root module, which has no path, is
    named by its class (``"GPT"``). ``path``: the path when the module does not know it (an
    NNX module; its front end passes it), else ``module.path``.
    """
    parts = module.path if path is None else path
    return "/".join(str(p) for p in parts) or type(module).__name__


def _path_regex(pattern: str) -> re.Pattern[str]:
    """'a/layers_*/attn' -> regex; '*' stays inside one path segment, '**' crosses segments."""
    out = []
    for part in re.split(r"(\*\*|\*|\?)", pattern):
        out.append({"**": ".*", "*": "[^/]*", "?": "[^/]"}.get(part, re.escape(part)))
    return re.compile("".join(out) + r"\Z")


def _literal_len(pattern: str) -> int:
    return len(pattern.replace("*", "").replace("?", ""))


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


def _key_text(key: Any) -> str:
    """An override key as its error messages name it: ``overrides['blocks_*/mlp']``,
    ``overrides[Dense]``."""
    return f"overrides[{key.__name__ if isinstance(key, type) else repr(key)}]"


@contextlib.contextmanager
def _naming(key: Any):
    """A bad override value's error, prefixed with the key it was given under."""
    try:
        yield
    except (ValueError, TypeError) as e:
        raise type(e)(f"{_key_text(key)}: {e}") from None


def _rule_policy(key: Any, value: str | jmp.Policy, default: jmp.Policy) -> ClassPolicy:
    """An override's policy, its string parsed once: one that sets only ``matmul=``
    (``"matmul=bfloat16"``) is relative (the inherited policy with that matmul dtype);
    anything else is absolute."""
    with _naming(key):
        parsed = policy_spec.read(value) if isinstance(value, str) else value
        if getattr(parsed, "opt_state", None) is not None or opt_state_dtype(value) is not None:
            raise ValueError(
                f"Override {value!r} sets opt_state=: the optimizer state is one for the whole "
                "model, stored in the dtype of the train state's policy. Set it there, e.g. "
                "TrainState.create(..., policy='params=float32,compute=bfloat16,output=float32,"
                "opt_state=bfloat16'), and leave it out of overrides.")
        if getattr(parsed, "given", None) == {"matmul"}:
            with_matmul(default, parsed)  # validate now (against the default), before tracing
            return functools.partial(_matmul_within, parsed=parsed, key=key)
        return get_policy(parsed)


def _matmul_within(inherited: jmp.Policy, parsed: policy_spec.PolicySpec, key: Any
                   ) -> jmp.Policy:
    with _naming(key):  # under an ancestor's rule with compute=float16, while tracing
        return with_matmul(inherited, parsed)


@dataclasses.dataclass(frozen=True)
class ModuleRules:
    """A default policy plus validated per-class and per-path overrides.

    Build it with :meth:`create`; :func:`jaxamp.autocast` does that for you.
    """

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

        ``path`` is the module's path (a linen module's own ``module.path`` if None; an NNX
        module does not know its path, its front end passes it); the root module (empty path)
        is matched by its class name. ``inherited``: the policy the module would inherit (its
        nearest matched ancestor's, else the default), which the built-in rules are relative
        to. ``root``: the root module's class name; a pattern may start with it
        (``"GPT/blocks_0"`` matches what ``"blocks_0"`` matches)."""
        text = module_path(module, path)
        texts = (text,) if root is None or text == type(module).__name__ and not (
            module.path if path is None else path) else (text, f"{root}/{text}")
        best = None
        for pattern, regex, pol in self.path_rules:
            if any(regex.match(t) for t in texts):
                if best is None or _literal_len(pattern) >= _literal_len(best[0]):
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
