"""The higher-order rules of autocast's evaluator: one ``rule(ctx, eqn, ins, site)`` per
primitive with sub-programs (:data:`HIGHER_ORDER`; what each does: jaxamp/_engine/README.md),
and :func:`rule_table`, the table ``autocast`` hands to the interpreter. Sub-programs are
cached bodies (:meth:`jaxamp._engine.context.Context.body`), evaluated once per (program,
inputs, region), so nested control flow costs time linear in its size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._engine import attention as fused
from jaxamp._engine.compat import (
    bind_with_params,
    call_jaxpr,
    call_name,
    close_jaxpr,
    cond_params,
    custom_jvp_params,
    custom_vjp_name,
    custom_vjp_primal_jaxpr,
    remat_params,
    scan_params,
    shard_map_again,
    shard_map_jaxpr,
    while_params,
)
from jaxamp._engine.context import Context, Rule, Site
from jaxamp._engine.jaxpr import param_matmuls
from jaxamp._engine.op_rules import RuleCall, as_traced, first_order
from jaxamp._engine.primitives import CALLS, FP8_MATMUL, PARAM_READS, REMAT
from jaxamp._engine.values import Value, cast, dtype_of, is_float, spec, widest

__all__ = ["HIGHER_ORDER", "INLINE", "rule_table"]

#: Calls evaluated in line, in the caller's context.
INLINE = CALLS
#: The longest scan ``Context.layers_in_place`` takes for a stack of layers (a longer one is a
#: loop over data, an RNN's time steps: it stays a loop).
LAYERS_AT_MOST = 256


def inline(ctx: Context, eqn, ins: list[Value], site: Site) -> list[Value]:
    recorded = ctx.attention.get(call_name(eqn))
    if recorded is not None:
        outs = attention(ctx, ins, site, recorded)
        if outs is not None:
            return outs
    return ctx.eval(call_jaxpr(eqn), None, ins, site.region, site.want32)


def attention(ctx: Context, ins, site: Site, call: tuple) -> list[Value] | None:
    """A recorded ``jax.nn.dot_product_attention`` call bound again as cuDNN's fused kernel
    in the region's compute dtype, or None: re-evaluate its traced XLA path."""
    static = call[1]
    dtype = ctx.compute_dtype(site.region)
    if not fused.wants_cudnn(static) or dtype == np.float32:
        return None
    vals = [ctx.operand(v, site.region).val for v in ins]
    try:
        out = fused.redispatch(call, vals, dtype)
    except Exception:
        if static.get("implementation") == "cudnn":
            raise  # asked for explicitly: JAX's own error says what cuDNN refused
        return None
    return [Value(o, False, False, site.region) for o in jax.tree.leaves(out)]


def remat(ctx: Context, eqn, ins: list[Value], site: Site) -> list[Value]:
    p = remat_params(eqn)
    with ctx.in_user_remat():  # the user's policy decides what its body keeps
        body = ctx.body(p.jaxpr, ins, site.region)
        outs = jax.checkpoint(body.fn, prevent_cse=p.prevent_cse, policy=p.policy)(
            *[v.val for v in ins])
    return body.values(outs)


def shard_map(ctx: Context, eqn, ins: list[Value], site: Site) -> list[Value]:
    """A ``shard_map`` body (a hand-written tensor-parallel layer, its ``psum``) re-evaluated
    per device under the region's policy, bound again as a ``shard_map`` with the same mesh
    and specs. Params enter as stored and are cast per shard where they are used. (The
    backward's ``psum`` of an activation gradient, the transpose of ``pvary``, is in that
    activation's dtype.)"""
    body = ctx.body(shard_map_jaxpr(eqn), ins, site.region)
    outs = shard_map_again(eqn, body.fn, [v.val for v in ins])
    return body.values(outs)


def _carry_dtypes(init: list[Value], body_dtypes) -> list:
    """The fixed point of carry dtypes: start from the initial values', widen by what the body
    returns (each round evaluates the body once per new dtypes; at most one widening per
    float carry)."""
    dtypes = [v.dtype for v in init]
    for _ in range(len(init) + 1):
        new = [widest([a, b]) if is_float(a) and is_float(b) else a
               for a, b in zip(dtypes, body_dtypes(dtypes))]
        if new == dtypes:
            return dtypes
        dtypes = new
    return dtypes


def scan(ctx: Context, eqn, ins: list[Value], site: Site) -> list[Value]:
    with ctx.in_scan():  # its body's output dtypes and its trace: the same Body
        return _scan(ctx, eqn, ins, site)


