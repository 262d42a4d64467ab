"""The files train_lm.py writes in ``--out``: which folder, and what it may replace.

Rules (see examples/README.md, "What lands in --out"):

* The script records every file and checkpoint step it writes in ``--out`` in
  :data:`MANIFEST` (written atomically) *before* writing it. ``--overwrite`` removes exactly
  those, nothing else: a file the script did not write (``checkpoints/my_model.pt``, a
  ``notes.txt``) is never deleted or overwritten.
* A folder holding a file with one of the script's names that the manifest does not list (a
  user's own ``summary.json``, a run of another tool) is refused, with or without
  ``--overwrite``.
* A new run in an explicit ``--out`` that holds a previous run needs ``--overwrite`` (or
  ``--resume`` to continue it). Without ``--out`` the default folder ``runs/<preset>-<dtype>``
  is used when free, else the first free ``runs/<preset>-<dtype>-2``, ``-3``, ... so the
  README's command keeps working; ``--resume`` without ``--out`` continues the newest of them.
* A run holds an exclusive lock on ``--out`` (``fcntl.flock`` on :data:`LOCK_FILE`, which
  holds the pid and host while locked and is emptied when the run ends): a second run started
  on the same folder exits 2 with one line naming the first. The folder is checked again once
  the lock is held, so of two runs started together exactly one trains.
* Metrics, summary and manifest are strict JSON: non-finite floats are written as ``null``
  (``jaxamp.diagnostics.metrics.dumps``; that module owns the metrics and summary format).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import socket
from pathlib import Path

from jaxamp.diagnostics.metrics import SUMMARY_FILE, MetricsWriter, dumps, write_summary

__all__ = ["CHECKPOINT_DIR", "LOCK_FILE", "MANIFEST", "OUTPUT_FILES", "FolderError",
           "FolderLock", "RunFolder", "choose_out", "lock", "metrics_writer", "prepare",
           "write_outputs"]

#: The list of what train_lm.py wrote in --out (the only files ``--overwrite`` removes).
MANIFEST = "train_lm.manifest.json"
#: The lock a run holds on --out (empty when no run holds it).
LOCK_FILE = "train_lm.lock"
CHECKPOINT_DIR = "checkpoints"
#: The files train_lm.py writes in --out, besides checkpoints/ and the manifest.
OUTPUT_FILES = ("metrics.jsonl", "summary.json", "precision.json", "curves.png")
_STEP_DIR = re.compile(r"^(\d+)(\.orbax-checkpoint-tmp-.*)?$")
_MAX_NUMBERED = 10_000


class FolderError(Exception):
    """--out cannot be used as asked; the message says why and what to pass instead."""


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class RunFolder:
    """``--out`` and the manifest of what train_lm.py wrote there."""

    def __init__(self, path: Path):
        self.path = Path(path)
        #: Whether this process writes in --out. On several hosts only the first does (every
        #: host takes part in the orbax checkpoints, which write each host's shards).
        self.writer = True
        self.files: set[str] = set()
        self.steps: set[int] = set()
        m = self.path / MANIFEST
        if m.is_file():
            try:
                data = json.loads(m.read_text())
                self.files = {f for f in data["files"] if f in OUTPUT_FILES}
                self.steps = {int(s) for s in data["checkpoint_steps"]}
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise FolderError(f"--out {self.path}: its {MANIFEST} is unreadable "
                                  f"({type(e).__name__}); it lists what train_lm.py wrote "
                                  "there, so nothing is replaced: choose another --out") from None

    def _step_entries(self) -> list[tuple[int, Path]]:
        ckpt = self.path / CHECKPOINT_DIR
        if not ckpt.is_dir():
            return []
        out = []
        for p in ckpt.iterdir():
            m = _STEP_DIR.match(p.name)
            if m:
                out.append((int(m.group(1)), p))
        return out

    def foreign(self) -> list[str]:
        """Entries with the script's names that the manifest does not list."""
        names = [f for f in OUTPUT_FILES if (self.path / f).exists() and f not in self.files]
        names += [f"{CHECKPOINT_DIR}/{p.name}" for s, p in self._step_entries()
                  if s not in self.steps]
        return sorted(names)

    def holds_run(self) -> bool:
        """Whether a file or checkpoint the manifest lists is still there."""
        return any((self.path / f).exists() for f in self.files) or \
            any(s in self.steps for s, _ in self._step_entries())

    def is_free(self) -> bool:
        return not self.path.exists() or not (self.holds_run() or self.foreign())

    def describe(self) -> str:
        steps = sorted(s for s, p in self._step_entries() if s in self.steps and
                       _STEP_DIR.match(p.name).group(2) is None)
        return f"checkpoints at steps {', '.join(map(str, steps))}" if steps else \
            "its outputs, no checkpoint"

    def record(self, *files: str, step: int | None = None) -> None:
        """Adds ``files`` / checkpoint ``step`` to the manifest, before they are written."""
        if not self.writer:
            return
        new_files = set(files) - self.files
        if not new_files and (step is None or step in self.steps):
            return
        self.files |= new_files
        if step is not None:
            self.steps.add(int(step))
        write_atomic(self.path / MANIFEST, dumps(
            {"written_by": "examples/train_lm.py", "files": sorted(self.files),
             "checkpoint_steps": sorted(self.steps)}, indent=1) + "\n")

    def remove_steps(self, steps) -> list[str]:
        """Deletes the listed checkpoint steps (only those the manifest records)."""
        removed = []
        for s, p in self._step_entries():
            if s in steps and s in self.steps:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
                removed.append(f"{CHECKPOINT_DIR}/{p.name}")
        return removed

    def remove_recorded(self) -> list[str]:
        """Deletes what the manifest lists (files, checkpoint steps and their temporary
        folders) and empties it; returns the removed names. Nothing else is touched."""
        removed = []
        for f in sorted(self.files):
            p = self.path / f
            if p.is_file():
                p.unlink()
                removed.append(f)
        removed += self.remove_steps(self.steps)
        self.files, self.steps = set(), set()
        (self.path / MANIFEST).unlink(missing_ok=True)
        return removed


