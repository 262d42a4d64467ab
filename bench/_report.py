"""The results as tables (title, header, rows) shared by stdout and Markdown, printed to
stdout; and the run's metadata (date, command, machine, versions)."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys
import time

import flax
import jax
import jmp
import optax
from _steps import POLICIES
from _targets import TARGETS, verdict

import jaxamp


def metadata(mode: str, started: float) -> dict:
    dev = jax.devices()[0]
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", *sys.argv]),
        "mode": mode,
        "wall_s": round(time.perf_counter() - started, 1),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "machine": platform.machine(), "cpu_count": os.cpu_count(),
                    "backend": jax.default_backend(), "device_kind": dev.device_kind,
                    "device_count": jax.device_count()},
        "versions": {"python": platform.python_version(), "jax": jax.__version__,
                     "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__")
                     else None, "flax": flax.__version__, "optax": optax.__version__,
                     "jmp": getattr(jmp, "__version__", None),
                     "jaxamp": getattr(jaxamp, "__version__", None)},
    }


def fmt_bytes(n) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def tables(res: dict, peer: bool = True) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) for stdout and markdown alike; ``peer``: with the peer's."""
    if "amp_step_runtime_ratio" not in res:  # --peer-only
        return peer_tables(res) if peer else []
    out = []
    cfg = res["config"]
    rows = [
        ["amp_step_runtime_ratio", f"{res['amp_step_runtime_ratio']:.3f}",
         f"<= {TARGETS['amp_step_runtime_ratio']}",
         verdict("amp_step_runtime_ratio", res["amp_step_runtime_ratio"]),
         f"AMP {res['amp_step_ms']:.1f} ms vs baseline {res['baseline_step_ms']:.1f} ms/step; "
         f"per-repeat ratio median {res['amp_step_runtime_ratio_paired']:.3f}, IQR "
         + "-".join(f"{x:.3f}" for x in res["amp_step_runtime_ratio_paired_iqr"])
         + f"; min/min {res['amp_step_runtime_ratio_min']:.3f}; CPU-time ratio "
         f"{res['amp_step_cpu_time_ratio']:.3f}"],
        ["amp_step_compile_ratio", f"{res['amp_step_compile_ratio']:.3f}",
         f"<= {TARGETS['amp_step_compile_ratio']}",
         verdict("amp_step_compile_ratio", res["amp_step_compile_ratio"]),
         f"AMP {res['amp_compile_s']:.2f} s vs baseline {res['baseline_compile_s']:.2f} s "
         f"(trace + lower + XLA compile; per-repeat ratio median "
         f"{res['amp_step_compile_ratio_paired']:.3f})"],
    ]
    if "amp_noscale_noclip_runtime_ratio" in res:
        rows.append(["(ablation) make_train_step, no scale/clip",
                     f"{res['amp_noscale_noclip_runtime_ratio']:.3f}", "", "",
                     "runtime ratio (finite check + skip only)"])
    rows += [
        ["convert_count_amp / _hand", f"{res['convert_count_amp']} / {res['convert_count_hand']}",
         "amp <= hand", "met" if res["convert_count_amp"] <= res["convert_count_hand"]
         else "MISSED", "stablehlo.convert ops in value_and_grad StableHLO"],
        ["lossy_round_trips_amp", str(res["lossy_round_trips_amp"]), "0",
         "met" if res["lossy_round_trips_amp"] == 0 else "MISSED", "f32->f16->f32 in forward"],
        ["matmul_flops_fraction_compute_dtype",
         f"{res['matmul_flops_fraction_compute_dtype']:.4f}", "1.0",
         "met" if res["matmul_flops_fraction_compute_dtype"] == 1.0 else "MISSED",
         f"{res['matmul_flops_fwd_bwd'] / 1e9:.2f} GFLOP of dot_general, fwd+bwd"],
        ["trace_compile_ratio_amp_vs_plain", f"{res['trace_compile_ratio_amp_vs_plain']:.3f}",
         "<= 1.3", verdict("trace_compile_ratio_amp_vs_plain",
                           res["trace_compile_ratio_amp_vs_plain"]),
         "value_and_grad(autocast loss) vs f32 loss; hand-cast: "
         + (f"{res['trace_compile_ratio_hand_vs_plain']:.3f}"
            if res["trace_compile_ratio_hand_vs_plain"] else "not timed")],
    ]
    out.append((f"AMP overhead and precision fidelity (GPT {cfg['layers']}x{cfg['d_model']}, "
                f"{cfg['heads']} heads, seq {cfg['seq']}, batch {cfg['batch']}, "
                f"{res['params'] / 1e6:.2f}M params, float16 compute)",
                ["metric", "value", "target", "", "detail"], rows))
    mem, ratios = res["memory_bytes"], res["memory_temp_ratio_vs_f32"]
    mrows = []
    for name, m in mem.items():
        if m is None:
            mrows.append([name, "n/a", "n/a", "n/a", ""])
            continue
        mrows.append([name, fmt_bytes(m["temp_size_in_bytes"]),
                      fmt_bytes(m["argument_size_in_bytes"]), fmt_bytes(m["output_size_in_bytes"]),
                      "1.000" if name == "float32" else f"{ratios.get(name, float('nan')):.3f}"])
    out.append(("Memory of the compiled AMP step (memory_analysis)",
                ["compute dtype", "temp", "arguments", "outputs", "temp vs f32"], mrows))
    if res.get("scaling"):
        srows = [[str(s["layers"]), f"{s['params'] / 1e6:.2f}M", f"{s['baseline_step_ms']:.1f}",
                  f"{s['amp_step_ms']:.1f}", f"{s['amp_step_runtime_ratio']:.3f}",
                  f"{s['amp_step_runtime_ratio_paired']:.3f}",
                  f"{s['amp_step_cpu_time_ratio']:.3f}",
                  f"{s['baseline_compile_s']:.2f}", f"{s['amp_compile_s']:.2f}",
                  f"{s['amp_step_compile_ratio']:.3f}",
                  f"{s['fusions_baseline']} / {s['fusions_amp']}",
                  f"{s.get('copies_baseline', '?')} / {s.get('copies_amp', '?')}",
                  f"{s.get('conditionals_amp', '?')}"] for s in res["scaling"]]
        out.append((f"Scaling with depth (width {res['config']['d_model']}, float16 compute)",
                    ["layers", "params", "base ms", "AMP ms", "runtime ratio",
                     "per-repeat ratio", "CPU-time ratio", "base compile s", "AMP compile s",
                     "compile ratio", "fusions base / AMP", "copies base / AMP",
                     "AMP conditionals"],
                    srows))
    if res.get("throughput"):
        tp = res["throughput"]
        trows = [[name, f"{tp[name]['step_ms']:.1f}", f"{tp[name]['tokens_per_s']:.0f}",
                  f"{tp[name]['mfu']:.3f}" if tp[name]["mfu"] is not None else "n/a"]
                 for name in POLICIES]
        peak = f"{tp['peak_flops']:.3g}" if tp["peak_flops"] else "unknown"
        out.append((f"Throughput of the AMP step ({tp['device_kind']}; MFU = "
                    f"{tp['flops_per_token']:.3g} FLOP/token x tokens/s over the dense bf16 "
                    f"peak, {peak} FLOP/s)",
                    ["compute dtype", "ms/step", "tokens/s", "MFU"], trows))
    return out + (peer_tables(res) if peer else [])


