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

__all__ = ["DTYPE_NAMES", "get_policy", "policy_to_str"]

DTYPE_NAMES: Mapping[str, Any] = MappingProxyType(
    {
        "float32": jnp.float32,
        "f32": jnp.float32,
        "full": jnp.float32,
        "float16": jnp.float16,
        "f16": jnp.float16,
        "bfloat16": jnp.bfloat16,
        "bf16": jnp.bfloat16,
    }
)
"""Read-only mapping from dtype name to the dtype jmp uses (``jnp.float32`` etc.).

``"half"`` is also accepted by :func:`get_policy` but is not in this mapping because it depends
on the backend (see :func:`get_policy`). Names are matched case-insensitively.
"""

_HALF = "half"
_KEYS = {
    "params": "params",
    "p": "params",
    "compute": "compute",
    "c": "compute",
    "output": "output",
    "o": "output",
}
_CANONICAL_NAMES = {
    np.dtype(jnp.float32): "float32",
    np.dtype(jnp.float16): "float16",
    np.dtype(jnp.bfloat16): "bfloat16",
}
_NON_FLOAT_NAMES = frozenset(
    {"bool", "complex64", "complex128", "c64", "c128"}
    | {f"{p}{n}" for p in ("int", "uint", "i", "u") for n in (4, 8, 16, 32, 64)}
)
_FLOAT64_NAMES = frozenset({"float64", "f64", "double"})

_ALLOWED_KEYS = "Allowed keys: params/p, compute/c, output/o."
_ALLOWED_DTYPES = "Allowed dtypes: float32/f32/full, float16/f16, bfloat16/bf16, half."
_EXAMPLE = "Example: 'params=float32,compute=float16,output=float32'."


def _error(message: str, *hints: str) -> ValueError:
    return ValueError(" ".join((message, *hints, _EXAMPLE)))


def _parse_dtype(value: str, part: str, spec: str) -> Any:
    name = value.strip().lower()
    where = f"'{value.strip()}' in '{part.strip()}'"
    if not name:
        raise _error(f"Empty dtype in '{part.strip()}' of '{spec}'.", _ALLOWED_DTYPES)
    if name == _HALF:
        return jmp.half_dtype()
    if name in DTYPE_NAMES:
        return DTYPE_NAMES[name]
    if name in _FLOAT64_NAMES:
        raise _error(
            f"Unsupported dtype {where}: JAX computes in float64 only with jax_enable_x64, "
            "and mixed precision has no use for it.",
            _ALLOWED_DTYPES,
        )
    if name in _NON_FLOAT_NAMES:
        raise _error(
            f"Dtype {where} is not a floating type; policies only cast floating-point values.",
            _ALLOWED_DTYPES,
        )
    raise _error(f"Unknown dtype {where}.", _ALLOWED_DTYPES)


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

    Args:
        spec: A policy string, or a :class:`jmp.Policy`, which is returned unchanged.

    Returns:
        The policy, with dtypes ``jnp.float32``, ``jnp.float16`` or ``jnp.bfloat16`` so that it
        compares equal to the policy :func:`jmp.get_policy` returns for the same string.

    Raises:
        TypeError: If ``spec`` is neither a string nor a :class:`jmp.Policy`.
        ValueError: If the string is malformed; the message names the bad part, the allowed
            keys or dtypes and gives a valid example.

    Example:
        >>> p = get_policy("c=f16")
        >>> p.param_dtype, p.compute_dtype, p.output_dtype
        (<class 'jax.numpy.float32'>, <class 'jax.numpy.float16'>, <class 'jax.numpy.float16'>)
        >>> get_policy(" params = f32 , compute=bf16 ") == get_policy("p=f32,c=bf16,o=bf16")
        True
    """
    if isinstance(spec, jmp.Policy):
        return spec
    if not isinstance(spec, str):
        raise TypeError(
            f"Policy must be a str or jmp.Policy, got {type(spec).__name__}: {spec!r}. {_EXAMPLE}"
        )
    if not spec.strip():
        raise _error(
            f"Empty policy string {spec!r}.",
            "Give a dtype name or comma-separated key=dtype parts.",
            _ALLOWED_KEYS,
            _ALLOWED_DTYPES,
        )

    if "=" not in spec and "," not in spec:
        dtype = _parse_dtype(spec, spec, spec)
        return jmp.Policy(param_dtype=dtype, compute_dtype=dtype, output_dtype=dtype)

    dtypes: dict[str, Any] = {}
    seen: dict[str, str] = {}
    for index, part in enumerate(spec.split(","), start=1):
        if not part.strip():
            raise _error(
                f"Empty part #{index} in '{spec}' (stray or trailing comma?).",
                "Each part must be key=dtype.",
                _ALLOWED_KEYS,
            )
        if part.count("=") != 1:
            problem = "has more than one '=' (missing comma?)" if "=" in part else "is missing '='"
            raise _error(
                f"Part '{part.strip()}' in '{spec}' {problem}; each part must be key=dtype.",
                _ALLOWED_KEYS,
                _ALLOWED_DTYPES,
            )
        raw_key, value = part.split("=")
        key = raw_key.strip().lower()
        if not key:
            raise _error(f"Empty key in '{part.strip()}' of '{spec}'.", _ALLOWED_KEYS)
        if key not in _KEYS:
            raise _error(
                f"Unknown policy key '{raw_key.strip()}' in '{part.strip()}'.", _ALLOWED_KEYS
            )
        field = _KEYS[key]
        if field in seen:
            raise _error(
                f"Duplicate policy key '{raw_key.strip()}' in '{spec}': {field} is already set "
                f"by '{seen[field]}'. Each of params/p, compute/c, output/o may appear once."
            )
        seen[field] = part.strip()
        dtypes[field] = _parse_dtype(value, part, spec)

    params = dtypes.get("params", jnp.float32)
    compute = dtypes.get("compute", params)
    output = dtypes.get("output", compute)
    return jmp.Policy(param_dtype=params, compute_dtype=compute, output_dtype=output)


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
            raise ValueError(
                f"The {field} dtype {dtype!r} has no policy-string name. {_ALLOWED_DTYPES}"
            ) from None
    return ",".join(names)
