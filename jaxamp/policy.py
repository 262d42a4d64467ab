"""Mixed-precision policies: the :class:`jmp.Policy` built once from a parsed policy string.

:func:`jaxamp.policy_spec.read` parses the string; :func:`get_policy` builds the policy JAX
needs from that value (a :class:`MatmulPolicy` for jaxamp's ``matmul=``/``opt_state=``).

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

__all__ = ["DTYPE_NAMES", "MatmulPolicy", "check_state_dtype", "fp8_recipe", "get_policy",
           "matmul_dtype", "opt_state_dtype", "policy_to_str"]

_DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}

DTYPE_NAMES: Mapping[str, Any] = MappingProxyType(
    {name: _DTYPES[canonical] for name, canonical in policy_spec.DTYPE_ALIASES.items()})
"""Read-only mapping from dtype name (lower case) to the dtype jmp uses (``jnp.float32`` etc.);
``"half"`` depends on the backend and is resolved by :func:`get_policy`."""

_NAMES = {np.dtype(dtype): name for name, dtype in _DTYPES.items()}


def _dtype(name: str) -> Any:
    return jmp.half_dtype() if name == policy_spec.HALF else _DTYPES[name]


@dataclasses.dataclass(frozen=True)
class MatmulPolicy(jmp.Policy):
    """A :class:`jmp.Policy` with jaxamp's two extra keys, ``matmul=`` and ``opt_state=``.

    ``matmul_dtype``: ``jnp.float8_e4m3fn`` runs the eligible ``dot_general`` calls in
    FP8 (:mod:`jaxamp.fp8`; the result in the compute dtype, the others stay there and the
    audit says why); a floating dtype runs its matmuls in that dtype; None, the compute dtype.

    ``fp8_recipe``: how ``matmul=float8`` scales (``fp8=``, :data:`jaxamp.policy_spec.FP8_RECIPES`);
    None is ``current``, the default.

    ``opt_state_dtype``: ``jnp.bfloat16`` or ``jnp.float32``, the dtype the train step stores
    the optimizer's floating state in (:func:`jaxamp.amp`'s ``state_dtype=``); None, as the
    optimizer makes it. It belongs to the train state's policy: an override that sets it is
    refused.

    Example:
        >>> p = get_policy("params=float32,compute=bfloat16,output=float32,matmul=fp8")
        >>> type(p).__name__, policy_to_str(p)
        ('MatmulPolicy', 'params=float32,compute=bfloat16,output=float32,matmul=float8')
        >>> get_policy("p=f32,c=bf16,o=f32,opt_state=bf16").opt_state_dtype
        <class 'jax.numpy.bfloat16'>
    """

    matmul_dtype: Any = None
    opt_state_dtype: Any = None
    fp8_recipe: str | None = None


def matmul_dtype(policy: jmp.Policy) -> Any:
    """The dtype ``policy``'s matmuls run in: its ``matmul_dtype``, else its compute dtype."""
    found = getattr(policy, "matmul_dtype", None)
    return policy.compute_dtype if found is None else found


def fp8_recipe(policy: jmp.Policy) -> str:
    """How ``policy``'s FP8 matmuls scale their operands (``fp8=``): ``"current"`` unless set."""
    return getattr(policy, "fp8_recipe", None) or "current"


def _recipe(name: str | None) -> str | None:
    return None if name in (None, "current") else name


def opt_state_dtype(policy: jmp.Policy) -> Any:
    """The dtype ``policy`` stores the optimizer state in, or None (as the optimizer makes it)."""
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


def _matmul(parsed: policy_spec.PolicySpec, compute: Any,
            inherited: jmp.Policy | None = None) -> Any:
    """The matmul dtype ``parsed`` sets (None: unset) for a region computing in ``compute``;
    ``inherited``: the policy an override that sets only ``matmul=`` applies to."""
    if parsed.matmul is None:
        return None
    if parsed.matmul != policy_spec.FLOAT8:
        return _dtype(parsed.matmul)
    if np.dtype(compute) == np.dtype(jnp.float16):
        source = "" if inherited is None else \
            f" (from the policy it overrides, {policy_to_str(inherited)!r})"
        raise ValueError(
            f"Policy {parsed.text!r}: matmul=float8 needs compute=bfloat16 or compute=float32, "
            f"got compute=float16{source}. FP8 matmuls return the compute dtype: float16's range "
            "(max 65504) overflows where the FP8 product of two scaled tensors does not, and "
            "float16 also needs a global loss scale on top of FP8's per-tensor scales. Write "
            "'params=float32,compute=bfloat16,output=float32,matmul=float8'.")
    return jnp.float8_e4m3fn


