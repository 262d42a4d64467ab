"""Every use of JAX internals in jaxamp, in one place: what to fix when JAX moves.

jaxamp re-evaluates jaxprs, so it reads equation parameters that JAX does not document. The
public ``jax.extend`` API covers most of it (``jax.extend.core``, ``jax.extend.source_info_util``);
what it does not cover is here, checked on jax 0.10.2, 0.11.x and 0.12.0.1.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import jax
import jax.extend.core as jcore
from jax.extend import source_info_util

__all__ = [
    "Tracer",
    "bind_with_params",
    "close_jaxpr",
    "dce_jaxpr",
    "inline_jit",
    "mesh_context",
    "mesh_is_set",
    "jit_inlines",
    "open_jaxpr",
    "scan_counts",
    "shard_map_again",
    "source_context",
]

#: JAX's tracer base class (``jax.core.Tracer``; public, but its home has moved before).
Tracer = jax.core.Tracer

# jax >= 0.11 merged ClosedJaxpr into Jaxpr: a Jaxpr carries its own consts.
_CLOSED_IS_OPEN = jcore.ClosedJaxpr is jcore.Jaxpr


def open_jaxpr(j: Any) -> tuple[jcore.Jaxpr, list | None]:
    """``(jaxpr, consts)`` of a closed jaxpr; ``consts`` is None for an open one (whose
    constvars, if any, the caller binds)."""
    if _CLOSED_IS_OPEN:
        consts = getattr(j, "consts", None)
        return j, (list(consts) if consts is not None else None)
    if isinstance(j, jcore.ClosedJaxpr):
        return j.jaxpr, list(j.consts)
    return j, None


def close_jaxpr(jaxpr: jcore.Jaxpr, consts=()) -> Any:
    """A closed jaxpr of ``jaxpr`` and its ``consts`` (what ``jaxprs_in_params`` yields)."""
    if _CLOSED_IS_OPEN:
        return jaxpr if not consts else jaxpr.with_consts(list(consts))
    return jcore.ClosedJaxpr(jaxpr, list(consts))


def scan_counts(params: dict) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation.

    jax <= 0.10 stores them as ``num_consts``/``num_carry``; jax >= 0.11 stores the flat
    argument groups ``ft_in = (consts, carry, xs)``.
    """
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()  # a jax._src.flattree.FlatTree
    return len(consts), len(carry)


def bind_with_params(eqn, vals):
    """Binds ``eqn``'s primitive on ``vals`` with its equation params (as ``eval_jaxpr`` does:
    higher-order primitives turn their jaxpr params back into callables)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(params, tuple):  # (subfuns, params)
        subfuns, params = params
        return eqn.primitive.bind(*subfuns, *vals, **params)
    return eqn.primitive.bind(*vals, **params)


def shard_map_again(eqn, body, vals):
    """``body(*vals)`` run per device as ``eqn`` (a ``shard_map`` equation) ran its jaxpr: the
    same mesh, in/out specs, manual axes and replication check, through the public
    ``jax.shard_map``. ``body`` returns a list of per-device values.

    jax >= 0.6 stores the manual axes as ``newly_manual_axes`` and the check as ``check_vma``
    (jax 0.10 and 0.12 alike); older versions stored the automatic axes (``auto``) and
    ``check_rep``."""
    p = eqn.params
    manual = p.get("newly_manual_axes")
    if manual is None:
        manual = frozenset(p["mesh"].axis_names) - frozenset(p.get("auto", ()))
    check = p["check_vma"] if "check_vma" in p else p.get("check_rep", True)
    fn = jax.shard_map(lambda *xs: tuple(body(*xs)), mesh=p["mesh"],
                       in_specs=tuple(p["in_specs"]), out_specs=tuple(p["out_specs"]),
                       axis_names=frozenset(manual), check_vma=check)
    return list(fn(*vals))


def custom_vjp_name(eqn) -> str:
    """The Python name of the function behind a ``custom_vjp_call`` equation ('' if unknown)."""
    call = eqn.params.get("call_jaxpr")
    info = getattr(getattr(call, "jaxpr", call), "debug_info", None)
    src = getattr(info, "func_src_info", None) or ""
    return src.split(" ", 1)[0]


def source_context(eqn):
    """A context that gives the equations bound inside it ``eqn``'s source info and name
    stack (so module paths survive the rewrite, for audits and profiles)."""
    try:
        stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        return source_info_util.user_context(eqn.source_info.traceback, name_stack=stack)
    except Exception:  # pragma: no cover - internal API moved: paths are lost, nothing else
        return contextlib.nullcontext()


def dce_jaxpr(jaxpr: jcore.Jaxpr) -> tuple[jcore.Jaxpr, list[bool]]:
    """Dead-code elimination keeping every output: ``(jaxpr, used_inputs)``."""
    from jax._src.interpreters import partial_eval as pe  # no public equivalent

    return pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))


def mesh_context(mesh):
    """A context in which ``mesh`` is the current mesh, for bare ``PartitionSpec`` sharding
    constraints and Flax's logical constraints (which read ``jax.sharding.get_abstract_mesh``).
    ``jax.set_mesh`` (jax >= 0.7) replaced ``jax.sharding.use_mesh``."""
    setter = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh
    return setter(mesh)


def mesh_is_set() -> bool:
    """Whether code is being traced under a (non-empty) current mesh (``jax.set_mesh``)."""
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    if get is None:  # pragma: no cover - older jax
        return False
    mesh = get()
    return mesh is not None and not mesh.empty


def inline_jit(fun):
    """``jax.jit(fun)`` inlined into the jaxpr of its caller when traced: jax 0.10 does this
    for ``inline=True``; jax >= 0.12 keeps a ``jit`` equation for that (inlined only when
    lowered) and inlines at trace time for ``inline=jax.Inline.JAX_EARLY``."""
    mode = getattr(jax, "Inline", None)
    return jax.jit(fun, inline=True if mode is None else mode.JAX_EARLY)


@functools.cache
def jit_inlines() -> bool:
    """Whether :func:`inline_jit` calls are inlined into the jaxpr that calls them, under
    autodiff too (checked once; if not, autocast binds primitives directly)."""
    try:
        f = inline_jit(lambda x: x + 1)
        for fn in (lambda x: f(x) * 2, jax.value_and_grad(lambda x: f(x) * 2)):
            closed = jax.make_jaxpr(fn)(1.0)
            if any(e.primitive.name in ("jit", "pjit") for e in _eqns_of(closed)):
                return False
        return True
    except Exception:  # pragma: no cover - be conservative
        return False


def _eqns_of(closed):
    from jaxamp._jaxpr import iter_eqns  # the one reader of equations

    return list(iter_eqns(closed))
