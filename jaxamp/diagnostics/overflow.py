"""Overflow and underflow locator: one forward and backward under a policy, every float value
recorded, and where low-precision values leave their dtype's range (float16: largest finite
65504, smallest normal 2**-14, smallest subnormal 2**-24). How: docs/api/diagnostics.rst.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import jmp
import numpy as np

from .._engine.compat import Tracer, bind_with_params, scan_params
from .._engine.jaxpr import evaluate, name_stack, sub_programs
from ..engine import autocast
from ..nnx_frontend import functional, is_module
from ..policy import get_policy, policy_to_str
from ..rules import ModuleRules, OpRules
from ..transform import default_loss_scale
from ._base import Report, escape, markdown_table, rich_table
from ._trace import (
    LOW,
    SCAFFOLD,
    TOP_LEVEL,
    Recorder,
    _module_key,
    canonical_path,
    clean_path,
    dce,
    display_path,
    module_of,
    recording,
    resolve_call,
)
from .metrics import strict

__all__ = ["F16_MAX", "F16_MIN_NORMAL", "F16_MIN_SUBNORMAL", "NEAR_OVERFLOW_BITS",
           "UNDERFLOW_FRACTION", "OverflowReport", "locate_overflow"]

F16_MAX = 65504.0
F16_MIN_NORMAL = 2.0**-14
F16_MIN_SUBNORMAL = 2.0**-24
#: a module whose low-precision values come within this many bits (a factor 4) of the largest
#: finite value is reported as ``near_overflow``.
NEAR_OVERFLOW_BITS = 2.0
#: a module is reported as ``underflow`` when more than this fraction of its true gradients
#: flush to zero in float16 even with the loss scale.
UNDERFLOW_FRACTION = 0.01


def _device_summary(x, scale: float):
    """The ``[k, 8]`` statistics of a ``[k, ...]`` stack of same-shaped arrays, reduced on the
    devices that hold it: [max finite |x|, #non-finite, #nonzero finite, #(0<|x|<2^-24),
    #(0<|x*scale|<2^-24), #(0<|x|<tiny(dtype)), #values, #saturated]. Values exactly at the
    dtype's largest magnitude (``finfo.min`` masks, autocast's saturated constants) are
    *saturated*: counted apart and left out of the max."""
    info = jnp.finfo(x.dtype)
    a = jnp.abs(x.astype(jnp.float32)).reshape(x.shape[0], math.prod(x.shape[1:]))
    fin = jnp.isfinite(a)
    sat = fin & (a >= jnp.float32(info.max))
    nz = fin & (a > 0)
    scaled = a * jnp.float32(scale)

    def count(m):
        return jnp.sum(m, axis=1, dtype=jnp.int32).astype(jnp.float32)
    return jnp.stack([
        jnp.max(jnp.where(fin & ~sat, a, 0.0), axis=1, initial=0.0), count(~fin),
        count(nz & ~sat), count(nz & (a < F16_MIN_SUBNORMAL)),
        count(nz & (scaled < F16_MIN_SUBNORMAL)), count(nz & (a < float(info.tiny))),
        jnp.full(a.shape[:1], a.shape[1], jnp.float32), count(sat)], axis=1)


def _device_summaries(xs, scale: float):
    """:func:`_device_summary` of every array in ``xs``, one ``[n, 8]`` array in their order;
    arrays of one shape and dtype are stacked and reduced together (a smaller program)."""
    if not xs:
        return jnp.zeros((0, 8), jnp.float32)
    groups: dict[tuple, list[int]] = {}
    for i, x in enumerate(xs):
        groups.setdefault((tuple(x.shape), np.dtype(x.dtype)), []).append(i)
    order = [i for idx in groups.values() for i in idx]
    stats = jnp.concatenate([_device_summary(jnp.stack([xs[i] for i in idx]), scale)
                             for idx in groups.values()])
    return stats[np.argsort(np.asarray(order))]


def _to_host(x) -> np.ndarray:
    """A small, fully replicated result on this host (every host holds a copy)."""
    return np.asarray(jax.device_get(x), np.float64)


def _summaries(xs, scale: float) -> list[np.ndarray]:
    """:func:`_device_summaries` of the arrays ``xs``, on the host."""
    if not xs:
        return []
    return list(_to_host(jax.jit(lambda xs: _device_summaries(xs, scale))(list(xs))))


def _is_float(x) -> bool:
    try:
        return jnp.issubdtype(x.dtype, jnp.floating)
    except (AttributeError, TypeError):
        return False


@dataclasses.dataclass
class _Acc:
    """Running statistics of the values one module produced in one pass."""

    max_abs: float = 0.0
    nonfinite: int = 0
    nonzero: int = 0
    under: int = 0  # 0 < |v| < 2^-24
    under_scaled: int = 0  # 0 < |v * scale| < 2^-24
    subnormal: int = 0  # 0 < |v| < smallest normal of the value's dtype
    count: int = 0
    saturated: int = 0
    dtypes: set = dataclasses.field(default_factory=set)
    # min over float16/bfloat16 values of log2(finfo.max / max|v|): bits of headroom
    low_headroom_bits: float = math.inf
    low_nonzero: int = 0

    def add(self, s: np.ndarray, dtype: str) -> None:
        mx = float(s[0])
        self.max_abs = max(self.max_abs, mx)
        self.nonfinite += int(s[1])
        self.nonzero += int(s[2])
        self.under += int(s[3])
        self.under_scaled += int(s[4])
        self.count += int(s[6])
        self.saturated += int(s[7])
        self.dtypes.add(dtype)
        if dtype in LOW:
            self.subnormal += int(s[5])
            self.low_nonzero += int(s[2])
            if mx > 0:
                self.low_headroom_bits = min(self.low_headroom_bits,
                                             math.log2(float(jnp.finfo(dtype).max) / mx))


class _Values:
    """Every float value one evaluation of a jaxpr makes (traced, inside one ``jax.jit``),
    with its ``(module, backward)`` and dtype, and per equation that makes one: where it ran,
    its inputs (value indices, or whether a constant is finite) and its outputs' indices."""

    def __init__(self, modules):
        self.modules = modules
        self.values: list = []
        self.keys: list[tuple[str, bool]] = []
        self.dtypes: list[str] = []
        self.ids: dict[int, int] = {}  # id(traced value) -> index in values
        self.events: list[tuple[dict[str, Any], list, list[int]]] = []

    def run(self, jaxpr, consts, args, prefix: str = ""):
        """Evaluates ``jaxpr``: calls inlined, ``scan`` unrolled, ``while``/``cond`` run as one
        operation (their inner values are not seen)."""
        return evaluate(jaxpr, consts, args,
                        lambda eqn, vals: self._eqn(eqn, vals, name_stack(eqn, prefix)))

    def _eqn(self, eqn, vals, full):
        name = eqn.primitive.name
        if SCAFFOLD in full:
            return _bind(eqn, vals)
        if name == "scan":
            return self._scan(eqn, vals, full)
        if name not in ("while", "cond", "custom_lin"):
            inline = [s for s in sub_programs(eqn) if None not in s.ins]
            if len(inline) == 1:  # a call (jit, remat, custom_jvp/vjp: its primal body)
                return self.run(inline[0].jaxpr, inline[0].consts, vals, full)
        outs = _bind(eqn, vals)
        floats = [o for o in outs if _is_float(o)]
        if floats:
            self._record(eqn.primitive.name, full, vals, floats)
        return outs

    def _record(self, primitive: str, full: str, vals, floats) -> None:
        key = (module_of(full, self.modules)[1], clean_path(full)[1])
        ins = [self.ids[id(v)] if id(v) in self.ids
               else bool(np.all(np.isfinite(np.asarray(v, np.float32)))) for v in vals
               if id(v) in self.ids or (not isinstance(v, Tracer) and _is_float(np.asarray(v)))]
        out_idx = list(range(len(self.values), len(self.values) + len(floats)))
        self.ids.update((id(o), i) for o, i in zip(floats, out_idx))
        self.values += floats
        self.keys += [key] * len(floats)
        dtypes = [np.dtype(o.dtype).name for o in floats]
        self.dtypes += dtypes
        self.events.append(({"module": key[0], "pass": "backward" if key[1] else "forward",
                             "primitive": primitive, "dtype": ",".join(sorted(set(dtypes)))},
                            ins, out_idx))

    def _scan(self, eqn, vals, full):
        p = scan_params(eqn)
        nc, nk = p.num_consts, p.num_carry
        consts, carry, xs = vals[:nc], vals[nc:nc + nk], vals[nc + nk:]
        ys = []
        for i in range(p.length - 1, -1, -1) if p.reverse else range(p.length):
            outs = self.run(p.jaxpr, None, consts + carry + [x[i] for x in xs], full)
            carry = outs[:nk]
            ys.append(outs[nk:])
        if not ys:
            return carry + [jnp.zeros(v.aval.shape, v.aval.dtype) for v in eqn.outvars[nk:]]
        return carry + [jnp.stack(y) for y in zip(*(ys[::-1] if p.reverse else ys))]