def get_policy(spec: str | jmp.Policy | policy_spec.PolicySpec) -> jmp.Policy:
    """Parses a policy string into a :class:`jmp.Policy`.

    The grammar (jmp's, plus ``matmul=`` and ``opt_state=``) is :func:`jaxamp.policy_spec.read`'s:
    a bare dtype name, or comma-separated ``key=dtype`` parts with keys ``params``/``p``,
    ``compute``/``c``, ``output``/``o`` (unset: params float32, compute params, output compute)
    and dtypes ``float32``/``f32``/``full``, ``float16``/``f16``, ``bfloat16``/``bf16``,
    ``half``. ``matmul=float8`` (``fp8``, ``f8``; refused with ``compute=float16``) or a dtype,
    and ``opt_state=bfloat16``/``float32``, give a :class:`MatmulPolicy`. ``half`` is resolved
    now, as :func:`jmp.half_dtype` does: bfloat16 on TPU, float16 on GPU and CPU (write
    ``bf16``/``f16`` for a policy that must not depend on the backend). float64 is refused:
    JAX only computes in it with ``jax_enable_x64``, and mixed precision has no use for it.

    Args:
        spec: A policy string, its :class:`~jaxamp.policy_spec.PolicySpec`, or a
            :class:`jmp.Policy`, returned unchanged once its dtypes are checked to be floating
            point (jmp builds ``compute_dtype=jnp.int8`` without a word).

    Returns:
        The policy, with dtypes ``jnp.float32``, ``jnp.float16`` or ``jnp.bfloat16``: equal to
        the policy :func:`jmp.get_policy` returns for the same string.

    Raises:
        TypeError: If ``spec`` is neither a string nor a :class:`jmp.Policy`.
        ValueError: If the string is malformed, or a :class:`jmp.Policy` has a dtype that is
            not floating point; the message names the bad part, what is allowed and an example.

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
    parsed = spec if isinstance(spec, policy_spec.PolicySpec) else policy_spec.read(spec)
    compute = _dtype(parsed.compute)
    fields = dict(param_dtype=_dtype(parsed.params), compute_dtype=compute,
                  output_dtype=_dtype(parsed.output))
    matmul = _matmul(parsed, compute)
    opt_state = None if parsed.opt_state is None else _DTYPES[parsed.opt_state]
    if parsed.fp8 is not None and parsed.matmul is None:
        raise ValueError(f"Policy {parsed.text!r} sets only fp8=, the recipe of the FP8 matmuls "
                         "of the policy it overrides; as a whole policy it needs matmul=float8. "
                         f"{policy_spec.FP8_EXAMPLE}")
    if matmul is None and opt_state is None:
        return jmp.Policy(**fields)
    return MatmulPolicy(**fields, matmul_dtype=matmul, opt_state_dtype=opt_state,
                        fp8_recipe=_recipe(parsed.fp8))


def with_matmul(policy: jmp.Policy, parsed: policy_spec.PolicySpec) -> jmp.Policy:
    """``policy`` with the ``matmul=`` and ``fp8=`` of ``parsed`` (an override that sets only
    those, ``{"lm_head": "matmul=bfloat16"}``, ``{"mlp": "fp8=rowwise"}``), its other fields
    unchanged; an FP8 region keeps its recipe unless ``parsed`` sets one."""
    matmul = getattr(policy, "matmul_dtype", None) if parsed.matmul is None else \
        _matmul(parsed, policy.compute_dtype, inherited=policy)
    fp8 = matmul is not None and np.dtype(matmul) == np.dtype(jnp.float8_e4m3fn)
    if parsed.fp8 is not None and not fp8:
        raise ValueError(f"Policy {parsed.text!r} sets fp8={parsed.fp8}, the recipe of FP8 "
                         f"matmuls, but the policy it overrides, {policy_to_str(policy)!r}, "
                         "runs no FP8 matmuls. Write 'matmul=float8,fp8=...' in the override, "
                         "or set matmul=float8 in the policy.")
    recipe = _recipe(parsed.fp8) if parsed.fp8 is not None else \
        getattr(policy, "fp8_recipe", None) if fp8 else None
    return MatmulPolicy(policy.param_dtype, policy.compute_dtype, policy.output_dtype,
                        matmul_dtype=matmul, opt_state_dtype=opt_state_dtype(policy),
                        fp8_recipe=recipe)


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
    for field, dtype in (("params", policy.param_dtype), ("compute", policy.compute_dtype),
                         ("output", policy.output_dtype)):
        try:
            names.append(f"{field}={_NAMES[np.dtype(dtype)]}")
        except (KeyError, TypeError):
            raise ValueError(f"The {field} dtype {dtype!r} has no policy-string name. "
                             f"{policy_spec.ALLOWED_DTYPES}") from None
    matmul, opt_state = getattr(policy, "matmul_dtype", None), opt_state_dtype(policy)
    if matmul is not None:
        fp8 = np.dtype(matmul) == np.dtype(jnp.float8_e4m3fn)
        names.append(f"matmul={policy_spec.FLOAT8 if fp8 else _NAMES[np.dtype(matmul)]}")
        if fp8 and getattr(policy, "fp8_recipe", None):
            names.append(f"fp8={policy.fp8_recipe}")
    if opt_state is not None:
        names.append(f"opt_state={_NAMES[np.dtype(opt_state)]}")
    return ",".join(names)
