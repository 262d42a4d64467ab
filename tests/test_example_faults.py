"""examples/train_lm.py with bad input and faults (GitHub issue #13): nothing lost, nothing
silently wrong.

* a checkpoint with flipped bytes is a one-line error (its checksums), ``--resume latest-intact``
  falls back to the newest intact one and says which;
* bad input never deletes anything, a new run never deletes or overwrites what the script did
  not write, a folder holding a previous run needs ``--overwrite``;
* every CLI failure is one ``error:`` line and exit 2, metrics are strict JSON;
* kill -9 at random points of a run, then ``--resume``: bit-identical to an uninterrupted run.

Every run uses the ``test`` preset and the compilation cache of tests/test_example.py.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from test_example import (  # noqa: F401 - compilation_cache: the module's autouse fixture
    EXAMPLES,
    assert_same_metrics,
    assert_same_state,
    compilation_cache,
    lm_data,
    metrics,
    restore_state,
    run_error,
    train_lm,
)

STEPS = 20


def args(out: Path, steps: int = STEPS, *extra: str) -> list[str]:
    # constant schedule: a run resumed with another --steps follows the same trajectory
    return ["--preset", "test", "--steps", str(steps), "--schedule", "constant", "--warmup",
            "5", "--eval-interval", "10", "--checkpoint-interval", "10", "--no-compare-f32",
            "--out", str(out), *extra]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One finished 20-step run with checkpoints at steps 10 and 20."""
    out = tmp_path_factory.mktemp("faults") / "run"
    assert train_lm.main(args(out)) == 0
    return out


@pytest.fixture
def part(run, tmp_path):
    """A copy of ``run`` to damage."""
    p = tmp_path / "part"
    shutil.copytree(run, p)
    return p


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def flip_bytes(ckpt: Path, n: int = 64) -> None:
    """Flips ``n`` bytes in the middle of the checkpoint's largest array data file (no
    truncation: the file still decodes, into wrong numbers)."""
    data = [f for f in (ckpt / "state").rglob("*") if f.is_file() and f.parent.name == "d"]
    f = max(data, key=lambda f: f.stat().st_size)
    b = bytearray(f.read_bytes())
    mid = len(b) // 2
    for i in range(mid, mid + n):
        b[i] ^= 0xFF
    f.write_bytes(bytes(b))


def flat(text: str) -> str:
    """Console output with rich's line wrapping undone."""
    return " ".join(text.split())


# ------------------------------------------------------------------------------------------
# 1. checkpoint integrity
# ------------------------------------------------------------------------------------------


def test_flipped_bytes_in_a_checkpoint_are_one_error_line(part, capsys):
    """Before: the flipped bytes decoded into NaNs in the optimizer state, step 21 was applied
    and every parameter became NaN, exit 0."""
    flip_bytes(part / "checkpoints" / "20")
    before = snapshot(part)
    line = run_error(capsys, args(part, 30, "--resume"))
    ckpt = part / "checkpoints" / "20"
    assert re.fullmatch(
        rf"error: --resume: checkpoint {re.escape(str(ckpt))} is corrupted \(1 of 63 arrays "
        r"fail their checksum, e\.g\. \.\S+\); pass --resume latest-intact to resume from "
        r"the newest intact earlier checkpoint \(steps 10\), or start again with --overwrite",
        line), line
    assert snapshot(part) == before  # nothing written, nothing removed


