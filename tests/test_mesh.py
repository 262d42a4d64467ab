"""The train step on a mesh of 8 virtual CPU devices: data parallel, FSDP, tensor parallel.

Everything runs in ONE subprocess (``XLA_FLAGS=--xla_force_host_platform_device_count=8``):
the layouts' steps, the single-device references, the NaN skip and the partitioned HLO's
collectives, reported as JSON and asserted here.
"""

from __future__ import annotations

import json
import os
import sys
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import multihost  # tests/multihost.py
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp
from jaxamp.diagnostics import format_collectives

F32 = "float32"
BF16 = "params=float32,compute=bfloat16,output=float32"
F16 = "params=float32,compute=float16,output=float32"

# A small transformer block whose params carry Flax logical partitioning metadata and whose
# activations carry logical constraints (and, on a mesh, one jax.lax.with_sharding_constraint).
VOCAB, D, HEADS, MLP, T = 32, 32, 4, 64, 8


def _part(init, names):
    return nn.with_logical_partitioning(init, names)


class Attention(nn.Module):
    """Causal self-attention, heads split over the ``heads`` logical axis. (Flax's
    ``MultiHeadDotProductAttention`` cannot take logical partitioning metadata under a mesh:
    ``DenseGeneral`` boxes its flattened 2-D kernel with the 3-D names.)"""

    @nn.compact
    def __call__(self, x):
        kv = D // HEADS
        qkv_w = self.param("qkv", _part(nn.initializers.xavier_uniform(),
                                        ("embed", None, "heads", "kv")), (D, 3, HEADS, kv))
        out_w = self.param("out", _part(nn.initializers.xavier_uniform(),
                                        ("heads", "kv", "embed")), (HEADS, kv, D))
        q, k, v = jnp.unstack(jnp.einsum("btd,dshk->sbthk", x, qkv_w), axis=0)
        q = nn.with_logical_constraint(q, ("batch", "length", "heads", "kv"))
        scores = jnp.einsum("bqhk,bthk->bhqt", q, k) / np.sqrt(kv)
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        y = jnp.einsum("bhqt,bthk->bqhk", weights, v)
        return jnp.einsum("bqhk,hkd->bqd", y, out_w)


class Block(nn.Module):
    spmd: bool = False  # adds a bare-PartitionSpec sharding constraint (needs a mesh)

    @nn.compact
    def __call__(self, ids):
        embed = self.param("embed", _part(nn.initializers.normal(0.5), ("vocab", "embed")),
                           (VOCAB, D))
        x = jnp.take(embed, ids, axis=0)
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        h = nn.LayerNorm(name="ln1")(x)
        x = x + Attention(name="attn")(h)
        h = nn.LayerNorm(name="ln2")(x)
        h = nn.Dense(MLP, name="fc", kernel_init=_part(nn.initializers.xavier_uniform(),
                                                       ("embed", "mlp")))(h)
        h = nn.with_logical_constraint(nn.gelu(h), ("batch", "length", "mlp"))
        x = x + nn.Dense(D, name="proj", kernel_init=_part(nn.initializers.xavier_uniform(),
                                                           ("mlp", "embed")))(h)
        if self.spmd:
            x = jax.lax.with_sharding_constraint(x, P("data"))
        return nn.Dense(VOCAB, name="head", kernel_init=_part(
            nn.initializers.xavier_uniform(), ("embed", "vocab")))(x)


def lm_loss(apply_fn, params, batch):
    logits = apply_fn({"params": params}, batch[:, :-1])
    return jaxamp.softmax_cross_entropy(logits, batch[:, 1:])


#: layout -> (mesh shape, axis names, logical axis rules)
LAYOUTS = {
    "dp8": ((8,), ("data",), [("batch", "data")]),
    "fsdp8": ((8,), ("data",), [("batch", "data"), ("embed", "data")]),
    "dp2_tp4": ((2, 4), ("data", "model"),
                [("batch", "data"), ("mlp", "model"), ("heads", "model"),
                 ("vocab", "model")]),
    "fsdp2_tp4": ((2, 4), ("data", "model"),
                  [("batch", "data"), ("embed", "data"), ("mlp", "model"),
                   ("heads", "model"), ("vocab", "model")]),
}


def _setup(batch_size=16, seed=0):
    ids = jax.random.randint(jax.random.key(seed), (batch_size, T + 1), 0, VOCAB)
    params = Block().init(jax.random.key(1), ids[:, :-1])["params"]
    return params, ids


