"""The first-order rules of autocast's evaluator, one per op class (:data:`BY_CLASS`, picked by
:func:`first_order`): ``rule(ctx, eqn, ins, site) -> list[Value]``, ``ins`` the operands as the
equation's region sees them. A user's handler gets a :class:`RuleCall` and runs first
(jaxamp/_engine/README.md, "The rule table")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jmp
import numpy as np
from jax import lax

from jaxamp._engine.compat import (
    Tracer,
    bind_with_params,
    checkpoint_in_place,
    here,
    new_dtype,
    sub_jaxprs,
)
from jaxamp._engine.context import Context, Rule, Site
from jaxamp._engine.primitives import NOT_ELEMENTWISE
from jaxamp._engine.values import (
    F32,
    F64,
    Value,
    bind,
    broadcast_convert,
    cast,
    dtype_of,
    is_float,
    widest,
)
from jaxamp._engine.values import convert as convert_dtype
from jaxamp._engine.wgrad import conv_f32_kernel_grads, dot_f32_weight_grads
from jaxamp.policy import matmul_dtype

__all__ = ["BY_CLASS", "NOT_ELEMENTWISE", "RuleCall", "Site", "first_order"]

def results(eqn, out, region, *, stored=False, const=False) -> list[Value]:
    outs = out if eqn.primitive.multiple_results else [out]
    return [Value(o, stored, const, region) for o in outs]


def bind_eqn(eqn, vals, site: Site, *, params=None, stored=False, const=False) -> list[Value]:
    """``eqn``'s primitive bound on ``vals`` (with ``params``, else the equation's)."""
    out = bind(eqn.primitive, vals, eqn.params if params is None else params)
    return results(eqn, out, site.region, stored=stored, const=const)


def _traced_float(var) -> bool:
    """``var`` was traced as a float (float64 too: a value a handler made narrower goes back)."""
    return is_float(var.aval.dtype) or dtype_of(var.aval) == F64


def as_traced(ctx: Context, eqn, ins: list[Value], site: Site) -> list[Value]:
    """Runs an equation exactly as traced (its original input dtypes)."""
    vals = [cast(v, var.aval.dtype) if v.is_float and _traced_float(var) else v.val
            for v, var in zip(ins, eqn.invars)]
    out = bind_with_params(eqn, vals)
    floats = [v for v in ins if v.is_float]
    const = all(v.const for v in ins)
    # A float made from no float input (random bits bitcast to a uniform) is computed, not
    # stored: cast like an activation it would quantise dropout's uniforms to float16.
    stored = all(v.stored for v in floats) if floats else const
    return results(eqn, out, site.region, stored=stored, const=const)


def structural(ctx: Context, eqn, ins: list[Value], site: Site) -> list[Value]:
    """Keeps the operand's dtype; a stored value stays stored (an embedding gathers rows of
    the stored table, then casts them)."""
    floats = [v for v in ins if v.is_float]
    all_const = all(v.const for v in ins)
    if site.want32 and all(site.want32) and any(not v.stored for v in floats):
        vals = [cast(v, F32) if v.is_float else v.val for v in ins]
    else:
        vals = [v.val for v in ins]
    outs = bind_eqn(eqn, vals, site, stored=all(v.stored for v in floats), const=all_const)
    if eqn.primitive.name == "gather" and vals[0] is ins[0].val and _small_table(ins[0], outs[0]):
        scope = here()  # the gather's module path, wherever its low copy is first asked for

        def recast(dtype):
            with scope():
                return gather_low(eqn, cast(ins[0], dtype), vals[0], vals[1:])

        outs[0].recast = recast
    if all_const and eqn.primitive.name == "broadcast_in_dim" and np.ndim(ins[0].val) == 0 \
            and not isinstance(ins[0].val, Tracer) and ins[0].is_float:
        outs[0].splat = float(ins[0].val)
    return outs


def _small_table(table: Value, rows: Value) -> bool:
    """``rows`` are gathered from a stored (not constant) float32 ``table`` that has no more
    elements than they do: its low-precision copy costs less than theirs."""
    return (table.stored and not table.const and table.dtype == F32
            and np.size(table.val) <= np.size(rows.val))


def gather_low(eqn, low_table, table, indices: Sequence[Any]):
    """``eqn``'s gather of rows from ``low_table`` (``table`` cast down: the same numbers as the
    rows cast), whose derivative is the float32 gather's of ``table``, so the table's gradient
    is summed in float32. For a table no larger than its rows read (README, Values)."""

    @jax.custom_jvp
    def rows(low_table, table, *indices):
        return bind(eqn.primitive, [low_table, *indices], eqn.params)

    @rows.defjvp
    def rows_jvp(primals, tangents):
        # the low table's tangent is its cast of the table's: only the table's is read
        tangent = bind(eqn.primitive, [tangents[1], *primals[2:]], eqn.params)
        return rows(*primals), convert_dtype(tangent, primals[0].dtype)

    return rows(low_table, table, *indices)


def matmul(ctx: Context, eqn, ins: list[Value], site: Site) -> list[Value]:
    """Runs in the region's compute dtype, inputs and output; with ``f32_weight_grads`` a
    param operand's gradient comes out in float32 (:mod:`jaxamp._engine.wgrad`)."""
    name = eqn.primitive.name
    dtype = ctx.matmul_dtype(site.region)
    floats = [v for v in ins if v.is_float]
    params = dict(eqn.params)
    if params.get("preferred_element_type") is not None and floats:
        params["preferred_element_type"] = dtype
    wide = tuple(v.stored and not v.const and v.is_float for v in ins)
    if ctx.f32_weight_grads and dtype != F32 and len(ins) == 2:
        # a param's gradient summed over the batch (across devices) in float32
        if name == "dot_general" and any(wide):
            out = dot_f32_weight_grads(eqn.primitive, params,
                                       *[v.val if w else cast(v, dtype)
                                         for v, w in zip(ins, wide)], dtype, wide)
            return [Value(out, False, False, site.region)]
        if name == "conv_general_dilated" and wide[1]:
            out = conv_f32_kernel_grads(eqn.primitive, params, cast(ins[0], dtype),
                                        ins[1].val, dtype)
            return [Value(out, False, False, site.region)]
    # a param as the function got it (region (); not a transposed kernel)
    given = tuple(w and v.region == () for v, w in zip(ins, wide))
    if ctx.segments_on() and dtype != F32 and any(given) \
            and any(isinstance(v.val, Tracer) for v in ins):
        # its low copy is made again in the backward from the param, not kept as a residual
        return recompute_param_casts(eqn, ins, site, params, dtype, given)
    return bind_eqn(eqn, [cast(v, dtype) for v in ins], site, params=params)


