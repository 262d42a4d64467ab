"""Orbax checkpoints with integrity data, for train_lm.py.

Each checkpoint ``checkpoints/<step>/`` holds three orbax items written in one atomic save
(orbax writes a temporary folder and renames it when complete):

* ``state``: the train state (``StandardSave``),
* ``meta``: a JSON dict (step, run settings, data position),
* ``integrity``: JSON ``{"format": 2, "arrays": {path: checksum}, "meta_sha256": ...}``: a
  checksum of every array (:func:`array_checksum`) and a sha256 of the canonical JSON of
  ``meta``, computed from the state in memory before it is saved.

:func:`restore_state` recomputes them from what it read and raises :class:`CorruptCheckpoint`
on any difference, so flipped bytes in a data file (which tensorstore may decode without
complaint into NaNs) are an error naming the checkpoint, never a silently wrong state.

An array's checksum is computed where the array lives, on its devices, so with ``--mesh`` on
several hosts no host ever reads a whole sharded array: each element's bits are mixed with
its position (murmur3's 32-bit finaliser, four seeds) and summed modulo 2**32 across the
array, shards and devices included, giving 128 bits that do not depend on how the array is
sharded (a checkpoint resumes on another mesh). Changing any one element always changes the
sum (the mix is a bijection); the sha256 of those bits with the dtype and shape is stored.
Checkpoints of format 1 (a sha256 of each array's bytes, read on one host) are still checked.

A checkpoint written before issue #41 holds the state's old layout (``loss_scale`` and
``skipped_steps`` beside ``opt_state``, which held the optimizer's own state): :func:`restore_state`
reads it as :class:`OldLayout` and moves them into today's ``opt_state`` (``jaxamp.amp``'s state).

For train_lm.py: :func:`resume` restores the latest checkpoint in ``--out`` (or, with
``--resume latest-intact``, the newest intact one) after checking it was made with the same
settings; :class:`Checkpoints` saves the run's state with the meta a resume needs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import hashlib
import json
import logging
import os
import re
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import lm_files
import numpy as np
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec
from lm_cli import Setup, UsageError

from jaxamp import policy_spec
from jaxamp.diagnostics.metrics import MetricsError, read_metrics, strict

__all__ = ["Checkpoints", "CorruptCheckpoint", "SaveError", "closed_event_loop_filter",
           "OldLayout", "from_old_layout", "latest_step", "manager", "metrics_before",
           "old_layout", "restore_meta", "restore_state",
           "resume", "run_config", "array_checksum", "save", "strong", "tree_digests"]

ITEMS = ("state", "meta", "integrity")
#: Checkpoints kept in checkpoints/ (orbax deletes older ones).
MAX_TO_KEEP = 3


class CorruptCheckpoint(Exception):
    """A checkpoint that cannot be read or does not match its integrity data."""

    def __init__(self, step: int, where: Path, reason: str):
        super().__init__(reason)
        self.step, self.where, self.reason = step, where, reason


def manager(folder: Path, *, create: bool = True):
    import orbax.checkpoint as ocp

    # Synchronous saves: the train step donates the state's buffers right after a save.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=MAX_TO_KEEP, create=create, enable_async_checkpointing=False)
    return ocp.CheckpointManager(Path(folder).resolve(), options=options, item_names=ITEMS)


FORMAT = 2
_SEEDS = (0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F)


def _fmix32(h):
    """murmur3's 32-bit finaliser: a bijection on uint32 that spreads every input bit."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _fingerprint(x):
    """uint32[4]: for each seed, the sum mod 2**32 of fmix32(element bits ^ fmix32(position +
    seed)), reduced on the devices that hold ``x`` (replicated result)."""
    if jnp.issubdtype(x.dtype, jnp.bool_):
        x = x.astype(jnp.uint8)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{x.dtype.itemsize * 8}"))
    if bits.dtype.itemsize > 4:  # 64-bit: two uint32 words per element
        bits = jax.lax.bitcast_convert_type(bits, jnp.uint32)
    bits = bits.astype(jnp.uint32).reshape(-1)
    position = jax.lax.iota(jnp.uint32, bits.size)
    return jnp.stack([jnp.sum(_fmix32(bits ^ _fmix32(position + jnp.uint32(seed))),
                              dtype=jnp.uint32) for seed in _SEEDS])


@functools.cache
def _jitted_fingerprint(out_sharding):
    return jax.jit(_fingerprint, out_shardings=out_sharding)


