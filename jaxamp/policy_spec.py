"""Policy strings without JAX: the one parser, the default policy, the loss-scaling rule.

:func:`read` parses a policy string once into a :class:`PolicySpec`, the typed value every later
layer reads: :func:`jaxamp.get_policy` builds the :class:`jmp.Policy` from it, module rules
(:class:`jaxamp.rules.ModuleRules`) read which keys an override sets, and
``python -m jaxamp.review`` reads the ``policy`` a run logged without importing JAX.

Example:
    >>> parse("p=f32,c=bf16")
    {'params': 'float32', 'compute': 'bfloat16', 'output': 'bfloat16'}
    >>> to_str(parse("c=bf16,o=f32,opt_state=bf16"))
    'params=float32,compute=bfloat16,output=float32,opt_state=bfloat16'
    >>> to_str(parse("f32"))
    'params=float32,compute=float32,output=float32'
    >>> read("matmul=fp8").given, read("matmul=fp8").matmul
    (frozenset({'matmul'}), 'float8')
    >>> to_str(parse("c=bf16,o=f32,matmul=fp8,fp8=rowwise"))
    'params=float32,compute=bfloat16,output=float32,matmul=float8,fp8=rowwise'
    >>> loss_scaling(parse(DEFAULT_POLICY)["compute"])
    'dynamic'
"""

from __future__ import annotations

import dataclasses

__all__ = ["DEFAULT_POLICY", "DTYPE_ALIASES", "EXTRA_FIELDS", "FIELDS", "FLOAT8", "FP8_RECIPES",
           "HALF", "MATMUL_ALIASES", "OPT_STATE_ALIASES", "OPT_STATE_FLOAT16", "PolicySpec",
           "loss_scaling", "parse", "parse_given", "read", "to_str"]

#: What jaxamp uses when no policy is given: float32 master weights, float16 compute, float32
#: outputs (with dynamic loss scaling, see :func:`loss_scaling`).
DEFAULT_POLICY = "params=float32,compute=float16,output=float32"

#: The three fields of a policy, in the order :func:`to_str` writes them.
FIELDS = ("params", "compute", "output")

#: jaxamp's optional fields, written after :data:`FIELDS` when set.
EXTRA_FIELDS = ("matmul", "fp8", "opt_state")

