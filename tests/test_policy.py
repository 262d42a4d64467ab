"""Tests for jaxamp.policy: parsing, jmp compatibility, round trips and error messages."""

import re

import jax.numpy as jnp
import jmp
import numpy as np
import pytest

from jaxamp.policy import DTYPE_NAMES, get_policy, policy_to_str

F32, F16, BF16 = jnp.float32, jnp.float16, jnp.bfloat16
HALF = jmp.half_dtype()

ALLOWED_KEYS = re.escape("Allowed keys: params/p, compute/c, output/o, matmul, fp8, opt_state.")
ALLOWED_DTYPES = re.escape("Allowed dtypes: float32/f32/full, float16/f16, bfloat16/bf16, half.")
EXAMPLE = re.escape("Example: 'params=float32,compute=float16,output=float32'.")

VALID = [
    # Full forms and aliases.
    ("params=float32,compute=float16,output=float32", (F32, F16, F32)),
    ("p=f32,c=f16,o=f32", (F32, F16, F32)),
    ("p=full,c=bf16,o=full", (F32, BF16, F32)),
    ("params=f32,c=bfloat16,output=f32", (F32, BF16, F32)),
    ("o=f32,c=f16,p=f32", (F32, F16, F32)),
    ("p=f16,c=f16,o=f16", (F16, F16, F16)),
    # Defaults: params -> f32, compute follows params, output follows compute.
    ("c=f16", (F32, F16, F16)),
    ("compute=bf16", (F32, BF16, BF16)),
    ("p=f16", (F16, F16, F16)),
    ("p=bf16,c=f32", (BF16, F32, F32)),
    ("p=f32,c=bf16", (F32, BF16, BF16)),
    ("o=f16", (F32, F32, F16)),
    ("c=f16,o=f32", (F32, F16, F32)),
    # Bare dtype names set all three.
    ("f32", (F32, F32, F32)),
    ("full", (F32, F32, F32)),
    ("float32", (F32, F32, F32)),
    ("f16", (F16, F16, F16)),
    ("float16", (F16, F16, F16)),
    ("bf16", (BF16, BF16, BF16)),
    ("bfloat16", (BF16, BF16, BF16)),
    ("half", (HALF, HALF, HALF)),
    ("c=half", (F32, HALF, HALF)),
    ("p=f32,c=half,o=f32", (F32, HALF, F32)),
]

# Accepted by jaxamp only: whitespace and upper case.
VALID_EXTENDED = [
    (" params = f32 , compute=f16 ", (F32, F16, F16)),
    ("  bf16  ", (BF16, BF16, BF16)),
    ("p = f32,\tc = bf16,\no = f32", (F32, BF16, F32)),
    ("P=F32,C=BF16,O=F32", (F32, BF16, F32)),
    ("Compute=Half", (F32, HALF, HALF)),
    ("FULL", (F32, F32, F32)),
]


def _dtypes(policy):
    return (policy.param_dtype, policy.compute_dtype, policy.output_dtype)


@pytest.mark.parametrize(("spec", "expected"), VALID + VALID_EXTENDED)
def test_parse(spec, expected):
    policy = get_policy(spec)
    assert isinstance(policy, jmp.Policy)
    assert _dtypes(policy) == expected
    # Same objects jmp uses, not merely equal dtypes.
    for got, want in zip(_dtypes(policy), expected, strict=True):
        assert got is want


@pytest.mark.parametrize("spec", [spec for spec, _ in VALID])
def test_matches_jmp(spec):
    assert get_policy(spec) == jmp.get_policy(spec)


def test_matches_jmp_docs_example():
    assert get_policy("p=f32,c=f16,o=f32") == jmp.get_policy("p=f32,c=f16,o=f32")


def test_policy_passes_through():
    policy = jmp.Policy(param_dtype=F32, compute_dtype=BF16, output_dtype=F32)
    assert get_policy(policy) is policy


def test_half_follows_jmp():
    assert get_policy("half").compute_dtype is jmp.half_dtype()


