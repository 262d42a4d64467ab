"""Train a small GPT on bytes with automatic mixed precision (jaxamp): a template to copy.

Run it with no flags to train the ``tiny`` preset on the Python standard library's own sources
(nothing to download) in float16 with dynamic loss scaling, for about a minute on 2 CPU cores::

    python examples/train_lm.py
    python examples/train_lm.py --policy params=float32,compute=bfloat16,output=float32 --api nnx
    python examples/train_lm.py --steps 600 --resume          # continue the default run

This file reads top to bottom: config, data, model, step, loop, log. The model (``lm_model.py``,
or ``lm_model_nnx.py`` with ``--api nnx``) has no dtype code: jaxamp runs it under the ``--policy``.
Beside it: ``lm_cli.py`` (the flags and every check on them), ``lm_data.py`` (bytes to batches),
``lm_checkpoint.py`` (orbax checkpoints with a checksum of every array; ``--resume`` continues
bit-identically), ``lm_files.py`` (which ``--out``; the script lists what it wrote in
``train_lm.manifest.json`` and never deletes or overwrites anything else) and ``lm_report.py``
(console, summary, plot). The metrics format is jaxamp's (``jaxamp.diagnostics.metrics``).

Everything lands in ``--out`` (default ``runs/<preset>-<dtype>``, or ``-2``, ``-3``, ... when
that holds an earlier run): ``metrics.jsonl``, ``summary.json``, ``precision.json`` (which dtype
every op ran in), ``curves.png`` and ``checkpoints/``. Bad input prints one ``error: ...`` line
and exits with status 2 before anything is compiled or any file is touched; so does a disk error
later, naming the checkpoint kept. A run locks ``--out``; Ctrl-C exits 130, SIGTERM 143
(``lm_stop.py``: one line, at any point, after the save in progress).
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

# examples/ on sys.path for the sibling modules, also when this file is imported from elsewhere
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import jax  # noqa: E402
import lm_checkpoint  # noqa: E402
import lm_data  # noqa: E402
import lm_files  # noqa: E402
import lm_mesh  # noqa: E402
import lm_model  # noqa: E402
import lm_model_nnx  # noqa: E402
import lm_report  # noqa: E402
import lm_stop  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from lm_cli import Setup, UsageError, build_parser, validate  # noqa: E402, F401

import jaxamp  # noqa: E402
from jaxamp.diagnostics import metrics  # noqa: E402 - the run-log format jaxamp.review reads

# ---- model, loss, optimiser, train state, step ----------------------------------------------

MODELS = {"linen": lm_model, "nnx": lm_model_nnx}  # --api: same params, outputs, checkpoints


def build_model(s: Setup) -> lm_model.GPT:
    return MODELS[s.args.api].GPT(s.config)


def loss_fn(apply_fn, params, batch, rng=None):
    """The user's loss: mean next-byte cross-entropy (jaxamp computes it in float32). ``rng``
    is the train step's dropout key; without one (evaluation) dropout is off."""
    logits = apply_fn({"params": params}, batch["inputs"], train=rng is not None,
                      rngs=None if rng is None else {"dropout": rng})
    return jaxamp.softmax_cross_entropy(logits, batch["targets"])


def make_optimizer(args) -> optax.GradientTransformation:
    """AdamW after a linear warmup; cosine decays to lr/10 at --steps. Weight decay on
    matrices only (Dense kernels, embeddings), not on biases or LayerNorm."""
    if args.schedule == "cosine":
        lr = optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=args.lr, warmup_steps=args.warmup,
            decay_steps=max(args.steps, args.warmup + 1), end_value=args.lr / 10)
    elif args.warmup == 0:
        lr = optax.constant_schedule(args.lr)
    else:
        lr = optax.join_schedules([optax.linear_schedule(0.0, args.lr, args.warmup),
                                   optax.constant_schedule(args.lr)], [args.warmup])

    decay = functools.partial(jax.tree_util.tree_map_with_path, lambda path, _: getattr(
        path[-1], "key", str(path[-1])) in ("kernel", "embedding"))
    return optax.adamw(lr, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay)


def dropout_rng(config, seed: int):
    """The state's base dropout key (None without dropout: the state then holds none)."""
    return jax.random.PRNGKey(seed) if config.dropout > 0 else None


