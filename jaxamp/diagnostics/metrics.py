"""The run-log format jaxamp writes and ``python -m jaxamp.review`` reads (its keys:
docs/api/diagnostics.rst, "The run-log format"). Imports no JAX.

Example:
    >>> import tempfile, pathlib
    >>> run = pathlib.Path(tempfile.mkdtemp())
    >>> with MetricsWriter(run / METRICS_FILE) as log:
    ...     log.write(step_record(1, {"loss": 2.5, "loss_scale": 65536.0,
    ...         "grad_norm": float("inf"), "grads_finite": False, "skipped": True,
    ...         "skipped_steps": 1}))
    >>> read_metrics(run / METRICS_FILE)[0]["grad_norm"] is None
    True
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = ["MAX_LINE_BYTES", "METRICS_FILE", "STEP_KEYS", "SUMMARY_FILE", "SUMMARY_KEYS",
           "MetricsError", "MetricsWriter", "array_bytes", "dumps", "iter_metrics",
           "read_metrics", "read_summary", "step_record", "strict", "write_summary"]

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
STEP_KEYS = ("step", "loss", "loss_scale", "grad_norm", "grads_finite", "skipped",
             "skipped_steps", "loss_scale_at_min", "loss_finite", "skip_reason",
             "tokens_per_s", "val_loss")
SUMMARY_KEYS = ("policy", "loss_scale_mode", "clip_norm", "min_loss_scale", "final_val_loss",
                "memory_bytes", "memory_bytes_f32", "largest_f32_buffers", "backend",
                "opt_state_bytes")
_FLOATS = ("loss", "loss_scale", "grad_norm")
_BOOLS = ("grads_finite", "skipped", "loss_scale_at_min", "loss_finite")


class MetricsError(ValueError):
    """A metrics or summary file that cannot be read; the message names the file and line."""


def strict(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by ``None`` (strict JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict(v) for v in obj]
    return obj


def dumps(obj: Any, **kw: Any) -> str:
    """Strict JSON (``null`` for inf/nan)."""
    return json.dumps(strict(obj), allow_nan=False, **kw)


def step_record(step: int, metrics: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    """One ``metrics.jsonl`` line from the metrics a train step returned (host values: call
    ``jax.device_get`` first) plus ``extra`` keys (``tokens_per_s=``, ``val_loss=``)."""
    row: dict[str, Any] = {"step": int(step)}
    for key in _FLOATS:
        if key in metrics:
            row[key] = float(metrics[key])
    for key in _BOOLS:
        if key in metrics:
            row[key] = bool(metrics[key])
    for key in ("skipped_steps", "skip_reason"):
        if key in metrics:
            row[key] = int(metrics[key])
    row.update(extra)
    return strict(row)


class MetricsWriter:
    """Appends :func:`step_record` lines to ``metrics.jsonl``: each line whole or not at all.

    A line is one ``write`` of its bytes at the end of the file; if that fails or writes
    only part of it (disk full), the file is truncated back to where the line began and the
    ``OSError`` is raised, so the file never holds a torn line written by this writer.
    :meth:`close` syncs the file to disk.

    ``keep_through=step`` first drops the lines logged after ``step`` (a resumed run continues
    from its checkpoint; the file is rewritten atomically, read line by line), keeping a line
    cut short by a kill out of the file.
    """

    def __init__(self, path: str | os.PathLike, *, keep_through: int | None = None):
        self.path = Path(path)
        if keep_through is not None:
            rows = [r for r in read_metrics(self.path, missing_ok=True)
                    if r["step"] <= keep_through]
            tmp = self.path.with_name(self.path.name + ".tmp")
            try:
                with open(tmp, "w") as f:
                    f.writelines(dumps(r) + "\n" for r in rows)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                                       0o666)

    def write(self, record: Mapping[str, Any]) -> None:
        data = (dumps(dict(record)) + "\n").encode()
        fd = self._fd
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            done = os.write(fd, data)
            if done != len(data):  # a short write: the disk filled up mid-line
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            raise

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.fsync(fd)
            except OSError as e:
                if e.errno != errno.EINVAL:  # EINVAL: not syncable (os.devnull)
                    raise
            finally:
                os.close(fd)

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


#: The longest ``metrics.jsonl`` line the reader takes (a step's record is ~250 bytes): a
#: longer one is an error, so a corrupt file never has to be held in memory whole.
MAX_LINE_BYTES = 1 << 20
_NUMBERS = ("loss", "loss_scale", "grad_norm", "tokens_per_s", "val_loss")


def iter_metrics(path: str | os.PathLike, *,
                 on_dropped: Callable[[str], None] | None = None,
                 ) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, row)`` for each line of ``metrics.jsonl``, in file order, read one
    line at a time (memory bounded by :data:`MAX_LINE_BYTES`, whatever the file's size).

    Each row is checked (:class:`MetricsError` naming the file, line and key): a JSON object
    with a whole-number ``step`` >= 0; ``loss``, ``loss_scale``, ``grad_norm``,
    ``tokens_per_s`` and ``val_loss`` numbers or ``null``; ``grads_finite``, ``skipped`` and
    ``loss_scale_at_min`` ``true``/``false``; ``skipped_steps`` a whole number. Every parse
    failure (bad UTF-8, invalid JSON, nesting too deep, a number too long to convert) is a
    :class:`MetricsError` too. A last line without its newline (the writer was killed
    mid-line) that does not parse is dropped, and ``on_dropped`` (if given) is called with a
    sentence that says so (the review prints it as a note). Blank lines are skipped.
    """
    path = Path(path)
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError as e:
        raise MetricsError(f"{path}: cannot read ({e.strerror or type(e).__name__})") from None
    with f:
        n = 0
        while True:
            try:
                raw = f.readline(MAX_LINE_BYTES + 1)
            except OSError as e:
                raise MetricsError(f"{path} line {n + 1}: cannot read "
                                   f"({e.strerror or type(e).__name__})") from None
            if not raw:
                return
            n += 1
            torn = not raw.endswith(b"\n")
            if torn and len(raw) > MAX_LINE_BYTES:
                raise MetricsError(f"{path} line {n}: longer than {MAX_LINE_BYTES} bytes; a "
                                   "metrics line is one step's record (a few hundred bytes)")
            if not raw.strip():
                continue
            try:
                yield n, _row(raw, path, n)
            except MetricsError as e:
                if torn:  # cut short by a kill: the last line, not a record
                    if on_dropped is not None:
                        reason = str(e).removeprefix(f"{path} line {n}: ")
                        on_dropped(f"{path} line {n} was dropped: the last line, without its "
                                   f"newline, does not parse ({reason}); the writer was "
                                   "stopped while writing it")
                    return
                raise


