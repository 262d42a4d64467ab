"""Which module calls autocast evaluates once and replays (a Transformer's N layers).

Every module call is a contiguous run of equations under its mark; :func:`plan` builds that
tree and gives each call a structural signature. Calls whose signature repeats are evaluated
once per (signature, what is known of their inputs, region) as a cached body and replayed
under each call's own name-stack prefix; only calls whose float inputs are read inside the
call alone are shared (a value used elsewhere keeps its one cast per dtype).
:func:`program_key` gives sub-programs the same structural identity. Both are pure functions
of a jaxpr and the :class:`Facts` they read; the caches are the caller's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax.extend.core as jcore
import numpy as np

from jaxamp._engine.compat import call_name, name_scopes, open_jaxpr
from jaxamp._engine.jaxpr import equations
from jaxamp._engine.values import is_float

__all__ = ["Facts", "Node", "Program", "plan", "program_key"]


class Facts(NamedTuple):
    """What planning reads of one autocast evaluation: of the call's marks, ``regions(eqn)``
    (its region ids, outermost first), ``scope_of`` (region -> scope name) and ``by_scope``
    (scope name -> mark); the ``policies`` per region; ``attention`` (jit name -> a recorded
    attention call) and ``matmul_ends`` (id(eqn) -> ``"first"``/``"last"``)."""

    regions: Callable[[Any], tuple[int, ...]]
    scope_of: Mapping[int, str]
    by_scope: Mapping[str, Any]
    policies: Sequence[Any]
    attention: Mapping[str, Any]
    matmul_ends: Mapping[int, str]


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
    return ("lit", str(np.asarray(lit.val).dtype), repr(lit.val))


def _aval_key(v) -> tuple:
    aval = v.aval
    return (getattr(aval, "shape", None), str(getattr(aval, "dtype", type(aval).__name__)),
            bool(getattr(aval, "weak_type", False)))


def program_key(closed, facts: Facts, keys: dict) -> Any:
    """A key equal for structurally equal programs (sub-jaxprs compared by their own keys,
    consts by identity). A pure function; ``keys`` (id(jaxpr) -> (it, its key)) is the
    caller's cache, shared between the programs of one trace."""
    jaxpr, consts = open_jaxpr(closed)
    known = keys.get(id(jaxpr))
    if known is not None and known[0] is jaxpr:
        return known[1]
    refs: dict = {v: ("const", i) for i, v in enumerate(jaxpr.constvars)}
    refs.update((v, ("in", i)) for i, v in enumerate(jaxpr.invars))

    def ref(v):
        return _literal_key(v) if isinstance(v, jcore.Literal) else refs[v]

    items = []
    for j, eqn in enumerate(equations(jaxpr)):
        items.append(_eqn_key(eqn, ref, None, facts, keys))
        refs.update((v, ("o", j, k)) for k, v in enumerate(eqn.outvars))
    key = ("program", tuple(_aval_key(v) for v in (*jaxpr.constvars, *jaxpr.invars)),
           tuple(items), tuple(ref(v) for v in jaxpr.outvars),
           tuple(id(c) for c in consts or ()))
    try:
        hash(key)
    except TypeError:
        key = ("program-id", id(jaxpr))
    keys[id(jaxpr)] = (jaxpr, key)
    return key


def _params_key(eqn, facts: Facts, keys: dict) -> Any:
    items = []
    recorded = facts.attention.get(call_name(eqn))
    for k, v in eqn.params.items():
        if k == "name" and recorded is not None:
            names, static, _ = recorded
            v = ("attention", names, repr(sorted(static.items())))
        items.append((k, _freeze(v, facts, keys)))
    key = tuple(items)
    try:
        hash(key)
        return key
    except TypeError:
        return ("eqn", id(eqn))


