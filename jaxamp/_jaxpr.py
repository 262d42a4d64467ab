"""Small readers of jaxprs shared by autocast's checks, the tests and the audit."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax.extend.core as jcore
import numpy as np

from jaxamp._compat import open_jaxpr

LOW_PRECISION = (np.dtype("float16"), np.dtype("bfloat16"))


def as_jaxpr(j: Any) -> jcore.Jaxpr:
    return open_jaxpr(j)[0]


def iter_jaxprs(j: Any) -> Iterator[jcore.Jaxpr]:
    """The jaxpr and every sub-jaxpr (jit, scan, cond, remat, custom_jvp bodies), depth first."""
    jaxpr = as_jaxpr(j)
    yield jaxpr
    for eqn in jaxpr.eqns:
        for sub in jcore.jaxprs_in_params(eqn.params):
            yield from iter_jaxprs(sub)


def iter_eqns(j: Any) -> Iterator[jcore.JaxprEqn]:
    """Every equation of a jaxpr and of its sub-jaxprs."""
    for jaxpr in iter_jaxprs(j):
        yield from jaxpr.eqns


def _is_cast(eqn) -> bool:
    return eqn.primitive.name == "convert_element_type"


def lossy_round_trips(j: Any) -> list[jcore.JaxprEqn]:
    """Casts that take a value float32 -> float16/bfloat16 -> float32 (precision thrown away)."""
    found = []
    for jaxpr in iter_jaxprs(j):
        down = {e.outvars[0]: e for e in jaxpr.eqns
                if _is_cast(e) and np.dtype(e.invars[0].aval.dtype) == np.float32
                and np.dtype(e.outvars[0].aval.dtype) in LOW_PRECISION}
        found += [e for e in jaxpr.eqns if _is_cast(e) and e.invars[0] in down
                  and np.dtype(e.outvars[0].aval.dtype) == np.float32]
    return found


def duplicate_casts(j: Any) -> list[tuple[jcore.JaxprEqn, jcore.JaxprEqn]]:
    """Pairs of casts of the same value to the same dtype within one jaxpr."""
    found = []
    for jaxpr in iter_jaxprs(j):
        seen: dict = {}
        for e in jaxpr.eqns:
            if not _is_cast(e) or not isinstance(e.invars[0], jcore.Var):
                continue
            key = (e.invars[0], np.dtype(e.params["new_dtype"]))
            if key in seen:
                found.append((seen[key], e))
            else:
                seen[key] = e
    return found
