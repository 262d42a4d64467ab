"""The jitted AMP train step: scaled loss -> grads -> unscale -> f32 -> clip -> skip -> rescale.

One step, in the order the methodology prescribes:

1. the loss runs under :func:`jaxamp.autocast` (the forward only; the backward follows the
   forward's dtypes), and is returned in float32;
2. the float32 loss is multiplied by the loss scale and differentiated;
3. the gradients are cast to float32 and divided by the scale (``unscale``);
4. their global norm is taken once: it is the metric, the finite check and the clip's norm;
5. the *unscaled* gradients are clipped with ``optax.clip_by_global_norm``'s rule and that
   norm (clipping scaled ones would shrink the threshold by the scale); a clip chained
   inside the user's optimizer also sees unscaled float32 gradients;
6. if the norm is not finite the update is skipped under ``lax.cond``: params and the whole
   optimizer state come back bit-identical, so schedules do not advance;
7. the loss scale adjusts (backs off on overflow, grows after a run of clean steps).

``TrainState.step`` counts every step, skipped or not; the optimizer's own counter (which drives
learning-rate schedules) counts applied updates only, and ``skipped_steps`` counts the rest.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
from flax import struct
from flax.training import train_state
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from jaxamp.autocast import autocast
from jaxamp.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from jaxamp.policy import get_policy

__all__ = ["TrainState", "default_loss_scale", "make_eval_step", "make_train_step"]

_LOSS_SCALES = (NoOpLossScale, StaticLossScale, DynamicLossScale)


def default_loss_scale(policy: str | jmp.Policy) -> NoOpLossScale | DynamicLossScale:
    """Dynamic loss scaling for float16 compute; none for bfloat16/float32 (same exponent
    range as float32, so gradients do not underflow)."""
    policy = get_policy(policy)
    if np.dtype(policy.compute_dtype) == np.float16:
        return DynamicLossScale()
    return NoOpLossScale()


def _apply_fn_of(model: Any) -> Callable:
    if isinstance(model, nn.Module):
        return model.apply
    if callable(model):
        return model
    raise TypeError(f"model must be a flax.linen.Module or an apply function, got "
                    f"{type(model).__name__}.")


def _check_float_params(params: Any, where: str) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        dtype = np.dtype(leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"{where}: params must be floating point, got {dtype} at "
                f"{jax.tree_util.keystr(path)}. Keep integer or boolean state out of params "
                "(e.g. in a separate argument or variable collection).")


class TrainState(train_state.TrainState):
    """``flax.training.train_state.TrainState`` plus the loss-scale state and a skip counter.

    Attributes:
      loss_scale: a :class:`NoOpLossScale`, :class:`StaticLossScale` or
        :class:`DynamicLossScale`; every field is a leaf, so it checkpoints with the state.
      skipped_steps: int32 count of steps whose update was skipped (non-finite gradients).
    """

    loss_scale: Any = None
    skipped_steps: jax.Array = struct.field(default_factory=lambda: jnp.zeros((), jnp.int32))

    @classmethod
    def create(cls, model: Any = None, params: Any = None, tx: optax.GradientTransformation
               | None = None, *, apply_fn: Callable | None = None, loss_scale: Any = None,
               policy: str | jmp.Policy | None = None, **kwargs) -> TrainState:
        """Creates a state; ``params`` are cast to the policy's ``param_dtype`` if one is given.

        Example:
          >>> state = TrainState.create(model, params, optax.adam(1e-3),
          ...                           loss_scale=jaxamp.DynamicLossScale())
        """
        if apply_fn is None:
            if model is None:
                raise TypeError("TrainState.create: pass the model (or apply_fn=...).")
            apply_fn = _apply_fn_of(model)
        if params is None or tx is None:
            raise TypeError("TrainState.create: params and tx are required, e.g. "
                            "TrainState.create(model, params, optax.adam(1e-3)).")
        if isinstance(params, dict) and set(params) == {"params"}:
            params = params["params"]  # accept model.init's {'params': ...} as flax users pass it
        _check_float_params(params, "TrainState.create")
        if policy is not None:
            params = get_policy(policy).cast_to_param(params)
        # The step donates the state's buffers: copy so the caller's params stay usable.
        params = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
        if loss_scale is None:
            loss_scale = default_loss_scale(policy) if policy is not None else NoOpLossScale()
        if not isinstance(loss_scale, _LOSS_SCALES):
            raise TypeError(
                f"TrainState.create: loss_scale must be NoOpLossScale, StaticLossScale or "
                f"DynamicLossScale, got {type(loss_scale).__name__}.")
        return cls(step=jnp.zeros((), jnp.int32), apply_fn=apply_fn, params=params, tx=tx,
                   opt_state=tx.init(params), loss_scale=loss_scale,
                   skipped_steps=jnp.zeros((), jnp.int32), **kwargs)


def _batch_size(batch: Any, where: str) -> int:
    sizes = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        shape = np.shape(leaf)
        if not shape:
            raise ValueError(f"{where}: every batch leaf needs a leading batch axis; "
                             f"{jax.tree_util.keystr(path)} is a scalar.")
        sizes[jax.tree_util.keystr(path)] = shape[0]
    if not sizes:
        raise ValueError(f"{where}: the batch has no array leaves.")
    if len(set(sizes.values())) > 1:
        listing = ", ".join(f"{k}: {v}" for k, v in sizes.items())
        raise ValueError(f"{where}: batch leaves disagree on the batch size ({listing}). Every "
                         "leaf must have the same leading dimension.")
    return next(iter(sizes.values()))


class _Step:
    """The jitted step. Its checks run while it is traced: once per input signature, before
    anything compiles, and at no cost on later calls."""

    def __init__(self, jitted):
        self._jitted = jitted

    def __call__(self, state, batch):
        if not isinstance(state, TrainState):  # jit would fail on it with a pytree error
            raise TypeError(f"step: state must be a jaxamp.TrainState, got "
                            f"{type(state).__name__}. Create it with jaxamp.TrainState.create.")
        return self._jitted(state, batch)

    def lower(self, state, batch):
        return self._jitted.lower(state, batch)

    def _cache_size(self) -> int:
        return self._jitted._cache_size()


def _check_loss(loss_fn, apply_fn, params, batch, where: str) -> None:
    out = jax.eval_shape(lambda p, b: loss_fn(apply_fn, p, b), params, batch)
    if not isinstance(out, jax.ShapeDtypeStruct) or out.shape != () \
            or not jnp.issubdtype(out.dtype, jnp.floating):
        got = (f"shape={out.shape}, dtype={out.dtype}" if isinstance(out, jax.ShapeDtypeStruct)
               else f"a {type(out).__name__}")
        raise ValueError(f"{where}: loss_fn must return a floating scalar, got {got}. Reduce "
                         "the per-example losses (e.g. with jnp.mean) and return only the loss.")


def make_train_step(model: Any, loss_fn: Callable, tx: optax.GradientTransformation | None
                    = None, *, policy: str | jmp.Policy = "params=float32,compute=float16,"
                    "output=float32", overrides: dict | None = None,
                    clip_norm: float | None = None, micro_batches: int = 1,
                    mesh: Mesh | None = None, data_axis: str = "data",
                    donate: bool = True) -> Callable:
    """Builds ``step(state, batch) -> (state, metrics)``, compiled once with ``jax.jit``.

    Args:
      model: a flax linen Module (its ``apply`` is used) or an apply function.
      loss_fn: ``loss_fn(apply_fn, params, batch) -> scalar``; it calls
        ``apply_fn({"params": params}, ...)``. The whole loss runs under the policy.
      tx: the optax optimizer; optional, the state's ``tx`` is used (if given, it must be
        the one the state was created with).
      policy: the default policy (string or :class:`jmp.Policy`).
      overrides: per-module rules for :func:`jaxamp.autocast`.
      clip_norm: clip the unscaled float32 gradients to this global norm (None: no clip).
      micro_batches: split the batch into this many micro-batches and accumulate float32
        gradients under one loss scale; one overflow skips the whole window.
      mesh: data parallel over ``mesh``'s ``data_axis``: the batch is split across devices,
        float32 gradients are averaged with ``pmean``, and every device takes the same skip
        decision. Params stay replicated.
      data_axis: the mesh axis the batch is split over.
      donate: donate the input state's buffers (do not reuse the state you passed in).

    Returns:
      The step. ``metrics`` holds float32/bool/int32 scalars: ``loss`` (unscaled),
      ``grad_norm`` (unscaled, before clipping), ``loss_scale`` (used in this step),
      ``grads_finite``, ``skipped``, ``skipped_steps`` (running total), ``loss_scale_at_min``.
    """
    where = "make_train_step"
    apply_fn = _apply_fn_of(model)
    if not callable(loss_fn):
        raise TypeError(f"{where}: loss_fn must be callable, got {type(loss_fn).__name__}.")
    if tx is not None and not isinstance(tx, optax.GradientTransformation):
        raise TypeError(f"{where}: tx must be an optax.GradientTransformation, got "
                        f"{type(tx).__name__}.")
    policy = get_policy(policy)
    if clip_norm is not None and (isinstance(clip_norm, bool)
                                  or not isinstance(clip_norm, int | float)
                                  or not math.isfinite(clip_norm) or clip_norm <= 0):
        raise ValueError(f"{where}: clip_norm must be a positive finite number or None, got "
                         f"{clip_norm!r}. Example: clip_norm=1.0.")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) \
            or micro_batches < 1:
        raise ValueError(f"{where}: micro_batches must be an integer >= 1, got "
                         f"{micro_batches!r}.")
    n_shards = 1
    if mesh is not None:
        if not isinstance(mesh, Mesh):
            raise TypeError(f"{where}: mesh must be a jax.sharding.Mesh, got "
                            f"{type(mesh).__name__}.")
        if data_axis not in mesh.axis_names:
            raise ValueError(f"{where}: data_axis {data_axis!r} is not an axis of the mesh "
                             f"(axes: {mesh.axis_names}).")
        n_shards = mesh.shape[data_axis]

    # The loss is returned in float32 whatever the policy's output dtype.
    amp_loss = autocast(lambda params, batch: loss_fn(apply_fn, params, batch),
                        policy.with_output_dtype(jnp.float32), overrides=overrides)

    def scaled_loss(params, batch, loss_scale, weight):
        loss = amp_loss(params, batch).astype(jnp.float32)
        return loss_scale.scale(loss * weight), loss

    grad_fn = jax.grad(scaled_loss, has_aux=True)

    def local_grads(params, batch, loss_scale, weight=1.0):
        """Mean loss and float32 *scaled* gradients of ``weight * loss`` (micro-batched)."""
        if micro_batches == 1:
            grads, loss = grad_fn(params, batch, loss_scale, weight)
            return loss, jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        micro = jax.tree.map(
            lambda x: x.reshape(micro_batches, x.shape[0] // micro_batches, *x.shape[1:]), batch)

        def body(acc, mb):
            grads, loss = grad_fn(params, mb, loss_scale, weight / micro_batches)
            acc_grads = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc[0], grads)
            return (acc_grads, acc[1] + loss), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        (grads, loss), _ = lax.scan(body, (zeros, jnp.zeros((), jnp.float32)), micro)
        return loss / micro_batches, grads

    if mesh is not None:
        def sharded(params, batch, loss_scale):
            # Each device differentiates its share of the global mean loss, so the float16
            # backward sees the same magnitudes as one device on the whole batch would.
            loss, grads = local_grads(params, batch, loss_scale, 1.0 / n_shards)
            # float32 all-reduce: every device then sees the same grads and the same skip.
            return lax.pmean(loss, data_axis), lax.psum(grads, data_axis)

        spec = PartitionSpec(data_axis)
        compute_grads = jax.shard_map(sharded, mesh=mesh, in_specs=(PartitionSpec(), spec,
                                                                    PartitionSpec()),
                                      out_specs=(PartitionSpec(), PartitionSpec()))
    else:
        compute_grads = local_grads

    def step(state: TrainState, batch):
        check(state, batch)  # trace time: before compiling
        ls = state.loss_scale
        loss, scaled_grads = compute_grads(state.params, batch, ls)
        grads = ls.unscale(scaled_grads)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm)
        if clip_norm is not None:
            # optax.clip_by_global_norm's rule, reusing the norm taken once above (the
            # metric and the finite check share it; recomputing it costs compile time).
            factor = jnp.where(grad_norm < clip_norm, 1.0, clip_norm / grad_norm)
            grads = jax.tree.map(lambda g: g * factor.astype(g.dtype), grads)

        def apply(operand):
            params, opt_state, g = operand
            updates, new_opt_state = state.tx.update(g, opt_state, params)
            # float32 grads would promote e.g. a bfloat16 Adam moment to float32; the state
            # keeps its dtypes (and lax.cond's branches their types).
            new_opt_state = jax.tree.map(lambda new, old: new.astype(old.dtype)
                                         if hasattr(old, "dtype") else new,
                                         new_opt_state, opt_state)
            return optax.apply_updates(params, updates), new_opt_state

        def skip(operand):
            return operand[0], operand[1]

        params, opt_state = lax.cond(finite, apply, skip,
                                     (state.params, state.opt_state, grads))
        new_ls = ls.adjust(finite)
        skipped_steps = state.skipped_steps + (~finite).astype(jnp.int32)
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                                  loss_scale=new_ls, skipped_steps=skipped_steps)
        metrics = {
            "loss": loss, "grad_norm": grad_norm, "loss_scale": ls.loss_scale,
            "grads_finite": finite, "skipped": ~finite, "skipped_steps": skipped_steps,
            "loss_scale_at_min": new_ls.at_min,
        }
        return new_state, metrics

    jitted = jax.jit(step, donate_argnums=(0,) if donate else ())

    def check(state, batch):
        if tx is not None and state.tx is not tx:
            raise ValueError("step: the state was created with a different optimizer than the "
                             "one given to make_train_step; pass the same tx to both.")
        _check_float_params(state.params, "step")
        size = _batch_size(batch, "step")
        if size % (micro_batches * n_shards):
            raise ValueError(
                f"step: the batch size {size} must be divisible by micro_batches "
                f"({micro_batches}) x data-parallel devices ({n_shards}).")
        micro = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((size // (micro_batches * n_shards),)
                                           + np.shape(x)[1:], x.dtype), batch)
        _check_loss(loss_fn, apply_fn, state.params, micro, "step")

    return _Step(jitted)


def make_eval_step(model: Any, loss_fn: Callable, *, policy: str | jmp.Policy =
                   "params=float32,compute=float16,output=float32",
                   overrides: dict | None = None) -> Callable:
    """Builds a jitted ``eval_step(params, batch) -> float32 loss`` under the same policy."""
    apply_fn = _apply_fn_of(model)
    policy = get_policy(policy)
    amp_loss = autocast(lambda params, batch: loss_fn(apply_fn, params, batch),
                        policy.with_output_dtype(jnp.float32), overrides=overrides)
    return jax.jit(lambda params, batch: amp_loss(params, batch).astype(jnp.float32))
