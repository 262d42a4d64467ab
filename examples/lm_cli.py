"""The command line of train_lm.py: its flags, and every check on them before anything runs.

:func:`build_parser` defines the flags (one ``add_argument`` each); :func:`validate` checks them
all, and the data and output paths, and returns a :class:`Setup`. Any bad input raises
:class:`UsageError` with a one-line message naming the flag, the value and the fix (train_lm.py
prints it as ``error: ...`` and exits with status :data:`EXIT_USAGE`), before anything is
compiled or any file is touched.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
from pathlib import Path

import jax
import lm_data
import lm_files
import lm_mesh
import lm_model
import numpy as np

import jaxamp
import jaxamp.policy_spec

__all__ = ["EXIT_USAGE", "FP8_SMALL", "Parser", "Setup", "UsageError", "build_parser",
           "check_number", "check_writable", "make_loss_scale", "validate"]

EXIT_USAGE = 2
#: Upper bounds of flags that end up in int32 device counters or in host memory.
MAX_INT32 = 2**31 - 1
MAX_SEED = 2**32 - 1
#: Tokens per step (batch size x context) and per evaluation: far beyond any single-device
#: run of these presets, low enough that a typo cannot allocate the host's memory for indices.
MAX_BATCH_TOKENS = 2**22
_SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
#: A command-line value argparse would take for an option: '-' and a digit ('-1,0', '-3').
_NEGATIVE = re.compile(r"-\d")
#: --fp8-small when not given: FP8Matmuls' default (torchao's K,N threshold and min_size 2048).
FP8_SMALL = "1024,4096,2048"


class UsageError(Exception):
    """Bad input; ``main`` prints ``error: <message>`` and returns 2."""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except empty ones (None/False say nothing the text does not)."""

    def _get_help_string(self, action):
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are a :class:`UsageError` (one line, exit status 2)."""

    def error(self, message):  # one line, no usage dump, no traceback
        raise UsageError(message)

    def parse_known_args(self, args=None, namespace=None):
        """A value that starts with '-' and a digit (``--fp8-small -1,0``) is the value of the
        ``--flag`` before it, as ``--flag=-1,0`` is: argparse took ``-1,0`` for an option and
        said "expected one argument" instead of what is wrong with the value."""
        args = list(sys.argv[1:] if args is None else args)
        out: list[str] = []
        for arg in args:
            if out and _NEGATIVE.match(arg) and out[-1].startswith("--") and "=" not in out[-1]:
                out[-1] = f"{out[-1]}={arg}"
            else:
                out.append(arg)
        return super().parse_known_args(out, namespace)


def build_parser() -> argparse.ArgumentParser:
    """Every flag of train_lm.py, one ``add_argument`` each (range checks go in validate)."""
    p = Parser(
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
    m.add_argument("--attention", default="fused", choices=tuple(lm_model.ATTENTION),
                   help="causal self-attention: fused = jax.nn.dot_product_attention (cuDNN's "
                        "fused flash attention in the compute dtype on a GPU, XLA's "
                        "implementation elsewhere), manual = the softmax attention written "
                        "out; the same params either way")
    m.add_argument("--policy", default=jaxamp.DEFAULT_POLICY,
                   help="jaxamp/jmp policy string: params/compute/output dtypes, e.g. "
                        "'params=float32,compute=bfloat16,output=float32', 'c=f16' or "
                        "'float32' (full precision); add ',matmul=float8' for FP8 matmuls")
    m.add_argument("--opt-state", default="float32", choices=("float32", "bfloat16"),
                   help="the dtype AdamW's moments are stored in (the policy's opt_state=): "
                        "bfloat16 halves them; the update still runs in float32 and the new "
                        "moments are written back with stochastic rounding, whose key is "
                        "checkpointed with them")
    m.add_argument("--fp8-small", default=None, metavar="K,N[,MIN]",
                   help="with matmul=float8 only: a matmul with contracting size <= K and "
                        "output features <= N, or either below MIN (0 when not given), stays "
                        f"in the compute dtype (default: {FP8_SMALL}, jaxamp.FP8Matmuls'; '0,0' "
                        "runs every aligned matmul in FP8)")
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
    o.add_argument("--mesh", default=None, metavar="data=D,model=M",
                   help="train on a mesh of D x M devices: data parallel over data, tensor "
                        "parallel over model (lm_mesh.py); default: one device")
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
    policy: object  # jmp.Policy (with --opt-state bfloat16: its opt_state=)
    policy_str: str
    loss_scale_kind: str
    out: Path
    corpus: lm_data.Corpus
    folder: lm_files.RunFolder | None = None  # --out and the manifest of what was written
    out_note: str | None = None  # e.g. "runs/tiny-f16 holds an earlier run; ... -2"
    loss_scale: object = None  # jaxamp.DynamicLossScale / StaticLossScale / NoOpLossScale
    lock: lm_files.FolderLock | None = None  # --out's lock, held for the run (first host)
    op_rules: object = jaxamp.DEFAULT_OP_RULES  # --fp8-small (jaxamp.FP8Matmuls)
    fp8_small: str | None = None  # 'K,N' of a matmul=float8 run (run config, summary); else None

    def release(self) -> None:
        """Drops --out's lock (at the end of the run)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    @property
    def is_float32(self) -> bool:
        """Params and compute in float32: the run is its own float32 reference."""
        return (np.dtype(self.policy.compute_dtype) == np.float32 and
                np.dtype(self.policy.param_dtype) == np.float32)

    def in_float32(self) -> Setup:
        """The same run with policy float32 and no loss scaling (the memory reference)."""
        f32 = jaxamp.get_policy("float32")
        return dataclasses.replace(self, policy=f32, policy_str=jaxamp.policy_to_str(f32),
                                   loss_scale_kind="none", loss_scale=jaxamp.NoOpLossScale())

    @property
    def opt_state(self) -> str:
        """--opt-state: the dtype the optimizer state is stored in (the policy's opt_state=)."""
        return jaxamp.policy_spec.parse(self.policy_str).get("opt_state", "float32")


