"""The jitted AMP train step (:func:`make_train_step`) and its state (:class:`TrainState`).

A step runs the loss under :func:`jaxamp.autocast`, differentiates the scaled float32 loss
(micro-batches accumulate float32 gradients; on a mesh each device takes its share of one SPMD
program), and updates once with the state's ``jaxamp.amp(tx)`` (unscale, float32, clip, skip on
inf/nan, adjust the scale); the collections skip with it. ``loss_fn`` is
``loss_fn(apply_fn, params, batch[, rng]) -> loss`` (linen; ``apply_fn`` adds the state's
collections) or ``loss_fn(model, batch[, rng])`` (NNX); with ``has_aux=True`` it returns
``(loss, aux)``. The whole story (the state's layout, aux across micro-batches, meshes,
``axis_name=``): ``docs/api/train.rst``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
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
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxamp import nnx_frontend, policy_spec
from jaxamp._engine.compat import Tracer, jit_cache_size, mesh_context
from jaxamp.engine import autocast, check_options
from jaxamp.fp8 import FP8Matmuls, delayed_scope, push_amax
from jaxamp.loss_scale import NoOpLossScale
from jaxamp.policy import fp8_recipe, get_policy, opt_state_dtype, policy_to_str
from jaxamp.rules import DEFAULT_OP_RULES, OpRules, read_overrides
from jaxamp.sharding import check_axis_rules, state_shardings
from jaxamp.transform import (
    AmpState,
    PerShape,
    amp_transform,
    check_clip_norm,
    check_loss_scale,
    check_opt_state,
    copy_tree,
    default_loss_scale,
    skip,
)

__all__ = ["DEFAULT_POLICY", "SKIP_NONFINITE_GRADS", "SKIP_NONFINITE_LOSS", "TrainState",
           "default_loss_scale", "make_eval_step", "make_train_step", "nnx_update"]

#: The policy of a state created without ``policy=`` and of :func:`make_eval_step`.
DEFAULT_POLICY = policy_spec.DEFAULT_POLICY

#: Bits of ``metrics["skip_reason"]`` (0: applied). Non-finite gradients are an overflow (the
#: scale backs off); a non-finite loss with finite gradients skips without backing off.
SKIP_NONFINITE_GRADS = 1
SKIP_NONFINITE_LOSS = 2


def _positive_int(value: Any, name: str, where: str) -> int:
    """A Python, NumPy or (concrete) JAX integer scalar >= 1, as an int."""
    ok = not isinstance(value, bool | Tracer)
    if ok:
        arr = np.asarray(value) if not isinstance(value, int) else np.asarray(value, np.int64)
        ok = arr.ndim == 0 and np.issubdtype(arr.dtype, np.integer) and int(arr) >= 1
    if not ok:
        raise ValueError(f"{where}: {name} must be an integer >= 1, got {value!r}. "
                         f"Example: {name}=4.")
    return int(arr)


def _apply_fn_of(model: Any) -> Callable:
    if isinstance(model, nn.Module):
        return model.apply
    if nnx_frontend.is_module(model):
        return nnx_frontend.Apply(model)
    if callable(model):
        return model
    raise TypeError(f"model must be a flax.linen.Module, a flax.nnx.Module or an apply "
                    f"function, got {type(model).__name__}.")


def _nnx_loss(loss_fn: Callable) -> Callable:
    """An NNX ``loss_fn(model, batch[, rng])`` as the linen-style loss the step runs: the
    model is merged from the params (and collections) inside the traced step."""
    def loss(apply_fn, params, batch, **kw):
        return apply_fn({"params": params}, loss_fn, batch, **kw)
    return loss


def _check_float_params(params: Any, where: str) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        dtype = np.dtype(leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"{where}: params must be floating point, got {dtype} at "
                f"{jax.tree_util.keystr(path)}. Keep integer or boolean state out of params "
                "(e.g. in a separate argument or variable collection).")


def _check_rng(rng: Any, where: str) -> None:
    if rng is None:
        return
    dtype = getattr(rng, "dtype", None)
    typed = dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    raw = dtype == np.uint32 and np.shape(rng) == (2,)
    if not (typed and np.shape(rng) == ()) and not raw:
        raise TypeError(f"{where}: rng must be one PRNG key (jax.random.key(seed) or "
                        f"jax.random.PRNGKey(seed)), got {type(rng).__name__} with "
                        f"dtype={dtype}, shape={np.shape(rng)}.")


def _amp_tx(tx: optax.GradientTransformation, policy: jmp.Policy, where: str,
            **options: Any) -> optax.GradientTransformationExtraArgs:
    """``jaxamp.amp(tx, **options)`` in the policy's ``opt_state=`` dtype (state and step)."""
    return amp_transform(tx, state_dtype=opt_state_dtype(policy), where=where, **options)


def _check_not_amp(inner_state: Any, where: str) -> None:
    """An optimizer that already is ``amp(...)`` would unscale twice (updates too small)."""
    if any(isinstance(x, AmpState) for x in
           jax.tree.leaves(inner_state, is_leaf=lambda x: isinstance(x, AmpState))):
        raise TypeError(
            f"{where}: tx is (or contains) jaxamp.amp(...), but the train step applies "
            "jaxamp.amp itself: the gradients would be unscaled twice (updates loss_scale "
            "times too small). Pass the plain optimizer and give the options to the step, "
            "e.g. TrainState.create(model, params, optax.sgd(0.1), loss_scale=...) and "
            "make_train_step(model, loss_fn, clip_norm=...); jaxamp.amp is for a "
            "hand-written step.")


def _replace(self, **changes: Any):
    """``dataclasses.replace``, also taking ``loss_scale=``/``skipped_steps=`` (in opt_state)."""
    amp = {k: changes.pop(k) for k in ("loss_scale", "skipped_steps") if k in changes}
    if amp:
        changes["opt_state"] = changes.get("opt_state", self.opt_state)._replace(**amp)
    return dataclasses.replace(self, **changes)


