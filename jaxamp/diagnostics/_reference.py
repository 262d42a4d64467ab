"""The mixed-precision reference table (which dtype each part of a GPT-style model should run in),
rebuilt from a trace's records; how: docs/api/diagnostics.rst, "The reference table". The same
role predicates (:func:`is_norm` in particular) classify the audit's findings."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax.extend.core as jcore
import jax.numpy as jnp

from .._engine.compat import new_dtype
from .._engine.jaxpr import consumers, containing
from ..rules import EMBED_MODULES, FP32_MODULES
from ._trace import (
    ACCUM,
    EXPLOG,
    PASS_THROUGH,
    Eqn,
    ModuleInfo,
    Trace,
    attention_dtypes,
    dtype_name,
    join_dtypes,
    loss_records,
)

_EMBED_NAME = re.compile(r"embed|wte|tok_?emb|word_?emb", re.I)
_ATTN_NAME = re.compile(r"attn|attention|mha", re.I)
_QKV_NAME = re.compile(r"^(q|k|v|qk|kv|qkv|query|key|value|wq|wk|wv|wqkv|c_attn|in_proj|"
                       r"query_key_value|to_q|to_k|to_v|to_qkv)(_proj)?(_\d+)?$", re.I)
_FFN_NAME = re.compile(r"mlp|ffn|feed_?forward|^fc\d*(_\d+)?$|^c_fc$|^wi(_\d+)?$|^wo$|^w[123]$|"
                       r"^(up|down|gate)_proj$|^dense_\d+$|^intermediate$", re.I)


def _last(path: str) -> str:
    return path.rsplit("/", 1)[-1].split(".")[0]


def _has_role(key: str, modules: dict[str, ModuleInfo], classes: tuple[type, ...], word: str,
              name_re: re.Pattern[str]) -> bool:
    """A module plays a role by its class (or class name); an unrecorded one by its name."""
    if not key:
        return False
    m = modules.get(key)
    if m is not None and (issubclass(m.cls, classes) or word in m.cls.__name__):
        return True
    return m is None and bool(name_re.search(_last(key)))


def is_norm(key: str, modules: dict[str, ModuleInfo]) -> bool:
    """Whether the recorded module ``key`` is a normalisation layer, by the engine's own rule:
    its class is one of :data:`jaxamp.FP32_MODULES` (or a subclass), the classes autocast runs
    in float32. A class *named* like a norm is not one (HF's ``...EncoderLayerStableLayerNorm``
    is a whole encoder layer, ``FlaxConvWithWeightNorm`` a convolution); a user's override of
    a norm class (``{nn.LayerNorm: "float16"}``) leaves it a norm, so the audit flags it."""
    m = modules.get(key) if key else None
    return m is not None and issubclass(m.cls, FP32_MODULES)


def _is_embed(key: str, modules: dict[str, ModuleInfo]) -> bool:
    return _has_role(key, modules, EMBED_MODULES, "Embed", _EMBED_NAME)


def _is_attention(key: str, modules: dict[str, ModuleInfo]) -> bool:
    if not key:
        return False
    m = modules.get(key)
    if m is not None and "Attention" in m.cls.__name__:
        return True
    return bool(_ATTN_NAME.search(_last(key)))


def _in_attention(key: str, modules) -> bool:
    segs = key.split("/")
    return any(_is_attention("/".join(segs[:i]), modules) for i in range(1, len(segs) + 1))


def _is_qkv(key: str) -> bool:
    return bool(key) and bool(_QKV_NAME.match(_last(key)))


def _is_ffn(key: str, modules) -> bool:
    if not key or _in_attention(key, modules):
        return False
    return any(_FFN_NAME.search(seg.split(".")[0]) for seg in key.split("/")[1:])


_ROWS = ("Embedding lookup", "Q/K/V Linear", "Attention scores", "Softmax", "LayerNorm",
         "Convolution", "FFN Linear", "CrossEntropy loss", "Parameter update")
_COMPUTE_ROWS = ("Q/K/V Linear", "Attention scores", "Convolution", "FFN Linear")
_NOTES = {
    "Embedding lookup": "the lookup computes nothing; its output is cast to the compute dtype",
    "Q/K/V Linear": "main Tensor Core work",
    "Attention scores": "cast to float32 before the softmax",
    "Softmax": "overflow-sensitive",
    "LayerNorm": "mean/variance need float32",
    "Convolution": "main Tensor Core work of a CNN",
    "FFN Linear": "largest gain",
    "CrossEntropy loss": "log-sum-exp needs float32",
    "Parameter update": "master weights always float32",
}


def _use_dtype(rec: Eqn, jaxpr: jcore.Jaxpr) -> str | None:
    """The dtype a gathered value is cast to before its first arithmetic use (following
    reshapes and other data movement), or None if it is used as is."""
    j = containing(jaxpr, rec.eqn)
    if j is None:
        return None
    uses = consumers(j)
    frontier = list(rec.eqn.outvars)
    seen = set()
    while frontier:
        v = frontier.pop()
        if v in seen:
            continue
        seen.add(v)
        for e in uses.get(v, []):
            name = e.primitive.name
            if name == "convert_element_type":
                return dtype_name(new_dtype(e))
            if name in PASS_THROUGH:
                frontier.extend(e.outvars)
    return None


def norm_row(classes: set[str]) -> str:
    """The reference row of a model's normalisation layers: ``"LayerNorm"`` (the
    Transformer's), or what the model has instead (``"BatchNorm"``, ``"GroupNorm/RMSNorm"``)."""
    return "/".join(sorted(classes)) if classes and classes != {"LayerNorm"} else "LayerNorm"


