"""Loss scaling for float16 training, as jit-safe JAX pytrees.

Gradients computed in float16 underflow to zero when they are smaller than
about ``6e-8``. Multiplying the loss by a large factor before differentiating
(``scale``) and dividing the gradients by it afterwards (``unscale``) keeps
them representable. A *dynamic* loss scale additionally shrinks the factor when
the gradients overflow and grows it again after a run of clean steps.

Three classes share one interface (the vocabulary of the ``jmp`` library):

* :class:`NoOpLossScale` -- scale 1, never adjusts (bfloat16 / float32 runs).
* :class:`StaticLossScale` -- a fixed scale.
* :class:`DynamicLossScale` -- Megatron-LM style dynamic scale.

Each has a ``loss_scale`` attribute (float32 scalar array), ``scale(tree)``,
``unscale(tree)``, ``adjust(grads_finite)`` and an ``at_min`` property.

Every field of every class, configuration included, is a pytree leaf stored as
a JAX array of fixed dtype (float32 for scales and factors, int32 for counters
and intervals). The state therefore survives ``jax.jit``, ``lax.cond``,
``lax.scan``, ``jax.vmap`` and checkpointing (orbax, ``flax.serialization``)
without losing or re-typing any field. (``jmp.DynamicLossScale`` does not
flatten ``min_loss_scale``, so it silently resets to its default under jit.)

Defaults of :class:`DynamicLossScale` compared with ``torch.amp.GradScaler``:

==============================  ====================  ====================
setting                         torch GradScaler      DynamicLossScale
==============================  ====================  ====================
initial scale                   2**16                 2**16
growth factor                   x2                    x2
backoff factor                  x0.5                  x0.5
grows on N-th clean step        N = 2000              N = 2000
floor (``min_loss_scale``)      none                  1.0
ceiling (``max_loss_scale``)    none                  2**24
hysteresis                      none (= 1)            1
==============================  ====================  ====================

What the extra settings add: the floor keeps a run of overflowing steps (e.g.
a NaN in the data) from driving the scale to 0, where every gradient would
vanish; ``at_min`` reports when the scale sits there so a train step can log
it. The ceiling stops the scale growing without bound during long clean runs
(in float32 it would reach inf after ~100 growths); ``2**24`` is already far
more than float16 gradients can use. ``hysteresis=n`` (from Megatron-LM) tolerates
``n - 1`` overflowing steps before backing off; the tolerance is restored
whenever the scale grows. With ``hysteresis=1`` the behaviour is exactly
torch's, apart from the floor and ceiling.
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

_F32 = jnp.float32
_I32 = jnp.int32


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def _concrete(value: Any) -> np.ndarray | None:
    """Returns ``value`` as a numpy array, or ``None`` if it is a tracer."""
    if isinstance(value, Tracer):
        return None
    try:
        return np.asarray(value)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _number(cls: str, name: str, value: Any, hint: str) -> float | None:
    """Validates that ``value`` is a real scalar; returns it as a float.

    Returns ``None`` (skipping validation) when ``value`` is a tracer.
    """
    arr = _concrete(value)
    if arr is None:
        return None
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.number) or np.iscomplexobj(arr):
        raise TypeError(
            f"{cls}: {name} must be a real number, got {type(value).__name__} {value!r}. {hint}"
        )
    if arr.ndim != 0:
        raise ValueError(f"{cls}: {name} must be a scalar, got shape {arr.shape}. {hint}")
    return float(arr)


def _integer(cls: str, name: str, value: Any, hint: str) -> int | None:
    x = _number(cls, name, value, hint)
    if x is None:
        return None
    if not (math.isfinite(x) and x == int(x)):
        raise ValueError(f"{cls}: {name} must be an integer, got {x!r}. {hint}")
    if not -(2**31) <= x < 2**31:
        raise ValueError(f"{cls}: {name} must fit in int32, got {int(x)}. {hint}")
    return int(x)


_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal float32
_MAGNITUDES = f"the allowed magnitudes are [{_F32_TINY:g}, {_F32_MAX:g}]"


def _f32(x: float) -> float:
    """``x`` as the float32 it is stored as (comparisons between fields use what is stored)."""
    with np.errstate(over="ignore", under="ignore"):
        return float(np.float32(x))


class _Rule(NamedTuple):
    """One row of a validation table: ``check(*values of fields)`` must hold, else
    ``ValueError("<cls>: " + allowed.format(...) + ". " + fix)``. ``allowed`` reads ``{x}``
    (the first field as given), ``{x32}`` (as stored in float32) and each field by name (as
    stored: float32 for scales and factors, int for counters)."""

    fields: tuple[str, ...]
    check: Callable[..., bool]
    allowed: str
    fix: str


def _scale_rules(name: str, fix: str) -> tuple[_Rule, ...]:
    """A scale: finite and > 0, and finite and normal once stored in float32 (1e39 would be
    stored as inf, 1e-46 as 0.0)."""
    stored = "float32, the dtype it is stored in"
    return (
        _Rule(
            (name,),
            lambda x: math.isfinite(x) and x > 0,
            "{name} must be finite and > 0, got {x!r}",
            fix,
        ),
        _Rule(
            (name,),
            lambda x: math.isfinite(_f32(x)),
            f"{{name}}={{x!r}} overflows {stored} ({_MAGNITUDES})",
            fix,
        ),
        _Rule(
            (name,),
            lambda x: abs(_f32(x)) >= _F32_TINY,
            f"{{name}}={{x!r}} underflows {stored} (it would be {{x32!r}}; {_MAGNITUDES})",
            fix,
        ),
    )


_STATIC_RULES = _scale_rules("loss_scale", "Use e.g. StaticLossScale(2.0**15).")

_IN_F32 = "in float32, the dtype it is stored in"
_DYNAMIC_RULES = (
    *_scale_rules("loss_scale", "Use e.g. loss_scale=2.0**16."),
    _Rule(
        ("growth_factor",),
        lambda x: math.isfinite(x) and x > 1,
        "{name} must be > 1, got {x!r}",
        "Use e.g. growth_factor=2.0.",
    ),
    *_scale_rules("growth_factor", "Use e.g. growth_factor=2.0.")[1:],
    # 1 + 1e-9 is stored as 1.0: the scale would never grow
    _Rule(
        ("growth_factor",),
        lambda x: _f32(x) > 1,
        f"{{name}} must be > 1 {_IN_F32}; got {{x!r}}, which rounds to {{x32!r}}",
        "Use e.g. growth_factor=2.0.",
    ),
    _Rule(
        ("backoff_factor",),
        lambda x: 0 < x < 1,
        "{name} must be in the open interval (0, 1), got {x!r}",
        "Use e.g. backoff_factor=0.5.",
    ),
    # 1 - 1e-9 is stored as 1.0, 1e-46 as 0.0
    _Rule(
        ("backoff_factor",),
        lambda x: _F32_TINY <= _f32(x) < 1,
        f"{{name}} must be in the open interval (0, 1) {_IN_F32} (at least {_F32_TINY:g}); "
        "got {x!r}, which rounds to {x32!r}",
        "Use e.g. backoff_factor=0.5.",
    ),
    _Rule(
        ("growth_interval",),
        lambda x: x >= 1,
        "{name} must be >= 1, got {x}",
        "Use e.g. growth_interval=2000.",
    ),
    *_scale_rules("min_loss_scale", "Use e.g. min_loss_scale=1.0."),
    *_scale_rules("max_loss_scale", "Use e.g. max_loss_scale=2.0**24."),
    _Rule(
        ("max_loss_scale", "min_loss_scale"),
        lambda hi, lo: _f32(hi) >= _f32(lo),
        "max_loss_scale must be >= min_loss_scale, got max_loss_scale={max_loss_scale!r} "
        "< min_loss_scale={min_loss_scale!r}",
        "",
    ),
    _Rule(
        ("loss_scale", "min_loss_scale"),
        lambda ls, lo: _f32(ls) >= _f32(lo),
        "loss_scale must be within [min_loss_scale, max_loss_scale], got "
        "loss_scale={loss_scale!r} < min_loss_scale={min_loss_scale!r}",
        "",  # the range is the fix (callers add their own)
    ),
    _Rule(
        ("loss_scale", "max_loss_scale"),
        lambda ls, hi: _f32(ls) <= _f32(hi),
        "loss_scale must be within [min_loss_scale, max_loss_scale], got "
        "loss_scale={loss_scale!r} > max_loss_scale={max_loss_scale!r}",
        "",  # the range is the fix (callers add their own)
    ),
    _Rule(
        ("hysteresis",), lambda x: x >= 1, "{name} must be >= 1, got {x}", "Use e.g. hysteresis=1."
    ),
    _Rule(
        ("counter", "growth_interval"),
        lambda c, gi: 0 <= c < gi,
        "{name} must be in [0, growth_interval), got {x}",
        "Use counter=0 for a fresh state.",
    ),
    _Rule(
        ("counter",),
        lambda c: c >= 0,
        "{name} must be in [0, growth_interval), got {x}",
        "Use counter=0 for a fresh state.",
    ),
    _Rule(
        ("hysteresis_counter", "hysteresis"),
        lambda hc, hy: 0 <= hc <= hy,
        "{name} must be in [0, hysteresis], got {x}",
        "Omit it to start at hysteresis.",
    ),
    _Rule(
        ("hysteresis_counter",),
        lambda hc: hc >= 0,
        "{name} must be in [0, hysteresis], got {x}",
        "Omit it to start at hysteresis.",
    ),
)


def _validate(obj: Any, rules: tuple[_Rule, ...], given: dict[str, Any]) -> None:
    """Checks ``given`` against ``rules``, in order (the first failing rule raises). Each field
    is parsed as its stored dtype asks (a real number for float32 fields, an integer for int32)
    when a rule first reads it; a traced value is not checked, nor any rule that reads it."""
    cls = type(obj).__name__
    dtypes = dict(obj._FIELDS)
    values: dict[str, Any] = {}
    for rule in rules:
        for f in rule.fields:
            if f not in values:
                parse = _integer if dtypes[f] == _I32 else _number
                values[f] = parse(cls, f, given[f], _first_fix(rules, f))
        args = [values[f] for f in rule.fields]
        if any(a is None for a in args) or rule.check(*args):
            continue
        x = args[0]
        stored = {f: (_f32(v) if dtypes[f] == _F32 else v) for f, v in values.items()}
        message = rule.allowed.format(name=rule.fields[0], x=x, x32=_f32(x), **stored)
        raise ValueError(f"{cls}: {message}." + (f" {rule.fix}" if rule.fix else ""))


def _first_fix(rules: tuple[_Rule, ...], field: str) -> str:
    return next(r.fix for r in rules if r.fields[0] == field)


def _is_float(x: Any) -> bool:
    return isinstance(x, float) or (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating))


class _LossScaleBase:
    """Pytree plumbing shared by the three loss-scale classes.

    Each subclass is a :func:`_pytree_dataclass`: every dataclass field is a leaf (config
    included) with a fixed dtype, listed in ``_FIELDS``. Unflattening bypasses ``__init__``
    so no validation runs on tracers or placeholder leaves.
    """

    _FIELDS: ClassVar[tuple[tuple[str, Any], ...]] = ()

    def _flatten(self) -> tuple[tuple[Any, ...], None]:
        return tuple(getattr(self, n) for n, _ in self._FIELDS), None

    def _flatten_with_keys(self) -> tuple[tuple[Any, ...], None]:
        return (
            tuple((jax.tree_util.GetAttrKey(n), getattr(self, n)) for n, _ in self._FIELDS),
            None,
        )

    @classmethod
    def _unflatten(cls, aux: None, children: Any) -> Any:
        del aux
        return cls._from_fields(dict(zip((n for n, _ in cls._FIELDS), children, strict=True)))

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
        fields = {n: getattr(self, n) for n, _ in self._FIELDS}
        fields.update(changes)
        return self._from_fields(fields)

    # ---- shared interface -------------------------------------------------

    loss_scale: jax.Array

    def scale(self, tree: Any) -> Any:
        """Multiplies every floating leaf of ``tree`` by the loss scale.

        Each floating leaf keeps its dtype (the scale is cast to it); integer
        and boolean leaves are returned unchanged. In practice this is applied
        to the float32 loss before differentiation.

        Args:
            tree: A pytree of arrays (typically the scalar loss).

        Returns:
            A pytree with the same structure and leaf dtypes as ``tree``.
        """
        ls = self.loss_scale

        def f(x: Any) -> Any:
            if not _is_float(x):
                return x
            x = jnp.asarray(x)
            return x * ls.astype(x.dtype)

        return jax.tree_util.tree_map(f, tree)

    def unscale(self, tree: Any) -> Any:
        """Divides every floating leaf of ``tree`` by the loss scale.

        Each floating leaf is first cast to float32 and then multiplied by
        ``1 / loss_scale`` (computed in float32), so the output floating leaves
        are float32 regardless of input dtype. Unscaling *before* any further
        processing matters: a float16 gradient of 300 scaled by 2**15 is
        finite, but squaring or summing it in float16 (e.g. inside an optax
        clip-by-global-norm) would overflow; the float32 unscaled value does
        not. Integer and boolean leaves are returned unchanged.

        Args:
            tree: A pytree of (scaled) gradients.

        Returns:
            A pytree with the same structure; floating leaves are float32.
        """
        inv = (1.0 / self.loss_scale).astype(_F32)

        def f(x: Any) -> Any:
            if not _is_float(x):
                return x
            return jnp.asarray(x).astype(_F32) * inv

        return jax.tree_util.tree_map(f, tree)


def _leaf(dtype: Any) -> Any:
    """A dataclass field stored as a JAX array of ``dtype``, a pytree leaf."""
    return dataclasses.field(metadata={"dtype": dtype})


def _pytree_dataclass(cls: type) -> type:
    """``cls`` as a frozen dataclass registered as a pytree (with keys, so checkpoints name
    each leaf) and with ``flax.serialization``: every field is a leaf of its ``_leaf`` dtype,
    in declaration order."""
    cls = dataclasses.dataclass(frozen=True, init=False, eq=False)(cls)
    cls._FIELDS = tuple((f.name, f.metadata["dtype"]) for f in dataclasses.fields(cls))
    jax.tree_util.register_pytree_with_keys(
        cls, cls._flatten_with_keys, cls._unflatten, cls._flatten
    )
    _register_flax_serialization(cls)
    return cls


def _register_flax_serialization(cls: type) -> None:
    """Registers ``cls`` with ``flax.serialization`` (if flax is installed)."""
    try:
        from flax import serialization
    except ImportError:  # pragma: no cover - flax is optional here
        return

    def to_state_dict(obj: Any) -> dict[str, Any]:
        return {n: serialization.to_state_dict(getattr(obj, n)) for n, _ in cls._FIELDS}

    def from_state_dict(target: Any, state: dict[str, Any]) -> Any:
        missing = [n for n, _ in cls._FIELDS if n not in state]
        if missing:
            raise ValueError(
                f"{cls.__name__}: checkpoint state is missing field(s) {missing}; "
                f"got keys {sorted(state)}."
            )
        return cls._from_fields({n: jnp.asarray(state[n], dtype=dtype) for n, dtype in cls._FIELDS})

    serialization.register_serialization_state(cls, to_state_dict, from_state_dict)


# --------------------------------------------------------------------------
# Public classes
# --------------------------------------------------------------------------


@_pytree_dataclass
class NoOpLossScale(_LossScaleBase):
    """A loss scale of 1 that never adjusts (for bfloat16 or float32 runs).

    It has no pytree leaves. ``unscale`` still casts floating leaves to
    float32, so all three classes return gradients of the same dtype.
    """

    def __init__(self) -> None:
        """Creates the no-op loss scale."""

    @property
    def loss_scale(self) -> jax.Array:  # type: ignore[override]
        """The scale, always ``1.0`` (float32 scalar)."""
        return jnp.ones((), _F32)

    @property
    def at_min(self) -> jax.Array:
        """Always ``False`` (bool scalar array): a no-op scale has no floor."""
        return jnp.zeros((), bool)

    def adjust(self, grads_finite: Any) -> NoOpLossScale:
        """Returns ``self`` unchanged.

        Args:
            grads_finite: Ignored.

        Returns:
            ``self``.
        """
        del grads_finite
        return self


@_pytree_dataclass
class StaticLossScale(_LossScaleBase):
    """A fixed loss scale.

    Attributes:
        loss_scale: The scale (float32 scalar array).
    """

    loss_scale: jax.Array = _leaf(_F32)

    def __init__(self, loss_scale: Any) -> None:
        """Creates a static loss scale.

        Args:
            loss_scale: The fixed scale; finite and > 0.

        Raises:
            ValueError: If ``loss_scale`` is not finite and positive.
            TypeError: If ``loss_scale`` is not a real number.
        """
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

    ``adjust(grads_finite)`` returns the next state:

    * finite step: ``counter += 1``; when it reaches ``growth_interval`` the
      scale becomes ``min(loss_scale * growth_factor, max_loss_scale)``,
      ``counter`` resets to 0 and ``hysteresis_counter`` to ``hysteresis``.
    * overflow: ``counter = 0`` and ``hysteresis_counter -= 1`` (never below
      0); when it is ``<= 0`` the scale becomes
      ``max(loss_scale * backoff_factor, min_loss_scale)``.

    All updates use ``jnp.where`` so ``adjust`` runs under ``jit``/``scan``/
    ``vmap`` with no host synchronisation. The scale always stays inside
    ``[min_loss_scale, max_loss_scale]``.

    Attributes:
        loss_scale: Current scale (float32).
        counter: Consecutive finite steps since the last growth or overflow
            (int32).
        hysteresis_counter: Overflows still tolerated before backing off
            (int32, starts at ``hysteresis``).
        growth_factor: Multiplier on growth (float32, > 1).
        backoff_factor: Multiplier on backoff (float32, in (0, 1)).
        growth_interval: Finite steps needed to grow (int32, >= 1).
        min_loss_scale: Floor of the scale (float32).
        max_loss_scale: Ceiling of the scale (float32).
        hysteresis: Overflows needed to back off (int32, >= 1).
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

    def __init__(
        self,
        loss_scale: Any = 2.0**16,
        *,
        growth_factor: Any = 2.0,
        backoff_factor: Any = 0.5,
        growth_interval: Any = 2000,
        min_loss_scale: Any = 1.0,
        max_loss_scale: Any = 2.0**24,
        hysteresis: Any = 1,
        counter: Any = 0,
        hysteresis_counter: Any = None,
    ) -> None:
        """Creates a dynamic loss scale.

        Args:
            loss_scale: Initial scale, within ``[min_loss_scale,
                max_loss_scale]``.
            growth_factor: Multiplier applied on growth; finite and > 1.
            backoff_factor: Multiplier applied on backoff; in (0, 1).
            growth_interval: The scale grows on this many consecutive finite
                steps; an integer >= 1.
            min_loss_scale: Floor; finite and > 0.
            max_loss_scale: Ceiling; finite and >= ``min_loss_scale``.
            hysteresis: Number of overflows (since the last growth) that
                trigger a backoff; an integer >= 1. 1 means every overflow.
            counter: Initial consecutive-finite-step count, in
                ``[0, growth_interval)``. For restoring state by hand.
            hysteresis_counter: Initial hysteresis counter, in
                ``[0, hysteresis]``; defaults to ``hysteresis``.

        Raises:
            ValueError: If a value is out of range (message names the field).
            TypeError: If a value is not a real number.
        """
        if hysteresis_counter is None:
            hysteresis_counter = hysteresis
        given = dict(
            loss_scale=loss_scale,
            counter=counter,
            hysteresis_counter=hysteresis_counter,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            min_loss_scale=min_loss_scale,
            max_loss_scale=max_loss_scale,
            hysteresis=hysteresis,
        )
        _validate(self, _DYNAMIC_RULES, given)
        self._set_fields(**given)

    @property
    def at_min(self) -> jax.Array:
        """Whether the scale sits at its floor (bool array, traceable)."""
        return self.loss_scale <= self.min_loss_scale

    def adjust(self, grads_finite: Any) -> DynamicLossScale:
        """Returns the next state given whether this step's grads were finite.

        Args:
            grads_finite: Boolean scalar (may be traced), e.g. from
                ``jnp.all(jnp.isfinite(...))`` over all gradient leaves.

        Returns:
            A new ``DynamicLossScale`` with identical leaf dtypes.
        """
        finite = jnp.asarray(grads_finite, dtype=bool)
        counter = self.counter.astype(_I32)
        hcounter = self.hysteresis_counter.astype(_I32)
        scale = self.loss_scale.astype(_F32)
        lo = self.min_loss_scale.astype(_F32)
        hi = self.max_loss_scale.astype(_F32)

        inc = counter + 1
        # ``>=`` rather than ``==`` so a counter restored past a (changed)
        # interval still grows instead of never growing again.
        grow = finite & (inc >= self.growth_interval)
        dec = jnp.maximum(hcounter - 1, 0)
        backoff = ~finite & (dec <= 0)

        grown = jnp.minimum(scale * self.growth_factor.astype(_F32), hi)
        shrunk = jnp.maximum(scale * self.backoff_factor.astype(_F32), lo)
        new_scale = jnp.where(grow, grown, jnp.where(backoff, shrunk, scale))
        new_scale = jnp.clip(new_scale, lo, hi).astype(_F32)
        new_counter = jnp.where(finite & ~grow, inc, 0).astype(_I32)
        new_hcounter = jnp.where(
            finite, jnp.where(grow, self.hysteresis.astype(_I32), hcounter), dec
        ).astype(_I32)
        return self._replace(
            loss_scale=new_scale, counter=new_counter, hysteresis_counter=new_hcounter
        )
