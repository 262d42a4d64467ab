"""Every use of JAX internals in jaxamp, in one place: what to fix when JAX moves.

jaxamp re-evaluates jaxprs, so it reads equation parameters that JAX does not document. The
public ``jax.extend`` API covers most of it (``jax.extend.core``, ``jax.extend.source_info_util``);
what it does not cover is here, checked on jax 0.10.2, 0.11.x and 0.12.0.1.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.extend.core as jcore
from jax.extend import source_info_util

__all__ = ["bind_with_params", "call_jaxpr", "call_name", "checkpoint_in_place", "close_jaxpr",
           "compile_only_gpu", "cond_params", "CondParams", "custom_jvp_params",
           "custom_vjp_name", "custom_vjp_primal_jaxpr", "CustomJvpParams", "dce_jaxpr",
           "device_target_config", "dot_dimension_numbers", "inline_jit", "jit_cache_size",
           "mesh_context", "mesh_is_set", "name_scopes", "named_sub_jaxprs", "new_dtype",
           "open_jaxpr", "remat_params", "RematParams", "scan_counts", "scan_params",
           "ScanParams", "shard_map_again", "shard_map_jaxpr", "source_context", "sub_jaxprs",
           "target_platform", "Tracer", "unnamed_scope", "while_params", "WhileParams"]

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


# ---- typed accessors of equation params ------------------------------------------------------
# Higher-order primitives keep their sub-programs and layout in ``eqn.params`` under names
# that JAX does not document (and that moved between versions): read them here only.


def scan_counts(eqn) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation.

    jax <= 0.10 stores them as ``num_consts``/``num_carry``; jax >= 0.11 stores the flat
    argument groups ``ft_in = (consts, carry, xs)``.
    """
    params = eqn.params
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()  # a jax._src.flattree.FlatTree
    return len(consts), len(carry)


class ScanParams(NamedTuple):
    jaxpr: Any  # the body, closed
    num_consts: int
    num_carry: int
    length: int
    reverse: bool
    unroll: Any


def scan_params(eqn) -> ScanParams:
    p = eqn.params
    nc, nk = scan_counts(eqn)
    return ScanParams(p["jaxpr"], nc, nk, p["length"], p["reverse"], p["unroll"])


class WhileParams(NamedTuple):
    cond_jaxpr: Any
    body_jaxpr: Any
    cond_nconsts: int
    body_nconsts: int


def while_params(eqn) -> WhileParams:
    p = eqn.params
    return WhileParams(p["cond_jaxpr"], p["body_jaxpr"], p["cond_nconsts"], p["body_nconsts"])


class CondParams(NamedTuple):
    branches: tuple  # closed jaxprs, one per branch index


def cond_params(eqn) -> CondParams:
    return CondParams(tuple(eqn.params["branches"]))


class RematParams(NamedTuple):
    jaxpr: Any  # closed
    prevent_cse: bool
    policy: Any


def remat_params(eqn) -> RematParams:
    p = eqn.params
    return RematParams(close_jaxpr(p["jaxpr"]), p.get("prevent_cse", True), p.get("policy"))


def call_jaxpr(eqn) -> Any:
    """The body of a call-like equation (``jit``/``pjit``, ``closed_call``, ``core_call``)."""
    p = eqn.params
    return p["jaxpr"] if "jaxpr" in p else p["call_jaxpr"]


def call_name(eqn) -> str:
    """The function name a ``jit``/``pjit`` equation records ('' if none)."""
    return str(eqn.params.get("name", ""))


def dot_dimension_numbers(eqn):
    """A ``dot_general`` equation's ``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))``."""
    return eqn.params["dimension_numbers"]


def new_dtype(eqn):
    """The target dtype of a ``convert_element_type`` equation."""
    return eqn.params["new_dtype"]


def shard_map_jaxpr(eqn) -> Any:
    return eqn.params["jaxpr"]


def custom_vjp_primal_jaxpr(eqn) -> Any:
    """The primal function of a ``custom_vjp_call`` equation, as a closed jaxpr."""
    return eqn.params["call_jaxpr"]


class CustomJvpParams(NamedTuple):
    call_jaxpr: Any  # the primal, closed
    num_consts: int
    jvp: Callable  # jvp(zeros: list[bool]) -> (jaxpr, consts, out_zeros)


def custom_jvp_params(eqn) -> CustomJvpParams:
    """A ``custom_jvp_call``'s primal and its JVP rule as a function of which tangents are
    symbolic zeros (``jvp_jaxpr_fun`` is a ``lu.WrappedFun``; ``call_wrapped`` runs it)."""
    p = eqn.params
    fun = p["jvp_jaxpr_fun"]
    return CustomJvpParams(p["call_jaxpr"], p["num_consts"],
                           lambda zeros: fun.call_wrapped(*zeros))


def named_sub_jaxprs(eqn) -> list:
    """The sub-jaxprs an equation keeps under a name of its own (``jaxpr``, ``call_jaxpr``,
    ``fun_jaxpr``), closed ones with their consts."""
    return [eqn.params[k] for k in ("jaxpr", "call_jaxpr", "fun_jaxpr")
            if eqn.params.get(k) is not None]


