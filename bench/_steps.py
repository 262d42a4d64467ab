"""The steps under test: jaxamp's AMP train step and a plain baseline with the same autocast
forward, the runners that thread their state through timed calls, and the model, parameters and
batch shared by every section (built once per process)."""

from __future__ import annotations

import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from gpt import GPT, GPTConfig, init, lm_loss, make_batch

import jaxamp

F16_POLICY = "params=float32,compute=float16,output=float32"
POLICIES = {
    "float32": "float32",
    "bfloat16": "params=float32,compute=bfloat16,output=float32",
    "float16": F16_POLICY,
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_tx() -> optax.GradientTransformation:
    return optax.adamw(1e-3)


def amp_loss_of(model, policy: str) -> Callable:
    return jaxamp.autocast(lambda params, batch: lm_loss(model.apply, params, batch), policy)


def make_baseline_step(model, tx, policy: str):
    """Same autocast forward/backward as the AMP step; no loss scale, finite check or clip."""
    loss_fn = amp_loss_of(model, policy)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def make_amp_step(model, tx, policy: str, *, clip_norm: float | None = 1.0):
    return jaxamp.make_train_step(model, lm_loss, tx, policy=policy, clip_norm=clip_norm)


def copy_tree(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


class AmpRunner:
    """Threads a (donated) ``TrainState`` through ``steps`` calls of a ``make_train_step``."""

    def __init__(self, model, params, tx, batch, policy, loss_scale, clip_norm=1.0):
        self.step = make_amp_step(model, tx, policy, clip_norm=clip_norm)
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


class BaselineRunner:
    def __init__(self, model, params, tx, batch, policy):
        self.step = make_baseline_step(model, tx, policy)
        self.params = copy_tree(params)
        self.opt_state = tx.init(self.params)
        self.batch = batch

    def __call__(self, steps: int) -> None:
        params, opt_state = self.params, self.opt_state
        for _ in range(steps):
            params, opt_state, _ = self.step(params, opt_state, self.batch)
        jax.block_until_ready((params, opt_state))
        self.params, self.opt_state = params, opt_state


_SETUP: dict = {}
# (compiled AMP step, its optax transformation) by (config, batch, policy name), kept from the
# compile and memory measurements so ``--smoke`` can time them again (a TrainState's pytree
# metadata holds the transformation, so the executable only accepts states built with it).
AMP_EXECUTABLES: dict = {}


def setup(cfg: GPTConfig, batch_size: int):
    """(model, float32 params, batch) for a config, built once per process."""
    key = (cfg, batch_size)
    if key not in _SETUP:
        model = GPT(cfg)
        _SETUP[key] = (model, init(model, cfg), make_batch(cfg, batch_size))
    return _SETUP[key]