def test_dtype_names():
    assert DTYPE_NAMES["float32"] is F32
    assert DTYPE_NAMES["f32"] is F32
    assert DTYPE_NAMES["full"] is F32
    assert DTYPE_NAMES["float16"] is F16
    assert DTYPE_NAMES["f16"] is F16
    assert DTYPE_NAMES["bfloat16"] is BF16
    assert DTYPE_NAMES["bf16"] is BF16
    assert "half" not in DTYPE_NAMES  # backend-dependent, resolved at parse time
    for name, dtype in DTYPE_NAMES.items():
        assert get_policy(name) == jmp.Policy(dtype, dtype, dtype)
    with pytest.raises(TypeError):
        DTYPE_NAMES["f64"] = jnp.float64  # read-only


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("p=f32,c=f16,o=f32", "params=float32,compute=float16,output=float32"),
        ("c=bf16", "params=float32,compute=bfloat16,output=bfloat16"),
        ("f16", "params=float16,compute=float16,output=float16"),
        ("full", "params=float32,compute=float32,output=float32"),
    ],
)
def test_policy_to_str(spec, expected):
    assert policy_to_str(get_policy(spec)) == expected


@pytest.mark.parametrize("spec", [spec for spec, _ in VALID + VALID_EXTENDED])
def test_round_trip(spec):
    policy = get_policy(spec)
    text = policy_to_str(policy)
    assert get_policy(text) == policy
    assert policy_to_str(get_policy(text)) == text


def test_policy_to_str_accepts_np_dtypes():
    policy = jmp.Policy(np.dtype("float32"), jnp.dtype(jnp.bfloat16), np.dtype("float32"))
    assert policy_to_str(policy) == "params=float32,compute=bfloat16,output=float32"


def test_policy_to_str_rejects_float64():
    policy = jmp.Policy(F32, jnp.float64, F32)
    with pytest.raises(ValueError, match=r"compute dtype .* has no policy-string name"):
        policy_to_str(policy)


def test_policy_to_str_rejects_non_policy():
    with pytest.raises(TypeError, match="Expected a jmp.Policy, got str"):
        policy_to_str("p=f32")


