"""BENCHMARKS.md: the section a run writes between its ``<!-- bench:KEY:start/end -->``
markers (tables plus the notes under them), and the page's text when the file is new."""

from __future__ import annotations

from pathlib import Path

from _report import peer_tables, tables
from _targets import GPU_COMMAND


def markdown_tables(tabs: list[tuple[str, list[str], list[list[str]]]]) -> list[str]:
    lines = []
    for title, header, rows in tabs:
        lines += [f"**{title}**", "", "| " + " | ".join(header) + " |",
                  "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |"
                  for row in rows]
        lines.append("")
    return lines


def markdown_section(res: dict) -> str:
    meta = res["metadata"]
    m, v = meta["machine"], meta["versions"]
    lines = [f"Measured {meta['date']} with `{meta['command']}` ({meta['wall_s']:.0f} s) on "
             f"{m['backend']} ({m['device_kind']}), {m['cpu_count']} CPUs, {m['platform']}; "
             f"python {v['python']}, jax {v['jax']}, flax {v['flax']}, optax {v['optax']}.", ""]
    lines += markdown_tables(tables(res, peer=False))
    hlo = res.get("hlo_ops")
    if hlo:
        ca, cb = hlo["compiled_amp"], hlo["compiled_baseline"]
        extra = ", ".join(f"{k} {v:+d}" for k, v in list(
            hlo["stablehlo_extra_ops_amp_by_op"].items())[:8])
        lines += [
            f"Where the AMP step's extra work goes: StableHLO {hlo['stablehlo_ops_amp']} ops vs "
            f"{hlo['stablehlo_ops_baseline']} for the baseline (largest differences: {extra}); "
            f"compiled HLO {ca['fusion']} vs {cb['fusion']} fusions, {ca['copy']} vs "
            f"{cb['copy']} copies, {ca['conditional']} vs {cb['conditional']} conditionals, "
            f"{ca['dot']} vs {cb['dot']} dots.", ""]
    tc, ops = res.get("trace_compile_s", {}), res.get("trace_compile_hlo_ops", {})
    if "hand" in tc and "autocast_f32" in tc:
        parts = [f"{name} {tc[name]['lower']:.2f} + {tc[name]['xla_compile']:.2f} s, "
                 f"{ops[name]['fusion']} fusions"
                 for name in ("plain", "autocast_f32", "hand", "amp") if name in tc]
        lines += [
            "Trace/compile of `value_and_grad(loss)` (lower + XLA compile, compiled fusions): "
            + "; ".join(parts) + ". `autocast_f32` is autocast under a float32 policy (its "
            "compiled HLO is the plain model's, so the difference is autocast's tracing); "
            "`hand` is the hand-cast float16 model.", ""]
    lines += markdown_tables(peer_tables(res))
    lines += peer_notes(res)
    if res.get("gpu_targets") and all(t["value"] is None for t in res["gpu_targets"].values()):
        lines += ["The Hopper targets are pending a GPU run; produce them on an H100/H200 "
                  f"with `{GPU_COMMAND}` (needs `pip install torch` for the peer target).", ""]
    return "\n".join(lines).rstrip() + "\n"


