"""Train a small GPT on bytes with automatic mixed precision (jaxamp), then report what it did.

Run it with no flags to train the ``tiny`` preset on the Python standard library's own sources
(nothing to download) in float16 with dynamic loss scaling, for about a minute on 2 CPU cores::

    python examples/train_lm.py
    python examples/train_lm.py --policy params=float32,compute=bfloat16,output=float32
    python examples/train_lm.py --steps 600 --resume          # continue the default run

The model (``lm_model.py``) has no dtype code at all: ``jaxamp.make_train_step`` runs it under
the ``--policy``. Everything lands in ``--out``: ``metrics.jsonl`` (one line per step),
``summary.json``, ``precision.json`` (which dtype every op ran in), ``curves.png`` and orbax
checkpoints in ``checkpoints/`` with a sha256 of every array (``lm_checkpoint.py``;
``--resume`` continues from the latest one, bit-identically; ``--resume latest-intact`` from
the newest one that passes its checksums). The script lists what it wrote in
``train_lm.manifest.json`` and never deletes or overwrites anything else (``lm_files.py``): a
new run in an ``--out`` holding a previous run needs ``--overwrite``; without ``--out`` it goes
to ``runs/<preset>-<dtype>``, or ``-2``, ``-3``, ... when that holds an earlier run.

Bad input (unknown preset, malformed policy, out-of-range numbers, unusable or special data
files, an --out that is unwritable, holds a previous run or files the script did not write, a
missing or corrupted checkpoint) prints one ``error: ...`` line to stderr and exits with status
2, before anything is compiled or any file is touched.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

# ``python examples/train_lm.py`` puts examples/ on sys.path; importing this file from
# elsewhere (e.g. ``importlib`` with only the repository root on the path) does not, so add it
# for the sibling modules lm_data and lm_model.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import lm_checkpoint  # noqa: E402
import lm_data  # noqa: E402
import lm_files  # noqa: E402
import lm_model  # noqa: E402
import lm_model_nnx  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxamp  # noqa: E402
import jaxamp.review  # noqa: E402

__all__ = ["build_parser", "main"]

EXIT_USAGE = 2
CHECKPOINT_DIR = lm_files.CHECKPOINT_DIR
#: Files this script writes in --out (``--overwrite`` removes them if its manifest lists them).
OUTPUT_FILES = lm_files.OUTPUT_FILES
#: Upper bounds of flags that end up in int32 device counters or in host memory.
MAX_INT32 = 2**31 - 1
MAX_SEED = 2**32 - 1
#: Tokens per step (batch size x context) and per evaluation: far beyond any single-device
#: run of these presets, low enough that a typo cannot allocate the host's memory for indices.
MAX_BATCH_TOKENS = 2**22
#: ``summary.json``'s ``final_train_loss`` is the mean over this many last steps.
FINAL_LOSS_WINDOW = 10
_SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


class UsageError(Exception):
    """Bad input; ``main`` prints ``error: <message>`` and returns 2."""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except empty ones (None/False say nothing the text does not)."""

    def _get_help_string(self, action):
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump, no traceback
        raise UsageError(message)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="train_lm.py",
        description="Train a byte-level GPT with jaxamp automatic mixed precision. With no "
                    "flags: the tiny preset, float16 compute with dynamic loss scaling, the "
                    "Python stdlib sources as data, output in runs/tiny-f16.",
        formatter_class=_HelpFormatter)
    m = p.add_argument_group("model and precision")
    m.add_argument("--api", default="linen", choices=("linen", "nnx"),
                   help="the model's Flax front end: lm_model.py (linen) or lm_model_nnx.py "
                        "(NNX); the same params, outputs and checkpoints")
    m.add_argument("--preset", default="tiny", metavar="NAME",
                   help=f"model size, one of: {', '.join(lm_model.PRESETS)}")
    m.add_argument("--policy", default="params=float32,compute=float16,output=float32",
                   help="jaxamp/jmp policy string: params/compute/output dtypes, e.g. "
                        "'params=float32,compute=bfloat16,output=float32', 'c=f16' or "
                        "'float32' (full precision)")
    m.add_argument("--dropout", type=float, default=0.0,
                   help="dropout rate (embeddings and residual branches), in [0, 1)")
    m.add_argument("--loss-scale", default="auto",
                   choices=("dynamic", "static", "none", "auto"),
                   help="loss scaling: dynamic (back off on overflow, grow after "
                        "--growth-interval clean steps), static (fixed at --init-scale), none; "
                        "auto = dynamic for float16 compute, none otherwise")
    m.add_argument("--init-scale", type=float, default=2.0**16,
                   help="initial (dynamic) or fixed (static) loss scale")
    m.add_argument("--growth-interval", type=int, default=100,
                   help="dynamic scaling: double the scale after this many finite steps "
                        "(jaxamp's/torch's default is 2000; shorter here so a short run shows "
                        "the scale moving both ways)")
    o = p.add_argument_group("optimisation")
    o.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    o.add_argument("--schedule", default="cosine", choices=("cosine", "constant"),
                   help="learning-rate schedule after the linear warmup (cosine decays to "
                        "lr/10 at --steps)")
    o.add_argument("--warmup", type=int, default=50, help="linear warmup steps")
    o.add_argument("--clip-norm", type=float, default=1.0,
                   help="clip the unscaled gradients to this global norm (0: no clipping)")
    o.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    o.add_argument("--micro-batches", type=int, default=1,
                   help="split each batch into this many micro-batches and accumulate "
                        "float32 gradients (the same update up to rounding, less activation "
                        "memory)")
    o.add_argument("--seed", type=int, default=0, help="initialisation and data-order seed")
    o.add_argument("--steps", type=int, default=300, help="total training steps")
    r = p.add_argument_group("evaluation, checkpoints and files")
    r.add_argument("--eval-interval", type=int, default=50,
                   help="validation loss every this many steps (0: only at the start and end)")
    r.add_argument("--eval-batches", type=int, default=8,
                   help="validation batches per evaluation (always the same batches)")
    r.add_argument("--checkpoint-interval", type=int, default=100,
                   help="save an orbax checkpoint every this many steps (0: only at the end)")
    r.add_argument("--resume", nargs="?", const="latest", default=None,
                   choices=("latest", "latest-intact"),
                   help="continue from the latest checkpoint in --out (same flags as the "
                        "original run; --steps may be larger); a corrupted latest checkpoint is "
                        "an error, unless '--resume latest-intact': then the newest checkpoint "
                        "that passes its checksums is used, and the script says which")
    r.add_argument("--overwrite", action="store_true",
                   help="start a new run in an --out that holds a previous one: removes only "
                        "the files this script wrote there (listed in its "
                        f"{lm_files.MANIFEST})")
    r.add_argument("--data", default=None, metavar="PATH",
                   help="a text file or a folder of text files (byte-level tokens); default: "
                        "the Python standard library's .py sources (first "
                        f"{lm_data.DEFAULT_MAX_BYTES // 2**20} MiB), no download needed")
    r.add_argument("--compare-f32", action=argparse.BooleanOptionalAction, default=True,
                   help="also compile the same step in float32 (not run it) to report how much "
                        "memory the policy saves; --no-compare-f32 skips that compile")
    r.add_argument("--out", default=None, metavar="DIR",
                   help="output folder (default: runs/<preset>-<compute dtype>, e.g. "
                        "runs/tiny-f16, or runs/tiny-f16-2, -3, ... when it holds an earlier "
                        "run; --resume continues the newest of them)")
    return p


