"""Every fact jaxamp keeps about JAX primitives by name, in one place (a second copy of a list
drifts: before this registry nine names had stopped being primitives of any supported JAX).
``tests/test_primitives.py`` checks every name against the installed JAX; names of some
versions only are in :data:`VERSIONED`. This module imports nothing.
"""

from __future__ import annotations

__all__ = ["AS_TRACED", "CALLS", "CONTAINERS", "FP32", "FP8_MATMUL", "IDENTITY", "IN_LINE",
           "LEADING_SUMS", "LOOPS", "MATMUL", "NEVER_RECOMPUTED", "NOT_ELEMENTWISE", "PARAM_READS",
           "PROMOTE", "REMAT", "SELF_DERIVED", "SOFTMAX", "STATISTICS", "STRUCTURAL", "SUM",
           "TRANSPARENT", "VERSIONED", "all_names"]

# ---- op classes: the defaults of jaxamp.rules.OpRules ----------------------------------------

#: Run in the region's compute dtype.
MATMUL = frozenset({"dot_general", "conv_general_dilated", "ragged_dot_general"})

#: Run in float32.
FP32 = frozenset({
    # exponentials, logarithms and the functions built on them (softmax, logsumexp, sigmoid)
    "exp", "exp2", "expm1", "log", "log1p", "log2", "pow", "rsqrt", "logistic", "tan", "acos",
    "asin", "acosh", "asinh", "atanh", "cosh", "sinh", "polynomial",
    # special functions
    "erf_inv", "lgamma", "digamma", "igamma", "igammac", "igamma_grad_a", "polygamma", "zeta",
    "bessel_i0e", "bessel_i1e", "regularized_incomplete_beta", "random_gamma",
    # sums (reductions, cumulative sums, average pooling, cross-device sums)
    "reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp", "reduce_window_sum",
    "psum", "psum_invariant", "reduce_scatter",
    # linear algebra and transforms (no float16 kernels; conditioning needs float32)
    "cholesky", "eig", "eigh", "lu", "qr", "svd", "schur", "hessenberg",
    "householder_product", "triangular_solve", "tridiagonal", "tridiagonal_solve", "fft",
    "symmetric_product",
})

#: The ``FP32`` primitives behind softmax, log-softmax and logsumexp, and the accumulating ones
#: (sums): the groups the audit names in its advice ("softmax exp/log ran in low precision",
#: "accumulating reductions ran in low precision"). Both are subsets of :data:`FP32`.
SOFTMAX = frozenset({"exp", "exp2", "expm1", "log", "log1p", "log2", "cumlogsumexp"})
SUM = frozenset({"reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp"})

#: Keep the operand's dtype (they move or select values, rounding nothing).
STRUCTURAL = frozenset({
    "reshape", "broadcast_in_dim", "transpose", "squeeze", "slice",
    "dynamic_slice", "gather", "rev", "copy", "reduce_max", "reduce_min", "argmax",
    "argmin", "stop_gradient", "sharding_constraint", "split", "unstack", "real", "imag",
    # max/min pooling and running maxima, top-k: they select values, rounding nothing
    "reduce_window_max", "reduce_window_min", "cummax", "cummin", "top_k", "approx_top_k",
    # data movement between devices
    "device_put", "all_gather", "all_to_all", "ppermute", "ragged_all_to_all", "pmax", "pmin",
    "all_gather_invariant",
    "pvary",  # shard_map: marks a replicated value as varying, the value unchanged
    "tile",  # jnp.tile (jax 0.10-0.12): copies of the operand
})

#: Run in the widest activation dtype among the operands.
PROMOTE = frozenset({
    "add", "add_any", "sub", "mul", "div", "rem", "max", "min", "neg", "abs", "sign", "floor",
    "ceil", "round", "nextafter", "atan2", "sqrt", "cbrt", "square", "integer_pow", "tanh",
    "one_minus_square", "sin", "cos", "atan", "erf", "erfc", "is_finite", "select_n", "clamp",
    "concatenate", "stack", "pad", "dynamic_update_slice", "eq", "ne", "lt", "le", "gt", "ge",
    "optimization_barrier", "reduce_precision",
})

#: Known to run exactly as traced: integer and bit operations, random numbers, typed
#: sub-computations (scatter, sort, generic reduce), effects and references, and the
#: higher-order primitives that autocast re-evaluates itself (jit, scan, cond, ...).
AS_TRACED = frozenset({
    "and", "or", "not", "xor", "shift_left", "shift_right_arithmetic", "shift_right_logical",
    "population_count", "clz", "bitcast_convert_type", "iota", "eq_to", "le_to", "lt_to",
    "random_bits", "random_clone", "random_fold_in", "random_seed", "random_split", "random_wrap",
    "random_unwrap", "threefry2x32", "rng_bit_generator", "rng_uniform",
    "scatter", "scatter-add", "scatter-mul", "scatter-min", "scatter-max", "sort", "reduce",
    "reduce_and", "reduce_or", "reduce_xor", "reduce_window", "select_and_gather_add",
    "select_and_scatter", "select_and_scatter_add", "complex", "conj", "after_all",
    "create_token", "axis_index", "empty2", "get", "swap", "name", "convert_element_type",
    "custom_lin", "custom_linear_solve", "jit", "closed_call", "call", "remat2", "scan",
    "while", "cond", "custom_jvp_call", "custom_vjp_call", "eval_jaxpr", "shard_map",
    # reached from jnp/lax functions without being exported (jnp.corrcoef's platform_index,
    # jnp.empty_like's empty and jnp.frexp's call_hi_primitive in jax 0.12), integer
    # arithmetic, DCE bookkeeping, and block-scaled matmuls of operands the user quantised
    "platform_index", "empty", "call_hi_primitive", "mulhi", "dce_sink", "scaled_dot",
})

