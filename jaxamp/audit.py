"""Precision audit: which dtype every part of a function actually ran in, and what looks wrong.

Two entry points read the *traced program* (the jaxpr, i.e. the StableHLO dtypes a GPU would
run; XLA on CPU upcasts low-precision matmuls later, at compile time, so never read compiled
HLO for this):

* :func:`precision_table` -- rows ``{"module", "op", "forward", "backward"}``: every equation of
  ``jax.value_and_grad`` of the autocast function, grouped by module path (from the name stack
  Flax linen records) and op class, with the float dtypes seen in each pass.
* :func:`audit` -- the same table plus :class:`Finding` s (the seed's review checklist, §5) and
  the seed's §4 reference table (:meth:`AuditReport.seed_rows`).
* :func:`audit_step` -- reads a whole user-written train step for the order of loss-scale
  unscaling and gradient clipping.

Findings :func:`audit` reports (``Finding.kind``):

``matmul_f32_in_low_precision_region``
    a ``dot_general``/``conv`` with float32 operands in a module whose policy computes in
    float16/bfloat16 (module policies are recomputed from ``policy``/``overrides`` with the same
    rules autocast applies; a module that a rule sets to float32 is not flagged). Typical cause:
    a ``custom_vjp`` function (autocast runs those exactly as traced, in float32) or another
    primitive autocast does not rewrite. (A manual ``.astype(jnp.float32)`` before a matmul does
    not cause it: autocast casts matmul operands to the region's compute dtype regardless.)
``softmax_low_precision``
    exp/log (and the sums of the same module) in float16/bfloat16 inside a module.
``normalisation_low_precision``
    arithmetic (statistics, rsqrt, scaling) of a normalisation module in float16/bfloat16.
``loss_low_precision``
    exp/log/sums outside every module (the loss) in float16/bfloat16, or a scalar output in a
    low-precision dtype.
``reduction_low_precision``
    any other accumulating reduction (``reduce_sum``, ``cumsum``, ...) in float16/bfloat16.
    Sums of 0/1 indicators (converted from booleans: exact counts) are not flagged; max/min
    reductions are exact in any dtype and never flagged.
``lossy_round_trip``
    a forward value cast float32 -> float16/bfloat16 -> float32 (precision thrown away).
``duplicate_cast``
    the same forward value cast to the same dtype twice in one (sub-)program. (Backward
    duplicates are not reported: JAX creates them when it transposes two casts whose
    cotangents are the same value, e.g. an embedding plus a positional embedding, and XLA's
    CSE merges them.)
``params_low_precision``
    float leaves of ``args[argnums]`` (the parameters) stored in float16/bfloat16 (e.g. a model
    cast wholesale with ``.astype(jnp.float16)``): the update then rounds to low precision.
``opt_state_low_precision``
    float leaves of ``opt_state=`` in float16/bfloat16.

Dead code is removed before auditing (``jax``'s DCE), so values a program computes and throws
away (e.g. the JVP of a ``stop_gradient``'ed max) are not reported.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import jmp
import numpy as np

from jaxamp._jaxpr import duplicate_casts, lossy_round_trips
from jaxamp.autocast import autocast
from jaxamp.policy import get_policy, policy_to_str
from jaxamp.rules import (
    DEFAULT_OP_RULES,
    EMBED_MODULES,
    FP32_MODULES,
    STRUCTURAL_PRIMITIVES,
    ModuleRules,
    OpRules,
)

try:  # dead-code elimination of jaxprs (internal API; the audit works without it)
    from jax._src.interpreters import partial_eval as _pe
except ImportError:  # pragma: no cover
    _pe = None

__all__ = ["AuditReport", "Finding", "audit", "audit_step", "format_precision_table",
           "precision_table"]

_DEFAULT_POLICY = "params=float32,compute=float16,output=float32"
_OP_CLASSES = {
    "dot_general": "matmul", "conv_general_dilated": "conv", "gather": "gather",
    "exp": "exp/log", "log": "exp/log", "log1p": "exp/log", "expm1": "exp/log",
    "reduce_sum": "reduction", "reduce_max": "reduction", "reduce_min": "reduction",
    "reduce_prod": "reduction", "cumsum": "reduction", "argmax": "reduction",
    "rsqrt": "rsqrt/sqrt", "sqrt": "rsqrt/sqrt", "convert_element_type": "cast",
}
_NOISE = re.compile(r"jaxamp<\d+>|rematted_computation|checkpoint|remat")
_TRANSFORM = re.compile(r"^(jvp|transpose|vmap|pjit|jit)\((.*)\)$")
_SCAFFOLD = "jaxamp_audit"  # name scope of the audit's own scalarisation (left out of rows)
_TOP = "(top level)"

_LOW = frozenset({"float16", "bfloat16"})
_MATMUL = frozenset({"dot_general", "conv_general_dilated", "ragged_dot_general"})
_EXPLOG = frozenset({"exp", "exp2", "log", "log1p", "expm1", "cumlogsumexp"})
_ACCUM = frozenset({"reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp"})
# Primitives whose result is exact in any float dtype (data movement, selection, comparison):
# they carry a dtype but round nothing, so they are never flagged and do not count towards the
# seed rows' dtypes.
_EXACT = frozenset(STRUCTURAL_PRIMITIVES) | frozenset({
    "concatenate", "pad", "dynamic_update_slice", "select_n", "max", "min", "neg", "abs",
    "sign", "eq", "ne", "lt", "le", "gt", "ge", "is_finite", "stop_gradient", "clamp", "floor",
    "ceil", "round", "copy", "copy_p", "iota", "scatter", "sort", "reduce_and", "reduce_or",
    "not", "and", "or", "xor", "squeeze", "expand_dims", "device_put", "zeros_like",
    "broadcast_in_dim", "reduce_precision", "random_bits", "random_wrap", "random_unwrap",
    "random_seed", "threefry2x32", "convert_element_type",
})


def _low(dtypes) -> bool:
    return any(d in _LOW for d in dtypes)


def _dt(name: Any) -> str:
    return np.dtype(name).name


# ---------------------------------------------------------------------------------------------
# Module information, recorded while autocast traces the function
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Module:
    path: str  # name-stack style: "GPT/blocks/attn"
    cls: type
    compute: str  # the compute dtype autocast's rules give this module
    output: str
    matched: bool  # a rule (built-in or user) chose its policy; False: inherited/default


class _Recorder:
    """A linen method interceptor that learns every module's path, class and policy."""

    def __init__(self, rules: ModuleRules):
        self.rules = rules
        self.modules: dict[str, _Module] = {}
        self.order: list[str] = []  # module paths in order of completion
        self.stack: list[tuple[nn.Module, jmp.Policy, str]] = []

    def interceptor(self, next_fun, args, kwargs, context):
        module = context.module
        if self.stack and self.stack[-1][0] is module:
            return next_fun(*args, **kwargs)
        policy, _ = self.rules.match(module)
        matched = policy is not None
        if policy is None:
            policy = self.stack[-1][1] if self.stack else self.rules.default
        if not module.path:
            path = type(module).__name__
        else:
            root = self.stack[0][2].split("/")[0] if self.stack else "?"
            path = "/".join([root, *(str(p) for p in module.path)])
        if path not in self.modules:
            self.modules[path] = _Module(path, type(module), _dt(policy.compute_dtype),
                                         _dt(policy.output_dtype), matched)
        self.stack.append((module, policy, path))
        try:
            return next_fun(*args, **kwargs)
        finally:
            self.stack.pop()
            self.order.append(path)


