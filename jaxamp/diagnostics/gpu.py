"""The GPU program, seen from any machine: :func:`gpu_program` compiles a train step (or any
function) for an NVIDIA GPU, with no GPU present, and reports its kernels, GEMM libraries,
fused attention, FP8 GEMMs, memory and a roofline estimate (how, and what the estimate ignores:
docs/api/diagnostics.rst, "The GPU program").

Example:
    >>> import jax, jax.numpy as jnp
    >>> def f(x, w):
    ...     return jnp.tanh(x @ w).sum()
    >>> x, w = jnp.ones((256, 512), jnp.bfloat16), jnp.ones((512, 1024), jnp.bfloat16)
    >>> report = gpu_program(jax.grad(f, argnums=1), x, w)  # doctest: +SKIP
    >>> report.gemm_libraries()  # doctest: +SKIP
    {'cublaslt bf16 x bf16': 2}
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import importlib.util
import os
import re
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from .._engine.compat import compile_only_gpu, device_target_config
from ._base import Report, markdown_table
from ._hlo import Kernel, kernels, planned_fp8_dots
from ._trace import decision_of

__all__ = ["GpuProgram", "GpuTarget", "gpu_program", "gpu_target", "main"]

_TARGET_DIR = Path(__file__).with_name("gpu_targets")
#: The built-in target descriptions (``jaxamp/diagnostics/gpu_targets/<name>.txtpb``).
BUILTIN_TARGETS = ("h100", "h200")
INSTALL_HINT = ('pip install "jaxamp-flax[gpu-compile]" (JAX\'s CUDA plugin, about 3 GB; or '
                'pip install "jax[cuda12]==<your jax version>")')
_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13", "jax_cuda12_plugin",
            "jax_cuda13_plugin")
# Dense Tensor Core FLOPs per SM per clock with 16-bit operands (bf16, f16), by compute
# capability: A100 312 TF = 108 SMs x 1.41 GHz x 2048; H100 989 TF = 132 x 1.83 GHz x 4096.
# FP8 doubles it (Ada, Hopper), TF32 halves it.
_TENSOR_CORE_16BIT = {(8, 0): 2048, (8, 6): 1024, (8, 7): 1024, (8, 9): 1024, (9, 0): 4096}
_FP8_CAPABLE = {(8, 9), (9, 0)}


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """The GPU a program is compiled for, and the rates its roofline estimate uses.

    Attributes:
      name: the card (``"NVIDIA H200"``).
      memory_bandwidth: HBM bytes per second.
      sm_count, clock_hz, fpus_per_sm: streaming multiprocessors, their clock, and float32
        lanes per SM (the CUDA-core rate).
      compute_capability: ``(major, minor)``.
      device_memory: bytes of device memory.
      config: the ``GpuTargetConfigProto`` XLA compiles with (text format).
      device: a real GPU to compile on (``target=jax.devices()[0]``), else None.
      source: where the description came from.
    """

    name: str
    memory_bandwidth: float
    sm_count: int
    clock_hz: float
    compute_capability: tuple[int, int]
    fpus_per_sm: int
    device_memory: int
    config: str | bytes = dataclasses.field(default="", repr=False)
    device: Any = dataclasses.field(default=None, repr=False, compare=False)
    source: str = ""

    @property
    def peak_flops(self) -> dict[str, float]:
        """Dense peak FLOP/s by operand class: ``"fp8"``, ``"bf16"`` (float16 too), ``"tf32"``
        (float32 GEMMs at DEFAULT precision) and ``"fp32"`` (float32 at HIGHEST precision, on
        the CUDA cores): SMs x clock x the per-SM rate of the compute capability."""
        per_clock = self.sm_count * self.clock_hz
        out = {"fp32": 2.0 * self.fpus_per_sm * per_clock}
        tc = _TENSOR_CORE_16BIT.get(self.compute_capability)
        if tc is not None:
            out.update(bf16=tc * per_clock, tf32=tc * per_clock / 2)
            if self.compute_capability in _FP8_CAPABLE:
                out["fp8"] = 2.0 * tc * per_clock
        return out

    def kernel_peak(self, k: Kernel) -> float:
        """The FLOP/s a matmul kernel's operands allow (see :attr:`peak_flops`)."""
        peaks = self.peak_flops
        dtypes = [d or "" for d in k.dtypes]
        if any(d.startswith("f8") for d in dtypes) and "fp8" in peaks:
            return peaks["fp8"]
        if dtypes and all(d in ("bf16", "f16") for d in dtypes) and "bf16" in peaks:
            return peaks["bf16"]
        if k.precision != "HIGHEST" and "tf32" in peaks:
            return peaks["tf32"]
        return peaks["fp32"]

    def seconds(self, k: Kernel) -> float:
        """One run of ``k`` by the roofline: max(bytes / bandwidth, FLOPs / peak)."""
        memory = k.bytes / self.memory_bandwidth
        return max(memory, k.flops / self.kernel_peak(k)) if k.flops else memory

    def compile_device(self) -> Any:
        """The device programs for this target compile on: :attr:`device` when it is a real
        GPU, else the compile-only GPU JAX's CUDA plugin describes from :attr:`config`."""
        return self.device if self.device is not None else _compile_only_device(self.config)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source,
                "memory_bandwidth": self.memory_bandwidth, "sm_count": self.sm_count,
                "clock_hz": self.clock_hz, "compute_capability": list(self.compute_capability),
                "fpus_per_sm": self.fpus_per_sm, "device_memory": self.device_memory,
                "peak_flops": self.peak_flops}