def peer_tables(res: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    out = []
    peer = res.get("peer") or {}
    if "tokens_per_s" in peer:
        out.append(peer_table(peer))
    if res.get("gpu_targets"):
        out.append(("Hopper targets (H100/H200, `--full`)",
                    ["target", "metric", "value", "status"],
                    [[t["target"], t["what"], "n/a" if t["value"] is None
                      else f"{t['value']:.3f}", t["status"]]
                     for t in res["gpu_targets"].values()]))
    return out


def peer_table(peer: dict) -> tuple[str, list[str], list[list[str]]]:
    tps, ms, first = peer["tokens_per_s"], peer["step_ms"], peer["first_step_s"]
    rows = []
    for dt in peer["dtypes"]:
        if tps["torch"][dt] is None:
            torch_cells = ["unsupported", "n/a", "n/a", "n/a", "n/a"]
        else:
            torch_cells = [f"{tps['torch'][dt]:.0f}", f"{peer['ratio_jaxamp_over_torch'][dt]:.3f}",
                           f"{peer['ratio_jaxamp_over_torch_paired'][dt]:.3f}",
                           f"{peer['ratio_jaxamp_over_torch_min'][dt]:.3f}",
                           f"{ms['torch'][dt]:.1f}"]
        rows.append([dt, f"{tps['jaxamp'][dt]:.0f}", *torch_cells[:4],
                     f"{ms['jaxamp'][dt]:.1f}", torch_cells[4],
                     f"{first['jaxamp'][dt]:.1f} / "
                     + (f"{first['torch'][dt]:.1f}" if dt in first["torch"] else "n/a")])
    how = "torch.compile" if peer["compiled"] else "eager"
    return (f"Peer: jaxamp vs PyTorch {peer['torch_version']} AMP ({how}, {peer['device']}, "
            f"{peer['torch_num_threads']} torch threads; same GPT, weights and batch, "
            f"interleaved)",
            ["compute dtype", "jaxamp tokens/s", "torch tokens/s", "jaxamp / torch",
             "per-repeat ratio", "min/min", "jaxamp ms/step", "torch ms/step",
             "first step s, jaxamp / torch"], rows)


def print_tables(res: dict) -> None:
    for title, header, rows in tables(res):
        widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
        print(f"\n{title}")
        print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
        print("  ".join("-" * w for w in widths))
        for row in rows:
            print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))