def _rel(a, b) -> float:
    """max |a - b| / max |b| over a tree's leaves."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return max(float(jnp.max(jnp.abs(jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32)))
                     / max(float(jnp.max(jnp.abs(jnp.asarray(y, jnp.float32)))), 1e-30))
               for x, y in zip(la, lb))


def _host(tree):
    """Global arrays to host numpy (fine on one host; every leaf addressable here)."""
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), nn.unbox(tree))


def run_steps(policy, micro_batches, layout=None, steps=5, lr=0.5):
    """(losses, grad norms, final params on the host, step, state, mesh, batch)."""
    params, ids = _setup()
    tx = optax.sgd(lr)
    kw = {}
    if layout is None:
        model, mesh = Block(), None
        state = jaxamp.TrainState.create(model, params, tx, policy=policy)
        batch = ids
    else:
        shape, names, rules = LAYOUTS[layout]
        mesh = Mesh(np.array(jax.devices()).reshape(shape), names)
        model = Block(spmd=True)
        state = jaxamp.shard_state(
            jaxamp.TrainState.create(model, params, tx, policy=policy), mesh, axis_rules=rules)
        batch = jax.device_put(ids, NamedSharding(mesh, P("data")))
        kw = {"mesh": mesh, "axis_rules": rules}
    step = jaxamp.make_train_step(model, lm_loss, micro_batches=micro_batches, **kw)
    losses, norms = [], []
    for _ in range(steps):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    return losses, norms, state, step, mesh, batch


def _rel_list(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def script() -> dict:
    """Run on 8 devices; returns the JSON report the test asserts."""
    assert jax.device_count() == 8, jax.devices()
    out: dict = {"f32": {}, "amp": {}}
    refs = {}
    for mb in (1, 2):
        refs[(F32, mb)] = run_steps(F32, mb)
    for layout in LAYOUTS:
        for mb in (1, 2):
            losses, norms, state, step, mesh, batch = run_steps(F32, mb, layout)
            r_losses, r_norms, r_state, *_ = refs[(F32, mb)]
            specs = {jax.tree_util.keystr(k): list(v.sharding.spec) for k, v in
                     jax.tree_util.tree_leaves_with_path(state.params)}
            out["f32"][f"{layout}/mb{mb}"] = {
                "loss": _rel_list(losses, r_losses), "grad_norm": _rel_list(norms, r_norms),
                "params": _rel(_host(state.params), _host(r_state.params)),
                "moved": max(float(np.max(np.abs(a - b))) for a, b in zip(
                    jax.tree.leaves(_host(r_state.params)), jax.tree.leaves(_host(_setup()[0])))),
                "compiles": step._cache_size(),
                "kernel_spec": specs["['fc']['kernel'].value"],
                "embed_spec": specs["['embed'].value"],
            }
    # AMP: each layout against the single-device AMP run, and that against float32
    for policy, name, runs in ((BF16, "bf16", (("fsdp2_tp4", 2), ("dp8", 1))),
                               (F16, "f16", (("dp2_tp4", 2),))):
        ref_amp = run_steps(policy, 1)
        for layout, mb in runs:
            losses, norms, state, *_ = run_steps(policy, mb, layout)
            out["amp"][f"{name}/{layout}/mb{mb}"] = {
                "loss": _rel_list(losses, ref_amp[0]),
                "params": _rel(_host(state.params), _host(ref_amp[2].params)),
                "one_device_vs_f32_loss": _rel_list(ref_amp[0], refs[(F32, 1)][0]),
                "one_device_vs_f32_params": _rel(_host(ref_amp[2].params),
                                                 _host(refs[(F32, 1)][2].params)),
            }
    out["nan"] = nan_skip()
    out["nnx"] = nnx_dp()
    out["hlo"] = hlo_collectives()
    return out


# ---- an NNX model on the mesh: the same step, data parallel over 8 devices ------------------
class NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(16, 32, rngs=rngs)
        self.ln = nnx.LayerNorm(32, rngs=rngs)
        self.fc2 = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.fc2(nnx.gelu(self.ln(self.fc1(x))))


def _nnx_run(micro_batches, mesh):
    """5 plain-SGD float32 steps of NnxNet: (losses, params on the host, compiles)."""
    model = NnxNet(nnx.Rngs(0))
    batch = {"x": jax.random.normal(jax.random.key(1), (16, 16)), "y": jnp.arange(16) % 4}
    state = jaxamp.TrainState.create(model, tx=optax.sgd(0.5), policy=F32)
    kw = {}
    if mesh is not None:
        state = jaxamp.shard_state(state, mesh)
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
        kw = {"mesh": mesh}
    step = jaxamp.make_train_step(
        loss_fn=lambda m, b: jaxamp.softmax_cross_entropy(m(b["x"]), b["y"]),
        micro_batches=micro_batches, **kw)
    losses = []
    for _ in range(5):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    return losses, _host(state.params), step._cache_size()


def nnx_dp() -> dict:
    mesh = Mesh(np.array(jax.devices()), ("data",))
    ref_losses, ref_params, _ = _nnx_run(1, None)
    out = {}
    for mb in (1, 2):
        losses, params, compiles = _nnx_run(mb, mesh)
        out[f"mb{mb}"] = {"loss": _rel_list(losses, ref_losses),
                          "params": _rel(params, ref_params), "compiles": compiles,
                          "moved": abs(ref_losses[-1] - ref_losses[0])}
    return out


def nan_skip() -> dict:
    """A NaN in the shard of one device (FSDP 2 x TP 4): every device skips, state identical."""
    params, ids = _setup()
    shape, names, rules = LAYOUTS["fsdp2_tp4"]
    mesh = Mesh(np.array(jax.devices()).reshape(shape), names)
    model = Block(spmd=True)
    state = jaxamp.shard_state(jaxamp.TrainState.create(model, params, optax.adam(1e-2),
                                                        policy=F16), mesh, axis_rules=rules)
    step = jaxamp.make_train_step(model, _poisonable_loss, mesh=mesh, axis_rules=rules,
                                  donate=False, micro_batches=2)
    poison = np.zeros((16,), np.float32)
    poison[11] = np.nan  # row 11: on the second device along the data axis
    batch = {"ids": jax.device_put(ids, NamedSharding(mesh, P("data"))),
             "poison": jax.device_put(poison, NamedSharding(mesh, P("data")))}
    clean = {"ids": batch["ids"], "poison": jax.device_put(np.zeros((16,), np.float32),
                                                           NamedSharding(mesh, P("data")))}
    state, _ = step(state, clean)
    new, m = step(state, batch)
    same = all(np.array_equal(np.asarray(jax.device_get(a)), np.asarray(jax.device_get(b)))
               for a, b in zip(jax.tree.leaves((state.params, state.opt_state.inner_state)),
                               jax.tree.leaves((new.params, new.opt_state.inner_state))))
    shards_same = all(
        all(np.array_equal(np.asarray(s.data), np.asarray(t.data))
            for s, t in zip(a.addressable_shards, b.addressable_shards))
        for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(new.params)))
    return {"skipped": bool(m["skipped"]), "identical": same and shards_same,
            "loss_scale": [float(state.loss_scale.loss_scale),
                           float(new.loss_scale.loss_scale)],
            "skipped_steps": int(new.skipped_steps)}


def _poisonable_loss(apply_fn, params, batch):
    logits = apply_fn({"params": params}, batch["ids"][:, :-1])
    logits = logits + batch["poison"][:, None, None]
    return jaxamp.softmax_cross_entropy(logits, batch["ids"][:, 1:])


def hlo_collectives() -> dict:
    """The partitioned program's collectives, FSDP 2 x TP 4 (and FSDP 8), f32 vs bf16."""
    out = {}
    for layout, policy, name in (("fsdp2_tp4", F32, "f32"), ("fsdp2_tp4", BF16, "bf16"),
                                 ("fsdp8", BF16, "bf16")):
        if True:
            params, ids = _setup()
            shape, names, rules = LAYOUTS[layout]
            mesh = Mesh(np.array(jax.devices()).reshape(shape), names)
            model = Block(spmd=True)
            state = jaxamp.shard_state(jaxamp.TrainState.create(model, params, optax.sgd(0.1),
                                                                policy=policy),
                                       mesh, axis_rules=rules)
            step = jaxamp.make_train_step(model, lm_loss, mesh=mesh, axis_rules=rules)
            batch = jax.device_put(ids, NamedSharding(mesh, P("data")))
            out[f"{layout}/{name}"] = jaxamp.collectives(step, state, batch)
    # the matmul weights as a device sees them once gathered over the data axis
    out["weight_shapes"] = {}
    for layout in ("fsdp2_tp4", "fsdp8"):
        shape, names, rules = LAYOUTS[layout]
        mesh = Mesh(np.array(jax.devices()).reshape(shape), names)
        shapes = []
        for x in (params["attn"]["qkv"], params["attn"]["out"], params["fc"]["kernel"],
                  params["proj"]["kernel"], params["head"]["kernel"]):
            spec = nn.logical_to_mesh_axes(x.names, rules)
            local = [n // (mesh.shape[a] if a not in (None, "data") else 1)
                     for n, a in zip(x.value.shape, tuple(spec) + (None,) * 4)]
            shapes.append(local)
        out["weight_shapes"][layout] = shapes
    return out


