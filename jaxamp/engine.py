"""``autocast``: run an unmodified JAX/Flax function under mixed-precision policies.

How it works, in one paragraph: the function is traced once in its own (float32) dtypes to a
jaxpr, with every Flax module call (linen, or NNX through :mod:`jaxamp.nnx_frontend`) that matches a
rule wrapped in a named scope ``jaxamp<k>`` (its *region*). The jaxpr is then re-evaluated
equation by equation, each primitive re-bound in the dtype its op rule and its region's policy
ask for (see :mod:`jaxamp.rules`).
Because the result is ordinary JAX code, ``jax.grad``, ``jax.jit`` and ``jax.vmap`` compose with
it, and the backward pass follows the forward's dtypes (a float16 matmul has float16 gradient
matmuls; the cast of a float32 parameter transposes into a float32 gradient).

Value bookkeeping that keeps casts minimal:

* *stored* values (the function's float inputs, e.g. params, and constants) are not cast up
  front; they are cast where an arithmetic op first uses them, after any gather/slice/reshape,
  so an embedding table is never cast whole and scanned stacked params are cast per layer;
* every value is cast at most once per dtype (a cache on the value);
* constants cast down saturate (an f32 ``finfo.min`` mask becomes -65504 in f16, not -inf);
* float -> float casts written in the traced function are hints: upcasts are honoured by the
  ops that follow, except matmuls, which always run in their region's compute dtype (ask for
  a float32 matmul with a module rule); downcasts are dropped (they are autocast's to make).
  A cast of a value that is already float32 when traced leaves no trace to honour;
* leaving a matched module's region casts to its ``output_dtype``; entering one casts
  activations to its ``compute_dtype``; the function's own float outputs get the default
  policy's ``output_dtype`` (a linen ``apply(..., mutable=...)`` leaves the updated
  collections in their stored dtype).

Where a batch contraction may be a sum across devices (traced under ``jax.set_mesh``, as
``make_train_step(mesh=...)`` does, or with more than one device visible, as for plain
``jax.jit`` of ``NamedSharding``-placed inputs), a matmul or convolution with a param operand
computes that param's gradient with a float32 output (same low-precision operands), so XLA's
SPMD partitioner sums it across devices in float32, not in the compute dtype (see
:mod:`jaxamp._wgrad`); ``autocast(..., f32_weight_grads=True/False)`` decides it explicitly.
The matmul is a ``jax.custom_jvp`` function (forward mode works); the convolution a
``jax.custom_vjp`` one (reverse mode only: ``jax.jvp`` through it fails, unless
``f32_weight_grads=False``). One device keeps JAX's own transposes.

Control flow keeps its structure: ``jit`` bodies are inlined, ``checkpoint``/``remat`` is
re-applied with its policy, ``scan``/``while`` carries keep a fixed dtype (the widest of the
initial value and what the body returns, so float32 accumulators stay float32), ``cond``
branches agree on the widest output dtype, ``shard_map`` bodies run per device under the
region's policy (a hand-written tensor-parallel matmul in the compute dtype, its ``psum`` in
float32) and are bound again with the same mesh and specs, ``custom_jvp`` and ``custom_vjp``
functions keep their custom rules (both halves of a ``custom_vjp`` re-evaluated under the
region's policy; ``OpRules.custom_vjp_as_traced`` opts functions out). Unknown higher-order
primitives run exactly as traced (float32): correct, not accelerated.

Trace cost: the re-evaluation binds every primitive through a cached, inlined ``jax.jit`` of
that primitive (:func:`_jitted_bind`), as ``jnp``'s own operators are, so that under
``jax.grad`` JAX linearizes each (primitive, params, input types) once instead of once per
equation; the walk itself is :func:`jaxamp._jaxpr.evaluate`, shared with the diagnostics.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import jmp
import numpy as np
from jax import lax

from jaxamp import _attention, nnx_frontend
from jaxamp._compat import (
    Tracer,
    bind_with_params,
    close_jaxpr,
    custom_vjp_name,
    inline_jit,
    jit_inlines,
    mesh_is_set,
    open_jaxpr,
    scan_counts,
    shard_map_again,
    source_context,
)
from jaxamp._jaxpr import all_consumers_accept, evaluate, name_stack
from jaxamp._wgrad import conv_f32_kernel_grads, dot_f32_weight_grads
from jaxamp.policy_spec import DEFAULT_POLICY
from jaxamp.rules import DEFAULT_OP_RULES, ModuleRules, OpRules, module_path

__all__ = ["REGION_MARKER", "autocast"]

_F32 = np.dtype(np.float32)
#: The name-scope marker of a module region: ``jaxamp<call.region>``. Each autocast call has its
#: own ``call`` number, so an autocast function traced inside another keeps its regions apart.
REGION_MARKER = re.compile(r"jaxamp<(\d+)\.(\d+)>")
_CALLS = itertools.count(1)
_INLINE = frozenset({"jit", "pjit", "closed_call", "core_call"})
_REMAT = frozenset({"remat2", "checkpoint", "remat"})
# "promote" primitives whose operands are not broadcast elementwise to the output's shape.
_NOT_ELEMENTWISE = frozenset({"concatenate", "stack", "pad", "dynamic_update_slice", "select_n",
                              "clamp"})


def _is_float(dtype) -> bool:
    try:  # jax's issubdtype knows extended dtypes (PRNG keys): not floating
        return bool(jax.dtypes.issubdtype(dtype, jnp.floating))
    except TypeError:
        return False


def _dtype_of(x) -> np.dtype:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        dtype = np.asarray(x).dtype
    try:
        return np.dtype(dtype)
    except TypeError:  # extended dtypes (PRNG keys)
        return dtype


def _widest(dtypes: Sequence[np.dtype]) -> np.dtype:
    out = dtypes[0]
    for d in dtypes[1:]:
        out = np.dtype(jnp.promote_types(out, d))
    return out


@dataclasses.dataclass(eq=False)
class _Val:
    """A value under evaluation and what autocast knows about it."""

    val: Any
    stored: bool  # an input or constant not yet committed to a compute dtype
    const: bool  # depends on no input (safe to compute at trace time; casts saturate)
    region: tuple[int, ...]
    casts: dict = dataclasses.field(default_factory=dict)
    splat: float | None = None  # a constant filled with one known value (zeros, finfo.min)

    @property
    def dtype(self):
        return _dtype_of(self.val)

    @property
    def is_float(self) -> bool:
        return _is_float(self.dtype)

    def fresh(self, val=None) -> _Val:
        """The same knowledge about a value seen from inside a new trace (no shared casts)."""
        return _Val(self.val if val is None else val, self.stored, self.const, self.region)


def _spec(x, dtype=None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), _dtype_of(x) if dtype is None else dtype)


def _saturating(x, dtype: np.dtype):
    info = jnp.finfo(dtype)
    if isinstance(x, Tracer):
        return lax.convert_element_type(jnp.clip(x, info.min, info.max), dtype)
    return np.asarray(np.clip(np.asarray(x, np.float32), float(info.min), float(info.max)),
                      dtype)


def _hashable_params(params: Mapping[str, Any]):
    try:
        key = tuple(params.items())
        hash(key)
        return key
    except TypeError:
        return None


@functools.lru_cache(maxsize=8192)
def _jitted_bind(prim, params_key):
    """``prim.bind`` with these params as an inlined ``jax.jit`` call
    (:func:`jaxamp._compat.inline_jit`). Under autodiff, JAX linearizes a jitted call once per
    (params, input types) and reuses the result (as it does for ``jnp``'s own jitted
    operators), where a bare ``bind`` re-derives the linearization of every equation; under
    ``make_jaxpr``/``jit`` tracing the call is inlined, so the program is the same. Used only
    where JAX inlines such calls at trace time (:func:`jaxamp._compat.jit_inlines`)."""
    params = dict(params_key)

    def bound(*vals):
        return prim.bind(*vals, **params)

    bound.__name__ = prim.name
    return inline_jit(bound)


def _bind(prim, vals: Sequence[Any], params: Mapping[str, Any]):
    """``prim.bind(*vals, **params)``; through a cached jitted call when tracing."""
    if jit_inlines() and any(isinstance(x, Tracer) for x in vals):
        key = _hashable_params(params)
        if key is not None:
            return _jitted_bind(prim, key)(*vals)
    return prim.bind(*vals, **params)


@functools.lru_cache(maxsize=64)
def _jitted_convert(dtype: np.dtype):
    return inline_jit(functools.partial(lax.convert_element_type, new_dtype=dtype))


def _convert(x, dtype):
    """``lax.convert_element_type(x, dtype)``; a cached jitted call when tracing (see
    :func:`_jitted_bind`)."""
    if jit_inlines() and isinstance(x, Tracer):
        return _jitted_convert(np.dtype(dtype))(x)
    return lax.convert_element_type(x, dtype)


@functools.lru_cache(maxsize=1024)
def _jitted_broadcast_convert(shape: tuple[int, ...], dtype: np.dtype):
    return inline_jit(lambda x: lax.convert_element_type(jnp.broadcast_to(x, shape), dtype))


def _broadcast_convert(x, shape, dtype):
    """``x`` broadcast to ``shape``, then cast (a cached jitted call when tracing)."""
    if jit_inlines() and isinstance(x, Tracer):
        return _jitted_broadcast_convert(tuple(shape), dtype)(x)
    return lax.convert_element_type(jnp.broadcast_to(x, shape), dtype)


def _cast(v: _Val, dtype) -> Any:
    """``v.val`` in ``dtype`` (cached: a value is cast to a given dtype at most once)."""
    dtype = np.dtype(dtype)
    if not v.is_float or v.dtype == dtype:
        return v.val
    if dtype not in v.casts:
        narrower = jnp.finfo(dtype).max < jnp.finfo(v.dtype).max
        if v.const and narrower and v.splat is not None:
            info = jnp.finfo(dtype)
            value = float(np.clip(v.splat, float(info.min), float(info.max)))
            v.casts[dtype] = lax.full(np.shape(v.val), value, dtype)
        elif v.const and narrower:
            v.casts[dtype] = _saturating(v.val, dtype)
        else:
            v.casts[dtype] = _convert(v.val, dtype)
    return v.casts[dtype]


def _computes_f32(eqn, op_rules: OpRules, wants: set) -> bool:
    """Whether ``eqn`` computes in float32 whatever its operands' dtypes: an ``fp32`` op, or
    a promote/structural op whose every float output is wanted in float32."""
    kind = op_rules.classify(eqn.primitive.name)
    if kind == "fp32":
        return True
    if kind in ("promote", "structural") or eqn.primitive.name in _INLINE:
        outs = [o for o in eqn.outvars if _is_float(o.aval.dtype)]
        return bool(outs) and all(o in wants for o in outs)
    return False


def _wants_f32(jaxpr: jcore.Jaxpr, op_rules: OpRules, out_wants: Sequence[bool]) -> set:
    """Vars whose every consumer computes in float32 (so they are best computed in float32)."""
    return all_consumers_accept(jaxpr, lambda eqn, wants: _computes_f32(eqn, op_rules, wants),
                                out_wants)


class _Regions:
    """The region table filled while tracing: region id -> policy (id 0: the default)."""

    def __init__(self, rules: ModuleRules):
        self.rules = rules
        self.policies: list[jmp.Policy] = [rules.default]
        self.paths: list[str] = ["<root>"]
        self.matched_patterns: set[str] = set()
        self.stack: list[nn.Module] = []
        self.call = next(_CALLS)  # this call's number in its region markers
        self.attention = _attention.Recorder(self.call)  # its fused-attention calls

    def interceptor(self, next_fun, args, kwargs, context):
        """A linen method interceptor, and an NNX one (:func:`jaxamp.nnx_frontend.intercept_calls`,
        whose ``context`` carries the path an NNX module does not know)."""
        module = context.module
        if self.stack and self.stack[-1] is module:
            return next_fun(*args, **kwargs)  # a module calling its own methods: same region
        path = getattr(context, "path", None)
        policy, pattern = self.rules.match(module, path)
        if pattern is not None:
            self.matched_patterns.add(pattern)
        self.stack.append(module)
        try:
            if policy is None:
                return next_fun(*args, **kwargs)
            self.policies.append(policy)
            self.paths.append(module_path(module, path))
            with jax.named_scope(f"jaxamp<{self.call}.{len(self.policies) - 1}>"):
                return next_fun(*args, **kwargs)
        finally:
            self.stack.pop()


class _Evaluator:
    """Re-evaluates a traced jaxpr with each equation in its autocast dtype."""

    def __init__(self, policies: Sequence[jmp.Policy], op_rules: OpRules, call: int = 0,
                 attention_calls: Sequence = (), f32_weight_grads: bool = False):
        self.policies = policies
        self.op_rules = op_rules
        self.f32_weight_grads = f32_weight_grads  # param gradients of matmuls: float32 output
        self.attention_calls = attention_calls  # jax.nn.dot_product_attention calls recorded
        self.call = call  # region markers of other autocast calls (nested ones) are ignored
        self.unknown: set[str] = set()  # primitives in no op list that were met (warned once)
        self.marks: dict = {}  # name stack -> the region ids of this call's markers in it

    # ---- regions -------------------------------------------------------------------------
    def compute_dtype(self, region: tuple[int, ...]) -> np.dtype:
        return np.dtype(self.policies[region[-1] if region else 0].compute_dtype)

    def region_of(self, eqn, base: tuple[int, ...]) -> tuple[int, ...]:
        stack = eqn.source_info.name_stack  # equal for the equations of one scope: cache it
        try:
            ids = self.marks.get(stack)
        except TypeError:  # pragma: no cover - an unhashable name stack
            stack, ids = None, None
        if ids is None:
            ids = tuple(int(k) for c, k in REGION_MARKER.findall(name_stack(eqn))
                        if int(c) == self.call)
            if stack is not None:
                self.marks[stack] = ids
        if not ids:
            return base
        return base + tuple(i for i in ids if i not in base)

    def crossing(self, v: _Val, region: tuple[int, ...]) -> np.dtype | None:
        """The dtype ``v`` is cast to on its way into ``region``, or None if it is not."""
        if v.region == region or not v.is_float:
            return None
        cut = 0
        while cut < min(len(v.region), len(region)) and v.region[cut] == region[cut]:
            cut += 1
        target = None
        stored = v.stored
        if len(v.region) > cut:  # leaving the module region v.region[cut]
            target = np.dtype(self.policies[v.region[cut]].output_dtype)
            stored = False
        if len(region) > cut and not stored:  # entering a module region
            target = self.compute_dtype(region)
        return target

    def computes_f32(self, eqn, raw: Sequence[_Val], region, wants: set) -> bool:
        """Whether ``eqn`` computes in float32 whatever the region crossings of its operands
        do: an fp32 op, an op whose outputs are wanted in float32, or a promote op with a
        float32 activation among its operands after their crossings."""
        if _computes_f32(eqn, self.op_rules, wants):
            return True
        if self.op_rules.classify(eqn.primitive.name) != "promote":
            return False
        for v in raw:
            if v.is_float and not v.stored:
                dtype = self.crossing(v, region) or v.dtype
                if dtype == _F32:
                    return True
        return False

    def operand(self, v: _Val, region: tuple[int, ...], f32_use: bool = False) -> _Val:
        """``v`` as an eqn in ``region`` sees it: cast on leaving/entering a matched module.

        The crossing is cached on ``v`` (every consumer in ``region`` shares one cast and its
        own casts). A value leaving a module wider than the module's output dtype stays wide
        for a consumer that computes in float32 anyway (``f32_use``): casting it down there
        would only round it (f32 -> f16 -> f32).
        """
        target = self.crossing(v, region)
        if target is None:
            return v
        if f32_use and target != v.dtype and v.dtype == _F32:
            target = _F32
        key = ("region", region, target)
        if key not in v.casts:
            if target == v.dtype:
                v.casts[key] = _Val(v.val, False, v.const, region, v.casts)
            else:
                v.casts[key] = _Val(_cast(v, target), False, False, region)
        return v.casts[key]

    # ---- the interpreter ------------------------------------------------------------------
    def eval(self, closed: jcore.ClosedJaxpr | jcore.Jaxpr, consts: Sequence[_Val] | None,
             args: Sequence[_Val], base: tuple[int, ...],
             out_wants: Sequence[bool] | None = None) -> list[_Val]:
        jaxpr, closed_consts = open_jaxpr(closed)
        if consts is None:
            consts = [_Val(c, True, not isinstance(c, Tracer), base)
                      for c in closed_consts or []]
        out_wants = out_wants or [False] * len(jaxpr.outvars)
        wants = _wants_f32(jaxpr, self.op_rules, out_wants)

        def literal(lit) -> _Val:
            return _Val(lit.val, True, True, base)

        def run_eqn(eqn, raw: list[_Val]) -> list[_Val]:
            region = self.region_of(eqn, base)
            if eqn.primitive.name in _INLINE:
                # An inlined call (jax.nn.silu, any @jax.jit helper) crosses no boundary of
                # its own: its equations take each operand across as they use it, so a
                # float32 value leaving a module stays float32 for an inner float32 consumer.
                ins = raw
            else:
                f32_use = self.computes_f32(eqn, raw, region, wants)
                ins = [self.operand(v, region, f32_use) for v in raw]
            want32 = [o in wants for o in eqn.outvars]
            with source_context(eqn):
                return self.eqn(eqn, ins, region, want32)

        return evaluate(jaxpr, consts, args, run_eqn, literal)

    def eqn(self, eqn, ins: list[_Val], region, want32: list[bool]) -> list[_Val]:
        name = eqn.primitive.name
        if name in _INLINE:
            recorded = _attention.CALL_NAME.fullmatch(str(eqn.params.get("name", "")))
            if recorded and int(recorded[1]) == self.call:
                outs = self.attention(ins, region, int(recorded[2]))
                if outs is not None:
                    return outs
            return self.eval(eqn.params["jaxpr"], None, ins, region, want32)
        if name in _REMAT:
            return self.remat(eqn, ins, region)
        if name == "scan":
            return self.scan(eqn, ins, region)
        if name == "while":
            return self.while_loop(eqn, ins, region)
        if name == "cond":
            return self.cond(eqn, ins, region)
        if name == "custom_jvp_call":
            return self.custom_jvp(eqn, ins, region)
        if name == "shard_map":
            return self.shard_map(eqn, ins, region)
        if name == "custom_vjp_call" and not self.op_rules.runs_custom_vjp_as_traced(
                custom_vjp_name(eqn)):
            return self.custom_vjp(eqn, ins, region)
        if name == "convert_element_type":
            return self.convert(eqn, ins, region)
        kind = self.op_rules.classify(name)
        if kind == "opaque" and name not in self.op_rules.as_traced:
            self.unknown.add(name)
        if any(jcore.jaxprs_in_params(eqn.params)):
            kind = "opaque"
        floats = [v for v in ins if v.is_float]
        all_const = all(v.const for v in ins)
        if kind == "structural":
            if want32 and all(want32) and any(not v.stored for v in floats):
                vals = [_cast(v, _F32) if v.is_float else v.val for v in ins]
            else:
                vals = [v.val for v in ins]
            outs = self.bind(eqn, vals, region, stored=all(v.stored for v in floats),
                             const=all_const)
            if all_const and name == "broadcast_in_dim" and np.ndim(ins[0].val) == 0 \
                    and not isinstance(ins[0].val, Tracer) and ins[0].is_float:
                outs[0].splat = float(ins[0].val)
            return outs
        if kind in ("promote", "matmul", "fp32") and all_const:
            return self.opaque(eqn, ins, region)
        if kind == "matmul":
            dtype = self.compute_dtype(region)
            params = dict(eqn.params)
            if params.get("preferred_element_type") is not None and floats:
                params["preferred_element_type"] = dtype
            wide = tuple(v.stored and not v.const and v.is_float for v in ins)
            if self.f32_weight_grads and dtype != _F32 and len(ins) == 2:
                # a param's gradient summed over the batch (across devices) in float32
                if name == "dot_general" and any(wide):
                    out = dot_f32_weight_grads(eqn.primitive, params,
                                               *[v.val if w else _cast(v, dtype)
                                                 for v, w in zip(ins, wide)], dtype, wide)
                    return [_Val(out, False, False, region)]
                if name == "conv_general_dilated" and wide[1]:
                    out = conv_f32_kernel_grads(eqn.primitive, params, _cast(ins[0], dtype),
                                                ins[1].val, dtype)
                    return [_Val(out, False, False, region)]
            vals = [_cast(v, dtype) for v in ins]
            return self.bind(eqn, vals, region, params=params)
        if kind == "fp32":
            return self.bind(eqn, [_cast(v, _F32) for v in ins], region)
        if kind == "promote":
            float_wants = [w for w, o in zip(want32, eqn.outvars) if _is_float(o.aval.dtype)]
            live = [v.dtype for v in floats if not v.stored]
            if float_wants and all(float_wants):
                dtype = _F32
            elif live:
                dtype = _widest(live)
            else:
                # Only stored operands (params, float inputs, int inputs made float): no
                # activation decides yet, so the op runs as traced and its result stays
                # stored, cast where an activation or a matmul first uses it. Committing to
                # the compute dtype here would round what precision depends on: a diffusion
                # timestep x frequency fed to sin/cos, a squared weight in an L2 penalty.
                return self.bind(eqn, [_cast(v, var.aval.dtype) if v.is_float else v.val
                                       for v, var in zip(ins, eqn.invars)], region,
                                 stored=True)
            return self.bind(eqn, [self.promoted(v, dtype, eqn) for v in ins], region)
        return self.opaque(eqn, ins, region)

    def promoted(self, v: _Val, dtype, eqn):
        """``v`` cast for an elementwise op; a stored operand that the op broadcasts (a bias)
        is broadcast before the cast, so its gradient is summed in its stored dtype."""
        out_shape = eqn.outvars[0].aval.shape
        shape = np.shape(v.val)
        if (v.stored and not v.const and v.is_float and v.dtype != np.dtype(dtype)
                and eqn.primitive.name not in _NOT_ELEMENTWISE
                and len(shape) == len(out_shape) and shape != out_shape
                and all(a in (1, b) for a, b in zip(shape, out_shape))):
            key = ("broadcast", out_shape, np.dtype(dtype))
            if key not in v.casts:
                v.casts[key] = _broadcast_convert(v.val, out_shape, np.dtype(dtype))
            return v.casts[key]
        return _cast(v, dtype)

    def bind(self, eqn, vals, region, *, params=None, stored=False, const=False) -> list[_Val]:
        params = eqn.params if params is None else params
        out = _bind(eqn.primitive, vals, params)
        outs = out if eqn.primitive.multiple_results else [out]
        return [_Val(o, stored, const, region) for o in outs]

    def opaque(self, eqn, ins: list[_Val], region) -> list[_Val]:
        """Runs an equation exactly as traced (its original input dtypes)."""
        vals = [_cast(v, var.aval.dtype) if v.is_float and _is_float(var.aval.dtype) else v.val
                for v, var in zip(ins, eqn.invars)]
        out = bind_with_params(eqn, vals)
        outs = out if eqn.primitive.multiple_results else [out]
        floats = [v for v in ins if v.is_float]
        const = all(v.const for v in ins)
        # A float made from no float input (random bits bitcast to a uniform) is computed, not
        # stored: cast like an activation it would quantise dropout's uniforms to float16.
        stored = all(v.stored for v in floats) if floats else const
        return [_Val(o, stored, const, region) for o in outs]

    def convert(self, eqn, ins, region) -> list[_Val]:
        (v,), new = ins, np.dtype(eqn.params["new_dtype"])
        src = eqn.invars[0].aval.dtype
        if v.is_float and _is_float(new):
            # Float -> float casts in the trace: a weak-type change or a downcast (often
            # jnp's own, e.g. after summing low-precision values in f32) is autocast's to
            # decide, so it passes the value through; an explicit upcast is honoured.
            if np.dtype(src) == new or jnp.finfo(new).bits <= jnp.finfo(v.dtype).bits:
                return [v]
            return [_Val(_cast(v, new), False, v.const, region)]
        out = lax.convert_element_type(v.val, new)
        # An int/bool -> float conversion makes a stored value (cast where it is used).
        return [_Val(out, v.stored or not v.is_float, v.const, region)]

    # ---- control flow ---------------------------------------------------------------------
    def run_body(self, closed, metas: Sequence[_Val], region, vals, out_wants=None):
        """Evaluates a sub-jaxpr inside a new trace: fresh values, no shared cast caches."""
        args = [m.fresh(x) for m, x in zip(metas, vals)]
        return self.eval(closed, None, args, region, out_wants)

    def out_dtypes(self, closed, metas, region, shapes) -> list:
        """The output dtypes of a sub-jaxpr run on ``shapes`` (abstract: nothing computed)."""
        outs = jax.eval_shape(
            lambda *xs: [o.val for o in self.run_body(closed, metas, region, xs)], *shapes)
        return [o.dtype for o in outs]

    def remat(self, eqn, ins, region) -> list[_Val]:
        p = eqn.params
        closed = close_jaxpr(p["jaxpr"])
        metas: list[_Val] = []

        def body(*xs):
            outs = self.run_body(closed, ins, region, xs)
            metas[:] = outs
            return [o.val for o in outs]

        outs = jax.checkpoint(body, prevent_cse=p.get("prevent_cse", True),
                              policy=p.get("policy"))(*[v.val for v in ins])
        return [m.fresh(o) for m, o in zip(metas, outs)]

    def shard_map(self, eqn, ins, region) -> list[_Val]:
        """A ``shard_map`` body (a hand-written tensor-parallel layer, its ``psum``) re-evaluated
        per device under the region's policy, bound again as a ``shard_map`` with the same
        mesh and specs. Params enter as stored and are cast per shard where they are used.
        (The backward's ``psum`` of an activation gradient, the transpose of ``pvary``, is in
        that activation's dtype.)"""
        metas: list[_Val] = []

        def body(*xs):
            outs = self.run_body(eqn.params["jaxpr"], ins, region, xs)
            metas[:] = outs
            return [o.val for o in outs]

        outs = shard_map_again(eqn, body, [v.val for v in ins])
        return [m.fresh(o) for m, o in zip(metas, outs)]

    def _carry_dtypes(self, init: list[_Val], body_dtypes: Callable[[list], list]) -> list:
        dtypes = [v.dtype for v in init]
        for _ in range(4):
            new = [_widest([a, b]) if _is_float(a) and _is_float(b) else a
                   for a, b in zip(dtypes, body_dtypes(dtypes))]
            if new == dtypes:
                return dtypes
            dtypes = new
        return dtypes

    def scan(self, eqn, ins, region) -> list[_Val]:
        p = eqn.params
        nc, nk = scan_counts(p)
        consts, init, xs = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]
        body = p["jaxpr"]
        live = [dataclasses.replace(v, stored=False, const=False, casts={}) for v in init]

        def body_dtypes(dtypes):
            shapes = ([_spec(v.val) for v in consts]
                      + [_spec(v.val, d) for v, d in zip(init, dtypes)]
                      + [jax.ShapeDtypeStruct(np.shape(v.val)[1:], v.dtype) for v in xs])
            return self.out_dtypes(body, consts + live + xs, region, shapes)[:nk]

        dtypes = self._carry_dtypes(init, body_dtypes)
        const_vals = [v.val for v in consts]

        def f(carry, x):
            outs = self.run_body(body, consts + live + xs, region, [*const_vals, *carry, *x])
            new_carry = [_cast(o, d) for o, d in zip(outs[:nk], dtypes)]
            return new_carry, [o.val for o in outs[nk:]]

        carry, ys = lax.scan(f, [_cast(v, d) for v, d in zip(init, dtypes)],
                             [v.val for v in xs], length=p["length"], reverse=p["reverse"],
                             unroll=p["unroll"])
        return [_Val(o, False, False, region) for o in (*carry, *ys)]

    def while_loop(self, eqn, ins, region) -> list[_Val]:
        p = eqn.params
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, init = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
        live = [dataclasses.replace(v, stored=False, const=False, casts={}) for v in init]
        bvals = [v.val for v in bconsts]
        cvals = [v.val for v in cconsts]

        def body_dtypes(dtypes):
            shapes = ([_spec(v.val) for v in bconsts]
                      + [_spec(v.val, d) for v, d in zip(init, dtypes)])
            return self.out_dtypes(p["body_jaxpr"], bconsts + live, region, shapes)

        dtypes = self._carry_dtypes(init, body_dtypes)

        def cond_fn(carry):
            (out,) = self.run_body(p["cond_jaxpr"], cconsts + live, region, [*cvals, *carry])
            return out.val

        def body_fn(carry):
            outs = self.run_body(p["body_jaxpr"], bconsts + live, region, [*bvals, *carry])
            return [_cast(o, d) for o, d in zip(outs, dtypes)]

        outs = lax.while_loop(cond_fn, body_fn, [_cast(v, d) for v, d in zip(init, dtypes)])
        return [_Val(o, False, False, region) for o in outs]

    def cond(self, eqn, ins, region) -> list[_Val]:
        index, ops = ins[0], ins[1:]
        branches = eqn.params["branches"]
        vals = [v.val for v in ops]
        per_branch = [self.out_dtypes(br, ops, region, [_spec(x) for x in vals])
                      for br in branches]
        dtypes = [_widest(list(ds)) if all(_is_float(d) for d in ds) else ds[0]
                  for ds in zip(*per_branch)]

        def make(br):
            def fn(*xs):
                outs = self.run_body(br, ops, region, xs)
                return [_cast(o, d) for o, d in zip(outs, dtypes)]
            return fn

        outs = lax.switch(index.val, [make(br) for br in branches], *vals)
        return [_Val(o, False, False, region) for o in outs]

    def custom_jvp(self, eqn, ins, region) -> list[_Val]:
        p = eqn.params
        if p["num_consts"]:
            return self.opaque(eqn, ins, region)
        call, jvp_fun = p["call_jaxpr"], p["jvp_jaxpr_fun"]

        def primal(*xs):
            return [o.val for o in self.run_body(call, ins, region, xs)]

        fn = jax.custom_jvp(primal)

        def rule(primals, tangents):
            out_dtypes = [o.dtype for o in jax.eval_shape(primal, *primals)]
            zeros = [_dtype_of(t) == jax.dtypes.float0 for t in tangents]
            jaxpr, consts, out_zeros = jvp_fun.call_wrapped(*zeros)
            nz = [t for t, z in zip(tangents, zeros) if not z]
            metas = list(ins) + [dataclasses.replace(v, stored=False, const=False, casts={})
                                 for v, z in zip(ins, zeros) if not z]
            outs = self.run_body(close_jaxpr(jaxpr, consts), metas, region,
                                 [*primals, *nz])
            n = len(out_zeros)
            p_out = [_cast(o, d) for o, d in zip(outs[:n], out_dtypes)]
            nz_t = iter(outs[n:])
            t_out = [jnp.zeros(np.shape(po), d) if z else _cast(next(nz_t), d)
                     for po, z, d in zip(p_out, out_zeros, out_dtypes)]
            return p_out, t_out

        fn.defjvp(rule)
        outs = fn(*[v.val for v in ins])
        return [_Val(o, False, all(v.const for v in ins), region) for o in outs]

    def attention(self, ins, region, index: int) -> list[_Val] | None:
        """A recorded ``jax.nn.dot_product_attention`` call bound again as cuDNN's fused
        kernel in the region's compute dtype, or None: re-evaluate its traced XLA path (see
        :mod:`jaxamp._attention`)."""
        names, static = self.attention_calls[index]
        dtype = self.compute_dtype(region)
        if not _attention.wants_cudnn(static) or dtype == _F32:
            return None
        vals = [self.operand(v, region).val for v in ins]
        try:
            out = _attention.redispatch(names, static, vals, dtype)
        except Exception:
            if static.get("implementation") == "cudnn":
                raise  # asked for explicitly: JAX's own error says what cuDNN refused
            return None
        return [_Val(o, False, False, region) for o in jax.tree.leaves(out)]

    def custom_vjp(self, eqn, ins, region) -> list[_Val]:
        """A ``jax.custom_vjp`` function keeps its custom rule, and both of its halves run
        under the region's policy. Its forward and backward rules are traced (as written, in
        the traced dtypes) through the public ``jax.vjp`` into two plain jaxprs, the forward
        returning the residuals the backward reads; each is then re-evaluated like any other
        program, so the matmuls of a hand-written attention kernel and of its backward run in
        the compute dtype and its softmax in float32."""
        floats = [i for i, v in enumerate(eqn.invars) if _is_float(v.aval.dtype)]
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

        fwd_jaxpr, (out_specs, res_specs) = jax.make_jaxpr(traced_fwd, return_shape=True)(
            *specs)
        bwd_jaxpr = jax.make_jaxpr(
            lambda res, cts: pullback[0].unflatten(res)(cts))(res_specs, out_specs)

        def activations(n):
            return [_Val(None, False, False, region) for _ in range(n)]

        def primal(*xs):
            return [o.val for o in self.run_body(eqn.params["call_jaxpr"], ins, region, xs)]

        fn = jax.custom_vjp(primal)

        def fwd(*xs):
            outs = self.run_body(fwd_jaxpr, ins, region, xs)
            # the primal outputs must have the dtypes the primal function gives them here
            dtypes = [o.dtype for o in jax.eval_shape(primal, *xs)]
            return ([_cast(o, d) for o, d in zip(outs[:n_out], dtypes)],
                    [o.val for o in outs[n_out:]])

        def bwd(res, cts):
            outs = self.run_body(bwd_jaxpr, activations(len(res) + len(cts)), region,
                                 [*res, *cts])
            cts_in = [None] * len(ins)
            for i, o in zip(floats, outs):
                cts_in[i] = _cast(o, ins[i].dtype)
            return tuple(cts_in)

        fn.defvjp(fwd, bwd)
        outs = fn(*[v.val for v in ins])
        return [_Val(o, False, all(v.const for v in ins), region) for o in outs]


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, Tracer))