def _scan(ctx: Context, eqn, ins: list[Value], site: Site) -> list[Value]:
    p = scan_params(eqn)
    nc, nk = p.num_consts, p.num_carry
    consts, init, xs = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]
    live = [v.live() for v in init]
    if ctx.layers_in_place and 0 < p.length <= LAYERS_AT_MOST and param_matmuls(
            p.jaxpr, FP8_MATMUL, PARAM_READS, range(nc + nk, nc + nk + len(xs))):
        return _layer_by_layer(ctx, p, consts, live, xs, site)
    x_specs = [jax.ShapeDtypeStruct(np.shape(v.val)[1:], v.dtype) for v in xs]

    def body_for(dtypes):
        return ctx.body(p.jaxpr, consts + live + xs, site.region,
                       dtypes=[v.dtype for v in consts] + list(dtypes) + [v.dtype for v in xs])

    def body_dtypes(dtypes):
        specs = ([spec(v.val) for v in consts] + [spec(v.val, d) for v, d in zip(init, dtypes)]
                 + x_specs)
        return body_for(dtypes).out_dtypes(specs)[:nk]

    dtypes = _carry_dtypes(init, body_dtypes)
    body = body_for(dtypes)
    const_vals = [v.val for v in consts]

    def f(carry, x):
        outs = body.values(body.fn(*const_vals, *carry, *x))
        return [cast(o, d) for o, d in zip(outs[:nk], dtypes)], [o.val for o in outs[nk:]]

    carry, ys = lax.scan(f, [cast(v, d) for v, d in zip(init, dtypes)], [v.val for v in xs],
                         length=p.length, reverse=p.reverse, unroll=p.unroll)
    return [Value(o, False, False, site.region) for o in (*carry, *ys)]


def _layer_by_layer(ctx: Context, p, consts, carry, xs, site: Site) -> list[Value]:
    """A scan over stacked layers evaluated one iteration at a time in the current trace
    (``Context.layers_in_place``): the carry as each iteration leaves it, each output of the
    iterations stacked in their widest dtype."""
    ys: list = [None] * p.length
    for i in (reversed(range(p.length)) if p.reverse else range(p.length)):
        x = [Value(v.val[i], v.stored, v.const, v.region) for v in xs]
        outs = ctx.eval(p.jaxpr, None, [*consts, *carry, *x], site.region)
        carry, ys[i] = outs[:p.num_carry], outs[p.num_carry:]
    stacked = []
    for column in zip(*ys):
        dtype = widest([v.dtype for v in column]) if column[0].is_float else column[0].dtype
        stacked.append(jnp.stack([cast(v, dtype) for v in column]))
    return [*carry, *(Value(y, False, False, site.region) for y in stacked)]


def while_loop(ctx: Context, eqn, ins: list[Value], site: Site) -> list[Value]:
    p = while_params(eqn)
    cn, bn = p.cond_nconsts, p.body_nconsts
    cconsts, bconsts, init = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
    live = [v.live() for v in init]
    bvals = [v.val for v in bconsts]
    cvals = [v.val for v in cconsts]

    def loop_body(closed, consts, dtypes):
        return ctx.body(closed, consts + live, site.region,
                       dtypes=[v.dtype for v in consts] + list(dtypes))

    def body_dtypes(dtypes):
        specs = [spec(v.val) for v in bconsts] + [spec(v.val, d) for v, d in zip(init, dtypes)]
        return loop_body(p.body_jaxpr, bconsts, dtypes).out_dtypes(specs)

    dtypes = _carry_dtypes(init, body_dtypes)
    body = loop_body(p.body_jaxpr, bconsts, dtypes)
    cond = loop_body(p.cond_jaxpr, cconsts, dtypes)

    def cond_fn(carry):
        (out,) = cond.fn(*cvals, *carry)
        return out

    def body_fn(carry):
        outs = body.values(body.fn(*bvals, *carry))
        return [cast(o, d) for o, d in zip(outs, dtypes)]

    outs = lax.while_loop(cond_fn, body_fn, [cast(v, d) for v, d in zip(init, dtypes)])
    return [Value(o, False, False, site.region) for o in outs]


def cond(ctx: Context, eqn, ins: list[Value], site: Site) -> list[Value]:
    index, ops = ins[0], ins[1:]
    vals = [v.val for v in ops]
    specs = [spec(x) for x in vals]
    bodies = [ctx.body(br, ops, site.region) for br in cond_params(eqn).branches]
    per_branch = [b.out_dtypes(specs) for b in bodies]
    dtypes = [widest(list(ds)) if all(is_float(d) for d in ds) else ds[0]
              for ds in zip(*per_branch)]

    def make(body):
        def fn(*xs):
            return [cast(o, d) for o, d in zip(body.values(body.fn(*xs)), dtypes)]
        return fn

    outs = lax.switch(index.val, [make(b) for b in bodies], *vals)
    return [Value(o, False, False, site.region) for o in outs]