def peer_notes(res: dict) -> list[str]:
    """Markdown paragraphs under the peer table (or the reason it is missing)."""
    peer = res.get("peer") or {}
    if "tokens_per_s" not in peer:
        return [f"**Peer (PyTorch):** skipped, {peer.get('skipped', 'not measured')}. Install "
                "the CPU build with `pip install torch==2.13.0` (PyTorch is not a jaxamp "
                "dependency) and rerun.", ""]
    loss0, after = peer["loss_at_init_float32"], peer["loss_after_float32_eval"]
    lines = [
        f"Peer recipe: {peer['recipe']['torch']}; jaxamp: {peer['recipe']['jaxamp']}. Both "
        f"sides start from the same float32 weights ({peer['params']['torch']:,} parameters, "
        f"asserted equal; float32 loss at init {loss0['jaxamp']:.5f} jaxamp vs "
        f"{loss0['torch']:.5f} torch) and train on the same batch for "
        f"{peer['steps_per_variant']} steps per variant (float32 loss after them, jaxamp / "
        "torch: "
        + ", ".join(f"{dt} {after['jaxamp'][dt]:.3f} / "
                    + (f"{after['torch'][dt]:.3f}" if after["torch"][dt] is not None
                       else "n/a") for dt in peer["dtypes"])
        + f"). PyTorch: {peer['compile_note']}; {peer['threads_note']}. `jaxamp / torch` is "
        "the ratio of median tokens/s (above 1: jaxamp faster); `per-repeat ratio` is the "
        "median over repeats of torch's step time over jaxamp's in the same repeat; `min/min` "
        "compares the fastest steps (contention only ever adds time). The first "
        "step includes compilation (jax.jit's, or torch.compile's"
        + (", from an empty inductor cache" if peer.get("inductor_cache", "") and
           peer["inductor_cache"].startswith("fresh") else "") + ").", ""]
    stalls = {dt: max(v) / min(v) for dt in peer["dtypes"]
              if (v := peer["runtime_samples_ms"].get(f"torch/{dt}"))}
    if stalls and max(stalls.values()) > 5:
        lines += [
            "PyTorch's steps stalled in some repeats (slowest step up to "
            f"{max(stalls.values()):.0f}x the fastest), as an OpenMP thread pool does when "
            "other processes take its cores (the jaxamp steps of the same repeats did not); "
            "read the medians and the min/min ratios, not single repeats.", ""]
    if peer["unsupported"]:
        lines += ["Unsupported by PyTorch here: " + "; ".join(
            f"{k}: {v}" for k, v in peer["unsupported"].items()) + ".", ""]
    if res["metadata"]["machine"]["backend"] == "cpu":
        native = peer.get("torch_cpu_native") or {}
        bf16 = {True: "PyTorch's oneDNN runs bfloat16 matmuls natively on this CPU "
                      "(AVX512-BF16 or AMX) while XLA:CPU computes them in float32",
                False: "neither side has native bfloat16 matmuls on this CPU (XLA:CPU and "
                       "PyTorch compute them in float32)",
                None: "bfloat16 may be emulated in float32 (XLA:CPU does so; PyTorch's "
                      "oneDNN uses native bfloat16 instructions where the CPU has them)"
                }[native.get("bfloat16")]
        lines += [
            "**What these CPU peer numbers can and cannot say.** They compare two software "
            "stacks running the same training step on the same cores: framework overhead, "
            "kernel fusion, the optimizer update, the cost of AMP's casts and loss scaling. "
            "They say nothing about GPU speed-ups or about Tensor Cores. A CPU has no float16 "
            "tensor cores: XLA:CPU upcasts float16 to float32, and PyTorch's CPU float16 path "
            "is a slow fallback"
            + (" (no native oneDNN float16 kernels on this CPU)"
               if native.get("float16") is False else "")
            + f"; {bf16}. So the float16 and bfloat16 rows mostly measure each library's CPU "
            "kernels for those types, not what mixed precision buys on a GPU; the float32 row "
            "is the like-for-like comparison of the two stacks.", ""]
    return lines


