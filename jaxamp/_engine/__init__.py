"""jaxamp's engine: the private modules behind :func:`jaxamp.autocast` (see README.md here).

Nothing here is public API. This package imports none of its modules, so importing one engine
module does not import the others.
"""
