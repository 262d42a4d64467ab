"""Mixed-precision policy strings.

A policy says which dtype parameters are stored in, which dtype a module computes in, and which
dtype its outputs are cast to. Policies are plain :class:`jmp.Policy` objects, so everything here
interoperates with jmp; this module adds a stricter parser with helpful error messages and a
canonical writer.

Example:
    >>> from jaxamp.policy import get_policy, policy_to_str
    >>> policy_to_str(get_policy("p=f32,c=bf16,o=f32"))
    'params=float32,compute=bfloat16,output=float32'
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax.numpy as jnp
import jmp
import numpy as np

from jaxamp import policy_spec

__all__ = ["DTYPE_NAMES", "get_policy", "policy_to_str"]

_DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}

DTYPE_NAMES: Mapping[str, Any] = MappingProxyType(
    {name: _DTYPES[canonical] for name, canonical in policy_spec.DTYPE_ALIASES.items()})
"""Read-only mapping from dtype name to the dtype jmp uses (``jnp.float32`` etc.).

``"half"`` is also accepted by :func:`get_policy` but is not in this mapping because it depends
on the backend (see :func:`get_policy`). Names are matched case-insensitively.
"""

_CANONICAL_NAMES = {
    np.dtype(jnp.float32): "float32",
    np.dtype(jnp.float16): "float16",
    np.dtype(jnp.bfloat16): "bfloat16",
}


def _dtype(name: str) -> Any:
    return jmp.half_dtype() if name == policy_spec.HALF else _DTYPES[name]


def get_policy(spec: str | jmp.Policy) -> jmp.Policy:
    """Parses a policy string into a :class:`jmp.Policy`.

    The grammar is jmp's: either a bare dtype name, which sets params, compute and output, or
    comma-separated ``key=dtype`` parts. Keys are ``params``/``p``, ``compute``/``c`` and
    ``output``/``o``; each may appear once. Dtype names are ``float32``/``f32``/``full``,
    ``float16``/``f16``, ``bfloat16``/``bf16`` and ``half``. Names are case-insensitive and
    whitespace around parts, keys and values is ignored. Unset values default as in jmp: params
    to float32, compute to params, output to compute.

    ``half`` is resolved when the string is parsed, from the platform of the first local device
    (the same rule as :func:`jmp.half_dtype`):

    * TPU: ``bfloat16``.
    * GPU: ``float16``.
    * CPU: ``float16``.

    Write ``bf16`` or ``f16`` explicitly if the policy must not depend on the backend.

    float64 is rejected: JAX only computes in float64 with ``jax_enable_x64`` and mixed precision
    has no use for it.

    A :class:`jmp.Policy` is returned unchanged once its three dtypes are checked to be floating
    point: jmp builds a policy with ``compute_dtype=jnp.int8`` without a word, and casting
    params or activations to an integer type would fail deep inside the model (or truncate).

    Args:
        spec: A policy string, or a :class:`jmp.Policy`, which is returned unchanged.

    Returns:
        The policy, with dtypes ``jnp.float32``, ``jnp.float16`` or ``jnp.bfloat16`` so that it
        compares equal to the policy :func:`jmp.get_policy` returns for the same string.

    Raises:
        TypeError: If ``spec`` is neither a string nor a :class:`jmp.Policy`.
        ValueError: If the string is malformed, or a :class:`jmp.Policy` has a dtype that is
            not floating point; the message names the bad part, the allowed keys or dtypes
            and gives a valid example.

    Example:
        >>> p = get_policy("c=f16")
        >>> p.param_dtype, p.compute_dtype, p.output_dtype
        (<class 'jax.numpy.float32'>, <class 'jax.numpy.float16'>, <class 'jax.numpy.float16'>)
        >>> get_policy(" params = f32 , compute=bf16 ") == get_policy("p=f32,c=bf16,o=bf16")
        True
    """
    if isinstance(spec, jmp.Policy):
        _check_float_policy(spec)
        return spec
    names = policy_spec.parse(spec)
    return jmp.Policy(param_dtype=_dtype(names["params"]), compute_dtype=_dtype(names["compute"]),
                      output_dtype=_dtype(names["output"]))


def _check_float_policy(policy: jmp.Policy) -> None:
    for field, attr in (("params", "param_dtype"), ("compute", "compute_dtype"),
                        ("output", "output_dtype")):
        value = getattr(policy, attr)
        try:
            dtype = np.dtype(value)
        except TypeError:
            dtype = None
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            shown = dtype.name if dtype is not None else repr(value)
            raise ValueError(
                f"jmp.Policy with {attr}={shown}: the {field} dtype is not a floating type; "
                "a policy casts floating-point params, activations and outputs only. Use "
                f"float32, float16 or bfloat16, e.g. jaxamp.get_policy("
                f"'params=float32,compute=float16,output=float32'). {policy_spec.ALLOWED_DTYPES}")


def policy_to_str(policy: jmp.Policy) -> str:
    """Writes a policy in the canonical full form, which :func:`get_policy` parses back.

    Args:
        policy: A :class:`jmp.Policy` whose dtypes are float32, float16 or bfloat16 (as scalar
            types such as ``jnp.float16`` or as ``np.dtype`` objects).

    Returns:
        A string such as ``"params=float32,compute=float16,output=float32"``.

    Raises:
        TypeError: If ``policy`` is not a :class:`jmp.Policy`.
        ValueError: If a dtype has no policy-string name (e.g. float64).

    Example:
        >>> policy_to_str(get_policy("bf16"))
        'params=bfloat16,compute=bfloat16,output=bfloat16'
    """
    if not isinstance(policy, jmp.Policy):
        raise TypeError(f"Expected a jmp.Policy, got {type(policy).__name__}: {policy!r}.")
    names = []
    for field, dtype in (
        ("params", policy.param_dtype),
        ("compute", policy.compute_dtype),
        ("output", policy.output_dtype),
    ):
        try:
            names.append(f"{field}={_CANONICAL_NAMES[np.dtype(dtype)]}")
        except (KeyError, TypeError):
            raise ValueError(f"The {field} dtype {dtype!r} has no policy-string name. "
                             f"{policy_spec.ALLOWED_DTYPES}") from None
    return ",".join(names)
