"""TrainState.create and make_train_step say where a misplaced option belongs (GitHub issue
#26): the state holds what is trained (params, policy, loss scale, RNG, collections), the step
how it runs (overrides, clipping, micro-batches, mesh, ...). Refused before anything traces."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import struct

import jaxamp

MODEL = nn.Dense(2)
VARIABLES = MODEL.init(jax.random.key(0), jnp.ones((1, 3)))


def loss_fn(apply_fn, params, batch):
    return jnp.mean(apply_fn({"params": params}, batch))


@pytest.mark.parametrize("name,value", [("overrides", {"Dense": "float32"}),
                                        ("clip_norm", 1.0), ("micro_batches", 2),
                                        ("op_rules", jaxamp.DEFAULT_OP_RULES),
                                        ("has_aux", True), ("donate", False)])
def test_step_options_given_to_the_state_name_make_train_step(name, value):
    with pytest.raises(TypeError, match=rf"TrainState.create: unexpected keyword argument "
                                        rf"'{name}'\. {name} belongs to make_train_step.*"
                                        rf"make_train_step\(model, loss_fn, {name}=\.\.\.\)"):
        jaxamp.TrainState.create(MODEL, VARIABLES, optax.sgd(0.1), **{name: value})


@pytest.mark.parametrize("name,value", [("loss_scale", jaxamp.DynamicLossScale()),
                                        ("rng", jax.random.key(0)), ("params", {}),
                                        ("collections", {})])
def test_state_options_given_to_the_step_name_trainstate_create(name, value):
    with pytest.raises(TypeError, match=rf"make_train_step: unexpected keyword argument "
                                        rf"'{name}'\. {name} belongs to TrainState.create"):
        jaxamp.make_train_step(MODEL, loss_fn, **{name: value})


def test_unknown_and_derived_options_list_what_is_taken():
    with pytest.raises(TypeError, match=r"'overide'\. TrainState.create takes model, params, "
                                        r"tx, apply_fn, loss_scale, policy, rng, collections"):
        jaxamp.TrainState.create(MODEL, VARIABLES, optax.sgd(0.1), overide={})
    with pytest.raises(TypeError, match=r"'overide'\. make_train_step takes loss_fn, "
                                        r"overrides, clip_norm"):
        jaxamp.make_train_step(MODEL, loss_fn, overide={})
    with pytest.raises(TypeError, match=r"sets opt_state itself.*state.replace\(opt_state="):
        jaxamp.TrainState.create(MODEL, VARIABLES, optax.sgd(0.1), opt_state=())


def test_a_subclass_field_still_passes_through():
    class Tagged(jaxamp.TrainState):
        tag: str = struct.field(pytree_node=False, default="")

    state = Tagged.create(MODEL, VARIABLES["params"], optax.sgd(0.1), tag="run-1",
                          collections={"stats": {"n": jnp.zeros(())}})
    assert state.tag == "run-1" and set(state.collections) == {"stats"}
    # the right home still works, and the step runs
    step = jaxamp.make_train_step(MODEL, loss_fn, overrides={"Dense": "float32"},
                                  donate=False)
    plain = jaxamp.TrainState.create(MODEL, VARIABLES, optax.sgd(0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the root's class name matched: no unmatched warning
        _, metrics = step(plain, jnp.ones((4, 3)))
    assert bool(metrics["grads_finite"])