def _linen_apply_module(fn) -> nn.Module | None:
    module = getattr(fn, "__self__", None)
    if isinstance(module, nn.Module) and getattr(fn, "__name__", "") == "apply":
        return module
    return None


def autocast(fn: Callable, policy: str | jmp.Policy = DEFAULT_POLICY, *,
             overrides: Mapping[Any, str | jmp.Policy] | None = None,
             op_rules: OpRules = DEFAULT_OP_RULES,
             f32_weight_grads: bool | None = None) -> Callable:
    """Returns ``fn`` running under mixed-precision policies, with ``fn``'s signature.

    ``fn`` is any JAX function, typically a Flax linen ``model.apply`` (then module rules
    apply per module) or a loss; or a Flax NNX module (``autocast(model)(x)``), a function
    taking NNX modules (``autocast(f)(model, x)``), or one that merges them from
    ``nnx.split``'s ``(graphdef, state)``: module rules then apply per NNX module, by class or
    by NNX path (``"blocks/3/attn"``). NNX models passed in are not traced into (copies are
    merged inside the trace); Variables the call changes (BatchNorm statistics) are written
    back to them, as calling the model would. Its author writes no dtype code:
    matmuls/convolutions run in the compute dtype; exp/log/softmax/logsumexp, sums and
    normalisation statistics in float32;
    float inputs (params) stay stored in their dtype and are cast where they are used, so
    gradients with respect to them come back in their dtype; integer inputs are never cast.
    The float outputs are cast to the policy's ``output_dtype``.

    Args:
      fn: the function to run.
      policy: the default policy, a string such as ``"params=float32,compute=bfloat16,
        output=float32"`` or a :class:`jmp.Policy`.
      overrides: per-module rules ``{module class or path pattern: policy}``; see
        :mod:`jaxamp.rules` for matching and precedence. Normalisation layers compute in
        float32 unless a rule says otherwise.
      op_rules: which primitives run in which dtype (:data:`jaxamp.DEFAULT_OP_RULES`), and
        which ``jax.custom_vjp`` functions run exactly as traced instead of under the policy
        (``DEFAULT_OP_RULES.extend(custom_vjp_as_traced={"flash_attention"})``; ``"*"``: all).
        Opt a whole module out with a module rule (``overrides={"blocks_*/attn":
        "float32"}``).
      f32_weight_grads: whether a low-precision matmul or convolution with a param operand
        computes that param's gradient with a float32 output (same low-precision operands),
        so that its sum over the batch, across devices too, is float32. None (the default):
        where that sum may cross devices, i.e. when traced under a mesh (``jax.set_mesh``,
        as ``make_train_step(mesh=...)`` does) or when more than one device is visible;
        one device keeps JAX's own transposes.

    Returns:
      A function with ``fn``'s signature; it traces ``fn`` on each call (``jax.jit`` it).

    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp, jaxamp
      >>> model = nn.Dense(4)
      >>> params = model.init(jax.random.key(0), jnp.ones((2, 3)))
      >>> fwd = jaxamp.autocast(model.apply, "params=float32,compute=float16,output=float32")
      >>> fwd(params, jnp.ones((2, 3))).dtype          # computed in f16, returned in f32
      dtype('float32')
    """
    if not callable(fn):
        raise TypeError(f"autocast: fn must be callable, got {type(fn).__name__}.")
    if not isinstance(op_rules, OpRules):
        raise TypeError(f"autocast: op_rules must be a jaxamp.OpRules, got "
                        f"{type(op_rules).__name__}. Use jaxamp.DEFAULT_OP_RULES.extend(...).")
    if f32_weight_grads is not None and not isinstance(f32_weight_grads, bool):
        raise TypeError(f"autocast: f32_weight_grads must be True, False or None (decided by "
                        f"the devices), got {f32_weight_grads!r}.")
    rules = ModuleRules.create(policy, overrides)
    apply_module = _linen_apply_module(fn)
    if nnx_frontend.is_module(fn):  # autocast(model)(x): model(x), the model passed as an argument
        model = fn

        def fn(*args, **kwargs):
            return args[0](*args[1:], **kwargs)

        functools.update_wrapper(fn, type(model).__call__)
        run = _autocast(fn, rules, op_rules, apply_module, f32_weight_grads)

        @functools.wraps(type(model).__call__)
        def call_model(*args, **kwargs):
            return run(model, *args, **kwargs)

        return call_model
    return functools.wraps(fn)(_autocast(fn, rules, op_rules, apply_module, f32_weight_grads))


