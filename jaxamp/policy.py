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

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax.numpy as jnp
import jmp
import numpy as np

from jaxamp import policy_spec

__all__ = ["DTYPE_NAMES", "MatmulPolicy", "check_state_dtype", "get_policy", "matmul_dtype",
           "opt_state_dtype", "policy_to_str"]

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


@dataclasses.dataclass(frozen=True)
class MatmulPolicy(jmp.Policy):
    """A :class:`jmp.Policy` that also says which dtype the matmuls run in, and which dtype the
    optimizer state is stored in: jaxamp's two extra keys, ``matmul=`` and ``opt_state=``.

    ``matmul_dtype``: ``jnp.float8_e4m3fn`` runs every *eligible* ``dot_general`` of the
    region in FP8 (:mod:`jaxamp.fp8`: E4M3 forward operands, E5M2 output gradients, per-tensor
    current scaling, the result in the compute dtype; the others stay in the compute dtype and
    the audit says why); a floating dtype runs the region's matmuls in it instead of the
    compute dtype; None is a plain policy (matmuls in the compute dtype).

    ``opt_state_dtype``: ``jnp.bfloat16`` or ``jnp.float32``, the dtype the train step stores
    the optimizer's floating state in (:func:`jaxamp.amp`'s ``state_dtype=``: it computes in
    float32 and writes bfloat16 back with stochastic rounding); None, the state as the
    optimizer makes it. It belongs to the state's policy (:meth:`jaxamp.TrainState.create`),
    not to a module's: an override that sets it is refused.

    Everything that takes a :class:`jmp.Policy` takes it; :func:`get_policy` makes one for
    ``matmul=`` or ``opt_state=``.

    Example:
        >>> p = get_policy("params=float32,compute=bfloat16,output=float32,matmul=fp8")
        >>> type(p).__name__, policy_to_str(p)
        ('MatmulPolicy', 'params=float32,compute=bfloat16,output=float32,matmul=float8')
        >>> get_policy("p=f32,c=bf16,o=f32,opt_state=bf16").opt_state_dtype
        <class 'jax.numpy.bfloat16'>
    """

    matmul_dtype: Any = None
    opt_state_dtype: Any = None


def matmul_dtype(policy: jmp.Policy) -> Any:
    """The dtype ``policy``'s matmuls run in: its ``matmul_dtype`` if it is a
    :class:`MatmulPolicy` that sets one, else its compute dtype."""
    found = getattr(policy, "matmul_dtype", None)
    return policy.compute_dtype if found is None else found


def opt_state_dtype(policy: jmp.Policy) -> Any:
    """The dtype ``policy`` stores the optimizer state in (its ``opt_state_dtype``), or None:
    the state as the optimizer makes it."""
    return getattr(policy, "opt_state_dtype", None)


def check_state_dtype(value: Any, where: str) -> Any:
    """``value`` as the dtype an optimizer state may be stored in: ``jnp.float32``,
    ``jnp.bfloat16`` or None (a dtype, or a name the policy's ``opt_state=`` takes).

    Raises:
      ValueError: for float16 (why: :data:`jaxamp.policy_spec.OPT_STATE_FLOAT16`) and for
        anything else, naming the value and what is allowed.
    """
    if value is None:
        return None
    name = policy_spec.OPT_STATE_ALIASES.get(value.strip().lower()) \
        if isinstance(value, str) else None
    try:
        dtype = np.dtype(name or value)
    except TypeError:
        dtype = None
    if dtype == np.dtype(jnp.float32) or dtype == np.dtype(jnp.bfloat16):
        return _DTYPES[dtype.name]
    if dtype == np.dtype(jnp.float16) or (isinstance(value, str)
                                          and value.strip().lower() == policy_spec.HALF):
        raise ValueError(f"{where}: the optimizer state cannot be stored in float16, got "
                         f"{value!r}. {policy_spec.OPT_STATE_FLOAT16}")
    raise ValueError(f"{where}: the optimizer state is stored in jnp.bfloat16 or jnp.float32 "
                     f"(or None: as the optimizer makes it), got {value!r}. Example: "
                     "jaxamp.amp(optax.adamw(3e-4), state_dtype=jnp.bfloat16), or "
                     "opt_state=bfloat16 in the policy.")