#: "promote" primitives whose operands are not broadcast elementwise to the output's shape.
NOT_ELEMENTWISE = frozenset({"concatenate", "stack", "pad", "dynamic_update_slice", "select_n",
                             "clamp"})

# ---- calls and control flow -------------------------------------------------------------------

#: Calls of a jaxpr that the interpreter evaluates in line, in the caller's context.
CALLS = frozenset({"jit", "closed_call"})
#: ``jax.checkpoint`` (``remat``).
REMAT = frozenset({"remat2"})
#: Loops: their bodies run once per iteration.
LOOPS = frozenset({"scan", "while"})
#: Higher-order primitives whose sub-jaxprs are programs run on the equation's operands.
CONTAINERS = CALLS | REMAT | LOOPS | frozenset({
    "custom_jvp_call", "custom_vjp_call", "cond", "shard_map", "custom_lin"})
#: Calls whose body runs once, in line, on the caller's values (a recompute segment is a
#: checkpoint): across them a value is one value. Loop bodies and branches are not.
IN_LINE = CALLS | REMAT | frozenset({"custom_jvp_call", "custom_vjp_call"})
#: First-order primitives whose outputs are their operands' values (``optimization_barrier``:
#: recompute reads its low-precision inputs through one).
IDENTITY = frozenset({"optimization_barrier"})

# ---- recompute --------------------------------------------------------------------------------

#: Calls whose inside is recomputable when each of their equations is.
TRANSPARENT = CALLS | frozenset({"custom_jvp_call"})
#: Never recomputed: communication (a collective run again in the backward costs a second
#: exchange), effects and references, user-named residuals, barriers, and sub-computations
#: that are costly or have their own derivative rules.
NEVER_RECOMPUTED = frozenset({
    "psum", "psum_invariant", "pmax", "pmin", "all_gather", "all_gather_invariant",
    "all_to_all", "ppermute", "ragged_all_to_all", "reduce_scatter", "axis_index", "pvary",
    "device_put", "sharding_constraint", "optimization_barrier", "name", "after_all",
    "create_token", "get", "swap", "empty2", "custom_lin", "custom_linear_solve",
    "custom_vjp_call", "sort", "top_k", "approx_top_k", "scatter", "scatter-add",
    "scatter-mul", "scatter-min", "scatter-max", "rng_bit_generator", "rng_uniform",
    "select_and_scatter_add", "select_and_gather_add", "cholesky", "eig", "eigh", "lu", "qr",
    "svd", "schur", "hessenberg", "triangular_solve", "tridiagonal_solve", "fft",
})
#: Reductions whose float outputs are row statistics (kept, not recomputed).
STATISTICS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax",
                        "argmin"})
#: A segment's first equation left out of it when it adds a matmul's output to a same-shape
#: array (a residual stream's ``x + h``): outside, the add keeps nothing (README, Recompute).
LEADING_SUMS = frozenset({"add", "add_any", "sub"})
#: Ops whose derivative reads only their output (``1 - tanh(x)**2``): ending a segment before
#: matmuls, one is a segment of its own that keeps that output (README, Recompute).
SELF_DERIVED = frozenset({"tanh"})


# ---- params -----------------------------------------------------------------------------------

#: What a param goes through between its read and a matmul (still "the param").
PARAM_READS = frozenset({"reshape", "transpose", "convert_element_type", "broadcast_in_dim",
                         "squeeze", "copy", "slice"})
#: The matmul the FP8 rule runs: the first and last of a program, and the scans over stacked
#: layers ``Context.layers_in_place`` evaluates layer by layer, are found among these.
FP8_MATMUL = frozenset({"dot_general"})

# ---- versions ---------------------------------------------------------------------------------

#: Names that are primitives in some supported JAX versions only: name -> (first version that
#: has it, first version checked without it), ``None`` for no bound. Checked on 0.10.2 and
#: 0.12.0.1 (``log2`` is new in 0.11; in 0.12 ``closed_call`` is ``eval_jaxpr``).
VERSIONED: dict[str, tuple[tuple[int, ...] | None, tuple[int, ...] | None]] = {
    "log2": ((0, 11), None),
    "polynomial": ((0, 12), None),
    "one_minus_square": ((0, 12), None),
    "closed_call": (None, (0, 12)),
    "call": (None, (0, 12)),
}


def all_names() -> frozenset[str]:
    """Every primitive name in this registry."""
    return frozenset().union(*(v for k, v in globals().items()
                               if k.isupper() and isinstance(v, frozenset)))
