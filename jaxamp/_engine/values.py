"""The values autocast's evaluator passes around (:class:`Value`: an array and what autocast
knows of it; jaxamp/_engine/README.md, "Values"), and the casts between them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._engine.compat import Tracer

__all__ = ["F32", "Value", "bind", "cast", "convert", "copies", "dtype_of", "is_float", "spec",
           "widest"]

F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)


def is_float(dtype) -> bool:
    """A floating dtype autocast may cast: float16, bfloat16 or float32 (never float64)."""
    try:  # jax's issubdtype knows extended dtypes (PRNG keys): not floating
        return bool(jax.dtypes.issubdtype(dtype, jnp.floating)) and np.dtype(dtype) != F64
    except TypeError:
        return False


def dtype_of(x) -> np.dtype:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        dtype = np.asarray(x).dtype
    try:
        return np.dtype(dtype)
    except TypeError:  # extended dtypes (PRNG keys)
        return dtype


def widest(dtypes: Sequence[np.dtype]) -> np.dtype:
    out = dtypes[0]
    for d in dtypes[1:]:
        out = np.dtype(jnp.promote_types(out, d))
    return out


def spec(x, dtype=None) -> jax.ShapeDtypeStruct:
    """``x``'s shape and dtype (or ``dtype``) with its weak type: a jitted body traced on specs
    is the one JAX's cache finds for ``x`` itself."""
    weak = bool(getattr(getattr(x, "aval", None), "weak_type", False))
    return jax.ShapeDtypeStruct(np.shape(x), dtype_of(x) if dtype is None else dtype,
                                weak_type=weak and dtype is None)


@dataclasses.dataclass(eq=False)
class Value:
    """A value under evaluation and what autocast knows about it."""

    val: Any
    stored: bool  # an input or constant not yet committed to a compute dtype
    const: bool  # depends on no input (safe to compute at trace time; casts saturate)
    region: tuple[int, ...]
    casts: dict = dataclasses.field(default_factory=dict)
    splat: float | None = None  # a constant filled with one known value (zeros, finfo.min)
    # how to make a narrower copy other than by converting ``val`` (rows of a small table:
    # gathered from its low-precision copy); ``None``: convert. Not carried into a new trace.
    recast: Callable[[np.dtype], Any] | None = None

    @property
    def dtype(self):
        return dtype_of(self.val)

    @property
    def is_float(self) -> bool:
        return is_float(self.dtype)

    def fresh(self, val=None) -> Value:
        """The same knowledge about a value seen from inside a new trace (no shared casts)."""
        return Value(self.val if val is None else val, self.stored, self.const, self.region,
                     splat=self.splat)

    def live(self) -> Value:
        """The same value as an activation (a loop carry: computed, whatever it started as)."""
        return Value(self.val, False, False, self.region)


def saturating(x, dtype: np.dtype):
    info = jnp.finfo(dtype)
    if isinstance(x, Tracer):
        return lax.convert_element_type(jnp.clip(x, info.min, info.max), dtype)
    return np.asarray(np.clip(np.asarray(x, np.float32), float(info.min), float(info.max)),
                      dtype)


def bind(prim, vals: Sequence[Any], params: Mapping[str, Any]):
    """``prim.bind(*vals, **params)``, directly: a jitted call per primitive cost more to
    trace than it saved (jaxamp/_engine/README.md, "Values")."""
    return prim.bind(*vals, **params)


def convert(x, dtype):
    """``lax.convert_element_type(x, dtype)``."""
    return lax.convert_element_type(x, dtype)


def broadcast_convert(x, shape, dtype):
    """``x`` broadcast to ``shape``, then cast."""
    return lax.convert_element_type(jnp.broadcast_to(x, shape), dtype)


def cast(v: Value, dtype) -> Any:
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
            v.casts[dtype] = saturating(v.val, dtype)
        elif narrower and v.recast is not None:
            v.casts[dtype] = v.recast(dtype)
        else:
            v.casts[dtype] = convert(v.val, dtype)
    return v.casts[dtype]


def copies(values: Sequence[Value]) -> list[tuple[int, np.dtype]]:
    """(index, dtype): the copies made of traced float ``values``, in a fixed order, which a
    body on fresh values is given and returns so none is cast twice across its boundary."""
    return [(i, d) for i, v in enumerate(values) if v.is_float
            for d in sorted((k for k in v.casts if isinstance(k, np.dtype)
                             and isinstance(v.casts[k], Tracer)), key=str)]
