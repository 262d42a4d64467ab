"""Every docstring example in the jaxamp package runs and prints what it says."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxamp

# every module of the package, jaxamp.diagnostics' included ("diagnostics._audit", ...)
MODULES = sorted(m.name.removeprefix("jaxamp.")
                 for m in pkgutil.walk_packages(jaxamp.__path__, prefix="jaxamp."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(f"jaxamp.{name}")
    globs = {"jax": jax, "jnp": jnp, "optax": optax, "jaxamp": jaxamp, **vars(module)}
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    tests = [t for t in doctest.DocTestFinder().find(module, globs=globs) if t.examples]
    failed = []
    for t in tests:
        if runner.run(t, out=lambda _: None).failed:
            failed.append(t.name)
    assert failed == [], f"docstring examples that fail: {failed}"


def test_the_examples_are_found():
    count = 0
    for name in MODULES:
        module = importlib.import_module(f"jaxamp.{name}")
        count += sum(len(t.examples) for t in doctest.DocTestFinder().find(module))
    assert count >= 20
