"""Orbax checkpoints with integrity data, for train_lm.py.

Each checkpoint ``checkpoints/<step>/`` holds three orbax items written in one atomic save
(orbax writes a temporary folder and renames it when complete):

* ``state``: the train state (``StandardSave``),
* ``meta``: a JSON dict (step, run settings, data position),
* ``integrity``: JSON ``{"arrays": {path: sha256}, "meta_sha256": ...}``: a sha256 of every
  array's dtype, shape and bytes, and of the canonical JSON of ``meta``, computed from the
  state in memory before it is saved.

:func:`restore` recomputes them from what it read and raises :class:`CorruptCheckpoint` on
any difference, so flipped bytes in a data file (which tensorstore may decode without
complaint into NaNs) are an error naming the checkpoint, never a silently wrong state.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import jax
import numpy as np

__all__ = ["CorruptCheckpoint", "manager", "restore_meta", "restore_state", "save",
           "tree_digests"]

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


def _digest(x) -> str:
    a = np.ascontiguousarray(np.asarray(x))
    h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
    h.update(a.reshape(-1).view(np.uint8))
    return h.hexdigest()


def tree_digests(tree) -> dict[str, str]:
    """``{jax.tree_util.keystr(path): sha256 of dtype, shape and bytes}`` for every leaf."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {jax.tree_util.keystr(p): _digest(x) for p, x in leaves}


def _meta_digest(meta: dict) -> str:
    text = json.dumps(meta, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def save(mgr, step: int, state, meta: dict) -> None:
    """Saves state, meta and their checksums as checkpoint ``step`` (blocks until written)."""
    import orbax.checkpoint as ocp

    integrity = {"format": 1, "hash": "sha256", "arrays": tree_digests(state),
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
        raise CorruptCheckpoint(step, where, f"unreadable: {_first_line(e)}") from None
    if not isinstance(integrity, dict) or not isinstance(integrity.get("arrays"), dict):
        raise CorruptCheckpoint(step, where, "its integrity item is malformed")
    if not isinstance(meta, dict) or _meta_digest(meta) != integrity.get("meta_sha256"):
        raise CorruptCheckpoint(step, where, "its meta item does not match its checksum")
    return meta, integrity


def restore_state(mgr, step: int, where: Path, abstract_state, integrity: dict):
    """The state of checkpoint ``step`` as host numpy arrays, every array checked against
    its sha256."""
    import orbax.checkpoint as ocp

    try:
        restored = mgr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state)))["state"]
        # Through host memory: orbax returns arrays committed to a device, which would add
        # sharding annotations to the lowered step (a different program from a fresh run's).
        restored = jax.tree.map(np.asarray, restored)
    except Exception as e:  # noqa: BLE001
        raise CorruptCheckpoint(step, where, f"unreadable: {_first_line(e)}") from None
    want = integrity["arrays"]
    got = tree_digests(restored)
    if set(got) != set(want):
        missing = sorted(set(want) ^ set(got))
        raise CorruptCheckpoint(step, where, f"its arrays do not match its integrity data "
                                f"({len(missing)} differ in name, e.g. {missing[0]})")
    bad = [k for k in got if got[k] != want[k]]
    if bad:
        raise CorruptCheckpoint(step, where, f"{len(bad)} of {len(got)} arrays fail their "
                                f"sha256 check, e.g. {bad[0]}")
    return restored
