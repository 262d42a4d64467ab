"""Subprocesses with several JAX devices: one process with virtual CPU devices
(:func:`script_on_devices`), or several JAX processes ("hosts") on this machine
(:func:`hosts`), joined by ``jax.distributed`` through the ``JAX_COORDINATOR_ADDRESS``,
``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` variables that ``examples/lm_mesh.py`` reads
(tests call ``jax.distributed.initialize`` with them themselves). CPU devices only;
cross-process collectives go through gloo, jaxlib's default on CPU."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def env(devices: int, **extra: str) -> dict:
    """The environment of a process with ``devices`` virtual CPU devices."""
    out = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    out.update(XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu", **extra)
    return out


def start(argv: list[str], *, devices: int, **extra: str) -> subprocess.Popen:
    return subprocess.Popen(argv, env=env(devices, **extra), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def hosts(argv: list[str], n: int = 2, *, devices: int = 1) -> list[subprocess.Popen]:
    """``argv`` started as ``n`` processes of one JAX program, ``devices`` each."""
    port = _free_port()
    return [start(argv, devices=devices, JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
                  JAX_NUM_PROCESSES=str(n), JAX_PROCESS_ID=str(i)) for i in range(n)]


def finish(procs: list[subprocess.Popen], timeout: float = 400) -> list[str]:
    """Each process's stdout (without gloo's connection lines) once all exited 0."""
    outs = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"a process did not finish in {timeout:.0f} s")
        assert p.returncode == 0, stderr[-3000:]
        outs.append("".join(line for line in stdout.splitlines(keepends=True)
                            if not line.startswith("[Gloo]")))
    return outs


def json_from(argv: list[str], *, devices: int = 8, timeout: float = 600) -> dict:
    """The JSON result (the last line printed) of ``argv`` run with ``devices`` virtual CPU
    devices."""
    proc = subprocess.run(argv, capture_output=True, text=True, env=env(devices),
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def script_on_devices(module: str, devices: int = 8, timeout: float = 600) -> dict:
    """``tests/<module>.py``'s ``script()`` run in one subprocess with ``devices`` virtual CPU
    devices; its JSON result."""
    code = (f"import sys, json; sys.path.insert(0, sys.argv[1]); import {module}; "
            f"print(json.dumps({module}.script()))")
    return json_from([sys.executable, "-c", code, str(Path(__file__).parent)],
                     devices=devices, timeout=timeout)