# ---------------------------------------------------------------------------------------------
# Walking the jaxpr
# ---------------------------------------------------------------------------------------------


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
    return "/".join(parts) or _TOP, backward


def _float_dtypes(vs) -> list[str]:
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


def _dce(jaxpr: jcore.Jaxpr) -> tuple[jcore.Jaxpr, list[bool]]:
    """The jaxpr without dead equations, and which inputs it still uses."""
    if _pe is not None:
        try:
            new, used = _pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
            return new, list(used)
        except Exception:  # pragma: no cover - internal API moved
            pass
    return jaxpr, [True] * len(jaxpr.invars)


def _sub_io(eqn) -> list[tuple[jcore.Jaxpr, list, list]]:
    """(sub-jaxpr, outer operand for each of its inputs, outer result for each of its outputs)
    for the sub-programs of an equation; ``None`` where the correspondence is unknown."""
    name = eqn.primitive.name
    p = eqn.params
    ins, outs = list(eqn.invars), list(eqn.outvars)
    subs = [_as_jaxpr(s) for s in jcore.jaxprs_in_params(p)]
    if not subs:
        return []
    if name not in _CONTAINERS and not any(len(s.invars) == len(ins) for s in subs):
        return []  # e.g. scatter-add's combiner: the equation itself is the operation
    if name == "cond":
        return [(_as_jaxpr(b), ins[1:], outs) for b in p["branches"]]
    if name == "while":
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        carry = ins[cn + bn:]
        return [(_as_jaxpr(p["cond_jaxpr"]), ins[:cn] + carry, [None]),
                (_as_jaxpr(p["body_jaxpr"]), ins[cn:cn + bn] + carry, outs)]
    found = []
    for sub in subs:
        sin = ins if len(sub.invars) == len(ins) else [None] * len(sub.invars)
        sout = outs if len(sub.outvars) == len(outs) else [None] * len(sub.outvars)
        found.append((sub, sin, sout))
    return found


_CONTAINERS = frozenset({
    "pjit", "jit", "closed_call", "core_call", "remat", "remat2", "checkpoint",
    "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "scan", "while", "cond",
    "shard_map", "xla_call", "xla_pmap", "custom_lin"})


def _as_jaxpr(j) -> jcore.Jaxpr:
    return j.jaxpr if isinstance(j, jcore.ClosedJaxpr) else j


@dataclasses.dataclass
class _Eqn:
    """One equation as the audit sees it."""

    eqn: Any
    stack: str  # the raw name stack
    module: str  # the cleaned module path (as in the rows)
    key: str  # the module it belongs to in the recorder's table ("" if none)
    op: str
    backward: bool
    in_dtypes: list[str]
    out_dtypes: list[str]
    param_operand: bool  # an operand comes (unchanged but for casts/reshapes) from the params
    count_sum: bool  # a sum of 0/1 indicators converted from booleans (an exact count)

    @property
    def prim(self) -> str:
        return self.eqn.primitive.name

    @property
    def dtypes(self) -> set[str]:
        return set(self.in_dtypes) | set(self.out_dtypes)

    @property
    def rounds(self) -> bool:
        return self.prim not in _EXACT and bool(self.dtypes)


_PASS_THROUGH = frozenset({"convert_element_type", "reshape", "broadcast_in_dim", "transpose",
                           "squeeze", "expand_dims", "slice", "dynamic_slice", "gather", "copy",
                           "copy_p", "split", "concatenate", "rev"})


def _collect(jaxpr: jcore.Jaxpr, param_inputs: Sequence[bool]) -> list[_Eqn]:
    """Every equation (sub-programs inlined, execution order) with its module path, pass and
    whether a matmul operand is a parameter."""
    records: list[_Eqn] = []

    def run(j: jcore.Jaxpr, prefix: str, flags: dict) -> None:
        producer: dict = {}
        for eqn in j.eqns:
            stack = str(eqn.source_info.name_stack)
            full = f"{prefix}/{stack}" if prefix and stack else (prefix or stack)
            subs = _sub_io(eqn)
            if subs:
                out_flags = [False] * len(eqn.outvars)
                for sub, sin, sout in subs:
                    inner = {v: bool(o is not None and isinstance(o, jcore.Var)
                                     and flags.get(o, False)) for v, o in zip(sub.invars, sin)}
                    run(sub, full, inner)
                    for v, o in zip(sub.outvars, sout):
                        if o is not None and isinstance(v, jcore.Var) and inner.get(v, False):
                            idx = eqn.outvars.index(o) if o in eqn.outvars else None
                            if idx is not None:
                                out_flags[idx] = True
                for o, f in zip(eqn.outvars, out_flags):
                    flags[o] = f
                continue
            if _SCAFFOLD in full:
                continue
            module, backward = _clean_path(full)
            name = eqn.primitive.name
            ins = [v for v in eqn.invars]
            pflags = [isinstance(v, jcore.Var) and flags.get(v, False) for v in ins]
            if name in _PASS_THROUGH and any(pflags):
                for o in eqn.outvars:
                    flags[o] = True
            count = False
            if name in _ACCUM and isinstance(ins[0], jcore.Var) and ins[0] in producer:
                src = producer[ins[0]]
                count = (src.primitive.name == "convert_element_type"
                         and not _float_dtypes(src.invars))
            for o in eqn.outvars:
                producer[o] = eqn
            records.append(_Eqn(eqn, full, module, "", _OP_CLASSES.get(name, "elementwise"),
                                backward, _float_dtypes(ins), _float_dtypes(eqn.outvars),
                                name in _MATMUL and any(pflags), count))

    run(jaxpr, "", {v: bool(f) for v, f in zip(jaxpr.invars, param_inputs)})
    return records


def _module_key(path: str, modules: dict[str, _Module]) -> str:
    """The recorded module a cleaned name-stack path belongs to ("" if none).

    Handles method suffixes (``GPT/embed.attend`` -> ``GPT/embed``) and equations that a
    transformation hoisted out of a ``scan`` body, whose name stack lost the enclosing modules
    (``blocks/ln1`` -> ``GPT/blocks/ln1``)."""
    if path == _TOP or not modules:
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


