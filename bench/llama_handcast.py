"""tunix's Llama3 (NNX) with its mixed-precision casts placed by hand, as a careful user would.

tunix's ``Llama3`` has no dtype options. This twin subclasses its modules and changes only what
casts, so the nnx state (paths, shapes, float32 params, sharding metadata) is tunix's: the same
params load into both, and the same ``nnx.Rngs`` initialise the same values. Every projection
(``Einsum``: q, k, v, o, the untied head) and the SwiGLU ``nnx.Linear`` layers compute in
``dtype`` (bfloat16 by default) from float32 weights; the embedding is gathered in float32,
then cast; tunix's ``RMSNorm`` (float32 inside) and attention (float32 softmax, rotary in
float32) are kept; the logits are float32; the residual stream is in ``dtype``. tunix is
imported as ``tests/third_party.py``'s ``import_bare`` does (its package ``__init__`` pulls in
training libraries the model does not use).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

_TESTS = str(Path(__file__).resolve().parents[1] / "tests")
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from third_party import import_bare  # noqa: E402

tunix = import_bare("tunix.models.llama3.model")

__all__ = ["HandCastLlama3", "tunix"]

F32 = jnp.float32


class Einsum(tunix.Einsum):
    """tunix's ``Einsum``, computing in ``dtype`` from its float32 weight."""

    def __init__(self, einsum_str, shape, *, dtype: Any, rngs: nnx.Rngs, sharding):
        super().__init__(einsum_str, shape, rngs=rngs, sharding=sharding)
        self.dtype = dtype

    @jax.named_scope("einsum")
    def __call__(self, x):
        return jnp.einsum(self.einsum_str, x.astype(self.dtype), self.w[...].astype(self.dtype))


class Embedder(tunix.Embedder):
    """tunix's ``Embedder``: gathers float32 rows, then casts them to ``dtype``; the tied
    head's ``decode`` multiplies in ``dtype``."""

    def __init__(self, vocab_size, embed_dim, *, dtype: Any, rngs: nnx.Rngs, shd_config):
        super().__init__(vocab_size, embed_dim, rngs=rngs, shd_config=shd_config)
        self.dtype = dtype

    def encode(self, x):  # tunix's is in its named scope
        return super().encode(x).astype(self.dtype)

    @jax.named_scope("embedder_decode")
    def decode(self, x):
        return jnp.dot(x.astype(self.dtype), self.input_embedding[...].T.astype(self.dtype))


class Attention(tunix.Attention):
    """tunix's ``Attention`` (its ``block``: rotary, grouped-query scores, float32 softmax)
    with ``dtype`` projections."""

    def __init__(self, config, *, dtype: Any, rngs: nnx.Rngs):  # tunix's, with dtype=
        self.config = config
        self.shd_config = shd = config.shd_config
        d, n, k, h = config.embed_dim, config.num_heads, config.num_kv_heads, config.head_dim
        self.q_proj = Einsum("BTD,DNH->BTNH", (d, n, h), dtype=dtype, rngs=rngs,
                             sharding=shd.q_weight_dnh)
        self.k_proj = Einsum("BSD,DKH->BSKH", (d, k, h), dtype=dtype, rngs=rngs,
                             sharding=shd.kv_weight_dnh)
        self.v_proj = Einsum("BSD,DKH->BSKH", (d, k, h), dtype=dtype, rngs=rngs,
                             sharding=shd.kv_weight_dnh)
        self.o_proj = Einsum("BTNH,NHD->BTD", (n, h, d), dtype=dtype, rngs=rngs,
                             sharding=shd.o_weight_nhd)
        self.n_rep = n // k
        self.scale = self.head_dim**-0.5


class MLP(tunix.MLP):
    """tunix's SwiGLU ``MLP`` (its ``block``) of ``nnx.Linear(dtype=..., param_dtype=F32)``."""

    def __init__(self, config, *, dtype: Any, rngs: nnx.Rngs):  # tunix's, with dtype=
        self.config = config
        self.shd_config = shd = config.shd_config
        zeros = nnx.initializers.zeros_init()

        def linear(n_in, n_out, sharding):
            return nnx.Linear(n_in, n_out, use_bias=False, dtype=dtype, param_dtype=F32,
                              rngs=rngs, kernel_init=nnx.with_partitioning(zeros, sharding))

        self.gate_proj = linear(config.embed_dim, config.hidden_dim, shd.ffw_weight_df)
        self.up_proj = linear(config.embed_dim, config.hidden_dim, shd.ffw_weight_df)
        self.down_proj = linear(config.hidden_dim, config.embed_dim, shd.ffw_weight_fd)


class DecoderLayer(tunix.DecoderLayer):
    """tunix's ``DecoderLayer`` (its ``block``) of the ``dtype`` attention and MLP."""

    def __init__(self, config, *, dtype: Any, rngs: nnx.Rngs):  # tunix's, with dtype=
        self.config = config
        self.input_layernorm = tunix.RMSNorm(config.embed_dim, norm_eps=config.norm_eps,
                                             rngs=rngs, shd_config=config.shd_config)
        self.attn = Attention(config, dtype=dtype, rngs=rngs)
        self.mlp = MLP(config, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = tunix.RMSNorm(
            config.embed_dim, norm_eps=config.norm_eps, rngs=rngs, shd_config=config.shd_config)


class HandCastLlama3(tunix.Llama3):
    """tunix's ``Llama3`` computing in ``dtype`` from float32 params; float32 logits.

    Same constructor as tunix's (``config``, ``rngs``) plus ``dtype``, same call:
    ``(tokens, positions, cache, attention_mask) -> (logits, cache)``.
    """

    def __init__(self, config, *, dtype: Any = jnp.bfloat16, rngs: nnx.Rngs):
        self.config = config
        self.embedder = Embedder(config.vocab_size, config.embed_dim, dtype=dtype, rngs=rngs,
                                 shd_config=config.shd_config)
        self.layers = tunix.compat.ModuleList([
            DecoderLayer(config, dtype=dtype, rngs=rngs) for _ in range(config.num_layers)])
        self.final_norm = tunix.RMSNorm(config.embed_dim, rngs=rngs, norm_eps=config.norm_eps,
                                        shd_config=config.shd_config)
        if not config.weight_tying:
            self.lm_head = Einsum("BTD,DV->BTV", (config.embed_dim, config.vocab_size),
                                  dtype=dtype, rngs=rngs, sharding=config.shd_config.emb_dv)

    def __call__(self, input_tokens, positions, cache, attention_mask):
        logits, cache = super().__call__(input_tokens, positions, cache, attention_mask)
        return logits.astype(F32), cache