def recompute_param_casts(eqn, ins: list[Value], site: Site, params, dtype,
                          wide: tuple[bool, ...]) -> list[Value]:
    """``eqn`` in ``dtype`` under a ``jax.checkpoint`` that keeps nothing, casting its ``wide``
    (param) operands inside (the backward casts again); the casts are kept for later readers."""
    def run(*xs):
        lows = [convert_dtype(x, dtype) if w else x for x, w in zip(xs, wide)]
        return bind(eqn.primitive, lows, params), [x for x, w in zip(lows, wide) if w]

    out, lows = checkpoint_in_place(run, jax.checkpoint_policies.nothing_saveable)(
        *[v.val if w else cast(v, dtype) for v, w in zip(ins, wide)])
    for v, low in zip([v for v, w in zip(ins, wide) if w], lows):
        v.casts.setdefault(np.dtype(dtype), low)
    return results(eqn, out, site.region)


def fp32(ctx: Context, eqn, ins: list[Value], site: Site) -> list[Value]:
    """Runs in float32 (inputs cast up); the output stays float32."""
    return bind_eqn(eqn, [cast(v, F32) for v in ins], site)


def promoted(v: Value, dtype, eqn):
    """``v`` cast for an elementwise op; a stored operand that the op broadcasts (a bias)
    is broadcast before the cast, so its gradient is summed in its stored dtype."""
    out_shape = eqn.outvars[0].aval.shape
    shape = np.shape(v.val)
    if (v.stored and not v.const and v.is_float and v.dtype != np.dtype(dtype)
            and eqn.primitive.name not in NOT_ELEMENTWISE
            and len(shape) == len(out_shape) and shape != out_shape
            and all(a in (1, b) for a, b in zip(shape, out_shape))):
        key = ("broadcast", out_shape, np.dtype(dtype))
        if key not in v.casts:
            v.casts[key] = broadcast_convert(v.val, out_shape, np.dtype(dtype))
        return v.casts[key]
    return cast(v, dtype)


def promote(ctx: Context, eqn, ins: list[Value], site: Site) -> list[Value]:
    """Runs in the widest activation dtype among the operands (float32 if every consumer
    wants it); with only stored operands, as traced, the result still stored."""
    floats = [v for v in ins if v.is_float]
    float_wants = [w for w, o in zip(site.want32, eqn.outvars) if is_float(o.aval.dtype)]
    live = [v.dtype for v in floats if not v.stored]
    if eqn.primitive.name == "dynamic_update_slice" and ins[0].stored and ins[0].is_float:
        # A write into a stored buffer (a decode cache): the buffer keeps its dtype.
        dtype = ins[0].dtype
    elif float_wants and all(float_wants):
        dtype = F32
    elif live:
        dtype = widest(live)
    else:
        # Only stored operands: as traced, the result still stored (cast where first used).
        # The compute dtype here would round what precision depends on (a diffusion
        # timestep x frequency fed to sin/cos, a squared weight in an L2 penalty).
        return bind_eqn(eqn, [cast(v, var.aval.dtype) if v.is_float else v.val
                              for v, var in zip(ins, eqn.invars)], site, stored=True)
    return bind_eqn(eqn, [promoted(v, dtype, eqn) for v in ins], site)


