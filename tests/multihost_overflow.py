"""Run as two processes by tests/test_multihost.py: ``jaxamp.locate_overflow`` on a model
whose params are split across both hosts (one device each, ``model`` axis), planted overflow
in ``fc2``. Prints the report's rows as JSON (first host). Without an argument: the same on
this process's devices (the reference)."""

from __future__ import annotations

import json
import os

import jax

if os.environ.get("JAX_COORDINATOR_ADDRESS"):
    jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"],
                               int(os.environ["JAX_NUM_PROCESSES"]),
                               int(os.environ["JAX_PROCESS_ID"]))

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxamp  # noqa: E402


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(64, name="fc1")(x))
        h = nn.Dense(64, name="fc2")(h)
        return nn.Dense(8, name="head")(nn.LayerNorm(name="ln")(h))


def main() -> None:
    x = jax.random.normal(jax.random.key(1), (4, 16))
    params = Net().init(jax.random.key(0), x)["params"]
    params = jax.tree_util.tree_map_with_path(
        lambda p, v: v * 3e4 if "fc2" in jax.tree_util.keystr(p) and v.ndim == 2 else v,
        params)
    mesh = Mesh(np.array(jax.devices()), ("model",))

    def place(v):  # kernels split over `model` (columns), the rest replicated
        v = np.asarray(v)
        spec = P(None, "model") if v.ndim == 2 and v.shape[1] % mesh.size == 0 else P()
        return jax.make_array_from_callback(v.shape, NamedSharding(mesh, spec), v.__getitem__)
    params = jax.tree.map(place, params)
    report = jaxamp.locate_overflow(
        Net().apply, {"params": params}, x, loss_scale=1024.0,
        loss_fn=lambda y: jnp.mean(y.astype(jnp.float32) ** 2))
    if jax.process_index() == 0:
        print(json.dumps({"first": report.first_nonfinite, "overflowing": report.overflowing,
                          "rows": report.to_dict()["rows"]}, sort_keys=True))


if __name__ == "__main__":
    main()
