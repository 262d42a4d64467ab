"""The one walker of jaxprs: autocast's interpreter, the overflow locator and the audits read
programs only through these functions (no other module reads ``.eqns``). The map of what each
does is in jaxamp/_engine/README.md ("The walker").
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np

from jaxamp._engine.compat import (
    bind_with_params,
    cond_params,
    inline_jit,
    new_dtype,
    open_jaxpr,
    sub_jaxprs,
    while_params,
)
from jaxamp._engine.primitives import CONTAINERS, IDENTITY, IN_LINE, LOOPS

__all__ = ["LOW_PRECISION", "Flat", "Run", "Span", "Sub", "all_consumers_accept", "as_jaxpr",
           "consumers", "containing", "duplicate_casts", "equations", "evaluate",
           "evaluate_rerouted", "feeders", "flat_scopes", "iter_eqns", "iter_jaxprs",
           "jit_inlines", "lossy_round_trips", "name_stack", "param_matmuls", "producers",
           "readers", "span_io", "spans", "sub_programs", "transposed_equations", "walk"]

LOW_PRECISION = (np.dtype("float16"), np.dtype("bfloat16"))


def as_jaxpr(j: Any) -> jcore.Jaxpr:
    return open_jaxpr(j)[0]


def equations(j: Any) -> list:
    """The equations of ``j`` (not of its sub-programs), in order."""
    return list(as_jaxpr(j).eqns)


def name_stack(eqn, prefix: str = "") -> str:
    """``eqn``'s name stack as a string, below ``prefix`` (its caller's stack)."""
    stack = str(eqn.source_info.name_stack)
    return f"{prefix}/{stack}" if prefix and stack else (prefix or stack)


# ---- running a jaxpr ------------------------------------------------------------------------


class Run(NamedTuple):
    """Equations up to ``end`` run as one: ``fn(values of ins) -> values of outs``."""

    end: int
    ins: list
    outs: list
    fn: Callable[[list], Sequence[Any]]


def evaluate(j: Any, consts: Sequence[Any] | None, args: Sequence[Any],
             run_eqn: Callable[[Any, list], Sequence[Any]],
             literal: Callable[[Any], Any] = lambda lit: lit.val,
             runs: dict[int, Run] | None = None) -> list:
    """Runs ``j``'s equations in order (``run_eqn(eqn, operand values)`` -> output values) and
    returns its outputs. ``consts``: the constvars' values (None: the closed jaxpr's own);
    ``runs``: equation index -> a :class:`Run` that replaces it and the equations after it."""
    jaxpr, own = open_jaxpr(j)
    env: dict[Any, Any] = {}
    for var, x in zip(jaxpr.constvars, (own or []) if consts is None else consts):
        env[var] = x
    for var, x in zip(jaxpr.invars, args):
        env[var] = x

    def read(var):
        return literal(var) if isinstance(var, jcore.Literal) else env[var]

    def write(outvars, outs):
        for var, out in zip(outvars, outs):
            if not isinstance(var, jcore.DropVar):
                env[var] = out

    eqns, i = jaxpr.eqns, 0
    while i < len(eqns):
        run = runs.get(i) if runs else None
        if run is not None:
            write(run.outs, run.fn([read(v) for v in run.ins]))
            i = run.end
            continue
        eqn = eqns[i]
        write(eqn.outvars, run_eqn(eqn, [read(v) for v in eqn.invars]))
        i += 1
    return [read(v) for v in jaxpr.outvars]


def evaluate_rerouted(j: Any, args: Sequence[Any],
                      reroute: Sequence[Callable[[Any], Any] | None]) -> tuple[list, list[bool]]:
    """Runs the closed jaxpr ``j`` on ``args`` as it is, except that output ``k`` is replaced
    by ``reroute[k](value)`` as soon as a top-level equation computes it (later equations and
    the output read the replacement). Returns ``(outputs, rerouted)``: whether output ``k``
    was replaced (not an input or literal of ``j``, nor with ``reroute[k]`` None)."""
    jaxpr = as_jaxpr(j)
    first: dict[Any, Callable] = {}
    for var, fn in zip(jaxpr.outvars, reroute):
        if fn is not None and isinstance(var, jcore.Var):
            first.setdefault(var, fn)
    done: set = set()

    def run_eqn(eqn, vals):
        outs = bind_with_params(eqn, vals)
        outs = list(outs) if eqn.primitive.multiple_results else [outs]
        for i, var in enumerate(eqn.outvars):
            if var in first and var not in done:
                outs[i] = first[var](outs[i])
                done.add(var)
        return outs

    outs = evaluate(j, None, args, run_eqn)
    return outs, [isinstance(v, jcore.Var) and v in done for v in jaxpr.outvars]


def consumers(j: Any) -> dict[Any, list]:
    """Each var of ``j`` (not of its sub-programs) -> the equations that read it."""
    uses: dict[Any, list] = {}
    for eqn in as_jaxpr(j).eqns:
        for v in eqn.invars:
            if isinstance(v, jcore.Var):
                uses.setdefault(v, []).append(eqn)
    return uses


def producers(j: Any) -> dict[Any, Any]:
    """Each var an equation of ``j`` makes (not in its sub-programs) -> that equation."""
    return {v: eqn for eqn in as_jaxpr(j).eqns for v in eqn.outvars
            if not isinstance(v, jcore.DropVar)}


def all_consumers_accept(j: Any, accept: Callable[[Any, set], bool], seeds: Sequence[bool]
                         ) -> set:
    """Vars of ``j`` whose every consumer satisfies ``accept(eqn, found)``, found backwards
    from the outputs (``seeds``: which outputs count as accepted); ``found``: the set so far."""
    jaxpr = as_jaxpr(j)
    uses = consumers(jaxpr)
    found = {v for v, s in zip(jaxpr.outvars, seeds) if s and isinstance(v, jcore.Var)}
    blocked = {v for v, s in zip(jaxpr.outvars, seeds) if not s and isinstance(v, jcore.Var)}
    for eqn in reversed(jaxpr.eqns):
        for out in eqn.outvars:
            if out in blocked or out in found:
                continue
            eqn_uses = uses.get(out, [])
            if eqn_uses and all(accept(u, found) for u in eqn_uses):
                found.add(out)
    return found


class Span(NamedTuple):
    """Equations ``start:end`` found by :func:`spans`; ``skipped``: those among them not in
    the run (they read nothing it made and run before it)."""

    start: int
    end: int
    skipped: tuple


def spans(j: Any, member: Sequence[bool], skippable: Callable[[Any], bool],
          stops: Callable[[int], bool]) -> list[Span]:
    """Maximal runs of consecutive equations of ``j`` whose ``member`` flag is set, from a
    member to its last member. A run goes past a ``skippable(eqn)`` non-member that reads
    nothing the run made (listed in ``skipped``), never past an index where ``stops(i)``
    (though a run may start at one), and ends at any other non-member."""
    eqns = as_jaxpr(j).eqns
    found, i = [], 0
    while i < len(eqns):
        if not member[i]:
            i += 1
            continue
        k, made, skipped, last = i, set(), [], i
        while k < len(eqns) and (k == i or not stops(k)):
            eqn = eqns[k]
            if member[k]:
                made.update(eqn.outvars)
                last = k
            elif skippable(eqn) and not any(
                    isinstance(v, jcore.Var) and v in made for v in eqn.invars):
                skipped.append(k)
            else:
                break
            k += 1
        found.append(Span(i, last + 1, tuple(s for s in skipped if s <= last)))
        i = last + 1
    return found


def span_io(j: Any, indices: Sequence[int], end: int) -> tuple[list, list]:
    """``(inputs, outputs)`` of equations ``indices`` of ``j`` (all before ``end``): the vars
    they read and none of them made, and those they make that ``j`` reads from ``end`` on."""
    jaxpr = as_jaxpr(j)
    eqns = jaxpr.eqns
    later: set = {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}
    for eqn in eqns[end:]:
        later.update(v for v in eqn.invars if isinstance(v, jcore.Var))
    made, inputs, seen = set(), [], set()
    for k in indices:
        for v in eqns[k].invars:
            if isinstance(v, jcore.Var) and v not in made and v not in seen:
                seen.add(v)
                inputs.append(v)
        made.update(eqns[k].outvars)
    outputs = [v for k in indices for v in eqns[k].outvars
               if not isinstance(v, jcore.DropVar) and v in later]
    return inputs, outputs


# ---- the sub-programs of an equation --------------------------------------------------------


class Sub(NamedTuple):
    """A sub-program of an equation: its open jaxpr and consts, and per input/output the
    caller's var it stands for (None where none does: a loop's carry, an unknown arity)."""

    jaxpr: jcore.Jaxpr
    consts: list
    ins: list
    outs: list


def _sub(j, ins, outs) -> Sub:
    jaxpr, consts = open_jaxpr(j)
    return Sub(jaxpr, consts or [], list(ins), list(outs))


def sub_programs(eqn) -> list[Sub]:
    """The sub-programs of ``eqn``; none for a first-order equation or a typed combiner (such
    as scatter-add's, where the equation itself is the operation)."""
    name = eqn.primitive.name
    ins, outs = list(eqn.invars), list(eqn.outvars)
    subs = sub_jaxprs(eqn)
    if not subs:
        return []
    if name not in CONTAINERS and not any(len(as_jaxpr(s).invars) == len(ins) for s in subs):
        return []
    if name == "cond":
        return [_sub(b, ins[1:], outs) for b in cond_params(eqn).branches]
    if name == "while":
        p = while_params(eqn)
        cn, bn = p.cond_nconsts, p.body_nconsts
        carry = ins[cn + bn:]
        return [_sub(p.cond_jaxpr, ins[:cn] + carry, [None]),
                _sub(p.body_jaxpr, ins[cn:cn + bn] + carry, outs)]
    found = []
    for s in subs:
        jaxpr = as_jaxpr(s)
        sin = ins if len(jaxpr.invars) == len(ins) else [None] * len(jaxpr.invars)
        sout = outs if len(jaxpr.outvars) == len(outs) else [None] * len(jaxpr.outvars)
        found.append(_sub(s, sin, sout))
    return found


# ---- visiting every equation ----------------------------------------------------------------


def walk(j: Any, leaf: Callable[[Any, str], None], *,
         enter: Callable[[Any, Sub, str], None] | None = None,
         leave: Callable[[Any, list[Sub], str], None] | None = None,
         prefix: str = "") -> None:
    """Visits every equation of ``j`` and its sub-programs in execution order: ``leaf(eqn,
    stack)`` for a first-order one; else ``enter(eqn, sub, stack)`` before each sub-program
    and ``leave(eqn, subs, stack)`` after them (``stack``: the full :func:`name_stack`)."""
    for eqn in as_jaxpr(j).eqns:
        stack = name_stack(eqn, prefix)
        subs = sub_programs(eqn)
        if not subs:
            leaf(eqn, stack)
            continue
        for sub in subs:
            if enter is not None:
                enter(eqn, sub, stack)
            walk(sub.jaxpr, leaf, enter=enter, leave=leave, prefix=stack)
        if leave is not None:
            leave(eqn, subs, stack)


def feeders(j: Any, outs: Sequence[Any], stop: frozenset[str] = frozenset()) -> list:
    """The top-level equations of ``j`` whose outputs reach ``outs``, walking back (the inputs
    of primitives in ``stop`` are not followed)."""
    reach = {v for v in outs if isinstance(v, jcore.Var)}
    found = []
    for e in reversed(as_jaxpr(j).eqns):
        if any(o in reach for o in e.outvars):
            found.append(e)
            if e.primitive.name not in stop:
                reach.update(v for v in e.invars if isinstance(v, jcore.Var))
    return found


def readers(j: Any, var) -> list:
    """The first-order equations that read ``var``, followed into sub-programs, in order."""
    found = []
    for eqn in as_jaxpr(j).eqns:
        if not any(v is var for v in eqn.invars):
            continue
        subs = sub_programs(eqn)
        if not subs:
            found.append(eqn)
        for sub in subs:
            for inner, outer in zip(sub.jaxpr.invars, sub.ins):
                if outer is var:
                    found += readers(sub.jaxpr, inner)
    return found


def transposed_equations(j: Any) -> set[int]:
    """``id`` of each equation of ``j`` (sub-programs included) whose full name stack names a
    ``transpose`` (a transposed checkpoint's body is marked by the checkpoint equation)."""
    found: set[int] = set()

    def mark(eqn, *args):
        if "transpose(" in args[-1]:
            found.add(id(eqn))

    walk(j, mark, enter=mark)
    return found


def iter_jaxprs(j: Any) -> Iterator[jcore.Jaxpr]:
    """The jaxpr and every sub-jaxpr, depth first."""
    jaxpr = as_jaxpr(j)
    yield jaxpr
    for eqn in jaxpr.eqns:
        for sub in sub_jaxprs(eqn):
            yield from iter_jaxprs(sub)


def iter_eqns(j: Any) -> Iterator[jcore.JaxprEqn]:
    """Every equation of a jaxpr and of its sub-jaxprs."""
    for jaxpr in iter_jaxprs(j):
        yield from jaxpr.eqns


@functools.cache
def jit_inlines() -> bool:
    """Whether ``compat.inline_jit`` calls are inlined into their caller's jaxpr, under autodiff
    too (if not, autocast calls its cached bodies unjitted)."""
    try:
        f = inline_jit(lambda x: x + 1)
        for fn in (lambda x: f(x) * 2, jax.value_and_grad(lambda x: f(x) * 2)):
            closed = jax.make_jaxpr(fn)(1.0)
            if any(e.primitive.name == "jit" for e in iter_eqns(closed)):
                return False
        return True
    except Exception:  # pragma: no cover - be conservative
        return False


def containing(j: Any, eqn) -> jcore.Jaxpr | None:
    """The jaxpr among ``j`` and its sub-jaxprs whose equations include ``eqn``."""
    for jaxpr in iter_jaxprs(j):
        if any(e is eqn for e in jaxpr.eqns):
            return jaxpr
    return None


def param_matmuls(j: Any, matmuls: frozenset[str], passes: frozenset[str],
                  inputs: Sequence[int] | None = None) -> list[tuple[Any, bool]]:
    """The ``matmuls`` equations with an operand that is an input or const of ``j`` (only the
    inputs at positions ``inputs``, and no const, where given), directly or through
    ``passes`` only (reshape, transpose, convert), in execution order, each with whether it
    sits in a loop body."""
    found: list[tuple[Any, bool]] = []

    def visit(jaxpr, consts_params: bool, params: set, in_loop: bool) -> None:
        jaxpr = as_jaxpr(jaxpr)
        if consts_params:
            params.update(jaxpr.constvars)
        for eqn in jaxpr.eqns:
            subs = sub_programs(eqn)
            name = eqn.primitive.name
            if subs:
                loop = in_loop or name in LOOPS
                for sub in subs:
                    inner = {v for v, o in zip(sub.jaxpr.invars, sub.ins)
                             if o is not None and not isinstance(o, jcore.Literal)
                             and o in params}
                    inner.update(sub.jaxpr.constvars)
                    visit(sub.jaxpr, False, inner, loop)
                    params.update(o for v, o in zip(sub.jaxpr.outvars, sub.outs)
                                  if o is not None and not isinstance(v, jcore.Literal)
                                  and v in inner)
                continue
            reads = [v for v in eqn.invars if not isinstance(v, jcore.Literal) and v in params]
            if name in matmuls and reads:
                found.append((eqn, in_loop))
            elif name in passes and reads:
                params.update(eqn.outvars)

    top = as_jaxpr(j)
    if inputs is None:
        visit(top, True, set(top.invars), False)
    else:
        visit(top, False, {top.invars[i] for i in inputs}, False)
    return found


# ---- checks on casts ------------------------------------------------------------------------

class Flat(NamedTuple):
    """A first-order equation with, per operand/result, the outermost var of the same value."""

    eqn: Any
    ins: list
    outs: list


def flat_scopes(j: Any) -> list[list[Flat]]:
    """The first-order equations of ``j``, seeing through in-line calls (``pjit``,
    ``checkpoint``, ``custom_jvp_call``, ...) and ``optimization_barrier``: a value passed
    in or out is one value on both sides. One list per scope: ``j``, then each loop body or
    branch and each differentiated ``checkpoint`` (a backward replay), whose inputs are new."""
    scopes: list[list[Flat]] = []
    calls = iter(range(1, 1 << 62))  # one number per body run: a jaxpr called twice (a
    # shared module call, one jit per layer) makes new values each time

    def scope(jaxpr) -> None:
        found: list[Flat] = []
        scopes.append(found)
        flatten(as_jaxpr(jaxpr), {}, found, 0)

    def flatten(jaxpr, env: dict, found: list, call: int) -> None:
        def same(v):
            if not isinstance(v, jcore.Var):
                return v
            return env.get(v, v if not call else (call, v))

        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name in IDENTITY and len(eqn.invars) == len(eqn.outvars):
                env.update((o, same(v)) for o, v in zip(eqn.outvars, eqn.invars))
                continue
            subs = sub_programs(eqn)
            if not subs:
                found.append(Flat(eqn, [same(v) for v in eqn.invars],
                                  [same(v) for v in eqn.outvars]))
                continue
            for sub in subs:
                if name not in IN_LINE or None in sub.ins \
                        or eqn.params.get("differentiated"):  # a backward replay
                    scope(sub.jaxpr)
                    continue
                inner = {v: same(o) for v, o in zip(sub.jaxpr.invars, sub.ins)
                         if isinstance(o, jcore.Var)}  # (a literal: a value of its own)
                n = next(calls)
                flatten(sub.jaxpr, inner, found, n)
                env.update((o, inner.get(v, (n, v))) for o, v in zip(sub.outs, sub.jaxpr.outvars)
                           if o is not None and isinstance(v, jcore.Var)
                           and not isinstance(o, jcore.DropVar))

    scope(j)
    return scopes


def _is_cast(eqn) -> bool:
    return eqn.primitive.name == "convert_element_type"


def _scopes(j: Any, nested: bool) -> list[list[Flat]]:
    if nested:
        return flat_scopes(j)
    return [[Flat(e, list(e.invars), list(e.outvars)) for e in jaxpr.eqns]
            for jaxpr in iter_jaxprs(j)]


def lossy_round_trips(j: Any, *, nested: bool = True) -> list[jcore.JaxprEqn]:
    """Casts that take a value float32 -> float16/bfloat16 -> float32 (precision thrown away);
    ``nested``: also across an in-line call's boundary (:func:`flat_scopes`)."""
    found = []
    for flat in _scopes(j, nested):
        down = {f.outs[0] for f in flat
                if _is_cast(f.eqn) and np.dtype(f.eqn.invars[0].aval.dtype) == np.float32
                and np.dtype(f.eqn.outvars[0].aval.dtype) in LOW_PRECISION}
        found += [f.eqn for f in flat if _is_cast(f.eqn) and f.ins[0] in down
                  and np.dtype(f.eqn.outvars[0].aval.dtype) == np.float32]
    return found


def duplicate_casts(j: Any, *, nested: bool = True
                    ) -> list[tuple[jcore.JaxprEqn, jcore.JaxprEqn]]:
    """Pairs of casts of the same floating value to the same dtype; ``nested``: also across an
    in-line call's boundary (:func:`flat_scopes`). Integers are skipped: autocast never casts
    them, so such a pair is the traced code's own."""
    found = []
    for flat in _scopes(j, nested):
        seen: dict = {}
        for f in flat:
            e = f.eqn
            if not _is_cast(e) or not isinstance(e.invars[0], jcore.Var) \
                    or not jnp.issubdtype(e.invars[0].aval.dtype, jnp.floating):
                continue
            key = (f.ins[0], np.dtype(new_dtype(e)))
            if key in seen:
                found.append((seen[key], e))
            else:
                seen[key] = e
    return found
