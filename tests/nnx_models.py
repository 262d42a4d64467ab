"""The NNX twin of ``models.TestNet`` (no dtype code), with the same parameter names, so one
set of weights loads into both."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from models import causal_attention


class HandAttention(nnx.Module):
    """Causal self-attention written by hand with jax.nn.softmax."""

    def __init__(self, d: int, heads: int = 2, *, rngs: nnx.Rngs):
        self.heads = heads
        self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
        self.proj = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        return self.proj(causal_attention(self.qkv(x), self.heads))


class Block(nnx.Module):
    """A transformer block: Flax attention, hand attention, LayerNorm, MLP."""

    def __init__(self, d: int, *, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.mha = nnx.MultiHeadAttention(num_heads=2, in_features=d, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = HandAttention(d, rngs=rngs)
        self.ln3 = nnx.LayerNorm(d, rngs=rngs)
        self.fc1 = nnx.Linear(d, 2 * d, rngs=rngs)
        self.fc2 = nnx.Linear(2 * d, d, rngs=rngs)

    def __call__(self, x):
        h = self.ln1(x)
        x = x + self.mha(h, h)
        x = x + self.attn(self.ln2(x))
        return x + self.fc2(nnx.gelu(self.fc1(self.ln3(x))))


class TestNet(nnx.Module):
    """Embed -> Conv -> BatchNorm -> blocks (nnx.scan over nnx.remat) -> LayerNorm -> logits."""

    __test__ = False  # not a pytest class

    def __init__(self, vocab: int = 32, dim: int = 16, layers: int = 2, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.conv = nnx.Conv(dim, dim, (3,), rngs=rngs)
        self.bn = nnx.BatchNorm(dim, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Block(dim, rngs=rngs)

        self.blocks = make(rngs)
        self.ln_f = nnx.LayerNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, rngs=rngs)

    def __call__(self, ids, train: bool = True):
        x = self.embed(ids)
        x = nnx.relu(self.bn(self.conv(x), use_running_average=not train))

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, block):
            return nnx.remat(lambda b, h: b(h))(block, x)

        x = run(x, self.blocks)
        return self.head(self.ln_f(x))


def twin_of(variables, vocab: int = 32, dim: int = 16, layers: int = 2) -> TestNet:
    """The NNX TestNet holding the linen TestNet's ``variables`` (params and batch_stats)."""
    model = TestNet(vocab, dim, layers, rngs=nnx.Rngs(0))
    params = jax.tree.map(jnp.asarray, nn.meta.unbox(variables["params"]))
    stats = variables["batch_stats"]["bn"]
    for path, var in nnx.iter_graph(model):
        if not isinstance(var, nnx.Variable):
            continue
        tree = {"bn": dict(stats, **params["bn"])} if path[0] == "bn" else params
        for key in path:
            tree = tree[key]
        assert tree.shape == var.get_value().shape, (path, tree.shape)
        var.set_value(tree)
    return model