MALFORMED = [
    # Unknown key.
    (
        "compute_dtype=f16",
        r"Unknown policy key 'compute_dtype' in 'compute_dtype=f16'\. " + ALLOWED_KEYS,
    ),
    ("p=f32,x=f16", r"Unknown policy key 'x' in 'x=f16'\. " + ALLOWED_KEYS),
    ("param=f32", r"Unknown policy key 'param' in 'param=f32'\. " + ALLOWED_KEYS),
    # Unknown dtype name.
    ("c=f15", r"Unknown dtype 'f15' in 'c=f15'\. " + ALLOWED_DTYPES),
    ("fp16", r"Unknown dtype 'fp16' in 'fp16'\. " + ALLOWED_DTYPES),
    ("compute", r"Unknown dtype 'compute' in 'compute'\. " + ALLOWED_DTYPES),
    ("c=f16 o", r"Unknown dtype 'f16 o' in 'c=f16 o'\. " + ALLOWED_DTYPES),
    # Non-floating dtypes.
    ("c=int8", r"Dtype 'int8' in 'c=int8' is not a floating type.*" + ALLOWED_DTYPES),
    ("int32", r"Dtype 'int32' in 'int32' is not a floating type.*" + ALLOWED_DTYPES),
    ("p=bool", r"Dtype 'bool' in 'p=bool' is not a floating type.*" + ALLOWED_DTYPES),
    ("o=uint8", r"Dtype 'uint8' in 'o=uint8' is not a floating type.*" + ALLOWED_DTYPES),
    # float64.
    (
        "p=float64",
        r"Unsupported dtype 'float64' in 'p=float64': .*jax_enable_x64.*" + ALLOWED_DTYPES,
    ),
    ("f64", r"Unsupported dtype 'f64' in 'f64': .*jax_enable_x64.*" + ALLOWED_DTYPES),
    # Duplicate keys, including aliases.
    (
        "p=f32,p=f16",
        r"Duplicate policy key 'p' in 'p=f32,p=f16': params is already set by "
        r"'p=f32'\. Each of params/p, compute/c, output/o, matmul, fp8, opt_state may appear "
        r"once\.",
    ),
    (
        "p=f32,params=f16",
        r"Duplicate policy key 'params' in 'p=f32,params=f16': params is "
        r"already set by 'p=f32'\. Each of params/p, compute/c, output/o, matmul, fp8, "
        r"opt_state may appear once\.",
    ),
    (
        "c=f16,compute=bf16",
        r"Duplicate policy key 'compute' in .*compute is already set by "
        r"'c=f16'\. Each of params/p, compute/c, output/o, matmul",
    ),
    # Empty string.
    ("", r"Empty policy string ''\..*" + ALLOWED_KEYS + " " + ALLOWED_DTYPES),
    ("   ", r"Empty policy string '   '\..*" + ALLOWED_KEYS + " " + ALLOWED_DTYPES),
    # Empty parts.
    (
        "p=f32,,c=f16",
        r"Empty part #2 in 'p=f32,,c=f16' \(stray or trailing comma\?\)\. "
        r"Each part must be key=dtype\. " + ALLOWED_KEYS,
    ),
    ("p=f32,", r"Empty part #2 in 'p=f32,' \(stray or trailing comma\?\).*" + ALLOWED_KEYS),
    (",c=f16", r"Empty part #1 in ',c=f16'.*" + ALLOWED_KEYS),
    ("p=f32, ,c=f16", r"Empty part #2 in 'p=f32, ,c=f16'.*" + ALLOWED_KEYS),
    # Missing '=' in a multi-part string.
    (
        "p=f32,c",
        r"Part 'c' in 'p=f32,c' is missing '='; each part must be key=dtype\. "
        + ALLOWED_KEYS
        + " "
        + ALLOWED_DTYPES,
    ),
    ("f32,f16", r"Part 'f32' in 'f32,f16' is missing '='.*" + ALLOWED_KEYS),
    # More than one '='.
    ("p=f32=f16", r"Part 'p=f32=f16' in 'p=f32=f16' has more than one '='.*" + ALLOWED_KEYS),
    (
        "p=f32 c=f16",
        r"Part 'p=f32 c=f16' in 'p=f32 c=f16' has more than one '=' "
        r"\(missing comma\?\).*" + ALLOWED_KEYS,
    ),
    ("c==f16", r"Part 'c==f16' in 'c==f16' has more than one '='.*" + ALLOWED_KEYS),
    # Empty key or value.
    ("=f16", r"Empty key in '=f16' of '=f16'\. " + ALLOWED_KEYS),
    ("p=f32, = f16", r"Empty key in '= f16' of 'p=f32, = f16'\. " + ALLOWED_KEYS),
    ("c=", r"Empty dtype in 'c=' of 'c='\. " + ALLOWED_DTYPES),
    ("p=f32,c= ", r"Empty dtype in 'c=' of 'p=f32,c= '\. " + ALLOWED_DTYPES),
    ("=", r"Empty key in '=' of '='\. " + ALLOWED_KEYS),
]


@pytest.mark.parametrize(("spec", "message"), MALFORMED, ids=[repr(s) for s, _ in MALFORMED])
def test_malformed(spec, message):
    with pytest.raises(ValueError, match=message + r".*" + EXAMPLE):
        get_policy(spec)


@pytest.mark.parametrize(
    ("spec", "type_name"),
    [
        (None, "NoneType"),
        (16, "int"),
        (jnp.float16, "_ScalarMeta"),
        (np.dtype("float16"), r"\w+: dtype\('float16'\)"),
        (b"p=f32", "bytes"),
        (["p=f32"], "list"),
    ],
)
def test_wrong_type(spec, type_name):
    with pytest.raises(TypeError, match=r"Policy must be a str or jmp\.Policy, got " + type_name):
        get_policy(spec)


# ---- matmul= (FP8 matmuls, issue 25) ----------------------------------------------------------


@pytest.mark.parametrize("alias", ["float8", "fp8", "f8", "FP8", " float8 "])
def test_matmul_float8_aliases_make_a_matmul_policy_that_round_trips(alias):
    from jaxamp.policy import MatmulPolicy, matmul_dtype

    p = get_policy(f"params=float32,compute=bfloat16,output=float32,matmul={alias}")
    assert isinstance(p, MatmulPolicy) and isinstance(p, jmp.Policy)
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (F32, BF16, F32)
    assert np.dtype(matmul_dtype(p)) == np.dtype(jnp.float8_e4m3fn)
    text = policy_to_str(p)
    assert text == "params=float32,compute=bfloat16,output=float32,matmul=float8"
    assert get_policy(text) == p
    # without matmul= it is jmp's own policy, equal to jmp.get_policy's
    assert type(get_policy("p=f32,c=bf16,o=f32")) is jmp.Policy
    assert matmul_dtype(get_policy("p=f32,c=bf16,o=f32")) == BF16