def _proto_field(text: str, name: str) -> str | None:
    m = re.search(rf"^\s*{name}\s*:\s*\"?([^\"\n]*)\"?\s*$", text, flags=re.M)
    return m.group(1).strip() if m else None


def parse_target_config(text: str, source: str, device: Any = None) -> GpuTarget:
    """A :class:`GpuTarget` from a ``GpuTargetConfigProto`` in text format."""
    cc = re.search(r"cuda_compute_capability\s*\{([^}]*)\}", text)
    needed = {k: _proto_field(text, k) for k in ("memory_bandwidth", "core_count",
                                                  "clock_rate_ghz", "fpus_per_core")}
    missing = [k for k, v in needed.items() if v is None]
    if cc is None or missing:
        raise ValueError(
            f"target {source}: not a GpuTargetConfigProto with gpu_device_info fields "
            f"memory_bandwidth, core_count, clock_rate_ghz, fpus_per_core and "
            f"cuda_compute_capability (missing: {', '.join(missing) or 'compute capability'}). "
            f"Start from a built-in one: {_TARGET_DIR / 'h200.txtpb'}.")
    major = re.search(r"major\s*:\s*(\d+)", cc.group(1))
    minor = re.search(r"minor\s*:\s*(\d+)", cc.group(1))
    name = _proto_field(text, "name") or _proto_field(text, "device_description_str") or "GPU"
    return GpuTarget(
        name=name, memory_bandwidth=float(needed["memory_bandwidth"]),
        sm_count=int(needed["core_count"]), clock_hz=float(needed["clock_rate_ghz"]) * 1e9,
        compute_capability=(int(major.group(1)) if major else 0,
                            int(minor.group(1)) if minor else 0),
        fpus_per_sm=int(needed["fpus_per_core"]),
        device_memory=int(_proto_field(text, "device_memory_size") or 0), config=text,
        device=device, source=source)


def gpu_target(target: Any = "h200") -> GpuTarget:
    """The :class:`GpuTarget` for ``"h100"``/``"h200"`` (built in), a path to a
    ``GpuTargetConfigProto`` text file, a GPU ``jax.Device`` (its own description; the program
    is then compiled on it), or a :class:`GpuTarget` (returned as is)."""
    if isinstance(target, GpuTarget):
        return target
    if isinstance(target, str) and target.lower() in BUILTIN_TARGETS:
        path = _TARGET_DIR / f"{target.lower()}.txtpb"
        return parse_target_config(path.read_text(), f"built-in {target.lower()}")
    if isinstance(target, str | os.PathLike) and Path(target).is_file():
        return parse_target_config(Path(target).read_text(), str(target))
    if hasattr(target, "platform") and hasattr(target, "device_kind"):
        if target.platform != "gpu":
            raise ValueError(f"target={target!r}: a device target must be a GPU, got a "
                             f"{target.platform} device. Pass target='h100' or 'h200' to "
                             "compile for a GPU without one.")
        config = device_target_config(target)
        if isinstance(config, str):
            try:
                return parse_target_config(config, f"device {target.device_kind}", target)
            except ValueError:
                pass
        for name in BUILTIN_TARGETS:  # the card's own rates when its description is binary
            if name in target.device_kind.lower():
                return dataclasses.replace(gpu_target(name), device=target,
                                           source=f"device {target.device_kind} (rates of "
                                                  f"the built-in {name})")
        raise ValueError(f"target={target!r}: the device gives no readable description. "
                         "Pass a GpuTarget with its rates, or a target-config file.")
    raise ValueError(f"target={target!r}: expected one of {', '.join(BUILTIN_TARGETS)}, a "
                     "path to a GpuTargetConfigProto text file, a GPU jax.Device or a "
                     "jaxamp.diagnostics.gpu.GpuTarget.")


