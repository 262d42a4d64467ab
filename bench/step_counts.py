#!/usr/bin/env python
"""The AMP step's compiled program against the plain step's, counted (deterministic, no
timing): fusions, instructions inside fusions, copies and conditionals of XLA's compiled HLO,
StableHLO ops, and XLA's cost estimate of the compiled step's flops and bytes accessed, for
``jaxamp.make_train_step`` (float16 compute, ``DynamicLossScale``, ``clip_norm=1.0``) and the
plain step with the same autocast forward (``_steps.py``), at the
``--quick`` shape and several depths. One compile of each; a loaded machine gives the same
figures as a quiet one.

Usage::

    python bench/step_counts.py                  # depths 2 4 8, the --quick shape
    python bench/step_counts.py --layers 4 --json /tmp/counts.json
"""

from __future__ import annotations

import argparse
import json
import sys

from _hlo import counts_row, hlo_diff
from _steps import (
    F16_POLICY,
    AmpRunner,
    BaselineRunner,
    make_amp_step,
    make_baseline_step,
    make_tx,
    setup,
)
from gpt import GPTConfig

import jaxamp


def counts(layers: int, *, d_model: int = 128, heads: int = 4, seq: int = 128,
           batch: int = 8) -> dict:
    cfg = GPTConfig(layers=layers, d_model=d_model, heads=heads, seq=seq)
    model, params, data = setup(cfg, batch)
    tx = make_tx()
    amp = AmpRunner(model, params, tx, data, F16_POLICY, jaxamp.DynamicLossScale())
    base = BaselineRunner(model, params, tx, data, F16_POLICY)
    lo_a = make_amp_step(model, tx, F16_POLICY).lower(amp.state, data)
    lo_b = make_baseline_step(model, tx, F16_POLICY).lower(base.params, base.opt_state, data)
    d = hlo_diff((lo_a, lo_a.compile()), (lo_b, lo_b.compile()))
    return {"layers": layers, **counts_row(d)}


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
