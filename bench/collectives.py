#!/usr/bin/env python
"""Bytes communicated per train step on a mesh, float32 vs bfloat16 policy.

The example GPT on 8 virtual CPU devices, ``--mesh data=D,model=M`` (``examples/lm_mesh.py``;
``--fsdp`` also splits over ``data`` the params ``model`` leaves whole). Every collective of
the partitioned program (:func:`jaxamp.collectives`: what a GPU runs) is summed by kind and
dtype, as the bytes each device sends per step (ring estimate)::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python bench/collectives.py --mesh data=4,model=2 [--fsdp] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import jax  # noqa: E402
import lm_mesh  # noqa: E402
import lm_model  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxamp  # noqa: E402

POLICIES = {"float32": "float32", "bfloat16": "params=float32,compute=bfloat16,output=float32"}


def _fsdp(state, mesh):
    """Params (and what mirrors them) not split over ``model``: their largest divisible
    dimension split over ``data`` too."""
    def one(x):
        spec = list(x.sharding.spec) + [None] * (x.ndim - len(x.sharding.spec))
        if "model" in spec or mesh.shape["data"] == 1:
            return x
        for d in sorted(range(x.ndim), key=lambda d: -x.shape[d]):
            if x.shape[d] % mesh.shape["data"] == 0 and spec[d] is None:
                spec[d] = "data"
                return jax.device_put(x, NamedSharding(mesh, P(*spec)))
        return x
    return jaxamp.shard_state(state.replace(params=jax.tree.map(one, state.params)), mesh)


def measure(preset: str, mesh_spec: str, fsdp: bool, batch_size: int) -> dict:
    config = lm_model.PRESETS[preset]
    sizes = lm_mesh.check_mesh(mesh_spec, batch_size, 1, config.n_head, config.d_model,
                               config.vocab_size)
    mesh = lm_mesh.make_mesh(sizes)
    model = lm_model.GPT(config)
    _, params = lm_model.init_params(config, seed=0)
    rng = np.random.default_rng(0)
    batch = rng.integers(0, config.vocab_size, (batch_size, config.block_size + 1),
                         dtype=np.int32)

    def loss_fn(apply_fn, params, batch):
        logits = apply_fn({"params": params}, batch[:, :-1])
        return jaxamp.softmax_cross_entropy(logits, batch[:, 1:])

    out = {}
    for name, policy in POLICIES.items():
        state = jaxamp.TrainState.create(model, params, optax.adamw(1e-3), policy=policy)
        state = lm_mesh.shard_state(state, mesh)
        if fsdp:
            state = _fsdp(state, mesh)
        step = jaxamp.make_train_step(model, loss_fn, mesh=mesh)
        rows = jaxamp.collectives(step, state, lm_mesh.shard_batch(batch, mesh))
        by = defaultdict(int)
        for r in rows:
            by[f"{r['kind']} {r['dtype']}"] += r["wire_bytes"]
        grad_reduce = {r["dtype"] for r in rows if r["kind"] in ("all-reduce", "reduce-scatter")
                       and "data" in (r["axes"] or ()) and "transpose(" in r["op_name"]}
        out[name] = {"collectives": len(rows), "wire_bytes": sum(r["wire_bytes"] for r in rows),
                     "by_kind_dtype": dict(sorted(by.items())),
                     "data_axis_grad_reduction_dtypes": sorted(grad_reduce)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--mesh", default="data=4,model=2")
    p.add_argument("--fsdp", action="store_true")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    res = measure(args.preset, args.mesh, args.fsdp, args.batch_size)
    res["config"] = vars(args)
    f32, bf16 = res["float32"]["wire_bytes"], res["bfloat16"]["wire_bytes"]
    print("| collective | float32 policy (bytes) | bfloat16 policy (bytes) |")
    print("|---|---:|---:|")
    keys = sorted(set(res["float32"]["by_kind_dtype"]) | set(res["bfloat16"]["by_kind_dtype"]))
    for k in keys:
        print(f"| {k} | {res['float32']['by_kind_dtype'].get(k, 0):,} | "
              f"{res['bfloat16']['by_kind_dtype'].get(k, 0):,} |")
    print(f"| **total per device and step** | **{f32:,}** | **{bf16:,}** "
          f"({bf16 / f32:.2f}x) |")
    print("gradient reductions over data:", res["float32"]["data_axis_grad_reduction_dtypes"],
          res["bfloat16"]["data_axis_grad_reduction_dtypes"])
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
