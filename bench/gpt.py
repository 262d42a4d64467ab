"""A small GPT-style decoder for the benchmarks, written plainly in Flax linen.

No dtype code (no ``dtype=``, no ``.astype``): the model a user writes for float32, where
:func:`jaxamp.autocast` decides every precision (``gpt_handcast.py`` places the casts by hand).
Token embedding + learned positions, pre-LayerNorm blocks with hand-written causal attention
around ``jax.nn.softmax`` and a 4x GELU MLP, a final LayerNorm, an untied head. The blocks are
an unrolled Python loop (no ``nn.scan``), as in most user models.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["GPT", "GPTConfig", "flops_per_token", "init", "lm_loss", "make_batch",
           "param_count"]

INIT = nn.initializers.normal(stddev=0.02)


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Model shape. ``seq`` is both the context length and the benchmark sequence length."""

    layers: int = 4
    d_model: int = 128
    heads: int = 4
    seq: int = 128
    vocab: int = 256
    # "manual": softmax attention written out (the default: what every recorded figure and the
    # PyTorch twin run, unlike the example's GPT, whose default is "fused"); "fused":
    # ``jax.nn.dot_product_attention(is_causal=True)``, which autocast re-dispatches to cuDNN's
    # fused kernel in the compute dtype on a GPU (the hand-cast twin binds cuDNN itself there).
    # Same parameters either way.
    attention: str = "manual"

    def __post_init__(self):
        if self.d_model % self.heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by heads={self.heads}.")
        if self.attention not in ("manual", "fused"):
            raise ValueError(f"attention={self.attention!r}: use 'manual' or 'fused'.")

    def replace(self, **kw) -> GPTConfig:
        return dataclasses.replace(self, **kw)


class CausalSelfAttention(nn.Module):
    heads: int
    fused: bool = False

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        hd = d // self.heads
        qkv = nn.Dense(3 * d, kernel_init=INIT, name="qkv")(x)
        q, k, v = (z.reshape(b, t, self.heads, hd) for z in jnp.split(qkv, 3, axis=-1))
        if self.fused:  # looked up at call time, so autocast can re-dispatch it
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
            mask = jnp.tril(jnp.ones((t, t), bool))
            scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
            weights = jax.nn.softmax(scores, axis=-1)
            out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        return nn.Dense(d, kernel_init=INIT, name="proj")(out.reshape(b, t, d))


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        h = nn.gelu(nn.Dense(4 * d, kernel_init=INIT, name="fc")(x))
        return nn.Dense(d, kernel_init=INIT, name="proj")(h)


class Block(nn.Module):
    heads: int
    fused: bool = False

    @nn.compact
    def __call__(self, x):
        x = x + CausalSelfAttention(self.heads, self.fused, name="attn")(
            nn.LayerNorm(name="ln1")(x))
        return x + MLP(name="mlp")(nn.LayerNorm(name="ln2")(x))


class GPT(nn.Module):
    """``int32[B, T]`` token ids -> ``[B, T, vocab]`` logits."""

    config: GPTConfig

    @nn.compact
    def __call__(self, ids):
        cfg = self.config
        t = ids.shape[-1]
        x = nn.Embed(cfg.vocab, cfg.d_model, embedding_init=INIT, name="embed")(ids)
        pos = self.param("pos_embed", INIT, (cfg.seq, cfg.d_model))
        x = x + pos[:t]
        for i in range(cfg.layers):
            x = Block(cfg.heads, cfg.attention == "fused", name=f"block_{i}")(x)
        x = nn.LayerNorm(name="ln_f")(x)
        return nn.Dense(cfg.vocab, use_bias=False, kernel_init=INIT, name="head")(x)


def init(model: nn.Module, config: GPTConfig, seed: int = 0):
    """Float32 params of ``model`` (a :class:`GPT` or the hand-cast twin; same tree)."""
    ids = jnp.zeros((1, config.seq), jnp.int32)
    return jax.jit(model.init)(jax.random.key(seed), ids)["params"]


def make_batch(config: GPTConfig, batch: int, seed: int = 1) -> dict:
    """A random next-token batch: ``inputs`` and ``targets``, both ``int32[batch, seq]``."""
    toks = jax.random.randint(jax.random.key(seed), (batch, config.seq + 1), 0, config.vocab)
    return {"inputs": toks[:, :-1], "targets": toks[:, 1:]}


def lm_loss(apply_fn, params, batch):
    """Mean next-token cross-entropy, in float32 (``jaxamp.make_train_step``'s loss_fn)."""
    import jaxamp  # local: keep this module importable without jaxamp

    logits = apply_fn({"params": params}, batch["inputs"])
    return jaxamp.softmax_cross_entropy(logits, batch["targets"])


def param_count(params) -> int:
    return int(sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params)))


def flops_per_token(config: GPTConfig, params) -> int:
    """Training FLOPs per token: ``6 * N + 12 * L * d * T`` (PaLM appendix B); ``N``: the
    parameters in matmuls (not the embeddings); the attention term: the full ``T x T`` scores."""
    n = param_count(params) - (config.vocab + config.seq) * config.d_model
    return 6 * n + 12 * config.layers * config.d_model * config.seq