def test_matmul_float_dtype_and_errors():
    p = get_policy("p=f32,c=bf16,o=f32,matmul=f32")
    assert p.matmul_dtype == F32 and policy_to_str(p).endswith(",matmul=float32")
    with pytest.raises(ValueError, match=r"matmul=float8 needs compute=bfloat16 or "
                                         r"compute=float32, got compute=float16.*Write "):
        get_policy("p=f32,c=f16,o=f32,matmul=fp8")
    with pytest.raises(ValueError, match=r"Unknown matmul dtype 'float8_e5m2'.*write float8"):
        get_policy("c=bf16,matmul=float8_e5m2")
    with pytest.raises(ValueError, match=r"Duplicate policy key 'matmul'"):
        get_policy("c=bf16,matmul=f8,matmul=bf16")


def test_a_matmul_only_override_keeps_the_inherited_policy():
    import flax.linen as nn

    from jaxamp.rules import ModuleRules

    rules = ModuleRules.create("p=f32,c=bf16,o=f32,matmul=float8",
                               {"lm_head": "matmul=bfloat16", nn.Dense: "matmul=f32"})
    head, pattern = rules.match(nn.Dense(4), path=("lm_head",), inherited=rules.default)
    assert pattern == "lm_head"
    assert policy_to_str(head) == "params=float32,compute=bfloat16,output=float32,matmul=bfloat16"
    other, _ = rules.match(nn.Dense(4), path=("fc",), inherited=rules.default)
    assert policy_to_str(other) == "params=float32,compute=bfloat16,output=float32,matmul=float32"
    # validated eagerly against the default policy, before any tracing
    with pytest.raises(ValueError, match="matmul=float8 needs compute=bfloat16"):
        ModuleRules.create("p=f32,c=f16,o=f32", {"lm_head": "matmul=fp8"})


# ---- fp8= (the recipe of matmul=float8, issue 43) ------------------------------------------


def test_fp8_recipe_round_trips_and_current_is_the_default():
    from jaxamp.policy import fp8_recipe

    p = get_policy("p=f32,c=bf16,o=f32,matmul=fp8,fp8=ROWWISE")
    assert p.fp8_recipe == "rowwise" and fp8_recipe(p) == "rowwise"
    text = policy_to_str(p)
    assert text == "params=float32,compute=bfloat16,output=float32,matmul=float8,fp8=rowwise"
    assert get_policy(text) == p
    # current is the default: written or not, the same policy
    assert get_policy("p=f32,c=bf16,o=f32,matmul=fp8,fp8=current") == \
        get_policy("p=f32,c=bf16,o=f32,matmul=fp8")
    assert fp8_recipe(get_policy("p=f32,c=bf16,o=f32,matmul=fp8")) == "current"


@pytest.mark.parametrize(("spec", "message"), [
    ("c=bf16,fp8=rowwise", r"sets fp8=rowwise, the recipe of FP8 matmuls, but not "
                           r"matmul=float8 \(matmul=unset\)\. Add matmul=float8"),
    ("c=bf16,matmul=bf16,fp8=rowwise", r"but not matmul=float8 \(matmul=bfloat16\)"),
    ("c=bf16,matmul=fp8,fp8=colwise", r"Unknown fp8 recipe 'colwise' in 'fp8=colwise'\. "
                                      r"Allowed fp8 recipes: current, rowwise, delayed\."),
    ("fp8=rowwise", r"sets only fp8=.*as a whole policy it needs matmul=float8"),
    ("c=bf16,matmul=fp8,fp8=rowwise,fp8=current", r"Duplicate policy key 'fp8'"),
])
def test_bad_fp8_recipes_name_the_value_and_the_fix(spec, message):
    with pytest.raises(ValueError, match=message):
        get_policy(spec)


