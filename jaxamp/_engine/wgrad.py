"""Low-precision matmuls and convolutions whose weight gradient is computed, and summed across
devices, in float32 (autocast's ``f32_weight_grads``; why: jaxamp/_engine/README.md, "Float32
weight gradients")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._engine.compat import target_platform

_F32 = np.dtype(np.float32)


def _cpu_lacks_bf16_f32_dot(x) -> bool:
    """XLA:CPU fails on some ``bf16 x bf16 -> f32`` dots and convolutions ("Unsupported element
    type for DotThunk::Execute", jaxlib 0.10 and 0.12): there the operands are cast up first
    (the same numbers: it computes bfloat16 products in float32 anyway)."""
    return np.dtype(x.dtype) == np.dtype(jnp.bfloat16) and target_platform() == "cpu"


def _algorithm(dtype):
    """The dot algorithm of a ``dtype`` x ``dtype`` -> float32 product (None on XLA:CPU)."""
    if target_platform() == "cpu":
        return None  # see _cpu_lacks_bf16_f32_dot: the mixed dot is lowered in float32
    presets = {np.dtype(jnp.bfloat16): lax.DotAlgorithmPreset.BF16_BF16_F32,
               np.dtype(jnp.float16): lax.DotAlgorithmPreset.F16_F16_F32}
    return presets.get(np.dtype(dtype))


def dot_f32_weight_grads(primitive, params: dict, lhs, rhs, dtype, wide: tuple[bool, bool]):
    """``dot_general`` of ``lhs``, ``rhs`` cast to ``dtype``; the cotangent of each ``wide``
    operand (a param in its stored dtype) has a float32 output, then that operand's dtype.

    A ``jax.custom_jvp`` function (forward mode works too): its tangent in a wide operand is
    a ``dtype x dtype -> float32`` dot, which JAX transposes into the weight gradient."""
    dtype = np.dtype(dtype)
    dn = params["dimension_numbers"]
    algorithm = _algorithm(dtype)

    def low(a):
        return lax.convert_element_type(a, dtype)

    @jax.custom_jvp
    def fn(a, b):
        return primitive.bind(low(a), low(b), **params)

    def jvp(primals, tangents):
        ops = [low(x) for x in primals]
        out = primitive.bind(*ops, **params)
        t_out = None
        for i, t in enumerate(tangents):
            if isinstance(t, jax.custom_derivatives.SymbolicZero):
                continue
            args = list(ops)
            if wide[i]:
                args[i] = t
                term = low(lax.dot_general(*args, dn, precision=algorithm,
                                           preferred_element_type=_F32))
            else:
                args[i] = low(t)
                term = primitive.bind(*args, **params)
            t_out = term if t_out is None else t_out + term
        if t_out is None:  # pragma: no cover - JAX calls the rule with a nonzero tangent
            t_out = jnp.zeros(out.shape, out.dtype)
        return out, t_out

    fn.defjvp(jvp, symbolic_zeros=True)
    return fn(lhs, rhs)


def _dilate(shape, dilation):
    return tuple(0 if d == 0 else 1 + r * (d - 1) for d, r in zip(shape, dilation))


def _conv_kernel_transpose(g, lhs, kernel_shape, params, out_dtype):
    """The kernel cotangent of ``conv_general_dilated(lhs, kernel, **params)`` with an
    ``out_dtype`` output: JAX's transpose rule, restated with the public API."""
    dn = params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn
    feature_groups, batch_groups = params["feature_group_count"], params["batch_group_count"]
    if batch_groups > 1:
        feature_groups, batch_groups = batch_groups, 1
    elif feature_groups > 1:
        feature_groups, batch_groups = 1, feature_groups
    swap = lambda spec: (spec[1], spec[0]) + tuple(spec[2:])  # noqa: E731
    trans = lax.ConvDimensionNumbers(swap(lhs_spec), swap(out_spec), swap(rhs_spec))
    in_shape = [np.shape(lhs)[i] for i in lhs_spec[2:]]
    window = [kernel_shape[i] for i in rhs_spec[2:]]
    out_shape = [np.shape(g)[i] for i in out_spec[2:]]
    strides, rhs_dilation = params["window_strides"], params["rhs_dilation"]
    lhs_dilation = params["lhs_dilation"]
    pads_lo = [lo for lo, _ in params["padding"]]
    from_lhs = [o - i for o, i in zip(_dilate(out_shape, strides), _dilate(in_shape, lhs_dilation))]
    from_rhs = [r - p - 1 for r, p in zip(_dilate(window, rhs_dilation), pads_lo)]
    padding = [(lo, a + b) for lo, a, b in zip(pads_lo, from_lhs, from_rhs)]
    if _cpu_lacks_bf16_f32_dot(g):
        g, lhs = lax.convert_element_type(g, _F32), lax.convert_element_type(lhs, _F32)
    return lax.conv_general_dilated(
        lhs, g, window_strides=rhs_dilation, padding=padding, lhs_dilation=lhs_dilation,
        rhs_dilation=strides, dimension_numbers=trans, feature_group_count=feature_groups,
        batch_group_count=batch_groups, precision=params.get("precision"),
        preferred_element_type=out_dtype)


def conv_f32_kernel_grads(primitive, params: dict, lhs, kernel, dtype):
    """``conv_general_dilated`` of ``lhs``, ``kernel`` cast to ``dtype``; the kernel cotangent
    has a float32 output, then the kernel's dtype. A ``jax.custom_vjp`` function (reverse
    mode only: a convolution's transpose casts its input to the cotangent's dtype, so no
    ``custom_jvp`` keeps low-precision operands with a float32 output)."""
    dtype = np.dtype(dtype)
    kernel_dtype, kernel_shape = np.dtype(kernel.dtype), np.shape(kernel)

    def low(a):
        return lax.convert_element_type(a, dtype)

    def forward(a, k):
        return primitive.bind(low(a), low(k), **params)

    fn = jax.custom_vjp(forward)
    perturbed = [True, True]  # which operands are differentiated (known when fwd is traced)

    def fwd(a, k):
        perturbed[:] = [a.perturbed, k.perturbed]
        a, k = low(a.value), low(k.value)
        return primitive.bind(a, k, **params), (a, k)

    def bwd(res, g):
        a, k = res
        if isinstance(g, jax.custom_derivatives.SymbolicZero):
            g = jnp.zeros(g.shape, dtype)
        g = low(g)
        ct_a = ct_k = None
        if perturbed[0]:
            _, pullback = jax.vjp(lambda x: primitive.bind(x, k, **params), a)
            (ct_a,) = pullback(g)
        if perturbed[1]:
            ct_k = lax.convert_element_type(
                _conv_kernel_transpose(g, a, kernel_shape, params, _F32), kernel_dtype)
        return ct_a, ct_k

    fn.defvjp(fwd, bwd, symbolic_zeros=True)
    return fn(lhs, kernel)
