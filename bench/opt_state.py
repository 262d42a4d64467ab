"""AdamW's moments in bfloat16 (``--opt-state bfloat16``, GitHub issue #44) against float32 ones,
as the Markdown tables of BENCHMARKS.md ("Optimizer state in bfloat16"):

* quality: ``examples/train_lm.py`` (float16 compute, dynamic loss scaling) trained ``--steps``
  steps with float32 and with bfloat16 moments, same seed and data;
* memory: the example's step compiled (not run) per preset, ``memory_analysis()``;
* cost: ``jaxamp.amp(optax.adamw(...))``'s update alone, jitted and donated, per state dtype.

    python bench/opt_state.py                       # tiny, 300 steps; memory of tiny, gpt2-small
    python bench/opt_state.py --steps 60 --preset test --memory test
    python bench/opt_state.py --steps 0 --memory    # the update's cost alone
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import jax  # noqa: E402
import lm_data  # noqa: E402
import lm_report  # noqa: E402
import train_lm  # noqa: E402
from lm_cli import build_parser, validate  # noqa: E402

STATES = ("float32", "bfloat16")


def quality(preset: str, steps: int, policy: str, work: Path) -> dict:
    """summary.json of a ``steps``-step run of ``preset`` per state dtype."""
    out = {}
    for state in STATES:
        run = work / f"{preset}-{state}"
        code = train_lm.main(["--preset", preset, "--steps", str(steps), "--policy", policy,
                              "--opt-state", state, "--no-compare-f32", "--out", str(run)])
        assert code == 0, code
        out[state] = json.loads((run / "summary.json").read_text())
    return out


def memory(preset: str, policy: str, work: Path) -> dict:
    """The compiled step's memory (bytes) and compile time per state dtype (nothing runs)."""
    out = {}
    for state in STATES:
        s = validate(build_parser().parse_args([
            "--preset", preset, "--policy", policy, "--opt-state", state, "--out",
            str(work / f"memory-{preset}-{state}")]))
        try:
            model, tx = train_lm.build_model(s), train_lm.make_optimizer(s.args)
            abstract = train_lm.create_state(model, tx, s, abstract=True)
            batch = jax.eval_shape(lambda s=s: lm_data.get_batch(
                s.corpus.train, seed=0, step=0, batch_size=s.args.batch_size,
                block_size=s.config.block_size))
            t = time.perf_counter()
            compiled = train_lm.make_step(model, tx, s).lower(abstract, batch).compile()
            seconds = time.perf_counter() - t
        finally:
            s.release()
        out[state] = {**lm_report.compiled_memory(compiled), "compile_s": seconds,
                      "opt_state": sum(x.size * x.dtype.itemsize
                                       for x in jax.tree.leaves(abstract.opt_state.inner_state))}
    return out


def update_cost(n: int, repeats: int = 31) -> dict:
    """Compile seconds and median milliseconds of AdamW's update (jaxamp.amp) over ``n``
    parameters, float32 vs bfloat16 state, the runs interleaved."""
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxamp

    rows = n // 1024
    params = {"w": jnp.zeros((rows - rows // 4, 1024)), "v": jnp.zeros((rows // 4, 1024))}
    grads = jax.tree.map(lambda x: jnp.full_like(x, 1e-3), params)
    runs = {}
    for state in STATES:
        tx = jaxamp.amp(optax.adamw(1e-3), loss_scale=jaxamp.NoOpLossScale(),
                        state_dtype=None if state == "float32" else jnp.bfloat16)

        def update(p, s, g, tx=tx):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        t = time.perf_counter()
        compiled = jax.jit(update, donate_argnums=(0, 1)).lower(
            params, tx.init(params), grads).compile()
        runs[state] = {"compile_s": time.perf_counter() - t, "fn": compiled,
                       "carry": (jax.tree.map(jnp.copy, params), tx.init(params)), "ms": [],
                       "temp": compiled.memory_analysis().temp_size_in_bytes}
    for _ in range(repeats):
        for r in runs.values():
            t = time.perf_counter()
            r["carry"] = r["fn"](*r["carry"], grads)
            jax.block_until_ready(r["carry"])
            r["ms"].append(1e3 * (time.perf_counter() - t))
    return {state: {"compile_s": r["compile_s"], "ms": float(np.median(r["ms"][1:])),
                    "temp": r["temp"], "params": rows * 1024} for state, r in runs.items()}


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def markdown(runs: dict, mem: dict, cost: dict, preset: str, steps: int) -> str:
    lines = []
    if runs:
        lines += [f"Quality, `{preset}` preset, {steps} steps:", "",
                  "| moments | final val loss | vs float32 | tokens/s | optimizer state |",
                  "|---|---:|---:|---:|---:|"]
        ref = runs["float32"]["final_val_loss"]
        for state in STATES:
            r = runs[state]
            lines.append(f"| {state} | {r['final_val_loss']:.4f} | "
                         f"{r['final_val_loss'] / ref - 1:+.2%} | {r['tokens_per_s']:,.0f} | "
                         f"{_mib(r['opt_state_bytes']['total'])} |")
        lines.append("")
    if cost:
        n = cost["float32"]["params"]
        lines += [f"AdamW's update alone ({n:,} params, `jaxamp.amp`, donated):", "",
                  "| moments | update | compile | temp |", "|---|---:|---:|---:|"]
        for state in STATES:
            c = cost[state]
            lines.append(f"| {state} | {c['ms']:.2f} ms | {c['compile_s']:.2f} s | "
                         f"{c['temp']:,} B |")
        lines.append("")
    if not mem:
        return "\n".join(lines)
    lines += [f"Compiled step (`memory_analysis`, {jax.default_backend()}):", "",
              "| preset | moments | optimizer state | arguments | temp | total | compile |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for name, m in mem.items():
        for state in STATES:
            x = m[state]
            lines.append(f"| {name} | {state} | {_mib(x['opt_state'])} | "
                         f"{_mib(x['argument'])} | {_mib(x['temp'])} | {_mib(x['total'])} | "
                         f"{x['compile_s']:.1f} s |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--policy", default="params=float32,compute=float16,output=float32")
    p.add_argument("--memory", nargs="*", default=["tiny", "gpt2-small"],
                   help="presets whose compiled step memory is reported")
    p.add_argument("--update-params", type=int, default=2**20 + 2**18,
                   help="parameters of the update-cost measurement (0: skip it)")
    p.add_argument("--json", default=None, help="also write the figures here")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        runs = quality(a.preset, a.steps, a.policy, work) if a.steps else {}
        mem = {preset: memory(preset, a.policy, work) for preset in a.memory}
    cost = update_cost(a.update_params) if a.update_params else {}
    print(f"jax {jax.__version__}, {jax.default_backend()}\n")
    print(markdown(runs, mem, cost, a.preset, a.steps))
    if a.json:
        Path(a.json).write_text(json.dumps({"runs": runs, "memory": mem, "update": cost},
                                           indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
