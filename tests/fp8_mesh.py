"""FP8 matmuls on 8 virtual devices (DP and FSDP): run in one subprocess by
``tests/test_fp8.py`` through :func:`multihost.script_on_devices` (``script()`` returns JSON)."""

from __future__ import annotations

from collections import Counter

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_mesh import LAYOUTS, Block, _host, _rel, _rel_list, _setup, lm_loss

import jaxamp

FP8 = "params=float32,compute=bfloat16,output=float32,matmul=float8"
BF16 = "params=float32,compute=bfloat16,output=float32"
RULES = jaxamp.DEFAULT_OP_RULES.extend(
    handlers={"dot_general": jaxamp.FP8Matmuls(small=(0, 0), min_size=0)})


def _run(policy, layout=None, steps=4, micro_batches=1):
    params, ids = _setup()
    tx = optax.sgd(0.5)
    kw, batch = {}, ids
    if layout is None:
        model = Block()
        state = jaxamp.TrainState.create(model, params, tx, policy=policy)
    else:
        shape, names, rules = LAYOUTS[layout]
        mesh = Mesh(np.array(jax.devices()).reshape(shape), names)
        model = Block(spmd=True)
        state = jaxamp.shard_state(jaxamp.TrainState.create(model, params, tx, policy=policy),
                                   mesh, axis_rules=rules)
        batch = jax.device_put(ids, NamedSharding(mesh, P("data")))
        kw = {"mesh": mesh, "axis_rules": rules}
    # f32_weight_grads as on a mesh, so that one device runs the same program
    step = jaxamp.make_train_step(model, lm_loss, micro_batches=micro_batches, op_rules=RULES,
                                  f32_weight_grads=True, **kw)
    losses = []
    table = jaxamp.collectives(step, state, batch) if layout else []
    for _ in range(steps):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    return losses, _host(state.params), table


def _key(row) -> str:
    return f"{row['kind']} {row['dtype']} {'x'.join(map(str, row['shape'])) or 'scalar'}"


def _size_key(row) -> str:
    """kind, dtype and element count: a weight gradient all-reduced in another axis order
    (``4x8x32`` for ``32x4x8``) is the same collective."""
    return f"{row['kind']} {row['dtype']} {int(np.prod(row['shape'], dtype=np.int64))}"


def script() -> dict:
    assert jax.device_count() == 8, jax.devices()
    ref8 = _run(FP8)
    ref_bf16 = _run(BF16)
    f32 = _run("float32")
    start = _host(_setup()[0])
    out = {"one_device": {"fp8_vs_f32_loss": _rel_list(ref8[0], f32[0]),
                          "bf16_vs_f32_loss": _rel_list(ref_bf16[0], f32[0]),
                          "fp8_vs_f32_params": _rel(ref8[1], f32[1]),
                          "moved": max(float(np.max(np.abs(a - b))) for a, b in zip(
                              jax.tree.leaves(ref8[1]), jax.tree.leaves(start)))}}
    for layout, mb in (("dp8", 1), ("fsdp8", 2)):
        if True:
            losses, params, table = _run(FP8, layout, micro_batches=mb)
            _, _, bf16_table = _run(BF16, layout, steps=0, micro_batches=mb)
            added = Counter(_key(r) for r in table) - Counter(_key(r) for r in bf16_table)
            removed = Counter(_key(r) for r in bf16_table) - Counter(_key(r) for r in table)
            mine, theirs = Counter(map(_size_key, table)), Counter(map(_size_key, bf16_table))
            out[f"{layout}/mb{mb}"] = {
                "loss": _rel_list(losses, ref8[0]), "params": _rel(params, ref8[1]),
                "vs_f32_loss": _rel_list(losses, f32[0]), "vs_f32_params": _rel(params, f32[1]),
                "added": dict(added), "removed": dict(removed),
                "net_added": dict(mine - theirs), "net_removed": dict(theirs - mine),
                "wire_bytes": sum(r["wire_bytes"] for r in table),
                "bf16_wire_bytes": sum(r["wire_bytes"] for r in bf16_table)}
    return out