def array_checksum(x) -> str:
    """sha256 (hex) of ``x``'s dtype, shape and on-device fingerprint (module docstring)."""
    x = x if isinstance(x, jax.Array) else jnp.asarray(x)
    s = x.sharding
    # the four sums replicated on x's mesh, so every host reads them (and nothing else)
    out = NamedSharding(s.mesh, PartitionSpec()) if isinstance(s, NamedSharding) else None
    fp = np.asarray(_jitted_fingerprint(out)(x), dtype="<u4")
    return hashlib.sha256(f"{np.dtype(x.dtype).str}{tuple(x.shape)}".encode()
                          + fp.tobytes()).hexdigest()


def _host_digest(x) -> str:
    """Format 1: sha256 of dtype, shape and bytes, read on this host (single-host arrays)."""
    a = np.ascontiguousarray(np.asarray(x))
    h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
    h.update(a.reshape(-1).view(np.uint8))
    return h.hexdigest()


def tree_digests(tree, fmt: int = FORMAT) -> dict[str, str]:
    """``{jax.tree_util.keystr(path): checksum}`` for every leaf (``fmt`` 1: sha256 of the
    bytes read on this host; 2: :func:`array_checksum`, computed on device)."""
    digest = array_checksum if fmt == FORMAT else _host_digest
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {jax.tree_util.keystr(p): digest(x) for p, x in leaves}


def _meta_digest(meta: dict) -> str:
    text = json.dumps(meta, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def save(mgr, step: int, state, meta: dict) -> None:
    """Saves state, meta and their checksums as checkpoint ``step`` (blocks until written)."""
    import orbax.checkpoint as ocp

    integrity = {"format": FORMAT, "hash": "sha256(dtype, shape, fmix32 position sums)",
                 "arrays": tree_digests(state),
                 "meta_sha256": _meta_digest(meta)}
    mgr.save(int(step), args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta),
        integrity=ocp.args.JsonSave(integrity)))
    mgr.wait_until_finished()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    line = text[0].split(" See full TensorStore details")[0] if text else ""
    line = f"{type(e).__name__}: {line}" if line else type(e).__name__
    return line if len(line) <= 200 else line[:197] + "..."


def restore_meta(mgr, step: int, where: Path) -> tuple[dict, dict]:
    """(meta, integrity) of checkpoint ``step``, meta checked against its checksum."""
    import orbax.checkpoint as ocp

    try:
        got = mgr.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore(), integrity=ocp.args.JsonRestore()))
        meta, integrity = got["meta"], got["integrity"]
    except Exception as e:  # noqa: BLE001 - any failure to read means unusable
        _drop_unretrieved_task_reports()
        raise CorruptCheckpoint(step, where, f"unreadable: {_first_line(e)}") from None
    if not isinstance(integrity, dict) or not isinstance(integrity.get("arrays"), dict):
        raise CorruptCheckpoint(step, where, "its integrity item is malformed")
    if not isinstance(meta, dict) or _meta_digest(meta) != integrity.get("meta_sha256"):
        raise CorruptCheckpoint(step, where, "its meta item does not match its checksum")
    return meta, integrity


class OldLayout(struct.PyTreeNode):
    """The state as checkpointed before issue #41 (the same key paths): ``opt_state`` is the
    optimizer's own state; the loss scale and the skipped-step count sit beside it."""

    step: Any
    params: Any
    opt_state: Any
    loss_scale: Any
    skipped_steps: Any
    rng: Any
    collections: Any


def old_layout(state) -> OldLayout:
    """``state`` (a ``jaxamp.TrainState``) in the layout of :class:`OldLayout`."""
    amp = state.opt_state
    return OldLayout(state.step, state.params, amp.inner_state, amp.loss_scale,
                     amp.skipped_steps, state.rng, state.collections)


def from_old_layout(abstract_state, old: OldLayout):
    """An :class:`OldLayout` read from a checkpoint as today's state: the loss scale and the
    count move into ``opt_state``; the last step's grad norm is not in it (a step sets it
    before anything reads it)."""
    amp = abstract_state.opt_state._replace(
        loss_scale=old.loss_scale, inner_state=old.opt_state, skipped_steps=old.skipped_steps,
        grad_norm=np.zeros((), np.float32), grads_finite=np.ones((), bool))
    return abstract_state.replace(step=old.step, params=old.params, opt_state=amp, rng=old.rng,
                                  collections=old.collections)