def convert(ctx: Context, eqn, ins: list[Value], site: Site) -> list[Value]:
    """A cast in the traced code: a float downcast (often jnp's own) or weak-type change is
    autocast's to decide (passed through); an explicit upcast is honoured."""
    (v,), new = ins, np.dtype(new_dtype(eqn))
    src = eqn.invars[0].aval.dtype
    if v.is_float and is_float(new):
        if np.dtype(src) == new or jnp.finfo(new).bits <= jnp.finfo(v.dtype).bits:
            return [v]
        return [Value(cast(v, new), False, v.const, site.region)]
    out = lax.convert_element_type(v.val, new)
    # An int/bool -> float conversion makes a stored value (cast where it is used).
    return [Value(out, v.stored or not v.is_float, v.const, site.region)]


#: op class of :class:`jaxamp.OpRules` -> its rule.
BY_CLASS: dict[str, Rule] = {
    "structural": structural,
    "matmul": matmul,
    "fp32": fp32,
    "promote": promote,
    "as_traced": as_traced,
}


def _float64_in(eqn) -> bool:
    return any(dtype_of(v.aval) == F64 for v in (*eqn.invars, *eqn.outvars)
               if hasattr(v.aval, "dtype"))


def _note_float64_matmul(ctx: Context, site: Site) -> None:
    """A float64 matmul where the policy asks for a low-precision one (autocast warns)."""
    dtype = np.dtype(matmul_dtype(ctx.policy(site.region)))
    if dtype.itemsize < 4:
        ctx.note_float64_matmul("float8" if dtype.itemsize == 1 else dtype.name)


def first_order(ctx: Context, eqn, ins: list[Value], site: Site) -> list[Value]:
    """The rule of ``eqn``'s op class (a constant computation, a float64 one and a
    primitive with sub-programs that autocast does not know run as traced)."""
    name = eqn.primitive.name
    if name == "convert_element_type":
        return convert(ctx, eqn, ins, site)
    kind = ctx.op_rules.classify(name)
    if not ctx.op_rules.known(name):
        ctx.note_unknown(name)
    if sub_jaxprs(eqn) or _float64_in(eqn):
        if kind == "matmul" and _float64_in(eqn):
            _note_float64_matmul(ctx, site)
        kind = "as_traced"
    elif kind in ("promote", "matmul", "fp32") and all(v.const for v in ins):
        kind = "as_traced"
    return BY_CLASS[kind](ctx, eqn, ins, site)


class RuleCall:
    """What a handler given in ``OpRules.extend(handlers={primitive: handler})`` receives.

    A handler returns the equation's outputs (a list of arrays), or None for its op class's
    rule (which :meth:`default` runs).

    Attributes:
      eqn: the traced equation (its invars have the traced avals).
      args: its operands as arrays, after region crossings (in their current dtypes).
      stored: per operand, whether it is stored (a param, a float input, a constant) rather
        than an activation.
      policy: the :class:`jmp.Policy` of the equation's region.
      want_f32: per output, whether every consumer computes in float32.
      position: ``"first"``/``"last"`` for the first and last matmul that reads a param
        (outside loops), found when some policy sets ``matmul=``; else None.
    """

    def __init__(self, ctx: Context, eqn, ins: Sequence[Value], site: Site):
        self._ctx, self._ins, self._site = ctx, list(ins), site
        self.eqn = eqn
        self.args = [v.val for v in ins]
        self.stored = [v.stored for v in ins]
        self.policy: jmp.Policy = ctx.policy(site.region)
        self.want_f32 = list(site.want32)
        self.position: str | None = ctx.matmul_ends.get(id(eqn))

    @property
    def compute_dtype(self) -> np.dtype:
        return np.dtype(self.policy.compute_dtype)

    def cast(self, i: int, dtype) -> Any:
        """Operand ``i`` in ``dtype`` (one cast per value and dtype, shared with the rest of
        the program)."""
        return cast(self._ins[i], dtype)

    def decided(self, decision: str):
        """A context: what is bound inside it carries ``decision`` (why this equation runs as
        it does), which :func:`jaxamp.audit` lists (``AuditReport.matmuls``' reason)."""
        return self._ctx.marks.decision(decision)

    def default(self) -> list:
        """The built-in rule's outputs for this equation, as arrays."""
        return [v.val for v in first_order(self._ctx, self.eqn, self._ins, self._site)]
