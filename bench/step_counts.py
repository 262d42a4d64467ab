#!/usr/bin/env python
"""The AMP step's compiled program against the plain step's, counted (deterministic, no
timing): fusions, instructions inside fusions, copies and conditionals of XLA's compiled HLO,
StableHLO ops, and XLA's cost estimate (flops, bytes accessed), for ``jaxamp.make_train_step``
(float16, ``DynamicLossScale``, ``clip_norm=1.0``) and the plain step with the same autocast
forward, on the bench GPT (width 128, seq 128, batch 8) at several depths::

    python bench/step_counts.py                  # depths 2 4 8
    python bench/step_counts.py --layers 4 --json /tmp/counts.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter

from _steps import F16_POLICY, AmpRunner, make_baseline_step, make_tx, setup
from gpt import GPTConfig

import jaxamp

_STABLEHLO_OP = re.compile(r"\b(stablehlo\.[a-z_]+|func\.call|chlo\.[a-z_]+)\b")


def stablehlo_ops(text: str) -> Counter:
    return Counter(m.group(1) for m in _STABLEHLO_OP.finditer(text)
                   if not m.group(1).startswith("stablehlo.return"))


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
    return {"instructions_in_fusions": nested, "fusion": ops["fusion"], "copy": ops["copy"],
            "conditional": ops["conditional"]}


def xla_cost(compiled) -> dict:
    """XLA's own estimate of a compiled program's work (``cost_analysis``): ``flops`` and
    ``bytes accessed``, deterministic for one program and platform; {} where the platform
    gives none."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) and cost else cost
    if not isinstance(cost, dict):
        return {}
    return {k: float(cost[k]) for k in ("flops", "bytes accessed") if k in cost}


def counts_row(amp, base) -> dict:
    """``(lowered, compiled)`` of the AMP and the plain step as one flat row:
    ``{op}_amp``/``{op}_baseline`` for fusions, instructions in fusions, copies and
    conditionals, the StableHLO op totals, and ``xla_flops_ratio`` /
    ``xla_bytes_accessed_ratio`` where the platform gives a cost."""
    row = {}
    for side, (lowered, compiled) in (("amp", amp), ("baseline", base)):
        ops = compiled_hlo_ops(compiled.as_text())
        for k in ("fusion", "instructions_in_fusions", "copy", "conditional"):
            row[f"{k}_{side}"] = ops[k]
        row[f"stablehlo_ops_{side}"] = int(sum(stablehlo_ops(lowered.as_text()).values()))
    cost_amp, cost_base = xla_cost(amp[1]), xla_cost(base[1])
    for k in ("flops", "bytes accessed"):
        if cost_amp.get(k) and cost_base.get(k):
            row[f"xla_{k.replace(' ', '_')}_ratio"] = cost_amp[k] / cost_base[k]
    return row


def counts(layers: int, *, d_model: int = 128, heads: int = 4, seq: int = 128,
           batch: int = 8) -> dict:
    cfg = GPTConfig(layers=layers, d_model=d_model, heads=heads, seq=seq)
    model, params, data = setup(cfg, batch)
    tx = make_tx()
    amp = AmpRunner(model, params, tx, data, F16_POLICY, jaxamp.DynamicLossScale())
    lo_a = amp.step.lower(amp.state, data)
    lo_b = make_baseline_step(model, tx, F16_POLICY).lower(params, tx.init(params), data)
    return {"layers": layers, **counts_row((lo_a, lo_a.compile()), (lo_b, lo_b.compile()))}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    rows = [counts(n) for n in args.layers]
    print("| layers | fusions base / AMP | instructions in fusions base / AMP (ratio) | "
          "copies base / AMP | conditionals AMP | StableHLO ops base / AMP | "
          "XLA cost: flops / bytes accessed |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layers']} | {r['fusion_baseline']} / {r['fusion_amp']} | "
              f"{r['instructions_in_fusions_baseline']} / {r['instructions_in_fusions_amp']} "
              f"({r['instructions_in_fusions_amp'] / r['instructions_in_fusions_baseline']:.2f}x)"
              f" | {r['copy_baseline']} / {r['copy_amp']} | {r['conditional_amp']} | "
              f"{r['stablehlo_ops_baseline']} / {r['stablehlo_ops_amp']} | "
              f"{r.get('xla_flops_ratio', float('nan')):.4f}x / "
              f"{r.get('xla_bytes_accessed_ratio', float('nan')):.4f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
