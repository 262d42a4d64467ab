"""The steps under test (jaxamp's AMP step, a plain one with the same autocast forward, the
hand-cast twin's), runners that thread their state through timed calls, interleaved timing."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import jmp
import optax
from gpt import GPT, GPTConfig, init, lm_loss, make_batch
from gpt_handcast import HandCastGPT, handcast_loss

import jaxamp

F16_POLICY = "params=float32,compute=float16,output=float32"
POLICIES = {
    "float32": "float32",
    "bfloat16": "params=float32,compute=bfloat16,output=float32",
    "float16": F16_POLICY,
}


def med(xs) -> float:
    return float(statistics.median(xs))


def interleaved_runtime(runners: dict[str, Callable[[int], None]], *, repeats: int,
                        steps: int, warmup: int) -> dict[str, list[float]]:
    """Wall-clock seconds per step of each runner, per repeat. The runners alternate and the
    order flips every repeat, so machine noise hits every side alike."""
    for run in runners.values():
        run(warmup)
    names = list(runners)
    wall: dict[str, list[float]] = {k: [] for k in names}
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            gc.collect()
            t0 = time.perf_counter()
            runners[name](steps)
            wall[name].append((time.perf_counter() - t0) / steps)
    return wall


def make_tx() -> optax.GradientTransformation:
    return optax.adamw(1e-3)


def make_baseline_step(model, tx, policy: str):
    """Same autocast forward/backward as the AMP step; no loss scale, finite check or clip."""
    loss_fn = jaxamp.autocast(lambda params, batch: lm_loss(model.apply, params, batch), policy)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def copy_tree(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


class AmpRunner:
    """Threads a (donated) ``TrainState`` through ``steps`` calls of ``jaxamp.make_train_step``
    (``lm_loss``, clip 1.0; ``op_rules``: the default where None)."""

    def __init__(self, model, params, tx, batch, policy, loss_scale, op_rules=None):
        kw = {} if op_rules is None else {"op_rules": op_rules}
        self.step = jaxamp.make_train_step(model, lm_loss, tx, policy=policy, clip_norm=1.0,
                                           **kw)
        self.state = jaxamp.TrainState.create(model, copy_tree(params), tx, policy=policy,
                                              loss_scale=loss_scale)
        self.batch = batch

    def __call__(self, steps: int) -> None:
        state = self.state
        for _ in range(steps):
            state, _ = self.step(state, self.batch)
        jax.block_until_ready(state)
        self.state = state

    def skipped(self) -> int:
        return int(self.state.skipped_steps)


def hand_train_step(loss_fn: Callable, tx, compute: str, *, clip_norm: float = 1.0,
                    period: int = 2000):
    """A plain ``jax.jit`` step of a hand-cast twin's ``loss_fn(params, batch)`` with ``jmp``
    loss scaling, doing ``jaxamp.make_train_step``'s work (scale, unscale, finite check, skip,
    clip, update): ``step(params, opt_state, scale_state, skipped, batch) -> (params,
    opt_state, scale_state, skipped, loss)``. ``scale_state``: ``(loss_scale, counter)`` of a
    ``jmp.DynamicLossScale`` for float16 (jaxamp's defaults), else ``()``; the jmp object is
    rebuilt inside the step (its ``__post_init__`` refuses ``lower``'s placeholders)."""
    clip = optax.clip_by_global_norm(clip_norm)
    dynamic = compute == "float16"

    def step(params, opt_state, scale_state, skipped, batch):
        loss_scale = (jmp.DynamicLossScale(*scale_state, period=period) if dynamic
                      else jmp.NoOpLossScale())
        loss, grads = jax.value_and_grad(
            lambda p: loss_scale.scale(loss_fn(p, batch)))(params)
        grads = loss_scale.unscale(grads)
        finite = jmp.all_finite(grads)
        grads, _ = clip.update(grads, clip.init(params))
        updates, new_opt = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jmp.select_tree(finite, (new_params, new_opt), (params, opt_state))
        skipped = skipped + jnp.where(finite, 0, 1).astype(jnp.int32)
        loss_scale = loss_scale.adjust(finite)
        scale_state = (loss_scale.loss_scale, loss_scale.counter) if dynamic else ()
        return params, opt_state, scale_state, skipped, loss_scale.unscale(loss)

    return jax.jit(step, donate_argnums=(0, 1, 2, 3))


def hand_carry(params, opt_state, compute: str) -> tuple:
    """:func:`hand_train_step`'s state before its first step: ``(params, opt_state,
    scale_state, skipped)``, jaxamp's initial float16 loss scale (2**16)."""
    dynamic = compute == "float16"
    scale_state = (jnp.float32(2.0**16), jnp.zeros((), jnp.int32)) if dynamic else ()
    return params, opt_state, scale_state, jnp.zeros((), jnp.int32)


class HandRunner:
    """The hand-written mixed-precision step a careful Flax user writes without jaxamp (the
    ``dtype=`` twin ``gpt_handcast.HandCastGPT`` in :func:`hand_train_step`); threads its
    (donated) state through ``steps`` calls."""

    def __init__(self, cfg: GPTConfig, params, tx, batch, compute: str):
        self.step = hand_train_step(handcast_loss(HandCastGPT(cfg, jnp.dtype(compute))), tx,
                                    compute)
        params = copy_tree(params)
        self.carry = hand_carry(params, tx.init(params), compute)
        self.batch = batch

    def args(self) -> tuple:
        return *self.carry, self.batch

    def __call__(self, steps: int) -> None:
        carry = self.carry
        for _ in range(steps):
            carry = self.step(*carry, self.batch)[:4]
        jax.block_until_ready(carry[:2])
        self.carry = carry

    def skipped(self) -> int:
        return int(self.carry[3])


_SETUP: dict = {}


def setup(cfg: GPTConfig, batch_size: int):
    """(model, float32 params, batch) for a config, built once per process."""
    key = (cfg, batch_size)
    if key not in _SETUP:
        model = GPT(cfg)
        _SETUP[key] = (model, init(model, cfg), make_batch(cfg, batch_size))
    return _SETUP[key]