@dataclasses.dataclass
class Setup:
    """Everything validated from the command line, before anything is built or compiled."""

    args: argparse.Namespace
    config: lm_model.GPTConfig
    policy: object  # jmp.Policy
    policy_str: str
    loss_scale_kind: str
    out: Path
    corpus: lm_data.Corpus
    folder: lm_files.RunFolder | None = None  # --out and the manifest of what was written
    out_note: str | None = None  # e.g. "runs/tiny-f16 holds an earlier run; ... -2"


def _check_number(name: str, value, *, minimum=None, positive=False, maximum=None,
                  float32=False, why=""):
    """``float32``: the value is stored as float32 (optax's learning rate, the clip norm), so
    it must stay finite there, and a positive one must stay a normal number (not 0 or
    subnormal)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise UsageError(f"{name} must be a finite number, got {value}")
    if positive and not value > 0:
        raise UsageError(f"{name} must be > 0, got {value}")
    if minimum is not None and value < minimum:
        raise UsageError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise UsageError(f"{name} must be <= {maximum}, got {value}{why}")
    if float32 and value != 0:
        fi = np.finfo(np.float32)
        if not float(fi.tiny) <= abs(value) <= float(fi.max):
            with np.errstate(over="ignore", under="ignore"):
                stored = float(np.float32(value))
            raise UsageError(f"{name} {value:g} is not representable in float32, the dtype it "
                             f"is stored in (it would be {stored!r}); use a value in "
                             f"[{float(fi.tiny):g}, {float(fi.max):g}]")


def validate(args: argparse.Namespace) -> Setup:
    """Checks every flag and the data/output paths; raises UsageError with a one-line message."""
    if args.preset not in lm_model.PRESETS:
        raise UsageError(f"--preset {args.preset!r} is unknown; choose one of: "
                         f"{', '.join(lm_model.PRESETS)}")
    if not (math.isfinite(args.dropout) and 0 <= args.dropout < 1):
        raise UsageError(f"--dropout must be in [0, 1), got {args.dropout}")
    config = dataclasses.replace(lm_model.PRESETS[args.preset], dropout=args.dropout)
    try:
        policy = jaxamp.get_policy(args.policy)
    except (ValueError, TypeError) as e:
        raise UsageError(f"--policy {args.policy!r}: {e}") from None
    policy_str = jaxamp.policy_to_str(policy)
    compute = np.dtype(policy.compute_dtype).name
    kind = args.loss_scale
    if kind == "auto":
        kind = "dynamic" if compute == "float16" else "none"
    _check_number("--init-scale", args.init_scale, positive=True)
    _check_number("--growth-interval", args.growth_interval, minimum=1, maximum=MAX_INT32)
    _check_loss_scale(kind, args)
    _check_number("--lr", args.lr, positive=True, float32=True)
    if args.schedule == "cosine":  # decays to lr/10, which must stay a float32 number too
        _check_number("--lr", args.lr / 10, float32=True)
    _check_number("--warmup", args.warmup, minimum=0, maximum=MAX_INT32)
    _check_number("--clip-norm", args.clip_norm, minimum=0, float32=True)
    _check_number("--batch-size", args.batch_size, minimum=1,
                  maximum=MAX_BATCH_TOKENS // config.block_size,
                  why=f" (at most {MAX_BATCH_TOKENS} tokens per step with the "
                      f"{args.preset} preset's context of {config.block_size})")
    _check_number("--micro-batches", args.micro_batches, minimum=1)
    _check_number("--seed", args.seed, minimum=0, maximum=MAX_SEED, why=" (a uint32)")
    _check_number("--steps", args.steps, minimum=1, maximum=MAX_INT32,
                  why=" (the step counter is an int32)")
    _check_number("--eval-interval", args.eval_interval, minimum=0)
    _check_number("--eval-batches", args.eval_batches, minimum=1,
                  maximum=max(1, MAX_BATCH_TOKENS // (config.block_size * args.batch_size)),
                  why=f" (at most {MAX_BATCH_TOKENS} validation tokens, held in memory)")
    _check_number("--checkpoint-interval", args.checkpoint_interval, minimum=0)
    if args.batch_size % args.micro_batches:
        raise UsageError(f"--batch-size {args.batch_size} is not divisible by --micro-batches "
                         f"{args.micro_batches}")
    try:
        corpus = lm_data.load_corpus(args.data, block_size=config.block_size)
    except lm_data.DataError as e:
        raise UsageError(str(e)) from None
    default = Path("runs", f"{args.preset}-{_SHORT.get(compute, compute)}")
    try:
        folder, note = lm_files.choose_out(args.out, default, resume=bool(args.resume),
                                           overwrite=args.overwrite)
    except lm_files.FolderError as e:
        raise UsageError(str(e)) from None
    # Every input is valid: only now is the disk touched (the folder created, if new).
    _check_writable(folder.path)
    return Setup(args, config, policy, policy_str, kind, folder.path, corpus, folder, note)


def _check_loss_scale(kind: str, args) -> None:
    """Builds the loss scale once here, so its own validation (in float32, its dtype) speaks
    before anything runs, as one line naming the flag."""
    try:
        make_loss_scale(kind, args)
    except (ValueError, TypeError) as e:
        flag = "--growth-interval" if "growth_interval" in str(e) else "--init-scale"
        value = args.growth_interval if flag == "--growth-interval" else args.init_scale
        hint = ""
        if kind == "dynamic" and flag == "--init-scale":
            d = jaxamp.DynamicLossScale()
            hint = (f"; dynamic scaling needs --init-scale in [{float(d.min_loss_scale):g}, "
                    f"{float(d.max_loss_scale):g}] (or use --loss-scale static)")
        raise UsageError(f"{flag} {value}: {e}{hint}") from None


def _check_writable(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: is a file, not a folder; choose a folder to write to")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise UsageError(f"--out {out}: cannot write there ({reason}); choose a writable "
                         "folder") from None


# ---------------------------------------------------------------------------------------------
# Model, optimiser, steps
# ---------------------------------------------------------------------------------------------


def loss_fn(apply_fn, params, batch, rng=None):
    """The user's loss: mean next-byte cross-entropy (jaxamp computes it in float32).

    ``rng`` is the train step's dropout key (the state's rng folded with the step); without
    one (evaluation) dropout is off."""
    logits = apply_fn({"params": params}, batch["inputs"], train=rng is not None,
                      rngs=None if rng is None else {"dropout": rng})
    return jaxamp.softmax_cross_entropy(logits, batch["targets"])


def make_schedule(args) -> optax.Schedule:
    warmup = args.warmup
    if args.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=args.lr, warmup_steps=warmup,
            decay_steps=max(args.steps, warmup + 1), end_value=args.lr / 10)
    if warmup == 0:
        return optax.constant_schedule(args.lr)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, args.lr, warmup), optax.constant_schedule(args.lr)],
        [warmup])


def _decay_mask(params):
    """Weight decay on matrices only (Dense kernels, embeddings), not on biases/LayerNorm."""
    def leaf(path, _):
        name = getattr(path[-1], "key", str(path[-1]))
        return name in ("kernel", "embedding")
    return jax.tree_util.tree_map_with_path(leaf, params)


def make_optimizer(args) -> optax.GradientTransformation:
    return optax.adamw(make_schedule(args), b1=0.9, b2=0.95, weight_decay=0.1,
                       mask=_decay_mask)


def make_loss_scale(kind: str, args):
    if kind == "dynamic":
        return jaxamp.DynamicLossScale(args.init_scale, growth_interval=args.growth_interval)
    if kind == "static":
        return jaxamp.StaticLossScale(args.init_scale)
    return jaxamp.NoOpLossScale()


def _strong(tree):
    """Drops weak types, so a fresh and a restored state have identical avals."""
    return jax.tree.map(lambda x: jnp.asarray(x, dtype=x.dtype), tree)


def dropout_rng(config, seed: int):
    """The state's base dropout key (None without dropout: the state then holds none)."""
    return jax.random.PRNGKey(seed) if config.dropout > 0 else None


