"""Auditing a whole train step (:func:`audit_step`): is the loss scale divided out before the
gradients' global norm is taken (a clip of scaled gradients over-suppresses every update)?
:class:`_Graph` holds the data dependencies of the step's jaxpr, :func:`_clip_findings` pairs
global norms with loss-scale unscaling (``docs/api/train.rst``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jcore
import numpy as np

from .._engine.compat import scan_counts
from .._engine.jaxpr import walk
from ..policy_spec import DEFAULT_POLICY
from ..rules import ModuleRules
from ..train import TrainStep
from ._report import AuditReport, Finding, group_findings, storage_findings
from ._trace import (
    Recorder,
    attribute,
    collect_eqns,
    dce,
    float_dtypes,
    recording,
    resolve_call,
    table_rows,
)


class _Graph:
    """Data dependencies between the variables of a jaxpr and all its sub-jaxprs."""

    def __init__(self, jaxpr: jcore.Jaxpr):
        self.preds: dict = {}
        self.producer: dict = {}
        self.leaves: list[tuple[Any, str]] = []  # (equation, name stack)
        self.outer: dict = {}  # a sub-jaxpr's input var -> the caller's var it is bound to
        self._build(jaxpr)

    def canonical(self, v):
        """The outermost var a sub-jaxpr input stands for (a loss scale passed into a
        micro-batch scan is the same scalar inside and outside)."""
        while isinstance(v, jcore.Var) and v in self.outer:
            v = self.outer[v]
        return v

    def _edge(self, dst, srcs):
        self.preds.setdefault(dst, []).extend(s for s in srcs if isinstance(s, jcore.Var))

    def _build(self, jaxpr: jcore.Jaxpr) -> None:
        def enter(eqn, sub, stack) -> None:
            for v, o in zip(sub.jaxpr.invars, sub.ins):
                if o is None:
                    self._edge(v, eqn.invars)
                else:
                    self._edge(v, [o])
                    self.outer[v] = o
            for v, o in zip(sub.jaxpr.outvars, sub.outs):
                if o is not None:
                    self._edge(o, [v])
            if eqn.primitive.name in ("scan", "while"):  # loop-carried values
                if eqn.primitive.name == "scan":
                    first, nc = scan_counts(eqn)
                else:
                    first, nc = len(sub.jaxpr.invars) - len(sub.jaxpr.outvars), \
                        len(sub.jaxpr.outvars)
                for k in range(nc):
                    if first + k < len(sub.jaxpr.invars) and k < len(sub.jaxpr.outvars):
                        self._edge(sub.jaxpr.invars[first + k], [sub.jaxpr.outvars[k]])

        def leave(eqn, subs, stack) -> None:
            if any(o is None for s in subs for o in (*s.ins, *s.outs)):
                for o in eqn.outvars:
                    self._edge(o, eqn.invars)

        def leaf(eqn, stack) -> None:
            self.leaves.append((eqn, stack))
            for o in eqn.outvars:
                self._edge(o, eqn.invars)
                self.producer[o] = eqn

        walk(jaxpr, leaf, enter=enter, leave=leave)

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
    return bool(float_dtypes([v]))


def _scalar_key(v, g: _Graph):
    """A hashable identity for a scalar operand: the (outermost) Var, or ('lit', value)."""
    if isinstance(v, jcore.Var):
        v = g.canonical(v)
    if isinstance(v, jcore.Literal):
        try:
            return ("lit", float(np.asarray(v.val)))
        except (TypeError, ValueError):
            return None
    return v


def _clip_findings(jaxpr: jcore.Jaxpr) -> list[Finding]:
    g = _Graph(jaxpr)
    norms = _global_norms(g, jaxpr)
    if not norms:
        return []
    scalar_mul = _scale_candidates(g, norms)
    unscale = _unscales(g, scalar_mul)
    if not unscale:
        return []
    unscaled_outs = {e.outvars[0] for e, _ in unscale}
    accounted = _accounted(g, scalar_mul)
    found = []
    for n, _, anc in norms:
        if anc & unscaled_outs or accounted(n):
            continue  # the norm reads unscaled gradients, or is unscaled itself
        later = [e for e, x in unscale if n.outvars[0] in g.ancestors([x])]
        found.append(_clip_before_unscale(len(later)) if later else _NORM_OF_SCALED)
    return group_findings([(kind, "(train step)", detail, None) for kind, detail in found])


def _clip_before_unscale(n_later: int) -> tuple[str, str]:
    return ("clip_before_unscale",
            "a global gradient norm is computed from gradients still multiplied by the "
            "loss scale, and the gradients it clips are divided by the scale only "
            f"afterwards ({n_later} unscale op(s) depend on that norm). Clipping "
            "scaled gradients shrinks the clip threshold by the scale and over-suppresses "
            "every update. Unscale first "
            "(grads = loss_scale.unscale(grads)), then clip (optax.clip_by_global_norm), "
            "or use jaxamp.make_train_step(clip_norm=...).")


_NORM_OF_SCALED = (
    "grad_norm_of_scaled_grads",
    "a global norm (sqrt of a sum) is computed from gradients still multiplied by "
    "the loss scale and is not followed by their unscaling: a logged grad norm "
    "(or a clip) on scaled gradients is off by the scale factor. Compute it after "
    "loss_scale.unscale(grads).")


def _global_norms(g: _Graph, jaxpr: jcore.Jaxpr) -> list:
    """``(eqn, name stack, ancestors)`` of each global norm (a scalar sqrt of a sum) read by
    more than a finite check (which does not depend on the scale); a program output counts
    as a reader."""
    norms = []
    for eqn, stack in g.leaves:
        if eqn.primitive.name == "sqrt" and _shape(eqn.outvars[0]) == () \
                and _is_float_var(eqn.outvars[0]):
            anc = g.ancestors(eqn.invars)
            if any(g.producer.get(v) is not None and g.producer[v].primitive.name == "reduce_sum"
                   for v in anc):
                norms.append((eqn, stack, anc))
    succs: dict = {}
    for dst, srcs in g.preds.items():
        for v in srcs:
            succs.setdefault(v, set()).add(dst)
    returned = {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}

    def finite_check_only(v) -> bool:
        after = succs.get(v, set())
        if v in returned or not after:
            return False
        for s in after:
            e = g.producer.get(s)
            if e is not None and e.primitive.name == "is_finite":
                continue
            if (e is None or e.primitive.name in ("convert_element_type", "copy")) \
                    and finite_check_only(s):
                continue  # a cast, a copy, or the var a sub-jaxpr binds it to
            return False
        return True

    return [n for n in norms if not finite_check_only(n[0].outvars[0])]


def _scale_candidates(g: _Graph, norms: list) -> set:
    """Loss-scale candidates: scalars multiplied with another scalar (the loss, or the
    cotangent seed), other than what is computed from a norm (clip factors)."""
    norm_outs = {n.outvars[0] for n, _, _ in norms}
    norm_desc = {v for v in g.preds if g.ancestors([v]) & norm_outs} | norm_outs
    scalar_mul: set = set()
    for eqn, _ in g.leaves:
        if eqn.primitive.name == "mul" and len(eqn.invars) == 2 and \
                all(_shape(v) == () for v in eqn.invars):
            for a in eqn.invars:
                key = _scalar_key(a, g)
                if key is not None and key not in (("lit", 1.0), ("lit", 0.0)) and \
                        not (isinstance(a, jcore.Var) and a in norm_desc):
                    scalar_mul.add(key)
    return scalar_mul


def _through(v, g: _Graph):
    """Follow a scalar back through casts/copies/broadcasts to its source."""
    while isinstance(v, jcore.Var) and v in g.producer and \
            g.producer[v].primitive.name in ("convert_element_type", "copy",
                                             "broadcast_in_dim", "reshape"):
        v = g.producer[v].invars[0]
    return v


def _unscales(g: _Graph, scalar_mul: set) -> list[tuple[Any, Any]]:
    """``(eqn, the tensor operand)`` of each op that divides a non-scalar value by a loss-scale
    candidate (directly or via a reciprocal)."""
    unscale: list[tuple[Any, Any]] = []
    for eqn, _ in g.leaves:
        name = eqn.primitive.name
        if name == "div" and len(eqn.invars) == 2:
            x, s = eqn.invars
            s = _through(s, g)
            if _shape(x) != () and _shape(s) == () and _scalar_key(s, g) in scalar_mul:
                unscale.append((eqn, x))
        elif name == "mul" and len(eqn.invars) == 2:
            for x, r in (eqn.invars, eqn.invars[::-1]):
                r = _through(r, g)
                if _shape(x) == () or _shape(r) != () or not isinstance(r, jcore.Var):
                    continue
                pe = g.producer.get(r)
                if pe is not None and pe.primitive.name == "div" and \
                        _shape(pe.invars[1]) == () and \
                        _scalar_key(_through(pe.invars[1], g), g) in scalar_mul:
                    unscale.append((eqn, x))
    return unscale


def _accounted(g: _Graph, scalar_mul: set) -> Callable:
    """Whether a norm meets 1 / scale as a scalar (``root * inv``, ``min(inv, clip / root)``):
    the unscaled norm computed from scaled gradients, as jaxamp.amp computes it."""
    # 1 / scale: a scalar divided by a loss-scale candidate
    recips = {e.outvars[0] for e, _ in g.leaves
              if e.primitive.name == "div" and _shape(e.outvars[0]) == ()
              and _scalar_key(_through(e.invars[1], g), g) in scalar_mul}
    scalar_pairs = [e.invars for e, _ in g.leaves
                    if e.primitive.name in ("mul", "min", "div") and len(e.invars) == 2
                    and all(isinstance(v, jcore.Var) and _shape(v) == () for v in e.invars)]

    def accounted(norm) -> bool:
        out = norm.outvars[0]
        for a, b in scalar_pairs:
            for x, y in ((a, b), (b, a)):
                ys = g.ancestors([y])
                if out in g.ancestors([x]) and out not in ys and ys & recips:
                    return True
        return False

    return accounted


def audit_step(step_fn: Callable, *args: Any, params: Any = None,
               opt_state: Any = None) -> AuditReport:
    """Audits a whole train step (traced as is, e.g. ``step(state, batch)``): the order of
    loss-scale unscaling and gradient clipping, the step's precision table, and low-precision
    ``params=``/``opt_state=`` storage.

    ``clip_before_unscale`` is a dataflow heuristic on the step's jaxpr: a global norm (a scalar
    ``sqrt`` of a ``reduce_sum``) read by more than a finite check, computed from gradients no
    loss-scale division has reached, while an unscaling depends on it (a norm no unscaling
    depends on is ``grad_norm_of_scaled_grads``). A loss scale is a scalar that multiplies a
    scalar and divides a tensor (``g / s`` or ``g * (1 / s)``); a norm that meets ``1 / scale``
    as a scalar (:func:`jaxamp.amp`'s unscaled norm) is fine. What it detects and cannot:
    ``docs/api/train.rst``.

    With a step from :func:`jaxamp.make_train_step` it traces that step and checks the state's
    params and optimizer state; module paths print as ``overrides=`` takes them.

    Args:
      step_fn: the train step; traced with ``jax.make_jaxpr`` (never run).
      *args: its example arguments (``state, batch``).
      params, opt_state: optional trees checked for float16/bfloat16 storage (default with a
        step from :func:`jaxamp.make_train_step`: the state's).

    Returns:
      An :class:`AuditReport` (its ``reference_table()`` is empty: module policies are unknown).
    """
    fn, context = step_fn, contextlib.nullcontext()
    if isinstance(step_fn, TrainStep):
        prog = resolve_call("audit_step", step_fn, args).program
        fn, context = step_fn.traceable, prog.context()
        params = prog.params if params is None else params
        opt_state = prog.opt_state if opt_state is None else opt_state
    recorder = Recorder(ModuleRules.create(DEFAULT_POLICY))
    with context, recording(recorder):
        closed = jax.make_jaxpr(fn)(*args)
    jaxpr, _ = dce(closed.jaxpr)
    records = attribute(collect_eqns(jaxpr, [False] * len(jaxpr.invars)), recorder.modules)
    out_dtypes = sorted({n for n in float_dtypes(jaxpr.outvars)})
    rows = table_rows(records, out_dtypes)
    for row in rows:
        row["category"] = {"matmul": "matmul", "conv": "matmul", "cast": "cast",
                           "gather": "gather", "output": "output", "max/min": "max/min",
                           "reduction": "reduction"}.get(row["op"], "elementwise")
    findings = _clip_findings(jaxpr)
    storage = group_findings(storage_findings(params, opt_state))
    return AuditReport(rows, storage + findings, "(train step)", None)
