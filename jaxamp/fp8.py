"""FP8 matmuls: the quantise -> FP8 dot -> dequantise pattern, and the engine rule that uses it.

A ``matmul=float8`` policy runs each eligible ``dot_general`` of its modules as
:func:`fp8_dot_general` (the recipe, eligibility and the mesh: README.md, "FP8 matmuls"):
Transformer Engine's ``Float8CurrentScaling`` with the HYBRID format (torchao's
``tensorwise``), written as the pattern XLA's GPU compiler fuses into one cuBLASLt FP8 GEMM
(``__cublas$lt$matmul$f8``). Scales are powers of two, so dividing by one rounds nothing (at
most one binade of FP8 range is unused; ``margin`` leaves ``2**margin`` more headroom).
float16 compute with FP8 matmuls is refused by :func:`jaxamp.get_policy`: only bfloat16
(float32's range) needs no loss scale. On CPU XLA upcasts FP8 dots (right numbers, no speed).

The policy's ``fp8=`` key picks the recipe (:data:`jaxamp.policy_spec.FP8_RECIPES`): ``current``
(the above), or ``rowwise``, torchao's rowwise recipe: one scale per row of each operand (per
element of its free dimensions, the amax over the contracted ones), so an outlier only coarsens
its own row, and the output gradient in E4M3 as well (per-row scales leave E5M2's range
unneeded). XLA forms its FP8 GEMM with unit scales and multiplies the output by the outer
product of the scale vectors in one more elementwise pass (cuBLASLt's outer-vector scale mode is
not used by XLA's GEMM rewriter; BENCHMARKS.md, "FP8 recipes"). Or ``delayed``, Transformer
Engine's ``DelayedScaling``: per-tensor scales from an amax history of earlier steps that the
train step keeps in its state (:class:`DelayedScaling`, :func:`fp8_delayed_dot_general`,
README.md "FP8 matmuls").
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import threading
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._engine.compat import current_trace, dot_dimension_numbers, name_scopes
from jaxamp._engine.context import MARKS
from jaxamp.policy import fp8_recipe
from jaxamp.policy_spec import FP8_RECIPES

__all__ = ["AMAX_REDUCTIONS", "DelayedScaling", "E4M3", "E5M2", "FP8Matmuls", "FP8_MATMULS",
           "delayed_active", "delayed_scope", "fp8_delayed_dot_general", "fp8_dot_general",
           "fp8_eligible", "history_amax", "push_amax", "quantize"]

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
_F32 = np.dtype(np.float32)


def quantize(x: jax.Array, dtype, margin: int = 0, axes: Sequence[int] | None = None
             ) -> tuple[jax.Array, jax.Array]:
    """``(q, scale)``: ``x`` quantised to FP8 ``dtype`` with a per-tensor current scale, or with
    one scale per element of the other axes when ``axes`` is given (the amax over ``axes``;
    ``scale`` keeps their dimensions with size 1).

    ``q = clip(x / scale, -max, max)`` and ``scale`` a float32 scalar (``x ~= q * scale``):
    ``amax(|x|) * 2**margin / finfo(dtype).max`` rounded up to a power of two (the largest
    element lands in ``[max / 2**(margin+1), max / 2**margin]``); 1 when the amax is zero or
    not finite.

    Example:
      >>> q, s = quantize(jnp.array([0.5, -3.0, 896.0]), E4M3)
      >>> q.dtype, float(s), [float(v) for v in q.astype(jnp.float32) * s]
      (dtype(float8_e4m3fn), 2.0, [0.5, -3.0, 896.0])
    """
    amax = jnp.max(jnp.abs(x), axis=None if axes is None else tuple(axes),
                   keepdims=axes is not None).astype(jnp.float32)
    scale = _scale_of(amax, dtype, margin)
    return _quantize_with(x, scale, dtype), scale


def _scale_of(amax: jax.Array, dtype, margin: int) -> jax.Array:
    """The power-of-two scale of a tensor whose amax is ``amax`` (:func:`quantize`); 1 when
    the amax is zero or not finite (never 0/0)."""
    fmax = float(jnp.finfo(dtype).max)
    ok = (amax > 0) & jnp.isfinite(amax)
    raw = jnp.where(ok, amax * (2.0 ** margin / fmax), 1.0)
    return jnp.exp2(jnp.ceil(jnp.log2(raw)))


def _quantize_with(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """``clip(x / scale, -max, max)`` in FP8 ``dtype``: beyond the scale's range saturates."""
    fmax = float(jnp.finfo(dtype).max)
    return jnp.clip(x / scale.astype(x.dtype), -fmax, fmax).astype(dtype)


