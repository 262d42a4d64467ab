"""The audit's view of a traced program: it traces the function under :func:`jaxamp.autocast`
(with ``jax.value_and_grad`` when there is something to differentiate) and reads the jaxpr,
never compiling or running it. :class:`Recorder` learns every module's path, class and policy
during the trace, and the marks autocast makes; :func:`collect_eqns` walks the jaxpr into
:class:`Eqn` records; :func:`trace_model` ties them into a :class:`Trace`; :func:`table_rows`
groups records into precision-table rows. Findings live in the modules built on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import jmp
import numpy as np

from .._engine.compat import dce_jaxpr
from .._engine.context import MARKS
from .._engine.jaxpr import feeders, walk
from ..engine import autocast
from ..nnx_frontend import functional, intercept_calls
from ..policy import get_policy
from ..policy_spec import DEFAULT_POLICY
from ..rules import (
    DEFAULT_OP_RULES,
    SOFTMAX_PRIMITIVES,
    STRUCTURAL_PRIMITIVES,
    SUM_PRIMITIVES,
    ModuleRules,
    OpRules,
    module_path,
)
from ..train import StepProgram, TrainState, TrainStep

_OP_CLASSES = {
    "dot_general": "matmul", "conv_general_dilated": "conv", "gather": "gather",
    "exp": "exp/log", "log": "exp/log", "log1p": "exp/log", "expm1": "exp/log",
    "reduce_sum": "reduction", "reduce_prod": "reduction", "cumsum": "reduction",
    # exact in any dtype (they select a value): apart from the accumulating reductions
    "reduce_max": "max/min", "reduce_min": "max/min", "argmax": "max/min", "argmin": "max/min",
    "rsqrt": "rsqrt/sqrt", "sqrt": "rsqrt/sqrt", "convert_element_type": "cast",
    # cuDNN's fused attention (jax.nn.dot_product_attention bound with implementation="cudnn",
    # as autocast binds it for a GPU): one equation each way, see attention_dtypes
    "dot_product_attention_fwd_wrapper": "attention",
    "dot_product_attention_bwd_wrapper": "attention",
}
_NOISE = re.compile("rematted_computation|checkpoint|remat")
_TRANSFORM = re.compile(r"^(jvp|transpose|vmap|pjit|jit)\((.*)\)$")
SCAFFOLD = "jaxamp_audit"  # name scope of the audit's own scalarisation (left out of rows)
TOP_LEVEL = "(top level)"

LOW = frozenset({"float16", "bfloat16"})
# The op classes come from jaxamp.rules (one taxonomy): which ops are matmuls and which must run
# in float32 from the OpRules given to autocast; the advice groups are fixed subsets of fp32.
EXPLOG = SOFTMAX_PRIMITIVES
ACCUM = SUM_PRIMITIVES
# Primitives whose result is exact in any float dtype (data movement, selection, comparison):
# they carry a dtype but round nothing, so they are never flagged and do not count towards the
# reference rows' dtypes.
_EXACT = frozenset(STRUCTURAL_PRIMITIVES) | frozenset({
    "concatenate", "pad", "dynamic_update_slice", "select_n", "max", "min", "neg", "abs",
    "sign", "eq", "ne", "lt", "le", "gt", "ge", "is_finite", "stop_gradient", "clamp", "floor",
    "ceil", "round", "copy", "iota", "scatter", "sort", "reduce_and", "reduce_or",
    "not", "and", "or", "xor", "squeeze", "device_put", "zeros_like",
    "broadcast_in_dim", "reduce_precision", "random_bits", "random_wrap", "random_unwrap",
    "random_seed", "threefry2x32", "convert_element_type",
})


def attention_dtypes(r: Eqn) -> tuple[list[str], list[str]]:
    """(the dtypes its matmuls read and write, its softmax's) of a cuDNN fused-attention
    record, from JAX's primitives' operands: the forward reads query/key/value (0-2) and
    returns the output and, for training, the float32 softmax statistics; the backward reads
    q/k/v, the statistics (10), the output and its cotangent (11, 12). cuDNN's softmax is
    float32 (a forward without statistics says nothing else)."""
    ins, outs = r.eqn.invars, r.eqn.outvars
    if r.prim == "dot_product_attention_fwd_wrapper":
        return float_dtypes([*ins[:3], outs[0]]), float_dtypes(outs[1:2]) or ["float32"]
    return float_dtypes([*ins[:3], *ins[11:13], *outs]), float_dtypes(ins[10:11])


def is_low(dtypes) -> bool:
    return any(d in LOW for d in dtypes)


def dtype_name(name: Any) -> str:
    return np.dtype(name).name


def join_dtypes(dtypes) -> str:
    return ",".join(sorted(set(dtypes))) or "-"


def low_leaves(tree) -> list[tuple[str, str]]:
    """(key path, dtype) of the float16/bfloat16 leaves of ``tree``."""
    out = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        dtype = getattr(leaf, "dtype", None)
        if dtype is None:
            continue
        try:
            name = np.dtype(dtype).name
        except TypeError:
            continue
        if name in LOW:
            out.append((jax.tree_util.keystr(path), name))
    return out


# ---- module information, recorded while autocast traces the function -----------------------------


@dataclasses.dataclass
class ModuleInfo:
    path: str  # name-stack style: "GPT/blocks/attn" (how equations are matched to modules)
    name: str  # as reports print it and path rules match it (rules.module_path): "blocks/attn"
    cls: type
    compute: str  # the compute dtype autocast's rules give this module
    output: str
    matched: bool  # a rule (built-in or user) chose its policy; False: inherited/default


class Recorder:
    """A linen method interceptor that learns every module's path, class and policy."""

    def __init__(self, rules: ModuleRules):
        self.rules = rules
        self.modules: dict[str, ModuleInfo] = {}
        self.stack: list[tuple[nn.Module, jmp.Policy, str]] = []

    def interceptor(self, next_fun, args, kwargs, context):
        """A linen method interceptor, and an NNX one (``context.path``: the NNX path)."""
        module = context.module
        if self.stack and self.stack[-1][0] is module:
            return next_fun(*args, **kwargs)
        parts = getattr(context, "path", None)  # NNX: its front end passes the path
        if parts is None:
            parts = module.path
        root = type(self.stack[0][0]).__name__ if self.stack else None
        policy, _ = self.rules.match(module, parts, root=root)
        matched = policy is not None
        if policy is None:
            policy = self.stack[-1][1] if self.stack else self.rules.default
        if not parts:
            path = type(module).__name__
        else:
            root = self.stack[0][2].split("/")[0] if self.stack else "?"
            path = "/".join([root, *(str(p) for p in parts)])
        if path not in self.modules:
            self.modules[path] = ModuleInfo(path, module_path(module, parts), type(module),
                                            dtype_name(policy.compute_dtype),
                                            dtype_name(policy.output_dtype), matched)
        self.stack.append((module, policy, path))
        try:
            return next_fun(*args, **kwargs)
        finally:
            self.stack.pop()


# ---- walking the jaxpr ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _parts(stack: str) -> tuple[str, ...]:
    """A name stack's scope names, transformations unwrapped (``jvp(a)`` -> ``a``)."""
    out = []
    for part in stack.split("/"):
        while (m := _TRANSFORM.match(part)) is not None:
            part = m.group(2)
        out.append(part)
    return tuple(out)


def clean_path(stack: str) -> tuple[str, bool]:
    """Module path (without autocast's marks) and whether the equation belongs to the backward
    pass."""
    parts = []
    for part in _parts(stack):
        if part in MARKS:
            continue
        part = _NOISE.sub("", part)
        if part and not any(c in part for c in ",->") and part not in parts[-1:]:
            parts.append(part)
    return "/".join(parts) or TOP_LEVEL, "transpose(" in stack


def float_dtypes(vs) -> list[str]:
    out = []
    for v in vs:
        dtype = getattr(getattr(v, "aval", None), "dtype", None)
        if dtype is not None:
            try:
                if jnp.issubdtype(dtype, jnp.floating):
                    out.append(np.dtype(dtype).name)
            except TypeError:  # extended dtypes (PRNG keys)
                pass
    return out


def dce(jaxpr: jcore.Jaxpr) -> tuple[jcore.Jaxpr, list[bool]]:
    """The jaxpr without dead equations, and which inputs it still uses."""
    try:
        new, used = dce_jaxpr(jaxpr)
        return new, list(used)
    except Exception:  # pragma: no cover - internal API moved
        pass
    return jaxpr, [True] * len(jaxpr.invars)


@dataclasses.dataclass
class Eqn:
    """One equation as the audit sees it."""

    eqn: Any
    stack: str  # the raw name stack
    module: str  # the cleaned module path (as in the rows)
    key: str  # the module it belongs to in the recorder's table ("" if none)
    op: str
    backward: bool
    in_dtypes: list[str]
    out_dtypes: list[str]
    param_operand: bool  # (a matmul or gather) an operand is (casts/reshapes of) a parameter
    count_sum: bool  # a sum of 0/1 indicators converted from booleans (an exact count)
    bounded: bool = False  # exp(-x**2) (JAX's derivative of erf/erfc): in [0, 1], no overflow
    top: int = 0  # id of the top-level equation it is (or is inside of)
    param_grad: bool = False  # (backward) it sums into a parameter's gradient, no matmul between
    decision: str | None = None  # a rule's decision on it (the FP8 rule's: "small", ...)

    @property
    def prim(self) -> str:
        return self.eqn.primitive.name

    @property
    def dtypes(self) -> set[str]:
        return set(self.in_dtypes) | set(self.out_dtypes)

    @property
    def rounds(self) -> bool:
        return self.prim not in _EXACT and bool(self.dtypes)


PASS_THROUGH = frozenset({"convert_element_type", "reshape", "broadcast_in_dim", "transpose",
                           "squeeze", "slice", "dynamic_slice", "gather", "copy", "split",
                           "concatenate", "rev"})


def _negative_square(v, producer: dict) -> bool:
    """Whether ``v`` is ``-(x * x)`` (or ``(-x) * x``): what JAX's derivative of
    ``erf``/``erfc`` (an exact GELU, ``jax.nn.gelu(approximate=False)``) exponentiates.
    ``exp`` of it lies in [0, 1] and cannot overflow in any dtype."""
    def made_by(u, name: str):
        e = producer.get(u) if isinstance(u, jcore.Var) else None
        return e if e is not None and e.primitive.name == name else None

    if (neg := made_by(v, "neg")) is not None:
        x = neg.invars[0]
        if made_by(x, "square") is not None:
            return True
        sq = made_by(x, "mul")
        return sq is not None and sq.invars[0] is sq.invars[1]
    mul = made_by(v, "mul")
    if mul is None:
        return False
    a, b = mul.invars
    return any((n := made_by(p, "neg")) is not None and n.invars[0] is q
               for p, q in ((a, b), (b, a)))


def collect_eqns(jaxpr: jcore.Jaxpr, param_inputs: Sequence[bool], *,
                 op_rules: OpRules = DEFAULT_OP_RULES) -> list[Eqn]:
    """Every equation (sub-programs inlined, execution order) with its module path, pass and
    whether a matmul (an op in ``op_rules.matmul``) has a parameter operand."""
    records: list[Eqn] = []
    # whether a var is (casts/reshapes of) a parameter; sub-program vars are distinct objects
    flags: dict = {v: bool(f) for v, f in zip(jaxpr.invars, param_inputs)}
    producer: dict = {}
    outer: list = []  # the equations whose sub-programs are being walked

    def is_param(v) -> bool:
        return isinstance(v, jcore.Var) and flags.get(v, False)

    def enter(eqn, sub, stack) -> None:
        outer.append(eqn)
        for v, o in zip(sub.jaxpr.invars, sub.ins):
            flags[v] = o is not None and is_param(o)

    def leave(eqn, subs, stack) -> None:
        del outer[len(outer) - len(subs):]
        out_flags = [False] * len(eqn.outvars)
        for sub in subs:
            for v, o in zip(sub.jaxpr.outvars, sub.outs):
                if o is not None and is_param(v) and o in eqn.outvars:
                    out_flags[eqn.outvars.index(o)] = True
        for o, f in zip(eqn.outvars, out_flags):
            flags[o] = f

    def leaf(eqn, full) -> None:
        if SCAFFOLD in full:
            return
        module, backward = clean_path(full)
        name = eqn.primitive.name
        ins = list(eqn.invars)
        pflags = [is_param(v) for v in ins]
        for o in eqn.outvars:  # set every time: a sub-program walked again has new inputs
            flags[o] = name in PASS_THROUGH and any(pflags)
        count = False
        if name in ACCUM and isinstance(ins[0], jcore.Var) and ins[0] in producer:
            src = producer[ins[0]]
            count = (src.primitive.name == "convert_element_type"
                     and not float_dtypes(src.invars))
        for o in eqn.outvars:
            producer[o] = eqn
        matmul = name in op_rules.matmul
        op = _OP_CLASSES.get(name, "matmul" if matmul else "elementwise")
        records.append(Eqn(eqn, full, module, "", op, backward, float_dtypes(ins),
                           float_dtypes(eqn.outvars), (matmul or name == "gather") and any(pflags),
                           count,
                           name == "exp" and _negative_square(ins[0], producer),
                           id(outer[0] if outer else eqn)))

    walk(jaxpr, leaf, enter=enter, leave=leave)
    return records


def _tokens(stack: str) -> list[str | None]:
    """A name stack's scopes, transformations unwrapped, with ``None`` where autocast marked a
    module call (the module's own scope is right before it) and autocast's other marks and
    remat names left out."""
    out: list[str | None] = []
    for part in _parts(stack):
        mark = MARKS.get(part)
        if mark is not None:
            if mark.region is not None:
                out.append(None)
            continue
        part = _NOISE.sub("", part)
        if part and not any(c in part for c in ",->"):
            out.append(part)
    return out


def _resolve(path: str | None, pending: list[str], modules: dict[str, ModuleInfo]
             ) -> tuple[str, str] | None:
    """The recorded module that the scopes ``pending`` (since the module ``path``, None: from
    the top) end with: ``(its name-stack path, method suffix)``, or None. The shortest tail of
    ``pending`` that names a module wins: scopes before it are the user's ``jax.named_scope`` s
    (tunix wraps each ``__call__`` in one)."""
    root = path.split("/")[0] if path else None
    for n in range(1, len(pending) + 1):
        tail = pending[-n:]
        head, dot, method = tail[-1].partition(".")  # linen: "embed.attend"
        rel = "/".join([*tail[:-1], head])
        if path is not None:
            cands = [f"{path}/{rel}", f"{root}/{rel}"]
        else:
            cands = [rel, *sorted((m for m in modules if m.endswith("/" + rel)), key=len)]
        for cand in cands:
            if cand in modules:
                return cand, dot + method
    return None


def module_of(stack: str, modules: dict[str, ModuleInfo], marked: bool = True
              ) -> tuple[str, str]:
    """``(key, printed path)`` of the module an equation with name stack ``stack`` belongs to:
    the recorded module (name-stack style, ``""`` if none) and its path as reports print it
    and ``overrides=`` matches it (:func:`jaxamp.rules.module_path`: ``embed.attend``), or
    ``(top level)``.

    The path is the module structure, not the name stack: scopes before a module-call mark
    that name no module (a ``jax.named_scope`` around a ``__call__``), or after the last one,
    are left out; no Flax module (Equinox, plain JAX) is all top level, and so is a stack
    without a mark in a program autocast ``marked``. A program without marks (a hand-written
    step without autocast) is read as its cleaned stack."""
    if not modules:  # no Flax module was called (Equinox, plain JAX): all is top level
        return "", TOP_LEVEL
    tokens = _tokens(stack)
    if None not in tokens:
        if marked:
            return "", TOP_LEVEL
        module, _ = clean_path(stack)
        module = canonical_path(module, modules)
        return _module_key(module, modules), display_path(module, modules)
    path, suffix, pending = None, "", []
    for tok in tokens:
        if tok is not None:
            pending.append(tok)
            continue
        if pending:
            found = _resolve(path, pending, modules)
            if found is not None:
                path, suffix = found
            pending = []
    if path is None:
        return "", TOP_LEVEL
    return path, modules[path].name + suffix


def mark_param_grad_sums(records: list[Eqn], jaxpr: jcore.Jaxpr, grad_outs: Sequence[Any],
                         matmuls: frozenset[str]) -> None:
    """Sets ``param_grad`` on the backward records whose (top-level) equation feeds a
    parameter's gradient (``grad_outs``) without a matmul between: a sum there accumulates
    the gradient itself, where one that feeds a matmul is an activation's cotangent (JAX's
    transpose of a broadcast), in the forward value's dtype."""
    hit = {id(e) for e in feeders(jaxpr, grad_outs, stop=matmuls)}
    for r in records:
        r.param_grad = r.backward and r.top in hit


def loss_records(records: Sequence[Eqn], matmuls) -> set[int]:
    """The ids of the records that are the loss: outside every module, in the forward after
    the last matmul (the head), in the backward before the first one (so a model without Flax
    modules, all top level, has no attention or norm in its loss)."""
    fwd = [i for i, r in enumerate(records) if r.prim in matmuls and not r.backward]
    bwd = [i for i, r in enumerate(records) if r.prim in matmuls and r.backward]
    last, first = (fwd[-1] if fwd else -1), (bwd[0] if bwd else len(records))
    return {id(r) for i, r in enumerate(records)
            if not r.key and r.module == TOP_LEVEL
            and (i > last if not r.backward else i < first)}


def _module_key(path: str, modules: dict[str, ModuleInfo]) -> str:
    """The recorded module a cleaned name-stack path belongs to ("" if none).

    Handles method suffixes (``GPT/embed.attend`` -> ``GPT/embed``) and equations that a
    transformation hoisted out of a ``scan`` body, whose name stack lost the enclosing modules
    (``blocks/ln1`` -> ``GPT/blocks/ln1``)."""
    if path == TOP_LEVEL or not modules:
        return ""
    segs = path.split("/")
    segs[-1] = segs[-1].split(".")[0]
    cand = "/".join(segs)
    if cand in modules:
        return cand
    tails = [m for m in modules if m.endswith("/" + cand)]
    if tails:
        return min(tails, key=len)
    # the innermost recorded ancestor (e.g. einsum sub-scopes)
    while len(segs) > 1:
        segs.pop()
        cand = "/".join(segs)
        if cand in modules:
            return cand
    return ""


def display_path(path: str, modules: dict[str, ModuleInfo]) -> str:
    """A canonical name-stack path as reports print it (:func:`jaxamp.rules.module_path`):
    ``GPT/blocks/attn`` -> ``blocks/attn``, ``GPT/embed.attend`` -> ``embed.attend``; the root
    module keeps its class name; paths outside modules are unchanged."""
    if path in modules:
        return modules[path].name
    head, sep, rest = path.partition("/")
    if sep and head in modules and "/" not in modules[head].path:  # below a root module
        return rest
    return path


def canonical_path(path: str, modules: dict[str, ModuleInfo]) -> str:
    """``path`` with a hoisted scan prefix restored (``blocks/ln1`` -> ``GPT/blocks/ln1``)."""
    if path == TOP_LEVEL or not modules or path in modules:
        return path
    head, dot, method = path.partition(".")
    if head in modules:
        return path
    tails = [m for m in modules if m.endswith("/" + head)]
    if tails:
        return min(tails, key=len) + dot + method
    return path


# ---- the step form: fn(step, state, batch) -------------------------------------------------------


@dataclasses.dataclass
class Call:
    """What a diagnostic traces: a function of ``args`` and the options it runs under. From a
    train step (``fn(step, state, batch)``), the step's own (:meth:`TrainStep.program`)."""

    fn: Callable
    args: tuple
    policy: Any
    overrides: Any
    op_rules: OpRules
    f32_weight_grads: bool | None = None
    program: StepProgram | None = None

    def context(self):
        return self.program.context() if self.program is not None else contextlib.nullcontext()


def resolve_call(where: str, fn: Any, args: Sequence[Any], *, policy=None, overrides=None,
                 op_rules=None) -> Call:
    """``fn(*args)`` with ``policy``/``overrides``/``op_rules`` (``None``: the defaults), or,
    when ``fn`` is a step from :func:`jaxamp.make_train_step`, ``(step, state, batch)``: the
    step's loss of the state's params, under the step's options."""
    if not isinstance(fn, TrainStep):
        return Call(fn, tuple(args), DEFAULT_POLICY if policy is None else policy, overrides,
                    DEFAULT_OP_RULES if op_rules is None else op_rules)
    if len(args) != 2 or not isinstance(args[0], TrainState):
        got = ", ".join(type(a).__name__ for a in args) or "nothing"
        raise TypeError(f"{where}(step, state, batch): a train step is called with the state "
                        f"and a batch, got {got} after the step. Example: "
                        f"jaxamp.{where}(step, state, batch).")
    given = [n for n, v in (("policy", policy), ("overrides", overrides),
                            ("op_rules", op_rules)) if v is not None]
    if given:
        raise TypeError(f"{where}(step, state, batch): the step's own {', '.join(given)} "
                        "apply; give the policy to TrainState.create(..., policy=...) and "
                        "overrides=/op_rules= to make_train_step(...), not to "
                        f"{where}.")
    prog = fn.program(*args)
    return Call(prog.loss, (prog.params,), prog.policy, prog.overrides, prog.op_rules,
                prog.f32_weight_grads, prog)


# ---- tracing -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Trace:
    """A function traced under autocast: its records, (DCE'd) jaxpr, modules and output."""

    records: list[Eqn]
    jaxpr: jcore.Jaxpr
    modules: dict[str, ModuleInfo]
    out_dtypes: list[str]
    out_scalar: bool
    policy: jmp.Policy
    grad: bool
    op_rules: OpRules = DEFAULT_OP_RULES  # what autocast ran by: the audit expects the same


def _n_leaves(tree) -> int:
    return len(jax.tree_util.tree_leaves(tree))


def _has_float(tree) -> bool:
    return any(jnp.issubdtype(np.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype,
                              jnp.floating) for x in jax.tree_util.tree_leaves(tree))


def trace_model(fn: Callable, args: Sequence[Any], *, policy, overrides, op_rules: OpRules,
                argnums: int | None, f32_weight_grads: bool | None = None,
                scope: Callable | None = None) -> Trace:
    """``fn(*args)`` traced under autocast (and its gradient w.r.t. ``args[argnums]``);
    ``scope()``: the context the autocast is evaluated in (:attr:`StepProgram.fp8_scope`)."""
    pol = get_policy(policy)
    rules = ModuleRules.create(pol, overrides)
    recorder = Recorder(rules)
    fn, args = functional(fn, tuple(args))  # NNX models -> their params

    def recorded(*a):
        with recording(recorder):
            return fn(*a)

    # Read with recompute off: recompute changes what the backward keeps, not the dtype any op
    # runs in, and its checkpoints would show replayed forward ops as backward ones.
    autocast_fn = autocast(recorded, pol, overrides=overrides,
                           op_rules=op_rules.extend(recompute=False),
                           f32_weight_grads=f32_weight_grads)

    def amp(*a):
        with scope() if scope else contextlib.nullcontext():  # in the evaluating trace
            return autocast_fn(*a)
    grad = argnums is not None and _has_float(args[argnums])

    def scalar(*a):
        out = amp(*a)
        with jax.named_scope(SCAFFOLD):
            outs = [o for o in jax.tree.leaves(out) if jnp.issubdtype(o.dtype, jnp.floating)]
            total = sum(jnp.sum(o.astype(jnp.float32)) for o in outs)
        return total, out

    if grad:
        closed, out_shape = jax.make_jaxpr(
            jax.value_and_grad(scalar, argnums=argnums, has_aux=True), return_shape=True)(*args)
        out_shape = out_shape[0][1]
    else:
        closed, out_shape = jax.make_jaxpr(amp, return_shape=True)(*args)
    before = sum(_n_leaves(a) for a in args[:argnums]) if grad else 0
    param_inputs = [grad and before <= i < before + _n_leaves(args[argnums])
                    for i in range(len(closed.jaxpr.invars))]
    jaxpr, used = dce(closed.jaxpr)
    param_inputs = [f for f, u in zip(param_inputs, used) if u]
    records = attribute(collect_eqns(jaxpr, param_inputs, op_rules=op_rules),
                        recorder.modules)
    if grad:
        n_grads = _n_leaves(args[argnums])
        mark_param_grad_sums(records, jaxpr, jaxpr.outvars[len(jaxpr.outvars) - n_grads:],
                             frozenset(op_rules.matmul))
    leaves = jax.tree.leaves(out_shape)
    out_dtypes = sorted({np.dtype(o.dtype).name for o in leaves})
    scalar_out = len(leaves) == 1 and tuple(leaves[0].shape) == ()
    return Trace(records, jaxpr, recorder.modules, out_dtypes, scalar_out, pol, grad, op_rules)


def attribute(records: list[Eqn], modules: dict[str, ModuleInfo]) -> list[Eqn]:
    """Gives each record its recorded module (``key``), the path reports print (``module``,
    :func:`module_of`: what ``overrides=`` accepts) and a rule's ``decision`` on it (the
    outermost), looked up in autocast's marks (:data:`jaxamp._engine.context.MARKS`)."""
    marked = any(None in _tokens(r.stack) for r in records)
    for r in records:
        r.key, r.module = module_of(r.stack, modules, marked)
        r.decision = decision_of(r.stack)
    return records


def decision_of(stack: str) -> str | None:
    """The (outermost) rule decision marked in a name stack or an XLA op name, looked up in
    autocast's marks of this process; None where there is none."""
    found = (MARKS.get(p) for p in _parts(stack))
    return next((m.decision for m in found if m is not None and m.decision), None)


def recording(recorder: Recorder):
    """The context in which ``recorder`` sees every linen and NNX module call."""
    stack = contextlib.ExitStack()
    stack.enter_context(nn.intercept_methods(recorder.interceptor))
    stack.enter_context(intercept_calls(recorder.interceptor))
    return stack


def matmul_rows(records: Sequence[Eqn]) -> list[dict[str, str]]:
    """One row per forward ``dot_general``, in program order: ``{"module", "shapes",
    "dtypes", "fp8", "recipe", "reason"}``. ``fp8`` is ``"yes"`` when its operands are FP8,
    and ``recipe`` then the ``fp8=`` recipe it ran with (``current``, ``rowwise``; empty for an
    FP8 dot a rule of the user's made); ``reason`` says why not: the FP8 rule's decision
    (``first``, ``last``, ``small``, ``unaligned``, ``batched``, ``not float``:
    :func:`jaxamp.fp8_eligible`), or ``policy`` where the module's policy does not set
    ``matmul=float8``."""
    rows = []
    for r in records:
        if r.prim != "dot_general" or r.backward or SCAFFOLD in r.stack:
            continue
        fp8 = any(d.startswith("float8") for d in r.in_dtypes)
        reason = "" if fp8 else r.decision or "policy"
        recipe = (r.decision or "") if fp8 else ""
        shapes = " @ ".join("x".join(str(d) for d in getattr(v.aval, "shape", ()))
                            for v in r.eqn.invars)
        rows.append({"module": r.module, "shapes": shapes,
                     "dtypes": f"{join_dtypes(r.in_dtypes)} -> {join_dtypes(r.out_dtypes)}",
                     "fp8": "yes" if fp8 else "no", "recipe": recipe, "reason": reason})
    return rows


def table_rows(records: Sequence[Eqn], out_dtypes: Sequence[str]) -> list[dict[str, str]]:
    table: dict[tuple[str, str], dict[str, set[str]]] = {}
    for r in records:
        if not r.dtypes:
            continue
        entry = table.setdefault((r.module, r.op), {"forward": set(), "backward": set()})
        entry["backward" if r.backward else "forward"] |= r.dtypes
    rows = [{"module": m, "op": op, "forward": ",".join(sorted(d["forward"])) or "-",
             "backward": ",".join(sorted(d["backward"])) or "-"}
            for (m, op), d in sorted(table.items())]
    rows.append({"module": "(output)", "op": "output", "forward": ",".join(out_dtypes) or "-",
                 "backward": "-"})
    return rows
