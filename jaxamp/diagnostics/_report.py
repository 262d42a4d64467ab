"""What an audit reports: :class:`Finding`, :class:`AuditReport` and their rendering.

:func:`jaxamp.audit` and :func:`jaxamp.audit_step` both return an :class:`AuditReport`: the
precision-table rows (with a coarse ``category`` per row), the :class:`Finding` s, and, for
:func:`jaxamp.audit`, the trace the reference table is rebuilt from on demand
(:meth:`AuditReport.reference_table`, see :mod:`jaxamp.diagnostics._reference`). Output as a dict,
JSON, Markdown
(:func:`format_precision_table` for the plain table) or a rich console print.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax

from ..state_dtype import StoredState
from ._base import Report, escape, rich_table
from ._reference import reference_rows
from ._trace import Trace, is_low, low_leaves, matmul_rows


@dataclasses.dataclass(frozen=True)
class Finding:
    """One problem the audit found.

    Attributes:
      kind: a stable identifier (see :mod:`jaxamp.audit`), e.g. ``softmax_low_precision``.
      module: the module path it concerns (``"(top level)"`` outside modules, ``"(params)"``,
        ``"(opt_state)"`` or ``"(train step)"`` for non-module findings).
      detail: a plain-English explanation with the likely fix.
      reference_row: the reference-table row it concerns, if any (e.g. ``"LayerNorm"``).
    """

    kind: str
    module: str
    detail: str
    reference_row: str | None = None

    @property
    def seed_row(self) -> str | None:
        """Deprecated name of :attr:`reference_row`."""
        warnings.warn("Finding.seed_row is deprecated; use Finding.reference_row",
                      DeprecationWarning, stacklevel=2)
        return self.reference_row

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["seed_row"] = self.reference_row  # the key before 0.2, kept for readers of old JSON
        return d


def group_findings(findings: list[tuple[str, str, str, str | None]]) -> list[Finding]:
    """One Finding per (kind, module), merging details."""
    merged: dict[tuple[str, str], list] = {}
    for kind, module, detail, row in findings:
        entry = merged.setdefault((kind, module), [[], row])
        if detail not in entry[0]:
            entry[0].append(detail)
    return [Finding(k, m, " ".join(d), row) for (k, m), (d, row) in merged.items()]


def without_rounded_state(opt_state: Any) -> Any:
    """``opt_state`` without the states stored by stochastic rounding (``opt_state=bfloat16``,
    ``jaxamp.amp(state_dtype=...)``): bfloat16 there is by design, not a finding, and the
    update itself runs in float32 (the reference table's "Parameter update" row)."""
    def drop(x):
        return x._replace(inner_state=None) if isinstance(x, StoredState) \
            and x.rounding_key is not None else x
    return jax.tree.map(drop, opt_state, is_leaf=lambda x: isinstance(x, StoredState))


def storage_findings(params: Any, opt_state: Any) -> list[tuple[str, str, str, str | None]]:
    """Raw findings (for :func:`group_findings`): params / optimizer state stored in f16/bf16
    (an optimizer state stored in bfloat16 with stochastic rounding is not one)."""
    raw = []
    param_low = low_leaves(params) if params is not None else []
    opt_low = low_leaves(without_rounded_state(opt_state)) if opt_state is not None else []

    def listing(low):
        more = f" and {len(low) - 4} more" if len(low) > 4 else ""
        return ", ".join(f"{p} ({d})" for p, d in low[:4]) + more

    if param_low:
        raw.append(("params_low_precision", "(params)",
                    f"{len(param_low)} parameter leaves are stored in low precision: "
                    f"{listing(param_low)}. A model cast wholesale (.astype(jnp.float16)) loses "
                    "small updates (lr * grad below half an ulp of the weight rounds away) and "
                    "runs LayerNorm/softmax from float16 weights. Keep float32 master weights "
                    "(params=float32 in the policy) and let autocast cast per use.",
                    "Parameter update"))
    if opt_low:
        raw.append(("opt_state_low_precision", "(opt_state)",
                    f"{len(opt_low)} optimizer-state leaves are in low precision: "
                    f"{listing(opt_low)}. Adam's second moment (grad**2) underflows float16 and "
                    "its updates round away; keep the optimizer state float32 (create it from "
                    "float32 params), or store it in bfloat16 with stochastic rounding: "
                    "opt_state=bfloat16 in the policy (jaxamp.amp(..., "
                    "state_dtype=jnp.bfloat16)).", "Parameter update"))
    return raw


def format_precision_table(rows: list[dict[str, str]]) -> str:
    """The rows as a Markdown table."""
    lines = ["| module | op | forward | backward |", "|---|---|---|---|"]
    lines += [f"| {r['module']} | {r['op']} | {r['forward']} | {r['backward']} |" for r in rows]
    return "\n".join(lines)


class PrecisionTable(Report, list):
    """What :func:`jaxamp.precision_table` returns: its rows (a list of ``{"module", "op",
    "forward", "backward"}`` dicts, compared and indexed as a list) that print themselves.

    Attributes:
      policy: the default policy the table was traced under, as a string.
    """

    def __init__(self, rows=(), policy: str = ""):
        super().__init__(rows)
        self.policy = policy

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "rows": list(self)}

    def to_markdown(self) -> str:
        """The rows as a Markdown table (:func:`format_precision_table`)."""
        return f"## Precision table ({self.policy})\n\n{format_precision_table(self)}"

    def _rich(self) -> list[Any]:
        return [rich_table(f"precision table ({self.policy})", _TABLE_COLUMNS,
                           [(escape(r["module"]), r["op"], r["forward"], r["backward"])
                            for r in self])]