def _canonical_path(path: str, modules: dict[str, _Module]) -> str:
    """``path`` with a hoisted scan prefix restored (``blocks/ln1`` -> ``GPT/blocks/ln1``)."""
    if path == _TOP or not modules or path in modules:
        return path
    head, dot, method = path.partition(".")
    if head in modules:
        return path
    tails = [m for m in modules if m.endswith("/" + head)]
    if tails:
        return min(tails, key=len) + dot + method
    return path


# ---------------------------------------------------------------------------------------------
# Tracing
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Trace:
    records: list[_Eqn]
    jaxpr: jcore.Jaxpr
    modules: dict[str, _Module]
    order: list[str]
    out_dtypes: list[str]
    out_scalar: bool
    policy: jmp.Policy
    grad: bool


def _n_leaves(tree) -> int:
    return len(jax.tree_util.tree_leaves(tree))


def _has_float(tree) -> bool:
    return any(jnp.issubdtype(np.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype,
                              jnp.floating) for x in jax.tree_util.tree_leaves(tree))


def _trace(fn: Callable, args: Sequence[Any], *, policy, overrides, op_rules: OpRules,
           argnums: int | None) -> _Trace:
    pol = get_policy(policy)
    rules = ModuleRules.create(pol, overrides)
    recorder = _Recorder(rules)

    def recorded(*a):
        with nn.intercept_methods(recorder.interceptor):
            return fn(*a)

    amp = autocast(recorded, pol, overrides=overrides, op_rules=op_rules)
    grad = argnums is not None and _has_float(args[argnums])

    if grad:
        def scalar(*a):
            out = amp(*a)
            with jax.named_scope(_SCAFFOLD):
                outs = [o for o in jax.tree.leaves(out) if jnp.issubdtype(o.dtype, jnp.floating)]
                total = sum(jnp.sum(o.astype(jnp.float32)) for o in outs)
            return total, out

        closed, out_shape = jax.make_jaxpr(
            jax.value_and_grad(scalar, argnums=argnums, has_aux=True),
            return_shape=True)(*args)
        out_shape = out_shape[0][1]
        before = sum(_n_leaves(a) for a in args[:argnums])
        param_inputs = [before <= i < before + _n_leaves(args[argnums])
                        for i in range(len(closed.jaxpr.invars))]
    else:
        closed, out_shape = jax.make_jaxpr(amp, return_shape=True)(*args)
        param_inputs = [False] * len(closed.jaxpr.invars)
    jaxpr, used = _dce(closed.jaxpr)
    param_inputs = [f for f, u in zip(param_inputs, used) if u]
    records = _collect(jaxpr, param_inputs)
    for r in records:
        r.module = _canonical_path(r.module, recorder.modules)
        r.key = _module_key(r.module, recorder.modules)
    leaves = jax.tree.leaves(out_shape)
    out_dtypes = sorted({np.dtype(o.dtype).name for o in leaves})
    scalar_out = len(leaves) == 1 and tuple(leaves[0].shape) == ()
    return _Trace(records, jaxpr, recorder.modules, recorder.order, out_dtypes, scalar_out,
                  pol, grad)


def _rows(records: Sequence[_Eqn], out_dtypes: Sequence[str]) -> list[dict[str, str]]:
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


def precision_table(fn: Callable, *args: Any, policy: str | jmp.Policy = _DEFAULT_POLICY,
                    overrides: dict | None = None, argnums: int = 0,
                    op_rules: OpRules = DEFAULT_OP_RULES) -> list[dict[str, str]]:
    """Rows ``{"module", "op", "forward", "backward"}`` for ``fn`` run under ``policy``.

    Args:
      fn: a loss or forward function (its float outputs are summed for the backward pass).
      *args: example arguments; ``args[argnums]`` is what gradients are taken with respect to.
      policy, overrides, op_rules: as for :func:`jaxamp.autocast`.
      argnums: which argument the backward pass differentiates.

    Returns:
      One row per (module path, op class) with the float dtypes seen, comma-separated
      (``"-"`` when the pass has no such op). The last row is the function's output. Op
      classes: ``matmul``, ``conv``, ``gather``, ``exp/log``, ``reduction``, ``rsqrt/sqrt``,
      ``cast``, ``elementwise`` (everything else), ``output``.
    """
    t = _trace(fn, args, policy=policy, overrides=overrides, op_rules=op_rules, argnums=argnums)
    return _rows(t.records, t.out_dtypes)


