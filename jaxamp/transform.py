"""``jaxamp.amp``: the AMP update as an optax ``GradientTransformation`` (one implementation;
:func:`jaxamp.make_train_step` composes it, its state in ``TrainState.opt_state``).

``update`` takes the gradients of the scaled loss (:func:`scale_loss`), casts them to float32,
takes their global norm once (computed scaled, so finite gradients never overflow it), unscales
and clips them with one scalar, runs the inner optimizer, and on a non-finite norm skips the
step (:func:`skip`: state bit for bit, ``-0.0`` updates, no ``lax.cond``); then the loss scale
adjusts. Why each piece is as it is: ``docs/api/train.rst``. A hand-written step needs three
changes (README, "Your own train step")::

    tx = jaxamp.amp(optax.adamw(3e-4), clip_norm=1.0)            # 1. wrap the optimizer
    loss = jaxamp.autocast(loss_fn, policy)(params, batch)       # 2. the loss under the policy
    return jaxamp.scale_loss(loss, opt_state)                    # 3. differentiate it scaled
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
from jax import lax

from jaxamp import policy_spec
from jaxamp._engine.compat import Tracer
from jaxamp._engine.jaxpr import evaluate_rerouted
from jaxamp.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from jaxamp.policy import check_state_dtype, get_policy
from jaxamp.state_dtype import with_state_dtype

__all__ = ["AmpState", "amp", "amp_state", "default_loss_scale", "scale_loss"]

LOSS_SCALES = (NoOpLossScale, StaticLossScale, DynamicLossScale)


class AmpState(NamedTuple):
    """The state of :func:`amp`.

    Attributes:
      loss_scale: the current loss scale (:class:`jaxamp.DynamicLossScale`,
        :class:`jaxamp.StaticLossScale` or :class:`jaxamp.NoOpLossScale`).
      inner_state: the wrapped optimizer's state; unchanged by a skipped step.
      skipped_steps: int32 count of updates skipped (non-finite gradients or loss).
      grad_norm: float32 global norm of the last update's unscaled gradients, before clipping
        (inf/nan on a skipped step).
      grads_finite: bool, whether the last update's gradients were finite (the update was
        applied when they were and ``update``'s ``loss_finite`` was true).
      fp8: the amax histories of ``fp8=delayed`` matmuls (site -> ``f32[3, L]``,
        :class:`jaxamp.fp8.DelayedScaling`), made and updated by :func:`jaxamp.make_train_step`
        (skipped with the rest); empty otherwise. ``update`` passes it on unchanged.
    """

    loss_scale: Any
    inner_state: Any
    skipped_steps: jax.Array
    grad_norm: jax.Array
    grads_finite: jax.Array
    fp8: Any = {}  # never mutated: the step replaces it


def default_loss_scale(policy: str | jmp.Policy) -> NoOpLossScale | DynamicLossScale:
    """Dynamic loss scaling for float16 compute; none for bfloat16/float32 (same exponent
    range as float32, so gradients do not underflow).

    Example:
      >>> type(jaxamp.default_loss_scale("params=float32,compute=float16")).__name__
      'DynamicLossScale'
    """
    compute = np.dtype(get_policy(policy).compute_dtype).name
    return DynamicLossScale() if policy_spec.loss_scaling(compute) == "dynamic" else NoOpLossScale()


def check_loss_scale(loss_scale: Any, where: str) -> None:
    if not isinstance(loss_scale, LOSS_SCALES):
        raise TypeError(
            f"{where}: loss_scale must be a jaxamp.DynamicLossScale, StaticLossScale or "
            f"NoOpLossScale, got {type(loss_scale).__name__} {loss_scale!r}. For a fixed scale "
            "write loss_scale=jaxamp.StaticLossScale(2.0**15).")


def copy_tree(tree: Any) -> Any:
    """Fresh buffers for every array leaf, so donating them leaves the caller's arrays alive."""
    def copy(x):
        if isinstance(x, jax.Array):
            return x.copy()  # works for typed PRNG keys too
        return jnp.array(x, copy=True) if isinstance(x, np.ndarray) else x

    return jax.tree.map(copy, tree)


