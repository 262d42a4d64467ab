"""Third-party model libraries, unmodified: tiny configs, dummy weights, a batch and a loss.

The models JAX users have since transformers v5 removed its Flax models: google-tunix's NNX
LLMs (Llama3, Qwen3, Qwen3-MoE, Gemma2 with logit soft-caps and sliding-window layers) and
eqx-zoo's Equinox ports (Qwen3; Python >= 3.12). Nothing here changes the libraries' code:
the builders only pick tiny configs and random weights (``create_dummy_model``'s std 0.02
gives logits near 1e-2, so 0.4: losses and gradients of a real size).

Each builder returns a :class:`Case`; :data:`THIRD_PARTY` maps names to builders and
:func:`case` skips the calling test where a library is not installed (``.ci/run`` installs
them: see its ``THIRD_PARTY_CMD``). The forms a user writes:

* NNX (tunix): ``loss(model, batch)``; ``jaxamp.TrainState.create(case.model, tx=...)`` and
  ``jaxamp.make_train_step(loss_fn=case.loss)``;
* Equinox (eqx-zoo): ``loss(model, batch)`` as well (``autocast(case.loss)(model, batch)``);
  the train step takes ``apply_fn=case.apply_fn`` and ``params=case.params`` (the model's
  float arrays, ``eqx.partition``) with ``case.step_loss(apply_fn, params, batch)``.

:meth:`Case.functional` gives every case as ``(params, f(params, batch))``, the form the
float32 references are differentiated in.

tunix's package ``__init__`` imports transformers, grain and tensorflow-datasets, which its
model files do not use: :func:`import_bare` imports a module with bare parent packages (their
``__init__`` files are not run), so a tunix model needs jaxtyping and nothing else.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import jaxamp

SCALE = 0.4  # dummy-weight std: logits of a size a real model has
BATCH, SEQ, VOCAB = 2, 12, 64


def import_bare(name: str) -> types.ModuleType:
    """Imports module ``name`` with its parent packages registered as bare package modules:
    their ``__init__`` files do not run (tunix's top-level one imports training libraries)."""
    parent = name.rpartition(".")[0]
    if parent:
        _bare_package(parent)
    return importlib.import_module(name)


def _bare_package(name: str) -> types.ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    parent, _, child = name.rpartition(".")
    if parent:
        path = [os.path.join(d, child) for d in _bare_package(parent).__path__]
    else:
        spec = importlib.util.find_spec(name)  # locates a top-level package, runs nothing
        if spec is None or spec.submodule_search_locations is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        path = list(spec.submodule_search_locations)
    module = types.ModuleType(name)
    module.__path__ = path
    module.__package__ = name
    sys.modules[name] = module
    return module


@dataclasses.dataclass
class Case:
    """A third-party model as its users run it.

    Attributes:
      name, library, note: what it is (``note``: what the model exercises).
      model: the library's model object (``nnx.Module`` or ``equinox.Module``).
      batch: ``{"inputs", "targets", ...}`` integer arrays with a leading batch axis.
      loss: ``loss(model, batch) -> float32 scalar`` (next-token cross-entropy through
        :func:`jaxamp.softmax_cross_entropy`).
      kind: ``"nnx"`` or ``"equinox"``.
    """

    name: str
    library: str
    note: str
    model: Any
    batch: dict
    loss: Callable
    kind: str

    def functional(self) -> tuple[Any, Callable]:
        """``(params, f(params, batch))``: the model's float params and the loss of them."""
        if self.kind == "nnx":
            from flax import nnx
            graphdef, params, rest = nnx.split(self.model, nnx.Param, ...)

            def f(params, batch):
                return self.loss(nnx.merge(graphdef, params, rest, copy=True), batch)
            return params, f
        import equinox as eqx
        params, static = eqx.partition(self.model, eqx.is_inexact_array)
        return params, lambda p, batch: self.loss(eqx.combine(p, static), batch)

    def state(self, policy: str, tx) -> jaxamp.TrainState:
        """A :class:`jaxamp.TrainState` as the README builds one for this kind of model."""
        if self.kind == "nnx":
            return jaxamp.TrainState.create(self.model, tx=tx, policy=policy)
        return jaxamp.TrainState.create(apply_fn=self.apply_fn, params=self.params, tx=tx,
                                        policy=policy)

    def train_step(self, **kwargs):
        """:func:`jaxamp.make_train_step` for this kind of model (``kwargs``: its options)."""
        if self.kind == "nnx":
            return jaxamp.make_train_step(loss_fn=self.loss, **kwargs)
        return jaxamp.make_train_step(loss_fn=self.step_loss, **kwargs)

    # Equinox: the model as (params, apply_fn), the form TrainState.create(apply_fn=) takes
    @property
    def params(self):
        import equinox as eqx
        return eqx.filter(self.model, eqx.is_inexact_array)

    def apply_fn(self, params, batch):
        import equinox as eqx
        static = eqx.filter(self.model, eqx.is_inexact_array, inverse=True)
        return self.loss(eqx.combine(params, static), batch)

    @staticmethod
    def step_loss(apply_fn, params, batch):
        return apply_fn(params, batch)


def _lm_batch(seed: int, vocab: int = VOCAB) -> dict:
    ids = jax.random.randint(jax.random.key(seed), (BATCH, SEQ + 1), 0, vocab)
    return {"inputs": ids[:, :-1], "targets": ids[:, 1:]}


def _tunix_inputs(batch: dict) -> tuple:
    """tunix's ``(tokens, positions, cache, attention_mask)`` for a causal forward."""
    b, t = batch["inputs"].shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    return batch["inputs"], positions, None, mask


def _tunix_loss(model, batch):
    logits, _ = model(*_tunix_inputs(batch))
    return jaxamp.softmax_cross_entropy(logits, batch["targets"])


def _dummy(module, cls, config, seed):
    creator = import_bare("tunix.models.dummy_model_creator")
    return creator.create_dummy_model(getattr(module, cls), config, random_seed=seed,
                                      scale=SCALE)


def tunix_llama3() -> Case:
    """tunix's Llama3: RoPE, grouped-query attention (4 q / 2 kv heads), SwiGLU, its own
    RMSNorm, modules whose ``__call__`` is wrapped in ``jax.named_scope``."""
    m = import_bare("tunix.models.llama3.model")
    config = m.ModelConfig(num_layers=2, vocab_size=VOCAB, embed_dim=64, hidden_dim=128,
                           num_heads=4, head_dim=16, num_kv_heads=2, rope_theta=10_000,
                           norm_eps=1e-5)
    return Case("llama3", "tunix", "RoPE, GQA 4q/2kv, SwiGLU, named scopes",
                _dummy(m, "Llama3", config, 1), _lm_batch(2), _tunix_loss, "nnx")


def tunix_qwen3() -> Case:
    """tunix's Qwen3 (dense): Llama3's layout plus RMS-normalised queries and keys."""
    m = import_bare("tunix.models.qwen3.model")
    config = m.ModelConfig(num_layers=2, vocab_size=VOCAB, embed_dim=64, hidden_dim=128,
                           num_heads=4, head_dim=16, num_kv_heads=2, rope_theta=10_000,
                           norm_eps=1e-6)
    return Case("qwen3", "tunix", "q/k RMSNorm, GQA, SwiGLU",
                _dummy(m, "Qwen3", config, 3), _lm_batch(4), _tunix_loss, "nnx")


def tunix_qwen3_moe() -> Case:
    """tunix's Qwen3-MoE on CPU: its dense fallback (softmax router, top-2 of 4 experts,
    one-hot dispatch, ``jnp.tile``'d routing weights)."""
    m = import_bare("tunix.models.qwen3.model")
    config = m.ModelConfig(num_layers=2, vocab_size=VOCAB, embed_dim=64, hidden_dim=32,
                           num_heads=4, head_dim=16, num_kv_heads=2, rope_theta=10_000,
                           norm_eps=1e-6, num_experts=4, num_experts_per_tok=2)
    return Case("qwen3_moe", "tunix", "top-2 of 4 experts, one-hot dispatch, jnp.tile",
                _dummy(m, "Qwen3", config, 5), _lm_batch(6), _tunix_loss, "nnx")


def tunix_gemma2() -> Case:
    """tunix's Gemma (version 2 config): attention-logit and final-logit soft-caps (tanh),
    alternating sliding-window and global layers, post-norms, a tied head, GELU gates."""
    m = import_bare("tunix.models.gemma.model")
    config = m.ModelConfig(
        num_layers=2, num_embed=VOCAB, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16,
        num_kv_heads=2, final_logit_softcap=30.0, use_post_attn_norm=True,
        use_post_ffw_norm=True, attention_types=(m.AttentionType.LOCAL_SLIDING,
                                                 m.AttentionType.GLOBAL),
        attn_logits_soft_cap=50.0, sliding_window_size=4)
    return Case("gemma2", "tunix", "soft-caps, sliding window 4, post-norms, tied head",
                _dummy(m, "Gemma", config, 7), _lm_batch(8), _tunix_loss, "nnx")


def _eqx_loss(model, batch):
    logits = jax.vmap(lambda ids: model(ids)[0])(batch["inputs"])
    return jaxamp.softmax_cross_entropy(logits, batch["targets"])


def eqx_qwen3() -> Case:
    """eqx-zoo's Qwen3 CausalLM (Equinox): q/k norm, GQA through ``jnp.repeat``, float32
    softmax written in the model, one sequence per call (``jax.vmap`` over the batch)."""
    import equinox as eqx
    from eqx_zoo import CausalLM, Config

    config = Config(architecture="Qwen3ForCausalLM", vocab_size=VOCAB, hidden_size=64,
                    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10_000.0,
                    tie_word_embeddings=False, attention_bias=False, qk_norm=True,
                    rope_scaling=None)
    model = CausalLM(config, key=jax.random.key(9))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(10), len(leaves))
    # the same dummy weights as tunix's: N(0, SCALE^2) everywhere (norm scales too)
    leaves = [SCALE * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    model = eqx.combine(jax.tree.unflatten(tree, leaves), static)
    return Case("qwen3", "eqx-zoo", "q/k norm, GQA by jnp.repeat, Equinox (no Flax)",
                model, _lm_batch(11), _eqx_loss, "equinox")


#: ``(library, name) -> builder``.
THIRD_PARTY: dict[tuple[str, str], Callable[[], Case]] = {
    ("tunix", "llama3"): tunix_llama3,
    ("tunix", "qwen3"): tunix_qwen3,
    ("tunix", "qwen3_moe"): tunix_qwen3_moe,
    ("tunix", "gemma2"): tunix_gemma2,
    ("eqx-zoo", "qwen3"): eqx_qwen3,
}

#: The importable module each library's models need.
_NEEDS = {"tunix": "tunix", "eqx-zoo": "eqx_zoo"}


def installed(library: str) -> bool:
    """Whether ``library`` ("tunix", "eqx-zoo") can be imported here."""
    name = _NEEDS[library]
    return name in sys.modules or importlib.util.find_spec(name) is not None


def case(library: str, name: str) -> Case:
    """The :class:`Case`, or a pytest skip where ``library`` is not installed (eqx-zoo needs
    Python >= 3.12; ``.ci/run`` installs both where they install)."""
    if not installed(library):
        pytest.skip(f"{library} is not installed (.ci/run's THIRD_PARTY_CMD installs it)")
    return THIRD_PARTY[(library, name)]()