def test_layouts_on_8_virtual_devices(tmp_path):
    out = multihost.script_on_devices("test_mesh")  # conftest: XLA:CPU's cheap compile
    if os.environ.get("JAXAMP_MESH_REPORT"):  # keep the numbers (for the report)
        with open(os.environ["JAXAMP_MESH_REPORT"], "w") as f:
            json.dump(out, f, indent=1)

    # float32, plain SGD, no clip: every layout equals one device on the global batch
    assert len(out["f32"]) == 8
    for key, r in out["f32"].items():
        assert r["moved"] > 1e-2, key  # SGD moved the params: a constant factor would show
        assert r["loss"] < 1e-5 and r["grad_norm"] < 1e-5 and r["params"] < 1e-5, (key, r)
        assert r["compiles"] == 1, key  # output state keeps its shardings: one compile
    assert out["f32"]["fsdp2_tp4/mb1"]["kernel_spec"] == ["data", "model"]
    assert out["f32"]["fsdp8/mb2"]["embed_spec"] == [None, "data"]
    assert out["f32"]["dp8/mb1"]["kernel_spec"] == [None, None]

    # bf16 / f16: the mesh run is as close to the one-device AMP run as that is to float32
    # (measured: bf16 loss 1.1e-4 vs 1.2e-4, params 3.3e-3 vs 4.1e-3; f16 1.1e-5 vs 2.2e-5)
    for key, r in out["amp"].items():
        assert r["loss"] <= 1.5 * r["one_device_vs_f32_loss"], (key, r)
        assert r["params"] <= 1.5 * r["one_device_vs_f32_params"], (key, r)

    # an NNX model, data parallel over 8 devices, with and without micro-batches: the same
    # plain-SGD float32 run as on one device
    for key, r in out["nnx"].items():
        assert r["moved"] > 1e-2 and r["compiles"] == 1, (key, r)
        assert r["loss"] < 1e-5 and r["params"] < 1e-5, (key, r)

    # a NaN on one device's shard: every device skips, the state is bit-identical
    assert out["nan"]["skipped"] and out["nan"]["identical"], out["nan"]
    assert out["nan"]["loss_scale"][1] == out["nan"]["loss_scale"][0] / 2
    assert out["nan"]["skipped_steps"] == 1

    # the partitioned program: every reduction across the data axis is float32, even under
    # the bf16 policy (the weight gradients among them); the matmul weights are all-gathered
    # in bf16 (cast before the gather). (The embedding lookup gathers its table as stored.)
    weight_shapes = out["hlo"].pop("weight_shapes")
    for key, rows in out["hlo"].items():
        reduces = [r for r in rows if r["kind"] in ("all-reduce", "reduce-scatter")
                   and "data" in (r["axes"] or ())]
        wgrads = [r for r in reduces if "transpose(" in r["op_name"]
                  and r["op_name"].endswith("dot_general")]
        assert len(wgrads) >= 5, (key, reduces)
        assert {r["dtype"] for r in reduces} == {"float32"}, (key, reduces)
        gathers = [r for r in rows if r["kind"] == "all-gather" and "data" in (r["axes"] or ())
                   and r["shape"] in weight_shapes[key.split("/")[0]]]
        want = "bfloat16" if key.endswith("bf16") else "float32"
        assert len(gathers) >= 5 and {r["dtype"] for r in gathers} == {want}, (key, gathers)
        # on a mesh the norm sums each leaf where it lies: concatenating the vector leaves (as
        # one device does) moved them, 24 more collectives in FSDP 2 x TP 4, 7 of them for the
        # concatenation itself
        assert not [r for r in rows if r["op_name"].endswith("concatenate")], (key, rows)
    # what crosses the wire, FSDP 2 x TP 4: bf16 moves fewer bytes than f32, not more
    wire = {k: sum(r["wire_bytes"] for r in rows) for k, rows in out["hlo"].items()}
    assert wire["fsdp2_tp4/bf16"] < wire["fsdp2_tp4/f32"], wire