def check_clip_norm(clip_norm: Any, where: str) -> float | jax.Array | None:
    """``None``, or a positive finite number (Python or JAX/NumPy scalar of any integer or
    float dtype, bfloat16 included) as a float."""
    if clip_norm is None:
        return None
    if isinstance(clip_norm, Tracer):
        return clip_norm  # traced (e.g. built inside jit): nothing to check at trace time
    arr = np.asarray(clip_norm) if not isinstance(clip_norm, bool) else None
    # jnp.issubdtype: NumPy does not count bfloat16/float8 (ml_dtypes) as np.number
    if arr is None or arr.ndim != 0 or not (jnp.issubdtype(arr.dtype, jnp.floating)
                                            or jnp.issubdtype(arr.dtype, jnp.integer)) \
            or not math.isfinite(float(arr)) or float(arr) <= 0:
        raise ValueError(f"{where}: clip_norm must be a positive finite number or None, got "
                         f"{clip_norm!r}. Example: clip_norm=1.0.")
    return float(arr)


def amp(tx: optax.GradientTransformation, *, loss_scale: Any = None,
        clip_norm: float | jax.Array | None = None, group_vectors: bool = True,
        state_dtype: Any = None) -> optax.GradientTransformationExtraArgs:
    """Wraps ``tx`` in the AMP update: unscale -> float32 -> clip -> skip on inf/nan -> adjust.

    ``update(grads, state, params, *, loss_finite=True, **extra_args)`` takes the gradients of
    the *scaled* loss (:func:`scale_loss`); the loss scale lives in the state
    (:class:`AmpState`), so it checkpoints with the optimizer. ``loss_finite=False`` (a traced
    bool) skips the update without backing the scale off (no smaller scale makes that loss
    finite); ``extra_args`` go to ``tx`` (e.g. ``value=`` for line searches).

    Args:
      tx: the optimizer to wrap (any optax transformation).
      loss_scale: the initial loss scale; ``None`` means ``jaxamp.DynamicLossScale()`` (what
        float16 needs; :func:`default_loss_scale` picks for a policy). ``init`` copies it.
      clip_norm: clip the unscaled float32 gradients to this global norm (a Python or JAX
        scalar), or ``None``.
      group_vectors: sum the squares of the vector leaves (biases, norm scales) in one
        reduction over their concatenation (fewer kernels). Pass ``False`` when the gradients
        are sharded over a mesh: the concatenation would move them between devices.
      state_dtype: store ``tx``'s non-scalar floating state in ``jnp.bfloat16`` (computed in
        float32, written back with stochastic rounding; ``inner_state`` is then a
        :class:`jaxamp.state_dtype.StoredState`) or ``jnp.float32``; None: as ``tx`` makes it.

    Example:
      >>> import optax
      >>> tx = jaxamp.amp(optax.sgd(0.1), loss_scale=jaxamp.StaticLossScale(8.0))
      >>> params = {"w": jnp.ones(2)}
      >>> opt_state = tx.init(params)
      >>> grads = jax.grad(lambda p: jaxamp.scale_loss(jnp.sum(p["w"] ** 2), opt_state))(params)
      >>> updates, opt_state = tx.update(grads, opt_state, params)
      >>> optax.apply_updates(params, updates)["w"]       # 1 - 0.1 * 2, unscaled
      Array([0.8, 0.8], dtype=float32)
      >>> updates, opt_state = tx.update({"w": jnp.array([jnp.inf, 1.0])}, opt_state, params)
      >>> optax.apply_updates(params, updates)["w"], int(opt_state.skipped_steps)
      (Array([1., 1.], dtype=float32), 1)

      Adam's moments stored in bfloat16 (2 bytes per parameter each instead of 4):

      >>> tx = jaxamp.amp(optax.adam(1e-3), loss_scale=jaxamp.NoOpLossScale(),
      ...                 state_dtype=jnp.bfloat16)
      >>> adam = tx.init(params).inner_state.inner_state[0]
      >>> adam.mu["w"].dtype, adam.nu["w"].nbytes
      (dtype(bfloat16), 4)
    """
    return amp_transform(tx, loss_scale=loss_scale, clip_norm=clip_norm,
                         group_vectors=group_vectors, state_dtype=state_dtype,
                         where="jaxamp.amp")


