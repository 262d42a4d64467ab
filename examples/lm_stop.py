"""How train_lm.py stops early: signals and file system errors, one line each.

* SIGINT (Ctrl-C) and SIGTERM raise :class:`Stopped` at any point (start-up, compilation, the
  loop, after it), except inside :meth:`Run.deferred`: a checkpoint save, a metrics line
  and the final outputs finish first, so orbax's threads are done and no file is half written.
  The run prints one line (where it stopped, which checkpoint is kept) and exits 130 / 143.
* An ``OSError`` (disk full, permissions, a name the filesystem refuses) is one ``error:``
  line saying what the run was doing and what is kept, exit 2.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable

import lm_checkpoint
import lm_files
from lm_cli import EXIT_USAGE, Setup, UsageError

__all__ = ["EXIT_INTERRUPTED", "Run", "Stopped", "exit_process", "kept", "main", "os_error",
           "report"]

EXIT_INTERRUPTED = {signal.SIGINT: 130, signal.SIGTERM: 143}  # 128 + the signal's number


class Stopped(BaseException):
    """SIGINT (Ctrl-C) or SIGTERM arrived: the run stops, the status is 128 + its number."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Run:
    """Where the run is (``phase``, the last ``step`` trained) and its signal handlers.

    SIGINT and SIGTERM raise :class:`Stopped` in the main thread, except inside
    :meth:`deferred` (a checkpoint save, a metrics line, the final outputs): there they are
    held until the block ends, so orbax's threads finish the save and no file is left half
    written. A second signal while one is held changes nothing.
    """

    def __init__(self):
        self.phase, self.step = "starting", None
        self.depth, self.pending, self._old = 0, None, {}

    def __enter__(self) -> Run:
        if threading.current_thread() is threading.main_thread():
            for signum in EXIT_INTERRUPTED:
                self._old[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, old in self._old.items():
            signal.signal(signum, old)

    def _handle(self, signum, frame) -> None:
        if self.depth:
            self.pending = self.pending or signum
            return
        raise Stopped(signum)

    @contextlib.contextmanager
    def deferred(self, phase: str | None = None):
        """Signals held for the block; ``phase``: what it does (for the line a failure
        prints)."""
        self.phase = phase or self.phase
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        if not self.depth and self.pending is not None:
            signum, self.pending = self.pending, None
            raise Stopped(signum)


    def close(self, *files) -> None:
        """Closes each of ``files`` (signals held); their errors are dropped, so the failure
        that stopped the run (if any) is the one reported."""
        with self.deferred():
            for f in files:
                with contextlib.suppress(Exception):
                    f.close()

def main(setup: Callable[[], Setup], train: Callable[[Setup, Run], int]) -> int:
    """``train(setup(), run)`` with every failure as one line: bad input (``UsageError``,
    exit 2), a signal (130 / 143), a file system error (2); --help exits 0. --out's lock is
    released at the end. ``setup()`` may return any object with ``out`` (the run folder's
    path), ``folder`` (its ``lm_files.RunFolder``) and ``release()``; one whose
    ``resumable`` is False (train_vision.py) is told to start again, not to ``--resume``."""
    s = None
    with Run() as run:
        try:
            try:
                s = setup()
            except SystemExit as e:  # --help
                return int(e.code or 0)
            return train(s, run)
        except UsageError as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_USAGE
        except (Stopped, KeyboardInterrupt, OSError) as e:
            return report(e, s, run)
        finally:
            if s is not None:
                s.release()


def report(e: BaseException, s: Setup | None, run: Run) -> int:
    """The one line for a signal (exit 130 / 143) or a file system error (exit 2)."""
    if isinstance(e, OSError):
        print(f"error: {run.phase}: {os_error(e)}; {kept(s)}", file=sys.stderr)
        return EXIT_USAGE
    signum = getattr(e, "signum", signal.SIGINT)  # KeyboardInterrupt: SIGINT
    done = f", after step {run.step}" if run.step else ""
    print(f"interrupted by {signal.Signals(signum).name} while {run.phase}{done}; {kept(s)}",
          file=sys.stderr)
    return EXIT_INTERRUPTED[signum]


def os_error(e: OSError) -> str:
    reason = e.strerror or str(e) or type(e).__name__
    return f"{reason} ({e.filename})" if e.filename else reason


def kept(s: Setup | None) -> str:
    """What a stopped run leaves to continue from: its latest complete checkpoint, or none."""
    if s is None:
        return "nothing was written"
    again = " plus --overwrite" if s.folder.holds_run() else ""
    if not getattr(s, "resumable", True):
        return (f"{s.out} keeps what was written (this script does not resume): start again "
                f"with the same flags{again}")
    step = lm_checkpoint.latest_step(s.out)
    if step is None:
        return (f"no checkpoint was saved in {s.out / lm_files.CHECKPOINT_DIR}, so there is "
                f"nothing to resume: start again with the same flags{again}")
    return (f"kept: the checkpoint of step {step} in {s.out / lm_files.CHECKPOINT_DIR} "
            "(continue with the same flags plus --resume)")


def exit_process(status: int) -> None:
    """Exits with ``status``. Stopped mid-way (maybe inside XLA or orbax), it skips the
    interpreter's teardown, which can crash on their half-finished state (everything the run
    wrote is closed by then)."""
    if status in EXIT_INTERRUPTED.values():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
