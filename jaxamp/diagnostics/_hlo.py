"""The one reader of compiled XLA:GPU HLO text (no JAX): the kernels a GPU will launch, what each
reads, writes and multiplies, the library that runs each matmul, and host traffic. What XLA:GPU
emits, and how it is read: docs/api/diagnostics.rst, "The GPU program".
"""

from __future__ import annotations

import dataclasses
import json
import math
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
_FUSION_CONFIG = re.compile(r'"fusion_backend_config"\s*:\s*')
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
    m = _ARRAY_TYPE.match(type_text.strip().lstrip("( "))
    if not m:
        return None, None
    return m.group(1), math.prod(int(d) for d in m.group(2).replace(" ", "").split(",") if d)


def _close(text: str, i: int) -> int:
    """The index after the bracket that closes the one at ``text[i]`` (counting that kind)."""
    open_, close, depth = text[i], {"(": ")", "{": "}"}[text[i]], 0
    for k in range(i, len(text)):
        depth += (text[k] == open_) - (text[k] == close)
        if depth == 0:
            return k + 1
    return len(text)


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
    m = re.match(r"\S+", rhs)
    i = _close(rhs, 0) if rhs.startswith("(") else m.end() if m else 0
    type_text, rest = rhs[:i], rhs[i:].lstrip()
    m = re.match(r"([a-z][\w\-]*)\(", rest)
    if not m:
        return None
    k = _close(rest, m.end() - 1)
    return type_text, m.group(1), _split_top(rest[m.end():k - 1]), rest[k:]


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


def _json_after(attrs: str, key: re.Pattern) -> dict:
    """The JSON object right after ``key`` in ``attrs`` ({} if absent or unreadable)."""
    m = key.search(attrs)
    if not m or not attrs.startswith("{", m.end()):
        return {}
    try:
        found = json.loads(attrs[m.end():_close(attrs, m.end())])
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def fusion_kind(attrs: str) -> str | None:
    """The ``"kind"`` of a fusion's ``fusion_backend_config`` (None if it has none), read from
    the config's own braces (on the H200's XLA it follows a nested object)."""
    kind = _json_after(attrs, _FUSION_CONFIG).get("kind")
    return kind if isinstance(kind, str) else None


def find_gemms(text: str) -> list[Gemm]:
    """Every matmul, convolution and cuDNN call the compiled module's kernels (:func:`kernels`)
    run, with the library that runs it; a plain dot inside a fusion is listed on its own."""
    prog = _Program(text)
    return [g for ins, _ in _launches(prog) for g in _gemms(prog, ins)]


def _gemms(prog: _Program, ins: Instr) -> list[Gemm]:
    """The matmuls kernel ``ins`` runs: a cuBLAS/cuDNN call, a GEMM fusion's dots (named by
    the fusion), a plain dot or convolution, or one inside an XLA fusion (named by itself)."""
    if ins.opcode == "custom-call":
        target = _target(ins)
        library = _library(target)
        return [] if library == "xla" else [_gemm(prog, ins, library.removesuffix("-fp8"),
                                                  target, ins)]
    if ins.opcode in ("dot", "convolution"):
        return [_gemm(prog, ins, "none", ins.opcode, ins)]
    kind, dots = fusion_kind(ins.attrs), _fusion_dots(prog, ins)
    if kind in GEMM_FUSION_KINDS:
        return [_gemm(prog, ins, GEMM_FUSION_KINDS[kind], kind, d) for d in dots]
    return [_gemm(prog, d, "none", d.opcode, d) for d in dots]


def _gemm(prog: _Program, ins: Instr, library: str, target: str, dot: Instr) -> Gemm:
    """``ins`` as a :class:`Gemm` whose operands and result are those of ``dot``."""
    infos = [first_array(t) for t in prog.operand_types(dot)[:2]]
    out_dt, out_n = first_array(dot.type)
    return Gemm(ins.name, ins.computation, library, target, tuple(d for d, _ in infos),
                out_dt or first_array(ins.type)[0], tuple(n for _, n in infos), out_n)


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
            elif ins.opcode == "custom-call" and any(
                    k in _target(ins).lower() for k in HOST_CALLBACK_MARKERS):
                out.append(f"{ins.name}: custom-call {_target(ins)}")
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

    from .._engine.jaxpr import iter_eqns

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