def check_number(name: str, value, *, minimum=None, positive=False, maximum=None,
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
    config = dataclasses.replace(lm_model.PRESETS[args.preset], dropout=args.dropout,
                                 attention=args.attention)
    try:
        if "opt_state" in jaxamp.policy_spec.parse(args.policy):
            raise ValueError("set the optimizer state's dtype with --opt-state, not in the "
                             "policy (e.g. --opt-state bfloat16)")
        names = jaxamp.policy_spec.parse(args.policy)
        if args.opt_state != "float32" or names["params"] != "float32":  # else: AdamW's own
            names["opt_state"] = args.opt_state
        policy = jaxamp.get_policy(jaxamp.policy_spec.to_str(names))
    except (ValueError, TypeError) as e:
        raise UsageError(f"--policy {args.policy!r}: {e}") from None
    policy_str = jaxamp.policy_to_str(policy)
    fp8_small, op_rules = _fp8_rules(args.fp8_small, policy, policy_str)
    compute = np.dtype(policy.compute_dtype).name
    kind = args.loss_scale
    if kind == "auto":
        kind = jaxamp.policy_spec.loss_scaling(compute)
    check_number("--init-scale", args.init_scale, positive=True)
    check_number("--growth-interval", args.growth_interval, minimum=1, maximum=MAX_INT32)
    loss_scale = _check_loss_scale(kind, args)
    check_number("--lr", args.lr, positive=True, float32=True)
    if args.schedule == "cosine":  # decays to lr/10, which must stay a float32 number too
        check_number("--lr", args.lr / 10, float32=True)
    check_number("--warmup", args.warmup, minimum=0, maximum=MAX_INT32)
    check_number("--clip-norm", args.clip_norm, minimum=0, float32=True)
    check_number("--batch-size", args.batch_size, minimum=1,
                  maximum=MAX_BATCH_TOKENS // config.block_size,
                  why=f" (at most {MAX_BATCH_TOKENS} tokens per step with the "
                      f"{args.preset} preset's context of {config.block_size})")
    check_number("--micro-batches", args.micro_batches, minimum=1)
    check_number("--seed", args.seed, minimum=0, maximum=MAX_SEED, why=" (a uint32)")
    check_number("--steps", args.steps, minimum=1, maximum=MAX_INT32,
                  why=" (the step counter is an int32)")
    check_number("--eval-interval", args.eval_interval, minimum=0)
    check_number("--eval-batches", args.eval_batches, minimum=1,
                  maximum=max(1, MAX_BATCH_TOKENS // (config.block_size * args.batch_size)),
                  why=f" (at most {MAX_BATCH_TOKENS} validation tokens, held in memory)")
    check_number("--checkpoint-interval", args.checkpoint_interval, minimum=0)
    if args.batch_size % args.micro_batches:
        raise UsageError(f"--batch-size {args.batch_size} is not divisible by --micro-batches "
                         f"{args.micro_batches}")
    try:
        lm_mesh.check_mesh(args.mesh, args.batch_size, args.micro_batches, config.n_head,
                           config.d_model, config.vocab_size)
    except ValueError as e:
        raise UsageError(str(e)) from None
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
    folder.writer = jax.process_index() == 0  # several hosts: the first writes --out
    # Every input is valid: only now is the disk touched (the folder created, if new).
    check_writable(folder.path)
    held = None
    if folder.writer:
        try:
            held = lm_files.lock(folder, resume=bool(args.resume), overwrite=args.overwrite)
        except lm_files.FolderError as e:
            raise UsageError(str(e)) from None
        except OSError as e:
            raise UsageError(f"--out {folder.path}: cannot lock it ({e.strerror or e}); choose "
                             "a folder on a filesystem that supports flock") from None
    return Setup(args, config, policy, policy_str, kind, folder.path, corpus, folder, note,
                 loss_scale, held, op_rules, fp8_small)


def _fp8_rules(text: str | None, policy, policy_str: str):
    """``--fp8-small K,N[,MIN]`` -> ``('K,N,MIN', op rules whose FP8 rule has that size
    threshold)``; ``(None, the default rules)`` for a policy without matmul=float8, which
    refuses the flag."""
    small = FP8_SMALL if text is None else text
    try:
        sizes = tuple(int(v) for v in small.split(","))
        if len(sizes) not in (2, 3):
            raise ValueError(sizes)
        rule = jaxamp.FP8Matmuls(small=sizes[:2], min_size=(*sizes, 0)[2])
    except ValueError:
        raise UsageError(f"--fp8-small must be two or three integers >= 0 as K,N[,MIN] (e.g. "
                         f"{FP8_SMALL} or 0,0), got {text!r}") from None
    fp8 = np.dtype(getattr(policy, "matmul_dtype", None) or np.float32).itemsize == 1
    if not fp8:
        if text is not None:
            raise UsageError(f"--fp8-small {text} sets which matmuls of a matmul=float8 policy "
                             f"stay in the compute dtype, and --policy {policy_str!r} has no "
                             "matmul=float8; add ',matmul=float8' to a compute=bfloat16 "
                             "--policy, or drop --fp8-small")
        return None, jaxamp.DEFAULT_OP_RULES
    return ",".join(map(str, (*rule.small, rule.min_size))), jaxamp.DEFAULT_OP_RULES.extend(
        handlers={"dot_general": rule})


def _check_loss_scale(kind: str, args):
    """Builds the loss scale here, so its own validation (in float32, its dtype) speaks
    before anything runs, as one line naming the flag."""
    try:
        return make_loss_scale(kind, args)
    except (ValueError, TypeError) as e:
        flag = "--growth-interval" if "growth_interval" in str(e) else "--init-scale"
        value = args.growth_interval if flag == "--growth-interval" else args.init_scale
        hint = ""
        if kind == "dynamic" and flag == "--init-scale":
            d = jaxamp.DynamicLossScale()
            hint = (f"; dynamic scaling needs --init-scale in [{float(d.min_loss_scale):g}, "
                    f"{float(d.max_loss_scale):g}] (or use --loss-scale static)")
        raise UsageError(f"{flag} {value}: {e}{hint}") from None


def check_writable(out: Path) -> None:
    """--out and the subfolder the run writes (checkpoints/, if there) take a new file, and
    the path is UTF-8 (orbax and tensorstore take paths as UTF-8 text); creates --out. Both
    examples call it once every other input is valid."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: is a file, not a folder; choose a folder to write to")
    try:
        str(out.resolve()).encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsencode(out).decode("utf-8", "backslashreplace")
        raise UsageError(f"--out {shown}: the name is not valid UTF-8, which the checkpoint "
                         "library needs; choose a folder name in UTF-8") from None
    ckpt = out / lm_files.CHECKPOINT_DIR
    if ckpt.exists() and not ckpt.is_dir():
        raise UsageError(f"--out {out}: {ckpt} is a file, not a folder, and checkpoints go "
                         "there; move it away or choose another --out")
    for folder in (out, ckpt):
        if folder is ckpt and not ckpt.exists():
            continue
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe = folder / f".write-test-{os.getpid()}-{jax.process_index()}"
            probe.write_text("ok")
            probe.unlink()
        except OSError as e:
            reason = e.strerror or type(e).__name__
            raise UsageError(f"--out {out}: cannot write in {folder} ({reason}); choose a "
                             "writable folder") from None


def make_loss_scale(kind: str, args):
    """The loss scale ``--loss-scale`` (``kind``, with ``auto`` resolved) asks for."""
    if kind == "dynamic":
        return jaxamp.DynamicLossScale(args.init_scale, growth_interval=args.growth_interval)
    if kind == "static":
        return jaxamp.StaticLossScale(args.init_scale)
    return jaxamp.NoOpLossScale()
