"""Where a train state lives on a mesh: the shardings the user already gave it.

A state's shardings come from what the user wrote, in this order, per leaf:

1. its own :class:`~jax.sharding.NamedSharding` on the mesh (the user ``device_put`` it);
2. Flax partitioning metadata: ``nn.with_partitioning`` (mesh axis names) or
   ``nn.with_logical_partitioning`` (logical names, mapped to mesh axes by ``axis_rules``,
   the rules of ``nn.logical_axis_rules``);
3. for an optimizer-state leaf that mirrors a param (Adam's ``mu``/``nu``: same path suffix,
   same shape), that param's sharding, so FSDP shards the optimizer state with the params;
4. replicated.

:func:`make_train_step` with ``mesh=`` reads them on every call (cheaply) and compiles the
step with those shardings as its output shardings, so the state keeps them step after step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax.core import meta
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = ["shard_state", "state_shardings"]


def _is_box(x) -> bool:
    return isinstance(x, meta.Partitioned)  # LogicallyPartitioned is a subclass


def check_axis_rules(axis_rules: Any, where: str) -> tuple | None:
    """``axis_rules`` as a tuple of ``(logical name, mesh axis or axes or None)`` pairs."""
    if axis_rules is None:
        return None
    if not (isinstance(axis_rules, Sequence) and not isinstance(axis_rules, str) and all(
            isinstance(r, Sequence) and len(r) == 2 and isinstance(r[0], str)
            for r in axis_rules)):
        raise TypeError(f"{where}: axis_rules must be a sequence of (logical axis, mesh axis) "
                        f"pairs as for flax.linen.logical_axis_rules, got {axis_rules!r}. "
                        "Example: axis_rules=[('batch', 'data'), ('mlp', 'model'), "
                        "('embed', None)].")
    return tuple((str(a), b if not isinstance(b, list) else tuple(b)) for a, b in axis_rules)


def _spec_of_box(box, axis_rules, path: str, where: str) -> PartitionSpec:
    names = tuple(box.names)
    if isinstance(box, nn.LogicallyPartitioned):
        rules = tuple(box.rules) if getattr(box, "rules", None) else axis_rules
        if rules is None:
            raise ValueError(
                f"{where}: {path} has logical partitioning names {names} "
                "(nn.with_logical_partitioning) but no axis_rules map them to mesh axes. Pass "
                "axis_rules=[(logical name, mesh axis), ...] (the rules of "
                "nn.logical_axis_rules).")
        return nn.logical_to_mesh_axes(names, rules)
    return PartitionSpec(*names)


def _check_spec(spec: PartitionSpec, shape, mesh: Mesh, path: str, where: str) -> None:
    if len(spec) > len(shape):
        raise ValueError(f"{where}: {path} has shape {tuple(shape)} but its partition spec "
                         f"{spec} names {len(spec)} dimensions.")
    for dim, axes in enumerate(spec):
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        size = 1
        for a in axes:
            if a not in mesh.axis_names:
                raise ValueError(
                    f"{where}: {path} is partitioned over mesh axis {a!r} (spec {spec}), "
                    f"which the mesh does not have (axes: {tuple(mesh.axis_names)}). Name a "
                    "mesh axis, or map the logical name to one in axis_rules.")
            size *= mesh.shape[a]
        if shape[dim] % size:
            raise ValueError(
                f"{where}: {path} has shape {tuple(shape)}; dimension {dim} ({shape[dim]}) "
                f"is split over {axes} ({size} devices) by spec {spec} and must be divisible "
                f"by {size}. Change the model size, the mesh, or the rule for this dimension.")


def state_shardings(tree: Any, mesh: Mesh, *, axis_rules: Any = None,
                    params: Any = None, where: str = "shard_state") -> Any:
    """The :class:`NamedSharding` of every array leaf of ``tree`` on ``mesh`` (the sources in
    the module docstring's order). ``params`` (default: ``tree.params`` if any) are the leaves
    optimizer-state leaves may mirror. Raises ``ValueError`` naming the leaf for an axis the
    mesh lacks or a dimension the mesh does not divide."""
    axis_rules = check_axis_rules(axis_rules, where)
    params = getattr(tree, "params", None) if params is None else params

    def own(leaf):
        s = getattr(leaf, "sharding", None)
        return s if isinstance(s, NamedSharding) and s.mesh == mesh else None

    def given(path, x):
        """Its own sharding, or for a box (when that is replicated) its metadata's."""
        if not _is_box(x):
            return own(x)
        (leaf,) = jax.tree.leaves(x)
        s = own(leaf)
        if s is None or s.is_fully_replicated:
            key = jax.tree_util.keystr(path)
            spec = _spec_of_box(x, axis_rules, key, where)
            _check_spec(spec, np.shape(leaf), mesh, key, where)
            s = NamedSharding(mesh, spec)
        return s

    def key(path):
        return jax.tree_util.keystr(path).replace(".value", "")

    by_path: dict[str, tuple[tuple, NamedSharding]] = {}  # params' shardings, to mirror
    for path, x in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_box)[0]:
        s = given(path, x)
        if s is not None:
            by_path[key(path)] = (np.shape(jax.tree.leaves(x)[0]), s)

    def final(path, x):
        if _is_box(x):
            s = given(path, x)
            return jax.tree.map(lambda _: s, x)
        if not hasattr(x, "shape"):
            return NamedSharding(mesh, PartitionSpec())
        s = own(x)
        if s is None or s.is_fully_replicated:  # mirrors a param (same path suffix and shape)?
            s = next((ps for pkey, (shape, ps) in by_path.items()
                      if key(path).endswith(pkey) and np.shape(x) == shape), None) or s
        return s or NamedSharding(mesh, PartitionSpec())

    return jax.tree_util.tree_map_with_path(final, tree, is_leaf=_is_box)


def shard_state(state: Any, mesh: Mesh, *, axis_rules: Any = None) -> Any:
    """Places every array of ``state`` on ``mesh`` with the sharding the user gave it (the
    sources in the module docstring's order: own, Flax metadata, a mirrored param, replicated).

    Args:
      state: a :class:`jaxamp.TrainState` (or any pytree of arrays).
      mesh: the :class:`jax.sharding.Mesh`.
      axis_rules: ``[(logical axis name, mesh axis or None), ...]`` as for
        ``flax.linen.logical_axis_rules``; needed for logical partitioning names.

    Returns:
      The state with every array on its :class:`NamedSharding` (arrays already there are
      not copied).

    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp, numpy as np, optax, jaxamp
      >>> from jax.sharding import Mesh
      >>> mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
      >>> model = nn.Dense(4, kernel_init=nn.with_partitioning(
      ...     nn.initializers.lecun_normal(), (None, "data")))
      >>> params = model.init(jax.random.key(0), jnp.ones((2, 3)))["params"]
      >>> state = jaxamp.TrainState.create(model, params, optax.adam(1e-3), policy="float32")
      >>> state = jaxamp.shard_state(state, mesh)
      >>> tuple(state.params["kernel"].value.sharding.spec)
      (None, 'data')
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"shard_state: mesh must be a jax.sharding.Mesh, got "
                        f"{type(mesh).__name__}.")
    shardings = state_shardings(state, mesh, axis_rules=axis_rules)
    return jax.tree.map(lambda x, s: x if getattr(x, "sharding", None) == s
                        else jax.device_put(x, s), state, shardings)
