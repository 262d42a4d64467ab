"""What train_lm.py shows and records about a run: console lines, progress, summary, plots.

Nothing here changes the run: :func:`header` prints what is about to run, :class:`Progress` a
live bar on a terminal (a plain line every ~10% in a log file), :func:`summary` builds
``summary.json`` (the keys ``jaxamp.diagnostics.metrics`` documents, plus the run's
configuration), :func:`finish` reviews the metrics (``jaxamp.review``), draws ``curves.png`` and
prints the precision and summary tables.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax
import lm_model
import numpy as np
import rich.markup
from lm_cli import Setup
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

import jaxamp
import jaxamp.review
from jaxamp.diagnostics import metrics

__all__ = ["Console", "Progress", "compiled_memory", "esc", "finish", "fmt_bytes",
           "header", "plot_curves", "summary"]

#: ``summary.json``'s ``final_train_loss`` is the mean over this many last steps.
FINAL_LOSS_WINDOW = 10
esc = rich.markup.escape  # paths and sources are not rich markup


def header(console: Console, s: Setup, params, start_step: int, meta: dict | None) -> None:
    """What is about to run: versions and device, policy, model, data, schedule, resume."""
    args, config, policy = s.args, s.config, s.policy
    devices = jax.devices()
    console.print(f"[bold]jax[/bold] {jax.__version__}  backend: "
                  f"[bold]{jax.default_backend()}[/bold]  "
                  f"device: {devices[0].device_kind} (x{len(devices)})")
    console.print(f"[bold]policy[/bold] {s.policy_str}: params stored in "
                  f"{np.dtype(policy.param_dtype).name}, matmuls in "
                  f"{np.dtype(policy.compute_dtype).name}, softmax/LayerNorm/loss in float32, "
                  f"outputs in {np.dtype(policy.output_dtype).name}; loss scale: "
                  f"{s.loss_scale_kind}"
                  + (f" (initial {args.init_scale:g})" if s.loss_scale_kind != "none" else "")
                  + ("; AdamW's moments stored in bfloat16 (stochastic rounding)"
                     if s.opt_state == "bfloat16" else ""))
    console.print(f"[bold]model[/bold] {args.preset}: {config.n_layer} layers, d_model "
                  f"{config.d_model}, {config.n_head} heads ({config.attention} attention), "
                  f"context {config.block_size}, "
                  f"{lm_model.param_count(params) / 1e6:.2f}M params, "
                  f"{lm_model.flops_per_token(config) / 1e6:.1f} MFLOP/token (train)")
    corpus = s.corpus
    console.print(f"[bold]data[/bold] {esc(corpus.source)}: {corpus.num_tokens / 1e6:.2f}M bytes "
                  f"({corpus.train.size / 1e6:.2f}M train / {corpus.val.size / 1e6:.2f}M val)")
    console.print(f"[bold]run[/bold] {args.steps} steps x {args.batch_size} x "
                  f"{config.block_size} tokens, lr {args.lr:g} ({args.schedule}, warmup "
                  f"{args.warmup}), out: {esc(str(s.out))}")
    if args.resume:
        console.print(f"resuming from the checkpoint at step {start_step}")
        if args.schedule == "cosine" and meta.get("steps") != args.steps:
            console.print(f"note: the cosine schedule now decays to step {args.steps} (the "
                          f"checkpointed run used --steps {meta.get('steps')}), so the learning "
                          "rate differs from the original run's from here on")


def compiled_memory(compiled) -> dict:
    """``{"temp", "argument", "output", "alias", "total"}`` bytes of a compiled step ({} when
    the backend does not say); ``total`` is temp + argument + output."""
    ma = compiled.memory_analysis()
    if ma is None:
        return {}
    out = {k: int(getattr(ma, f"{k}_size_in_bytes", 0) or 0)
           for k in ("temp", "argument", "output", "alias")}
    out["total"] = out["temp"] + out["argument"] + out["output"]
    return out


class Progress:
    """The training progress: a live bar on a terminal; in a log file (not a terminal) a plain
    line every ~10% of the steps."""

    def __init__(self, console: Console, s: Setup, start_step: int):
        from rich.progress import Progress as Bar

        self.console, self.steps, self.start_step = console, s.args.steps, start_step
        self.live = console.is_terminal
        self.log_every = max(1, (self.steps - start_step) // 10)
        self.bar = Bar(TextColumn("[bold]train"), BarColumn(bar_width=30), MofNCompleteColumn(),
                       TimeElapsedColumn(), TimeRemainingColumn(),
                       TextColumn("{task.fields[stats]}"), console=console,
                       disable=not self.live)
        self.task = self.bar.add_task("train", total=self.steps, completed=start_step,
                                      stats="")
        self.val_step = start_step  # the step of the last validation loss shown

    def __enter__(self) -> Progress:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)

    def update(self, row: dict, tokens_per_s: float, last_val: float | None) -> None:
        """After the step ``row`` (a ``metrics.jsonl`` record)."""
        step = row["step"]
        evaluated = row.get("val_loss") is not None
        if self.live and evaluated:
            self.bar.console.print(f"step {step}: validation loss {last_val:.4f}")
        stats = (f"loss {_fmt(row['loss'])}  scale {row['loss_scale']:g}  "
                 f"skipped {row['skipped_steps']}  {tokens_per_s:,.0f} tok/s")
        # the validation loss only on the step that measured it (a value repeated on later
        # lines would read as a plateau); the bar says which step it is from
        val = f"  val {last_val:.3f}" if evaluated else ""
        if self.live and last_val is not None and not evaluated:
            val = f"  val {last_val:.3f} (step {self.val_step})"
        if evaluated:
            self.val_step = step
        self.bar.update(self.task, completed=step, stats=stats + val)
        if not self.live and ((step - self.start_step) % self.log_every == 0 or
                              step == self.steps or evaluated):
            self.console.print(f"step {step}/{self.steps}: {stats}{val}")


def summary(s: Setup, state, rows: list[dict], *, start_step: int, initial_val: float,
            final_val: float | None, tokens: int, train_s: float, compile_s: float,
            memory: dict, memory_f32: dict) -> dict:
    """``summary.json``: the run's configuration and results."""
    args, config, corpus = s.args, s.config, s.corpus
    fpt = lm_model.flops_per_token(config)
    tail = [r["loss"] for r in rows[-FINAL_LOSS_WINDOW:] if r.get("loss") is not None]
    return {
        "preset": args.preset, "model": dataclasses.asdict(config),
        "params": lm_model.param_count(state.params),
        "flops_per_token": fpt, "policy": s.policy_str, "fp8_small": s.fp8_small,
        "loss_scale_mode": s.loss_scale_kind,
        "steps": args.steps, "resumed_from": start_step if args.resume else None,
        "batch_size": args.batch_size, "micro_batches": args.micro_batches,
        "tokens_per_step": args.batch_size * config.block_size,
        "initial_val_loss": initial_val, "final_val_loss": final_val,
        "final_train_loss": float(np.mean(tail)) if tail else None,
        "final_train_loss_window": len(tail),
        "skipped_steps": int(state.skipped_steps),
        "final_loss_scale": float(state.loss_scale.loss_scale),
        "tokens_per_s": tokens / train_s if train_s else None,
        "model_tflops_per_s": (tokens / train_s * fpt / 1e12) if train_s else None,
        "train_seconds": train_s, "compile_seconds": compile_s,
        "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
        "jax_version": jax.__version__,
        "memory_bytes": memory, "memory_bytes_f32": memory_f32,
        "opt_state": s.opt_state,
        "opt_state_bytes": metrics.array_bytes(jax.tree.leaves(state.opt_state.inner_state)),
        # read by `python -m jaxamp.review` (clip threshold, scale floor)
        "clip_norm": args.clip_norm or None,
        "min_loss_scale": (float(state.loss_scale.min_loss_scale)
                           if isinstance(state.loss_scale, jaxamp.DynamicLossScale) else None),
        "data": {"source": corpus.source, "train_tokens": int(corpus.train.size),
                 "val_tokens": int(corpus.val.size), "fingerprint": corpus.fingerprint},
    }