INTRO = """# Benchmarks

`bench/run.py` measures what jaxamp costs and what it buys, on a small GPT written with no dtype
code (`bench/gpt.py`) and its hand-cast twin (`bench/gpt_handcast.py`).

```bash
. .venv/bin/activate
python bench/run.py --quick --json bench/results-cpu-quick.json   # a few minutes on 2 CPU cores
python bench/run.py --smoke --json /tmp/smoke.json                # < 1 minute (used by a test)
pip install torch==2.13.0   # optional, CPU build: adds the PyTorch peer (section 5)
python bench/run.py --quick --peer-only --json /tmp/peer.json     # the peer comparison alone
```

Every figure is a ratio of two variants measured side by side in one process: the variants
alternate in interleaved repeats and the medians are compared, so machine noise hits both sides
alike. Compile times are medians of fresh `lower().compile()` runs (tracing included) after
`jax.clear_caches()`.

**CPU numbers show overhead, not speed-up.** XLA on CPU computes float16/bfloat16 matmuls in
float32, so a float16 step is no faster than a float32 one there. The CPU runs compare the full
AMP step (`jaxamp.make_train_step`: loss scaling, finite check and skip, clipping) with a plain
step that uses the *same* autocast forward and backward, and so isolate what the AMP machinery
adds. Memory figures come from XLA's `memory_analysis()` of the compiled step.

**Peer.** The last section trains the same GPT written in PyTorch (`bench/torch_gpt.py`: same
architecture, parameter count asserted equal, loaded with the very same float32 weights) with
PyTorch's AMP recipe (`torch.autocast` + `GradScaler` for float16, `clip_grad_norm_(1.0)`,
AdamW with optax's hyper-parameters, `torch.compile` where it works) on the same batch, its
steps interleaved with jaxamp's in the same process, and reports tokens/s per compute dtype and
the ratio jaxamp / torch. PyTorch is not a dependency of jaxamp: without it the section is
skipped and the JSON says so (`"peer": {"skipped": "torch not installed"}`).

The JSON written by `--json` holds every figure below plus the raw samples and metadata (date,
machine, versions, command line).

## CPU, `--quick`

<!-- bench:cpu-quick:start -->
_Not yet run._
<!-- bench:cpu-quick:end -->

### Reading the CPU figures

* **Step runtime.** Per parameter leaf, the AMP step adds one (variadic) reduction for the
  global norm (also the finite check and the clip's norm), one multiply by the scalar that
  unscales and clips, and a select of new vs old values for the params and each optimizer-state
  leaf (skipped steps leave them bit-identical; no `lax.cond`). The optimizer's updates read
  its selected state, so XLA computes each new moment once and updates the donated buffers in
  place (no copies; `bench/step_counts.py`). The
  measured cost sits around the 3% target at every depth; on a shared 2-core machine the
  spread between repeats (per-repeat IQR about +-5%) is larger than the effect, so read the
  runtime ratio, the per-repeat median, min/min and CPU-time ratios together.
* **Step compile.** XLA:CPU compile time follows the number of fusions; with the select the
  AMP step has about 1.1x the baseline's (it had 1.5x with the `lax.cond`: the optimizer's
  fusions in the apply branch, -0.0 trees in the skip branch). The fusion ratio is the same at
  every depth (see the table); the compile-time ratio is noisy around it.
* **Autocast compile.** autocast's own tracing is cheap: under a float32 policy it produces the
  very same compiled HLO as the plain model, with the same lowering time. The float16 program
  costs XLA:CPU more to compile whoever writes it: the hand-cast float16 model is also well
  above the plain float32 one (XLA:CPU has no native float16 arithmetic and upcasts it, about
  37% more fusions). Expect different ratios on a GPU.
* **Memory.** On CPU, temporaries do not shrink with float16/bfloat16 compute: XLA:CPU keeps
  float32 temporaries for the upcast math, and the float32 master params and Adam state are
  the same in every policy. Activation savings need the GPU run.

## GPU figures

The GPU issue's run is `bash bench/gpu.sh OUTDIR` (jaxamp, hand-cast Flax and PyTorch AMP;
results in `bench/results-gpu.json`). The `--full` mode: pending a GPU run (tokens/s and MFU
for float32/bfloat16/float16 AMP steps on the gpt2-small shape, 12 layers x 768, sequence 1024,
batch 8, the PyTorch peer on CUDA, and the Hopper targets: bf16 jaxamp >= torch AMP, f16 with
dynamic loss scaling within 3% of bf16, bf16 peak memory <= 0.6x f32, bf16 MFU >= 40%).
Produce them on a GPU machine (with
`pip install torch` for the peer) with:

```bash
python bench/run.py --full --json bench/results-gpu-full.json
```

<!-- bench:gpu-full:start -->
_Pending a GPU run._
<!-- bench:gpu-full:end -->
"""


def write_markdown(path: Path, key: str, body: str) -> None:
    start, end = f"<!-- bench:{key}:start -->", f"<!-- bench:{key}:end -->"
    text = path.read_text() if path.exists() else INTRO
    block = f"{start}\n{body}{end}"
    if start in text and end in text:
        i, j = text.index(start), text.index(end) + len(end)
        text = text[:i] + block + text[j:]
    else:
        text = text.rstrip() + f"\n\n## {key}\n\n{block}\n"
    path.write_text(text)
