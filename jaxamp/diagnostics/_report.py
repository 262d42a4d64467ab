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
from ._base import Report, escape, markdown_table, rich_table
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


_TABLE_COLUMNS = ("module", "op", "forward", "backward")
_REFERENCE_COLUMNS = ("module / op", "forward", "backward", "expected", "ok")


def _reference_cells(rows: list[dict[str, Any]], marks: dict) -> list[tuple]:
    return [(r["row"], r["forward"], r["backward"],
             f"{r['expected_forward']} / {r['expected_backward']}", marks[r["ok"]])
            for r in rows]


def format_precision_table(rows: list[dict[str, str]]) -> str:
    """The rows as a Markdown table."""
    return "\n".join(markdown_table(_TABLE_COLUMNS, [[r[c] for c in _TABLE_COLUMNS]
                                                   for r in rows]))


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
        "dtypes", "fp8", "recipe", "reason"}``, ``fp8`` ``"yes"``/``"no"``, its ``fp8=`` recipe
        and ``reason`` why not
        (:func:`jaxamp.diagnostics._trace.matmul_rows`)."""
        return matmul_rows(self._trace.records) if self._trace is not None else []

    @property
    def ok(self) -> bool:
        """True when there are no findings."""
        return not self.findings

    def kinds(self) -> set[str]:
        """The set of finding kinds."""
        return {f.kind for f in self.findings}

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

        How module paths and op classes map to rows: docs/api/diagnostics.rst, "The
        reference table".
        """
        return reference_rows(self._trace, self._param_dtypes, self._opt_dtypes)

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
            out += ["", "### Mixed-precision reference table", "", *markdown_table(
                _REFERENCE_COLUMNS, _reference_cells(seed, {True: "yes", False: "**NO**",
                                                            None: "n/a"}))]
        if "matmul=" in self.policy or any(m["fp8"] == "yes" for m in self.matmuls):
            out += ["", "### Matmuls", "", *markdown_table(
                ("module", "shapes", "dtypes", "fp8", "recipe", "why not"),
                [[m[k] for k in ("module", "shapes", "dtypes", "fp8", "recipe", "reason")]
                 for m in self.matmuls])]
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
            out.append(rich_table(f"mixed-precision reference table ({self.policy})",
                                  _REFERENCE_COLUMNS, _reference_cells(seed, marks)))
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