def test_an_fp8_only_override_changes_the_recipe_and_keeps_the_rest():
    import flax.linen as nn

    from jaxamp.rules import ModuleRules

    rules = ModuleRules.create("p=f32,c=bf16,o=f32,matmul=float8",
                               {"mlp": "fp8=rowwise", "lm_head": "matmul=bfloat16"})
    mlp, _ = rules.match(nn.Dense(4), path=("mlp",), inherited=rules.default)
    assert policy_to_str(mlp) == \
        "params=float32,compute=bfloat16,output=float32,matmul=float8,fp8=rowwise"
    # a matmul-only override of a rowwise region keeps its recipe; leaving FP8 drops it
    inner = ModuleRules.create("p=f32,c=bf16,o=f32", {"x": "matmul=fp8"})
    kept, _ = inner.match(nn.Dense(4), path=("x",), inherited=mlp)
    assert kept.fp8_recipe == "rowwise"
    head, _ = rules.match(nn.Dense(4), path=("lm_head",), inherited=mlp)
    assert policy_to_str(head).endswith(",matmul=bfloat16")
    # fp8= on a region without FP8 matmuls is refused, before tracing
    with pytest.raises(ValueError, match=r"overrides\['mlp'\]: .*sets fp8=rowwise.*runs no FP8 "
                                         r"matmuls\. Write 'matmul=float8,fp8=\.\.\.'"):
        ModuleRules.create("p=f32,c=bf16,o=f32", {"mlp": "fp8=rowwise"})


# ---- errors that name the right choices (issue 46) --------------------------------------------

ALLOWED_MATMUL = re.escape("Allowed matmul dtypes: float8/fp8/f8 (FP8 for eligible matmuls), "
                           "float32/f32, float16/f16, bfloat16/bf16, half.")
MATMUL_EXAMPLE = re.escape(
    "Example: 'params=float32,compute=bfloat16,output=float32,matmul=float8'.")
BAD_MATMUL = [
    ("float9", r"Unknown matmul dtype 'float9' in 'matmul=float9'\. "),
    ("fp9", r"Unknown matmul dtype 'fp9' in 'matmul=fp9'\. "),
    ("e4m3", r"Unknown matmul dtype 'e4m3' in 'matmul=e4m3': write float8 \(E4M3 forward "
             r"operands, E5M2 gradients\)\. "),
    ("", r"Empty matmul dtype in 'matmul=' of 'c=bf16,matmul='\. "),
    ("int8", r"Matmul dtype 'int8' in 'matmul=int8' is not a floating type; policies only cast "
             r"floating-point values\. "),
    ("float64", r"Unsupported matmul dtype 'float64' in 'matmul=float64': JAX computes in "
                r"float64 only with jax_enable_x64, and mixed precision has no use for it\. "),
]


@pytest.mark.parametrize(("value", "message"), BAD_MATMUL,
                         ids=[v or "empty" for v, _ in BAD_MATMUL])
def test_a_bad_matmul_value_lists_the_matmul_choices(value, message):
    """Before: "Allowed dtypes: float32/f32/full, float16/f16, bfloat16/bf16, half." and an
    example without matmul=: float8/fp8/f8, what the key takes, were never named."""
    with pytest.raises(ValueError) as info:
        get_policy(f"c=bf16,matmul={value}")
    assert re.fullmatch(message + ALLOWED_MATMUL + " " + MATMUL_EXAMPLE, str(info.value)), \
        str(info.value)


def test_an_override_refused_for_fp8_with_float16_names_its_key():
    """Before: "Policy 'matmul=float8': matmul=float8 needs compute=bfloat16 ..." without the
    override it came from."""
    import flax.linen as nn

    from jaxamp.rules import ModuleRules

    with pytest.raises(ValueError) as info:
        ModuleRules.create("p=f32,c=f16,o=f32", {"blocks_0/mlp": "matmul=float8"})
    assert str(info.value).startswith(
        "overrides['blocks_0/mlp']: Policy 'matmul=float8': matmul=float8 needs "
        "compute=bfloat16 or compute=float32, got compute=float16 (from the policy it "
        "overrides, 'params=float32,compute=float16,output=float32'). "), str(info.value)
    with pytest.raises(ValueError) as info:
        ModuleRules.create("p=f32,c=bf16,o=f32", {nn.Dense: "c=f16,matmul=fp8"})
    assert str(info.value).startswith(
        "overrides[Dense]: Policy 'c=f16,matmul=fp8': matmul=float8 needs compute=bfloat16 or "
        "compute=float32, got compute=float16. "), str(info.value)
    # under an ancestor's float16 rule the refusal comes while tracing: it names the key too
    rules = ModuleRules.create("p=f32,c=bf16,o=f32", {"blocks_0": "c=f16", nn.Dense:
                                                      "matmul=float8"})
    with pytest.raises(ValueError, match=r"^overrides\[Dense\]: Policy 'matmul=float8': "
                                         r"matmul=float8 needs .*got compute=float16 \(from "
                                         r"the policy it overrides, 'params=float32,"
                                         r"compute=float16,output=float16'\)"):
        rules.match(nn.Dense(4), path=("blocks_0", "fc"), inherited=get_policy("c=f16"))
    with pytest.raises(ValueError, match=r"^overrides\['head'\]: Unknown dtype 'f15'"):
        ModuleRules.create("p=f32,c=bf16,o=f32", {"head": "c=f15"})