def _bind(eqn, vals) -> list:
    out = bind_with_params(eqn, vals)
    return list(out) if eqn.primitive.multiple_results else [out]


_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _compile(lowered):
    """On CPU without LLVM's expensive passes: a program with hundreds of outputs compiles
    several times faster, and runs once."""
    if jax.default_backend() == "cpu":
        try:
            return lowered.compile(_FAST_COMPILE)
        except Exception:  # noqa: BLE001 - an XLA without these options
            pass
    return lowered.compile()


def _interpret(closed, flat_args, modules, scale: float):
    """Runs ``closed`` (dead code removed) once under jit, keeping every value; returns the
    outputs, per-(module, pass) accumulators in first-seen order, and the equations that made
    non-finite values out of finite inputs (in execution order)."""
    jaxpr, used = dce(closed.jaxpr)
    args = [x for x, u in zip(flat_args, used) if u]
    rec = _Values(modules)

    def program(consts, args):
        nonlocal rec
        rec = _Values(modules)
        outs = rec.run(jaxpr, consts, args)
        stats = _device_summaries(rec.values, scale)  # only the [n, 8] table leaves the devices
        rec.values, rec.ids = [], {}  # the tracers die with the trace
        return outs, stats

    outs, stats = _compile(jax.jit(program).lower(list(closed.consts), args))(
        list(closed.consts), args)
    stats = _to_host(stats)
    acc: dict[tuple[str, bool], _Acc] = {}
    for key, s, dtype in zip(rec.keys, stats, rec.dtypes):
        acc.setdefault(key, _Acc()).add(s, dtype)
    finite = stats[:, 1] == 0
    origins = [where for where, ins, out_idx in rec.events
               if all(i if isinstance(i, bool) else finite[i] for i in ins)
               and not all(finite[i] for i in out_idx)]
    return outs, acc, origins


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0"
    if math.isinf(x):
        return "inf"
    return f"{x:.3g}"


