"""Loss scaling for float16 training, as jit-safe JAX pytrees (jmp's vocabulary).

:class:`NoOpLossScale` (scale 1, for bfloat16/float32), :class:`StaticLossScale` (fixed) and
:class:`DynamicLossScale` (Megatron-LM style, torch's defaults) share ``loss_scale``,
``scale(tree)``, ``unscale(tree)``, ``adjust(grads_finite)`` and ``at_min``. Every field,
configuration included, is a pytree leaf of a fixed dtype (float32 scales and factors, int32
counters), so the state survives ``jit``, ``scan``, ``vmap`` and checkpoints intact. The
defaults against torch's GradScaler: ``docs/api/loss_scale.rst``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._engine.compat import Tracer

__all__ = ["NoOpLossScale", "StaticLossScale", "DynamicLossScale"]

_F32, _I32 = jnp.float32, jnp.int32
_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal float32
_MAGNITUDES = f"the allowed magnitudes are [{_F32_TINY:g}, {_F32_MAX:g}]"


def _number(cls: str, name: str, value: Any, hint: str, integer: bool = False):
    """``value`` as a float (an int if ``integer``), checked to be a real scalar (an int32);
    ``None`` for a tracer (unchecked)."""
    if isinstance(value, Tracer):
        return None
    try:
        arr = np.asarray(value)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.number) or np.iscomplexobj(arr):
        raise TypeError(
            f"{cls}: {name} must be a real number, got {type(value).__name__} {value!r}. {hint}")
    if arr.ndim != 0:
        raise ValueError(f"{cls}: {name} must be a scalar, got shape {arr.shape}. {hint}")
    x = float(arr)
    if not integer:
        return x
    if not (math.isfinite(x) and x == int(x)):
        raise ValueError(f"{cls}: {name} must be an integer, got {x!r}. {hint}")
    if not -(2**31) <= x < 2**31:
        raise ValueError(f"{cls}: {name} must fit in int32, got {int(x)}. {hint}")
    return int(x)


def _f32(x: float) -> float:
    """``x`` as the float32 it is stored as (comparisons between fields use what is stored)."""
    with np.errstate(over="ignore", under="ignore"):
        return float(np.float32(x))


class _Rule(NamedTuple):
    """``check(*fields)`` must hold, else ``ValueError("<cls>: " + allowed + ". " + fix)``;
    ``allowed`` reads ``{x}`` (the first field as given), ``{x32}`` (it in float32) and each
    field by name (as stored)."""

    fields: tuple[str, ...]
    check: Callable[..., bool]
    allowed: str
    fix: str


_STORED = "float32, the dtype it is stored in"
_IN_F32 = "in float32, the dtype it is stored in"


def _scale_rules(name: str, fix: str) -> tuple[_Rule, ...]:
    """A scale: finite and > 0, and finite and normal once stored in float32 (1e39 would be
    stored as inf, 1e-46 as 0.0)."""
    return (
        _Rule((name,), lambda x: math.isfinite(x) and x > 0,
              "{name} must be finite and > 0, got {x!r}", fix),
        _Rule((name,), lambda x: math.isfinite(_f32(x)),
              f"{{name}}={{x!r}} overflows {_STORED} ({_MAGNITUDES})", fix),
        _Rule((name,), lambda x: abs(_f32(x)) >= _F32_TINY,
              f"{{name}}={{x!r}} underflows {_STORED} (it would be {{x32!r}}; {_MAGNITUDES})",
              fix),
    )


def _count_rules(name: str, bound: str, check: Callable, interval: str, fix: str):
    """A counter: within ``interval`` of ``bound``, and >= 0 (alone, when ``bound`` is traced)."""
    allowed = f"{{name}} must be in {interval}, got {{x}}"
    return _Rule((name, bound), check, allowed, fix), _Rule((name,), lambda c: c >= 0, allowed, fix)


_STATIC_RULES = _scale_rules("loss_scale", "Use e.g. StaticLossScale(2.0**15).")
_GROWTH, _BACKOFF = "Use e.g. growth_factor=2.0.", "Use e.g. backoff_factor=0.5."
_RANGE = "loss_scale must be within [min_loss_scale, max_loss_scale], got loss_scale={loss_scale!r}"
_DYNAMIC_RULES = (
    *_scale_rules("loss_scale", "Use e.g. loss_scale=2.0**16."),
    _Rule(("growth_factor",), lambda x: math.isfinite(x) and x > 1,
          "{name} must be > 1, got {x!r}", _GROWTH),
    *_scale_rules("growth_factor", _GROWTH)[1:],
    # 1 + 1e-9 is stored as 1.0: the scale would never grow
    _Rule(("growth_factor",), lambda x: _f32(x) > 1,
          f"{{name}} must be > 1 {_IN_F32}; got {{x!r}}, which rounds to {{x32!r}}", _GROWTH),
    _Rule(("backoff_factor",), lambda x: 0 < x < 1,
          "{name} must be in the open interval (0, 1), got {x!r}", _BACKOFF),
    # 1 - 1e-9 is stored as 1.0, 1e-46 as 0.0
    _Rule(("backoff_factor",), lambda x: _F32_TINY <= _f32(x) < 1,
          f"{{name}} must be in the open interval (0, 1) {_IN_F32} (at least {_F32_TINY:g}); "
          "got {x!r}, which rounds to {x32!r}", _BACKOFF),
    _Rule(("growth_interval",), lambda x: x >= 1, "{name} must be >= 1, got {x}",
          "Use e.g. growth_interval=2000."),
    *_scale_rules("min_loss_scale", "Use e.g. min_loss_scale=1.0."),
    *_scale_rules("max_loss_scale", "Use e.g. max_loss_scale=2.0**24."),
    _Rule(("max_loss_scale", "min_loss_scale"), lambda hi, lo: _f32(hi) >= _f32(lo),
          "max_loss_scale must be >= min_loss_scale, got max_loss_scale={max_loss_scale!r} "
          "< min_loss_scale={min_loss_scale!r}", ""),
    # the range is the fix (callers add their own)
    _Rule(("loss_scale", "min_loss_scale"), lambda ls, lo: _f32(ls) >= _f32(lo),
          _RANGE + " < min_loss_scale={min_loss_scale!r}", ""),
    _Rule(("loss_scale", "max_loss_scale"), lambda ls, hi: _f32(ls) <= _f32(hi),
          _RANGE + " > max_loss_scale={max_loss_scale!r}", ""),
    _Rule(("hysteresis",), lambda x: x >= 1, "{name} must be >= 1, got {x}",
          "Use e.g. hysteresis=1."),
    *_count_rules("counter", "growth_interval", lambda c, gi: 0 <= c < gi,
                  "[0, growth_interval)", "Use counter=0 for a fresh state."),
    *_count_rules("hysteresis_counter", "hysteresis", lambda hc, hy: 0 <= hc <= hy,
                  "[0, hysteresis]", "Omit it to start at hysteresis."),
)


def _validate(obj: Any, rules: tuple[_Rule, ...], given: dict[str, Any]) -> None:
    """Checks ``given`` against ``rules`` in order (the first failing one raises). Each field is
    parsed as its stored dtype asks when a rule first reads it; a traced value is not checked,
    nor any rule that reads it."""
    cls = type(obj).__name__
    dtypes = dict(obj._FIELDS)
    values: dict[str, Any] = {}
    for rule in rules:
        for f in rule.fields:
            if f not in values:
                fix = next(r.fix for r in rules if r.fields[0] == f)
                values[f] = _number(cls, f, given[f], fix, integer=dtypes[f] == _I32)
        args = [values[f] for f in rule.fields]
        if any(a is None for a in args) or rule.check(*args):
            continue
        x = args[0]
        stored = {f: (_f32(v) if dtypes[f] == _F32 else v) for f, v in values.items()}
        message = rule.allowed.format(name=rule.fields[0], x=x, x32=_f32(x), **stored)
        raise ValueError(f"{cls}: {message}." + (f" {rule.fix}" if rule.fix else ""))


def _floats(fn: Callable, tree: Any) -> Any:
    """``fn`` on every floating leaf of ``tree``; integer and boolean leaves unchanged."""
    def one(x):
        if isinstance(x, float) or (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)):
            return fn(jnp.asarray(x))
        return x
    return jax.tree_util.tree_map(one, tree)


class _LossScaleBase:
    """Pytree plumbing: every dataclass field is a leaf of a fixed dtype (``_FIELDS``);
    unflattening bypasses ``__init__``, so no validation runs on tracers or placeholders."""

    _FIELDS: ClassVar[tuple[tuple[str, Any], ...]] = ()
    loss_scale: jax.Array

    def _flatten_with_keys(self):
        return tuple((jax.tree_util.GetAttrKey(n), getattr(self, n)) for n, _ in self._FIELDS), None

    @classmethod
    def _from_fields(cls, fields: dict[str, Any]) -> Any:
        obj = object.__new__(cls)
        for name, value in fields.items():
            object.__setattr__(obj, name, value)
        return obj

    def _set_fields(self, **values: Any) -> None:
        """Stores constructor values as arrays of each field's fixed dtype."""
        for name, dtype in self._FIELDS:
            object.__setattr__(self, name, jnp.asarray(values[name], dtype=dtype))

    def _replace(self, **changes: Any) -> Any:
        return self._from_fields({n: getattr(self, n) for n, _ in self._FIELDS} | changes)

    def scale(self, tree: Any) -> Any:
        """Multiplies every floating leaf of ``tree`` (typically the float32 loss) by the loss
        scale, cast to the leaf's dtype; other leaves are returned unchanged."""
        return _floats(lambda x: x * self.loss_scale.astype(x.dtype), tree)

    def unscale(self, tree: Any) -> Any:
        """Divides every floating leaf of ``tree`` by the loss scale, returning it in float32
        (other leaves unchanged). Unscale *before* any further processing: a float16 gradient
        of 300 scaled by 2**15 is finite, but squaring or summing it in float16 (e.g. in
        optax's clip-by-global-norm) would overflow; the float32 unscaled value does not."""
        inv = (1.0 / self.loss_scale).astype(_F32)
        return _floats(lambda x: x.astype(_F32) * inv, tree)