def finish(console: Console, s: Setup, rows: list[dict], summary: dict,
           precision: list[dict]) -> None:
    """After the run: warns if the loss diverged (``jaxamp.review``), draws ``curves.png`` and
    prints the precision and summary tables."""
    out = s.out
    diverged = [f for f in jaxamp.review.review_metrics(rows, summary).findings
                if f.code == "loss_diverged"]
    if diverged:  # exit 0 (the run did what was asked), but never silently
        console.print(f"[bold red]warning[/bold red]: {esc(diverged[0].explanation)} "
                      f"(python -m jaxamp.review {esc(str(out))})")
    if rows:
        plot_curves(rows, out / "curves.png",
                    f"{s.args.preset} | {s.policy_str} | loss scale: {s.loss_scale_kind}",
                    summary["initial_val_loss"], clip_norm=summary.get("clip_norm"),
                    resumed_from=summary.get("resumed_from"))

    shown = [r for r in precision if r.get("op") not in ("cast", "elementwise")]
    t = Table(title="precision: the dtypes each op ran in, forward / backward (traced; casts "
                    f"and elementwise ops: {len(precision) - len(shown)} more rows in "
                    "precision.json)", title_justify="left")
    for col in ("module", "op", "forward", "backward"):
        t.add_column(col)
    for r in shown:
        t.add_row(str(r.get("module", "")), str(r.get("op", "")), str(r.get("forward", "")),
                  str(r.get("backward", "")))
    console.print(t)
    memory, ref_memory = summary["memory_bytes"], summary["memory_bytes_f32"]
    st = Table(title="summary", title_justify="left", show_header=False)
    st.add_column("")
    st.add_column("", justify="right")
    ratio = (memory.get("total") / ref_memory["total"]
             if memory.get("total") and ref_memory.get("total") else None)
    tail = summary["final_train_loss_window"]
    for k, v in (
            ("validation loss", f"{_fmt(summary['initial_val_loss'], 4)} -> "
                                f"{_fmt(summary['final_val_loss'], 4)}"),
            (f"train loss (last {tail} steps)",
             f"{summary['final_train_loss']:.4f}" if tail else "n/a"),
            ("skipped steps", f"{summary['skipped_steps']}"),
            ("final loss scale", f"{summary['final_loss_scale']:g}"),
            ("tokens/s", f"{summary['tokens_per_s']:,.0f}" if summary["tokens_per_s"] else
             "n/a"),
            ("step memory (temp+args+out)", fmt_bytes(memory.get("total"))),
            ("same step in float32", fmt_bytes(ref_memory.get("total"))
             + (f"  (AMP uses {ratio:.2f}x)" if ratio else "")),
            ("optimizer state", f"{fmt_bytes(summary['opt_state_bytes']['total'])} "
                                f"({summary['opt_state']})"),
            ("outputs", esc(f"{out}/ metrics.jsonl summary.json precision.json curves.png"))):
        st.add_row(k, v)
    console.print(st)