def _plugin_installed() -> bool:
    for name in _PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


@functools.lru_cache(maxsize=8)
def _compile_only_device(config: str | bytes):
    if not _plugin_installed():
        raise ModuleNotFoundError(
            "jaxamp.gpu_program compiles for a GPU with JAX's CUDA plugin, which is not "
            f"installed. Install it: {INSTALL_HINT}.")
    try:
        return compile_only_gpu(config)
    except NotImplementedError as e:
        platforms = os.environ.get("JAX_PLATFORMS")
        raise RuntimeError(
            f"jaxamp.gpu_program: JAX's CUDA plugin gave no compile-only GPU ({e}). On a "
            "machine without a GPU the plugin registers its compiler only when JAX starts "
            f"with JAX_PLATFORMS=cpu (now {platforms!r}): set it in the environment before "
            "Python starts, e.g. JAX_PLATFORMS=cpu python train.py.") from e


def _abstract(x: Any, sharding) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct) or (hasattr(x, "shape") and hasattr(x, "dtype")):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding,
                                    weak_type=bool(getattr(x, "weak_type", False)))
    return x


@dataclasses.dataclass(frozen=True)
class GpuProgram(Report):
    """What :func:`gpu_program` found in the compiled GPU program.

    Attributes:
      target: the :class:`GpuTarget` it was compiled for.
      kernels: every kernel launch (:class:`jaxamp.diagnostics._hlo.Kernel`; ``times`` counts
        loop trips).
      memory: XLA's ``memory_analysis()`` in bytes: ``temp``, ``argument``, ``output``,
        ``alias``, ``generated_code``.
      fp8_planned_dots: the FLOPs of each FP8 ``dot_general`` of the lowered program
        (jaxamp's plan: forward, dgrad, wgrad).
      options: how it was compiled (``triton_gemm``, ``autotuned``, compiler options).
      hlo: the compiled HLO text.
    """

    target: GpuTarget
    kernels: list[Kernel]
    memory: dict[str, int]
    fp8_planned_dots: list[int]
    options: dict[str, Any]
    hlo: str = dataclasses.field(repr=False, default="")

    @classmethod
    def read(cls, compiled: Any, target: Any = "h200", *, lowered: Any = None,
             options: dict[str, Any] | None = None) -> GpuProgram:
        """The report of a program compiled elsewhere: ``compiled`` is a
        ``jax.stages.Compiled`` (its ``memory_analysis()`` is read too) or its HLO text;
        ``lowered`` (a ``jax.stages.Lowered`` or its StableHLO text) gives the planned FP8
        dots. ``bench/gpu.sh`` reads the programs it times on a GPU this way."""
        text = compiled if isinstance(compiled, str) else compiled.as_text()
        ma = None if isinstance(compiled, str) else compiled.memory_analysis()
        memory = {key: int(getattr(ma, f"{key}_size_in_bytes", 0) or 0)
                  for key in ("temp", "argument", "output", "alias", "generated_code")} \
            if ma is not None else {}
        planned = [] if lowered is None else planned_fp8_dots(
            lowered if isinstance(lowered, str) else lowered.as_text())
        return cls(gpu_target(target), kernels(text), memory, planned, dict(options or {}),
                   text)

    @property
    def bytes(self) -> int:
        """HBM bytes every kernel launch reads and writes, summed over loop trips."""
        return sum(k.bytes * k.times for k in self.kernels)

    @property
    def flops(self) -> int:
        """Matmul, convolution and attention FLOPs, summed over loop trips."""
        return sum(k.flops * k.times for k in self.kernels)

    @property
    def estimated_seconds(self) -> float:
        """The roofline estimate of one call (see the module doc for what it ignores)."""
        return sum(self.target.seconds(k) * k.times for k in self.kernels)

    @property
    def launches(self) -> int:
        """Kernel launches per call (loop trips included)."""
        return sum(k.times for k in self.kernels)

    def gemms(self) -> list[Kernel]:
        """The matmul kernels: GEMMs, cuDNN attention and convolutions."""
        return [k for k in self.kernels if k.kind in ("gemm", "attention", "convolution")]

    def gemm_libraries(self) -> dict[str, int]:
        """Matmul launches by ``"<library> <lhs> x <rhs>"`` (loop trips included)."""
        c: Counter = Counter()
        for k in self.gemms():
            c[f"{k.library} {' x '.join(d or '?' for d in k.dtypes)}"] += k.times
        return dict(sorted(c.items()))

    @property
    def attention(self) -> list[Kernel]:
        """cuDNN fused-attention calls (forward ``__cudnn$fmha...``, backward ``...Backward``)."""
        return [k for k in self.kernels if k.kind == "attention"]

    @property
    def fp8_planned(self) -> int:
        """FP8 ``dot_general`` s in the lowered program (jaxamp's plan)."""
        return len(self.fp8_planned_dots)

    @property
    def fp8_planned_flops(self) -> int:
        return sum(self.fp8_planned_dots)

    @property
    def fp8_formed_flops(self) -> int:
        """FLOPs of the FP8 GEMMs, per instruction: equal to :attr:`fp8_planned_flops` when
        every planned FP8 dot became (part of) an FP8 GEMM."""
        return sum(k.flops for k in self.kernels if k.kind == "gemm" and k.fp8)

    @property
    def fp8_formed(self) -> int:
        """GEMM kernels that multiply float8 operands: cuBLASLt FP8 GEMMs
        (``__cublas$lt$matmul$f8``) and Triton GEMM fusions whose dot reads float8 (XLA gives
        FP8 dots to Triton when Triton GEMMs are on). Counted per instruction, as the planned
        dots are (a loop body's GEMM once); XLA's DotMerger may make one GEMM of two planned
        dots that share an operand, so compare :attr:`fp8_formed_flops`."""
        return sum(1 for k in self.kernels if k.kind == "gemm" and k.fp8)

    @property
    def fp8_recipes(self) -> dict[str, int]:
        """FP8 GEMMs by the ``fp8=`` recipe of the matmul they came from (its mark in the
        kernel's op name; ``"?"`` for a program traced in another process, whose marks this
        one does not have)."""
        return dict(Counter(decision_of(k.op_name) or "?" for k in self.kernels
                            if k.kind == "gemm" and k.fp8))

    @property
    def fp8_fallbacks(self) -> list[Kernel]:
        """GEMMs fed float8 data that multiply in a wider dtype: XLA's silent
        ``TurnF8DotIntoF16Dot`` (the operands converted up, a 16-bit GEMM, no FP8 speed-up)."""
        return [k for k in self.kernels if k.kind == "gemm" and k.f8_inputs and not k.fp8]

    def mfu(self, model_flops: float) -> float:
        """``model_flops`` per call over the estimated time, as a fraction of the dense
        16-bit Tensor Core peak: the MFU the estimate predicts."""
        peak = self.target.peak_flops.get("bf16") or self.target.peak_flops["fp32"]
        return model_flops / self.estimated_seconds / peak

    def by_kind(self) -> dict[str, dict[str, float]]:
        """Launches, bytes, FLOPs and estimated seconds by kernel kind."""
        out: dict[str, dict[str, float]] = {}
        for k in self.kernels:
            row = out.setdefault(k.kind, {"launches": 0, "bytes": 0, "flops": 0, "seconds": 0.0})
            row["launches"] += k.times
            row["bytes"] += k.bytes * k.times
            row["flops"] += k.flops * k.times
            row["seconds"] += self.target.seconds(k) * k.times
        return out

    def top(self, n: int = 10) -> list[tuple[Kernel, float]]:
        """The ``n`` kernels with the largest estimated time (all their loop trips)."""
        timed = [(k, self.target.seconds(k) * k.times) for k in self.kernels]
        return sorted(timed, key=lambda kt: -kt[1])[:n]

    def summary(self) -> dict[str, Any]:
        return {"target": self.target.name, "estimated_ms": 1e3 * self.estimated_seconds,
                "kernel_bytes": self.bytes, "flops": self.flops, "launches": self.launches,
                "temp_bytes": self.memory.get("temp"),
                "gemm_libraries": self.gemm_libraries(),
                "attention_calls": [k.target for k in self.attention],
                "fp8_planned": self.fp8_planned, "fp8_formed": self.fp8_formed,
                "fp8_planned_flops": self.fp8_planned_flops,
                "fp8_formed_flops": self.fp8_formed_flops,
                "fp8_recipes": self.fp8_recipes,
                "fp8_fallbacks": [k.name for k in self.fp8_fallbacks]}

    def to_dict(self, kernels: bool = True) -> dict[str, Any]:
        out = {"target": self.target.to_dict(), "options": self.options,
               "memory": self.memory, "summary": self.summary(), "by_kind": self.by_kind()}
        if kernels:
            out["kernels"] = [dict(dataclasses.asdict(k), seconds=self.target.seconds(k))
                              for k in self.kernels]
        return out

    def _lines(self) -> list[tuple[str, str]]:
        s = self.summary()
        mem = self.memory
        fp8 = (f"{s['fp8_formed']} GEMMs for {s['fp8_planned']} planned dots, "
               f"{s['fp8_formed_flops'] / max(s['fp8_planned_flops'], 1):.0%} of their FLOPs"
               + (" (" + ", ".join(f"{r} {n}" for r, n in s["fp8_recipes"].items()) + ")"
                  if s["fp8_recipes"] else "")
               + (f"; NOT FP8 GEMMs: {', '.join(s['fp8_fallbacks'])}" if s["fp8_fallbacks"]
                  else "")) if s["fp8_planned"] or s["fp8_formed"] else "none planned"
        how = ("compiled on the device (autotuned)" if self.options.get("autotuned") else
               "Triton GEMMs" if self.options.get("triton_gemm") else "cuBLAS GEMMs")
        return [
            ("target", f"{self.target.name} ({self.target.source}; {how})"),
            ("estimated time", f"{s['estimated_ms']:.3f} ms"),
            ("kernel bytes", f"{s['kernel_bytes'] / 1e9:.3f} GB"),
            ("matmul FLOPs", f"{s['flops'] / 1e12:.3f} TFLOP"),
            ("kernel launches", str(s["launches"])),
            ("XLA memory", f"temp {mem.get('temp', 0) / 2**20:,.1f} MiB, arguments "
                           f"{mem.get('argument', 0) / 2**20:,.1f} MiB, outputs "
                           f"{mem.get('output', 0) / 2**20:,.1f} MiB"),
            ("GEMMs", ", ".join(f"{n} {k}" for k, n in s["gemm_libraries"].items()) or "none"),
            ("fused attention", ", ".join(s["attention_calls"]) or "none"),
            ("FP8 GEMMs", fp8)]

    def to_markdown(self, top: int = 10) -> str:
        out = [f"## GPU program ({self.target.name})", "", "| | |", "|---|---|"]
        out += [f"| {k} | {v} |" for k, v in self._lines()]
        out += ["", *markdown_table(
            ("kind", "launches", "GB", "TFLOP", "est. ms"),
            [(kind, r["launches"], f"{r['bytes'] / 1e9:.3f}", f"{r['flops'] / 1e12:.3f}",
              f"{1e3 * r['seconds']:.3f}")
             for kind, r in sorted(self.by_kind().items(), key=lambda kv: -kv[1]["seconds"])])]
        out += ["", f"Top {top} kernels by estimated time:", "", *markdown_table(
            ("kernel", "kind", "library", "dtypes", "x", "MB", "est. ms", "op"),
            [(k.name, k.kind, k.library, " x ".join(map(str, k.dtypes)), k.times,
              f"{k.bytes / 1e6:.1f}", f"{1e3 * sec:.3f}", k.op_name[-60:])
             for k, sec in self.top(top)])]
        return "\n".join(out)

    def print(self, file=None) -> None:
        """Prints the summary lines."""
        file = file or sys.stdout
        width = max(len(k) for k, _ in self._lines())
        for k, v in self._lines():
            print(f"{k.ljust(width)}  {v}", file=file)


