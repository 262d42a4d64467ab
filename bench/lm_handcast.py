"""The example's GPT (``examples/lm_model.py``) with its mixed-precision casts placed by hand.

The model a careful Flax user writes without jaxamp, as ``gpt_handcast.py`` does for the bench
GPT: ``nn.Dense`` and ``nn.Embed`` (the tied head's ``embed.attend`` too) compute in ``dtype``
(bfloat16 by default) from float32 params; the positional embedding is sliced, then cast;
``nn.LayerNorm`` computes in float32; the attention scores are cast to float32 before the causal
mask and softmax, the weights back to ``dtype`` for ``weights @ V``; the logits are float32.
The residual stream (the ``nn.scan`` carry) is in ``dtype``. Same parameter tree, initialisers,
``nn.scan``, ``nn.remat`` and dropout as :class:`lm_model.GPT` (the same float32 params work
for both; with ``dtype=jnp.float32`` it computes what that model does). Written-out attention
only.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

_EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

from gpt_handcast import causal_attention  # noqa: E402 (the bench GPT twin's, same casts)
from lm_model import GPTConfig  # noqa: E402

__all__ = ["HandCastGPT", "causal_attention"]

F32 = jnp.float32
# lm_model.py's initialisers (the params are loaded from the original model, but initialising
# the twin from the same seed gives the same params too: tests/test_handcast_twins.py)
INIT = nn.initializers.normal(stddev=0.02)


def _proj_init(n_layer: int):
    """GPT-2's residual projections: std 0.02 / sqrt(2 * n_layer)."""
    return nn.initializers.normal(stddev=0.02 / math.sqrt(2 * n_layer))


class CausalSelfAttention(nn.Module):
    n_head: int
    n_layer: int
    dtype: Any

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        qkv = nn.Dense(3 * d, kernel_init=INIT, dtype=self.dtype, name="qkv")(x)
        out = causal_attention(qkv, self.n_head, self.dtype)
        return nn.Dense(d, kernel_init=_proj_init(self.n_layer), dtype=self.dtype,
                        name="proj")(out)


class MLP(nn.Module):
    n_layer: int
    dtype: Any

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        h = nn.gelu(nn.Dense(4 * d, kernel_init=INIT, dtype=self.dtype, name="fc")(x))
        return nn.Dense(d, kernel_init=_proj_init(self.n_layer), dtype=self.dtype,
                        name="proj")(h)


class Block(nn.Module):
    """``(carry, None) -> (carry, None)`` for ``nn.scan``; the carry is in ``dtype``."""

    n_head: int
    n_layer: int
    dropout: float = 0.0
    deterministic: bool = True
    dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, x, _):
        drop = nn.Dropout(self.dropout, deterministic=self.deterministic)
        h = nn.LayerNorm(dtype=F32, name="ln1")(x)
        x = x + drop(CausalSelfAttention(self.n_head, self.n_layer, self.dtype, name="attn")(h))
        h = nn.LayerNorm(dtype=F32, name="ln2")(x)
        x = x + drop(MLP(self.n_layer, self.dtype, name="mlp")(h))
        return x, None


class HandCastGPT(nn.Module):
    """``int32[B, T]`` -> float32 ``[B, T, vocab_size]`` logits, computed in ``dtype``.

    ``train=True`` applies dropout (``config.dropout``) from the ``"dropout"`` RNG, as
    :class:`lm_model.GPT` does.
    """

    config: GPTConfig
    dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, ids, train: bool = False):
        cfg = self.config
        t = ids.shape[-1]
        if t > cfg.block_size:
            raise ValueError(f"GPT: sequence length {t} exceeds block_size {cfg.block_size}.")
        if cfg.attention != "manual":
            raise ValueError(
                f"HandCastGPT writes attention out only; got GPTConfig(attention="
                f"{cfg.attention!r}). Use dataclasses.replace(config, attention='manual') for "
                "the twin of the example's written-out attention.")
        embed = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=INIT, dtype=self.dtype,
                         name="embed")
        pos = self.param("pos_embed", INIT, (cfg.block_size, cfg.d_model))
        x = nn.Dropout(cfg.dropout, deterministic=not train)(
            embed(ids) + pos[:t].astype(self.dtype))
        block = nn.remat(Block) if cfg.remat else Block
        blocks = nn.scan(block, variable_axes={"params": 0},
                         split_rngs={"params": True, "dropout": True}, length=cfg.n_layer)
        x, _ = blocks(cfg.n_head, cfg.n_layer, cfg.dropout, not train, self.dtype,
                      name="blocks")(x, None)
        x = nn.LayerNorm(dtype=F32, name="ln_f")(x)
        if cfg.tied:
            logits = embed.attend(x)  # nn.Embed casts x and the table to dtype
        else:
            logits = nn.Dense(cfg.vocab_size, use_bias=False, kernel_init=INIT,
                              dtype=self.dtype, name="head")(x)
        return logits.astype(F32)