def _frac(n: int, d: int) -> float | None:
    return n / d if d else None


def _pass_stats(name: str, a: _Acc) -> dict[str, Any]:
    return {f"{name}_dtypes": ",".join(sorted(a.dtypes)) or "-",
            f"{name}_max_abs": a.max_abs if a.count else None,
            f"{name}_nonfinite": a.nonfinite,
            f"{name}_headroom_bits": None if math.isinf(a.low_headroom_bits)
            else a.low_headroom_bits}


@dataclasses.dataclass
class OverflowReport(Report):
    """What :func:`locate_overflow` found.

    Attributes:
      rows: one dict per module path (execution order), ``module``, ``status``
        (``overflow``, ``nonfinite``, ``near_overflow``, ``underflow`` or ``ok``) and the
        statistics of its forward, backward and gradients (the keys: docs/api/diagnostics.rst,
        "Overflow report rows").
      first_nonfinite: the first equation in execution order (forward, then backward) that
        made a non-finite value out of finite inputs: ``{"module", "pass", "primitive",
        "dtype"}``, or None.
      overflowing: the modules where non-finite values originate (in order).
      underflow: totals over all gradients: ``{"param_grads": {"unscaled", "scaled",
        "count"}, "activation_grads": {...}}``.
      loss_scale: the scale used; loss: the float32 loss of the mixed-precision run.
    """

    rows: list[dict[str, Any]]
    first_nonfinite: dict[str, Any] | None
    overflowing: list[str]
    underflow: dict[str, dict[str, Any]]
    loss_scale: float
    loss: float
    policy: str

    def row(self, module: str) -> dict[str, Any]:
        """The row of ``module`` (exact path, or the unique row ending with it)."""
        for r in self.rows:
            if r["module"] == module:
                return r
        hits = [r for r in self.rows if r["module"].endswith("/" + module)]
        if len(hits) == 1:
            return hits[0]
        raise KeyError(f"no row for module {module!r}; modules: "
                       f"{[r['module'] for r in self.rows]}")

    def to_dict(self) -> dict[str, Any]:
        return strict({"policy": self.policy, "loss_scale": self.loss_scale, "loss": self.loss,
                       "first_nonfinite": self.first_nonfinite,
                       "overflowing": self.overflowing, "underflow": self.underflow,
                       "rows": self.rows})

    def summary(self) -> str:
        """A few sentences: where it overflows, how much underflows."""
        lines = []
        if self.first_nonfinite:
            f = self.first_nonfinite
            lines.append(f"first non-finite value: {f['module']} ({f['pass']}, "
                         f"{f['primitive']} in {f['dtype']})")
        else:
            lines.append("no non-finite values in the forward or backward pass")
        pg = self.underflow.get("param_grads", {})
        ag = self.underflow.get("activation_grads", {})
        for name, u in (("parameter", pg), ("activation", ag)):
            if u.get("count"):
                lines.append(f"{name} gradients flushed to zero in float16: "
                             f"{100 * u['unscaled']:.1f}% unscaled, {100 * u['scaled']:.1f}% "
                             f"with loss scale {self.loss_scale:g}")
        return "\n".join(lines)

    def _cells(self) -> list[tuple]:
        return [(r["module"], r["status"], _fmt(r["forward_max_abs"]),
                 r["forward_dtypes"], _fmt(r["backward_max_abs"]),
                 _fmt(r["param_grad_max_abs"]), _pct(r["underflow_unscaled"]),
                 _pct(r["underflow_scaled"])) for r in self.rows]

    def to_markdown(self) -> str:
        return "\n".join([
            f"## Overflow report ({self.policy}, loss scale {self.loss_scale:g})", "",
            self.summary().replace("\n", "  \n"), "",
            *markdown_table(("module", "status", "fwd max", "fwd dtypes", "bwd max (scaled)",
                             "param grad max", "underflow unscaled", "underflow scaled"),
                            self._cells())])

    def _rich(self) -> list[Any]:
        """The rows as a table, then the summary."""
        colors = {"overflow": "bold red", "nonfinite": "red", "near_overflow": "yellow",
                  "underflow": "magenta"}

        def status(st: str) -> str:
            return f"[{colors[st]}]{st}[/{colors[st]}]" if st in colors else st

        table = rich_table(
            f"overflow / underflow per module ({self.policy}, loss scale {self.loss_scale:g})",
            ("module", "status", "fwd max |x|", "fwd dtypes", "bwd max |g| (scaled)",
             "param grad max", "underflow unscaled", "underflow scaled"),
            [(escape(m), status(st), *rest) for m, st, *rest in self._cells()])
        return [table, escape(self.summary())]


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _scale_value(loss_scale, policy: jmp.Policy) -> float:
    if loss_scale is None:
        loss_scale = default_loss_scale(policy)  # the train step's default for this policy
    value = getattr(loss_scale, "loss_scale", loss_scale)
    value = float(np.asarray(value))
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"locate_overflow: loss_scale must be a positive finite number or a "
                         f"jaxamp loss scale, got {loss_scale!r}.")
    return value