# ---- on one device: errors before anything compiles ---------------------------------------
def _mesh1(names=("data",)):
    return Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(names)), names)


def test_shard_state_names_the_leaf_for_an_unknown_mesh_axis():
    params, _ = _setup()
    state = jaxamp.TrainState.create(Block(), params, optax.sgd(0.1), policy=F32)
    with pytest.raises(ValueError, match=r"\['fc'\]\['kernel'\].*mesh axis 'model'.*"
                                         r"axes: \('data',\)"):
        jaxamp.shard_state(state, _mesh1(), axis_rules=[("mlp", "model")])
    with pytest.raises(ValueError, match="logical partitioning names.*axis_rules"):
        jaxamp.shard_state(state, _mesh1())
    with pytest.raises(TypeError, match="axis_rules must be a sequence of"):
        jaxamp.shard_state(state, _mesh1(), axis_rules="batch=data")


def test_make_train_step_rejects_bad_mesh_arguments():
    with pytest.raises(ValueError, match="data_axis 'batch' is not an axis of the mesh"):
        jaxamp.make_train_step(Block(), lm_loss, mesh=_mesh1(), data_axis="batch")
    with pytest.raises(ValueError, match="axis_rules= maps logical axes.*pass mesh="):
        jaxamp.make_train_step(Block(), lm_loss, axis_rules=[("batch", "data")])
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        jaxamp.make_train_step(Block(), lm_loss, mesh="data=8")


