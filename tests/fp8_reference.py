"""The independent FP8 quantise reference of the FP8 tests, written with numpy and ml_dtypes
(no jaxamp): per-tensor, per-row (``axis``) or from a given amax (delayed scaling)."""

from __future__ import annotations

import ml_dtypes
import numpy as np


def quantize(x, dtype, *, amax=None, axis=None):
    """``(q, scale)``, ``x ~= q * scale`` in float64: ``scale`` is ``amax / finfo(dtype).max``
    rounded up to a power of two (1 for a zero or non-finite amax), ``q = clip(x / scale)``
    rounded to ``dtype`` (what exceeds the range saturates). ``amax``: the tensor's own (over
    ``axis``, kept as size-1 dimensions; all axes: a scalar) unless given."""
    fmax = float(ml_dtypes.finfo(dtype).max)
    x = np.asarray(x, np.float64)
    if amax is None:
        amax = np.max(np.abs(x), axis=axis, keepdims=axis is not None)
    amax = np.asarray(amax, np.float64)
    ok = (amax > 0) & np.isfinite(amax)
    scale = np.where(ok, 2.0 ** np.ceil(np.log2(np.where(ok, amax, 1.0) / fmax)), 1.0)
    return np.clip(x / scale, -fmax, fmax).astype(dtype).astype(np.float64), scale
