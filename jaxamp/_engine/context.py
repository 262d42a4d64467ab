"""What a rule sees of one autocast evaluation (:class:`Context`), the shared types of the
rules (:class:`Site`, :data:`Rule`) and sub-programs (:class:`Body`), and the marks a call
leaves in the name stack (:class:`Marks`). A rule never sees the interpreter, a planner only
what it reads. This module imports only leaves; the rule modules and ``recompute`` import it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jmp
import numpy as np

from jaxamp._engine.compat import inline_jit, name_scopes
from jaxamp._engine.jaxpr import jit_inlines
from jaxamp._engine.values import F32, Value, cast, copies, is_float
from jaxamp.policy import matmul_dtype

__all__ = ["MARKS", "Body", "Context", "Mark", "Marks", "Rule", "Site"]


@dataclasses.dataclass(frozen=True)
class Mark:
    """What a name scope autocast made stands for: module call ``region`` of autocast call
    ``call``, or a rule's ``decision`` on the equations inside it (the FP8 rule's)."""

    call: int
    region: int | None = None
    decision: str | None = None


#: Every mark made in this process, the newest 2**16: what the diagnostics look scope names up
#: in, also for a program traced before (a jit cache hit keeps the marks of its first trace).
MARKS: collections.OrderedDict[str, Mark] = collections.OrderedDict()
_KEPT = 1 << 16


class Marks:
    """The marks of one autocast call: scope name -> :class:`Mark`, made here only.

    The name stack carries them (JAX keeps it through jvp, transpose, vmap and remat on every
    equation); a reader looks an equation's scope names up in the table, never parses one.
    Names are unique per call, so the marks of an autocast traced inside another stay apart.
    """

    def __init__(self, call: int):
        self.call = call
        self.by_scope: dict[str, Mark] = {}
        self.scope_of: dict[int, str] = {}  # region id -> its scope name
        self._regions: dict = {}  # name stack -> the region ids in it

    def _enter(self, name: str, mark: Mark):
        self.by_scope[name] = MARKS[name] = mark
        if len(MARKS) > _KEPT:
            MARKS.popitem(last=False)
        return jax.named_scope(name)

    def region(self, k: int):
        """The scope (a context) of module call ``k``."""
        self.scope_of[k] = name = f"jaxamp<{self.call}.{k}>"
        return self._enter(name, Mark(self.call, region=k))

    def decision(self, text: str):
        """A scope (a context) whose equations carry ``text``, a rule's decision."""
        name = f"jaxamp_matmul<{self.call}.{text.replace(' ', '_')}>"
        return self._enter(name, Mark(self.call, decision=text))

    def regions(self, eqn) -> tuple[int, ...]:
        """The module calls of this autocast call in ``eqn``'s name stack, outermost first."""
        stack = name_scopes(eqn)
        ids = self._regions.get(stack)
        if ids is None:
            marks = [self.by_scope.get(part.name) for part in stack]
            ids = self._regions[stack] = tuple(m.region for m in marks
                                               if m is not None and m.region is not None)
        return ids


class Site(NamedTuple):
    """Where an equation runs: its region (the module-region ids, outermost first) and, per
    output, whether every consumer computes in float32."""

    region: tuple[int, ...]
    want32: list[bool]


#: A rule: ``rule(ctx, eqn, ins, site) -> outputs``.
Rule = Callable[["Context", Any, list, Site], list]


