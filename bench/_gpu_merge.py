"""The last stage of ``bench/gpu.sh``: folds the stages, the environment, the gpu tests and the
example runs into ``OUTDIR/results-gpu.json`` (next to the bench's own figures) and prints a
short summary last. Standard library only: it must run even when JAX does not import."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gpu import gpu_target_values, judge_gpu_targets, print_gpu_table  # noqa: E402 (no JAX)

EXAMPLE_DTYPES = ("bfloat16", "float16")
SUMMARY_KEYS = ("preset", "policy", "loss_scale_mode", "steps", "batch_size", "tokens_per_step",
                "initial_val_loss", "final_val_loss", "final_train_loss", "skipped_steps",
                "final_loss_scale", "tokens_per_s", "model_tflops_per_s", "compile_seconds",
                "train_seconds", "memory_bytes", "device", "backend", "jax_version")


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def junit_results(path: Path) -> dict:
    """{"passed": n, "failed": n, "skipped": n, "errors": n, "tests": {id: outcome, ...}}."""
    out: dict = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "tests": {}}
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        return {"error": f"no junit report ({type(e).__name__})"}
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, detail = "passed", None
        for tag, what in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
            el = case.find(tag)
            if el is not None:
                outcome = what
                detail = (el.get("message") or el.text or "")[:600]
                break
        out[outcome] += 1
        out["tests"][name] = {"outcome": {"errors": "error"}.get(outcome, outcome),
                              **({"detail": detail} if detail else {})}
    return out


def example_result(work: Path, outdir: Path, dt: str) -> dict:
    folder = work / f"example-{dt}"
    summary = read_json(folder / "summary.json")
    res: dict = {"summary": ({k: summary.get(k) for k in SUMMARY_KEYS} if summary else None)}
    rows = []
    metrics = outdir / f"example-{dt}-metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                break
    res["validation_curve"] = ([[0, summary["initial_val_loss"]]] if summary else []) + [
        [r["step"], r["val_loss"]] for r in rows if r.get("val_loss") is not None]
    res["skipped_step_numbers"] = [r["step"] for r in rows if r.get("skipped")]
    res["loss_scale_curve"] = [[r["step"], r["loss_scale"]] for r in rows
                               if r["step"] == 1 or r.get("skipped")
                               or r["step"] % 25 == 0]
    res["steps_logged"] = len(rows)
    res["files"] = [p.name for p in (metrics, outdir / f"example-{dt}-curves.png")
                    if p.exists()]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--outdir", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--dry-run", default="0")
    ap.add_argument("--command", default="bash bench/gpu.sh OUTDIR")
    ap.add_argument("--wall-s", type=float, default=None)
    a = ap.parse_args(argv)
    outdir, work = Path(a.outdir), Path(a.work)
    path = outdir / "results-gpu.json"
    res = read_json(path)
    if not isinstance(res, dict):
        # The bench stage did not finish: keep what its framework processes wrote.
        res = {"bench_incomplete": True,
               "jax": read_json(outdir / "gpu-jax.json") or {"missing": True},
               "torch": read_json(outdir / "gpu-torch.json") or {"missing": True}}
        try:
            res["targets"] = judge_gpu_targets(gpu_target_values(res["jax"], res["torch"]),
                                               evaluate=False)
            for t in res["targets"].values():
                t["status"] = "pending: the bench stage did not finish"
        except Exception as e:  # JAX itself may be what broke
            res["targets"] = {"error": f"{type(e).__name__}: {e}"}
    for side in ("jax", "torch"):
        (outdir / f"gpu-{side}.json").unlink(missing_ok=True)
    stages = []
    stages_file = work / "stages.jsonl"
    if stages_file.exists():
        stages = [json.loads(x) for x in stages_file.read_text().splitlines() if x.strip()]
    res["gpu_sh"] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": a.command,
        "dry_run": a.dry_run == "1",
        "wall_s": a.wall_s,
        "stages": stages,
        "env": read_json(work / "env.json"),
        "gpu_tests": junit_results(work / "pytest.xml"),
        "examples": {dt: example_result(work, outdir, dt) for dt in EXAMPLE_DTYPES},
    }
    path.write_text(json.dumps(res, indent=2, default=float) + "\n")

    print("== jaxamp GPU run" + (" (CPU DRY RUN: figures mean nothing)" if a.dry_run == "1"
                                 else "") + f": {path}")
    for s in stages:
        state = ("SKIPPED" if s.get("skipped") else "TIMED OUT" if s.get("timed_out")
                 else "ok" if s.get("rc") == 0 else f"exit {s.get('rc')}")
        print(f"  stage {s['stage']:<18} {state:<10} {s.get('seconds', 0)} s")
    t = res["gpu_sh"]["gpu_tests"]
    if "error" not in t:
        print(f"  gpu tests: {t['passed']} passed, {t['failed']} failed, {t['errors']} errors, "
              f"{t['skipped']} skipped")
    print_gpu_table({"dry_run": a.dry_run == "1", **res})

    def mib(x):
        return "n/a" if x is None else f"{x / 2**20:,.0f} MiB"

    def times(x):
        return "n/a" if x is None else f"{x:.3f}x"

    for dt, r in ((res.get("jax") or {}).get("recompute_peak_memory") or {}).items():
        print(f"  recompute {dt}: peak {mib(r['peak_bytes_before'])} off -> "
              f"{mib(r['peak_bytes_after'])} on ({times(r['peak_after_over_before'])}), "
              f"temp {mib(r['temp_bytes_before'])} -> {mib(r['temp_bytes_after'])} "
              f"({times(r['temp_after_over_before'])})")
    for dt, e in res["gpu_sh"]["examples"].items():
        s = e["summary"]
        if s:
            print(f"  example {dt}: val {s['initial_val_loss']:.3f} -> {s['final_val_loss']:.3f}"
                  f", skipped {s['skipped_steps']}, {s['tokens_per_s'] or 0:,.0f} tok/s")
        else:
            print(f"  example {dt}: no summary (stage failed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
