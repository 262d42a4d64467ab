"""Fused attention under autocast: ``jax.nn.dot_product_attention`` re-dispatched in the
compute dtype.

autocast traces a model in float32, and in float32 ``jax.nn.dot_product_attention`` can only
take its XLA path (``implementation="cudnn"`` refuses float32 outright). So while autocast
traces, a call of ``jax.nn.dot_product_attention`` is recorded instead: its static arguments
are kept, and its array arguments go through a ``jax.jit`` call named
``jaxamp_attention_<call>_<k>`` (traced with the XLA path). When autocast re-evaluates the
program and meets that call, :func:`wants_cudnn` decides:

* ``implementation="cudnn"``, or ``None`` for a GPU (the platform the step is traced for:
  ``jax.default_device`` when set, as :func:`jaxamp.gpu_program` and a step with inputs on a
  GPU set it, else JAX's default backend): the real ``jax.nn.dot_product_attention``
  is bound again with ``implementation="cudnn"`` on query/key/value (and a float bias) cast to
  the region's compute dtype: cuDNN's fused flash-attention kernel, whose softmax statistics
  are float32. For ``None``, a configuration cuDNN refuses (at trace time) falls back to:
* otherwise (``"xla"``, or ``None`` elsewhere): the recorded XLA path is re-evaluated like
  any other code: its matmuls, forward and backward, in the compute dtype, its softmax in
  float32. (Binding JAX's XLA path on low-precision inputs instead would keep its float32
  logits, whose backward matmuls then mix float32 and float16 operands.)

Only calls made through the attribute ``jax.nn.dot_product_attention`` at call time are seen
(a reference taken earlier, ``from jax.nn import dot_product_attention``, is not). While at
least one autocast trace runs, the attribute is a wrapper of whatever it was before (JAX's
function, or another library's wrapper of it, which recording and re-dispatch then call
through); the wrapper behaves as the function it wraps in every thread that is not tracing
under autocast. When the last trace ends the attribute is put back, unless someone replaced it
meanwhile: then their function stays (it may call ours, which passes calls through).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from typing import Any

import jax

from jaxamp._engine.compat import target_platform

ORIGINAL = jax.nn.dot_product_attention
_SIGNATURE = inspect.signature(ORIGINAL)


def jit_name(call: int, index: int) -> str:
    """The jit name of recorded call ``index`` of autocast call ``call`` (looked up, not parsed)."""
    return f"jaxamp_attention_{call}_{index}"


#: Array arguments cast to the compute dtype (masks and sequence lengths are not floats).
CAST_ARGUMENTS = frozenset({"query", "key", "value", "bias"})

_local = threading.local()
_lock = threading.Lock()
_active = 0
_installed = None  # our wrapper while installed
_replaced = None  # what it replaced


class Recorder:
    """The fused-attention calls of one autocast trace: ``(array argument names, static
    keyword arguments, the function recorded through)`` per call, in order."""

    def __init__(self, call: int):
        self.call = call
        self.calls: list[tuple[tuple[str, ...], dict[str, Any], Any]] = []


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _wrapper(previous):
    """A ``jax.nn.dot_product_attention`` that records calls made under autocast's trace in
    this thread and otherwise calls ``previous``."""

    def dot_product_attention(*args, **kwargs):
        stack = getattr(_local, "stack", None)
        if not stack or getattr(_local, "busy", False):
            return previous(*args, **kwargs)
        recorder = stack[-1]
        bound = _SIGNATURE.bind(*args, **kwargs)
        arrays = {n: v for n, v in bound.arguments.items() if _is_array(v)}
        static = {n: v for n, v in bound.arguments.items() if n not in arrays}
        traced = dict(static, implementation="xla")  # float32 can only take the XLA path
        names = tuple(arrays)

        def attention(*vals):
            _local.busy = True  # a wrapper below ours that calls ours again passes through
            try:
                return previous(**dict(zip(names, vals)), **traced)
            finally:
                _local.busy = False

        attention.__name__ = jit_name(recorder.call, len(recorder.calls))
        recorder.calls.append((names, static, previous))
        return jax.jit(attention)(*arrays.values())

    dot_product_attention.__wrapped__ = previous
    dot_product_attention.__doc__ = getattr(previous, "__doc__", None)
    return dot_product_attention


@contextlib.contextmanager
def recording(recorder: Recorder):
    """Records this thread's ``jax.nn.dot_product_attention`` calls into ``recorder``."""
    global _active, _installed, _replaced
    with _lock:
        if _active == 0:
            _replaced = jax.nn.dot_product_attention
            _installed = jax.nn.dot_product_attention = _wrapper(_replaced)
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
                if jax.nn.dot_product_attention is _installed:  # else someone built on it
                    jax.nn.dot_product_attention = _replaced
                _installed = _replaced = None


def wants_cudnn(static: dict[str, Any]) -> bool:
    """Whether a recorded call is bound again as cuDNN's fused kernel (see the module doc)."""
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