class TrainState(train_state.TrainState):
    """``flax.training.train_state.TrainState`` plus what an AMP step needs.

    Attributes:
      opt_state: the state of ``jaxamp.amp(tx)`` (:class:`jaxamp.transform.AmpState`): the
        loss scale, ``tx``'s own state (``inner_state``), the skipped-step count, and the
        amax histories of ``fp8=delayed`` matmuls (``fp8``; the step's first call makes them).
      loss_scale: ``opt_state.loss_scale`` (read-only; ``state.replace(loss_scale=...)``).
      skipped_steps: ``opt_state.skipped_steps``, int32 count of skipped steps.
      rng: the base PRNG key, or ``None``; never changes: step ``s``, micro-batch ``m`` draws
        from ``fold_in(fold_in(fold_in(rng, s), 0), m)``, so a resumed run and a mesh draw the
        same dropout masks as one uninterrupted device.
      collections: variable collections other than ``params`` (``batch_stats``), updated on
        applied steps only.
      policy: the :class:`jmp.Policy` (static) the step runs under.
    """

    rng: Any = None
    collections: Any = struct.field(default_factory=dict)
    policy: Any = struct.field(pytree_node=False, default=None)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.replace = _replace  # flax's dataclass sets its own on every subclass

    @property
    def loss_scale(self) -> Any:
        return self.opt_state.loss_scale

    @property
    def skipped_steps(self) -> jax.Array:
        return self.opt_state.skipped_steps

    def apply_gradients(self, *, grads: Any, **kwargs: Any) -> TrainState:
        """Flax's: ``tx`` applied to ``grads`` as they are (no loss scale, no skip), on
        ``opt_state.inner_state``."""
        updates, inner = self.tx.update(grads, self.opt_state.inner_state, self.params)
        return self.replace(step=self.step + 1, params=optax.apply_updates(self.params, updates),
                            opt_state=self.opt_state._replace(inner_state=inner), **kwargs)

    @classmethod
    def create(cls, model: Any = None, params: Any = None, tx: optax.GradientTransformation
               | None = None, *, apply_fn: Callable | None = None, loss_scale: Any = None,
               policy: str | jmp.Policy | None = None, rng: Any = None,
               **kwargs) -> TrainState:
        """Creates a state: one place for the policy, the loss scale, the RNG and collections.

        Args:
          model: a flax linen Module, a flax NNX Module (``params`` may then be omitted: its
            ``nnx.Param`` values become ``params``, its other Variables the collection
            ``"nnx_state"``; :func:`nnx_update` writes them back), or an apply function.
          params: the params, or ``model.init``'s variables (other collections go to
            ``collections``); cast to the policy's ``param_dtype``.
          tx: the plain optax optimizer (the state wraps it in :func:`jaxamp.amp`).
          apply_fn: instead of ``model``.
          loss_scale: the initial loss scale; ``None``: :func:`jaxamp.default_loss_scale`.
            ``NoOpLossScale()`` with float16 compute warns (small gradients underflow).
          policy: string or :class:`jmp.Policy`; ``None`` is :data:`DEFAULT_POLICY`. Its
            ``opt_state=bfloat16`` stores the optimizer's state in bfloat16 (``inner_state`` is
            then a :class:`jaxamp.state_dtype.StoredState`).
          rng: the base PRNG key for dropout, or ``None``.
          **kwargs: other fields (``collections=``, a subclass's); a step option is refused,
            naming :func:`make_train_step`.

        Every array is copied (the step donates the state's buffers).

        Example:
          >>> import flax.linen as nn
          >>> model = nn.Dense(4)
          >>> params = model.init(jax.random.key(0), jnp.ones((1, 3)))["params"]
          >>> state = TrainState.create(model, params, optax.adam(1e-3))
          >>> type(state.loss_scale).__name__  # the default policy computes in float16
          'DynamicLossScale'
        """
        where = "TrainState.create"
        # a subclass's own fields pass through; what create sets itself does not
        _misplaced(where, kwargs, {f.name for f in dataclasses.fields(cls)}
                   - set(_STATE_OPTIONS) | {"collections"})
        if nnx_frontend.is_module(model) and params is None:
            params = nnx_frontend.Apply.variables(model)  # {"params": ..., "nnx_state": ...}
        if apply_fn is None:
            if model is None:
                raise TypeError(f"{where}: pass the model (or apply_fn=...).")
            apply_fn = _apply_fn_of(model)
        if params is None or tx is None:
            raise TypeError(f"{where}: params and tx are required, e.g. "
                            "TrainState.create(model, params, optax.adam(1e-3)) (for an NNX "
                            "model: TrainState.create(model, tx=optax.adam(1e-3))).")
        if not (hasattr(tx, "init") and hasattr(tx, "update")):
            raise TypeError(f"{where}: tx must be an optax.GradientTransformation, got "
                            f"{type(tx).__name__}.")
        collections = kwargs.pop("collections", {})
        if isinstance(params, Mapping) and "params" in params:
            # model.init's variables, as flax users pass them: params + other collections
            if collections:
                raise ValueError(f"{where}: pass the collections once: either inside the "
                                 "variables dict or as collections=, not both.")
            collections = {k: v for k, v in params.items() if k != "params"}
            params = params["params"]
        _check_float_params(params, where)
        _check_rng(rng, where)
        policy = get_policy(DEFAULT_POLICY if policy is None else policy)
        params = copy_tree(policy.cast_to_param(params))
        if loss_scale is None:
            loss_scale = default_loss_scale(policy)
        check_loss_scale(loss_scale, where)
        if isinstance(loss_scale, NoOpLossScale) and \
                policy_spec.loss_scaling(np.dtype(policy.compute_dtype).name) == "dynamic":
            warnings.warn(
                f"{where}: the policy computes in float16 ({policy_to_str(policy)}) but "
                "loss_scale=NoOpLossScale(): float16 gradients below ~6e-8 underflow to zero. "
                "Omit loss_scale= for dynamic scaling (or pass jaxamp.DynamicLossScale()).",
                UserWarning, stacklevel=2)
        opt_state = _amp_tx(tx, policy, where, loss_scale=loss_scale).init(params)
        _check_not_amp(opt_state.inner_state, where)
        return cls(step=jnp.zeros((), jnp.int32), apply_fn=apply_fn, params=params, tx=tx,
                   opt_state=opt_state, rng=copy_tree(rng),
                   collections=copy_tree(dict(collections)), policy=policy, **kwargs)


TrainState.replace = _replace  # TrainState's own (flax set it)