def gpu_program(fn: Callable, *args: Any, target: Any = "h200", triton_gemm: bool | None = None,
                compiler_options: dict[str, Any] | None = None) -> GpuProgram:
    """Compiles ``fn(*args)`` for a GPU, with or without one, and reports the program.

    ``gpu_program(step, state, batch)`` takes a step from :func:`jaxamp.make_train_step` (the
    call shape of the other diagnostics); ``gpu_program(fn, *args)`` any function, jitted or
    not. Arrays in ``args`` (or ``jax.ShapeDtypeStruct`` s) give only their shapes and dtypes:
    nothing is computed and nothing is copied. The step is traced for the GPU (autocast
    re-dispatches ``jax.nn.dot_product_attention`` to cuDNN there), lowered, and compiled by
    XLA's GPU compiler.

    Args:
      target: ``"h100"`` or ``"h200"`` (built-in descriptions), a path to a
        ``GpuTargetConfigProto`` text file, ``jax.devices()[0]`` on a GPU (compiled on it, with
        autotuning), or a :class:`GpuTarget`.
      triton_gemm: compile GEMMs as XLA Triton fusions (``True``) or cuBLAS calls (``False``).
        Default: cuBLAS without a GPU (no autotuner picks Triton tiles there, and Triton's
        untuned default tile splits K into float32 partials a tuned program does not have),
        XLA's autotuner on a real GPU.
      compiler_options: more XLA options for ``compile()``.

    Raises:
      ModuleNotFoundError: JAX's CUDA plugin is not installed (the message names the install).
      RuntimeError: the plugin gave no compile-only GPU (``JAX_PLATFORMS=cpu`` missing).
      ValueError: an unknown target, or a step built with ``mesh=`` (one GPU only).
    """
    from ..train import TrainStep

    tgt = gpu_target(target)
    if isinstance(fn, TrainStep) and fn._mesh is not None:
        raise ValueError("gpu_program: this step was built with mesh=; the GPU program is "
                         "compiled for one GPU. Build the step without mesh= to see the "
                         "program one device runs on its share of the batch.")
    if isinstance(fn, TrainStep) and len(args) == 2:  # fp8=delayed: the state it would run
        args = (jax.eval_shape(fn.calibrate, *args), args[1])
    device = tgt.compile_device()
    sharding = jax.sharding.SingleDeviceSharding(device)
    abstract = jax.tree.map(lambda x: _abstract(x, sharding), args,
                            is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    options = dict(compiler_options or {})
    if triton_gemm is None and tgt.device is None:
        triton_gemm = False
    if triton_gemm is not None:
        options["xla_gpu_enable_triton_gemm"] = bool(triton_gemm)
    lower = fn.lower if hasattr(fn, "lower") else jax.jit(fn).lower
    with jax.default_device(device):
        lowered = lower(*abstract)
    compiled = lowered.compile(compiler_options=options or None)
    return GpuProgram.read(compiled, tgt, lowered=lowered,
                           options={"triton_gemm": triton_gemm,
                                    "autotuned": tgt.device is not None,
                                    "compiler_options": options})


def _load(spec: str) -> Callable:
    """``module:function`` or ``path/to/file.py:function``."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(f"{spec!r}: expected MODULE:FUNCTION or FILE.py:FUNCTION")
    if where.endswith(".py"):
        path = Path(where).resolve()
        sys.path.insert(0, str(path.parent))
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


def main(argv: list[str] | None = None) -> int:
    """``python -m jaxamp.diagnostics.gpu FILE.py:make [--target h200] [--json OUT]``: ``make()``
    returns ``(fn, *args)`` (a step with its state and batch, or any function and its
    arguments); prints the report (or writes JSON / Markdown)."""
    ap = argparse.ArgumentParser(prog="python -m jaxamp.diagnostics.gpu",
                                 description="Compile a step for a GPU and report the program.")
    ap.add_argument("make", help="MODULE:FUNCTION or FILE.py:FUNCTION returning (fn, *args)")
    ap.add_argument("--target", default="h200",
                    help="h100, h200 or a GpuTargetConfigProto text file (default h200)")
    ap.add_argument("--triton-gemm", action="store_true", help="Triton GEMMs, not cuBLAS")
    ap.add_argument("--json", default=None, help="write the report as JSON here")
    ap.add_argument("--markdown", action="store_true", help="print Markdown")
    a = ap.parse_args(argv)
    try:
        made = _load(a.make)()
        fn, *args = made
        report = gpu_program(fn, *args, target=a.target,
                             triton_gemm=True if a.triton_gemm else None)
    except (ValueError, ModuleNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.json:
        Path(a.json).write_text(report.to_json() + "\n")
    print(report.to_markdown()) if a.markdown else report.print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