def _param_module(path, root: str | None) -> str:
    names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    head = names[:-1]
    return "/".join(([root] if root else []) + head) if head or root else "(params)"


def _param_owner(path: str, modules) -> str:
    """The module a param's gradient is reported at: its own, or its nearest called ancestor
    (an NNX module used through another method, tunix's ``Embedder.encode``, ran in its
    caller's region); ``(top level)`` without Flax modules (Equinox, plain JAX)."""
    if not modules:
        return TOP_LEVEL
    return display_path(_module_key(path, modules) or canonical_path(path, modules), modules)


def locate_overflow(fn: Callable | nn.Module, variables: Any, *args: Any,
                    policy: str | jmp.Policy | None = None,
                    overrides: Mapping | None = None, op_rules: OpRules | None = None,
                    loss_fn: Callable[[Any], Any] | None = None,
                    loss_scale: Any = None) -> OverflowReport:
    """Runs one forward and backward of ``fn`` under ``policy`` and locates overflow/underflow.

    ``locate_overflow(step, state, batch)`` runs the loss a step from
    :func:`jaxamp.make_train_step` differentiates, as the step runs it (the state's policy,
    collections, dropout key and current loss scale; the step's ``overrides``/``op_rules``;
    ``train=`` as its loss_fn passes it), on ``batch``.

    Args:
      fn: a step, a Flax linen ``model.apply`` (or the module itself), or any function
        ``fn(variables, *args)``; a loss if ``loss_fn`` is None and it returns a scalar.
      variables: what ``fn`` takes first: a linen variables dict (gradients are taken with
        respect to its ``"params"`` collection; other collections such as ``batch_stats`` are
        passed through unchanged) or a params pytree (differentiated whole).
      *args: the remaining arguments of ``fn`` (e.g. the batch).
      policy, overrides, op_rules: as for :func:`jaxamp.autocast` (``None``: the defaults;
        with a step, the step's own).
      loss_fn: ``loss_fn(outputs) -> scalar``, applied to ``fn``'s outputs (close over the
        targets: ``loss_fn=lambda logits: jaxamp.softmax_cross_entropy(logits, labels)``).
        It runs under the policy too. If None and ``fn`` returns a non-scalar, the loss is the
        mean of its float outputs (a stand-in: gradient magnitudes are then not a real loss's).
      loss_scale: a number or a jaxamp loss scale (its current ``loss_scale`` is used); None:
        ``2**16`` (DynamicLossScale's initial scale) for float16 compute, 1 otherwise.

    Returns:
      An :class:`OverflowReport`: ``.rows`` per module, ``.first_nonfinite``,
      ``.overflowing``, ``.underflow``, ``.to_json()``, ``.print()``.

    Every float value is kept and the program compiled twice (mixed precision, float32
    reference): use a small batch. What it does not see, and where it attributes values:
    docs/api/diagnostics.rst, "Overflow locator".

    Example:
      >>> import flax.linen as nn
      >>> class Model(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x):  # 30 x 4 x 1000 = 120000 > float16's 65504
      ...         h = nn.Dense(8, name="fc1", kernel_init=nn.initializers.constant(1e3))(x)
      ...         return nn.Dense(1, name="fc2")(nn.relu(h))
      >>> model, x = Model(), jnp.full((2, 4), 30.0)
      >>> variables = model.init(jax.random.key(0), x)
      >>> rep = jaxamp.locate_overflow(model.apply, variables, x,
      ...                              loss_fn=lambda y: jnp.mean(y ** 2))
      >>> rep.first_nonfinite
      {'module': 'fc1', 'pass': 'forward', 'primitive': 'dot_general', 'dtype': 'float16'}
    """
    call = resolve_call("locate_overflow", fn, (variables, *args), policy=policy,
                        overrides=overrides, op_rules=op_rules)
    if call.program is not None:
        if loss_fn is not None:
            raise TypeError("locate_overflow(step, state, batch): the step's own loss_fn "
                            "is used; drop loss_fn=.")
        fn, (variables,), args = call.fn, call.args, ()
        loss_scale = call.program.loss_scale if loss_scale is None else loss_scale
    policy, overrides, op_rules = call.policy, call.overrides, call.op_rules
    with call.context():
        return _locate(fn, variables, *args, policy=policy, overrides=overrides,
                       op_rules=op_rules, loss_fn=loss_fn, loss_scale=loss_scale,
                       f32_weight_grads=call.f32_weight_grads)