def amp_transform(tx, *, loss_scale=None, clip_norm=None, group_vectors=True,
                  state_dtype=None, where: str) -> optax.GradientTransformationExtraArgs:
    """:func:`amp`, its errors naming ``where`` (the train step composes it too)."""
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
        raise TypeError(f"{where}: tx must be an optax.GradientTransformation, got "
                        f"{type(tx).__name__}. Example: jaxamp.amp(optax.adam(1e-3)).")
    if loss_scale is None:
        loss_scale = DynamicLossScale()
    check_loss_scale(loss_scale, where)
    clip_norm = check_clip_norm(clip_norm, where)
    if not isinstance(group_vectors, bool):
        raise TypeError(f"{where}: group_vectors must be True or False, got "
                        f"{group_vectors!r}. Pass False when the gradients are sharded over a "
                        "mesh.")
    state_dtype = check_state_dtype(state_dtype, where)
    if state_dtype is not None:
        tx = with_state_dtype(tx, state_dtype, where=where)
    inner_update = optax.with_extra_args_support(tx).update

    def init_fn(params):
        return AmpState(loss_scale=copy_tree(loss_scale), inner_state=tx.init(params),
                        skipped_steps=jnp.zeros((), jnp.int32),
                        grad_norm=jnp.zeros((), jnp.float32),
                        grads_finite=jnp.ones((), bool))

    def update_fn(updates, state, params=None, *, loss_finite=True, **extra_args):
        _check_state(tx, state, params, where)
        return _update(inner_update, clip_norm, updates, state, params, extra_args,
                       loss_finite, group_vectors)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


#: The norm's second sum is of the gradients times 2**-64 (docs/api/train.rst).
_DOWN_EXPONENT = 64
_DOWN = np.float32(2.0**-_DOWN_EXPONENT)


def _down_exact(g: jax.Array) -> jax.Array:
    """``g * 2**-64`` for one-element leaves, by the exponent bits (XLA:CPU would fold the
    constant of ``(g*c) * (g*c)`` into an overflowing ``(g*g) * (c*c)``)."""
    bits = lax.bitcast_convert_type(g, jnp.int32) - (_DOWN_EXPONENT << 23)
    down = jnp.where(jnp.abs(g) >= 2.0 ** (2 - _DOWN_EXPONENT),
                     lax.bitcast_convert_type(bits, jnp.float32), 0.0)
    return jnp.where(jnp.isfinite(g), down, g)


def _add_pairs(a, b):
    """The reducer of the norm's sums (one function, so JAX traces it once)."""
    return a[0] + b[0], a[1] + b[1]


#: Vector leaves (biases, norm scales: at most one axis, at most this many elements) share one
#: reduction in the norm, over their concatenation.
_GROUP_MAX_SIZE = 2**16


def _grouped(leaves: list[jax.Array]) -> list[jax.Array]:
    """``leaves``, the vectors among them replaced by their concatenation (one reduction
    for all the biases and norm scales: fewer kernels)."""
    is_vector = [g.ndim <= 1 and g.size <= _GROUP_MAX_SIZE for g in leaves]
    if sum(is_vector) < 2:
        return leaves
    rest = [g for g, v in zip(leaves, is_vector) if not v]
    return rest + [lax.concatenate([lax.reshape(g, (g.size,))
                                    for g, v in zip(leaves, is_vector) if v], 0)]


def _scaled_sums(leaves: list[jax.Array], group: bool = True
                 ) -> tuple[jax.Array, jax.Array]:
    """``(total, r)``: ``sqrt(total) / r`` is the global norm of the float32 ``leaves``;
    ``total`` is inf/nan exactly when an element is (unless the norm exceeds float32's range).
    One variadic reduction per leaf sums ``g**2`` and ``(g * 2**-64)**2``; the second stands
    in (``r = 2**-64``) when the first overflows. ``group``: :func:`_grouped` (not on a mesh).
    """
    zero = jnp.zeros((), jnp.float32)
    down = PerShape(_DOWN)

    def sums(g):  # lax, not jnp: no jit of jnp's operator to trace per shape
        d = _down_exact(g) if g.size == 1 else lax.mul(g, down(g.shape))
        return lax.reduce((lax.mul(g, g), lax.mul(d, d)), (zero, zero), _add_pairs,
                          tuple(range(g.ndim)))

    if not leaves:
        return zero, jnp.float32(1.0)
    pairs = [sums(g) for g in (_grouped(leaves) if group else leaves)]
    # The per-leaf sums added by one more reduction (not a chain of scalar additions): XLA
    # computes it once, where it copied a chain into each of its scalar consumers.
    low, high = lax.reduce((jnp.stack([lo for lo, _ in pairs]),
                            jnp.stack([hi for _, hi in pairs])), (zero, zero),
                           _add_pairs, (0,))
    fits = jnp.isfinite(low)
    return (jnp.where(fits, low, high),
            jnp.where(fits, jnp.float32(1.0), jnp.float32(2.0**-_DOWN_EXPONENT)))


def _is_float(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) \
        or isinstance(x, float)