def create_state(model, tx, s: Setup, *, abstract: bool = False):
    """The train state: params from --seed, AdamW's moments, the loss scale, the dropout key.
    ``abstract``: its shapes and dtypes only (nothing allocated), to restore a checkpoint into
    or to compile against."""
    def create(params):
        return jaxamp.TrainState.create(model, params, tx, loss_scale=s.loss_scale,
                                        policy=s.policy, rng=dropout_rng(s.config, s.args.seed))
    if abstract:
        return jax.eval_shape(create, lm_model.abstract_params(s.config))
    _, params = MODELS[s.args.api].init_params(s.config, seed=s.args.seed)
    return lm_checkpoint.strong(create(params))  # the avals of a restored state


def make_step(model, tx, s: Setup, mesh=None):
    """``(state, batch) -> (state, metrics)``: casts, loss scaling, skipping non-finite updates,
    clipping the unscaled gradients, micro-batches, --mesh (lm_mesh.py)."""
    return jaxamp.make_train_step(model, loss_fn, tx, policy=s.policy, op_rules=s.op_rules,
                                  clip_norm=s.args.clip_norm or None,
                                  micro_batches=s.args.micro_batches, **lm_mesh.step_kwargs(mesh))


# ---- main ------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    """Runs the CLI: exit status 0, 2 (bad input, disk error), 130 / 143 (SIGINT / SIGTERM)."""
    lm_mesh.initialize_distributed()  # several hosts (JAX_COORDINATOR_ADDRESS, ...): first
    return lm_stop.main(lambda: validate(build_parser().parse_args(argv)), train)