_F8_DOT = re.compile(r"stablehlo\.dot_general .*: \(tensor<([^>]*)xf8E\w+>, "
                     r"tensor<[^>]*xf8E\w+>\) -> tensor<([^>]*)x\w+>")
_CONTRACTING = re.compile(r"contracting_dims = \[([\d, ]*)\]")


def planned_fp8_dots(stablehlo: str) -> list[int]:
    """The FLOPs of each ``dot_general`` with two FP8 operands in StableHLO text
    (``lower(...).as_text()``): 2 x output elements x contracted size."""
    out = []
    for line in stablehlo.splitlines():
        m = _F8_DOT.search(line)
        if not m:
            continue
        lhs = [int(d) for d in m.group(1).split("x") if d]
        res = [int(d) for d in m.group(2).split("x") if d]
        c = _CONTRACTING.search(line)
        dims = [int(x) for x in c.group(1).split(",") if x.strip()] if c else []
        out.append(2 * math.prod(res) * math.prod(lhs[d] if d < len(lhs) else 1 for d in dims))
    return out


#: Bits per element of each HLO element type (``pred`` is stored in a byte).
_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32,
         "u32": 32, "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64,
         "c64": 64, "c128": 128, "f8e4m3fn": 8, "f8e5m2": 8, "f8e4m3fnuz": 8, "f8e5m2fnuz": 8,
         "f8e4m3": 8, "f8e3m4": 8, "f8e4m3b11fnuz": 8, "f8e8m0fnu": 8, "f4e2m1fn": 4,
         "token": 0}
# Instructions that launch nothing: buffer plumbing, and control flow whose bodies are walked.
_NO_KERNEL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
              "conditional", "call", "after-all", "opt-barrier", "optimization-barrier",
              "partition-id", "replica-id", "add-dependency", "domain", "iota-fake"}
_ARRAY_ANY = re.compile(r"\b([a-z]\w*)\[([\d,\s]*)\]")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_BODY = re.compile(r"\bbody=%?([\w.\-$]+)")
_CONDITION = re.compile(r"\bcondition=%?([\w.\-$]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-$]+)|"
                       r"false_computation=%?([\w.\-$]+)")
_TO_APPLY = re.compile(r"\bto_apply=%?([\w.\-$]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_LHS_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,\s]*)\}")
_DIM_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")
_BACKEND_CONFIG = re.compile(r"backend_config=")
_SLICING = {"slice", "dynamic-slice", "gather"}  # a parameter read only through these: rows
FP8_GEMM_TARGETS = ("__cublas$lt$matmul$f8",)


def arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """Every array of a (possibly tuple) type: ``[(dtype, dims), ...]``."""
    return [(m.group(1), tuple(int(d) for d in m.group(2).replace(" ", "").split(",") if d))
            for m in _ARRAY_ANY.finditer(type_text) if m.group(1) in _BITS]


def type_bytes(type_text: str) -> int:
    """Bytes of every array in a (possibly tuple) type."""
    return sum(array_bytes(dtype, dims) for dtype, dims in arrays(type_text))


def array_bytes(dtype: str, dims: tuple[int, ...]) -> int:
    """Bytes of one array of HLO element type ``dtype`` (``"bf16"``) and shape ``dims``."""
    return (math.prod(dims) * _BITS[dtype] + 7) // 8