def _update(inner_update, clip_norm, grads, state: AmpState, params, extra_args: dict,
            loss_finite, group_vectors: bool) -> tuple[Any, AmpState]:
    """:func:`amp`'s update: ``(updates, state)``; on a skipped step the updates are ``-0.0``
    (:func:`skip_updates`) and ``inner_state`` is the old one bit for bit (:func:`skip`). The
    loss scale follows the gradients alone (a non-finite loss is no overflow)."""
    ls = state.loss_scale
    scale = jnp.asarray(ls.loss_scale, jnp.float32)
    inv = (1.0 / ls.loss_scale).astype(jnp.float32)
    grads = jax.tree.map(lambda g: jnp.asarray(g).astype(jnp.float32) if _is_float(g) else g,
                         grads)
    total, r = _scaled_sums([g for g in jax.tree.leaves(grads) if _is_float(g)],
                            group=group_vectors)
    root = jnp.sqrt(total)
    grads_finite = jnp.isfinite(root)
    grad_norm = root * (inv / r)  # unscaled (inv and r are powers of two for dynamic scales)
    # One scalar unscales and clips: inv * min(1, clip / grad_norm) = 1 / max(scale, root /
    # (clip * r)), finite when the norm itself does not fit in float32 (a zero root gives
    # inv). Each leaf multiplies by it once. Ending in a division, it is computed once: XLA
    # copies a cheap scalar expression (a min) into every fusion that reads it.
    factor = inv if clip_norm is None else \
        1.0 / jnp.maximum(scale, root / (jnp.asarray(clip_norm, jnp.float32) * r))
    factors = PerShape(factor)
    grads = jax.tree.map(lambda g: lax.mul(g, factors(g.shape)) if _is_float(g) else g, grads)
    # Whether the step applies, as the finiteness of one square root (computed once, where an
    # ``isfinite(root) & isfinite(loss)`` was recomputed in each of the update's fusions).
    applied = jnp.isfinite(jnp.sqrt(jnp.where(loss_finite, root, jnp.float32(np.nan))))
    applied_by_shape = PerShape(applied)
    new_updates, inner = _inner_update_selected(inner_update, applied_by_shape, grads,
                                                state.inner_state, params, extra_args)
    return skip_updates(applied_by_shape, new_updates), AmpState(
        loss_scale=ls.adjust(grads_finite), inner_state=inner,
        skipped_steps=state.skipped_steps + (~applied).astype(jnp.int32),
        grad_norm=grad_norm.astype(jnp.float32), grads_finite=grads_finite, fp8=state.fp8)


def _inner_update_selected(inner_update, applied, grads, inner_state, params,
                           extra_args: dict) -> tuple[Any, Any]:
    """``(updates, state)`` of ``inner_update``, the state's leaves selected: new where
    ``applied``, else the old ones (bit for bit, counters included); the updates read the
    selected state, so XLA computes each new leaf once (``docs/api/train.rst``)."""
    old_leaves, old_tree = jax.tree.flatten(inner_state)
    closed, out_shape = jax.make_jaxpr(
        lambda g, s, p: inner_update(g, s, p, **extra_args), return_shape=True)(
            grads, inner_state, params)
    out_tree = jax.tree.structure(out_shape)
    n_upd = len(jax.tree.leaves(out_shape[0]))
    same_tree = jax.tree.structure(out_shape[1]) == old_tree

    def reroute(new, old):
        if not (hasattr(old, "dtype") and np.shape(old) == new.shape):
            return None
        return lambda v: select(applied, v, jnp.asarray(old).astype(v.dtype))

    n_state = len(outs_shape := jax.tree.leaves(out_shape[1]))
    fns = [None] * n_state if not same_tree else \
        [reroute(n, o) for n, o in zip(outs_shape, old_leaves)]
    outs, rerouted = evaluate_rerouted(
        closed, jax.tree.leaves((grads, inner_state, params)), [None] * n_upd + fns)
    updates, new_state = jax.tree.unflatten(out_tree, outs)
    if not same_tree:  # the select raises on the mismatch, as it did before
        return updates, skip(applied, new_state, inner_state)
    # float32 grads would promote e.g. a bfloat16 Adam moment to float32: keep its dtype.
    leaves = [new if done and new.dtype == old.dtype else _skip_leaf(applied, new, old)
              for new, old, done in zip(outs[n_upd:], old_leaves, rerouted[n_upd:])]
    return updates, jax.tree.unflatten(old_tree, leaves)


