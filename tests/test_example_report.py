"""The LM example's fixes from GitHub issue #26: ``--resume`` into a folder that does not exist
refuses before creating anything; the validation loss is shown only on the steps that measured
it (not repeated on later lines, where it read as a plateau); the plot shows the clip threshold
and where a run resumed."""

from __future__ import annotations

import io
import sys
import types
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import lm_report  # noqa: E402
import train_lm  # noqa: E402


@pytest.mark.parametrize("nested", [False, True])
def test_resume_into_a_missing_folder_refuses_before_creating_it(tmp_path, capsys, nested):
    out = tmp_path / "fresh" / "run" if nested else tmp_path / "fresh"
    assert train_lm.main(["--preset", "test", "--resume", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0] == (f"error: --resume: --out {out} does not exist, so it holds no checkpoints "
                      "to continue (nothing was created); drop --resume to start a new run "
                      "there")
    assert not (tmp_path / "fresh").exists()  # no folder, no parent, no probe file
    assert list(tmp_path.iterdir()) == []


def test_resume_into_a_folder_without_checkpoints_names_the_fix(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert train_lm.main(["--preset", "test", "--resume", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no checkpoints in" in err and "without --resume" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def _rows(steps, evals):
    return [{"step": s, "loss": 3.0 - s / 100, "loss_scale": 65536.0, "grad_norm": 0.5,
             "skipped": False, "skipped_steps": 0,
             **({"val_loss": 2.0 - s / 1000} if s in evals else {})} for s in steps]


def test_validation_loss_is_shown_only_where_it_was_measured():
    out = io.StringIO()
    console = lm_report.Console(file=out, force_terminal=False, width=200)
    setup = types.SimpleNamespace(args=types.SimpleNamespace(steps=150))
    last = None
    with lm_report.Progress(console, setup, 0) as progress:  # a line every 15 steps
        for row in _rows(range(1, 151), {50, 100, 150}):
            last = row.get("val_loss", last)
            progress.update(row, 1000.0, last)
    lines = out.getvalue().splitlines()
    with_val = [line.split(":")[0] for line in lines if " val " in line]
    assert with_val == ["step 50/150", "step 100/150", "step 150/150"]
    assert "val 1.950" in lines[[i for i, x in enumerate(lines) if x.startswith(
        "step 50/")][0]]
    # lines between evaluations carry no (stale) validation value
    assert any(x.startswith("step 60/150") and " val " not in x for x in lines)


def _is(data, value) -> bool:
    """A straight axhline/axvline: two points at ``value``."""
    data = np.asarray(data, dtype=float)
    return data.shape == (2,) and np.allclose(data, value)


def test_plot_shows_the_clip_threshold_and_the_resume_step(tmp_path):
    fig = lm_report.plot_curves(_rows(range(1, 41), {20, 40}), tmp_path / "c.png", "t", 5.0,
                                clip_norm=1.0, resumed_from=20)
    assert (tmp_path / "c.png").stat().st_size > 0
    loss_ax, scale_ax, norm_ax = fig.axes[:3]
    horizontal = [ln for ln in norm_ax.get_lines() if _is(ln.get_ydata(), 1.0)]
    assert len(horizontal) == 1 and horizontal[0].get_linestyle() == "--"
    for ax in (loss_ax, scale_ax, norm_ax):
        assert [ln for ln in ax.get_lines() if _is(ln.get_xdata(), 20)]
    labels = [t.get_text() for t in loss_ax.get_legend().get_texts()]
    assert "resumed at step 20" in labels
    assert "clip norm 1" in [t.get_text() for t in norm_ax.get_legend().get_texts()]
    # without them, neither line
    fig = lm_report.plot_curves(_rows(range(1, 41), set()), tmp_path / "d.png", "t")
    assert not [ln for ln in fig.axes[2].get_lines() if len(ln.get_xdata()) == 2]