def _locate(fn, variables, *args, policy, overrides, op_rules, loss_fn, loss_scale,
            f32_weight_grads) -> OverflowReport:
    if isinstance(fn, nn.Module):
        fn = fn.apply
    if is_module(fn) or is_module(variables):
        # NNX: locate_overflow(model, *args) or (fn, model, *args); differentiate its params
        fn, (variables, *args) = functional(fn, (variables, *args))
    if not callable(fn):
        raise TypeError(f"locate_overflow: fn must be callable, got {type(fn).__name__}.")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError("locate_overflow: loss_fn must be callable (outputs -> scalar).")
    pol = get_policy(policy)
    scale = _scale_value(loss_scale, pol)
    params, loss_of = _loss_of(fn, variables, loss_fn)
    recorder = Recorder(ModuleRules.create(pol, overrides))

    def recorded(*a):
        with recording(recorder):
            return loss_of(*a)

    amp = autocast(recorded, pol.with_output_dtype(jnp.float32), overrides=overrides,
                   op_rules=op_rules, f32_weight_grads=f32_weight_grads)

    def scaled(p, *a):
        loss = amp(p, *a).astype(jnp.float32)
        with jax.named_scope(SCAFFOLD):
            return loss * scale, loss

    closed = jax.make_jaxpr(jax.value_and_grad(scaled, has_aux=True))(params, *args)
    outs, acc, origin_events = _interpret(closed, jax.tree.leaves((params, *args)),
                                          recorder.modules, scale)
    first = origin_events[0] if origin_events else None
    (_, amp_loss), amp_grads = jax.tree.unflatten(
        jax.tree.structure(((0.0, 0.0), params)), outs)

    # the float32 reference (true, unscaled gradients), traced with its module calls marked
    # as in the AMP run, so that its values are named by the same module paths (no recompute:
    # its replayed forward values would count as backward ones)
    p32 = jax.tree.map(lambda x: x.astype(jnp.float32) if _is_float(x) else x, params)
    f32 = autocast(recorded, jmp.Policy(jnp.float32, jnp.float32, jnp.float32),
                   op_rules=op_rules.extend(recompute=False), f32_weight_grads=f32_weight_grads)
    ref_closed = jax.make_jaxpr(jax.value_and_grad(f32))(p32, *args)
    ref_outs, ref_acc, _ = _interpret(ref_closed, jax.tree.leaves((p32, *args)),
                                      recorder.modules, scale)
    _, true_grads = jax.tree.unflatten(jax.tree.structure((0.0, p32)), ref_outs)

    pg, tg = _param_grad_accs(amp_grads, true_grads, recorder.modules, scale)
    # activation gradients of the reference, per module
    ag: dict[str, _Acc] = {m: a for (m, bwd), a in ref_acc.items() if bwd}
    origins = _unique(o["module"] for o in origin_events)
    names = _unique([m for m, _ in acc] + list(pg) + list(ag))
    rows = [_module_row(m, acc, pg.get(m), tg.get(m), ag.get(m), origins) for m in names]
    underflow = {"param_grads": _underflow_total(list(tg.values())),
                 "activation_grads": _underflow_total(list(ag.values()))}
    return OverflowReport(rows, first, origins, underflow, scale, float(_to_host(amp_loss)),
                          policy_to_str(pol))


