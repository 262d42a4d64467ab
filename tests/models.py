"""Unmodified test models (no dtype code anywhere), shared by the tests."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

import jaxamp


def causal_attention(qkv, heads: int):
    """softmax(Q K^T / sqrt(head dim) + causal mask) V from a fused ``[b, t, 3d]`` projection:
    the hand-written attention of the linen test model and its NNX twin."""
    b, t, d = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
    q, k, v = (z.reshape(b, t, heads, d // heads) for z in jnp.split(qkv, 3, axis=-1))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // heads)
    mask = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d)


class HandAttention(nn.Module):
    """Causal self-attention written by hand with jax.nn.softmax."""

    heads: int = 2

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        return nn.Dense(d, name="proj")(causal_attention(nn.Dense(3 * d, name="qkv")(x),
                                                         self.heads))


class Block(nn.Module):
    """A transformer block: Flax attention, hand attention, LayerNorm, MLP."""

    @nn.compact
    def __call__(self, x, _):
        d = x.shape[-1]
        h = nn.LayerNorm(name="ln1")(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=2, name="mha")(h, h)
        x = x + HandAttention(name="attn")(nn.LayerNorm(name="ln2")(x))
        h = nn.Dense(2 * d, name="fc1")(nn.LayerNorm(name="ln3")(x))
        x = x + nn.Dense(d, name="fc2")(nn.gelu(h))
        return x, None


class TestNet(nn.Module):
    """Embed -> Conv -> BatchNorm -> scanned+remat'd blocks -> LayerNorm -> logits."""

    vocab: int = 32
    dim: int = 16
    layers: int = 2

    @nn.compact
    def __call__(self, ids, train: bool = True):
        x = nn.Embed(self.vocab, self.dim, name="embed")(ids)
        x = nn.Conv(self.dim, (3,), name="conv")(x)
        x = nn.BatchNorm(use_running_average=not train, name="bn")(x)
        x = nn.relu(x)
        blocks = nn.scan(nn.remat(Block), variable_axes={"params": 0},
                         split_rngs={"params": True}, length=self.layers)
        x, _ = blocks(name="blocks")(x, None)
        x = nn.LayerNorm(name="ln_f")(x)
        return nn.Dense(self.vocab, name="head")(x)


def init_testnet(seed: int = 0, batch: int = 2, seq: int = 8, **kw):
    model = TestNet(**kw)
    ids = jax.random.randint(jax.random.key(seed + 1), (batch, seq), 0, model.vocab)
    variables = model.init(jax.random.key(seed), ids, train=False)
    return model, variables, ids


class MLP(nn.Module):
    """Dense -> GELU -> LayerNorm -> Dense: the train-step tests' small classifier."""

    @nn.compact
    def __call__(self, x):
        x = nn.gelu(nn.Dense(32)(x))
        x = nn.LayerNorm()(x)
        return nn.Dense(4)(x)


def ce_loss(apply_fn, params, batch):
    return jaxamp.softmax_cross_entropy(apply_fn({"params": params}, batch["x"]), batch["y"])


class CNN(nn.Module):
    """Conv -> BatchNorm -> ReLU -> Conv -> BatchNorm -> pool -> Dropout -> Dense, with
    ``train=``: the newcomer's image classifier (GitHub issue #26)."""

    classes: int = 4

    @nn.compact
    def __call__(self, x, train: bool = True):
        for features in (8, 16):
            x = nn.Conv(features, (3, 3))(x)
            x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dropout(0.2, deterministic=not train)(x)
        return nn.Dense(self.classes)(x)


def cnn_loss(apply_fn, params, batch, rng=None):
    rngs = {} if rng is None else {"dropout": rng}
    logits = apply_fn({"params": params}, batch["x"], train=True, rngs=rngs)
    return jaxamp.softmax_cross_entropy(logits, batch["y"])


def cnn_state(policy: str = "p=f32,c=f16,o=f32", seed: int = 0, batch: int = 8):
    """(model, state, batch) of :class:`CNN` on random 12x12 RGB images."""
    import optax

    model = CNN()
    kx, ky = jax.random.split(jax.random.key(seed + 1))
    data = {"x": jax.random.normal(kx, (batch, 12, 12, 3)),
            "y": jax.random.randint(ky, (batch,), 0, model.classes)}
    variables = model.init(jax.random.key(seed), data["x"], train=False)
    state = jaxamp.TrainState.create(model, variables, optax.sgd(0.1), policy=policy,
                                     rng=jax.random.key(seed + 2))
    return model, state, data
