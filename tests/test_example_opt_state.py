"""examples/train_lm.py --opt-state bfloat16 (GitHub issue #44): AdamW's moments stored in
bfloat16 with stochastic rounding.

* the run trains as well as the float32-state run of the same seed and data (final validation
  loss within 1%) with exactly half the moment bytes, which summary.json, the summary table
  and ``python -m jaxamp.review`` report;
* the rounding key is in the checkpoint: a run cut short and resumed is bit-identical to an
  uninterrupted one (kill -9 at a random point: tests/test_example_faults.py);
* --opt-state is a setting of the run: resuming with another value is refused, naming it; a
  checkpoint written before the flag existed resumes as float32.

Every run uses the ``test`` preset and the compilation cache of tests/test_example.py.
"""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import pytest
from test_example import (  # noqa: F401 - compilation_cache: the module's autouse fixture
    STEPS,
    assert_same_metrics,
    assert_same_state,
    base_args,
    compilation_cache,
    lm_checkpoint,
    metrics,
    restore_state,
    run_error,
    summary,
    train_lm,
)

from jaxamp.diagnostics import review

BF16 = "params=float32,compute=bfloat16,output=float32"
#: |final val loss (bfloat16 state) / final val loss (float32 state) - 1| must stay below this
#: (issue #44). Measured on CPU, 60 steps of the test preset: 0.25% (2.7338 vs 2.7408).
QUALITY = 0.01


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """60 steps of the bf16 policy with float32 and with bfloat16 AdamW moments."""
    root = tmp_path_factory.mktemp("opt-state")
    outs = {}
    for state in ("float32", "bfloat16"):
        out = root / state
        assert train_lm.main(base_args(out, "--policy", BF16, "--opt-state", state,
                                       "--no-compare-f32")) == 0
        outs[state] = out
    return outs


def test_bfloat16_moments_train_as_well_in_half_the_bytes(runs):
    f32, bf16 = summary(runs["float32"]), summary(runs["bfloat16"])
    assert f32["opt_state"] == "float32" and bf16["opt_state"] == "bfloat16"
    assert bf16["policy"] == BF16 + ",opt_state=bfloat16" and f32["policy"] == BF16
    assert abs(bf16["final_val_loss"] / f32["final_val_loss"] - 1) < QUALITY, (
        bf16["final_val_loss"], f32["final_val_loss"])
    assert bf16["skipped_steps"] == 0
    # AdamW's two moments: float32 -> bfloat16 bytes, exactly half; the counts stay int32;
    # the rounding key is 4 uint32 words
    a, b = f32["opt_state_bytes"], bf16["opt_state_bytes"]
    assert set(a) == {"float32", "int32", "total"} and b["int32"] == a["int32"]
    assert b["bfloat16"] * 2 == a["float32"] and b["uint32"] == 16
    assert b["total"] == a["total"] - a["float32"] // 2 + 16
    # the review reports it, and says what the float32 state would save
    note_bf16 = [n for n in review.review_run(runs["bfloat16"]).notes
                 if n.startswith("optimizer state")]
    note_f32 = [n for n in review.review_run(runs["float32"]).notes
                if n.startswith("optimizer state")]
    assert note_bf16 and "opt_state=bfloat16 stores its moments in bfloat16" in note_bf16[0]
    assert note_f32 and "would store its float32 moments in half" in note_f32[0]


def test_the_rounding_key_is_checkpointed_and_a_resume_is_bit_identical(runs, tmp_path):
    full = runs["bfloat16"]
    state = restore_state(full, STEPS)
    opt = state["opt_state"]  # StoredState(inner_state=AdamW's state, rounding_key)
    assert opt["rounding_key"].dtype == "uint32" and opt["rounding_key"].shape == (4,)
    adam = opt["inner_state"][0]
    moments = jax.tree.leaves((adam["mu"], adam["nu"]))
    assert len(moments) > 20 and all(x.dtype == jnp.bfloat16 for x in moments)
    part = tmp_path / "part"
    shutil.copytree(full, part)
    for step in (40, 60):  # the run died after the step-20 checkpoint
        shutil.rmtree(part / "checkpoints" / str(step))
    lines = (part / "metrics.jsonl").read_text().splitlines(keepends=True)
    (part / "metrics.jsonl").write_text("".join(lines[:31]))
    assert train_lm.main(base_args(part, "--policy", BF16, "--opt-state", "bfloat16",
                                   "--no-compare-f32", "--resume")) == 0
    assert_same_metrics(metrics(part), metrics(full))
    assert_same_state(restore_state(part, STEPS), state)  # moments and key, bit for bit


def test_another_opt_state_on_resume_is_refused_naming_it(runs, tmp_path, capsys):
    for was, now in (("float32", "bfloat16"), ("bfloat16", "float32")):
        part = tmp_path / was
        shutil.copytree(runs[was], part)
        line = run_error(capsys, base_args(part, "--policy", BF16, "--opt-state", now,
                                           "--no-compare-f32", "--resume"))
        assert line == (f"error: --resume: the checkpoint in {part / 'checkpoints'} was made "
                        f"with other settings (--opt-state: checkpoint has {was}, now {now}); "
                        "pass the original flags or choose another --out")


def test_a_checkpoint_from_before_the_flag_resumes_as_float32(runs):
    s = train_lm.validate(train_lm.build_parser().parse_args(
        base_args(runs["float32"], "--policy", BF16, "--resume")))
    try:
        old = {k: v for k, v in lm_checkpoint.run_config(s).items() if k != "opt_state"}
        assert list(lm_checkpoint._differences(old, lm_checkpoint.run_config(s))) == []
        bf16 = json.loads(json.dumps(lm_checkpoint.run_config(s)))
        bf16["opt_state"] = "bfloat16"
        assert list(lm_checkpoint._differences(old, bf16)) == [
            ("--opt-state", "float32", "bfloat16")]
    finally:
        s.release()


def test_opt_state_belongs_to_its_flag_not_the_policy(tmp_path, capsys):
    line = run_error(capsys, ["--policy", BF16 + ",opt_state=bf16", "--out",
                              str(tmp_path / "x")])
    assert line.startswith("error: --policy ") and "--opt-state bfloat16" in line
    line = run_error(capsys, ["--opt-state", "float16", "--out", str(tmp_path / "x")])
    assert "--opt-state" in line and "'float16'" in line and "bfloat16" in line
    assert not (tmp_path / "x").exists()