def _batch_size(batch: Any, where: str) -> int:
    sizes, shapes = {}, {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        shape = np.shape(leaf)
        if not shape:
            raise ValueError(f"{where}: every batch leaf needs a leading batch axis; "
                             f"{jax.tree_util.keystr(path)} is a scalar.")
        sizes[jax.tree_util.keystr(path)] = shape[0]
        shapes[jax.tree_util.keystr(path)] = shape
    if not sizes:
        raise ValueError(f"{where}: the batch has no array leaves.")
    if len(set(sizes.values())) > 1:
        listing = ", ".join(f"{k}: {v}" for k, v in sizes.items())
        raise ValueError(f"{where}: batch leaves disagree on the batch size ({listing}). Every "
                         "leaf must have the same leading dimension.")
    size = next(iter(sizes.values()))
    if size == 0:
        first = next(iter(shapes))
        raise ValueError(
            f"{where}: the batch has 0 rows (batch{first} has shape {tuple(shapes[first])}); a "
            "train step needs at least one example: the mean loss over none is NaN, and the "
            "step would be skipped. Leave empty batches out of the loop (e.g. drop a last, "
            "empty batch).")
    return size


@dataclasses.dataclass(frozen=True)
class StepProgram:
    """What a train step runs for one state and batch (:meth:`TrainStep.program`, from the
    step's own internals), for the diagnostics to trace or run.

    Attributes:
      loss: ``loss(params) -> float32 scalar``: the step's loss on ``batch`` with the state's
        collections and micro-batch 0's dropout key; run it under :func:`jaxamp.autocast`
        with ``policy``/``overrides``/``op_rules``/``f32_weight_grads``.
      params, opt_state: the state's (``loss_scale``: ``opt_state``'s).
      policy: the policy the step runs (the state's, output float32).
      context: ``context()`` enters what the step traces under (its mesh and axis rules).
      fp8_scope: ``fp8_scope()`` is the context an autocast of ``loss`` runs in, in the trace
        that evaluates it: the ``fp8=delayed`` scope with the state's amax histories (a
        calibration scope when it has none), else nothing.
    """

    loss: Callable
    params: Any
    opt_state: Any
    policy: jmp.Policy
    overrides: Any
    op_rules: OpRules
    f32_weight_grads: bool | None
    context: Callable
    fp8_scope: Callable = contextlib.nullcontext

    @property
    def loss_scale(self) -> Any:
        return self.opt_state.loss_scale


class TrainStep:
    """The step :func:`make_train_step` returns: ``step(state, batch) -> (state, metrics)``,
    jitted; its checks run while it is traced (once per input signature, before compiling).

    With a mesh the state is placed on its shardings (:func:`jaxamp.sharding.state_shardings`)
    on every call (a no-op once there) and the step compiled with them as output shardings;
    tracing runs under the mesh and ``axis_rules``. :meth:`program` gives the diagnostics
    (``fn(step, state, batch)``) what the step runs.

    ``metrics`` holds float32/bool/int32 scalars: ``loss`` (unscaled), ``grad_norm``
    (unscaled, before clipping), ``loss_scale`` (used in this step), ``grads_finite``,
    ``loss_finite``, ``skipped`` (not finite gradients and loss), ``skip_reason`` (int32 bits,
    0 when applied: :data:`SKIP_NONFINITE_GRADS`, :data:`SKIP_NONFINITE_LOSS`),
    ``skipped_steps`` (running total), ``loss_scale_at_min``, and ``aux`` with
    ``has_aux=True``. On a skipped step params, ``opt_state.inner_state`` and collections come
    back bit-identical; the loss scale backs off on non-finite gradients only.
    """

    def __init__(self, step, donate: bool, mesh: Mesh | None = None, axis_rules=None,
                 program=None, calibrate=None):
        self._step = step
        self._calibrate = calibrate  # (uses_delayed(state), calibrate(state, batch)) or None
        self._calibrate_jit = None if calibrate is None else jax.jit(calibrate[1])
        self._delayed: dict = {}  # policy -> whether its step has delayed FP8 matmuls
        self._donate = donate
        self._mesh = mesh
        self._axis_rules = axis_rules
        self._program = program
        self._plain = None
        self._by_sharding: dict = {}

    @property
    def traceable(self) -> Callable:
        """The step as a plain (un-jitted) function of ``(state, batch)``, for tracing."""
        return self._step

    def program(self, state: TrainState, batch: Any) -> StepProgram:
        """The loss this step differentiates for ``state`` and ``batch``, with its options
        (see :class:`StepProgram`); checks ``state`` as a call does."""
        self._check(state)
        return self._program(state, batch, self._context)

    def _check(self, state):
        if not isinstance(state, TrainState):  # jit would fail on it with a pytree error
            raise TypeError(f"step: state must be a jaxamp.TrainState, got "
                            f"{type(state).__name__}. Create it with jaxamp.TrainState.create.")
        if self._donate and any(isinstance(x, jax.Array) and not isinstance(x, Tracer)
                                and x.is_deleted()
                                for x in jax.tree.leaves(state)):
            raise ValueError("step: this state's buffers were donated to an earlier step call "
                             "(donate=True): use the state that call returned, or build the "
                             "step with donate=False to keep the old one.")

    def _prepare(self, state):
        """-> (jitted, state on its shardings)."""
        donate = (0,) if self._donate else ()
        if self._mesh is None:
            if self._plain is None:
                self._plain = jax.jit(self._step, donate_argnums=donate)
            return self._plain, state
        shardings = state_shardings(state, self._mesh, axis_rules=self._axis_rules,
                                    where="step")
        leaves, treedef = jax.tree.flatten(shardings)
        key = (treedef, tuple(leaves))
        if key not in self._by_sharding:
            self._by_sharding[key] = jax.jit(
                functools.partial(self._step, shardings=shardings), donate_argnums=donate,
                out_shardings=(shardings, None))
        state = jax.tree.map(lambda x, s: x if getattr(x, "sharding", None) == s
                             else jax.device_put(x, s), state, shardings)
        return self._by_sharding[key], state

    def _context(self):
        return _tracing_context(self._mesh, self._axis_rules)

    def __call__(self, state, batch):
        """One step; a state without the amax histories its ``fp8=delayed`` matmuls need gets
        them first (:meth:`calibrate`)."""
        return self._run(self.calibrate(state, batch), batch,
                         lambda jitted, *a: jitted(*a))

    def calibrate(self, state: TrainState, batch: Any) -> TrainState:
        """``state`` with the amax histories of its ``fp8=delayed`` matmuls
        (``opt_state.fp8``), made from one pass over ``batch`` with current scaling, when the
        policy asks for them and the state has none; else ``state`` as it is. The first call
        does it; ``jax.eval_shape(step.calibrate, state, batch)`` gives a checkpoint's target."""
        if not self._lacks_histories(state):
            return state
        self._check(state)
        if self._mesh is not None:
            state = self._prepare(state)[1]
        with self._context(), _platform_of(self._mesh, state):
            fp8 = self._calibrate_jit(state, batch)
        if not fp8:  # no FP8 matmul of the step's top level: nothing to keep, ask no more
            self._delayed[state.policy] = False
            return state
        return state.replace(opt_state=state.opt_state._replace(fp8=fp8))

    def _lacks_histories(self, state) -> bool:
        """Whether ``state`` is a train state without amax histories whose policy asks for
        ``fp8=delayed`` (it may still have no delayed matmul at the step's top level)."""
        return self._calibrate is not None and isinstance(state, TrainState) \
            and isinstance(state.opt_state, AmpState) and not state.opt_state.fp8 \
            and self._asks_delayed(state)

    def _asks_delayed(self, state) -> bool:
        """Whether the policy (or an override) asks for ``fp8=delayed``, read once per policy."""
        if state.policy not in self._delayed:
            self._delayed[state.policy] = self._calibrate[0](state)
        return self._delayed[state.policy]

    def lower(self, state, batch):
        """The step lowered for ``state``'s shapes, which must already hold any amax
        histories the policy needs: a program lowered without them would run every
        ``fp8=delayed`` matmul with current scaling, silently."""
        if self._lacks_histories(state) \
                and jax.eval_shape(self.calibrate, state, batch).opt_state.fp8:
            raise ValueError(
                f"step.lower: the policy {state.policy!r} asks for fp8=delayed, and the state "
                "holds no amax histories yet (a call of the step makes them first; lower does "
                "not). Lower the calibrated state: state = step.calibrate(state, batch), or, "
                "for its shapes only, jax.eval_shape(step.calibrate, state, batch).")
        return self._run(state, batch, lambda jitted, *a: jitted.lower(*a))

    def _run(self, state, batch, how):
        self._check(state)
        jitted, state = self._prepare(state)
        with self._context(), _platform_of(self._mesh, state):
            try:
                return how(jitted, state, batch)
            except NameError as e:  # raised while tracing, before anything is compiled
                if "unbound axis name" not in str(e):
                    raise
                raise ValueError(
                    f"step: the model uses a named axis ({e}), as a model written for jax.pmap "
                    f"does (nn.BatchNorm(axis_name='batch')). The step is one jax.jit over the "
                    f"global batch (sharded over the mesh when mesh= is given): pass the name "
                    f"to it, make_train_step(..., axis_name='batch'), and the model's "
                    f"collectives run over the global batch, as a pmean over the pmap axis "
                    f"did (or build the model with axis_name=None).") from e

    def _cache_size(self) -> int:
        jitted = [self._plain] if self._plain is not None else []
        return sum(jit_cache_size(j) for j in jitted + list(self._by_sharding.values()))


def _platform_of(mesh, state):
    """``jax.default_device`` set to the step's device where its platform is not the default
    backend's (compile-only GPU devices, ``jaxamp.gpu_program``): autocast decides by the
    platform it traces for, and JAX keys its trace caches on the default device."""
    device = mesh.devices.flat[0] if mesh is not None else None
    if device is None:  # the step counter: one leaf, not a flatten of the state per call
        leaf = state.step
        sharding = None if isinstance(leaf, Tracer) else getattr(leaf, "sharding", None)
        device = next(iter(sharding.device_set), None) if sharding is not None else None
    if device is None or device.platform == jax.default_backend():
        return contextlib.nullcontext()
    return jax.default_device(device)


def _tracing_context(mesh, axis_rules):
    stack = contextlib.ExitStack()
    if mesh is not None:
        stack.enter_context(mesh_context(mesh))
    if axis_rules is not None:
        stack.enter_context(nn.logical_axis_rules(axis_rules))
    return stack


def _takes_rng(loss_fn: Callable) -> tuple[bool, bool]:
    """(whether loss_fn has an ``rng`` parameter, whether it is required)."""
    try:
        param = inspect.signature(loss_fn).parameters.get("rng")
    except (TypeError, ValueError):  # builtins without a signature
        return False, False
    if param is None:
        return False, False
    return True, param.default is inspect.Parameter.empty


#: What the state holds (given to TrainState.create) and what the step adds (make_train_step).
_STATE_OPTIONS = ("params", "tx", "apply_fn", "loss_scale", "policy", "rng", "collections",
                  "opt_state", "step", "skipped_steps")
_STEP_OPTIONS = ("loss_fn", "overrides", "clip_norm", "micro_batches", "mesh", "data_axis",
                 "axis_rules", "donate", "has_aux", "mutable", "op_rules", "f32_weight_grads",
                 "axis_name")


def _misplaced(where: str, kwargs: Mapping[str, Any], allowed: set[str]) -> None:
    """Refuses keyword arguments ``where`` does not take, saying where each belongs."""
    for name in kwargs:
        if name in allowed:
            continue
        if name in ("opt_state", "step", "skipped_steps"):
            home = (f"TrainState.create sets {name} itself (opt_state from tx.init); set it "
                    f"afterwards with state.replace({name}=...).")
        elif name in _STEP_OPTIONS and where != "make_train_step":
            home = (f"{name} belongs to make_train_step: the step decides how to run, the "
                    f"state what it holds. Use jaxamp.make_train_step(model, loss_fn, "
                    f"{name}=...).")
        elif name in _STATE_OPTIONS and where != "TrainState.create":
            home = (f"{name} belongs to TrainState.create: the state is the one source of "
                    f"truth for the params, policy, loss scale, RNG and collections. Use "
                    f"jaxamp.TrainState.create(model, variables, tx, {name}=...).")
        else:
            takes = _STEP_OPTIONS if where == "make_train_step" else (
                "model", "params", "tx", "apply_fn", "loss_scale", "policy", "rng",
                "collections", *sorted(allowed - {"collections"}))
            home = f"{where} takes {', '.join(takes)}."
        raise TypeError(f"{where}: unexpected keyword argument {name!r}. {home}")


def _step_key(state: TrainState) -> jax.Array:
    """The key of step ``state.step`` ("device 0": one stream for the global batch); micro-batch
    ``m`` uses ``fold_in(key, m)``."""
    return jax.random.fold_in(jax.random.fold_in(state.rng, state.step), 0)


def _spec(x):
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype) if hasattr(x, "dtype") else x


