"""The diagnostics on two hosts: ``jaxamp.locate_overflow`` on params split across two
processes (``jax.distributed``, one CPU device each). JAX refuses to read an array that spans
another process's devices on one host, so a statistic computed on the host would fail here;
the report must equal the one-process run's on the same two-device mesh."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import multihost

SCRIPT = str(Path(__file__).with_name("multihost_overflow.py"))


def test_locate_overflow_on_two_hosts_equals_one():
    one = multihost.start([sys.executable, SCRIPT], devices=2)
    two = multihost.finish(multihost.hosts([sys.executable, SCRIPT]))
    (want,) = multihost.finish([one])
    assert two[1] == ""  # the second host prints nothing
    got, want = json.loads(two[0]), json.loads(want)
    assert got["first"] == {"dtype": "float16", "module": "fc2", "pass": "forward",
                            "primitive": "dot_general"}
    assert got["overflowing"] == ["fc2"]
    assert got == want