def format_precision_table(rows: list[dict[str, str]]) -> str:
    """The rows as a Markdown table."""
    lines = ["| module | op | forward | backward |", "|---|---|---|---|"]
    lines += [f"| {r['module']} | {r['op']} | {r['forward']} | {r['backward']} |" for r in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Classifying modules
# ---------------------------------------------------------------------------------------------

_NORM_NAME = re.compile(r"(^|_)(ln|norm|layer_?norm|rms_?norm|group_?norm|bn)(_?\d+)?$|norm",
                        re.I)
_EMBED_NAME = re.compile(r"embed|wte|tok_?emb|word_?emb", re.I)
_ATTN_NAME = re.compile(r"attn|attention|mha", re.I)
_QKV_NAME = re.compile(r"^(q|k|v|qk|kv|qkv|query|key|value|wq|wk|wv|wqkv|c_attn|in_proj|"
                       r"query_key_value|to_q|to_k|to_v|to_qkv)(_proj)?(_\d+)?$", re.I)
_FFN_NAME = re.compile(r"mlp|ffn|feed_?forward|^fc\d*(_\d+)?$|^c_fc$|^wi(_\d+)?$|^wo$|^w[123]$|"
                       r"^(up|down|gate)_proj$|^dense_\d+$|^intermediate$", re.I)


def _last(path: str) -> str:
    return path.rsplit("/", 1)[-1].split(".")[0]


def _is_norm(key: str, modules: dict[str, _Module]) -> bool:
    if not key:
        return False
    m = modules.get(key)
    if m is not None and (issubclass(m.cls, FP32_MODULES) or "Norm" in m.cls.__name__):
        return True
    return m is None and bool(_NORM_NAME.search(_last(key)))


def _is_embed(key: str, modules: dict[str, _Module]) -> bool:
    if not key:
        return False
    m = modules.get(key)
    if m is not None and (issubclass(m.cls, EMBED_MODULES) or "Embed" in m.cls.__name__):
        return True
    return m is None and bool(_EMBED_NAME.search(_last(key)))


def _is_attention(key: str, modules: dict[str, _Module]) -> bool:
    if not key:
        return False
    m = modules.get(key)
    if m is not None and "Attention" in m.cls.__name__:
        return True
    return bool(_ATTN_NAME.search(_last(key)))


def _in_attention(key: str, modules) -> bool:
    segs = key.split("/")
    return any(_is_attention("/".join(segs[:i]), modules) for i in range(1, len(segs) + 1))


def _is_qkv(key: str) -> bool:
    return bool(key) and bool(_QKV_NAME.match(_last(key)))


def _is_ffn(key: str, modules) -> bool:
    if not key or _in_attention(key, modules):
        return False
    return any(_FFN_NAME.search(seg.split(".")[0]) for seg in key.split("/")[1:])


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Finding:
    """One problem the audit found.

    Attributes:
      kind: a stable identifier (see the module docstring), e.g. ``softmax_low_precision``.
      module: the module path it concerns (``"(top level)"`` outside modules, ``"(params)"``,
        ``"(opt_state)"`` or ``"(train step)"`` for non-module findings).
      detail: a plain-English explanation with the likely fix.
      seed_row: the seed §4 table row it concerns, if any (e.g. ``"LayerNorm"``).
    """

    kind: str
    module: str
    detail: str
    seed_row: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SEED_ROWS = ("Embedding lookup", "Q/K/V Linear", "Attention scores", "Softmax", "LayerNorm",
              "FFN Linear", "CrossEntropy loss", "Parameter update")
_SEED_NOTES = {
    "Embedding lookup": "the lookup computes nothing; its output is cast to the compute dtype",
    "Q/K/V Linear": "main Tensor Core work",
    "Attention scores": "cast to float32 before the softmax",
    "Softmax": "overflow-sensitive",
    "LayerNorm": "mean/variance need float32",
    "FFN Linear": "largest gain",
    "CrossEntropy loss": "log-sum-exp needs float32",
    "Parameter update": "master weights always float32",
}


def _join(dtypes) -> str:
    return ",".join(sorted(set(dtypes))) or "-"


@dataclasses.dataclass
class AuditReport:
    """What :func:`audit` found.

    Attributes:
      rows: ``{"module", "op", "forward", "backward", "category"}`` per (module path, op
        class); the first four keys are exactly :func:`precision_table`'s. ``category`` is the
        coarse class: ``matmul``, ``softmax``, ``normalisation``, ``reduction``, ``loss``,
        ``elementwise``, ``gather``, ``cast`` or ``output``.
      findings: the :class:`Finding` s, most important first.
      policy: the default policy, as a string.
    """

    rows: list[dict[str, str]]
    findings: list[Finding]
    policy: str
    _trace: _Trace | None = dataclasses.field(default=None, repr=False)
    _param_dtypes: list[str] = dataclasses.field(default_factory=list, repr=False)
    _opt_dtypes: list[str] = dataclasses.field(default_factory=list, repr=False)

    @property
    def ok(self) -> bool:
        """True when there are no findings."""
        return not self.findings

    def kinds(self) -> set[str]:
        """The set of finding kinds."""
        return {f.kind for f in self.findings}

    # ---- the seed's §4 table -------------------------------------------------------------
    def seed_rows(self) -> list[dict[str, Any]]:
        """The seed's §4 reference table, reproduced from the traced program.

        Returns one dict per seed row, in the seed's order: ``row``, ``forward``, ``backward``
        (dtypes actually used), ``expected_forward``, ``expected_backward`` (the seed's, with
        the policy's compute dtype for FP16), ``ok`` (``True``/``False``, ``None`` when the
        model has no such part), ``modules`` (the module paths that make up the row) and
        ``note``.

        The mapping from module paths and op classes to rows is a heuristic for GPT-style
        models; it only counts equations that round (data movement, max/min, selections and
        casts are exact and left out):

        * **Embedding lookup**: the ``gather`` in an embedding module (``nn.Embed`` or a module
          named like ``embed``/``wte``); forward ``"<table dtype> -> <output dtype>"``, the
          output dtype being the dtype the gathered rows are cast to before their first use;
          backward: the dtype of the gradient arriving at the lookup's output (JAX gives a
          cotangent its primal's dtype). A tied output head (``embed.attend``) is not part of
          this row.
        * **Q/K/V Linear**: matmuls in modules named ``q``/``k``/``v``/``qkv``/``query``/
          ``key``/``value`` (also ``q_proj``, ``wq``, ``c_attn``, ``in_proj``, ...), and
          matmuls with a parameter operand written directly in an attention module.
        * **Attention scores**: matmuls in an attention module itself (class name containing
          ``Attention`` or a path segment like ``attn``/``attention``/``mha``), not in its
          Dense children, without a parameter operand (scores and weights @ V).
        * **Softmax**: exp/log and sums in an attention module itself; backward: its sums and
          exp/log (the softmax's backward reduction).
        * **LayerNorm**: every rounding op of normalisation modules (``nn.LayerNorm``,
          ``RMSNorm``, ``GroupNorm``, ``BatchNorm``, or a class with ``Norm`` in its name);
          the cast of the result to the compute dtype on the way out is not counted.
        * **FFN Linear**: matmuls in modules whose path has a segment like ``mlp``/``ffn``/
          ``fc``/``fc1``/``c_fc``/``w1``/``up_proj``/``Dense_<n>``, outside attention.
        * **CrossEntropy loss**: exp/log and sums outside every module (the loss function);
          backward: every rounding op outside modules.
        * **Parameter update**: the dtypes of the parameters (``args[argnums]``) and of
          ``opt_state`` if given; forward ``-``.
        """
        t = self._trace
        if t is None:
            return []
        mods = t.modules
        low = _dt(t.policy.compute_dtype)
        recs = [r for r in t.records if r.dtypes]
        groups: dict[str, dict[str, Any]] = {
            name: {"forward": set(), "backward": set(), "modules": set()} for name in _SEED_ROWS}

        def add(name, r, forward=True, backward=True):
            g = groups[name]
            if r.backward and backward:
                g["backward"] |= r.dtypes
            elif not r.backward and forward:
                g["forward"] |= r.dtypes
            else:
                return
            g["modules"].add(r.module)

        emb_fwd = None
        for r in recs:
            key, prim = r.key, r.prim
            if prim in _MATMUL:
                if _is_embed(key, mods):
                    continue  # a tied head: not a seed row
                if _is_qkv(key):
                    add("Q/K/V Linear", r)
                elif _is_attention(key, mods):
                    if r.backward:
                        add("Attention scores", r)
                    elif r.param_operand:
                        add("Q/K/V Linear", r)
                    else:
                        add("Attention scores", r)
                elif _is_ffn(key, mods):
                    add("FFN Linear", r)
                continue
            if _is_norm(key, mods):
                if r.rounds:
                    add("LayerNorm", r)
                continue
            if prim == "gather" and _is_embed(key, mods) and not r.backward:
                table = r.in_dtypes[:1]
                out = _use_dtype(r, t.jaxpr) or (r.out_dtypes[0] if r.out_dtypes else None)
                emb_fwd = (table[0] if table else "-", out)
                groups["Embedding lookup"]["modules"].add(r.module)
                continue
            sensitive = prim in _EXPLOG or (prim in _ACCUM and not r.count_sum)
            if not key and r.module == _TOP:
                if (not r.backward and sensitive) or (r.backward and r.rounds):
                    add("CrossEntropy loss", r)
                continue
            if _is_attention(key, mods) and sensitive:
                add("Softmax", r)
        rows = []
        for name in _SEED_ROWS:
            g = groups[name]
            if name == "Embedding lookup":
                if emb_fwd is None:
                    fwd = bwd = "-"
                else:
                    fwd = f"{emb_fwd[0]} -> {emb_fwd[1]}"
                    bwd = emb_fwd[1] if t.grad else "-"
                exp_f, exp_b = f"float32 -> {low}", low
            elif name == "Parameter update":
                fwd = "-"
                bwd = _join(self._param_dtypes + self._opt_dtypes)
                exp_f, exp_b = "-", "float32"
            else:
                fwd, bwd = _join(g["forward"]), _join(g["backward"])
                compute = name in ("Q/K/V Linear", "Attention scores", "FFN Linear")
                exp_f = exp_b = low if compute else "float32"
            if not t.grad and name != "Parameter update":
                exp_b = "-"
            present = fwd != "-" or (name == "Parameter update" and bwd != "-")
            ok = None if not present else (fwd == exp_f and (bwd == exp_b or not t.grad
                                                            or exp_b == "-"))
            rows.append({"row": name, "forward": fwd, "backward": bwd,
                         "expected_forward": exp_f, "expected_backward": exp_b, "ok": ok,
                         "modules": sorted(g["modules"]), "note": _SEED_NOTES[name]})
        return rows

    # ---- output --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "rows": self.rows,
                "findings": [f.to_dict() for f in self.findings],
                "seed_rows": self.seed_rows()}

    def to_json(self, indent: int | None = 2) -> str:
        """The report (rows, findings, seed rows) as a JSON string."""
        return json.dumps(self.to_dict(), indent=indent)

    def to_markdown(self) -> str:
        """Findings, the seed table and the full precision table as Markdown."""
        out = [f"## Precision audit ({self.policy})", ""]
        if self.findings:
            out += ["### Findings", ""]
            out += [f"- **{f.kind}** `{f.module}`: {f.detail}" for f in self.findings]
        else:
            out.append("No findings.")
        seed = self.seed_rows()
        if seed:
            out += ["", "### Seed reference table (§4)", "",
                    "| module / op | forward | backward | expected | ok |", "|---|---|---|---|---|"]
            for r in seed:
                ok = {True: "yes", False: "**NO**", None: "n/a"}[r["ok"]]
                out.append(f"| {r['row']} | {r['forward']} | {r['backward']} | "
                           f"{r['expected_forward']} / {r['expected_backward']} | {ok} |")
        out += ["", "### Precision table", "", format_precision_table(self.rows)]
        return "\n".join(out)

    def print(self, console=None) -> None:
        """Prints the findings and tables with rich."""
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table

        console = console or Console()
        seed = self.seed_rows()
        if seed:
            t = Table(title=f"seed reference table ({self.policy})", title_justify="left")
            for col in ("module / op", "forward", "backward", "expected", "ok"):
                t.add_column(col)
            for r in seed:
                ok = {True: "[green]ok[/green]", False: "[bold red]MISMATCH[/bold red]",
                      None: "[dim]n/a[/dim]"}[r["ok"]]
                t.add_row(r["row"], r["forward"], r["backward"],
                          f"{r['expected_forward']} / {r['expected_backward']}", ok)
            console.print(t)
        t = Table(title="precision table (casts and elementwise rows: see to_json())",
                  title_justify="left")
        for col in ("module", "op", "forward", "backward"):
            t.add_column(col)
        for r in self.rows:
            if r.get("category") in ("cast", "elementwise"):
                continue
            style = "red" if _low(r["forward"].split(",") + r["backward"].split(",")) and \
                r.get("category") in ("softmax", "normalisation", "loss", "reduction") else None
            t.add_row(escape(r["module"]), r["op"], r["forward"], r["backward"], style=style)
        console.print(t)
        if not self.findings:
            console.print("[green]no findings[/green]")
        for f in self.findings:
            console.print(f"[bold red]{f.kind}[/bold red] [cyan]{escape(f.module)}[/cyan]: "
                          f"{escape(f.detail)}")