def _check_matmul(names: dict[str, str], compute, spec: str,
                  inherited: jmp.Policy | None = None) -> Any:
    """The matmul dtype ``spec`` sets (None: unset); ``inherited``: the policy a string that
    sets only ``matmul=`` overrides (where its compute dtype comes from)."""
    name = names.get("matmul")
    if name is None:
        return None
    if name != policy_spec.FLOAT8:
        return _dtype(name)
    if np.dtype(compute) == np.dtype(jnp.float16):
        source = "" if inherited is None else \
            f" (from the policy it overrides, {policy_to_str(inherited)!r})"
        raise ValueError(
            f"Policy {spec!r}: matmul=float8 needs compute=bfloat16 or compute=float32, got "
            f"compute=float16{source}. FP8 matmuls return the compute dtype: float16's range (max "
            "65504) overflows where the FP8 product of two scaled tensors does not, and "
            "float16 also needs a global loss scale on top of FP8's per-tensor scales. Write "
            "'params=float32,compute=bfloat16,output=float32,matmul=float8'.")
    return jnp.float8_e4m3fn


def get_policy(spec: str | jmp.Policy) -> jmp.Policy:
    """Parses a policy string into a :class:`jmp.Policy`.

    The grammar is jmp's: either a bare dtype name, which sets params, compute and output, or
    comma-separated ``key=dtype`` parts. Keys are ``params``/``p``, ``compute``/``c`` and
    ``output``/``o``; each may appear once. Dtype names are ``float32``/``f32``/``full``,
    ``float16``/``f16``, ``bfloat16``/``bf16`` and ``half``. Names are case-insensitive and
    whitespace around parts, keys and values is ignored. Unset values default as in jmp: params
    to float32, compute to params, output to compute.

    jaxamp adds ``matmul=``: ``float8`` (``fp8``, ``f8``) returns a :class:`MatmulPolicy`
    whose eligible matmuls run in FP8 (:mod:`jaxamp.fp8`); float8 with ``compute=float16`` is
    refused (use bfloat16 compute: see :class:`MatmulPolicy`); a floating dtype runs the
    matmuls in that dtype. And ``opt_state=``: ``bfloat16`` (``bf16``) or ``float32``
    (``f32``, ``full``), the dtype the train step stores the optimizer state in
    (``float16``/``half`` are refused: see :data:`jaxamp.policy_spec.OPT_STATE_FLOAT16`).
    Without either the result is a plain :class:`jmp.Policy`.

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
    compute = _dtype(names["compute"])
    fields = dict(param_dtype=_dtype(names["params"]), compute_dtype=compute,
                  output_dtype=_dtype(names["output"]))
    matmul = _check_matmul(names, compute, spec)
    opt_state = _DTYPES[names["opt_state"]] if "opt_state" in names else None
    if matmul is None and opt_state is None:
        return jmp.Policy(**fields)
    return MatmulPolicy(**fields, matmul_dtype=matmul, opt_state_dtype=opt_state)


def with_matmul(policy: jmp.Policy, spec: str) -> jmp.Policy:
    """``policy`` with the ``matmul=`` of ``spec`` (a string that sets only ``matmul=``, as an
    override ``{"lm_head": "matmul=bfloat16"}`` does): its other fields unchanged."""
    names = policy_spec.parse_given(spec)
    matmul = _check_matmul(names, policy.compute_dtype, spec, inherited=policy)
    return MatmulPolicy(policy.param_dtype, policy.compute_dtype, policy.output_dtype,
                        matmul_dtype=matmul, opt_state_dtype=opt_state_dtype(policy))


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
    value = opt_state_dtype(policy)
    check_state_dtype(value, f"{type(policy).__name__} with opt_state_dtype={value!r}")


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
    matmul = getattr(policy, "matmul_dtype", None)
    if matmul is not None:
        fp8 = np.dtype(matmul) == np.dtype(jnp.float8_e4m3fn)
        name = policy_spec.FLOAT8 if fp8 else _CANONICAL_NAMES[np.dtype(matmul)]
        names.append(f"matmul={name}")
    opt_state = opt_state_dtype(policy)
    if opt_state is not None:
        names.append(f"opt_state={_CANONICAL_NAMES[np.dtype(opt_state)]}")
    return ",".join(names)
