"""The example's ``--dropout``: the GPT's dropout runs through jaxamp's step with the state's rng
(kept apart from tests/test_example.py, which covers the CLI)."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import lm_data  # noqa: E402
import lm_model  # noqa: E402
import train_lm  # noqa: E402

import jaxamp  # noqa: E402


def test_example_dropout_uses_the_state_rng_and_is_off_in_evaluation():
    config = lm_model.GPTConfig(n_layer=2, n_head=2, d_model=32, block_size=16, dropout=0.1)
    model, params = lm_model.init_params(config)
    args = train_lm.build_parser().parse_args(["--dropout", "0.1"])
    tx = train_lm.make_optimizer(args)  # the example's AdamW
    ids = np.random.default_rng(0).integers(0, 256, (4, config.block_size + 1))
    batch = {"inputs": ids[:, :-1].astype(np.int32), "targets": ids[:, 1:].astype(np.int32)}
    state = jaxamp.TrainState.create(model, params, tx, rng=train_lm.dropout_rng(config, 0))
    step = jaxamp.make_train_step(model, train_lm.loss_fn, donate=False)
    _, m_a = step(state, batch)
    _, m_b = step(state.replace(rng=jax.random.PRNGKey(1)), batch)
    _, m_a2 = step(state, batch)
    assert float(m_a["loss"]) != float(m_b["loss"])  # another key: other dropout masks
    assert float(m_a["loss"]) == float(m_a2["loss"])  # the same key: the same masks
    # evaluation (no rng): no dropout
    eval_loss = jaxamp.make_eval_step(model, train_lm.loss_fn)(params, batch)
    assert abs(float(m_a["loss"]) - float(eval_loss)) > 1e-4


def test_dropout_flag_is_validated():
    with pytest.raises(train_lm.UsageError, match=r"--dropout must be in \[0, 1\), got 1.0"):
        train_lm.validate(train_lm.build_parser().parse_args(["--dropout", "1.0"]))
    assert lm_data  # the example's data module imports alongside