def _use_dtype(rec: _Eqn, jaxpr: jcore.Jaxpr) -> str | None:
    """The dtype a gathered value is cast to before its first arithmetic use (following
    reshapes and other data movement), or None if it is used as is."""
    for j in _iter_jaxprs(jaxpr):
        if rec.eqn in j.eqns:
            break
    else:
        return None
    consumers: dict = {}
    for e in j.eqns:
        for v in e.invars:
            if isinstance(v, jcore.Var):
                consumers.setdefault(v, []).append(e)
    frontier = list(rec.eqn.outvars)
    seen = set()
    while frontier:
        v = frontier.pop()
        if v in seen:
            continue
        seen.add(v)
        for e in consumers.get(v, []):
            name = e.primitive.name
            if name == "convert_element_type":
                return _dt(e.params["new_dtype"])
            if name in _PASS_THROUGH:
                frontier.extend(e.outvars)
    return None


def _iter_jaxprs(j: jcore.Jaxpr) -> Iterator[jcore.Jaxpr]:
    yield j
    for eqn in j.eqns:
        for sub in jcore.jaxprs_in_params(eqn.params):
            yield from _iter_jaxprs(_as_jaxpr(sub))


def _category(module: str, op: str, key: str, modules, has_explog: set[str],
              scalar_out: bool) -> str:
    if op in ("matmul", "conv"):
        return "matmul"
    if op in ("cast", "gather", "output"):
        return op
    if _is_norm(key, modules):
        return "normalisation"
    if op == "exp/log" or (op == "reduction" and module in has_explog):
        if module == _TOP and scalar_out:
            return "loss"
        return "softmax"
    if op == "reduction":
        return "loss" if module == _TOP and scalar_out else "reduction"
    return "elementwise"


def _low_leaves(tree) -> list[tuple[str, str]]:
    out = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        dtype = getattr(leaf, "dtype", None)
        if dtype is None:
            continue
        try:
            name = np.dtype(dtype).name
        except TypeError:
            continue
        if name in _LOW:
            out.append((jax.tree_util.keystr(path), name))
    return out


def _float_leaf_dtypes(tree) -> list[str]:
    out = set()
    for leaf in jax.tree_util.tree_leaves(tree):
        dtype = getattr(leaf, "dtype", None)
        try:
            if dtype is not None and jnp.issubdtype(dtype, jnp.floating):
                out.add(np.dtype(dtype).name)
        except TypeError:
            pass
    return sorted(out)


