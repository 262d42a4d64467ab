"""Readers of the programs: op counts of StableHLO and compiled HLO text, ``stablehlo.convert``
directions, and the matmul FLOPs of a jaxpr by operand dtype."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np

from jaxamp._jaxpr import iter_eqns

_STABLEHLO_OP = re.compile(r"\b(stablehlo\.[a-z_]+|func\.call|chlo\.[a-z_]+)\b")
_CONVERT = re.compile(r"stablehlo\.convert\b[^\n]*?:\s*\(?tensor<(?:[\dx]*x)?(\w+)>\)?\s*->"
                      r"\s*tensor<(?:[\dx]*x)?(\w+)>")


def stablehlo_ops(text: str) -> Counter:
    return Counter(m.group(1) for m in _STABLEHLO_OP.finditer(text)
                   if not m.group(1).startswith("stablehlo.return"))


def convert_stats(text: str) -> dict:
    count = len(re.findall(r"stablehlo\.convert\b", text))
    kinds = Counter(f"{a}->{b}" for a, b in _CONVERT.findall(text))
    return {"count": count, "by_direction": dict(sorted(kinds.items()))}


_HLO_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+ = (?:\([^=]*?\)|\S+) ([a-z][\w\-]*)\(")
_HLO_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_HLO_CALLED = re.compile(r"(?:branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+)|"
                         r"false_computation=%?([\w.\-]+)|body=%?([\w.\-]+)|"
                         r"condition=%?([\w.\-]+))")


def compiled_hlo_ops(text: str) -> dict:
    """Opcode histogram of the compiled (optimized) HLO's control-flow level: the entry
    computation and the conditional branches / loop bodies it runs, not the bodies of fusions
    or the reducers of reduce ops. ``instructions_in_fusions`` counts everything else."""
    text = re.sub(r"/\*.*?\*/", "", text)
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in text.splitlines():
        m = _HLO_COMPUTATION.match(line)
        if m and "->" in line:
            current = m.group(2)
            comps[current] = []
            if m.group(1):
                entry = current
        elif current is not None and line.strip() != "}":
            comps[current].append(line)
    top, todo = set(), [entry] if entry else []
    while todo:
        name = todo.pop()
        if name in top or name not in comps:
            continue
        top.add(name)
        for line in comps[name]:
            for m in _HLO_CALLED.finditer(line):
                for g in m.groups():
                    if g:
                        todo += [n.strip().lstrip("%") for n in g.split(",")]
    ops: Counter = Counter()
    nested = 0
    for name, lines in comps.items():
        for line in lines:
            m = _HLO_INSTR.match(line)
            if not m:
                continue
            if name in top:
                ops[m.group(1)] += 1
            else:
                nested += 1
    return {"unfused_instructions": int(sum(ops.values())), "instructions_in_fusions": nested,
            "computations": len(comps), "fusion": ops["fusion"], "copy": ops["copy"],
            "conditional": ops["conditional"], "dot": ops["dot"], "by_op": dict(ops.most_common())}


def xla_cost(compiled) -> dict:
    """XLA's own estimate of a compiled program's work (``cost_analysis``): ``flops`` and
    ``bytes accessed``, deterministic for one program and platform; {} where the platform
    gives none."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) and cost else cost
    if not isinstance(cost, dict):
        return {}
    return {k: float(cost[k]) for k in ("flops", "bytes accessed") if k in cost}


def counts_row(diff: dict) -> dict:
    """The compiled counts of an :func:`hlo_diff` as one flat row: ``{op}_amp``/``{op}_baseline``
    for fusions, instructions in fusions, copies and conditionals, the StableHLO op totals, and
    ``xla_flops_ratio``/``xla_bytes_accessed_ratio`` where the platform gives a cost."""
    row = {f"{k}_{side}": diff[f"compiled_{side}"].get(k, 0) for side in ("amp", "baseline")
           for k in ("fusion", "instructions_in_fusions", "copy", "conditional")}
    row["stablehlo_ops_amp"] = diff["stablehlo_ops_amp"]
    row["stablehlo_ops_baseline"] = diff["stablehlo_ops_baseline"]
    amp, base = diff["xla_cost_amp"], diff["xla_cost_baseline"]
    for k in ("flops", "bytes accessed"):
        if amp.get(k) and base.get(k):
            row[f"xla_{k.replace(' ', '_')}_ratio"] = amp[k] / base[k]
    return row


def dot_flops(eqn) -> int:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    rhs_free = [d for i, d in enumerate(rhs) if i not in rc and i not in rb]
    return 2 * int(np.prod(lhs, dtype=np.int64)) * int(np.prod(rhs_free, dtype=np.int64))


def matmul_fraction(jaxpr, dtype) -> tuple[float, int, dict]:
    total, low = 0, 0
    by_dtype: Counter = Counter()
    for eqn in iter_eqns(jaxpr):
        if eqn.primitive.name != "dot_general":
            continue
        flops = dot_flops(eqn)
        total += flops
        dts = "x".join(str(v.aval.dtype) for v in eqn.invars)
        by_dtype[dts] += flops
        if all(np.dtype(v.aval.dtype) == np.dtype(dtype) for v in eqn.invars):
            low += flops
    return (low / total if total else 0.0), total, dict(by_dtype)


def hlo_diff(amp, base) -> dict:
    """Op counts of the AMP step vs the baseline, StableHLO and compiled HLO."""
    amp_ops, base_ops = stablehlo_ops(amp[0].as_text()), stablehlo_ops(base[0].as_text())
    extra = {k: amp_ops[k] - base_ops[k] for k in set(amp_ops) | set(base_ops)
             if amp_ops[k] != base_ops[k]}
    amp_c, base_c = compiled_hlo_ops(amp[1].as_text()), compiled_hlo_ops(base[1].as_text())
    return {
        "stablehlo_ops_amp": int(sum(amp_ops.values())),
        "stablehlo_ops_baseline": int(sum(base_ops.values())),
        "stablehlo_extra_ops_amp_by_op": dict(sorted(extra.items(), key=lambda kv: -kv[1])),
        "compiled_amp": {k: v for k, v in amp_c.items() if k != "by_op"},
        "compiled_baseline": {k: v for k, v in base_c.items() if k != "by_op"},
        "xla_cost_amp": xla_cost(amp[1]),
        "xla_cost_baseline": xla_cost(base[1]),
        "compiled_extra_unfused_by_op": {
            k: amp_c["by_op"].get(k, 0) - base_c["by_op"].get(k, 0)
            for k in sorted(set(amp_c["by_op"]) | set(base_c["by_op"]))
            if amp_c["by_op"].get(k, 0) != base_c["by_op"].get(k, 0)},
    }
