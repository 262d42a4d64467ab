"""Byte-level language-model data: a corpus, a deterministic split and a pure batch sampler.

Tokens are raw bytes (vocabulary 256), so any text works and nothing needs downloading. The
built-in corpus is the Python standard library's own ``.py`` sources, read from the running
interpreter (``sysconfig.get_paths()["stdlib"]``), in sorted path order and capped at
:data:`DEFAULT_MAX_BYTES`: it exists on every machine that can run this example.

Batches are a pure function of ``(seed, step)``: :func:`get_batch` draws its offsets from
``np.random.default_rng([seed, step])``, so a run resumed at step ``s`` sees exactly the batches
an uninterrupted run sees from step ``s`` on, with no sampler state to checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np

__all__ = [
    "DEFAULT_MAX_BYTES",
    "Corpus",
    "DataError",
    "eval_batches",
    "get_batch",
    "load_corpus",
]

#: Cap of the built-in corpus (the first this-many bytes of the sorted stdlib sources).
DEFAULT_MAX_BYTES = 4 * 2**20
#: Fraction of the tokens used for training; the rest is validation (see :func:`split`).
TRAIN_FRACTION = 0.9
#: The split cuts the tokens into this many pieces; every tenth one is validation.
SPLIT_PIECES = 50
#: Suffixes read when ``--data`` is a folder.
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".json", ".csv", ".tsv", ".html", ".xml",
                 ".c", ".h", ".cc", ".cpp", ".js", ".ts", ".go", ".rs", ".java", ".toml",
                 ".yaml", ".yml", ".ini", ".cfg", ".tex", ".sh")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
#: Also skipped in the built-in corpus: the test-suite (most of the stdlib's bytes) and the
#: codec tables (``encodings``: long runs of near-identical lines that teach little).
_SKIP_STDLIB_DIRS = _SKIP_DIRS | {"test", "tests", "idle_test", "encodings", "pydoc_data"}


class DataError(ValueError):
    """The data cannot be used; the message names the path and how to fix it."""


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Byte tokens split into train and validation parts.

    Attributes:
      train: ``uint8[n_train]`` training tokens (90%, see :func:`split`).
      val: ``uint8[n_val]`` validation tokens (10%).
      source: human-readable description of where the bytes came from.
      num_files: number of files read.
      fingerprint: sha256 (hex, first 16 chars) of all tokens, to check a resumed run's data.
    """

    train: np.ndarray
    val: np.ndarray
    source: str
    num_files: int
    fingerprint: str

    @property
    def num_tokens(self) -> int:
        return int(self.train.size + self.val.size)


