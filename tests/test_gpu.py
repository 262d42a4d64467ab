"""On a GPU: the example's AMP train step runs its matmuls on Tensor Cores and its loss scaling
on the device (``pytest -m gpu tests/test_gpu.py``, run by ``bench/gpu.sh``).

Every test here is marked ``gpu`` and skips unless ``jax.default_backend() == "gpu"``. With
``JAXAMP_GPU_DRY_RUN=1`` (``bench/gpu.sh --cpu-dry-run``) they run on CPU at the ``test`` preset
instead, to prove the plumbing (building the example's step, compiling it, reading its HLO,
poisoning a step): the Tensor Core assertions only apply to GPU HLO, so on CPU those tests stop
after checking that the reader found the matmuls. The HLO reader itself is tested on CPU with
handwritten XLA:GPU samples in ``tests/test_gpu_hlo.py``.

The step is the example's own: ``examples/train_lm.py``'s ``loss_fn``, ``make_optimizer`` and
``make_loss_scale`` with its default flags, ``lm_model.GPT`` at the ``gpt2-small`` preset
(``JAXAMP_GPU_TEST_PRESET`` to change), under ``jaxamp.make_train_step``.
"""

import os
import sys
from collections import Counter
from functools import cache
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp.diagnostics._hlo import (
    f32_dot_signatures,
    find_gemms,
    host_traffic,
    summarize,
    tensor_core_violations,
)

ROOT = Path(__file__).resolve().parent.parent
for sub in ("bench", "examples"):
    sys.path.insert(0, str(ROOT / sub))
try:
    import lm_cli
    import lm_model
    import train_lm
finally:
    for sub in ("bench", "examples"):
        sys.path.remove(str(ROOT / sub))

ON_GPU = jax.default_backend() == "gpu"
DRY_RUN = os.environ.get("JAXAMP_GPU_DRY_RUN", "") not in ("", "0")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (ON_GPU or DRY_RUN),
                       reason=f"needs a GPU (backend is {jax.default_backend()}); "
                              "JAXAMP_GPU_DRY_RUN=1 runs the plumbing on CPU"),
]
PRESET = os.environ.get("JAXAMP_GPU_TEST_PRESET", "gpt2-small" if ON_GPU else "test")
BATCH = 8 if PRESET == "gpt2-small" else 2
POLICIES = {"bfloat16": "params=float32,compute=bfloat16,output=float32",
            "float16": "params=float32,compute=float16,output=float32"}
CUBLAS_CUDNN = ("cublas", "cublaslt", "cudnn", "cudnn-fusion")


def example_parts(policy: str, *extra: str):
    """(model, config, tx, loss scale, policy, args) exactly as ``train_lm.py`` builds them."""
    args = train_lm.build_parser().parse_args(
        ["--preset", PRESET, "--policy", policy, "--batch-size", str(BATCH), *extra])
    config = lm_model.PRESETS[PRESET]
    pol = jaxamp.get_policy(policy)
    kind = args.loss_scale
    if kind == "auto":
        kind = "dynamic" if np.dtype(pol.compute_dtype) == np.float16 else "none"
    return (lm_model.GPT(config), config, train_lm.make_optimizer(args),
            lm_cli.make_loss_scale(kind, args), pol, args)


def abstract_batch(config):
    ids = jax.ShapeDtypeStruct((BATCH, config.block_size), jnp.int32)
    return {"inputs": ids, "targets": ids}


@cache
def compiled_example_step(dtype: str):
    """(compiled HLO text, f32 dot allowance from the traced step) of the example's step."""
    model, config, tx, loss_scale, policy, args = example_parts(POLICIES[dtype])
    step = jaxamp.make_train_step(model, train_lm.loss_fn, tx, policy=policy,
                                  clip_norm=args.clip_norm or None)
    state = jax.eval_shape(lambda p: jaxamp.TrainState.create(  # train_lm.create_state's
        model, p, tx, loss_scale=loss_scale, policy=policy), lm_model.abstract_params(config))
    batch = abstract_batch(config)
    text = step.lower(state, batch).compile().as_text()
    allowed = f32_dot_signatures(jax.make_jaxpr(step)(state, batch))
    return text, allowed


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_every_matmul_runs_on_tensor_cores(dtype):
    """Every dot of the compiled step is a library GEMM (cuBLAS/cuBLASLt/cuDNN, or XLA's Triton
    GEMM) with f16/bf16 operands, except the float32 matmuls the float32 rules ask for."""
    text, allowed = compiled_example_step(dtype)
    gemms = find_gemms(text)
    summary = summarize(gemms)
    print(f"{PRESET} {dtype}: {summary}; f32 matmuls the rules keep: {sum(allowed.values())}")
    # Forward qkv, scores, weights @ v, proj, fc, proj, head: 7 matmuls, twice more backward.
    assert len(gemms) >= 7, summary
    if not ON_GPU:  # CPU dry run: the reader found the matmuls; the rest is GPU HLO only
        return
    violations = tensor_core_violations(gemms, allowed)
    assert not violations, "\n".join([f"{len(violations)} of {len(gemms)} matmuls:"]
                                     + violations[:20])
    low = {"bfloat16": "bf16", "float16": "f16"}[dtype]
    n_low = sum(1 for g in gemms if set(g.operand_dtypes) == {low})
    assert n_low >= len(gemms) - sum(allowed.values()), summary


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_matmuls_are_cublas_or_cudnn_calls(dtype):
    """The issue's letter: cuBLAS/cuBLASLt (or cuDNN) calls. A GEMM XLA's autotuner gave to
    Triton (f16/bf16 Triton GEMMs use Tensor Cores too) fails this test and says so."""
    text, allowed = compiled_example_step(dtype)
    gemms = find_gemms(text)
    if not ON_GPU:
        assert gemms
        return
    violations = tensor_core_violations(gemms, allowed, libraries=CUBLAS_CUDNN)
    triton = sum(1 for g in gemms if g.library == "triton")
    assert not violations, (f"{len(violations)} of {len(gemms)} matmuls are not cuBLAS/cuDNN "
                            f"calls in f16/bf16 ({triton} are XLA Triton GEMMs):\n"
                            + "\n".join(violations[:20]))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_step_never_talks_to_the_host(dtype):
    """No callback, send/recv or in/outfeed: the finite check, skip and loss-scale update are
    device code."""
    text, _ = compiled_example_step(dtype)
    assert host_traffic(text) == []