class FolderLock:
    """The exclusive ``flock`` a run holds on ``--out`` until :meth:`release` (or its exit)."""

    def __init__(self, path: Path, fd: int):
        self.path, self._fd = path, fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # at rest the lock file is empty
            os.close(fd)  # closing drops the flock


def lock(folder: RunFolder, *, resume: bool, overwrite: bool) -> FolderLock:
    """Takes ``--out``'s lock (the folder exists), then checks the folder again under it: a run
    that finished on it since :func:`choose_out` looked is seen. FolderError when another run
    holds the lock (naming its pid and host) or the folder no longer fits."""
    path = folder.path / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
        os.close(fd)
        raise FolderError(f"--out {folder.path} is in use by another train_lm.py run ({holder}, "
                          f"holding {path}); wait for it to finish or choose another "
                          "--out") from None
    except BaseException:
        os.close(fd)
        raise
    held = FolderLock(path, fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        fresh = RunFolder(folder.path)  # what is there now, under the lock
        _check(fresh, resume=resume, overwrite=overwrite)
        folder.files, folder.steps = fresh.files, fresh.steps
    except BaseException:
        held.release()
        raise
    return held


def _check(folder: RunFolder, *, resume: bool, overwrite: bool) -> None:
    if folder.path.exists() and not folder.path.is_dir():
        raise FolderError(f"--out {folder.path}: is a file, not a folder; choose a folder to "
                          "write to")
    foreign = folder.foreign()
    if foreign:
        raise FolderError(
            f"--out {folder.path} holds {', '.join(foreign[:4])}"
            f"{' ...' if len(foreign) > 4 else ''}, which train_lm.py did not write (they are "
            f"not in its {MANIFEST}: another tool's, yours, or from a train_lm.py older than "
            "the manifest) and will not replace; move them away or choose another --out")
    if not resume and not overwrite and folder.holds_run():
        raise FolderError(
            f"--out {folder.path} holds a previous run ({folder.describe()}); pass --resume to "
            "continue it, --overwrite to replace it (only the files train_lm.py wrote there "
            "are removed), or choose another --out")


def _check_resumable(folder: RunFolder) -> None:
    """--resume needs a folder with checkpoints: refused here, before anything is created."""
    if not folder.path.is_dir():
        raise FolderError(f"--resume: --out {folder.path} does not exist, so it holds no "
                          "checkpoints to continue (nothing was created); drop --resume to "
                          "start a new run there")
    if not (folder.path / CHECKPOINT_DIR).is_dir():
        raise FolderError(f"--resume: no checkpoints in {folder.path / CHECKPOINT_DIR}; start "
                          "a new run there without --resume (with --overwrite if it holds an "
                          "earlier run's files)")


def choose_out(out: str | None, default: Path, *, resume: bool, overwrite: bool) -> tuple[
        RunFolder, str | None]:
    """The run folder to use and a note to print (or None); FolderError if none fits.

    Nothing is created or removed here.
    """
    if resume and overwrite:
        raise FolderError("--resume continues the run in --out and --overwrite replaces it; "
                          "pass one of them")
    if out is not None:
        if not out.strip():
            raise FolderError(f"--out {out!r} is empty; pass a folder (--out . for the current "
                              "folder)")
        folder = RunFolder(Path(out).expanduser())
        _check(folder, resume=resume, overwrite=overwrite)
        if resume:
            _check_resumable(folder)
        return folder, None
    numbered = [default] + [default.with_name(f"{default.name}-{n}")
                            for n in range(2, _MAX_NUMBERED)]
    if resume:  # the newest run among runs/<name>, runs/<name>-2, ...
        last = default
        for p in numbered:
            if not p.exists():
                break
            if RunFolder(p).holds_run():
                last = p
        folder = RunFolder(last)
        _check(folder, resume=True, overwrite=False)
        _check_resumable(folder)
        return folder, None
    first = RunFolder(default)
    if overwrite or first.is_free():
        _check(first, resume=False, overwrite=overwrite)
        return first, None
    for p in numbered[1:]:
        if not p.exists():
            return RunFolder(p), (f"note: {default} holds an earlier run; this one goes to {p} "
                                  f"(--resume continues the newest, --overwrite replaces "
                                  f"{default}, --out chooses the folder)")
    raise FolderError(f"{default}-2 ... -{_MAX_NUMBERED - 1} all exist; pass --out")


def prepare(folder: RunFolder, *, overwrite: bool, note: str | None = None,
            corrupted=(), start_step: int = 0) -> list[str]:
    """Readies ``--out`` for the run, once every input is valid; returns the notes to print.

    Removes the corrupted checkpoints ``--resume latest-intact`` passed over (``corrupted``:
    ``lm_checkpoint.CorruptCheckpoint``s; orbax skips saving a step at or below its latest one,
    and the script wrote them: an --out holding steps it did not list is refused) and, with
    ``--overwrite``, the previous run's files; then records ``metrics.jsonl`` in the manifest,
    before it is (re)written.
    """
    notes = [note] if note else []
    if not folder.writer:  # another host readies --out
        return notes
    if corrupted:
        removed = folder.remove_steps({e.step for e in corrupted})
        notes.append(f"note: --resume latest-intact: checkpoint(s) "
                     f"{', '.join(str(e.step) for e in corrupted)} corrupted "
                     f"({corrupted[0].reason}); removed {len(removed)} of them, resuming "
                     f"from the newest intact checkpoint, step {start_step}")
    if overwrite and folder.holds_run():
        removed = folder.remove_recorded()
        notes.append(f"note: --overwrite: removed the previous run's {len(removed)} files and "
                     f"checkpoints in {folder.path} (only what train_lm.py wrote there)")
    folder.record(OUTPUT_FILES[0])  # metrics.jsonl
    return notes


def metrics_writer(folder: RunFolder, *, keep_through: int) -> MetricsWriter:
    """The writer of ``metrics.jsonl`` (one that writes nowhere on a host that is not the
    folder's writer)."""
    if not folder.writer:
        return MetricsWriter(os.devnull)
    return MetricsWriter(folder.path / OUTPUT_FILES[0], keep_through=keep_through)


def write_outputs(folder: RunFolder, summary: dict, precision: list[dict]) -> None:
    """``summary.json`` and ``precision.json`` (recorded in the manifest first)."""
    if folder.writer:
        folder.record(*OUTPUT_FILES)
        write_summary(folder.path / SUMMARY_FILE, summary)
        (folder.path / "precision.json").write_text(dumps(precision, indent=2) + "\n")
