"""The one base of the diagnostics' reports. Imports no JAX (the log reader's report is one).

A report holds plain data and says it four ways: :meth:`Report.to_dict` (the JSON keys, a
contract), :meth:`Report.to_json`, :meth:`Report.to_markdown` and :meth:`Report.print` (rich
tables and lines, built by the subclass's ``_rich``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any


class Report:
    """Base of :class:`AuditReport`, :class:`PrecisionTable`, :class:`OverflowReport`,
    :class:`RunReview` and :class:`GpuProgram`: a subclass defines ``to_dict``,
    ``to_markdown`` and ``_rich`` (what :meth:`print` shows)."""

    def to_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def to_json(self, indent: int | None = 2, *args: Any, **kwargs: Any) -> str:
        """:meth:`to_dict` (given any further arguments) as a JSON string."""
        return json.dumps(self.to_dict(*args, **kwargs), indent=indent)

    def to_markdown(self) -> str:
        raise NotImplementedError

    def _rich(self) -> list[Any]:
        """What :meth:`print` prints, in order: rich tables and markup strings."""
        raise NotImplementedError

    def print(self, console=None) -> None:
        """Prints the report with rich, on ``console`` (default: a new ``rich`` Console)."""
        from rich.console import Console

        console = console or Console()
        for item in self._rich():
            console.print(item)


def rich_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[str]],
               styles: Sequence[str | None] | None = None):
    """A rich ``Table`` titled ``title`` (left), one column per name, one row per cell list;
    ``styles``: a style per row (None: unstyled)."""
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for col in columns:
        t.add_column(col)
    for i, row in enumerate(rows):
        t.add_row(*row, style=styles[i] if styles is not None else None)
    return t


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[Any]],
                   align: Sequence[str] | None = None) -> list[str]:
    """The lines of a Markdown table: a header of ``columns`` (``align``: each column's
    separator, default ``---``), then one line per row of cells."""
    return ["| " + " | ".join(columns) + " |",
            "|" + "|".join(align or ["---"] * len(columns)) + "|",
            *("| " + " | ".join(map(str, row)) + " |" for row in rows)]


def escape(text: str) -> str:
    """``text`` with rich markup escaped."""
    from rich.markup import escape as rich_escape

    return rich_escape(text)
