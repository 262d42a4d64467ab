"""The bench GPT of ``bench/gpt.py`` in PyTorch, and PyTorch's AMP training recipe: the peer.

Same architecture and initialisation (learned positions, pre-LayerNorm blocks with hand-written
causal attention and a 4x tanh-GELU MLP, untied bias-free head; normal(0.02) weights, LayerNorm
epsilon 1e-6 as Flax's), so the parameter count is the Flax model's and :func:`load_flax_params`
starts both sides from the same weights. :class:`TorchTrainer`: ``torch.autocast`` around
forward + float32 loss, ``GradScaler`` for float16, ``clip_grad_norm_(1.0)``, AdamW with
``optax.adamw(1e-3)``'s hyper-parameters, optionally ``torch.compile``. Imported only by
``_gpu.py``'s torch side (and a test); it does not import JAX.
"""

from __future__ import annotations

import contextlib
import math
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["AMP_DTYPES", "TorchGPT", "TorchTrainer", "load_flax_params", "param_count"]

INIT_STD = 0.02
LN_EPS = 1e-6  # flax.linen.LayerNorm's default (PyTorch's is 1e-5)
# optax.adamw(1e-3) defaults: b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4 on every parameter
# (torch.optim.AdamW's default weight_decay is 1e-2, so it is set explicitly).
ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-4)
AMP_DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _linear(d_in: int, d_out: int, bias: bool = True) -> nn.Linear:
    layer = nn.Linear(d_in, d_out, bias=bias)
    nn.init.normal_(layer.weight, std=INIT_STD)
    if bias:
        nn.init.zeros_(layer.bias)
    return layer


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int, seq: int):
        super().__init__()
        self.heads = heads
        self.qkv = _linear(d_model, 3 * d_model)
        self.proj = _linear(d_model, d_model)
        self.register_buffer("mask", torch.ones(seq, seq, dtype=torch.bool).tril(),
                             persistent=False)

    def forward(self, x):
        b, t, d = x.shape
        hd = d // self.heads
        q, k, v = (z.view(b, t, self.heads, hd).transpose(1, 2)  # [b, h, t, hd]
                   for z in self.qkv(x).split(d, dim=-1))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
        scores = scores.masked_fill(~self.mask[:t, :t], torch.finfo(scores.dtype).min)
        weights = scores.softmax(dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(out)


class MLP(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.fc = _linear(d_model, 4 * d_model)
        self.proj = _linear(4 * d_model, d_model)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))  # flax nn.gelu: tanh approx.


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, seq: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model, eps=LN_EPS)
        self.attn = CausalSelfAttention(d_model, heads, seq)
        self.ln2 = nn.LayerNorm(d_model, eps=LN_EPS)
        self.mlp = MLP(d_model)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TorchGPT(nn.Module):
    """``int64[B, T]`` token ids -> ``[B, T, vocab]`` logits. ``config``: a ``GPTConfig`` (any
    object with ``layers``, ``d_model``, ``heads``, ``seq`` and ``vocab``)."""

    def __init__(self, config):
        super().__init__()
        c = config
        self.embed = nn.Embedding(c.vocab, c.d_model)
        nn.init.normal_(self.embed.weight, std=INIT_STD)
        self.pos_embed = nn.Parameter(torch.randn(c.seq, c.d_model) * INIT_STD)
        self.blocks = nn.ModuleList(Block(c.d_model, c.heads, c.seq) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.d_model, eps=LN_EPS)
        self.head = _linear(c.d_model, c.vocab, bias=False)

    def forward(self, ids):
        t = ids.shape[-1]
        x = self.embed(ids) + self.pos_embed[:t]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def param_count(model: nn.Module) -> int:
    return int(sum(p.numel() for p in model.parameters()))


