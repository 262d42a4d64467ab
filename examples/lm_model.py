"""A GPT-style decoder written plainly in Flax linen, with no dtype code anywhere.

There is not a single ``dtype=``, ``param_dtype=`` or ``.astype`` in this file: the model is
written the way you would write it for float32, and ``jaxamp.autocast`` decides the precision of
every operation at trace time (matmuls in the policy's compute dtype; softmax, LayerNorm
statistics and reductions in float32). That is the point of the example.

Architecture (GPT-2 style):

* token embedding (``nn.Embed``) + learned positional embedding (``self.param``);
* ``n_layer`` pre-LayerNorm blocks, each ``x + attn(ln(x))`` then ``x + mlp(ln(x))``, with
  causal self-attention (``config.attention``: ``jax.nn.dot_product_attention``, which
  jaxamp runs as cuDNN's fused flash attention on a GPU, or written out by hand with
  ``jax.nn.softmax`` over masked scores) and a 4x GELU MLP; the blocks are stacked with
  ``nn.scan`` (parameters stacked on axis 0), optionally wrapped in ``nn.remat`` to trade
  compute for activation memory;
* final LayerNorm and an output head: tied (``embed.attend``) or an untied ``nn.Dense``.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["ATTENTION", "GPT", "GPTConfig", "PRESETS", "causal_attention", "flops_per_token",
           "fused_causal_attention", "init_params", "param_count"]


def _heads(qkv, n_head: int):
    """The fused projection ``[b, t, 3d]`` as query, key and value ``[b, t, heads, d/heads]``."""
    b, t, d = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
    return tuple(z.reshape(b, t, n_head, d // n_head) for z in jnp.split(qkv, 3, axis=-1))


def causal_attention(qkv, n_head: int):
    """softmax(Q K^T / sqrt(head dim) + causal mask) V from the fused projection ``[b, t, 3d]``
    to ``[b, t, d]``, written out: ``attention="manual"`` of both model files (linen, NNX)."""
    q, k, v = _heads(qkv, n_head)
    b, t, _, hd = q.shape
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    mask = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, n_head * hd)


def fused_causal_attention(qkv, n_head: int):
    """The same attention as one ``jax.nn.dot_product_attention`` call: ``attention="fused"``.

    The function is looked up on ``jax.nn`` when called (not imported by name), so that
    ``jaxamp.autocast`` sees the call and can run it as cuDNN's fused kernel on a GPU."""
    q, k, v = _heads(qkv, n_head)
    b, t, h, hd = q.shape
    return jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, h * hd)