def abstract_train_state(model, config, tx, loss_scale, policy, rng=None):
    """The train state's structure with ``ShapeDtypeStruct`` leaves: no memory, no compile."""
    return jax.eval_shape(
        lambda p: jaxamp.TrainState.create(model, p, tx, loss_scale=loss_scale, policy=policy,
                                           rng=rng),
        lm_model.abstract_params(config))


def _compiled_memory(compiled) -> dict:
    ma = compiled.memory_analysis()
    if ma is None:
        return {}
    out = {k: int(getattr(ma, f"{k}_size_in_bytes", 0) or 0)
           for k in ("temp", "argument", "output", "alias")}
    out["total"] = out["temp"] + out["argument"] + out["output"]
    return out


# ---------------------------------------------------------------------------------------------
# Checkpoints (orbax)
# ---------------------------------------------------------------------------------------------


def _run_config(s: Setup) -> dict:
    """The settings a resumed run must share with the checkpointed one (they shape the
    trajectory). --steps may differ (to extend a run); eval/checkpoint intervals may too."""
    a = s.args
    return {
        "preset": a.preset, "model": dataclasses.asdict(s.config), "policy": s.policy_str,
        "loss_scale": s.loss_scale_kind, "init_scale": a.init_scale,
        "growth_interval": a.growth_interval, "lr": a.lr, "schedule": a.schedule,
        "warmup": a.warmup, "clip_norm": a.clip_norm, "batch_size": a.batch_size,
        "micro_batches": a.micro_batches, "seed": a.seed, "eval_batches": a.eval_batches,
        "data_fingerprint": s.corpus.fingerprint,
    }