def test_real_process_reports_the_bit_flip(part):
    flip_bytes(part / "checkpoints" / "20")
    proc = subprocess.run([sys.executable, str(EXAMPLES / "train_lm.py"),
                           *args(part, 30, "--resume")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --resume: checkpoint "), proc.stderr
    assert "checksum" in lines[0]


def test_latest_intact_falls_back_and_says_which(run, part, capsys):
    flip_bytes(part / "checkpoints" / "20")
    assert train_lm.main(args(part, STEPS, "--resume", "latest-intact")) == 0
    out = flat(capsys.readouterr().out)
    assert re.search(r"note: --resume latest-intact: checkpoint\(s\) 20 corrupted \(1 of 63 "
                     r"arrays fail their checksum, e\.g\. \S+\); removed 1 of them, "
                     r"resuming from the newest intact checkpoint, step 10", out), out
    assert "resuming from the checkpoint at step 10" in out
    # steps 11-20 were trained again, the step-20 checkpoint rewritten: identical to the run's
    assert_same_state(restore_state(part, STEPS), restore_state(run, STEPS))
    assert_same_metrics(metrics(part), metrics(run))


def test_latest_intact_with_bad_input_removes_nothing(part, capsys):
    """The corrupted checkpoint is only removed once the run really continues."""
    flip_bytes(part / "checkpoints" / "20")
    before = snapshot(part)
    line = run_error(capsys, args(part, 5, "--resume", "latest-intact"))
    assert line.startswith("error: --steps 5 is below the step of the latest checkpoint"), line
    assert snapshot(part) == before


def test_latest_intact_with_every_checkpoint_corrupted(part, capsys):
    for step in (10, 20):
        flip_bytes(part / "checkpoints" / str(step))
    line = run_error(capsys, args(part, 30, "--resume=latest-intact"))
    assert line.startswith(f"error: --resume latest-intact: every checkpoint in "
                           f"{part / 'checkpoints'} is corrupted (steps 20, 10; newest: 1 of 63 "
                           "arrays fail their checksum"), line


# ------------------------------------------------------------------------------------------
# 2. nothing deleted that should not be
# ------------------------------------------------------------------------------------------


def test_new_run_in_a_previous_runs_folder_needs_overwrite(part, capsys):
    before = snapshot(part)
    line = run_error(capsys, args(part))
    assert line == (f"error: --out {part} holds a previous run (checkpoints at steps 10, 20); "
                    "pass --resume to continue it, --overwrite to replace it (only the files "
                    "train_lm.py wrote there are removed), or choose another --out")
    assert snapshot(part) == before


@pytest.mark.parametrize("bad, flag", [
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2**64)], "--seed"),
    (["--batch-size", "100000000"], "--batch-size"),
    (["--init-scale", "0.5"], "--init-scale"),
    (["--init-scale", "1e30"], "--init-scale"),
    (["--growth-interval", "2147483648"], "--growth-interval"),
    (["--lr", "1e300"], "--lr"),
    (["--lr", "1e-46"], "--lr"),
    (["--clip-norm", "1e39"], "--clip-norm"),
    (["--steps", str(2**31)], "--steps"),
    (["--eval-batches", "100000000"], "--eval-batches"),
])
@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_bad_input_is_one_line_and_deletes_nothing(part, capsys, bad, flag, overwrite):
    """Before: the previous run's checkpoints and outputs were deleted first, then these
    crashed with a traceback (or, for --lr 1e300, trained to NaN with exit 0)."""
    before = snapshot(part)
    line = run_error(capsys, args(part, STEPS, *overwrite, *bad))
    assert line.startswith(f"error: {flag} "), line
    assert snapshot(part) == before


def test_bad_loss_scale_flags_name_the_range(tmp_path, capsys):
    out = str(tmp_path / "out")
    line = run_error(capsys, ["--preset", "test", "--init-scale", "0.5", "--out", out])
    assert line == ("error: --init-scale 0.5: DynamicLossScale: loss_scale must be within "
                    "[min_loss_scale, max_loss_scale], got loss_scale=0.5 < min_loss_scale=1.0."
                    "; dynamic scaling needs --init-scale in [1, 1.67772e+07] (or use "
                    "--loss-scale static)")
    line = run_error(capsys, ["--preset", "test", "--loss-scale", "static", "--init-scale",
                              "1e39", "--out", out])
    assert "StaticLossScale: loss_scale=1e+39 overflows float32" in line
    line = run_error(capsys, ["--preset", "test", "--growth-interval", "2147483648",
                              "--out", out])
    assert line == "error: --growth-interval must be <= 2147483647, got 2147483648"
    assert not (tmp_path / "out").exists()  # bad input: nothing created either


def test_overwrite_removes_only_what_the_script_wrote(run, part):
    """Before: a new run removed the whole checkpoints/ folder, my_model.pt included."""
    mine = {"checkpoints/my_model.pt": os.urandom(1000), "notes.txt": b"my notes\n",
            "checkpoints/README": b"keep\n"}
    for name, data in mine.items():
        (part / name).write_bytes(data)
    old_metrics = (part / "metrics.jsonl").read_bytes()
    assert train_lm.main(args(part, 10, "--overwrite")) == 0
    for name, data in mine.items():
        assert (part / name).read_bytes() == data, name
    assert sorted(p.name for p in (part / "checkpoints").iterdir()) == [
        "10", "README", "my_model.pt"]  # the old step-20 checkpoint is gone, step 10 is new
    assert (part / "metrics.jsonl").read_bytes() != old_metrics
    assert [r["step"] for r in metrics(part)] == list(range(1, 11))