def restore_state(mgr, step: int, where: Path, abstract_state, integrity: dict):
    """The state of checkpoint ``step``, every array checked against its checksum. Leaves of
    ``abstract_state`` with a ``sharding`` are restored onto it (each host reads its shards);
    without, the state comes back as host numpy arrays. A checkpoint of the old layout
    (:class:`OldLayout`) is read in it and returned in today's."""
    import orbax.checkpoint as ocp

    fmt = integrity.get("format")
    if fmt not in (1, FORMAT):
        raise CorruptCheckpoint(step, where, f"its integrity data has format {fmt!r}, "
                                f"not 1 or {FORMAT}")
    old = any(k.startswith(".skipped_steps") for k in integrity.get("arrays", {}))
    if old:
        abstract_state, today = old_layout(abstract_state), abstract_state
    sharded = any(getattr(x, "sharding", None) is not None
                  for x in jax.tree.leaves(abstract_state))
    if not sharded:  # onto one device, whatever mesh the checkpoint was written from
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        abstract_state = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract_state)
    try:
        restored = mgr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state)))["state"]
        got = tree_digests(restored, fmt)
        if not sharded:
            # Through host memory: orbax returns arrays committed to a device, which would add
            # sharding annotations to the lowered step (a different program from a fresh run's).
            restored = jax.tree.map(np.asarray, restored)
    except Exception as e:  # noqa: BLE001
        _drop_unretrieved_task_reports()  # orbax's failed deserialize tasks
        raise CorruptCheckpoint(step, where, f"unreadable: {_first_line(e)}") from None
    want = integrity["arrays"]
    if set(got) != set(want):
        missing = sorted(set(want) ^ set(got))
        raise CorruptCheckpoint(step, where, f"its arrays do not match its integrity data "
                                f"({len(missing)} differ in name, e.g. {missing[0]})")
    bad = [k for k in got if got[k] != want[k]]
    if bad:
        raise CorruptCheckpoint(step, where, f"{len(bad)} of {len(got)} arrays fail their "
                                f"checksum, e.g. {bad[0]}")
    return from_old_layout(today, restored) if old else restored


# ---------------------------------------------------------------------------------------------
# train_lm.py's checkpoints: what a resume needs, and the checks it makes
# ---------------------------------------------------------------------------------------------


def strong(tree):
    """Drops weak types, so a fresh and a restored state have identical avals."""
    return jax.tree.map(lambda x: jnp.asarray(x, dtype=x.dtype), tree)


def run_config(s: Setup) -> dict:
    """The settings a resumed run must share with the checkpointed one (they shape the
    trajectory). --steps may differ (to extend a run); eval/checkpoint intervals may too."""
    a = s.args
    return {
        "preset": a.preset, "model": dataclasses.asdict(s.config),
        "policy": policy_spec.to_str({k: v for k, v in policy_spec.parse(s.policy_str).items()
                                      if k != "opt_state"}), "opt_state": s.opt_state,
        "loss_scale": s.loss_scale_kind, "init_scale": a.init_scale,
        "growth_interval": a.growth_interval, "lr": a.lr, "schedule": a.schedule,
        "warmup": a.warmup, "clip_norm": a.clip_norm, "batch_size": a.batch_size,
        "micro_batches": a.micro_batches, "seed": a.seed, "eval_batches": a.eval_batches,
        "data_fingerprint": s.corpus.fingerprint, "fp8_small": s.fp8_small,
    }


_FLAG_OF = {"preset": "--preset", "model": "--preset", "policy": "--policy",
            "opt_state": "--opt-state",
            "loss_scale": "--loss-scale", "init_scale": "--init-scale",
            "growth_interval": "--growth-interval", "lr": "--lr", "schedule": "--schedule",
            "warmup": "--warmup", "clip_norm": "--clip-norm", "batch_size": "--batch-size",
            "micro_batches": "--micro-batches", "seed": "--seed",
            "eval_batches": "--eval-batches", "data_fingerprint": "--data",
            "fp8_small": "--fp8-small"}
#: Settings recorded since a later version: a checkpoint without one is not compared on it.
_RECORDED_LATER = frozenset({"fp8_small"})


class SaveError(OSError):
    """Writing checkpoint ``step`` failed (disk full, permissions, ...): the orbax save left
    at most its temporary folder, which a resume ignores."""

    def __init__(self, step: int, folder: Path, cause: BaseException):
        errno_ = getattr(cause, "errno", None)
        if not isinstance(errno_, int):  # tensorstore: "... [os_error_code='28']"
            found = re.search(r"os_error_code='(\d+)'|\[Errno (\d+)\]", str(cause))
            errno_ = int(found.group(1) or found.group(2)) if found else None
        reason = os.strerror(errno_) if isinstance(errno_, int) else _first_line(cause)
        super().__init__(errno_, reason, str(folder))
        self.step = step


_UNRETRIEVED = re.compile(r"\w+ exception was never retrieved")