_FLAG_OF = {"preset": "--preset", "model": "--preset", "policy": "--policy",
            "loss_scale": "--loss-scale", "init_scale": "--init-scale",
            "growth_interval": "--growth-interval", "lr": "--lr", "schedule": "--schedule",
            "warmup": "--warmup", "clip_norm": "--clip-norm", "batch_size": "--batch-size",
            "micro_batches": "--micro-batches", "seed": "--seed",
            "eval_batches": "--eval-batches", "data_fingerprint": "--data"}


def _checkpoint_manager(out: Path, *, create=True):
    return lm_checkpoint.manager(out / CHECKPOINT_DIR, create=create)


def save_checkpoint(manager, state, meta: dict,
                    folder: lm_files.RunFolder | None = None) -> None:
    """Saves ``state`` and ``meta`` with their checksums (``lm_checkpoint.save``), recording
    the step in the manifest first."""
    if folder is not None:
        folder.record(step=int(meta["step"]))
    lm_checkpoint.save(manager, int(meta["step"]), state, lm_files.strict(meta))


def restore_checkpoint(s: Setup, abstract_state, skipped: list | None = None):
    """(state, meta) from the latest checkpoint in --out; UsageError if none or unusable.

    Orbax writes a checkpoint into a temporary folder and renames it when complete, so a run
    killed mid-save leaves only a ``<step>.orbax-checkpoint-tmp-*`` folder, which orbax does not
    list as a step: the latest *complete* checkpoint is the one restored. Every checkpoint
    carries a sha256 of each array and of its meta (``lm_checkpoint``): one that fails them is
    an error, or with ``--resume latest-intact`` is passed over for the next older one
    (appended to ``skipped`` as ``lm_checkpoint.CorruptCheckpoint``).
    """
    folder = s.out / CHECKPOINT_DIR
    no_checkpoint = UsageError(f"--resume: no checkpoints in {folder}; start a new run there "
                               "with --overwrite instead of --resume")
    if not folder.is_dir():
        raise no_checkpoint
    try:
        manager = _checkpoint_manager(s.out, create=False)
    except Exception as e:  # noqa: BLE001 - any orbax failure means an unusable folder
        raise UsageError(f"--resume: cannot read checkpoints in {folder} "
                         f"({type(e).__name__}: {_first_line(e)})") from None
    fallback = s.args.resume == "latest-intact"
    with manager:
        steps = sorted(manager.all_steps(), reverse=True)
        if not steps:
            raise no_checkpoint
        bad = []
        for step in steps:
            where = folder / str(step)
            try:
                meta, integrity = lm_checkpoint.restore_meta(manager, step, where)
                if "run_config" not in meta:
                    raise lm_checkpoint.CorruptCheckpoint(
                        step, where, "its meta item is not from train_lm.py")
                _check_same_settings(s, meta, folder)
                restored = lm_checkpoint.restore_state(manager, step, where, abstract_state,
                                                       integrity)
                if int(restored.step) != step or int(meta.get("step", -1)) != step:
                    raise lm_checkpoint.CorruptCheckpoint(
                        step, where, f"it holds step {int(restored.step)}, not {step}")
            except lm_checkpoint.CorruptCheckpoint as e:
                if not fallback:
                    older = (f"pass --resume latest-intact to resume from the newest intact "
                             f"earlier checkpoint (steps {', '.join(map(str, steps[1:]))})"
                             if len(steps) > 1 else "no earlier checkpoint exists")
                    raise UsageError(f"--resume: checkpoint {where} is corrupted ({e.reason}); "
                                     f"{older}, or start again with --overwrite") from None
                bad.append(e)
                continue
            break
        else:
            raise UsageError(f"--resume latest-intact: every checkpoint in {folder} is "
                             f"corrupted (steps {', '.join(map(str, steps))}; newest: "
                             f"{bad[0].reason}); start again with --overwrite") from None
    if skipped is not None:
        skipped.extend(bad)
    restored = _strong(jax.tree.map(jnp.asarray, restored))
    jax.block_until_ready(restored)
    return restored, meta


