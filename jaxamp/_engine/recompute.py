"""Activation memory: the cheap code between two matmuls is recomputed in the backward pass.

:func:`plan` cuts a jaxpr into *segments*, maximal runs of cheap equations between matmuls;
:func:`run` evaluates one as a ``jax.checkpoint`` that keeps only its inputs (the matmuls'
low-precision outputs) and its row statistics (:data:`STAT`). The forward's values are
unchanged. Why, and what is kept where: jaxamp/_engine/README.md ("Recompute segments").
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxamp._engine.compat import Tracer, checkpoint_in_place, sub_jaxprs
from jaxamp._engine.context import Body, Context
from jaxamp._engine.jaxpr import Span, consumers, equations, producers, span_io, spans
from jaxamp._engine.primitives import (
    LEADING_SUMS,
    NEVER_RECOMPUTED,
    SELF_DERIVED,
    STATISTICS,
    TRANSPARENT,
)
from jaxamp._engine.sharing import Program
from jaxamp._engine.values import Value, convert, copies, is_float
from jaxamp.fp8 import FP8Matmuls
from jaxamp.policy import matmul_dtype
from jaxamp.rules import OpRules

__all__ = ["STAT", "Segment", "plan", "run", "run_range", "tag_statistics"]

#: The ``checkpoint_name`` of the row statistics a segment keeps.
STAT = "jaxamp_row_stat"
_POLICY = jax.checkpoint_policies.save_only_these_names(STAT)


class Segment(NamedTuple):
    """Equations ``start:end``: the vars the recomputed ones read from before (``inputs``) and
    those read after (``outputs``); ``hoisted``: matmuls among them that read nothing the
    segment makes, run first outside the checkpoint; ``run_ins``/``run_outs``: the same for
    the whole range; ``tail``: for a segment of one trailing ``SELF_DERIVED`` op, the matmuls
    that read its output; ``readers``: per output, the matmuls that read it."""

    start: int
    end: int
    inputs: list
    outputs: list
    hoisted: tuple
    run_ins: list
    run_outs: list
    tail: tuple = ()
    readers: tuple = ()


def _recomputable(rules: OpRules, eqn, memo: dict) -> bool:
    name = eqn.primitive.name
    if name in NEVER_RECOMPUTED or rules.classify(name) == "matmul" \
            or rules.handler(name) is not None or not rules.known(name):
        return False
    subs = sub_jaxprs(eqn)
    if not subs:
        return True
    if name not in TRANSPARENT:
        return False
    return all(_program_recomputable(rules, s, memo) for s in subs)


def _program_recomputable(rules: OpRules, closed, memo: dict) -> bool:
    key = id(closed)
    if key not in memo:
        memo[key] = (closed, all(_recomputable(rules, e, memo) for e in equations(closed)))
    return memo[key][1]


def _weight(rules: OpRules, eqn) -> int:
    """What recomputing ``eqn`` may save: arithmetic 1, a call (GELU, softmax) 2."""
    name = eqn.primitive.name
    if name in TRANSPARENT:
        return 2
    return int(rules.classify(name) in ("fp32", "promote"))


def _trimmed(rules: OpRules, eqns, made: dict, span):
    """``span`` without a leading sum with a matmul's output (``made``: var -> its equation)."""
    start, end = span.start, span.end
    first = eqns[start]
    if first.primitive.name in LEADING_SUMS and len(first.invars) == 2 and all(
            isinstance(v, jcore.Var) and v.aval.shape == first.outvars[0].aval.shape
            for v in first.invars) and any(
            v in made and rules.classify(made[v].primitive.name) == "matmul"
            for v in first.invars):
        start += 1
        while start < end and start in span.skipped:
            start += 1
    if (start, end) == (span.start, span.end):
        return span
    return span._replace(start=start, end=end,
                         skipped=tuple(k for k in span.skipped if start < k < end))


