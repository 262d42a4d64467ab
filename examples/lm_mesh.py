"""``--mesh data=D,model=M`` for train_lm.py: the mesh, the GPT's partitioning, sharded batches.

Data parallel over ``data``, Megatron-style tensor parallel over ``model``: the attention's
``qkv`` and the MLP's ``fc`` split their output features (column parallel), the attention and
MLP ``proj`` their input features (row parallel), the (tied) embedding its vocabulary; every
other param replicated. The optimizer state follows the params
(``jaxamp.sharding.state_shardings``).
``jaxamp.make_train_step(mesh=...)`` runs one partitioned program on it.

Several hosts: run the same command on every host with ``JAX_COORDINATOR_ADDRESS=host:port``,
``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` set; :func:`initialize_distributed` calls
``jax.distributed.initialize`` with them, and :func:`shard_batch` builds each global batch from
the rows this host's devices hold (no host ever reads the whole of a global array).
"""

from __future__ import annotations

import os
import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxamp.sharding import state_shardings

__all__ = ["barrier", "check_mesh", "initialize_distributed", "make_mesh", "param_specs", "place",
           "shard_batch", "shard_state", "state_shardings_on", "step_kwargs"]

AXES = ("data", "model")


def initialize_distributed() -> None:
    """``jax.distributed.initialize`` from ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``,
    ``JAX_PROCESS_ID`` (a no-op without them: one host)."""
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if address:
        jax.distributed.initialize(coordinator_address=address,
                                   num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                                   process_id=int(os.environ["JAX_PROCESS_ID"]))


def barrier(name: str) -> None:
    """Waits for every host to get here (nothing to wait for on one host)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def parse_mesh(spec: str) -> dict[str, int]:
    """``"data=4,model=2"`` -> ``{"data": 4, "model": 2}`` (raises ValueError, saying why)."""
    sizes: dict[str, int] = {}
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\w+)\s*=\s*(\d+)\s*", part)
        if not m or m.group(1) not in AXES or m.group(1) in sizes or int(m.group(2)) < 1:
            raise ValueError(f"--mesh {spec!r}: expected data=D[,model=M] with each axis once "
                             f"and sizes >= 1 (axes: {', '.join(AXES)}), e.g. --mesh "
                             "data=4,model=2")
        sizes[m.group(1)] = int(m.group(2))
    return {a: sizes.get(a, 1) for a in AXES}


def check_mesh(spec: str | None, batch_size: int, micro_batches: int, n_head: int,
               d_model: int, vocab_size: int) -> dict[str, int] | None:
    """The parsed ``--mesh``, checked against the devices and the model before anything
    compiles (None without ``--mesh``)."""
    if spec is None:
        return None
    sizes = parse_mesh(spec)
    n = sizes["data"] * sizes["model"]
    if n != jax.device_count():
        raise ValueError(f"--mesh {spec}: data x model = {n} devices, but JAX sees "
                         f"{jax.device_count()}; make the product {jax.device_count()} (on CPU, "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={n} gives {n})")
    if batch_size % (sizes["data"] * micro_batches):
        raise ValueError(f"--batch-size {batch_size} must be divisible by the data axis "
                         f"({sizes['data']}) x --micro-batches ({micro_batches})")
    for what, size in (("n_head", n_head), ("d_model", d_model), ("vocab", vocab_size)):
        if size % sizes["model"]:
            raise ValueError(f"--mesh {spec}: the model's {what} ({size}) must be divisible "
                             f"by the model axis ({sizes['model']})")
    return sizes


def make_mesh(sizes: dict[str, int]) -> Mesh:
    devices = np.array(jax.devices()).reshape(sizes["data"], sizes["model"])
    return Mesh(devices, AXES)


def param_specs(params) -> dict:
    """A PartitionSpec per param of ``lm_model.GPT`` (stacked blocks: a leading layer axis)."""
    def spec(path, x):
        key = jax.tree_util.keystr(path)
        lead = (None,) * (x.ndim - 2)  # the stacked layer axis, if any
        if re.search(r"\['(qkv|fc)'\]\['kernel'\]", key):
            return P(*lead, None, "model")  # column parallel
        if re.search(r"\['(qkv|fc)'\]\['bias'\]", key):
            return P(*(None,) * (x.ndim - 1), "model")
        if re.search(r"\['proj'\]\['kernel'\]", key):
            return P(*lead, "model", None)  # row parallel
        if re.search(r"\['embed'\]\['embedding'\]", key):
            return P("model", None)  # vocabulary parallel
        return P()
    return jax.tree_util.tree_map_with_path(spec, params)


def state_shardings_on(state, mesh: Mesh):
    """The ``NamedSharding`` of every leaf of ``state`` (arrays or ``jax.ShapeDtypeStruct``s):
    params on :func:`param_specs`, the rest on jaxamp's defaults (optimizer moments follow
    their params)."""
    params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
        state.params, param_specs(state.params))
    return state_shardings(state.replace(params=params), mesh)


def shard_state(state, mesh: Mesh):
    """The state placed on :func:`state_shardings_on`."""
    return jax.device_put(state, state_shardings_on(state, mesh))


def place(abstract_state, mesh: Mesh | None):
    """``abstract_state`` (``jax.ShapeDtypeStruct`` leaves) with the shardings
    :func:`shard_state` gives, so a checkpoint is restored straight onto the mesh, each host
    reading only its shards (unchanged without a mesh)."""
    if mesh is None:
        return abstract_state
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        abstract_state, state_shardings_on(abstract_state, mesh))


def shard_batch(batch, mesh: Mesh | None):
    """A global batch split over ``data``, each host placing only the rows its own devices
    hold (the same seed gives every host the same global batch)."""
    if mesh is None:
        return batch
    sharding = NamedSharding(mesh, P("data"))

    def one(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
    return jax.tree.map(one, batch)


def step_kwargs(mesh: Mesh | None) -> dict:
    """What ``jaxamp.make_train_step`` needs for the mesh."""
    return {} if mesh is None else {"mesh": mesh}
