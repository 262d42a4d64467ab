"""The GPT of ``lm_model.py`` written once more in Flax NNX, again with no dtype code.

The same architecture and the same parameter names (``embed/embedding``, ``pos_embed``,
``blocks/{ln1,attn/{qkv,proj},ln2,mlp/{fc,proj}}`` stacked on axis 0, ``ln_f``, ``head``), so
its params are the linen model's pytree: the same checkpoints, the same optimizer state, the
same ``precision_table`` rows. ``jaxamp`` finds the NNX modules while it traces, so there is
still not a single ``dtype=``, ``param_dtype=`` or ``.astype`` here.

``GPT(config)`` is what ``train_lm.py --api nnx`` uses: it presents the NNX model with linen's
``init``/``apply`` signature over those params (each ``apply`` merges the NNX model from them:
inside the jitted step, a trace-time cost only), so the example's loss, step, evaluation and
checkpoints are shared by both front ends.
"""

from __future__ import annotations

import math

import jax
from flax import nnx
from lm_model import ATTENTION, PRESETS, GPTConfig  # noqa: F401  (the same configs)

__all__ = ["GPT", "GPTModel", "init_params"]

_INIT = nnx.initializers.normal(stddev=0.02)


def _proj_init(n_layer: int):
    return nnx.initializers.normal(stddev=0.02 / math.sqrt(2 * n_layer))


class CausalSelfAttention(nnx.Module):
    """Multi-head causal self-attention (``attention``: a key of ``lm_model.ATTENTION``)."""

    def __init__(self, d: int, n_head: int, n_layer: int, attention: str, *, rngs: nnx.Rngs):
        self.n_head, self.attention = n_head, attention
        self.qkv = nnx.Linear(d, 3 * d, kernel_init=_INIT, rngs=rngs)
        self.proj = nnx.Linear(d, d, kernel_init=_proj_init(n_layer), rngs=rngs)

    def __call__(self, x):
        return self.proj(ATTENTION[self.attention](self.qkv(x), self.n_head))


class MLP(nnx.Module):
    """The 4x GELU feed-forward block."""

    def __init__(self, d: int, n_layer: int, *, rngs: nnx.Rngs):
        self.fc = nnx.Linear(d, 4 * d, kernel_init=_INIT, rngs=rngs)
        self.proj = nnx.Linear(4 * d, d, kernel_init=_proj_init(n_layer), rngs=rngs)

    def __call__(self, x):
        return self.proj(nnx.gelu(self.fc(x)))


class Block(nnx.Module):
    """A pre-LayerNorm transformer block."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        d = config.d_model
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = CausalSelfAttention(d, config.n_head, config.n_layer, config.attention,
                                        rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.mlp = MLP(d, config.n_layer, rngs=rngs)
        self.drop = nnx.Dropout(config.dropout)

    def __call__(self, x, key):
        keys = (None, None) if key is None else tuple(jax.random.split(key))
        x = x + self.drop(self.attn(self.ln1(x)), deterministic=key is None, rngs=keys[0])
        return x + self.drop(self.mlp(self.ln2(x)), deterministic=key is None, rngs=keys[1])


class GPTModel(nnx.Module):
    """The decoder: ``int32[B, T]`` token ids -> ``[B, T, vocab_size]`` logits. With a
    ``dropout_key`` dropout is on (``config.dropout``)."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embed = nnx.Embed(config.vocab_size, config.d_model, embedding_init=_INIT,
                               rngs=rngs)
        self.pos_embed = nnx.Param(_INIT(rngs.params(), (config.block_size, config.d_model)))
        self.drop = nnx.Dropout(config.dropout)

        @nnx.split_rngs(splits=config.n_layer)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs):  # one Block whose params are stacked on axis 0, as nn.scan's
            return Block(config, rngs=rngs)

        self.blocks = blocks(rngs)
        self.ln_f = nnx.LayerNorm(config.d_model, rngs=rngs)
        if not config.tied:
            self.head = nnx.Linear(config.d_model, config.vocab_size, use_bias=False,
                                   kernel_init=_INIT, rngs=rngs)

    def __call__(self, ids, dropout_key=None):
        cfg = self.config
        t = ids.shape[-1]
        if t > cfg.block_size:
            raise ValueError(f"GPT: sequence length {t} exceeds block_size {cfg.block_size}.")
        keys = None if dropout_key is None else jax.random.split(dropout_key, cfg.n_layer + 1)
        x = self.embed(ids) + self.pos_embed[:t]
        x = self.drop(x, deterministic=keys is None, rngs=None if keys is None else keys[0])

        def layer(block, x, key):
            return block(x, key)

        if cfg.remat:
            layer = nnx.remat(layer)

        @nnx.scan(in_axes=(0, nnx.Carry, 0 if keys is not None else None), out_axes=nnx.Carry)
        def run(block, x, key):
            return layer(block, x, key)

        x = run(self.blocks, x, None if keys is None else keys[1:])
        x = self.ln_f(x)
        if cfg.tied:
            return self.embed.attend(x)
        return self.head(x)


class GPT:
    """The NNX GPT behind linen's ``init``/``apply`` (and callable as ``apply``): params are
    plain nested dicts, exactly the linen model's."""

    def __init__(self, config: GPTConfig):
        self.config = config

    def _split(self):
        return nnx.split(nnx.eval_shape(lambda: GPTModel(self.config, rngs=nnx.Rngs(0))))

    def init(self, key, ids=None) -> dict:
        model = GPTModel(self.config, rngs=nnx.Rngs(params=key))
        return {"params": nnx.to_pure_dict(nnx.state(model, nnx.Param))}

    def model(self, params) -> GPTModel:
        """The NNX model holding ``params`` (a new object; inside a trace, traced values)."""
        graphdef, state = self._split()
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(graphdef, state)

    def apply(self, variables, ids, train: bool = False, rngs=None):
        key = rngs["dropout"] if train and rngs else None
        return self.model(variables["params"])(ids, dropout_key=key)

    __call__ = apply


def init_params(config: GPTConfig, seed: int = 0):
    """The model and its float32 parameters, as ``lm_model.init_params``."""
    model = GPT(config)
    return model, jax.jit(model.init)(jax.random.key(seed))["params"]