def plan(rules: OpRules, jaxpr, taken: dict, cuts: set[int],
         memo: dict | None = None) -> dict[int, Segment]:
    """The segments of ``jaxpr`` (start index -> :class:`Segment`), around the runs in
    ``taken`` (shared module calls: start -> run with ``.end``), none across an index in
    ``cuts``. A pure function; ``memo`` may be shared between the programs of one trace."""
    eqns = equations(jaxpr)
    memo = {} if memo is None else memo
    ok = [_recomputable(rules, e, memo) for e in eqns]
    for start, run in taken.items():  # a shared call's equations are its own
        ok[start:run.end] = [False] * (run.end - start)
    out, made, uses = {}, producers(jaxpr), consumers(jaxpr)

    def add(span, tail=()):
        own = [k for k in range(span.start, span.end) if k not in span.skipped]
        if not own or not tail and sum(_weight(rules, eqns[k]) for k in own) < 2:
            return
        inputs, outputs = span_io(jaxpr, own, span.end)
        run_ins, run_outs = span_io(jaxpr, [*span.skipped, *own], span.end)
        if outputs:
            readers = tuple(tuple(e for e in uses.get(v, ()) if _plain_matmul(rules, e))
                            for v in outputs)
            out[span.start] = Segment(span.start, span.end, inputs, outputs, span.skipped,
                                      run_ins, run_outs, tail, readers)

    for span in spans(jaxpr, ok,
                      lambda e: rules.classify(e.primitive.name) == "matmul",
                      lambda k: k in taken or k in cuts):
        span = _trimmed(rules, eqns, made, span)
        last = eqns[span.end - 1]
        tail = () if span.end - 1 in span.skipped or len(last.outvars) != 1 \
            or last.primitive.name not in SELF_DERIVED \
            or rules.classify(last.primitive.name) == "fp32" \
            else tuple(e for e in uses.get(last.outvars[0], ()) if _plain_matmul(rules, e))
        if tail:
            add(span._replace(end=span.end - 1,
                              skipped=tuple(k for k in span.skipped if k < span.end - 1)))
            add(Span(span.end - 1, span.end, ()), tail)
        else:
            add(span)
    return out


def _plain_matmul(rules: OpRules, eqn) -> bool:
    """A matmul the built-in rule may run: no user handler (the FP8 rule defers outside FP8)."""
    name = eqn.primitive.name
    handler = rules.handler(name)
    return rules.classify(name) == "matmul" and (
        handler is None or isinstance(handler, FP8Matmuls))


def _low_casts(ctx: Context, seg: Segment, base, outs, metas) -> list[tuple[int, np.dtype]]:
    """(output index, dtype): outputs that matmuls read cast down (a float32 softmax before
    ``P @ V``), with that dtype; the segment makes the cast inside its checkpoint (why: the
    README). Not FP8, nor where a region crossing casts the output on the way."""
    found = []
    for i, (out, meta, readers) in enumerate(zip(outs, metas, seg.readers)):
        if not readers or not is_float(out.dtype) or meta.stored or meta.const:
            continue
        width = np.dtype(out.dtype).itemsize
        dtypes = {d for d in _matmul_casts(ctx, readers, base, out, meta)
                  if d is not None and d.itemsize < width}
        found += [(i, d) for d in sorted(dtypes, key=str)]
    return found


def _kept_by_matmuls(ctx: Context, readers: tuple, base, out, meta: Value) -> bool:
    """Whether every matmul in ``readers`` reads (and keeps) ``out`` as it is, uncast."""
    return is_float(out.dtype) and all(
        d is not None and d == out.dtype for d in _matmul_casts(ctx, readers, base, out, meta))


def _matmul_casts(ctx: Context, readers: tuple, base, out, meta: Value) -> list:
    """Per matmul in ``readers``, the dtype its rule casts ``out`` to, or None where that is
    not a plain cast (a region crossing casts it first, or the matmul is FP8)."""
    value = Value(out, meta.stored, meta.const, meta.region)
    casts = []
    for eqn in readers:
        region = ctx.region_of(eqn, base)
        plain = ctx.crossing(value, region) in (None, value.dtype) \
            and np.dtype(matmul_dtype(ctx.policy(region))).itemsize > 1
        casts.append(ctx.matmul_dtype(region) if plain else None)
    return casts


