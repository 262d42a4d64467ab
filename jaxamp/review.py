"""``python -m jaxamp.review RUN_DIR``: the run-log reader, kept at this path for the command line.

The implementation is :mod:`jaxamp.diagnostics.review`; this module re-exports it. Imports no JAX.
"""

from jaxamp.diagnostics.review import *  # noqa: F403
from jaxamp.diagnostics.review import __all__, main  # noqa: F401

if __name__ == "__main__":
    raise SystemExit(main())
