"""The run-log format jaxamp writes and ``python -m jaxamp.review`` reads. Imports no JAX.

A run directory holds :data:`METRICS_FILE` (``metrics.jsonl``: one JSON object per step) and
:data:`SUMMARY_FILE` (``summary.json``: one object for the run). Both are strict JSON: a
non-finite float is written as ``null``. The keys, what they mean and who reads them:

``metrics.jsonl`` (:data:`STEP_KEYS`; :func:`step_record` builds a line from the metrics
:func:`jaxamp.make_train_step` returns)

- ``step``: the step number (whole number >= 1; the last line of a repeated step wins)
- ``loss``: the unscaled training loss (``null``: inf/nan)
- ``loss_scale``: the loss scale the step used
- ``grad_norm``: global norm of the unscaled float32 gradients (``null``: inf/nan)
- ``grads_finite``: whether every gradient was finite
- ``skipped``: whether the update was skipped (non-finite gradients or loss)
- ``loss_finite``: whether the loss was finite (optional)
- ``skip_reason``: why it was skipped, int bits: 1 non-finite gradients, 2 non-finite loss
  (0: applied; optional)
- ``skipped_steps``: skipped steps so far
- ``loss_scale_at_min``: whether the dynamic scale sits at its floor (optional)
- ``tokens_per_s``: throughput of this step (optional)
- ``val_loss``: validation loss, on the steps that evaluate (optional)

``summary.json`` (:data:`SUMMARY_KEYS`, all optional for the reader)

- ``policy``: the policy string (any form :func:`jaxamp.policy_spec.parse` reads)
- ``loss_scale_mode``: ``"dynamic"``, ``"static"`` or ``"none"``
- ``clip_norm``: the gradient clipping threshold, or ``null``
- ``min_loss_scale``: the dynamic scale's floor, or ``null``
- ``final_val_loss``: the last validation loss (``null``: non-finite)
- ``memory_bytes``: compiled step memory ``{"temp", "argument", "output", "total"}`` in bytes
- ``memory_bytes_f32``: the same for the float32 step (to see what the policy saved)
- ``largest_f32_buffers``: optional, ``[{"name", "shape", "dtype", "bytes"}]``, named when
  memory did not drop

Writers add other keys freely (``examples/train_lm.py`` records its configuration); readers
ignore keys they do not know.

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

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["METRICS_FILE", "STEP_KEYS", "SUMMARY_FILE", "SUMMARY_KEYS", "MetricsError",
           "MetricsWriter", "dumps", "read_metrics", "read_summary", "step_record", "strict",
           "write_summary"]

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
STEP_KEYS = ("step", "loss", "loss_scale", "grad_norm", "grads_finite", "skipped",
             "skipped_steps", "loss_scale_at_min", "loss_finite", "skip_reason",
             "tokens_per_s", "val_loss")
SUMMARY_KEYS = ("policy", "loss_scale_mode", "clip_norm", "min_loss_scale", "final_val_loss",
                "memory_bytes", "memory_bytes_f32", "largest_f32_buffers")
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
    """Appends :func:`step_record` lines to ``metrics.jsonl``, flushed line by line.

    ``keep_through=step`` first drops the lines logged after ``step`` (a resumed run continues
    from its checkpoint; the file is rewritten atomically), keeping a line cut short by a kill
    out of the file.
    """

    def __init__(self, path: str | os.PathLike, *, keep_through: int | None = None):
        self.path = Path(path)
        if keep_through is not None:
            rows = [r for r in read_metrics(self.path, missing_ok=True)
                    if r["step"] <= keep_through]
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(dumps(r) + "\n" for r in rows))
            os.replace(tmp, self.path)
        self._file = open(self.path, "a")  # noqa: SIM115 - closed by close()

    def write(self, record: Mapping[str, Any]) -> None:
        self._file.write(dumps(dict(record)) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_metrics(path: str | os.PathLike, *, missing_ok: bool = False) -> list[dict[str, Any]]:
    """The rows of ``metrics.jsonl``, sorted by step (the last line of a repeated step wins).

    A last line without its newline (the writer was killed mid-line) is dropped. Any other line
    that is not a JSON object with a whole-number ``step`` raises :class:`MetricsError` naming
    the line. ``missing_ok``: a missing file reads as no rows.
    """
    path = Path(path)
    if not path.is_file():
        if missing_ok and not path.exists():
            return []
        raise MetricsError(f"{path}: no such file")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise MetricsError(f"{path}: cannot read ({e})") from None
    lines = text.split("\n")
    torn = lines.pop()  # "" when the file ends with a newline
    rows: dict[int, dict] = {}
    for n, line in enumerate(lines, 1):
        if line.strip():
            row = _row(line, path, n)
            rows[row["step"]] = row
    if torn.strip():
        try:
            row = _row(torn, path, len(lines) + 1)
        except MetricsError:
            row = None  # cut short by a kill
        if row is not None:
            rows[row["step"]] = row
    return [rows[k] for k in sorted(rows)]


def _row(line: str, path: Path, n: int) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise MetricsError(f"{path} line {n}: not valid JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise MetricsError(f"{path} line {n}: expected a JSON object per line")
    step = row.get("step")
    if isinstance(step, bool) or not isinstance(step, (int, float)):
        raise MetricsError(f"{path} line {n}: missing or non-numeric 'step'")
    if not (math.isfinite(step) and step == int(step)):
        raise MetricsError(f"{path} line {n}: 'step' must be a whole number, got {step!r}")
    row["step"] = int(step)
    return row


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