def _flax_to_torch_names(params: dict) -> dict[str, np.ndarray]:
    """Flax param tree (``bench/gpt.py``) -> ``{torch state_dict name: array}``."""
    out = {"embed.weight": params["embed"]["embedding"], "pos_embed": params["pos_embed"],
           "ln_f.weight": params["ln_f"]["scale"], "ln_f.bias": params["ln_f"]["bias"],
           "head.weight": np.asarray(params["head"]["kernel"]).T}
    i = 0
    while f"block_{i}" in params:
        p, pre = params[f"block_{i}"], f"blocks.{i}."
        for ln in ("ln1", "ln2"):
            out[pre + ln + ".weight"] = p[ln]["scale"]
            out[pre + ln + ".bias"] = p[ln]["bias"]
        for mod, sub in (("attn", "qkv"), ("attn", "proj"), ("mlp", "fc"), ("mlp", "proj")):
            out[f"{pre}{mod}.{sub}.weight"] = np.asarray(p[mod][sub]["kernel"]).T  # [in,out]
            out[f"{pre}{mod}.{sub}.bias"] = p[mod][sub]["bias"]
        i += 1
    return {k: np.asarray(v, dtype=np.float32) for k, v in out.items()}


def load_flax_params(model: TorchGPT, params: dict) -> None:
    """Copy the Flax float32 params of ``bench/gpt.py``'s ``GPT`` into ``model`` (in place).
    Every parameter must be matched, with its exact shape."""
    arrays = _flax_to_torch_names(params)
    named = dict(model.named_parameters())
    if set(arrays) != set(named):
        raise ValueError(f"Flax/PyTorch parameter names differ: only Flax "
                         f"{sorted(set(arrays) - set(named))}, only PyTorch "
                         f"{sorted(set(named) - set(arrays))}.")
    with torch.no_grad():
        for name, p in named.items():
            a = torch.from_numpy(np.array(arrays[name], dtype=np.float32))
            if tuple(a.shape) != tuple(p.shape):
                raise ValueError(f"{name}: Flax shape {tuple(a.shape)} vs PyTorch "
                                 f"{tuple(p.shape)}.")
            p.copy_(a)


class TorchTrainer:
    """One model + AdamW + GradScaler trained on one fixed batch; ``trainer(steps)`` runs
    ``steps`` steps and waits for the device. A ``torch.compile`` that fails at the first step
    falls back to eager and says why in ``compile_error``."""

    def __init__(self, config, batch: dict, dtype: str, *, device: str = "cpu",
                 params: dict | None = None, compile: bool = False, clip_norm: float = 1.0,
                 seed: int = 0):
        torch.manual_seed(seed)
        self.device = torch.device(device)
        self.amp_dtype = AMP_DTYPES[dtype]
        self.model = TorchGPT(config).to(self.device)
        if params is not None:
            load_flax_params(self.model, params)
        self.opt = torch.optim.AdamW(self.model.parameters(), **ADAMW)
        self.scaler = torch.amp.GradScaler(self.device.type,
                                           enabled=self.amp_dtype == torch.float16)
        self.clip_norm = clip_norm
        self.compiled = compile
        self.compile_error: str | None = None
        self.forward = torch.compile(self.model) if compile else self.model
        # Copies (np.array): jax arrays view read-only buffers, which torch will not wrap.
        self.inputs = torch.from_numpy(np.array(batch["inputs"], dtype=np.int64)).to(self.device)
        self.targets = torch.from_numpy(np.array(batch["targets"], dtype=np.int64)).to(
            self.device)
        self.last_loss: torch.Tensor | None = None

    def autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def loss(self) -> torch.Tensor:
        with self.autocast():
            logits = self.forward(self.inputs)
            return F.cross_entropy(logits.float().flatten(0, 1), self.targets.flatten())

    def step(self) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss()
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.opt)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_norm)
        self.scaler.step(self.opt)
        self.scaler.update()
        return loss.detach()

    def first(self) -> float:
        """The first step (``torch.compile``'s compile happens here); eager fallback."""
        t0 = time.perf_counter()
        try:
            self(1)
        except Exception as e:  # any compile failure means "use eager"
            if not self.compiled:
                raise
            self.compile_error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            self.compiled, self.forward = False, self.model
            self(1)
        return time.perf_counter() - t0

    def __call__(self, steps: int) -> None:
        loss = None
        for _ in range(steps):
            loss = self.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_loss = loss

    @torch.no_grad()
    def eval_loss(self) -> float:
        """Float32 loss of the current params in eager mode, no autocast."""
        logits = self.model(self.inputs)
        return float(F.cross_entropy(logits.float().flatten(0, 1), self.targets.flatten()))