def custom_jvp(ctx: Context, eqn, ins: list[Value], site: Site) -> list[Value]:
    p = custom_jvp_params(eqn)
    if p.num_consts:
        return as_traced(ctx, eqn, ins, site)
    primal = ctx.body(p.call_jaxpr, ins, site.region)
    fn = jax.custom_jvp(primal.fn)

    def rule(primals, tangents):
        out_dtypes = primal.out_dtypes([spec(x) for x in primals])
        zeros = [dtype_of(t) == jax.dtypes.float0 for t in tangents]
        jaxpr, consts, out_zeros = p.jvp(zeros)
        metas = list(ins) + [v.live() for v, z in zip(ins, zeros) if not z]
        nz = [t for t, z in zip(tangents, zeros) if not z]
        outs = ctx.run_body(close_jaxpr(jaxpr, consts), metas, site.region, [*primals, *nz])
        n = len(out_zeros)
        p_out = [cast(o, d) for o, d in zip(outs[:n], out_dtypes)]
        nz_t = iter(outs[n:])
        t_out = [jnp.zeros(np.shape(po), d) if z else cast(next(nz_t), d)
                 for po, z, d in zip(p_out, out_zeros, out_dtypes)]
        return p_out, t_out

    fn.defjvp(rule)
    outs = fn(*[v.val for v in ins])
    return [Value(o, False, all(v.const for v in ins), site.region) for o in outs]


def custom_vjp(ctx: Context, eqn, ins: list[Value], site: Site) -> list[Value]:
    """A ``jax.custom_vjp`` function keeps its custom rule, and both of its halves run under
    the region's policy. Its forward and backward rules are traced (as written, in the traced
    dtypes) through the public ``jax.vjp`` into two plain jaxprs, the forward returning the
    residuals the backward reads; each is then re-evaluated like any other program, so the
    matmuls of a hand-written attention kernel and of its backward run in the compute dtype
    and its softmax in float32. ``OpRules.custom_vjp_as_traced`` opts functions out."""
    if ctx.op_rules.runs_custom_vjp_as_traced(custom_vjp_name(eqn)):
        return as_traced(ctx, eqn, ins, site)
    region = site.region
    floats = [i for i, v in enumerate(eqn.invars) if is_float(v.aval.dtype)]
    specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    n_out = len(eqn.outvars)
    pullback = []

    def traced_fwd(*xs):
        def on_floats(*fs):
            full = list(xs)
            for i, f in zip(floats, fs):
                full[i] = f
            out = bind_with_params(eqn, full)
            return list(out) if eqn.primitive.multiple_results else [out]

        outs, vjp = jax.vjp(on_floats, *[xs[i] for i in floats])
        res, tree = jax.tree.flatten(vjp)
        pullback[:] = [tree]
        return outs, res

    fwd_jaxpr, (out_specs, res_specs) = jax.make_jaxpr(traced_fwd, return_shape=True)(*specs)
    bwd_jaxpr = jax.make_jaxpr(lambda res, cts: pullback[0].unflatten(res)(cts))(
        res_specs, out_specs)
    primal = ctx.body(custom_vjp_primal_jaxpr(eqn), ins, region)
    fwd_body = ctx.body(fwd_jaxpr, ins, region)
    fn = jax.custom_vjp(primal.fn)

    def fwd(*xs):
        outs = fwd_body.values(fwd_body.fn(*xs))
        # the primal outputs must have the dtypes the primal function gives them here
        dtypes = primal.out_dtypes([spec(x) for x in xs])
        return ([cast(o, d) for o, d in zip(outs[:n_out], dtypes)],
                [o.val for o in outs[n_out:]])

    def bwd(res, cts):
        acts = [Value(None, False, False, region) for _ in range(len(res) + len(cts))]
        outs = ctx.run_body(bwd_jaxpr, acts, region, [*res, *cts])
        cts_in = [None] * len(ins)
        for i, o in zip(floats, outs):
            cts_in[i] = cast(o, ins[i].dtype)
        return tuple(cts_in)

    fn.defvjp(fwd, bwd)
    outs = fn(*[v.val for v in ins])
    return [Value(o, False, all(v.const for v in ins), region) for o in outs]


#: primitive name -> its rule.
HIGHER_ORDER: dict[str, Rule] = {
    **{name: inline for name in INLINE},
    **{name: remat for name in REMAT},
    "scan": scan,
    "while": while_loop,
    "cond": cond,
    "custom_jvp_call": custom_jvp,
    "custom_vjp_call": custom_vjp,
    "shard_map": shard_map,
}


def _handled(handler, fallback: Rule) -> Rule:
    """A user's handler (``OpRules.extend(handlers=...)``) as a rule: it gets a
    :class:`jaxamp.rules.RuleCall`; where it returns None, ``fallback`` runs."""

    def rule(ctx: Context, eqn, ins: list[Value], site: Site) -> list[Value]:
        out = handler(RuleCall(ctx, eqn, ins, site))
        if out is not None:
            return [Value(o, False, False, site.region) for o in out]
        return fallback(ctx, eqn, ins, site)

    return rule


def rule_table(op_rules) -> dict[str, Rule]:
    """Primitive name -> rule for :class:`jaxamp.OpRules` ``op_rules``: the user's handlers
    (falling back to the built-in rule), else the higher-order rules; a primitive not in it
    gets :func:`jaxamp._engine.op_rules.first_order` (its op class's rule)."""
    table = dict(HIGHER_ORDER)
    for name in {name for name, _ in op_rules.handlers}:
        table[name] = _handled(op_rules.handler(name), table.get(name, first_order))
    return table
