"""The registry of primitive names (jaxamp._engine.primitives) against the installed JAX."""

import gc
import importlib

import jax
import jax.extend.core as jcore
import pytest
from test_house import STALE

from jaxamp import rules
from jaxamp._engine import primitives

# Modules that define primitives jaxamp names; importing them registers every one.
_MODULES = [
    "jax.numpy", "jax.lax", "jax.nn", "jax.random", "jax.scipy.special", "jax.ad_checkpoint",
    "jax._src.lax.linalg", "jax._src.lax.fft", "jax._src.lax.special", "jax._src.lax.ann",
    "jax._src.lax.parallel", "jax._src.lax.control_flow", "jax._src.custom_derivatives",
    "jax._src.shard_map", "jax._src.random", "jax._src.ffi",
]
_STALE = STALE  # tests/test_house.py: names that are primitives of no supported JAX


def _version() -> tuple[int, ...]:
    return tuple(int(p) for p in jax.__version__.split(".")[:2])


@pytest.fixture(scope="module")
def installed() -> set[str]:
    for name in _MODULES:
        importlib.import_module(name)
    return {o.name for o in gc.get_objects() if isinstance(o, jcore.Primitive)}


def test_every_registered_name_is_a_primitive_of_this_jax(installed):
    assert len(installed) > 200
    version = _version()
    missing = []
    for name in sorted(primitives.all_names() - installed):
        since, until = primitives.VERSIONED.get(name, (None, None))
        if name not in primitives.VERSIONED or (
                (since is None or version >= since) and (until is None or version < until)):
            missing.append(name)
    assert missing == [], (f"names in jaxamp._engine.primitives that are no primitive of jax "
                           f"{jax.__version__}: {missing}")


def test_versioned_names_are_primitives_where_jax_has_them(installed):
    version = _version()
    present = {name for name, (since, until) in primitives.VERSIONED.items()
               if (since is None or version >= since) and (until is None or version < until)}
    assert present <= installed
    assert present  # each supported JAX has some of them (0.10: closed_call; 0.12: log2)


def test_no_stale_name_in_the_registry():
    assert _STALE & primitives.all_names() == set()


def test_stale_names_are_primitives_of_no_installed_jax(installed):
    assert _STALE & installed == set()


def test_op_rules_defaults_are_the_registry():
    defaults = rules.OpRules()
    assert defaults.matmul is primitives.MATMUL
    assert defaults.fp32 is primitives.FP32
    assert defaults.structural is primitives.STRUCTURAL
    assert defaults.promote is primitives.PROMOTE
    assert defaults.as_traced is primitives.AS_TRACED
    assert primitives.SOFTMAX <= primitives.FP32 and primitives.SUM <= primitives.FP32
