"""A reader of compiled XLA:GPU HLO text: which library runs each matmul, with which operand
dtypes, and whether anything leaves the device.

Pure text functions (no JAX), so they are unit-tested on CPU with handwritten XLA:GPU samples
(``tests/test_gpu_hlo.py``) and used on a GPU by ``tests/test_gpu.py`` on the example's compiled
train step (``jax.jit(step).lower(...).compile().as_text()``).

What XLA:GPU emits for a matmul (target names as in XLA's ``xla/service/gpu/cublas_cudnn.h``):

* a ``custom-call`` to cuBLAS, ``custom_call_target="__cublas$gemm"``, or to cuBLASLt,
  ``"__cublas$lt$matmul"`` (``"__cublas$lt$matmul$f8"`` for float8); its result is a tuple
  ``(out, s8[workspace])``;
* a ``custom-call`` to cuDNN, ``"__cudnn$..."``: convolutions (``$convForward``,
  ``$convBackwardInput``, ``$convBackwardFilter``, ``$convBiasActivationForward``) and fused
  attention (``$fmha...``);
* a ``fusion`` with ``kind=kCustom`` whose backend config names ``"__triton_gemm"`` or, in
  newer XLA, ``"__triton_nested_gemm_fusion"`` (XLA's Triton GEMM emitter, chosen by
  autotuning; on Hopper it issues wgmma, i.e. Tensor Cores, when its operands are f16/bf16), or
  ``"__cudnn$fusion"`` (a cuDNN graph); the ``dot`` is inside the called computation, often
  behind a ``convert`` fused into it (nested: inside a "block" fusion feeding the dot, which
  then reads that fusion's result type);
* a plain ``dot``/``convolution`` left in the program (not rewritten to any library): XLA's own
  loop emitter, no Tensor Cores. :func:`tensor_core_violations` always reports these.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter

LOW_PRECISION = ("f16", "bf16")
CUBLAS_PREFIX = "__cublas$"
CUDNN_PREFIX = "__cudnn$"
# Library-backed GEMM fusions (fusion_backend_config kind).
GEMM_FUSION_KINDS = {"__triton_gemm": "triton", "__triton_nested_gemm_fusion": "triton",
                     "__cudnn$fusion": "cudnn-fusion", "__cublas": "cublas-fusion"}
# Custom-call targets that run Python on the host, and ops that move data to or from it.
HOST_CALLBACK_MARKERS = ("callback", "host_compute", "xla_python")
HOST_TRANSFER_OPS = ("send", "send-done", "recv", "recv-done", "outfeed", "infeed")

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-$]+)\s*(?:\(.*\)\s*->.*)?\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-$]+)\s*=\s*(.*)$")
_ARRAY_TYPE = re.compile(r"^([a-z]\w*)\[([\d,\s]*)\]")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_FUSION_CONFIG = re.compile(r'"fusion_backend_config"\s*:\s*\{')
_CALLS = re.compile(r"\bcalls=%?([\w.\-$]+)")
# An instruction starts "name = TYPE": an array type or a tuple (not "attr=value").
_INSTR_START = re.compile(r"^(ROOT\s+)?%?[\w.\-$]+\s*=\s*(\(|[a-z]\w*\[)")
_OPERAND = re.compile(r"^(?:(\(.*\)|[a-z]\w*\[[\d,\s]*\](?:\{[^}]*\})?)\s+)?%?([\w.\-$]+)$")


@dataclasses.dataclass(frozen=True)
class Instr:
    computation: str
    name: str
    type: str  # the result type text: "bf16[8,8]{1,0}" or a tuple "(bf16[..], s8[..])"
    opcode: str
    operands: tuple[str, ...]  # operand texts, as written ("bf16[8,8]{1,0} %x" or "%x")
    attrs: str  # everything after the operand list

    @property
    def dtype(self) -> str | None:
        return first_array(self.type)[0]


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One matmul (or convolution / fused attention) of the compiled program."""

    name: str
    computation: str
    library: str  # cublas, cublaslt, cudnn, triton, cudnn-fusion, ... or "none" (plain dot)
    target: str  # custom-call target, fusion kind, or the opcode for a plain dot
    operand_dtypes: tuple[str | None, ...]  # of the first two operands (lhs, rhs)
    out_dtype: str | None
    operand_elements: tuple[int | None, ...]
    out_elements: int | None

    @property
    def low_precision(self) -> bool:
        return bool(self.operand_dtypes) and all(d in LOW_PRECISION for d in self.operand_dtypes)

    @property
    def signature(self) -> tuple:
        """Layout-free identity: sorted operand element counts and output element count."""
        return gemm_signature(self.operand_elements, self.out_elements)


def gemm_signature(operand_elements, out_elements) -> tuple:
    return (tuple(sorted((e if e is not None else -1) for e in operand_elements)),
            out_elements if out_elements is not None else -1)


