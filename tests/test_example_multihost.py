"""train_lm.py on two hosts: two processes joined by ``jax.distributed`` (one CPU device each,
``--mesh data=1,model=2``: the tensor-parallel params split across the hosts), as the README's
multi-host command runs it.

A fresh run to step 4 (checkpoints at 2 and 4), then ``--resume`` to step 6, both on the two
processes, against the same 6 steps in one process with 2 devices. On several hosts no host may
read a whole sharded array: JAX itself refuses it (``np.asarray`` of an array that spans
another process's devices raises), so the runs finishing is the first check. Then: the losses
equal the one-process run's, only the first host wrote in ``--out`` (everything there is in the
manifest, nothing left half-written), and a checkpoint written by the two hosts verifies
(checksums computed on device, independent of the sharding) when restored on one device.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

import lm_checkpoint  # noqa: E402
import lm_files  # noqa: E402
import multihost  # noqa: E402 - tests/multihost.py
import train_lm  # noqa: E402

# model=2 spans both hosts: neither holds the whole of a tensor-parallel param
FLAGS = ["--preset", "test", "--mesh", "data=1,model=2", "--checkpoint-interval", "2",
         "--eval-interval", "2", "--no-compare-f32"]


def _train(out: Path, steps: int, *extra: str) -> list[str]:
    return [sys.executable, str(EXAMPLES / "train_lm.py"), *FLAGS, "--steps", str(steps),
            "--out", str(out), *extra]


def _losses(out: Path) -> list[tuple[int, float, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows]


def test_two_hosts_train_resume_and_checkpoint_like_one(tmp_path):
    two, one = tmp_path / "two", tmp_path / "one"
    reference = multihost.start(_train(one, 6), devices=2)  # meanwhile, in one process
    try:
        first = multihost.finish(multihost.hosts(_train(two, 4)))
        assert "summary" in first[0] and first[1] == ""  # only the first host prints
        multihost.finish(multihost.hosts(_train(two, 6, "--resume")))
    finally:
        multihost.finish([reference])

    got, want = _losses(two), _losses(one)
    assert [s for s, _, _ in got] == list(range(1, 7))
    np.testing.assert_allclose([g[1:] for g in got], [w[1:] for w in want], rtol=1e-5)

    manifest = json.loads((two / lm_files.MANIFEST).read_text())
    assert sorted(manifest["files"]) == sorted(lm_files.OUTPUT_FILES)
    assert manifest["checkpoint_steps"] == [2, 4, 6]
    written = {p.name for p in two.iterdir()}
    assert written == {*lm_files.OUTPUT_FILES, lm_files.MANIFEST, lm_files.CHECKPOINT_DIR,
                       lm_files.LOCK_FILE}
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == ["2", "4", "6"]

    # The two hosts' checkpoint, restored here on one device and checked against the
    # checksums they computed on their shards; it equals the one-process run's.
    s = train_lm.validate(train_lm.build_parser().parse_args(
        [*FLAGS[:2], "--steps", "6", "--out", str(tmp_path / "unused")]))
    abstract = train_lm.create_state(train_lm.build_model(s), train_lm.make_optimizer(s.args),
                                     s, abstract=True)
    states = []
    for out in (two, one):
        with lm_checkpoint.manager(out / "checkpoints", create=False) as mgr:
            where = out / "checkpoints" / "6"
            _, integrity = lm_checkpoint.restore_meta(mgr, 6, where)
            assert integrity["format"] == 2
            states.append(lm_checkpoint.restore_state(mgr, 6, where, abstract, integrity))
    assert int(states[0].step) == 6
    for a, b in zip(jax.tree.leaves(states[0]), jax.tree.leaves(states[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