def run_range(ctx: Context, eqns, seg: Segment, base, wants: set, drop,
              ins: list[Value]) -> list[Value]:
    """The equations of ``seg``'s range: its hoisted matmuls, then the segment (:func:`run`)."""
    env = dict(zip(seg.run_ins, ins))

    def read(v):
        return Value(v.val, True, True, base) if isinstance(v, jcore.Literal) else env[v]

    for k in seg.hoisted:
        eqn = eqns[k]
        env.update(zip(eqn.outvars, ctx.run_eqn(eqn, [read(v) for v in eqn.invars], base,
                                                wants, drop)))
    env.update(zip(seg.outputs, run(ctx, eqns, seg, base, wants, drop,
                                    [read(v) for v in seg.inputs])))
    return [env[v] for v in seg.run_outs]


def run(ctx: Context, eqns, seg: Segment, base, wants: set, drop,
        ins: list[Value]) -> list[Value]:
    """Segment ``seg`` of ``eqns`` evaluated under a ``jax.checkpoint`` that keeps only its
    inputs and row statistics (in place where no input is traced: nothing to differentiate)."""
    out_wants = [v in wants for v in seg.outputs]
    program = Program([], seg.inputs, seg.outputs, [eqns[k] for k in range(seg.start, seg.end)
                                                   if k not in seg.hoisted], drop)
    traced = [i for i, v in enumerate(ins) if isinstance(v.val, Tracer)]
    if not traced:  # run eagerly: nothing to differentiate, the equations one by one
        with ctx.in_segment():
            return ctx.eval(program, None, ins, base, out_wants)
    given = tuple(copies(ins))  # the copies made of the inputs before: read, not made again
    key = ("segment", id(eqns[seg.start]), seg.end - seg.start, seg.hoisted,
           tuple((v.stored, v.const, v.splat, v.dtype, v.region) for v in ins), base,
           tuple(out_wants), given)
    first = eqns[seg.start]  # never skipped: a segment starts at one of its own
    body = ctx.cached_body(key, first, lambda: Body(ctx, program, ins, base, out_wants, given,
                                                    export=True, anchor=first))
    vals = body.args(ins)
    traced = [i for i, x in enumerate(vals) if isinstance(x, Tracer)]

    def fn(*xs):
        full = list(vals)
        for i, x in zip(traced, _rounded(xs)):
            full[i] = x
        outs = body.fn(*full)
        outs, made = outs[:len(body.out)], outs[len(body.out):]
        if seg.tail:  # decided as the checkpoint traces fn; JAX asks the policy later
            keep[0] = _kept_by_matmuls(ctx, seg.tail, base, outs[0], body.out[0])
        low[:] = [c for c in _low_casts(ctx, seg, base, outs, body.out) if c not in body.made_out]
        return [*outs, *made, *(convert(outs[i], d) for i, d in low)]

    keep = [False]  # a tail keeps its op's output when the matmuls keep that very array
    low: list = []  # the low-precision casts of outputs made inside (_low_casts)

    def policy(prim, *args, **params):
        return _POLICY(prim, *args, **params) or (keep[0] and prim.name in SELF_DERIVED)

    with ctx.in_segment():
        outs = checkpoint_in_place(fn, policy if seg.tail else _POLICY)(
            *[vals[i] for i in traced])
    n = len(outs) - len(low)
    values = body.values(outs[:n])
    body.keep(ins, outs[:n], values)  # the copies it made: not made again after it
    for (i, dtype), x in zip(low, outs[n:]):
        values[i].casts[dtype] = x  # the matmul rule's cast(value, dtype) finds it
    return values


def _rounded(xs: tuple) -> list:
    """``xs`` with each low-precision float read through an ``optimization_barrier``, so the
    forward reads it rounded as the backward does (why: the README)."""
    low = [i for i, x in enumerate(xs)
           if jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize < 4]
    out = list(xs)
    for i, x in zip(low, lax.optimization_barrier([xs[i] for i in low]) if low else ()):
        out[i] = x
    return out


def tag_statistics(eqn, outs: list[Value]) -> list[Value]:
    """The float outputs of a reduction inside a segment, named :data:`STAT` (kept)."""
    if eqn.primitive.name not in STATISTICS:
        return outs
    return [Value(checkpoint_name(o.val, STAT), o.stored, o.const, o.region, splat=o.splat)
            if is_float(o.dtype) and isinstance(o.val, Tracer) else o for o in outs]
