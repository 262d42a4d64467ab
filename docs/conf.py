"""Sphinx configuration: the API reference built from jaxamp's docstrings (Google style)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # import jaxamp from the checkout

import jaxamp  # noqa: E402

project = "jaxamp"
author = "jaxamp contributors"
copyright = "2026, jaxamp contributors"  # noqa: A001 - Sphinx's name
release = version = jaxamp.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # Google-style Args:/Returns:/Example: sections
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",
]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as fields: NamedTuple fields are not described twice
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
intersphinx_mapping = {}  # offline builds: no inventories fetched
exclude_patterns = ["_build"]
html_theme = "alabaster"
nitpicky = False
