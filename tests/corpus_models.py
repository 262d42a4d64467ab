"""Real architecture patterns, written the way their authors write them (no dtype code).

Each builder returns a :class:`Case`: an unmodified Flax linen model, its variables, a batch and
a loss ``loss(apply_fn, params, batch) -> scalar`` in the form ``jaxamp.make_train_step`` takes.
Configs are tiny (seconds per model on a CPU); the shapes and code paths are the real ones:
BERT's exact-erf GELU and padding mask, GPT's tied head, T5's hand RMS norm and bucketed
relative position bias, Llama's RoPE/GQA/SwiGLU, a Switch-style MoE with capacity-based
scatter/gather dispatch, ViT's class token with interpolated position embeddings, CLIP's learned
temperature, ResNet's BatchNorm and max pooling, a diffusion UNet's GroupNorm and up-sampling,
and Flax's lifted ``nn.scan`` / ``nn.remat`` / ``nn.vmap``.

Nothing here was written for jaxamp: these are the patterns that broke a first engine
(``tests/test_corpus.py`` checks each under float16 and bfloat16 against float32).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax


@dataclasses.dataclass
class Case:
    model: nn.Module
    params: Any
    batch: dict
    loss: Callable  # loss(apply_fn, params, batch) -> float scalar
    note: str


def _ce(logits, labels, where=None):
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return jnp.mean(losses, where=where)


def _ids(seed, shape, vocab, low=0):
    return jax.random.randint(jax.random.key(seed), shape, low, vocab)


# ---- BERT: post-LN encoder, exact-erf GELU, padding mask, dropout (typed key), tied MLM head --
class BertLayer(nn.Module):
    heads: int
    dropout: float

    @nn.compact
    def __call__(self, x, mask, train: bool):
        d = x.shape[-1]
        h = nn.MultiHeadDotProductAttention(num_heads=self.heads, dropout_rate=self.dropout,
                                            deterministic=not train, name="attention")(
            x, x, mask=mask)
        x = nn.LayerNorm(epsilon=1e-12, name="attn_ln")(
            x + nn.Dropout(self.dropout)(h, deterministic=not train))
        h = nn.gelu(nn.Dense(4 * d, name="intermediate")(x), approximate=False)
        h = nn.Dense(d, name="output")(h)
        return nn.LayerNorm(epsilon=1e-12, name="out_ln")(
            x + nn.Dropout(self.dropout)(h, deterministic=not train))


class Bert(nn.Module):
    vocab: int = 64
    d: int = 32
    heads: int = 4
    layers: int = 2
    max_len: int = 16
    dropout: float = 0.1

    @nn.compact
    def __call__(self, ids, token_types, train: bool = True):
        words = nn.Embed(self.vocab, self.d, name="word_embeddings")
        pos = nn.Embed(self.max_len, self.d, name="position_embeddings")(
            jnp.arange(ids.shape[1])[None])
        x = words(ids) + pos + nn.Embed(2, self.d, name="token_type_embeddings")(token_types)
        x = nn.Dropout(self.dropout)(nn.LayerNorm(epsilon=1e-12, name="emb_ln")(x),
                                     deterministic=not train)
        mask = nn.make_attention_mask(ids > 0, ids > 0)
        for i in range(self.layers):
            x = BertLayer(self.heads, self.dropout, name=f"layer_{i}")(x, mask, train)
        h = nn.gelu(nn.Dense(self.d, name="mlm_dense")(x), approximate=False)
        h = nn.LayerNorm(epsilon=1e-12, name="mlm_ln")(h)
        bias = self.param("mlm_bias", nn.initializers.zeros, (self.vocab,))
        return words.attend(h) + bias


def bert() -> Case:
    model = Bert()
    ids = _ids(0, (4, 16), model.vocab, low=1).at[:, 12:].set(0)  # padding at the end
    types = jnp.zeros_like(ids).at[:, 8:].set(1)
    masked = (jax.random.uniform(jax.random.key(1), ids.shape) < 0.3) & (ids > 0)
    batch = {"ids": jnp.where(masked, 3, ids), "types": types, "labels": ids,
             "masked": masked}
    params = model.init(jax.random.key(2), batch["ids"], types, train=False)["params"]
    key = jax.random.key(3)  # typed key: dropout active

    def loss(apply_fn, params, b):
        logits = apply_fn({"params": params}, b["ids"], b["types"], train=True,
                          rngs={"dropout": key})
        return _ce(logits, b["labels"], where=b["masked"])

    return Case(model, params, batch, loss, "MLM, padding mask, dropout 0.1 (typed key)")


# ---- GPT-2: pre-LN decoder, hand-written causal attention, tied head, dropout (raw key) -------
class GPTBlock(nn.Module):
    heads: int
    dropout: float

    @nn.compact
    def __call__(self, x, train: bool):
        b, t, d = x.shape
        hd = d // self.heads
        qkv = nn.Dense(3 * d, name="c_attn")(nn.LayerNorm(epsilon=1e-5, name="ln_1")(x))
        q, k, v = (a.reshape(b, t, self.heads, hd).transpose(0, 2, 1, 3)
                   for a in jnp.split(qkv, 3, axis=-1))
        att = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(hd))
        att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, float("-inf"))
        att = nn.Dropout(self.dropout)(jax.nn.softmax(att, axis=-1), deterministic=not train)
        y = (att @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
        x = x + nn.Dropout(self.dropout)(nn.Dense(d, name="c_proj")(y), deterministic=not train)
        h = nn.gelu(nn.Dense(4 * d, name="c_fc")(nn.LayerNorm(epsilon=1e-5, name="ln_2")(x)))
        return x + nn.Dropout(self.dropout)(nn.Dense(d, name="mlp_proj")(h),
                                            deterministic=not train)


class GPT(nn.Module):
    vocab: int = 64
    d: int = 32
    heads: int = 4
    layers: int = 2
    ctx: int = 16
    dropout: float = 0.1

    @nn.compact
    def __call__(self, ids, train: bool = True):
        wte = nn.Embed(self.vocab, self.d, name="wte")
        wpe = self.param("wpe", nn.initializers.normal(0.02), (self.ctx, self.d))
        x = nn.Dropout(self.dropout)(wte(ids) + wpe[: ids.shape[1]], deterministic=not train)
        for i in range(self.layers):
            x = GPTBlock(self.heads, self.dropout, name=f"h_{i}")(x, train)
        return wte.attend(nn.LayerNorm(epsilon=1e-5, name="ln_f")(x))  # tied head


def gpt() -> Case:
    model = GPT()
    ids = _ids(10, (4, 17), model.vocab)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:]}
    params = model.init(jax.random.key(11), batch["inputs"], train=False)["params"]
    key = jax.random.PRNGKey(12)  # raw uint32 key

    def loss(apply_fn, params, b):
        logits = apply_fn({"params": params}, b["inputs"], train=True, rngs={"dropout": key})
        return _ce(logits, b["targets"])

    return Case(model, params, batch, loss, "tied head, -inf causal mask, dropout (raw key)")


# ---- T5: hand RMS norm, bucketed relative position bias, encoder-decoder cross-attention ------
class T5LayerNorm(nn.Module):
    eps: float = 1e-6

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],))
        var = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
        return weight * (x * jax.lax.rsqrt(var + self.eps))


def _relative_bucket(rel, bidirectional, num_buckets=8, max_distance=16):
    ret = 0
    n = -rel
    if bidirectional:
        num_buckets //= 2
        ret += (n < 0).astype(jnp.int32) * num_buckets
        n = jnp.abs(n)
    else:
        n = jnp.maximum(n, 0)
    max_exact = num_buckets // 2
    large = max_exact + (jnp.log(n.astype(jnp.float32) / max_exact + np.finfo(np.float32).eps)
                         / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).astype(jnp.int32)
    large = jnp.minimum(large, num_buckets - 1)
    return ret + jnp.where(n < max_exact, n, large)


class T5Attention(nn.Module):
    heads: int
    bidirectional: bool = True
    has_bias: bool = False

    @nn.compact
    def __call__(self, x, kv, mask=None, bias=None):
        b, t, d = x.shape
        hd = d // self.heads
        dense = lambda name: nn.Dense(d, use_bias=False, name=name)  # noqa: E731
        q = dense("q")(x).reshape(b, t, self.heads, hd)
        k = dense("k")(kv).reshape(b, kv.shape[1], self.heads, hd)
        v = dense("v")(kv).reshape(b, kv.shape[1], self.heads, hd)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k)  # T5 does not scale the scores
        if self.has_bias:
            rel = jnp.arange(kv.shape[1])[None, :] - jnp.arange(t)[:, None]
            buckets = _relative_bucket(rel, self.bidirectional)
            bias = nn.Embed(8, self.heads, name="relative_attention_bias")(buckets)
            bias = bias.transpose(2, 0, 1)[None]
        if bias is not None:
            scores = scores + bias
        if mask is not None:
            scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
        w = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(scores.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, t, d)
        return dense("o")(out), bias


class T5(nn.Module):
    vocab: int = 64
    d: int = 32
    heads: int = 4

    @nn.compact
    def __call__(self, enc_ids, dec_ids):
        shared = nn.Embed(self.vocab, self.d, name="shared")
        ff = lambda x, name: nn.Dense(self.d, use_bias=False, name=f"{name}_wo")(  # noqa: E731
            nn.relu(nn.Dense(2 * self.d, use_bias=False, name=f"{name}_wi")(x)))
        x = shared(enc_ids)
        bias = None
        for i in range(2):
            h, bias = T5Attention(self.heads, True, has_bias=i == 0, name=f"enc_{i}_sa")(
                T5LayerNorm(name=f"enc_{i}_ln1")(x), T5LayerNorm(name=f"enc_{i}_ln1b")(x),
                bias=bias)
            x = x + h
            x = x + ff(T5LayerNorm(name=f"enc_{i}_ln2")(x), f"enc_{i}")
        enc = T5LayerNorm(name="enc_final_ln")(x)
        y = shared(dec_ids)
        causal = jnp.tril(jnp.ones((dec_ids.shape[1],) * 2, bool))[None, None]
        bias = None
        for i in range(2):
            hy = T5LayerNorm(name=f"dec_{i}_ln1")(y)
            h, bias = T5Attention(self.heads, False, has_bias=i == 0, name=f"dec_{i}_sa")(
                hy, hy, mask=causal, bias=bias)
            y = y + h
            h, _ = T5Attention(self.heads, name=f"dec_{i}_xa")(
                T5LayerNorm(name=f"dec_{i}_ln2")(y), enc)
            y = y + h
            y = y + ff(T5LayerNorm(name=f"dec_{i}_ln3")(y), f"dec_{i}")
        y = T5LayerNorm(name="dec_final_ln")(y) * (self.d ** -0.5)
        return shared.attend(y)


def t5() -> Case:
    model = T5()
    enc, dec = _ids(20, (4, 12), model.vocab), _ids(21, (4, 9), model.vocab)
    batch = {"enc": enc, "dec": dec[:, :-1], "targets": dec[:, 1:]}
    params = model.init(jax.random.key(22), enc, batch["dec"])["params"]

    def loss(apply_fn, params, b):
        return _ce(apply_fn({"params": params}, b["enc"], b["dec"]), b["targets"])

    return Case(model, params, batch, loss, "hand RMS norm, relative bias, cross-attention")


# ---- Llama: RMSNorm, RoPE, grouped-query attention, SwiGLU ------------------------------------
def _rope(x, positions, theta=10000.0):
    hd = x.shape[-1]
    freqs = 1.0 / theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
    angles = positions[:, None].astype(jnp.float32) * freqs[None]
    cos, sin = jnp.cos(angles)[None, :, None], jnp.sin(angles)[None, :, None]
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class LlamaBlock(nn.Module):
    heads: int
    kv_heads: int

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        hd = d // self.heads
        h = nn.RMSNorm(epsilon=1e-5, name="input_layernorm")(x)
        q = nn.Dense(self.heads * hd, use_bias=False, name="q_proj")(h)
        k = nn.Dense(self.kv_heads * hd, use_bias=False, name="k_proj")(h)
        v = nn.Dense(self.kv_heads * hd, use_bias=False, name="v_proj")(h)
        pos = jnp.arange(t)
        q = _rope(q.reshape(b, t, self.heads, hd), pos)
        k = _rope(k.reshape(b, t, self.kv_heads, hd), pos)
        v = v.reshape(b, t, self.kv_heads, hd)
        rep = self.heads // self.kv_heads
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd).astype(q.dtype)
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, jnp.finfo(q.dtype).min)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v).reshape(b, t, d)
        x = x + nn.Dense(d, use_bias=False, name="o_proj")(out)
        h = nn.RMSNorm(epsilon=1e-5, name="post_attention_layernorm")(x)
        gate = nn.silu(nn.Dense(2 * d, use_bias=False, name="gate_proj")(h))
        up = nn.Dense(2 * d, use_bias=False, name="up_proj")(h)
        return x + nn.Dense(d, use_bias=False, name="down_proj")(gate * up)


class Llama(nn.Module):
    vocab: int = 64
    d: int = 32
    heads: int = 4
    kv_heads: int = 2
    layers: int = 2

    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(self.vocab, self.d, name="embed_tokens")(ids)
        for i in range(self.layers):
            x = LlamaBlock(self.heads, self.kv_heads, name=f"layers_{i}")(x)
        x = nn.RMSNorm(epsilon=1e-5, name="norm")(x)
        return nn.Dense(self.vocab, use_bias=False, name="lm_head")(x)


def llama() -> Case:
    model = Llama()
    ids = _ids(30, (4, 17), model.vocab)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:]}
    params = model.init(jax.random.key(31), batch["inputs"])["params"]

    def loss(apply_fn, params, b):
        return _ce(apply_fn({"params": params}, b["inputs"]), b["targets"])

    return Case(model, params, batch, loss, "RoPE, GQA 4q/2kv, SwiGLU, nn.RMSNorm")


# ---- Mixture of Experts: softmax router, top-2, capacity, scatter dispatch / gather combine ---
class MoE(nn.Module):
    experts: int = 4
    top_k: int = 2
    capacity_factor: float = 2.0

    @nn.compact
    def __call__(self, x):
        shape, d = x.shape, x.shape[-1]
        tokens = x.reshape(-1, d)
        n = tokens.shape[0]
        probs = jax.nn.softmax(nn.Dense(self.experts, use_bias=False, name="router")(tokens))
        gates, expert = jax.lax.top_k(probs, self.top_k)                     # (n, k)
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
        capacity = int(self.capacity_factor * n * self.top_k / self.experts)
        onehot = jax.nn.one_hot(expert.reshape(-1), self.experts, dtype=jnp.int32)
        slot = (jnp.cumsum(onehot, axis=0) - 1)[jnp.arange(n * self.top_k), expert.reshape(-1)]
        keep = slot < capacity
        slot = jnp.where(keep, slot, capacity)  # overflowing tokens land in a dropped slot
        token = jnp.repeat(jnp.arange(n), self.top_k)
        buf = jnp.zeros((self.experts, capacity + 1, d), tokens.dtype)
        buf = buf.at[expert.reshape(-1), slot].set(tokens[token])               # scatter
        w_in = self.param("w_in", nn.initializers.lecun_normal(), (self.experts, d, 2 * d))
        w_out = self.param("w_out", nn.initializers.lecun_normal(), (self.experts, 2 * d, d))
        h = nn.gelu(jnp.einsum("ecd,edh->ech", buf[:, :capacity], w_in))
        y = jnp.einsum("ech,ehd->ecd", h, w_out)
        y = jnp.pad(y, ((0, 0), (0, 1), (0, 0)))                                # dropped slot
        out = y[expert.reshape(-1), slot] * (gates.reshape(-1) * keep)[:, None]  # gather
        # combine; the gates are float32 (a softmax), so under Flax's dtype= the expert outputs
        # meet a bfloat16 buffer: cast, where JAX warns (and will raise) on the implicit one
        out = jnp.zeros_like(tokens).at[token].add(out.astype(tokens.dtype))
        # Switch Transformer load-balancing loss: fraction routed x mean router probability.
        frac = jnp.mean(onehot.reshape(n, self.top_k, -1).sum(1).astype(jnp.float32), axis=0)
        self.sow("intermediates", "aux_loss", self.experts * jnp.sum(frac * probs.mean(0)))
        return out.reshape(shape)


class MoELM(nn.Module):
    vocab: int = 64
    d: int = 32

    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(self.vocab, self.d, name="embed")(ids)
        x = x + MoE(name="moe")(nn.LayerNorm(name="ln")(x))
        return nn.Dense(self.vocab, name="head")(nn.LayerNorm(name="ln_f")(x))


def moe() -> Case:
    model = MoELM()
    ids = _ids(40, (4, 9), model.vocab)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:]}
    params = model.init(jax.random.key(41), batch["inputs"])["params"]

    def loss(apply_fn, params, b):
        logits, inter = apply_fn({"params": params}, b["inputs"], mutable=["intermediates"])
        aux = inter["intermediates"]["moe"]["aux_loss"][0]
        return _ce(logits, b["targets"]) + 0.01 * aux

    return Case(model, params, batch, loss, "top-2 router, capacity, scatter/gather, aux loss")


# ---- ViT: patch conv, class token, position embeddings interpolated to a new resolution ------
class ViTBlock(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(epsilon=1e-6, name="ln1")(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, name="attn")(h, h)
        h = nn.gelu(nn.Dense(2 * x.shape[-1], name="fc1")(nn.LayerNorm(epsilon=1e-6,
                                                                        name="ln2")(x)))
        return x + nn.Dense(x.shape[-1], name="fc2")(h)


class ViT(nn.Module):
    d: int = 32
    patch: int = 4
    grid: int = 4  # position embeddings are stored for a 4x4 grid (16x16 images)
    classes: int = 10

    @nn.compact
    def __call__(self, images):
        x = nn.Conv(self.d, (self.patch,) * 2, strides=(self.patch,) * 2, name="patch_embed")(
            images)
        b, gh, gw, d = x.shape
        x = x.reshape(b, gh * gw, d)
        cls = self.param("cls_token", nn.initializers.normal(0.02), (1, 1, d))
        pos = self.param("pos_embed", nn.initializers.normal(0.02), (1, 1 + self.grid ** 2, d))
        grid = pos[0, 1:].reshape(self.grid, self.grid, d)
        if (gh, gw) != (self.grid, self.grid):  # DeiT/DINO: fine-tune at another resolution
            grid = jax.image.resize(grid, (gh, gw, d), method="bicubic")
        pos = jnp.concatenate([pos[:, :1], grid.reshape(1, gh * gw, d)], axis=1)
        x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, d)), x], axis=1) + pos
        for i in range(2):
            x = ViTBlock(4, name=f"block_{i}")(x)
        x = nn.LayerNorm(epsilon=1e-6, name="norm")(x)
        return nn.Dense(self.classes, name="head")(x[:, 0])


def vit() -> Case:
    model = ViT()
    init_images = jax.random.normal(jax.random.key(50), (1, 16, 16, 3))
    params = model.init(jax.random.key(51), init_images)["params"]
    images = jax.random.normal(jax.random.key(52), (4, 24, 24, 3))  # 6x6 patches: interpolated
    batch = {"images": images, "labels": _ids(53, (4,), 10)}

    def loss(apply_fn, params, b):
        return _ce(apply_fn({"params": params}, b["images"]), b["labels"])

    return Case(model, params, batch, loss, "class token, bicubic-interpolated positions")


# ---- CLIP: two towers, L2-normalised projections, learned temperature exp(logit_scale) --------
class TextTower(nn.Module):
    vocab: int = 64
    d: int = 32

    @nn.compact
    def __call__(self, ids):
        t = ids.shape[1]
        x = nn.Embed(self.vocab, self.d, name="token_embedding")(ids)
        x = x + self.param("positional_embedding", nn.initializers.normal(0.01), (t, self.d))
        h = nn.LayerNorm(name="ln_1")(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=4, name="attn")(
            h, h, mask=nn.make_causal_mask(ids))
        x = x + nn.Dense(self.d, name="mlp")(nn.gelu(nn.Dense(2 * self.d, name="fc")(
            nn.LayerNorm(name="ln_2")(x))))
        x = nn.LayerNorm(name="ln_final")(x)
        eot = x[jnp.arange(x.shape[0]), jnp.argmax(ids, axis=-1)]  # EOT token has the top id
        return nn.Dense(16, use_bias=False, name="text_projection")(eot)


class ImageTower(nn.Module):
    @nn.compact
    def __call__(self, images):
        x = nn.Conv(16, (3, 3), strides=(2, 2), name="conv1")(images)
        x = nn.LayerNorm(name="ln_pre")(nn.gelu(x))
        x = nn.Conv(32, (3, 3), strides=(2, 2), name="conv2")(x)
        x = jnp.mean(nn.gelu(x), axis=(1, 2))
        x = nn.LayerNorm(name="ln_post")(x)
        return nn.Dense(16, use_bias=False, name="visual_projection")(x)


class CLIP(nn.Module):
    @nn.compact
    def __call__(self, images, ids):
        img = ImageTower(name="visual")(images)
        txt = TextTower(name="text")(ids)
        img = img / jnp.linalg.norm(img, axis=-1, keepdims=True)
        txt = txt / jnp.linalg.norm(txt, axis=-1, keepdims=True)
        logit_scale = self.param("logit_scale", nn.initializers.constant(math.log(1 / 0.07)),
                                 ())
        return jnp.exp(logit_scale) * img @ txt.T


def clip() -> Case:
    model = CLIP()
    images = jax.random.normal(jax.random.key(60), (8, 16, 16, 3))
    ids = _ids(61, (8, 8), 60).at[:, 6].set(63)  # EOT
    params = model.init(jax.random.key(62), images, ids)["params"]
    batch = {"images": images, "ids": ids}

    def loss(apply_fn, params, b):
        logits = apply_fn({"params": params}, b["images"], b["ids"])
        labels = jnp.arange(logits.shape[0])
        return (_ce(logits, labels) + _ce(logits.T, labels)) / 2

    return Case(model, params, batch, loss, "two towers, L2 norm, exp(logit_scale)")


# ---- ResNet: conv-BN-ReLU, max pooling, basic blocks with projection shortcuts ----------------
class BasicBlock(nn.Module):
    filters: int
    strides: int = 1

    @nn.compact
    def __call__(self, x, train: bool):
        norm = lambda name: nn.BatchNorm(use_running_average=not train, momentum=0.9,  # noqa
                                         name=name)
        y = nn.relu(norm("bn1")(nn.Conv(self.filters, (3, 3), (self.strides,) * 2,
                                        use_bias=False, name="conv1")(x)))
        y = norm("bn2")(nn.Conv(self.filters, (3, 3), use_bias=False, name="conv2")(y))
        if x.shape != y.shape:
            x = norm("bn_proj")(nn.Conv(self.filters, (1, 1), (self.strides,) * 2,
                                        use_bias=False, name="conv_proj")(x))
        return nn.relu(x + y)


class ResNet(nn.Module):
    classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(16, (3, 3), use_bias=False, name="conv_init")(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, name="bn_init")(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        x = BasicBlock(16, name="block1")(x, train)
        x = BasicBlock(32, strides=2, name="block2")(x, train)
        return nn.Dense(self.classes, name="head")(jnp.mean(x, axis=(1, 2)))


def resnet() -> Case:
    model = ResNet()
    images = jax.random.normal(jax.random.key(70), (4, 16, 16, 3))
    variables = model.init(jax.random.key(71), images, train=False)
    stats = variables["batch_stats"]
    batch = {"images": images, "labels": _ids(72, (4,), 10)}

    def loss(apply_fn, params, b):
        logits, _ = apply_fn({"params": params, "batch_stats": stats}, b["images"],
                             train=True, mutable=["batch_stats"])
        return _ce(logits, b["labels"])

    return Case(model, variables["params"], batch, loss,
                "BatchNorm (batch statistics, mutable), max pooling")


# ---- UNet (diffusion style): GroupNorm, SiLU, timestep embedding, up-sampling, skips ----------
class ResBlock(nn.Module):
    filters: int

    @nn.compact
    def __call__(self, x, temb):
        h = nn.Conv(self.filters, (3, 3), name="conv1")(nn.silu(nn.GroupNorm(4, name="gn1")(x)))
        h = h + nn.Dense(self.filters, name="temb")(nn.silu(temb))[:, None, None]
        h = nn.Conv(self.filters, (3, 3), name="conv2")(nn.silu(nn.GroupNorm(4, name="gn2")(h)))
        if x.shape[-1] != self.filters:
            x = nn.Conv(self.filters, (1, 1), name="skip")(x)
        return x + h


def _timestep_embedding(t, dim):
    freqs = jnp.exp(-math.log(10000.0) * jnp.arange(dim // 2) / (dim // 2))
    args = t[:, None].astype(jnp.float32) * freqs[None]
    return jnp.concatenate([jnp.sin(args), jnp.cos(args)], axis=-1)


class UNet(nn.Module):
    @nn.compact
    def __call__(self, x, t):
        temb = nn.Dense(32, name="temb_fc2")(nn.silu(nn.Dense(32, name="temb_fc1")(
            _timestep_embedding(t, 16))))
        h0 = nn.Conv(16, (3, 3), name="conv_in")(x)
        h1 = ResBlock(16, name="down1")(h0, temb)
        h2 = ResBlock(32, name="down2")(nn.avg_pool(h1, (2, 2), (2, 2)), temb)
        mid = ResBlock(32, name="mid")(h2, temb)
        b, hh, ww, c = mid.shape
        up = jax.image.resize(mid, (b, 2 * hh, 2 * ww, c), method="nearest")
        up = nn.Conv(32, (3, 3), name="upsample_conv")(up)
        h = ResBlock(16, name="up1")(jnp.concatenate([up, h1], axis=-1), temb)
        return nn.Conv(x.shape[-1], (3, 3), name="conv_out")(
            nn.silu(nn.GroupNorm(4, name="gn_out")(h)))


def unet() -> Case:
    model = UNet()
    x0 = jax.random.normal(jax.random.key(80), (4, 8, 8, 3))
    noise = jax.random.normal(jax.random.key(81), x0.shape)
    t = jnp.array([1, 100, 500, 900])
    alpha = jnp.cos(t / 1000 * jnp.pi / 2)[:, None, None, None]
    batch = {"noisy": alpha * x0 + jnp.sqrt(1 - alpha ** 2) * noise, "t": t, "noise": noise}
    params = model.init(jax.random.key(82), batch["noisy"], t)["params"]

    def loss(apply_fn, params, b):
        return jnp.mean(jnp.square(apply_fn({"params": params}, b["noisy"], b["t"])
                                   - b["noise"]))

    return Case(model, params, batch, loss, "GroupNorm, SiLU, timestep embedding, nearest up")


# ---- Flax lifted transforms: nn.scan over nn.remat'd blocks, nn.vmap'd ensemble heads ---------
class ScanBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        d = x.shape[-1]
        h = nn.LayerNorm(name="ln1")(x)
        x = x + nn.SelfAttention(num_heads=4, name="attn")(h)
        x = x + nn.Dense(d, name="fc2")(nn.gelu(nn.Dense(2 * d, name="fc1")(
            nn.LayerNorm(name="ln2")(x))))
        return x, None


class Head(nn.Module):
    vocab: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.vocab, name="out")(nn.tanh(nn.Dense(x.shape[-1], name="hid")(x)))


class Lifted(nn.Module):
    vocab: int = 64
    d: int = 32

    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(self.vocab, self.d, name="embed")(ids)
        blocks = nn.scan(nn.remat(ScanBlock), variable_axes={"params": 0},
                         split_rngs={"params": True}, length=3)
        x, _ = blocks(name="blocks")(x, None)
        x = nn.LayerNorm(name="ln_f")(x)
        heads = nn.vmap(Head, variable_axes={"params": 0}, split_rngs={"params": True},
                        in_axes=None, out_axes=0, axis_size=3)
        return heads(self.vocab, name="ensemble")(x)  # (3, b, t, vocab)


def lifted() -> Case:
    model = Lifted()
    ids = _ids(90, (4, 9), model.vocab)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:]}
    params = model.init(jax.random.key(91), batch["inputs"])["params"]

    def loss(apply_fn, params, b):
        logits = apply_fn({"params": params}, b["inputs"])
        return _ce(logits, jnp.broadcast_to(b["targets"], logits.shape[:-1]))

    return Case(model, params, batch, loss, "nn.scan(nn.remat(block)), nn.vmap ensemble")


CORPUS: dict[str, Callable[[], Case]] = {
    "bert": bert, "gpt2": gpt, "t5": t5, "llama": llama, "moe": moe, "vit": vit, "clip": clip,
    "resnet": resnet, "unet": unet, "scan_remat_vmap": lifted,
}