def _unique(items) -> list:
    """``items`` without repeats, in first-seen order."""
    return list(dict.fromkeys(items))


def _loss_of(fn, variables, loss_fn) -> tuple[Any, Callable]:
    """The params to differentiate, and ``loss_of(params, *args)``: ``fn``'s scalar loss."""
    is_vars = isinstance(variables, Mapping) and "params" in variables
    params = variables["params"] if is_vars else variables

    def rebuild(p):
        if not is_vars:
            return p
        v = dict(variables)
        v["params"] = p
        return v

    def loss_of(p, *a):
        out = fn(rebuild(p), *a)
        if loss_fn is not None:
            loss = loss_fn(out)
        else:
            floats = [o for o in jax.tree.leaves(out) if _is_float(o)]
            if not floats:
                raise ValueError("locate_overflow: fn returns no float output; pass loss_fn.")
            loss = sum(jnp.mean(o.astype(jnp.float32)) for o in floats)
        if np.shape(loss) != ():
            raise ValueError(f"locate_overflow: the loss must be a scalar, got shape "
                             f"{np.shape(loss)}; pass loss_fn=... that reduces it.")
        return loss

    return params, loss_of


def _param_grad_accs(amp_grads, true_grads, modules, scale: float
                     ) -> tuple[dict[str, _Acc], dict[str, _Acc]]:
    """The AMP run's and the float32 reference's parameter gradients, per module."""
    root = next((m for m in modules if "/" not in m), None)
    pg: dict[str, _Acc] = {}
    tg: dict[str, _Acc] = {}
    pairs = [(path, g, t) for (path, g), (_, t) in zip(
        jax.tree_util.tree_leaves_with_path(amp_grads),
        jax.tree_util.tree_leaves_with_path(true_grads)) if _is_float(g)]
    g_stats = _summaries([g for _, g, _ in pairs], 1.0)
    t_stats = _summaries([t for _, _, t in pairs], scale)
    for (path, g, t), gs, ts in zip(pairs, g_stats, t_stats):
        mod = _param_owner(_param_module(path, root), modules)
        pg.setdefault(mod, _Acc()).add(gs, np.dtype(g.dtype).name)
        tg.setdefault(mod, _Acc()).add(ts, np.dtype(t.dtype).name)
    return pg, tg


