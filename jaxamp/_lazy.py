"""Package attributes imported on first use (PEP 562), so importing ``jaxamp`` imports no JAX.

The public names are listed once, in the package's stub (``__init__.pyi``, which type checkers
read): :func:`stub_exports` reads its ``from M import X as X`` lines into the map
:func:`lazy_exports` resolves.

Example:
    >>> getattr_, dir_ = lazy_exports("jaxamp", {"get_policy": "jaxamp.policy"})
    >>> getattr_("get_policy").__name__
    'get_policy'
"""

from __future__ import annotations

import ast
import importlib
import sys
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["lazy_exports", "stub_exports"]


def stub_exports(init_file: str) -> dict[str, str]:
    """``{name: module}`` for each ``from module import name as name`` of the ``.pyi`` beside
    ``init_file`` (a package's ``__init__.py``)."""
    tree = ast.parse(Path(init_file).with_suffix(".pyi").read_text())
    return {a.asname: node.module for node in tree.body if isinstance(node, ast.ImportFrom)
            for a in node.names if a.asname == a.name}


def lazy_exports(package: str, exports: Mapping[str, str],
                 deprecated: Mapping[str, str] | None = None,
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``exports`` maps each public name to
    the module defining it; a name is imported when first read and then cached.
    ``deprecated`` maps names no longer public here to the module that keeps them: reading
    one warns (``DeprecationWarning``) with the path to import it from."""
    deprecated = dict(deprecated or {})

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None and name in deprecated:
            warnings.warn(f"{package}.{name} is deprecated and will be removed; import it from "
                          f"{deprecated[name]}: `from {deprecated[name]} import {name}`.",
                          DeprecationWarning, stacklevel=2)
            return getattr(importlib.import_module(deprecated[name]), name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