def reference_rows(t: Trace | None, param_dtypes: Sequence[str],
               opt_dtypes: Sequence[str]) -> list[dict[str, Any]]:
    """The rows of :meth:`jaxamp.AuditReport.reference_table` (which documents them) for trace
    ``t``; ``param_dtypes``/``opt_dtypes``: the float dtypes of the parameters and optimizer
    state (the "Parameter update" row). Empty without a trace."""
    if t is None:
        return []
    mods = t.modules
    low = dtype_name(t.policy.compute_dtype)
    recs = [r for r in t.records if r.dtypes]
    groups: dict[str, dict[str, Any]] = {
        name: {"forward": set(), "backward": set(), "modules": set(), "name": name,
               "expected": set()}
        for name in _ROWS}
    loss = loss_records(recs, t.op_rules.matmul)

    def add(name, r, forward=True, backward=True, dtypes=None):
        g = groups[name]
        dtypes = r.dtypes if dtypes is None else set(dtypes)
        if r.backward and backward:
            g["backward"] |= dtypes
        elif not r.backward and forward:
            g["forward"] |= dtypes
        else:
            return
        g["modules"].add(r.module)
        # what the module's policy computes in (a rule may make a module float32 on purpose)
        g["expected"].add(mods[key].compute if (key := r.key) in mods else low)

    emb_fwd = None
    norm_classes: set[str] = set()
    for r in recs:
        key, prim = r.key, r.prim
        if r.op == "attention":  # cuDNN's fused kernel: scores and softmax in one equation
            scores, softmax = attention_dtypes(r)
            add("Attention scores", r, dtypes=scores)
            add("Softmax", r, dtypes=softmax)
            continue
        if prim in t.op_rules.matmul:
            if _is_embed(key, mods):
                continue  # a tied head: not a reference row
            if r.op == "conv" and not _in_attention(key, mods):
                add("Convolution", r)
            elif _is_qkv(key):
                add("Q/K/V Linear", r)
            elif _is_attention(key, mods):
                if r.backward:
                    add("Attention scores", r)
                elif r.param_operand:
                    add("Q/K/V Linear", r)
                else:
                    add("Attention scores", r)
            elif _is_ffn(key, mods):
                add("FFN Linear", r)
            continue
        if is_norm(key, mods):
            if r.rounds:
                add("LayerNorm", r)
                norm_classes.add(mods[key].cls.__name__ if key in mods else "LayerNorm")
            continue
        if prim == "gather" and _is_embed(key, mods) and not r.backward:
            emb_fwd = _embedding(r, t)
            groups["Embedding lookup"]["modules"].add(r.module)
            continue
        sensitive = (prim in EXPLOG and not r.bounded) or (prim in ACCUM and not r.count_sum)
        if id(r) in loss:
            if (not r.backward and sensitive) or (r.backward and r.rounds):
                add("CrossEntropy loss", r)
            continue
        if not key:
            continue  # model code outside every module (Equinox, plain JAX): no row of its own
        if _is_attention(key, mods) and sensitive:
            add("Softmax", r)
    rows = [_table_row(name, groups[name], t, emb_fwd, norm_classes,
                       list(param_dtypes) + list(opt_dtypes)) for name in _ROWS]
    return [r for r in rows if r is not None]


def _embedding(r: Eqn, t: Trace) -> tuple:
    """``(table dtype, output dtype)`` of an embedding lookup. The table is the params' as
    stored when it is one: a small table's rows are gathered from its low-precision copy
    (``gather_low``), the same numbers as the stored table's rows cast."""
    table = r.in_dtypes[0] if r.in_dtypes else "-"
    if r.param_operand:
        table = jnp.dtype(t.policy.param_dtype).name
    return table, _use_dtype(r, t.jaxpr) or (r.out_dtypes[0] if r.out_dtypes else None)


def _table_row(name: str, g: dict[str, Any], t: Trace, emb_fwd: tuple | None,
               norm_classes: set[str], state_dtypes: list[str]) -> dict[str, Any] | None:
    """Row ``name`` of the table from what was seen of it (``g``), or None when the model
    has no such part."""
    low = dtype_name(t.policy.compute_dtype)
    if name == "Embedding lookup":
        if emb_fwd is None:
            fwd = bwd = "-"
        else:
            fwd = f"{emb_fwd[0]} -> {emb_fwd[1]}"
            bwd = emb_fwd[1] if t.grad else "-"
        exp_f, exp_b = f"float32 -> {low}", low
    elif name == "Parameter update":
        fwd = "-"
        bwd = join_dtypes(state_dtypes)
        exp_f, exp_b = "-", "float32"
    else:
        fwd, bwd = join_dtypes(g["forward"]), join_dtypes(g["backward"])
        exp_f = exp_b = join_dtypes(g["expected"]) if name in _COMPUTE_ROWS else "float32"
    if not t.grad and name != "Parameter update":
        exp_b = "-"
    present = fwd != "-" or (name == "Parameter update" and bwd != "-")
    if not present:
        return None  # the model has no such part: the table shows the rows it has
    # graded on what was seen: a pass with nothing in it ("-") is not a mismatch
    ok = fwd in (exp_f, "-") and (bwd in (exp_b, "-") or not t.grad or exp_b == "-")
    if name == "LayerNorm":
        name = norm_row(norm_classes)
    return {"row": name, "forward": fwd, "backward": bwd,
            "expected_forward": exp_f, "expected_backward": exp_b, "ok": ok,
            "modules": sorted(g["modules"]), "note": _NOTES[g["name"]]}