def _floating_scalar(out) -> bool:
    return isinstance(out, jax.ShapeDtypeStruct) and out.shape == () \
        and jnp.issubdtype(out.dtype, jnp.floating)


def _describe(out) -> str:
    return (f"shape={out.shape}, dtype={out.dtype}" if isinstance(out, jax.ShapeDtypeStruct)
            else f"a {type(out).__name__}")


def _check_loss_out(out, has_aux: bool, where: str) -> None:
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ValueError(f"{where}: with has_aux=True loss_fn must return (loss, aux), got "
                             f"{_describe(out)}.")
        if not _floating_scalar(out[0]):
            raise ValueError(f"{where}: loss_fn must return (loss, aux) with a floating scalar "
                             f"loss, got loss {_describe(out[0])}.")
        return
    if isinstance(out, tuple) and len(out) == 2 and _floating_scalar(out[0]):
        raise ValueError(f"{where}: loss_fn returned a pair (loss, aux); build the step with "
                         "make_train_step(..., has_aux=True) to get aux in the metrics.")
    if not _floating_scalar(out):
        raise ValueError(f"{where}: loss_fn must return a floating scalar, got "
                         f"{_describe(out)}. Reduce the per-example losses (e.g. with jnp.mean) "
                         "and return only the loss (or (loss, aux) with has_aux=True).")


def _check_loss_is_array(loss, where: str) -> None:
    """A Python or NumPy number is a constant: no gradient reaches the params through it."""
    if not isinstance(loss, jax.Array) and isinstance(loss, (int, float, np.generic,
                                                              np.ndarray)):
        raise TypeError(
            f"{where}: loss_fn returned a {type(loss).__name__} ({loss!r}), a constant: the "
            "loss must be a JAX scalar computed from the params, or its gradient is zero. "
            "Return the jnp value itself (no float(...), .item() or np.asarray(...)), e.g. "
            "return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels)).")