def _unretrieved_task_error(record: logging.LogRecord) -> bool:
    """asyncio's report of a task or future whose exception nobody retrieved (logged when it is
    garbage-collected, possibly long after the save returned). asyncio names the class:
    "Task exception was never retrieved", "Future exception ...", a subclass's name."""
    return record.name == "asyncio" and _UNRETRIEVED.match(record.getMessage()) is not None


def _not_unretrieved_task_error(record: logging.LogRecord) -> bool:
    return not _unretrieved_task_error(record)


# Python's warning when a coroutine object is collected before anyone awaited it (orbax's read
# of a corrupted checkpoint leaves e.g. ``Store._get_array_metadatas`` so).
_UNAWAITED = r"coroutine '[^']*' was never awaited"


def _drop_unretrieved_task_reports() -> None:
    """After a failed orbax read or write: asyncio's reports of its failed tasks (each with a
    traceback, logged when the garbage collector collects the task, possibly at exit) and
    Python's ``RuntimeWarning`` for the coroutines it never awaited repeat the error already
    reported in one line; they are dropped for the rest of the process, and the tasks
    collected now. (One filter object: ``addFilter`` adds it once, however many checkpoints
    fail; ``filterwarnings`` moves an equal filter to the front instead of adding it again.)"""
    logging.getLogger("asyncio").addFilter(_not_unretrieved_task_error)
    warnings.filterwarnings("ignore", message=_UNAWAITED, category=RuntimeWarning)
    gc.collect()


@contextlib.contextmanager
def _orbax_log_held():
    """Holds what orbax logs during a save (its threads log the failure of a write with a
    traceback, through absl): dropped if the save fails (the failure is reported as one
    line), logged as usual once it succeeds.

    Newer orbax also leaves the failed write coroutines' tasks unretrieved: asyncio logs each
    with its traceback when the task is collected, which can be after the save raised (it
    depends on when the garbage collector runs). After a failed save those reports are
    dropped for the rest of the process: they repeat the error already reported."""
    held: list[logging.LogRecord] = []

    def hold(record):
        held.append(record)
        return False

    loggers = [logging.getLogger(), logging.getLogger("absl"), logging.getLogger("asyncio")]
    for lg in loggers:
        lg.addFilter(hold)
    try:
        yield
    except BaseException:
        _drop_unretrieved_task_reports()  # while their reports are held
        raise
    finally:
        for lg in loggers:
            lg.removeFilter(hold)
    for record in held:
        logging.getLogger(record.name).handle(record)


class Checkpoints:
    """``--out``/checkpoints/: :meth:`save` records the step in the manifest, then writes the
    state, the meta a resume needs and their checksums (:func:`save`)."""

    def __init__(self, s: Setup, *, initial_val_loss: float):
        self.s, self.initial_val_loss = s, initial_val_loss
        self.manager = manager(s.out / lm_files.CHECKPOINT_DIR)

    def save(self, state, step: int) -> None:
        a = self.s.args
        meta = {
            "step": step, "run_config": run_config(self.s),
            "initial_val_loss": self.initial_val_loss,
            "data": {"next_step": step, "seed": a.seed,
                     "sampler": "np.random.default_rng([seed, 0, step])",
                     "fingerprint": self.s.corpus.fingerprint, "source": self.s.corpus.source},
            "rng": {"seed": a.seed, "init": "jax.random.key(seed)",
                    "dropout": "fold_in(state.rng = PRNGKey(seed), step), in the checkpoint",
                    "opt_state": "--opt-state bfloat16: stochastic rounding's key is "
                                 "state.opt_state.inner_state.rounding_key, in the checkpoint",
                    "note": "batches depend only on (seed, step)"},
            "steps": a.steps,
        }
        try:
            self.s.folder.record(step=int(step))
            with _orbax_log_held():
                save(self.manager, int(step), state, strict(meta))
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as e:  # noqa: BLE001 - orbax/tensorstore wrap OSErrors in their own
            raise SaveError(int(step), self.s.out / lm_files.CHECKPOINT_DIR, e) from None

    def close(self) -> None:
        self.manager.close()


def latest_step(out: Path) -> int | None:
    """The latest checkpoint step in ``out`` (None if there is none or it is unreadable)."""
    try:
        m = manager(out / lm_files.CHECKPOINT_DIR, create=False)
        try:
            return m.latest_step()
        finally:
            m.close()
    except Exception:  # noqa: BLE001
        return None


