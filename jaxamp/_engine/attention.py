"""Fused attention under autocast: ``jax.nn.dot_product_attention`` re-dispatched in the
compute dtype.

While autocast traces (in float32, where only JAX's XLA path exists), a call of the attribute
``jax.nn.dot_product_attention`` is recorded (:class:`Recorder`) and traced with the XLA path
inside a ``jax.jit`` named ``jaxamp_attention_<call>_<k>``; re-evaluation binds it again as
cuDNN in the compute dtype where :func:`wants_cudnn`, else re-evaluates the XLA path like any
code. The attribute is patched through :mod:`jaxamp._engine.patching`. The full story is in
``jaxamp/_engine/README.md``.
"""

from __future__ import annotations

import inspect
from typing import Any

import jax

from jaxamp._engine.compat import target_platform
from jaxamp._engine.patching import Patch

ORIGINAL = jax.nn.dot_product_attention
_SIGNATURE = inspect.signature(ORIGINAL)


def jit_name(call: int, index: int) -> str:
    """The jit name of recorded call ``index`` of autocast call ``call`` (looked up, not parsed)."""
    return f"jaxamp_attention_{call}_{index}"


#: Array arguments cast to the compute dtype (masks and sequence lengths are not floats).
CAST_ARGUMENTS = frozenset({"query", "key", "value", "bias"})


class Recorder:
    """The fused-attention calls of one autocast trace: ``(array argument names, static
    keyword arguments, the function recorded through)`` per call, in order."""

    def __init__(self, call: int):
        self.call = call
        self.calls: list[tuple[tuple[str, ...], dict[str, Any], Any]] = []


def _record(recorder: Recorder, previous, *args, **kwargs):
    """A call under autocast's trace: recorded, and traced through ``previous`` (JAX's
    function or another library's wrapper of it) on the XLA path inside a named jit."""
    bound = _SIGNATURE.bind(*args, **kwargs)
    arrays = {n: v for n, v in bound.arguments.items() if hasattr(v, "shape")
              and hasattr(v, "dtype")}
    static = {n: v for n, v in bound.arguments.items() if n not in arrays}
    traced = dict(static, implementation="xla")  # float32 can only take the XLA path
    names = tuple(arrays)

    def attention(*vals):
        with _PATCH.paused():  # a wrapper below ours that calls ours again passes through
            return previous(**dict(zip(names, vals)), **traced)

    attention.__name__ = jit_name(recorder.call, len(recorder.calls))
    recorder.calls.append((names, static, previous))
    return jax.jit(attention)(*arrays.values())


_PATCH = Patch(lambda: [(jax.nn, "dot_product_attention")], _record)


def recording(recorder: Recorder):
    """Records this thread's ``jax.nn.dot_product_attention`` calls into ``recorder``."""
    return _PATCH.active(recorder)


def wants_cudnn(static: dict[str, Any]) -> bool:
    """Whether a recorded call is bound again as cuDNN: ``implementation="cudnn"``, or
    ``None`` on a GPU (:func:`~jaxamp._engine.compat.target_platform`)."""
    implementation = static.get("implementation")
    return implementation == "cudnn" or (implementation is None
                                         and target_platform() == "gpu")


def redispatch(call: tuple, vals: list, compute_dtype):
    """A recorded call bound as cuDNN attention, its float query/key/value/bias in
    ``compute_dtype``, through the function it was recorded through. Raises what JAX raises
    for a configuration cuDNN does not support."""
    names, static, fn = call
    args = {}
    for name, val in zip(names, vals):
        if name in CAST_ARGUMENTS and jax.numpy.issubdtype(val.dtype, jax.numpy.floating):
            val = val.astype(compute_dtype)
        args[name] = val
    return fn(**args, **dict(static, implementation="cudnn"))