@pytest.mark.parametrize("flags", [[], ["--overwrite"]])
def test_a_users_own_files_are_never_overwritten(tmp_path, capsys, flags):
    """Before: a new run overwrote a user's summary.json in --out."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "summary.json").write_text('{"my": "results"}\n')
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "7").mkdir()  # some other tool's step folder
    before = snapshot(out)
    line = run_error(capsys, args(out, STEPS, *flags))
    assert line == (f"error: --out {out} holds checkpoints/7, summary.json, which train_lm.py "
                    "did not write (they are not in its train_lm.manifest.json: another tool's, "
                    "yours, or from a train_lm.py older than the manifest) and will not "
                    "replace; move them away or choose another --out")
    assert snapshot(out) == before


def test_empty_out_is_refused(tmp_path, capsys, monkeypatch):
    """Before: --out '' was the current folder."""
    monkeypatch.chdir(tmp_path)
    line = run_error(capsys, ["--preset", "test", "--out", ""])
    assert line == "error: --out '' is empty; pass a folder (--out . for the current folder)"
    assert list(tmp_path.iterdir()) == []


def test_default_out_keeps_working_in_a_fresh_numbered_folder(tmp_path, capsys, monkeypatch):
    """The README's command, run twice: the second run goes to runs/<name>-2 and says so; the
    first run's files are untouched; --resume without --out continues the newest."""
    monkeypatch.chdir(tmp_path)
    short = ["--preset", "test", "--steps", "3", "--eval-interval", "0",
             "--checkpoint-interval", "0", "--no-compare-f32", "--schedule", "constant"]
    assert train_lm.main(short) == 0
    first = snapshot(tmp_path / "runs" / "test-f16")
    capsys.readouterr()
    assert train_lm.main(short) == 0
    out = flat(capsys.readouterr().out)
    assert ("note: runs/test-f16 holds an earlier run; this one goes to runs/test-f16-2 "
            "(--resume continues the newest, --overwrite replaces runs/test-f16, --out "
            "chooses the folder)") in out
    assert snapshot(tmp_path / "runs" / "test-f16") == first
    assert [r["step"] for r in metrics(tmp_path / "runs" / "test-f16-2")] == [1, 2, 3]
    assert train_lm.main([*short[:2], "--steps", "5", *short[4:], "--resume"]) == 0
    assert [r["step"] for r in metrics(tmp_path / "runs" / "test-f16-2")] == [1, 2, 3, 4, 5]
    assert snapshot(tmp_path / "runs" / "test-f16") == first