def resume(s: Setup, abstract_state) -> tuple[object, dict, list[CorruptCheckpoint]]:
    """(state, meta, corrupted) from the latest checkpoint in --out; UsageError if none or
    unusable, or if it is beyond ``--steps``.

    Orbax writes a checkpoint into a temporary folder and renames it when complete, so a run
    killed mid-save leaves only a ``<step>.orbax-checkpoint-tmp-*`` folder, which orbax does not
    list as a step: the latest *complete* checkpoint is the one restored. Every checkpoint
    carries a checksum of each array and of its meta: one that fails them is an error, or with
    ``--resume latest-intact`` is passed over for the next older one (returned in
    ``corrupted``). Nothing is removed here.
    """
    folder = s.out / lm_files.CHECKPOINT_DIR
    no_checkpoint = UsageError(f"--resume: no checkpoints in {folder}; start a new run there "
                               "with --overwrite instead of --resume")
    if not folder.is_dir():
        raise no_checkpoint
    try:
        mgr = manager(folder, create=False)
    except Exception as e:  # noqa: BLE001 - any orbax failure means an unusable folder
        raise UsageError(f"--resume: cannot read checkpoints in {folder} "
                         f"({_first_line(e)})") from None
    fallback = s.args.resume == "latest-intact"
    with mgr:
        steps = sorted(mgr.all_steps(), reverse=True)
        if not steps:
            raise no_checkpoint
        bad = []
        for step in steps:
            where = folder / str(step)
            try:
                meta, integrity = restore_meta(mgr, step, where)
                if "run_config" not in meta:
                    raise CorruptCheckpoint(step, where, "its meta item is not from train_lm.py")
                _check_same_settings(s, meta, folder)
                restored = restore_state(mgr, step, where, abstract_state, integrity)
                if int(restored.step) != step or int(meta.get("step", -1)) != step:
                    raise CorruptCheckpoint(
                        step, where, f"it holds step {int(restored.step)}, not {step}")
            except CorruptCheckpoint as e:
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
    if int(meta["step"]) > s.args.steps:
        raise UsageError(f"--steps {s.args.steps} is below the step of the latest checkpoint "
                         f"in {folder} ({int(meta['step'])}); pass --steps "
                         f">= {int(meta['step'])}")
    restored = strong(jax.tree.map(jnp.asarray, restored))
    jax.block_until_ready(restored)
    return restored, meta, bad


#: Settings a checkpoint made before their flag existed ran with (it records none).
_BEFORE_ITS_FLAG = {"opt_state": "float32"}

#: Fields of the model config set by their own flag (the others come from --preset).
_MODEL_FLAG_OF = {"dropout": "--dropout", "attention": "--attention"}
#: Model config fields a checkpoint made before their flag existed ran with (it records none).
_MODEL_BEFORE_ITS_FLAG = {"attention": "manual"}


def _differences(old: dict, now: dict):
    """(flag, old value, new value) of each setting that differs; the model config field by
    field, under the flag that sets it (--dropout, else --preset)."""
    for k, v in now.items():
        if k in _RECORDED_LATER and k not in old:
            continue  # an older checkpoint: the setting was not recorded
        was = old.get(k, _BEFORE_ITS_FLAG.get(k))
        if k == "model" and isinstance(was, dict) and isinstance(v, dict):
            if old.get("preset") != now.get("preset"):
                continue  # reported as --preset itself
            for field in sorted(set(was) | set(v)):
                before = was.get(field, _MODEL_BEFORE_ITS_FLAG.get(field))
                if before != v.get(field):
                    flag = _MODEL_FLAG_OF.get(field, f"--preset (its {field})")
                    yield flag, before, v.get(field)
        elif was != v:
            yield _FLAG_OF[k], was, v


def _check_same_settings(s: Setup, meta: dict, folder: Path) -> None:
    old = meta["run_config"]
    mismatch = list(_differences(old if isinstance(old, dict) else {}, run_config(s)))
    if mismatch:
        detail = "; ".join(f"{flag}: checkpoint has {_show(was)}, now {_show(v)}"
                           for flag, was, v in mismatch)
        raise UsageError(f"--resume: the checkpoint in {folder} was made with other "
                         f"settings ({detail}); pass the original flags or choose another "
                         "--out")


def _show(v) -> str:
    text = json.dumps(v) if not isinstance(v, str) else v
    return text if len(text) <= 80 else text[:77] + "..."


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


def metrics_before(path: Path, step: int) -> list[dict]:
    """The ``metrics.jsonl`` rows up to a resumed checkpoint's ``step`` (read before anything
    is changed, so an unreadable file is an error, not lost lines)."""
    try:
        rows = read_metrics(path, missing_ok=True)
    except MetricsError as e:
        raise UsageError(f"--resume: {e}; move it away to resume without it") from None
    return [r for r in rows if r["step"] <= step]