# ---- opt_state= (the optimizer state's storage dtype, issue 44) ---------------------------------

BASE = "params=float32,compute=bfloat16,output=float32"


@pytest.mark.parametrize(("alias", "canonical", "dtype"), [
    ("bfloat16", "bfloat16", BF16), ("bf16", "bfloat16", BF16), (" BF16 ", "bfloat16", BF16),
    ("float32", "float32", F32), ("f32", "float32", F32), ("full", "float32", F32)])
def test_opt_state_aliases_round_trip(alias, canonical, dtype):
    from jaxamp import policy_spec
    from jaxamp.policy import MatmulPolicy, matmul_dtype, opt_state_dtype

    p = get_policy(f"p=f32,c=bf16,o=f32,opt_state={alias}")
    assert isinstance(p, MatmulPolicy) and opt_state_dtype(p) == dtype
    assert matmul_dtype(p) == BF16  # matmuls untouched
    text = policy_to_str(p)
    assert text == f"{BASE},opt_state={canonical}"
    assert get_policy(text) == p and policy_to_str(get_policy(text)) == text
    # the JAX-free parser (what python -m jaxamp.review reads) agrees, and round-trips
    assert policy_spec.parse(text)["opt_state"] == canonical
    assert policy_spec.to_str(policy_spec.parse(text)) == text
    # with matmul= too: both extra keys, in a fixed order
    both = get_policy(f"opt_state={alias},c=bf16,matmul=fp8,o=f32")
    assert policy_to_str(both) == f"{BASE},matmul=float8,opt_state={canonical}"
    assert get_policy(policy_to_str(both)) == both


def test_opt_state_unset_is_a_plain_policy_and_a_bare_name_never_sets_it():
    from jaxamp import policy_spec
    from jaxamp.policy import opt_state_dtype

    for spec in ("bf16", "p=f32,c=bf16,o=f32", "p=f32,c=bf16,matmul=fp8"):
        assert opt_state_dtype(get_policy(spec)) is None
        assert "opt_state" not in policy_spec.parse(spec)
        assert "opt_state" not in policy_to_str(get_policy(spec))
    assert type(get_policy("p=f32,c=bf16,o=f32")) is jmp.Policy


@pytest.mark.parametrize("value", ["float16", "f16", "F16", "half"])
def test_opt_state_float16_is_refused_saying_why_and_the_fix(value):
    with pytest.raises(ValueError) as e:
        get_policy(f"c=bf16,opt_state={value}")
    text = str(e.value)
    assert text.startswith(f"Unsupported opt_state dtype '{value}' in 'opt_state={value}': "
                           "float16 cannot hold an optimizer state")
    assert "underflows float16" in text and "write bfloat16" in text
    assert "Allowed opt_state dtypes: float32/f32/full, bfloat16/bf16." in text
    assert "Example: 'params=float32,compute=float16,output=float32'." in text


@pytest.mark.parametrize(("value", "message"), [
    ("fp8", r"Unknown dtype 'fp8' in 'opt_state=fp8'\. " + ALLOWED_DTYPES),
    ("int8", r"Dtype 'int8' in 'opt_state=int8' is not a floating type"),
    ("float64", r"Unsupported dtype 'float64' in 'opt_state=float64'"),
    ("", r"Empty dtype in 'opt_state=' of 'c=bf16,opt_state='"),
])
def test_opt_state_bad_values_name_the_value(value, message):
    with pytest.raises(ValueError, match=message):
        get_policy(f"c=bf16,opt_state={value}")