def sub_jaxprs(eqn) -> list:
    """Every jaxpr among ``eqn``'s params (``jax.extend.core.jaxprs_in_params``)."""
    return list(jcore.jaxprs_in_params(eqn.params))


def jit_cache_size(jitted) -> int:
    """How many compiled versions a ``jax.jit`` function holds (``_cache_size``, private)."""
    return jitted._cache_size()


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


def name_scopes(eqn) -> tuple:
    """``eqn``'s name stack as JAX keeps it (``NameStack.stack``): its scopes and transforms,
    each with a ``name``, outermost first; hashable. The one reader of its parts."""
    return eqn.source_info.name_stack.stack


def _split_stack(name_stack, scope: str):
    """``(prefix up to and including the scope named scope, the rest)`` of a name stack."""
    parts = name_stack.stack
    for i, part in enumerate(parts):
        if part.name == scope:
            return (dataclasses.replace(name_stack, stack=parts[:i + 1]),
                    dataclasses.replace(name_stack, stack=parts[i + 1:]))
    return dataclasses.replace(name_stack, stack=()), name_stack


def source_context(eqn, drop: str | None = None, keep: str | None = None):
    """A context that gives the equations bound inside it ``eqn``'s source info and name
    stack (so module paths survive the rewrite, for audits and profiles). ``drop``: leave out
    the part of the stack up to and including the scope of that name (an equation replayed
    under another call's prefix); ``keep``: only that part (the prefix of such a call)."""
    try:
        stack = eqn.source_info.name_stack
        if drop is not None:
            stack = _split_stack(stack, drop)[1]
        elif keep is not None:
            stack = _split_stack(stack, keep)[0]
        stack = source_info_util.current_name_stack() + stack
        return source_info_util.user_context(eqn.source_info.traceback, name_stack=stack)
    except Exception:  # pragma: no cover - internal API moved: paths are lost, nothing else
        return contextlib.nullcontext()


def here() -> Callable[[], Any]:
    """A function giving a context that restores the source info and name stack current now:
    a value made lazily (a cast's ``recast``) is bound where it was asked for, and keeps the
    module path of the equation that defined it."""
    info = source_info_util.current()

    def scope():
        try:
            return source_info_util.user_context(info.traceback, name_stack=info.name_stack)
        except Exception:  # pragma: no cover - internal API moved: paths are lost
            return contextlib.nullcontext()

    return scope


def unnamed_scope():
    """A context with an empty name stack: what is traced inside a ``jax.checkpoint`` body
    records its stack relative to the checkpoint equation (which has the caller's)."""
    try:
        return source_info_util.reset_name_stack()
    except Exception:  # pragma: no cover - internal API moved: paths are lost, nothing else
        return contextlib.nullcontext()


def checkpoint_in_place(fn, policy):
    """``jax.checkpoint(fn, policy=policy)`` bound with an empty name stack, ``fn`` traced
    under the caller's: JAX's partial evaluation of a checkpoint bound under a name stack
    repeats that stack in the backward equations it makes (``a/b/a/b``)."""
    scope = here()

    def inner(*xs):
        with scope():
            return fn(*xs)

    def call(*xs):
        with unnamed_scope():
            return jax.checkpoint(inner, policy=policy)(*xs)

    return call


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


def target_platform() -> str:
    """The platform the program being traced will run on: that of ``jax.default_device`` when
    it is set (:func:`jaxamp.gpu_program` and a step whose inputs sit on another platform set
    it, and JAX keys its trace caches on it), else JAX's default backend."""
    device = jax.config.jax_default_device
    if isinstance(device, str):
        return "gpu" if device in ("cuda", "rocm") else device
    if device is not None:
        return device.platform
    return jax.default_backend()


def compile_only_gpu(target_config: str | bytes):
    """A compile-only GPU device described by a ``GpuTargetConfigProto`` (text format), for
    ``jax.jit(...).lower(...).compile()`` without a GPU (``jax.experimental.topologies``; the
    CUDA plugin must be installed and, on a machine without a GPU, ``JAX_PLATFORMS=cpu`` set
    before JAX starts). Raises ``NotImplementedError`` where the plugin cannot give one."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="cuda", target_config=target_config,
                                            topology="1x1x1")
    return topology.devices[0]


def device_target_config(device) -> str | bytes | None:
    """A real GPU's own ``GpuTargetConfigProto`` (what :func:`compile_only_gpu` takes), as JAX's
    ``tests/aot_test.py`` reads it; None where the backend gives none."""
    from jax._src.lib import xla_client  # no public equivalent

    try:
        return xla_client.get_topology_for_devices([device]).target_config
    except Exception:  # backends without a serializable topology
        return None


def current_trace() -> Any:
    """The trace code is being traced under now (an identity to compare: a function traced
    inside a loop body, a ``jit`` or a ``checkpoint`` runs under another one than its caller)."""
    from jax._src import core  # no public equivalent

    return core.trace_ctx.trace
