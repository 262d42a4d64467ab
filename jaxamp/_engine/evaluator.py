"""autocast's evaluator (:class:`Evaluator`): a walker that knows regions and casts, and a
table of rules. For each equation it finds its module region (the call's :class:`Marks` in its
name stack), takes each operand across module boundaries
(:meth:`jaxamp._engine.context.Context.operand`) and hands it to its rule; sub-programs are
cached :class:`Body` s, repeated module calls shared (:mod:`jaxamp._engine.sharing`). See
jaxamp/_engine/README.md.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.extend.core as jcore
import jmp

from jaxamp._engine import recompute, sharing
from jaxamp._engine.compat import Tracer, open_jaxpr, source_context
from jaxamp._engine.context import Body, Context, Marks, Rule, Site
from jaxamp._engine.control import INLINE, rule_table
from jaxamp._engine.jaxpr import Run, all_consumers_accept, equations, evaluate
from jaxamp._engine.op_rules import first_order
from jaxamp._engine.sharing import Node, Program
from jaxamp._engine.values import F32, Value, copies, is_float
from jaxamp.rules import OpRules

__all__ = ["Body", "Evaluator"]
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


def _cached(cache: dict, key, jaxpr, make: Callable[[], Any]) -> Any:
    """``make()``, kept in ``cache`` under ``key`` (which names ``jaxpr`` by id) for ``jaxpr``."""
    known = cache.get(key)
    if known is None or known[0] is not jaxpr:
        known = cache[key] = (jaxpr, make())
    return known[1]


def wants_f32(jaxpr: jcore.Jaxpr, op_rules: OpRules, out_wants: Sequence[bool]) -> set:
    """Vars whose every consumer computes in float32 (so they are best computed in float32)."""
    return all_consumers_accept(jaxpr, lambda eqn, wants: _computes_f32(eqn, op_rules, wants),
                                out_wants)


class Evaluator:
    """Re-evaluates a traced jaxpr with each equation in its autocast dtype: the interpreter.
    It owns the rule table (primitive name -> rule; else the op class's rule) and the caches
    (bodies, program keys, sharing and recompute plans); rules see only its :attr:`ctx`, the
    planners (pure functions) only what they read of it (:attr:`facts`)."""

    def __init__(self, policies: Sequence[jmp.Policy | None], op_rules: OpRules,
                 marks: Marks | None = None, attention: Mapping[str, Any] | None = None,
                 f32_weight_grads: bool = False, share: bool = True, *,
                 matmul_ends: Mapping[int, str] | None = None,
                 rules: Mapping[str, Rule] | None = None, layers_in_place: bool = False):
        self.ctx = Context(policies, op_rules, marks=marks, attention=attention,
                           f32_weight_grads=f32_weight_grads, matmul_ends=matmul_ends,
                           interpreter=self, layers_in_place=layers_in_place)
        self.op_rules = op_rules
        self.rules = rule_table(op_rules) if rules is None else rules
        self.bodies: dict[Any, Body] = {}  # Body cache (see body() and cached_body())
        self.evaluations: collections.Counter = collections.Counter()  # id(jaxpr) -> count
        marks = self.ctx.marks
        self.facts = sharing.Facts(marks.regions, marks.scope_of, marks.by_scope, policies,
                                   self.ctx.attention, self.ctx.matmul_ends)
        self.share = share  # evaluate repeated module calls once (see jaxamp._engine.sharing)
        self.program_keys: dict = {}  # id(jaxpr) -> (it, sharing.program_key's)
        self.recompute_memo: dict = {}  # id(sub-program) -> (it, recomputable)
        self.plans: dict = {}  # (planner, id(jaxpr), ...) -> (jaxpr, its plan): _cached

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
                dtype = self.ctx.crossing(v, region) or v.dtype
                if dtype == F32:
                    return True
        return False

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

        runs, segments = None, self.ctx.segments_on()
        nodes: dict = {}
        if (self.share or segments) and not isinstance(jaxpr, Program):
            nodes = _cached(self.plans, ("share", id(jaxpr), tuple(out_wants)), jaxpr,
                            lambda: sharing.plan(jaxpr, wants, self.facts, self.program_keys))
        if self.share and nodes:
            runs = {start: Run(node.end, node.inputs, node.outputs, functools.partial(
                        self.run_node, equations(jaxpr), node, base, wants))
                    for start, node in nodes.items()}
        if segments:
            # segments end where shared calls begin and end, shared or not (the same program)
            runs = dict(runs or {})
            eqns = equations(jaxpr)
            cuts = {n.start for n in nodes.values()} | {n.end for n in nodes.values()}
            plan = _cached(self.plans, ("segments", id(jaxpr), tuple(sorted(runs))), jaxpr,
                           lambda: recompute.plan(self.op_rules, jaxpr, runs, cuts,
                                                  self.recompute_memo))
            for start, seg in plan.items():
                runs[start] = Run(seg.end, seg.run_ins, seg.run_outs, functools.partial(
                    recompute.run_range, self.ctx, eqns, seg, base, wants, drop))
        return evaluate(jaxpr, consts, args, run_eqn, literal, runs)

    def run_node(self, eqns, node: Node, base, wants: set, ins: list[Value]) -> list[Value]:
        """A module call whose structure repeats: one :class:`Body` per (structure, what is
        known of its inputs, region), bound under this call's own name-stack prefix."""
        scope = self.ctx.marks.scope_of[node.marker]
        path = self.ctx.marks.regions(eqns[node.start])
        outer = [i for i in path[:path.index(node.marker)]
                 if self.ctx.policies[i] is not None and i not in base]
        entry = base + tuple(outer)  # the region the call is made in
        out_wants = [v in wants for v in node.outputs]
        key = ("call", node.sig, tuple(self._relative(v, entry) for v in ins), entry,
               self.ctx.segments_on())  # a call in a scan body and one outside: two bodies
        body = self.bodies.get(key)
        if body is None:
            program = Program([], node.inputs, node.outputs, eqns[node.start:node.end], scope)
            body = self.bodies[key] = Body(self.ctx, program, ins, entry, out_wants,
                                           copies(ins), export=True)
        with source_context(eqns[node.start], keep=scope):
            outs = body.fn(*body.args(ins))
        values = body.values(outs)
        body.keep(ins, outs, values)
        return values

    def _relative(self, v: Value, region: tuple[int, ...]) -> tuple:
        """What the evaluation of a call in ``region`` can learn about input ``v``: its flags
        and dtype, and where it comes from relative to ``region`` (the policies of the module
        regions it leaves), which decides its crossing casts, and the copies made of it
        (:func:`jaxamp._engine.values.copies`)."""
        cut = 0
        while cut < min(len(v.region), len(region)) and v.region[cut] == region[cut]:
            cut += 1
        return (v.stored, v.const, v.splat, v.dtype, cut,
                tuple(self.ctx.policies[i] for i in v.region[cut:]),
                tuple(d for _, d in copies([v])))

    def run_eqn(self, eqn, raw: list[Value], base, wants: set, drop=None) -> list[Value]:
        region = self.ctx.region_of(eqn, base)
        if eqn.primitive.name in INLINE:
            # An inlined call (jax.nn.silu, any @jax.jit helper) crosses no boundary of its
            # own: its equations take each operand across as they use it, so a float32 value
            # leaving a module stays float32 for an inner float32 consumer.
            ins = raw
        else:
            f32_use = self.computes_f32(eqn, raw, region, wants)
            ins = [self.ctx.operand(v, region, f32_use) for v in raw]
        site = Site(region, [o in wants for o in eqn.outvars])
        with source_context(eqn, drop=drop):
            outs = self.dispatch(eqn, ins, site)
        if self.ctx.segment_depth and not self.ctx.remat_depth:
            outs = recompute.tag_statistics(eqn, outs)
        return outs

    def dispatch(self, eqn, ins: list[Value], site: Site) -> list[Value]:
        """``eqn``'s rule from the table (a user's handler, a higher-order rule), else its op
        class's."""
        return self.rules.get(eqn.primitive.name, first_order)(self.ctx, eqn, ins, site)

    # ---- sub-programs ---------------------------------------------------------------------
    def body(self, closed, metas: Sequence[Value], region, out_wants=None,
             dtypes: Sequence[Any] | None = None) -> Body:
        """The :class:`Body` of ``closed`` for inputs known as ``metas`` (with ``dtypes``
        instead of theirs, where given), in ``region``: one per program, inputs and region."""
        if dtypes is None:
            dtypes = [m.dtype for m in metas]
        key = (sharing.program_key(closed, self.facts, self.program_keys),
               tuple((m.stored, m.const, m.region, m.splat, d) for m, d in zip(metas, dtypes)),
               region, None if out_wants is None else tuple(out_wants), self.ctx.scopes())
        body = self.bodies.get(key)
        if body is None:
            body = self.bodies[key] = Body(self.ctx, closed, metas, region, out_wants)
        return body

    def cached_body(self, key, anchor, make) -> Body:
        """The body cached under ``key`` whose anchor is ``anchor`` (else ``make()``'s)."""
        body = self.bodies.get(key)
        if body is None or body.anchor is not anchor:
            body = self.bodies[key] = make()
        return body