def _leaf(dtype: Any) -> Any:
    """A dataclass field stored as a JAX array of ``dtype``, a pytree leaf."""
    return dataclasses.field(metadata={"dtype": dtype})


def _pytree_dataclass(cls: type) -> type:
    """``cls`` as a frozen dataclass registered as a pytree (with keys, so checkpoints name
    each leaf) and with ``flax.serialization``: every field a leaf, in declaration order."""
    cls = dataclasses.dataclass(frozen=True, init=False, eq=False)(cls)
    cls._FIELDS = tuple((f.name, f.metadata["dtype"]) for f in dataclasses.fields(cls))
    names = [n for n, _ in cls._FIELDS]
    jax.tree_util.register_pytree_with_keys(
        cls, cls._flatten_with_keys,
        lambda _, children: cls._from_fields(dict(zip(names, children, strict=True))),
        lambda obj: (tuple(getattr(obj, n) for n in names), None))
    try:
        from flax import serialization
    except ImportError:  # pragma: no cover - flax is optional here
        return cls

    def from_state_dict(target: Any, state: dict[str, Any]) -> Any:
        missing = [n for n in names if n not in state]
        if missing:
            raise ValueError(f"{cls.__name__}: checkpoint state is missing field(s) {missing}; "
                             f"got keys {sorted(state)}.")
        return cls._from_fields({n: jnp.asarray(state[n], dtype=dt) for n, dt in cls._FIELDS})

    serialization.register_serialization_state(
        cls, lambda obj: {n: serialization.to_state_dict(getattr(obj, n)) for n in names},
        from_state_dict)
    return cls