def _int_at_least(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _check_scaling(where: str, margin, shards) -> None:
    if not _int_at_least(margin, 0):
        raise ValueError(f"{where}: margin must be an int >= 0, got {margin!r} (headroom "
                         "2**margin below the FP8 maximum).")
    if not _int_at_least(shards, 1):
        raise ValueError(f"{where}: shards must be an int >= 1 (the devices of the data axis; "
                         f"1: per-tensor scales), got {shards!r}.")


def _dims(dimension_numbers) -> tuple:
    (lc, rc), (lb, rb) = dimension_numbers
    return (tuple(lc), tuple(rc)), (tuple(lb), tuple(rb))


def _remaining(n: int, *taken: Sequence[int]) -> list[int]:
    used = {d for t in taken for d in t}
    return [d for d in range(n) if d not in used]


def _transpose_lhs(g, lhs_ndim: int, rhs, dims, out_dtype, scale, *, swap=False):
    """The cotangent of a dot_general's lhs, ``dot_general(g, rhs) * scale`` with the axes put
    back: ``lax.dot_general``'s transpose with FP8 operands, HIGHEST precision and the caller's
    output dtype; the scale multiplies the dot's output before the transpose (what XLA fuses)."""
    (lc, rc), (lb, rb) = dims
    l_kept = _remaining(lhs_ndim, lc, lb)
    r_kept = _remaining(rhs.ndim, rc, rb)
    nb = len(lb)
    if swap:
        ans_r = list(range(nb, nb + len(r_kept)))
    else:
        ans_r = list(range(nb + len(l_kept), nb + len(l_kept) + len(r_kept)))
    ans_b = list(range(nb))
    out = _dequant(lax.dot_general(g, rhs, ((ans_r, r_kept), (ans_b, list(rb))),
                                   precision=lax.Precision.HIGHEST,
                                   preferred_element_type=out_dtype), scale, out_dtype)
    return lax.transpose(out, _back_order(lb, l_kept, lc, rc))


def _back_order(batch, kept, contracted, partner) -> tuple[int, ...]:
    """The transpose that puts an operand's cotangent back in the operand's axis order: the dot
    that makes it outputs ``batch``, the operand's ``kept`` dims, then its ``contracted`` dims
    in the ascending order of their ``partner`` dims in the other operand."""
    by_partner = list(np.take(contracted, np.argsort(partner))) if contracted else []
    return tuple(int(a) for a in np.argsort(list(batch) + list(kept) + by_partner))


def _dequant(y, scale, dtype):
    return y * scale.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _fp8_dot(lhs, rhs, dims, out_dtype, margin):
    return _fp8_fwd(lhs, rhs, dims, out_dtype, margin)[0]


def _scaled_dot(lhs, rhs, lq, rq, ls, rs, dims, out_dtype):
    """The FP8 dot of operands quantised with scales ``ls``, ``rs``, dequantised; and the
    residuals :func:`_scaled_grads` reads (the operands' dtypes carried as zeros)."""
    y = lax.dot_general(lq, rq, dims, precision=lax.Precision.DEFAULT,
                        preferred_element_type=out_dtype)
    zeros = (jnp.zeros((), lhs.dtype), jnp.zeros((), rhs.dtype))
    return _dequant(y, ls * rs, out_dtype), (lq, rq, ls, rs, zeros)


def _scaled_grads(res, dims, gq, gs):
    """dgrad and wgrad of :func:`_scaled_dot` from the output gradient ``gq`` (scale ``gs``),
    each in its operand's dtype."""
    lq, rq, ls, rs, (lz, rz) = res
    dl = _transpose_lhs(gq, lq.ndim, rq, dims, lz.dtype, gs * rs)
    (lc, rc), (lb, rb) = dims
    dr = _transpose_lhs(gq, rq.ndim, lq, ((rc, lc), (rb, lb)), rz.dtype, gs * ls, swap=True)
    return dl, dr


def _fp8_fwd(lhs, rhs, dims, out_dtype, margin):
    (lq, ls), (rq, rs) = quantize(lhs, E4M3, margin), quantize(rhs, E4M3, margin)
    return _scaled_dot(lhs, rhs, lq, rq, ls, rs, dims, out_dtype)


def _fp8_bwd(dims, out_dtype, margin, res, g):
    return _scaled_grads(res, dims, *quantize(g, E5M2, margin))


_fp8_dot.defvjp(_fp8_fwd, _fp8_bwd)


def _axiswise(a, b, ca, cb, formats, out_dtype, margin, precision):
    """``dot_general(a, b)`` contracting ``ca`` with ``cb`` (no batch dimensions), each operand
    quantised with one scale per element of its free dimensions; the output (``a``'s free
    dimensions, then ``b``'s) multiplied by both scale vectors after the FP8 dot."""
    qa, sa = quantize(a, formats[0], margin, axes=ca)
    qb, sb = quantize(b, formats[1], margin, axes=cb)
    y = lax.dot_general(qa, qb, ((tuple(ca), tuple(cb)), ((), ())), precision=precision,
                        preferred_element_type=out_dtype)
    fa, fb = (_remaining(a.ndim, ca), _remaining(b.ndim, cb))
    sa = sa.reshape([a.shape[d] for d in fa] + [1] * len(fb)).astype(out_dtype)
    sb = sb.reshape([1] * len(fa) + [b.shape[d] for d in fb]).astype(out_dtype)
    return y * sa * sb


def _rowwise_grad(g, x, g_contract, x_contract, order, out_dtype, margin):
    """An operand's cotangent, ``g`` against the other operand ``x``, rowwise in both and both
    in E4M3 as torchao's rowwise recipe casts them (a row's own scale leaves E5M2's range
    unneeded, and E4M3's extra mantissa bit halves the rounding), with the axes put back
    (``order``: :func:`_back_order`)."""
    out = _axiswise(g, x, g_contract, x_contract, (E4M3, E4M3), out_dtype, margin,
                    lax.Precision.HIGHEST)
    return lax.transpose(out, order)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _rowwise_dot(lhs, rhs, dims, out_dtype, margin):
    (lc, rc), _ = dims
    return _axiswise(lhs, rhs, lc, rc, (E4M3, E4M3), out_dtype, margin, lax.Precision.DEFAULT)


def _rowwise_fwd(lhs, rhs, dims, out_dtype, margin):
    # the backward scales along other axes (dgrad contracts N, wgrad M): it quantises again
    return _rowwise_dot(lhs, rhs, dims, out_dtype, margin), (lhs, rhs)


def _rowwise_bwd(dims, out_dtype, margin, res, g):
    lhs, rhs = res
    (lc, rc), _ = dims
    lk, rk = _remaining(lhs.ndim, lc), _remaining(rhs.ndim, rc)
    g_l, g_r = list(range(len(lk))), list(range(len(lk), g.ndim))
    return (_rowwise_grad(g, rhs, g_r, rk, _back_order((), lk, lc, rc), lhs.dtype, margin),
            _rowwise_grad(g, lhs, g_l, lk, _back_order((), rk, rc, lc), rhs.dtype, margin))


_rowwise_dot.defvjp(_rowwise_fwd, _rowwise_bwd)


def _chunked(lhs, rhs, dims, out_dtype, margin, shards, side):
    """The FP8 dot with one scale per chunk of operand ``side``'s leading dimension: the
    scalar-scale dot vmapped over the chunks; the wgrad's per-chunk dots are summed by vmap's
    transpose of the shared operand (the sum over the batch the weight gradient takes anyway)."""
    x = (lhs, rhs)[side]
    rows = x.shape[0]
    chunks = x.reshape(shards, rows // shards, *x.shape[1:])
    (lc, _), _ = dims
    # where the chunked dimension lands in the output: lhs free dims come first
    at = 0 if side == 0 else lhs.ndim - len(lc)
    y = jax.vmap(lambda a, b: _fp8_dot(a, b, dims, out_dtype, margin),
                 in_axes=(0, None) if side == 0 else (None, 0), out_axes=at)(
        *((chunks, rhs) if side == 0 else (lhs, chunks)))
    return y.reshape(*y.shape[:at], rows, *y.shape[at + 2:])


def fp8_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers, *, compute_dtype,
                    margin: int = 0, shards: int = 1, activation: int = 0,
                    recipe: str = "current") -> jax.Array:
    """``lax.dot_general(lhs, rhs, dimension_numbers)`` with FP8 operands, a ``jax.custom_vjp``:
    E4M3 operands with per-tensor current scales forward (DEFAULT precision), the output
    gradient in E5M2 for dgrad and wgrad (HIGHEST); the result in ``compute_dtype``, each
    operand's gradient in its own dtype. ``recipe="rowwise"`` scales each row instead, with an
    E4M3 output gradient (see the module's docstring; no batch dimensions; ``shards`` is then
    moot: a row's scale needs no other device's rows).

    Args:
      lhs, rhs: float operands (any float dtype; quantised from it).
      dimension_numbers: as for ``lax.dot_general``.
      compute_dtype: the output dtype (``preferred_element_type`` of the FP8 dot).
      margin: ``2**margin`` headroom below the FP8 maximum.
      shards: take the activation's scale (and its output gradient's) per chunk of its
        leading dimension, ``shards`` chunks: on a mesh whose data axis has ``shards``
        devices each scales its own rows, so the amax needs no collective. Used when that
        dimension is free (not contracted), ``shards`` divides it and there are no batch
        dimensions; otherwise the scale is per tensor.
      activation: which operand is the activation (0: ``lhs``, 1: ``rhs``) for ``shards``;
        the other (the weight) keeps one scale.

    Example:
      >>> x, w = jnp.ones((16, 32)), jnp.full((32, 16), 0.5)
      >>> y = fp8_dot_general(x, w, (((1,), (0,)), ((), ())), compute_dtype=jnp.bfloat16)
      >>> y.dtype, float(y[0, 0])
      (dtype(bfloat16), 16.0)
    """
    _check_scaling("fp8_dot_general", margin, shards)
    if activation not in (0, 1):
        raise ValueError(f"fp8_dot_general: activation must be 0 (lhs) or 1 (rhs), got "
                         f"{activation!r}.")
    dims = _dims(dimension_numbers)
    (lc, rc), (lb, _) = dims
    if recipe == "rowwise":
        if lb:
            raise ValueError(f"fp8_dot_general: recipe='rowwise' takes no batch dimensions, got "
                             f"{lb} (attention's batched matmuls stay out of FP8); use "
                             "recipe='current' for them.")
        return _rowwise_dot(lhs, rhs, dims, np.dtype(compute_dtype), margin)
    if recipe == "delayed":
        raise ValueError("fp8_dot_general: recipe='delayed' scales from an amax history: call "
                         "fp8_delayed_dot_general(lhs, rhs, dimension_numbers, history, ...).")
    if recipe != "current":
        raise ValueError(f"fp8_dot_general: recipe must be one of {FP8_RECIPES}, got "
                         f"{recipe!r}.")
    x = (lhs, rhs)[activation]
    if shards > 1 and not lb and x.ndim and 0 not in (lc, rc)[activation] \
            and x.shape[0] % shards == 0:
        return _chunked(lhs, rhs, dims, np.dtype(compute_dtype), margin, shards, activation)
    return _fp8_dot(lhs, rhs, dims, np.dtype(compute_dtype), margin)


# ---- fp8=delayed: per-tensor scales from an amax history of earlier steps -------------------

#: ``DelayedScaling.reduction`` values: ``"max"`` (the largest amax of the history, Transformer
#: Engine's default ``amax_compute_algo``) or ``"most_recent"`` (the last step's).
AMAX_REDUCTIONS = ("max", "most_recent")
_CALIBRATE = "calibrate"  # the reduction of the first (calibration) pass: this step's amaxes


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """How ``fp8=delayed`` keeps its amax histories (Transformer Engine's ``DelayedScaling``
    with ``amax_history_len=1024, amax_compute_algo="max"`` by default).

    Each FP8 matmul the step runs at its top level keeps an ``f32[3, history]`` array in
    ``TrainState.opt_state.fp8`` (rows: the lhs, the rhs, the output gradient; column 0 the
    newest step's amax) and scales with the ``reduction`` of it.

    Attributes:
      history: the steps an amax stays in the history (an int >= 1).
      reduction: ``"max"`` (the largest amax in the history) or ``"most_recent"``.
    """

    history: int = 1024
    reduction: str = "max"

    def __post_init__(self):
        if not _int_at_least(self.history, 1):
            raise ValueError(f"DelayedScaling: history must be an int >= 1 (the steps an amax "
                             f"is kept), got {self.history!r}. Example: "
                             "DelayedScaling(history=1024) (Transformer Engine's default).")
        if self.reduction not in AMAX_REDUCTIONS:
            raise ValueError(f"DelayedScaling: reduction must be one of {AMAX_REDUCTIONS}, got "
                             f"{self.reduction!r}. Example: DelayedScaling(reduction='max') "
                             "(Transformer Engine's default amax_compute_algo).")


def _amax(x: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def history_amax(history: jax.Array, reduction: str) -> jax.Array:
    """``f32[3]``: the amax each row of ``history`` (``f32[3, L]``, newest first) scales with;
    non-finite entries count as 0 (an inf amax of a step that applied does not pin the scale
    at 1 for ``L`` steps)."""
    h = jnp.where(jnp.isfinite(history), history, 0.0)
    return h[:, 0] if reduction == "most_recent" else jnp.max(h, axis=1)


def push_amax(history: jax.Array, amax: jax.Array) -> jax.Array:
    """``history`` (``f32[3, L]``) with ``amax`` (``f32[3]``) as its newest column, the oldest
    dropped."""
    return jnp.concatenate([amax.astype(history.dtype)[:, None], history[:, :-1]], axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _delayed_dot(lhs, rhs, history, dims, out_dtype, margin, reduction):
    return _delayed_fwd(lhs, rhs, history, dims, out_dtype, margin, reduction)[0]


def _delayed_fwd(lhs, rhs, history, dims, out_dtype, margin, reduction):
    ax, aw = _amax(lhs), _amax(rhs)
    if reduction == _CALIBRATE:
        amax = jnp.stack([ax, aw, jnp.zeros((), jnp.float32)])
    else:
        amax = history_amax(history, reduction)
    ls, rs = _scale_of(amax[0], E4M3, margin), _scale_of(amax[1], E4M3, margin)
    gs = _scale_of(amax[2], E5M2, margin)
    y, res = _scaled_dot(lhs, rhs, _quantize_with(lhs, ls, E4M3), _quantize_with(rhs, rs, E4M3),
                         ls, rs, dims, out_dtype)
    return y, (res, gs, ax, aw, jnp.zeros_like(history))


def _delayed_bwd(dims, out_dtype, margin, reduction, res, g):
    res, gs, ax, aw, h0 = res
    ag = _amax(g)
    if reduction == _CALIBRATE:
        gs = _scale_of(ag, E5M2, margin)
    dl, dr = _scaled_grads(res, dims, _quantize_with(g, gs, E5M2), gs)
    # the history's "gradient": this call's amaxes in column 0 (the step rolls them in)
    return dl, dr, h0.at[:, 0].set(jnp.stack([ax, aw, ag]))


_delayed_dot.defvjp(_delayed_fwd, _delayed_bwd)


def fp8_delayed_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers,
                            history: jax.Array, *, compute_dtype, margin: int = 0,
                            reduction: str = "max") -> jax.Array:
    """:func:`fp8_dot_general` with delayed scaling: the scales of ``lhs``, ``rhs`` (E4M3) and
    of the output gradient (E5M2) come from ``history`` (``f32[3, L]``, rows lhs, rhs,
    gradient, newest first) by ``reduction`` (:func:`history_amax`), not from the tensors
    themselves; a value beyond its scale's range saturates. The gradient w.r.t. ``history``
    is zeros with this call's own amaxes (``|lhs|``, ``|rhs|``, ``|g|``) in column 0, which a
    train step pushes into the history (:func:`push_amax`) once the step is known finite.

    Example:
      >>> h = jnp.zeros((3, 4)).at[:, 1].set(jnp.array([1.0, 0.5, 1.0]))
      >>> x, w = jnp.ones((16, 32)), jnp.full((32, 16), 0.5)
      >>> f = lambda x, w, h: fp8_delayed_dot_general(
      ...     x, w, (((1,), (0,)), ((), ())), h, compute_dtype=jnp.float32).sum()
      >>> float(f(x, w, h)), jax.grad(f, argnums=2)(x, w, h)[:, 0].tolist()
      (4096.0, [1.0, 0.5, 1.0])
    """
    _check_scaling("fp8_delayed_dot_general", margin, 1)
    if reduction not in AMAX_REDUCTIONS:
        raise ValueError(f"fp8_delayed_dot_general: reduction must be one of "
                         f"{AMAX_REDUCTIONS}, got {reduction!r}.")
    if np.shape(history)[:1] != (3,) or np.ndim(history) != 2:
        raise ValueError(f"fp8_delayed_dot_general: history must be f32[3, L] (rows lhs, rhs, "
                         f"output gradient), got shape {np.shape(history)}. Example: "
                         "jnp.zeros((3, 1024)).")
    return _delayed_dot(lhs, rhs, jnp.asarray(history, jnp.float32), _dims(dimension_numbers),
                        np.dtype(compute_dtype), margin, reduction)


class _DelayedScope:
    def __init__(self, histories: Mapping[str, jax.Array], calibrate: bool):
        self.histories = dict(histories)
        self.calibrate = calibrate
        self.found: dict[str, int] = {}  # site -> history length, in program order
        self.counts: collections.Counter = collections.Counter()
        self.trace = current_trace()


_SCOPES = threading.local()


@contextlib.contextmanager
def delayed_scope(histories: Mapping[str, jax.Array], *, calibrate: bool = False):
    """While a train step traces its loss: the amax histories (site -> ``f32[3, L]``) its
    ``fp8=delayed`` matmuls scale with and whose gradients are their amaxes. ``calibrate``:
    a site without a history scales with this step's own amaxes (the first pass). Yields the
    scope; its ``found`` lists the sites met (site -> history length)."""
    stack = _SCOPES.__dict__.setdefault("stack", [])
    stack.append(scope := _DelayedScope(histories, calibrate))
    try:
        yield scope
    finally:
        stack.pop()


def delayed_active() -> bool:
    """Whether a :func:`delayed_scope` is open in this thread (autocast then evaluates every
    module call in place and a scan over stacked layers one layer at a time: a shared
    evaluation of repeated layers would share one history)."""
    return bool(getattr(_SCOPES, "stack", None))


def _delayed_site(eqn, delayed: DelayedScaling) -> tuple[str | None, str]:
    """``(site, mark)``: this matmul's history key and ``"delayed"``, or ``None`` and the
    audit's mark for current scaling: outside a train step (no history), or in a loop body
    that is not a stack of layers, a ``jit`` or ``checkpoint`` body (one equation for every
    iteration: no history each)."""
    stack = getattr(_SCOPES, "stack", None)
    if not stack:
        return None, "current (no history)"
    scope = stack[-1]
    if current_trace() is not scope.trace:
        return None, "current (loop body)"
    path = "/".join(p.name for p in name_scopes(eqn) if p.name not in MARKS)
    site = f"{path}#{scope.counts[path]}"
    scope.counts[path] += 1
    scope.found[site] = delayed.history
    return site, "delayed"


def _delayed_matmul(call, site: str, rule: FP8Matmuls) -> jax.Array:
    scope = _SCOPES.stack[-1]
    history = scope.histories.get(site)
    if history is None and not scope.calibrate:
        known = sorted(scope.histories)
        raise ValueError(
            f"fp8=delayed: the FP8 matmul {site!r} has no amax history in the state, which "
            f"holds {len(known)} ({', '.join(known[:4])}{', ...' if len(known) > 4 else ''}): "
            "the state's opt_state.fp8 was made for another model or policy. Start its "
            "histories again with state.replace(opt_state=state.opt_state._replace(fp8={})) "
            "(the next step calibrates them).")
    if not scope.calibrate and history is not None \
            and np.shape(history)[1] != rule.delayed.history:
        raise ValueError(
            f"fp8=delayed: the state's amax history of {site!r} holds {np.shape(history)[1]} "
            f"steps, but the step's FP8Matmuls(delayed=DelayedScaling(history="
            f"{rule.delayed.history})) keeps {rule.delayed.history}: the state was made with "
            f"other settings. Resume with DelayedScaling(history={np.shape(history)[1]}), or "
            "start the histories again with state.replace(opt_state=state.opt_state._replace("
            "fp8={})) (the next step calibrates them).")
    lhs, rhs = call.args
    return _delayed_dot(lhs, rhs, jnp.zeros((3, 1), jnp.float32) if history is None
                        else history, _dims(dot_dimension_numbers(call.eqn)),
                        np.dtype(call.compute_dtype), rule.margin,
                        _CALIBRATE if scope.calibrate else rule.delayed.reduction)


def _size(shape, dims) -> int:
    return int(np.prod([shape[d] for d in dims], dtype=np.int64)) if dims else 1


def fp8_eligible(lhs_shape: Sequence[int], rhs_shape: Sequence[int], dimension_numbers, *,
                 lhs_dtype=jnp.float32, rhs_dtype=jnp.float32, param: int | None = 1,
                 small: tuple[int, int] = (1024, 4096), min_size: int = 0) -> str | None:
    """Why this ``dot_general`` should not run in FP8, or None when it is eligible.

    Reasons (the audit prints them): ``"not float"`` (an integer operand), ``"float64"``
    (left alone, as all float64 in autocast), ``"batched"`` (batch dimensions: attention's
    q @ k and weights @ v, best left to the fused attention), ``"unaligned"`` (the contracting
    size K or the weight's output features N not a multiple of 16, torchao's rule for
    cuBLASLt; XLA pads the rows M), ``"small"`` (K <= small[0] and N <= small[1], torchao's
    auto-filter, or min(K, N) < min_size: where quantising costs more than the faster GEMM
    gains; ``small=(0, 0), min_size=0`` lets every aligned matmul run in FP8).
    """
    if not all(jnp.issubdtype(d, jnp.floating) for d in (lhs_dtype, rhs_dtype)):
        return "not float"
    if any(np.dtype(d) == np.float64 for d in (lhs_dtype, rhs_dtype)):
        return "float64"
    (lc, rc), (lb, rb) = _dims(dimension_numbers)
    if lb or rb:
        return "batched"
    k = _size(lhs_shape, lc)
    m = _size(lhs_shape, _remaining(len(lhs_shape), lc))
    n = _size(rhs_shape, _remaining(len(rhs_shape), rc))
    if k % 16 or n % 16:
        return "unaligned"
    features = m if param == 0 else n
    if (k <= small[0] and features <= small[1]) or min(k, features) < min_size:
        return "small"
    return None


@dataclasses.dataclass(frozen=True)
class FP8Matmuls:
    """The engine rule (an :class:`jaxamp.OpRules` handler of ``dot_general``) that runs the
    eligible matmuls of a ``matmul=float8`` region in FP8; elsewhere it defers to the built-in
    matmul rule. :data:`jaxamp.DEFAULT_OP_RULES` holds :data:`FP8_MATMULS`; other options:
    ``DEFAULT_OP_RULES.extend(handlers={"dot_general": FP8Matmuls(small=(0, 0), min_size=0)})``.

    Attributes:
      small: ``(K, N)``: a matmul with contracting size <= K and output features <= N stays in
        the compute dtype (:func:`fp8_eligible`).
      min_size: a matmul whose contracting size or output features are below it stays in the
        compute dtype. 2048 by the H200 estimate (BENCHMARKS.md, "FP8 recipes"): with current
        scaling at 8k tokens a GEMM gains from FP8 only when both K and N are >= 2048 (Llama
        3.2 1B's k/v projections, N = 512, and every projection of a 768-wide model lose).
      keep_first_last: keep the first and the last matmul of the program that reads a param
        (input projection, head) in the compute dtype, against the divergence TE/Megatron
        users report (``--first-last-layers-bf16``); never a matmul in a loop body.
      margin: headroom ``2**margin`` below the FP8 maximum (:func:`quantize`).
      shards: the activation's (the operand that is not a param) and its output gradient's
        scale per chunk of its leading dimension (:func:`fp8_dot_general`);
        :func:`jaxamp.make_train_step` with ``mesh=`` sets it (when left at 1) to the devices
        of the data axis, so each device scales its own rows. A weight keeps one scale.
      delayed: the amax histories of ``fp8=delayed`` (:class:`DelayedScaling`: length and
        reduction).
    """

    small: tuple[int, int] = (1024, 4096)
    min_size: int = 2048
    keep_first_last: bool = True
    margin: int = 0
    shards: int = 1
    delayed: DelayedScaling = DelayedScaling()

    def __post_init__(self):
        if not isinstance(self.delayed, DelayedScaling):
            raise TypeError(f"FP8Matmuls: delayed must be a jaxamp.fp8.DelayedScaling, got "
                            f"{self.delayed!r}. Example: FP8Matmuls(delayed=DelayedScaling("
                            "history=16, reduction='most_recent')).")
        if (not isinstance(self.small, tuple) or len(self.small) != 2
                or not all(isinstance(s, int) and s >= 0 for s in self.small)):
            raise ValueError(f"FP8Matmuls: small must be a tuple (K, N) of ints >= 0, got "
                             f"{self.small!r}. Example: FP8Matmuls(small=(0, 0), min_size=0) "
                             "runs every aligned matmul in FP8.")
        if not _int_at_least(self.min_size, 0):
            raise ValueError(f"FP8Matmuls: min_size must be an int >= 0, got "
                             f"{self.min_size!r}. Example: FP8Matmuls(min_size=0) lifts the "
                             "size threshold (small= still applies).")
        _check_scaling("FP8Matmuls", self.margin, self.shards)

    def decide(self, call) -> str:
        """``"float8"``, or why ``call``'s matmul stays in the compute dtype."""
        eqn = call.eqn
        if self.keep_first_last and call.position is not None:
            return call.position  # "first" / "last"
        lhs, rhs = eqn.invars
        param = 1 if call.stored[1] else 0 if call.stored[0] else None
        why = fp8_eligible(lhs.aval.shape, rhs.aval.shape, dot_dimension_numbers(eqn),
                           lhs_dtype=lhs.aval.dtype, rhs_dtype=rhs.aval.dtype, param=param,
                           small=self.small, min_size=self.min_size)
        return "float8" if why is None else why

    def __call__(self, call) -> list | None:
        if getattr(call.policy, "matmul_dtype", None) is None or \
                np.dtype(call.policy.matmul_dtype) != E4M3 or len(call.args) != 2:
            return None
        decision = self.decide(call)
        recipe = mark = fp8_recipe(call.policy)
        site = None
        if recipe == "delayed" and decision == "float8":
            site, mark = _delayed_site(call.eqn, self.delayed)
            recipe = "delayed" if site is not None else "current"
        # a mark in the name stack (replayed layers keep it) that the audit looks up: the
        # recipe of an FP8 matmul, or why it stays in the compute dtype
        with call.decided(mark if decision == "float8" else decision):
            if decision != "float8":
                return call.default()
            if site is not None:
                return [_delayed_matmul(call, site, self)]
            lhs, rhs = call.args  # a param in its stored dtype: quantised from it
            # the activation is scaled per shard, a weight keeps one scale
            activation = 1 if call.stored[0] and not call.stored[1] else 0
            shards = 1 if call.stored[activation] else self.shards
            return [fp8_dot_general(lhs, rhs, dot_dimension_numbers(call.eqn),
                                    compute_dtype=call.compute_dtype, margin=self.margin,
                                    shards=shards, activation=activation, recipe=recipe)]


#: The FP8 rule with its defaults (in :data:`jaxamp.DEFAULT_OP_RULES`).
FP8_MATMULS = FP8Matmuls()