def _mutable_names(mutable, collections, where: str) -> tuple[str, ...]:
    if mutable is None:
        return tuple(collections)
    missing = [m for m in mutable if m not in collections]
    if missing:
        raise ValueError(f"{where}: mutable={list(mutable)} names collections the state does "
                         f"not hold: {missing} (the state holds {sorted(collections)}). Create "
                         "the state from model.init's variables: TrainState.create(model, "
                         "variables, tx).")
    return tuple(mutable)


class _BoundApply:
    """The ``apply_fn`` a loss_fn gets when the state holds collections: it adds them to the
    variables and ``mutable=`` to the call, keeps the updates and returns only the output."""

    def __init__(self, apply_fn, collections, mutable):
        self.apply_fn, self.collections, self.mutable = apply_fn, collections, mutable
        self.updates = {}

    def __call__(self, variables, *args, **kwargs):
        variables = {**self.collections, **variables}
        if not self.mutable or "mutable" in kwargs:
            return self.apply_fn(variables, *args, **kwargs)
        out, updates = self.apply_fn(variables, *args, mutable=list(self.mutable), **kwargs)
        self.updates = dict(updates)
        return out


def _reduce_aux(stacked, size: int, strided: bool = False):
    """Micro-batch outputs ``[M, ...]`` -> one value per leaf; see ``make_train_step``. A leaf
    whose leading axis (after ``M``) is the micro-batch ``size`` is per-example."""
    def leaf(x):
        if x.ndim >= 2 and x.shape[1] == size:  # per-example: back in batch order
            if strided:  # micro-batch m held rows m, m + M, m + 2M, ...
                x = jnp.swapaxes(x, 0, 1)
            return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
        if jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.mean(x, axis=0)
        return jnp.sum(x.astype(jnp.int32), axis=0)
    return jax.tree.map(leaf, stacked)


def make_train_step(model: Any = None, loss_fn: Callable | None = None,
                    tx: optax.GradientTransformation | None = None, *,
                    policy: str | jmp.Policy | None = None, overrides: dict | None = None,
                    clip_norm: float | jax.Array | None = None, micro_batches: int = 1,
                    mesh: Mesh | None = None, data_axis: str = "data",
                    axis_rules: Sequence[tuple[str, Any]] | None = None, donate: bool = True,
                    has_aux: bool = False, mutable: Sequence[str] | None = None,
                    op_rules: OpRules = DEFAULT_OP_RULES,
                    f32_weight_grads: bool | None = None, axis_name: str | None = None,
                    **misplaced: Any) -> TrainStep:
    """Builds ``step(state, batch) -> (state, metrics)``, compiled once with ``jax.jit``.

    The state (:meth:`TrainState.create`) holds the policy, the loss scale, the optimizer, the
    RNG and the collections; the step adds how to run. :class:`TrainStep` lists the metrics;
    ``docs/api/train.rst`` says what a step does and how a mesh runs it.

    Args:
      model: a flax linen Module, a flax NNX Module, or an apply function; optional (the
        state's ``apply_fn``).
      loss_fn: linen: ``loss_fn(apply_fn, params, batch[, rng]) -> loss``; NNX:
        ``loss_fn(model, batch[, rng])``. The whole loss runs under the policy.
      tx, policy: optional; if given, the state's.
      overrides: per-module rules for :func:`jaxamp.autocast`.
      clip_norm: clip the unscaled float32 gradients to this global norm (None: no clip).
      micro_batches: accumulate float32 gradients over this many micro-batches under one
        loss scale; one overflow skips the whole window.
      mesh: run on this :class:`jax.sharding.Mesh`, the batch split over ``data_axis``, the
        state kept on its shardings (data, FSDP and tensor parallel alike).
      data_axis: the mesh axis the batch is split over.
      axis_rules: Flax logical axis rules (as for ``nn.logical_axis_rules``); only with mesh.
      donate: donate the input state's buffers (a donated state is refused afterwards).
      has_aux: ``loss_fn`` returns ``(loss, aux)``; aux goes to ``metrics["aux"]``.
      mutable: the collections the step updates (default: all of the state's).
      op_rules, f32_weight_grads: as for :func:`jaxamp.autocast`.
      axis_name: the axis a model written for ``jax.pmap`` reduces over (bound to one member
        holding the whole global batch).
      **misplaced: refused, naming where each belongs (:meth:`TrainState.create`).
    """
    _misplaced("make_train_step", misplaced, set())
    opts = _StepOptions(
        apply_fn=None if model is None else _apply_fn_of(model), loss_fn=loss_fn, tx=tx,
        policy=policy, overrides=overrides, clip_norm=clip_norm, micro_batches=micro_batches,
        mesh=mesh, data_axis=data_axis, axis_rules=axis_rules, has_aux=has_aux,
        mutable=mutable, op_rules=op_rules, f32_weight_grads=f32_weight_grads,
        axis_name=axis_name)
    return TrainStep(functools.partial(_train_step, opts), donate, opts.mesh, opts.axis_rules,
                     functools.partial(_step_program, opts),
                     (functools.partial(_uses_delayed, opts), functools.partial(_calibrate, opts)))


@dataclasses.dataclass(frozen=True, eq=False)
class _StepOptions:
    """:func:`make_train_step`'s options, checked eagerly (before any state is seen): how the
    step runs (the state holds the rest). ``policy``/``apply_fn``: ``None`` for the state's."""

    apply_fn: Callable | None
    loss_fn: Callable
    tx: optax.GradientTransformation | None
    policy: jmp.Policy | None
    overrides: dict | None
    clip_norm: float | jax.Array | None
    micro_batches: int
    mesh: Mesh | None
    data_axis: str
    axis_rules: Any
    has_aux: bool
    mutable: tuple[str, ...] | None
    op_rules: OpRules
    f32_weight_grads: bool | None
    axis_name: str | None
    n_shards: int = 1

    def __post_init__(self):
        where, put = "make_train_step", functools.partial(object.__setattr__, self)
        if self.axis_name is not None and not isinstance(self.axis_name, str):
            raise TypeError(f"{where}: axis_name must be the name (a str) of the axis the "
                            "model's collectives reduce over, as given to jax.pmap, got "
                            f"{self.axis_name!r}. Example: make_train_step(model, loss_fn, "
                            "axis_name='batch').")
        if not callable(self.loss_fn):
            raise TypeError(f"{where}: loss_fn must be callable, got "
                            f"{type(self.loss_fn).__name__}. Example: make_train_step(model, "
                            "loss_fn).")
        if self.tx is not None and not isinstance(self.tx, optax.GradientTransformation):
            raise TypeError(f"{where}: tx must be an optax.GradientTransformation, got "
                            f"{type(self.tx).__name__}.")
        put("policy", None if self.policy is None else get_policy(self.policy))
        put("overrides", read_overrides(self.overrides))  # parsed once, not at every trace
        check_options(where, self.op_rules, self.f32_weight_grads)
        put("clip_norm", check_clip_norm(self.clip_norm, where))
        put("micro_batches", _positive_int(self.micro_batches, "micro_batches", where))
        if not isinstance(self.has_aux, bool):
            raise TypeError(f"{where}: has_aux must be True or False, got {self.has_aux!r}.")
        put("mutable", _check_mutable(self.mutable, where))
        n_shards, axis_rules = _check_mesh(self.mesh, self.data_axis, self.axis_rules, where)
        put("n_shards", n_shards)
        put("axis_rules", axis_rules)
        if n_shards > 1:
            put("op_rules", _fp8_per_shard(self.op_rules, n_shards))