def first_array(type_text: str) -> tuple[str | None, int | None]:
    """(dtype, element count) of an array type, or of a tuple type's first element."""
    t = type_text.strip()
    while t.startswith("("):
        t = t[1:].lstrip()
    m = _ARRAY_TYPE.match(t)
    if not m:
        return None, None
    dims = [int(d) for d in m.group(2).replace(" ", "").split(",") if d]
    n = 1
    for d in dims:
        n *= d
    return m.group(1), n


def _split_top(text: str) -> list[str]:
    """Splits on commas outside (), [], {}."""
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def _parse_rhs(rhs: str) -> tuple[str, str, list[str], str] | None:
    """``TYPE opcode(operands), attrs`` -> (type, opcode, operands, attrs)."""
    rhs = rhs.strip()
    i = 0
    if rhs.startswith("("):  # tuple type: up to its matching parenthesis
        depth = 0
        while i < len(rhs):
            depth += rhs[i] == "("
            depth -= rhs[i] == ")"
            i += 1
            if depth == 0:
                break
    else:
        m = re.match(r"\S+", rhs)
        i = m.end() if m else 0
    type_text, rest = rhs[:i], rhs[i:].lstrip()
    m = re.match(r"([a-z][\w\-]*)\(", rest)
    if not m:
        return None
    opcode, j, depth = m.group(1), m.end(), 1
    k = j
    while k < len(rest) and depth:
        depth += rest[k] == "("
        depth -= rest[k] == ")"
        k += 1
    operands = _split_top(rest[j:k - 1])
    return type_text, opcode, operands, rest[k:]


def _balance(text: str) -> int:
    return sum(text.count(c) for c in "([{") - sum(text.count(c) for c in ")]}")