def _group(findings: list[tuple[str, str, str, str | None]]) -> list[Finding]:
    """One Finding per (kind, module), merging details."""
    merged: dict[tuple[str, str], list] = {}
    for kind, module, detail, row in findings:
        entry = merged.setdefault((kind, module), [[], row])
        if detail not in entry[0]:
            entry[0].append(detail)
    return [Finding(k, m, " ".join(d), row) for (k, m), (d, row) in merged.items()]


def _pass(r: _Eqn) -> str:
    return "backward" if r.backward else "forward"


def _prims(recs: Sequence[_Eqn]) -> str:
    parts = sorted({f"{r.prim} ({_pass(r)}, {_join(r.dtypes)})" for r in recs})
    return ", ".join(parts[:6]) + (f" and {len(parts) - 6} more" if len(parts) > 6 else "")


def _findings(t: _Trace, param_low, opt_low) -> list[Finding]:
    mods = t.modules
    low_default = _dt(t.policy.compute_dtype) in _LOW
    raw: list[tuple[str, str, str, str | None]] = []
    by_kind: dict[tuple[str, str], list[_Eqn]] = {}
    for r in t.records:
        if not r.dtypes:
            continue
        prim = r.prim
        if prim in _MATMUL:
            compute = mods[r.key].compute if r.key in mods else _dt(t.policy.compute_dtype)
            if (compute in _LOW or (not r.key and low_default)) and "float32" in r.in_dtypes:
                by_kind.setdefault(("matmul_f32_in_low_precision_region", r.module),
                                   []).append(r)
            continue
        if not _low(r.dtypes) or not r.rounds:
            continue
        sensitive = prim in _EXPLOG or (prim in _ACCUM and not r.count_sum)
        if _is_norm(r.key, mods):
            by_kind.setdefault(("normalisation_low_precision", r.module), []).append(r)
        elif not r.key and r.module == _TOP:
            if sensitive:
                by_kind.setdefault(("loss_low_precision", r.module), []).append(r)
        elif prim in _EXPLOG:
            by_kind.setdefault(("softmax_low_precision", r.module), []).append(r)
        elif sensitive:
            by_kind.setdefault(("reduction_low_precision", r.module), []).append(r)
    # sums inside a module whose exp/log ran in low precision belong to the softmax finding
    soft = {m for (k, m) in by_kind if k == "softmax_low_precision"}
    for (k, m) in list(by_kind):
        if k == "reduction_low_precision" and m in soft:
            by_kind[("softmax_low_precision", m)] += by_kind.pop((k, m))
    explain = {
        "matmul_f32_in_low_precision_region": (
            "matmul(s) ran in float32 although this module's policy computes in {low}: {ops}. "
            "Usually a jax.custom_vjp function (autocast runs those exactly as traced, in "
            "float32) or another operation autocast does not rewrite: write it without "
            "custom_vjp, cast its inputs to the compute dtype inside it, or give the module a "
            "float32 rule in overrides= if float32 is intended.", None),
        "softmax_low_precision": (
            "softmax exp/log and its sums ran in low precision: {ops}. exp overflows float16 "
            "above ~11 and the normaliser loses small probabilities; keep exp/log/reduce_sum in "
            "the fp32 op list (jaxamp.DEFAULT_OP_RULES) and the module's compute dtype "
            "float16/bfloat16 only for its matmuls.", "Softmax"),
        "normalisation_low_precision": (
            "normalisation statistics ran in low precision: {ops}. Mean/variance need float32 "
            "(seed mistake 1: a global .half() overflows LayerNorm); drop the override that "
            "sets this norm to a low-precision compute dtype.", "LayerNorm"),
        "loss_low_precision": (
            "the loss (outside all modules) ran in low precision: {ops}. log-sum-exp needs "
            "float32: compute the loss on float32 logits (jaxamp.softmax_cross_entropy) and "
            "keep exp/log/reduce_sum in the fp32 op list.", "CrossEntropy loss"),
        "reduction_low_precision": (
            "accumulating reduction(s) ran in low precision: {ops}. Sums of many float16 "
            "values lose precision and overflow; keep reduce_sum/cumsum in the fp32 op list.",
            None),
    }
    for (kind, module), recs in by_kind.items():
        text, row = explain[kind]
        if kind == "matmul_f32_in_low_precision_region":
            compute = mods[recs[0].key].compute if recs[0].key in mods else \
                _dt(t.policy.compute_dtype)
            text = text.replace("{low}", compute)
        raw.append((kind, module, text.replace("{ops}", _prims(recs)), row))
    if t.out_scalar and _low(t.out_dtypes):
        raw.append(("loss_low_precision", "(output)",
                    f"the function returns a scalar (a loss?) in {_join(t.out_dtypes)}: use "
                    "output=float32 in the policy so the loss (and its scaling) is float32.",
                    "CrossEntropy loss"))
    by_eqn = {id(r.eqn): r for r in t.records}
    for e in lossy_round_trips(t.jaxpr):
        r = by_eqn.get(id(e))
        if r is None or r.backward:
            continue
        raw.append(("lossy_round_trip", r.module,
                    "a float32 value is cast to low precision and straight back to float32: the "
                    "low-precision copy only throws mantissa bits away. Usually a manual "
                    ".astype() in the model fighting autocast (seed mistake 2); remove it.",
                    None))
    for _, b in duplicate_casts(t.jaxpr):
        r = by_eqn.get(id(b))
        if r is None or r.backward:
            # backward duplicates come from JAX transposing two casts whose cotangents are
            # the same value (e.g. embedding + positional embedding); XLA's CSE merges them
            continue
        raw.append(("duplicate_cast", r.module,
                    f"the same value is cast to {_dt(b.params['new_dtype'])} twice "
                    f"({_pass(r)}); the second cast is redundant work (seed §3: cast "
                    "elimination).", None))
    if param_low:
        names = ", ".join(f"{p} ({d})" for p, d in param_low[:4])
        more = f" and {len(param_low) - 4} more" if len(param_low) > 4 else ""
        raw.append(("params_low_precision", "(params)",
                    f"{len(param_low)} parameter leaves are stored in low precision: "
                    f"{names}{more}. A model cast wholesale (.astype(jnp.float16)) loses "
                    "small updates (lr * grad below half an ulp of the weight rounds away) and "
                    "runs LayerNorm/softmax from float16 weights. Keep float32 master weights "
                    "(params=float32 in the policy) and let autocast cast per use.",
                    "Parameter update"))
    if opt_low:
        names = ", ".join(f"{p} ({d})" for p, d in opt_low[:4])
        more = f" and {len(opt_low) - 4} more" if len(opt_low) > 4 else ""
        raw.append(("opt_state_low_precision", "(opt_state)",
                    f"{len(opt_low)} optimizer-state leaves are in low precision: {names}"
                    f"{more}. Adam's second moment (grad**2) underflows float16 and its "
                    "updates round away; keep the optimizer state float32 (create it from "
                    "float32 params).", "Parameter update"))
    order = ["params_low_precision", "opt_state_low_precision", "loss_low_precision",
             "normalisation_low_precision", "softmax_low_precision", "reduction_low_precision",
             "matmul_f32_in_low_precision_region", "lossy_round_trip", "duplicate_cast"]
    found = _group(raw)
    found.sort(key=lambda f: (order.index(f.kind) if f.kind in order else len(order),
                              f.module))
    return found