def _check_mutable(mutable: Any, where: str) -> tuple[str, ...] | None:
    if mutable is None:
        return None
    if isinstance(mutable, str):
        mutable = (mutable,)
    if not all(isinstance(m, str) for m in mutable):
        raise TypeError(f"{where}: mutable must be a list of collection names such as "
                        f"['batch_stats'], got {mutable!r}.")
    return tuple(mutable)


def _check_mesh(mesh: Any, data_axis: str, axis_rules: Any, where: str) -> tuple[int, Any]:
    """-> (devices along the data axis, the checked axis rules)."""
    n_shards = 1
    if mesh is not None:
        if not isinstance(mesh, Mesh):
            raise TypeError(f"{where}: mesh must be a jax.sharding.Mesh, got "
                            f"{type(mesh).__name__}.")
        if data_axis not in mesh.axis_names:
            raise ValueError(f"{where}: data_axis {data_axis!r} is not an axis of the mesh "
                             f"(axes: {tuple(mesh.axis_names)}). Pass data_axis= one of them.")
        n_shards = mesh.shape[data_axis]
    axis_rules = check_axis_rules(axis_rules, where)
    if axis_rules is not None and mesh is None:
        raise ValueError(f"{where}: axis_rules= maps logical axes to the axes of a mesh; pass "
                         "mesh= too (e.g. mesh=jax.sharding.Mesh(devices, ('data', "
                         "'model'))).")
    return n_shards, axis_rules


@dataclasses.dataclass(frozen=True, eq=False)
class _StepLoss:
    """The loss the step differentiates, as the state decides it (its apply_fn, collections
    and rng): ``loss(params, collections, batch, rng) -> (loss, aux, new collections)``, the
    function autocast runs."""

    apply_fn: Callable
    loss_fn: Callable  # linen-style: loss_fn(apply_fn, params, batch[, rng=])
    mutable: tuple[str, ...]
    use_rng: bool
    has_aux: bool
    axis_name: str | None

    def __call__(self, params, collections, batch, rng):
        if self.axis_name is None:
            return self._run(params, collections, batch, rng)
        # A model written for pmap: its collectives reduce over a one-member axis of that
        # name whose member is the whole batch (a pmean over it is the identity).
        run = functools.partial(self._run, params, collections, batch, rng)
        outs = jax.vmap(run, in_axes=(), axis_size=1, axis_name=self.axis_name)()
        return jax.tree.map(lambda x: x[0], outs)

    def _run(self, params, collections, batch, rng):
        bound = _BoundApply(self.apply_fn, collections, self.mutable) if collections \
            else self.apply_fn
        out = self.loss_fn(bound, params, batch, **({"rng": rng} if self.use_rng else {}))
        # checked while the step is traced (the loss is traced once), before compiling
        paired = self.has_aux and isinstance(out, tuple) and len(out) == 2
        _check_loss_is_array(out[0] if paired else out, "step")
        _check_loss_out(jax.tree.map(_spec, out), self.has_aux, "step")
        loss, aux = out if self.has_aux else (out, None)
        updates = bound.updates if collections else {}
        return loss, aux, {**collections, **updates}


def _step_policy(opts: _StepOptions, state: TrainState) -> jmp.Policy:
    """The policy the step runs: its own, else the state's, else the default."""
    return opts.policy or state.policy or get_policy(DEFAULT_POLICY)


def _state_loss(opts: _StepOptions, state: TrainState) -> tuple[jmp.Policy, _StepLoss]:
    """Trace-time: what the state decides (policy, apply_fn, collections, rng)."""
    if opts.policy is not None and state.policy is not None and opts.policy != state.policy:
        raise ValueError(
            f"step: make_train_step(policy={policy_to_str(opts.policy)!r}) but the state "
            f"was created with policy={policy_to_str(state.policy)!r} (and a loss scale "
            f"for it). Give the policy once, to TrainState.create(..., policy=...); "
            "make_train_step then uses the state's.")
    policy = _step_policy(opts, state)
    apply_fn = opts.apply_fn or state.apply_fn
    nnx = isinstance(apply_fn, nnx_frontend.Apply)
    wants_rng, needs_rng = _takes_rng(opts.loss_fn)
    if needs_rng and state.rng is None:
        raise ValueError("step: loss_fn takes an rng but the state has none. Create the "
                         "state with TrainState.create(..., rng=jax.random.key(0)) (or "
                         "give loss_fn's rng a default, rng=None).")
    return policy, _StepLoss(
        apply_fn, _nnx_loss(opts.loss_fn) if nnx else opts.loss_fn,
        _mutable_names(opts.mutable, state.collections, "step"),
        wants_rng and (state.rng is not None or needs_rng), opts.has_aux, opts.axis_name)


def _train_step(opts: _StepOptions, state: TrainState, batch: Any, shardings: Any = None):
    """The step :func:`make_train_step` jits: loss and scaled grads, then the update."""
    policy, loss_of = _state_loss(opts, state)
    tx = _amp_tx(state.tx, policy, "step", loss_scale=getattr(state.opt_state, "loss_scale",
                                                                None),
                 clip_norm=opts.clip_norm, group_vectors=opts.mesh is None)
    _check_step(opts, state, batch, tx)  # trace time: before compiling
    grad_fn = _grad_fn(_amp_loss(opts, policy, loss_of), state, calibrate=False)
    key = _step_key(state) if loss_of.use_rng else None
    loss, aux, new_coll, scaled_grads, amaxes = _gradients(
        opts, grad_fn, state, _on_data_axis(opts, batch), key, shardings,
        state.opt_state.fp8)
    new_state, metrics = _update(tx, state, loss, new_coll, scaled_grads, amaxes)
    if opts.has_aux:
        metrics["aux"] = aux
    return new_state, metrics


def _amp_loss(opts: _StepOptions, policy, loss_of: _StepLoss) -> Callable:
    return autocast(loss_of, policy.with_output_dtype(jnp.float32), overrides=opts.overrides,
                    op_rules=opts.op_rules, f32_weight_grads=opts.f32_weight_grads)


def _grad_fn(amp_loss, state: TrainState, *, calibrate: bool) -> Callable:
    """The gradient of the scaled loss w.r.t. (params, FP8 histories) (:func:`_scaled_loss`)."""
    return jax.grad(functools.partial(_scaled_loss, amp_loss, state.collections, calibrate),
                    argnums=(0, 1), has_aux=True)


