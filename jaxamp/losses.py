"""Losses computed in float32 whatever the dtype of their inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

__all__ = ["softmax_cross_entropy"]


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array, *,
                          where: jax.Array | None = None) -> jax.Array:
    """Mean cross-entropy of integer ``labels`` under ``logits``, computed in float32.

    The log-sum-exp of float16 logits overflows beyond ~11 and loses the small probabilities,
    so the loss runs in float32 (the mixed-precision rule): called on low-precision logits it casts
    them to float32 first; under :func:`jaxamp.autocast`, where the function is traced in
    float32, the op rules run its exp, log and sums in float32.

    Args:
      logits: ``[..., num_classes]`` floating array of any float dtype.
      labels: ``[...]`` integer class ids.
      where: optional boolean mask ``[...]``; masked-out positions do not count.

    Returns:
      A float32 scalar.

    Example:
      >>> import jax.numpy as jnp
      >>> softmax_cross_entropy(jnp.zeros((2, 4), jnp.float16), jnp.array([0, 3])).dtype
      dtype('float32')
    """
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise TypeError(f"softmax_cross_entropy: logits must be floating, got {logits.dtype}.")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(
            f"softmax_cross_entropy: labels must be integer class ids, got {labels.dtype}. "
            "For one-hot or soft targets use optax.softmax_cross_entropy on float32 logits.")
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"softmax_cross_entropy: labels.shape must equal logits.shape[:-1]. Received "
            f"logits.shape={logits.shape} and labels.shape={labels.shape}.")
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    return jnp.mean(losses, where=where)