def test_poisoned_step_is_skipped_on_device():
    """float16 with dynamic scaling: a poisoned step (loss times inf) is skipped, the scale
    halves and the params stay bit-identical; a clean step then updates them. Both steps run
    under ``jax.transfer_guard("disallow")`` on device-resident inputs: no host round trip."""
    preset_cfg = lm_model.PRESETS["test"]
    model = lm_model.GPT(preset_cfg)
    args = train_lm.build_parser().parse_args(
        ["--preset", "test", "--policy", POLICIES["float16"], "--init-scale", "32768",
         "--schedule", "constant", "--warmup", "0"])  # the first update has lr > 0
    policy = jaxamp.get_policy(POLICIES["float16"])
    tx = train_lm.make_optimizer(args)
    loss_scale = lm_cli.make_loss_scale("dynamic", args)

    def poisonable_loss(apply_fn, params, batch):
        clean = {k: batch[k] for k in ("inputs", "targets")}
        return train_lm.loss_fn(apply_fn, params, clean) * batch["poison"][0]

    step = jaxamp.make_train_step(model, poisonable_loss, tx, policy=policy,
                                  clip_norm=args.clip_norm or None)
    _, params = lm_model.init_params(preset_cfg, seed=0)
    state = jaxamp.TrainState.create(model, params, tx, loss_scale=loss_scale, policy=policy)
    device = jax.devices()[0]
    ids = jax.random.randint(jax.random.key(0), (2, preset_cfg.block_size + 1), 0, 256)
    clean = {"inputs": ids[:, :-1], "targets": ids[:, 1:], "poison": jnp.ones((2,), jnp.float32)}
    poisoned = dict(clean, poison=jnp.full((2,), jnp.inf, jnp.float32))
    clean, poisoned = jax.device_put((clean, poisoned), device)
    state = jax.device_put(state, device)
    before = jax.tree.map(np.asarray, state.params)
    assert float(state.loss_scale.loss_scale) == 32768.0

    with jax.transfer_guard("disallow"):
        state, m = step(state, poisoned)
        jax.block_until_ready((state, m))
    assert bool(m["skipped"]) and not bool(m["grads_finite"])
    assert int(state.skipped_steps) == 1
    assert float(state.loss_scale.loss_scale) == 16384.0
    after = jax.tree.map(np.asarray, state.params)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before),
                                                      jax.tree.leaves(after), strict=True))
    leaf = jax.tree.leaves(state.params)[0]
    assert leaf.devices() == {device} and device.platform == jax.default_backend()

    with jax.transfer_guard("disallow"):
        state, m = step(state, clean)
        jax.block_until_ready((state, m))
    assert not bool(m["skipped"]) and bool(m["grads_finite"])
    assert int(state.skipped_steps) == 1
    assert float(state.loss_scale.loss_scale) == 16384.0  # grows only after growth_interval
    changed = [not np.array_equal(a, np.asarray(b)) for a, b in
               zip(jax.tree.leaves(after), jax.tree.leaves(state.params), strict=True)]
    assert any(changed)


def test_fused_attention_runs_in_cudnn_in_the_compute_dtype():
    """``jax.nn.dot_product_attention`` under a bf16 autocast policy (traced in float32) is
    re-dispatched by the engine to cuDNN's fused kernel with bf16 operands, forward and
    backward (the engine's mechanism is tested on CPU in tests/test_fused_attention.py)."""
    policy = POLICIES["bfloat16"]

    def loss(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        return jnp.mean(out.astype(jnp.float32) ** 2)

    f = jax.jit(jax.value_and_grad(jaxamp.autocast(loss, policy), argnums=(0, 1, 2)))
    shape = (2, 1024, 12, 64) if ON_GPU else (1, 16, 2, 8)
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, shape, jnp.float32) for kk in keys)
    text = f.lower(q, k, v).compile().as_text()
    gemms = find_gemms(text)
    print(f"fused attention, bf16 policy: {summarize(gemms)}")
    value, grads = f(q, k, v)
    assert np.isfinite(float(value)) and all(np.isfinite(np.asarray(g)).all() for g in grads)
    if not ON_GPU:
        return
    fmha = [g for g in gemms if g.library == "cudnn" and "fmha" in g.target.lower()]
    assert len(fmha) >= 2, f"no cuDNN fused attention forward + backward: {summarize(gemms)}"
    assert all(g.operand_dtypes == ("bf16", "bf16") for g in fmha), fmha
    assert not tensor_core_violations(gemms)


def test_f32_allowance_is_small():
    """The float32 rules keep few matmuls in float32 (none in this model's forward or
    backward); a jump here would mean the policy stopped applying."""
    _, allowed = compiled_example_step("bfloat16")
    assert sum(allowed.values()) <= 2, Counter(allowed)