# ------------------------------------------------------------------------------------------
# 3. one error line: special and huge --data files
# ------------------------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
def test_fifo_as_data_is_refused(tmp_path, capsys):
    """Before: it hung, reading a pipe nobody writes."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    line = run_error(capsys, ["--preset", "test", "--data", str(fifo), "--out",
                              str(tmp_path / "out")])
    assert line.startswith(f"error: --data {fifo}: not a regular file (a FIFO, socket or "
                           "device)"), line


def test_30_gib_data_file_reads_only_the_cap(tmp_path, capsys):
    """Before: MemoryError (the whole file was read to use 4 MiB). A sparse file: no disk."""
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.write(b"hello world\n" * 1000)
        f.truncate(30 * 2**30)
    corpus = lm_data.load_corpus(big, block_size=32)
    assert corpus.num_tokens == lm_data.DEFAULT_MAX_BYTES
    # and through the CLI, up to the first error that needs the data loaded
    line = run_error(capsys, ["--preset", "test", "--data", str(big), "--resume", "--out",
                              str(tmp_path / "out")])
    assert "no checkpoints" in line


# ------------------------------------------------------------------------------------------
# 4-6. a diverged run: strict JSON, reviewed as diverged
# ------------------------------------------------------------------------------------------


def _strict_json(text: str):
    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")
    return json.loads(text, parse_constant=refuse)


def test_diverged_run_writes_strict_json_and_reviews_as_diverged(tmp_path, capsys):
    """--lr 1e30 is a float32 number, so it is accepted; the run diverges. Before: metrics and
    summary held NaN tokens, and the review found nothing (too few skips for its checks)."""
    from jaxamp import review

    out = tmp_path / "nan"
    assert train_lm.main(["--preset", "test", "--steps", "6", "--lr", "1e30", "--warmup", "0",
                          "--schedule", "constant", "--eval-interval", "3", "--no-compare-f32",
                          "--out", str(out)]) == 0
    rows = [_strict_json(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    sm = _strict_json((out / "summary.json").read_text())
    _strict_json((out / "train_lm.manifest.json").read_text())
    assert rows[-1]["loss"] is None and rows[-1]["val_loss"] is None
    assert sm["final_val_loss"] is None
    assert "warning: the run diverged: the training loss is non-finite from step" in flat(
        capsys.readouterr().out)
    assert review.main([str(out)]) == 1
    assert "loss_diverged" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------
# fault injection: kill -9 at random points, resume, bit-identical
# ------------------------------------------------------------------------------------------

KILL_STEPS = 24


def _kill_args(out: Path, *extra: str) -> list[str]:
    # a checkpoint every 3 steps (orbax keeps 3, so it deletes one at most saves too): a
    # random kill often lands inside a save or a deletion
    return [sys.executable, str(EXAMPLES / "train_lm.py"), "--preset", "test", "--steps",
            str(KILL_STEPS), "--schedule", "constant", "--warmup", "5", "--eval-interval", "8",
            "--checkpoint-interval", "3", "--no-compare-f32", "--out", str(out), *extra]


def _lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return -1


def test_kill_9_at_random_points_then_resume_is_bit_identical(tmp_path):
    """For each seed: a random step (0: during the first evaluation, KILL_STEPS: while the
    summary and plots are written), then a random delay of up to about a step and a save;
    SIGKILL there; then ``--resume`` (or ``--overwrite`` if no checkpoint was complete)."""
    _kill_and_resume(tmp_path, range(2))


def test_kill_9_with_bfloat16_moments_resumes_bit_identically(tmp_path):
    """--opt-state bfloat16 (issue #44): the stochastic rounding's key is in the checkpoint, so
    the resumed run rounds with the same bits as the uninterrupted one (and resumes from a
    checkpoint: the kill lands after several)."""
    resumed = _kill_and_resume(tmp_path, [9], "--opt-state", "bfloat16")  # killed near step 14
    assert resumed == [True]  # from a checkpoint, not started again
    state = restore_state(tmp_path / "seed9", KILL_STEPS)
    assert state["opt_state"]["inner_state"]["rounding_key"].shape == (2,)


def test_a_checkpoint_of_the_old_layout_resumes_bit_identically(run, part):
    """A checkpoint written before issue #41 (``loss_scale`` and ``skipped_steps`` beside
    ``opt_state``, the optimizer's own state; ``lm_checkpoint.OldLayout`` has its key paths)
    resumes into today's layout (the loss scale inside ``opt_state``), and the run continues
    bit for bit: steps 11-20 and the step-20 state equal the uninterrupted run's."""
    import lm_checkpoint

    shutil.rmtree(part / "checkpoints" / "20")
    s = train_lm.validate(train_lm.build_parser().parse_args(args(part, STEPS, "--resume")))
    try:
        abstract = train_lm.create_state(train_lm.build_model(s),
                                         train_lm.make_optimizer(s.args), s, abstract=True)
        folder = part / "checkpoints"
        with lm_checkpoint.manager(folder, create=False) as mgr:
            meta, integrity = lm_checkpoint.restore_meta(mgr, 10, folder / "10")
            state = lm_checkpoint.restore_state(mgr, 10, folder / "10", abstract, integrity)
            mgr.delete(10)
            lm_checkpoint.save(mgr, 10, lm_checkpoint.old_layout(state), meta)
    finally:
        s.release()
    old = restore_state(part, 10)
    assert {"loss_scale", "skipped_steps"} <= set(old) and "inner_state" not in old["opt_state"]
    with lm_checkpoint.manager(folder, create=False) as mgr:
        _, integrity = lm_checkpoint.restore_meta(mgr, 10, folder / "10")
        again = lm_checkpoint.restore_state(mgr, 10, folder / "10", abstract, integrity)
    # all that the old layout holds (the last step's grad norm is not in it)
    assert_same_state(*(jax.tree.map(np.asarray, lm_checkpoint.old_layout(x))
                        for x in (again, state)))
    assert train_lm.main(args(part, STEPS, "--resume")) == 0
    assert_same_metrics(metrics(part), metrics(run))
    new = restore_state(part, STEPS)
    assert "loss_scale" in new["opt_state"] and "loss_scale" not in new
    assert_same_state(new, restore_state(run, STEPS))


def _kill_and_resume(tmp_path, seeds, *extra: str) -> list[bool]:
    """Kills a run per seed and finishes it; whether each resumed from a checkpoint."""
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla-cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")

    def finish(cmd):
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)

    ref = tmp_path / "ref"
    res = finish(_kill_args(ref, *extra))  # the uninterrupted run (and a warm compilation cache)
    assert res.returncode == 0, res.stderr[-2000:]

    kills, resumed = [], []
    for seed in seeds:
        rnd = random.Random(seed)
        target, delay = rnd.randint(0, KILL_STEPS), rnd.uniform(0, 0.15)
        if target == KILL_STEPS:
            delay = rnd.uniform(0, 0.5)
        out = tmp_path / f"seed{seed}"
        proc = subprocess.Popen(_kill_args(out, *extra), env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        while _lines(out / "metrics.jsonl") < target and proc.poll() is None:
            time.sleep(0.002)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        kills.append((seed, target, round(delay, 3), proc.returncode))
        res = finish(_kill_args(out, *extra, "--resume"))
        resumed.append(not (res.returncode == 2 and "no checkpoints" in res.stderr))
        if not resumed[-1]:  # killed before the first checkpoint
            res = finish(_kill_args(out, *extra, "--overwrite"))
        assert res.returncode == 0, (kills[-1], res.stderr[-2000:])
        assert_same_metrics(metrics(out), metrics(ref))
        assert_same_state(restore_state(out, KILL_STEPS), restore_state(ref, KILL_STEPS))
        assert _strict_json((out / "summary.json").read_text())["steps"] == KILL_STEPS
    # every run was really killed (not finished before the signal)
    assert all(rc == -signal.SIGKILL for *_, rc in kills), kills
    return resumed


# ------------------------------------------------------------------------------------------
# issue #27: two runs on one --out, signals at any point, disk full, start-up checks
# ------------------------------------------------------------------------------------------

#: Runs train_lm.py as the program does (its __main__), after one fault injected by argv[1]:
#: "none"; "sigint-compile" (SIGINT while XLA compiles the step); "sigint-save" (SIGINT as
#: the first checkpoint save starts); "sigterm-step3" (SIGTERM while step 3 trains);
#: "sigterm-after" (SIGTERM once the loop is done); "enospc-save" (the step-20 save fails with
#: ENOSPC after orbax made its temporary folder); "enospc-metrics" (the disk fills up half-way
#: through step 15's metrics line: a short write).
RUNNER = r'''
import errno, os, signal, sys, threading
sys.path.insert(0, sys.argv[2])
import jax, train_lm, lm_checkpoint, lm_stop, orbax.checkpoint as ocp
import jaxamp
mode, argv = sys.argv[1], sys.argv[3:]
me = os.getpid()
if mode == "sigint-compile":  # the signal arrives while XLA compiles (a C++ call)
    compile_ = jax.stages.Lowered.compile
    def compile(self, *a, **k):
        timer = threading.Timer(0.01, os.kill, (me, signal.SIGINT))
        timer.start()
        out = compile_(self, *a, **k)
        timer.join()  # a compile served from the cache may end first: then the signal is here
        return out
    jax.stages.Lowered.compile = compile
def signal_before(owner, name, signum, when=lambda *a, **k: True):
    """``owner.name`` sends ``signum`` to this process first (when ``when(*args)``)."""
    original = getattr(owner, name)
    def patched(*a, **k):
        if when(*a, **k):
            os.kill(me, signum)
        return original(*a, **k)
    setattr(owner, name, patched)
if mode == "sigint-save":
    signal_before(lm_checkpoint, "save", signal.SIGINT)
elif mode == "sigterm-step3":
    signal_before(train_lm.lm_data, "get_batch", signal.SIGTERM, lambda *a, step, **k: step == 2)
elif mode == "sigterm-after":
    signal_before(jaxamp, "precision_table", signal.SIGTERM)
if mode == "enospc-save":
    save_ = ocp.CheckpointManager.save
    def save(self, step, *a, **k):
        if step == 20:
            tmp = self.directory / "20.orbax-checkpoint-tmp-1"
            (tmp / "state").mkdir(parents=True)
            (tmp / "state" / "part").write_bytes(b"\0" * 100)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return save_(self, step, *a, **k)
    ocp.CheckpointManager.save = save
elif mode == "enospc-metrics":
    write_ = os.write
    def write(fd, data):
        if bytes(data).startswith(b'{"step": 15,'):
            return write_(fd, bytes(data)[:len(data) // 2])  # a short write: the disk is full
        return write_(fd, data)
    os.write = write
sys.unraisablehook = lm_checkpoint.closed_event_loop_filter(sys.unraisablehook)
lm_stop.exit_process(train_lm.main(argv))  # as train_lm.py's __main__
'''


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    """``(mode, argv) -> CompletedProcess`` of RUNNER, sharing this module's XLA cache."""

    script = tmp_path_factory.mktemp("runner") / "runner.py"
    script.write_text(RUNNER)
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(jax.config.jax_compilation_cache_dir),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")

    def start(mode, argv):
        return subprocess.Popen([sys.executable, str(script), mode, str(EXAMPLES), *argv],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)

    def run(mode, argv):
        proc = start(mode, argv)
        out, err = proc.communicate(timeout=180)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    run.start = start
    return run


def one_line(res) -> str:
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    return lines[0]


def test_two_runs_on_one_out_started_together(run, runner, tmp_path):
    """Before: both passed the "holds a previous run" check; both exited 0 and the folder held
    one run's files mixed with the other's (or one died with orbax's "Directory not empty")."""
    out = tmp_path / "shared"
    procs = [runner.start("none", args(out)) for _ in range(2)]
    results = [(p.wait(timeout=180), *p.communicate()) for p in procs]
    codes = sorted(rc for rc, _, _ in results)
    assert codes == [0, 2], [(rc, err[-2000:]) for rc, _, err in results]
    (winner,) = [p for p, (rc, _, _) in zip(procs, results) if rc == 0]
    err = next(e for rc, _, e in results if rc == 2)
    line = one_line(subprocess.CompletedProcess([], 2, "", err))
    assert (line.startswith(f"error: --out {out} is in use by another train_lm.py run (pid "
                            f"{winner.pid} on ") or
            line.startswith(f"error: --out {out} holds a previous run")), line
    # the folder holds one complete run, the same as the module's run
    assert_same_metrics(metrics(out), metrics(run))
    assert_same_state(restore_state(out, STEPS), restore_state(run, STEPS))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["10", "20"]
    assert (out / "train_lm.lock").read_bytes() == b""  # released


def test_a_locked_out_is_refused_with_the_holder(part, capsys):
    import fcntl

    fd = os.open(part / "train_lm.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, b"pid 4242 on otherhost\n")
        before = snapshot(part)
        line = run_error(capsys, args(part, 30, "--resume"))
        assert line == (f"error: --out {part} is in use by another train_lm.py run (pid 4242 "
                        f"on otherhost, holding {part / 'train_lm.lock'}); wait for it to "
                        "finish or choose another --out")
        assert snapshot(part) == before
    finally:
        os.close(fd)
    assert train_lm.main(args(part, 30, "--resume")) == 0  # once free, it resumes


@pytest.mark.parametrize("mode, status, says", [
    ("sigint-compile", 130, "interrupted by SIGINT while compiling the train step; no "
                            "checkpoint was saved in {ckpt}, so there is nothing to resume: "
                            "start again with the same flags"),
    ("sigterm-step3", 143, "interrupted by SIGTERM while training step 3, after step 2; kept: "
                           "the checkpoint of step 2 in {ckpt} (continue with the same flags "
                           "plus --resume)"),
    ("sigterm-after", 143, "interrupted by SIGTERM while writing the summary and plots, after "
                           "step 6; kept: the checkpoint of step 6 in {ckpt} (continue with "
                           "the same flags plus --resume)"),
])
def test_a_signal_at_any_point_is_one_line_and_its_status(runner, tmp_path, mode, status, says):
    """Before: Ctrl-C while compiling or after the loop printed a KeyboardInterrupt traceback
    and then crashed (exit 139); SIGTERM killed the run without a word (exit -15)."""
    out = tmp_path / "run"
    res = runner(mode, args(out, 6, "--checkpoint-interval", "2"))
    assert res.returncode == status, res.stderr[-3000:]
    assert one_line(res) == says.format(ckpt=out / "checkpoints")
    if mode == "sigterm-step3":
        assert [r["step"] for r in metrics(out)] == [1, 2]
    if mode == "sigint-compile":
        assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()


def test_sigint_during_the_only_save_finishes_it_and_resume_works(runner, tmp_path, capsys):
    """Before: the clean line, then an orbax thread traceback; "Last checkpoint is at step
    None ... --resume", and --resume then failed. Now the save completes first."""
    out = tmp_path / "run"
    res = runner("sigint-save", args(out, 6, "--checkpoint-interval", "0"))
    assert res.returncode == 130, res.stderr[-3000:]
    assert one_line(res) == (f"interrupted by SIGINT while saving the checkpoint of step 6, "
                             f"after step 6; kept: the checkpoint of step 6 in "
                             f"{out / 'checkpoints'} (continue with the same flags plus "
                             "--resume)")
    assert train_lm.main(args(out, 6, "--checkpoint-interval", "0", "--resume")) == 0
    assert "nothing to train: the checkpoint is already at step 6" in flat(
        capsys.readouterr().out)


@pytest.mark.parametrize("mode, step_line, kept_lines", [
    ("enospc-save", "saving the checkpoint of step 20", 20),
    ("enospc-metrics", "writing step 15 to {out}/metrics.jsonl", 14),
])
def test_disk_full_is_one_line_and_the_previous_checkpoint_resumes(run, runner, tmp_path,
                                                                    mode, step_line, kept_lines):
    """Before: disk full during a save was exit 1 with ~680 lines of tracebacks; during a
    metrics line, a traceback and a torn line. Now: one line naming what is kept, whole lines
    only, and --resume continues from step 10 to the same state as an uninterrupted run."""
    out = tmp_path / "full"
    res = runner(mode, args(out))
    assert res.returncode == 2, res.stderr[-3000:]
    where = step_line.format(out=out)
    target = out / "checkpoints" if mode == "enospc-save" else out / "metrics.jsonl"
    assert one_line(res) == (f"error: {where}: No space left on device ({target}); kept: the "
                             f"checkpoint of step 10 in {out / 'checkpoints'} (continue with "
                             "the same flags plus --resume)")
    text = (out / "metrics.jsonl").read_bytes()
    assert text.endswith(b"\n") and text.count(b"\n") == kept_lines  # whole lines only
    assert train_lm.main(args(out, STEPS, "--resume")) == 0
    assert_same_metrics(metrics(out), metrics(run))
    assert_same_state(restore_state(out, STEPS), restore_state(run, STEPS))


def test_start_up_checks_cover_checkpoints_and_the_name(tmp_path, capsys):
    """Before: a checkpoints/ the run cannot write into, or a --out whose name is not UTF-8,
    passed the start-up checks and failed at the first save with a traceback."""
    out = tmp_path / "blocked"
    out.mkdir()
    (out / "checkpoints").write_text("not a folder")
    line = run_error(capsys, args(out))
    assert line == (f"error: --out {out}: {out / 'checkpoints'} is a file, not a folder, and "
                    "checkpoints go there; move it away or choose another --out")
    bad = Path(os.fsdecode(bytes(tmp_path) + b"/caf\xe9"))
    line = run_error(capsys, args(bad))
    assert line == (f"error: --out {tmp_path}/caf\\xe9: the name is not valid UTF-8, which the "
                    "checkpoint library needs; choose a folder name in UTF-8")
    assert not bad.exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_checkpoints_folder_is_refused_at_start(tmp_path, capsys):
    out = tmp_path / "ro"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints").chmod(0o555)
    try:
        line = run_error(capsys, args(out))
    finally:
        (out / "checkpoints").chmod(0o755)
    assert line.startswith(f"error: --out {out}: cannot write in {out / 'checkpoints'} ("), line


def test_resume_with_another_dropout_names_dropout(part, capsys):
    """Before: "--preset: checkpoint has {...the whole model config...}"."""
    line = run_error(capsys, args(part, 30, "--resume", "--dropout", "0.1"))
    assert line == (f"error: --resume: the checkpoint in {part / 'checkpoints'} was made with "
                    "other settings (--dropout: checkpoint has 0.0, now 0.1); pass the original "
                    "flags or choose another --out")


def test_resume_with_another_attention_names_it(part, capsys):
    """--attention (issue 40) is a model setting of its own: another value is refused under its
    flag, and a checkpoint made before the flag existed (its model config has no attention)
    ran the written-out attention, so it resumes with --attention manual and names it
    otherwise."""
    line = run_error(capsys, args(part, 30, "--resume", "--attention", "manual"))
    assert line == (f"error: --resume: the checkpoint in {part / 'checkpoints'} was made with "
                    "other settings (--attention: checkpoint has fused, now manual); pass the "
                    "original flags or choose another --out")
    import lm_checkpoint

    for attention, expected in (("manual", []), ("fused", [("--attention", "manual", "fused")])):
        s = train_lm.validate(train_lm.build_parser().parse_args(
            args(part, 30, "--resume", "--attention", attention)))
        try:
            now = lm_checkpoint.run_config(s)
        finally:
            s.release()
        old = dict(now, model={k: v for k, v in now["model"].items() if k != "attention"})
        assert list(lm_checkpoint._differences(old, now)) == expected


def test_resume_with_another_fp8_small_names_both_values(tmp_path, capsys):
    """Issue 46: --resume took a changed --fp8-small (a run with 16 FP8 matmuls resumed with
    none), which neither the checkpoint's run config nor summary.json recorded."""
    out = tmp_path / "fp8"
    fp8 = ["--policy", "params=float32,compute=bfloat16,output=float32,matmul=float8"]
    assert train_lm.main(args(out, 2, *fp8, "--fp8-small", "0,0")) == 0
    assert json.loads((out / "summary.json").read_text())["fp8_small"] == "0,0,0"
    before = snapshot(out)
    line = run_error(capsys, args(out, 4, *fp8, "--resume"))
    assert line == (f"error: --resume: the checkpoint in {out / 'checkpoints'} was made with "
                    "other settings (--fp8-small: checkpoint has 0,0,0, now 1024,4096,2048); "
                    "pass the original flags or choose another --out")
    assert snapshot(out) == before
    assert train_lm.main(args(out, 4, *fp8, "--fp8-small", "0,0", "--resume")) == 0


def _mount_tmpfs(where: Path, size: int) -> bool:
    where.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                         capture_output=True)
    return res.returncode == 0


@pytest.mark.parametrize("kind", ["task", "future", "gathering future"])
def test_a_failed_saves_unretrieved_tasks_are_not_reported(caplog, kind):
    """Before: on the newest orbax a full disk left its write coroutines' tasks unretrieved, and
    asyncio logged "Task exception was never retrieved" with a traceback for each whenever the
    garbage collector met them, after the one error line (about 1 run in 10 of the tmpfs test
    below). Then CI's tmpfs run logged 84 lines of "Future exception was never retrieved": the
    filter knew only tasks. Here a task, a future, or gather's future fails inside a save that
    fails, and is collected after it."""
    import asyncio
    import gc

    import lm_checkpoint

    async def write():
        raise ValueError("RESOURCE_EXHAUSTED: Failed to write: No space left on device")

    def fail_a_save():
        loop = asyncio.new_event_loop()
        try:
            with lm_checkpoint._orbax_log_held():
                if kind == "task":
                    failed = loop.create_task(write())
                elif kind == "future":
                    failed = loop.create_future()
                    failed.set_exception(ValueError("RESOURCE_EXHAUSTED: No space left"))
                else:
                    failed = asyncio.gather(loop.create_task(write()), loop.create_task(write()))
                loop.run_until_complete(asyncio.sleep(0.01))  # the coroutines run and fail
                assert failed.done()
                raise OSError(28, "No space left on device")
        finally:
            loop.close()

    with pytest.raises(OSError):
        fail_a_save()
    gc.collect()
    assert not [r.getMessage() for r in caplog.records if r.name == "asyncio"]
    # other asyncio reports still get through
    logging.getLogger("asyncio").error("something else")
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == ["something else"]


def test_a_failed_reads_unawaited_coroutines_are_not_reported():
    """Before: resuming from a checkpoint with truncated arrays printed Python's
    "RuntimeWarning: coroutine 'Store._get_array_metadatas' was never awaited" (and the source
    line of the collect) before the one error line, in 1 of 2 full suite runs. Now a failed
    orbax read or write drops that warning for the rest of the process; other runtime warnings
    still get through."""
    import gc
    import warnings

    import lm_checkpoint

    async def read():
        return None

    with warnings.catch_warnings(record=True) as seen:  # restores the filters on exit
        warnings.simplefilter("always")
        unawaited = read()
        del unawaited
        gc.collect()
        assert any("was never awaited" in str(w.message) for w in seen)  # what it looks like
        seen.clear()
        with pytest.raises(OSError), lm_checkpoint._orbax_log_held():
            unawaited = read()
            raise OSError(5, "Input/output error")
        del unawaited
        gc.collect()
        assert not [str(w.message) for w in seen]
        warnings.warn("something else", RuntimeWarning, stacklevel=1)
        assert [str(w.message) for w in seen] == ["something else"]


def test_a_really_full_disk_during_a_save(run, runner, tmp_path):
    """The same on a real full disk (a tmpfs with room for one checkpoint and a half), where
    the test may mount one: tensorstore's error from orbax's threads, not an injected one."""
    fs = tmp_path / "fs"
    ckpt = sum(f.stat().st_size for f in (run / "checkpoints" / "10").rglob("*") if f.is_file())
    if not _mount_tmpfs(fs, int(ckpt * 1.5) + 200_000):
        pytest.skip("cannot mount a tmpfs here")
    try:
        out = fs / "run"
        res = runner("none", args(out))
        assert res.returncode == 2, res.stderr[-3000:]
        assert one_line(res) == (f"error: saving the checkpoint of step 20: No space left on "
                                 f"device ({out / 'checkpoints'}); kept: the checkpoint of step "
                                 f"10 in {out / 'checkpoints'} (continue with the same flags "
                                 "plus --resume)")
        subprocess.run(["mount", "-o", "remount,size=64m", str(fs)], check=True)
        assert train_lm.main(args(out, STEPS, "--resume")) == 0
        assert_same_metrics(metrics(out), metrics(run))
        assert_same_state(restore_state(out, STEPS), restore_state(run, STEPS))
    finally:
        subprocess.run(["umount", str(fs)], capture_output=True)


def test_resume_reads_metrics_with_the_same_checks_as_the_review(part, capsys):
    """Before: --resume read metrics.jsonl whole with the same parser: a 100k-deep line was a
    RecursionError traceback. Now one line naming the line, and nothing changed."""
    with open(part / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 21, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n")
    before = snapshot(part)
    line = run_error(capsys, args(part, 30, "--resume"))
    assert line == (f"error: --resume: {part / 'metrics.jsonl'} line 21: JSON nested too deeply "
                    "to read; move it away to resume without it")
    assert snapshot(part) == before