def parse_hlo(text: str) -> dict[str, list[Instr]]:
    """Computations of an HLO module, in order: ``{name: [Instr, ...]}``. Instructions may span
    several lines (handwritten HLO); comments (``/* ... */``) are dropped."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    comps: dict[str, list[str]] = {}
    current = None
    depth = 0  # unclosed brackets of the instruction being read: its next lines continue it
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        if current is not None and depth > 0:
            comps[current][-1] += " " + stripped
            depth += _balance(stripped)
            continue
        if stripped.startswith(("HloModule", "//")):
            continue
        if stripped == "}":
            current = None
            continue
        is_instr = bool(_INSTR_START.match(stripped))
        m = _COMPUTATION.match(stripped)
        if m and not is_instr:
            current = m.group(2)
            comps[current] = []
            continue
        if current is None:
            continue
        if is_instr:
            comps[current].append(stripped)
            depth = _balance(stripped)
        elif comps[current]:
            comps[current][-1] += " " + stripped
            depth += _balance(stripped)
    out: dict[str, list[Instr]] = {}
    for name, lines in comps.items():
        instrs = []
        for line in lines:
            m = _INSTR.match(line)
            parsed = _parse_rhs(m.group(3)) if m else None
            if parsed is None:
                continue
            type_text, opcode, operands, attrs = parsed
            instrs.append(Instr(name, m.group(2), type_text, opcode, tuple(operands), attrs))
        out[name] = instrs
    return out


def _operand_info(operand: str, table: dict[str, str]) -> tuple[str | None, int | None]:
    m = _OPERAND.match(operand.strip())
    if not m:
        return None, None
    if m.group(1):
        return first_array(m.group(1))
    return first_array(table.get(m.group(2), ""))


def fusion_kind(attrs: str) -> str | None:
    """The ``"kind"`` of a fusion's ``fusion_backend_config`` (None if it has none). Read from
    the config's own braces: XLA writes its fields in name order, so on the H200's XLA (jax
    0.11.2) ``"kind"`` comes after a nested ``"block_level_fusion_config": {...}``."""
    m = _FUSION_CONFIG.search(attrs)
    if not m:
        return None
    depth, i = 0, m.end() - 1
    for j in range(i, len(attrs)):
        depth += {"{": 1, "}": -1}.get(attrs[j], 0)
        if depth == 0:
            try:
                kind = json.loads(attrs[i:j + 1]).get("kind")
            except ValueError:
                return None
            return kind if isinstance(kind, str) else None
    return None


def find_gemms(text: str) -> list[Gemm]:
    """Every matmul/convolution of a compiled XLA:GPU module, with the library that runs it."""
    comps = parse_hlo(text)
    tables = {c: {i.name: i.type for i in instrs} for c, instrs in comps.items()}
    gemms: list[Gemm] = []
    inside_gemm_fusion: set[str] = set()

    def make(instr: Instr, library: str, target: str, operands_of: Instr) -> Gemm:
        table = tables[operands_of.computation]
        infos = [_operand_info(o, table) for o in operands_of.operands[:2]]
        out_dt, out_n = first_array(instr.type)
        return Gemm(instr.name, instr.computation, library, target,
                    tuple(d for d, _ in infos), out_dt, tuple(n for _, n in infos), out_n)

    for instrs in comps.values():
        for ins in instrs:
            if ins.opcode == "custom-call":
                m = _TARGET.search(ins.attrs)
                target = m.group(1) if m else ""
                if target.startswith(CUBLAS_PREFIX):
                    lib = "cublaslt" if target.startswith("__cublas$lt$") else "cublas"
                    gemms.append(make(ins, lib, target, ins))
                elif target.startswith(CUDNN_PREFIX):
                    gemms.append(make(ins, "cudnn", target, ins))
            elif ins.opcode == "fusion":
                kind = fusion_kind(ins.attrs)
                called = _CALLS.search(ins.attrs)
                if kind in GEMM_FUSION_KINDS and called and called.group(1) in comps:
                    body = called.group(1)
                    inside_gemm_fusion.add(body)
                    dots = [i for i in comps[body] if i.opcode in ("dot", "convolution")]
                    for dot in dots or []:
                        g = make(ins, GEMM_FUSION_KINDS[kind], kind, dot)
                        gemms.append(dataclasses.replace(
                            g, out_dtype=first_array(dot.type)[0] or g.out_dtype,
                            out_elements=first_array(dot.type)[1]))
    for comp, instrs in comps.items():
        if comp in inside_gemm_fusion:
            continue
        for ins in instrs:
            if ins.opcode in ("dot", "convolution"):
                gemms.append(make(ins, "none", ins.opcode, ins))
    return gemms


def tensor_core_violations(gemms: list[Gemm], allowed_f32: Counter | None = None,
                           libraries: tuple[str, ...] = ("cublas", "cublaslt", "cudnn",
                                                         "triton", "cudnn-fusion")
                           ) -> list[str]:
    """Why each matmul would not run on Tensor Cores in f16/bf16; empty when every one does.

    A matmul violates when it is not a call into one of ``libraries`` (a plain ``dot`` left to
    XLA's loop emitter), or when its operands are not all f16/bf16 and it is not one of the
    float32 matmuls that the policy's float32 rules ask for: ``allowed_f32`` counts those by
    :func:`gemm_signature` (each one allowed consumes one count)."""
    allowed = Counter(allowed_f32 or {})
    out = []
    for g in gemms:
        dts = "x".join(map(str, g.operand_dtypes))
        where = f"{g.name} in {g.computation} ({g.target}, operands {dts})"
        if g.library not in libraries:
            out.append(f"{where}: not a cuBLAS/cuBLASLt/cuDNN call (library {g.library!r})")
            continue
        if g.low_precision:
            continue
        if allowed[g.signature] > 0:
            allowed[g.signature] -= 1
            continue
        out.append(f"{where}: operands are not f16/bf16 and no float32 rule asks for it")
    return out


def host_traffic(text: str) -> list[str]:
    """Instructions that move data between host and device or call back into Python: a loss
    scale or skip decision taken on the host would need one of these."""
    out = []
    for instrs in parse_hlo(text).values():
        for ins in instrs:
            if ins.opcode in HOST_TRANSFER_OPS:
                out.append(f"{ins.name}: {ins.opcode}")
            elif ins.opcode == "custom-call":
                m = _TARGET.search(ins.attrs)
                target = m.group(1) if m else ""
                if any(k in target.lower() for k in HOST_CALLBACK_MARKERS):
                    out.append(f"{ins.name}: custom-call {target}")
    return out


def summarize(gemms: list[Gemm]) -> dict:
    """Counts by library and by operand dtypes (for reports)."""
    return {"count": len(gemms),
            "by_library": dict(Counter(g.library for g in gemms)),
            "by_target": dict(Counter(g.target for g in gemms)),
            "by_operand_dtypes": dict(Counter("x".join(map(str, g.operand_dtypes))
                                              for g in gemms))}


def f32_dot_signatures(closed_jaxpr) -> Counter:
    """The float32 matmuls a traced program asks for (``dot_general`` with a float32 operand,
    sub-jaxprs included), counted by :func:`gemm_signature`: under an AMP policy these are the
    ones the float32 rules kept, so the compiled program may hold that many f32 GEMMs."""
    import numpy as np

    from jaxamp._jaxpr import iter_eqns

    out: Counter = Counter()
    for eqn in iter_eqns(closed_jaxpr):
        if eqn.primitive.name != "dot_general":
            continue
        avals = [v.aval for v in eqn.invars[:2]]
        if not any(np.dtype(a.dtype) == np.float32 for a in avals):
            continue
        sizes = [int(np.prod(a.shape, dtype=np.int64)) for a in avals]
        out_size = int(np.prod(eqn.outvars[0].aval.shape, dtype=np.int64))
        out[gemm_signature(sizes, out_size)] += 1
    return out