@_pytree_dataclass
class NoOpLossScale(_LossScaleBase):
    """A loss scale of 1 that never adjusts (for bfloat16 or float32 runs); no pytree leaves.
    ``unscale`` still casts to float32, so all three classes return gradients alike."""

    @property
    def loss_scale(self) -> jax.Array:  # type: ignore[override]
        """The scale, always ``1.0`` (float32 scalar)."""
        return jnp.ones((), _F32)

    @property
    def at_min(self) -> jax.Array:
        """Always ``False`` (bool scalar array): a no-op scale has no floor."""
        return jnp.zeros((), bool)

    def adjust(self, grads_finite: Any) -> NoOpLossScale:
        """Returns ``self`` unchanged (``grads_finite`` is ignored)."""
        del grads_finite
        return self


@_pytree_dataclass
class StaticLossScale(_LossScaleBase):
    """A fixed loss scale ``loss_scale``: finite and > 0 in float32, the dtype of the scalar
    array it is stored as (else ``ValueError``; ``TypeError`` if it is not a real number)."""

    loss_scale: jax.Array = _leaf(_F32)

    def __init__(self, loss_scale: Any) -> None:
        _validate(self, _STATIC_RULES, {"loss_scale": loss_scale})
        self._set_fields(loss_scale=loss_scale)

    @property
    def at_min(self) -> jax.Array:
        """Always ``False`` (bool array): a static scale has no floor."""
        return jnp.zeros(jnp.shape(self.loss_scale), bool)

    adjust = NoOpLossScale.adjust  # a fixed scale: returns ``self`` unchanged


