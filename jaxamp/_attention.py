"""Fused attention under autocast: ``jax.nn.dot_product_attention`` re-dispatched in the
compute dtype.

autocast traces a model in float32, and in float32 ``jax.nn.dot_product_attention`` can only
take its XLA path (``implementation="cudnn"`` refuses float32 outright). So while autocast
traces, a call of ``jax.nn.dot_product_attention`` is recorded instead: its static arguments
are kept, and its array arguments go through a ``jax.jit`` call named
``jaxamp_attention_<call>_<k>`` (traced with the XLA path). When autocast re-evaluates the
program and meets that call, :func:`wants_cudnn` decides:

* ``implementation="cudnn"``, or ``None`` on a GPU: the real ``jax.nn.dot_product_attention``
  is bound again with ``implementation="cudnn"`` on query/key/value (and a float bias) cast to
  the region's compute dtype: cuDNN's fused flash-attention kernel, whose softmax statistics
  are float32. For ``None``, a configuration cuDNN refuses (at trace time) falls back to:
* otherwise (``"xla"``, or ``None`` elsewhere): the recorded XLA path is re-evaluated like
  any other code: its matmuls, forward and backward, in the compute dtype, its softmax in
  float32. (Binding JAX's XLA path on low-precision inputs instead would keep its float32
  logits, whose backward matmuls then mix float32 and float16 operands.)

Only calls made through the attribute ``jax.nn.dot_product_attention`` at call time are seen
(a reference taken earlier, ``from jax.nn import dot_product_attention``, is not); the
attribute is replaced while at least one autocast trace runs, and the replacement behaves as
the original in every thread that is not tracing under autocast.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import threading
from typing import Any

import jax

ORIGINAL = jax.nn.dot_product_attention
_SIGNATURE = inspect.signature(ORIGINAL)
#: The name of the recorded call: ``jaxamp_attention_<autocast call>_<index>``.
CALL_NAME = re.compile(r"jaxamp_attention_(\d+)_(\d+)")
#: Array arguments cast to the compute dtype (masks and sequence lengths are not floats).
CAST_ARGUMENTS = frozenset({"query", "key", "value", "bias"})

_local = threading.local()
_lock = threading.Lock()
_active = 0


class Recorder:
    """The fused-attention calls of one autocast trace: ``(array argument names, static
    keyword arguments)`` per call, in order."""

    def __init__(self, call: int):
        self.call = call
        self.calls: list[tuple[tuple[str, ...], dict[str, Any]]] = []


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _dot_product_attention(*args, **kwargs):
    stack = getattr(_local, "stack", None)
    if not stack:
        return ORIGINAL(*args, **kwargs)
    recorder = stack[-1]
    bound = _SIGNATURE.bind(*args, **kwargs)
    arrays = {n: v for n, v in bound.arguments.items() if _is_array(v)}
    static = {n: v for n, v in bound.arguments.items() if n not in arrays}
    traced = dict(static, implementation="xla")  # float32 can only take the XLA path
    names = tuple(arrays)

    def attention(*vals):
        return ORIGINAL(**dict(zip(names, vals)), **traced)

    attention.__name__ = f"jaxamp_attention_{recorder.call}_{len(recorder.calls)}"
    recorder.calls.append((names, static))
    return jax.jit(attention)(*arrays.values())


@contextlib.contextmanager
def recording(recorder: Recorder):
    """Records this thread's ``jax.nn.dot_product_attention`` calls into ``recorder``."""
    global _active
    with _lock:
        if _active == 0:
            jax.nn.dot_product_attention = _dot_product_attention
        _active += 1
    stack = _local.__dict__.setdefault("stack", [])
    stack.append(recorder)
    try:
        yield
    finally:
        stack.pop()
        with _lock:
            _active -= 1
            if _active == 0:
                jax.nn.dot_product_attention = ORIGINAL


def wants_cudnn(static: dict[str, Any]) -> bool:
    """Whether a recorded call is bound again as cuDNN's fused kernel (see the module doc)."""
    implementation = static.get("implementation")
    return implementation == "cudnn" or (implementation is None
                                         and jax.default_backend() == "gpu")


def redispatch(names: tuple[str, ...], static: dict[str, Any], vals: list, compute_dtype):
    """The recorded call bound as cuDNN attention, its float query/key/value/bias in
    ``compute_dtype``. Raises what JAX raises for a configuration cuDNN does not support."""
    args = {}
    for name, val in zip(names, vals):
        if name in CAST_ARGUMENTS and jax.numpy.issubdtype(val.dtype, jax.numpy.floating):
            val = val.astype(compute_dtype)
        args[name] = val
    return ORIGINAL(**args, **dict(static, implementation="cudnn"))