def _check_same_settings(s: Setup, meta: dict, folder: Path) -> None:
    now = _run_config(s)
    old = meta["run_config"]
    mismatch = [k for k, v in now.items() if old.get(k) != v]
    if mismatch:
        detail = "; ".join(f"{_FLAG_OF[k]}: checkpoint has {_show(old.get(k))}, now "
                           f"{_show(now[k])}" for k in mismatch)
        raise UsageError(f"--resume: the checkpoint in {folder} was made with other "
                         f"settings ({detail}); pass the original flags or choose another "
                         "--out")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    line = text[0].split(" See full TensorStore details")[0] if text else ""
    return line if len(line) <= 200 else line[:197] + "..."


def _show(v) -> str:
    return json.dumps(v) if not isinstance(v, str) else v


# ---------------------------------------------------------------------------------------------
# Files: metrics, plots, summary
# ---------------------------------------------------------------------------------------------


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut short by a kill: it and anything after it are dropped
    return rows


def write_metrics(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(lm_files.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)


def plot_curves(rows: list[dict], path: Path, title: str,
                initial_val: float | None = None) -> None:
    """Loss, loss scale (log y) and grad norm vs step; skipped steps as red lines/markers."""
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
    ax.set_ylabel("loss (nats/byte)")
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
    ax.set_ylabel("grad norm (unscaled)")
    ax.set_xlabel("step")
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


def _finite(x) -> float | None:
    """A metric as a JSON-safe float; None for inf/nan (strict JSON has no NaN)."""
    x = float(x)
    return x if math.isfinite(x) else None


def _fmt(x, digits=3) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def _fmt_bytes(n) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Runs the CLI; returns the exit status (0 ok, 2 bad input, 130 interrupted)."""
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as e:  # --help
            return int(e.code or 0)
        setup = validate(args)
        return train(setup)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE


def train(s: Setup) -> int:
    import rich.markup
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.table import Table

    args, config, policy, out, corpus = s.args, s.config, s.policy, s.out, s.corpus
    console = Console(highlight=False)
    esc = rich.markup.escape  # paths and sources are not rich markup
    metrics_path = out / "metrics.jsonl"

    # ---- abstract state (no compile): enough to restore a checkpoint and to validate it ----
    models = lm_model_nnx if args.api == "nnx" else lm_model
    model = models.GPT(config)
    tx = make_optimizer(args)
    loss_scale = make_loss_scale(s.loss_scale_kind, args)

    rng = dropout_rng(config, args.seed)

    def create_state(params):
        return jaxamp.TrainState.create(model, params, tx, loss_scale=loss_scale,
                                        policy=policy, rng=rng)

    abstract_state = abstract_train_state(model, config, tx, loss_scale, policy, rng)
    start_step, meta, corrupted = 0, None, []
    if args.resume:
        state, meta = restore_checkpoint(s, abstract_state, corrupted)
        start_step = int(meta["step"])
        if start_step > args.steps:
            raise UsageError(f"--steps {args.steps} is below the step of the latest checkpoint "
                             f"in {out / CHECKPOINT_DIR} ({start_step}); pass --steps "
                             f">= {start_step}")
    # ---- from here on, input is valid: build and run ----
    folder = s.folder or lm_files.RunFolder(out)
    if s.out_note:
        console.print(esc(s.out_note))
    if corrupted:
        # Orbax skips saving a step at or below its latest one: the corrupted newer ones go
        # (this script wrote them: validate() refused an --out holding steps it did not list).
        removed = folder.remove_steps({e.step for e in corrupted})
        console.print(esc(f"note: --resume latest-intact: checkpoint(s) "
                          f"{', '.join(str(e.step) for e in corrupted)} corrupted "
                          f"({corrupted[0].reason}); removed {len(removed)} of them, resuming "
                          f"from the newest intact checkpoint, step {start_step}"))
    if args.overwrite and folder.holds_run():
        removed = folder.remove_recorded()
        console.print(f"note: --overwrite: removed the previous run's {len(removed)} files and "
                      f"checkpoints in {esc(str(out))} (only what train_lm.py wrote there)")
    folder.record(*OUTPUT_FILES[:1])  # metrics.jsonl, before it is (re)written

    backend = jax.default_backend()
    devices = jax.devices()
    n_params = lm_model.param_count(abstract_state.params)
    fpt = lm_model.flops_per_token(config)
    tokens_per_step = args.batch_size * config.block_size
    console.print(f"[bold]jax[/bold] {jax.__version__}  backend: [bold]{backend}[/bold]  "
                  f"device: {devices[0].device_kind} (x{len(devices)})")
    console.print(f"[bold]policy[/bold] {s.policy_str}: params stored in "
                  f"{np.dtype(policy.param_dtype).name}, matmuls in "
                  f"{np.dtype(policy.compute_dtype).name}, softmax/LayerNorm/loss in float32, "
                  f"outputs in {np.dtype(policy.output_dtype).name}; loss scale: "
                  f"{s.loss_scale_kind}"
                  + (f" (initial {args.init_scale:g})" if s.loss_scale_kind != "none" else ""))
    console.print(f"[bold]model[/bold] {args.preset}: {config.n_layer} layers, d_model "
                  f"{config.d_model}, {config.n_head} heads, context {config.block_size}, "
                  f"{n_params / 1e6:.2f}M params, {fpt / 1e6:.1f} MFLOP/token (train)")
    console.print(f"[bold]data[/bold] {esc(corpus.source)}: {corpus.num_tokens / 1e6:.2f}M bytes "
                  f"({corpus.train.size / 1e6:.2f}M train / {corpus.val.size / 1e6:.2f}M val)")
    console.print(f"[bold]run[/bold] {args.steps} steps x {args.batch_size} x "
                  f"{config.block_size} tokens, lr {args.lr:g} ({args.schedule}, warmup "
                  f"{args.warmup}), out: {esc(str(out))}")

    if args.resume:
        console.print(f"resuming from the checkpoint at step {start_step}")
        if args.schedule == "cosine" and meta.get("steps") != args.steps:
            console.print(f"note: the cosine schedule now decays to step {args.steps} (the "
                          f"checkpointed run used --steps {meta.get('steps')}), so the learning "
                          "rate differs from the original run's from here on")
    else:
        _, params = models.init_params(config, seed=args.seed)
        state = _strong(create_state(params))

    step_fn = jaxamp.make_train_step(model, loss_fn, tx, policy=policy,
                                     clip_norm=args.clip_norm or None,
                                     micro_batches=args.micro_batches)
    eval_fn = jaxamp.make_eval_step(model, loss_fn, policy=policy)
    batch0 = lm_data.get_batch(corpus.train, seed=args.seed, step=0,
                               batch_size=args.batch_size, block_size=config.block_size)
    val_batches = lm_data.eval_batches(corpus.val, seed=args.seed, num_batches=args.eval_batches,
                                       batch_size=args.batch_size,
                                       block_size=config.block_size)

    def evaluate(params) -> float:
        return float(np.mean([float(eval_fn(params, b)) for b in val_batches]))

    t0 = time.perf_counter()
    with console.status("compiling the train step..."):
        compiled = step_fn.lower(state, batch0).compile()
    compile_s = time.perf_counter() - t0
    memory = _compiled_memory(compiled)
    console.print(f"compiled the train step in {compile_s:.1f}s; memory: "
                  f"{_fmt_bytes(memory.get('total'))} (temp {_fmt_bytes(memory.get('temp'))})")

    if args.resume:
        rows = [r for r in read_metrics(metrics_path) if r.get("step", 0) <= start_step]
        if len(rows) != start_step:
            console.print(f"note: metrics.jsonl holds {len(rows)} of the {start_step} steps "
                          "before the checkpoint")
        write_metrics(metrics_path, rows)  # drop lines logged after the checkpoint
        initial_val = meta["initial_val_loss"]
    else:
        rows = []
        write_metrics(metrics_path, rows)
        initial_val = evaluate(state.params)
        console.print(f"step 0: validation loss {initial_val:.4f} "
                      f"(uniform over 256 bytes: {math.log(256):.4f})")

    manager = _checkpoint_manager(out)
    run_config = _run_config(s)

    def checkpoint(state, step):
        save_checkpoint(manager, state, folder=folder, meta={
            "step": step, "run_config": run_config, "initial_val_loss": initial_val,
            "data": {"next_step": step, "seed": args.seed,
                     "sampler": "np.random.default_rng([seed, 0, step])",
                     "fingerprint": corpus.fingerprint, "source": corpus.source},
            "rng": {"seed": args.seed, "init": "jax.random.key(seed)",
                    "dropout": "fold_in(state.rng = PRNGKey(seed), step), in the checkpoint",
                    "note": "batches depend only on (seed, step)"},
            "steps": args.steps,
        })

    metrics_file = open(metrics_path, "a")  # noqa: SIM115 - closed in finally
    columns = (TextColumn("[bold]train"), BarColumn(bar_width=30), MofNCompleteColumn(),
               TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[stats]}"))
    # A live bar on a terminal; in a log file (not a terminal) a plain line every ~10%.
    live = console.is_terminal
    log_every = max(1, (args.steps - start_step) // 10)
    train_time, tokens_seen, last_val = 0.0, 0, None
    step = start_step
    interrupted = False
    try:
        with Progress(*columns, console=console, disable=not live) as progress:
            task = progress.add_task("train", total=args.steps, completed=start_step, stats="")
            for step in range(start_step + 1, args.steps + 1):
                t = time.perf_counter()
                batch = lm_data.get_batch(corpus.train, seed=args.seed, step=step - 1,
                                          batch_size=args.batch_size,
                                          block_size=config.block_size)
                state, m = compiled(state, batch)
                m = jax.device_get(m)
                dt = time.perf_counter() - t
                train_time += dt
                tokens_seen += tokens_per_step
                row = {
                    "step": step, "loss": _finite(m["loss"]),
                    "loss_scale": float(m["loss_scale"]),
                    "grad_norm": _finite(m["grad_norm"]),  # None: inf/nan (a skipped step)
                    "grads_finite": bool(m["grads_finite"]), "skipped": bool(m["skipped"]),
                    "skipped_steps": int(m["skipped_steps"]),
                    "tokens_per_s": tokens_per_step / dt if dt > 0 else None,
                }
                if (args.eval_interval and step % args.eval_interval == 0) or \
                        step == args.steps:
                    last_val = evaluate(state.params)
                    row["val_loss"] = last_val
                    if live:
                        progress.console.print(f"step {step}: validation loss {last_val:.4f}")
                rows.append(row)
                metrics_file.write(lm_files.dumps(row) + "\n")
                metrics_file.flush()
                if (args.checkpoint_interval and step % args.checkpoint_interval == 0) or \
                        step == args.steps:
                    checkpoint(state, step)
                stats = (f"loss {_fmt(row['loss'])}  scale {row['loss_scale']:g}  "
                         f"skipped {row['skipped_steps']}  {tokens_seen / train_time:,.0f} tok/s"
                         + (f"  val {last_val:.3f}" if last_val is not None else ""))
                progress.update(task, completed=step, stats=stats)
                if not live and ((step - start_step) % log_every == 0 or step == args.steps):
                    console.print(f"step {step}/{args.steps}: {stats}")
    except KeyboardInterrupt:
        interrupted = True
    finally:
        metrics_file.close()
        manager.close()
    if interrupted:
        last = manager_latest(out)
        print(f"interrupted at step {step}; the last checkpoint is at step {last}. Continue "
              f"with the same flags plus --resume.", file=sys.stderr)
        return 130

    # ---- summary ----
    if start_step >= args.steps:
        console.print(f"nothing to train: the checkpoint is already at step {args.steps}")
    final_val = last_val
    if final_val is None:
        vals = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
        final_val = vals[-1] if vals else evaluate(state.params)
    tail = [r["loss"] for r in rows[-FINAL_LOSS_WINDOW:] if r.get("loss") is not None]
    ref_memory = (_f32_reference_memory(s, model, tx, batch0, memory) if args.compare_f32
                  else {})
    rows_table = _precision_rows(model, state.params, batch0, policy)
    summary = {
        "preset": args.preset, "model": dataclasses.asdict(config), "params": n_params,
        "flops_per_token": fpt, "policy": s.policy_str, "loss_scale_mode": s.loss_scale_kind,
        "steps": args.steps, "resumed_from": start_step if args.resume else None,
        "batch_size": args.batch_size, "micro_batches": args.micro_batches,
        "tokens_per_step": tokens_per_step,
        "initial_val_loss": initial_val, "final_val_loss": final_val,
        "final_train_loss": float(np.mean(tail)) if tail else None,
        "final_train_loss_window": len(tail),
        "skipped_steps": int(state.skipped_steps),
        "final_loss_scale": float(state.loss_scale.loss_scale),
        "tokens_per_s": tokens_seen / train_time if train_time else None,
        "model_tflops_per_s": (tokens_seen / train_time * fpt / 1e12) if train_time else None,
        "train_seconds": train_time, "compile_seconds": compile_s,
        "backend": backend, "device": devices[0].device_kind, "jax_version": jax.__version__,
        "memory_bytes": memory, "memory_bytes_f32": ref_memory,
        # read by `python -m jaxamp.review` (clip threshold, scale floor)
        "clip_norm": args.clip_norm or None,
        "min_loss_scale": (float(state.loss_scale.min_loss_scale)
                           if isinstance(state.loss_scale, jaxamp.DynamicLossScale) else None),
        "data": {"source": corpus.source, "train_tokens": int(corpus.train.size),
                 "val_tokens": int(corpus.val.size), "fingerprint": corpus.fingerprint},
    }
    folder.record(*OUTPUT_FILES)
    (out / "summary.json").write_text(lm_files.dumps(summary, indent=2) + "\n")
    (out / "precision.json").write_text(lm_files.dumps(rows_table, indent=2) + "\n")
    all_rows = read_metrics(metrics_path)
    diverged = [f for f in jaxamp.review.review_metrics(all_rows, summary).findings
                if f.code == "loss_diverged"]
    if diverged:  # exit 0 (the run did what was asked), but never silently
        console.print(f"[bold red]warning[/bold red]: {esc(diverged[0].explanation)} "
                      f"(python -m jaxamp.review {esc(str(out))})")
    if all_rows:
        plot_curves(all_rows, out / "curves.png",
                    f"{args.preset} | {s.policy_str} | loss scale: {s.loss_scale_kind}",
                    initial_val)

    shown = [r for r in rows_table if r.get("op") not in ("cast", "elementwise")]
    t = Table(title="precision: the dtypes each op ran in, forward / backward (traced; casts "
                    f"and elementwise ops: {len(rows_table) - len(shown)} more rows in "
                    "precision.json)", title_justify="left")
    for col in ("module", "op", "forward", "backward"):
        t.add_column(col)
    for r in shown:
        t.add_row(str(r.get("module", "")), str(r.get("op", "")), str(r.get("forward", "")),
                  str(r.get("backward", "")))
    console.print(t)
    st = Table(title="summary", title_justify="left", show_header=False)
    st.add_column("")
    st.add_column("", justify="right")
    ratio = (memory.get("total") / ref_memory["total"]
             if memory.get("total") and ref_memory.get("total") else None)
    for k, v in (
            ("validation loss", f"{_fmt(initial_val, 4)} -> {_fmt(final_val, 4)}"),
            (f"train loss (last {len(tail)} steps)",
             f"{summary['final_train_loss']:.4f}" if tail else "n/a"),
            ("skipped steps", f"{summary['skipped_steps']}"),
            ("final loss scale", f"{summary['final_loss_scale']:g}"),
            ("tokens/s", f"{summary['tokens_per_s']:,.0f}" if summary["tokens_per_s"] else
             "n/a"),
            ("step memory (temp+args+out)", _fmt_bytes(memory.get("total"))),
            ("same step in float32", _fmt_bytes(ref_memory.get("total"))
             + (f"  (AMP uses {ratio:.2f}x)" if ratio else "")),
            ("outputs", esc(f"{out}/ metrics.jsonl summary.json precision.json curves.png"))):
        st.add_row(k, v)
    console.print(st)
    return 0


def _precision_rows(model, params, batch, policy) -> list[dict]:
    """Which dtype each (module, op class) ran in, forward and backward, read from the traced
    step (``jaxamp.precision_table``); tracing only, nothing is compiled or run."""
    return jaxamp.precision_table(lambda p, b: loss_fn(model.apply, p, b), params, batch,
                                  policy=policy)


def manager_latest(out: Path):
    try:
        m = _checkpoint_manager(out, create=False)
        try:
            return m.latest_step()
        finally:
            m.close()
    except Exception:  # noqa: BLE001
        return None


def _f32_reference_memory(s: Setup, model, tx, batch, memory: dict) -> dict:
    """Compiled memory of the same step with policy float32 and no loss scaling."""
    if np.dtype(s.policy.compute_dtype) == np.float32 and \
            np.dtype(s.policy.param_dtype) == np.float32:
        return dict(memory)
    f32 = jaxamp.get_policy("float32")
    ref_step = jaxamp.make_train_step(model, loss_fn, tx, policy=f32,
                                      clip_norm=s.args.clip_norm or None,
                                      micro_batches=s.args.micro_batches)
    ref_state = abstract_train_state(model, s.config, tx, jaxamp.NoOpLossScale(), f32,
                                     dropout_rng(s.config, s.args.seed))
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    return _compiled_memory(ref_step.lower(ref_state, batch).compile())


def closed_event_loop_filter(default):
    """An ``unraisablehook`` that keeps orbax's clean-up noise off stderr after a failed restore.

    When reading a corrupted checkpoint fails, tensorstore still completes the other pending
    reads from its own threads and tries to hand them to orbax's asyncio event loop, which is
    already closed: Python then prints "RuntimeError: Event loop is closed" tracebacks through
    ``sys.unraisablehook``. They carry no information (the failure itself is reported as one
    ``error:`` line), so exactly those are dropped; anything else goes to ``default``.
    """
    def hook(unraisable):
        exc = unraisable.exc_value
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return
        default(unraisable)

    return hook


if __name__ == "__main__":
    sys.unraisablehook = closed_event_loop_filter(sys.unraisablehook)
    sys.exit(main())