# The skip, the one implementation (jaxamp.amp's update and the train step): per-leaf selects
# of the state; updates -0.0, the identity of IEEE addition (p + -0.0 == p bit for bit).


def skip(applied: PerShape, new: Any, old: Any) -> Any:
    """``new`` where the step is ``applied``, else ``old``, leaf by leaf and bit for bit (each
    new leaf cast to its old dtype): an optimizer state or the model's collections."""
    return jax.tree.map(lambda n, o: _skip_leaf(applied, n, o), new, old)


def skip_updates(applied: PerShape, updates: Any) -> Any:
    """``updates`` where the step is ``applied``, else ``-0.0`` (see :func:`skip`): one
    ``-0.0`` broadcast per shape and dtype (:class:`PerShape`)."""
    zeros: dict = {}

    def zero(u):
        return zeros.setdefault(u.dtype, PerShape(jnp.asarray(-0.0, u.dtype)))(u.shape)

    return skip(applied, updates, jax.tree.map(zero, updates))


def _skip_leaf(applied: PerShape, new: Any, old: Any) -> Any:
    return select(applied, new.astype(old.dtype), old) if hasattr(old, "dtype") else new


class PerShape:
    """A scalar broadcast once per shape it is asked for (one ``broadcast`` per distinct
    shape, not per leaf: fewer HLO instructions to compile)."""

    def __init__(self, x: jax.Array):
        self.x = x
        self._by_shape: dict = {}

    def __call__(self, shape: tuple[int, ...]) -> jax.Array:
        if not shape:
            return self.x
        if shape not in self._by_shape:
            self._by_shape[shape] = lax.broadcast_in_dim(self.x, shape, ())
        return self._by_shape[shape]


def select(pred: jax.Array | PerShape, new: Any, old: Any) -> jax.Array:
    """``new`` where the scalar ``pred``, else ``old``: one ``select`` (``lax.select``
    when the two agree in shape and dtype, which costs less to trace than ``jnp.where``)."""
    if isinstance(new, jax.Array | Tracer) and isinstance(old, jax.Array | Tracer) \
            and new.shape == old.shape and new.dtype == old.dtype:
        return lax.select(pred(new.shape) if isinstance(pred, PerShape) else pred, new, old)
    return jnp.where(pred.x if isinstance(pred, PerShape) else pred, new, old)


def _check_state(tx, state, params, where: str) -> None:
    """Trace-time checks: a foreign optimizer state gets a clear error, not an optax one."""
    if not isinstance(state, AmpState):
        raise TypeError(
            f"{where}: update expected the state made by this transformation's init (an "
            f"AmpState), got {type(state).__name__}. Create it with tx.init(params) from the "
            "same jaxamp.amp(...) you pass to update.")
    check_loss_scale(state.loss_scale, where)
    if params is not None:
        check_opt_state(tx, state.inner_state, params, where)


def check_opt_state(tx, opt_state, params, where: str) -> None:
    """Raises if ``opt_state`` does not have the structure of ``tx.init(params)``."""
    want = jax.tree.structure(jax.eval_shape(tx.init, params))
    got = jax.tree.structure(opt_state)
    if got != want:
        raise ValueError(
            f"{where}: the optimizer state does not match the optimizer: expected the "
            f"structure of tx.init(params), {_short(want)}, got {_short(got)} instead. It was "
            "created by another optimizer (or for other params); create it with "
            "tx.init(params) from the same tx.")


def _short(treedef) -> str:
    text = str(treedef)
    return text if len(text) <= 200 else text[:200] + "..."


def amp_state(opt_state: Any) -> AmpState:
    """The one :class:`AmpState` inside ``opt_state`` (which may be an optax chain's state).

    Raises:
      ValueError: if ``opt_state`` holds none or several.
    """
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, AmpState))
             if isinstance(x, AmpState)]
    if len(found) != 1:
        raise ValueError(
            f"jaxamp: expected exactly one jaxamp.amp state in the optimizer state, found "
            f"{len(found)}. Wrap the optimizer once: tx = jaxamp.amp(optax.adam(1e-3)), "
            "opt_state = tx.init(params).")
    return found[0]


def scale_loss(loss: jax.Array, opt_state: Any) -> jax.Array:
    """``loss`` multiplied by the current loss scale held in ``opt_state`` (see :func:`amp`).

    Differentiate the result; ``tx.update`` unscales the gradients.

    Args:
      loss: the (float32) loss.
      opt_state: the state of a :func:`amp` transformation, or a state that contains one.
    """
    return amp_state(opt_state).loss_scale.scale(loss)