def _freeze(v, facts: Facts, keys: dict) -> Any:
    if isinstance(v, jcore.Jaxpr | jcore.ClosedJaxpr):
        return program_key(v, facts, keys)
    if isinstance(v, tuple | list):
        return tuple(_freeze(x, facts, keys) for x in v)
    return v


def _stack_key(eqn, marker: int | None, facts: Facts) -> tuple:
    """``eqn``'s name stack below the scope of module call ``marker`` (all of it for None),
    without this call's marks."""
    parts = name_scopes(eqn)
    if marker is not None:
        scope = facts.scope_of[marker]
        parts = parts[next((i for i, p in enumerate(parts) if p.name == scope), -1) + 1:]
    return tuple(p for p in parts if p.name not in facts.by_scope)


def _eqn_key(eqn, ref: Callable, marker: int | None, facts: Facts, keys: dict) -> tuple:
    """``eqn``'s structure, its operands named by ``ref`` (var or literal -> key)."""
    policies = tuple(facts.policies[i] for i in facts.regions(eqn))
    # the first/last matmul (kept out of FP8) is not the same as its repeats
    end = facts.matmul_ends.get(id(eqn))
    return (eqn.primitive, _params_key(eqn, facts, keys), tuple(ref(v) for v in eqn.invars),
            tuple(_aval_key(v) for v in eqn.outvars), _stack_key(eqn, marker, facts), policies,
            end)


def plan(jaxpr, wants: set, facts: Facts, keys: dict) -> dict[int, Node]:
    """The module calls of ``jaxpr`` to evaluate once per signature: start index ->
    :class:`Node` (only calls whose signature occurs more than once, outermost first);
    ``wants``: the vars wanted in float32. A pure function (``keys``: :func:`program_key`'s)."""
    eqns = equations(jaxpr)
    roots = _tree(eqns, facts.regions)
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
        _sign(node, eqns, wants, (last_use, first_use), facts, keys)
        counts[node.sig] = counts.get(node.sig, 0) + 1

    for root in roots:
        visit(root)
    out: dict[int, Node] = {}

    def choose(node: Node) -> None:
        if counts[node.sig] > 1 and node.local_inputs and node.outputs:
            out[node.start] = node
            return
        for child in node.children:
            choose(child)

    for root in roots:
        choose(root)
    return out


def _tree(eqns: Sequence, regions: Callable) -> list[Node]:
    """The module calls of ``eqns`` (``regions``: eqn -> its module calls, outermost first) as
    a forest of contiguous runs."""
    roots: list[Node] = []
    open_: list[Node] = []
    for i, eqn in enumerate(eqns):
        path = regions(eqn)
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


def _sign(node: Node, eqns, wants: set, uses: tuple[dict, dict], facts: Facts,
          keys: dict) -> None:
    """Fills in ``node``'s signature, inputs and outputs (its children's are filled in
    already; ``uses``: var -> the index of its last use, and of its first)."""
    last_use, first_use = uses
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
            refs.update((v, ("o", len(items) - 1, k)) for k, v in enumerate(child.outputs))
            made += child.outputs
            pos, child = child.end, next(children, None)
            continue
        eqn = eqns[pos]
        key = _eqn_key(eqn, ref, node.marker, facts, keys)
        items.append((*key, tuple(o in wants for o in eqn.outvars)))
        refs.update((v, ("o", len(items) - 1, k)) for k, v in enumerate(eqn.outvars))
        made += eqn.outvars
        pos += 1
    node.inputs = inputs
    node.outputs = [v for v in made if last_use.get(v, -1) >= node.end]
    node.local_inputs = all(
        not is_float(getattr(v.aval, "dtype", None))
        or (last_use.get(v, -1) < node.end and first_use.get(v, node.start) >= node.start)
        for v in inputs)
    node.sig = (facts.policies[node.marker], tuple(_aval_key(v) for v in inputs),
                tuple(items), tuple(refs[v] for v in node.outputs),
                tuple(v in wants for v in node.outputs))