def test_opt_state_duplicate_and_misplaced():
    import flax.linen as nn

    from jaxamp.policy import MatmulPolicy, check_state_dtype
    from jaxamp.rules import ModuleRules

    with pytest.raises(ValueError, match=r"Duplicate policy key 'opt_state'.*opt_state=bf16"):
        get_policy("c=bf16,opt_state=bf16,opt_state=f32")
    # the optimizer state is one for the model: a module override may not set it
    for override in ("opt_state=bf16", "p=f32,c=f32,opt_state=bf16",
                     get_policy("c=bf16,opt_state=bf16")):
        with pytest.raises(ValueError, match=r"sets opt_state=: the optimizer state is one for "
                                             r"the whole model.*leave it out of overrides"):
            ModuleRules.create(BASE, {nn.Dense: override})
    # a hand-built policy object is checked as strings are
    with pytest.raises(ValueError, match=r"cannot be stored in float16"):
        get_policy(MatmulPolicy(F32, BF16, F32, opt_state_dtype=F16))
    # the dtype check that jaxamp.amp(state_dtype=) uses: dtypes, names, None
    assert check_state_dtype(np.dtype("bfloat16"), "x") is BF16
    assert check_state_dtype("bf16", "x") is BF16 and check_state_dtype(F32, "x") is F32
    assert check_state_dtype(None, "x") is None
    for bad in (F16, "half", jnp.int8, "fp8", 3):
        with pytest.raises(ValueError, match=r"^x: ") as e:
            check_state_dtype(bad, "x")
        assert repr(bad) in str(e.value)


def test_a_policy_and_its_overrides_are_parsed_once_per_autocast(monkeypatch):
    """Issue #41: each policy string is parsed once, into a PolicySpec, and every later layer
    (the module rules while tracing, the engine) reads that value: tracing a model whose
    three Dense layers each match a ``matmul=`` override parses nothing again."""
    import flax.linen as nn
    import jax

    import jaxamp
    from jaxamp import policy_spec

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(3):
                x = nn.Dense(8, name=f"fc_{i}")(x)
            return nn.LayerNorm(name="norm")(x)

    x = jnp.ones((2, 8))
    params = MLP().init(jax.random.key(0), x)
    parsed, read = [], policy_spec.read
    monkeypatch.setattr(policy_spec, "read", lambda s: parsed.append(s) or read(s))
    fwd = jaxamp.autocast(MLP().apply, "p=f32,c=bf16,o=f32",
                          overrides={nn.Dense: "matmul=float32", "norm": "c=f32,o=bf16"})
    jaxpr = jax.make_jaxpr(fwd)(params, x)
    assert sorted(parsed) == sorted(["p=f32,c=bf16,o=f32", "matmul=float32", "c=f32,o=bf16"])
    # ... and what they say reached the engine: float32 matmuls in a bfloat16 region
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 3 and all(v.aval.dtype == F32 for e in dots for v in e.invars)
    assert jaxpr.out_avals[0].dtype == F32


def test_a_train_steps_overrides_are_parsed_once_per_builder(monkeypatch):
    """``make_train_step(overrides=)`` reads its strings when it is built: tracing the step for
    two batch shapes parses none of them again (it did at every trace)."""
    import flax.linen as nn
    import jax
    import optax

    import jaxamp
    from jaxamp import policy_spec

    model = nn.Dense(8)
    params = model.init(jax.random.key(0), jnp.ones((2, 8)))

    def loss(apply_fn, params, batch):
        return jnp.mean(apply_fn({"params": params}, batch) ** 2)
    parsed, read = [], policy_spec.read
    monkeypatch.setattr(policy_spec, "read", lambda s: parsed.append(s) or read(s))
    state = jaxamp.TrainState.create(model, params["params"], optax.sgd(0.1),
                                     policy="p=f32,c=bf16,o=f32")
    step = jaxamp.make_train_step(model, loss, overrides={nn.Dense: "matmul=float32"})
    assert parsed == ["p=f32,c=bf16,o=f32", "matmul=float32"]
    for rows in (2, 4):
        jax.eval_shape(step, state, jnp.ones((rows, 8)))
    assert parsed == ["p=f32,c=bf16,o=f32", "matmul=float32"]
    # a bad string is refused by the builder, named by its key
    with pytest.raises(ValueError, match=r"overrides\[Dense\]: Unknown policy key 'matmal'"):
        jaxamp.make_train_step(model, loss, overrides={nn.Dense: "matmal=float32"})