class Body:
    """A sub-program evaluated as a cached, inlined ``jax.jit`` (:attr:`fn`): asking for its
    output dtypes and then calling it evaluates it once. A recompute segment's or a shared
    call's body is given the copies made of its inputs (``casts``, after them) and, with
    ``export``, returns those it made after its outputs (:meth:`keep`), so a value is cast once
    across its boundary. ``anchor``: an object the cache key names by id."""

    def __init__(self, ctx: Context, closed, metas: Sequence[Value], region, out_wants,
                 casts: Sequence[tuple[int, Any]] = (), export: bool = False,
                 anchor: Any = None):
        self.out: list[Value] | None = None
        self.anchor = anchor
        self.casts = tuple(casts)  # (input, dtype): copies given after the inputs (copies())
        # with export: the copies made inside of inputs and of outputs, (index, dtype) each,
        # returned after the outputs (keep() records them)
        self.made: list = []
        self.made_out: list = []
        n = len(metas)

        def run(*vals):
            args = [m.fresh(x) for m, x in zip(metas, vals[:n])]
            for (i, dtype), x in zip(self.casts, vals[n:]):
                args[i].casts[dtype] = x
            outs = ctx.eval(closed, None, args, region, out_wants)
            self.out = [Value(None, o.stored, o.const, o.region, splat=o.splat) for o in outs]
            if export:
                self.made = [c for c in copies(args) if c not in self.casts]
                self.made_out = copies(outs)
            return [o.val for o in outs] + [args[i].casts[d] for i, d in self.made] \
                + [outs[j].casts[d] for j, d in self.made_out]

        run.__name__ = "jaxamp_body"
        self.fn = inline_jit(run) if jit_inlines() else run

    def args(self, ins: Sequence[Value]) -> list:
        """What :attr:`fn` takes for inputs ``ins``: their arrays, then the copies it is given."""
        return [v.val for v in ins] + [ins[i].casts[d] for i, d in self.casts]

    def keep(self, ins: Sequence[Value], outs: Sequence[Any], values: Sequence[Value]) -> None:
        """Records the copies that the call returning ``outs`` made (after its outputs) on its
        inputs ``ins`` and on its output ``values``, so that what reads them later does not
        cast them again."""
        k = len(self.out) + len(self.made)
        for (i, dtype), x in zip(self.made, outs[len(self.out):k]):
            ins[i].casts.setdefault(dtype, x)
        for (j, dtype), x in zip(self.made_out, outs[k:]):
            values[j].casts.setdefault(dtype, x)

    def out_dtypes(self, specs) -> list:
        return [np.dtype(o.dtype) if is_float(o.dtype) else o.dtype
                for o in jax.eval_shape(self.fn, *specs)]

    def values(self, outs) -> list[Value]:
        return [Value(o, m.stored, m.const, m.region, splat=m.splat)
                for o, m in zip(outs, self.out)]