def audit(fn: Callable, *args: Any, policy: str | jmp.Policy = _DEFAULT_POLICY,
          overrides: dict | None = None, op_rules: OpRules = DEFAULT_OP_RULES,
          argnums: int | None = 0, opt_state: Any = None) -> AuditReport:
    """Audits ``fn`` run under ``jaxamp.autocast``: the dtypes every module and op class used
    (forward and backward) and the precision mistakes of the seed's review checklist.

    ``fn`` is traced (never compiled or run) under ``autocast(fn, policy, overrides=...,
    op_rules=...)``; if ``args[argnums]`` has float leaves, ``jax.value_and_grad`` of the sum of
    its float outputs is traced too, so the backward pass is audited. Module policies are
    recomputed with autocast's own rules from ``policy`` and ``overrides``, so a float32 matmul
    is flagged only where its module was meant to compute in float16/bfloat16.

    Args:
      fn: a forward (``model.apply``), a loss, or any JAX function (unmodified user code).
      *args: example arguments (arrays or ``jax.ShapeDtypeStruct`` s).
      policy, overrides, op_rules: as for :func:`jaxamp.autocast`.
      argnums: the argument holding the parameters (differentiated, and checked for
        low-precision storage); ``None``: forward only.
      opt_state: optional optimizer state, checked for float16/bfloat16 leaves.

    Returns:
      An :class:`AuditReport`: ``.rows``, ``.findings``, ``.seed_rows()``, ``.to_json()``,
      ``.to_markdown()``, ``.print()``.

    Example:
      >>> report = jaxamp.audit(loss_fn, params, batch, policy="p=f32,c=f16,o=f32")
      >>> [f.kind for f in report.findings]
      []
    """
    t = _trace(fn, args, policy=policy, overrides=overrides, op_rules=op_rules,
               argnums=argnums)
    rows = _rows(t.records, t.out_dtypes)
    explog = {r.module for r in t.records if r.op == "exp/log"}
    keys = {r.module: r.key for r in t.records}
    for row in rows:
        if row["op"] == "output":
            row["category"] = "output"
            continue
        row["category"] = _category(row["module"], row["op"], keys.get(row["module"], ""),
                                    t.modules, explog, t.out_scalar)
    params = args[argnums] if argnums is not None else None
    param_low = _low_leaves(params) if params is not None else []
    opt_low = _low_leaves(opt_state) if opt_state is not None else []
    findings = _findings(t, param_low, opt_low)
    return AuditReport(rows, findings, policy_to_str(t.policy), t,
                       _float_leaf_dtypes(params) if params is not None else [],
                       _float_leaf_dtypes(opt_state) if opt_state is not None else [])


# ---------------------------------------------------------------------------------------------
# A whole train step: the order of unscaling and clipping
# ---------------------------------------------------------------------------------------------


class _Graph:
    """Data dependencies between the variables of a jaxpr and all its sub-jaxprs."""

    def __init__(self, jaxpr: jcore.Jaxpr):
        self.preds: dict = {}
        self.producer: dict = {}
        self.consumers: dict = {}
        self.eqns: list[tuple[Any, str]] = []
        self._build(jaxpr, "")

    def _edge(self, dst, srcs):
        self.preds.setdefault(dst, []).extend(s for s in srcs if isinstance(s, jcore.Var))

    def _build(self, j: jcore.Jaxpr, prefix: str):
        for eqn in j.eqns:
            stack = str(eqn.source_info.name_stack)
            full = f"{prefix}/{stack}" if prefix and stack else (prefix or stack)
            subs = _sub_io(eqn)
            if subs:
                mapped = True
                for sub, sin, sout in subs:
                    for v, o in zip(sub.invars, sin):
                        if o is None:
                            mapped = False
                            self._edge(v, eqn.invars)
                        else:
                            self._edge(v, [o])
                    for v, o in zip(sub.outvars, sout):
                        if o is not None:
                            self._edge(o, [v])
                    if eqn.primitive.name in ("scan", "while"):  # loop-carried values
                        nc = eqn.params.get("num_carry", 0) if eqn.primitive.name == "scan" \
                            else len(sub.outvars)
                        first = (eqn.params["num_consts"] if eqn.primitive.name == "scan"
                                 else len(sub.invars) - len(sub.outvars))
                        for k in range(nc):
                            if first + k < len(sub.invars) and k < len(sub.outvars):
                                self._edge(sub.invars[first + k], [sub.outvars[k]])
                    self._build(sub, full)
                if not mapped or any(o is None for _, _, so in subs for o in so):
                    for o in eqn.outvars:
                        self._edge(o, eqn.invars)
                continue
            self.eqns.append((eqn, full))
            for o in eqn.outvars:
                self._edge(o, eqn.invars)
                self.producer[o] = eqn
            for v in eqn.invars:
                if isinstance(v, jcore.Var):
                    self.consumers.setdefault(v, []).append(eqn)

    def ancestors(self, roots) -> set:
        seen: set = set()
        stack = [r for r in roots if isinstance(r, jcore.Var)]
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            stack.extend(self.preds.get(v, []))
        return seen


def _shape(v) -> tuple:
    return tuple(getattr(getattr(v, "aval", None), "shape", ()) or ())


def _is_float_var(v) -> bool:
    return bool(_float_dtypes([v]))


def _scalar_key(v):
    """A hashable identity for a scalar operand: the Var, or ('lit', value) for a literal."""
    if isinstance(v, jcore.Literal):
        try:
            return ("lit", float(np.asarray(v.val)))
        except (TypeError, ValueError):
            return None
    return v


