"""autocast's evaluator: a walker that knows regions and casts, and a table of rules.

:class:`Evaluator` re-evaluates a traced (float32) jaxpr equation by equation. For each
equation it finds the module region it belongs to (the ``jaxamp<call.region>`` name-scope
markers the trace left), takes each operand across the module boundaries between where the
operand was made and where it is used (:meth:`Evaluator.operand`), and hands the equation to
its rule: a user's handler (``OpRules.extend(handlers=...)``), else the primitive's
higher-order rule (:data:`jaxamp._control.HIGHER_ORDER`), else its op class's rule
(:func:`jaxamp._op_rules.first_order`). The walk itself is :func:`jaxamp._jaxpr.evaluate`,
shared with the diagnostics.

Sub-programs are evaluated through :meth:`Evaluator.body`: once per (program, what is known of
its inputs, region), then replayed from JAX's jit cache, so the cost of nested control flow
is linear in its size; and repeated module calls with the same structure (the layers of a
Transformer) share one evaluation (:mod:`jaxamp._sharing`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import jmp
import numpy as np

from jaxamp import _recompute, _sharing
from jaxamp._compat import Tracer, inline_jit, jit_inlines, open_jaxpr, source_context
from jaxamp._control import HIGHER_ORDER, INLINE
from jaxamp._jaxpr import Run, all_consumers_accept, equations, evaluate, name_stack
from jaxamp._op_rules import RuleCall, Site, first_order
from jaxamp._sharing import Node, Program
from jaxamp._values import F32, Value, cast, copies, is_float
from jaxamp.policy import matmul_dtype
from jaxamp.rules import OpRules

__all__ = ["REGION_MARKER", "Body", "Evaluator"]

#: The name-scope marker of a module call: ``jaxamp<call.id>``. Each autocast call has its own
#: ``call`` number, so an autocast function traced inside another keeps its regions apart.
REGION_MARKER = _sharing.REGION_MARKER
#: Counters (id(jaxpr) -> evaluations) that :func:`jaxamp.engine.counting_evaluations` adds.
COUNTERS: list[collections.Counter] = []


def _computes_f32(eqn, op_rules: OpRules, wants: set) -> bool:
    """Whether ``eqn`` computes in float32 whatever its operands' dtypes: an ``fp32`` op, or
    a promote/structural op whose every float output is wanted in float32."""
    kind = op_rules.classify(eqn.primitive.name)
    if kind == "fp32":
        return True
    if kind in ("promote", "structural") or eqn.primitive.name in INLINE:
        outs = [o for o in eqn.outvars if is_float(o.aval.dtype)]
        return bool(outs) and all(o in wants for o in outs)
    return False


def wants_f32(jaxpr: jcore.Jaxpr, op_rules: OpRules, out_wants: Sequence[bool]) -> set:
    """Vars whose every consumer computes in float32 (so they are best computed in float32)."""
    return all_consumers_accept(jaxpr, lambda eqn, wants: _computes_f32(eqn, op_rules, wants),
                                out_wants)


class Body:
    """A sub-program evaluated under autocast as a cached, inlined ``jax.jit``: JAX traces
    :attr:`fn` once per input types, so asking for its output dtypes (:meth:`out_dtypes`) and
    then calling it evaluates it once. :meth:`values` gives its outputs with what the
    evaluation learnt about them (stored, constant, region). A recompute segment's or a
    shared call's body is given the copies made of its inputs (``casts``, after them:
    :meth:`args`) and, with ``export``, returns those it made of its inputs and outputs after
    its outputs (:meth:`keep` records them), so a value is cast once across its boundary."""

    def __init__(self, ev: Evaluator, closed, metas: Sequence[Value], region, out_wants,
                 casts: Sequence[tuple[int, Any]] = (), export: bool = False):
        self.out: list[Value] | None = None
        self.casts = tuple(casts)  # (input, dtype): copies given after the inputs (copies())
        # with export: the copies made inside of inputs and of outputs, (index, dtype) each,
        # returned after the outputs (keep() records them)
        self.made: list = []
        self.made_out: list = []
        n = len(metas)

        def run(*vals):
            args = [m.fresh(x) for m, x in zip(metas, vals[:n])]
            for (i, dtype), x in zip(self.casts, vals[n:]):
                args[i].casts[dtype] = x
            outs = ev.eval(closed, None, args, region, out_wants)
            self.out = [Value(None, o.stored, o.const, o.region, splat=o.splat) for o in outs]
            if export:
                self.made = [c for c in copies(args) if c not in self.casts]
                self.made_out = copies(outs)
            return [o.val for o in outs] + [args[i].casts[d] for i, d in self.made] \
                + [outs[j].casts[d] for j, d in self.made_out]

        run.__name__ = "jaxamp_body"
        self.fn = inline_jit(run) if jit_inlines() else run

    def args(self, ins: Sequence[Value]) -> list:
        """What :attr:`fn` takes for inputs ``ins``: their arrays, then the copies it is given."""
        return [v.val for v in ins] + [ins[i].casts[d] for i, d in self.casts]

    def keep(self, ins: Sequence[Value], outs: Sequence[Any], values: Sequence[Value]) -> None:
        """Records the copies that the call returning ``outs`` made (after its outputs) on its
        inputs ``ins`` and on its output ``values``, so that what reads them later does not
        cast them again."""
        k = len(self.out) + len(self.made)
        for (i, dtype), x in zip(self.made, outs[len(self.out):k]):
            ins[i].casts.setdefault(dtype, x)
        for (j, dtype), x in zip(self.made_out, outs[k:]):
            values[j].casts.setdefault(dtype, x)

    def out_dtypes(self, specs) -> list:
        return [np.dtype(o.dtype) if is_float(o.dtype) else o.dtype
                for o in jax.eval_shape(self.fn, *specs)]

    def values(self, outs) -> list[Value]:
        return [Value(o, m.stored, m.const, m.region, splat=m.splat)
                for o, m in zip(outs, self.out)]


class Evaluator:
    """Re-evaluates a traced jaxpr with each equation in its autocast dtype."""

    def __init__(self, policies: Sequence[jmp.Policy | None], op_rules: OpRules, call: int = 0,
                 attention_calls: Sequence = (), f32_weight_grads: bool = False,
                 share: bool = True):
        self.policies = policies  # region id -> policy (None: a module call without a rule)
        self.op_rules = op_rules
        self.f32_weight_grads = f32_weight_grads  # param gradients of matmuls: float32 output
        self.attention_calls = attention_calls  # jax.nn.dot_product_attention calls recorded
        self.call = call  # region markers of other autocast calls (nested ones) are ignored
        self.unknown: set[str] = set()  # primitives in no op list that were met (warned once)
        # the low-precision matmul dtypes ("float16", "float8", ...) of regions whose matmuls
        # ran in float64 (jax_enable_x64: float64 is left alone; warned once)
        self.float64_matmuls: set[str] = set()
        self.marks: dict = {}  # name stack -> the region ids of this call's markers in it
        self.bodies: dict = {}  # Body cache (see body())
        self.evaluations: collections.Counter = collections.Counter()  # id(jaxpr) -> count
        self.sharing = _sharing.Sharing(self)
        self.share = share  # evaluate repeated module calls once (see jaxamp._sharing)
        # id(eqn) -> "first"/"last": the first and last matmul reading a param (RuleCall.position)
        self.matmul_ends: dict[int, str] = {}
        # recompute segments (jaxamp._recompute): off inside a segment and a user's remat
        self.segment_depth = 0
        self.remat_depth = 0
        self.scan_depth = 0  # inside a lax.scan body (OpRules.recompute="scan")
        self.recompute_memo: dict = {}  # id(sub-program) -> (it, recomputable)
        self.segment_plans: dict = {}  # id(jaxpr) -> (jaxpr, taken starts, segments)

    @contextlib.contextmanager
    def in_segment(self):
        """Evaluating a recompute segment: no segments inside it, its statistics named."""
        self.segment_depth += 1
        try:
            yield
        finally:
            self.segment_depth -= 1

    @contextlib.contextmanager
    def in_user_remat(self):
        """Evaluating a user's ``jax.checkpoint`` body: its policy decides what is kept."""
        self.remat_depth += 1
        try:
            yield
        finally:
            self.remat_depth -= 1

    @contextlib.contextmanager
    def in_scan(self):
        """Evaluating a ``lax.scan`` body, where ``recompute="scan"`` makes segments."""
        self.scan_depth += 1
        try:
            yield
        finally:
            self.scan_depth -= 1

    def segments_on(self) -> bool:
        where = self.op_rules.recompute
        return (where is True or (where == "scan" and self.scan_depth > 0)) \
            and not self.segment_depth and not self.remat_depth

    # ---- regions -------------------------------------------------------------------------
    def policy(self, region: tuple[int, ...]) -> jmp.Policy:
        return self.policies[region[-1] if region else 0]

    def compute_dtype(self, region: tuple[int, ...]) -> np.dtype:
        return np.dtype(self.policy(region).compute_dtype)

    def matmul_dtype(self, region: tuple[int, ...]) -> np.dtype:
        """The dtype the built-in matmul rule runs in: the policy's ``matmul=`` dtype when it
        is a float16/bfloat16/float32 one, else the compute dtype (FP8 is the FP8 rule's,
        :mod:`jaxamp.fp8`, and falls back to the compute dtype)."""
        dtype = np.dtype(matmul_dtype(self.policy(region)))
        return dtype if dtype.itemsize > 1 else self.compute_dtype(region)

    def markers(self, eqn) -> tuple[int, ...]:
        """The ids of this call's module-call markers in ``eqn``'s name stack, outermost
        first (cached per name stack: the equations of one scope share it)."""
        stack = eqn.source_info.name_stack
        try:
            ids = self.marks.get(stack)
        except TypeError:  # pragma: no cover - an unhashable name stack
            stack, ids = None, None
        if ids is None:
            ids = tuple(int(k) for c, k in REGION_MARKER.findall(name_stack(eqn))
                        if int(c) == self.call)
            if stack is not None:
                self.marks[stack] = ids
        return ids

    def region_of(self, eqn, base: tuple[int, ...]) -> tuple[int, ...]:
        ids = [i for i in self.markers(eqn) if self.policies[i] is not None and i not in base]
        return base + tuple(ids) if ids else base

    def crossing(self, v: Value, region: tuple[int, ...]) -> np.dtype | None:
        """The dtype ``v`` is cast to on its way into ``region``, or None if it is not."""
        if v.region == region or not v.is_float:
            return None
        cut = 0
        while cut < min(len(v.region), len(region)) and v.region[cut] == region[cut]:
            cut += 1
        target = None
        stored = v.stored
        if len(v.region) > cut:  # leaving the module region v.region[cut]
            target = np.dtype(self.policies[v.region[cut]].output_dtype)
            stored = False
        if len(region) > cut and not stored:  # entering a module region
            target = self.compute_dtype(region)
        return target

    def computes_f32(self, eqn, raw: Sequence[Value], region, wants: set) -> bool:
        """Whether ``eqn`` computes in float32 whatever the region crossings of its operands
        do: an fp32 op, an op whose outputs are wanted in float32, or a promote op with a
        float32 activation among its operands after their crossings."""
        if _computes_f32(eqn, self.op_rules, wants):
            return True
        if self.op_rules.classify(eqn.primitive.name) != "promote":
            return False
        for v in raw:
            if v.is_float and not v.stored:
                dtype = self.crossing(v, region) or v.dtype
                if dtype == F32:
                    return True
        return False

    def operand(self, v: Value, region: tuple[int, ...], f32_use: bool = False) -> Value:
        """``v`` as an eqn in ``region`` sees it: cast on leaving/entering a matched module.

        The crossing is cached on ``v`` (every consumer in ``region`` shares one cast and its
        own casts). A value leaving a module wider than the module's output dtype stays wide
        for a consumer that computes in float32 anyway (``f32_use``): casting it down there
        would only round it (f32 -> f16 -> f32).
        """
        target = self.crossing(v, region)
        if target is None:
            return v
        if f32_use and target != v.dtype and v.dtype == F32:
            target = F32
        key = ("region", region, target)
        if key not in v.casts:
            if target == v.dtype:
                v.casts[key] = Value(v.val, False, v.const, region, v.casts)
            else:
                v.casts[key] = Value(cast(v, target), False, False, region)
        return v.casts[key]

    # ---- the interpreter ------------------------------------------------------------------
    def eval(self, closed, consts: Sequence[Value] | None, args: Sequence[Value],
             base: tuple[int, ...], out_wants: Sequence[bool] | None = None) -> list[Value]:
        jaxpr, closed_consts = open_jaxpr(closed)
        self.evaluations[id(jaxpr)] += 1
        for counter in COUNTERS:
            counter[id(jaxpr)] += 1
        if consts is None:
            consts = [Value(c, True, not isinstance(c, Tracer), base)
                      for c in closed_consts or []]
        out_wants = out_wants or [False] * len(jaxpr.outvars)
        wants = wants_f32(jaxpr, self.op_rules, out_wants)

        drop = getattr(jaxpr, "drop", None)  # a shared module call's own equations

        def literal(lit) -> Value:
            return Value(lit.val, True, True, base)

        def run_eqn(eqn, raw: list[Value]) -> list[Value]:
            return self.run_eqn(eqn, raw, base, wants, drop)

        runs, segments = None, self.segments_on()
        nodes: dict = {}
        if (self.share or segments) and not isinstance(jaxpr, Program):
            nodes = self.sharing.plan(jaxpr, wants, out_wants)
        if self.share and nodes:
            runs = {start: Run(node.end, node.inputs, node.outputs, functools.partial(
                        self.run_node, equations(jaxpr), node, base, wants))
                    for start, node in nodes.items()}
        if segments:
            # segments end where shared calls begin and end, shared or not (the same program)
            runs = dict(runs or {})
            eqns = equations(jaxpr)
            for start, seg in self.segment_plan(jaxpr, runs, nodes).items():
                runs[start] = Run(seg.end, seg.run_ins, seg.run_outs, functools.partial(
                    _recompute.run_range, self, eqns, seg, base, wants, drop))
        return evaluate(jaxpr, consts, args, run_eqn, literal, runs)

    def segment_plan(self, jaxpr, taken: dict, nodes: dict) -> dict:
        key = (id(jaxpr), tuple(sorted(taken)))
        known = self.segment_plans.get(key)
        if known is None or known[0] is not jaxpr:
            cuts = {n.start for n in nodes.values()} | {n.end for n in nodes.values()}
            known = self.segment_plans[key] = (jaxpr,
                                               _recompute.plan(self, jaxpr, taken, cuts))
        return known[1]

    def run_node(self, eqns, node: Node, base, wants: set, ins: list[Value]) -> list[Value]:
        """A module call whose structure repeats: one :class:`Body` per (structure, what is
        known of its inputs, region), bound under this call's own name-stack prefix."""
        scope = self.sharing.marker_scope(node.marker)
        path = self.markers(eqns[node.start])
        outer = [i for i in path[:path.index(node.marker)]
                 if self.policies[i] is not None and i not in base]
        entry = base + tuple(outer)  # the region the call is made in
        out_wants = [v in wants for v in node.outputs]
        key = ("call", node.sig, tuple(self._relative(v, entry) for v in ins), entry,
               self.segments_on())  # a call in a scan body and one outside: two bodies
        body = self.bodies.get(key)
        if body is None:
            program = Program([], node.inputs, node.outputs, eqns[node.start:node.end], scope)
            body = self.bodies[key] = Body(self, program, ins, entry, out_wants, copies(ins),
                                           export=True)
        with source_context(eqns[node.start], keep=scope):
            outs = body.fn(*body.args(ins))
        values = body.values(outs)
        body.keep(ins, outs, values)
        return values

    def _relative(self, v: Value, region: tuple[int, ...]) -> tuple:
        """What the evaluation of a call in ``region`` can learn about input ``v``: its flags
        and dtype, and where it comes from relative to ``region`` (the policies of the module
        regions it leaves), which decides its crossing casts, and the copies made of it
        (:func:`jaxamp._values.copies`)."""
        cut = 0
        while cut < min(len(v.region), len(region)) and v.region[cut] == region[cut]:
            cut += 1
        return (v.stored, v.const, v.splat, v.dtype, cut,
                tuple(self.policies[i] for i in v.region[cut:]),
                tuple(d for _, d in copies([v])))

    def run_eqn(self, eqn, raw: list[Value], base, wants: set, drop=None) -> list[Value]:
        region = self.region_of(eqn, base)
        if eqn.primitive.name in INLINE:
            # An inlined call (jax.nn.silu, any @jax.jit helper) crosses no boundary of its
            # own: its equations take each operand across as they use it, so a float32 value
            # leaving a module stays float32 for an inner float32 consumer.
            ins = raw
        else:
            f32_use = self.computes_f32(eqn, raw, region, wants)
            ins = [self.operand(v, region, f32_use) for v in raw]
        site = Site(region, [o in wants for o in eqn.outvars])
        with source_context(eqn, drop=drop):
            outs = self.dispatch(eqn, ins, site)
        if self.segment_depth and not self.remat_depth:
            outs = _recompute.tag_statistics(eqn, outs)
        return outs

    def dispatch(self, eqn, ins: list[Value], site: Site) -> list[Value]:
        """The rule for ``eqn``: a user's handler, else its higher-order rule, else its op
        class's."""
        name = eqn.primitive.name
        handler = self.op_rules.handler(name)
        if handler is not None:
            out = handler(RuleCall(self, eqn, ins, site))
            if out is not None:
                return [Value(o, False, False, site.region) for o in out]
        rule = HIGHER_ORDER.get(name)
        if rule is not None:
            return rule(self, eqn, ins, site)
        return first_order(self, eqn, ins, site)

    # ---- sub-programs ---------------------------------------------------------------------
    def run_body(self, closed, metas: Sequence[Value], region, vals,
                 out_wants=None) -> list[Value]:
        """Evaluates a sub-jaxpr in the current trace: fresh values, no shared cast caches."""
        args = [m.fresh(x) for m, x in zip(metas, vals)]
        return self.eval(closed, None, args, region, out_wants)

    def body(self, closed, metas: Sequence[Value], region, out_wants=None,
             dtypes: Sequence[Any] | None = None) -> Body:
        """The :class:`Body` of ``closed`` for inputs known as ``metas`` (with ``dtypes``
        instead of theirs, where given), in ``region``: one per program, inputs and region."""
        if dtypes is None:
            dtypes = [m.dtype for m in metas]
        key = (self.sharing.program_key(closed),
               tuple((m.stored, m.const, m.region, m.splat, d) for m, d in zip(metas, dtypes)),
               region, None if out_wants is None else tuple(out_wants),
               self.segment_depth > 0, self.remat_depth > 0, self.scan_depth > 0)
        body = self.bodies.get(key)
        if body is None:
            body = self.bodies[key] = Body(self, closed, metas, region, out_wants)
        return body