#: Accepted dtype names (lower case) -> canonical name. ``"half"`` is resolved by
#: :func:`jaxamp.get_policy` from the backend (bfloat16 on TPU, float16 elsewhere).
DTYPE_ALIASES = {
    "float32": "float32", "f32": "float32", "full": "float32",
    "float16": "float16", "f16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}

#: The backend-dependent half-precision name.
HALF = "half"

#: The ``matmul=`` value that runs eligible matmuls in FP8 (E4M3 forward operands, E5M2
#: gradients: :mod:`jaxamp.fp8`).
FLOAT8 = "float8"

#: Accepted ``matmul=`` names (lower case) -> canonical name: ``float8`` and its aliases, or a
#: floating dtype name (matmuls in that dtype instead of the compute dtype).
MATMUL_ALIASES = {"float8": FLOAT8, "fp8": FLOAT8, "f8": FLOAT8, **DTYPE_ALIASES}

#: The ``fp8=`` recipes of ``matmul=float8`` (:mod:`jaxamp.fp8`): ``current``, per-tensor scales
#: from this step's amax (the default); ``rowwise``, a scale per row of each operand (per
#: element of its free dimensions, the amax over the contracted ones: torchao's rowwise);
#: ``delayed``, per-tensor scales from an amax history of earlier steps kept in the train state
#: (Transformer Engine's ``DelayedScaling``).
FP8_RECIPES = ("current", "rowwise", "delayed")

#: Accepted ``opt_state=`` names (lower case) -> canonical name: the dtype the optimizer's
#: floating state is stored in (:func:`jaxamp.amp`'s ``state_dtype=``).
OPT_STATE_ALIASES = {name: canonical for name, canonical in DTYPE_ALIASES.items()
                     if canonical != "float16"}

#: Why ``opt_state=float16`` (and ``half``) is refused (the parser and ``amp(state_dtype=)``).
OPT_STATE_FLOAT16 = (
    "float16 cannot hold an optimizer state: Adam's second moment is the square of the "
    "gradients, which underflows float16 below ~6e-8 (gradients below ~2.4e-4) and overflows "
    "it above 65504 (gradients above 256), and a zero second moment turns the update into "
    "m / eps. bfloat16 has float32's exponent range; write bfloat16 (stored with stochastic "
    "rounding) or float32.")

_KEYS = {"params": "params", "p": "params", "compute": "compute", "c": "compute",
         "output": "output", "o": "output", "matmul": "matmul", "fp8": "fp8",
         "opt_state": "opt_state"}
_NON_FLOAT_NAMES = frozenset(
    {"bool", "complex64", "complex128", "c64", "c128"}
    | {f"{p}{n}" for p in ("int", "uint", "i", "u") for n in (4, 8, 16, 32, 64)}
)
_FLOAT64_NAMES = frozenset({"float64", "f64", "double"})

ALLOWED_DTYPES = "Allowed dtypes: float32/f32/full, float16/f16, bfloat16/bf16, half."
ALLOWED_MATMUL = ("Allowed matmul dtypes: float8/fp8/f8 (FP8 for eligible matmuls), float32/f32, "
                  "float16/f16, bfloat16/bf16, half.")
ALLOWED_OPT_STATE = "Allowed opt_state dtypes: float32/f32/full, bfloat16/bf16."
ALLOWED_FP8 = f"Allowed fp8 recipes: {', '.join(FP8_RECIPES)}."
FP8_EXAMPLE = "Example: 'params=float32,compute=bfloat16,output=float32,matmul=float8,fp8=rowwise'."
_ALLOWED_KEYS = "Allowed keys: params/p, compute/c, output/o, matmul, fp8, opt_state."
EXAMPLE = "Example: 'params=float32,compute=float16,output=float32'."
MATMUL_EXAMPLE = "Example: 'params=float32,compute=bfloat16,output=float32,matmul=float8'."
#: FP8 format names a ``matmul=`` value may be written as: all mean ``float8``.
_FP8_LIKE = ("float8", "f8", "fp8", "e4m3", "e5m2")


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    """A parsed policy string (:func:`read`): canonical names, unset values defaulted as jmp does.

    Attributes:
      params, compute, output: dtype names (``"float32"``, ``"float16"``, ``"bfloat16"`` or
        ``"half"``).
      matmul: ``"float8"``, a dtype name, or None (matmuls in the compute dtype).
      fp8: the recipe of ``matmul=float8`` (:data:`FP8_RECIPES`), or None (not set: ``current``,
        or the recipe of the policy an override inherits).
      opt_state: ``"float32"``, ``"bfloat16"`` or None (the state as the optimizer makes it).
      given: the fields the string sets (a bare dtype name sets the three :data:`FIELDS`); an
        override that sets only ``matmul`` keeps the rest of the policy its module inherits.
      text: the string as given, which error messages quote.
    """

    params: str = "float32"
    compute: str = "float32"
    output: str = "float32"
    matmul: str | None = None
    opt_state: str | None = None
    given: frozenset[str] = frozenset(FIELDS)
    text: str = ""
    fp8: str | None = None

    @property
    def relative(self) -> bool:
        """Sets only ``matmul=`` and/or ``fp8=``: an override that keeps every other field of
        the policy its module inherits."""
        return bool(self.given) and self.given <= {"matmul", "fp8"}

    def names(self) -> dict[str, str]:
        """:func:`parse`'s dict: the three fields, and the extra ones that are set."""
        return {f: getattr(self, f) for f in (*FIELDS, *EXTRA_FIELDS)
                if getattr(self, f) is not None}


def _error(message: str, *hints: str, example: str = EXAMPLE) -> ValueError:
    return ValueError(" ".join((message, *hints, example)))


def _parse_dtype(value: str, part: str, spec: str, *, what: str = "dtype",
                 allowed: str = ALLOWED_DTYPES, example: str = EXAMPLE) -> str:
    """A field's dtype name (``what``, ``allowed``, ``example``: the words of the errors)."""
    name = value.strip().lower()
    where = f"'{value.strip()}' in '{part.strip()}'"
    if not name:
        raise _error(f"Empty {what} in '{part.strip()}' of '{spec}'.", allowed, example=example)
    if name == HALF:
        return HALF
    if name in DTYPE_ALIASES:
        return DTYPE_ALIASES[name]
    if name in _FLOAT64_NAMES:
        raise _error(
            f"Unsupported {what} {where}: JAX computes in float64 only with jax_enable_x64, "
            "and mixed precision has no use for it.", allowed, example=example)
    if name in _NON_FLOAT_NAMES:
        raise _error(
            f"{what[0].upper()}{what[1:]} {where} is not a floating type; policies only cast "
            "floating-point values.", allowed, example=example)
    raise _error(f"Unknown {what} {where}.", allowed, example=example)


def _parse_matmul(value: str, part: str, spec: str) -> str:
    name = value.strip().lower()
    if name in MATMUL_ALIASES:
        return MATMUL_ALIASES[name]
    if name.startswith(_FP8_LIKE):
        raise _error(f"Unknown matmul dtype '{value.strip()}' in '{part.strip()}': "
                     "write float8 (E4M3 forward operands, E5M2 gradients).", ALLOWED_MATMUL,
                     example=MATMUL_EXAMPLE)
    return _parse_dtype(value, part, spec, what="matmul dtype", allowed=ALLOWED_MATMUL,
                        example=MATMUL_EXAMPLE)


def _parse_opt_state(value: str, part: str, spec: str) -> str:
    name = value.strip().lower()
    if name in OPT_STATE_ALIASES:
        return OPT_STATE_ALIASES[name]
    if name in ("float16", "f16", HALF):
        raise _error(f"Unsupported opt_state dtype '{value.strip()}' in '{part.strip()}': "
                     f"{OPT_STATE_FLOAT16}", ALLOWED_OPT_STATE)
    _parse_dtype(value, part, spec)  # raises with the dtype's own message
    raise _error(f"Unknown opt_state dtype '{value.strip()}' in '{part.strip()}'.",
                 ALLOWED_OPT_STATE)  # pragma: no cover - _parse_dtype raised


def _parse_fp8(value: str, part: str, spec: str) -> str:
    name = value.strip().lower()
    if name in FP8_RECIPES:
        return name
    raise _error(f"Unknown fp8 recipe '{value.strip()}' in '{part.strip()}'.", ALLOWED_FP8,
                 example=FP8_EXAMPLE)


_PARSE_VALUE = {"matmul": _parse_matmul, "fp8": _parse_fp8, "opt_state": _parse_opt_state}


def read(spec: str) -> PolicySpec:
    """Parses a policy string into a :class:`PolicySpec`: the one policy parser.

    The grammar is jmp's: a bare dtype name, which sets all three, or comma-separated
    ``key=dtype`` parts (keys ``params``/``p``, ``compute``/``c``, ``output``/``o``, each at
    most once). Names are case-insensitive; whitespace is ignored. Unset values default as in
    jmp: params to float32, compute to params, output to compute. ``half`` stays ``"half"``.
    jaxamp adds ``matmul=``: ``float8`` (aliases ``fp8``, ``f8``) runs the eligible matmuls in
    FP8 (:mod:`jaxamp.fp8`); a floating dtype runs the matmuls in it instead of the compute
    dtype. ``opt_state=`` (``float32`` or ``bfloat16``, with their aliases) is the dtype the
    optimizer state is stored in (:func:`jaxamp.amp`'s ``state_dtype=``; float16 is refused,
    see :data:`OPT_STATE_FLOAT16`). ``fp8=`` (:data:`FP8_RECIPES`) chooses how ``matmul=float8``
    scales its operands; it needs ``matmul=float8`` in the same string, except in an override
    that sets only ``fp8=`` (applied to the FP8 policy it inherits). A bare dtype name sets none.

    Raises:
        TypeError: ``spec`` is not a string.
        ValueError: the string is malformed; the message names the bad part, what is allowed,
            and gives a valid example.
    """
    given = _given(spec)
    params = given.get("params", "float32")
    compute = given.get("compute", params)
    if "fp8" in given and given.get("matmul") != FLOAT8 and not set(given) == {"fp8"}:
        raise _error(f"Policy '{spec}' sets fp8={given['fp8']}, the recipe of FP8 matmuls, but "
                     f"not matmul=float8 (matmul={given.get('matmul', 'unset')}). Add "
                     "matmul=float8, or drop fp8=.", ALLOWED_FP8, example=FP8_EXAMPLE)
    return PolicySpec(params, compute, given.get("output", compute), given.get("matmul"),
                      given.get("opt_state"), frozenset(given), spec, given.get("fp8"))


def parse(spec: str) -> dict[str, str]:
    """:func:`read` as a dict of canonical names: ``{"params", "compute", "output"}``, and
    ``"matmul"``/``"fp8"``/``"opt_state"`` when the string sets them."""
    return read(spec).names()


def parse_given(spec: str) -> dict[str, str]:
    """The fields ``spec`` sets (:attr:`PolicySpec.given`), as :func:`parse` names them."""
    parsed = read(spec)
    return {f: getattr(parsed, f) for f in (*FIELDS, *EXTRA_FIELDS) if f in parsed.given}


def _given(spec: str) -> dict[str, str]:
    if not isinstance(spec, str):
        raise TypeError(
            f"Policy must be a str or jmp.Policy, got {type(spec).__name__}: {spec!r}. {EXAMPLE}")
    if not spec.strip():
        raise _error(f"Empty policy string {spec!r}.",
                     "Give a dtype name or comma-separated key=dtype parts.", _ALLOWED_KEYS,
                     ALLOWED_DTYPES)
    if "=" not in spec and "," not in spec:
        dtype = _parse_dtype(spec, spec, spec)
        return {"params": dtype, "compute": dtype, "output": dtype}
    dtypes: dict[str, str] = {}
    seen: dict[str, str] = {}
    for index, part in enumerate(spec.split(","), start=1):
        if not part.strip():
            raise _error(f"Empty part #{index} in '{spec}' (stray or trailing comma?).",
                         "Each part must be key=dtype.", _ALLOWED_KEYS)
        if part.count("=") != 1:
            problem = "has more than one '=' (missing comma?)" if "=" in part else "is missing '='"
            raise _error(f"Part '{part.strip()}' in '{spec}' {problem}; each part must be "
                         "key=dtype.", _ALLOWED_KEYS, ALLOWED_DTYPES)
        raw_key, value = part.split("=")
        key = raw_key.strip().lower()
        if not key:
            raise _error(f"Empty key in '{part.strip()}' of '{spec}'.", _ALLOWED_KEYS)
        if key not in _KEYS:
            raise _error(f"Unknown policy key '{raw_key.strip()}' in '{part.strip()}'.",
                         _ALLOWED_KEYS)
        field = _KEYS[key]
        if field in seen:
            raise _error(
                f"Duplicate policy key '{raw_key.strip()}' in '{spec}': {field} is already set "
                f"by '{seen[field]}'. Each of params/p, compute/c, output/o, matmul, fp8, "
                "opt_state may appear once.")
        seen[field] = part.strip()
        dtypes[field] = _PARSE_VALUE.get(field, _parse_dtype)(value, part, spec)
    return dtypes


def to_str(names: dict[str, str]) -> str:
    """The canonical full form of :func:`parse`'s result, which :func:`parse` reads back."""
    fields = (*FIELDS, *(f for f in EXTRA_FIELDS if f in names))
    return ",".join(f"{field}={names[field]}" for field in fields)


def loss_scaling(compute: str) -> str:
    """The loss scaling a compute dtype needs by default, the one place this rule is written:
    ``"dynamic"`` for float16 (its gradients underflow below ~6e-8), else ``"none"``."""
    return "dynamic" if DTYPE_ALIASES.get(compute.strip().lower()) == "float16" else "none"
