"""One walker, one taxonomy: only ``jaxamp/_engine/jaxpr.py`` reads jaxpr equations, and the audit's
expectations come from the same ``OpRules`` autocast ran by."""

from __future__ import annotations

import ast
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp._engine.jaxpr import iter_eqns
from jaxamp.diagnostics._audit import _findings
from jaxamp.diagnostics._trace import trace_model

F16 = "params=float32,compute=float16,output=float32"
PACKAGE = pathlib.Path(jaxamp.__file__).parent


def test_only_the_walker_module_reads_jaxpr_equations():
    readers = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        if any(isinstance(n, ast.Attribute) and n.attr == "eqns" for n in ast.walk(tree)):
            readers.add(path.relative_to(PACKAGE).as_posix())
    assert readers == {"_engine/jaxpr.py"}


class TanhMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(jnp.tanh(nn.Dense(8)(x)))


@pytest.fixture(scope="module")
def mlp():
    model = TanhMLP()
    x = jnp.ones((2, 3), jnp.float32)
    params = model.init(jax.random.key(0), x)
    return model, params, x


def _in_dtypes(jaxpr, prim):
    return {str(v.aval.dtype) for e in iter_eqns(jaxpr) if e.primitive.name == prim
            for v in e.invars}


def _kinds(findings, word):
    return {f.kind for f in findings if word in f.detail}


def _trace(model, params, x, rules):
    return trace_model(model.apply, (params, x), policy=F16, overrides=None, op_rules=rules,
                       argnums=0)


def test_user_fp32_op_autocast_and_audit_agree(mlp):
    model, params, x = mlp
    rules = jaxamp.DEFAULT_OP_RULES.extend(fp32={"tanh"})
    jaxpr = jax.make_jaxpr(jaxamp.autocast(model.apply, F16, op_rules=rules))(params, x)
    assert _in_dtypes(jaxpr, "tanh") == {"float32"}
    default = jax.make_jaxpr(jaxamp.autocast(model.apply, F16))(params, x)
    assert _in_dtypes(default, "tanh") == {"float16"}

    # what autocast did by the user's rules is what the audit expects: no finding
    report = jaxamp.audit(model.apply, params, x, policy=F16, op_rules=rules)
    assert not _kinds(report.findings, "tanh")
    # a program traced under the default rules, checked against the user's: tanh ran low
    t_default = _trace(model, params, x, jaxamp.DEFAULT_OP_RULES)
    assert _kinds(_findings(t_default, None, None, rules), "tanh") == {"fp32_op_low_precision"}
    assert not _kinds(_findings(t_default, None, None), "tanh")  # by its own rules: fine


def test_moved_matmul_autocast_and_audit_agree(mlp):
    model, params, x = mlp
    rules = jaxamp.DEFAULT_OP_RULES.extend(fp32={"dot_general"})  # matmuls in float32
    jaxpr = jax.make_jaxpr(jaxamp.autocast(model.apply, F16, op_rules=rules))(params, x)
    assert _in_dtypes(jaxpr, "dot_general") == {"float32"}
    t = _trace(model, params, x, rules)
    assert t.op_rules is rules
    assert not _findings(t, None, None)  # dot_general is no matmul under these rules
    by_default = {f.kind for f in _findings(t, None, None, jaxamp.DEFAULT_OP_RULES)}
    assert by_default == {"matmul_f32_in_low_precision_region"}
    assert not [f for f in jaxamp.audit(model.apply, params, x, policy=F16,
                                        op_rules=rules).findings
                if f.kind == "matmul_f32_in_low_precision_region"]


def test_audit_and_rules_share_the_op_lists():
    from jaxamp.diagnostics import _trace
    from jaxamp.rules import FP32_PRIMITIVES, MATMUL_PRIMITIVES

    assert _trace.EXPLOG <= FP32_PRIMITIVES and _trace.ACCUM <= FP32_PRIMITIVES
    assert {"exp2", "log2"} <= _trace.EXPLOG
    assert "ragged_dot_general" in MATMUL_PRIMITIVES
    assert not hasattr(_trace, "MATMUL")  # the audit reads matmuls from the OpRules