def _on_data_axis(opts: _StepOptions, batch: Any) -> Any:
    """On a mesh: the batch split over the data axis, whatever it arrived as."""
    if opts.mesh is None:
        return batch
    return jax.tree.map(lambda x: lax.with_sharding_constraint(
        x, NamedSharding(opts.mesh, PartitionSpec(opts.data_axis))), batch)


def _scaled_loss(amp_loss, collections0, calibrate, params, fp8, collections, batch, loss_scale,
                 weight, rng):
    """-> (scaled weighted float32 loss, (loss, aux, new collections in their old dtypes)).
    ``fp8``: the ``fp8=delayed`` histories (:func:`jaxamp.fp8.delayed_scope`): their gradients
    are this pass's amaxes; ``calibrate``: the first pass, current scaling."""
    with delayed_scope(fp8, calibrate=calibrate) if fp8 or calibrate \
            else contextlib.nullcontext():
        loss, aux, new_coll = amp_loss(params, collections, batch, rng)
    loss = loss.astype(jnp.float32)
    new_coll = jax.tree.map(lambda n, o: n.astype(o.dtype), new_coll, collections0)
    return loss_scale.scale(loss * weight), (loss, aux, new_coll)


def _gradients(opts: _StepOptions, grad_fn, state: TrainState, batch, key, shardings, fp8):
    """Mean loss, aux, new collections, float32 *scaled* grads of the loss and the amaxes of
    the ``fp8`` histories' matmuls (site -> ``f32[3]``): at once, or over micro-batches
    (collections threaded through them in order; grads summed, amaxes their maximum)."""
    params, loss_scale = state.params, state.loss_scale
    if opts.micro_batches == 1:
        k = None if key is None else jax.random.fold_in(key, 0)
        (grads, amaxes), (loss, aux, coll) = grad_fn(params, fp8, state.collections, batch,
                                                     loss_scale, 1.0, k)
        return (loss, aux, coll, jax.tree.map(lambda g: g.astype(jnp.float32), grads),
                _newest(amaxes))
    micro = jax.tree.map(functools.partial(_split_micro, opts), batch)
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    if shardings is not None:  # the f32 accumulator sharded like the params
        zeros = jax.tree.map(lax.with_sharding_constraint, zeros, shardings.params)
    body = functools.partial(_micro_step, grad_fn, params, fp8, loss_scale, key,
                             1.0 / opts.micro_batches)
    carry0 = (zeros, {k: jnp.zeros((3,), jnp.float32) for k in fp8},
              jnp.zeros((), jnp.float32), state.collections)
    (grads, amaxes, loss, coll), auxs = lax.scan(body, carry0,
                                                 (micro, jnp.arange(opts.micro_batches)))
    aux = None if auxs is None else _reduce_aux(
        auxs, _micro_size(opts, batch), strided=opts.mesh is not None)
    return loss / opts.micro_batches, aux, coll, grads, amaxes


def _newest(history_grads: dict) -> dict:
    """site -> ``f32[3]``: the amaxes a pass wrote into column 0 of its histories' gradients."""
    return {k: g[:, 0] for k, g in history_grads.items()}


def _micro_step(grad_fn, params, fp8, loss_scale, key, weight, carry, xs):
    """One micro-batch: its float32 grads added to the accumulator, its amaxes maxed into
    theirs (an amax is of one tensor, not a sum: the scan's body)."""
    acc, amax_acc, loss_acc, coll = carry
    mb, i = xs
    k = None if key is None else jax.random.fold_in(key, i)
    (grads, amaxes), (loss, aux, coll) = grad_fn(params, fp8, coll, mb, loss_scale, weight, k)
    acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)
    amax_acc = {k: jnp.maximum(a, amaxes[k][:, 0]) for k, a in amax_acc.items()}
    return (acc, amax_acc, loss_acc + loss, coll), aux


def _split_micro(opts: _StepOptions, x: jax.Array) -> jax.Array:
    """``[B, ...]`` -> ``[M, B / M, ...]``."""
    m = opts.micro_batches
    if opts.mesh is None:  # contiguous micro-batches
        return x.reshape(m, x.shape[0] // m, *x.shape[1:])
    # Strided: micro-batch m takes rows m, m + M, ...: every device holds an equal share of
    # every micro-batch, so all devices work on each one (no resharding).
    x = jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)
    return lax.with_sharding_constraint(
        x, NamedSharding(opts.mesh, PartitionSpec(None, opts.data_axis)))


def _update(tx, state: TrainState, loss, new_coll, scaled_grads, amaxes
            ) -> tuple[TrainState, dict]:
    """``tx`` (the state's ``jaxamp.amp``) updates once; the collections and the FP8 amax
    histories (``amaxes`` pushed in) skip with the same :func:`jaxamp.transform.skip`."""
    loss_finite = jnp.isfinite(loss)
    updates, out = tx.update(scaled_grads, state.opt_state, state.params,
                             loss_finite=loss_finite)
    grads_finite = out.grads_finite
    applied = grads_finite & loss_finite
    old = state.opt_state.fp8
    fp8 = skip(PerShape(applied), {k: push_amax(h, amaxes[k]) for k, h in old.items()}, old)
    new_state = state.replace(
        step=state.step + 1, params=optax.apply_updates(state.params, updates),
        opt_state=out._replace(fp8=fp8) if old else out,
        collections=skip(PerShape(applied), new_coll, state.collections))
    metrics = {
        "loss": loss, "grad_norm": out.grad_norm, "loss_scale": state.loss_scale.loss_scale,
        "grads_finite": grads_finite, "loss_finite": loss_finite, "skipped": ~applied,
        "skip_reason": ((~grads_finite).astype(jnp.int32) * SKIP_NONFINITE_GRADS
                        + (~loss_finite).astype(jnp.int32) * SKIP_NONFINITE_LOSS),
        "skipped_steps": out.skipped_steps, "loss_scale_at_min": out.loss_scale.at_min,
    }
    return new_state, metrics


def _calibrate(opts: _StepOptions, state: TrainState, batch: Any) -> dict:
    """The ``fp8=delayed`` histories of a state that has none (site -> ``f32[3, L]``): the
    sites from a forward trace, their first amaxes from one pass over ``batch`` with current
    scaling (column 0; the rest zeros). A zero history would scale the first step by 1: E5M2
    flushes gradients below 1.5e-5 to zero, E4M3 clips activations beyond 448."""
    policy, loss_of = _state_loss(opts, state)
    key = _step_key(state) if loss_of.use_rng else None
    batch = _on_data_axis(opts, batch)
    amp_loss = _amp_loss(opts, policy, loss_of)
    found: dict[str, int] = {}

    def discover(params):  # the scope opens inside the trace: its matmuls at its top level
        with delayed_scope({}, calibrate=True) as scope:
            loss = amp_loss(params, state.collections, batch, None if key is None
                            else jax.random.fold_in(key, 0))[0]
        found.update(scope.found)
        return loss

    jax.eval_shape(discover, state.params)
    probes = {site: jnp.zeros((3, 1), jnp.float32) for site in found}
    grad_fn = _grad_fn(amp_loss, state, calibrate=True)
    *_, amaxes = _gradients(opts, grad_fn, state, batch, key, None, probes)
    return {site: jnp.zeros((3, n), jnp.float32).at[:, 0].set(amaxes[site])
            for site, n in found.items()}


