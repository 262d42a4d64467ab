"""Train a small ResNet on generated images with automatic mixed precision (jaxamp).

The second template beside ``train_lm.py``: a convolutional network with BatchNorm and dropout
(``train=``), float16 compute with dynamic loss scaling by default, nothing to download::

    python examples/train_vision.py
    python examples/train_vision.py --policy params=float32,compute=bfloat16,output=float32
    python -m jaxamp.review runs/vision-f16

The data are generated: each image is one of four oriented sinusoidal gratings (horizontal,
vertical, two diagonals) with a random phase, frequency, colour and Gaussian noise, so a
classifier must learn orientation, not a pixel. A batch is a pure function of ``(seed, step)``.

The model has no dtype code: jaxamp runs it under ``--policy`` (convolutions and the Dense in
the compute dtype, BatchNorm statistics and the loss in float32). What keeps the run safe and
reports on it is the LM example's, shared: ``lm_cli.py`` (flag checks, one ``error:`` line and
exit status 2 before anything runs), ``lm_files.py`` (which ``--out``; nothing it did not write
is ever replaced; ``--out`` checked writable), ``lm_stop.py`` (Ctrl-C, SIGTERM or a disk
error: one line and an exit status), ``lm_checkpoint.py`` (a checksummed orbax checkpoint of
the final state), ``lm_report.py`` (compiled memory, ``curves.png``) and jaxamp's run-log
format (``metrics.jsonl``, ``summary.json``) that ``python -m jaxamp.review`` reads.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import lm_checkpoint  # noqa: E402
import lm_files  # noqa: E402
import lm_report  # noqa: E402
import lm_stop  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from lm_cli import Parser, UsageError, check_number, check_writable  # noqa: E402

import jaxamp  # noqa: E402
import jaxamp.policy_spec  # noqa: E402
from jaxamp.diagnostics import metrics  # noqa: E402

CLASSES = ("horizontal", "vertical", "diagonal", "anti-diagonal")
_SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


# ---- data: oriented gratings, a pure function of (seed, step) --------------------------------

def make_batch(seed: int, step: int, batch_size: int, size: int = 16) -> dict:
    rng = np.random.default_rng([seed, 1, step])
    labels = rng.integers(0, len(CLASSES), batch_size)
    angle = np.array([0.0, 0.5, 0.25, 0.75])[labels] * np.pi
    freq = rng.uniform(0.6, 1.2, batch_size)
    phase = rng.uniform(0, 2 * np.pi, batch_size)
    yy, xx = np.meshgrid(np.arange(size), np.arange(size), indexing="ij")
    proj = np.cos(angle)[:, None, None] * yy + np.sin(angle)[:, None, None] * xx
    wave = np.sin(freq[:, None, None] * proj + phase[:, None, None])
    colour = rng.uniform(0.3, 1.0, (batch_size, 1, 1, 3))
    images = wave[..., None] * colour + rng.normal(0, 1.0, (batch_size, size, size, 3))
    return {"images": images.astype(np.float32), "labels": labels.astype(np.int32)}


# ---- model: a small ResNet, plain Flax linen with no dtype code ------------------------------

class ResidualBlock(nn.Module):
    features: int
    strides: int = 1

    @nn.compact
    def __call__(self, x, train: bool):
        norm = lambda: nn.BatchNorm(use_running_average=not train, momentum=0.9)  # noqa: E731
        y = nn.relu(norm()(nn.Conv(self.features, (3, 3), self.strides, use_bias=False)(x)))
        y = norm()(nn.Conv(self.features, (3, 3), use_bias=False)(y))
        if x.shape != y.shape:
            x = norm()(nn.Conv(self.features, (1, 1), self.strides, use_bias=False)(x))
        return nn.relu(x + y)


class ResNet(nn.Module):
    classes: int = len(CLASSES)
    dropout: float = 0.1

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(
            nn.Conv(16, (3, 3), use_bias=False)(x)))
        x = ResidualBlock(16)(x, train)
        x = ResidualBlock(32, strides=2)(x, train)
        x = nn.Dropout(self.dropout, deterministic=not train)(jnp.mean(x, axis=(1, 2)))
        return nn.Dense(self.classes)(x)


def loss_fn(apply_fn, params, batch, rng=None):
    """Cross-entropy; with the step's dropout key the model trains (dropout, batch
    statistics), without one (evaluation) it uses the running statistics."""
    logits = apply_fn({"params": params}, batch["images"], train=rng is not None,
                      rngs=None if rng is None else {"dropout": rng})
    return jaxamp.softmax_cross_entropy(logits, batch["labels"])


# ---- the command line ------------------------------------------------------------------------

def parse(argv):
    p = Parser(prog="train_vision.py", description="Train a small ResNet on generated images "
               "with jaxamp mixed precision (default: float16 compute, dynamic loss scaling).")
    p.add_argument("--policy", default=jaxamp.DEFAULT_POLICY, help="jaxamp policy string")
    p.add_argument("--steps", type=int, default=200, help="training steps")
    p.add_argument("--batch-size", type=int, default=32, help="images per step")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    p.add_argument("--clip-norm", type=float, default=5.0, help="global norm clip (0: none)")
    p.add_argument("--eval-interval", type=int, default=50, help="validation every N steps")
    p.add_argument("--seed", type=int, default=0, help="initialisation and data seed")
    p.add_argument("--out", default=None, help="output folder (default: runs/vision-<dtype>)")
    p.add_argument("--overwrite", action="store_true", help="replace a previous run in --out")
    args = p.parse_args(argv)
    try:
        args.policy_obj = jaxamp.get_policy(args.policy)
    except (ValueError, TypeError) as e:
        raise UsageError(f"--policy {args.policy!r}: {e}") from None
    check_number("--steps", args.steps, minimum=1, maximum=2**31 - 1)
    check_number("--batch-size", args.batch_size, minimum=1, maximum=4096)
    check_number("--lr", args.lr, positive=True, float32=True)
    check_number("--clip-norm", args.clip_norm, minimum=0, float32=True)
    check_number("--eval-interval", args.eval_interval, minimum=1)
    check_number("--seed", args.seed, minimum=0, maximum=2**32 - 1)
    compute = np.dtype(args.policy_obj.compute_dtype).name
    try:
        args.folder, args.note = lm_files.choose_out(
            args.out, Path("runs", f"vision-{_SHORT.get(compute, compute)}"), resume=False,
            overwrite=args.overwrite)
    except lm_files.FolderError as e:
        raise UsageError(str(e)) from None
    check_writable(args.folder.path)  # every input is valid: only now is --out touched
    # what lm_stop reports a stop with: the run folder; no lock to release, no --resume
    args.out, args.release, args.resumable = args.folder.path, lambda: None, False
    return args


def main(argv: list[str] | None = None) -> int:
    """Exit status 0, 2 (bad input, disk error), 130 / 143 (SIGINT / SIGTERM): one line."""
    return lm_stop.main(lambda: parse(argv), train)


def train(args, run: lm_stop.Run) -> int:
    console = lm_report.Console(highlight=False)
    folder, out, policy = args.folder, args.folder.path, args.policy_obj
    for note in lm_files.prepare(folder, overwrite=args.overwrite, note=args.note):
        console.print(lm_report.esc(note))

    model = ResNet()
    variables = model.init(jax.random.key(args.seed), make_batch(args.seed, 0, 2)["images"],
                           train=False)
    tx = optax.adam(args.lr)
    state = jaxamp.TrainState.create(model, variables, tx, policy=policy,
                                     rng=jax.random.PRNGKey(args.seed))  # checkpointable
    step_fn = jaxamp.make_train_step(model, loss_fn, clip_norm=args.clip_norm or None)
    # XLA:CPU since jax 0.11 compiles this bfloat16 forward to NaN (its YNNPACK fusion of the
    # convolutions, tests/test_example_vision.py); recompute segments' barriers keep that
    # fusion off, and in a forward without a backward they change nothing else
    rules = jaxamp.DEFAULT_OP_RULES.extend(
        recompute=True if jax.default_backend() == "cpu" else "scan")
    eval_fn = jax.jit(lambda state, images: jnp.argmax(jaxamp.autocast(
        model.apply, policy, op_rules=rules)(
        {"params": state.params, **state.collections}, images, train=False), -1))
    val = [make_batch(args.seed + 1, i, 256) for i in range(2)]  # the same 512 images always

    def accuracy(state) -> float:
        return float(np.mean([np.mean(np.asarray(eval_fn(state, b["images"])) == b["labels"])
                              for b in val]))

    run.phase, t0 = "compiling the train step", time.perf_counter()
    compiled = step_fn.lower(state, make_batch(args.seed, 0, args.batch_size)).compile()
    compile_s, memory = time.perf_counter() - t0, lm_report.compiled_memory(compiled)
    console.print(f"{jaxamp.policy_to_str(policy)} on {jax.default_backend()}: compiled in "
                  f"{compile_s:.1f}s, step memory {lm_report.fmt_bytes(memory.get('total'))}; "
                  f"chance accuracy {1 / len(CLASSES):.2f}")

    rows, train_s = [], 0.0
    with lm_files.metrics_writer(folder, keep_through=0) as log:
        for step in range(1, args.steps + 1):
            run.phase, t = f"training step {step}", time.perf_counter()
            state, m = compiled(state, make_batch(args.seed, step, args.batch_size))
            m = jax.device_get(m)
            dt = time.perf_counter() - t
            train_s += dt
            extra = {"images_per_s": args.batch_size / dt if dt > 0 else None}
            if step % args.eval_interval == 0 or step == args.steps:
                extra["val_accuracy"] = accuracy(state)
                console.print(f"step {step}: loss {m['loss']:.3f}  scale "
                              f"{m['loss_scale']:g}  skipped {m['skipped_steps']}  "
                              f"val accuracy {extra['val_accuracy']:.3f}")
            rows.append(metrics.step_record(step, m, **extra))
            with run.deferred(f"writing step {step} to {out / metrics.METRICS_FILE}"):
                log.write(rows[-1])  # a whole line, whatever signal arrives
                run.step = step

    with run.deferred(f"saving the checkpoint of step {args.steps}"):
        mgr = lm_checkpoint.manager(out / lm_files.CHECKPOINT_DIR)
        folder.record(step=args.steps)
        lm_checkpoint.save(mgr, args.steps, state, {"step": args.steps, "seed": args.seed,
                                                    "policy": jaxamp.policy_to_str(policy)})
        mgr.close()
    run.phase = "writing the summary and plots"
    final_acc = rows[-1]["val_accuracy"]
    precision = jaxamp.precision_table(step_fn, state, make_batch(args.seed, 0, 8))
    summary = {
        "policy": jaxamp.policy_to_str(policy),
        "loss_scale_mode": jaxamp.policy_spec.loss_scaling(np.dtype(policy.compute_dtype).name),
        "clip_norm": args.clip_norm or None, "steps": args.steps, "batch_size": args.batch_size,
        "final_val_accuracy": final_acc, "chance_accuracy": 1 / len(CLASSES),
        "skipped_steps": int(state.skipped_steps),
        "final_loss_scale": float(state.loss_scale.loss_scale),
        "min_loss_scale": (float(state.loss_scale.min_loss_scale)
                           if isinstance(state.loss_scale, jaxamp.DynamicLossScale) else None),
        "images_per_s": args.steps * args.batch_size / train_s, "train_seconds": train_s,
        "compile_seconds": compile_s, "memory_bytes": memory,
        "backend": jax.default_backend(), "jax_version": jax.__version__,
    }
    with run.deferred():  # no half-written summary
        lm_files.write_outputs(folder, summary, precision)
        lm_report.plot_curves(rows, out / "curves.png", f"ResNet | {summary['policy']}",
                              clip_norm=summary["clip_norm"], ylabel="loss (cross-entropy)")
    console.print(f"validation accuracy {final_acc:.3f} (chance {1 / len(CLASSES):.2f}), "
                  f"{summary['images_per_s']:,.0f} images/s, {int(state.skipped_steps)} "
                  f"skipped steps; review: python -m jaxamp.review {lm_report.esc(str(out))}")
    return 0


if __name__ == "__main__":
    lm_stop.exit_process(main())  # skips the interpreter's teardown after a signal
