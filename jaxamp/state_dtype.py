"""The optimizer state stored in bfloat16, computed in float32 and written back with
stochastic rounding, its random bits from a key carried in the state (README "Optimizer state
in bfloat16"; ``docs/api/state_dtype.rst``). :func:`jaxamp.amp` (``state_dtype=``) and the
train step (``opt_state=``) use it; a skipped step keeps the whole stored state, key included.

Example:
    >>> import optax
    >>> tx = with_state_dtype(optax.adam(1e-3), jnp.bfloat16)
    >>> state = tx.init({"w": jnp.ones(3)})
    >>> state.inner_state[0].mu["w"].dtype, state.inner_state[0].count.dtype
    (dtype(bfloat16), dtype('int32'))
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxamp._engine.jaxpr import evaluate_rerouted
from jaxamp.policy import check_state_dtype

__all__ = ["INITIAL_SEED", "RNG_IMPL", "StoredState", "is_stored", "rounding_bits",
           "stochastic_round", "with_state_dtype"]

#: The seed of the first rounding key: every run starts from the same key, so two runs with the
#: same data round alike. Replace ``StoredState.rounding_key`` to vary it.
INITIAL_SEED = 0

#: The PRNG of the rounding key (pinned, whatever ``jax_default_prng_impl`` says, so the key
#: in a checkpoint always has the same shape: ``uint32[2]``).
RNG_IMPL = "threefry2x32"


class StoredState(NamedTuple):
    """The state of :func:`with_state_dtype`.

    Attributes:
      inner_state: the wrapped optimizer's state, its :func:`is_stored` leaves (moments,
        accumulated gradients) in the storage dtype, the others as the optimizer made them.
      rounding_key: uint32 key data of a :data:`RNG_IMPL` PRNG key (plain integers, so it
        checkpoints like any array); each update splits it, keeps one half and draws the
        rounding bits from the other. None when the storage dtype is float32.
    """

    inner_state: Any
    rounding_key: jax.Array | None


def is_stored(leaf: Any) -> bool:
    """Whether ``leaf`` of an optimizer state is stored in the storage dtype: a floating array
    of at least one dimension. Scalars (counts, an injected learning rate that rounding would
    change) keep their dtype."""
    return hasattr(leaf, "dtype") and np.ndim(leaf) > 0 \
        and jnp.issubdtype(leaf.dtype, jnp.floating)


_LOW_BITS, _HIGH_BITS = np.uint32(0xFFFF), np.uint32(0xFFFF0000)
_MIX = (np.uint32(0x7FEB352D), np.uint32(0x846CA68B))
_SHIFTS = (np.uint32(16), np.uint32(15))

# lax, not jnp, below: scalar operands stay literals (docs/api/state_dtype.rst)


def _mix(x: jax.Array) -> jax.Array:
    """Wellons' ``lowbias32`` integer hash: a bijection of uint32 whose output bits each flip
    with probability ~1/2 when any input bit does."""
    for shift, factor in zip(_SHIFTS, _MIX):
        x = lax.mul(lax.bitwise_xor(x, lax.shift_right_logical(x, shift)), factor)
    return lax.bitwise_xor(x, lax.shift_right_logical(x, _SHIFTS[0]))


def rounding_bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """uint32 random bits for an array of ``shape``: ``mix(mix(index + key[0]) ^ key[1])`` of
    each element's row-major index (mod 2**32), ``key`` a fresh ``uint32[2]`` per leaf and
    update. Ten integer ops per element, fused into the rounding and the same sharded or not
    (why not ``jax.random.bits``: ``docs/api/state_dtype.rst``)."""
    index = lax.full(shape, np.uint32(0), jnp.uint32)
    stride = 1
    for d in reversed(range(len(shape))):
        term = lax.broadcasted_iota(jnp.uint32, shape, d)
        index = lax.add(index, term if stride == 1 else lax.mul(term, np.uint32(stride % 2**32)))
        stride *= shape[d]
    return _mix(lax.bitwise_xor(_mix(lax.add(index, key[0])), key[1]))


def stochastic_round(x: jax.Array, bits: jax.Array) -> jax.Array:
    """``x`` (float32) rounded to bfloat16, stochastically.

    A float32 is a bfloat16 followed by 16 more bits of mantissa. Adding 16 uniform random
    ``bits`` to those and truncating rounds the magnitude up with probability ``low / 2**16``,
    the distance from the lower neighbour in ulps: ``E[stochastic_round(x)] == x`` for every
    finite ``x`` (subnormals included), the error is below one ulp, and values bfloat16 holds
    exactly, ``inf`` and ``-0.0`` are unchanged. NaN stays NaN. A value within one ulp of
    bfloat16's largest finite value may round to ``inf``, as rounding to nearest does above it.

    Args:
      x: float32 array.
      bits: uint16 or uint32 (only the low 16 bits are used) random bits of ``x``'s shape.
    """
    x = lax.convert_element_type(x, jnp.float32)
    low = lax.bitwise_and(lax.convert_element_type(bits, jnp.uint32), _LOW_BITS)
    up = lax.bitwise_and(lax.add(lax.bitcast_convert_type(x, jnp.uint32), low), _HIGH_BITS)
    rounded = lax.convert_element_type(lax.bitcast_convert_type(up, jnp.float32),
                                       jnp.bfloat16)  # exact: the low 16 bits are zero
    # A NaN whose payload lies in the low 16 bits would truncate to inf.
    return lax.select(lax.ne(x, x), lax.convert_element_type(x, jnp.bfloat16), rounded)


def with_state_dtype(tx: optax.GradientTransformation, dtype: Any, *,
                     where: str = "with_state_dtype") -> optax.GradientTransformationExtraArgs:
    """Wraps ``tx`` so that its floating state is stored in ``dtype`` and updated in float32.

    ``init`` casts the state's :func:`is_stored` leaves to ``dtype`` (to nearest: zeros or the
    params). ``update`` upcasts them, runs ``tx.update`` and writes them back in ``dtype``:
    with :func:`stochastic_round` for bfloat16 (bits from the key in the state), plainly for
    float32. The updates returned are computed from the new state as stored (Adam reads its
    rounded moments, upcast), so the compiled step updates the state in place.

    Args:
      tx: any optax transformation (a ``chain``, ``MultiSteps``, ``inject_hyperparams``, ...).
      dtype: ``jnp.bfloat16`` or ``jnp.float32`` (float16 is refused: its range cannot hold a
        second moment, see :data:`jaxamp.policy_spec.OPT_STATE_FLOAT16`).
      where: the caller's name, for error messages.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`StoredState`.
    """
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
        raise TypeError(f"{where}: tx must be an optax.GradientTransformation, got "
                        f"{type(tx).__name__}. Example: optax.adam(1e-3).")
    dtype = check_state_dtype(dtype, where)
    if dtype is None:
        raise ValueError(f"{where}: with_state_dtype needs a dtype (jnp.bfloat16 or "
                         "jnp.float32), got None.")
    rounds = np.dtype(dtype) != np.dtype(jnp.float32)
    inner_update = optax.with_extra_args_support(tx).update

    def init_fn(params):
        inner = jax.tree.map(lambda x: x.astype(dtype) if is_stored(x) else x, tx.init(params))
        key = jax.random.key_data(jax.random.key(INITIAL_SEED, impl=RNG_IMPL)) \
            if rounds else None
        return StoredState(inner, key)

    def update_fn(updates, state, params=None, **extra_args):
        old, tree = jax.tree.flatten(state.inner_state)
        upcast = [x.astype(jnp.float32) if is_stored(x) else x for x in old]
        args = (updates, tree.unflatten(upcast), params)
        if not rounds:
            updates, new_inner = inner_update(*args, **extra_args)
            new = tree.flatten_up_to(new_inner)
            return updates, StoredState(tree.unflatten(
                [_as(n, o) for n, o in zip(new, old)]), None)
        key, now = jax.random.split(jax.random.wrap_key_data(state.rounding_key, impl=RNG_IMPL))
        targets = [x for x, o in zip(upcast, old) if is_stored(o)]
        keys = jax.random.key_data(jax.random.split(now, max(len(targets), 1)))
        bits = iter([rounding_bits(keys[i], x.shape) for i, x in enumerate(targets)])
        # The new state is rounded where the optimizer computes it, and what it reads of it
        # afterwards is the rounded value behind a barrier: XLA then computes the update from
        # the new state's buffer (in place), not from the old state, which it would have to
        # copy (4 bytes per parameter: the whole saving). jaxamp.amp's skip selects on these
        # values, as for a float32 state (transform._inner_update_selected).
        closed, out_shape = jax.make_jaxpr(
            lambda *a: inner_update(*a, **extra_args), return_shape=True)(*args)
        if jax.tree.structure(out_shape[1]) != tree:
            raise ValueError(f"{where}: expected the optimizer's update to return a state of "
                             f"its init's structure, {tree}, got "
                             f"{jax.tree.structure(out_shape[1])} instead.")
        n_upd = len(jax.tree.leaves(out_shape[0]))
        stored: dict[int, jax.Array] = {}

        def rounder(k: int, b: jax.Array):
            def fn(v):
                stored[k] = stochastic_round(v, b)
                return lax.optimization_barrier(stored[k]).astype(v.dtype)
            return fn

        reroute = [rounder(k, next(bits)) if is_stored(o) else None
                   for k, o in enumerate(old)]
        outs, _ = evaluate_rerouted(closed, jax.tree.leaves(args), [None] * n_upd + reroute)
        updates = jax.tree.unflatten(jax.tree.structure(out_shape[0]), outs[:n_upd])
        leaves = []
        for k, (new, o, fn) in enumerate(zip(outs[n_upd:], old, reroute)):
            if fn is not None and k not in stored:  # an input or a constant: not computed
                fn(new)
            leaves.append(stored[k] if fn is not None else _as(new, o))
        return updates, StoredState(tree.unflatten(leaves), jax.random.key_data(key))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _as(new: Any, old: Any) -> Any:
    """A leaf that is not stored in the storage dtype, in the dtype it had."""
    if hasattr(new, "astype") and hasattr(old, "dtype") and new.dtype != old.dtype:
        return new.astype(old.dtype)
    return new