def _clip_findings(jaxpr: jcore.Jaxpr) -> list[Finding]:
    g = _Graph(jaxpr)
    # 1. global norms: scalar sqrt of a sum
    norms = []
    for eqn, stack in g.eqns:
        if eqn.primitive.name == "sqrt" and _shape(eqn.outvars[0]) == () \
                and _is_float_var(eqn.outvars[0]):
            anc = g.ancestors(eqn.invars)
            if any(g.producer.get(v) is not None and g.producer[v].primitive.name == "reduce_sum"
                   for v in anc):
                norms.append((eqn, stack, anc))
    if not norms:
        return []
    norm_desc: set = set()  # everything computed from a norm (clip factors)
    norm_outs = {n.outvars[0] for n, _, _ in norms}
    for v in list(g.preds):
        if g.ancestors([v]) & norm_outs:
            norm_desc.add(v)
    norm_desc |= norm_outs

    # 2. loss-scale candidates: scalars multiplied with another scalar (the loss, or the
    # cotangent seed) that also divide non-scalar values (directly or via a reciprocal)
    scalar_mul: set = set()
    for eqn, _ in g.eqns:
        if eqn.primitive.name == "mul" and len(eqn.invars) == 2 and \
                all(_shape(v) == () for v in eqn.invars):
            for a in eqn.invars:
                key = _scalar_key(a)
                if key is not None and key not in (("lit", 1.0), ("lit", 0.0)) and \
                        not (isinstance(a, jcore.Var) and a in norm_desc):
                    scalar_mul.add(key)

    def through(v):
        """Follow a scalar back through casts/copies/broadcasts to its source."""
        while isinstance(v, jcore.Var) and v in g.producer and \
                g.producer[v].primitive.name in ("convert_element_type", "copy", "copy_p",
                                                 "broadcast_in_dim", "reshape"):
            v = g.producer[v].invars[0]
        return v

    unscale: list[tuple[Any, Any]] = []  # (eqn, the tensor operand)
    for eqn, _ in g.eqns:
        name = eqn.primitive.name
        if name == "div" and len(eqn.invars) == 2:
            x, s = eqn.invars
            s = through(s)
            if _shape(x) != () and _shape(s) == () and _scalar_key(s) in scalar_mul:
                unscale.append((eqn, x))
        elif name == "mul" and len(eqn.invars) == 2:
            for x, r in (eqn.invars, eqn.invars[::-1]):
                r = through(r)
                if _shape(x) == () or _shape(r) != () or not isinstance(r, jcore.Var):
                    continue
                pe = g.producer.get(r)
                if pe is not None and pe.primitive.name == "div" and \
                        _shape(pe.invars[1]) == () and \
                        _scalar_key(through(pe.invars[1])) in scalar_mul:
                    unscale.append((eqn, x))
    if not unscale:
        return []
    unscaled_outs = {e.outvars[0] for e, _ in unscale}
    found = []
    for n, stack, anc in norms:
        if anc & unscaled_outs:
            continue  # the norm reads unscaled gradients: correct order
        module, _ = _clean_path(stack)
        later = [e for e, x in unscale if n.outvars[0] in g.ancestors([x])]
        if later:
            found.append(Finding(
                "clip_before_unscale", "(train step)",
                "a global gradient norm is computed from gradients still multiplied by the "
                "loss scale, and the gradients it clips are divided by the scale only "
                f"afterwards ({len(later)} unscale op(s) depend on that norm). Clipping "
                "scaled gradients shrinks the clip threshold by the scale and over-suppresses "
                "every update (seed §2 step 5, mistake 3). Unscale first "
                "(grads = loss_scale.unscale(grads)), then clip (optax.clip_by_global_norm), "
                "or use jaxamp.make_train_step(clip_norm=...)."))
        else:
            found.append(Finding(
                "grad_norm_of_scaled_grads", "(train step)",
                "a global norm (sqrt of a sum) is computed from gradients still multiplied by "
                "the loss scale and is not followed by their unscaling: a logged grad norm "
                "(or a clip) on scaled gradients is off by the scale factor. Compute it after "
                "loss_scale.unscale(grads)."))
    return _group([(f.kind, f.module, f.detail, None) for f in found])


def audit_step(step_fn: Callable, *args: Any, params: Any = None,
               opt_state: Any = None) -> AuditReport:
    """Audits a whole user-written train step (traced as is, e.g. ``step(state, batch)``):
    the order of loss-scale unscaling and gradient clipping, plus the precision table of the
    step and low-precision ``params=``/``opt_state=`` if given.

    The check (``clip_before_unscale``) is a dataflow heuristic on the step's jaxpr:

    1. a *global norm* is a scalar ``sqrt`` whose input is computed from a ``reduce_sum``
       (``optax.global_norm``, ``optax.clip_by_global_norm``, ``jnp.linalg.norm`` of a leaf);
    2. a *loss scale* is a scalar (a traced value, or a literal like ``1024.0``) that is both
       multiplied with another scalar (the loss, or the backward's cotangent seed) and divides
       a non-scalar value, directly (``g / scale``) or through a reciprocal
       (``g * (1 / scale)``, as ``jaxamp`` loss scales do); values derived from a global norm
       are never taken for a loss scale (they are clip factors);
    3. a norm whose inputs include no unscaled value, while some unscaling is computed from
       that norm, is ``clip_before_unscale``; a norm of scaled gradients that no unscaling
       depends on is ``grad_norm_of_scaled_grads`` (e.g. a logged grad norm off by the scale).

    What it cannot detect: a loss scale that is never divided back out (nothing to pair the
    scaling with), an unscale written as a multiplication by a precomputed reciprocal passed
    in as an input, clipping without a ``sqrt`` (per-value ``clip_by_value``, or a norm
    compared squared), and steps whose clipping happens inside ``custom_vjp`` functions or
    host callbacks. It assumes no unrelated scalar both multiplies a scalar and divides
    tensors after the backward pass (a false positive would name a norm that is then divided
    by such a scalar).

    Args:
      step_fn: the train step; traced with ``jax.make_jaxpr`` (never run).
      *args: its example arguments.
      params, opt_state: optional trees checked for float16/bfloat16 storage.

    Returns:
      An :class:`AuditReport` (its ``seed_rows()`` is empty: module policies are unknown).
    """
    closed = jax.make_jaxpr(step_fn)(*args)
    jaxpr, _ = _dce(closed.jaxpr)
    records = _collect(jaxpr, [False] * len(jaxpr.invars))
    out_dtypes = sorted({n for n in _float_dtypes(jaxpr.outvars)})
    rows = _rows(records, out_dtypes)
    for row in rows:
        row["category"] = {"matmul": "matmul", "conv": "matmul", "cast": "cast",
                           "gather": "gather", "output": "output",
                           "reduction": "reduction"}.get(row["op"], "elementwise")
    findings = _clip_findings(jaxpr)
    raw = []
    if params is not None and _low_leaves(params):
        pl = _low_leaves(params)
        raw.append(Finding("params_low_precision", "(params)",
                           f"{len(pl)} parameter leaves are stored in low precision (e.g. "
                           f"{pl[0][0]}: {pl[0][1]}); keep float32 master weights.",
                           "Parameter update"))
    if opt_state is not None and _low_leaves(opt_state):
        ol = _low_leaves(opt_state)
        raw.append(Finding("opt_state_low_precision", "(opt_state)",
                           f"{len(ol)} optimizer-state leaves are in low precision (e.g. "
                           f"{ol[0][0]}: {ol[0][1]}); keep the optimizer state float32.",
                           "Parameter update"))
    return AuditReport(rows, raw + findings, "(train step)", None)
