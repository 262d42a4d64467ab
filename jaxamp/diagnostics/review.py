"""Review a finished (or running) mixed-precision run from its logs (``metrics.jsonl``,
``summary.json``): loss scale, gradients, memory. Its findings, the format it reads and its
command line (``python -m jaxamp.review RUN_DIR [--clip-norm 1.0] [--json]``; exit 0 healthy,
1 findings, 2 error): docs/api/diagnostics.rst, "Reviewing a run". Imports no JAX.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..policy_spec import parse as parse_policy
from ._base import Report, escape, markdown_table
from .metrics import (
    METRICS_FILE,
    STEP_KEYS,
    SUMMARY_FILE,
    MetricsError,
    read_metrics,
    read_summary,
)

__all__ = ["ReviewError", "RunFinding", "RunReview", "main", "review_metrics", "review_run"]

#: detection thresholds (keyword arguments of :func:`review_metrics` override them)
DEFAULTS: dict[str, float] = {
    "spike_window": 20,  # steps of history a spike is measured against
    "spike_sigmas": 6.0,  # a spike exceeds the recent median by this many robust sigmas ...
    "spike_rel": 0.1,  # ... and by this fraction of the median
    "coincide_steps": 2,  # a spike "coincides" with a scale change this close to it
    "min_coincident": 2,  # spikes that must coincide before it is a finding
    "floor_steps": 10,  # consecutive steps at the scale floor
    "max_consecutive_skips": 8,
    "tiny_grad_norm": 1e-5,  # median grad norm below this is implausible
    "clip_rel_tol": 1e-3,  # |grad_norm - clip| <= tol * clip counts as "at the clip"
    "clip_fraction": 0.9,  # ... at this fraction of the steps
    "memory_ratio": 0.9,  # mixed-precision memory >= this fraction of float32's
}


class ReviewError(Exception):
    """The run directory or its files cannot be read (the CLI prints it and exits 2)."""


@dataclasses.dataclass(frozen=True)
class RunFinding:
    """A problem found in a run's logs.

    Attributes:
      code: ``loss_spike_at_scale_change``, ``scale_at_floor``, ``consecutive_skips``,
        ``grad_norm_tiny``, ``grad_norm_at_clip``, ``memory_not_reduced`` or
        ``loss_diverged``.
      steps: the steps involved (for memory: empty).
      explanation: what was seen, what it means and the likely fix (plain English).
    """

    code: str
    steps: tuple[int, ...]
    explanation: str

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "steps": list(self.steps), "explanation": self.explanation}


@dataclasses.dataclass
class RunReview(Report):
    """The review of one run: ``findings`` (empty when healthy) and what was read."""

    findings: list[RunFinding]
    num_steps: int
    run_dir: str | None = None
    #: what the review could not judge and why, and figures worth knowing (not problems:
    #: ``ok`` ignores them), e.g. that memory cannot drop on the CPU backend, or the bytes of
    #: the optimizer state
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.findings

    def codes(self) -> set[str]:
        return {f.code for f in self.findings}

    def to_dict(self) -> dict[str, Any]:
        return {"run_dir": self.run_dir, "num_steps": self.num_steps, "ok": self.ok,
                "findings": [f.to_dict() for f in self.findings], "notes": list(self.notes)}

    def to_text(self) -> str:
        head = f"{self.run_dir}: " if self.run_dir else ""
        notes = [f"note: {n}" for n in self.notes]
        if self.ok:
            return "\n".join([f"{head}no problems found ({self.num_steps} steps reviewed)",
                              *notes])
        lines = [f"{head}{len(self.findings)} problem(s) in {self.num_steps} steps"]
        for f in self.findings:
            lines.append(f"- {f.code} (steps {_steps_text(f.steps)}): {f.explanation}"
                         if f.steps else f"- {f.code}: {f.explanation}")
        return "\n".join(lines + notes)

    def to_markdown(self) -> str:
        if self.ok:
            return f"No problems found ({self.num_steps} steps reviewed)."
        return "\n".join(markdown_table(("code", "steps", "explanation"), [
            (f.code, _steps_text(f.steps), f.explanation) for f in self.findings]))

    def _rich(self) -> list[Any]:
        out = [f"[green]no problems found[/green] ({self.num_steps} steps reviewed)"] \
            if self.ok else []
        for f in self.findings:
            steps = f" (steps {_steps_text(f.steps)})" if f.steps else ""
            out.append(f"[bold red]{f.code}[/bold red]{steps}: {escape(f.explanation)}")
        return out + [f"[dim]note:[/dim] {escape(n)}" for n in self.notes]


def _steps_text(steps: Sequence[int], limit: int = 12) -> str:
    """``steps`` with runs compressed (3,4,5,6 -> 3-6), at most ``limit`` parts."""
    parts: list[list[int]] = []
    for s in steps:
        if parts and s == parts[-1][1] + 1:
            parts[-1][1] = s
        else:
            parts.append([s, s])
    text = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in parts[:limit]) or "-"
    return text + (f", ... ({len(steps)} steps)" if len(parts) > limit else "")


def _num(x) -> float:
    """A float; None/strings/non-finite -> nan."""
    if isinstance(x, bool):
        return float(x)
    if isinstance(x, (int, float)):
        try:
            return float(x)
        except OverflowError:  # an integer beyond float range
            return math.inf if x > 0 else -math.inf
    return math.nan


def read_run(run_dir: str | Path, notes: list[str] | None = None) -> tuple[list[dict], dict]:
    """``metrics.jsonl`` rows (sorted by step, the last line of a repeated step wins) and
    ``summary.json`` (``{}`` if absent), read by :mod:`jaxamp.diagnostics.metrics`. Raises
    :class:`ReviewError` on a missing run directory or a missing/corrupt file. ``notes``:
    gets a sentence for what was read but left out (a torn last line)."""
    d = Path(run_dir)
    if not d.exists():
        raise ReviewError(f"{d}: no such run directory")
    if not d.is_dir():
        raise ReviewError(f"{d}: not a directory (pass the run directory that holds "
                          f"{METRICS_FILE})")
    if not (d / METRICS_FILE).is_file():
        raise ReviewError(f"{d}: no {METRICS_FILE} in the run directory")
    try:
        rows = read_metrics(d / METRICS_FILE, keys=STEP_KEYS,
                            on_dropped=None if notes is None else notes.append)
        summary = read_summary(d / SUMMARY_FILE)
    except MetricsError as e:
        raise ReviewError(str(e)) from None
    if not rows:
        raise ReviewError(f"{d / METRICS_FILE}: no steps logged")
    return rows, summary


def _runs(flags: Sequence[bool], steps: Sequence[int]) -> list[list[int]]:
    """Maximal runs of consecutive True flags, as lists of steps."""
    out, cur = [], []
    for f, s in zip(flags, steps):
        if f:
            cur.append(s)
        elif cur:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out


def _nonfinite(row: Mapping, key: str) -> bool:
    """Whether ``row[key]`` is logged as non-finite: ``null`` (strict JSON, as train_lm.py and
    jaxamp write inf/nan) or a NaN/Infinity float (non-standard JSON). Absent keys and values
    of other types (malformed) are not."""
    if key not in row:
        return False
    v = row[key]
    return v is None or (isinstance(v, float) and not math.isfinite(v))


def _diverged(steps, rows, summary: Mapping) -> RunFinding | None:
    """The loss non-finite from some step to the last logged one, or a non-finite validation
    loss: the run diverged (params or optimizer state hold inf/nan)."""
    tail = []
    for s, r in zip(reversed(steps), reversed(rows)):
        if not _nonfinite(r, "loss"):
            break
        tail.append(s)
    tail.reverse()
    val = [s for s, r in zip(steps, rows) if _nonfinite(r, "val_loss")]
    final_val = _nonfinite(summary, "final_val_loss")
    if not (tail or val or final_val):
        return None
    seen = []
    if tail:
        seen.append(f"the training loss is non-finite from step {tail[0]} to the last logged "
                    f"step ({len(tail)} steps)")
    if val:
        seen.append(f"the validation loss non-finite at step {_steps_text(val)}")
    elif final_val:
        seen.append("summary.json's final validation loss is non-finite")
    return RunFinding(
        "loss_diverged", tuple(sorted(set(tail) | set(val))),
        f"the run diverged: {'; '.join(seen)}. The parameters or optimizer state hold inf/NaN, "
        "so every later step is skipped or applies garbage, whatever the loss scale. Typical "
        "causes: a learning rate too high for this model, a NaN/inf in the data, a corrupted "
        "checkpoint that was resumed, or an op overflowing in float16. Fix: resume from the "
        "last checkpoint before it with a lower learning rate (or a longer warmup), check the "
        "data, and run jaxamp.locate_overflow on the first bad step's batch.")


def _skipped(row: Mapping) -> bool:
    if "skipped" in row:
        return bool(row["skipped"])
    if "grads_finite" in row:
        return not bool(row["grads_finite"])
    return False


def _spikes(steps, loss, skipped, cfg) -> list[int]:
    """Steps whose loss jumps above the recent level: the median of the last 5 finite losses
    plus ``spike_sigmas`` robust standard deviations of the step-to-step noise (the MAD of the
    last ``spike_window`` first differences, so a falling trend is not mistaken for noise) and
    at least ``spike_rel`` of that level."""
    w = int(cfg["spike_window"])
    out = []
    for i, s in enumerate(steps):
        if skipped[i] and not math.isfinite(loss[i]):
            continue
        hist = [loss[j] for j in range(max(0, i - w), i) if math.isfinite(loss[j])]
        if len(hist) < 5:
            continue
        if not math.isfinite(loss[i]):
            out.append(s)  # a non-finite loss on an applied step
            continue
        level = statistics.median(hist[-5:])
        diffs = [b - a for a, b in zip(hist, hist[1:])]
        md = statistics.median(diffs)
        sigma = 1.4826 * statistics.median(abs(d - md) for d in diffs) / math.sqrt(2)
        if loss[i] - level > max(cfg["spike_sigmas"] * sigma, cfg["spike_rel"] * abs(level),
                                 1e-8):
            out.append(s)
    return out


def _clip_norm(summary: Mapping, override: float | None) -> float | None:
    v = summary.get("clip_norm") if override is None else override
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(_num(v)) \
            and v > 0:
        return float(v)
    return None


def _policy_compute(summary: Mapping) -> str | None:
    """The canonical compute dtype name of the logged policy (None: absent or unreadable)."""
    pol = summary.get("policy")
    try:
        return parse_policy(pol)["compute"] if isinstance(pol, str) else None
    except ValueError:
        return None


def _memory_pair(summary: Mapping) -> tuple[dict, dict] | None:
    a, f = summary.get("memory_bytes"), summary.get("memory_bytes_f32")
    if isinstance(a, Mapping) and isinstance(f, Mapping) and a and f:
        return dict(a), dict(f)
    return None


def _mem_value(m: Mapping) -> tuple[str, float] | None:
    def num(k):
        v = m.get(k)
        return _num(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
    if num("temp"):
        return "temp", num("temp")
    if num("total"):
        return "total", num("total")
    parts = [num(k) for k in ("temp", "argument", "output")]
    if any(parts):
        return "total", float(sum(p for p in parts if p))
    return None


def _largest_buffers(summary: Mapping) -> list[str]:
    """``summary["largest_f32_buffers"]`` (``{"name", "shape", "dtype", "bytes"}`` each) as
    text, float32 ones only, at most five."""
    bufs = summary.get("largest_f32_buffers")
    out = []
    for b in bufs if isinstance(bufs, list) else []:
        if not isinstance(b, Mapping) or str(b.get("dtype", "float32")) != "float32":
            continue
        desc = str(b.get("name", "?"))
        if isinstance(b.get("shape"), list):
            desc += f" {b['shape']}"
        if isinstance(b.get("bytes"), (int, float)):
            desc += f" ({_fmt_bytes(b['bytes'])})"
        out.append(desc)
    return out[:5]


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def review_metrics(rows: Sequence[Mapping], summary: Mapping | None = None, *,
                   clip_norm: float | None = None, **thresholds: float) -> RunReview:
    """Reviews logged rows (dicts as in ``metrics.jsonl``) and an optional summary dict.

    Args:
      rows: one dict per step (``step``, ``loss``, ``loss_scale``, ``grad_norm``,
        ``grads_finite``, ``skipped``; missing keys disable the checks that need them; a
        ``None`` loss or grad norm means non-finite).
      summary: ``summary.json``'s content, with the keys :mod:`jaxamp.diagnostics.metrics`
        documents (``policy``, ``clip_norm``, ``loss_scale_mode``, ``min_loss_scale``,
        ``final_val_loss``, ``memory_bytes`` / ``memory_bytes_f32``, and optionally
        ``largest_f32_buffers``); others are ignored.
      clip_norm: the clip threshold (overrides the summary's).
      **thresholds: overrides of :data:`DEFAULTS`.

    The heuristics and their limits: docs/api/diagnostics.rst, "Reviewing a run".
    """
    cfg = dict(DEFAULTS)
    for k, v in thresholds.items():
        if k not in cfg:
            raise TypeError(f"review_metrics: unknown threshold {k!r}; known: {sorted(cfg)}")
        cfg[k] = v
    summary = dict(summary or {})
    run = _Series(sorted(rows, key=lambda r: r.get("step", 0)))
    findings = [f for f in (_spike_finding(run, cfg), _diverged(run.steps, run.rows, summary),
                            _floor_finding(run, summary, cfg), _skips_finding(run, cfg))
                if f is not None]
    findings += _grad_norm_findings(run, _clip_norm(summary, clip_norm), cfg)
    memory, notes = _memory_review(summary, cfg)
    findings += memory
    opt_note = _opt_state_note(summary)
    if opt_note:
        notes.append(opt_note)
    return RunReview(findings, len(run.rows), notes=notes)


class _Series:
    """A run's logged rows, in step order, as columns (a missing or ``None`` value is nan)."""

    def __init__(self, rows: Sequence[Mapping]):
        self.rows = rows
        self.steps = [int(r.get("step", i)) for i, r in enumerate(rows)]
        self.loss = [_num(r.get("loss")) for r in rows]
        self.scale = [_num(r.get("loss_scale")) for r in rows]
        self.gnorm = [_num(r.get("grad_norm")) for r in rows]
        self.skipped = [_skipped(r) for r in rows]


def _spike_finding(run: _Series, cfg: Mapping) -> RunFinding | None:
    """(a) loss spikes that coincide with loss-scale changes."""
    steps, scale = run.steps, run.scale
    changes = [(steps[i], scale[i - 1], scale[i]) for i in range(1, len(run.rows))
               if math.isfinite(scale[i]) and math.isfinite(scale[i - 1])
               and scale[i] != scale[i - 1]]
    if not changes:
        return None
    spikes = _spikes(steps, run.loss, run.skipped, cfg)
    near = int(cfg["coincide_steps"])
    hits = [s for s in spikes if any(abs(s - c) <= near for c, _, _ in changes)]
    if len(hits) < int(cfg["min_coincident"]):
        return None
    involved = sorted({c for s in hits for c, _, _ in changes if abs(s - c) <= near})
    desc = "; ".join(f"step {c}: {a:g} -> {b:g}" for c, a, b in changes if c in involved[:6])
    return RunFinding(
        "loss_spike_at_scale_change", tuple(hits),
        f"the loss spiked at {len(hits)} step(s) ({_steps_text(hits)}), each within "
        f"{near} steps of a loss-scale change ({desc}). With correct AMP a scale change "
        "never moves the loss: gradients are unscaled with the scale of their own step "
        "and overflowing steps are skipped. Spikes that track the scale mean the scale "
        "is adjusted too aggressively or overflowed/partly-inf gradients are "
        "being applied. Fix: make sure non-finite steps are skipped and unscaled with "
        "the scale that produced them (jaxamp.make_train_step does both), lengthen the "
        "growth interval (DynamicLossScale(growth_interval=2000)) or lower the growth "
        "factor, or train in bfloat16 (no loss scaling).")


def _floor_finding(run: _Series, summary: Mapping, cfg: Mapping) -> RunFinding | None:
    """(b) the dynamic loss scale stuck at its floor."""
    steps, scale = run.steps, run.scale
    mode = str(summary.get("loss_scale_mode", "")).lower()
    finite_scales = [s for s in scale if math.isfinite(s)]
    if not finite_scales or len(set(finite_scales)) <= 1 or mode in ("none", "static"):
        return None
    floor = summary.get("min_loss_scale")
    floor = _num(floor) if isinstance(floor, (int, float)) else 1.0
    at_min = [bool(r.get("loss_scale_at_min")) if "loss_scale_at_min" in r
              else (math.isfinite(s) and s <= floor * (1 + 1e-6))
              for r, s in zip(run.rows, scale)]
    runs = [r for r in _runs(at_min, steps) if len(r) >= int(cfg["floor_steps"])]
    if not runs:
        return None
    stuck = [s for r in runs for s in r]
    n_skip = sum(1 for s, k in zip(steps, run.skipped) if k and s in set(stuck))
    return RunFinding(
        "scale_at_floor", tuple(stuck),
        f"the loss scale sat at its floor ({floor:g}) for {len(stuck)} steps "
        f"({_steps_text(stuck)}), {n_skip} of them skipped. Backing off cannot cure "
        "this overflow: something is inf/nan whatever the scale -- a forward overflow "
        "(activations beyond float16's 65504, e.g. LayerNorm/softmax/loss running in "
        "float16 or an un-normalised residual stream), a NaN in the data, or a "
        "diverged learning rate. Fix: run jaxamp.locate_overflow on a failing batch to "
        "find the module, check jaxamp.audit keeps softmax/LayerNorm/loss in float32, "
        "lower the learning rate, or train in bfloat16.")


def _skips_finding(run: _Series, cfg: Mapping) -> RunFinding | None:
    """(b) many consecutive skipped steps."""
    steps = run.steps
    skip_runs = [r for r in _runs(run.skipped, steps)
                 if len(r) >= int(cfg["max_consecutive_skips"])]
    if not skip_runs:
        return None
    longest = max(skip_runs, key=len)
    all_skips = [s for r in skip_runs for s in r]
    sc = [run.scale[steps.index(s)] for s in longest]
    trend = (f"; the loss scale went {sc[0]:g} -> {sc[-1]:g}" if sc and
             all(math.isfinite(x) for x in (sc[0], sc[-1])) else "")
    return RunFinding(
        "consecutive_skips", tuple(all_skips),
        f"{len(longest)} consecutive steps were skipped ({_steps_text(longest)}){trend}: "
        "their gradients were non-finite, so no update happened. A few skips while a "
        "dynamic scale backs off from 2**16 at the start are normal; a long run means "
        "every step overflows. Fix: if the scale is still high, back off faster "
        "(backoff_factor) or start lower (DynamicLossScale(2.0**12)); if it reached its "
        "floor, find the overflowing module with jaxamp.locate_overflow and keep the "
        "sensitive ops in float32 (jaxamp.audit).")


def _grad_norm_findings(run: _Series, clip: float | None, cfg: Mapping) -> list[RunFinding]:
    """(c) the grad norm implausibly small, or pinned to the clip threshold."""
    applied = [(s, g, sc) for s, g, sc, k in zip(run.steps, run.gnorm, run.scale, run.skipped)
               if not k and math.isfinite(g)]
    if len(applied) < 5:
        return []
    med = statistics.median(g for _, g, _ in applied)
    out = [_tiny_grad_finding(applied, med, clip, cfg)]
    out.append(_at_clip_finding(applied, med, clip, cfg))
    return [f for f in out if f is not None]


def _tiny_grad_finding(applied, med: float, clip: float | None,
                       cfg: Mapping) -> RunFinding | None:
    zeros = [s for s, g, _ in applied if g == 0.0]
    at_clip_scaled = []
    if clip is not None:
        at_clip_scaled = [s for s, g, sc in applied if math.isfinite(sc) and sc > 1
                          and abs(g - clip / sc) <= 0.01 * clip / sc]
    if len(at_clip_scaled) >= cfg["clip_fraction"] * len(applied):
        return RunFinding(
            "grad_norm_tiny", tuple(at_clip_scaled),
            f"the gradient norm equals clip_norm / loss_scale ({clip:g} / scale) at "
            f"{len(at_clip_scaled)} of {len(applied)} applied steps (median "
            f"{med:.3g}): the gradients were clipped while still multiplied by the loss "
            "scale and then unscaled, so every update is shrunk by the scale (clip "
            "before unscale). Fix: unscale first, then clip "
            "(jaxamp.make_train_step(clip_norm=...) does it in that order).")
    if med < cfg["tiny_grad_norm"] or len(zeros) > 0.1 * len(applied):
        which = zeros if len(zeros) > 0.1 * len(applied) else [s for s, _, _ in applied]
        return RunFinding(
            "grad_norm_tiny", tuple(which),
            f"the gradient norm is implausibly small (median {med:.3g} over "
            f"{len(applied)} applied steps; exactly 0 at {len(zeros)}). Typical causes: the "
            "gradients are divided by the loss scale twice or unscaled in the wrong order "
            "they were clipped while scaled, or they underflowed to zero in "
            "float16 (loss scale too small or missing). Fix: scale the loss once, unscale "
            "the gradients once with the same scale before clipping and the update; check "
            "with jaxamp.audit_step and jaxamp.locate_overflow (underflow fractions).")
    return None


def _at_clip_finding(applied, med: float, clip: float | None,
                     cfg: Mapping) -> RunFinding | None:
    if clip is not None:
        pinned = [s for s, g, _ in applied if abs(g - clip) <= cfg["clip_rel_tol"] * clip]
        what = f"the clip threshold {clip:g}"
    else:
        pinned = [s for s, g, _ in applied if med > 0 and abs(g - med) <= 1e-4 * med]
        what = f"a constant {med:.6g} (probably the clip threshold)"
    if len(applied) < 10 or len(pinned) < cfg["clip_fraction"] * len(applied):
        return None
    return RunFinding(
        "grad_norm_at_clip", tuple(pinned),
        f"the logged gradient norm equals {what} at {len(pinned)} of {len(applied)} "
        "applied steps: every update is clipped. That is the signature of clipping "
        "(or measuring) *scaled* gradients: their norm is loss_scale times too large, "
        "so the clip always triggers and the effective threshold shrinks by the scale "
        "Fix: unscale the gradients before computing the norm and "
        "clipping; log the norm of the unscaled gradients before clipping.")


def _memory_review(summary: Mapping, cfg: Mapping) -> tuple[list[RunFinding], list[str]]:
    """(d) memory that did not drop vs float32: a finding, or a note where it cannot be
    judged (a step compiled for XLA:CPU)."""
    pair = _memory_pair(summary)
    compute = _policy_compute(summary)
    if pair is None or compute == "float32":
        return [], []
    va, vf = _mem_value(pair[0]), _mem_value(pair[1])
    if summary.get("backend") == "cpu":
        ratio = f" (here x{va[1] / vf[1]:.2f} of float32)" if va and vf and va[0] == vf[0] \
            and vf[1] > 0 else ""
        return [], [
            f"memory not judged: the step was compiled for XLA:CPU (summary.json backend: "
            f"cpu), which upcasts {compute or 'low-precision'} matmuls and convolutions to "
            f"float32, so mixed precision cannot reduce memory there{ratio}. Compare "
            "memory_bytes with memory_bytes_f32 from a run on a GPU."]
    if not (va and vf and va[0] == vf[0] and vf[1] > 0 and va[1] >= cfg["memory_ratio"] * vf[1]):
        return [], []
    amp, f32 = pair
    extra = ""
    args_a, args_f = amp.get("argument"), f32.get("argument")
    if isinstance(args_a, (int, float)) and isinstance(args_f, (int, float)):
        extra = (f" (arguments: {_fmt_bytes(args_a)} vs {_fmt_bytes(args_f)}; params and "
                 "optimizer state stay float32 under AMP, unless the policy's "
                 "opt_state=bfloat16 halves the moments)")
    bufs = _largest_buffers(summary)
    named = (" Largest float32 buffers: " + "; ".join(bufs) + ".") if bufs else ""
    return [RunFinding(
        "memory_not_reduced", (),
        f"the compiled step's {va[0]} memory is {_fmt_bytes(va[1])} under mixed "
        f"precision vs {_fmt_bytes(vf[1])} for the same step in float32 (x{va[1] / vf[1]:.2f})"
        f"{extra}: memory did not drop, so many float32 tensors stay resident."
        f"{named} Likely causes: activations saved for the backward are float32 "
        "(modules computing in float32 via overrides, manual .astype(jnp.float32), "
        "custom_vjp functions in OpRules.custom_vjp_as_traced), float32 copies of the "
        "weights kept per use, or a step dominated by parameters/optimizer state, "
        "which the compute policy does not shrink. Fix: check jaxamp.audit for "
        "float32 matmuls in low-precision regions, remove manual casts, use nn.remat "
        "for activation memory, and opt_state=bfloat16 in the policy for the "
        "optimizer's moments.")], []


def _opt_state_note(summary: Mapping) -> str | None:
    """The optimizer state's bytes (``summary["opt_state_bytes"]``), by dtype, and what the
    policy's ``opt_state=`` makes of them."""
    record = summary.get("opt_state_bytes")
    if not isinstance(record, Mapping):
        return None
    sizes = {k: _num(v) for k, v in record.items() if k != "total"}
    sizes = {k: v for k, v in sizes.items() if math.isfinite(v) and v > 0}
    if not sizes:
        return None
    parts = ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in
                      sorted(sizes.items(), key=lambda kv: -kv[1]))
    text = f"optimizer state: {_fmt_bytes(sum(sizes.values()))} ({parts})"
    pol = summary.get("policy")
    try:
        stored = parse_policy(pol).get("opt_state") if isinstance(pol, str) else None
    except ValueError:
        stored = None
    low = sizes.get("bfloat16", 0.0)
    f32 = sizes.get("float32", 0.0)
    if stored == "bfloat16" and low:
        return (f"{text}; opt_state=bfloat16 stores its moments in bfloat16 with stochastic "
                f"rounding: {_fmt_bytes(low)}, where float32 would take {_fmt_bytes(2 * low)}")
    if f32 and not low:
        return (f"{text}; opt_state=bfloat16 in the policy would store its float32 moments "
                f"in half ({_fmt_bytes(f32)} -> {_fmt_bytes(f32 / 2)}), with stochastic "
                "rounding")
    return text


