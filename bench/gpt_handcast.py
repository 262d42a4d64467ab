"""The bench GPT (:mod:`gpt`) with its mixed-precision casts placed by hand, as a user would.

Same architecture and parameter tree (the same float32 params work for both). ``nn.Dense`` and
``nn.Embed`` compute in ``dtype`` (float16 by default) from float32 params; the positional
embedding is sliced, then cast; ``nn.LayerNorm`` computes in float32; the attention scores are
cast to float32 before the mask and softmax, the weights back to ``dtype`` for ``weights @ V``;
the logits are float32 for the loss; the residual stream is in ``dtype``. With
``GPTConfig.attention="fused"``: ``jax.nn.dot_product_attention(is_causal=True)`` in ``dtype``,
``implementation="cudnn"`` where the step is traced for a GPU.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from gpt import INIT, GPTConfig, lm_loss

__all__ = ["HandCastGPT", "causal_attention", "handcast_loss"]

F32 = jnp.float32


def attention_implementation() -> str | None:
    """``"cudnn"`` where the step is traced for a GPU (the platform of ``jax.default_device``
    when set, else of the default backend), else ``None`` (JAX's XLA path)."""
    device = jax.config.jax_default_device
    platform = getattr(device, "platform", device) or jax.default_backend()
    return "cudnn" if platform in ("gpu", "cuda") else None


def causal_attention(qkv, heads: int, dtype, fused: bool = False):
    """Causal attention from the fused projection ``[b, t, 3d]`` to ``[b, t, d]`` with the
    casts: scores in ``dtype`` from the matmul, then mask and softmax in float32, ``weights @
    V`` in ``dtype`` (``lm_handcast.py``'s too); ``fused``: ``jax.nn.dot_product_attention``
    in ``dtype`` (cuDNN computes the softmax in float32 inside the kernel)."""
    b, t, d = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
    hd = d // heads
    q, k, v = (z.reshape(b, t, heads, hd) for z in jnp.split(qkv, 3, axis=-1))
    if fused:
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                           implementation=attention_implementation())
        return out.reshape(b, t, d)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.asarray(math.sqrt(hd), dtype)
    scores = scores.astype(F32)
    mask = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(mask, scores, jnp.finfo(F32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d)


class CausalSelfAttention(nn.Module):
    heads: int
    dtype: Any
    fused: bool = False

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        qkv = nn.Dense(3 * d, kernel_init=INIT, dtype=self.dtype, name="qkv")(x)
        out = causal_attention(qkv, self.heads, self.dtype, self.fused)
        return nn.Dense(d, kernel_init=INIT, dtype=self.dtype, name="proj")(out)


class MLP(nn.Module):
    dtype: Any

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        h = nn.gelu(nn.Dense(4 * d, kernel_init=INIT, dtype=self.dtype, name="fc")(x))
        return nn.Dense(d, kernel_init=INIT, dtype=self.dtype, name="proj")(h)


class Block(nn.Module):
    heads: int
    dtype: Any
    fused: bool = False

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(dtype=F32, name="ln1")(x)
        x = x + CausalSelfAttention(self.heads, self.dtype, self.fused, name="attn")(h)
        h = nn.LayerNorm(dtype=F32, name="ln2")(x)
        return x + MLP(self.dtype, name="mlp")(h)


class HandCastGPT(nn.Module):
    """``int32[B, T]`` -> float32 ``[B, T, vocab]`` logits, computed in ``dtype``."""

    config: GPTConfig
    dtype: Any = jnp.float16

    @nn.compact
    def __call__(self, ids):
        cfg = self.config
        t = ids.shape[-1]
        x = nn.Embed(cfg.vocab, cfg.d_model, embedding_init=INIT, dtype=self.dtype,
                     name="embed")(ids)
        pos = self.param("pos_embed", INIT, (cfg.seq, cfg.d_model))
        x = x + pos[:t].astype(self.dtype)
        for i in range(cfg.layers):
            x = Block(cfg.heads, self.dtype, cfg.attention == "fused", name=f"block_{i}")(x)
        x = nn.LayerNorm(dtype=F32, name="ln_f")(x)
        logits = nn.Dense(cfg.vocab, use_bias=False, kernel_init=INIT, dtype=self.dtype,
                          name="head")(x)
        return logits.astype(F32)


def handcast_loss(model: HandCastGPT):
    """``loss(params, batch)`` of the hand-cast model (the same float32 cross-entropy)."""
    return lambda params, batch: lm_loss(model.apply, params, batch)
