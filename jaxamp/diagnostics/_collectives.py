"""What crosses the wire: every collective of a partitioned program (read after XLA's SPMD
partitioner), with its kind, dtype, bytes, mesh axes and origin (docs/api/diagnostics.rst)."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from ._base import markdown_table
from ._hlo import Instr, array_bytes, arrays, hlo_modules, op_name, operand_name, parse_hlo

__all__ = ["collectives", "format_collectives", "hlo_collectives", "total_bytes"]

_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
          "collective-broadcast", "ragged-all-to-all")
_DTYPE_NAMES = {"f64": "float64", "f32": "float32", "f16": "float16", "bf16": "bfloat16",
                "s32": "int32", "u32": "uint32", "s64": "int64", "u64": "uint64", "s8": "int8",
                "u8": "uint8", "pred": "bool", "f8e4m3fn": "float8_e4m3fn",
                "f8e5m2": "float8_e5m2", "s16": "int16", "u16": "uint16"}
def _nbytes(found) -> int:
    return sum(array_bytes(d, shape) for d, shape in found)


def _groups(line: str, n_devices: int | None) -> list[list[int]] | None:
    """The device groups of a collective, from any of XLA's spellings (explicit lists, iota
    ``[G,S]<=[dims]T(perm)``, Shardy's ``mesh['a'=2,...] {'a'}``, source-target pairs)."""
    m = re.search(r"replica_groups=\{(\{[\d,{} ]*\})\}", line)
    if m:
        return [[int(x) for x in g.split(",") if x.strip()]
                for g in re.findall(r"\{([\d, ]*)\}", m.group(1))]
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(shape).tolist()
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?"
                  r"\s*\{([^}]*)\}", line)
    if m:
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names = [a for a, _ in axes]
        sizes = [int(s) for _, s in axes]
        chosen = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(3))]
        ids = np.arange(int(np.prod(sizes)))
        if m.group(2):  # the mesh's devices: iota [dims]T(perm), or a list
            iota = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", m.group(2).strip())
            if iota:
                ids = ids.reshape([int(x) for x in iota.group(1).split(",")])
                if iota.group(2):
                    ids = ids.transpose([int(x) for x in iota.group(2).split(",")])
            else:
                ids = np.array([int(x) for x in re.findall(r"\d+", m.group(2))])
        ids = ids.reshape(sizes)
        rest = [i for i in range(len(sizes)) if i not in chosen]
        ids = ids.transpose(rest + chosen)
        return ids.reshape(-1, int(np.prod([sizes[i] for i in chosen]))).tolist()
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", line + "}")
    if m:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1) + "}")]
    if "replica_groups={}" in line and n_devices:
        return [list(range(n_devices))]
    return None


def _axes(groups, mesh: Mesh | None) -> tuple[str, ...] | None:
    """The mesh axes along which the members of the groups differ."""
    if mesh is None or not groups:
        return None
    shape = mesh.devices.shape
    varying: set[int] = set()
    for g in groups:
        coords = [np.unravel_index(i, shape) for i in g if i < mesh.size]
        for ax in range(len(shape)):
            if len({c[ax] for c in coords}) > 1:
                varying.add(ax)
    return tuple(mesh.axis_names[a] for a in sorted(varying))


def hlo_collectives(text: str, mesh: Mesh | None = None) -> list[dict[str, Any]]:
    """Every collective in the HLO module(s) ``text`` (see :func:`collectives` for the
    fields), read with the one HLO reader (:func:`jaxamp.diagnostics._hlo.parse_hlo`)."""
    found = []
    for module in hlo_modules(text):
        for instrs in parse_hlo(module).values():
            types = {i.name: i.type for i in instrs}
            found += [_collective(i, types, mesh) for i in instrs
                      if i.opcode.removesuffix("-start") in _KINDS]
    return found