def plot_curves(rows: list[dict], path: Path, title: str, initial_val: float | None = None,
                *, clip_norm: float | None = None, resumed_from: int | None = None,
                ylabel: str = "loss (nats/byte)"):
    """Loss, loss scale (log y) and grad norm vs step; skipped steps as red lines/markers, the
    clip threshold as a dashed line on the grad norm (the review checklist: a norm that sits
    on it every step was clipped while scaled), and a dotted line where a run resumed.
    Returns the (closed) figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.array([r["step"] for r in rows])
    loss = np.array([np.nan if r["loss"] is None else r["loss"] for r in rows], dtype=float)
    scale = np.array([r["loss_scale"] for r in rows], dtype=float)
    gnorm = np.array([r["grad_norm"] if r["grad_norm"] is not None else np.nan for r in rows],
                     dtype=float)
    skipped = np.array([bool(r["skipped"]) for r in rows])
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    if initial_val is not None:
        val.insert(0, (0, initial_val))

    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    ax = axes[0]
    ax.plot(steps, loss, lw=1, label="train loss")
    if val:
        vs, vl = zip(*val, strict=True)
        ax.plot(vs, vl, "o-", ms=4, label="validation loss")
    ax.set_ylabel(ylabel)
    ax.legend(loc="upper right")
    ax.set_title(title, fontsize=9)
    ax = axes[1]
    ax.step(steps, scale, where="post", lw=1.2)
    ax.set_yscale("log", base=2)
    ax.set_ylabel("loss scale")
    ax = axes[2]
    finite = np.isfinite(gnorm)
    ax.plot(steps[finite], gnorm[finite], lw=1)
    if finite.any():
        ax.set_yscale("log")
    if clip_norm:
        ax.axhline(clip_norm, color="black", ls="--", lw=0.9, label=f"clip norm {clip_norm:g}")
        ax.legend(loc="upper right")
    ax.set_ylabel("grad norm (unscaled)")
    ax.set_xlabel("step")
    if resumed_from:
        for i, a in enumerate(axes):
            a.axvline(resumed_from, color="tab:green", ls=":", lw=1.2,
                      label=f"resumed at step {resumed_from}" if i == 0 else None)
        axes[0].legend(loc="upper right")
    if skipped.any():
        for a in axes:
            for s in steps[skipped]:
                a.axvline(s, color="red", lw=0.8, alpha=0.6)
        axes[1].plot(steps[skipped], scale[skipped], "rv", ms=6,
                     label=f"skipped step ({int(skipped.sum())})")
        axes[1].legend(loc="lower right")
    for a in axes:
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig


def _fmt(x, digits=3) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def fmt_bytes(n) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)