#: ``GPTConfig.attention`` -> the attention function of both model files.
ATTENTION = {"fused": fused_causal_attention, "manual": causal_attention}


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Model hyper-parameters.

    Attributes:
      vocab_size: number of token ids (256 for byte-level data).
      n_layer: number of transformer blocks.
      n_head: attention heads per block (must divide ``d_model``).
      d_model: width of the residual stream.
      block_size: maximum sequence length (size of the positional embedding).
      tied: share the token embedding with the output head (``embed.attend``).
      remat: recompute each block's activations in the backward pass (``nn.remat``).
      dropout: GPT-2's dropout rate (embeddings and each residual branch) when called with
        ``train=True``; 0 disables it.
      attention: how each block computes causal self-attention (the same parameters either
        way): ``"fused"`` calls ``jax.nn.dot_product_attention(q, k, v, is_causal=True)``,
        which ``jaxamp.autocast`` runs as cuDNN's fused flash-attention kernel in the compute
        dtype when the step is traced for a GPU (XLA's implementation elsewhere);
        ``"manual"`` is the softmax attention written out (:func:`causal_attention`).
    """

    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    block_size: int = 128
    tied: bool = True
    remat: bool = False
    dropout: float = 0.0
    attention: str = "fused"

    def __post_init__(self):
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}.")
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig: d_model={self.d_model} must be divisible by n_head={self.n_head}.")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}.")
        if not isinstance(self.attention, str) or self.attention not in ATTENTION:
            raise ValueError(
                f"GPTConfig.attention must be one of {', '.join(map(repr, ATTENTION))}, got "
                f"{self.attention!r}; use 'fused' for jax.nn.dot_product_attention or 'manual' "
                "for the softmax attention written out.")


PRESETS: dict[str, GPTConfig] = {
    # Trains to a visibly lower loss in about a minute on 2 CPU cores (see train_lm.py).
    "tiny": GPTConfig(n_layer=2, n_head=4, d_model=128, block_size=128),
    # Small enough for the test-suite: a few seconds of compile, well under a second per step.
    "test": GPTConfig(n_layer=2, n_head=2, d_model=64, block_size=32),
    # The 124M-parameter GPT-2 shape (with a byte-level vocabulary), for a GPU.
    "gpt2-small": GPTConfig(n_layer=12, n_head=12, d_model=768, block_size=1024),
}

_INIT = nn.initializers.normal(stddev=0.02)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (``attention``: a key of :data:`ATTENTION`)."""

    n_head: int
    n_layer: int
    attention: str = "fused"

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        qkv = nn.Dense(3 * d, kernel_init=_INIT, name="qkv")(x)
        out = ATTENTION[self.attention](qkv, self.n_head)
        # GPT-2: residual projections start smaller, by 1/sqrt(2 * n_layer).
        proj_init = nn.initializers.normal(stddev=0.02 / math.sqrt(2 * self.n_layer))
        return nn.Dense(d, kernel_init=proj_init, name="proj")(out)


class MLP(nn.Module):
    """The 4x GELU feed-forward block."""

    n_layer: int

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        h = nn.gelu(nn.Dense(4 * d, kernel_init=_INIT, name="fc")(x))
        proj_init = nn.initializers.normal(stddev=0.02 / math.sqrt(2 * self.n_layer))
        return nn.Dense(d, kernel_init=proj_init, name="proj")(h)


class Block(nn.Module):
    """A pre-LayerNorm transformer block; ``(carry, None) -> (carry, None)`` for ``nn.scan``."""

    n_head: int
    n_layer: int
    dropout: float = 0.0
    deterministic: bool = True
    attention: str = "fused"

    @nn.compact
    def __call__(self, x, _):
        drop = nn.Dropout(self.dropout, deterministic=self.deterministic)
        x = x + drop(CausalSelfAttention(self.n_head, self.n_layer, self.attention,
                                         name="attn")(nn.LayerNorm(name="ln1")(x)))
        x = x + drop(MLP(self.n_layer, name="mlp")(nn.LayerNorm(name="ln2")(x)))
        return x, None


class GPT(nn.Module):
    """The decoder: ``int32[B, T]`` token ids -> ``[B, T, vocab_size]`` logits.

    ``train=True`` applies dropout (``config.dropout``), drawing from the ``"dropout"`` RNG.
    """

    config: GPTConfig

    @nn.compact
    def __call__(self, ids, train: bool = False):
        cfg = self.config
        t = ids.shape[-1]
        if t > cfg.block_size:
            raise ValueError(f"GPT: sequence length {t} exceeds block_size {cfg.block_size}.")
        embed = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=_INIT, name="embed")
        pos = self.param("pos_embed", _INIT, (cfg.block_size, cfg.d_model))
        x = nn.Dropout(cfg.dropout, deterministic=not train)(embed(ids) + pos[:t])
        block = nn.remat(Block) if cfg.remat else Block
        blocks = nn.scan(block, variable_axes={"params": 0},
                         split_rngs={"params": True, "dropout": True}, length=cfg.n_layer)
        x, _ = blocks(cfg.n_head, cfg.n_layer, cfg.dropout, not train, cfg.attention,
                      name="blocks")(x, None)
        x = nn.LayerNorm(name="ln_f")(x)
        if cfg.tied:
            return embed.attend(x)
        return nn.Dense(cfg.vocab_size, use_bias=False, kernel_init=_INIT, name="head")(x)


def init_params(config: GPTConfig, seed: int = 0):
    """The model and its float32 parameters (``{"embed": ..., "blocks": ..., ...}``)."""
    model = GPT(config)
    ids = jnp.zeros((1, config.block_size), jnp.int32)
    params = jax.jit(model.init)(jax.random.key(seed), ids)["params"]
    return model, params


def abstract_params(config: GPTConfig):
    """Shapes/dtypes of the parameters, without allocating or computing them."""
    model = GPT(config)
    ids = jax.ShapeDtypeStruct((1, config.block_size), jnp.int32)
    return jax.eval_shape(model.init, jax.random.key(0), ids)["params"]


def param_count(params) -> int:
    """Total number of parameter elements (works on arrays and on ``ShapeDtypeStruct``s)."""
    return int(sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params)))


def flops_per_token(config: GPTConfig) -> int:
    """Training FLOPs per token (forward + backward), the PaLM-paper estimate.

    ``6 * N + 12 * L * d * T`` where

    * ``N`` is the number of parameters that take part in matrix multiplies: every parameter
      except the positional embedding (an addition) and, for an untied head, except the input
      token embedding (a gather). A tied embedding is counted once, for the output head's
      ``[d, vocab]`` matmul. Each such weight costs 2 FLOPs per token forward (multiply-add)
      and 4 backward (gradients w.r.t. input and weight): 6 per token.
    * ``12 * L * d * T`` is attention itself (``QK^T`` and ``weights @ V``: ``2 * 2 * d * T``
      FLOPs per token and layer forward, times 3 for forward + backward), with ``L`` layers,
      width ``d`` and context ``T = block_size``. The causal mask is ignored, as is usual, so
      this counts the full ``T x T`` score matrix.

    Biases, LayerNorm and GELU are included in ``N`` (a few per cent at most) rather than
    counted exactly.
    """
    n = param_count(abstract_params(config))
    n -= config.block_size * config.d_model  # positional embedding
    if not config.tied:
        n -= config.vocab_size * config.d_model  # input embedding: a gather, no FLOPs
    return 6 * n + 12 * config.n_layer * config.d_model * config.block_size
