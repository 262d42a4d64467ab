"""jaxamp.review (GitHub issue #5, part 3): synthetic run directories with each of the four
planted pathologies of the mixed-precision review checklist are diagnosed, a healthy run is not,
and ``python -m jaxamp.review`` exits 0 / 1 / 2."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxamp.review import main, review_metrics, review_run

ROOT = Path(__file__).resolve().parents[1]
STEPS = 300
F32_MEMORY = {"temp": 8_000_000, "argument": 2_000_000, "output": 2_000_000, "alias": 0,
              "total": 12_000_000}
AMP_MEMORY = {"temp": 4_100_000, "argument": 2_000_000, "output": 2_000_000, "alias": 0,
              "total": 8_100_000}


def healthy_rows(steps: int = STEPS, seed: int = 0) -> list[dict]:
    """A float16 run that behaves: the loss falls with noise, the dynamic scale grows every
    100 clean steps and backs off once after an overflow (one skipped step), and the loss
    ignores both."""
    rng = np.random.default_rng(seed)
    rows, scale = [], 2.0**16
    for step in range(1, steps + 1):
        overflow = step == 150
        rows.append({
            "step": step,
            "loss": float(2.0 + 3.0 * math.exp(-step / 60) + rng.normal(0, 0.03)),
            "loss_scale": scale,
            "grad_norm": None if overflow else float(rng.uniform(0.3, 2.5)),
            "grads_finite": not overflow, "skipped": overflow,
            "tokens_per_s": float(rng.uniform(9000, 11000)),
        })
        if overflow:
            scale /= 2
        elif step % 100 == 0:
            scale *= 2
    return rows


def healthy_summary() -> dict:
    return {"policy": "params=float32,compute=float16,output=float32",
            "loss_scale_mode": "dynamic", "clip_norm": 1.0,
            "memory_bytes": dict(AMP_MEMORY), "memory_bytes_f32": dict(F32_MEMORY)}


def write_run(path: Path, rows: list[dict], summary: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    return path


def test_healthy_run_has_no_findings(tmp_path):
    review = review_run(write_run(tmp_path / "ok", healthy_rows(), healthy_summary()))
    assert review.ok, review.to_text()
    assert review.num_steps == STEPS
    assert "no problems found" in review.to_text()


def test_loss_spikes_at_scale_changes():
    # the scale grows every 25 steps and each growth is followed by a loss spike
    rows = healthy_rows()
    scale = 2.0**10
    for r in rows:
        if r["step"] % 25 == 0:
            scale *= 2
        r["loss_scale"] = scale
        if r["step"] % 25 == 0:
            r["loss"] += 1.5
    review = review_metrics(rows, healthy_summary())
    assert review.codes() == {"loss_spike_at_scale_change"}, review.to_text()
    (f,) = review.findings
    assert set(f.steps) == set(range(25, STEPS + 1, 25))
    assert "growth" in f.explanation and "skipped" in f.explanation


def test_scale_stuck_at_floor_and_consecutive_skips():
    # from step 100 on every step overflows: the scale halves down to its floor (1.0) and
    # stays there, every step skipped
    rows = healthy_rows()
    scale = 2.0**16
    for r in rows[99:]:
        r.update(grad_norm=None, grads_finite=False, skipped=True, loss_scale=scale)
        scale = max(scale / 2, 1.0)
    review = review_metrics(rows, healthy_summary())
    assert review.codes() == {"scale_at_floor", "consecutive_skips"}, review.to_text()
    floor = next(f for f in review.findings if f.code == "scale_at_floor")
    assert floor.steps[0] == 116 and floor.steps[-1] == STEPS  # 2**16 -> 1: 16 halvings
    skips = next(f for f in review.findings if f.code == "consecutive_skips")
    assert skips.steps == tuple(range(100, STEPS + 1))
    assert "locate_overflow" in floor.explanation


def test_grad_norm_tiny_from_clipping_scaled_grads():
    # clip(scaled grads, 1.0) then unscale: the logged norm is clip / scale at every step
    rows = healthy_rows()
    for r in rows:
        if not r["skipped"]:
            r["grad_norm"] = 1.0 / r["loss_scale"]
    review = review_metrics(rows, healthy_summary())
    assert review.codes() == {"grad_norm_tiny"}, review.to_text()
    assert "clip_norm / loss_scale" in review.findings[0].explanation


def test_grad_norm_tiny_without_clip_threshold():
    rows = healthy_rows()
    for r in rows:
        if r["grad_norm"] is not None:
            r["grad_norm"] *= 1e-7  # divided by the scale twice
    summary = healthy_summary()
    del summary["clip_norm"]
    review = review_metrics(rows, summary)
    assert review.codes() == {"grad_norm_tiny"}, review.to_text()
    assert "implausibly small" in review.findings[0].explanation


def test_grad_norm_pinned_to_the_clip_threshold(tmp_path):
    rows = healthy_rows()
    for r in rows:
        if not r["skipped"]:
            r["grad_norm"] = 1.0  # clipped while scaled: the norm always hits the threshold
    summary = healthy_summary()
    review = review_metrics(rows, summary)
    assert review.codes() == {"grad_norm_at_clip"}, review.to_text()
    assert len(review.findings[0].steps) == STEPS - 1
    # without a threshold anywhere: a constant norm is still recognised
    del summary["clip_norm"]
    assert review_metrics(rows, summary).codes() == {"grad_norm_at_clip"}
    # --clip-norm on the command line
    write_run(tmp_path / "clip", rows, summary)
    assert review_run(tmp_path / "clip", clip_norm=1.0).codes() == {"grad_norm_at_clip"}


def test_memory_not_reduced_names_the_largest_float32_buffers():
    summary = healthy_summary()
    summary["memory_bytes"] = {"temp": 7_900_000, "argument": 2_000_000, "output": 2_000_000,
                               "total": 11_900_000}
    summary["largest_f32_buffers"] = [
        {"name": "blocks/mlp/fc activations", "shape": [2, 16, 128, 512], "dtype": "float32",
         "bytes": 8_388_608},
        {"name": "ids", "shape": [16, 128], "dtype": "int32", "bytes": 8192}]
    review = review_metrics(healthy_rows(), summary)
    assert review.codes() == {"memory_not_reduced"}, review.to_text()
    text = review.findings[0].explanation
    assert "blocks/mlp/fc activations" in text and "ids" not in text
    assert "x0.99" in text
    # a float32 run is its own reference: nothing to compare, however the policy is written
    # (the one parser, jaxamp.policy_spec: "p=f32" computes in float32 too)
    for f32_policy in ("params=float32,compute=float32,output=float32", "p=f32", "F32", "full",
                       "p=f32,o=f32"):
        assert review_metrics(healthy_rows(), dict(summary, policy=f32_policy)).ok, f32_policy
    for low in ("p=f32,c=f16", "c=bf16", "bf16"):
        assert review_metrics(healthy_rows(), dict(summary, policy=low)).codes() == \
            {"memory_not_reduced"}, low


def test_memory_on_the_cpu_backend_is_a_note_not_a_finding(tmp_path, capsys):
    """XLA:CPU upcasts float16/bfloat16 dots: memory cannot drop there (GitHub issue #26)."""
    summary = healthy_summary()
    summary["memory_bytes"] = dict(F32_MEMORY)  # x1.00 of float32, as a CPU run measures
    assert review_metrics(healthy_rows(), dict(summary, backend="gpu")).codes() == \
        {"memory_not_reduced"}
    review = review_metrics(healthy_rows(), dict(summary, backend="cpu", policy="c=bf16"))
    assert review.ok and review.findings == []
    (note,) = review.notes
    assert "XLA:CPU" in note and "bfloat16" in note and "x1.00" in note
    assert json.loads(review.to_json())["notes"] == [note]
    run = write_run(tmp_path / "cpu", healthy_rows(), dict(summary, backend="cpu"))
    assert main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "no problems found" in out and "note: memory not judged" in out


def test_the_optimizer_state_bytes_are_a_note(tmp_path, capsys):
    """summary.json's opt_state_bytes (issue #44): reported by dtype, with what the policy's
    opt_state=bfloat16 saves, or would save; never a finding."""
    mib = 2**20
    f32_state = {"float32": 8 * mib, "int32": 8, "total": 8 * mib + 8}
    review = review_metrics(healthy_rows(), dict(healthy_summary(), opt_state_bytes=f32_state))
    assert review.ok
    (note,) = [n for n in review.notes if n.startswith("optimizer state")]
    assert note == ("optimizer state: 8.0 MiB (float32 8.0 MiB, int32 8 B); opt_state=bfloat16 "
                    "in the policy would store its float32 moments in half (8.0 MiB -> 4.0 "
                    "MiB), with stochastic rounding")
    bf16_state = {"bfloat16": 4 * mib, "int32": 8, "uint32": 16, "total": 4 * mib + 24}
    summary = dict(healthy_summary(), opt_state_bytes=bf16_state,
                   policy="params=float32,compute=bfloat16,output=float32,opt_state=bfloat16")
    run = write_run(tmp_path / "bf16", healthy_rows(), summary)
    assert main([str(run)]) == 0
    out = capsys.readouterr().out
    assert ("note: optimizer state: 4.0 MiB (bfloat16 4.0 MiB, uint32 16 B, int32 8 B); "
            "opt_state=bfloat16 stores its moments in bfloat16 with stochastic rounding: "
            "4.0 MiB, where float32 would take 8.0 MiB") in out
    for bad in ("x", {"total": None}, {"float32": "many"}):  # unreadable: no note, no error
        review = review_metrics(healthy_rows(), dict(healthy_summary(), opt_state_bytes=bad))
        assert not [n for n in review.notes if n.startswith("optimizer state")]


def test_cli_exit_codes(tmp_path, capsys):
    ok = write_run(tmp_path / "ok", healthy_rows(), healthy_summary())
    rows = healthy_rows()
    for r in rows[99:]:
        r.update(grad_norm=None, grads_finite=False, skipped=True, loss_scale=1.0)
    sick = write_run(tmp_path / "sick", rows, healthy_summary())
    corrupt = write_run(tmp_path / "corrupt", healthy_rows())
    with open(corrupt / "metrics.jsonl", "a") as f:
        f.write('{"step": 301, "loss": \n')

    assert main([str(ok)]) == 0
    assert "no problems found" in capsys.readouterr().out
    assert main([str(sick), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert {f["code"] for f in data["findings"]} == {"scale_at_floor", "consecutive_skips"}
    for bad in (tmp_path / "missing", corrupt, tmp_path / "ok" / "metrics.jsonl"):
        assert main([str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err

    # the real interpreter: exit status and stderr of ``python -m jaxamp.review``
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "jaxamp.review", *map(str, args)],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)
    res = cli(sick)
    assert res.returncode == 1 and "scale_at_floor" in res.stdout, res.stderr
    res = cli(tmp_path / "missing")
    assert res.returncode == 2 and res.stderr.startswith("error: ") and not res.stdout
    assert res.stderr.count("\n") == 1, res.stderr


@pytest.mark.parametrize("field", ["loss_scale", "grad_norm", "skipped"])
def test_missing_metric_keys_only_disable_their_checks(field):
    rows = [{k: v for k, v in r.items() if k != field} for r in healthy_rows()]
    assert review_metrics(rows, healthy_summary()).ok


# ------------------------------------------------------------------------------------------
# issue #13: malformed lines never crash the review; a diverged run is a finding
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("step", ["NaN", "Infinity", "-Infinity", "1.5", "1e400", "true",
                                  '"3"', "null"])
def test_malformed_step_is_one_error_line(tmp_path, capsys, step):
    run = write_run(tmp_path / "run", healthy_rows(20))
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": ' + step + ', "loss": 1.0}\n')
    assert main([str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: {run / 'metrics.jsonl'} line 21: ") and "'step'" in err, err


@pytest.mark.parametrize("key, value, says", [
    ("skipped", '"false"', "'skipped' must be true or false, got \"false\""),
    ("grads_finite", "1", "'grads_finite' must be true or false, got 1"),
    ("loss", '"abc"', "'loss' must be a number or null, got \"abc\""),
    ("grad_norm", "[1, 2]", "'grad_norm' must be a number or null, got [1, 2]"),
    ("loss_scale", '{"x": 1}', "'loss_scale' must be a number or null, got {\"x\": 1}"),
    ("loss_scale", "true", "'loss_scale' must be a number or null, got true"),
])
def test_a_value_of_the_wrong_type_is_an_error_not_truthy(tmp_path, capsys, key, value, says):
    """Issue #27: another tool's "skipped": "false" was read as true (bool("false")): 50 such
    lines gave a false "50 consecutive steps skipped". Before #27 wrong types were ignored."""
    run = write_run(tmp_path / "run", healthy_rows(20))
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 21, "loss": 1.0, "' + key + '": ' + value + "}\n")
    assert main([str(run)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {run / 'metrics.jsonl'} line 21: {says}\n", err


def _bad_line(kind: str) -> bytes:
    return {
        "deep": b'{"step": 1, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "huge-int": b'{"step": ' + b"7" * 5000 + b"}",
        "utf8": b'{"step": 1, "note": "\xff\xfe"}',
        "long": b'{"step": 1, "pad": "' + b"x" * (2 << 20) + b'"}',
    }[kind]


@pytest.mark.parametrize("kind, says", [
    ("deep", "JSON nested too deeply to read"),
    ("huge-int", "unreadable JSON (Exceeds the limit (4300 digits) for integer string "
                 "conversion"),
    ("utf8", "not UTF-8 text (byte 21)"),
    ("long", "longer than 1048576 bytes"),
])
def test_every_parse_failure_is_one_error_line(tmp_path, kind, says):
    """Before: a RecursionError traceback (100k-deep line), a ValueError traceback (5000-digit
    step); the docs promise ``error:`` and exit 2. Run as the command, in a fresh process."""
    run = write_run(tmp_path / "run", healthy_rows(20))
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(_bad_line(kind) + b"\n")
    res = subprocess.run([sys.executable, "-m", "jaxamp.review", str(run)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res
    assert res.stderr.startswith(f"error: {run / 'metrics.jsonl'} line 21: {says}"), res.stderr
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, res.stderr


@pytest.mark.parametrize("kind", ["deep", "huge-int", "utf8"])
def test_a_torn_last_line_that_does_not_parse_is_dropped(tmp_path, kind):
    """A kill mid-line leaves a last line without its newline: not a record, not an error."""
    run = write_run(tmp_path / "run", healthy_rows(), healthy_summary())
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(_bad_line(kind)[:-1])
    review = review_run(run)
    assert review.num_steps == STEPS and review.ok, review.to_text()


def test_a_dropped_torn_last_line_is_said(tmp_path, capsys):
    """Issue 46: the review dropped a torn last line and reported "no problems found (9 steps
    reviewed)" without a word about it."""
    rows = healthy_rows(10)
    run = write_run(tmp_path / "run", rows[:9])
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps(rows[9])[:30])  # killed mid-line: no newline, does not parse
    assert main([str(run)]) == 0
    note = (f"note: {run / 'metrics.jsonl'} line 10 was dropped: the last line, without its "
            "newline, does not parse (not valid JSON (Expecting ',' delimiter)); the "
            "writer was stopped while writing it")
    assert capsys.readouterr().out == f"{run}: no problems found (9 steps reviewed)\n{note}\n"
    review = review_run(run)
    assert review.ok and review.notes == [note[len("note: "):]]
    assert review.to_dict()["notes"] == review.notes


def test_review_memory_does_not_grow_with_the_file_size(tmp_path):
    """Issue #27: the whole file was read (peak ~7.5x its size; 20 MB -> 64 MB here). Now it is
    read line by line: a 20 MB and a 2 MB file of the same 1000 steps peak alike (each
    reviewed in a fresh interpreter). bench/review_memory.py measures 200 MB the same way."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import review_memory
    finally:
        sys.path.remove(str(ROOT / "bench"))
    peaks = {}
    for mb in (2, 20):
        size = review_memory.write_metrics(tmp_path / f"run{mb}", mb)
        assert size >= mb * 0.9e6
        peaks[mb], code = review_memory.peak_rss_of_review(tmp_path / f"run{mb}")
        assert code == 0
    assert peaks[20] - peaks[2] < 4e6, peaks  # before: +45 MB


def diverged_rows(at: int, nan_token: bool) -> list[dict]:
    """The last steps of a run whose params became NaN at step ``at``: from then on the loss
    is NaN and every step is skipped (too few for consecutive_skips), and the final validation
    loss is NaN. ``nan_token``: written as the non-standard NaN token (old metrics files)
    instead of strict JSON's null."""
    rows = healthy_rows()
    bad = math.nan if nan_token else None
    for r in rows:
        if r["step"] >= at:
            r.update(loss=bad, grad_norm=bad, grads_finite=False, skipped=True)
    rows[-1]["val_loss"] = bad
    rows[199]["val_loss"] = 2.5
    return rows


@pytest.mark.parametrize("nan_token", [False, True])
def test_diverged_run_is_a_finding(tmp_path, capsys, nan_token):
    rows = diverged_rows(STEPS - 4, nan_token)
    summary = dict(healthy_summary(), final_val_loss=math.nan if nan_token else None)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps(summary))
    review = review_run(run)
    assert review.codes() == {"loss_diverged"}, review.to_text()
    (finding,) = review.findings
    assert finding.steps == (STEPS - 4, STEPS - 3, STEPS - 2, STEPS - 1, STEPS)
    assert f"non-finite from step {STEPS - 4}" in finding.explanation
    assert f"validation loss non-finite at step {STEPS}" in finding.explanation
    assert main([str(run)]) == 1
    assert "loss_diverged" in capsys.readouterr().out


def test_validation_loss_alone_can_diverge():
    rows = healthy_rows()
    rows[99]["val_loss"] = 3.0
    rows[199]["val_loss"] = None  # the eval diverged, the train loss did not (yet)
    review = review_metrics(rows, healthy_summary())
    assert review.codes() == {"loss_diverged"}
    assert review.findings[0].steps == (200,)


def test_a_recovered_overflow_is_not_divergence():
    rows = healthy_rows()
    rows[149].update(loss=None)  # step 150: the forward overflowed too; skipped, then fine
    assert review_metrics(rows, healthy_summary()).ok