def backend_config(attrs: str) -> dict:
    """The JSON ``backend_config`` of an instruction ({} if absent or unreadable)."""
    return _json_after(attrs, _BACKEND_CONFIG)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel launch of the compiled program (per execution of its computation).

    ``kind``: ``gemm`` (a cuBLAS/cuBLASLt call or a Triton/cuDNN GEMM fusion), ``attention``
    (cuDNN fused attention), ``convolution`` (cuDNN), ``fusion`` (XLA's own fused elementwise /
    reduction kernel; ``target`` is its fusion kind, ``kLoop``, ``kInput``, ...), ``copy``, or
    ``other`` (any other custom call or unfused op). ``times`` is how often it runs per call of
    the program (the trip counts of the loops it sits in). ``flops`` counts the multiply-adds of
    matmuls, convolutions and attention (x2); elementwise work is not counted.
    """

    name: str
    computation: str
    kind: str
    library: str  # cublas, cublaslt, cublaslt-fp8, triton, cudnn, cudnn-fusion, xla
    target: str  # custom-call target, fusion kind, or opcode
    bytes_read: int
    bytes_written: int
    flops: int
    dtypes: tuple[str | None, ...]  # GEMM/attention operand dtypes; () for other kernels
    precision: str  # "HIGHEST" when a GEMM asks for full float32 products, else "DEFAULT"
    times: int
    op_name: str
    f8_inputs: bool = False  # a GEMM fed float8 data (its operands, or a fusion producing them)

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def fp8(self) -> bool:
        """Every GEMM/attention operand is a float8 type (an FP8 GEMM XLA formed)."""
        return bool(self.dtypes) and all((d or "").startswith("f8") for d in self.dtypes)


def operand_name(operand: str) -> str | None:
    m = _OPERAND.match(operand.strip())
    return m.group(2) if m else None


def op_name(attrs: str) -> str:
    """The JAX name stack of an instruction (its ``metadata={op_name=...}``; "" if none)."""
    m = _OP_NAME.search(attrs)
    return m.group(1) if m else ""


def hlo_modules(text: str) -> list[str]:
    """``text`` split into its HLO modules (several dump files read as one text)."""
    parts = re.split(r"^(?=HloModule\b)", text, flags=re.M)
    return [p for p in parts if p.strip()] or [text]


class _Program:
    """A parsed module with name tables and instruction users, per computation."""

    def __init__(self, text: str):
        self.comps = parse_hlo(text)
        self.types = {c: {i.name: i.type for i in ins} for c, ins in self.comps.items()}
        self.by_name = {c: {i.name: i for i in ins} for c, ins in self.comps.items()}
        self.entry = _entry_name(text) or (next(reversed(self.comps)) if self.comps else None)

    def operand_types(self, ins: Instr) -> list[str]:
        table = self.types.get(ins.computation, {})
        out = []
        for o in ins.operands:
            m = _OPERAND.match(o.strip())
            if m and m.group(1):
                out.append(m.group(1))
            else:
                out.append(table.get(m.group(2), "") if m else "")
        return out

    def users(self, comp: str) -> dict[str, list[Instr]]:
        out: dict[str, list[Instr]] = {}
        for ins in self.comps.get(comp, []):
            for o in ins.operands:
                name = operand_name(o)
                if name is not None:
                    out.setdefault(name, []).append(ins)
        return out


def _entry_name(text: str) -> str | None:
    m = re.search(r"^ENTRY\s+%?([\w.\-$]+)", text, flags=re.M)
    return m.group(1) if m else None


def _read_bytes(param: Instr, users: dict) -> int:
    """Bytes a fused computation reads of one parameter: all of it, or only the rows its
    slices and gathers take when those are its only readers (a layer's slice of stacked
    weights, an embedding's rows), or nothing when it is the buffer an in-place
    dynamic-update-slice / scatter writes into."""
    full = type_bytes(param.type)
    seen, frontier, taken = set(), [param.name], 0
    while frontier:
        name = frontier.pop()
        for u in users.get(name, []):
            if u.name in seen:
                continue
            seen.add(u.name)
            first = operand_name(u.operands[0]) if u.operands else None
            if u.opcode in _SLICING and first == name:
                taken += type_bytes(u.type)
            elif u.opcode in ("dynamic-update-slice", "scatter") and first == name:
                continue  # written in place: the buffer is not read
            elif u.opcode in ("bitcast", "reshape"):
                frontier.append(u.name)
            else:
                return full
    return min(taken, full)


def _written_bytes(prog: _Program, comp: str, result_type: str) -> int:
    """Bytes a fused computation writes: its result, except that an in-place
    dynamic-update-slice or scatter root writes only its update."""
    instrs = prog.comps.get(comp, [])
    root = instrs[-1] if instrs else None
    if root is None:
        return type_bytes(result_type)
    table = prog.by_name.get(comp, {})
    outs = [table.get(operand_name(o) or "") for o in root.operands] \
        if root.opcode == "tuple" else [root]
    total = 0
    for out in outs:
        if out is None:
            continue
        if out.opcode == "dynamic-update-slice" and len(out.operands) > 1:
            total += type_bytes(prog.operand_types(out)[1])
        elif out.opcode == "scatter" and len(out.operands) > 2:
            total += type_bytes(prog.operand_types(out)[2])
        else:
            total += type_bytes(out.type)
    return total


def _flops(lhs_type: str, out_type: str, contracting: tuple[int, ...]) -> int:
    lhs = arrays(lhs_type)
    out = arrays(out_type)
    if not lhs or not out:
        return 0
    k = 1
    for d in contracting:
        if d < len(lhs[0][1]):
            k *= lhs[0][1][d]
    return 2 * math.prod(out[0][1]) * k


def _dot_flops(prog: _Program, dot: Instr) -> int:
    types = prog.operand_types(dot)
    m = _LHS_CONTRACTING.search(dot.attrs)
    dims = tuple(int(d) for d in m.group(1).replace(" ", "").split(",") if d) if m else ()
    return _flops(types[0] if types else "", dot.type, dims)


def _gemm_call(prog: _Program, ins: Instr, target: str) -> tuple[int, str]:
    """(flops, precision) of a cuBLAS / cuBLASLt custom call."""
    cfg = backend_config(ins.attrs).get("gemm_backend_config", {})
    dnums = cfg.get("dot_dimension_numbers", {})
    contracting = tuple(int(d) for d in dnums.get("lhs_contracting_dimensions", []))
    types = prog.operand_types(ins)
    precision = "HIGHEST" if "HIGHEST" in cfg.get("precision_config", {}).get(
        "operand_precision", []) else "DEFAULT"
    return _flops(types[0] if types else "", ins.type, contracting), precision


def _attention_call(prog: _Program, ins: Instr, target: str) -> int:
    """FLOPs of a cuDNN fused-attention call: 2 GEMMs forward (Q K^T, P V), 5 backward, half
    under a causal mask; scores of the config's ``intermediate_tensor_shape``, the head size
    the query's last dimension."""
    cfg = backend_config(ins.attrs).get("cudnn_fmha_backend_config", {})
    scores = tuple(int(d) for d in cfg.get("intermediate_tensor_shape", {})
                   .get("dimensions", []))
    types = prog.operand_types(ins)
    q = arrays(types[0]) if types else []
    if not scores or not q or not q[0][1]:
        return 0
    flops = 2 * (5 if "Backward" in target else 2) * math.prod(scores) * q[0][1][-1]
    return flops // 2 if "CAUSAL" in str(cfg.get("mask_type", "")) else flops


def _conv_call(prog: _Program, ins: Instr, target: str) -> int:
    """FLOPs of a cuDNN convolution: 2 x the output activation's elements x the kernel's
    elements per output feature (forward, input and filter gradients alike)."""
    m = _DIM_LABELS.search(ins.attrs)
    types = prog.operand_types(ins)
    result = ins.type
    if not m or len(types) < 2:
        return 0
    kernel_labels = m.group(2)
    if "BackwardFilter" in target:
        activation, kernel = types[1], result
    elif "BackwardInput" in target:
        activation, kernel = types[0], types[1]
    else:
        activation, kernel = result, types[1]
    act, ker = arrays(activation), arrays(kernel)
    if not act or not ker or "o" not in kernel_labels:
        return 0
    dims = ker[0][1]
    out_features = dims[kernel_labels.index("o")] if len(dims) == len(kernel_labels) else 1
    return 2 * math.prod(act[0][1]) * (math.prod(dims) // max(out_features, 1))


def _target(ins: Instr) -> str:
    m = _TARGET.search(ins.attrs)
    return m.group(1) if m else ""


def _library(target: str) -> str:
    """The library a custom-call target runs in (``xla``: none of cuBLAS/cuBLASLt/cuDNN)."""
    if target.startswith(CUBLAS_PREFIX):
        return ("cublaslt-fp8" if target in FP8_GEMM_TARGETS else
                "cublaslt" if target.startswith("__cublas$lt$") else "cublas")
    return "cudnn" if target.startswith(CUDNN_PREFIX) else "xla"


def _kernel(target: str, read: int, written: int, kind: str, library: str = "xla",
            flops: int = 0, dtypes: tuple = (), precision: str = "DEFAULT") -> dict:
    return dict(target=target, bytes_read=read, bytes_written=written, flops=flops,
                dtypes=dtypes, precision=precision, kind=kind, library=library)


def _custom_call_kernel(prog: _Program, ins: Instr) -> dict:
    target = _target(ins)
    library = _library(target)
    # A library call returns (outputs..., s8/u8 workspace): the workspace is scratch.
    outs = arrays(ins.type)
    written = type_bytes(ins.type)
    if ins.type.lstrip().startswith("(") and outs and outs[-1][0] in ("s8", "u8"):
        written -= array_bytes(*outs[-1])
    out = _kernel(target, sum(type_bytes(t) for t in prog.operand_types(ins)), written,
                  "other", library)
    dtypes = _gemms(prog, ins)[0].operand_dtypes if library != "xla" else ()
    if library.startswith("cublas"):
        flops, precision = _gemm_call(prog, ins, target)
        out.update(kind="gemm", flops=flops, dtypes=dtypes, precision=precision)
    elif library == "cudnn" and "fmha" in target:
        out.update(kind="attention", flops=_attention_call(prog, ins, target), dtypes=dtypes)
    elif library == "cudnn" and "conv" in target:
        out.update(kind="convolution", flops=_conv_call(prog, ins, target), dtypes=dtypes)
    return out


def _fusion_dots(prog: _Program, ins: Instr) -> list[Instr]:
    """The dots and convolutions in the computation fusion ``ins`` calls."""
    called = _CALLS.search(ins.attrs) if ins.opcode == "fusion" else None
    body = prog.comps.get(called.group(1), []) if called else []
    return [i for i in body if i.opcode in ("dot", "convolution")]


def _fusion_kernel(prog: _Program, ins: Instr) -> dict:
    called = _CALLS.search(ins.attrs)
    comp = called.group(1) if called else None
    kind = fusion_kind(ins.attrs)
    m = re.search(r"\bkind=(\w+)", ins.attrs)
    target = kind or (m.group(1) if m else "fusion")
    types = prog.operand_types(ins)
    if comp not in prog.comps:
        return _kernel(target, sum(map(type_bytes, types)), type_bytes(ins.type), "fusion")
    users = prog.users(comp)
    params = {int(p.operands[0]): p for p in prog.comps[comp]
              if p.opcode == "parameter" and p.operands and p.operands[0].isdigit()}
    read = sum(_read_bytes(params[k], users) if k in params else type_bytes(t)
               for k, t in enumerate(types))
    out = _kernel(target, read, _written_bytes(prog, comp, ins.type), "fusion")
    if kind in GEMM_FUSION_KINDS:
        dots = _fusion_dots(prog, ins)
        gemms = _gemms(prog, ins)
        flops = sum(_dot_flops(prog, d) for d in dots)
        precision = "HIGHEST" if any("HIGHEST" in d.attrs for d in dots) else "DEFAULT"
        out.update(kind="gemm", library=GEMM_FUSION_KINDS[kind], flops=flops,
                   dtypes=gemms[0].operand_dtypes if gemms else (), precision=precision)
    return out


def _plain_kernel(prog: _Program, ins: Instr) -> dict:
    types = prog.operand_types(ins)
    out = _kernel(ins.opcode, sum(map(type_bytes, types)), type_bytes(ins.type),
                  "copy" if ins.opcode == "copy" else "other")
    if ins.opcode == "dot":
        out.update(kind="gemm", library="none", flops=_dot_flops(prog, ins),
                   dtypes=_gemms(prog, ins)[0].operand_dtypes)
    return out


def _is_f8(type_text: str) -> bool:
    return any(d.startswith("f8") for d, _ in arrays(type_text))


def _computes_f8(prog: _Program, comp: str) -> bool:
    return any(_is_f8(i.type) for i in prog.comps.get(comp, []))


def _made_from_f8(prog: _Program, comp: str, name: str | None, depth: int = 0) -> bool:
    """Whether value ``name`` of ``comp`` is float8 or made from float8 data: followed back
    through tuple elements, bitcasts and copies to a fusion (any float8 value inside it) or a
    convert of a float8 value."""
    ins = prog.by_name.get(comp, {}).get(name or "")
    if ins is None or depth > 8:
        return False
    if _is_f8(ins.type):
        return True
    if ins.opcode in ("get-tuple-element", "bitcast", "copy", "reshape", "transpose"):
        return bool(ins.operands) and _made_from_f8(prog, comp, operand_name(ins.operands[0]),
                                                    depth + 1)
    if ins.opcode == "fusion":
        called = _CALLS.search(ins.attrs)
        return bool(called) and _computes_f8(prog, called.group(1))
    if ins.opcode == "convert":
        return any(_is_f8(t) for t in prog.operand_types(ins))
    return False


def _reads_f8(prog: _Program, ins: Instr) -> bool:
    """Whether a GEMM kernel is fed float8 data: an f8 operand, float8 values in its own fused
    computation, or an operand made from float8 data (XLA's ``TurnF8DotIntoF16Dot`` converts
    a float8 operand up, usually inside the fusion that quantized it)."""
    called = _CALLS.search(ins.attrs) if ins.opcode == "fusion" else None
    if called and _computes_f8(prog, called.group(1)):
        return True
    return any(_made_from_f8(prog, ins.computation, operand_name(o)) for o in ins.operands)


def _launches(prog: _Program):
    """``(instruction, times)`` of every kernel launch, walked from the entry computation
    through loops (a body runs its known trip count times; a loop without one once),
    conditionals (every branch, as if each ran) and calls."""
    def walk(comp: str, times: int, depth: int):
        if depth > 32 or comp not in prog.comps:
            return
        for ins in prog.comps[comp]:
            op = ins.opcode
            if op == "while":
                trip = _TRIP_COUNT.search(ins.attrs)
                n = int(trip.group(1)) if trip else 1
                body, cond = _BODY.search(ins.attrs), _CONDITION.search(ins.attrs)
                if cond:
                    yield from walk(cond.group(1), times * (n + 1), depth + 1)
                if body:
                    yield from walk(body.group(1), times * n, depth + 1)
            elif op == "conditional":
                for m in _BRANCHES.finditer(ins.attrs):
                    names = m.group(1).split(",") if m.group(1) else [m.group(2) or m.group(3)]
                    for name in names:
                        yield from walk(name.strip().lstrip("%"), times, depth + 1)
            elif op in ("call", "async-start"):
                called = _TO_APPLY.search(ins.attrs) or _CALLS.search(ins.attrs)
                if called:
                    yield from walk(called.group(1), times, depth + 1)
            elif not (op in _NO_KERNEL or op.endswith("-done") or op.endswith("-update")):
                yield ins, times

    if prog.entry is not None:
        yield from walk(prog.entry, 1, 0)


def kernels(text: str) -> list[Kernel]:
    """Every kernel the compiled module launches (loop bodies' ``times`` their trip count,
    every branch of a conditional listed, as if each ran)."""
    prog = _Program(text)
    out: list[Kernel] = []
    for ins, times in _launches(prog):
        read = {"custom-call": _custom_call_kernel, "fusion": _fusion_kernel}.get(
            ins.opcode, _plain_kernel)
        k = read(prog, ins)
        out.append(Kernel(ins.name, ins.computation, k["kind"], k["library"], k["target"],
                          k["bytes_read"], k["bytes_written"], k["flops"], k["dtypes"],
                          k["precision"], times, op_name(ins.attrs),
                          k["kind"] == "gemm" and _reads_f8(prog, ins)))
    return out
