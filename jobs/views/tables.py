"""The tables ``ckpteval status`` prints: a rich table of one-line text cells, printed fast where that is exact.

Rich lays out and draws every cell through its general machinery (markup, measuring, wrapping), tens of
microseconds a cell: the points tables of a 1,000-point run (about 50k cells) took seconds.
:class:`PlainTable` takes the same columns and rows as :class:`rich.table.Table` and prints through it,
except where the output has no colour (a file, a pipe: no style is written) and every cell is plain text
(one printable line, no markup or emoji syntax, no outer spaces) and the table fits the width as it is
(so rich would wrap nothing). Then rich draws the title, the header and the first row with every column at
the width it would give it, and the other rows are written as the same characters the first row shows
(borders and padding taken from rich's own first row, which is checked: rich draws the whole table when the
two differ).

Guarantee: the characters are those of the rich table of the same columns and rows. Limits: on a colour
terminal every table is drawn by rich (it highlights numbers, a style per number), as slowly as before;
columns are justified ``left`` or ``right`` (anything else goes through rich).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

FAST_JUSTIFY = ("left", "right")


@dataclass(frozen=True)
class Column:
    """A column as rich names its parts (``header``, ``justify``)."""

    header: str
    justify: str


def _plain(cell: str) -> bool:
    """A cell rich shows as it is: one printable line without markup (``[``) or emoji codes (``:``)."""
    return cell.isprintable() and "[" not in cell and ":" not in cell and cell == cell.strip()


class PlainTable:
    """A rich-compatible table (``add_column``, ``add_row``) of string cells, every column folding overflow."""

    def __init__(self, title: str) -> None:
        self.title = title
        self.columns: list[Column] = []
        self.rows: list[tuple[str, ...]] = []

    def add_column(self, header: str, justify: str = "left", overflow: str = "fold") -> None:
        if overflow != "fold":
            raise ValueError(f"column {header!r}: PlainTable columns fold their overflow, got {overflow!r}")
        self.columns.append(Column(header, justify))

    def add_row(self, *cells: str) -> None:
        self.rows.append(cells)

    def rich_table(self, widths: list[int] | None = None, rows: int | None = None) -> Any:
        """The rich table of these columns and (the first ``rows``) rows; ``widths`` (padding included) fixes
        each column's width."""
        from rich.table import Table

        table = Table(title=self.title)
        for i, column in enumerate(self.columns):
            table.add_column(column.header, justify=column.justify, overflow="fold",  # type: ignore[arg-type]
                             width=None if widths is None else widths[i] - 2)
        for row in self.rows[:rows]:
            table.add_row(*row)
        return table

    def plain_widths(self) -> list[int] | None:
        """Each column's width as rich gives it when the table fits (its widest cell plus the padding), when
        every cell is plain; None otherwise."""
        from rich.cells import cell_len

        if not all(_plain(c.header) for c in self.columns) or not all(_plain(c) for row in self.rows for c in row):
            return None
        widths = [cell_len(c.header) for c in self.columns]
        for row in self.rows:
            widths = [max(w, cell_len(c)) for w, c in zip(widths, row, strict=True)]
        return [w + 2 for w in widths]

    def maximum_width(self) -> int:
        """The columns the table takes when nothing is wrapped (rich's measure of it)."""
        widths = self.plain_widths()
        if widths is not None:
            return sum(widths) + len(widths) + 1  # the borders: one left of each column, one at the right
        from rich.console import Console

        return Console(width=10_000, file=io.StringIO()).measure(self.rich_table()).maximum

    def __rich_console__(self, console: Any, options: Any) -> Any:
        widths = self.plain_widths() if console.color_system is None and len(self.rows) > 1 else None
        if (widths is None or sum(widths) + len(widths) + 1 > options.max_width
                or any(c.justify not in FAST_JUSTIFY for c in self.columns)):
            yield self.rich_table()
            return
        from rich.segment import Segment

        lines = list(Segment.split_lines(console.render(self.rich_table(widths, rows=1), options)))
        first = "".join(s.text for s in lines[-2])  # the first row, as rich draws it; then the bottom border
        if not first or self._line(self.rows[0], widths, first[0]) != first:
            yield self.rich_table()
            return
        for line in lines[:-1]:
            yield from line
            yield Segment.line()
        for row in self.rows[1:]:
            yield Segment(self._line(row, widths, first[0]))
            yield Segment.line()
        yield from lines[-1]
        yield Segment.line()

    def _line(self, row: tuple[str, ...], widths: list[int], bar: str) -> str:
        from rich.cells import cell_len

        cells = []
        for cell, width, column in zip(row, widths, self.columns, strict=True):
            pad = " " * (width - 2 - cell_len(cell))
            cells.append(f" {pad}{cell} " if column.justify == "right" else f" {cell}{pad} ")
        return bar + bar.join(cells) + bar