def train(s: Setup, run: lm_stop.Run) -> int:
    """Trains as the validated flags say; returns 0 (``run``: how far it got, for lm_stop)."""
    args, config = s.args, s.config
    console = lm_report.Console(highlight=False, quiet=not s.folder.writer)  # first host
    metrics_path = s.out / metrics.METRICS_FILE

    mesh = args.mesh and lm_mesh.make_mesh(lm_mesh.parse_mesh(args.mesh))  # None: one device

    # ---- data: a batch is a pure function of (seed, step), so a resumed run sees the same ----
    def batch_at(step: int) -> dict:
        return lm_mesh.shard_batch(lm_data.get_batch(
            s.corpus.train, seed=args.seed, step=step, batch_size=args.batch_size,
            block_size=config.block_size), mesh)

    val_batches = lm_data.eval_batches(s.corpus.val, seed=args.seed, batch_size=args.batch_size,
                                       num_batches=args.eval_batches,
                                       block_size=config.block_size)

    # ---- model and train state: fresh, or the latest checkpoint in --out ----
    model = build_model(s)
    tx = make_optimizer(args)
    start_step, meta, corrupted, kept = 0, None, [], []
    run.phase = "reading the checkpoint" if args.resume else "initialising"
    step_fn = make_step(model, tx, s, mesh)  # .calibrate: fp8=delayed's amax histories
    if args.resume:  # onto the mesh, if any; the target has fp8=delayed's amax histories
        state, meta, corrupted = lm_checkpoint.resume(s, lm_mesh.place(jax.eval_shape(
            step_fn.calibrate, create_state(model, tx, s, abstract=True), batch_at(0)), mesh))
        start_step = int(meta["step"])
        kept = lm_checkpoint.metrics_before(metrics_path, start_step)
    else:
        state = create_state(model, tx, s)
    lm_mesh.barrier("inputs read")  # several hosts: all have read --out before it changes
    with run.deferred(f"preparing {s.out}"):  # every input is valid: only now is --out changed
        for note in lm_files.prepare(s.folder, overwrite=args.overwrite, note=s.out_note,
                                     corrupted=corrupted, start_step=start_step):
            console.print(lm_report.esc(note))
    lm_report.header(console, s, state.params, start_step, meta)

    # ---- step: compiled once; its memory read from the compiled program ----
    state = step_fn.calibrate(lm_mesh.shard_state(state, mesh) if mesh else state, batch_at(0))
    eval_fn = jaxamp.make_eval_step(model, loss_fn, policy=s.policy, op_rules=s.op_rules)

    def evaluate(params) -> float:
        return float(np.mean([float(eval_fn(params, b)) for b in val_batches]))

    run.phase = "compiling the train step"
    t0 = time.perf_counter()
    with console.status("compiling the train step..."):
        compiled = step_fn.lower(state, batch_at(0)).compile()
    compile_s = time.perf_counter() - t0
    memory = lm_report.compiled_memory(compiled)
    console.print(f"compiled the train step in {compile_s:.1f}s; memory: "
                  f"{lm_report.fmt_bytes(memory.get('total'))} "
                  f"(temp {lm_report.fmt_bytes(memory.get('temp'))})")

    # ---- loop: a metrics line per step; evaluate and checkpoint at their intervals ----
    with run.deferred(f"writing {metrics_path}"):
        log = lm_files.metrics_writer(s.folder, keep_through=start_step)  # drops later lines
    rows = list(kept)  # metrics.jsonl's lines, as written
    if args.resume:
        initial_val = meta["initial_val_loss"]
        if len(kept) != start_step:
            console.print(f"note: metrics.jsonl holds {len(kept)} of the {start_step} steps "
                          "before the checkpoint")
    else:
        run.phase = "evaluating the initial model"
        initial_val = evaluate(state.params)
        console.print(f"step 0: validation loss {initial_val:.4f} "
                      f"(uniform over 256 bytes: {np.log(256):.4f})")
    checkpoints = lm_checkpoint.Checkpoints(s, initial_val_loss=initial_val)

    def due(interval: int, step: int) -> bool:  # every `interval` steps (0: never), and last
        return bool(interval and step % interval == 0) or step == args.steps

    tokens_per_step = args.batch_size * config.block_size
    train_s, tokens, last_val = 0.0, 0, None
    run.step = start_step
    try:
        with lm_report.Progress(console, s, start_step) as progress:
            for step in range(start_step + 1, args.steps + 1):
                run.phase = f"training step {step}"
                t = time.perf_counter()
                state, m = compiled(state, batch_at(step - 1))
                m = jax.device_get(m)
                dt = time.perf_counter() - t
                train_s, tokens = train_s + dt, tokens + tokens_per_step
                extra = {"tokens_per_s": tokens_per_step / dt if dt > 0 else None}
                if due(args.eval_interval, step):
                    extra["val_loss"] = last_val = evaluate(state.params)
                row = metrics.step_record(step, m, **extra)
                with run.deferred(f"writing step {step} to {metrics_path}"):  # signals held
                    log.write(row)
                    rows.append(row)
                    run.step = step
                    if due(args.checkpoint_interval, step):
                        run.phase = f"saving the checkpoint of step {step}"
                        checkpoints.save(state, step)
                progress.update(row, tokens / train_s, last_val)
    finally:
        run.close(log, checkpoints)  # signals held; an error here hides not the first one
    run.phase = "writing the summary and plots"

    # ---- log: summary.json, precision.json, curves.png, tables ----
    if start_step >= args.steps:
        console.print(f"nothing to train: the checkpoint is already at step {args.steps}")
    if last_val is None:  # nothing trained: the last logged validation loss
        vals = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
        last_val = vals[-1] if vals else evaluate(state.params)
    memory_f32 = {}
    if args.compare_f32 and not mesh:  # the same step in float32, compiled (not run)
        s32 = s.in_float32()
        memory_f32 = dict(memory) if s.is_float32 else lm_report.compiled_memory(
            make_step(model, tx, s32).lower(create_state(model, tx, s32, abstract=True),
                                            batch_at(0)).compile())
    precision = jaxamp.precision_table(lambda p, b: loss_fn(model.apply, p, b), state.params,
                                       batch_at(0), policy=s.policy, op_rules=s.op_rules)
    summary = lm_report.summary(s, state, rows, start_step=start_step, initial_val=initial_val,
                                final_val=last_val, tokens=tokens, train_s=train_s,
                                compile_s=compile_s, memory=memory, memory_f32=memory_f32)
    with run.deferred():
        lm_files.write_outputs(s.folder, summary, precision)
        lm_report.finish(console, s, rows, summary, precision)
    return 0


if __name__ == "__main__":
    sys.unraisablehook = lm_checkpoint.closed_event_loop_filter(sys.unraisablehook)
    lm_stop.exit_process(main())  # skips the interpreter's teardown after a signal