_TABLE_COLUMNS = ("module", "op", "forward", "backward")


@dataclasses.dataclass
class AuditReport(Report):
    """What :func:`jaxamp.audit` (or :func:`jaxamp.audit_step`) found.

    Attributes:
      rows: ``{"module", "op", "forward", "backward", "category"}`` per (module path, op
        class); the first four keys are exactly :func:`jaxamp.precision_table`'s.
        ``category`` is the coarse class: ``matmul``, ``softmax``, ``normalisation``,
        ``reduction``, ``loss``, ``elementwise``, ``gather``, ``max/min``, ``cast`` or
        ``output``.
      findings: the :class:`Finding` s, most important first.
      policy: the default policy, as a string.
    """

    rows: list[dict[str, str]]
    findings: list[Finding]
    policy: str
    _trace: Trace | None = dataclasses.field(default=None, repr=False)
    _param_dtypes: list[str] = dataclasses.field(default_factory=list, repr=False)
    _opt_dtypes: list[str] = dataclasses.field(default_factory=list, repr=False)

    @property
    def matmuls(self) -> list[dict[str, str]]:
        """Every forward matmul (``dot_general``) in program order: ``{"module", "shapes",
        "dtypes", "fp8", "reason"}``, ``fp8`` ``"yes"``/``"no"`` and ``reason`` why not
        (:func:`jaxamp.diagnostics._trace.matmul_rows`)."""
        return matmul_rows(self._trace.records) if self._trace is not None else []

    @property
    def ok(self) -> bool:
        """True when there are no findings."""
        return not self.findings

    def kinds(self) -> set[str]:
        """The set of finding kinds."""
        return {f.kind for f in self.findings}

    # ---- the reference table -------------------------------------------------------------
    def seed_rows(self) -> list[dict[str, Any]]:
        """Deprecated name of :meth:`reference_table`."""
        warnings.warn("AuditReport.seed_rows() is deprecated; use reference_table()",
                      DeprecationWarning, stacklevel=2)
        return self.reference_table()

    def reference_table(self) -> list[dict[str, Any]]:
        """What each part of a Transformer ran in vs what mixed precision wants, from the
        traced program.

        Returns one dict per row the model has, in this order (embedding lookup, Q/K/V
        linear, attention scores, softmax, LayerNorm, convolution, FFN linear, cross-entropy
        loss, parameter update): a GPT has the seed's eight Transformer rows, a CNN its
        normalisation, convolution, linear, loss and update rows; a part the model does not
        have is left out. Keys: ``row``, ``forward``, ``backward``
        (dtypes actually used), ``expected_forward``, ``expected_backward`` (the reference's, with
        the policy's compute dtype for FP16), ``ok`` (``True``/``False``), ``modules`` (the
        module paths that make up the row) and ``note``.

        The mapping from module paths and op classes to rows is a heuristic for GPT-style
        models; it only counts equations that round (data movement, max/min, selections and
        casts are exact and left out):

        * **Embedding lookup**: the ``gather`` in an embedding module (``nn.Embed`` or a module
          named like ``embed``/``wte``); forward ``"<table dtype> -> <output dtype>"``, the
          output dtype being the dtype the gathered rows are cast to before their first use;
          backward: the dtype of the gradient arriving at the lookup's output (JAX gives a
          cotangent its primal's dtype). A tied output head (``embed.attend``) is not part of
          this row.
        * **Q/K/V Linear**: matmuls in modules named ``q``/``k``/``v``/``qkv``/``query``/
          ``key``/``value`` (also ``q_proj``, ``wq``, ``c_attn``, ``in_proj``, ...), and
          matmuls with a parameter operand written directly in an attention module.
        * **Attention scores**: matmuls in an attention module itself (class name containing
          ``Attention`` or a path segment like ``attn``/``attention``/``mha``), not in its
          Dense children, without a parameter operand (scores and weights @ V).
        * **Softmax**: exp/log and sums in an attention module itself; backward: its sums and
          exp/log (the softmax's backward reduction).
        * cuDNN's fused attention (``jax.nn.dot_product_attention`` traced for a GPU, op
          ``attention`` in the precision table) is both rows, wherever it is called: its
          query/key/value, output and gradients make the **Attention scores**, the softmax
          statistics it keeps for the backward (float32) the **Softmax**.
        * **LayerNorm**: every rounding op of normalisation modules (the classes of
          :data:`jaxamp.FP32_MODULES`, the engine's own float32 rule, and their subclasses);
          the cast of the result to the compute dtype on the way out is not counted. The row
          is named after the classes when they are not LayerNorm (``"BatchNorm"``).
        * **Convolution**: ``conv`` ops outside attention modules.
        * **FFN Linear**: matmuls in modules whose path has a segment like ``mlp``/``ffn``/
          ``fc``/``fc1``/``c_fc``/``w1``/``up_proj``/``Dense_<n>``, outside attention.
        * **CrossEntropy loss**: exp/log and sums outside every module (the loss function);
          backward: every rounding op outside modules.
        * **Parameter update**: the dtypes of the parameters (``args[argnums]``) and of
          ``opt_state`` if given; forward ``-``.
        """
        return reference_rows(self._trace, self._param_dtypes, self._opt_dtypes)

    # ---- output --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "rows": self.rows,
                "findings": [f.to_dict() for f in self.findings], "matmuls": self.matmuls,
                "reference_table": (table := self.reference_table()),
                "seed_rows": table}  # the key before 0.2, kept for readers of old JSON

    def to_markdown(self) -> str:
        """Findings, the reference table and the full precision table as Markdown."""
        out = [f"## Precision audit ({self.policy})", ""]
        if self.findings:
            out += ["### Findings", ""]
            out += [f"- **{f.kind}** `{f.module}`: {f.detail}" for f in self.findings]
        else:
            out.append("No findings.")
        seed = self.reference_table()
        if seed:
            out += ["", "### Mixed-precision reference table", "",
                    "| module / op | forward | backward | expected | ok |", "|---|---|---|---|---|"]
            for r in seed:
                ok = {True: "yes", False: "**NO**", None: "n/a"}[r["ok"]]
                out.append(f"| {r['row']} | {r['forward']} | {r['backward']} | "
                           f"{r['expected_forward']} / {r['expected_backward']} | {ok} |")
        if "matmul=" in self.policy or any(m["fp8"] == "yes" for m in self.matmuls):
            out += ["", "### Matmuls", "", "| module | shapes | dtypes | fp8 | why not |",
                    "|---|---|---|---|---|"]
            out += [f"| {m['module']} | {m['shapes']} | {m['dtypes']} | {m['fp8']} | "
                    f"{m['reason']} |" for m in self.matmuls]
        out += ["", "### Precision table", "", format_precision_table(self.rows)]
        return "\n".join(out)

    def _rich(self) -> list[Any]:
        """The reference table, the precision table (without casts, elementwise and max/min
        rows) and the findings."""
        out: list[Any] = []
        seed = self.reference_table()
        if seed:
            marks = {True: "[green]ok[/green]", False: "[bold red]MISMATCH[/bold red]",
                     None: "[dim]n/a[/dim]"}
            out.append(rich_table(
                f"mixed-precision reference table ({self.policy})",
                ("module / op", "forward", "backward", "expected", "ok"),
                [(r["row"], r["forward"], r["backward"],
                  f"{r['expected_forward']} / {r['expected_backward']}", marks[r["ok"]])
                 for r in seed]))
        rows = [r for r in self.rows if r.get("category") not in ("cast", "elementwise",
                                                                  "max/min")]
        styles = ["red" if is_low(r["forward"].split(",") + r["backward"].split(",")) and
                  r.get("category") in ("softmax", "normalisation", "loss", "reduction")
                  else None for r in rows]
        out.append(rich_table("precision table (casts and elementwise rows: see to_json())",
                              _TABLE_COLUMNS,
                              [(escape(r["module"]), r["op"], r["forward"], r["backward"])
                               for r in rows], styles))
        if not self.findings:
            out.append("[green]no findings[/green]")
        out += [f"[bold red]{f.kind}[/bold red] [cyan]{escape(f.module)}[/cyan]: "
                f"{escape(f.detail)}" for f in self.findings]
        return out
