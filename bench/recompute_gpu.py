"""What autocast's recompute costs and saves on a GPU, and which part of it costs what.

Issue 24 made autocast recompute the cheap code between matmuls in the backward pass
(:mod:`jaxamp._recompute`): norm regions, softmax, activation chains (segments, each a
``jax.checkpoint`` keeping its low-precision inputs and row statistics) and the low-precision
copies of params (:func:`jaxamp._op_rules.recompute_param_casts`). The program-level
residual bytes fall to ~0.27x; on an H200 ``bench/gpu.sh`` measured the gpt2-small-shape step
at 0.945x the peak memory and 0.87x the tokens/s of the same step with ``recompute=False``.
This script takes that apart: the same step (``bench/gpt.py``, ``make_train_step``, AdamW,
clip 1.0) built with one piece of the recompute machinery switched off at a time (patched
in this process only, during tracing), each variant's

* step time (interleaved repeats, medians) and its ratio to ``recompute=False``;
* peak device memory of its first step (``memory_stats``, padded to the earlier peak:
  ``_gpu.peak_step``) and XLA's temp bytes (``memory_analysis``);
* GEMMs by library (``jaxamp.diagnostics._hlo``: cuBLAS calls vs XLA Triton GEMM fusions);
* ``optimization_barrier`` count in its StableHLO (proves the patch changed the program).

Variants (bf16 unless named; ``off`` is ``recompute=False``, ``on`` ``recompute=True``, the
default before issue 40):
``off``, ``on``, ``on-no-param-casts`` (params cast once in the forward and kept),
``on-no-cse-barrier`` (``jax.checkpoint(prevent_cse=False)``), ``on-no-rounding``
(segments read low inputs without ``_recompute._rounded``'s barrier), ``on-no-softmax``
(segments holding an ``exp`` are evaluated plainly), ``on-no-stats`` (nor segments holding a
reduction: norms, softmax), ``param-casts-only`` (no segments),
and ``off``/``on`` in float16.

Usage: ``python bench/recompute_gpu.py --out DIR`` on a GPU (gpt2-small shape, batch 16;
about 3 minutes on an H200), ``--cpu-dry-run`` at toy size on CPU (plumbing only). Writes
``DIR/recompute-gpu.json`` and ``DIR/recompute-hlo.tar.gz`` (the compiled HLO of ``off``,
``on`` and ``on-no-param-casts``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

VARIANTS = ("off", "on", "on-no-param-casts", "on-no-rounding", "on-no-cse-barrier",
            "on-no-softmax", "off/float16", "on/float16", "param-casts-only",
            "on-none-of-three")
DUMPED = ("off", "on", "on-no-param-casts")


def _prims(eqns) -> set[str]:
    """The primitives of ``eqns`` and of their sub-jaxprs."""
    from jaxamp._compat import sub_jaxprs
    from jaxamp._jaxpr import iter_eqns

    return {e.primitive.name for e in eqns} | {
        x.primitive.name for e in eqns for s in sub_jaxprs(e) for x in iter_eqns(s)}


@contextlib.contextmanager
def patched(variant: str):
    """The recompute machinery with the variant's piece switched off, while tracing."""
    import jax

    import jaxamp._op_rules as op_rules
    import jaxamp._recompute as rc
    from jaxamp._jaxpr import equations

    saved = []

    def put(mod, name, val):
        saved.append((mod, name, getattr(mod, name)))
        setattr(mod, name, val)

    def plain_param_casts(eqn, ins, site, params, dtype, given):
        return op_rules.bind_eqn(eqn, [op_rules.cast(v, dtype) for v in ins], site,
                                 params=params)

    plan = rc.plan

    def plan_without(prims):
        def f(rules, jaxpr, taken, cuts, memo=None):
            eqns = equations(jaxpr)
            return {k: s for k, s in plan(rules, jaxpr, taken, cuts, memo).items()
                    if not (_prims([eqns[i] for i in range(s.start, s.end)
                                    if i not in s.hoisted]) & prims)}
        return f

    base = variant.split("/")[0]
    if base in ("on-no-param-casts", "on-none-of-three"):
        put(op_rules, "recompute_param_casts", plain_param_casts)
    if base in ("on-no-cse-barrier", "on-none-of-three"):  # what checkpoint_in_place calls
        put(jax, "checkpoint", functools.partial(jax.checkpoint, prevent_cse=False))
    if base in ("on-no-rounding", "on-none-of-three"):
        put(rc, "_rounded", list)
    if base == "on-no-softmax":
        put(rc, "plan", plan_without({"exp"}))
    if base == "on-no-stats":  # no segment holding a row statistic (norms, softmax)
        put(rc, "plan", plan_without({"reduce_sum", "reduce_max"}))
    if base == "param-casts-only":
        put(rc, "plan", lambda rules, jaxpr, taken, cuts, memo=None: {})
    try:
        yield
    finally:
        for mod, name, val in reversed(saved):
            setattr(mod, name, val)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu-dry-run", action="store_true")
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    a = ap.parse_args(argv)
    started = time.monotonic()
    import jax
    from _gpu import GPU_SIZES, _footprint, _jax_memory_stats, _tree_bytes, peak_step
    from _memory import memory_dict
    from _steps import POLICIES, AmpRunner, log, make_tx, setup
    from _timing import interleaved_runtime, med
    from gpt import GPTConfig

    import jaxamp
    from jaxamp.diagnostics._hlo import find_gemms, summarize

    size = GPU_SIZES["dry" if a.cpu_dry_run else "gpu"]
    cfg, batch_size = GPTConfig(**size["config"]), size["batch"]
    model, params, batch = setup(cfg, batch_size)
    tx = make_tx()
    off_rules = jaxamp.DEFAULT_OP_RULES.extend(recompute=False)
    # "on" is recompute everywhere (the default before issue 40, which recomputes in lax.scan
    # bodies only; this model's layers are unrolled)
    on_rules = jaxamp.DEFAULT_OP_RULES.extend(recompute=True)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    res: dict = {"command": "python bench/recompute_gpu.py --out DIR"
                 + (" --cpu-dry-run" if a.cpu_dry_run else ""),
                 "jax": jax.__version__, "device": jax.devices()[0].device_kind,
                 "config": {**cfg.__dict__, "batch": batch_size}, "variants": {}}
    path = out_dir / "recompute-gpu.json"

    def write():
        path.write_text(json.dumps(res, indent=1, default=float) + "\n")

    runners, texts = {}, {}
    for name in [v for v in a.variants.split(",") if v]:
        if time.monotonic() - started > 0.6 * a.budget_s:
            res["variants"][name] = {"skipped": "time budget"}
            continue
        dt = name.split("/")[1] if "/" in name else "bfloat16"
        policy = POLICIES[dt]
        rules = off_rules if name.split("/")[0] == "off" else on_rules
        try:
            with patched(name):
                r = AmpRunner(model, params, tx, batch, policy,
                              jaxamp.default_loss_scale(policy), op_rules=rules)
                t0 = time.perf_counter()
                lowered = r.step.lower(r.state, batch)
                barriers = lowered.as_text().count("optimization_barrier")
                compiled = lowered.compile()
                t1 = time.perf_counter()
        except Exception as e:
            res["variants"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            log(f"[recompute] {name}: FAILED ({res['variants'][name]['error']})")
            continue
        text = compiled.as_text()
        if name in DUMPED:
            texts[name] = text
        r.step = compiled
        runners[name] = r
        res["variants"][name] = {
            "compile_s": t1 - t0, "stablehlo_optimization_barriers": barriers,
            "memory_analysis": memory_dict(compiled.memory_analysis()),
            "state_bytes": _tree_bytes(r.state) + _tree_bytes(batch),
            "gemms": summarize(find_gemms(text)),
            "gemm_fusion_lines": [ln.strip()[:400] for ln in text.splitlines()
                                  if " fusion(" in ln and "gemm_fusion" in ln][:3]}
        log(f"[recompute] {name}: compiled in {t1 - t0:.1f} s, {barriers} barriers, "
            f"temp {res['variants'][name]['memory_analysis']['temp_size_in_bytes'] / 2**20:,.0f}"
            f" MiB")
        write()
    # smallest footprint first, as bench/run.py --gpu does (peak_step pads the rest)
    for name in sorted(runners, key=lambda k: _footprint(res["variants"][k]["memory_analysis"])
                       or 0):
        v, r = res["variants"][name], runners[name]
        rise, source = peak_step(lambda r=r: r(1), _footprint(v["memory_analysis"]))
        v["peak_memory_bytes"] = None if rise is None else rise + v["state_bytes"]
        v["peak_memory_source"] = source
    write()
    if runners:
        left = a.budget_s - (time.monotonic() - started) - 10
        repeats = 7 if left > 60 or a.cpu_dry_run else 3
        times, _ = interleaved_runtime(runners, repeats=2 if a.cpu_dry_run else repeats,
                                       steps=size["steps"], warmup=1)
        tokens = batch_size * cfg.seq
        for name in runners:
            base = "off/float16" if name.endswith("/float16") else "off"
            v = res["variants"][name]
            v["step_ms"] = med(times[name]) * 1e3
            v["tokens_per_s"] = tokens / med(times[name])
            if base in times:
                v["time_over_off"] = med(times[name]) / med(times[base])
                peak_off = res["variants"][base].get("peak_memory_bytes")
                if peak_off and v.get("peak_memory_bytes"):
                    v["peak_over_off"] = v["peak_memory_bytes"] / peak_off
                v["temp_over_off"] = (v["memory_analysis"]["temp_size_in_bytes"]
                                      / res["variants"][base]["memory_analysis"][
                                          "temp_size_in_bytes"])
    res["memory_stats_end"] = _jax_memory_stats()
    res["wall_s"] = time.monotonic() - started
    write()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in texts.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{name.replace('/', '-')}.hlo.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (out_dir / "recompute-hlo.tar.gz").write_bytes(buf.getvalue())
    print(f"{'variant':<22}{'step ms':>9}{'x off':>7}{'peak MiB':>10}{'x off':>7}"
          f"{'temp MiB':>10}{'x off':>7}{'barriers':>9}  gemms by library")
    for name, v in res["variants"].items():
        if "step_ms" not in v:
            print(f"{name:<22} {v.get('skipped') or v.get('error')}")
            continue
        peak = v.get("peak_memory_bytes")
        print(f"{name:<22}{v['step_ms']:>9.2f}{v.get('time_over_off', 0):>7.3f}"
              f"{(peak or 0) / 2**20:>10,.0f}{v.get('peak_over_off') or 0:>7.3f}"
              f"{v['memory_analysis']['temp_size_in_bytes'] / 2**20:>10,.0f}"
              f"{v.get('temp_over_off', 0):>7.3f}{v['stablehlo_optimization_barriers']:>9}"
              f"  {v['gemms']['by_library']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