def _module_row(m: str, acc: dict, p: _Acc | None, t: _Acc | None, a: _Acc | None,
                origins: list[str]) -> dict[str, Any]:
    """One row of the report: module ``m``'s forward and backward values (``acc``), its
    parameter gradients (``p``; ``t`` in the float32 reference) and the reference's activation
    gradients (``a``)."""
    f = acc.get((m, False), _Acc())
    b = acc.get((m, True), _Acc())
    nz = (t.nonzero if t else 0) + (a.nonzero if a else 0)
    under = (t.under if t else 0) + (a.under if a else 0)
    under_s = (t.under_scaled if t else 0) + (a.under_scaled if a else 0)
    row = {
        "module": m, **_pass_stats("forward", f),
        "forward_subnormal": _frac(f.subnormal, f.low_nonzero),
        "forward_saturated": f.saturated, **_pass_stats("backward", b),
        "param_grad_max_abs": p.max_abs if p else None,
        "param_grad_nonfinite": p.nonfinite if p else 0,
        "true_grad_max_abs": t.max_abs if t else None,
        "underflow_unscaled": _frac(under, nz),
        "underflow_scaled": _frac(under_s, nz),
    }
    low_head = min(f.low_headroom_bits, b.low_headroom_bits)
    if m in origins:
        status = "overflow"
    elif f.nonfinite or b.nonfinite or row["param_grad_nonfinite"]:
        status = "nonfinite"
    elif low_head < NEAR_OVERFLOW_BITS:
        status = "near_overflow"
    elif (row["underflow_scaled"] or 0) > UNDERFLOW_FRACTION:
        status = "underflow"
    else:
        status = "ok"
    row["status"] = status
    return row


def _underflow_total(accs) -> dict[str, Any]:
    nz = sum(x.nonzero for x in accs)
    return {"unscaled": _frac(sum(x.under for x in accs), nz),
            "scaled": _frac(sum(x.under_scaled for x in accs), nz), "count": nz}