def _collective(ins: Instr, types: dict[str, str], mesh: Mesh | None) -> dict[str, Any]:
    op, type_text, line = ins.opcode, ins.type, ins.attrs
    kind = op.removesuffix("-start")
    operands = [a for o in ins.operands for a in arrays(types.get(operand_name(o) or "", ""))]
    result = arrays(type_text)
    if op.endswith("-start") and operands:  # (operands, results) tuples
        result = result[len(operands):] or result
    groups = _groups(line, mesh.size if mesh is not None else None)
    size = max((len(g) for g in groups), default=1) if groups else None
    in_bytes, out_bytes = _nbytes(operands or result), _nbytes(result)
    n = size or 1
    wire = {"all-reduce": 2 * (n - 1) / n * in_bytes, "all-gather": (n - 1) / n * out_bytes,
            "reduce-scatter": (n - 1) / n * in_bytes,
            "all-to-all": (n - 1) / n * in_bytes}.get(kind, in_bytes)
    dtype = (result or operands or [("?", ())])[0][0]
    return {
        "kind": kind, "dtype": _DTYPE_NAMES.get(dtype, dtype),
        "shape": list((result or operands)[0][1]) if (result or operands) else [],
        "bytes": max(in_bytes, out_bytes), "wire_bytes": int(round(wire)),
        "group_size": size, "axes": _axes(groups, mesh),
        "op_name": op_name(line), "name": ins.name,
    }


def _mesh_of(fn, args) -> Mesh | None:
    mesh = getattr(fn, "_mesh", None)
    if isinstance(mesh, Mesh):
        return mesh
    for leaf in jax.tree.leaves(args):
        s = getattr(leaf, "sharding", None)
        if isinstance(s, NamedSharding) and isinstance(s.mesh, Mesh):
            return s.mesh
    return None


def collectives(fn: Callable, *args: Any, mesh: Mesh | None = None) -> list[dict[str, Any]]:
    """The collectives of ``fn(*args)`` as XLA partitioned it, one dict per collective.

    Args:
      fn: a ``jax.jit`` function or a :func:`jaxamp.make_train_step` step (anything with
        ``.lower(*args)``).
      *args: its arguments (arrays with their shardings, or ``jax.ShapeDtypeStruct`` s).
      mesh: the mesh, to name the axes each collective spans; default: the step's mesh or
        the mesh of the first ``NamedSharding`` among ``args``.

    Returns:
      One dict per collective, in program order (empty on one device): ``kind``
      (``"all-reduce"``, ``"all-gather"``, ``"reduce-scatter"``, ``"all-to-all"``,
      ``"collective-permute"``, ...), ``dtype`` (``"float32"``), ``shape`` (``[32, 32]``),
      ``bytes`` (the per-device buffer size), ``wire_bytes`` (bytes each device sends, a ring
      estimate), ``group_size`` (``8``), ``axes`` (``("data",)``), ``op_name`` (the JAX name
      stack) and ``name`` (the HLO name).

    It compiles ``fn`` once more (the HLO is dumped to a temporary directory and removed).
    """
    if not hasattr(fn, "lower"):
        raise TypeError(f"collectives: fn must be jitted (jax.jit(f)) or a jaxamp step, got "
                        f"{type(fn).__name__}.")
    mesh = mesh if mesh is not None else _mesh_of(fn, args)
    lowered = fn.lower(*args)
    with tempfile.TemporaryDirectory() as d:
        compiled = lowered.compile({"xla_dump_to": d,
                                    "xla_dump_hlo_pass_re": "spmd-partitioning"})
        files = sorted(f for f in os.listdir(d) if "after_spmd-partitioning" in f
                       and f.endswith(".txt"))
        if files:
            text = "\n".join(open(os.path.join(d, f)).read() for f in files)
        else:  # nothing was partitioned (one device): the compiled program
            text = compiled.as_text()
    return hlo_collectives(text, mesh)


def total_bytes(rows: Sequence[dict[str, Any]], key: str = "wire_bytes") -> dict[str, int]:
    """Bytes per dtype (``{"float32": ..., "bfloat16": ..., "total": ...}``)."""
    out: dict[str, int] = {}
    for r in rows:
        out[r["dtype"]] = out.get(r["dtype"], 0) + int(r[key])
    out["total"] = sum(v for k, v in out.items())
    return out


def format_collectives(rows: Sequence[dict[str, Any]]) -> str:
    """A markdown table of :func:`collectives` rows, with the totals per dtype."""
    lines = markdown_table(
        ("kind", "dtype", "shape", "axes", "bytes", "wire bytes", "from"),
        [(r["kind"], r["dtype"], "x".join(str(s) for s in r["shape"]) or "scalar",
          ",".join(r["axes"]) if r["axes"] is not None else "?", r["bytes"], r["wire_bytes"],
          r["op_name"]) for r in rows], ("---",) * 4 + ("---:",) * 2 + ("---",))
    return "\n".join([*lines, "", "wire bytes per device and step: " + ", ".join(
        f"{k} {v}" for k, v in total_bytes(rows).items())])