def test_example_mesh_flag_is_checked_before_anything_runs():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    import lm_mesh

    assert lm_mesh.parse_mesh("data=4,model=2") == {"data": 4, "model": 2}
    assert lm_mesh.parse_mesh("data=8") == {"data": 8, "model": 1}
    for bad in ("data=4,data=2", "pipe=2", "data=0", "data4"):
        with pytest.raises(ValueError, match=r"expected data=D\[,model=M\]"):
            lm_mesh.parse_mesh(bad)
    n = jax.device_count() + 1
    with pytest.raises(ValueError, match=rf"data x model = {n} devices, but JAX sees {n - 1}"):
        lm_mesh.check_mesh(f"data={n}", 16, 1, 4, 128, 256)


_HLO = """
ENTRY %main {
  %dot.1 = bf16[32,32]{1,0} dot(%a, %b), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  %all-reduce.1 = bf16[32,32]{1,0} all-reduce(%dot.1), channel_id=3, replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}, use_global_device_ids=true, to_apply=%add, metadata={op_name="jit(loss)/transpose(jvp())/mlp/fc/dot_general"}
  %p = f32[8,32]{1,0} parameter(0)
  %all-gather.2 = f32[8,128]{1,0} all-gather(%p), channel_id=4, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={1}, use_global_device_ids=true
  %all-reduce.3 = f32[] all-reduce(%s), channel_id=5, replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_1'}, use_global_device_ids=true, to_apply=%add
}
"""  # noqa: E501 (HLO as XLA prints it)


def test_hlo_collectives_reads_kinds_dtypes_bytes_and_mesh_axes():
    from jaxamp.diagnostics._collectives import hlo_collectives

    # what is read of a (data=2, model=4) mesh: its shape and names (no 8 devices needed)
    mesh = types.SimpleNamespace(devices=np.zeros((2, 4)), axis_names=("data", "model"),
                                 size=8)
    rows = hlo_collectives(_HLO, mesh)
    assert [(r["kind"], r["dtype"], r["shape"], r["axes"]) for r in rows] == [
        ("all-reduce", "bfloat16", [32, 32], ("data",)),
        ("all-gather", "float32", [8, 128], ("model",)),
        ("all-reduce", "float32", [], ("data",)),
    ]
    assert rows[0]["bytes"] == 32 * 32 * 2 and rows[0]["wire_bytes"] == 2048  # 2(n-1)/n, n=2
    assert rows[1]["bytes"] == 8 * 128 * 4 and rows[1]["wire_bytes"] == 3 * 8 * 32 * 4
    assert rows[0]["op_name"].endswith("mlp/fc/dot_general")
    table = format_collectives(rows)
    assert "| all-reduce | bfloat16 | 32x32 | data | 2048 | 2048 |" in table
    assert "bfloat16 2048, float32 3076, total 5124" in table