class Context:
    """What rules see of one autocast evaluation (planners: :class:`sharing.Facts` of it).

    Args:
      policies: region id -> its policy (None: a module call without a rule).
      op_rules: the :class:`jaxamp.OpRules` of the call.
      marks: the call's :class:`Marks` (its regions, and where rules record decisions).
      attention: jit name -> a ``jax.nn.dot_product_attention`` call recorded while tracing
        (:func:`jaxamp._engine.attention.jit_name`).
      f32_weight_grads: param gradients of matmuls come out in float32.
      matmul_ends: id(eqn) -> ``"first"``/``"last"``: the first and last matmul reading a
        param (:attr:`jaxamp.rules.RuleCall.position`).
      interpreter: evaluates sub-programs (``eval``, ``body``, ``cached_body``, ``run_eqn``:
        :class:`jaxamp._engine.evaluator.Evaluator`); the context forwards to it.
      layers_in_place: a ``lax.scan`` whose body multiplies by a per-iteration input (a stack
        of layers' weights) is evaluated one iteration at a time in the current trace, so a
        rule sees each layer's own equations (``fp8=delayed``: a history per layer).
    """

    def __init__(self, policies: Sequence[jmp.Policy | None], op_rules, *,
                 marks: Marks | None = None, attention: Mapping[str, Any] | None = None,
                 f32_weight_grads: bool = False,
                 matmul_ends: Mapping[int, str] | None = None, interpreter: Any = None,
                 layers_in_place: bool = False):
        self.policies = policies
        self.op_rules = op_rules
        self.marks = Marks(0) if marks is None else marks
        self.attention: Mapping[str, Any] = dict(attention or {})
        self.f32_weight_grads = f32_weight_grads
        self.matmul_ends: Mapping[int, str] = dict(matmul_ends or {})
        self._interpreter = interpreter
        self.layers_in_place = layers_in_place
        # what the rules report: primitives in no op list (warned once), and the
        # low-precision matmul dtypes of regions whose matmuls ran in float64 (warned once)
        self.unknown: set[str] = set()
        self.float64_matmuls: set[str] = set()
        # scopes: recompute segments are off inside a segment and a user's remat
        self.segment_depth = 0
        self.remat_depth = 0
        self.scan_depth = 0  # inside a lax.scan body (OpRules.recompute="scan")

    # ---- reports --------------------------------------------------------------------------
    def note_unknown(self, name: str) -> None:
        """A primitive in no op list was met (autocast warns once, naming it)."""
        self.unknown.add(name)

    def note_float64_matmul(self, dtype_name: str) -> None:
        """A matmul of a region asking for ``dtype_name`` ran in float64 (warned once)."""
        self.float64_matmuls.add(dtype_name)

    # ---- sub-programs (the interpreter's) -------------------------------------------------
    def eval(self, closed, consts: Sequence[Value] | None, args: Sequence[Value],
             base: tuple[int, ...], out_wants: Sequence[bool] | None = None) -> list[Value]:
        """``closed`` evaluated on ``args`` in region ``base``."""
        return self._interpreter.eval(closed, consts, args, base, out_wants)

    def run_body(self, closed, metas: Sequence[Value], region, vals,
                 out_wants=None) -> list[Value]:
        """Evaluates a sub-jaxpr in the current trace: fresh values, no shared cast caches."""
        args = [m.fresh(x) for m, x in zip(metas, vals)]
        return self.eval(closed, None, args, region, out_wants)

    def body(self, closed, metas: Sequence[Value], region, out_wants=None,
             dtypes: Sequence[Any] | None = None) -> Body:
        """The cached :class:`Body` of ``closed`` for inputs known as ``metas`` (with
        ``dtypes`` instead of theirs, where given), in ``region``."""
        return self._interpreter.body(closed, metas, region, out_wants, dtypes)

    def cached_body(self, key, anchor, make: Callable[[], Body]) -> Body:
        """The body cached under ``key`` (made by ``make`` on a miss, or when the cached one's
        anchor is not ``anchor``)."""
        return self._interpreter.cached_body(key, anchor, make)

    def run_eqn(self, eqn, raw: list[Value], base, wants: set, drop=None) -> list[Value]:
        """``eqn`` evaluated on ``raw`` operands (crossings and its rule)."""
        return self._interpreter.run_eqn(eqn, raw, base, wants, drop)

    # ---- scopes ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def _deeper(self, depth: str):
        setattr(self, depth, getattr(self, depth) + 1)
        try:
            yield
        finally:
            setattr(self, depth, getattr(self, depth) - 1)

    def in_segment(self):
        """Evaluating a recompute segment: no segments inside it, its statistics named."""
        return self._deeper("segment_depth")

    def in_user_remat(self):
        """Evaluating a user's ``jax.checkpoint`` body: its policy decides what is kept."""
        return self._deeper("remat_depth")

    def in_scan(self):
        """Evaluating a ``lax.scan`` body, where ``recompute="scan"`` makes segments."""
        return self._deeper("scan_depth")

    def segments_on(self) -> bool:
        where = self.op_rules.recompute
        return (where is True or (where == "scan" and self.scan_depth > 0)) \
            and not self.segment_depth and not self.remat_depth

    def scopes(self) -> tuple[bool, bool, bool]:
        """In a segment, in a user's remat, in a scan body: what a cached body depends on."""
        return self.segment_depth > 0, self.remat_depth > 0, self.scan_depth > 0

    # ---- regions --------------------------------------------------------------------------
    def policy(self, region: tuple[int, ...]) -> jmp.Policy:
        return self.policies[region[-1] if region else 0]

    def compute_dtype(self, region: tuple[int, ...]) -> np.dtype:
        return np.dtype(self.policy(region).compute_dtype)

    def matmul_dtype(self, region: tuple[int, ...]) -> np.dtype:
        """The dtype the built-in matmul rule runs in: the policy's ``matmul=`` dtype when it
        is a float16/bfloat16/float32 one, else the compute dtype (FP8 is the FP8 rule's,
        :mod:`jaxamp.fp8`, and falls back to the compute dtype)."""
        dtype = np.dtype(matmul_dtype(self.policy(region)))
        return dtype if dtype.itemsize > 1 else self.compute_dtype(region)

    def region_of(self, eqn, base: tuple[int, ...]) -> tuple[int, ...]:
        ids = [i for i in self.marks.regions(eqn)
               if self.policies[i] is not None and i not in base]
        return base + tuple(ids) if ids else base

    def crossing(self, v: Value, region: tuple[int, ...]) -> np.dtype | None:
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

    def operand(self, v: Value, region: tuple[int, ...], f32_use: bool = False) -> Value:
        """``v`` as an eqn in ``region`` sees it: cast on leaving/entering a matched module.

        The crossing is cached on ``v`` (every consumer in ``region`` shares one cast and its
        own casts). A value leaving a module wider than the module's output dtype stays wide
        for a consumer that computes in float32 anyway (``f32_use``): casting it down there
        would only round it (f32 -> f16 -> f32).
        """
        target = self.crossing(v, region)
        if target is None:
            return v
        if f32_use and target != v.dtype and v.dtype == F32:
            target = F32
        key = ("region", region, target)
        if key not in v.casts:
            if target == v.dtype:
                v.casts[key] = Value(v.val, False, v.const, region, v.casts)
            else:
                v.casts[key] = Value(cast(v, target), False, False, region)
        return v.casts[key]