def _uses_delayed(opts: _StepOptions, state: TrainState) -> bool:
    """Whether the step's policy or an override asks for ``fp8=delayed`` (read, not traced)."""
    given = [_step_policy(opts, state), *(opts.overrides or {}).values()]
    return any((p.fp8 if isinstance(p, policy_spec.PolicySpec) else fp8_recipe(p))
               == "delayed" for p in given)  # override strings are read by the builder


def _step_program(opts: _StepOptions, state: TrainState, batch: Any, context) -> StepProgram:
    """The step's loss for the diagnostics (:class:`StepProgram`): built as the step builds
    it, with micro-batch 0's dropout key."""
    policy, loss_of = _state_loss(opts, state)
    key = jax.random.fold_in(_step_key(state), 0) if loss_of.use_rng else None
    loss = functools.partial(_loss_only, loss_of, state.collections, batch, key)
    fp8 = getattr(state.opt_state, "fp8", None) or {}
    scope = functools.partial(delayed_scope, fp8, calibrate=not fp8) \
        if _uses_delayed(opts, state) else contextlib.nullcontext
    return StepProgram(loss, state.params, state.opt_state,
                       policy.with_output_dtype(jnp.float32), opts.overrides, opts.op_rules,
                       opts.f32_weight_grads, context, scope)


def _loss_only(loss_of: _StepLoss, collections, batch, key, params):
    return loss_of(params, collections, batch, key)[0]


def _micro_size(opts: _StepOptions, batch: Any) -> int:
    size = _batch_size(batch, "step")
    if size % (opts.micro_batches * opts.n_shards):
        raise ValueError(
            f"step: the batch size {size} must be divisible by micro_batches "
            f"({opts.micro_batches}) x data-parallel devices ({opts.n_shards}).")
    return size // opts.micro_batches


def _check_step(opts: _StepOptions, state: TrainState, batch: Any, tx):
    if opts.tx is not None and state.tx is not opts.tx:
        raise ValueError("step: the state was created with a different optimizer than the "
                         "one given to make_train_step; pass the same tx to both (or omit "
                         "it: the step uses the state's).")
    _check_not_amp(jax.eval_shape(state.tx.init, state.params), "step")
    opt = state.opt_state  # an AmpState of state.tx (its FP8 histories are the step's)
    check_opt_state(tx, opt._replace(fp8={}) if isinstance(opt, AmpState) else opt,
                    state.params, "step")
    _check_float_params(state.params, "step")
    _micro_size(opts, batch)


def _fp8_per_shard(op_rules: OpRules, n_shards: int) -> OpRules:
    """``op_rules`` with its FP8 rule scaling activations per device of the data axis (left as
    it is when it already has ``shards`` or is not :class:`jaxamp.FP8Matmuls`): the amax of a
    batch-sharded activation or output gradient then needs no all-reduce."""
    rule = op_rules.handler("dot_general")
    if n_shards > 1 and isinstance(rule, FP8Matmuls) and rule.shards == 1:
        return op_rules.extend(handlers={"dot_general": dataclasses.replace(
            rule, shards=n_shards)})
    return op_rules


def make_eval_step(model: Any, loss_fn: Callable, *, policy: str | jmp.Policy | None = None,
                   overrides: dict | None = None, op_rules: OpRules = DEFAULT_OP_RULES,
                   f32_weight_grads: bool | None = None) -> Callable:
    """Builds a jitted ``eval_step(params_or_state, batch) -> float32 loss`` under a policy.

    Args:
      model: a flax linen Module, a flax NNX Module or an apply function.
      loss_fn: ``loss_fn(apply_fn, params, batch) -> loss`` (NNX: ``loss_fn(model, batch)``),
        as for :func:`make_train_step`
        (an ``rng`` parameter, if any, must have a default: evaluation passes none).
      policy: the policy; ``None``: the state's when a :class:`TrainState` is passed, else
        :data:`DEFAULT_POLICY`.
      overrides: per-module rules for :func:`jaxamp.autocast`.
      op_rules, f32_weight_grads: as for :func:`jaxamp.autocast`.

    Given a :class:`TrainState`, its collections (BatchNorm's running statistics) are added to
    the variables ``apply_fn`` receives, read-only.
    """
    check_options("make_eval_step", op_rules, f32_weight_grads)
    apply_fn = _apply_fn_of(model)
    if isinstance(apply_fn, nnx_frontend.Apply):
        loss_fn = _nnx_loss(loss_fn)
    fixed = None if policy is None else get_policy(policy)

    @functools.partial(jax.jit, static_argnums=0)
    def run(pol, params, collections, batch):
        def loss(params, collections, batch):
            bound = _BoundApply(apply_fn, collections, ()) if collections else apply_fn
            return loss_fn(bound, params, batch)
        amp_loss = autocast(loss, pol.with_output_dtype(jnp.float32), overrides=overrides,
                            op_rules=op_rules, f32_weight_grads=f32_weight_grads)
        return jnp.asarray(amp_loss(params, collections, batch), jnp.float32)

    def eval_step(params, batch):
        if isinstance(params, TrainState):
            pol = fixed or params.policy or get_policy(DEFAULT_POLICY)
            return run(pol, params.params, params.collections, batch)
        return run(fixed or get_policy(DEFAULT_POLICY), params, {}, batch)

    return eval_step


def nnx_update(model: Any, state: TrainState) -> None:
    """Writes a :class:`TrainState`'s params and NNX state (BatchNorm statistics) into the
    NNX ``model``'s Variables, in place (what ``nnx.update`` does for an ``nnx.State``).

    Example:
      >>> from flax import nnx
      >>> model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
      >>> state = TrainState.create(model, tx=optax.sgd(0.1), policy="float32")
      >>> state = state.replace(params={"bias": jnp.ones(2), "kernel": jnp.zeros((3, 2))})
      >>> nnx_update(model, state)
      >>> model(jnp.ones((1, 3)))
      Array([[1., 1.]], dtype=float32)
    """
    if not nnx_frontend.is_module(model):
        raise TypeError(f"nnx_update: model must be a flax.nnx.Module, got "
                        f"{type(model).__name__}.")
    if not isinstance(state, TrainState):
        raise TypeError(f"nnx_update: state must be a jaxamp.TrainState, got "
                        f"{type(state).__name__}.")
    nnx_frontend.update(model, {"params": state.params, **state.collections})
