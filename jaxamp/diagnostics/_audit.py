"""Precision audit: which dtype every part of a function actually ran in, and what looks wrong.

:func:`precision_table` and :func:`audit` read the traced program (the dtypes a GPU would run),
never compiled HLO; this module holds the findings of :func:`audit` (each kind, what it means
and why: docs/audit.md) and re-exports the public names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jmp
import numpy as np

from .._engine.compat import new_dtype
from .._engine.jaxpr import duplicate_casts, lossy_round_trips
from ..engine import float64_cause, float64_inputs
from ..policy import policy_to_str
from ..rules import OpRules
from ._reference import is_norm, norm_row
from ._report import (
    AuditReport,
    Finding,
    PrecisionTable,
    format_precision_table,
    group_findings,
    storage_findings,
    without_rounded_state,
)
from ._step import audit_step
from ._trace import (
    ACCUM,
    EXPLOG,
    LOW,
    TOP_LEVEL,
    Eqn,
    Trace,
    dtype_name,
    is_low,
    join_dtypes,
    loss_records,
    resolve_call,
    table_rows,
    trace_model,
)

__all__ = ["AuditReport", "Finding", "PrecisionTable", "audit", "audit_step",
           "format_precision_table", "precision_table"]


def precision_table(fn: Callable, *args: Any, policy: str | jmp.Policy | None = None,
                    overrides: dict | None = None, argnums: int = 0,
                    op_rules: OpRules | None = None) -> PrecisionTable:
    """Rows ``{"module", "op", "forward", "backward"}`` for ``fn`` run under ``policy``.

    Two call shapes:

    * ``precision_table(step, state, batch)``: ``step`` from :func:`jaxamp.make_train_step`;
      the table of the loss the step differentiates, as the step runs it (the state's policy,
      collections and dropout key, the step's ``overrides``/``op_rules``, ``train=`` as the
      loss_fn passes it).
    * ``precision_table(fn, *args, policy=..., overrides=...)``: any function.

    Args:
      fn: a step, or a loss or forward function (its float outputs are summed for the
        backward pass).
      *args: ``(state, batch)`` for a step, else example arguments; ``args[argnums]`` is what
        gradients are taken with respect to.
      policy, overrides, op_rules: as for :func:`jaxamp.autocast` (``None``: the defaults;
        with a step, the step's own and not allowed here).
      argnums: which argument the backward pass differentiates.

    Returns:
      A :class:`PrecisionTable`, a list of rows with ``.print()``, ``.to_json()`` and
      ``.to_markdown()``: one row per (module path, op class) with the float dtypes seen,
      comma-separated (``"-"`` when the pass has no such op). The last row is the function's
      output. Op classes: ``matmul``, ``conv``, ``gather``, ``exp/log``, ``reduction``
      (accumulating: sums, products), ``max/min`` (exact in any dtype), ``rsqrt/sqrt``,
      ``cast``, ``attention`` (cuDNN's fused attention: ``jax.nn.dot_product_attention``
      traced for a GPU; its inputs and outputs, softmax statistics in float32 included),
      ``elementwise`` (everything else), ``output``. Module paths are as
      ``overrides=`` takes them.
    """
    _, t = _traced("precision_table", fn, args, policy, overrides, op_rules, argnums)
    return PrecisionTable(table_rows(t.records, t.out_dtypes), policy_to_str(t.policy))


def _traced(where: str, fn, args, policy, overrides, op_rules, argnums):
    """``(call, trace)``: ``fn(*args)`` (or a step's loss) traced under its options."""
    call = resolve_call(where, fn, args, policy=policy, overrides=overrides, op_rules=op_rules)
    with call.context():
        return call, trace_model(call.fn, call.args, policy=call.policy,
                                 overrides=call.overrides, op_rules=call.op_rules,
                                 argnums=argnums if call.program is None else 0,
                                 f32_weight_grads=call.f32_weight_grads,
                                 scope=getattr(call.program, "fp8_scope", None))



def _category(module: str, op: str, key: str, modules, has_explog: set[str],
              scalar_out: bool) -> str:
    if op in ("matmul", "conv"):
        return "matmul"
    if op in ("cast", "gather", "output", "max/min", "attention"):
        return op
    if is_norm(key, modules):
        return "normalisation"
    if op == "exp/log" or (op == "reduction" and module in has_explog):
        if module == TOP_LEVEL and scalar_out:
            return "loss"
        return "softmax"
    if op == "reduction":
        return "loss" if module == TOP_LEVEL and scalar_out else "reduction"
    return "elementwise"


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


def _pass(r: Eqn) -> str:
    return "backward" if r.backward else "forward"


def _prims(recs: Sequence[Eqn]) -> str:
    parts = sorted({f"{r.prim} ({_pass(r)}, {join_dtypes(r.dtypes)})" for r in recs})
    return ", ".join(parts[:6]) + (f" and {len(parts) - 6} more" if len(parts) > 6 else "")


def _findings(t: Trace, params, opt_state, op_rules: OpRules | None = None,
              float64_names: Sequence[str] = ()) -> list[Finding]:
    """The findings of trace ``t``. What must be a matmul in the compute dtype and what must
    run in float32 comes from ``op_rules`` (default: the rules autocast ran ``t`` by, so the
    audit expects what autocast did); the softmax/sum/loss/normalisation findings are the
    seed's advice and hold under any rules. ``float64_names``: the float64 inputs of the
    audited call (:func:`jaxamp.engine.float64_inputs`), named by a float64 matmul finding."""
    rules = t.op_rules if op_rules is None else op_rules
    raw = _op_findings(t, _low_precision_ops(t, rules), float64_names)
    if t.out_scalar and is_low(t.out_dtypes):
        raw.append(("loss_low_precision", "(output)",
                    f"the function returns a scalar (a loss?) in {join_dtypes(t.out_dtypes)}: use "
                    "output=float32 in the policy so the loss (and its scaling) is float32.",
                    "CrossEntropy loss"))
    raw += _cast_findings(t)
    raw += storage_findings(params, opt_state)
    found = group_findings(raw)
    found.sort(key=lambda f: (_ORDER.index(f.kind) if f.kind in _ORDER else len(_ORDER),
                              f.module))
    return found


_ORDER = ["params_low_precision", "opt_state_low_precision", "loss_low_precision",
          "normalisation_low_precision", "softmax_low_precision", "reduction_low_precision",
          "matmul_f32_in_low_precision_region", "matmul_f64_in_low_precision_region",
          "lossy_round_trip", "duplicate_cast"]


def _low_precision_ops(t: Trace, rules: OpRules) -> dict[tuple[str, str], list[Eqn]]:
    """The records of ``t`` that ran in the wrong precision, by (finding kind, module)."""
    mods = t.modules
    low_default = dtype_name(t.policy.compute_dtype) in LOW
    by_kind: dict[tuple[str, str], list[Eqn]] = {}
    loss = loss_records(t.records, rules.matmul)
    for r in t.records:
        if not r.dtypes:
            continue
        kind = _matmul_kind(t, r, low_default) if r.prim in rules.matmul else \
            _op_kind(r, rules, mods, id(r) in loss)
        if kind is not None:
            by_kind.setdefault((kind, r.module), []).append(r)
    # sums inside a module whose exp/log ran in low precision belong to the softmax finding
    soft = {m for (k, m) in by_kind if k == "softmax_low_precision"}
    for (k, m) in list(by_kind):
        if k == "reduction_low_precision" and m in soft:
            by_kind[("softmax_low_precision", m)] += by_kind.pop((k, m))
    return by_kind


def _matmul_kind(t: Trace, r: Eqn, low_default: bool) -> str | None:
    """A float32 or float64 matmul in a region that computes in low precision."""
    mods = t.modules
    compute = mods[r.key].compute if r.key in mods else dtype_name(t.policy.compute_dtype)
    low = compute in LOW or (not r.key and low_default)
    if low and "float32" in r.in_dtypes:
        return "matmul_f32_in_low_precision_region"
    if low and "float64" in r.in_dtypes:
        return "matmul_f64_in_low_precision_region"
    return None


def _op_kind(r: Eqn, rules: OpRules, mods, in_loss: bool) -> str | None:
    """A rounding op that ran in low precision where it needs float32, by what it is."""
    prim = r.prim
    if not is_low(r.dtypes) or not r.rounds or r.bounded:
        return None
    sensitive = prim in EXPLOG or (prim in ACCUM and not r.count_sum)
    if is_norm(r.key, mods):
        return "normalisation_low_precision"
    if r.backward and prim in ACCUM and not r.param_grad:
        # an activation's cotangent summed in the dtype the forward value had (JAX's
        # transpose of a broadcast: jnp.repeat, a bias-like add), not an accumulation
        return None
    if in_loss:
        return "loss_low_precision" if sensitive else None
    if prim in EXPLOG:
        return "softmax_low_precision"
    if sensitive:
        return "reduction_low_precision"
    if prim in rules.fp32:
        return "fp32_op_low_precision"
    return None


#: The explanation (``{low}``: the region's compute dtype, ``{ops}``: the ops) and the
#: reference-table row of each kind of low-precision op finding.
_EXPLAIN = {
    "matmul_f32_in_low_precision_region": (
        "matmul(s) ran in float32 although this module's policy computes in {low}: {ops}. "
        "Usually a jax.custom_vjp function in op_rules.custom_vjp_as_traced (run exactly "
        "as traced, in float32) or another operation autocast does not rewrite (an unknown "
        "higher-order primitive): drop it from custom_vjp_as_traced, cast its inputs to "
        "the compute dtype inside it, or give the module a float32 rule in overrides= if "
        "float32 is intended.", None),
    "softmax_low_precision": (
        "softmax exp/log and its sums ran in low precision: {ops}. exp overflows float16 "
        "above ~11 and the normaliser loses small probabilities; keep exp/log/reduce_sum in "
        "the fp32 op list (jaxamp.DEFAULT_OP_RULES) and the module's compute dtype "
        "float16/bfloat16 only for its matmuls.", "Softmax"),
    "normalisation_low_precision": (
        "normalisation statistics ran in low precision: {ops}. Mean/variance need float32 "
        "(a global .half() overflows LayerNorm); drop the override that "
        "sets this norm to a low-precision compute dtype.", "LayerNorm"),
    "loss_low_precision": (
        "the loss (outside all modules) ran in low precision: {ops}. log-sum-exp needs "
        "float32: compute the loss on float32 logits (jaxamp.softmax_cross_entropy) and "
        "keep exp/log/reduce_sum in the fp32 op list.", "CrossEntropy loss"),
    "fp32_op_low_precision": (
        "operation(s) in the op rules' fp32 list ran in low precision: {ops}. autocast runs "
        "them in float32; this program did not (traced under other op rules, or by code "
        "autocast does not rewrite): trace it under these rules, or move the op out of "
        "fp32 with op_rules=jaxamp.DEFAULT_OP_RULES.extend(promote={...}) if low "
        "precision is intended.", None),
    "reduction_low_precision": (
        "accumulating reduction(s) ran in low precision: {ops}. Sums of many float16 "
        "values lose precision and overflow; keep reduce_sum/cumsum in the fp32 op list.",
        None),
}


def _explain(kind: str, float64_names: Sequence[str]) -> tuple[str, str | None]:
    if kind == "matmul_f64_in_low_precision_region":
        return ("matmul(s) ran in float64 although this module's policy computes in {low}: "
                "{ops}. With jax_enable_x64 on, float64 values are left alone, and "
                + float64_cause(float64_names), None)
    return _EXPLAIN[kind]


def _op_findings(t: Trace, by_kind: dict, float64_names: Sequence[str]) -> list[tuple]:
    mods = t.modules
    raw = []
    for (kind, module), recs in by_kind.items():
        text, row = _explain(kind, float64_names)
        if kind == "normalisation_low_precision":
            row = norm_row({mods[r.key].cls.__name__ for r in recs if r.key in mods})
        if kind in ("matmul_f32_in_low_precision_region", "matmul_f64_in_low_precision_region"):
            compute = mods[recs[0].key].compute if recs[0].key in mods else \
                dtype_name(t.policy.compute_dtype)
            text = text.replace("{low}", compute)
        raw.append((kind, module, text.replace("{ops}", _prims(recs)), row))
    return raw


def _cast_findings(t: Trace) -> list[tuple]:
    """Forward casts that only throw bits away: lossy round trips and duplicate casts."""
    raw = []
    by_eqn = {id(r.eqn): r for r in t.records}
    for e in lossy_round_trips(t.jaxpr):
        r = by_eqn.get(id(e))
        if r is None or r.backward:
            continue
        raw.append(("lossy_round_trip", r.module,
                    "a float32 value is cast to low precision and straight back to float32: the "
                    "low-precision copy only throws mantissa bits away. Usually a manual "
                    ".astype() in the model fighting autocast; remove it.",
                    None))
    for _, b in duplicate_casts(t.jaxpr):
        r = by_eqn.get(id(b))
        if r is None or r.backward:
            # backward duplicates come from JAX transposing two casts whose cotangents are
            # the same value (e.g. embedding + positional embedding); XLA's CSE merges them
            continue
        raw.append(("duplicate_cast", r.module,
                    f"the same value is cast to {dtype_name(new_dtype(b))} twice "
                    f"({_pass(r)}); the second cast is redundant work.", None))
    return raw


def audit(fn: Callable, *args: Any, policy: str | jmp.Policy | None = None,
          overrides: dict | None = None, op_rules: OpRules | None = None,
          argnums: int | None = 0, opt_state: Any = None) -> AuditReport:
    """Audits ``fn`` run under ``jaxamp.autocast``: the dtypes every module and op class used
    (forward and backward) and the common mixed-precision mistakes it can see.

    ``fn`` is traced (never compiled or run) under ``autocast(fn, policy, overrides=...,
    op_rules=...)``; if ``args[argnums]`` has float leaves, ``jax.value_and_grad`` of the sum of
    its float outputs is traced too, so the backward pass is audited. Module policies are
    recomputed with autocast's own rules from ``policy`` and ``overrides``, so a float32 matmul
    is flagged only where its module was meant to compute in float16/bfloat16.

    ``audit(step, state, batch)`` audits the loss a step from :func:`jaxamp.make_train_step`
    differentiates, as the step runs it (see :func:`precision_table`), and the state's params
    and optimizer state.

    Args:
      fn: a step, a forward (``model.apply``), a loss, or any JAX function (unmodified user
        code).
      *args: ``(state, batch)`` for a step, else example arguments (arrays or
        ``jax.ShapeDtypeStruct`` s).
      policy, overrides, op_rules: as for :func:`jaxamp.autocast` (``None``: the defaults;
        with a step, the step's own).
      argnums: the argument holding the parameters (differentiated, and checked for
        low-precision storage); ``None``: forward only.
      opt_state: optional optimizer state, checked for float16/bfloat16 leaves.

    Returns:
      An :class:`AuditReport`: ``.rows``, ``.findings``, ``.reference_table()``, ``.to_json()``,
      ``.to_markdown()``, ``.print()``.

    Example:
      >>> import flax.linen as nn
      >>> model = nn.Sequential([nn.Dense(8), nn.LayerNorm(), nn.Dense(2)])
      >>> x = jnp.ones((4, 3))
      >>> params = model.init(jax.random.key(0), x)["params"]
      >>> def loss_fn(params, x):
      ...     return jnp.mean(model.apply({"params": params}, x) ** 2)
      >>> report = jaxamp.audit(loss_fn, params, x, policy="p=f32,c=f16,o=f32")
      >>> [f.kind for f in report.findings]
      []
    """
    call, t = _traced("audit", fn, args, policy, overrides, op_rules, argnums)
    given = args  # as the caller passed them: (state, batch) for a step
    if call.program is not None:
        args, argnums = call.args, 0
        opt_state = call.program.opt_state if opt_state is None else opt_state
    rows = table_rows(t.records, t.out_dtypes)
    explog = {r.module for r in t.records if r.op == "exp/log"}
    keys = {r.module: r.key for r in t.records}
    for row in rows:
        if row["op"] == "output":
            row["category"] = "output"
            continue
        row["category"] = _category(row["module"], row["op"], keys.get(row["module"], ""),
                                    t.modules, explog, t.out_scalar)
    params = args[argnums] if argnums is not None else None
    findings = _findings(t, params, opt_state, float64_names=float64_inputs(fn, given))
    return AuditReport(rows, findings, policy_to_str(t.policy), t,
                       _float_leaf_dtypes(params) if params is not None else [],
                       _float_leaf_dtypes(without_rounded_state(opt_state))
                       if opt_state is not None else [])
