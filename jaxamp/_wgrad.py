"""A low-precision matmul whose weight gradient is computed, and summed, in float32.

Used by :func:`jaxamp.autocast` on a mesh (a ``jax.set_mesh`` context, which
``make_train_step(mesh=...)`` enters while tracing).

The weight gradient of ``x @ w`` is a matmul that contracts the batch (and sequence)
dimensions. When the batch is split across devices (data parallel, FSDP), that contraction is
a sum across devices, and XLA's SPMD partitioner reduces it in the matmul's output dtype. With
JAX's own transpose rule that dtype is the compute dtype (bfloat16/float16), and the cast back
to the float32 param comes after the cross-device sum. Here the weight-gradient matmul is
bound with ``preferred_element_type=float32`` instead: the same low-precision operands (the
tensor cores' float32 accumulators), a float32 output, so every partial sum, on one device or
across many, is float32. The activation gradient keeps the compute dtype.

The transpose of ``dot_general`` below is JAX's own (``jax._src.lax.lax``), restated with the
public ``lax.dot_general``.
"""

from __future__ import annotations

import contextlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_F32 = np.dtype(np.float32)


def _remaining(original, *removed_lists):
    removed = set(itertools.chain(*removed_lists))
    return [i for i in original if i not in removed]


def _ranges_like(*xs):
    start = 0
    for x in xs:
        yield range(start, start + len(x))
        start += len(x)


def _cpu_lacks_bf16_f32_dot(x) -> bool:
    """XLA:CPU fails at run time on some ``bf16 x bf16 -> f32`` dots ("Unsupported element
    type for DotThunk::Execute", jaxlib 0.10 and 0.12); it computes bfloat16 dots in float32
    anyway, so there the operands are cast up first (same numbers, same float32 sums)."""
    return np.dtype(x.dtype) == np.dtype(jnp.bfloat16) and jax.default_backend() == "cpu"


def _transpose_lhs(g, x, y, dimension_numbers, precision, out_dtype, swap_ans=False):
    """The cotangent of ``x`` in ``dot_general(x, y)``, computed with ``out_dtype`` output."""
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    x_kept = _remaining(range(np.ndim(x)), x_contract, x_batch)
    y_kept = _remaining(range(np.ndim(y)), y_contract, y_batch)
    if swap_ans:
        ans_batch, ans_y, _ = _ranges_like(x_batch, y_kept, x_kept)
    else:
        ans_batch, _, ans_y = _ranges_like(x_batch, x_kept, y_kept)
    dims = ((tuple(ans_y), tuple(y_kept)), (tuple(ans_batch), tuple(y_batch)))
    x_contract_sorted_by_y = list(np.take(x_contract, np.argsort(y_contract)))
    out_axes = np.argsort(list(x_batch) + x_kept + x_contract_sorted_by_y)
    if out_dtype is not None and _cpu_lacks_bf16_f32_dot(g):
        g, y = lax.convert_element_type(g, _F32), lax.convert_element_type(y, _F32)
    out = lax.dot_general(g, y, dims, precision=precision, preferred_element_type=out_dtype)
    return lax.transpose(out, tuple(int(a) for a in out_axes))


def _transpose_rhs(g, x, y, dimension_numbers, precision, out_dtype):
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    swapped = ((y_contract, x_contract), (y_batch, x_batch))
    return _transpose_lhs(g, y, x, swapped, precision, out_dtype, swap_ans=True)


def dot_f32_weight_grads(primitive, params: dict, lhs, rhs, dtype, wide: tuple[bool, bool],
                         context=contextlib.nullcontext):
    """``primitive`` (``dot_general``) of ``lhs``, ``rhs`` cast to ``dtype``; the cotangent
    of each operand marked ``wide`` (a stored param, passed in its stored dtype) is computed
    with float32 output, then cast to that operand's dtype; the others' in ``dtype``.
    ``context()`` is entered where the forward is traced (module paths in the name stack)."""
    dtype = np.dtype(dtype)
    in_dtypes = (np.dtype(lhs.dtype), np.dtype(rhs.dtype))
    dn, precision = params["dimension_numbers"], params.get("precision")

    def forward(a, b):
        with context():
            return primitive.bind(lax.convert_element_type(a, dtype),
                                  lax.convert_element_type(b, dtype), **params)

    fn = jax.custom_vjp(forward)
    perturbed = [True, True]  # which operands are differentiated (known when fwd is traced)

    def fwd(a, b):
        perturbed[:] = [a.perturbed, b.perturbed]
        a, b = a.value, b.value
        a, b = lax.convert_element_type(a, dtype), lax.convert_element_type(b, dtype)
        return primitive.bind(a, b, **params), (a, b)

    def bwd(res, g):
        a, b = res
        if isinstance(g, jax.custom_derivatives.SymbolicZero):
            g = jnp.zeros(g.shape, dtype)
        g = lax.convert_element_type(g, dtype)
        cts = []
        for i, transpose in enumerate((_transpose_lhs, _transpose_rhs)):
            if not perturbed[i]:  # not differentiated: no matmul for it
                cts.append(None)
                continue
            ct = transpose(g, a, b, dn, precision, _F32 if wide[i] else None)
            cts.append(lax.convert_element_type(ct, in_dtypes[i]))
        return tuple(cts)

    fn.defvjp(fwd, bwd, symbolic_zeros=True)
    return fn(lhs, rhs)