@_pytree_dataclass
class DynamicLossScale(_LossScaleBase):
    """A dynamic loss scale (Megatron-LM semantics, torch defaults).

    ``adjust(grads_finite)`` returns the next state (with ``jnp.where``: no host sync). A
    finite step counts (``counter += 1``); at ``growth_interval`` the scale becomes
    ``min(loss_scale * growth_factor, max_loss_scale)``, ``counter`` 0 and
    ``hysteresis_counter`` ``hysteresis``. An overflow sets ``counter = 0`` and
    ``hysteresis_counter -= 1`` (not below 0); at 0 the scale becomes ``max(loss_scale *
    backoff_factor, min_loss_scale)``. Every argument is a field (float32 or int32 leaf).

    Args:
        loss_scale: Initial scale, within ``[min_loss_scale, max_loss_scale]``.
        growth_factor: Multiplier applied on growth; finite and > 1.
        backoff_factor: Multiplier applied on backoff; in (0, 1).
        growth_interval: The scale grows after this many consecutive finite steps (>= 1).
        min_loss_scale: Floor; finite and > 0 (a run of overflows never reaches 0).
        max_loss_scale: Ceiling; finite and >= ``min_loss_scale``.
        hysteresis: Overflows since the last growth that trigger a backoff (>= 1; 1: every
            overflow, as torch).
        counter: Consecutive finite steps, in ``[0, growth_interval)`` (to restore by hand).
        hysteresis_counter: Overflows still tolerated, in ``[0, hysteresis]``; defaults to
            ``hysteresis``.

    Raises:
        ValueError: If a value is out of range (naming the field); TypeError if not a number.
    """

    loss_scale: jax.Array = _leaf(_F32)
    counter: jax.Array = _leaf(_I32)
    hysteresis_counter: jax.Array = _leaf(_I32)
    growth_factor: jax.Array = _leaf(_F32)
    backoff_factor: jax.Array = _leaf(_F32)
    growth_interval: jax.Array = _leaf(_I32)
    min_loss_scale: jax.Array = _leaf(_F32)
    max_loss_scale: jax.Array = _leaf(_F32)
    hysteresis: jax.Array = _leaf(_I32)

    def __init__(self, loss_scale: Any = 2.0**16, *, growth_factor: Any = 2.0,
                 backoff_factor: Any = 0.5, growth_interval: Any = 2000,
                 min_loss_scale: Any = 1.0, max_loss_scale: Any = 2.0**24, hysteresis: Any = 1,
                 counter: Any = 0, hysteresis_counter: Any = None) -> None:
        given = dict(loss_scale=loss_scale, counter=counter,
                     hysteresis_counter=hysteresis if hysteresis_counter is None
                     else hysteresis_counter,
                     growth_factor=growth_factor, backoff_factor=backoff_factor,
                     growth_interval=growth_interval, min_loss_scale=min_loss_scale,
                     max_loss_scale=max_loss_scale, hysteresis=hysteresis)
        _validate(self, _DYNAMIC_RULES, given)
        self._set_fields(**given)

    @property
    def at_min(self) -> jax.Array:
        """Whether the scale sits at its floor (bool array, traceable)."""
        return self.loss_scale <= self.min_loss_scale

    def adjust(self, grads_finite: Any) -> DynamicLossScale:
        """The next state, given whether this step's gradients were all finite (a bool scalar,
        may be traced); the same leaf dtypes."""
        finite = jnp.asarray(grads_finite, dtype=bool)
        counter, hcounter = self.counter.astype(_I32), self.hysteresis_counter.astype(_I32)
        scale = self.loss_scale.astype(_F32)
        lo, hi = self.min_loss_scale.astype(_F32), self.max_loss_scale.astype(_F32)
        inc = counter + 1
        # >= rather than ==: a counter restored past a (changed) interval still grows
        grow = finite & (inc >= self.growth_interval)
        dec = jnp.maximum(hcounter - 1, 0)
        backoff = ~finite & (dec <= 0)
        grown = jnp.minimum(scale * self.growth_factor.astype(_F32), hi)
        shrunk = jnp.maximum(scale * self.backoff_factor.astype(_F32), lo)
        new_scale = jnp.clip(jnp.where(grow, grown, jnp.where(backoff, shrunk, scale)), lo, hi)
        new_hcounter = jnp.where(finite, jnp.where(grow, self.hysteresis.astype(_I32), hcounter),
                                 dec)
        return self._replace(loss_scale=new_scale.astype(_F32),
                             counter=jnp.where(finite & ~grow, inc, 0).astype(_I32),
                             hysteresis_counter=new_hcounter.astype(_I32))
