"""Which module calls autocast evaluates once and replays (a Transformer's N layers).

Every module call is a contiguous run of equations under its mark; :meth:`Sharing.plan`
builds that tree and gives each call a structural signature. Calls whose signature repeats
are evaluated once per (signature, what is known of their inputs, region) as a cached body
and replayed under each call's own name-stack prefix; only calls whose float inputs are read
inside the call alone are shared (a value used elsewhere keeps its one cast per dtype).
:meth:`Sharing.program_key` gives sub-programs the same structural identity.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax.extend.core as jcore
import numpy as np

from jaxamp._engine.compat import call_name, name_scopes, open_jaxpr
from jaxamp._engine.context import Context
from jaxamp._engine.jaxpr import equations
from jaxamp._engine.values import is_float

__all__ = ["Node", "Program", "Sharing"]


class Program(NamedTuple):
    """A run of a jaxpr's equations as a program of its own (duck-typed as an open jaxpr).
    ``drop``: the marker scope whose name-stack prefix its equations leave out when they are
    bound (the prefix of the call being replayed is put in front instead)."""

    constvars: list
    invars: list
    outvars: list
    eqns: list
    drop: str | None = None


@dataclasses.dataclass(eq=False)
class Node:
    """One module call: equations ``start:end`` of a jaxpr, under marker ``marker``."""

    marker: int
    start: int
    end: int = -1
    children: list = dataclasses.field(default_factory=list)
    sig: Any = None
    inputs: list = dataclasses.field(default_factory=list)
    outputs: list = dataclasses.field(default_factory=list)
    local_inputs: bool = True  # every float input is read inside this call only


def _literal_key(lit) -> tuple:
    val = lit.val
    return ("lit", str(np.asarray(val).dtype), repr(val))


def _aval_key(v) -> tuple:
    aval = v.aval
    return (getattr(aval, "shape", None), str(getattr(aval, "dtype", type(aval).__name__)),
            bool(getattr(aval, "weak_type", False)))


class Sharing:
    """Structural signatures and sharing plans of one autocast evaluation."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.keys: dict[int, tuple[Any, Any]] = {}  # id(jaxpr) -> (jaxpr kept alive, key)
        self.plans: dict = {}

    # ---- signatures -----------------------------------------------------------------------
    def program_key(self, closed) -> Any:
        """A key equal for structurally equal programs (sub-jaxprs compared by their own
        keys, consts by identity); cached per jaxpr object."""
        jaxpr, consts = open_jaxpr(closed)
        known = self.keys.get(id(jaxpr))
        if known is not None and known[0] is jaxpr:
            return known[1]
        refs: dict = {}
        for i, v in enumerate(jaxpr.constvars):
            refs[v] = ("const", i)
        for i, v in enumerate(jaxpr.invars):
            refs[v] = ("in", i)
        items = []
        for j, eqn in enumerate(equations(jaxpr)):
            items.append(self.eqn_key(eqn, refs, None))
            for k, v in enumerate(eqn.outvars):
                refs[v] = ("o", j, k)
        key = ("program", tuple(_aval_key(v) for v in (*jaxpr.constvars, *jaxpr.invars)),
               tuple(items), tuple(self.ref(refs, v) for v in jaxpr.outvars),
               tuple(id(c) for c in consts or ()))
        try:
            hash(key)
        except TypeError:
            key = ("program-id", id(jaxpr))
        self.keys[id(jaxpr)] = (jaxpr, key)
        return key

    @staticmethod
    def ref(refs: dict, v) -> tuple:
        if isinstance(v, jcore.Literal):
            return _literal_key(v)
        return refs[v]

    def params_key(self, eqn) -> Any:
        items = []
        recorded = self.ctx.attention.get(call_name(eqn))
        for k, v in eqn.params.items():
            if k == "name" and recorded is not None:
                names, static, _ = recorded
                v = ("attention", names, repr(sorted(static.items())))
            items.append((k, self.freeze(v)))
        key = tuple(items)
        try:
            hash(key)
            return key
        except TypeError:
            return ("eqn", id(eqn))

    def freeze(self, v) -> Any:
        if isinstance(v, jcore.Jaxpr | jcore.ClosedJaxpr):
            return self.program_key(v)
        if isinstance(v, tuple | list):
            return tuple(self.freeze(x) for x in v)
        return v

    def stack_key(self, eqn, marker: int | None) -> tuple:
        """``eqn``'s name stack below the scope of module call ``marker`` (all of it for
        None), without this call's marks."""
        parts = name_scopes(eqn)
        if marker is not None:
            scope = self.ctx.marks.scope_of[marker]
            parts = parts[next((i for i, p in enumerate(parts) if p.name == scope), -1) + 1:]
        return tuple(p for p in parts if p.name not in self.ctx.marks.by_scope)

    def eqn_key(self, eqn, refs: dict, marker: int | None) -> tuple:
        policies = tuple(self.ctx.policies[i] for i in self.ctx.marks.regions(eqn))
        # the first/last matmul (kept out of FP8) is not the same as its repeats
        end = self.ctx.matmul_ends.get(id(eqn))
        return (eqn.primitive, self.params_key(eqn), tuple(self.ref(refs, v) for v in eqn.invars),
                tuple(_aval_key(v) for v in eqn.outvars), self.stack_key(eqn, marker), policies,
                end)

    # ---- plans ----------------------------------------------------------------------------
    def plan(self, jaxpr, wants: set, out_wants: Sequence[bool]) -> dict[int, Node]:
        """The module calls of ``jaxpr`` to evaluate once per signature: start index ->
        :class:`Node` (only calls whose signature occurs more than once, outermost first).
        ``wants`` (the vars wanted in float32) follows from ``out_wants``."""
        key = (id(jaxpr), tuple(out_wants))
        known = self.plans.get(key)
        if known is not None and known[0] is jaxpr:
            return known[1]
        plan = self._plan(jaxpr, wants)
        self.plans[key] = (jaxpr, plan)
        return plan

    def _plan(self, jaxpr, wants: set) -> dict[int, Node]:
        eqns = equations(jaxpr)
        roots = self._tree(eqns)
        if not roots:
            return {}
        last_use: dict = {}
        first_use: dict = {}
        for i, eqn in enumerate(eqns):
            for v in eqn.invars:
                if isinstance(v, jcore.Var):
                    last_use[v] = i
                    first_use.setdefault(v, i)
        for v in jaxpr.outvars:
            if isinstance(v, jcore.Var):
                last_use[v] = len(eqns)
        counts: dict = {}

        def visit(node: Node) -> None:
            for child in node.children:
                visit(child)
            self._sign(node, eqns, wants, last_use, first_use)
            counts[node.sig] = counts.get(node.sig, 0) + 1

        for root in roots:
            visit(root)
        plan: dict[int, Node] = {}

        def choose(node: Node) -> None:
            if counts[node.sig] > 1 and node.local_inputs and node.outputs:
                plan[node.start] = node
                return
            for child in node.children:
                choose(child)

        for root in roots:
            choose(root)
        return plan

    def _tree(self, eqns: Sequence) -> list[Node]:
        """The module calls of ``eqns`` as a forest of contiguous runs."""
        roots: list[Node] = []
        open_: list[Node] = []
        for i, eqn in enumerate(eqns):
            path = self.ctx.marks.regions(eqn)
            depth = 0
            while depth < min(len(open_), len(path)) and open_[depth].marker == path[depth]:
                depth += 1
            for node in open_[depth:]:
                node.end = i
            del open_[depth:]
            for marker in path[depth:]:
                node = Node(marker, i)
                (open_[-1].children if open_ else roots).append(node)
                open_.append(node)
        for node in open_:
            node.end = len(eqns)
        return roots

    def _sign(self, node: Node, eqns, wants, last_use, first_use) -> None:
        refs: dict = {}
        inputs: list = []

        def ref(v):
            if isinstance(v, jcore.Literal):
                return _literal_key(v)
            r = refs.get(v)
            if r is None:
                r = refs[v] = ("in", len(inputs))
                inputs.append(v)
            return r

        items: list = []
        made: list = []  # vars this call defines that something after it may read
        pos, children = node.start, iter(node.children)
        child = next(children, None)
        while pos < node.end:
            if child is not None and child.start == pos:
                items.append(("call", child.sig, tuple(ref(v) for v in child.inputs)))
                for k, v in enumerate(child.outputs):
                    refs[v] = ("o", len(items) - 1, k)
                made += child.outputs
                pos, child = child.end, next(children, None)
                continue
            eqn = eqns[pos]
            key = self.eqn_key(eqn, _Refs(ref), node.marker)
            items.append((*key, tuple(o in wants for o in eqn.outvars)))
            for k, v in enumerate(eqn.outvars):
                refs[v] = ("o", len(items) - 1, k)
            made += eqn.outvars
            pos += 1
        node.inputs = inputs
        node.outputs = [v for v in made if last_use.get(v, -1) >= node.end]
        node.local_inputs = all(
            not is_float(getattr(v.aval, "dtype", None))
            or (last_use.get(v, -1) < node.end and first_use.get(v, node.start) >= node.start)
            for v in inputs)
        node.sig = (self.ctx.policies[node.marker], tuple(_aval_key(v) for v in inputs),
                    tuple(items), tuple(refs[v] for v in node.outputs),
                    tuple(v in wants for v in node.outputs))


class _Refs:
    """``refs[v]`` through a function (first use makes an input)."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, v):
        return self.fn(v)