def _autocast(fn: Callable, rules: ModuleRules, op_rules: OpRules,
              apply_module: nn.Module | None, f32_weight_grads: bool | None) -> Callable:
    def wrapped(*args, **kwargs):
        modules = None
        if any(nnx_frontend.is_module(x) for x in jax.tree_util.tree_leaves(
                (args, kwargs), is_leaf=nnx_frontend.is_module)):
            # NNX models are split: their state is traced, copies are merged inside the trace
            # (the user's objects never hold tracers), and changed values are written back.
            modules = nnx_frontend.ModuleArgs(args, kwargs)
            args, kwargs = modules.split()
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        dyn = [i for i, x in enumerate(leaves) if _is_array(x)]
        regions = _Regions(rules)

        def flat_fn(*dyn_vals):
            full = list(leaves)
            for i, x in zip(dyn, dyn_vals):
                full[i] = x
            a, k = jax.tree_util.tree_unflatten(treedef, full)
            with nn.intercept_methods(regions.interceptor), \
                    nnx_frontend.intercept_calls(regions.interceptor), \
                    _attention.recording(regions.attention):
                if modules is None:
                    return fn(*a, **k)
                copies, a, k = modules.merge(a, k)
                return fn(*a, **k), modules.values(copies)

        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(
            *[leaves[i] for i in dyn])
        _warn_unmatched(rules, regions)
        evaluator = _Evaluator(regions.policies, op_rules, regions.call,
                               regions.attention.calls, _sums_across_devices()
                               if f32_weight_grads is None else f32_weight_grads)
        dyn_vals = [leaves[i] for i in dyn]
        consts = [_Val(c, True, not isinstance(c, Tracer), (0,)) for c in closed.consts]
        ins = [_Val(x, True, False, ()) for x in dyn_vals]
        outs = evaluator.eval(closed.jaxpr, consts, ins, (0,))
        _warn_unknown(evaluator.unknown)
        out_leaves, out_tree = jax.tree_util.tree_flatten(out_shape)
        cast_mask = [True] * len(out_leaves)
        if (apply_module is not None and kwargs.get("mutable")) or modules is not None:
            # linen's updated collections / NNX models' Variables keep their stored dtypes
            n_first = len(jax.tree_util.tree_leaves(out_shape[0]))
            cast_mask = [i < n_first for i in range(len(out_leaves))]
        result = []
        for v, do_cast, shape in zip(outs, cast_mask, out_leaves):
            if not do_cast and modules is not None and v.is_float:
                result.append(_cast(v, shape.dtype))  # a Variable keeps its dtype
            elif not do_cast or not v.is_float:
                result.append(v.val)
            else:
                result.append(_cast(v, rules.default.output_dtype))
        out = jax.tree_util.tree_unflatten(out_tree, result)
        if modules is None:
            return out
        modules.write_back(out[1])
        return out[0]

    return wrapped


def _sums_across_devices() -> bool:
    """Whether a batch contraction may be a sum across devices: traced under a mesh
    (``jax.set_mesh``), or more than one device visible (plain ``jax.jit`` of inputs placed
    with ``NamedSharding``, which sets no mesh)."""
    return mesh_is_set() or jax.device_count() > 1


def _warn_unknown(names: set[str]) -> None:
    if names:
        warnings.warn(
            f"jaxamp.autocast: primitive(s) {sorted(names)} are in no list of the op_rules; "
            "they run exactly as traced (float32). Classify them with "
            "op_rules=jaxamp.DEFAULT_OP_RULES.extend(promote={...}) (or matmul=, fp32=, "
            "structural=, as_traced=) to silence this.", stacklevel=3)


def _warn_unmatched(rules: ModuleRules, regions: _Regions) -> None:
    for pattern, _, _ in rules.path_rules:
        if pattern not in regions.matched_patterns:
            warnings.warn(
                f"jaxamp.autocast: path rule {pattern!r} matched no module in this call. Module "
                "paths look like 'Decoder_0/layers_1/attn' ('*' matches within one segment, "
                "'**' across segments); check the pattern.", stacklevel=3)