def test_walk_maps_sub_program_inputs_to_caller_vars():
    from jaxamp._engine.jaxpr import sub_programs, walk

    @jax.jit
    def inner(a, b):
        return jnp.sin(a) * b

    def f(x, y):
        return jax.lax.scan(lambda c, z: (inner(c, z), None), x, y)[0]

    closed = jax.make_jaxpr(f)(np.ones(3, np.float32), np.ones((2, 3), np.float32))
    (scan,) = [e for e in iter_eqns(closed) if e.primitive.name == "scan"]
    (body,) = sub_programs(scan)
    assert body.ins == list(scan.invars) and body.outs == list(scan.outvars)
    seen, entered = [], []
    walk(closed, lambda e, stack: seen.append(e.primitive.name),
         enter=lambda e, sub, stack: entered.append(e.primitive.name))
    assert seen == ["sin", "mul"]
    assert entered in (["scan", "pjit"], ["scan", "jit"])  # the primitive's name by version


def test_cast_checks_see_across_in_line_calls():
    """A cast outside a ``jax.checkpoint`` (a recompute segment) and one of the same value
    inside it are two casts of one value; a cast down outside and back up inside, through the
    ``optimization_barrier`` a segment reads its low inputs with, is a round trip. One jaxpr
    at a time sees neither; a jitted body called twice makes new values each time."""
    from jaxamp._engine.jaxpr import duplicate_casts, lossy_round_trips

    def body(x, low):
        return x.astype(jnp.bfloat16) * 2, jax.lax.optimization_barrier(low).astype(jnp.float32)

    def f(x):
        low = x.astype(jnp.bfloat16)
        twice, back = jax.checkpoint(body)(x, low)
        return low, twice, back

    closed = jax.make_jaxpr(f)(np.ones(3, np.float32))
    assert duplicate_casts(closed, nested=False) == [] == lossy_round_trips(closed, nested=False)
    ((a, b),) = duplicate_casts(closed)
    assert (a.outvars[0].aval.dtype, b.outvars[0].aval.dtype) == (jnp.bfloat16, jnp.bfloat16)
    (up,) = lossy_round_trips(closed)
    assert up.outvars[0].aval.dtype == jnp.float32

    inner = jax.jit(lambda x: x.astype(jnp.bfloat16) + 1)
    closed = jax.make_jaxpr(lambda x: inner(inner(x).astype(jnp.float32)))(np.ones(3))
    assert duplicate_casts(closed) == []


def test_rebinding_leaves_no_call_per_primitive(mlp):
    """autocast evaluates sub-programs and repeated module calls as cached jitted bodies
    where JAX inlines them (``jaxamp._engine.jaxpr.jit_inlines``): the program it produces has
    no call left of them."""
    model, params, x = mlp
    amp = jaxamp.autocast(lambda p, x: jnp.sum(model.apply(p, x)), F16)
    for closed in (jax.make_jaxpr(amp)(params, x),
                   jax.make_jaxpr(jax.value_and_grad(amp))(params, x)):
        calls = [e for e in iter_eqns(closed) if e.primitive.name in ("jit", "pjit")]
        assert not calls, [e.params.get("name") for e in calls]


def test_cached_bodies_are_inlined_on_every_supported_jax():
    """Cached jitted bodies are on for each jax this project supports (jax 0.12 through
    ``jax.Inline.JAX_EARLY``): without them a body would be evaluated once for its output
    dtypes and again when called, and repeated layers once each (BENCHMARKS.md, "The engine
    as a table of rules")."""
    from jaxamp._engine.jaxpr import jit_inlines

    assert jit_inlines(), jax.__version__
