"""Suite-wide settings, applied before JAX starts its backend.

On CPU, XLA's cheap backend optimisation: the suite compiles hundreds of small programs and
runs each for a few steps, so LLVM's expensive passes cost far more than they save (about 30%
of a compile). They change generated code only, not the HLO program whose dtypes and numbers
the tests read. Subprocesses the tests start inherit them. Not on a GPU machine (unless
``JAX_PLATFORMS=cpu``): tests/test_gpu.py reads what XLA's GPU compiler makes.

Off a GPU machine JAX is also told to use the CPU (``JAX_PLATFORMS=cpu``, unless set): with the
``gpu-compile`` extra (JAX's CUDA plugin) installed, JAX would otherwise try to start CUDA,
print its failure, and leave the plugin's compiler unregistered, which the ``gpu_compile``
tests (``jaxamp.gpu_program``: compiling for an H200 without one) need.
"""

import os

_FAST = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
_on_gpu_machine = os.path.exists("/dev/nvidiactl") and os.environ.get("JAX_PLATFORMS") != "cpu"
if not _on_gpu_machine:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    _flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = " ".join([_flags, *(f for f in _FAST if f not in _flags)]).strip()
