"""The benchmark entry point runs end to end (``bench/run.py --smoke``) and reports every key."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

RATIO_KEYS = ("amp_step_runtime_ratio", "amp_step_compile_ratio",
              "trace_compile_ratio_amp_vs_plain")
POSITIVE_KEYS = ("amp_step_ms", "baseline_step_ms", "amp_compile_s", "baseline_compile_s")
COUNT_KEYS = ("convert_count_amp", "convert_count_hand", "lossy_round_trips_amp")
MEMORY_FIELDS = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "smoke.json"
    md = ROOT / "BENCHMARKS.md"
    before = md.read_text() if md.exists() else None
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--smoke", "--json",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS",
                                                                             "cpu")})
    assert proc.returncode == 0, f"bench/run.py --smoke failed:\n{proc.stdout}\n{proc.stderr}"
    after = md.read_text() if md.exists() else None
    assert before == after, "--smoke must not rewrite BENCHMARKS.md"
    return json.loads(out.read_text()), proc.stdout


def finite_positive(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def test_ratios_and_times_are_positive(smoke):
    res, _ = smoke
    for key in RATIO_KEYS + POSITIVE_KEYS:
        assert key in res, key
        assert finite_positive(res[key]), (key, res[key])


def test_counts(smoke):
    res, _ = smoke
    for key in COUNT_KEYS:
        assert isinstance(res[key], int) and res[key] >= 0, (key, res[key])
    assert res["convert_count_amp"] > 0 and res["convert_count_hand"] > 0
    assert res["lossy_round_trips_amp"] == 0


def test_matmuls_all_in_compute_dtype(smoke):
    res, _ = smoke
    assert res["matmul_flops_fraction_compute_dtype"] == 1.0
    assert res["matmul_flops_fwd_bwd"] > 0


def test_memory(smoke):
    res, _ = smoke
    mem = res["memory_bytes"]
    assert set(mem) == {"float32", "bfloat16", "float16"}
    for name, stats in mem.items():
        for field in MEMORY_FIELDS:
            assert isinstance(stats[field], int) and stats[field] >= 0, (name, field)
        assert stats["argument_size_in_bytes"] > 0, name
    for name in ("bfloat16", "float16"):
        assert finite_positive(res["memory_temp_ratio_vs_f32"][name]), name


def test_metadata_and_table(smoke):
    res, stdout = smoke
    meta = res["metadata"]
    assert meta["mode"] == "smoke" and "--smoke" in meta["command"]
    assert meta["machine"]["cpu_count"] >= 1 and meta["date"]
    for lib in ("python", "jax", "flax", "optax"):
        assert meta["versions"][lib], lib
    assert res["scaling"] == []  # skipped in --smoke
    assert res["amp_skipped_steps"] >= 0
    for key in RATIO_KEYS:
        assert key in stdout