def read_metrics(path: str | os.PathLike, *, missing_ok: bool = False,
                 keys: Collection[str] | None = None,
                 on_dropped: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """The rows of ``metrics.jsonl``, sorted by step (the last line of a repeated step wins),
    read line by line (:func:`iter_metrics`, which checks every line and says what an
    unreadable one is).

    ``missing_ok``: a missing file reads as no rows. ``keys``: keep only these keys of each
    row (``step`` always), so the rows kept in memory stay small however long the lines.
    ``on_dropped``: told about a torn last line that was dropped (:func:`iter_metrics`).
    """
    path = Path(path)
    if not path.is_file():
        if missing_ok and not path.exists():
            return []
        raise MetricsError(f"{path}: no such file")
    keep = None if keys is None else frozenset(keys) | {"step"}
    rows: dict[int, dict] = {}
    for _, row in iter_metrics(path, on_dropped=on_dropped):
        if keep is not None:
            row = {k: v for k, v in row.items() if k in keep}
        rows[row["step"]] = row
    return [rows[k] for k in sorted(rows)]


def _row(raw: bytes, path: Path, n: int) -> dict[str, Any]:
    where = f"{path} line {n}"
    try:
        row = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise MetricsError(f"{where}: not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise MetricsError(f"{where}: not valid JSON ({e.msg})") from None
    except RecursionError:
        raise MetricsError(f"{where}: JSON nested too deeply to read") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise MetricsError(f"{where}: unreadable JSON ({str(e).splitlines()[0][:120]})") \
            from None
    if not isinstance(row, dict):
        raise MetricsError(f"{where}: expected a JSON object per line")
    step = row.get("step")
    if isinstance(step, bool) or not isinstance(step, (int, float)):
        raise MetricsError(f"{where}: missing or non-numeric 'step'")
    if isinstance(step, float) and not (math.isfinite(step) and step.is_integer()):
        raise MetricsError(f"{where}: 'step' must be a whole number, got {step!r}")
    row["step"] = int(step)
    for key in _NUMBERS:
        v = row.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise MetricsError(f"{where}: {key!r} must be a number or null, got {_show(v)}")
    for key in _BOOLS:
        if key in row and not isinstance(row[key], bool):
            raise MetricsError(f"{where}: {key!r} must be true or false, got {_show(row[key])}")
    v = row.get("skipped_steps")
    if "skipped_steps" in row and (isinstance(v, bool) or not isinstance(v, (int, float))):
        raise MetricsError(f"{where}: 'skipped_steps' must be a number, got {_show(v)}")
    return row


def _show(v: Any) -> str:
    text = json.dumps(v)
    return text if len(text) <= 40 else text[:37] + "..."


def array_bytes(arrays: Iterable[Any]) -> dict[str, int]:
    """``{"<dtype name>": bytes, ..., "total": bytes}`` of ``arrays`` (anything with ``shape``
    and ``dtype``: JAX or NumPy arrays, ``jax.ShapeDtypeStruct``), the record of
    ``summary.json``'s ``opt_state_bytes``: pass ``jax.tree.leaves(state.opt_state)``.

    Example:
        >>> import numpy as np
        >>> array_bytes([np.zeros(3, np.float32), np.zeros((2, 2), np.float32), np.int32(0)])
        {'float32': 28, 'int32': 4, 'total': 32}
    """
    out: dict[str, int] = {}
    for a in arrays:
        dtype = getattr(a, "dtype", None)
        if dtype is None:
            continue
        size = math.prod(getattr(a, "shape", ())) * dtype.itemsize
        out[str(dtype)] = out.get(str(dtype), 0) + size
    return {**dict(sorted(out.items())), "total": sum(out.values())}


def write_summary(path: str | os.PathLike, summary: Mapping[str, Any]) -> None:
    """Writes ``summary.json`` atomically (strict JSON)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(dumps(dict(summary), indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_summary(path: str | os.PathLike, *, missing_ok: bool = True) -> dict[str, Any]:
    """``summary.json`` as a dict (``{}`` when absent and ``missing_ok``)."""
    path = Path(path)
    if not path.exists():
        if missing_ok:
            return {}
        raise MetricsError(f"{path}: no such file")
    try:
        summary = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MetricsError(f"{path}: not valid JSON ({getattr(e, 'msg', e)})") from None
    if not isinstance(summary, dict):
        raise MetricsError(f"{path}: expected a JSON object")
    return summary