def review_run(run_dir: str | Path, *, clip_norm: float | None = None,
               **thresholds: float) -> RunReview:
    """Reads ``run_dir/metrics.jsonl`` (and ``summary.json`` if present) and reviews the run
    (see :func:`review_metrics`). Raises :class:`ReviewError` for a missing/corrupt run dir."""
    dropped: list[str] = []
    rows, summary = read_run(run_dir, dropped)
    review = review_metrics(rows, summary, clip_norm=clip_norm, **thresholds)
    review.run_dir = str(run_dir)
    review.notes[:0] = dropped  # a torn last line left out: said first
    return review


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ReviewError(message)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m jaxamp.review RUN_DIR``: 0 healthy, 1 findings, 2 error."""
    parser = _Parser(prog="python -m jaxamp.review",
                     description="Review a mixed-precision run's metrics.jsonl/summary.json "
                                 "for mixed-precision problems.")
    parser.add_argument("run_dir", help="the run directory (holds metrics.jsonl)")
    parser.add_argument("--clip-norm", type=float, default=None,
                        help="the gradient clip threshold (default: from summary.json)")
    parser.add_argument("--json", action="store_true", help="print the review as JSON")
    try:
        args = parser.parse_args(argv)
        review = review_run(args.run_dir, clip_norm=args.clip_norm)
    except ReviewError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(review.to_json() if args.json else review.to_text())
    return 0 if review.ok else 1


if __name__ == "__main__":
    sys.exit(main())