def stdlib_dir() -> Path:
    """The running interpreter's standard-library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def _files_under(folder: Path, suffixes, skip=frozenset(_SKIP_DIRS)) -> list[Path]:
    out = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if d not in skip and not d.startswith(".")]
        for name in files:
            if name.endswith(suffixes) and not name.startswith("."):
                out.append(Path(root) / name)
    # Sorted by path relative to the folder, as a POSIX string: the same order on every OS.
    return sorted(out, key=lambda p: p.relative_to(folder).as_posix())


def _read_head(path: Path, limit: int | None) -> bytes:
    """The first ``limit`` bytes of a regular file (all of it for ``None``), without reading
    the rest: a 30 GiB file costs what the cap allows, not 30 GiB of memory."""
    with open(path, "rb") as f:
        return f.read() if limit is None else f.read(limit)


def _read_capped(files: list[Path], max_bytes: int | None) -> tuple[bytes, int]:
    chunks, total, used = [], 0, 0
    for path in files:
        if not path.is_file():  # a FIFO or device among the files: reading it would block
            continue
        try:
            data = _read_head(path, None if max_bytes is None else max_bytes - total)
        except OSError:
            continue  # an unreadable file in the stdlib (permissions) is simply skipped
        if not data:
            continue
        chunks.append(data)
        total += len(data)
        used += 1
        if max_bytes is not None and total >= max_bytes:
            break
    return b"".join(chunks), used


def load_corpus(path: str | os.PathLike | None = None, *, block_size: int,
                max_bytes: int | None = DEFAULT_MAX_BYTES) -> Corpus:
    """Reads the corpus and splits it 90/10 with :func:`split`.

    Args:
      path: ``None`` for the built-in standard-library corpus; a text file; or a folder, whose
        text files (by suffix, see :data:`TEXT_SUFFIXES`) are read recursively in sorted order.
      block_size: the model's context; each split must hold at least one batch window
        (``block_size + 1`` tokens).
      max_bytes: cap on the bytes read (``None``: no cap). Only that many bytes are read, from
        a file given explicitly as from a folder's files; special files (FIFOs, devices,
        sockets) are refused, or skipped inside a folder, since reading them may block.

    Raises:
      DataError: missing path, a special file, empty file or folder, or a split shorter than
        one window.
    """
    if path is None:
        folder = stdlib_dir()
        files = _files_under(folder, (".py",), _SKIP_STDLIB_DIRS)
        data, used = _read_capped(files, max_bytes)
        source = f"Python {'.'.join(map(str, sys.version_info[:3]))} stdlib sources ({folder})"
        hint = "pass --data PATH with a text file or a folder of text files"
        shown = str(folder)
        if not data:  # e.g. an interpreter shipped with compiled .pyc files only
            raise DataError(
                f"the built-in corpus found no Python sources (.py) under {folder}, this "
                f"interpreter's standard library; {hint}.")
    else:
        p = Path(path).expanduser()
        shown = str(path)
        hint = "pass --data with a non-empty text file or a folder of text files"
        if not p.exists():
            raise DataError(f"--data {shown}: no such file or folder; {hint}.")
        if p.is_dir():
            files = _files_under(p, TEXT_SUFFIXES)
            if not files:
                raise DataError(
                    f"--data {shown}: the folder holds no text files (looked for "
                    f"{', '.join(TEXT_SUFFIXES[:5])}, ...); {hint}.")
            data, used = _read_capped(files, max_bytes)
            source = f"{len(files)} text files under {shown}"
        else:
            if not p.is_file():  # checked before opening: opening a FIFO blocks
                raise DataError(f"--data {shown}: not a regular file (a FIFO, socket or "
                                f"device); {hint}.")
            try:
                data = _read_head(p, max_bytes)
            except OSError as e:
                raise DataError(f"--data {shown}: cannot read it ({e.strerror}); {hint}.") from e
            used = 1
            source = f"file {shown}"
    if not data:
        what = "the folder's text files are all empty" if p.is_dir() else "the file is empty"
        raise DataError(f"--data {shown}: {what} (0 bytes of text); {hint}.")
    tokens = np.frombuffer(data, dtype=np.uint8)
    train, val = split(tokens)
    need = block_size + 1
    if min(train.size, val.size) < need:
        need_total = 10 * need + SPLIT_PIECES  # validation gets ~10%, in 5 pieces
        where = f"--data {shown}" if path is not None else f"the built-in corpus ({shown})"
        raise DataError(
            f"{where}: {tokens.size} bytes is too short: the 90/10 split gives "
            f"{train.size} training and {val.size} validation tokens, and each needs at least "
            f"block_size+1 = {need}. Use at least {need_total} bytes of text, or a preset with a "
            "smaller block_size.")
    fingerprint = hashlib.sha256(data).hexdigest()[:16]
    return Corpus(train=train, val=val, source=source, num_files=used, fingerprint=fingerprint)


def split(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The deterministic 90/10 split: the tokens are cut into :data:`SPLIT_PIECES` equal
    contiguous pieces and every tenth piece (the 10th, 20th, ...) goes to validation, so the
    validation set samples the whole corpus (the built-in one is sorted by module name) instead
    of only its tail."""
    bounds = np.linspace(0, tokens.size, SPLIT_PIECES + 1).astype(np.int64)
    pieces = [tokens[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    val = [p for i, p in enumerate(pieces) if i % 10 == 9]
    train = [p for i, p in enumerate(pieces) if i % 10 != 9]
    return np.concatenate(train), np.concatenate(val)


def _windows(tokens: np.ndarray, rng: np.random.Generator, batch_size: int, block_size: int):
    offsets = rng.integers(0, tokens.size - block_size, size=batch_size)
    idx = offsets[:, None] + np.arange(block_size + 1)[None, :]
    chunk = tokens[idx].astype(np.int32)
    return {"inputs": chunk[:, :-1], "targets": chunk[:, 1:]}


def get_batch(tokens: np.ndarray, *, seed: int, step: int, batch_size: int,
              block_size: int) -> dict[str, np.ndarray]:
    """The training batch for ``step``: a pure function of ``(seed, step)``.

    Returns ``{"inputs": int32[B, T], "targets": int32[B, T]}`` with targets shifted by one.
    """
    rng = np.random.default_rng([seed, 0, step])
    return _windows(tokens, rng, batch_size, block_size)


def eval_batches(tokens: np.ndarray, *, seed: int, num_batches: int, batch_size: int,
                 block_size: int) -> list[dict[str, np.ndarray]]:
    """A fixed list of validation batches (the same at every evaluation, so losses compare)."""
    return [_windows(tokens, np.random.default_rng([seed, 1, i]), batch_size, block_size)
            for i in range(num_batches)]
